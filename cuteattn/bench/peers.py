"""The implementations a cell is timed with: cuteattn and its peers, each as a zero-argument callable
returning the output in cuteattn's layout, or a string saying why it cannot run this cell."""
from __future__ import annotations

import torch

from cuteattn.bench.shapes import Cell
from cuteattn.reference import attention_ref
from cuteattn.testing import FA_FLOOR, fa_error

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(cell: Cell, device: torch.device) -> dict:
    dtype = DTYPES[cell.dtype]
    if cell.kind in ("decode", "prefill"):
        return _decode_inputs(cell, device, dtype)
    if cell.kind == "fp8":
        return _fp8_inputs(cell, device)
    if cell.kind in ("sparse", "sparse_bwd"):
        return _sparse_inputs(cell, device, dtype, grad=cell.kind == "sparse_bwd")
    if cell.kind in ("mods", "mods_bwd"):
        x = {n: torch.randn(cell.batch, cell.seqlen_q, cell.nheads, cell.d, device=device,
                            dtype=dtype, requires_grad=cell.kind == "mods_bwd")
             for n in ("q", "k", "v")}
        x["mask_mod"], x["score_mod"] = mod_functions(cell, device)
        return x
    grad = cell.kind == "bwd"
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)
    if cell.lens is None:
        return dict(
            q=rand(cell.batch, cell.seqlen_q, cell.nheads, cell.d),
            k=rand(cell.batch, cell.seqlen_k, cell.nheads_k, cell.d),
            v=rand(cell.batch, cell.seqlen_k, cell.nheads_k, cell.dv or cell.d),
        )
    total = sum(cell.lens)
    cu = torch.tensor([0, *torch.tensor(cell.lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(
        q=rand(total, cell.nheads, cell.d),
        k=rand(total, cell.nheads_k, cell.d),
        v=rand(total, cell.nheads_k, cell.d),
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max(cell.lens),
        max_seqlen_k=max(cell.lens),
    )


def _decode_inputs(cell: Cell, device, dtype) -> dict:
    """q (b, 1, h, d); the cache contiguous (b, L, hk, d), or in shuffled pages with a block
    table; every sequence's cache full."""
    b, n, hk, d = cell.batch, cell.seqlen_k, cell.nheads_k, cell.d
    x = dict(q=torch.randn(b, cell.seqlen_q, cell.nheads, d, device=device, dtype=dtype),
             lens=torch.full((b,), n, dtype=torch.int32, device=device), table=None)
    if cell.page_size is None:
        x["k"] = torch.randn(b, n, hk, d, device=device, dtype=dtype)
        x["v"] = torch.randn(b, n, hk, d, device=device, dtype=dtype)
    else:
        pages = b * n // cell.page_size
        x["k"] = torch.randn(pages, cell.page_size, hk, d, device=device, dtype=dtype)
        x["v"] = torch.randn(pages, cell.page_size, hk, d, device=device, dtype=dtype)
        x["table"] = torch.randperm(pages, device=device).to(torch.int32).view(b, -1)
    if cell.kv_dtype:  # an fp8 cache with descales, and its values in bf16 (dequantized)
        for name in ("k", "v"):
            x[name] = (x[name] * 2).to(torch.float8_e4m3fn)
            x[f"{name}_descale"] = torch.rand(b, hk, device=device) + 0.5
        # the sequence each cache row belongs to (with pages: the table's row holding the page)
        owner = torch.arange(b, device=device)
        if x["table"] is not None:
            owner = torch.empty(x["k"].shape[0], dtype=torch.long, device=device)
            owner[x["table"].long().flatten()] = torch.arange(b, device=device).repeat_interleave(
                x["table"].shape[1])
        for name in ("k", "v"):
            scale = x[f"{name}_descale"][owner][:, None, :, None]
            x[f"{name}_bf16"] = (x[name].float() * scale).to(dtype)
    return x


def _fp8_inputs(cell: Cell, device) -> dict:
    """q, k, v in float8_e4m3fn with random per-(batch, kv head) descales, and the same values
    in bf16 (for our bf16 forward beside it)."""
    x = {}
    for name, heads, s in (("q", cell.nheads, cell.seqlen_q), ("k", cell.nheads_k, cell.seqlen_k),
                           ("v", cell.nheads_k, cell.seqlen_k)):
        x[name] = (torch.randn(cell.batch, s, heads, cell.d, device=device) * 2).to(torch.float8_e4m3fn)
        x[f"{name}_descale"] = torch.rand(cell.batch, cell.nheads_k, device=device) + 0.5
    group = cell.nheads // cell.nheads_k
    for name in ("q", "k", "v"):
        scale = x[f"{name}_descale"]
        if name == "q":
            scale = scale.repeat_interleave(group, dim=1)
        x[f"{name}_bf16"] = (x[name].float() * scale[:, None, :, None]).to(torch.bfloat16)
    return x


def _sparse_inputs(cell: Cell, device, dtype, grad: bool = False) -> dict:
    """q, k, v and an exact logical mask: every 256-row query block keeps the same number of
    the 256-key blocks (chosen at random), expanded to the cell's physical blocks."""
    from cuteattn import sparse
    from cuteattn.bench.shapes import LOGICAL_BLOCK
    x = {n: torch.randn(cell.batch, cell.seqlen_q, cell.nheads, cell.d, device=device, dtype=dtype,
                        requires_grad=grad) for n in ("q", "k", "v")}
    keep, n = cell.kept_blocks()
    ranks = torch.rand(cell.batch, cell.nheads, -(-cell.seqlen_q // LOGICAL_BLOCK), n, device=device)
    top = ranks.topk(keep, dim=-1).indices
    logical = sparse.from_topk(top, n, LOGICAL_BLOCK, LOGICAL_BLOCK)
    x["blocks"] = sparse.expand(logical, cell.block_q, cell.block_k)
    # what a model runs each step to make the lists (timed apart: bench "builder_ms")
    x["builders"] = lambda: sparse.from_topk(top, n, LOGICAL_BLOCK, LOGICAL_BLOCK,
                                             physical=(cell.block_q, cell.block_k))
    return x


def _sparse(cell, x, device):
    """cuteattn's block-sparse forward, and flash-attn-4's (full blocks) on the same lists."""
    from cuteattn import flash_attn_func
    strict = device.type == "cuda"
    ours = lambda: flash_attn_func(x["q"], x["k"], x["v"], block_sparse=x["blocks"], strict=strict)
    if device.type != "cuda":
        return {"cuteattn (reference)": ours}
    impls = {"cuteattn": ours}
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception as e:
        impls["fa4"] = f"flash_attn.cute not importable ({type(e).__name__})"
        return impls
    m = x["blocks"]
    tensors = BlockSparseTensorsTorch(
        mask_block_cnt=m.partial_count, mask_block_idx=m.partial_index,
        full_block_cnt=m.full_count, full_block_idx=m.full_index, block_size=(m.q_block, m.kv_block))
    first = lambda r: r[0] if isinstance(r, tuple) else r
    impls["fa4"] = lambda: first(fa4(x["q"], x["k"], x["v"], block_sparse_tensors=tensors))
    return impls


def mod_functions(cell, device) -> tuple:
    """(mask_mod, score_mod) of a "mods" cell (shapes.MODS), FlexAttention's signatures."""
    from cuteattn.bench.shapes import SLIDING
    if cell.mod == "document":
        docs = torch.arange(cell.seqlen_q, device=device, dtype=torch.int32) // (cell.seqlen_q // 4)

        def document(b, h, q_idx, kv_idx):
            return docs[q_idx] == docs[kv_idx]
        return document, None
    if cell.mod == "sliding":
        def sliding(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= SLIDING) & (kv_idx - q_idx <= SLIDING)
        return sliding, None
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / cell.nheads) for i in range(cell.nheads)],
                          device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return None, alibi


def _mods(cell, x, device):
    """cuteattn with the mods traced into its kernel (on every block; and, for a mask_mod, on
    the block-sparse lists sparse.from_mask_mod builds, timed apart as the builders), beside
    FlexAttention (torch.compile'd flex_attention with its own block mask)."""
    from cuteattn import flash_attn_func, sparse
    strict = device.type == "cuda"
    mods = dict(mask_mod=x["mask_mod"], score_mod=x["score_mod"])
    impls = {"cuteattn": lambda: flash_attn_func(x["q"], x["k"], x["v"], causal=cell.causal,
                                                 strict=strict, **mods)}
    if device.type != "cuda":
        return {"cuteattn (reference)": impls["cuteattn"]}
    if x["mask_mod"] is not None:
        build = lambda: sparse.from_mask_mod(x["mask_mod"], 1, 1, cell.seqlen_q, cell.seqlen_k,
                                             128, 128, device=device)
        lists = build()
        x["builders"] = build
        impls["cuteattn-lists"] = lambda: flash_attn_func(
            x["q"], x["k"], x["v"], causal=cell.causal, strict=True, block_sparse=lists, **mods)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # the backward is timed as repeats over one forward's graph (retain_graph), which a
        # compiled backward that donates its saved buffers refuses (seen on the 16k cells)
        torch._functorch.config.donated_buffer = False
        flex = torch.compile(flex_attention)
        mask_mod = x["mask_mod"]
        if cell.causal:
            inner = mask_mod or (lambda b, h, q_idx, kv_idx: q_idx >= 0)
            mask_mod = lambda b, h, q_idx, kv_idx: inner(b, h, q_idx, kv_idx) & (kv_idx <= q_idx)
        block = None if mask_mod is None else create_block_mask(
            mask_mod, None, None, cell.seqlen_q, cell.seqlen_k, device=device)
        tr = lambda t: t.transpose(1, 2)
        impls["flex"] = lambda: tr(flex(tr(x["q"]), tr(x["k"]), tr(x["v"]), score_mod=x["score_mod"],
                                        block_mask=block))
    except Exception as e:
        impls["flex"] = f"flex_attention unavailable ({type(e).__name__}: {str(e)[:120]})"
    return impls


def _fp8(cell, x, device):
    """cuteattn on fp8 inputs, and our bf16 forward on the same values beside it."""
    from cuteattn import flash_attn_func
    strict = device.type == "cuda"
    ours = lambda: flash_attn_func(x["q"], x["k"], x["v"], causal=cell.causal, strict=strict,
                                   q_descale=x["q_descale"], k_descale=x["k_descale"],
                                   v_descale=x["v_descale"])
    if device.type != "cuda":
        return {"cuteattn (reference)": ours}
    return {"cuteattn": ours,
            "cuteattn-bf16": lambda: flash_attn_func(x["q_bf16"], x["k_bf16"], x["v_bf16"],
                                                     causal=cell.causal, strict=True),
            "fa4": "flash-attn-4 runs FP8 on sm100 only"}


def _prefill(cell, x, device):
    """name -> callable for a prefill cell: cuteattn's paged varlen call, our fixed-length
    forward on the same keys laid out contiguously, FA4's paged varlen; outputs (b, sq, h, d)."""
    from cuteattn import flash_attn_func, flash_attn_varlen_func
    strict = device.type == "cuda"
    b, sq, sk = cell.batch, cell.seqlen_q, cell.seqlen_k
    cu = lambda n: torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=device)
    q = x["q"].flatten(0, 1)
    unpack = lambda o: o.view(b, sq, *o.shape[1:])
    impls = {"cuteattn": lambda: unpack(flash_attn_varlen_func(
        q, x["k"], x["v"], cu(sq), cu(sk), sq, sk, causal=True, block_table=x["table"],
        strict=strict))}
    if device.type != "cuda":
        return {"cuteattn (reference)": impls["cuteattn"]}
    keys = [_decode_keys(x, i) for i in range(b)]
    k, v = (torch.stack([kv[j] for kv in keys]) for j in (0, 1))
    impls["cuteattn-fixed"] = lambda: flash_attn_func(x["q"], k, v, causal=True, strict=True)
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func as fa4
    except Exception as e:
        impls["fa4"] = f"flash_attn.cute not importable ({type(e).__name__})"
        return impls
    first = lambda r: r[0] if isinstance(r, tuple) else r
    impls["fa4"] = lambda: unpack(first(fa4(q, x["k"], x["v"], cu_seqlens_q=cu(sq),
                                            max_seqlen_q=sq, seqused_k=x["lens"],
                                            max_seqlen_k=sk, page_table=x["table"], causal=True)))
    return impls


def _decode_keys(x, b: int):
    """Sequence b's keys and values (L, hk, d), gathered from the pages if paged."""
    if x["table"] is None:
        return x["k"][b], x["v"][b]
    pages = x["table"][b].long()
    return (x["k"][pages].flatten(0, 1), x["v"][pages].flatten(0, 1))


def _decode(cell, x, device):
    """name -> callable for a decode cell: cuteattn's flash_attn_with_kvcache, FA4's paged
    varlen (or its plain call on a contiguous cache), SDPA on a contiguous cache."""
    from cuteattn import flash_attn_with_kvcache
    strict = device.type == "cuda"
    descales = dict(k_descale=x["k_descale"], v_descale=x["v_descale"]) if cell.kv_dtype else {}
    ours = lambda: flash_attn_with_kvcache(x["q"], x["k"], x["v"], cache_seqlens=x["lens"],
                                           block_table=x["table"], strict=strict, **descales)
    if device.type != "cuda":
        return {"cuteattn (reference)": ours}
    impls = {"cuteattn": ours}
    if not cell.kv_dtype and cell.seqlen_q == 1:
        # the same step appending one new token (at the last position: the same keys are read;
        # the call rewrites that slot with the same values every time)
        new = [torch.randn(cell.batch, 1, cell.nheads_k, cell.d, device=device,
                           dtype=x["q"].dtype) for _ in range(2)]
        before = x["lens"] - 1
        impls["cuteattn-append"] = lambda: flash_attn_with_kvcache(
            x["q"], x["k"], x["v"], k=new[0], v=new[1], cache_seqlens=before,
            block_table=x["table"], strict=True)
    if cell.kv_dtype:  # our decode of the same values from a bf16 cache; no peer reads fp8
        impls["cuteattn-bf16-cache"] = lambda: flash_attn_with_kvcache(
            x["q"], x["k_bf16"], x["v_bf16"], cache_seqlens=x["lens"], block_table=x["table"],
            strict=True)
        impls["fa4"] = impls["sdpa"] = "no fp8 KV cache"
        return impls
    if x["table"] is None:
        from torch.nn.functional import scaled_dot_product_attention
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        impls["sdpa"] = lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
    else:
        impls["sdpa"] = "no paged cache"
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception as e:
        impls["fa4"] = f"flash_attn.cute not importable ({type(e).__name__})"
        return impls
    first = lambda r: r[0] if isinstance(r, tuple) else r
    if x["table"] is None:
        impls["fa4"] = lambda: first(flash_attn_func(x["q"], x["k"], x["v"]))
    else:
        impls["fa4"] = lambda: first(flash_attn_varlen_func(
            x["q"], x["k"], x["v"], seqused_k=x["lens"], max_seqlen_k=cell.seqlen_k,
            page_table=x["table"]))
    return impls


def _cuteattn(cell, x, strict, deterministic=False):
    from cuteattn import flash_attn_func, flash_attn_varlen_func

    if cell.lens is None:
        return lambda: flash_attn_func(x["q"], x["k"], x["v"], causal=cell.causal, strict=strict,
                                       deterministic=deterministic)
    return lambda: flash_attn_varlen_func(**x, causal=cell.causal, strict=strict,
                                          deterministic=deterministic)


def _sdpa(cell, x, backend_name):
    if cell.lens is not None:
        return "no varlen"
    if cell.causal and cell.seqlen_q != cell.seqlen_k:
        return "SDPA's causal mask is top-left aligned"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = getattr(SDPBackend, backend_name)
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))  # SDPA wants (b, h, s, d)
    gqa = cell.nheads != cell.nheads_k

    def run():
        with sdpa_kernel(backend):
            out = scaled_dot_product_attention(q, k, v, is_causal=cell.causal, enable_gqa=gqa)
        return out.transpose(1, 2)

    return run


