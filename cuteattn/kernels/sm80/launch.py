"""The sm80 forward family: which specs it serves, and how a call becomes a launch.

The mma.sync path serves the GPUs without wgmma (sm_80, sm_86, sm_89, sm_120) and, chosen with
CUTEATTN_PATH=sm80 (dispatch.py), any later one: there it is compiled for the running arch but
uses only sm_80 instructions, which is how it is tested on Hopper. The tile shapes follow the
device's shared memory (config.py). One CTA per tile, no persistent grid: the grid is the tile
count, causal tiles longest first.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import cutlass
import torch

from ... import compile_cache, dispatch
from ...spec import AttentionSpec
from ..common.arguments import Binder, group_names
from ..launch_common import (CUTLASS_DTYPES, aligned16, call_kernel, kernel_scalars, l2_groups,
                             sm_count, to_runtime, unserved_dtype_or_dims, unserved_form, use_tvm_ffi)
from . import arguments, config
from ..compile_common import first_spill_free, from_candidate
from .combine import CombineConfig

ARCH, KIND = "sm80", "fwd"
# an fp8 KV cache's torch dtype -> the format its bytes are read as (decoding)
FP8_FORMATS = {torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.float8_e5m2: cutlass.Float8E5M2}
FP8_MIN_CAPABILITY = (8, 9)  # converting fp8 to 16-bit floats in hardware (cvt ...e4m3x2)
COMPILE_MODULE = "cuteattn.kernels.sm80.compile"

# Testing knob: CUTEATTN_SM80_CONFIGS=sm_86 (or sm_80, sm_89, sm_120a) makes a launch on any GPU
# choose the configs (tiles for that target's shared memory, register parts for its compiler)
# that target would run, still compiled for the GPU at hand: so a Hopper GPU runs, and verifies,
# the kernels an Ampere, Ada or RTX part gets. Set it for the whole process (a call's kernel is
# chosen once per call signature); unset in normal use.
CONFIGS_ENV = "CUTEATTN_SM80_CONFIGS"


def _capability_of(target: str) -> tuple:
    try:
        return dispatch.target_capability(target)
    except ValueError as e:
        raise ValueError(f"{CONFIGS_ENV}/CUTE_DSL_ARCH: {e}") from None


def target_capability(device_index: int) -> tuple:
    """The compute capability whose configs the kernels take: the device's (or CUTEATTN_SM80_CONFIGS's
    when set); for host-only callers (compile-only, python -m cuteattn.precompile) the
    CUTE_DSL_ARCH target's (sm_86 if unset)."""
    if device_index >= 0:
        emulated = os.environ.get(CONFIGS_ENV)
        return _capability_of(emulated) if emulated else torch.cuda.get_device_capability(device_index)
    return _capability_of(os.environ.get("CUTE_DSL_ARCH", "sm_86"))


def smem_limit(device_index: int) -> int:
    """Opt-in shared memory per block of the device (host-only callers, and CUTEATTN_SM80_CONFIGS:
    the target's, never more than the device has)."""
    if device_index < 0:
        return config.SMEM_BY_CAPABILITY.get(target_capability(-1), 99 * 1024)
    limit = _device_smem(device_index)
    if os.environ.get(CONFIGS_ENV):
        limit = min(limit, config.SMEM_BY_CAPABILITY.get(target_capability(device_index), 99 * 1024))
    return limit


