"""CUDA graphs: a captured forward replays correctly with new data in its captured buffers.

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
