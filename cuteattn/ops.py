"""torch.library custom ops: what torch.compile and autograd see of cuteattn.

`cuteattn::fwd` and `cuteattn::fwd_varlen` run the forward (api.forward / api.forward_varlen:
checks, kernel or reference fallback) as opaque operators with fake (meta) implementations that
give the output shapes, so `torch.compile(..., fullgraph=True)` traces a model that calls cuteattn
without a graph break and without specialising on sequence lengths. Their autograd formulas call
`cuteattn::bwd_ref` / `cuteattn::bwd_varlen_ref`: the float32 reference backward
(reference.attention_ref_backward, written out: autograd is off inside a custom op), as no
backward kernel exists yet; announced once by a FallbackWarning, refused in strict mode.

Plain eager calls without gradients do not come here (api._through_op): the op dispatcher costs
host time that the direct path does not pay.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cuteattn import _checks, api
from cuteattn.reference import attention_ref_backward, attention_varlen_ref_backward

_BACKWARD_REASON = "no backward kernel yet: the gradient is computed with the PyTorch reference"


def _strict_code(strict) -> int:
    """strict as the ops carry it: -1 for None (CUTEATTN_STRICT decides), else 0 or 1."""
    return -1 if strict is None else int(bool(strict))


def _strict(code: int):
    return None if code < 0 else bool(code)


def _normalised(q, softmax_scale, causal, window_size, softcap):
    """The Python scalars checked and put in the form the ops take (done before the op, so that
    a bad argument raises at the call, in eager and compiled code alike)."""
    causal, local, left, right = _checks.normalize_mask(causal, window_size)
    # int(): the head dim is static for a model (a symbolic one would only be specialised here)
    scale, softcap = _checks.check_scalars(softmax_scale, softcap, int(q.shape[-1]))
    return scale, causal, left, right, softcap


# ---- fixed length ----

@torch.library.custom_op("cuteattn::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
         window_right: int, softcap: float, strict: int) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = api.forward(q, k, v, softmax_scale, causal, (window_left, window_right),
                                 softcap, _strict(strict))
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap, strict):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[-1])),
            q.new_empty((b, h, sq), dtype=torch.float32))


@torch.library.custom_op("cuteattn::bwd_ref", mutates_args=())
def _bwd_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool,
             window_left: int, window_right: int, softcap: float,
             strict: int) -> tuple[Tensor, Tensor, Tensor]:
    api._fall_back(_BACKWARD_REASON, _strict(strict))
    grads = attention_ref_backward(dout, q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), softcap=softcap)
    return _as_inputs(grads, (q, k, v))


@_bwd_ref.register_fake
def _bwd_ref_fake(dout, q, k, v, *args):
    return _contiguous_like(q, k, v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, *scalars = inputs
    ctx.save_for_backward(q, k, v)
    ctx.scalars = scalars
    ctx.mark_non_differentiable(output[1])  # lse


def _fwd_backward(ctx, dout, dlse):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = _bwd_ref(dout.contiguous(), q, k, v, *ctx.scalars)
    return dq, dk, dv, None, None, None, None, None, None


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def attention(q, k, v, softmax_scale, causal, window_size, softcap, strict):
    """flash_attn_func through the custom op: returns (out, lse)."""
    scale, causal, left, right, softcap = _normalised(q, softmax_scale, causal, window_size, softcap)
    return _fwd(q, k, v, scale, causal, left, right, softcap, _strict_code(strict))


# ---- packed (varlen) ----

@torch.library.custom_op("cuteattn::fwd_varlen", mutates_args=())
def _fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                seqused_q: Optional[Tensor], seqused_k: Optional[Tensor], max_seqlen_q: int,
                max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float, validate: bool,
                strict: int) -> tuple[Tensor, Tensor]:
    return api.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, (window_left, window_right), softcap,
                              seqused_q, seqused_k, validate, _strict(strict))


@_fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, *args):
    total_q, h, _ = q.shape
    return (q.new_empty((total_q, h, v.shape[-1])),
            q.new_empty((h, total_q), dtype=torch.float32))


@torch.library.custom_op("cuteattn::bwd_varlen_ref", mutates_args=())
def _bwd_varlen_ref(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
                    softmax_scale: float, causal: bool, window_left: int, window_right: int,
                    softcap: float, strict: int) -> tuple[Tensor, Tensor, Tensor]:
    api._fall_back(_BACKWARD_REASON, _strict(strict))
    grads = attention_varlen_ref_backward(
        dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap)
    return _as_inputs(grads, (q, k, v))


@_bwd_varlen_ref.register_fake
def _bwd_varlen_ref_fake(dout, q, k, v, *args):
    return _contiguous_like(q, k, v)


def _fwd_varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, used_q, used_k, _max_q, _max_k, *scalars = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, used_q, used_k)
    ctx.scalars = scalars[:-2] + scalars[-1:]  # drop `validate`: the forward checked already
    ctx.mark_non_differentiable(output[1])


def _fwd_varlen_backward(ctx, dout, dlse):
    q, k, v, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    dq, dk, dv = _bwd_varlen_ref(dout.contiguous(), q, k, v, cu_q, cu_k, used_q, used_k,
                                 *ctx.scalars)
    return (dq, dk, dv) + (None,) * 13


_fwd_varlen.register_autograd(_fwd_varlen_backward, setup_context=_fwd_varlen_setup)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_size, softcap, seqused_q, seqused_k, validate,
                     strict):
    """flash_attn_varlen_func through the custom op: returns (out, lse)."""
    scale, causal, left, right, softcap = _normalised(q, softmax_scale, causal, window_size, softcap)
    return _fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                       max_seqlen_k, scale, causal, left, right, softcap, bool(validate),
                       _strict_code(strict))


def _as_inputs(grads, inputs):
    """Gradients in their inputs' dtypes, contiguous: the layout the fakes promise (a compiled
    backward views them by the fake's strides)."""
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, inputs))


def _contiguous_like(*tensors):
    return tuple(t.new_empty(t.shape) for t in tensors)
