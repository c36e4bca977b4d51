"""A mask_mod as a kernel's compile key (launch_common.mod_key) and the tensors handed to
the kernel, without a GPU: what the key holds, when two functions share a kernel and when they
do not, what cannot be traced and why; and the compile-only trace of the forward with mask_mods
of each kind (pytest -m compile)."""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cuteattn import alibi as fa2_alibi  # noqa: E402
from cuteattn import compile_cache  # noqa: E402
from cuteattn.kernels.launch_common import (UnsupportedMod, mod_key,  # noqa: E402
                                            mod_tensors_of)

WINDOW = 64
DOCS = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int64)


def sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= WINDOW) & (kv_idx <= q_idx)


def document(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def prefix_lm_of(prefix):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])
    return prefix_lm


def window_of(w):
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= w) & (kv_idx - q_idx <= w)
    return window


def test_key_holds_constants_and_tensor_kinds():
    key = mod_key(sliding)
    assert key.name == "sliding" and ("WINDOW", 64) in key.constants and key.tensors == ()
    key = mod_key(document)
    assert key.tensors == (("int32", 1),) and key.tensor_names == ("DOCS",)  # (int64 as int32)
    (docs,) = mod_tensors_of(document, key)
    assert docs.dtype == torch.int32 and docs.tolist() == DOCS.tolist()
    prefix = torch.tensor([[3], [9]], dtype=torch.int32)
    fn = prefix_lm_of(prefix)
    key = mod_key(fn)
    assert key.tensors == (("int32", 2),) and key.tensor_cells == (0,)
    assert mod_tensors_of(fn, key)[0] is prefix
    compile_cache.key_text(key)  # (a disk-cache key: stable text)


def test_same_code_and_constants_share_a_kernel():
    """Closures of one function share a key when their constants are equal and their tensors of
    one kind (the tensors are arguments, not part of the code); a changed constant does not."""
    assert mod_key(window_of(8)) == mod_key(window_of(8))
    assert mod_key(window_of(8)) != mod_key(window_of(16))
    a, b = (prefix_lm_of(torch.tensor([n], dtype=torch.int32)) for n in (1, 2))
    assert mod_key(a) == mod_key(b)
    c = prefix_lm_of(torch.tensor([[1]], dtype=torch.int32))
    assert mod_key(a) != mod_key(c)  # (another rank)
    assert mod_key(sliding) != mod_key(window_of(64))  # (other code)


@pytest.mark.parametrize("fn,reason", [
    (lambda b, h: True, "must take (b, h, q_idx, kv_idx)"),
    (prefix_lm_of(torch.zeros(2, dtype=torch.bool)), "torch.bool tensor"),
    (prefix_lm_of([1, 2]), "closes over a list"),
    (len, "not a plain Python function"),
])
def test_untraceable_forms_say_why(fn, reason):
    with pytest.raises(UnsupportedMod, match=re.escape(reason)):
        mod_key(fn)


def test_too_many_tensors():
    t = torch.zeros(4, dtype=torch.int32)

    def three(b, h, q_idx, kv_idx):
        return (t[q_idx] == t[kv_idx]) & (DOCS[q_idx] == DOCS[kv_idx]) & (t[b] == 0)
    assert mod_key(three).tensors == (("int32", 1), ("int32", 1))
    u = torch.zeros(4, dtype=torch.int32)

    def four(b, h, q_idx, kv_idx):
        return (t[q_idx] == u[kv_idx]) & (DOCS[q_idx] == DOCS[kv_idx])
    with pytest.raises(UnsupportedMod, match="at most 2"):
        mod_key(four)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def test_score_mod_key():
    key = mod_key(alibi, "score_mod")
    assert key.kind == "score_mod" and key.tensors == (("float32", 1),)
    with pytest.raises(UnsupportedMod, match=re.escape("must take (b, h, q_idx, kv_idx)")):
        mod_key(alibi, "mask_mod")
    with pytest.raises(UnsupportedMod, match=re.escape("must take (score, b, h, q_idx, kv_idx)")):
        mod_key(sliding, "score_mod")


COMPILE_CASES = [("sliding", sliding, 128, None), ("document", document, 64, None),
                 ("prefix", prefix_lm_of(torch.tensor([5, 7], dtype=torch.int32)), 256, None),
                 ("document-sparse-128", document, 128, (128, 128)),
                 ("sliding-sparse-64", sliding, 128, (64, 64))]


