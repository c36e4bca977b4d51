"""FlashAttention-compatible entry points: validate, normalise into an AttentionSpec, dispatch.

Flow: arguments -> _checks (no sync) -> AttentionSpec -> dispatch.can_implement -> kernel, or the
PyTorch reference with a warning (or a RuntimeError in strict mode). Never a silent wrong answer.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

import torch

from cuteattn import _checks, alibi
from cuteattn.reference import (attention_ref, attention_ref_backward, attention_varlen_ref,
                                attention_varlen_ref_backward, dequantize_fp8)
from cuteattn.spec import AttentionSpec


class FallbackWarning(UserWarning):
    """Emitted (once per distinct reason) when a call runs on the PyTorch reference, not a kernel."""


_warned_reasons: set[str] = set()


def _strict(strict: bool | None) -> bool:
    if strict is not None:
        return _checks.check_flag("strict", strict)
    return os.environ.get("CUTEATTN_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _select_kernel(spec: AttentionSpec, device: torch.device):
    """(launch, None) when a GPU kernel serves spec on device, else (None, reason); launch is
    what the serving kernel family made for spec (for the sm90 forward a kernels.sm90.launch.Launch:
    the compiled kernel, compiled now if this is its first use).

    dispatch is imported lazily so the CPU path never needs the DSL or the kernels.
    """
    if device.type != "cuda":
        return None, f"no kernel for {device.type} tensors"
    try:
        from cuteattn import dispatch
    except ImportError as e:
        return None, f"no kernel: cuteattn.dispatch could not be imported ({type(e).__name__}: {e})"
    reason = dispatch.can_implement(spec, device)
    return (dispatch.launch(spec, device), None) if reason is None else (None, reason)


def _fall_back(reason: str, strict: bool | None) -> None:
    """Raise in strict mode, else warn once per distinct reason."""
    if _strict(strict):
        raise RuntimeError(
            f"cuteattn: no GPU kernel for this call ({reason}); strict mode (strict=True or "
            "CUTEATTN_STRICT=1) forbids the PyTorch reference fallback"
        )
    if torch.compiler.is_compiling():
        return  # code being traced cannot warn; eager calls (and strict mode) still say it
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        warnings.warn(
            f"cuteattn: {reason}; computing with the PyTorch reference instead (slow: float32, "
            "scores materialised). Pass strict=True or set CUTEATTN_STRICT=1 to raise instead.",
            FallbackWarning,
            stacklevel=_user_stacklevel(),
        )


_INTERNAL_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(torch.__file__))


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside cuteattn and torch, so a warning names the
    user's line whichever path (direct, custom op, autograd, torch.compile) led to it."""
    frame, level = sys._getframe(2), 2  # the frame that calls warnings.warn is level 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _reference_kwargs(spec: AttentionSpec, sink=None) -> dict:
    # the normalised spec, not the user's arguments: the fallback then exercises the normalisation
    return dict(
        softmax_scale=spec.softmax_scale,
        causal=spec.causal,
        window_size=(spec.window_left, spec.window_right),
        softcap=spec.softcap,
        learnable_sink=sink,
    )


def _is_empty(spec: AttentionSpec, out: torch.Tensor) -> bool:
    """True when there is nothing to launch: no rows, or no keys for any row (host ints only)."""
    return spec.batch == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0 or out.numel() == 0


def _run(q, k, v, spec, out, lse, strict, varlen: dict | None = None,
         varlen_host: dict | None = None, sink=None, descales=(None, None, None)):
    """Fill (out, lse): empty shortcut, kernel, or reference fallback. Returns (out, lse,
    launch), launch being the kernel that ran (None for the empty shortcut or the fallback).

    varlen: the index tensors passed to the kernel; varlen_host: their host copies when
    validate=True already read and checked them (else the fallback reads and checks them here).
    sink: the learnable sink (the families that take spec.has_sink get it as learnable_sink);
    descales: fp8 inputs' (q, k, v) descales (the sm90 fp8 forward takes them)."""
    if _is_empty(spec, out):
        launch, reason = None, None
        if varlen is not None and varlen_host is None and not q.is_cuda:
            # (on the host the lengths cost nothing to read: an empty problem claimed by
            # max_seqlen = 0 or no sequences is held to the metadata's rules too)
            _varlen_host_values(q, k, spec, varlen)
    else:
        launch, reason = _select_kernel(spec, q.device)
        if reason is not None:
            _fall_back(reason, strict)  # decided here, before any work, so strict raises early
            if varlen is not None and varlen_host is None:
                # the reference reads the lengths to the host anyway: hold them to validate=True's
                # rules (ValueError) rather than compute a silently wrong answer from bad metadata
                varlen_host = _varlen_host_values(q, k, spec, varlen)

    def run():
        if launch is not None:
            launch(q, k, v, out, lse, **(varlen or {}), **_extra_kwargs(q, sink, descales))
        elif reason is None:  # empty: every query row (if any) sees no key
            out.zero_()
            if sink is None:
                lse.fill_(float("-inf"))
            else:  # only the sink's logit in each row's denominator
                heads = 0 if spec.varlen_q else 1
                lse.copy_(sink.view([-1 if i == heads else 1 for i in range(lse.dim())]).expand_as(lse))
        else:
            fp8 = q.dtype == _checks.FP8
            if varlen is None:
                inputs = (q, k, v)
                if fp8:
                    inputs = [dequantize_fp8(x, d) for x, d in zip(inputs, descales)]
                o, l = attention_ref(*inputs, **_reference_kwargs(spec, sink))
            else:
                packed = [_checks.batched_as_packed(x, varlen[cu]) for x, cu in
                          ((q, "cu_seqlens_q"), (k, "cu_seqlens_k"), (v, "cu_seqlens_k"))]
                if fp8:
                    packed = [(dequantize_fp8(x, d, cu), cu) for (x, cu), d in zip(packed, descales)]
                o, l = attention_varlen_ref(*(x for x, _ in packed), **varlen_host,
                                            **_reference_kwargs(spec, sink))
                if not spec.varlen_q:  # batched q: lse (h, b * sq) -> (b, h, sq)
                    l = l.view(spec.nheads, q.shape[0], q.shape[1]).permute(1, 0, 2)
            out.copy_(o.view(out.shape))
            lse.copy_(l)
        return out, lse

    return (*run(), launch)


