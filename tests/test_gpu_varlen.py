"""GPU forward of flash_attn_varlen_func against the varlen reference, sequence by sequence.

strict=True: a call that would take the reference fallback fails instead of passing on it.
"""
import pytest
import torch

from cuteattn import flash_attn_varlen_func
from cuteattn.reference import attention_varlen_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENS_Q = [1, 0, 63, 64, 65, 128, 129, 700]
# different k lengths per sequence; sequence 2 has 63 queries and no key, sequence 1 keys but no query
LENS_K = [129, 65, 0, 700, 1, 64, 128, 63]
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(128, 0))}


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def run_and_check(lens_q, lens_k, h, hk, d, dtype, seqused_q=None, seqused_k=None, **kw):
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((h, q.shape[0]), float("nan"), device="cuda")
    flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_q=seqused_q, seqused_k=seqused_k,
        return_lse=True, strict=True, validate=True, out=out, lse=lse, **kw,
    )
    ref_args = (q, k, v, cu_q, cu_k, seqused_q, seqused_k)
    ref, ref_lse = attention_varlen_ref(*ref_args, **kw)
    lowprec, _ = attention_varlen_ref(*ref_args, **kw, upcast=False)
    used_q = seqused_q.tolist() if seqused_q is not None else lens_q
    for b, start in enumerate(cu_q.tolist()[:-1]):
        rows = slice(start, start + used_q[b])  # rows beyond seqused_q are undefined
        assert_close_fa(out[rows], ref[rows], lowprec[rows], name=f"out of sequence {b}")
        assert_lse_close(lse[:, rows], ref_lse[:, rows], name=f"lse of sequence {b}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen(seed, dtype, d, h, hk, mask):
    run_and_check(LENS_Q, LENS_K, h, hk, d, dtype, **MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen_self_attention(seed, mask):
    run_and_check(LENS_Q, LENS_Q, 8, 2, 128, torch.bfloat16, **MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen_seqused(seed, mask):
    used_q = torch.tensor([1, 0, 20, 64, 0, 100, 129, 650], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([100, 3, 0, 700, 1, 0, 128, 10], dtype=torch.int32, device="cuda")
    run_and_check(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, seqused_q=used_q, seqused_k=used_k,
                  **MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen_many_tiles_per_cta(seed, mask):
    """Several hundred tiles of unequal cost, more than the GPU has SMs: the persistent grid's
    CTAs draw many tiles each from the tile counter."""
    lens = [4096, 512, 3072, 1, 1024, 700, 2560, 0, 1536]
    run_and_check(lens, lens, 8, 2, 128, torch.bfloat16, **MASKS[mask])
