"""The sm80 backward family: which specs it serves, and how a call becomes a launch.

Three steps on the current stream, no host synchronisation, as for sm90 (launch_common has the
PyTorch steps): the preprocess (D = rowsum(dO * O), the LSE in log2 units, rows padded per
sequence), the kernel (bwd.py: dK and dV per query head, dQ accumulated in float32), the
postprocess (dQ to the input dtype, GQA's dK and dV summed per kv head).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from ... import compile_cache
from ...spec import AttentionSpec
from ..compile_common import first_spill_free, from_candidate
from ..launch_common import (CUTLASS_DTYPES, BackwardLaunch, compiled_width,
                             shared_memory_per_sm, sm_count, unserved_dtype_or_dims,
                             unserved_form, use_tvm_ffi)
from . import arguments
from .bwd import Sm80BwdConfig
from .launch import ARCH, COMPILE_MODULE, smem_limit, target_capability

KIND = "bwd"
# Head dims over 128 where the grids' tile does not fit (99 KB targets) run in column passes
# (bwd.Sm80BwdConfig.kv_passes, 64 columns each: one CTA of bwd.py's layout holding dK and dV of
# every column would need 2d float32 registers a thread).
WIDE_HEAD_DIMS = (192, 256)
SUPPORTED_HEAD_DIMS = (64, 96, 128) + WIDE_HEAD_DIMS
# (tile_m, tile_n, warps) of those passes, the first that fits the target's shared memory:
# 32 x 64 at d=192 and 32 x 32 at d=256 in the 99 KB of sm_86/89/120; 16-row query blocks do
# not tile (the copy passes).
WIDE_TILES = ((32, 64, 4), (32, 32, 2))
PASS_COLS = 64  # dK's and dV's columns a pass (a whole 128-byte swizzle atom)
# dQ = dS K's warps along the queries on 8-warp tiles: 2 (4 along the columns; 32-row warp
# tiles read 7% fewer ldmatrix a block than 4 x 2 at d = 64 and 128, and ran 1.03-1.05x on the
# H200, docs/perf-log.md); 4-warp tiles keep tile_m / 16 (2 x 2 spilled 16 bytes at d = 256)
DQ_WARPS_M_8_WARPS = 2
# Head dims on the two-dimensional warp grids of bwd_grid.py (8 warps; P and dS through shared
# memory; 0.85x / 0.71x the ldmatrix a block of bwd.py's layout at d = 64 / 128), with their
# (tile_m, tile_n), where that tile fits the target's shared memory: 1.06-1.09x / 1.11-1.12x /
# 1.18-1.19x over bwd.py at d = 64 / 96 / 128 on the H200; over 128 in one pass of 64 keys (dK
# and dV of 32 keys x d/4 columns a warp, as FlashAttention-2 runs d = 256), not bwd.py's
# column passes that recompute S and dP: 1.14-1.25x at d = 192, 1.40-1.48x at d = 256
# (docs/perf-log.md). d = 128 with softcap too: 1.10-1.13x bwd.py on the H200, spill-free since
# dQ's blocked accumulator. Not at d = 128 with a sliding window, padded head dim or packed
# sequences: 128 keys spilled 8-32 bytes there (sm_80/90), and 64 keys on the grids ran
# 0.73-0.95x of bwd.py's 128 (0.82-0.84x of its 99 KB tile); but packed deterministic ones
# (dQ in split accumulators) take the grid where it compiles spill-free (sm_90a's causal:
# 253 registers), the launch falling back to bwd.py's layout where it spills: 1.75-1.81x at
# 8 x 2048 tokens, 1.04x on the skewed lengths (H100, d=128 bf16 packed deterministic).
GRID = True
GRID_TILES = {64: (64, 128), 96: (64, 128), 128: (64, 128), 192: (64, 64), 256: (64, 64)}
# 128 queries a block at d = 64 (FlashAttention-2's d=64 tile on sm_80) where it fits with the
# Q/dO ring (166 KB: sm_80 and Hopper): 1.03-1.06x of 64 on the H200 (docs/perf-log.md);
# spill-free on sm_90a at 242-252 registers; without the ring the causal variant spilled 56
# bytes, softcap 24 and packed causal 64 with it, so the 64-query tile stays for those and
# where the ring does not fit
GRID_D64_TILE_M = 128
# Deterministic dQ (docs/perf-log.md, 2026-12-05), by the compiled head dim:
# - up to DQ_SPLITS_MAX_DIM, in split accumulators (Sm80BwdConfig.dq_splits, FlashAttention-2's
#   deterministic backward): no semaphore wait, fence or barrier pair a query block, at the cost
#   of a zeroed accumulator per split and one sum. On the H200 at d=64/128: 1.07-1.38x of the
#   turns without a mask, 2.0-2.4x causal;
# - above it, in turns (common/dq_order.py), descending under a causal or windowed mask, the
#   order the key blocks reach a query block (as the sm90 backward runs it): 1.3-1.8x of the
#   ascending turns at d=192/256 causal. The splits there ran 0.79-1.05x of the turns without a
#   mask and below the descending turns under causal masks.
DQ_SPLITS_MAX_DIM = 128
# The split accumulators' memory, at most (beyond it fewer splits: fewer CTAs than the SMs
# hold). FlashAttention-2 has no cap (its splits: the SMs over batch x heads).
DQ_SPLIT_BYTES = 4 << 30
# Q and dO in a ring of this many buffers where the target's shared memory holds them
# (Sm80BwdConfig.q_stages: the next query block's loads in flight during this one's GEMMs)
Q_STAGES = 2
# (tile_m queries, tile_n keys, warps) per compiled head dim, the first whose storage fits the
# target's shared memory: warps of 16 keys each hold dK and dV (d registers a thread); checked
# spill-free per target by tests/test_compile_sm80.py. 128 keys a CTA read each query block's
# Q, dO, LSE and D, and add its dQ share, half as often as 64 (1.06-1.21x at d = 64/96, 1.09-
# 1.24x at d = 128 on the H200, docs/perf-log.md); at d = 128 that tile needs 115 KB, so 64
# keys in the 99 KB of sm_86/89/120 (K, V, Q, dO and dS^T: 66 / 91 / 72 KB there), and with
# packed sequences (PACKED_TILES: 4-16 bytes of spills at 128 keys on sm_80/90).
TILES = {64: ((64, 128, 8),), 96: ((64, 128, 8),), 128: ((64, 128, 8), (64, 64, 4))}
PACKED_TILES = {128: ((64, 64, 4),)}
# 32 queries a block in two 16-query sub-blocks (q_parts 2), with the Q/dO ring (70 KB at
# d=128): sm_12x's d=128 tile, where its compiler spilled 8-32 bytes on 64 x 64 x 4 (q_parts 4;
# head dims padded to 128 16-32, no mask and softcap 8 since the blocked dQ); spill-free there
# (225-247 registers), and passes the GPU suite under CUTEATTN_SM80_CONFIGS=sm_120a (its speed
# there is not sm_120's). Also every target's last fallback up to d=128 (bwd_configs).
SMALL_TILE = (32, 64, 4)


def register_parts(head_dim: int, major: int) -> tuple:
    """(kv_parts, q_parts) of Sm80BwdConfig: at d = 128 dK and dV (128 registers a thread) leave
    little room: halves of both were spill-free for sm_80/86/89; sm_120's compiler spilled
    64-124 bytes with those (and 16-84 bytes at d = 96 with packed sequences) and needed
    16-query sub-blocks from d = 96 on (quarters of dK's and dV's columns did not help)."""
    kv_parts = 2 if head_dim >= 128 else 1  # (d = 96's 48-column halves do not tile its rows)
    if major >= 12 and head_dim >= 96:
        return kv_parts, 4
    return kv_parts, 2 if head_dim >= 128 else 1


def _major(spec: AttentionSpec) -> int:
    return target_capability(spec.device_index)[0]


def wide_tile(dtype, head_dim: int, smem: int) -> tuple:
    """WIDE_TILES' first (tile_m, tile_n, warps) whose storage fits `smem` bytes."""
    for tile_m, tile_n, warps in WIDE_TILES:
        cfg = Sm80BwdConfig(dtype, head_dim, tile_m, tile_n, warps)
        if cfg.smem_bytes() <= smem:
            return tile_m, tile_n, warps
    raise ValueError(f"no sm80 backward tile for head_dim {head_dim} fits {smem} bytes")