def _extra_kwargs(q, sink, descales) -> dict:
    """A launch's keywords for a call's learnable sink and fp8 descales."""
    extra = {"descales": descales} if q.dtype == _checks.FP8 else {}
    if sink is not None:
        extra["learnable_sink"] = sink
    return extra


def _tensor_signature(t):
    """A tensor argument as the shortcut's signature holds it (what the checks read of it)."""
    # (isinstance: a learnable sink is often an nn.Parameter)
    return (t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t), t)


def _varlen_host_values(q, k, spec, varlen) -> dict:
    """check_varlen_values on the metadata (a sync), a batched side (no cu_seqlens) seen as its
    packed rows: returns the host copies, cu_seqlens included for every side."""
    (qp, cu_q), (kp, cu_k) = (_checks.batched_as_packed(x, varlen[cu]) for x, cu in
                              ((q, "cu_seqlens_q"), (k, "cu_seqlens_k")))
    return _checks.check_varlen_values(cu_q, cu_k, qp.shape[0], kp.shape[0], spec.seqlen_q,
                                       spec.seqlen_k, varlen["seqused_q"], varlen["seqused_k"])


def _needs_grad(q, k, v) -> bool:
    # getattr: a non-tensor argument reaches the checks, which name it
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))


# Repeated calls with one signature (shapes, strides, dtypes and devices of q, k, v, and the
# other arguments) skip the checks, the spec and the kernel choice: they read nothing else, and
# were done on the first such call. That is most of the host time of a call (tens of
# microseconds), which at 1k tokens is as long as the kernel. Tensor extras (a learnable sink,
# fp8 descales) are in the signature by shape, stride, dtype and device, which is all the checks
# read of them. Only calls a kernel served are kept: errors, fallbacks, empty problems and
# preallocated outputs always take the full path, as do calls that record a gradient with a
# sink (the others keep their launch too: ops._Kept).
_launches: dict = {}
_LAUNCHES_MAX = 1024