def _fa4(cell, x):
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # not installed, or its import fails on this machine
        return f"flash_attn.cute not importable ({type(e).__name__})"
    first = lambda r: r[0] if isinstance(r, tuple) else r  # FA4 returns (out, lse)
    if cell.lens is None:
        return lambda: first(flash_attn_func(x["q"], x["k"], x["v"], causal=cell.causal))
    return lambda: first(flash_attn_varlen_func(
        x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"],
        max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"], causal=cell.causal,
    ))


def implementations(cell: Cell, x: dict, device: torch.device) -> dict:
    """name -> callable or reason string. cuteattn is strict on a GPU: a fallback is not a timing.
    For a "bwd" cell each callable runs the backward alone (the forward ran once, here)."""
    if cell.kind == "decode":
        return _decode(cell, x, device)
    if cell.kind == "prefill":
        return _prefill(cell, x, device)
    if cell.kind == "fp8":
        return _fp8(cell, x, device)
    if cell.kind == "mods":
        return _mods(cell, x, device)
    if cell.kind == "mods_bwd":
        return {name: fn if isinstance(fn, str) else _backward_of(fn, x)
                for name, fn in _mods(cell, x, device).items()}
    if cell.kind == "sparse":
        return _sparse(cell, x, device)
    if cell.kind == "sparse_bwd":
        impls = {name: fn if isinstance(fn, str) else _backward_of(fn, x)
                 for name, fn in _sparse(cell, x, device).items()}
        if "fa4" in impls and cell.sparsity and torch.cuda.get_device_capability(device)[0] == 9:
            # measured on the H200 (c3074d4): its sm90 backward runs the dense backward whatever
            # the lists say (wrong gradients, at its dense rate); its sparse backward is sm100's
            impls["fa4"] = "flash-attn-4's sm90 backward does not apply block-sparse lists"
        return impls
    if device.type != "cuda":
        return {"cuteattn (reference)": _cuteattn(cell, x, strict=False)}
    forwards = {
        "cuteattn": _cuteattn(cell, x, strict=True),
        "sdpa-flash": _sdpa(cell, x, "FLASH_ATTENTION"),
        "sdpa-cudnn": _sdpa(cell, x, "CUDNN_ATTENTION"),
        "fa4": _fa4(cell, x),
    }
    if cell.kind != "bwd":
        return forwards
    forwards["cuteattn-deterministic"] = _cuteattn(cell, x, strict=True, deterministic=True)
    return {name: fn if isinstance(fn, str) else _backward_of(fn, x) for name, fn in forwards.items()}


