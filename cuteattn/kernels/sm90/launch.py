"""The sm90 forward family: which specs it serves, and how a call becomes a launch.

The host side of kernels/sm90 (the one module here that imports torch): the spec becomes the
kernel's static configuration (config.py), which is the compile key; the compiled kernel comes
from the compile cache; the launch policy (persistent grid size, the causal tile order's L2 groups,
the tile counter) and the scalar arguments are worked out once per Launch, so that a repeated
call only converts its tensors and launches. No host synchronisation, no per-call compilation.
dispatch.py registers the family (families.py lists it) when an sm90 device first asks.
"""
from __future__ import annotations

import functools
from typing import Optional

import cutlass
import torch

from ... import compile_cache
from ..._checks import FP8
from ...sparse import KERNEL_BLOCKS
from ...spec import AttentionSpec
from ..launch_common import (CUTLASS_DTYPES, aligned16, call_kernel, kernel_scalars, l2_groups, sm_count,
                            to_runtime, unserved_dtype_or_dims, unserved_form, use_tvm_ffi)
from ..common.convert import FP8_KEY_ORDER
from . import arguments, config
from .arguments import NO_FP8, NO_SPARSE, NO_VARLEN, Fp8Descales, SparseMetadata, VarlenMetadata

ARCH, KIND = "sm90", "fwd"
# the kernel's q/k/v dtypes: fp16/bf16, and fp8 (FlashAttention-3's, with descales; out in bf16)
KERNEL_DTYPES = {**CUTLASS_DTYPES, FP8: cutlass.Float8E4M3FN}


def sm90_config(spec: AttentionSpec):
    """The kernel's static configuration for spec (config.fwd_config: the tiles depend on the
    sequence length class too, config.SHORT_SEQLEN)."""
    return config.fwd_config(
        KERNEL_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
        spec.has_softcap, spec.varlen_q, spec.varlen_k, spec.has_seqused_q, spec.has_seqused_k,
        max_seqlen_q=spec.seqlen_q,
        sparse_block=(spec.sparse_q_block, spec.sparse_kv_block) if spec.sparse_q_block else None,
    )


# The compiled code depends on compile.py and what it imports (fwd.py, arguments.py, common/):
# the disk cache's fingerprint covers those. Not config.py (its choices are in the key) nor this
# file (its choices are runtime arguments).
COMPILE_MODULE = "cuteattn.kernels.sm90.compile"


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    """The files the family's compiled code depends on (compile_cache.module_sources)."""
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg, tvm_ffi: bool):
    """The compiled kernel for cfg. The key is the frozen config itself: every field of it
    changes the code, and nothing else does (sizes and scales are runtime arguments)."""
    def build():
        from .compile import compile_fwd_with_report
        return compile_fwd_with_report(cfg, tvm_ffi=tvm_ffi)
    key = (ARCH, KIND, tvm_ffi, cfg)
    return compile_cache.get_or_compile(key, build, persist=tvm_ffi, sources=sources())


# The kernel's grid is persistent: one CTA per SM walks the tiles (fwd.py says why; one CTA per
# tile measured 2-11% slower, docs/perf-log.md). Host-only callers (tests) have no SMs to count.
_ONE_CTA_PER_TILE = (1 << 31) - 1


def max_ctas(spec: AttentionSpec) -> int:
    """The persistent grid's size: one CTA per SM (a CTA fills an SM's shared memory)."""
    if spec.device_index < 0:
        return _ONE_CTA_PER_TILE
    return sm_count(spec.device_index)


# The counter a dynamically scheduled kernel draws its tiles from (fwd.py: dynamic_tiles). The
# kernel leaves it at zero when it ends, but two launches running at once must not share one,
# so there is one per (device, stream). Kernels without dynamic tiles ignore it: one per device.
_tile_counters: dict = {}