def deterministic_dq(spec: AttentionSpec, head_dim: int) -> dict:
    """Sm80BwdConfig's dq_splits / descending_turns for spec at the compiled `head_dim`
    (DQ_SPLITS_MAX_DIM); both off without deterministic=True."""
    splits = spec.deterministic and head_dim <= DQ_SPLITS_MAX_DIM
    return dict(dq_splits=splits, descending_turns=spec.deterministic and not splits
                and (spec.causal or spec.local))


def bwd_config(spec: AttentionSpec, major: int = 8, smem: int = 163 * 1024) -> Sm80BwdConfig:
    """major: the compute capability's, whose compiler the register parts are chosen for;
    smem: the target's shared memory a block (the tile over 128). A head dim between the
    compiled widths runs on the next one up (`padded`)."""
    head_dim = compiled_width(spec.head_dim, SUPPORTED_HEAD_DIMS)
    dtype = CUTLASS_DTYPES[spec.dtype]
    packed = spec.varlen_q or spec.varlen_k or spec.has_seqused_q or spec.has_seqused_k
    # (v narrower than q: v and dO read zero-filled past their head dim, as a padded one)
    narrow_v = spec.head_dim_v != spec.head_dim
    padded = head_dim != spec.head_dim or narrow_v
    switches = dict(
        dtype=dtype, head_dim=head_dim, causal=spec.causal, local=spec.local,
        has_softcap=spec.has_softcap, varlen_q=spec.varlen_q, varlen_k=spec.varlen_k,
        has_seqused_q=spec.has_seqused_q, has_seqused_k=spec.has_seqused_k,
        deterministic=spec.deterministic, padded=padded, narrow_v=narrow_v,
        **deterministic_dq(spec, head_dim))
    if GRID and not (head_dim == 128 and (spec.local or padded
                                          or (packed and not spec.deterministic))):
        tile_m, tile_n = GRID_TILES[head_dim]
        if head_dim == 64 and not (spec.has_softcap or packed):
            tall = Sm80BwdConfig(tile_m=GRID_D64_TILE_M, tile_n=tile_n, num_warps=8, grid=True,
                                 dq_warps_m=DQ_WARPS_M_8_WARPS, q_stages=Q_STAGES, **switches)
            if tall.smem_bytes() <= smem:
                return tall
        cfg = Sm80BwdConfig(tile_m=tile_m, tile_n=tile_n, num_warps=8, grid=True,
                            dq_warps_m=DQ_WARPS_M_8_WARPS, **switches)
        if cfg.smem_bytes() <= smem:
            return with_ring(cfg, smem, packed)
    kv_passes = 1
    if head_dim in WIDE_HEAD_DIMS:
        tile_m, tile_n, warps = wide_tile(dtype, head_dim, smem)
        kv_passes, kv_parts, q_parts = head_dim // PASS_COLS, 1, 1
    else:
        tiles = PACKED_TILES.get(head_dim, TILES[head_dim]) if packed else TILES[head_dim]
        tile_m, tile_n, warps = next(
            (t for t in tiles if Sm80BwdConfig(dtype, head_dim, *t).smem_bytes() <= smem), tiles[-1])
        kv_parts, q_parts = register_parts(head_dim, major)
        if major >= 12 and head_dim == 128 and not packed:
            (tile_m, tile_n, warps), q_parts = SMALL_TILE, 2
    cfg = Sm80BwdConfig(
        tile_m=tile_m, tile_n=tile_n, num_warps=warps, kv_parts=kv_parts, q_parts=q_parts,
        kv_passes=kv_passes, dq_warps_m=DQ_WARPS_M_8_WARPS if warps == 8 else 0, **switches)
    return with_ring(cfg, smem, packed)