def _backward_of(forward, x):
    """A callable running the backward of one forward call (its graph kept for repeats), giving
    (dq, dk, dv). The forward runs here, once: a failing one fails when called, as a timing does."""
    state = {}

    def run():
        if not state:
            out = forward()
            state.update(out=out, dout=torch.randn_like(out))
        return torch.autograd.grad(state["out"], (x["q"], x["k"], x["v"]), state["dout"],
                                   retain_graph=True)
    run.state = state
    return run


def check(cell: Cell, x: dict, out, dout=None) -> dict:
    """FA rule on a slice (first sequence, first group of query heads sharing kv head 0), so the
    float32 reference stays small even for 16k tokens. For a "bwd" cell `out` is (dq, dk, dv)
    of the backward against `dout`: the worst of the three gradients' checks."""
    r = cell.nheads // cell.nheads_k
    if cell.kind == "bwd":
        return _check_grads(cell, x, out, dout, r)
    if cell.kind == "fp8":
        return _check_fp8(cell, x, out, r)
    if cell.kind == "sparse":
        return _check_sparse(cell, x, out)
    if cell.kind == "mods":
        return _check_mods(cell, x, out)
    if cell.kind == "mods_bwd":
        return _check_mods_dq(cell, x, out[0], dout)
    if cell.kind == "sparse_bwd":
        return _check_sparse_dq(cell, x, out[0], dout)
    if cell.kind in ("decode", "prefill"):  # batch 0, kv head 0's query heads, its whole cache
        k0, v0 = _decode_keys(x, 0)
        if cell.kv_dtype:  # the real values: stored x descale, in float32 for the reference
            k0, v0 = (t.float() * x[f"{n}_descale"][0][None, :, None] for t, n in ((k0, "k"), (v0, "v")))
            q, o = x["q"][:1, :, :r].float(), out[:1, :, :r]
            k, v = k0[None, :, :1], v0[None, :, :1]
            ref, _ = attention_ref(q, k, v)
            lowprec, _ = attention_ref(*(t.to(x["q"].dtype) for t in (q, k, v)), upcast=False)
            err, base = fa_error(o, ref, lowprec)
            bound = 2 * base + FA_FLOOR
            return dict(ok=bool(err <= bound), err=err, bound=bound)
        q, k, v, o = x["q"][:1, :, :r], k0[None, :, :1], v0[None, :, :1], out[:1, :, :r]
    elif cell.lens is None:
        q, k, v, o = x["q"][:1, :, :r], x["k"][:1, :, :1], x["v"][:1, :, :1], out[:1, :, :r]
    else:
        n = cell.lens[0]
        q, k, v, o = (t[None, :n] for t in (x["q"][:, :r], x["k"][:, :1], x["v"][:, :1], out[:, :r]))
    ref, _ = attention_ref(q, k, v, causal=cell.causal)
    lowprec, _ = attention_ref(q, k, v, causal=cell.causal, upcast=False)
    err, base = fa_error(o, ref, lowprec)
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)


