"""FlashAttention-2's alibi_slopes (cuteattn/alibi.py) on the CPU reference path: the bias
-slope * |i + seqlen_k - seqlen_q - j| on the scaled (softcapped) scores, per head or per
(batch, head), with the call's masks; packed sequences with their own offsets; the slopes take
no gradient; bad slopes are clear errors. (On Hopper the same score_mod runs in the kernels:
tests/test_gpu_mods.py; its trace compiles in tests/test_mods.py.)"""
import math

import pytest
import torch

from cuteattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from cuteattn.alibi import key_offsets

pytestmark = pytest.mark.usefixtures("quiet_fallback")
BF16 = torch.bfloat16


def explicit(q, k, v, slopes, causal=False, window=(-1, -1), softcap=0.0):
    """FlashAttention-2's definition written out in float32 for one sequence (b, s, h, d)."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(d)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
    per = slopes if slopes.dim() == 2 else slopes.expand(q.shape[0], -1)
    s = s - per[:, :, None, None] * (i + sk - sq - j).abs()
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + sk - sq + right
    if left >= 0:
        keep &= j >= i + sk - sq - left
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float()), s.logsumexp(-1)


@pytest.mark.parametrize("sq,sk", [(7, 11), (9, 9), (13, 5)])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window": (3, 1)}, {"softcap": 2.0}])
def test_fixed_length_is_flashattention2s_bias(seed, sq, sk, per_batch, mask):
    b, h, d = 2, 4, 64
    q, k, v = (torch.randn(b, s, h, d, dtype=BF16) for s in (sq, sk, sk))
    slopes = torch.rand(b, h) if per_batch else torch.rand(h)
    kw = dict(causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)),
              softcap=mask.get("softcap", 0.0))
    out, lse = flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True, **kw)
    ref, ref_lse = explicit(q, k, v, slopes, kw["causal"], kw["window_size"], kw["softcap"])
    rows = torch.isfinite(ref_lse)  # (rows a mask leaves without keys: out 0, lse -inf)
    torch.testing.assert_close(lse[rows], ref_lse[rows], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.float(), ref.nan_to_num(0.0).to(BF16).float(), rtol=0,
                               atol=2 ** -7)


def test_packed_sequences_take_their_own_offsets(seed):
    """Each packed sequence's bias is measured from its own bottom-right corner; one-sided
    packing and seqused follow the same lengths as the masks."""
    lens_q, lens_k, h, d = [3, 0, 6, 1], [5, 4, 2, 7], 2, 64
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lens_q), h, d, dtype=BF16)
    k, v = (torch.randn(sum(lens_k), h, d, dtype=BF16) for _ in range(2))
    slopes = torch.rand(len(lens_q), h)
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      causal=True, alibi_slopes=slopes, return_lse=True)
    for i, (a, b) in enumerate(zip(cu(lens_q).tolist()[:-1], cu(lens_k).tolist()[:-1])):
        rq, rk = slice(a, a + lens_q[i]), slice(b, b + lens_k[i])
        ref, ref_lse = explicit(q[None, rq], k[None, rk], v[None, rk], slopes[i:i + 1], True)
        rows = torch.isfinite(ref_lse[0])
        torch.testing.assert_close(lse[:, rq][rows], ref_lse[0][rows], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[rq].float(), ref[0].nan_to_num(0.0).to(BF16).float(),
                                   rtol=0, atol=2 ** -7)
    assert key_offsets(q, k, cu(lens_q), cu(lens_k)).tolist() == [2, 4, -4, 6]
    used = torch.tensor([2, 0, 6, 1], dtype=torch.int32)
    assert key_offsets(q, k, cu(lens_q), cu(lens_k), seqused_q=used).tolist() == [3, 4, -4, 6]
    batched_q = torch.zeros(4, 6, h, d)
    assert key_offsets(batched_q, k, None, cu(lens_k)).tolist() == [-1, -2, -4, 1]
    assert key_offsets(q[None], q[None]) is None  # (equal lengths: the mod reads no offsets)


def test_gradients_flow_to_qkv_and_not_the_slopes(seed):
    q, k, v = (torch.randn(1, 9, 2, 64, dtype=BF16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
    assert slopes.grad is None
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = explicit(qf, kf, vf, slopes.detach(), causal=True)
    ref.square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (qf.grad, kf.grad, vf.grad)):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("slopes, exc, match", [
    (torch.ones(4, dtype=torch.float16), TypeError, "alibi_slopes must be float32"),
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\)"),
    (torch.ones(3, 4), ValueError, r"\(batch, nheads\) = \(2, 4\)"),
    (torch.ones(4, 2).t(), ValueError, "unit stride"),
    ([1.0] * 4, TypeError, "alibi_slopes must be a torch.Tensor"),
])
def test_bad_slopes_are_clear_errors(slopes, exc, match):
    q = torch.randn(2, 5, 4, 64, dtype=BF16)
    with pytest.raises(exc, match=match):
        flash_attn_func(q, q, q, alibi_slopes=slopes)


def test_alibi_with_a_score_mod_or_a_kv_cache_is_refused():
    q = torch.randn(1, 5, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="cannot be combined with a score_mod"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(2), score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache does not take ALiBi"):
        flash_attn_with_kvcache(q, q, q, alibi_slopes=torch.ones(2))