def tile_counter(device_index: int, per_stream: bool) -> torch.Tensor:
    stream = torch.cuda.current_stream(device_index).cuda_stream if (
        per_stream and device_index >= 0) else None
    key = (device_index, stream)
    counter = _tile_counters.get(key)
    if counter is None:
        device = torch.device("cuda", device_index) if device_index >= 0 else torch.device("cpu")
        counter = _tile_counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def launch_scalars(spec: AttentionSpec) -> dict:
    """The kernel's scalar arguments by name (arguments.SCALARS), as Python numbers."""
    score_scale, scale_log2, left, right = kernel_scalars(spec)
    small, num_small = l2_groups(spec)
    return dict(qhead_per_kvhead=spec.qhead_per_kvhead, score_scale=score_scale,
                softmax_scale_log2=scale_log2, window_left=left, window_right=right,
                max_ctas=max_ctas(spec), l2_group=small, l2_small_groups=num_small)


# The kernel's arguments each call passes, in the order a launch passes them (the varlen group
# as its VarlenMetadata fields); the scalars come from launch_scalars. arguments.Binder puts
# both in the kernel's order.
PER_CALL = ("mQ", "mK", "mV", "mO", "mLSE", *arguments.group_names("varlen"),
            *arguments.group_names("sparse"), *arguments.group_names("fp8"), "mTileCounter")


def _binder(scalars: dict, tvm_ffi: bool) -> arguments.Binder:
    return arguments.Binder(PER_CALL, scalars, None if tvm_ffi else to_runtime)


def launch_arguments(spec: AttentionSpec, q, k, v, out, lse, varlen: VarlenMetadata = NO_VARLEN,
                     tvm_ffi: bool = False, scalars: Optional[dict] = None,
                     counter: Optional[torch.Tensor] = None,
                     sparse: SparseMetadata = NO_SPARSE, fp8: Fp8Descales = NO_FP8) -> tuple:
    """The compiled kernel's arguments, less the stream, in the order arguments.ARGUMENTS
    declares: cute runtime tensors and scalars, or for TVM-FFI as they are.
    `scalars`: launch_scalars(spec), when the caller kept them."""
    if counter is None:
        counter = tile_counter(spec.device_index, per_stream=False)
    bind = _binder(launch_scalars(spec) if scalars is None else scalars, tvm_ffi)
    return bind(q, k, v, out, lse, *varlen, *sparse, *fp8, counter)