def _check_grads(cell, x, grads, dout, r):
    """The gradients of batch 0 (packed: the first sequence) and kv head 0's query heads
    against the float32 reference's."""
    if cell.lens is None:
        sl = lambda t, heads: t.detach()[:1, :, :heads]
    else:
        sl = lambda t, heads: t.detach()[None, :cell.lens[0], :heads]
    inputs = (sl(x["q"], r), sl(x["k"], 1), sl(x["v"], 1))
    g = sl(dout, r)
    got = (sl(grads[0], r), sl(grads[1], 1), sl(grads[2], 1))
    results = []
    for upcast in (True, False):
        leaves = [(t.float() if upcast else t.clone()).requires_grad_() for t in inputs]
        o, _ = attention_ref(*leaves, causal=cell.causal, upcast=upcast)
        o.backward(g.float() if upcast else g)
        results.append([t.grad for t in leaves])
    worst = dict(ok=True, err=0.0, bound=0.0)
    for mine, ref, low in zip(got, *results):
        err, base = fa_error(mine, ref, low)
        bound = 2 * base + FA_FLOOR
        if not err <= bound or err / bound > worst["err"] / max(worst["bound"], 1e-30):
            worst = dict(ok=bool(err <= bound) and worst["ok"], err=err, bound=bound)
    return worst