@pytest.mark.compile
@pytest.mark.parametrize("name,fn,d,block", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_compile_forward_with_mask_mod(name, fn, d, block, capfd, tmp_path, monkeypatch):
    """The forward with the mask_mod traced in: compiles for sm_90a without spills; a mod that
    reads a tensor loads from global memory."""
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90.compile import compile_fwd
    monkeypatch.chdir(tmp_path)
    cfg = config.fwd_config(cutlass.BFloat16, d, d, False, False, False, False, False,
                            sparse_block=block, mask_mod=mod_key(fn))
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}", mod_fns=(fn, None)).__ptx__
    assert "wgmma.mma_async" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


# FlashAttention-2's alibi_slopes (cuteattn/alibi.py): per (batch, head) slopes with the
# sequences' key offsets, and per-head slopes without
FA2_ALIBI = fa2_alibi.score_mod(torch.ones(2, 4), torch.zeros(2, dtype=torch.int32))
FA2_ALIBI_HEADS = fa2_alibi.score_mod(torch.ones(4), None)
SCORE_CASES = [("alibi", alibi, None, 128, None), ("alibi-document", alibi, document, 128, None),
               ("alibi-document-sparse", alibi, document, 128, (128, 128)),
               ("alibi-document-sparse-64", alibi, document, 128, (128, 64)),
               ("alibi-document-d64", alibi, document, 64, None),
               ("fa2-alibi", FA2_ALIBI, None, 128, None),
               ("fa2-alibi-heads-d64", FA2_ALIBI_HEADS, None, 64, None)]


