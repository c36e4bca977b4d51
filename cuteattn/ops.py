"""torch.library custom ops: what torch.compile and autograd see of cuteattn.

`cuteattn::fwd` and `cuteattn::fwd_varlen` run the forward (api.forward / api.forward_varlen:
checks, kernel or reference fallback) as opaque operators with fake (meta) implementations that
give the output shapes, so `torch.compile(..., fullgraph=True)` traces a model that calls cuteattn
without a graph break and without specialising on sequence lengths. The forward saves q, k, v,
out and lse; their autograd formulas call `cuteattn::bwd` / `cuteattn::bwd_varlen` (api.backward
/ api.backward_varlen: the backward kernel, or the float32 reference backward, written out since
autograd is off inside a custom op, with the usual FallbackWarning or strict-mode error).

Plain eager calls without gradients do not come here (api._through_op): the op dispatcher costs
host time that the direct path does not pay. Eager calls that record a gradient run the same
forward and backward bodies through a torch.autograd.Function (_Eager, _EagerVarlen) rather than
the ops: with torch 2.11 on an H200 the dispatcher and the op's autograd wrapper took ~0.4 ms of
host time a backward call, longer than the kernels of a 1k-token layer. A call whose signature
api.py has kept a launch for runs through _Kept instead (no checks, no kernel choice).
torch.compile traces the ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cuteattn import _checks, api


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

def _fwd_body(q: Tensor, k: Tensor, v: Tensor, learnable_sink: Optional[Tensor],
              descales: list[Optional[Tensor]], softmax_scale: float, causal: bool,
              window_left: Optional[int], window_right: Optional[int], softcap: float,
              deterministic: bool, strict: int) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = api.forward(q, k, v, softmax_scale, causal, (window_left, window_right),
                                 softcap, _strict(strict), learnable_sink=learnable_sink,
                                 descales=tuple(descales))
    return out, lse


_fwd = torch.library.custom_op("cuteattn::fwd", mutates_args=())(_fwd_body)


@_fwd.register_fake
def _fwd_fake(q, k, v, *args):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[-1]), dtype=_checks.out_dtype(q)),
            q.new_empty((b, h, sq), dtype=torch.float32))


def _bwd_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              learnable_sink: Optional[Tensor], softmax_scale: float, causal: bool,
              window_left: Optional[int], window_right: Optional[int], softcap: float,
              deterministic: bool, strict: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    *grads, dsink = api.backward(dout, q, k, v, out, lse, softmax_scale, causal,
                                 (window_left, window_right), softcap, deterministic,
                                 _strict(strict), learnable_sink)
    return (*_as_inputs(grads, (q, k, v)), _sink_grad(dsink, learnable_sink, q))


_bwd = torch.library.custom_op("cuteattn::bwd", mutates_args=())(_bwd_body)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, learnable_sink, *args):
    return (*_contiguous_like(q, k, v), _sink_grad_fake(learnable_sink, q))


def _fwd_setup(ctx, inputs, output):
    q, k, v, sink, _descales, *scalars = inputs  # (fp8 with its descales never records a grad)
    ctx.save_for_backward(q, k, v, *output, sink)  # out, lse: what the backward needs besides
    ctx.scalars = scalars
    ctx.mark_non_differentiable(output[1])  # lse


def _fwd_backward(ctx, dout, dlse, bwd=_bwd):
    q, k, v, out, lse, sink = ctx.saved_tensors
    dq, dk, dv, dsink = bwd(dout.contiguous(), q, k, v, out, lse, sink, *ctx.scalars)
    return (dq, dk, dv, dsink if sink is not None else None) + (None,) * 8


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _eager(name: str, body, setup, formula, bwd_body):
    """A torch.autograd.Function running an op's body (body, setup) and its autograd formula
    (formula, on bwd_body: the backward op's body) for eager calls, without the op dispatcher."""

    def forward(ctx, *inputs):
        output = body(*inputs)
        setup(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # (lse has no gradient: no zeros for it)
        return output

    def backward(ctx, dout, dlse):
        if dout is None:  # (out was not used)
            return (None,) * len(ctx.needs_input_grad)
        return formula(ctx, dout, dlse, bwd=bwd_body)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


_Eager = _eager("_Eager", _fwd_body, _fwd_setup, _fwd_backward, _bwd_body)


class _Kept(torch.autograd.Function):
    """An eager call that records a gradient, on the launch api._launches keeps for its
    signature (shapes, strides, dtypes, scalars): the forward's checks and kernel choice are
    not redone, and the backward starts from the forward's spec (api.backward_of). index: the
    packed sequences' index tensors (empty for fixed lengths)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, launch, deterministic, strict, index):
        out, lse = api._new_outputs(q, v, spec, index or None)
        launch(q, k, v, out, lse, **index)
        ctx.save_for_backward(q, k, v, out, lse, *index.values())
        ctx.spec, ctx.deterministic, ctx.strict, ctx.index_names = (
            spec, deterministic, strict, tuple(index))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # (out was not used)
            return (None,) * 8
        q, k, v, out, lse, *index = ctx.saved_tensors
        grads = api.backward_of(ctx.spec, dout.contiguous(), q, k, v, out, lse, ctx.deterministic,
                                ctx.strict, dict(zip(ctx.index_names, index)) or None)
        return (*_as_inputs(grads, (q, k, v)), None, None, None, None, None)


def attention_kept(q, k, v, spec, launch, deterministic, strict, index=None):
    """flash_attn_func / flash_attn_varlen_func (index: its index tensors) for an eager call
    that records a gradient, on a kept (spec, launch): returns (out, lse)."""
    return _Kept.apply(q, k, v, spec, launch, bool(deterministic), strict, index or {})


def attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, strict,
              learnable_sink=None, descales=(None, None, None)):
    """flash_attn_func through the custom op: returns (out, lse)."""
    scale, causal, left, right, softcap = _normalised(q, softmax_scale, causal, window_size, softcap)
    op = _fwd if torch.compiler.is_compiling() else _Eager.apply
    return op(q, k, v, learnable_sink, list(descales), scale, causal, left, right, softcap,
              bool(deterministic), _strict_code(strict))


# ---- packed (varlen) ----

def _fwd_varlen_body(q: Tensor, k: Tensor, v: Tensor, learnable_sink: Optional[Tensor],
                     descales: list[Optional[Tensor]], cu_seqlens_q: Optional[Tensor],
                     cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor],
                     seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool, window_left: Optional[int],
                     window_right: Optional[int], softcap: float, validate: bool,
                     deterministic: bool, strict: int) -> tuple[Tensor, Tensor]:
    return api.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, (window_left, window_right), softcap,
                              seqused_q, seqused_k, validate, _strict(strict),
                              learnable_sink=learnable_sink, descales=tuple(descales))


_fwd_varlen = torch.library.custom_op("cuteattn::fwd_varlen", mutates_args=())(_fwd_varlen_body)


@_fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, learnable_sink, descales, cu_seqlens_q, *args):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=_checks.out_dtype(q))
    if cu_seqlens_q is not None:  # packed q: (total_q, h, d), lse (h, total_q)
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    b, sq, h, _ = q.shape  # batched q (FlashAttention-4's seqused-only form)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


def _bwd_varlen_body(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     learnable_sink: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                     cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor],
                     seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool, window_left: Optional[int],
                     window_right: Optional[int], softcap: float, deterministic: bool,
                     strict: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    *grads, dsink = api.backward_varlen(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, causal, (window_left, window_right), softcap, deterministic,
        _strict(strict), learnable_sink)
    return (*_as_inputs(grads, (q, k, v)), _sink_grad(dsink, learnable_sink, q))


_bwd_varlen = torch.library.custom_op("cuteattn::bwd_varlen", mutates_args=())(_bwd_varlen_body)


@_bwd_varlen.register_fake
def _bwd_varlen_fake(dout, q, k, v, out, lse, learnable_sink, *args):
    return (*_contiguous_like(q, k, v), _sink_grad_fake(learnable_sink, q))


def _fwd_varlen_setup(ctx, inputs, output):
    q, k, v, sink, _descales, cu_q, cu_k, used_q, used_k, max_q, max_k, *scalars = inputs
    ctx.save_for_backward(q, k, v, *output, sink, cu_q, cu_k, used_q, used_k)
    # (scale, causal, left, right, softcap, deterministic, strict): `validate` dropped, the
    # forward checked already
    ctx.scalars = (max_q, max_k, *scalars[:5], *scalars[6:])
    ctx.mark_non_differentiable(output[1])


def _fwd_varlen_backward(ctx, dout, dlse, bwd=_bwd_varlen):
    q, k, v, out, lse, sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    dq, dk, dv, dsink = bwd(dout.contiguous(), q, k, v, out, lse, sink, cu_q, cu_k,
                            used_q, used_k, *ctx.scalars)
    return (dq, dk, dv, dsink if sink is not None else None) + (None,) * 15


_fwd_varlen.register_autograd(_fwd_varlen_backward, setup_context=_fwd_varlen_setup)


_EagerVarlen = _eager("_EagerVarlen", _fwd_varlen_body, _fwd_varlen_setup, _fwd_varlen_backward,
                      _bwd_varlen_body)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, window_size, softcap, seqused_q, seqused_k, validate,
                     deterministic, strict, learnable_sink=None, descales=(None, None, None)):
    """flash_attn_varlen_func through the custom op: returns (out, lse)."""
    scale, causal, left, right, softcap = _normalised(q, softmax_scale, causal, window_size, softcap)
    op = _fwd_varlen if torch.compiler.is_compiling() else _EagerVarlen.apply
    return op(q, k, v, learnable_sink, list(descales), cu_seqlens_q, cu_seqlens_k, seqused_q,
              seqused_k, max_seqlen_q, max_seqlen_k, scale, causal, left, right, softcap,
              bool(validate), bool(deterministic), _strict_code(strict))


# ---- block-sparse lists (fixed length) ----

@torch.library.custom_op("cuteattn::fwd_sparse", mutates_args=())
def _fwd_sparse(q: Tensor, k: Tensor, v: Tensor, full_count: Tensor, full_index: Tensor,
                partial_count: Tensor, partial_index: Tensor, q_block: int, kv_block: int,
                softmax_scale: float, causal: bool, window_left: Optional[int],
                window_right: Optional[int], softcap: float, deterministic: bool,
                strict: int) -> tuple[Tensor, Tensor]:
    out, lse = api.forward_sparse(q, k, v, _lists(full_count, full_index, partial_count,
                                                  partial_index, q_block, kv_block),
                                  softmax_scale, causal, (window_left, window_right), softcap,
                                  _strict(strict))
    return out.contiguous(), lse.contiguous()


@_fwd_sparse.register_fake
def _fwd_sparse_fake(q, k, v, *args):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32))


@torch.library.custom_op("cuteattn::bwd_sparse", mutates_args=())
def _bwd_sparse(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                full_count: Tensor, full_index: Tensor, partial_count: Tensor,
                partial_index: Tensor, q_block: int, kv_block: int, softmax_scale: float,
                causal: bool, window_left: Optional[int], window_right: Optional[int],
                softcap: float, deterministic: bool, strict: int) -> tuple[Tensor, Tensor, Tensor]:
    grads = api.backward_sparse(dout, q, k, v, out, lse,
                                _lists(full_count, full_index, partial_count, partial_index,
                                       q_block, kv_block),
                                softmax_scale, causal, (window_left, window_right), softcap,
                                deterministic, _strict(strict))
    return _as_inputs(grads, (q, k, v))


@_bwd_sparse.register_fake
def _bwd_sparse_fake(dout, q, k, v, *args):
    return _contiguous_like(q, k, v)


def _fwd_sparse_setup(ctx, inputs, output):
    q, k, v, *lists_and_scalars = inputs
    ctx.save_for_backward(q, k, v, *output, *lists_and_scalars[:4])
    ctx.scalars = lists_and_scalars[4:]  # (q_block, kv_block, scale, causal, ..., strict)
    ctx.mark_non_differentiable(output[1])


def _fwd_sparse_backward(ctx, dout, dlse):
    q, k, v, out, lse, *lists = ctx.saved_tensors
    dq, dk, dv = _bwd_sparse(dout.contiguous(), q, k, v, out, lse, *lists, *ctx.scalars)
    return (dq, dk, dv) + (None,) * 13


_fwd_sparse.register_autograd(_fwd_sparse_backward, setup_context=_fwd_sparse_setup)


def _lists(full_count, full_index, partial_count, partial_index, q_block, kv_block):
    from cuteattn.sparse import BlockSparseMask
    return BlockSparseMask(q_block, kv_block, full_count, full_index, partial_count, partial_index)


def attention_sparse(q, k, v, mask, softmax_scale, causal, window_size, softcap, deterministic,
                     strict):
    """flash_attn_func(block_sparse=mask) through the custom op (torch.compile): returns
    (out, lse). The lists' rules are checked here, before the op, as in eager calls."""
    from cuteattn import sparse
    scale, causal, left, right, softcap = _normalised(q, softmax_scale, causal, window_size, softcap)
    sparse.check(mask, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device)
    return _fwd_sparse(q, k, v, mask.full_count, mask.full_index, mask.partial_count,
                       mask.partial_index, mask.q_block, mask.kv_block, scale, causal, left,
                       right, softcap, bool(deterministic), _strict_code(strict))


# ---- KV cache (inference: no autograd) ----

@torch.library.custom_op("cuteattn::kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
             rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor],
             cache_seqlens_tensor: Optional[Tensor], cache_seqlens_int: Optional[int],
             cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
             block_table: Optional[Tensor], softmax_scale: float, causal: bool,
             window_left: Optional[int], window_right: Optional[int], softcap: float,
             rotary_interleaved: bool, learnable_sink: Optional[Tensor], validate: bool,
             strict: int, num_splits: int, k_descale: Optional[Tensor] = None,
             v_descale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    from cuteattn.kvcache import kvcache_forward
    seqlens = cache_seqlens_tensor if cache_seqlens_tensor is not None else cache_seqlens_int
    out, lse = kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens,
                               cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                               window_left, window_right, softcap, rotary_interleaved,
                               learnable_sink, validate, _strict(strict), num_splits,
                               descales=(k_descale, v_descale))
    return out.contiguous(), lse.contiguous()


@_kvcache.register_fake
def _kvcache_fake(q, k_cache, v_cache, *args):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v_cache.shape[-1])),
            q.new_empty((b, h, sq), dtype=torch.float32))


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, left, right, softcap,
            rotary_interleaved, learnable_sink, validate, strict, num_splits,
            descales=(None, None)):
    """flash_attn_with_kvcache through the custom op (torch.compile): returns (out, lse); the
    caches are written in place, as the op declares (an fp8 cache with its descales too)."""
    as_tensor = isinstance(cache_seqlens, Tensor)
    return _kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                    cache_seqlens if as_tensor else None, None if as_tensor else cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, left,
                    right, softcap, rotary_interleaved, learnable_sink, validate,
                    _strict_code(strict), num_splits, *descales)


def _sink_grad(dsink, sink, q):
    """The sink's gradient as the op returns it: float32 like the sink, or an empty tensor when
    there is no sink (an op output cannot be None)."""
    if sink is None:
        return q.new_empty((0,), dtype=torch.float32)
    return dsink.to(torch.float32).contiguous()


def _sink_grad_fake(sink, q):
    return q.new_empty((0,) if sink is None else tuple(sink.shape), dtype=torch.float32)


def _as_inputs(grads, inputs):
    """Gradients in their inputs' dtypes, contiguous: the layout the fakes promise (a compiled
    backward views them by the fake's strides)."""
    return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, inputs))


def _contiguous_like(*tensors):
    return tuple(t.new_empty(t.shape) for t in tensors)
