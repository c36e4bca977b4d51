"""GPU forward of flash_attn_func against the float32 reference, FlashAttention's rule.

Run with `pytest -m gpu` on a machine with a CUDA GPU. strict=True everywhere: a case the kernel does
not serve fails instead of silently passing on the reference. Outputs are poisoned with NaN (through
the API's out= / lse= buffers) so any element the kernel does not write fails.
"""
import itertools

import pytest
import torch

from cuteattn import flash_attn_func
from cuteattn.reference import attention_ref
from cuteattn.testing import assert_close_fa, assert_lse_close, rising_row_maxima_qk

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 80, 96, 128, 192, 256]  # (80: its own width on sm90)
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA, MQA
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(64, 32)),
    "left": dict(window_size=(64, -1)),
    "right": dict(window_size=(-1, 32)),
    "softcap": dict(softcap=30.0),
    "softcap_causal": dict(softcap=30.0, causal=True),
}
SEQLENS = [(1, 1), (17, 17), (113, 203), (203, 113), (1023, 1023), (128, 17), (64, 1), (1, 64),
           (256, 512), (4224, 4224)]


def cases():
    """Every (head_dim, mask, seqlens) triple; dtype and head layout cycle so that every pair of
    values of any two dimensions appears at least once (checked by test_cases_cover_all_pairs)."""
    out = []
    for (i_d, d), (i_m, mask), (i_s, sl) in itertools.product(
        enumerate(HEAD_DIMS), enumerate(MASKS), enumerate(SEQLENS)
    ):
        dtype = DTYPES[(i_d + i_m + i_s) % 2]
        heads = HEADS[(i_d + i_m + 2 * i_s) % 3]
        out.append((dtype, d, heads, mask, sl))
    return out


CASES = cases()


def case_id(case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    return f"{str(dtype)[6:]}-d{d}-h{h}:{hk}-{mask}-{sq}x{sk}"


def test_cases_cover_all_pairs():
    """Runs on CPU: the selection is pairwise-complete and stays near 350 cases."""
    dims = [DTYPES, HEAD_DIMS, HEADS, list(MASKS), SEQLENS]
    for a, b in itertools.combinations(range(len(dims)), 2):
        seen = {(c[a], c[b]) for c in CASES}
        assert len(seen) == len(dims[a]) * len(dims[b]), (a, b)
    assert 300 <= len(CASES) <= 450


def run_and_check(q, k, v, **kw):
    b, sq, h, _ = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=q.device)
    got, got_lse = flash_attn_func(q, k, v, **kw, return_lse=True, strict=True, out=out, lse=lse)
    assert got is out and got_lse is lse
    ref, ref_lse = attention_ref(q, k, v, **kw)
    lowprec, _ = attention_ref(q, k, v, **kw, upcast=False)
    assert_close_fa(out, ref, lowprec)
    assert_lse_close(lse, ref_lse)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(seed, case):
    run_case(case)


def run_case(case):
    """One case of CASES on random inputs (also run on the sm80 path: test_gpu_sm80.py)."""
    dtype, d, (h, hk), mask, (sq, sk) = case
    kw = MASKS[mask]
    batch = max(1, min(3, 2**21 // (sq * sk)))
    q = torch.randn(batch, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, sk, hk, d, device="cuda", dtype=dtype)
    if "softcap" in kw:
        q = q * 8  # scores of magnitude ~softcap, so that tanh actually bends them
    run_and_check(q, k, v, **kw)


@gpu
@needs_cuda
def test_custom_scale_and_strided_inputs(seed):
    """A softmax_scale of our own, and q/k/v that are views (non-contiguous in seqlen and heads)."""
    qkv = torch.randn(2, 300, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    run_and_check(q, k, v, softmax_scale=0.05, causal=True)


@gpu
@needs_cuda
def test_no_recompile_for_new_shapes(seed):
    from cuteattn import compile_cache

    def call(b, sq, sk, h, hk):
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, 128, device="cuda", dtype=torch.bfloat16)
        run_and_check(q, k, torch.randn_like(k), causal=True)

    call(2, 128, 128, 4, 4)
    before = compile_cache.stats()
    call(3, 200, 333, 8, 2)
    call(1, 1000, 77, 16, 1)
    after = compile_cache.stats()
    assert after["compiles"] == before["compiles"], (before, after)
    assert after["hits"] >= before["hits"] + 2, (before, after)


@gpu
@needs_cuda
@pytest.mark.parametrize("mask", ["causal", "window", "none"])
def test_tile_counters_left_at_zero_across_streams(seed, mask):
    """Dynamically scheduled kernels (causal, windowed) draw tiles from a per-stream counter and
    must leave it at zero; two streams at once must not disturb each other."""
    from cuteattn.kernels.sm90 import launch as sm90_launch

    kw = MASKS[mask]
    side = torch.cuda.Stream()
    inputs = [[torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
              for _ in range(2)]
    torch.cuda.synchronize()
    outs = []
    for i in range(4):  # alternate streams, without waiting in between
        stream = side if i % 2 else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            outs.append(flash_attn_func(*inputs[i % 2], strict=True, **kw))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        q, k, v = inputs[i % 2]
        ref, _ = attention_ref(q, k, v, **kw)
        lowprec, _ = attention_ref(q, k, v, **kw, upcast=False)
        assert_close_fa(out, ref, lowprec, name=f"call {i}")
    assert all(int(c.abs().sum()) == 0 for c in sm90_launch._tile_counters.values())


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_rising_row_maxima(seed, dtype, d, causal):
    """Scores that climb along the keys, in steps smaller and larger than the row max's lag
    (OnlineSoftmax.max_lag_log2: 8 in exp2 units, 5.5 natural): rows keep a stale max over
    some blocks (probabilities up to 2^8) and move it over others, in every warp's own
    pattern (a per-row offset), with a large jump now and then."""
    # steps of 1.2-2.1 every 97 keys (1.7-3.1 in exp2 units: a few stay within the lag, then
    # the max moves) and jumps of 6.5-12 every 701 keys (9.4-17: past it at once)
    b, s, h = 2, 2111, 4
    q, k = rising_row_maxima_qk(b, s, h, d, step=2.3)
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    run_and_check(q, k, v, causal=causal)
