"""The sm80 forward family: which specs it serves, and how a call becomes a launch.

The mma.sync path serves the GPUs without wgmma (sm_80, sm_86, sm_89, sm_120) and, chosen with
CUTEATTN_PATH=sm80 (dispatch.py), any later one: there it is compiled for the running arch but
uses only sm_80 instructions, which is how it is tested on Hopper. The tile shapes follow the
device's shared memory (config.py). One CTA per tile, no persistent grid: the grid is the tile
count, causal tiles longest first.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ... import compile_cache
from ...spec import AttentionSpec
from ..common.arguments import Binder, group_names
from ..launch_common import (CUTLASS_DTYPES, aligned16, kernel_scalars, l2_groups, to_runtime,
                             unserved_form, use_tvm_ffi)
from . import arguments, config

ARCH, KIND = "sm80", "fwd"
COMPILE_MODULE = "cuteattn.kernels.sm80.compile"

# The path compiles spill-free for every target (tests/test_compile_sm80.py) but has not yet run
# its GPU suite (tests/test_gpu_sm80.py). Until it has, it serves only calls that ask for it by
# name (CUTEATTN_PATH=sm80); other sm_8x/sm_12x calls take the reference with this reason.
# Deleted once the suite has passed on a GPU.
GPU_VERIFIED = False


@functools.lru_cache(maxsize=None)
def smem_limit(device_index: int) -> int:
    """Opt-in shared memory per block of the device (host-only callers: an sm_86's 99 KB)."""
    if device_index < 0:
        return config.SMEM_BY_CAPABILITY[(8, 6)]
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def sm80_config(spec: AttentionSpec):
    return config.fwd_config(
        CUTLASS_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
        spec.has_softcap, spec.varlen_q, spec.varlen_k, spec.has_seqused_q, spec.has_seqused_k,
        smem_limit=smem_limit(spec.device_index))


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


def launch_scalars(spec: AttentionSpec) -> dict:
    """The kernel's scalar arguments by name (arguments.SCALARS), as Python numbers."""
    score_scale, scale_log2, left, right = kernel_scalars(spec)
    small, num_small = l2_groups(spec)
    return dict(qhead_per_kvhead=spec.qhead_per_kvhead, score_scale=score_scale,
                softmax_scale_log2=scale_log2, window_left=left, window_right=right,
                l2_group=small, l2_small_groups=num_small)


# The arguments each call passes, in the order a launch passes them.
PER_CALL = ("mQ", "mK", "mV", "mO", "mLSE", *group_names("varlen", arguments.ARGUMENTS))


class Launch:
    """The compiled kernel for one spec with its scalar arguments worked out (sm90/launch.Launch
    says why)."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = use_tvm_ffi()
        self.fn = _compiled(sm80_config(spec), self.tvm_ffi)
        self.bind = Binder(PER_CALL, launch_scalars(spec), arguments.ARGUMENTS,
                           None if self.tvm_ffi else to_runtime)

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None) -> None:
        # cp.async moves 16 bytes: bases and strides 16-byte aligned (odd views are copied)
        q, k, v = aligned16(q), aligned16(k), aligned16(v)
        out_k = aligned16(out)
        args = self.bind(q, k, v, out_k, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        if self.tvm_ffi:
            self.fn(*args)
        else:
            import cuda.bindings.driver as cuda
            self.fn(*args, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
        if out_k is not out:
            out.copy_(out_k)


class Sm80Forward:
    """The kernel family of ("sm80", "fwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        supported = ", ".join(map(str, config.SUPPORTED_HEAD_DIMS))
        if spec.dtype not in CUTLASS_DTYPES:
            return f"dtype {spec.dtype} is not supported by the sm80 forward (fp16, bf16)"
        if spec.head_dim not in config.SUPPORTED_HEAD_DIMS:
            return (f"head_dim {spec.head_dim} is not supported by the sm80 forward "
                    f"(supported: {supported})")
        if spec.head_dim_v != spec.head_dim:
            return (f"head_dim_v {spec.head_dim_v} != head_dim {spec.head_dim} is not supported "
                    "by the sm80 forward")
        try:
            sm80_config(spec)
        except ValueError as e:  # no tile fits this device's shared memory
            return str(e)
        if not GPU_VERIFIED and os.environ.get("CUTEATTN_PATH") != ARCH:
            return ("the sm80 forward has not been verified on a GPU yet: set CUTEATTN_PATH=sm80 "
                    "to use it anyway")
        return unserved_form(spec, ARCH, "forward")

    def launch(self, spec: AttentionSpec) -> Launch:
        return Launch(spec)


FORWARD = Sm80Forward()