def _check_fp8(cell, x, out, r):
    """Batch 0 and kv head 0's query heads against the float32 reference on the dequantized
    inputs; the bound is twice the error of a plain PyTorch fp8 emulation (probabilities
    quantized to e4m3 before P V, as an fp8 kernel does), plus the floor."""
    q, k, v = (x[f"{n}_bf16"][:1, :, :r if n == "q" else 1].float() for n in ("q", "k", "v"))
    ref, _ = attention_ref(q, k, v, causal=cell.causal)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, r, -1)) / cell.d ** 0.5
    if cell.causal:
        n_q, n_k = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
                                    .triu(n_k - n_q + 1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p8 = (p * 448).to(torch.float8_e4m3fn).float() / 448  # e4m3's range, as kernels scale P
    emulated = torch.einsum("bhqk,bkhd->bqhd", p8, v.expand(-1, -1, r, -1))
    err, base = fa_error(out[:1, :, :r], ref, emulated)
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)


def fp8_gemm_tflops(device, n: int = 8192, iters: int = 20) -> float:
    """The rate of an n^3 e4m3 GEMM (torch._scaled_mm, bf16 out): the fp8 forward's ceiling."""
    from cuteattn.bench.timing import median_ms
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    run = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    run()
    return 2 * n ** 3 / (median_ms(run, device, iters=iters) * 1e-3) / 1e12