@pytest.mark.compile
@pytest.mark.parametrize("name,score,mask,d,block", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_compile_forward_with_score_mod(name, score, mask, d, block, capfd, tmp_path, monkeypatch):
    """A score_mod (ALiBi reading its slopes), alone or with a mask_mod: spill-free."""
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90.compile import compile_fwd
    monkeypatch.chdir(tmp_path)
    cfg = config.fwd_config(cutlass.BFloat16, d, d, True, False, False, False, False,
                            sparse_block=block, mask_mod=mod_key(mask) if mask else None,
                            score_mod=mod_key(score, "score_mod"))
    compile_fwd(cfg, options="--keep-ptx remarks{ptx}", mod_fns=(mask, score))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


BWD_CASES = [("document", document, 64, 0), ("sliding", sliding, 96, 0),
             ("document-lists", document, 128, 128), ("prefix", prefix_lm_of(
                 torch.tensor([5, 7], dtype=torch.int32)), 128, 0)]


@pytest.mark.compile
@pytest.mark.parametrize("name,fn,d,sparse_q", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_compile_backward_with_mask_mod(name, fn, d, sparse_q, capfd, tmp_path, monkeypatch):
    """The backward with the mask_mod traced into its S^T masking: spill-free."""
    from cuteattn.kernels.sm90.bwd import Sm90BwdConfig
    from cuteattn.kernels.sm90.compile import compile_bwd
    monkeypatch.chdir(tmp_path)
    cfg = Sm90BwdConfig(cutlass.BFloat16, d, causal=True, dq_single_wg=d == 96,
                        sparse_q_block=sparse_q, mask_mod=mod_key(fn))
    compile_bwd(cfg, options="--keep-ptx remarks{ptx}", mask_mod_fn=fn)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


def test_score_mod_scalars():
    """With a score_mod the kernel scales the scores itself and the exponent takes log2(e)."""
    import dataclasses
    import math
    from cuteattn.kernels.launch_common import kernel_scalars
    from cuteattn.spec import AttentionSpec
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=64, head_dim_v=64, causal=False,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         softmax_scale=0.125)
    plain = kernel_scalars(spec)[:2]
    assert plain == (0.125, pytest.approx(0.125 * math.log2(math.e)))
    modded = kernel_scalars(dataclasses.replace(spec, score_mod=mod_key(alibi, "score_mod")))[:2]
    assert modded == (0.125, pytest.approx(math.log2(math.e)))


@pytest.mark.compile
def test_a_torch_call_does_not_trace():
    """A mask_mod calling a torch function the kernel has no counterpart for (common/mods.
    TorchInKernel) has a key but fails to trace: the API catches that and serves the call on
    the reference (tests/test_api_cpu.py checks the routing)."""
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90.compile import compile_fwd

    def calls_torch(b, h, q_idx, kv_idx):
        return torch.fmod(q_idx - kv_idx, 4) == 0
    cfg = config.fwd_config(cutlass.BFloat16, 64, 64, False, False, False, False, False,
                            mask_mod=mod_key(calls_torch))
    with pytest.raises(Exception):
        compile_fwd(cfg, mod_fns=(calls_torch, None))


def test_api_routes_a_traceable_mask_mod_to_the_kernel(monkeypatch):
    """flash_attn_func(mask_mod=...) hands the forward kernel the mod's key (with the function
    attached for tracing) and the tensors it reads; block-sparse lists go along; a mod that
    fails to trace is remembered and served by the reference with the reason. (GPU-free: the
    kernel choice and launch are stand-ins.)"""
    from cuteattn import api, flash_attn_func, sparse
    calls, selected = [], []

    def launch(q, k, v, out, lse, sparse=None, mod_tensors=()):
        calls.append(dict(sparse=sparse, mod_tensors=mod_tensors))
        out.zero_()
        lse.zero_()

    def cached_launch(spec, device):
        selected.append(spec)
        return launch, None
    monkeypatch.setattr(api, "_sparse_reason", lambda *a: None)
    monkeypatch.setattr(api, "_cached_launch", cached_launch)
    q, k, v = (torch.randn(1, 5, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_func(q, k, v, mask_mod=document, strict=True)
    spec = selected[-1]
    assert spec.mask_mod == mod_key(document) and spec.mask_mod.fn is document
    assert spec.sparse_q_block == 0 and calls[-1]["sparse"] is None
    assert calls[-1]["mod_tensors"][0].tolist() == DOCS.tolist()
    lists = sparse.from_topk(torch.zeros(1, 1, 1, 1, dtype=torch.int32), 1, 128, 128, partial=True)
    flash_attn_func(q, k, v, mask_mod=sliding, block_sparse=lists, strict=True)
    assert selected[-1].sparse_q_block == 128 and len(calls[-1]["sparse"]) == 4

    def failing(spec, device):
        raise TypeError("abs(): argument 'input' must be Tensor, not Int32")
    monkeypatch.setattr(api, "_cached_launch", failing)
    monkeypatch.setattr(api, "_untraceable", {})
    before = len(calls)
    with pytest.raises(RuntimeError, match="could not be traced into the kernel"):
        flash_attn_func(q, k, v, mask_mod=window_of(3), strict=True)
    with pytest.warns(Warning, match="could not be traced"):
        out = flash_attn_func(q, k, v, mask_mod=window_of(3))  # (the reference: remembered)
    assert len(calls) == before and out.shape == q.shape


def test_api_routes_packed_sequences_with_mods(monkeypatch):
    """flash_attn_varlen_func(mask_mod=..., score_mod=...): the varlen spec with the mods' keys,
    the launch given the sequence metadata and buffers of the varlen layouts (out like q, lse
    (h, total_q) for packed q, (b, h, sq) for batched q); block-sparse lists with packed
    sequences still go to the reference. (GPU-free stand-ins for the kernel.)"""
    from cuteattn import api, flash_attn_varlen_func, sparse
    calls, selected = [], []

    def launch(q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
               seqused_k=None, sparse=None, mod_tensors=()):
        calls.append(dict(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, used_k=seqused_k, out=out.shape,
                          lse=lse.shape, mod_tensors=mod_tensors, sparse=sparse))
        out.zero_()
        lse.zero_()
    monkeypatch.setattr(api, "_sparse_reason", lambda q, sink: None)
    monkeypatch.setattr(api, "_cached_launch", lambda spec, device: (selected.append(spec) or launch, None))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, mask_mod=document, score_mod=alibi, strict=True)
    spec = selected[-1]
    assert spec.varlen_q and spec.varlen_k and spec.mask_mod == mod_key(document)
    assert spec.score_mod == mod_key(alibi, "score_mod")
    assert calls[-1]["cu_q"] is cu and calls[-1]["out"] == q.shape and calls[-1]["lse"] == (2, 8)
    qb = torch.randn(2, 5, 2, 64, dtype=torch.bfloat16)  # batched q, packed keys
    flash_attn_varlen_func(qb, k, v, None, cu, 5, 5, mask_mod=document, strict=True)
    assert calls[-1]["cu_q"] is None and calls[-1]["lse"] == (2, 2, 5)
    # block lists per sequence too (with or without mods), and validate=True reads the metadata
    lists = sparse.from_topk(torch.zeros(1, 1, 1, 1, dtype=torch.int32), 1, 128, 128, partial=True)
    for mods in (dict(mask_mod=document), {}):
        flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, block_sparse=lists, strict=True, **mods)
        assert selected[-1].sparse_q_block == 128 and selected[-1].varlen_q
        assert calls[-1]["cu_q"] is cu and calls[-1]["sparse"] is not None
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 9, 8], dtype=torch.int32), cu, 5, 5,
                               block_sparse=lists, validate=True, strict=True)


