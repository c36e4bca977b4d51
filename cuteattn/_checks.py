"""Argument validation and normalisation into an AttentionSpec.

Everything here reads only shapes, dtypes, devices, strides and Python scalars: no device sync, so it
is cheap enough for every call. The one exception is `check_varlen_values`, which reads cu_seqlens
and seqused to the host and runs only when the caller asks (validate=True) or when the call runs on
the reference fallback (which reads those values anyway).
Errors name the argument and the rule: TypeError for a wrong type or dtype, ValueError for a wrong
value or shape, NotImplementedError for a valid request cuteattn does not support yet.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from cuteattn.reference import window_bounds
from cuteattn.spec import AttentionSpec

HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 8, 256  # every head dim FlashAttention accepts
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)  # the ones a kernel serves (others: the reference)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn  # FlashAttention-3's fp8 inputs (with descales); out in bf16


def check_unsupported(dropout_p) -> None:
    """FlashAttention arguments we accept in the signature but do not implement."""
    if not isinstance(dropout_p, numbers.Real) or dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p!r}: dropout is not supported (only 0.0)")


# window edges and sequence positions cross into the kernels as int32
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = 3.4028234663852886e38


def check_flag(name: str, value) -> bool:
    """A boolean argument as a bool: True / False (numpy's too) or the ints 0 and 1, as
    FlashAttention's bindings take them; anything else (a string "False" is truthy) a TypeError."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy"
                                   and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool; got {value!r}")


def check_flags(**flags) -> None:
    """check_flag on each keyword (strict may also be None: CUTEATTN_STRICT decides)."""
    for name, value in flags.items():
        if not (name == "strict" and value is None):
            check_flag(name, value)


def normalize_mask(causal: bool, window_size) -> tuple:
    """FlashAttention's mask semantics -> (causal, local, window_left, window_right), each side an
    int bound or None (unbounded): reference.window_bounds' rules (-1 unbounded where neither
    side is None; None unbounded; negative values are edges past the diagonal). causal=True sets
    right = 0; a window of (unbounded, 0) is causal whether or not causal=True was passed; any
    other bound makes the mask local. Causal is returned as (None, 0), no mask as (None, None).
    Two bounded sides must leave keys to see: left + right >= 0.
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right); got {window_size!r}")
    for name, w in zip(("left", "right"), window_size):
        if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral)):
            raise TypeError(f"window_size {name} must be an int or None (unbounded); got {w!r}")
        if w is not None and not -INT32_MAX <= w <= INT32_MAX:
            raise ValueError(f"window_size {name} must fit int32 (|w| < 2**31; None is unbounded); "
                             f"got {w}")
    left, right = (None if w is None else int(w) for w in window_bounds(tuple(window_size)))
    if check_flag("causal", causal):
        right = 0
    if left is not None and right is not None and left + right < 0:
        raise ValueError(f"window_size ({left}, {right}) leaves no key to any query: left + right "
                         "must be >= 0")
    causal = left is None and right == 0
    local = not causal and (left is not None or right is not None)
    return causal, local, left, right


def check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    """-> (softmax_scale, softcap) as floats; scale defaults to 1/sqrt(head_dim), softcap 0 = off."""
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a Python number or None; got {type(softmax_scale)}")
        scale = float(softmax_scale)
        # comparisons, not math.isfinite: they also work on torch.compile's symbolic floats
        # (the kernels take it, times log2(e), as float32)
        if not (0 < scale < FLOAT32_MAX / 2):  # False for NaN and inf
            raise ValueError(f"softmax_scale must be finite and > 0 (below float32's range / 2); "
                             f"got {softmax_scale}")
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a Python number; got {type(softcap)}")
    softcap = float(softcap)
    if not (0 <= softcap < math.inf):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off); got {softcap}")
    return scale, softcap


def check_qkv(q, k, v, rank: int, layout: str, rank_k: int | None = None,
              layout_k: str | None = None, kv_dtypes: tuple = ()) -> None:
    """Types, ranks, dtypes, devices, head dims, head counts and strides shared by the entry
    points. layout names the expected shapes for messages, e.g. "(batch, seqlen, nheads,
    head_dim)"; rank_k / layout_k: k's and v's, where they differ from q's; kv_dtypes: dtypes k
    and v may have besides q's (an fp8 KV cache; both the same)."""
    rank_k, layout_k = (rank if rank_k is None else rank_k), (layout if layout_k is None else layout_k)
    for name, t, r, lay in (("q", q, rank, layout), ("k", k, rank_k, layout_k), ("v", v, rank_k, layout_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t)}")
        if t.dim() != r:
            raise ValueError(f"{name} must be {r}-D {lay}; got shape {tuple(t.shape)}")
    if q.dtype == torch.float8_e5m2:
        raise TypeError("q dtype float8_e5m2 is not supported: fp8 inputs must be float8_e4m3fn")
    if q.dtype not in SUPPORTED_DTYPES + (FP8,):
        raise TypeError(f"q dtype must be float16, bfloat16 or float8_e4m3fn; got {q.dtype}")
    if k.dtype in kv_dtypes and v.dtype != k.dtype:
        raise TypeError(f"v dtype ({v.dtype}) must equal k's ({k.dtype})")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype and t.dtype not in kv_dtypes:
            raise TypeError(f"{name} dtype ({t.dtype}) must equal q's ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all tensors on one device")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"v's shape {tuple(v.shape)} must match k's {tuple(k.shape)} in all but the last dim"
        )
    d, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    if d_k != d:
        raise ValueError(f"k's head_dim ({d_k}) must equal q's ({d})")
    # FlashAttention's range: any multiple of 8 up to 256, for q/k and for v. The kernels serve
    # KERNEL_HEAD_DIMS with head_dim_v == head_dim; the rest runs on the reference (a
    # FallbackWarning names the reason, from the kernel family's can_implement).
    for name, x in (("head_dim", d), ("head_dim_v (v's last dim)", d_v)):
        if not (x % HEAD_DIM_MULTIPLE == 0 and 0 < x <= MAX_HEAD_DIM):
            raise NotImplementedError(f"{name} {x} is not supported: it must be a multiple of "
                                      f"{HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads < 1 or nheads_k < 1:
        raise ValueError(f"nheads ({nheads}) and nheads_k ({nheads_k}) must be >= 1")
    if nheads % nheads_k != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # the kernels load rows of head_dim contiguous elements; a hidden copy would cost a pass
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have stride 1 in its last (head_dim) dimension; got strides "
                f"{t.stride()} (call .contiguous() first)"
            )