class Launch:
    """The compiled kernel for one spec with its scalar arguments worked out: calling it costs
    only the per-tensor work (alignment check, argument conversion) and the launch itself.
    The API keeps one per distinct call signature, so a repeated call skips everything else."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = use_tvm_ffi()
        cfg = sm90_config(spec)
        self.fn = _compiled(cfg, self.tvm_ffi)
        self.scalars = launch_scalars(spec)
        self.bind = _binder(self.scalars, self.tvm_ffi)
        self.dynamic_tiles = cfg.dynamic_tiles

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, sparse: SparseMetadata = NO_SPARSE,
                 descales=(None, None, None)) -> None:
        """sparse: the block-sparse lists (int32, contiguous in their last mode) when the spec
        is block-sparse. descales: fp8 inputs' (q, k, v) descales, float32 (batch, nheads_k);
        None = 1.0."""
        fp8 = NO_FP8
        if self.spec.dtype == FP8:
            # the bytes cross into the kernel (arguments.py); V transposed for the fp8 P V GEMM
            q, k, v = q.view(torch.uint8), k.view(torch.uint8), fp8_value_operand(v)
            fp8 = Fp8Descales(*(self._ones(q, k) if x is None else x for x in descales))
        q, k, v = aligned16(q), aligned16(k), aligned16(v)
        out_k = aligned16(out) if out.dtype == torch.bfloat16 or self.spec.dtype != FP8 else (
            torch.empty_like(out, dtype=torch.bfloat16))  # (fp8's out is bf16 in the kernel)
        counter = tile_counter(self.spec.device_index, per_stream=self.dynamic_tiles)
        # the varlen values in VarlenMetadata's order, as PER_CALL has them
        args = self.bind(q, k, v, out_k, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         *sparse, *fp8, counter)
        call_kernel(self.fn, self.tvm_ffi, args, q.device)
        if out_k is not out:
            out.copy_(out_k)

    def _ones(self, q, k) -> torch.Tensor:
        """A missing descale: ones of (batch, nheads_k), kept for the next call."""
        shape = (q.shape[0], k.shape[2])
        ones = getattr(self, "_ones_cache", None)
        if ones is None or tuple(ones.shape) != shape or ones.device != q.device:
            ones = self._ones_cache = torch.ones(shape, dtype=torch.float32, device=q.device)
        return ones


def forward(spec: AttentionSpec, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None) -> None:
    """Launches the forward kernel on the current stream: writes `out` and `lse` (float32)."""
    Launch(spec)(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)


def fp8_value_operand(v: torch.Tensor) -> torch.Tensor:
    """fp8 V (batch, seqlen_k, nheads_k, d_v) as the fp8 P V GEMM takes it (its operands must
    both be K-major): its bytes transposed to (batch, nheads_k, d_v, seqlen_k rounded up to 16,
    the extra keys zero), the keys of each 16-key group in FP8_KEY_ORDER (convert.fp8_p_fragment
    says why). One gather kernel (and a zero fill when seqlen_k is not a multiple of 16)."""
    b, s, hk, dv = v.shape
    x = v.view(torch.uint8)
    s16 = -(-s // 16) * 16
    if s16 != s:
        padded = torch.zeros((b, s16, hk, dv), dtype=torch.uint8, device=v.device)
        padded[:, :s] = x
        x = padded
    order = _key_order(v.device)
    groups = x.view(b, s16 // 16, 16, hk, dv).permute(0, 3, 4, 1, 2)  # (b, hk, dv, G, 16)
    return groups[..., order].reshape(b, hk, dv, s16)


@functools.lru_cache(maxsize=None)
def _key_order(device) -> torch.Tensor:
    return torch.tensor(FP8_KEY_ORDER, dtype=torch.long, device=device)


def unserved_fp8(spec: AttentionSpec) -> Optional[str]:
    """The reason the fp8 forward does not take spec (an fp8 spec), or None."""
    if spec.head_dim not in config.SUPPORTED_HEAD_DIMS or spec.head_dim_v != spec.head_dim:
        return (f"fp8 at head_dim {spec.head_dim} (head_dim_v {spec.head_dim_v}): the sm90 fp8 "
                f"forward takes head dims {', '.join(map(str, config.SUPPORTED_HEAD_DIMS))}, "
                f"head_dim_v equal")
    if spec.varlen_q or spec.varlen_k or spec.has_seqused_q or spec.has_seqused_k:
        return "fp8 with packed sequences or seqused: no sm90 fp8 kernel yet"
    if spec.sparse_q_block:
        return "fp8 block-sparse: no sm90 fp8 kernel yet"
    return None


class Sm90Forward:
    """The kernel family of ("sm90", "fwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        if spec.dtype == FP8:
            return unserved_fp8(spec) or unserved_form(spec, ARCH, "forward")
        return (unserved_dtype_or_dims(spec, ARCH, "forward", config.SUPPORTED_HEAD_DIMS,
                                       padded_dims=True)
                or unserved_form(spec, ARCH, "forward") or unserved_sparse(spec))

    def launch(self, spec: AttentionSpec) -> Launch:
        return Launch(spec)


def unserved_sparse(spec: AttentionSpec) -> Optional[str]:
    """The reason the block-sparse kernel does not take spec, or None (also for dense specs)."""
    if not spec.sparse_q_block:
        return None
    block = (spec.sparse_q_block, spec.sparse_kv_block)
    if block not in KERNEL_BLOCKS:
        shapes = ", ".join(f"{q}x{k}" for q, k in KERNEL_BLOCKS)
        return f"block-sparse blocks of {block[0]}x{block[1]}: the sm90 kernel takes {shapes}"
    if spec.head_dim > config.SPARSE_MAX_HEAD_DIM:
        return (f"block-sparse at head_dim {spec.head_dim}: the sm90 kernel takes head dims up "
                f"to {config.SPARSE_MAX_HEAD_DIM}")
    if spec.varlen_q or spec.varlen_k or spec.has_seqused_q or spec.has_seqused_k:
        return "block-sparse with packed sequences or seqused: no sm90 kernel yet"
    return None


FORWARD = Sm90Forward()