@functools.lru_cache(maxsize=None)
def _device_smem(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def sm80_configs(spec: AttentionSpec) -> list:
    """The candidate configs, preferred first (ValueError if no tile fits the device)."""
    if spec.paged_kv:  # the paged prefill (packed q, keys in pages): the decode kernel's tiles
        # (one pass over the keys: a sink joins the epilogue's denominator as in the forward)
        return [dataclasses.replace(config.decode_config(
            CUTLASS_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
            spec.has_softcap, False, False, spec.page_size, False, varlen_q=spec.varlen_q,
            has_seqused_q=spec.has_seqused_q, smem_limit=smem_limit(spec.device_index)),
            has_sink=spec.has_sink)]
    return config.fwd_configs(
        CUTLASS_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
        spec.has_softcap, spec.varlen_q, spec.varlen_k, spec.has_seqused_q, spec.has_seqused_k,
        smem_limit=smem_limit(spec.device_index), has_sink=spec.has_sink)


# Testing knob: CUTEATTN_SM80_FWD_FALLBACK=k makes the forward start from candidate k of
# sm80_configs (the last where a form has fewer), so a GPU whose compiler builds the first
# spill-free runs the smaller tiles other targets' compilers take. Unset in normal use.
FWD_FALLBACK_ENV = "CUTEATTN_SM80_FWD_FALLBACK"


def compiled_forward(spec: AttentionSpec, tvm_ffi: bool):
    """(config, kernel): the first candidate config that compiles without register spills for
    this target (a spilling candidate is compiled, or loaded from the disk cache, to learn it)."""
    compile_with_report = lambda cfg: (_compiled(cfg, tvm_ffi),
                                       compile_cache.kernel_info((ARCH, KIND, tvm_ffi, cfg)))
    cfg, fn, _ = first_spill_free(from_candidate(sm80_configs(spec), FWD_FALLBACK_ENV),
                                  compile_with_report)
    return cfg, fn


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    """The files the family's compiled code depends on (compile_cache.module_sources)."""
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg, tvm_ffi: bool):
    def build():
        from .compile import compile_fwd_with_report
        return compile_fwd_with_report(cfg, tvm_ffi=tvm_ffi)
    # the disk cache's directory fingerprint holds the target arch: the same config compiled
    # for an sm_86 and an sm_90 never share a file
    return compile_cache.get_or_compile((ARCH, KIND, tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=sources())


def _compiled_combine(cfg: CombineConfig, tvm_ffi: bool):
    def build():
        from .compile import compile_combine
        return compile_combine(cfg, tvm_ffi=tvm_ffi), {}
    return compile_cache.get_or_compile((ARCH, "combine", tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=sources())


def launch_scalars(spec: AttentionSpec, pack_gqa: int = 1) -> dict:
    """The kernel's scalar arguments by name (arguments.SCALARS), as Python numbers; pack_gqa:
    the compiled kernel's (Sm80FwdConfig.pack_gqa), which decides what its tile order walks."""
    score_scale, scale_log2, left, right = kernel_scalars(spec)
    small, num_small = l2_groups(spec, packed=pack_gqa > 1)
    return dict(qhead_per_kvhead=spec.qhead_per_kvhead, score_scale=score_scale,
                softmax_scale_log2=scale_log2, window_left=left, window_right=right,
                l2_group=small, l2_small_groups=num_small)


# The arguments each call passes, in the order a launch passes them (the forward: one split,
# the cache group for the paged prefill's page table; the decode kernel: the splits too).
PER_CALL = ("mQ", "mK", "mV", "mO", "mLSE", *group_names("varlen", arguments.ARGUMENTS),
            *group_names("cache", arguments.ARGUMENTS), "mSink")
DECODE_PER_CALL = PER_CALL + ("num_splits",)


class Launch:
    """The compiled kernel for one spec with its scalar arguments worked out (sm90/launch.Launch
    says why)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = use_tvm_ffi()
        self.cfg, self.fn = compiled_forward(spec, self.tvm_ffi)
        self.bind = Binder(PER_CALL, {**launch_scalars(spec, self.cfg.pack_gqa), "num_splits": 1},
                           arguments.ARGUMENTS, None if self.tvm_ffi else to_runtime)

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, page_table=None, learnable_sink=None) -> None:
        """page_table: the paged prefill's block table (k, v: the paged cache; the key lengths
        in seqused_k, cu_seqlens_k None). learnable_sink: float32 (nheads,) when the spec has
        a sink."""
        # cp.async moves 16 bytes: bases and strides 16-byte aligned (odd views are copied)
        q, k, v = aligned16(q), aligned16(k), aligned16(v)
        out_k = aligned16(out)
        args = self.bind(q, k, v, out_k, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         None, None, page_table, None, None, None, None, None, learnable_sink)
        call_kernel(self.fn, self.tvm_ffi, args, q.device)
        if out_k is not out:
            out.copy_(out_k)


# The split counters of fold_combine's decode kernels: zeros, left at zero by each launch, one
# buffer per (device, stream) (two launches at once must not share one), grown when a call
# has more tiles.
_split_counts: dict = {}


def split_counts(device: torch.device, tiles: int) -> torch.Tensor:
    # (the raw stream handle: building torch.cuda.current_stream's Stream object costs more
    # host time than the rest of this lookup, at every decode step)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    counts = _split_counts.get(key)
    if counts is None or counts.numel() < tiles:
        counts = _split_counts[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32,
                                                  device=device)
    return counts


class DecodeLaunch:
    """Attention of batched q against a KV cache (flash_attn_with_kvcache, after the new keys
    are appended): seqused_k holds each sequence's used length; the cache may be paged, rows
    picked by kv_batch_idx, keys start at leftpad_k. With num_splits > 1 the keys of each tile
    are split into that many ranges whose float32 partials are merged by their LSE. A learnable
    sink joins that merge (counted once, as one more term of the LSE), so a call with a sink
    takes the partial-output path even with one split."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = use_tvm_ffi()
        self.fns = {}  # split_kv -> compiled kernel (compiled on first use)
        # a step of at most 16 rows a kv head (all its query heads packed) on the 16-row tile
        # whose warps split the keys (Sm80FwdConfig.split_keys)
        self.split_keys = config.decode_split_keys(spec)
        scalars = dict(launch_scalars(spec, config.decode_pack_group(spec, self.split_keys)))
        self.bind = Binder(DECODE_PER_CALL, scalars, arguments.ARGUMENTS,
                           None if self.tvm_ffi else to_runtime)
        self.combine = None  # (compiled combine kernel, its binder), made on first use

    def _ones(self, q):
        """Descales of 1.0 for an fp8 cache called without them, (batch, nheads_k), kept."""
        shape = (q.shape[0], self.spec.nheads_k)
        if getattr(self, "ones", None) is None or self.ones.shape != shape or self.ones.device != q.device:
            self.ones = torch.ones(shape, dtype=torch.float32, device=q.device)
        return self.ones

    def _combine(self, has_sink: bool):
        if self.combine is None or self.combine[2] != has_sink:
            cfg = CombineConfig(CUTLASS_DTYPES[self.spec.dtype], self.spec.head_dim_v, has_sink)
            bind = Binder(("mOPartial", "mLSEPartial", "mSink", "mO", "mLSE", "num_splits"), {},
                          arguments.COMBINE_ARGUMENTS, None if self.tvm_ffi else to_runtime)
            self.combine = (_compiled_combine(cfg, self.tvm_ffi), bind, has_sink)
        return self.combine[:2]

    def _fn(self, split_kv: bool, fold: bool = False):
        fn = self.fns.get((split_kv, fold))
        if fn is None:
            spec = self.spec
            _, self.ctas_per_sm = config.decode_grid(spec, sm_count(spec.device_index),
                                                     smem_limit(spec.device_index))
            cfg = config.decode_config(
                CUTLASS_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal,
                spec.local, spec.has_softcap, spec.has_kv_batch_idx, spec.has_leftpad_k,
                spec.page_size if spec.paged_kv else 0, split_kv, spec.qhead_per_kvhead,
                smem_limit=smem_limit(spec.device_index), kv_fp8=FP8_FORMATS.get(spec.kv_dtype),
                split_keys=self.split_keys, ctas_per_sm=self.ctas_per_sm, fold_combine=fold)
            fn = self.fns[split_kv, fold] = _compiled(cfg, self.tvm_ffi)
        return fn

    def __call__(self, q, k_cache, v_cache, out, lse, seqused_k, kv_batch_idx=None,
                 leftpad_k=None, page_table=None, num_splits: int = 1,
                 learnable_sink=None, k_descale=None, v_descale=None) -> None:
        """k_descale, v_descale: an fp8 cache's (float32 (batch, nheads_k); None = 1.0)."""
        if self.spec.kv_dtype in FP8_FORMATS:
            # fp8 crosses into the kernel as its bytes (the kernel reads them as the format)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            k_descale, v_descale = (self._ones(q) if x is None else x.float().contiguous()
                                    for x in (k_descale, v_descale))
        q, k_cache, v_cache = aligned16(q), aligned16(k_cache), aligned16(v_cache)
        out_k = aligned16(out)
        o_part = lse_part = counts = None
        partials = num_splits > 1 or learnable_sink is not None
        # the merge in the decode kernel's last split of each tile (no combine launch), where
        # the switch is on, the merge is short, and there is no sink to merge
        fold = (partials and learnable_sink is None
                and config.decode_folds(self.spec, self.split_keys, q.shape[1], num_splits))
        if partials:
            b, sq, h = q.shape[:3]
            o_part = torch.empty(num_splits, b, sq, h, self.spec.head_dim_v, dtype=torch.float32,
                                 device=q.device)
            lse_part = torch.empty(num_splits, b, h, sq, dtype=torch.float32, device=q.device)
            if fold:  # (a tile per query row at most: enough counters for any tile shape)
                counts = split_counts(q.device, b * sq * h)
        args = self.bind(q, k_cache, v_cache, out_k, lse, None, None, None, seqused_k,
                         kv_batch_idx, leftpad_k, page_table, o_part, lse_part, counts,
                         k_descale, v_descale, None, num_splits)
        call_kernel(self._fn(partials, fold), self.tvm_ffi, args, q.device)
        if partials and not fold:  # the combine: the exact merge of the splits (and the sink) by their LSE
            fn, bind = self._combine(learnable_sink is not None)
            call_kernel(fn, self.tvm_ffi, bind(o_part, lse_part, learnable_sink, out_k, lse, num_splits),
                  q.device)
        if out_k is not out:
            out.copy_(out_k)