def _check_sparse_dq(cell, x, dq, dout, rows: int = 256):
    """dq of the first query rows of batch 0, head 0 (it depends on those rows alone) against
    float32 autograd under the dense mask the block lists mean; dk and dv, which need every
    row, are checked by the GPU tests."""
    m = x["blocks"]
    mask = m.dense(cell.seqlen_q, cell.seqlen_k, rows=(0, rows))[0, 0]
    sl = lambda t, n: t.detach()[:1, :n, :1]
    q, k, v, g = sl(x["q"], rows), sl(x["k"], cell.seqlen_k), sl(x["v"], cell.seqlen_k), sl(dout, rows)

    def dq_of(dtype):
        leaf = q.to(dtype).requires_grad_()
        s = torch.einsum("bqhd,bkhd->bhqk", leaf, k.to(dtype)) / cell.d ** 0.5
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1))
        torch.einsum("bhqk,bkhd->bqhd", p, v.to(dtype)).backward(g.to(dtype))
        return leaf.grad
    err, base = fa_error(dq[:1, :rows, :1], dq_of(torch.float32), dq_of(q.dtype))
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)


def _check_mods(cell, x, out, rows: int = 256):
    """The first query rows of batch 0, head 0 against the float32 reference with the mods
    (attention_ref evaluates them on that block of rows)."""
    sl = lambda t, n: t[:1, :n, :1]
    q, k, v = sl(x["q"], rows), sl(x["k"], cell.seqlen_k), sl(x["v"], cell.seqlen_k)
    kw = _mods_for_rows(cell, x)  # (the rows are the sequence's first: causal is top-left)
    ref, _ = attention_ref(q.float(), k.float(), v.float(), **kw)
    low, _ = attention_ref(q, k, v, upcast=False, **kw)
    err, base = fa_error(out[:1, :rows, :1], ref, low)
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)


