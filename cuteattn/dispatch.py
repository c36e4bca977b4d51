"""Which kernel serves an AttentionSpec on a device, and the launch.

`can_implement` answers with None (served) or the reason it is not, so the API can fall back to
the reference or, in strict mode, raise with that reason. `forward` turns the spec into the
kernel's static configuration (the compile key), fetches the compiled kernel from the cache and
launches it on the current stream. No host synchronisation, no per-call compilation.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from . import compile_cache
from .spec import AttentionSpec

_UNBOUNDED = 1 << 30  # a window side of -1 (unbounded) as the kernel sees it
_LOG2E = 1.0 / math.log(2.0)


def can_implement(spec: AttentionSpec, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"no kernel for device type {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"no kernel for sm_{major}{minor} yet (only sm_90a)"
    from .kernels.sm90.config import SUPPORTED_HEAD_DIMS
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {spec.head_dim} is not supported by the sm90 kernel"
    if spec.head_dim_v != spec.head_dim:
        return "head_dim_v != head_dim is not supported by the sm90 kernel"
    if spec.varlen_q != spec.varlen_k:
        return "the sm90 kernel needs q and k both packed (cu_seqlens) or both batched"
    return None


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass
    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


def sm90_config(spec: AttentionSpec):
    from .kernels.sm90.config import fwd_config
    return fwd_config(
        _cutlass_dtype(spec.dtype), spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
        spec.has_softcap, spec.varlen_q, spec.varlen_k, spec.has_seqused_q, spec.has_seqused_k,
        max_seqlen_q=spec.seqlen_q,
    )


# Call the kernels through TVM-FFI: torch tensors and Python numbers go straight in and the
# stream comes from torch, ~1 us per call instead of ~95 us of DLPack conversion (host-only
# probe on the CPU). GPU-verified at c5a578c (benchmarks/dev_smoke.py tvm: 136 cases correct).
# Without apache-tvm-ffi installed, or with this set to False, calls go through DLPack.
USE_TVM_FFI = True


def _use_tvm_ffi() -> bool:
    if not USE_TVM_FFI:
        return False
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


def _compiled(spec: AttentionSpec, tvm_ffi: bool, cfg=None):
    """The compiled kernel for spec, keyed by the spec's static part and the tile shape (which
    also depends on the sequence length class, config.SHORT_SEQLEN)."""
    cfg = cfg or sm90_config(spec)

    def build():
        from .kernels.sm90.compile import compile_fwd_with_report
        return compile_fwd_with_report(cfg, tvm_ffi=tvm_ffi)
    key = ("sm90", "fwd", tvm_ffi) + spec.compile_key() + (
        cfg.num_wg, cfg.tile_n, cfg.num_stages, cfg.o_path, cfg.tma_store_o,
        cfg.split_mask_loop)
    return compile_cache.get_or_compile(key, build, persist=tvm_ffi)


# The kernel's grid is persistent: one CTA per SM walks the tiles (fwd.py says why). False
# launches one CTA per tile instead (the same compiled kernel), to compare the two.
PERSISTENT = True
_ONE_CTA_PER_TILE = (1 << 31) - 1


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def max_ctas(spec: AttentionSpec) -> int:
    """The persistent grid's size: one CTA per SM (a CTA fills an SM's shared memory)."""
    if not PERSISTENT or spec.device_index < 0:
        return _ONE_CTA_PER_TILE
    return _sm_count(spec.device_index)


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    if device_index < 0:
        return 50 << 20  # an H100/H200's, for host-only callers (tests)
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def l2_group(spec: AttentionSpec) -> int:
    """(batch, head) pairs per group of the causal/windowed tile order (common/tile_scheduler.py):
    as many as have K/V in half the L2 (the other half for the next group's first tiles, Q and O),
    in whole GQA groups, at least one."""
    elem = spec.dtype.itemsize
    kv_head_bytes = max(spec.seqlen_k, 1) * (spec.head_dim + spec.head_dim_v) * elem
    kv_heads = max(1, (_l2_bytes(spec.device_index) // 2) // kv_head_bytes)
    return kv_heads * spec.qhead_per_kvhead


def balanced_l2_groups(pairs: int, max_pairs: int, unit: int) -> tuple:
    """(pairs per small group, number of small groups) of the causal tile order: as few groups
    as `max_pairs` per group allows, their sizes within one `unit` (the pairs sharing K/V under
    GQA) of each other; the groups after the small ones have `unit` more pairs."""
    units = max(pairs // unit, 1)
    num_groups = -(-units // max(max_pairs // unit, 1))
    return units // num_groups * unit, num_groups - units % num_groups


def l2_groups(spec: AttentionSpec) -> tuple:
    """(pairs per small group, number of small groups): l2_group's budget, balanced."""
    return balanced_l2_groups(max(spec.batch * spec.nheads, 1), l2_group(spec),
                              spec.qhead_per_kvhead)


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


def _to_cute(t: Optional[torch.Tensor], align: int = 16):
    if t is None:
        return None
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.ndim - 1)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA (and the kernel's compiled promise) needs a 16-byte aligned base and strides that are
    multiples of 16 bytes. Tensors that are not (odd views, storage offsets) are copied."""
    unit = 16 // t.element_size()
    if t.data_ptr() % 16 == 0 and all(st % unit == 0 for st in t.stride()[:-1]):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def kernel_scalars(spec: AttentionSpec):
    """(score_scale, softmax_scale_log2, window_left, window_right) as the kernel takes them."""
    if spec.has_softcap:
        # s' = softcap * tanh(s * scale / softcap); exp(s') = exp2(tanh(...) * softcap * log2 e)
        score_scale = spec.softmax_scale / spec.softcap
        scale_log2 = spec.softcap * _LOG2E
    else:
        score_scale = spec.softmax_scale
        scale_log2 = spec.softmax_scale * _LOG2E
    left = _UNBOUNDED if spec.window_left < 0 else spec.window_left
    right = _UNBOUNDED if spec.window_right < 0 else spec.window_right
    return score_scale, scale_log2, left, right


def launch_scalars(spec: AttentionSpec) -> tuple:
    """(max_seqlen_q, qhead_per_kvhead, score_scale, softmax_scale_log2, window_left,
    window_right, max_ctas, l2_group, l2_small_groups): the kernel's scalar arguments, in order."""
    score_scale, scale_log2, left, right = kernel_scalars(spec)
    return (max(spec.seqlen_q, 1), spec.qhead_per_kvhead, score_scale, scale_log2, left, right,
            max_ctas(spec), *l2_groups(spec))


def launch_arguments(spec: AttentionSpec, q, k, v, out, lse, cu_seqlens_q=None,
                     cu_seqlens_k=None, seqused_q=None, seqused_k=None, tvm_ffi=False,
                     scalars=None, counter=None) -> tuple:
    """The compiled kernel's arguments, less the stream: (q, k, v, out, lse, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, tile_counter, max_seqlen_q, qhead_per_kvhead, score_scale,
    softmax_scale_log2, window_left, window_right, max_ctas, l2_group, l2_small_groups); cute runtime tensors and scalars,
    or as they are for TVM-FFI. `scalars`: launch_scalars(spec), when the caller kept them."""
    if counter is None:
        counter = tile_counter(spec.device_index, per_stream=False)
    tensors = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, counter)
    if scalars is None:
        scalars = launch_scalars(spec)
    if tvm_ffi:
        return tensors + scalars
    from cutlass import Float32, Int32
    converted = tuple(_to_cute(t) for t in tensors[:4]) + (_to_cute(lse, 4),) + tuple(
        _to_cute(t, 4) for t in tensors[5:])
    return converted + tuple(kind(x) for kind, x in zip(
        (Int32, Int32, Float32, Float32, Int32, Int32, Int32, Int32, Int32), scalars))


class Launch:
    """The compiled kernel for one spec with its scalar arguments worked out: calling it costs
    only the per-tensor work (alignment check, argument conversion) and the launch itself.
    The API keeps one per distinct call signature, so a repeated call skips everything else."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = _use_tvm_ffi()
        cfg = sm90_config(spec)
        self.fn = _compiled(spec, self.tvm_ffi, cfg)
        self.scalars = launch_scalars(spec)
        self.dynamic_tiles = cfg.dynamic_tiles

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None) -> None:
        q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
        out_k = _tma_ready(out)
        counter = tile_counter(self.spec.device_index, per_stream=self.dynamic_tiles)
        args = launch_arguments(self.spec, q, k, v, out_k, lse, cu_seqlens_q, cu_seqlens_k,
                                seqused_q, seqused_k, self.tvm_ffi, self.scalars, counter)
        if self.tvm_ffi:
            self.fn(*args)
        else:
            import cuda.bindings.driver as cuda
            self.fn(*args, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
        if out_k is not out:
            out.copy_(out_k)


def forward(spec: AttentionSpec, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None) -> None:
    """Launches the forward kernel on the current stream: writes `out` and `lse` (float32)."""
    Launch(spec)(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