class Sm80Forward:
    """The kernel family of ("sm80", "fwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        # (the paged prefill runs the decode kernel's tiles, which take compiled widths only)
        reason = unserved_dtype_or_dims(spec, ARCH, "forward", config.SUPPORTED_HEAD_DIMS,
                                        padded_dims=not spec.paged_kv)
        if reason is not None:
            return reason
        try:
            sm80_configs(spec)
        except ValueError as e:  # no tile fits this device's shared memory
            return str(e)
        if spec.paged_kv:
            # the paged prefill: packed q, keys in pages (their lengths as seqused_k); the
            # other forms' rules, but for packed k
            if not spec.varlen_q or spec.page_size <= 0:
                return "paged keys need packed q (flash_attn_varlen_func) and a page size"
            form = dataclasses.replace(spec, paged_kv=False, varlen_k=True)
            return unserved_form(form, ARCH, "forward", sinks=True)
        # (a learnable sink: the epilogue's denominator, plain, packed and paged forms)
        return unserved_form(spec, ARCH, "forward", sinks=True)

    def launch(self, spec: AttentionSpec) -> Launch:
        return Launch(spec)


FORWARD = Sm80Forward()


class Sm80Decode:
    """The kernel family of ("sm80", "decode"): flash_attn_with_kvcache's attention (the
    portable kernel with the cache switches). Hopper registers it too (arch="sm90"): decoding
    is bound by reading the cache, which mma.sync keeps up with."""
    kind = "decode"

    def __init__(self, arch: str = ARCH):
        self.arch = arch

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        if spec.dtype not in CUTLASS_DTYPES:
            return f"dtype {spec.dtype} is not supported by the sm80 decode kernel (fp16, bf16)"
        if spec.head_dim not in config.DECODE_TILES or spec.head_dim_v != spec.head_dim:
            return (f"head_dim {spec.head_dim} (v: {spec.head_dim_v}) is not supported by the sm80 "
                    f"decode kernel (supported: equal head dims "
                    f"{', '.join(map(str, config.DECODE_TILES))})")
        if any(side is not None and side < 0 for side in (spec.window_left, spec.window_right)):
            return (f"window_size ({spec.window_left}, {spec.window_right}) has a negative edge: no "
                    "sm80 decode kernel serves it yet")
        if spec.kv_dtype is not None:
            if spec.kv_dtype not in FP8_FORMATS:
                return f"a {spec.kv_dtype} cache with {spec.dtype} q: no decode kernel reads one"
            target = target_capability(spec.device_index)
            if tuple(target) < FP8_MIN_CAPABILITY:
                return (f"an fp8 KV cache needs sm_89 or later (the decode kernel converts fp8 in "
                        f"hardware); this target is sm_{target[0]}{target[1]}")
        return None

    def launch(self, spec: AttentionSpec) -> DecodeLaunch:
        return DecodeLaunch(spec)


DECODE = Sm80Decode()
