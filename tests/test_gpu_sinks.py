"""GPU learnable sinks (gpt-oss): the sm90 forward and backward kernels against the float32
reference (out, lse; dq, dk, dv, dsink by FlashAttention's rule), strict=True so a case the
kernels do not serve fails. Fixed length and packed sequences (seqused_q rows left out of
dsink), GQA, masks, rows that see no key (out 0, lse = the sink), large sinks (the epilogue's
overflow-safe sum), NaN-poisoned outputs."""
import contextlib
import os
import itertools

import pytest
import torch

from cuteattn import FallbackWarning, flash_attn_func, flash_attn_varlen_func
from cuteattn.reference import attention_ref, attention_varlen_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(64, 0)),
         "softcap": dict(softcap=20.0)}
CASES = [(d, mask, sl, heads) for (d, mask), sl, heads in zip(
    itertools.product((64, 128, 256), MASKS), itertools.cycle([(1, 300), (700, 700), (129, 65), (257, 1000)]),
    itertools.cycle([(4, 4), (8, 2), (4, 1)]))]


def close_grads(got, inputs, dout, fn, **kw):
    """Each gradient of (q, k, v, sink) within FlashAttention's rule of the float32 reference's
    autograd. fn(q, k, v, sink, upcast, **kw) -> (out, lse)."""
    leaves32 = [t.detach().float().requires_grad_() for t in inputs]
    ref = torch.autograd.grad(fn(*leaves32, True, **kw)[0], leaves32, dout.float())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    low = torch.autograd.grad(fn(*leaves, False, **kw)[0], leaves, dout)
    for g, r, lo, name in zip(got, ref, low, ("dq", "dk", "dv", "dsink")):
        assert_close_fa(g.float(), r, lo.float(), name=name)


def fixed_ref(q, k, v, sink, upcast, **kw):
    return attention_ref(q, k, v, learnable_sink=sink, upcast=upcast, **kw)


@pytest.mark.parametrize("d,mask,sl,heads", CASES,
                         ids=[f"d{d}-{m}-{sq}x{sk}-h{h}:{hk}" for d, m, (sq, sk), (h, hk) in CASES])
def test_sink_forward_and_backward(seed, d, mask, sl, heads):
    (sq, sk), (h, hk) = sl, heads
    kw = MASKS[mask]
    q = torch.randn(2, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = (torch.randn(h, device="cuda") * 2).requires_grad_()
    with torch.no_grad():  # the forward alone, into NaN-poisoned buffers
        out = torch.full((2, sq, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((2, h, sq), float("nan"), device="cuda")
        flash_attn_func(q, k, v, learnable_sink=sink, strict=True, out=out, lse=lse, **kw)
    ref, ref_lse = attention_ref(q, k, v, learnable_sink=sink.detach(), **kw)
    low, _ = attention_ref(q, k, v, learnable_sink=sink.detach(), upcast=False, **kw)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)
    # the portable backward serves head dims up to 128 (the sm90 one all of them); beyond,
    # the reference's gradients, with the fallback warning (and the sink's gradient from there)
    has_kernel = d <= 128 or (torch.cuda.get_device_capability() == (9, 0)
                               and os.environ.get("CUTEATTN_PATH", "") != "sm80")
    with contextlib.nullcontext() if has_kernel else pytest.warns(FallbackWarning, match="backward"):
        got_out = flash_attn_func(q, k, v, learnable_sink=sink, strict=has_kernel, **kw)
        dout = torch.randn_like(got_out)
        grads = torch.autograd.grad(got_out, (q, k, v, sink), dout)
    close_grads(grads, (q, k, v, sink), dout, fixed_ref, **kw)


def test_rows_without_keys_and_large_sinks(seed):
    """Causal with more queries than keys: the first rows see no key (out 0, lse = the sink);
    sinks far above and below the scores (the epilogue's sum stays finite)."""
    q = torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 100, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sink = torch.tensor([80.0, -80.0, 0.0, 5.0], device="cuda")
    out, lse = flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True,
                               strict=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    low, _ = attention_ref(q, k, v, causal=True, learnable_sink=sink, upcast=False)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)
    assert (out[0, :200] == 0).all()
    assert torch.allclose(lse[0, :, :200], sink.view(4, 1).expand(4, 200), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_sink_with_packed_sequences(seed, causal):
    lens_q, lens_k, used_q = [300, 0, 129, 64], [500, 7, 129, 1], [250, 0, 129, 64]
    cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    sink = torch.randn(8, device="cuda", requires_grad=True)
    used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    args = (cu(lens_q), cu(lens_k), max(lens_q), max(lens_k))
    out, lse = flash_attn_varlen_func(q, k, v, *args, causal=causal, learnable_sink=sink,
                                      seqused_q=used, return_lse=True, strict=True)

    def ref_fn(q, k, v, sink, upcast, **a):
        return attention_varlen_ref(q, k, v, args[0], args[1], used, None, learnable_sink=sink,
                                    upcast=upcast, **a)
    rows = torch.cat([torch.arange(s, s + u) for s, u in zip(
        itertools.accumulate([0] + lens_q[:-1]), used_q)]).to(q.device)
    ref, ref_lse = ref_fn(q, k, v, sink.detach(), True, causal=causal)
    low, _ = ref_fn(q, k, v, sink.detach(), False, causal=causal)
    assert_close_fa(out[rows], ref[rows], low[rows])
    assert_lse_close(lse[:, rows], ref_lse[:, rows])
    dout = torch.zeros_like(out)
    dout[rows] = torch.randn_like(out[rows])  # (rows past seqused_q have no defined output)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    close_grads(grads, (q, k, v, sink), dout, ref_fn, causal=causal)
