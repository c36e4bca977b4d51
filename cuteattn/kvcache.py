"""flash_attn_with_kvcache: attention of a few new query rows against a KV cache (decoding,
speculative decoding, chunked prefill), with FlashAttention's signature and semantics.

The argument checks here read no device value (no sync) unless validate=True (the reference,
which reads the lengths anyway, always checks the values). Where a decode kernel serves the call
(kind "decode": the sm80 family's, with CUTEATTN_PATH=sm80 until it is GPU-verified), the new
tokens are rotated and appended on the device (`append_and_rotate`, no sync) and the kernel
attends over the cache; otherwise the PyTorch reference (reference.attention_kvcache_ref) does
all of it, with the usual FallbackWarning (strict mode raises).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import os

import torch

from cuteattn import _checks, api
from cuteattn.reference import apply_rotary_ref, attention_kvcache_ref, attention_varlen_ref
from cuteattn.spec import AttentionSpec

PAGE_MULTIPLE = 16  # paged caches: the page size must be a multiple of this


# Split-KV counts CTAs against the slots of every SM (sm80/config.decode_ctas_per_sm: the K/V
# ring is sized so that many share an SM). Measured on an H200 (CUDA-graph replays,
# docs/perf-log.md): 256 CTAs beat 128 by 1-33% at batch 1 and 8.
@functools.lru_cache(maxsize=1024)  # (a decode step asks again every call: keep it off the host's path)
def split_count(work_tiles: int, slots: int, key_blocks: int, max_splits: int = 128) -> int:
    """How many ranges to split each tile's keys into (num_splits=0): 1 when the tiles alone
    (batch x kv heads x query blocks, with pack-GQA) fill 80% of the GPU's CTA slots (`slots`:
    SMs x the decode kernel's CTAs an SM, kernels/sm80/config.decode_ctas_per_sm); else the
    count with the least estimated time, the fewest splits among equals, never more splits
    than key blocks. The estimate: the waves of CTA slots the CTAs take times a CTA's time,
    which is its split's key blocks (the longest split's) plus SPLIT_OVERHEAD_BLOCKS for its fixed work (q, the partial output and
    LSE, the merge). At batch 1 with 8 kv heads over 1024 key blocks on 132 SMs: 32 splits of
    32 blocks (256 CTAs, one wave); 31 would leave the longest split 34 blocks."""
    if work_tiles <= 0 or work_tiles >= 0.8 * slots:
        return 1
    limit = max(1, min(max_splits, slots, key_blocks))
    cost = lambda splits: (-(-work_tiles * splits // slots)
                           * (-(-key_blocks // splits) + SPLIT_OVERHEAD_BLOCKS))
    return min(range(1, limit + 1), key=lambda splits: (cost(splits), splits))


SPLIT_OVERHEAD_BLOCKS = 2  # (an estimate: a CTA's fixed work against one key block's, unmeasured)


FP8_CACHE = (torch.float8_e4m3fn, torch.float8_e5m2)  # an fp8 cache, with bf16/fp16 q


def _index_vector(name: str, t, batch: int, device) -> None:
    if t is None:
        return
    _checks._check_index_tensor(name, t, batch, device)


def _check_cache(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad,
                 rotary_cos, rotary_sin, cache_seqlens, num_splits, descales=(None, None)):
    """The shape/dtype/device rules; returns (batch, seqlen_new, capacity per sequence)."""
    if isinstance(q, torch.Tensor) and q.dtype not in _checks.SUPPORTED_DTYPES:
        raise TypeError(f"q dtype must be float16 or bfloat16 for flash_attn_with_kvcache (the "
                        f"cache may be fp8); got {q.dtype}")
    _checks.check_qkv(q, k_cache, v_cache, 4, "(batch_cache, seqlen_cache, nheads_k, head_dim) "
                      "or paged (num_blocks, page_size, nheads_k, head_dim)", kv_dtypes=FP8_CACHE)
    for name, d in zip(("k_descale", "v_descale"), descales):
        if d is None:
            continue
        if k_cache.dtype not in FP8_CACHE:
            raise ValueError(f"{name} applies to an fp8 cache only; the cache is {k_cache.dtype}")
        shape = (q.shape[0], k_cache.shape[2])
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != shape \
                or d.device != q.device:
            raise ValueError(f"{name} must be float32 of shape (batch, nheads_k) = {shape} on "
                             f"{q.device}; got {getattr(d, 'dtype', type(d))} "
                             f"{tuple(getattr(d, 'shape', ()))}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape (batch, seqlen, nheads, head_dim); got {tuple(q.shape)}")
    batch, device = q.shape[0], q.device
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor; got {type(block_table)}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32; got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch={batch}, max_pages); got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != device:
            raise ValueError(f"block_table must be on q's device ({device}); got {block_table.device}")
        page = k_cache.shape[1]
        if page <= 0 or page % PAGE_MULTIPLE != 0:
            raise ValueError(f"the page size (k_cache.shape[1] = {page}) must be a positive "
                             f"multiple of {PAGE_MULTIPLE} for a paged cache")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (the block "
                             "table already says where each sequence's pages are)")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad cannot be combined with block_table")
        capacity = block_table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"k_cache has {k_cache.shape[0]} sequences for a batch of {batch} "
                             "(pass cache_batch_idx to pick cache rows)")
    _index_vector("cache_batch_idx", cache_batch_idx, batch, device)
    _index_vector("cache_leftpad", cache_leftpad, batch, device)
    s_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is not None:
        hk, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
        for name, t, last in (("k", k, d), ("v", v, dv)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(t)}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != hk or t.shape[3] != last:
                raise ValueError(f"{name} must have shape (batch={batch}, seqlen_new, nheads_k={hk}, "
                                 f"{last}); got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != device:
                raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {device}); "
                                 f"got {t.dtype}, {t.device} (an fp8 cache takes new tokens in "
                                 "q's dtype and quantizes them with its descales)")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have the same seqlen_new; got {k.shape[1]} and {v.shape[1]}")
        s_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("new k / v need cache_seqlens: where to append them in each sequence")
        if s_new > capacity:
            raise ValueError(f"{s_new} new tokens do not fit a cache of {capacity} per sequence")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != rotary_cos.shape:
                raise ValueError(f"{name} must be a 2-D tensor (seqlen_ro, rotary_dim / 2), both "
                                 f"the same shape; got {getattr(t, 'shape', type(t))}")
            if t.device != device or not t.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor on q's device ({device})")
        rd = 2 * rotary_cos.shape[1]
        if rd > q.shape[-1] or rd % 16 != 0:
            raise ValueError(f"rotary_dim (2 x rotary_cos.shape[1] = {rd}) must be a multiple of 16 "
                             f"and at most head_dim ({q.shape[-1]})")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"rotary_cos/sin must cover every cache position: {rotary_cos.shape[0]} "
                             f"rows for a capacity of {capacity}")
    if isinstance(cache_seqlens, bool) or not (
            cache_seqlens is None or isinstance(cache_seqlens, (numbers.Integral, torch.Tensor))):
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor; got {type(cache_seqlens)}")
    if isinstance(cache_seqlens, numbers.Integral) and not 0 <= int(cache_seqlens) <= capacity - s_new:
        raise ValueError(f"cache_seqlens ({cache_seqlens}) must lie in [0, capacity - seqlen_new] = "
                         f"[0, {capacity - s_new}]")
    if isinstance(cache_seqlens, torch.Tensor):
        _index_vector("cache_seqlens", cache_seqlens, batch, device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic); got {num_splits!r}")
    return batch, s_new, capacity


def _check_rotary_rows(rotary_cos, seqlens, seqlen_q: int, positional: bool) -> None:
    """q is rotated at cache_seqlens[b] + i (i < seqlen_q) when `positional` (causal or
    windowed), else at cache_seqlens[b]: rotary_cos/sin need a row for each such position."""
    last = max(seqlens, default=0) + (seqlen_q - 1 if positional else 0)
    if seqlen_q > 0 and last >= rotary_cos.shape[0]:
        raise ValueError(f"rotary_cos/sin have {rotary_cos.shape[0]} rows, but q is rotated at "
                         f"position {last} (cache_seqlens{' + the query row' if positional else ''}; "
                         "without cache_seqlens the cache is full: its capacity)")


def _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, s_new,
                  capacity, batch, rotary=(None, 0, False)) -> None:
    """validate=True (and every fallback): the index values (a device sync). rotary: (rotary_cos
    or None, seqlen_q, positional), _check_rotary_rows' arguments."""
    seqlens = ([cache_seqlens] * batch if not isinstance(cache_seqlens, torch.Tensor)
               else cache_seqlens.tolist()) if cache_seqlens is not None else [capacity - s_new] * batch
    for b, n in enumerate(seqlens):
        if not 0 <= n <= capacity - s_new:
            raise ValueError(f"cache_seqlens[{b}] = {n}: must lie in [0, capacity - seqlen_new] = "
                             f"[0, {capacity - s_new}]")
    if rotary[0] is not None:
        _check_rotary_rows(rotary[0], [capacity] if cache_seqlens is None else seqlens, *rotary[1:])
    if cache_leftpad is not None:
        for b, (pad, n) in enumerate(zip(cache_leftpad.tolist(), seqlens)):
            if not 0 <= pad <= n:
                raise ValueError(f"cache_leftpad[{b}] = {pad}: must lie in [0, cache_seqlens[{b}] = {n}]")
    if cache_batch_idx is not None:
        rows = cache_batch_idx.tolist()
        bad = [r for r in rows if not 0 <= r < k_cache.shape[0]]
        if bad:
            raise ValueError(f"cache_batch_idx {bad[0]} is outside the cache's {k_cache.shape[0]} rows")
        if len(set(rows)) != len(rows):
            raise ValueError("cache_batch_idx must not repeat a cache row (two sequences would "
                             "append into it)")
    if block_table is not None:
        page, table = k_cache.shape[1], block_table.tolist()
        for b, n in enumerate(seqlens):
            used = table[b][: (n + s_new + page - 1) // page]
            bad = [p for p in used if not 0 <= p < k_cache.shape[0]]
            if bad:
                raise ValueError(f"block_table[{b}] holds page {bad[0]}, outside the cache's "
                                 f"{k_cache.shape[0]} pages")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    learnable_sink=None,
    k_descale=None,
    v_descale=None,
    validate=False,
    strict=None,
):
    """Attention of q (batch, seqlen_q, nheads, head_dim) against a KV cache, FlashAttention's
    `flash_attn_with_kvcache`.

    k_cache / v_cache: (batch_cache, seqlen_cache, nheads_k, head_dim), or with block_table
    (batch, max_pages) int32, paged: (num_blocks, page_size, nheads_k, head_dim), page_size a
    multiple of 16, pages in any order and shared between sequences. cache_seqlens (int, or
    (batch,) int32): the cache's current length per sequence (None: the whole capacity).
    k / v (batch, seqlen_new, nheads_k, head_dim): new tokens, written into the caches in place
    at cache_seqlens before attending, rotated first when rotary_cos / rotary_sin
    (seqlen_ro, rotary_dim / 2) are given (q too: at positions cache_seqlens + i when causal or
    windowed, else at cache_seqlens), interleaved (GPT-J) or not (GPT-NeoX). cache_batch_idx
    (batch,) int32: the cache row of each sequence; cache_leftpad (batch,) int32: where each
    sequence's keys start. Masks are bottom-right aligned against the keys
    [cache_leftpad, cache_seqlens + seqlen_new). num_splits: each sequence's keys in that many
    ranges merged by their lse (split-KV; 0 = split_count's choice for the GPU, 1 = none).

    learnable_sink (nheads,) float32: one logit per query head joining every row's softmax
    denominator (gpt-oss), counted once. An fp8 cache (float8_e4m3fn or float8_e5m2) with
    fp16/bf16 q: k_descale / v_descale ((batch, nheads_k) float32, None = 1.0) give the real
    values (stored x descale); new k / v in q's dtype are quantized into it (value / descale).

    Returns out (batch, seqlen_q, nheads, head_dim), and lse (batch, nheads, seqlen_q) float32
    with return_softmax_lse. No gradients (inference). validate=True also checks the index
    values (a sync): lengths within the capacity, leftpad within the length, rows and pages in
    range, rows not repeated. Without it they are trusted.
    """
    _checks.check_flags(rotary_interleaved=rotary_interleaved, return_softmax_lse=return_softmax_lse,
                        validate=validate, strict=strict)
    compiling = torch.compiler.is_compiling()
    sig = None
    if not compiling and not validate:
        sig = _step_signature(q, k_cache, v_cache, (
            k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, learnable_sink, k_descale, v_descale), (
            softmax_scale, causal, window_size, softcap, bool(rotary_interleaved), num_splits,
            strict, tuple(map(type, window_size)) if type(window_size) is tuple else None))
        step = _steps.get(sig) if sig is not None else None
        if step is not None:
            out, lse = step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                            cache_batch_idx, cache_leftpad, block_table, bool(rotary_interleaved),
                            learnable_sink, (k_descale, v_descale))
            return (out, lse) if return_softmax_lse else out
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: flash_attn_with_kvcache does not take ALiBi yet "
                                  "(flash_attn_func and flash_attn_varlen_func do; pass None)")
    checked = _check_cache(q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad,
                           rotary_cos, rotary_sin, cache_seqlens, num_splits, (k_descale, v_descale))
    if isinstance(cache_seqlens, numbers.Integral):
        cache_seqlens = int(cache_seqlens)  # (numpy's ints too: the reference indexes with it)
    causal, _, left, right = _checks.normalize_mask(causal, window_size)
    scale, softcap = _checks.check_scalars(softmax_scale, softcap, q.shape[-1])
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, scale, causal, left, right, softcap,
            bool(rotary_interleaved), learnable_sink, bool(validate), strict, int(num_splits))
    if compiling:  # an opaque op: the cache lengths are read inside
        from cuteattn import ops
        out, lse = ops.kvcache(*args, descales=(k_descale, v_descale))
    else:
        out, lse = kvcache_forward(*args, descales=(k_descale, v_descale), checked=checked,
                                   keep_as=sig)
    return (out, lse) if return_softmax_lse else out