def _signature(q, k, v, *args):
    """A hashable summary of everything the checks read, with each argument's type (so that
    True does not pass for 1), or None when the call does not qualify for the shortcut."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    # the kernel path variable (dispatch.PATH_ENV) too: a call after it changed chooses anew
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, tuple(map(type, args)), args,
            os.environ.get("CUTEATTN_PATH"))


def _remember(sig, spec, launch) -> None:
    if sig is None or launch is None:
        return
    if len(_launches) >= _LAUNCHES_MAX:
        _launches.clear()
    _launches[sig] = (spec, launch)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    return_lse=False,
    strict=None,
    *,
    out=None,
    lse=None,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    block_sparse=None,
    mask_mod=None,
    score_mod=None,
):
    """Attention of q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d),
    v (batch, seqlen_k, nheads_k, d), fp16 or bf16, with FlashAttention's semantics.

    causal / window_size=(left, right) masks are bottom-right aligned (-1 or None = unbounded
    side; FlashAttention-4's negative edges: values below -1, or -1 beside a None side, keep only
    keys that far past the diagonal; causal=True means right = 0); softcap > 0 maps scores s to
    softcap * tanh(s / softcap);
    softmax_scale defaults to 1/sqrt(d); nheads must be a multiple of nheads_k (GQA/MQA).

    Returns out (batch, seqlen_q, nheads, d), or (out, lse) with return_lse, lse float32
    (batch, nheads, seqlen_q), natural log; rows that see no key get out 0 and lse -inf.
    return_attn_probs=True returns FlashAttention-2's triple (out, lse, None): without dropout
    its third member, the probabilities' dropout pattern, is None there too.

    Checked on every call without a device sync: types, dtypes, devices, ranks, shapes, head dims
    (q/k and v) multiples of 8 up to 256 (kernels: 64, 96, 128, 192, 256 with v's equal to q's;
    others run on the reference), nheads % nheads_k, unit stride in head_dim (no hidden copy),
    a window that leaves keys (left + right >= 0 when both are bounded) with int32 edges,
    softcap >= 0, softmax_scale finite > 0, causal / deterministic / return_lse / strict bools
    (or 0 / 1).
    alibi_slopes: FlashAttention-2's, float32 (nheads,) or (batch, nheads): a bias of
    -slope * |i + seqlen_k - seqlen_q - j| on the (scaled, softcapped) score of query i and key
    j, no gradient for the slopes; it runs as a score_mod (below), so on Hopper's kernels and
    elsewhere on the reference, and cannot be combined with a score_mod of the call's own.
    Not supported (NotImplementedError): dropout_p > 0.
    Keyword-only extras: learnable_sink (nheads,) float32, one logit per query head joining each
    row's softmax denominator (gpt-oss); q_descale / k_descale / v_descale, FlashAttention-3's
    (batch, nheads_k) float32 descales of float8_e4m3fn q, k, v (out then bf16, or an out= in
    fp16/bf16; inference only, torch.compile included). block_sparse
    (cuteattn.sparse.BlockSparseMask), mask_mod(b, h, q_idx, kv_idx) and score_mod(score, b, h,
    q_idx, kv_idx): FlexAttention's modifiers (FlashAttention-4's block-sparse form),
    differentiable, including through tensors a score_mod closes over.
    fp8 inputs and the modifiers run on sm90 kernels (the README's table says which forms);
    a learnable sink too (forward and backward; not yet with block-sparse lists, mods, fp8 or
    pages, which take the reference).

    Gradients (q, k or v requiring grad) flow through torch autograd: the backward kernel where
    one serves the problem (sm_90a, head_dims up to 256), else the float32 reference backward
    (a FallbackWarning says so once; strict mode raises); out= / lse= cannot be combined with
    them. deterministic=True makes the backward bitwise reproducible (the forward always is).

    Without a GPU kernel for the problem (CPU tensors, an unsupported GPU or feature) the PyTorch
    reference computes the result and a FallbackWarning names the reason once; strict=True (or
    CUTEATTN_STRICT=1 when strict is None) raises RuntimeError instead.

    out / lse (keyword-only, optional): preallocated buffers of the returned shapes, written in place
    and returned. The GPU tests pass NaN-filled ones so that any element a kernel fails to write fails.
    A seqlen_q or batch of 0 returns empty results; seqlen_k 0 returns out 0 and lse -inf; neither
    launches a kernel.
    """
    _checks.check_unsupported(dropout_p)
    if _checks.check_flag("return_attn_probs", return_attn_probs):
        # FlashAttention-2's triple (out, softmax_lse, S_dmask): S_dmask is None without dropout
        out, lse = flash_attn_func(
            q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, False, True, strict, out=out, lse=lse, learnable_sink=learnable_sink,
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            block_sparse=block_sparse, mask_mod=mask_mod, score_mod=score_mod)
        return out, lse, None
    _checks.check_flags(deterministic=deterministic, return_lse=return_lse, strict=strict)
    if alibi_slopes is not None:  # (FlashAttention-2's bias, as a score_mod: cuteattn/alibi.py)
        spec = _checks.fixed_spec(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap)
        score_mod = _alibi_mod(q, k, alibi_slopes, score_mod, spec)
    if block_sparse is not None or mask_mod is not None or score_mod is not None:
        sig = None
        if (mask_mod is None and score_mod is None and out is None and lse is None
                and learnable_sink is None and type(window_size) is tuple
                and not torch.compiler.is_compiling()):
            sig = _sparse_signature(q, k, v, block_sparse, softmax_scale, causal, window_size,
                                    softcap)
            hit = _launches.get(sig) if sig is not None else None
            if hit is not None and not _needs_grad(q, k, v) and not torch.compiler.is_compiling():
                out, lse = _launch_sparse(q, k, v, *hit, block_sparse)
                return (out, lse) if return_lse else out
        if (torch.compiler.is_compiling() and mask_mod is None and score_mod is None
                and out is None and lse is None and learnable_sink is None
                and getattr(q, "dtype", None) != _checks.FP8):
            # an opaque op with autograd (ops.py): the kernels run inside the compiled graph
            from cuteattn import ops
            out, lse = ops.attention_sparse(q, k, v, block_sparse, softmax_scale, causal,
                                            window_size, softcap, deterministic, strict)
            return (out, lse) if return_lse else out
        out, lse = _modded(q, k, v, softmax_scale, causal, window_size, softcap, strict,
                           learnable_sink, block_sparse, mask_mod, score_mod, out=out, lse=lse,
                           sparse_sig=sig, deterministic=deterministic,
                           descales=(q_descale, k_descale, v_descale))
        return (out, lse) if return_lse else out
    descales = (q_descale, k_descale, v_descale)
    grad = _through_op(q, k, v, out, lse, learnable_sink)
    if grad and torch.compiler.is_compiling():
        from cuteattn import ops
        out, lse = ops.attention(q, k, v, softmax_scale, causal, window_size, softcap,
                                 deterministic, strict, learnable_sink, descales)
        return (out, lse) if return_lse else out
    sig = hit = None
    # a learnable sink and fp8 descales are kept by their tensors' shapes (gradient calls take
    # neither here: ops.attention's full path has their rules)
    extras = (learnable_sink, *descales)
    plain = out is None and lse is None and not (grad and any(x is not None for x in extras))
    if plain and type(window_size) is tuple:
        try:
            sig = _signature(q, k, v, softmax_scale, causal, window_size, *map(type, window_size),
                             softcap, tuple(map(_tensor_signature, extras)))
            hit = _launches.get(sig) if sig is not None else None
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            sig = hit = None
        if hit is None and grad and sig is not None:
            hit = _keep_for_grad(sig, lambda: _checks.fixed_spec(
                q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap), q.device)
        if hit is not None:
            spec, launch = hit
            if grad:
                from cuteattn import ops
                out, lse = ops.attention_kept(q, k, v, spec, launch, deterministic, strict)
                return (out, lse) if return_lse else out
            out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=_checks.out_dtype(q), device=q.device)
            lse = torch.empty((spec.batch, spec.nheads, spec.seqlen_q), dtype=torch.float32,
                              device=q.device)
            launch(q, k, v, out, lse, **_extra_kwargs(q, learnable_sink, descales))
            return (out, lse) if return_lse else out
    if grad:
        from cuteattn import ops
        out, lse = ops.attention(q, k, v, softmax_scale, causal, window_size, softcap,
                                 deterministic, strict, learnable_sink, descales)
        return (out, lse) if return_lse else out
    out, lse, spec, launch = forward(q, k, v, softmax_scale, causal, window_size, softcap, strict,
                                     out, lse, learnable_sink, descales)
    _remember(sig, spec, launch)
    return (out, lse) if return_lse else out


def _keep_for_grad(sig, make_spec, device):
    """(spec, launch) kept under sig for an eager call that records a gradient (as the
    shortcut keeps plain calls'): the checks (make_spec) and the kernel choice made once, or
    None where no kernel serves the call (ops.attention's full path then falls back, warns or
    raises)."""
    spec = make_spec()
    if spec.batch == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0:  # (_is_empty: no launch)
        return None
    launch, reason = _select_kernel(spec, device)
    if reason is not None:
        return None
    _remember(sig, spec, launch)
    return spec, launch


def _alibi_mod(q, k, alibi_slopes, score_mod, spec: AttentionSpec, varlen: dict | None = None):
    """FlashAttention-2's alibi_slopes as the call's score_mod (checked first)."""
    if score_mod is not None:
        raise ValueError("alibi_slopes cannot be combined with a score_mod: add the bias inside "
                         "the score_mod (cuteattn.alibi.score_mod builds it)")
    alibi.check(alibi_slopes, q, spec.batch, spec.nheads)
    return alibi.score_mod(alibi_slopes, alibi.key_offsets(q, k, **(varlen or {})))


def _modded(q, k, v, softmax_scale, causal, window_size, softcap, strict, sink, block_sparse,
            mask_mod, score_mod, varlen: dict | None = None, out=None, lse=None, sparse_sig=None,
            deterministic=False, validate=False, descales=(None, None, None)):
    """flash_attn_func / flash_attn_varlen_func (varlen: its metadata, max lengths included)
    with FlexAttention's modifiers: checked, then the block-sparse kernel where one serves the
    call (_sparse_kernel), else the reference, differentiated by torch autograd itself (a
    score_mod's own tensors get gradients too); the fallback warning or the strict error as
    usual. out / lse: preallocated buffers, written in place (not under autograd, whose
    results are new tensors). fp8 inputs (their descales) run on the reference, dequantized,
    their output bf16 (or out's fp16). sparse_sig: the call's _sparse_signature, under which a
    block-sparse launch is kept for the next such call. deterministic: the backward's
    (a block-sparse backward kernel that cannot promise it is not taken). validate (packed
    sequences): their metadata's values checked first (a sync), as flash_attn_varlen_func's."""
    from cuteattn import sparse
    if varlen is None:
        spec = _checks.fixed_spec(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap)
    else:
        spec = _checks.varlen_spec(q, k, v, **varlen, softmax_scale=softmax_scale,
                                   causal=causal, window_size=window_size, softcap=softcap)
    spec = dataclasses.replace(_checks.with_sink(spec, sink, q), deterministic=bool(deterministic))
    _checks.check_descales(q, k, spec.batch, descales)
    if varlen is not None and validate:
        _varlen_host_values(q, k, spec, _index_tensors(varlen))
    for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if mod is not None and not callable(mod):
            raise TypeError(f"{name} must be callable; got {type(mod)}")
    if block_sparse is not None:
        sparse.check(block_sparse, spec.batch, spec.nheads, spec.seqlen_q, spec.seqlen_k, q.device)
    if out is not None or lse is not None:
        if _needs_grad(q, k, v):
            raise ValueError("out= / lse= buffers take no gradient: call without them to differentiate")
        lse_shape = ((spec.batch, spec.nheads, spec.seqlen_q) if varlen is None
                     else _varlen_lse_shape(q, spec))
        out, lse = _checks.output_buffers(q, out, lse, out_shape=(*q.shape[:-1], v.shape[-1]),
                                          lse_shape=lse_shape)
    fp8 = q.dtype == _checks.FP8
    if fp8:  # (no fp8 kernel takes lists or mods)
        served, reason = None, "fp8 inputs with block-sparse lists or mods: no kernel yet"
    elif mask_mod is None and score_mod is None:
        served, reason = _sparse_kernel(q, k, v, spec, block_sparse, varlen, sink, out, lse,
                                        sparse_sig)
    else:
        served, reason = _mods_kernel(q, k, v, spec, mask_mod, score_mod, block_sparse, varlen,
                                      sink, out, lse)
    if served is not None:
        return served
    if block_sparse is not None and not torch.compiler.is_compiling():
        sparse.check_values(block_sparse)
    _fall_back(reason, strict)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, block_sparse=block_sparse)
    if varlen is None:
        inputs = (q, k, v)
        if fp8:
            inputs = [dequantize_fp8(x, d) for x, d in zip(inputs, descales)]
        o, l = attention_ref(*inputs, **_reference_kwargs(spec, sink), **mods)
    else:
        meta = _index_tensors(varlen)
        host = _varlen_host_values(q, k, spec, meta)
        packed = [_checks.batched_as_packed(x, meta[cu]) for x, cu in
                  ((q, "cu_seqlens_q"), (k, "cu_seqlens_k"), (v, "cu_seqlens_k"))]
        inputs = [x for x, _ in packed]
        if fp8:
            inputs = [dequantize_fp8(x, d, cu) for (x, cu), d in zip(packed, descales)]
        o, l = attention_varlen_ref(*inputs, **host, **_reference_kwargs(spec, sink), **mods)
        o = o.view(*q.shape[:-1], v.shape[-1])
        if not spec.varlen_q:  # batched q: lse (h, b * sq) -> (b, h, sq)
            l = l.view(spec.nheads, q.shape[0], q.shape[1]).permute(1, 0, 2)
    if out is None:
        return o.to(_checks.out_dtype(q)), l
    out.copy_(o)
    lse.copy_(l)
    return out, lse


def _index_tensors(varlen: dict | None) -> dict:
    """The packed sequences' index tensors of a call's varlen metadata, as launches take them
    (none for fixed lengths)."""
    if varlen is None:
        return {}
    return {n: varlen[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")}


def _new_outputs(q, v, spec: AttentionSpec, varlen: dict | None) -> tuple:
    """Fresh (out, lse) for a modded or block-sparse call: out in q's layout with v's head dim,
    lse (batch, heads, seqlen_q) or, for packed q, (heads, total_q)."""
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse_shape = ((spec.batch, spec.nheads, spec.seqlen_q) if varlen is None
                 else _varlen_lse_shape(q, spec))
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _sparse_spec(spec: AttentionSpec, mask) -> tuple:
    """(the spec of the block-sparse kernel for mask, the lists at the block shape it takes):
    a logical mask coarser than every kernel block (VSA's 256x256) is expanded on the GPU to the
    largest one that divides it (sparse.expand: the same token pairs)."""
    from cuteattn import sparse
    block = sparse.kernel_block(mask.q_block, mask.kv_block)
    if block != (mask.q_block, mask.kv_block):
        mask = sparse.expand(mask, *block)
    return dataclasses.replace(spec, sparse_q_block=mask.q_block, sparse_kv_block=mask.kv_block), mask


def _sparse_reason(q, sink):
    """Why no block-sparse kernel serves this call whatever the GPU (None: one may)."""
    if q.device.type != "cuda":
        return f"no kernel for {q.device.type} tensors"
    if sink is not None:
        return "no kernel with a learnable sink yet"
    if torch.compiler.is_compiling():
        return "no kernel under torch.compile yet"
    return None


def _sparse_signature(q, k, v, mask, *args):
    """_signature of a block-sparse call: the lists' block shape, and their tensors' shapes,
    strides, dtypes and devices (what sparse.check reads); None when it does not qualify."""
    try:
        lists = tuple((t.shape, t.stride(), t.dtype, t.device) for t in
                      (mask.full_count, mask.full_index, mask.partial_count, mask.partial_index))
        sig = _signature(q, k, v, *args, *map(type, args[2]), "sparse", mask.q_block,
                         mask.kv_block, lists)
        hash(sig)
    except (AttributeError, TypeError):  # not a BlockSparseMask: the checks say so
        return None
    return sig


def _launch_sparse(q, k, v, spec, launch, mask, out=None, lse=None, varlen=None):
    """The block-sparse kernel on mask's lists (in launch's block shape; with packed
    sequences, varlen's metadata, the lists' batch mode the sequence)."""
    if out is None:
        out, lse = _new_outputs(q, v, spec, varlen)
    launch(q, k, v, out, lse, **_index_tensors(varlen), sparse=_kernel_lists(mask))
    return out, lse


def _kernel_lists(mask) -> tuple:
    """A mask's four list tensors as the kernels take them (a mode of extent 1 broadcasts in the
    kernel; an expanded view's zero strides do not pass every call path, so such a view is
    copied)."""
    return tuple(t if t.stride(-1) == 1 and 0 not in t.stride() else t.contiguous() for t in
                 (mask.full_count, mask.full_index, mask.partial_count, mask.partial_index))


def _transposed_lists(mask, paired: bool) -> tuple:
    """(the backward's four list tensors, the halves' table or None): sparse.transpose
    (paired: transpose_paired) of mask, on a GPU in one launch (kernels/common/list_transpose.py;
    the PyTorch form's few dozen operations cost more host time than a small backward's
    kernel), elsewhere the PyTorch form (host-side tests with stand-in kernels)."""
    from cuteattn import sparse
    if mask.full_index.is_cuda:
        from cuteattn.kernels.launch_common import transpose_lists
        return transpose_lists(_kernel_lists(mask), paired)
    if paired:
        pairs, halves = sparse.transpose_paired(mask)
        return _kernel_lists(pairs), halves
    return _kernel_lists(sparse.transpose(mask)), None


class _BlockSparse(torch.autograd.Function):
    """Block-sparse attention on the kernels, forward and backward. The backward's key blocks
    walk the transposed lists (sparse.transpose, built in one launch when the backward runs,
    kernels/common/list_transpose.py; for lists of 64-key blocks the pairs' lists and which
    half attends what, sparse.transpose_paired; with deterministic=True the order of the dQ
    additions, sparse.dq_turns)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, forward_launch, backward_launch, mask, varlen=None):
        out, lse = _launch_sparse(q, k, v, spec, forward_launch, mask, varlen=varlen)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_launch, ctx.mask, ctx.deterministic = backward_launch, mask, spec.deterministic
        ctx.index = _index_tensors(varlen)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _sparse_backward(ctx.backward_launch, ctx.mask, ctx.deterministic, dout,
                                      q, k, v, out, lse, ctx.index)
        return dq, dk, dv, None, None, None, None, None


def _sparse_backward(launch, mask, deterministic, dout, q, k, v, out, lse, index=None) -> tuple:
    """(dq, dk, dv) from the block-sparse backward kernel on mask's lists (in its block shape;
    index: packed sequences' index tensors, the lists' batch mode the sequence)."""
    from cuteattn import sparse
    lists, halves = _transposed_lists(mask, paired=mask.kv_block < sparse.BACKWARD_KEY_BLOCK)
    # deterministic=True: each key block's turn to add into a query block's dQ
    turns = sparse.dq_turns(mask) if deterministic else None
    return launch(dout.contiguous(), q, k, v, out, lse, **(index or {}),
                  sparse=(*lists, halves, turns))


def forward_sparse(q, k, v, mask, softmax_scale, causal, window_size, softcap, strict):
    """flash_attn_func with block-sparse lists, without autograd (ops.py's custom op runs this
    under torch.compile): the kernel, or the reference with the usual warning. (out, lse)."""
    with torch.no_grad():
        return _modded(q, k, v, softmax_scale, causal, window_size, softcap, strict, None, mask,
                       None, None)


def backward_sparse(dout, q, k, v, out, lse, mask, softmax_scale, causal, window_size, softcap,
                    deterministic, strict) -> tuple:
    """Gradients (dq, dk, dv) of forward_sparse's (out, lse): the block-sparse backward kernel,
    or the reference's written-out backward with the usual warning (strict mode raises)."""
    spec = _checks.fixed_spec(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap)
    spec = dataclasses.replace(spec, deterministic=bool(deterministic), kind="bwd")
    if _is_empty(spec, out):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    reason = _sparse_reason(q, None)
    if reason is None:
        kspec, physical = _sparse_spec(spec, mask)
        launch, reason = _cached_launch(kspec, q.device)
        if launch is not None:
            return _sparse_backward(launch, physical, spec.deterministic, dout, q, k, v, out, lse)
    _fall_back(f"block-sparse attention: backward: {reason}", strict)
    grads = attention_ref_backward(dout, q, k, v, **_reference_kwargs(spec), block_sparse=mask)
    return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def _cached_launch(spec, device):
    """(launch, None) of the family serving spec, kept per spec (which holds every static
    choice) and kernel path variable; else (None, reason). For the calls that skip the eager
    shortcut: block-sparse ones, and backwards (whose selection and launch setup cost about
    as much host time as a 1k-token kernel)."""
    sig = ("spec", spec, device, os.environ.get("CUTEATTN_PATH"))
    hit = _launches.get(sig)
    if hit is not None:
        return hit[1], None
    launch, reason = _select_kernel(spec, device)
    _remember(sig, spec, launch)
    return launch, reason


def _sparse_kernel(q, k, v, spec, mask, varlen, sink, out=None, lse=None, sig=None):
    """((out, lse), None) from the block-sparse kernel, or (None, the reason none serves the
    call). Its lists' values are not read on the host (no sync): the kernel keeps every load
    inside k/v whatever they hold (kernels/common/block_sparse.py); the reference path checks
    them."""
    reason = _sparse_reason(q, sink)
    if reason is not None:
        return None, "block-sparse attention: " + reason
    if (spec.batch == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0 or q.numel() == 0
            or k.numel() == 0):
        return None, "block-sparse attention: an empty problem (the reference's results)"
    kspec, physical = _sparse_spec(spec, mask)
    launch, reason = _cached_launch(kspec, q.device)
    if launch is None:
        return None, "block-sparse attention: " + reason
    if _needs_grad(q, k, v):
        backward, reason = _cached_launch(dataclasses.replace(kspec, kind="bwd"), q.device)
        if backward is None:
            return None, "block-sparse attention: backward: " + reason
        return _BlockSparse.apply(q, k, v, kspec, launch, backward, physical, varlen), None
    if varlen is not None:  # packed sequences: the lists per sequence
        return _launch_sparse(q, k, v, spec, launch, physical, varlen=varlen), None
    if physical is mask:  # (an expanded mask is expanded again on every call: not kept)
        _remember(sig, kspec, launch)
    return _launch_sparse(q, k, v, kspec, launch, physical, out, lse), None


# mask_mod keys whose function the kernel could not trace, with the reason (not retried)
_untraceable: dict = {}


def _mods_kernel(q, k, v, spec, mask_mod, score_mod, mask, varlen, sink, out=None, lse=None):
    """((out, lse), None) from the forward kernel with the mask_mod and / or score_mod traced
    into it (the mask_mod on every block, or with block-sparse lists on their partial blocks;
    the score_mod on every score), or (None, the reason none serves the call). A call that
    records a gradient runs the backward kernel with the mods traced in too (_Modded; the
    score_mod with its derivative); one whose mod tensors need a gradient, the reference."""
    from .kernels.launch_common import UnsupportedMod, mod_key, mod_tensors_of
    # (packed sequences: b is the sequence's index, q_idx / kv_idx positions within it)
    reason = _sparse_reason(q, sink)
    if reason is None and (spec.batch == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0):
        reason = "an empty problem (the reference's results)"
    if reason is not None:
        return None, "mask_mod / score_mod: " + reason
    keys = {}
    for kind, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is None:
            continue
        try:
            keys[kind] = mod_key(fn, kind)
        except UnsupportedMod as e:
            return None, f"{kind}: {e}"
        if keys[kind] in _untraceable:
            return None, _untraceable[keys[kind]]
        object.__setattr__(keys[kind], "fn", fn)  # (not a field: the key compares without it)
    kspec, physical = dataclasses.replace(spec, **keys), None
    if mask is not None:
        kspec, physical = _sparse_spec(kspec, mask)
    try:
        launch, reason = _cached_launch(kspec, q.device)
    except Exception as e:  # the DSL could not trace it (a torch call, an unsupported operator)
        first_line = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        why = (f"{' and '.join(keys)} could not be traced into the kernel "
               f"({type(e).__name__}: {first_line})")
        for key in keys.values():
            _untraceable[key] = why
        return None, why
    if launch is None:
        return None, "mask_mod / score_mod: " + reason
    tensors = [None] * 4  # (the kernel's ModTensors: a mask_mod's two, a score_mod's two)
    for slot, kind, fn in ((0, "mask_mod", mask_mod), (2, "score_mod", score_mod)):
        if fn is not None:
            found = mod_tensors_of(fn, keys[kind])
            tensors[slot:slot + len(found)] = found
    if _needs_grad(q, k, v) or any(getattr(t, "requires_grad", False) for t in tensors):
        if any(getattr(t, "requires_grad", False) for t in tensors):
            return None, "a mod's tensor requires grad: its gradient runs on the reference"
        try:
            backward, reason = _cached_launch(dataclasses.replace(kspec, kind="bwd"), q.device)
        except Exception as e:  # (the backward traces the mods too)
            return None, f"mask_mod / score_mod could not be traced into the backward ({type(e).__name__})"
        if backward is None:
            return None, "mask_mod / score_mod: backward: " + reason
        return _Modded.apply(q, k, v, kspec, launch, backward, physical, tensors, varlen), None
    if out is None:
        out, lse = _new_outputs(q, v, spec, varlen)
    lists = {"sparse": _kernel_lists(physical)} if physical is not None else {}
    launch(q, k, v, out, lse, **_index_tensors(varlen), **lists, mod_tensors=tensors)
    return (out, lse), None


class _Modded(torch.autograd.Function):
    """Attention with traced mods on the kernels, forward and backward (dense, or on
    block-sparse lists as _BlockSparse walks them); a score_mod's gradient by the score is the
    backward kernel's, traced with a Dual score (the mods' own tensors need none: _mods_kernel
    sends those that do to the reference)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, forward_launch, backward_launch, mask, mod_tensors,
                varlen=None):
        out, lse = _new_outputs(q, v, spec, varlen)
        lists = {"sparse": _kernel_lists(mask)} if mask is not None else {}
        ctx.index = _index_tensors(varlen)
        forward_launch(q, k, v, out, lse, **ctx.index, **lists, mod_tensors=mod_tensors)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_launch, ctx.mask, ctx.deterministic = backward_launch, mask, spec.deterministic
        ctx.mod_tensors = mod_tensors
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from cuteattn import sparse
        q, k, v, out, lse = ctx.saved_tensors
        lists = ()
        if ctx.mask is not None:
            turns = sparse.dq_turns(ctx.mask) if ctx.deterministic else None
            lists = (*_transposed_lists(ctx.mask, paired=False)[0], None, turns)
        dq, dk, dv = ctx.backward_launch(dout.contiguous(), q, k, v, out, lse, **ctx.index,
                                         sparse=lists, mod_tensors=ctx.mod_tensors)
        return dq, dk, dv, None, None, None, None, None, None


def _through_op(q, k, v, out, lse, sink=None) -> bool:
    """Calls that record a gradient, and calls traced by torch.compile, go through the
    torch.library custom ops (ops.py: fake shapes, autograd); plain eager calls skip the op
    dispatcher's host time. out= / lse= buffers are an eager, inference-only extra."""
    needs_grad = _needs_grad(q, k, v) or (torch.is_grad_enabled()
                                          and getattr(sink, "requires_grad", False))
    if not (torch.compiler.is_compiling() or needs_grad):
        return False
    if needs_grad and getattr(q, "dtype", None) == _checks.FP8:
        raise NotImplementedError("float8_e4m3fn inputs have no gradients (inference only)")
    if out is not None or lse is not None:
        raise ValueError(
            "out= / lse= buffers are for calls without gradients outside torch.compile: drop them "
            "when q, k or v require grad (or wrap the call in torch.no_grad())")
    return True


def forward(q, k, v, softmax_scale, causal, window_size, softcap, strict, out=None, lse=None,
            learnable_sink=None, descales=(None, None, None)):
    """The fixed-length forward without autograd: checks, spec, kernel or fallback. Returns
    (out, lse, spec, launch); ops.py's custom op runs this."""
    spec = _checks.fixed_spec(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap
    )
    spec = _checks.with_sink(spec, learnable_sink, q)
    _checks.check_descales(q, k, spec.batch, descales)
    out, lse = _checks.output_buffers(
        q, out, lse,
        out_shape=(*q.shape[:3], v.shape[-1]),
        lse_shape=(spec.batch, spec.nheads, spec.seqlen_q),
    )
    out, lse, launch = _run(q, k, v, spec, out, lse, strict, sink=learnable_sink,
                            descales=descales)
    return out, lse, spec, launch


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    seqused_q=None,
    seqused_k=None,
    return_lse=False,
    validate=False,
    strict=None,
    *,
    out=None,
    lse=None,
    learnable_sink=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    block_table=None,
    block_sparse=None,
    mask_mod=None,
    score_mod=None,
):
    """Attention over packed sequences: q (total_q, nheads, d), k/v (total_k, nheads_k, d).

    Sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1]
    of k/v (int32, length batch + 1); seqused_q / seqused_k (int32, length batch), when given, limit
    sequence b to its first seqused[b] rows (the masks align to those lengths). max_seqlen_q/k are
    Python ints bounding the lengths. Mask, scale, softcap and GQA semantics as in flash_attn_func.

    Returns out (total_q, nheads, d), or (out, lse) with return_lse, lse float32 (nheads, total_q);
    return_attn_probs=True: (out, lse, None), as FlashAttention-2 returns them without dropout.
    Rows outside every sequence or beyond seqused_q are left undefined by the kernel (the reference
    fallback writes out 0, lse -inf there).

    Checked on every call without a device sync: everything flash_attn_func checks, plus
    cu_seqlens_q/k and seqused_q/k being int32 1-D tensors on q's device with lengths batch + 1 and
    batch, and max_seqlen_q/k being Python ints >= 0. A side given without its cu_seqlens is
    batched (batch, seqlen, nheads, head_dim), as FlashAttention-4 allows (one side packed, or
    batched q/k with seqused only); out and lse then follow q's layout ((batch, seqlen_q, nheads,
    d) and (batch, nheads, seqlen_q) for batched q). The kernels serve these forms as they serve
    packed ones.
    validate=True also reads the lengths (a device sync) and checks that each cu_seqlens starts at 0,
    never decreases and ends at the total row count, that seqused[b] lies in [0, length b], and that
    max_seqlen is at least every used length (ValueError naming the argument and the rule). The
    reference fallback reads the lengths anyway, so it always runs these checks. Without
    validate=True a GPU kernel trusts them: wrong metadata may give wrong values in out / lse, but
    no access outside q, k, v, out and lse.

    block_sparse / mask_mod / score_mod (keywords): as in flash_attn_func, b the sequence's index
    and q_idx / kv_idx positions within it; block lists per sequence (max_seqlen's blocks).
    block_table (keyword): FlashAttention's paged keys: k / v are (num_blocks, page_size,
    nheads_k, d) pages (page_size a multiple of 16), sequence b's keys at positions [0, length)
    of the pages block_table[b] (int32 (batch, max_pages)) lists, lengths from cu_seqlens_k;
    inference only.
    Fallback, strict, out / lse: as in flash_attn_func. A batch, total_q or max_seqlen of 0 writes
    out 0 and lse -inf without a launch.
    """
    _checks.check_unsupported(dropout_p)
    if _checks.check_flag("return_attn_probs", return_attn_probs):
        # FlashAttention-2's triple (out, softmax_lse, S_dmask): S_dmask is None without dropout
        out, lse = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, False,
            seqused_q, seqused_k, True, validate, strict, out=out, lse=lse,
            learnable_sink=learnable_sink, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, block_table=block_table, block_sparse=block_sparse,
            mask_mod=mask_mod, score_mod=score_mod)
        return out, lse, None
    _checks.check_flags(deterministic=deterministic, return_lse=return_lse, validate=validate,
                        strict=strict)
    if alibi_slopes is not None:  # (FlashAttention-2's bias, as a score_mod: cuteattn/alibi.py)
        if block_table is not None:
            raise NotImplementedError("alibi_slopes with block_table (paged keys) is not "
                                      "supported yet")
        spec = _checks.varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, seqused_q, seqused_k,
                                   softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap)
        score_mod = _alibi_mod(q, k, alibi_slopes, score_mod, spec, dict(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
            seqused_k=seqused_k))
    if block_sparse is not None or mask_mod is not None or score_mod is not None:
        varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                      seqused_k=seqused_k)
        out, lse = _modded(q, k, v, softmax_scale, causal, window_size, softcap, strict,
                           learnable_sink, block_sparse, mask_mod, score_mod, varlen, out=out,
                           lse=lse, deterministic=deterministic, validate=validate,
                           descales=(q_descale, k_descale, v_descale))
        return (out, lse) if return_lse else out
    if block_table is not None:  # paged keys (FlashAttention's paged prefill)
        from cuteattn.kvcache import paged_varlen
        if out is not None or lse is not None or any(x is not None for x in (q_descale, k_descale, v_descale)):
            raise ValueError("block_table cannot be combined with out= / lse= or fp8 descales")
        out, lse = paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                block_table, softmax_scale, causal, window_size, softcap,
                                seqused_q, seqused_k, learnable_sink, validate, strict)
        return (out, lse) if return_lse else out
    grad = _through_op(q, k, v, out, lse, learnable_sink)

    def through_op():
        from cuteattn import ops
        return ops.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_size, softcap, seqused_q, seqused_k, validate, deterministic, strict,
            learnable_sink, (q_descale, k_descale, v_descale))

    if grad and torch.compiler.is_compiling():
        out, lse = through_op()
        return (out, lse) if return_lse else out
    sig = hit = None
    descales = (q_descale, k_descale, v_descale)
    extras = (learnable_sink, *descales)
    plain = (out is None and lse is None and not validate
             and not (grad and any(x is not None for x in extras)))
    if plain and type(window_size) is tuple:
        # as flash_attn_func's shortcut; the index tensors by shape, stride, dtype and device
        # (their values are never checked without validate=True, so they cannot fail anew)
        index = tuple(map(_tensor_signature, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                              *extras)))
        try:
            sig = _signature(q, k, v, softmax_scale, causal, window_size,
                             *map(type, window_size), softcap, max_seqlen_q, max_seqlen_k,
                             type(max_seqlen_q), type(max_seqlen_k), index)
            hit = _launches.get(sig) if sig is not None else None
        except TypeError:  # an unhashable argument: the checks below say what is wrong with it
            sig = hit = None
        if hit is None and grad and sig is not None:
            hit = _keep_for_grad(sig, lambda: _checks.varlen_spec(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                seqused_k, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap), q.device)
        if hit is not None:
            spec, launch = hit
            index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         seqused_q=seqused_q, seqused_k=seqused_k)
            if grad:
                from cuteattn import ops
                out, lse = ops.attention_kept(q, k, v, spec, launch, deterministic, strict, index)
                return (out, lse) if return_lse else out
            out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=_checks.out_dtype(q), device=q.device)
            lse = torch.empty(_varlen_lse_shape(q, spec), dtype=torch.float32, device=q.device)
            launch(q, k, v, out, lse, **index, **_extra_kwargs(q, learnable_sink, descales))
            return (out, lse) if return_lse else out
    if grad:
        out, lse = through_op()
        return (out, lse) if return_lse else out
    out, lse, spec, launch = _forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        window_size, softcap, seqused_q, seqused_k, validate, strict, out, lse, learnable_sink,
        descales)
    _remember(sig, spec, launch)
    return (out, lse) if return_lse else out


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, seqused_q, seqused_k, validate,
                   strict, out=None, lse=None, learnable_sink=None, descales=(None, None, None)):
    """The varlen forward without autograd (ops.py's custom op runs this). Returns (out, lse)."""
    return _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size, softcap, seqused_q, seqused_k,
                           validate, strict, out, lse, learnable_sink, descales)[:2]


