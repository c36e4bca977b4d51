"""The sm90 backward family: which specs it serves, and how a call becomes a launch.

A backward call is three steps on the current stream, no host synchronisation:
  1. preprocess (a CuTe kernel, launch_common.bwd_preprocess): D = rowsum(dO * O) in float32
     and the LSE in log2 units (rows that saw no key get +inf, so their probabilities are 0),
     both laid out (batch, heads, rows) with the rows padded to a multiple of 4 (the kernel
     loads them with TMA: 16-byte strides);
  2. the kernel (bwd.py): dK and dV (per query head when GQA), dQ accumulated in float32;
  3. postprocess (PyTorch): dQ to the input dtype; under GQA, dK and dV summed over the query
     heads that share a kv head.
"""
from __future__ import annotations

import functools
from typing import Optional


from ... import compile_cache
from ...spec import AttentionSpec
from . import arguments
from .bwd import NUM_CONSUMER_WG, Sm90BwdConfig
from .config import kernel_width
from .pipelines import WG_ROWS
from ..launch_common import (CUTLASS_DTYPES, BackwardLaunch, compiled_width,
                            unserved_dtype_or_dims, unserved_form, use_tvm_ffi, sm_count)

ARCH, KIND = "sm90", "bwd"
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SMEM_LIMIT = 227 * 1024  # an H100 / H200 CTA's shared memory
COMPILE_MODULE = "cuteattn.kernels.sm90.compile"


# Head dims up to this run at their own width rounded up to 16 columns (config.kernel_width:
# d=80 as 80, not 96); wider ones between the compiled widths on the next of them (at 112 the
# packed-sequence variants spill).
NATIVE_WIDTH_MAX = 96

# Query rows per step of the d=64 kernels that take them (bwd_config's `tall`): 128 measured
# 1.04-1.16x of 64 with dQ by TMA (docs/perf-log.md)
D64_TILE_M = 128