# A decoder calls flash_attn_with_kvcache with one signature step after step (shapes, strides,
# dtypes and devices of every tensor, the scalars; never the lengths' values, which the checks
# do not read without validate=True): the first such call's checks, spec, kernel and split
# count are kept under it (a DecodeStep), and the next calls go straight to the update and the
# launch. Only calls a kernel served are kept (fallbacks take the full path every time).
_steps: dict = {}
_STEPS_MAX = 256


def _step_signature(q, k_cache, v_cache, tensors: tuple, scalars: tuple):
    """The call's signature (api._signature's, tensors by api._tensor_signature), or None
    when it does not qualify (non-tensor q / caches, an unhashable argument)."""
    try:
        sig = api._signature(q, k_cache, v_cache, tuple(map(api._tensor_signature, tensors)),
                             *scalars)
        if sig is not None:
            hash(sig)
        return sig
    except TypeError:  # an unhashable argument (the checks then say what is wrong with it)
        return None


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """What a served call decided past its checks: the spec's launch, the split count, the
    capacity per sequence and whether q rotates at each row's own position. Calling it runs the
    step: the KV update (append_and_rotate), then the attention."""
    spec: AttentionSpec
    launch: object
    splits: int
    capacity: int
    positional: bool
    append: object = None  # the KV update's launch (append_launch), made once for the signature

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, learnable_sink,
                 descales):
        with torch.no_grad():
            q_rot, seqused_k = append_and_rotate(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                block_table, self.positional, rotary_interleaved, self.capacity, descales,
                self.append)
            out = torch.empty(*q.shape[:3], v_cache.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32,
                              device=q.device)
            extra = (dict(k_descale=descales[0], v_descale=descales[1])
                     if self.spec.kv_dtype is not None else {})
            self.launch(q_rot, k_cache, v_cache, out, lse, seqused_k, cache_batch_idx,
                        cache_leftpad, block_table, self.splits, learnable_sink=learnable_sink,
                        **extra)
        return out, lse


def kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, left, right,
                    softcap, rotary_interleaved, learnable_sink, validate, strict, num_splits=1,
                    descales=(None, None), checked=None, keep_as=None):
    """flash_attn_with_kvcache past its argument checks (the normalised mask and scalars):
    the kernel choice, the value checks (always, on the reference path; a kernel will take them
    with validate=True), the computation. Returns (out, lse);
    ops.py's custom op runs this under torch.compile. checked: _check_cache's result when the
    caller has just run it (eager calls: each step checks its arguments once). keep_as: the
    call's signature (_step_signature), under which a served call's DecodeStep is kept."""
    batch, s_new, capacity = checked or _check_cache(
        q, k_cache, v_cache, k, v, block_table, cache_batch_idx, cache_leftpad, rotary_cos,
        rotary_sin, cache_seqlens, 0)
    causal, local, left, right = _checks.normalize_mask(causal, (left, right))
    if rotary_cos is not None and not isinstance(cache_seqlens, torch.Tensor):
        _check_rotary_rows(rotary_cos, [capacity if cache_seqlens is None else cache_seqlens],
                           q.shape[1], causal or local)
    fp8 = k_cache.dtype in FP8_CACHE
    spec = AttentionSpec(
        dtype=q.dtype, head_dim=q.shape[-1],
        head_dim_v=v_cache.shape[-1], causal=causal, local=local, has_softcap=softcap > 0,
        varlen_q=False, varlen_k=False, has_seqused_k=True, kind="decode", batch=batch,
        seqlen_q=q.shape[1], seqlen_k=capacity, nheads=q.shape[2], nheads_k=k_cache.shape[2],
        softmax_scale=softmax_scale, window_left=left, window_right=right, softcap=softcap,
        paged_kv=block_table is not None, has_kv_batch_idx=cache_batch_idx is not None,
        has_leftpad_k=cache_leftpad is not None,
        page_size=k_cache.shape[1] if block_table is not None else 0,
        device_index=q.device.index if q.device.type == "cuda" else -1,
        kv_dtype=k_cache.dtype if fp8 else None)
    spec = _checks.with_sink(spec, learnable_sink, q)
    if batch == 0:  # nothing to append or attend
        return (q.new_empty(*q.shape[:3], v_cache.shape[-1]),
                torch.empty(0, q.shape[2], q.shape[1], dtype=torch.float32, device=q.device))
    launch, reason = _decode_launch(spec, q.device)
    rotary = (rotary_cos, q.shape[1], causal or local)
    if launch is not None:
        if validate:
            _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                          s_new, capacity, batch, rotary)
        step = DecodeStep(spec, launch, _splits(num_splits, spec, q.device, capacity), capacity,
                          causal or local,
                          append_launch(q, k_cache, v_cache, k, rotary_cos, cache_batch_idx,
                                        block_table, causal or local, rotary_interleaved))
        if keep_as is not None:
            if len(_steps) >= _STEPS_MAX:
                _steps.clear()
            _steps[keep_as] = step
        return step(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                    cache_batch_idx, cache_leftpad, block_table, rotary_interleaved,
                    learnable_sink, descales)
    api._fall_back(reason, strict)
    # the reference reads the index values anyway: hold them to validate=True's rules always
    # (a clear ValueError, not an index error or a write outside a sequence's pages)
    _check_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, s_new,
                  capacity, batch, rotary)
    with torch.no_grad():
        out, lse = attention_kvcache_ref(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale=softmax_scale, causal=causal,
            window_size=(left, right), softcap=softcap, rotary_interleaved=rotary_interleaved,
            learnable_sink=learnable_sink, descales=descales,
            num_splits=_splits(num_splits, spec, q.device, capacity))
    return out.to(q.dtype), lse


