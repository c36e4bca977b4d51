"""CUDA graphs: a captured forward (and a decoding step) replays correctly with new data in its
captured buffers.

The dynamically scheduled kernels (causal, windowed, varlen) draw tiles from a per-stream counter
that the kernel's last CTA resets, so a replay starts from zero like an eager call. Each replay
here gets new q/k/v values (and, varlen, new sequence lengths with the same totals and bounds)
and is checked against the float32 reference with FlashAttention's rule.
"""
import pytest
import torch

from cuteattn import flash_attn_func, flash_attn_varlen_func
from cuteattn.reference import attention_ref, attention_varlen_ref
from cuteattn.testing import assert_close_fa

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def capture(fn, warmup: int = 2):
    """(graph, output) of fn captured after warm-up calls on a side stream (compiles happen
    there, outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("mask", [{}, dict(causal=True), dict(window_size=(100, 0))])
def test_fixed_length_forward_replays(seed, mask):
    q = torch.randn(2, 777, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 777, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    graph, out = capture(lambda: flash_attn_func(q, k, v, strict=True, **mask))
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_ref(q, k, v, **mask)
        low, _ = attention_ref(q, k, v, upcast=False, **mask)
        assert_close_fa(out, ref, low)


def test_varlen_forward_replays_with_new_lengths(seed):
    total, batch, max_len = 1200, 4, 700
    q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, 300, 300, 1000, 1200], dtype=torch.int32, device="cuda")
    graph, out = capture(lambda: flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len,
                                                        causal=True, strict=True))
    for lengths in ([300, 0, 700, 200], [1, 699, 500, 0], [650, 150, 300, 100]):
        assert sum(lengths) == total and max(lengths) <= max_len
        cu.copy_(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True)
        low, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)
        assert_close_fa(out, ref, low)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_step_replays_with_new_tokens_and_lengths(seed, splits):
    """One decoding step (flash_attn_with_kvcache: append the new token into a paged cache at
    cache_seqlens, attend over the cache) captured once and replayed with new q, new tokens and
    new lengths written into the captured buffers: the kernel path reads no device value on the
    host, so the graph holds every step. Each replay's output against the reference on a copy
    of the caches, and the caches after the append compared exactly."""
    from cuteattn import flash_attn_with_kvcache
    from cuteattn.reference import attention_kvcache_ref
    b, h, hk, d, page, pages_per_seq = 3, 16, 4, 128, 16, 40
    dev, dtype = "cuda", torch.bfloat16
    k_cache = torch.randn(b * pages_per_seq + 2, page, hk, d, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(b * pages_per_seq + 2, device=dev)[: b * pages_per_seq].reshape(b, -1).int()
    q = torch.randn(b, 1, h, d, device=dev, dtype=dtype)
    k_new = torch.randn(b, 1, hk, d, device=dev, dtype=dtype)
    v_new = torch.randn_like(k_new)
    lens = torch.tensor([5, 300, 600], dtype=torch.int32, device=dev)
    step = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                           block_table=table, causal=True, num_splits=splits,
                                           strict=True)
    graph, out = capture(step)
    for new_lens in ([6, 301, 601], [0, 639, 17], [200, 1, 400]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        ref_k, ref_v, low_k, low_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        kw = dict(cache_seqlens=lens, block_table=table, causal=True)
        ref, _ = attention_kvcache_ref(q, ref_k, ref_v, k_new, v_new, **kw)
        low, _ = attention_kvcache_ref(q, low_k, low_v, k_new, v_new, upcast=False, **kw)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "the append differs"
        assert_close_fa(out, ref, low)