def bwd_configs(spec: AttentionSpec, major: int = 8, smem: int = 163 * 1024) -> list:
    """bwd_config first, then fallbacks, preferred first: the launch takes the first that its
    target's compiler builds without register spills (compile_common.first_spill_free), as the
    forward does. The rules above were tuned on sm_80/90a/120a; some forms near 255 registers
    spill on one target and not another (fp16 d=128 causal on the grid's ring, packed
    sequences at d=128/256 on sm_100a). In order: the Q/dO ring dropped; bwd.py's layout (over
    128: its 64-column passes) instead of the grid; 16-query sub-blocks; 32 queries a block."""
    first = bwd_config(spec, major, smem)
    head_dim = first.head_dim
    packed = spec.varlen_q or spec.varlen_k or spec.has_seqused_q or spec.has_seqused_k
    fields = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    switches = {k: fields[k] for k in (
        "dtype", "head_dim", "causal", "local", "has_softcap", "varlen_q", "varlen_k",
        "has_seqused_q", "has_seqused_k", "deterministic", "padded", "narrow_v",
        "descending_turns", "dq_splits")}
    candidates = [first, dataclasses.replace(first, q_stages=1)]
    if head_dim in WIDE_HEAD_DIMS:
        tile_m, tile_n, warps = wide_tile(first.dtype, head_dim, smem)
        candidates.append(Sm80BwdConfig(tile_m=tile_m, tile_n=tile_n, num_warps=warps,
                                        kv_passes=head_dim // PASS_COLS, **switches))
    else:
        if first.grid:
            tiles = PACKED_TILES.get(head_dim, TILES[head_dim]) if packed else TILES[head_dim]
            tile_m, tile_n, warps = next(
                (t for t in tiles if Sm80BwdConfig(first.dtype, head_dim, *t).smem_bytes() <= smem),
                tiles[-1])
            kv_parts, q_parts = register_parts(head_dim, major)
            layout = Sm80BwdConfig(
                tile_m=tile_m, tile_n=tile_n, num_warps=warps, kv_parts=kv_parts, q_parts=q_parts,
                dq_warps_m=DQ_WARPS_M_8_WARPS if warps == 8 else 0, **switches)
            candidates += [with_ring(layout, smem, packed), layout]
        else:
            layout = dataclasses.replace(first, q_stages=1)
        if layout.tile_m % 64 == 0:  # 16-query sub-blocks: a quarter of a 64-query block
            quartered = dataclasses.replace(layout, q_parts=4)
            candidates += [with_ring(quartered, smem, packed), quartered]
        (tile_m, tile_n, warps), q_parts = SMALL_TILE, 2
        small = Sm80BwdConfig(tile_m=tile_m, tile_n=tile_n, num_warps=warps,
                              kv_parts=register_parts(head_dim, major)[0], q_parts=q_parts,
                              **switches)
        candidates += [with_ring(small, smem, packed), small]
    unique = []
    for cfg in candidates:
        if cfg not in unique and cfg.smem_bytes() <= smem:
            unique.append(cfg)
    return unique


# Testing knob: CUTEATTN_SM80_BWD_FALLBACK=k makes the launch start from candidate k of
# bwd_configs (the last where a form has fewer), so a GPU whose compiler takes the first runs,
# and verifies, the fallbacks other targets' compilers take. Unset in normal use.
FALLBACK_ENV = "CUTEATTN_SM80_BWD_FALLBACK"


def launch_candidates(spec: AttentionSpec, major: int, smem: int) -> list:
    """bwd_configs, from candidate CUTEATTN_SM80_BWD_FALLBACK on when that is set."""
    return from_candidate(bwd_configs(spec, major, smem), FALLBACK_ENV)


def with_ring(cfg: Sm80BwdConfig, smem: int, packed: bool) -> Sm80BwdConfig:
    """cfg with Q_STAGES stages of Q and dO where they fit `smem` (not the grid's d = 256 with
    packed sequences: 4 bytes of spill in fp16 on sm_90a)."""
    ringed = dataclasses.replace(cfg, q_stages=Q_STAGES)
    if ringed.smem_bytes() > smem or (cfg.grid and cfg.head_dim == 256 and packed):
        return cfg
    return ringed


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg: Sm80BwdConfig, tvm_ffi: bool):
    def build():
        from .compile import compile_bwd_with_report
        return compile_bwd_with_report(cfg, tvm_ffi=tvm_ffi)
    return compile_cache.get_or_compile((ARCH, KIND, tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=sources())


class BwdLaunch(BackwardLaunch):
    """The compiled backward for one spec; calling it runs the three steps."""

    def __init__(self, spec: AttentionSpec):
        tvm_ffi = use_tvm_ffi()
        compile_with_report = lambda cfg: (_compiled(cfg, tvm_ffi),
                                           compile_cache.kernel_info((ARCH, KIND, tvm_ffi, cfg)))
        cfg, fn, _ = first_spill_free(
            launch_candidates(spec, _major(spec), smem_limit(spec.device_index)),
            compile_with_report)
        super().__init__(spec, cfg, fn, tvm_ffi, arguments.BWD_ARGUMENTS)

    def dq_blocks(self):
        return "single"  # (red.global.add.f32: one float a lane)

    def dq_splits(self, q, k, cu_seqlens_q, cu_seqlens_k) -> int:
        """cfg.dq_splits: as many splits as the SMs hold CTAs over the (batch, head) pairs; with
        packed keys of unequal lengths at least enough that the longest sequence's splits
        carry no more than an SM's share (below); at most the longest sequence's key blocks
        and DQ_SPLIT_BYTES of accumulators; at least 1."""
        cfg = self.cfg
        if not cfg.dq_splits:
            return 0
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        heads = max(self.spec.nheads, 1)
        # the longest sequence's keys: max_seqlen_k when packed (the spec's, this call's)
        longest = k.shape[1] if cu_seqlens_k is None else min(self.spec.seqlen_k or k.shape[0],
                                                              k.shape[0])
        per_sm = max(1, min(65536 // (256 * cfg.num_threads),  # registers (up to 255 a thread)
                            shared_memory_per_sm(q.device.index or 0)
                            // (cfg.smem_bytes() + 1024)))
        slots = sm_count(q.device.index or 0) * per_sm
        splits = slots // max(batch * heads, 1)
        if cu_seqlens_k is not None and longest * batch > k.shape[0] > 0:
            # unequal lengths: a sequence's (head's) work grows as its keys times its queries,
            # and its splits walk it in parallel; the total is at most longest x total keys,
            # so the longest one's splits need longest x slots / (heads x total keys) to stay
            # within an SM's share (8 sequences of 512-4096 keys, 16 heads: 3 where the
            # (batch, head) count alone gives 1)
            splits = max(splits, -(-longest * slots // (heads * k.shape[0])))
        dq_bytes = 4 * q.shape[:-2].numel() * q.shape[-2] * cfg.head_dim
        return max(1, min(splits, -(-longest // cfg.tile_n), DQ_SPLIT_BYTES // max(dq_bytes, 1)))


class Sm80Backward:
    """The kernel family of ("sm80", "bwd") (dispatch.KernelFamily)."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        reason = unserved_dtype_or_dims(spec, ARCH, "backward", SUPPORTED_HEAD_DIMS,
                                        padded_dims=True, narrower_v=True)
        if reason is not None:
            return reason
        return unserved_form(spec, ARCH, "backward", sinks=True)  # (dsink: api._sink_gradient)

    def launch(self, spec: AttentionSpec) -> BwdLaunch:
        return BwdLaunch(spec)


BACKWARD = Sm80Backward()