def _varlen_lse_shape(q, spec) -> tuple:
    """(nheads, total_q) for packed q, (batch, nheads, seqlen_q) for batched q."""
    return (spec.nheads, q.shape[0]) if spec.varlen_q else (q.shape[0], spec.nheads, q.shape[1])


def _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_size, softcap, seqused_q, seqused_k, validate,
                    strict, out=None, lse=None, learnable_sink=None, descales=(None, None, None)):
    """forward_varlen, also returning the spec and the launch that ran (None if none did)."""
    spec = _checks.varlen_spec(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
    )
    spec = _checks.with_sink(spec, learnable_sink, q)
    _checks.check_descales(q, k, spec.batch, descales)
    varlen = dict(
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k
    )
    host = None  # the index tensors read to the host (validate=True, or the fallback, reads them)
    if validate:
        host = _varlen_host_values(q, k, spec, varlen)
    out, lse = _checks.output_buffers(
        q, out, lse, out_shape=(*q.shape[:-1], v.shape[-1]), lse_shape=_varlen_lse_shape(q, spec))
    out, lse, launch = _run(q, k, v, spec, out, lse, strict, varlen, host, learnable_sink,
                            descales)
    return out, lse, spec, launch


# ---- gradients ----

@functools.lru_cache(maxsize=1024)
def _backward_spec(spec: AttentionSpec, deterministic: bool) -> AttentionSpec:
    """The backward's spec of a forward's (dataclasses.replace costs ~20 us a call: kept)."""
    return dataclasses.replace(spec, kind="bwd", deterministic=deterministic)