def test_api_runs_gradients_through_both_kernels(monkeypatch):
    """With q/k/v requiring grad, the call records the forward kernel and the backward kernel
    (with the same traced mods and their tensors: the mask_mod's, then the score_mod's); a
    mod whose own tensor requires grad takes the reference, which differentiates it too.
    (GPU-free stand-ins for the kernels.)"""
    from cuteattn import api, flash_attn_func
    seen = []

    def forward_launch(q, k, v, out, lse, sparse=None, mod_tensors=()):
        out.fill_(1.0)
        lse.zero_()

    def backward_launch(dout, q, k, v, out, lse, sparse=(), mod_tensors=()):
        seen.append(dict(sparse=sparse, mod_tensors=mod_tensors))
        return torch.zeros_like(q), torch.ones_like(k), torch.zeros_like(v)

    monkeypatch.setattr(api, "_sparse_reason", lambda *a: None)
    monkeypatch.setattr(api, "_cached_launch", lambda spec, device: (
        backward_launch if spec.kind == "bwd" else forward_launch, None))
    q, k, v = (torch.randn(1, 5, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, mask_mod=document, strict=True)
    assert torch.all(out == 1)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.all(dk == 1) and seen[-1]["sparse"] == ()
    assert seen[-1]["mod_tensors"][0].tolist() == DOCS.tolist()
    slopes = torch.rand(2)
    out = flash_attn_func(q, k, v, mask_mod=document, score_mod=_alibi_of(slopes), strict=True)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    tensors = seen[-1]["mod_tensors"]
    assert tensors[0].tolist() == DOCS.tolist() and torch.equal(tensors[2], slopes)
    learnable = torch.rand(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="a mod's tensor requires grad"):
        flash_attn_func(q, k, v, score_mod=_alibi_of(learnable), strict=True)


def _alibi_of(slopes):
    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_bias


BWD_SCORE_CASES = [("alibi", alibi, None, 128), ("softcap", None, None, 128),
                   ("alibi-document", alibi, document, 64), ("softcap-document", None, document, 96),
                   ("fa2-alibi", FA2_ALIBI, None, 128), ("fa2-alibi-heads", FA2_ALIBI_HEADS, None, 64)]


@pytest.mark.compile
@pytest.mark.parametrize("name,score,mask,d", BWD_SCORE_CASES, ids=[c[0] for c in BWD_SCORE_CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compile_backward_with_score_mod(name, score, mask, d, causal, capfd, tmp_path, monkeypatch):
    """The backward with a score_mod traced with a Dual score (its value and derivative in the
    one pass that makes P and dS), alone or with a mask_mod: spill-free at d 64-128."""
    from cuteattn.kernels.sm90.bwd import Sm90BwdConfig
    from cuteattn.kernels.sm90.compile import compile_bwd
    monkeypatch.chdir(tmp_path)
    score = score or softcap_of(20.0)
    cfg = Sm90BwdConfig(dtype=cutlass.BFloat16, head_dim=d, causal=causal, dq_single_wg=d == 96,
                        score_mod=mod_key(score, "score_mod"),
                        mask_mod=mod_key(mask) if mask else None)
    ptx = compile_bwd(cfg, options="--keep-ptx remarks{ptx}", mask_mod_fn=mask,
                      score_mod_fn=score).__ptx__
    assert ("tanh.approx.f32" in ptx) == name.startswith("softcap")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


BLOCKS_CASES = [("document-128x128", document, 128, 128), ("sliding-128x64", sliding, 128, 64),
                ("prefix-64x64", prefix_lm_of(torch.tensor([5, 7], dtype=torch.int32)), 64, 64),
                ("constant", lambda b, h, q_idx, kv_idx: True, 128, 128)]


@pytest.mark.compile
@pytest.mark.parametrize("name,fn,q_block,kv_block", BLOCKS_CASES, ids=[c[0] for c in BLOCKS_CASES])
def test_compile_mask_mod_blocks(name, fn, q_block, kv_block, capfd, tmp_path, monkeypatch):
    """sparse.from_mask_mod's kernel (common/mask_blocks.py): the mod traced in, spill-free, its
    warp votes present; a tensor-reading mod loads from global memory."""
    from cuteattn.kernels.common import arguments as common_arguments
    from cuteattn.kernels.common.mask_blocks import MaskBlocks, MaskBlocksConfig
    from cuteattn.kernels.compile_common import compile_kernel
    from cuteattn.kernels.sm90 import arguments as sm90_arguments
    monkeypatch.chdir(tmp_path)
    key = mod_key(fn)
    cfg = MaskBlocksConfig(key, q_block, kv_block)
    fakes = common_arguments.fakes(cfg, sm90_arguments.MASK_BLOCKS_ARGUMENTS, None)
    ptx = compile_kernel(MaskBlocks(cfg, fn), fakes, options="--keep-ptx remarks{ptx}").__ptx__
    assert "vote.sync.any" in ptx and "vote.sync.all" in ptx
    assert ("ld.global" in ptx) == bool(key.tensors)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


def softcap_of(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def gated(score, b, h, q_idx, kv_idx):  # torch.where, torch.abs, torch.exp on kernel values
    near = torch.abs(q_idx - kv_idx) < 64
    return torch.where(near, score, score - torch.exp(torch.clamp(score, max=0.0)))


TORCH_CASES = [("softcap", softcap_of(30.0), 128), ("gated", gated, 64)]


@pytest.mark.compile
@pytest.mark.parametrize("name,fn,d", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_compile_score_mod_with_torch_functions(name, fn, d, capfd, tmp_path, monkeypatch):
    """torch's element-wise functions inside a score_mod trace (TorchInKernel): a softcap
    written as FlexAttention writes it compiles spill-free to tanh.approx, as the built-in
    softcap does; its constant is part of the key."""
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90.compile import compile_fwd
    monkeypatch.chdir(tmp_path)
    key = mod_key(fn, "score_mod")
    cfg = config.fwd_config(cutlass.BFloat16, d, d, True, False, False, False, False,
                            score_mod=key)
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}", mod_fns=(None, fn)).__ptx__
    assert ("tanh.approx.f32" in ptx) == (name == "softcap")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0
    if name == "softcap":
        assert mod_key(softcap_of(20.0), "score_mod") != key


def document_window(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx - kv_idx <= WINDOW)


@pytest.mark.compile
def test_traced_mods_take_the_widest_spill_free_tile(capfd, monkeypatch, tmp_path):
    """A traced mod's register need is the user's: the launch compiles the config's tile and,
    while it spills, ever narrower key blocks (config.narrower_tiles), keeping the first that
    does not. Here a windowed document mask_mod on a packed causal d=128 config, whose 128-key
    tile spills (60 bytes; the 112-key one does not)."""
    from cuteattn.kernels.sm90 import config
    from cuteattn.kernels.sm90 import launch as sm90_launch
    from cuteattn.kernels.sm90.compile import compile_fwd_with_report
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "0")
    cfg = config.fwd_config(cutlass.BFloat16, 128, 128, True, False, False, True, True, True, True,
                            mask_mod=mod_key(document_window))
    candidates = config.narrower_tiles(cfg)
    assert [c.tile_n for c in candidates] == list(range(cfg.tile_n, 31, -16))
    assert compile_fwd_with_report(cfg, mod_fns=(document_window, None))[1]["spill_store_bytes"] > 0
    compile_cache.clear()
    sm90_launch._compiled(cfg, False, (document_window, None))
    info = compile_cache.stats()["kernel_info"][("sm90", "fwd", False, cfg)]
    assert info["spill_store_bytes"] == 0


def test_torch_minimum_refuses_a_number_as_eager_torch_does():
    """torch.minimum(score, 0.0) raises in eager torch (so in the reference); the traced form
    raises too, so a mod never works on one path and fails on the other. clamp takes numbers."""
    from cuteattn.kernels.common.mods import TorchInKernel
    with pytest.raises(TypeError):
        torch.minimum(torch.zeros(1), 0.0)
    for fn in (TorchInKernel.minimum, TorchInKernel.maximum):
        with pytest.raises(TypeError, match="torch.clamp"):
            fn(1.0, 0.0)


PACKED_BWD_CASES = [("document", document, None, 128), ("alibi-document", document, alibi, 64)]


@pytest.mark.compile
@pytest.mark.parametrize("name,mask,score,d", PACKED_BWD_CASES, ids=[c[0] for c in PACKED_BWD_CASES])
def test_compile_backward_with_mods_and_packed_sequences(name, mask, score, d, capfd, tmp_path,
                                                         monkeypatch):
    """The backward with mods over packed sequences (b the sequence, positions within it, as the
    forward), the family's own config for such a spec: compiled without spills (the document
    mask at d=128 spilled 40 bytes until the packed kernels' tile coordinates and warpgroup
    indices were marked warp-uniform)."""
    import dataclasses
    from cuteattn.kernels.sm90 import launch_bwd
    from cuteattn.kernels.sm90.compile import compile_bwd
    from cuteattn.spec import AttentionSpec
    monkeypatch.chdir(tmp_path)
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=d, head_dim_v=d, causal=True, local=False,
                         has_softcap=False, varlen_q=True, varlen_k=True, softmax_scale=d ** -0.5,
                         kind="bwd", mask_mod=mod_key(mask),
                         score_mod=mod_key(score, "score_mod") if score else None)
    for m in (spec.mask_mod, spec.score_mod):
        if m is not None:
            object.__setattr__(m, "fn", mask if m is spec.mask_mod else score)
    assert launch_bwd.BACKWARD.can_implement(spec) is None
    cfg = launch_bwd.bwd_config(spec)
    assert cfg.varlen_q and cfg.varlen_k and cfg.mask_mod == spec.mask_mod
    compile_bwd(cfg, options="--keep-ptx remarks{ptx}", mask_mod_fn=mask, score_mod_fn=score)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg}: {spills}"


def test_api_runs_packed_gradients_through_both_kernels(monkeypatch):
    """Packed sequences with mods, or with block-sparse lists, requiring grad: the forward and
    the backward kernels both get the sequence metadata and the varlen-shaped out / lse (the
    lists' batch mode the sequence, transposed per sequence for the backward). (GPU-free
    stand-ins for the kernels.)"""
    from cuteattn import api, flash_attn_varlen_func, sparse
    seen = []

    def forward_launch(q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                       seqused_k=None, sparse=None, mod_tensors=()):
        seen.append(("fwd", cu_seqlens_q, cu_seqlens_k, tuple(out.shape), tuple(lse.shape), sparse))
        out.fill_(1.0)
        lse.zero_()

    def backward_launch(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                        seqused_q=None, seqused_k=None, sparse=(), mod_tensors=()):
        seen.append(("bwd", cu_seqlens_q, cu_seqlens_k, tuple(out.shape), tuple(lse.shape), sparse))
        return torch.zeros_like(q), torch.ones_like(k), torch.zeros_like(v)

    monkeypatch.setattr(api, "_sparse_reason", lambda *a: None)
    monkeypatch.setattr(api, "_cached_launch", lambda spec, device: (
        backward_launch if spec.kind == "bwd" else forward_launch, None))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    lists = sparse.from_topk(torch.zeros(2, 1, 1, 1, dtype=torch.int32), 1, 128, 128, partial=True)
    for kw in (dict(mask_mod=document), dict(block_sparse=lists), dict(score_mod=alibi)):
        seen.clear()
        q, k, v = (torch.randn(8, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, strict=True, **kw)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert [s[0] for s in seen] == ["fwd", "bwd"], kw
        for _, cu_q, cu_k, out_shape, lse_shape, lists_seen in seen:
            assert cu_q is cu and cu_k is cu and out_shape == (8, 2, 64) and lse_shape == (2, 8)
            assert (lists_seen is not None and len(lists_seen) > 0) == ("block_sparse" in kw)
        assert torch.equal(dk, torch.ones_like(k))  # (the backward kernel's, not the reference's)