# Decode steps repeat one spec (shapes, lengths class, flags) call after call: the launch made
# for it is kept (with the kernel path variable, which changes the choice), so a step costs no
# kernel choice or launch setup. Only served specs are kept: reasons are re-derived (and warned
# about once) every time.
_decode_launches: dict = {}
_DECODE_LAUNCHES_MAX = 256


def _decode_launch(spec: AttentionSpec, device):
    key = (spec, os.environ.get("CUTEATTN_PATH"))
    launch = _decode_launches.get(key)
    if launch is not None:
        return launch, None
    launch, reason = api._select_kernel(spec, device)
    if launch is not None:
        if len(_decode_launches) >= _DECODE_LAUNCHES_MAX:
            _decode_launches.clear()
        _decode_launches[key] = launch
    return launch, reason


def append_and_rotate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                      cache_batch_idx, block_table, positional: bool, interleaved: bool,
                      capacity: int, descales=(None, None), launch=None):
    """The KV-cache update before a decode kernel attends, on the device with no sync (on a GPU
    one launch of kernels/common/kv_append.py, elsewhere append_and_rotate_torch): new k
    (rotated) and v written into the caches in place at positions [cache_seqlens[b],
    cache_seqlens[b] + seqlen_new) of cache row cache_batch_idx[b] (or b; paged: of sequence
    b's pages), and q rotated (at positions cache_seqlens[b] + i when `positional`, causal or
    windowed; at cache_seqlens[b] otherwise), as reference.attention_kvcache_ref does.
    An fp8 cache takes the new tokens quantized, value / descale (descales: (k's, v's), (batch,
    nheads_k) float32 or None = 1.0), as the reference stores them.
    launch: the KvAppendLaunch for this call's form, when the caller keeps one (DecodeStep).
    Returns (rotated q, the used length per sequence: int32 (batch,) cache_seqlens + seqlen_new)."""
    b, sq = q.shape[:2]
    device = q.device
    if (k is None and rotary_cos is None and isinstance(cache_seqlens, torch.Tensor)
            and cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()):
        # nothing to append or rotate: the lengths go to the kernel as they are (a decode step
        # then launches no PyTorch kernel before the attention's own)
        return q, cache_seqlens
    if q.is_cuda and (k is not None or rotary_cos is not None):
        # one launch of common/kv_append.py for what the PyTorch steps below do in a dozen
        if isinstance(cache_seqlens, torch.Tensor):
            lengths = cache_seqlens
        else:
            lengths = torch.full((b,), capacity if cache_seqlens is None else int(cache_seqlens),
                                 dtype=torch.int32, device=device)
        if launch is None:
            launch = append_launch(q, k_cache, v_cache, k, rotary_cos, cache_batch_idx,
                                   block_table, positional, interleaved)
        return launch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths,
                      cache_batch_idx, block_table, descales)
    return append_and_rotate_torch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                   cache_seqlens, cache_batch_idx, block_table, positional,
                                   interleaved, capacity, descales)