def backward_of(spec, dout, q, k, v, out, lse, deterministic, strict, varlen=None) -> tuple:
    """(dq, dk, dv) of a forward that ran on a kept launch of spec (ops._Kept): its spec is
    the forward's, so nothing is checked again."""
    return _run_backward(_backward_spec(spec, bool(deterministic)), dout, q, k, v, out, lse,
                         strict, varlen)[:3]


def _run_backward(spec, dout, q, k, v, out, lse, strict, varlen: dict | None = None, sink=None):
    """(dq, dk, dv, dsink) for spec (a backward's: _backward_spec): nothing to do for an empty
    problem, else the backward kernel, or the reference's backward with the usual warning
    (strict mode raises). dsink is None without a learnable sink."""
    if _is_empty(spec, out):
        zero_sink = None if sink is None else torch.zeros(sink.shape, dtype=torch.float32,
                                                          device=sink.device)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), zero_sink
    launch, reason = _cached_launch(spec, q.device)
    if reason is None:
        if sink is None:
            return (*launch(dout, q, k, v, out, lse, **(varlen or {})), None)
        return launch(dout, q, k, v, out, lse, **(varlen or {}), sink=sink)  # dsink its 4th
    _fall_back(f"backward: {reason}", strict)  # its own warning: the forward may have a kernel
    if varlen is None:
        grads = attention_ref_backward(dout, q, k, v, **_reference_kwargs(spec, sink))
    else:
        (qp, cu_q), (kp, cu_k), (vp, _), (dp, _) = (
            _checks.batched_as_packed(x, varlen[cu]) for x, cu in
            ((q, "cu_seqlens_q"), (k, "cu_seqlens_k"), (v, "cu_seqlens_k"), (dout, "cu_seqlens_q")))
        grads = attention_varlen_ref_backward(dp, qp, kp, vp, cu_q, cu_k, varlen["seqused_q"],
                                              varlen["seqused_k"], **_reference_kwargs(spec, sink))
    dsink = grads[3] if sink is not None else None
    return (*(g.view(x.shape) for g, x in zip(grads[:3], (q, k, v))), dsink)


def backward(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, deterministic,
             strict, learnable_sink=None):
    """Gradients (dq, dk, dv, dsink) of the fixed-length forward that returned (out, lse);
    ops.py's autograd formula runs this. deterministic: bitwise-reproducible gradients."""
    spec = _checks.fixed_spec(q, k, v, softmax_scale=softmax_scale, causal=causal,
                              window_size=window_size, softcap=softcap)
    spec = _backward_spec(_checks.with_sink(spec, learnable_sink, q), bool(deterministic))
    return _run_backward(spec, dout, q, k, v, out, lse, strict, sink=learnable_sink)


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                    deterministic, strict, learnable_sink=None):
    """Gradients (dq, dk, dv, dsink) of the varlen forward (the metadata was checked by it)."""
    spec = _checks.varlen_spec(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    spec = _backward_spec(_checks.with_sink(spec, learnable_sink, q), bool(deterministic))
    varlen = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                  seqused_k=seqused_k)
    return _run_backward(spec, dout, q, k, v, out, lse, strict, varlen, learnable_sink)