def bwd_config(spec: AttentionSpec) -> Sm90BwdConfig:
    """A head dim runs at its kernel width (NATIVE_WIDTH_MAX) or on the next compiled width up:
    TMA reads q, k, v and dO zero-filled past their head dim, and the gradient buffers have
    the kernel's width (launch_common.bwd_buffers)."""
    head_dim = kernel_width(spec.head_dim)
    if head_dim > NATIVE_WIDTH_MAX:
        head_dim = compiled_width(spec.head_dim, SUPPORTED_HEAD_DIMS)
    # over 128, the warpgroups split the head dim of a 64-key block (bwd.Sm90BwdConfig.split_d)
    split = head_dim > 128
    tile_n = WG_ROWS if split else Sm90BwdConfig.tile_n
    # dQ's shares by one TMA reduce-add a warpgroup box (bwd.Sm90BwdConfig.dq_tma): 1.07-1.22x
    # at 4k-16k, packed sequences at d=128 1.07-1.23x; not where d=128 spills with it: packed
    # sequences with block-sparse lists or mods (36-48 bytes). (A window, packed softcap and
    # packed causal with seqused spilled 4-44 bytes until the warpgroup and packed indices
    # were warp-uniform; spill-free since.) Over 128 (split_d) at d=192: 1.25-1.36x; d=256 fits
    # its box only beside one Q / dO stage (0.95-1.02x with the consumers issuing, 0.97-1.01x
    # with the writer warp). Deterministic mode takes it at every head dim, its turns the writer
    # warp's (Sm90BwdConfig.dq_writer): 1.27-1.74x the consumers' reductions in turn (d=256
    # 1.27-1.49x)
    packed = spec.varlen_q or spec.varlen_k
    # dQ's additions in turn in deterministic mode only: plain d=256 in turns ran 0.76-0.87x its
    # blocked reductions beside two Q / dO stages (those beat the row-layout reductions the
    # turns were measured against, 1.01-1.16x, by 1.28x: docs/perf-log.md)
    ordered = spec.deterministic
    dq_tma_max = 256 if ordered else 192
    # (the blocked reductions in place of the box at d = 64-192 ran 0.89-1.01x)
    dq_tma = head_dim <= dq_tma_max and not (head_dim == 128 and packed and spec.mods_or_lists)
    # d=64 in query steps of D64_TILE_M rows (the S^T and dP^T GEMMs twice as wide), where
    # it compiles without spills: dQ by TMA, no lists or mods (windows and packed sequences
    # too since the uniform indices)
    tall = head_dim == 64 and dq_tma and not (spec.sparse_q_block or spec.mods_or_lists)
    # two Q / dO stages (three at d<=128 measured 0.93-1.01x: perf-log), if shared memory
    # holds them
    stages = Sm90BwdConfig.num_stages
    while stages > 1 and Sm90BwdConfig(
            CUTLASS_DTYPES[spec.dtype], head_dim, tile_n=tile_n, num_stages=stages,
            split_d=split, dq_tma=dq_tma, tile_m=D64_TILE_M if tall else 64).smem_bytes() > SMEM_LIMIT:
        stages -= 1
    return Sm90BwdConfig(
        dtype=CUTLASS_DTYPES[spec.dtype], head_dim=head_dim, tile_n=tile_n, num_stages=stages,
        split_d=split, causal=spec.causal, tile_m=D64_TILE_M if tall else 64,
        # dQ's additions under dK's GEMM: 1.00-1.07x at 4k-16k (perf-log); packed sequences
        # too since their indices are warp-uniform (they spilled 28-48 bytes at d=128 before);
        # not d=64's causal 128-row steps (20 bytes)
        dq_before_dk=not (tall and spec.causal),
        local=spec.local, has_softcap=spec.has_softcap, varlen_q=spec.varlen_q,
        varlen_k=spec.varlen_k, has_seqused_q=spec.has_seqused_q,
        has_seqused_k=spec.has_seqused_k, deterministic=ordered,
        # halves of 48 (40, 24, ...) columns would need a 32-byte swizzle on K: one warpgroup
        # takes all of dQ
        dq_single_wg=not split and head_dim % (NUM_CONSUMER_WG * 64) != 0 and head_dim != 64,
        sparse_q_block=spec.sparse_q_block,
        sparse_kv_half=spec.sparse_kv_block == Sm90BwdConfig.tile_n // 2,
        mask_mod=spec.mask_mod, score_mod=spec.score_mod,
        dq_tma=dq_tma,
        # the reduce-adds by the producer warpgroup's writer warp (deterministic mode: and the
        # turns); in plain mode too: 1.00-1.10x at d=64/128, 1.03-1.05x at d=192 at fixed
        # length (the consumers' warp 0 no longer waits for its warpgroup to stage); packed
        # sequences since their indices are warp-uniform (spill-free now)
        dq_writer=dq_tma,
        has_sink=spec.has_sink,
    )


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg: Sm90BwdConfig, tvm_ffi: bool, mask_mod_fn=None, score_mod_fn=None):
    def build():
        from .compile import compile_bwd
        return compile_bwd(cfg, tvm_ffi=tvm_ffi, mask_mod_fn=mask_mod_fn,
                           score_mod_fn=score_mod_fn), {}
    return compile_cache.get_or_compile((ARCH, KIND, tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=sources())


class BwdLaunch(BackwardLaunch):
    """The compiled backward for one spec; calling it runs the three steps."""

    def __init__(self, spec: AttentionSpec):
        cfg, tvm_ffi = bwd_config(spec), use_tvm_ffi()
        fns = (getattr(spec.mask_mod, "fn", None), getattr(spec.score_mod, "fn", None))
        super().__init__(spec, cfg, _compiled(cfg, tvm_ffi, *fns), tvm_ffi,
                         arguments.BWD_ARGUMENTS)

    def dq_blocks(self):
        """The reductions' pairs (where dQ is not added by TMA) into blocks of 8 rows: two lines
        a warp's addition, not 8 (1.14-1.29x, docs/perf-log.md); the TMA reduce-adds (dq_tma)
        keep q's row layout."""
        return None if self.cfg.dq_tma else "pairs"

    def heads_interleaved(self, q, cu_seqlens_q) -> int:
        """Deterministic mode with turns in key-block order (no causal or window mask, no
        lists): key block n of a head adds into each query block one turn-chain link (a few
        round trips to L2, about one query step's time) after block n - 1, so when a head's key
        blocks start together (the first wave) or closer than that (later waves, with several
        heads a wave) they idle. Interleaving G heads launches a head's neighbours G CTAs apart,
        G x (a CTA's walk) / (the SMs) apart in time. A walk of at least as many query steps as
        there are SMs needs none (later launches already come a step apart; G = 2 measured
        0.97x at 16k, d=128); shorter ones take the smallest divisor of the heads with
        G >= 2 x SMs / (query steps a walk), twice the spacing a link needs (1.14-1.27x at 1k
        and 4k)."""
        cfg = self.cfg
        if not cfg.interleaves_heads or q.device.type != "cuda":
            return 1
        batch = 1 if cu_seqlens_q is None else max(cu_seqlens_q.shape[0] - 1, 1)
        rows = q.shape[1] if cu_seqlens_q is None else q.shape[0] // batch
        steps = max(-(-rows // cfg.tile_m), 1)
        sms = sm_count(q.device.index or 0)
        want = 1 if steps >= sms else -(-2 * sms // steps)
        heads = self.spec.nheads
        return next((g for g in range(1, heads + 1) if heads % g == 0 and g >= want), heads)


class Sm90Backward:
    """The kernel family of ("sm90", "bwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        # (a learnable sink: the forward's LSE holds it, so P and dS are the kernel's as they
        # are; the sink's own gradient is launch_common.sink_gradient's)
        return (unserved_dtype_or_dims(spec, ARCH, "backward", SUPPORTED_HEAD_DIMS, padded_dims=True,
                                       narrower_v=True)
                or unserved_form(spec, ARCH, "backward", mods=True, sinks=not spec.mods_or_lists)
                or unserved_wide(spec)
                or unserved_sparse(spec)
                or unserved_mods(spec))

    def launch(self, spec: AttentionSpec) -> BwdLaunch:
        return BwdLaunch(spec)


def unserved_wide(spec: AttentionSpec) -> Optional[str]:
    """Head dims over 128 (the split_d kernel) take neither block-sparse lists nor mods yet."""
    if spec.head_dim <= 128 or not spec.mods_or_lists:
        return None
    return (f"block-sparse lists or mods at head_dim {spec.head_dim}: the sm90 backward takes "
            "them at head dims up to 128")


def unserved_sparse(spec: AttentionSpec) -> Optional[str]:
    """The reason the block-sparse backward does not take spec, or None (also when dense)."""
    if not spec.sparse_q_block:
        return None
    key_blocks = (Sm90BwdConfig.tile_n, Sm90BwdConfig.tile_n // 2)  # (64: pairs of them)
    if spec.sparse_kv_block not in key_blocks or spec.sparse_q_block not in (64, 128):
        return (f"block-sparse backward of {spec.sparse_q_block}x{spec.sparse_kv_block} blocks: "
                f"the sm90 kernel takes 128 or 64 query rows by {key_blocks[0]} or "
                f"{key_blocks[1]} keys")
    packed = spec.varlen_q or spec.varlen_k or spec.has_seqused_q or spec.has_seqused_k
    if packed and spec.deterministic:
        # (lists sized for the longest sequence name blocks past a shorter one's end, which
        # the kernel visits as its end block; the turns table counts them where they are listed)
        return "deterministic block-sparse backward with packed sequences or seqused: no sm90 kernel yet"
    return None  # (packed sequences: the lists' batch mode is the sequence, as the forward's)


def unserved_mods(spec: AttentionSpec) -> Optional[str]:
    """The reason the backward does not trace spec's mods, or None (also without them). A
    score_mod is traced with a Dual score (common/mods.py): its derivative by the score is
    the gradient's; the tensors it reads get none (the API sends those that need one to the
    reference)."""
    if spec.mask_mod is None and spec.score_mod is None:
        return None
    if spec.sparse_kv_block == Sm90BwdConfig.tile_n // 2:
        return "mask_mod / score_mod with 64-key block-sparse lists: no sm90 backward kernel yet"
    if spec.score_mod is not None and spec.has_softcap:
        return "softcap with a score_mod: no sm90 backward kernel (write the softcap in the score_mod)"
    if not all(hasattr(m, "fn") for m in (spec.mask_mod, spec.score_mod) if m is not None):
        return "mask_mod / score_mod: the function is not attached to the spec"
    return None


BACKWARD = Sm90Backward()