def append_launch(q, k_cache, v_cache, k, rotary_cos, cache_batch_idx, block_table,
                  positional: bool, interleaved: bool):
    """The GPU's KV update for calls of this form (a KvAppendLaunch), or None where
    append_and_rotate launches nothing (no new tokens and no rotary) or runs PyTorch steps."""
    if not q.is_cuda or (k is None and rotary_cos is None):
        return None
    from .kernels.launch_common import KvAppendLaunch
    return KvAppendLaunch(q, k_cache, v_cache, k, rotary_cos, cache_batch_idx, block_table,
                          positional, interleaved)


def append_and_rotate_torch(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                            cache_batch_idx, block_table, positional: bool, interleaved: bool,
                            capacity: int, descales=(None, None)):
    """append_and_rotate in PyTorch steps (the kernel's reference)."""
    b, sq = q.shape[:2]
    device = q.device
    if cache_seqlens is None:
        old = torch.full((b,), capacity, dtype=torch.long, device=device)
    elif isinstance(cache_seqlens, torch.Tensor):
        old = cache_seqlens.long()
    else:
        old = torch.full((b,), int(cache_seqlens), dtype=torch.long, device=device)
    if rotary_cos is not None:
        steps = torch.arange(sq, device=device) if positional else torch.zeros(sq, dtype=torch.long, device=device)
        pos = old[:, None] + steps
        q = apply_rotary_ref(q, rotary_cos[pos], rotary_sin[pos], interleaved)
    s_new = 0
    if k is not None:
        s_new = k.shape[1]
        pos = old[:, None] + torch.arange(s_new, device=device)  # (b, s_new)
        if rotary_cos is not None:
            k = apply_rotary_ref(k, rotary_cos[pos], rotary_sin[pos], interleaved)
        if block_table is None:
            rows = (cache_batch_idx.long() if cache_batch_idx is not None
                    else torch.arange(b, device=device))[:, None].expand(b, s_new)
            where = (rows, pos)
        else:
            page = k_cache.shape[1]
            where = (block_table.long().gather(1, pos // page), pos % page)
        k_cache[where] = _quantized(k, k_cache.dtype, descales[0])
        v_cache[where] = _quantized(v, v_cache.dtype, descales[1])
    return q, (old + s_new).to(torch.int32)


def _quantized(x, dtype, descale):
    """New tokens (batch, s_new, h_k, d) as a cache of `dtype` holds them: for an fp8 cache
    x / descale (per batch and kv head) rounded to it, else x in the cache's dtype."""
    if dtype in FP8_CACHE and descale is not None:
        return (x.float() / descale.float()[:, None, :, None]).to(dtype)
    return x.to(dtype)


def _splits(num_splits: int, spec: AttentionSpec, device, capacity: int) -> int:
    """num_splits as given, or for 0 split_count's choice for this device (1 off the GPU)."""
    if num_splits > 0:
        return num_splits
    if device.type != "cuda":
        return 1
    from .kernels.launch_common import sm_count
    from .kernels.sm80.config import decode_grid
    from .kernels.sm80.launch import smem_limit
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = sm_count(index)
    tiles, ctas_per_sm = decode_grid(spec, sms, smem_limit(index))
    return split_count(tiles, sms * ctas_per_sm, -(-capacity // 128))


def _check_paged_lengths(cu_seqlens_k, seqused_k, block_table, page: int, capacity: int,
                         num_pages: int):
    """The paged prefill's index values (a sync): each sequence's key length fits its pages,
    and the pages it uses are in the cache; cu_seqlens_k starts at 0 (as validate=True holds
    every cu_seqlens to). Returns (used lengths, the table) as lists."""
    if int(cu_seqlens_k[0]) != 0:
        raise ValueError(f"cu_seqlens_k must start at 0; got {int(cu_seqlens_k[0])}")
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    used = seqused_k.tolist() if seqused_k is not None else lengths
    table = block_table.tolist()
    for b, n in enumerate(used):
        if not 0 <= n <= min(lengths[b], capacity) or lengths[b] > capacity:
            raise ValueError(f"sequence {b}: its key length ({lengths[b]}, used {n}) must fit its "
                             f"pages ({capacity} keys)")
        if any(not 0 <= p < num_pages for p in table[b][: (n + page - 1) // page]):
            raise ValueError(f"block_table[{b}] holds a page outside the cache's {num_pages}")
    return used, table


def paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 block_table, softmax_scale, causal, window_size, softcap, seqused_q, seqused_k,
                 learnable_sink, validate, strict):
    """flash_attn_varlen_func with FlashAttention's block_table= (paged prefill): packed q with
    cu_seqlens_q; keys of sequence b at positions [0, its length) of its pages, the lengths from
    cu_seqlens_k (and seqused_k). Returns (out (total_q, h, d), lse (h, total_q)). Inference
    only. Where a kernel serves it (the sm80 forward's paged form) it reads the pages itself and
    the index values are checked with validate=True; otherwise the reference gathers the keys
    from the pages and always checks the values."""
    if not isinstance(cu_seqlens_q, torch.Tensor) or not isinstance(cu_seqlens_k, torch.Tensor):
        raise ValueError("block_table needs cu_seqlens_q and cu_seqlens_k (packed q; the key "
                         "lengths of the paged sequences)")
    _checks.check_qkv(q, k_cache, v_cache, 3, "(total_q, nheads, head_dim)", rank_k=4,
                      layout_k="paged (num_blocks, page_size, nheads_k, head_dim)")
    _checks._check_index_tensor("cu_seqlens_q", cu_seqlens_q, None, q.device)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1; got an empty tensor")
    batch = cu_seqlens_q.shape[0] - 1
    for name, t, n in (("cu_seqlens_k", cu_seqlens_k, batch + 1),
                       ("seqused_q", seqused_q, batch), ("seqused_k", seqused_k, batch)):
        if t is not None:
            _checks._check_index_tensor(name, t, n, q.device)
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 \
            or block_table.dim() != 2 or block_table.shape[0] != batch or block_table.device != q.device:
        raise ValueError(f"block_table must be an int32 (batch={batch}, max_pages) tensor on "
                         f"{q.device}; got {getattr(block_table, 'dtype', type(block_table))} "
                         f"{tuple(getattr(block_table, 'shape', ()))}")
    page = k_cache.shape[1]
    if page <= 0 or page % PAGE_MULTIPLE != 0:
        raise ValueError(f"the page size (k.shape[1] = {page}) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}")
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k_cache, v_cache)):
        raise NotImplementedError("block_table (paged keys): no gradients (inference only)")
    max_seqlen_q = _checks._check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _checks._check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if batch == 0 or q.shape[0] == 0:
        # no sequence (every row outside them: out 0, lse -inf) or no rows: nothing to launch
        # (a kernel's tiles would index the lengths of sequence -1)
        return (torch.zeros(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype, device=q.device),
                torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device))
    capacity = block_table.shape[1] * page
    spec = _checks._spec(q, k_cache, v_cache, softmax_scale=softmax_scale, causal=causal,
                         window_size=window_size, softcap=softcap, varlen_q=True, varlen_k=True,
                         has_seqused_q=seqused_q is not None, has_seqused_k=seqused_k is not None,
                         batch=batch, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k, paged_kv=True)
    spec = dataclasses.replace(_checks.with_sink(spec, learnable_sink, q), page_size=page)
    # (kept per spec, as the other calls' launches: choosing the kernel and building its launch
    # cost host time on every call)
    launch, reason = api._cached_launch(spec, q.device)
    if launch is not None:
        if validate:
            _check_paged_lengths(cu_seqlens_k, seqused_k, block_table, page, capacity,
                                 k_cache.shape[0])
            # (the keys are in pages, not packed: cu_seqlens_k's end is its own total)
            _checks.check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                                        int(cu_seqlens_k[-1]), max_seqlen_q, max_seqlen_k,
                                        seqused_q, seqused_k)
        # the kernel reads each sequence's keys from position 0 of its pages: their count is
        # seqused_k, or the cu_seqlens_k difference (on the device, no sync)
        used_k = seqused_k if seqused_k is not None else (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).int()
        out = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        with torch.no_grad():
            launch(q, k_cache, v_cache, out, lse, cu_seqlens_q, None, seqused_q, used_k,
                   page_table=block_table, learnable_sink=learnable_sink)
        return out, lse
    api._fall_back(reason, strict)
    # the reference reads the lengths anyway: hold them to the rules (validate=True's and more)
    used, table = _check_paged_lengths(cu_seqlens_k, seqused_k, block_table, page, capacity,
                                       k_cache.shape[0])
    keys, values, starts = [], [], [0]
    for b in range(batch):
        n = used[b]
        pages = table[b][: (n + page - 1) // page]
        index = torch.tensor(pages, dtype=torch.long, device=q.device)
        keys.append(k_cache[index].reshape(-1, *k_cache.shape[2:])[:n])
        values.append(v_cache[index].reshape(-1, *v_cache.shape[2:])[:n])
        starts.append(starts[-1] + n)
    cu_k = torch.tensor(starts, dtype=torch.int32, device=q.device)
    k, v = torch.cat(keys), torch.cat(values)
    host = _checks.check_varlen_values(cu_seqlens_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q,
                                       max_seqlen_k, seqused_q, None)
    with torch.no_grad():
        out, lse = attention_varlen_ref(
            q, k, v, **host, softmax_scale=spec.softmax_scale, causal=spec.causal,
            window_size=(spec.window_left, spec.window_right), softcap=spec.softcap,
            learnable_sink=learnable_sink)
    return out.to(q.dtype), lse
