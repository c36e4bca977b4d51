"""The sm90 backward family: which specs it serves, and how a call becomes a launch.

A backward call is three steps on the current stream, no host synchronisation:
  1. preprocess (PyTorch, launch_common.bwd_preprocess): D = rowsum(dO * O) in float32 and the LSE in log2 units (rows that saw
     no key get +inf, so their probabilities are 0), both laid out (batch, heads, rows) with the
     rows padded to a multiple of 4 (the kernel loads them with TMA: 16-byte strides);
  2. the kernel (bwd.py): dK and dV (per query head when GQA), dQ accumulated in float32;
  3. postprocess (PyTorch): dQ to the input dtype; under GQA, dK and dV summed over the query
     heads that share a kv head.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ... import compile_cache
from ...spec import AttentionSpec
from . import arguments
from .bwd import NUM_CONSUMER_WG, Sm90BwdConfig
from ..launch_common import (CUTLASS_DTYPES, aligned16, bwd_buffers, bwd_postprocess,
                            bwd_preprocess, kernel_scalars, to_runtime, unserved_dtype_or_dims,
                            unserved_form, use_tvm_ffi)

ARCH, KIND = "sm90", "bwd"
SUPPORTED_HEAD_DIMS = (64, 96, 128)
COMPILE_MODULE = "cuteattn.kernels.sm90.compile"


# bwd.Sm90BwdConfig.dq_store for launches: "red" is GPU-verified; "bulk" is staged for an A/B
# (set here, or per config in a benchmark process, then delete the loser).
DQ_STORE = "red"


def bwd_config(spec: AttentionSpec) -> Sm90BwdConfig:
    return Sm90BwdConfig(
        dtype=CUTLASS_DTYPES[spec.dtype], head_dim=spec.head_dim, causal=spec.causal,
        local=spec.local, has_softcap=spec.has_softcap, varlen_q=spec.varlen_q,
        varlen_k=spec.varlen_k, has_seqused_q=spec.has_seqused_q,
        has_seqused_k=spec.has_seqused_k, deterministic=spec.deterministic,
        # halves of 48 columns would need a 32-byte swizzle on K: one warpgroup takes all of dQ
        dq_single_wg=spec.head_dim % (NUM_CONSUMER_WG * 64) != 0 and spec.head_dim != 64,
        dq_store=DQ_STORE,
    )


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg: Sm90BwdConfig, tvm_ffi: bool):
    def build():
        from .compile import compile_bwd
        return compile_bwd(cfg, tvm_ffi=tvm_ffi), {}
    return compile_cache.get_or_compile((ARCH, KIND, tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=sources())


# What each call passes (in this order); the scalars fixed per spec come from BwdLaunch.
PER_CALL = ("mQ", "mK", "mV", "mdO", "mLSE2", "mD", "mdQacc", "mdK", "mdV",
            *arguments.group_names("varlen", arguments.BWD_ARGUMENTS), "mSemaphore",
            "num_n_blocks")


class BwdLaunch:
    """The compiled backward for one spec; calling it runs the three steps."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.cfg = bwd_config(spec)
        self.tvm_ffi = use_tvm_ffi()
        self.fn = _compiled(self.cfg, self.tvm_ffi)
        score_scale, scale_log2, left, right = kernel_scalars(spec)
        fixed = dict(qhead_per_kvhead=spec.qhead_per_kvhead, softmax_scale=spec.softmax_scale,
                     score_scale=score_scale, softmax_scale_log2=scale_log2, window_left=left,
                     window_right=right)
        self.bind = arguments.Binder(PER_CALL, fixed, None if self.tvm_ffi else to_runtime,
                                     entries=arguments.BWD_ARGUMENTS)

    def __call__(self, dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None):
        spec, cfg = self.spec, self.cfg
        packed = cu_seqlens_q is not None
        q, k, v, dout = (aligned16(t) for t in (q, k, v, dout))
        lse2, dsum = bwd_preprocess(dout, out, lse, cu_seqlens_q, seqused_q, cfg.tile_m)
        dq_acc, dk, dv = bwd_buffers(spec, q, k)
        if packed:
            batch = cu_seqlens_q.shape[0] - 1
            n_blocks = k.shape[0] // cfg.tile_n + batch  # bounds sum_b ceil(len_b / tile_n)
            slots = q.shape[0] // cfg.tile_m + 2 * batch + 1
        else:
            batch = q.shape[0]
            n_blocks = -(-k.shape[1] // cfg.tile_n)
            slots = batch * -(-q.shape[1] // cfg.tile_m)
        semaphore = torch.zeros((spec.nheads, slots if cfg.deterministic else 1), dtype=torch.int32,
                                device=q.device)
        if n_blocks > 0:
            args = self.bind(q, k, v, dout, lse2, dsum, dq_acc, dk, dv, cu_seqlens_q,
                             cu_seqlens_k, seqused_q, seqused_k, semaphore, n_blocks)
            if self.tvm_ffi:
                self.fn(*args)
            else:
                import cuda.bindings.driver as cuda
                self.fn(*args, cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
        return bwd_postprocess(dq_acc, dk, dv, q, k, spec.qhead_per_kvhead)


class Sm90Backward:
    """The kernel family of ("sm90", "bwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        return (unserved_dtype_or_dims(spec, ARCH, "backward", SUPPORTED_HEAD_DIMS)
                or unserved_form(spec, ARCH, "backward"))

    def launch(self, spec: AttentionSpec) -> BwdLaunch:
        return BwdLaunch(spec)


BACKWARD = Sm90Backward()
