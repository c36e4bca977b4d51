"""Learnable sinks on a kernel path, on the CPU: the API hands the sink to a family that takes
it (spec.has_sink); stand-in launches compute what the kernels compute (the float32 reference
with the sink) and the backward's dsink as the kernel launches do (launch_common.sink_gradient
from the preprocess's rows, here bwd_preprocess's PyTorch form), so what is checked is the
sink's way through the API and that gradient: rows outside sequences or past seqused_q,
NaN-poisoned here, count nothing, and dsink equals the reference's written-out gradient."""
import itertools
import warnings

import pytest
import torch

from cuteattn import FallbackWarning, api, flash_attn_func, flash_attn_varlen_func
from cuteattn.kernels import launch_common
from cuteattn.reference import (attention_ref, attention_ref_backward, attention_varlen_ref,
                                attention_varlen_ref_backward)


def stand_in_kernels(monkeypatch, seen):
    """_select_kernel's contract with launches computing the reference's values; rows the
    kernels leave unwritten (outside every sequence, past seqused_q) are NaN."""
    def forward(q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                seqused_k=None, learnable_sink=None):
        seen.append(learnable_sink)
        kw = dict(softmax_scale=spec_of[0].softmax_scale, causal=spec_of[0].causal,
                  learnable_sink=learnable_sink)
        if cu_seqlens_q is None:
            o, l = attention_ref(q, k, v, **kw)
            out.copy_(o)
            lse.copy_(l)
            return
        o, l = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, **kw)
        used = rows_in_use(spec_of[0].batch, cu_seqlens_q, seqused_q, l.shape[-1])
        out.copy_(torch.where(used.view(-1, 1, 1), o.view(out.shape).to(out.dtype), float("nan")))
        lse.copy_(torch.where(used, l, float("nan")))

    def backward(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, sink=None):
        assert sink is not None and torch.equal(sink.detach(), sink_of[0])
        kw = dict(softmax_scale=spec_of[0].softmax_scale, causal=spec_of[0].causal,
                  learnable_sink=sink_of[0])
        if cu_seqlens_q is None:
            grads = attention_ref_backward(dout, q, k, v, **kw)
        else:
            grads = attention_varlen_ref_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                  seqused_q, seqused_k, **kw)
        lse2, dsum = launch_common.bwd_preprocess(dout, out, lse, cu_seqlens_q, seqused_q)
        dsink = launch_common.sink_gradient(sink.detach(), lse2, dsum)
        return (*(g.to(x.dtype) for g, x in zip(grads[:3], (q, k, v))), dsink)

    spec_of, sink_of = [None], [None]

    def select(spec, device):
        assert spec.has_sink
        spec_of[0] = spec
        return (backward if spec.kind == "bwd" else forward), None
    monkeypatch.setattr(api, "_select_kernel", select)
    return sink_of


def rows_in_use(batch, cu_q, used_q, rows):
    """Bool (rows,) of packed q (or broadcastable to a batched lse): the rows inside a
    sequence and within seqused_q, the ones the kernels write."""
    if cu_q is None:
        r = torch.arange(rows)
        return torch.ones((), dtype=torch.bool) if used_q is None else r.view(1, 1, -1) < used_q.view(-1, 1, 1)
    r = torch.arange(rows)
    seq = torch.searchsorted(cu_q[1:].contiguous(), r, right=True).clamp(max=batch - 1)
    start = cu_q[seq]
    length = cu_q[seq + 1] - start if used_q is None else used_q[seq]
    return ((r - start) < length) & (r < cu_q[-1])


def test_sink_reaches_the_kernel_and_its_gradient_is_the_apis(monkeypatch):
    torch.manual_seed(0)
    seen = []
    sink_of = stand_in_kernels(monkeypatch, seen)
    q = torch.randn(2, 37, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 50, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 50, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(4, requires_grad=True)
    sink_of[0] = sink.detach()
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, strict=True)
    assert seen and seen[-1] is not None and torch.equal(seen[-1], sink.detach())
    dout = torch.randn_like(out)
    dq, dk, dv, dsink = torch.autograd.grad(out, (q, k, v, sink), dout)
    want = attention_ref_backward(dout, q.detach(), k.detach(), v.detach(), causal=True,
                                  learnable_sink=sink.detach())
    assert torch.allclose(dsink, want[3], rtol=2e-2, atol=1e-3)


def test_sink_gradient_with_packed_sequences_counts_only_used_rows(monkeypatch):
    torch.manual_seed(0)
    sink_of = stand_in_kernels(monkeypatch, [])
    lens_q, lens_k, used_q = [20, 0, 33], [25, 4, 33], [15, 0, 33]
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens_q) + 3, 4, 32, dtype=torch.bfloat16, requires_grad=True)  # 3 spare rows
    k = torch.randn(sum(lens_k), 2, 32, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 32, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(4, requires_grad=True)
    sink_of[0] = sink.detach()
    args = (q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
    used = torch.tensor(used_q, dtype=torch.int32)
    out = flash_attn_varlen_func(*args, causal=True, learnable_sink=sink, seqused_q=used,
                                 strict=True)
    dout = torch.randn_like(out)
    dsink = torch.autograd.grad(out, sink, dout)[0]
    assert torch.isfinite(dsink).all()
    want = attention_varlen_ref_backward(dout, q.detach(), k.detach(), v.detach(), cu(lens_q),
                                         cu(lens_k), used, None, causal=True,
                                         learnable_sink=sink.detach())
    assert torch.allclose(dsink, want[3], rtol=2e-2, atol=1e-3)
