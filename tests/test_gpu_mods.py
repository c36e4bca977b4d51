"""GPU: FlexAttention mask_mods and score_mods traced into the sm90 forward
(kernels/common/mods.py), against the float32 reference with the same mods, FlashAttention's
rule; strict=True (the
kernel must serve the call), NaN-poisoned out= / lse=. Dense tiles (the mod on every block) and
block-sparse lists from sparse.from_mask_mod (the mod on their partial blocks), with the
call's causal flag on top, GQA, odd lengths; document masks and prefix-LM lengths read from
tensors; rows the mod leaves without keys get out 0 and lse -inf."""
import pytest
import torch

from cuteattn import flash_attn_func, sparse
from cuteattn import mods as cmods
from cuteattn.reference import attention_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (the traced mask_mod is the sm90 forward's)")]


def sliding_of(w):
    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= w) & (kv_idx - q_idx <= w)
    return sliding


def document_of(lengths, device="cuda"):
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]
    return document


def prefix_lm_of(prefix):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])
    return prefix_lm


def check(q, k, v, mask_mod, block_sparse=None, **kw):
    b, sq, h, _ = q.shape
    out = torch.full((b, sq, h, v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    flash_attn_func(q, k, v, mask_mod=mask_mod, block_sparse=block_sparse, return_lse=True,
                    strict=True, out=out, lse=lse, **kw)
    ref, ref_lse = attention_ref(q, k, v, mask_mod=mask_mod, block_sparse=block_sparse, **kw)
    low, _ = attention_ref(q, k, v, mask_mod=mask_mod, block_sparse=block_sparse, upcast=False, **kw)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)


def alibi_of(heads):
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)], device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def halved(score, b, h, q_idx, kv_idx):
    return score * 0.5