def _mods_for_rows(cell, x) -> dict:
    """The cell's mods for attention_ref over the sequence's first rows (causal, top-left for
    them, folded into the mask_mod)."""
    kw = dict(mask_mod=x["mask_mod"], score_mod=x["score_mod"])
    if cell.causal:
        inner = x["mask_mod"] or (lambda b, h, q_idx, kv_idx: q_idx >= 0)
        kw["mask_mod"] = lambda b, h, q_idx, kv_idx: inner(b, h, q_idx, kv_idx) & (kv_idx <= q_idx)
    return kw


def _check_mods_dq(cell, x, dq, dout, rows: int = 256):
    """dq of the first query rows of batch 0, head 0 (it depends on those rows alone) against
    the float32 reference's autograd through the same mods."""
    sl = lambda t, n: t.detach()[:1, :n, :1]
    q, k, v, g = sl(x["q"], rows), sl(x["k"], cell.seqlen_k), sl(x["v"], cell.seqlen_k), sl(dout, rows)
    kw = _mods_for_rows(cell, x)

    def dq_of(dtype, upcast):
        leaf = q.to(dtype).requires_grad_()
        out, _ = attention_ref(leaf, k.to(dtype), v.to(dtype), upcast=upcast, **kw)
        out.backward(g.to(out.dtype))
        return leaf.grad
    err, base = fa_error(dq[:1, :rows, :1], dq_of(torch.float32, True), dq_of(q.dtype, False))
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)


def _check_sparse(cell, x, out, rows: int = 256):
    """The first query rows of batch 0, head 0 against float32 attention under the dense mask
    the block lists mean (only those rows' mask is built)."""
    m = x["blocks"]
    mask = m.dense(cell.seqlen_q, cell.seqlen_k, rows=(0, rows))[0, 0]
    sl = lambda t, n: t[:1, :n, :1]
    q, k, v = sl(x["q"], rows), sl(x["k"], cell.seqlen_k), sl(x["v"], cell.seqlen_k)

    def masked(dtype):
        s = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k.to(dtype)) / cell.d ** 0.5
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1))
        return torch.einsum("bhqk,bkhd->bqhd", p, v.to(dtype))
    err, base = fa_error(out[:1, :rows, :1], masked(torch.float32), masked(q.dtype))
    bound = 2 * base + FA_FLOOR
    return dict(ok=bool(err <= bound), err=err, bound=bound)