def _spec(q, k, v, *, softmax_scale, causal, window_size, softcap, **fields) -> AttentionSpec:
    causal, local, left, right = normalize_mask(causal, window_size)
    scale, softcap = check_scalars(softmax_scale, softcap, q.shape[-1])
    return AttentionSpec(
        dtype=q.dtype,
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        causal=causal,
        local=local,
        has_softcap=softcap > 0,
        nheads=q.shape[-2],
        nheads_k=k.shape[-2],
        softmax_scale=scale,
        window_left=left,
        window_right=right,
        softcap=softcap,
        device_index=q.device.index if q.device.type == "cuda" else -1,
        **fields,
    )


def fixed_spec(q, k, v, *, softmax_scale, causal, window_size, softcap) -> AttentionSpec:
    """Validate flash_attn_func's arguments (no sync) and build the spec."""
    check_qkv(q, k, v, 4, "(batch, seqlen, nheads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k's batch ({k.shape[0]}) must equal q's ({q.shape[0]})")
    return _spec(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, varlen_q=False, varlen_k=False,
        batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1],
    )


def _check_index_tensor(name: str, t, length: int | None, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t)}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32; got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}: all tensors on one device")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length batch = {length}; got {t.shape[0]}")


def _check_max_seqlen(name: str, value) -> int:
    # a tensor here would need .item() (a sync) on every call: ask for the Python int instead
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int; got {type(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return int(value)


def varlen_spec(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
    *, softmax_scale, causal, window_size, softcap,
) -> AttentionSpec:
    """Validate flash_attn_varlen_func's arguments (no sync) and build the spec.

    Each side is packed (total, nheads, head_dim) with its cu_seqlens, or batched (batch, seqlen,
    nheads, head_dim) without (FlashAttention-4's forms: seqused only, or one side packed); a
    batched side's length is its seqlen (its max_seqlen is checked but not used)."""
    packed_q, packed_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    layout = lambda packed: ("(total, nheads, head_dim) with cu_seqlens" if packed else
                             "(batch, seqlen, nheads, head_dim) without cu_seqlens")
    check_qkv(q, k, v, 3 if packed_q else 4, layout(packed_q), rank_k=3 if packed_k else 4,
              layout_k=layout(packed_k))
    batch = {}
    for side, cu, x in (("q", cu_seqlens_q, q), ("k", cu_seqlens_k, k)):
        if cu is None:
            batch[side] = x.shape[0]
            continue
        _check_index_tensor(f"cu_seqlens_{side}", cu, None, q.device)
        if cu.shape[0] < 1:
            raise ValueError(f"cu_seqlens_{side} must have length batch + 1 >= 1; got length 0")
        batch[side] = cu.shape[0] - 1
    if batch["q"] != batch["k"]:
        name = lambda side, cu: (f"cu_seqlens_{side} (length {batch[side] + 1})" if cu is not None
                                 else f"{side}'s batch ({batch[side]})")
        raise ValueError(f"{name('k', cu_seqlens_k)} does not match {name('q', cu_seqlens_q)}: "
                         "both sides must hold the same number of sequences")
    b = batch["q"]
    if seqused_q is not None:
        _check_index_tensor("seqused_q", seqused_q, b, q.device)
    if seqused_k is not None:
        _check_index_tensor("seqused_k", seqused_k, b, q.device)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    return _spec(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, varlen_q=packed_q, varlen_k=packed_k,
        has_seqused_q=seqused_q is not None, has_seqused_k=seqused_k is not None,
        batch=b, seqlen_q=max_seqlen_q if packed_q else q.shape[1],
        seqlen_k=max_seqlen_k if packed_k else k.shape[1],
    )


def with_sink(spec: AttentionSpec, sink, q) -> AttentionSpec:
    """Checks a learnable sink (float32 (nheads,) on q's device, or None) and marks the spec."""
    if sink is None:
        return spec
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor or None; got {type(sink)}")
    if sink.dtype != torch.float32 or sink.dim() != 1 or sink.shape[0] != spec.nheads:
        raise ValueError(f"learnable_sink must be float32 of shape (nheads={spec.nheads},); got "
                         f"{sink.dtype} {tuple(sink.shape)}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink is on {sink.device} but q is on {q.device}")
    return dataclasses.replace(spec, has_sink=True)


def check_descales(q, k, batch: int, descales) -> None:
    """q_descale, k_descale, v_descale: None, or float32 (batch, nheads_k) on q's device, and
    only for fp8 inputs."""
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        if d is None:
            continue
        if q.dtype != FP8:
            raise ValueError(f"{name} applies to float8_e4m3fn inputs only; q is {q.dtype}")
        if not isinstance(d, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None; got {type(d)}")
        shape = (batch, k.shape[-2])
        if d.dtype != torch.float32 or tuple(d.shape) != shape or d.device != q.device:
            raise ValueError(f"{name} must be float32 of shape (batch, nheads_k) = {shape} on "
                             f"{q.device}; got {d.dtype} {tuple(d.shape)} on {d.device}")


def out_dtype(q) -> torch.dtype:
    """The output dtype: q's, or bfloat16 for fp8 inputs."""
    return torch.bfloat16 if q.dtype == FP8 else q.dtype


def batched_as_packed(x, cu):
    """A batched side (batch, seqlen, ...) seen as packed rows, with the cu_seqlens that say so
    (on x's device); a packed side as it is. What the varlen reference and value checks take."""
    if cu is not None:
        return x, cu
    b, s = x.shape[:2]
    rows = torch.arange(b + 1, dtype=torch.int32, device=x.device) * s
    return x.reshape(b * s, *x.shape[2:]), rows


def varlen_values_on_host(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> dict:
    """The index tensors on the host, read once (one transfer, a device sync when they live on a
    GPU): a dict cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k of CPU int32 tensors (None stays
    None). Expects what varlen_spec accepted: int32 1-D tensors on one device."""
    named = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                 seqused_k=seqused_k)
    given = {n: t for n, t in named.items() if t is not None}
    flat = torch.cat(list(given.values())).cpu()  # one copy for all (cheap: batch-sized)
    parts = dict(zip(given, flat.split([t.shape[0] for t in given.values()])))
    return {n: parts.get(n) for n in named}


def check_varlen_host_values(
    cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
) -> None:
    """check_varlen_values' rules on CPU tensors (see there)."""
    for side, cu, total, max_len, used in (
        ("q", cu_seqlens_q, total_q, max_seqlen_q, seqused_q),
        ("k", cu_seqlens_k, total_k, max_seqlen_k, seqused_k),
    ):
        cu = cu.long()  # int64: differences of int32 extremes do not overflow
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_{side} must start at 0; got {int(cu[0])}")
        lengths = cu[1:] - cu[:-1]
        if (lengths < 0).any():
            b = int((lengths < 0).nonzero()[0])
            raise ValueError(f"cu_seqlens_{side} must be non-decreasing; it decreases after index {b}")
        if cu[-1] != total:
            raise ValueError(
                f"cu_seqlens_{side} must end at the total number of rows ({total}); got {int(cu[-1])}"
            )
        if used is not None:
            used = used.long()
            bad = (used < 0) | (used > lengths)
            if bad.any():
                b = int(bad.nonzero()[0])
                raise ValueError(
                    f"seqused_{side}[{b}] = {int(used[b])} must lie in [0, {int(lengths[b])}] "
                    f"(sequence {b}'s length in {side}: its cu_seqlens_{side} span, or {side}'s "
                    "seqlen when batched)"
                )
            lengths = used
        longest = int(lengths.max()) if lengths.numel() else 0
        if max_len < longest:
            raise ValueError(f"max_seqlen_{side} ({max_len}) is smaller than a sequence's length ({longest})")


def check_varlen_values(
    cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
) -> dict:
    """The checks that must read cu_seqlens / seqused (a device sync): run by validate=True, and by
    the reference fallback, which reads the lengths anyway. Each cu_seqlens starts at 0, never
    decreases (so no value is negative) and ends at the total row count (total_q / total_k, the
    packed tensors' first dim); seqused[b] lies in [0, length b]; max_seqlen is at least every used
    length. Raises ValueError naming the argument and the rule; returns the host copies
    (varlen_values_on_host) so that the caller need not read the values again.
    """
    host = varlen_values_on_host(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    check_varlen_host_values(
        host["cu_seqlens_q"], host["cu_seqlens_k"], total_q, total_k, max_seqlen_q, max_seqlen_k,
        host["seqused_q"], host["seqused_k"],
    )
    return host


def _buffer(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device):
    """Allocate an output, or check the caller's preallocated one (written in place)."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t)}")
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} on {device}; got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension; got strides {t.stride()}")
    return t


def output_buffers(q, out, lse, out_shape: tuple, lse_shape: tuple):
    """(out, lse): allocated, or the caller's preallocated ones checked (written in place). out is
    in q's dtype, or for fp8 inputs bfloat16 (a float16 buffer is also taken)."""
    dtype = out_dtype(q)
    if q.dtype == FP8 and isinstance(out, torch.Tensor) and out.dtype == torch.float16:
        dtype = torch.float16
    return (_buffer("out", out, out_shape, dtype, q.device),
            _buffer("lse", lse, lse_shape, torch.float32, q.device))