@pytest.mark.parametrize("score", ["alibi", "halved"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("with_mask", [False, True], ids=["alone", "document"])
def test_score_mods(seed, score, d, with_mask):
    """A score_mod on every score (ALiBi reading its slopes per head; a plain rescale), alone or
    with a document mask_mod, causal."""
    s = 777
    q, k, v = inputs(2, s, s, 4, 2, d)
    score_mod = alibi_of(4) if score == "alibi" else halved
    mask_mod = MODS["document"](s) if with_mask else None
    b, sq, h, _ = q.shape
    out = torch.full((b, sq, h, d), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    flash_attn_func(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod,
                    return_lse=True, strict=True, out=out, lse=lse)
    kw = dict(causal=True, score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    low, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)


def inputs(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    return (torch.randn(b, sq, h, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype),
            torch.randn(b, sk, hk, d, device="cuda", dtype=dtype))


MODS = {"sliding": lambda s: sliding_of(77),
        "document": lambda s: document_of([s // 3, 1, s - s // 3 - 1]),
        "prefix": lambda s: prefix_lm_of(torch.tensor([5, s // 2], dtype=torch.int32, device="cuda"))}


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [700, 1031])
def test_dense_tiles(seed, mod, d, causal, s):
    q, k, v = inputs(2, s, s, 4, 2, d)
    check(q, k, v, MODS[mod](s), causal=causal)


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("block", [(128, 128), (64, 64)], ids=["128x128", "64x64"])
def test_block_sparse_partial_blocks(seed, mod, block):
    """Lists from from_mask_mod: full blocks skip the mod, partial ones apply it, others are
    never visited."""
    s = 1000
    q, k, v = inputs(2, s, s, 4, 4, 128)
    fn = MODS[mod](s)
    lists = sparse.from_mask_mod(fn, 2, 4, s, s, *block, device="cuda")
    check(q, k, v, fn, block_sparse=lists)


def test_rows_without_keys(seed):
    """A mod that leaves some rows no key: their out is 0 and lse -inf."""
    def none_before_100(b, h, q_idx, kv_idx):
        return (q_idx >= 100) & (kv_idx <= q_idx)
    q, k, v = inputs(1, 300, 300, 2, 2, 64)
    check(q, k, v, none_before_100)


def test_untraceable_mod_falls_back(seed):
    """A mod calling torch functions runs on the reference, with a warning naming why."""
    def calls_torch(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 9  # (a tensor method: the DSL's integers have none)
    q, k, v = inputs(1, 200, 200, 2, 2, 64)
    with pytest.warns(Warning, match="could not be traced"):
        out = flash_attn_func(q, k, v, mask_mod=calls_torch)
    ref, _ = attention_ref(q, k, v, mask_mod=calls_torch)
    low, _ = attention_ref(q, k, v, mask_mod=calls_torch, upcast=False)
    assert_close_fa(out, ref, low)


def check_grads(q, k, v, mask_mod, block_sparse=None, **kw):
    """dq, dk, dv through autograd (the backward kernel with the mask_mod traced in) against
    the reference's autograd with the same mask_mod."""
    from test_gpu_bwd import check_grads as check, poison_allocator, reference_grads
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flash_attn_func(*leaves, mask_mod=mask_mod, block_sparse=block_sparse, strict=True, **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, leaves, dout)
    ref, low = reference_grads(attention_ref, (q, k, v), dout, mask_mod=mask_mod,
                               block_sparse=block_sparse, **kw)
    check(got, ref, low)


@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sparse_lists", [False, True], ids=["dense", "lists128"])
def test_mask_mod_gradients(seed, mod, d, sparse_lists):
    s = 700
    q, k, v = inputs(2, s, s, 4, 2, d)
    fn = MODS[mod](s)
    lists = sparse.from_mask_mod(fn, 2, 4, s, s, 128, 128, device="cuda") if sparse_lists else None
    check_grads(q, k, v, fn, block_sparse=lists, causal=mod == "sliding")


def test_mask_mod_gradients_deterministic(seed):
    """deterministic=True with a mask_mod: bitwise-equal gradients over repeated runs."""
    q, k, v = inputs(1, 513, 513, 4, 4, 128)
    fn = MODS["document"](513)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn(1, 513, 4, 128, device="cuda", dtype=q.dtype)
    runs = [torch.autograd.grad(flash_attn_func(*leaves, mask_mod=fn, strict=True,
                                                deterministic=True), leaves, dout)
            for _ in range(3)]
    for later in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], later))


BLOCK_MODS = {
    "document": lambda: document_of([129, 1, 400, 170, 331]),
    "sliding": lambda: sliding_of(100),
    "prefix": lambda: prefix_lm_of(torch.tensor([5, 300], dtype=torch.int32, device="cuda")),
    "by head": lambda: (lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (h == 1)),
    "all": lambda: (lambda b, h, q_idx, kv_idx: True),
    "none": lambda: (lambda b, h, q_idx, kv_idx: False),
}


@pytest.mark.parametrize("mod", list(BLOCK_MODS))
@pytest.mark.parametrize("block", [(128, 128), (128, 64), (64, 64)], ids=["128x128", "128x64", "64x64"])
@pytest.mark.parametrize("lens", [(700, 700), (63, 1031)], ids=["700", "63x1031"])
def test_mask_mod_blocks_kernel_matches_torch(seed, mod, block, lens):
    """sparse.from_mask_mod's kernel (common/mask_blocks.py) gives every block pair the state
    the PyTorch evaluation gives it: per batch and head, short last blocks, constant mods."""
    from cuteattn.kernels.launch_common import mask_mod_blocks
    fn, (sq, sk) = BLOCK_MODS[mod](), lens
    state = mask_mod_blocks(fn, 2, 3, sq, sk, *block, torch.device("cuda", torch.cuda.current_device()))
    assert state is not None, "the kernel did not take the mod"
    attended, full = sparse.mask_mod_blocks_torch(fn, 2, 3, sq, sk, *block, device="cuda")
    assert torch.equal(state > 0, attended) and torch.equal(state == 2, full & attended)
    assert torch.equal(state.clamp(0, 2), state)  # (nothing but the three states written)


def test_mask_mod_blocks_untraceable_uses_torch(seed):
    """A mod no kernel traces still builds its lists (the PyTorch evaluation), the same ones."""
    def calls_torch(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 90  # (a tensor method: untraceable)
    lists = sparse.from_mask_mod(calls_torch, 1, 2, 500, 500, 128, 128, device="cuda")
    attended, full = sparse.mask_mod_blocks_torch(calls_torch, 1, 2, 500, 500, 128, 128, device="cuda")
    want = sparse.from_block_mask(attended, 128, 128, partial=attended & ~full)
    got_full, got_partial = lists.block_masks()
    want_full, want_partial = want.block_masks()
    assert torch.equal(got_full, want_full) and torch.equal(got_partial, want_partial)


READY_MADE = {  # cuteattn.mods: (kind, the mod for a sequence of s tokens)
    "causal": ("mask_mod", lambda s: cmods.causal()),
    "sliding_window": ("mask_mod", lambda s: cmods.sliding_window(100, 20)),
    "document_causal": ("mask_mod", lambda s: cmods.document_from_lengths(
        [s // 3, 0, s - s // 3], device="cuda", causal=True)),
    "prefix_lm": ("mask_mod", lambda s: cmods.prefix_lm(torch.tensor([17, s // 2], device="cuda"))),
    "alibi": ("score_mod", lambda s: cmods.alibi(4, device="cuda")),
    "softcap": ("score_mod", lambda s: cmods.softcap(20.0)),
}


@pytest.mark.parametrize("name", list(READY_MADE))
def test_ready_made_mods(seed, name):
    """Each of cuteattn.mods on the kernel (strict), against the reference with the same mod."""
    kind, make = READY_MADE[name]
    s = 333
    q, k, v = inputs(2, s, s, 4, 2, 128)
    mod = make(s)
    if kind == "mask_mod":
        check(q, k, v, mod)
    else:
        check(q, k, v, None, score_mod=mod)


def gated(score, b, h, q_idx, kv_idx):  # torch.where / abs / exp / clamp on kernel values
    near = torch.abs(q_idx - kv_idx) < 64
    return torch.where(near, score, score - torch.exp(torch.clamp(score, max=0.0)))


SCORE_GRADS = {"alibi": lambda: alibi_of(4), "halved": lambda: halved,
               "softcap": lambda: cmods.softcap(5.0), "gated": lambda: gated}


@pytest.mark.parametrize("score", list(SCORE_GRADS))
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("with_mask", [False, True], ids=["alone", "document"])
def test_score_mod_gradients(seed, score, d, with_mask):
    """A score_mod's gradient on the backward kernel (traced with a Dual score: its value and
    derivative in one pass), alone or with a document mask_mod, causal, against the
    reference's autograd through the same mods."""
    s = 555
    q, k, v = inputs(2, s, s, 4, 2, d)
    mask_mod = MODS["document"](s) if with_mask else None
    check_grads(q, k, v, mask_mod, causal=True, score_mod=SCORE_GRADS[score]())


def test_score_mod_with_learnable_tensor_falls_back(seed):
    """A score_mod whose tensor requires grad (learnable slopes) runs on the reference, which
    differentiates the slopes too; strict mode names that."""
    import cuteattn
    q, k, v = (x.requires_grad_() for x in inputs(1, 130, 130, 4, 4, 64))
    slopes = torch.rand(4, device="cuda", requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    with pytest.raises(RuntimeError, match="a mod's tensor requires grad"):
        flash_attn_func(q, k, v, score_mod=learnable, strict=True)
    with pytest.warns(cuteattn.FallbackWarning, match="a mod's tensor requires grad"):
        out = flash_attn_func(q, k, v, score_mod=learnable)
    (g,) = torch.autograd.grad(out.float().sum(), (slopes,))
    assert torch.isfinite(g).all() and g.abs().sum() > 0
@pytest.mark.parametrize("mods", ["document", "alibi", "both"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_sequences_with_mods(seed, mods, d):
    """flash_attn_varlen_func with mods on the kernel (strict): b is the sequence's index and
    q_idx / kv_idx positions within it (FlashAttention-4's varlen semantics), empty and odd
    sequences, q and k lengths differing; against the varlen reference with the same mods."""
    from cuteattn import flash_attn_varlen_func
    from cuteattn.reference import attention_varlen_ref
    lens_q, lens_k = [0, 1, 63, 129, 300], [5, 0, 63, 300, 129]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda")
    docs = torch.arange(max(lens_k), device="cuda") // 50  # a document every 50 positions

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]
    kw = dict(mask_mod=document if mods != "alibi" else None,
              score_mod=alibi_of(4) if mods != "document" else None)
    q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      causal=True, return_lse=True, strict=True, **kw)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), causal=True, **kw)
    low, _ = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), causal=True, upcast=False, **kw)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("mods", ["document", "alibi", "both"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_packed_sequences_with_mods_gradients(seed, mods, d, deterministic):
    """Gradients of flash_attn_varlen_func with mods on the backward kernel (strict): b the
    sequence, positions within it; empty and odd sequences, q and k lengths differing; dq, dk,
    dv against the varlen reference's autograd by FlashAttention's rule."""
    from cuteattn import flash_attn_varlen_func
    from cuteattn.reference import attention_varlen_ref
    from test_gpu_bwd import check_grads, reference_grads
    lens_q, lens_k = [0, 1, 63, 129, 300], [5, 0, 63, 300, 129]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda")
    docs = torch.arange(max(lens_k), device="cuda") // 50

    def document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]
    kw = dict(mask_mod=document if mods != "alibi" else None,
              score_mod=alibi_of(4) if mods != "document" else None)
    q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                 causal=True, deterministic=deterministic, strict=True, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu(lens_q), cu(lens_k),
                                                          causal=True, **a)
    check_grads(got, *reference_grads(ref_fn, (q, k, v), dout, **kw))
    if deterministic:  # bitwise again
        again = torch.autograd.grad(flash_attn_varlen_func(
            q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True,
            deterministic=True, strict=True, **kw), (q, k, v), dout)
        assert all(torch.equal(a, b) for a, b in zip(got, again))


# ---- FlashAttention-2's alibi_slopes (cuteattn/alibi.py: a score_mod on these kernels) ----

def fa2_alibi_ref(q, k, v, slopes, upcast=True, **kw):
    """The reference with FlashAttention-2's bias written as its own score_mod (float32)."""
    sq, sk = q.shape[1], k.shape[1]
    per = slopes if slopes.dim() == 2 else slopes[None].expand(q.shape[0], -1)

    def bias(score, b, h, q_idx, kv_idx):
        return score - per[b, h] * (q_idx + sk - sq - kv_idx).abs()
    return attention_ref(q, k, v, score_mod=bias, upcast=upcast, **kw)


@pytest.mark.parametrize("sq,sk", [(777, 777), (300, 1031), (1031, 200)])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_alibi_slopes_on_the_kernel(seed, sq, sk, per_batch, mask):
    """flash_attn_func(alibi_slopes=) on the forward kernel (strict: no fallback), NaN-poisoned
    outputs, GQA, the offset seqlen_k - seqlen_q read from a tensor (new lengths compile
    nothing new)."""
    kw = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(100, 20))}[mask]
    q, k, v = inputs(2, sq, sk, 8, 2, 128)
    slopes = torch.rand(2, 8, device="cuda") if per_batch else torch.rand(8, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 8, sq), float("nan"), device="cuda")
    flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True, strict=True, out=out,
                    lse=lse, **kw)
    ref, ref_lse = fa2_alibi_ref(q, k, v, slopes, **kw)
    low, _ = fa2_alibi_ref(q, k, v, slopes, upcast=False, **kw)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)


def test_alibi_slopes_with_softcap_take_the_reference(seed):
    """A softcap beside the bias has no sm90 kernel (the score_mod path takes no softcap):
    strict mode names it, the fallback computes FlashAttention-2's order (cap, then bias)."""
    import cuteattn
    q, k, v = inputs(1, 200, 300, 4, 4, 64)
    slopes = torch.rand(4, device="cuda")
    with pytest.raises(RuntimeError, match="softcap with a score_mod"):
        flash_attn_func(q, k, v, alibi_slopes=slopes, softcap=5.0, strict=True)
    with pytest.warns(cuteattn.FallbackWarning, match="softcap with a score_mod"):
        out = flash_attn_func(q, k, v, alibi_slopes=slopes, softcap=5.0)
    ref, _ = fa2_alibi_ref(q, k, v, slopes, softcap=5.0)
    low, _ = fa2_alibi_ref(q, k, v, slopes, softcap=5.0, upcast=False)
    assert_close_fa(out, ref, low)


@pytest.mark.parametrize("d", [64, 128])
def test_alibi_slopes_gradients_on_the_kernel(seed, d):
    """The backward kernel with the bias traced in (strict), against the reference's autograd;
    the slopes take no gradient, as in FlashAttention-2."""
    from test_gpu_bwd import check_grads as check_fa_grads, reference_grads
    q, k, v = (x.requires_grad_() for x in inputs(2, 555, 700, 4, 2, d))
    slopes = torch.rand(4, device="cuda", requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, strict=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_fn = lambda q_, k_, v_, **kw: fa2_alibi_ref(q_, k_, v_, slopes.detach(), **kw)
    check_fa_grads(got, *reference_grads(ref_fn, (q, k, v), dout, causal=True))
    assert slopes.grad is None


def test_alibi_slopes_packed_sequences_on_the_kernel(seed):
    """flash_attn_varlen_func(alibi_slopes=): each sequence's bias from its own lengths."""
    from cuteattn import flash_attn_varlen_func
    lens_q, lens_k = [0, 1, 63, 129, 300], [5, 0, 63, 300, 129]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda")
    q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(len(lens_q), 4, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      causal=True, alibi_slopes=slopes, return_lse=True,
                                      strict=True)
    for i in range(len(lens_q)):
        a, b = sum(lens_q[:i]), sum(lens_k[:i])
        if lens_q[i] == 0:
            continue
        seq = (q[None, a:a + lens_q[i]], k[None, b:b + lens_k[i]], v[None, b:b + lens_k[i]])
        ref, ref_lse = fa2_alibi_ref(*seq, slopes[i:i + 1], causal=True)
        low, _ = fa2_alibi_ref(*seq, slopes[i:i + 1], upcast=False, causal=True)
        assert_close_fa(out[None, a:a + lens_q[i]], ref, low)
        assert_lse_close(lse[None, :, a:a + lens_q[i]], ref_lse)
