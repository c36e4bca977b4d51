"""The portable attention backward (mma.sync, ldmatrix, cp.async only): dQ, dK, dV from Q, K,
V, dO, the forward's LSE and D = rowsum(dO * O) (the preprocess: launch_common.bwd_preprocess).

A CTA owns one block of `tile_n` keys of one (batch, query head) and walks the query blocks that
see it (`tile_m` rows each): dK and dV stay in registers for the whole walk and are written once;
dQ gets a float32 share from every key block, added to a global accumulator. As in the sm90
backward the scores are computed transposed, keys as the MMA's rows, so that P^T and dS^T land
in registers already shaped as the A operand of dV += P^T dO and dK += dS^T Q:
    S^T = K Q^T,  P^T = exp2(S^T * scale_log2 - lse_log2),  dP^T = V dO^T,
    dS^T = P^T * (dP^T - D),  dV += P^T dO,  dK += dS^T Q,  dQ = dS K.
dQ needs dS with the queries as rows: dS^T goes through shared memory and is read back
transposed (ldmatrix .trans) as the A operand of dQ = dS K, whose float32 share is added with
red.global.add.f32 (rows inside the sequence only); in deterministic mode in key-block order
(common/dq_order).

Per query block: Q, dO (cp.async, rows past the sequence zeroed: a masked P of 0 times a NaN of
garbage would still be NaN) and the block's LSE and D rows (+inf and 0 past the sequence) are
loaded, then the GEMMs run; two barriers per block. softmax_scale is applied once at the end
(dK) and to each dQ share; softcap multiplies dS by its derivative (score_mod's rule).
"""
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common import dq_blocks, epilogue, one_key
from ..common.block_info import BlockInfo
from ..common.convert import convert_fragment
from ..common.dq_order import in_turn, key_block_turn, launch_order_block, semaphore_slot
from ..common.global_atomics import red_add_f32
from ..common.layout import (acc_mn_view, acc_to_a_operand_layout, lse_seq_major, seq_major,
                             transposed_view)
from ..common.mask import apply_mask_transposed
from ..common.score_mod import softcap_scores
from ..common.seqlen_info import SeqlenInfo
from ..common.tile_scheduler import varlen_tile_coord
from . import mma


@dataclass(frozen=True)
class Sm80BwdConfig:
    """The static configuration of one compiled backward kernel (the compile key)."""
    dtype: type
    head_dim: int
    tile_m: int        # queries per block of the walk
    tile_n: int        # keys per CTA
    num_warps: int
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    # Register pressure knobs (each thread holds dK and dV: d registers): dV and dK are
    # accumulated in kv_parts column parts, so one part's B fragments are live at a time; S^T
    # and dP^T are computed in q_parts sub-blocks of the query block (tile_m / q_parts queries).
    kv_parts: int = 1
    q_parts: int = 1
    # Head dims over 128: dK and dV of every column would be 2d registers a thread, so the walk
    # over the query blocks runs kv_passes times, each pass accumulating d / kv_passes of their
    # columns (written out at its end, straight from the registers) and recomputing S^T and
    # dP^T; dQ is added in the first pass, in chunks of that many columns.
    kv_passes: int = 1
    # dQ's shares added in key-block order (bitwise-reproducible gradients; common/dq_order)
    deterministic: bool = False
    # ... from the last key block down, the grid launching a sequence's last key block first
    # (deterministic under a causal or windowed mask: common/dq_order's descending turns)
    descending_turns: bool = False
    # ... or no turns at all (deterministic): FlashAttention-2's split accumulators. Grid x is
    # a split count S (the launch's); the CTA of split s walks one key block of each round of
    # S (zigzag: split_walk) of its (batch, head) and adds dQ into split s's own float32 accumulator,
    # which no other CTA touches, so its additions land in program order; the launch sums
    # the S accumulators in a fixed order. No semaphore wait and no fence a query block.
    dq_splits: bool = False
    # Q and dO (and the block's LSE and D) in a ring of q_stages buffers: with 2, the next query
    # block's loads are in flight while this one computes (1: loaded, then waited for)
    q_stages: int = 1
    # q, k, v and dO's head dim may be narrower than head_dim (padded to this compiled width):
    # their loads zero-fill the columns past it (the gradient buffers have the compiled width)
    padded: bool = False
    # (padded) v's and dO's head dim narrower than q's and k's (head_dim_v < head_dim): their
    # loads zero-fill past their own, whose zero columns add nothing to dP = dO V^T and leave
    # dV's 0 there (bwd_postprocess cuts dV to v's width)
    narrow_v: bool = False
    # dQ = dS K's warp grid: dq_warps_m warps along the queries, the rest along the columns
    # (0: tile_m / 16 along the queries, 16-row warp tiles)
    dq_warps_m: int = 0
    # the two-dimensional warp grids of bwd_grid.FlashBwdSm80Grid (P through shared memory)
    grid: bool = False

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        """K and V, q_stages of Q and dO, dS^T (and P with `grid`; 16-bit), q_stages of the LSE
        and D (float32)."""
        elem = self.dtype.width // 8
        q_rows = self.q_stages * self.tile_m
        scores = (2 if self.grid else 1) * self.tile_n * self.tile_m
        return ((2 * self.tile_n + 2 * q_rows) * self.head_dim + scores) * elem + 2 * q_rows * 4


class FlashBwdSm80:
    p_in_smem = False  # (bwd_grid.FlashBwdSm80Grid: P through shared memory too)

    def __init__(self, cfg: Sm80BwdConfig):
        # warps split the keys (bwd_grid.py's grids check their own tiles)
        assert cfg.grid or cfg.tile_n % (mma.MMA_ROWS * cfg.num_warps) == 0, cfg
        # dQ's warps: dq_warps_m (or tile_m / 16) along the queries, the rest along the columns
        self.dq_warps_m = cfg.dq_warps_m or cfg.tile_m // mma.MMA_ROWS
        assert cfg.tile_m % (mma.MMA_ROWS * self.dq_warps_m) == 0, cfg
        assert cfg.num_warps % self.dq_warps_m == 0, cfg
        assert cfg.tile_m <= cfg.num_threads, cfg  # one thread per LSE/D row
        for rows, cols in ((cfg.tile_m, cfg.head_dim), (cfg.tile_n, cfg.head_dim)):
            assert rows % mma.rows_per_copy_pass(cfg.dtype, cfg.num_threads, cols) == 0, cfg
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.tile_m, self.tile_n, self.d = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_threads = cfg.num_threads
        self.pass_cols = self.d // cfg.kv_passes  # dK's and dV's columns per pass
        self.kv_cols = self.pass_cols // cfg.kv_parts  # ... and per GEMM
        # dQ's columns per GEMM: all of them, or 64 at a time (its accumulator in parts:
        # spill-free that way) with column passes and with 128 keys a CTA at d = 128
        self.dq_cols = 64 if cfg.kv_passes > 1 or (self.d >= 128 and cfg.tile_n >= 128) else self.d
        assert self.d % cfg.kv_passes == 0 and self.pass_cols % cfg.kv_parts == 0, cfg
        assert self.dq_cols % (8 * (cfg.num_warps // self.dq_warps_m)) == 0, cfg
        if cfg.kv_passes > 1 or cfg.kv_parts > 1:
            # a column part's views start at multiples of kv_cols: whole swizzle atoms only
            # (mma.smem_layout), else they would address other elements
            assert self.kv_cols * cfg.dtype.width // 8 % mma.atom_width_bytes(cfg.dtype, self.d) == 0, cfg
        self.sub_m = cfg.tile_m // cfg.q_parts  # queries per S^T / dP^T sub-block
        assert self.kv_cols % 16 == 0 and self.sub_m % 16 == 0, cfg
        assert cfg.q_stages in (1, 2), cfg
        self.ring = cfg.q_stages > 1

    # ------------------------------------------------------------------------------------------
    # Host side (arguments.BWD_ARGUMENTS declares the parameters)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor,   # float32 (b, h, rows_pad) or (h, rows_pad): LSE in log2 units
        mD: cute.Tensor,      # like mLSE2: rowsum(dO * O)
        mdQacc: cute.Tensor,  # float32, shaped like q, in dq_view's blocks (zeroed)
        mdK: cute.Tensor, mdV: cute.Tensor,  # like k, with the query heads
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: cute.Tensor,  # int32 (h, slots), zeroed (deterministic only)
        qhead_per_kvhead: Int32,
        softmax_scale: Float32,
        score_scale: Float32,
        softmax_scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        num_n_blocks: Int32,  # grid x: key blocks (per sequence, or a packed bound; dq_splits:
                              # the split count)
        heads_interleaved: Int32,  # 1 here (BackwardLaunch's default): the grid is (key block,
                                   # head, batch); the decode's registers spilled at d=128/256
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        mQ, mdO, mdQacc = (seq_major(t, cfg.varlen_q) for t in (mQ, mdO, mdQacc))
        mK, mV, mdK, mdV = (seq_major(t, cfg.varlen_k) for t in (mK, mV, mdK, mdV))
        mLSE2, mD = lse_seq_major(mLSE2, cfg.varlen_q), lse_seq_major(mD, cfg.varlen_q)
        # (with a ring: a stage mode, each stage a whole tile, so its views are swizzle-safe)
        sQ_layout = mma.smem_layout(self.dtype, self.tile_m, self.d,
                                    stages=cfg.q_stages if const_expr(self.ring) else 0)
        sK_layout = mma.smem_layout(self.dtype, self.tile_n, self.d)
        sdS_layout = self.score_layout()
        SharedStorage = self.shared_storage(sQ_layout, sK_layout, sdS_layout)
        heads = mQ.shape[2]
        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(cfg.varlen_q) else mQ.shape[3]
        self.kernel(
            mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mSemaphore, qhead_per_kvhead, batch,
            softmax_scale, score_scale, softmax_scale_log2, window_left, window_right,
            sQ_layout, sK_layout, sdS_layout, SharedStorage,
        ).launch(
            # (dq_splits: x the split count; packed keys too take z as the sequence)
            grid=[num_n_blocks, heads,
                  1 if const_expr(cfg.varlen_k and not cfg.dq_splits) else batch],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    def score_layout(self):
        """dS^T's shared-memory tile: (tile_n keys, tile_m queries)."""
        return mma.smem_layout(self.dtype, self.tile_n, self.tile_m)

    def shared_storage(self, sQ_layout, sK_layout, sdS_layout):
        cfg, p_in_smem = self.cfg, self.p_in_smem

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            if p_in_smem:  # (P beside dS: bwd_grid.py)
                sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * cfg.q_stages], 16]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * cfg.q_stages], 16]
        return SharedStorage

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
        mdV: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: cute.Tensor,
        qhead_per_kvhead: Int32, batch: Int32, softmax_scale: Float32, score_scale: Float32,
        softmax_scale_log2: Float32, window_left: Int32, window_right: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        if const_expr(cfg.dq_splits):
            self.split_walk(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mCuSeqlensQ,
                            mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mSemaphore, qhead_per_kvhead,
                            batch, softmax_scale, score_scale, softmax_scale_log2, window_left,
                            window_right, sQ_layout, sK_layout, sdS_layout, SharedStorage)
        else:
            tidx, _, _ = cute.arch.thread_idx()
            n_block, head_idx, batch_idx = cute.arch.block_idx()
            in_range = True
            if const_expr(cfg.varlen_k):
                n_block, batch_idx = varlen_tile_coord(n_block, mCuSeqlensK, mSeqUsedK, batch,
                                                       mK.shape[0], self.tile_n,
                                                       cfg.descending_turns)
                in_range = batch_idx < batch
                batch_idx = cutlass.min(batch_idx, batch - 1)
            seqlen = SeqlenInfo.create(batch_idx, mQ.shape[0], mK.shape[0],
                                       mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
            views = self.smem_views(SharedStorage, sQ_layout, sK_layout, sdS_layout)
            in_range = in_range & (n_block * self.tile_n < seqlen.seqlen_k)
            if const_expr(not cfg.varlen_k):  # (packed: varlen_tile_coord numbers them)
                n_block = launch_order_block(n_block, seqlen.seqlen_k, self.tile_n,
                                             cfg.descending_turns)
            if in_range:
                self.key_block(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore,
                               *views[:7], seqlen, n_block, head_idx,
                               head_idx // qhead_per_kvhead, batch_idx, softmax_scale,
                               score_scale, softmax_scale_log2, window_left, window_right,
                               tidx, views[7])

    def smem_views(self, SharedStorage, sQ_layout, sK_layout, sdS_layout) -> tuple:
        """(sQ, sdO, sK, sV, sdS^T, sLSE2, sD, sP or None) in the CTA's shared memory."""
        cfg = self.cfg
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_layout), storage.sdO.get_tensor(sQ_layout)
        sK, sV = storage.sK.get_tensor(sK_layout), storage.sV.get_tensor(sK_layout)
        sdSt = storage.sdS.get_tensor(sdS_layout)
        sP = storage.sP.get_tensor(sdS_layout) if const_expr(self.p_in_smem) else None
        rows_layout = cute.make_layout((self.tile_m, cfg.q_stages) if const_expr(self.ring)
                                       else self.tile_m)
        return (sQ, sdO, sK, sV, sdSt, storage.sLSE2.get_tensor(rows_layout),
                storage.sD.get_tensor(rows_layout), sP)

    @cute.jit
    def split_walk(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
                   mSeqUsedQ, mSeqUsedK, mSemaphore, qhead_per_kvhead, batch, softmax_scale,
                   score_scale, softmax_scale_log2, window_left, window_right, sQ_layout,
                   sK_layout, sdS_layout, SharedStorage: cutlass.Constexpr):
        """dq_splits: this CTA's key blocks (one a round of `splits`, zigzag, of its batch and
        head) one after another, dQ into the split's own accumulator: the launch lays the splits'
        accumulators one after another, each the whole buffer's rows rounded up to 8 (a
        multiple of dq_blocks' row groups), and hands the kernel the first one's view."""
        tidx, _, _ = cute.arch.thread_idx()
        split, head_idx, batch_idx = cute.arch.block_idx()
        splits = cute.arch.grid_dim()[0]
        seqlen = SeqlenInfo.create(batch_idx, mQ.shape[0], mK.shape[0],
                                   mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        views = self.smem_views(SharedStorage, sQ_layout, sK_layout, sdS_layout)
        rows = mdQacc.shape[0]  # packed: every sequence's rows; fixed length: batch x seqlen
        if const_expr(not self.cfg.varlen_q):
            rows = rows * mdQacc.shape[3]
        split_floats = cutlass.Int64((rows + 7) // 8 * 8) * cutlass.Int64(mdQacc.stride[0])
        dq_split = cute.make_tensor(mdQacc.iterator + cutlass.Int64(split) * split_floats,
                                    mdQacc.layout)
        key_blocks = (seqlen.seqlen_k + self.tile_n - 1) // self.tile_n
        # round r takes key block r * splits + (split, or splits - 1 - split in odd rounds): under
        # a causal mask a key block's walk shortens with its index, and the zigzag evens the
        # splits' sums (in increasing rounds split 0 would take the longest of every round)
        for r in cutlass.range((key_blocks + splits - 1) // splits, unroll=1):
            n_block = r * splits + split
            if r % 2 == 1:
                n_block = r * splits + splits - 1 - split
            if n_block < key_blocks:
                # the last key block's copies landed (a block no query sees leaves its K and V
                # in flight when its dK and dV go out from the registers: column passes) and
                # every warp is past its shared memory
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                self.key_block(mQ, mK, mV, mdO, mLSE2, mD, dq_split, mdK, mdV, mSemaphore,
                               *views[:7], seqlen, n_block, head_idx,
                               head_idx // qhead_per_kvhead, batch_idx, softmax_scale,
                               score_scale, softmax_scale_log2, window_left, window_right, tidx,
                               views[7])

    @cute.jit
    def key_block(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore, sQ, sdO, sK, sV, sdSt,
                  sLSE2, sD, seqlen: SeqlenInfo, n_block, head_idx, head_idx_kv, batch_idx,
                  softmax_scale, score_scale, softmax_scale_log2, window_left, window_right,
                  tidx, sP=None):
        """One CTA: K and V in, the walk over the query blocks, dK and dV out."""
        cfg = self.cfg
        block_info, m_min, m_max, key_start, gLSE2, gD, dq_out, load_q_block = self.start_walk(
            mQ, mK, mV, mdO, mLSE2, mD, mdQacc, sQ, sdO, sK, sV, seqlen, n_block, head_idx,
            head_idx_kv, batch_idx, window_left, window_right, tidx)
        ring = self.ring
        stage_of = lambda t, st: t[None, None, st] if const_expr(ring) else t
        rows_stage = lambda t, st: t[None, st] if const_expr(ring) else t

        # S^T, dP^T, dV, dK: warps split the keys. dQ: warps split the queries.
        tiled_mma = mma.tiled_mma(self.dtype, cfg.num_warps)
        thr = tiled_mma.get_slice(tidx)
        ld = lambda transpose, b_operand: (cute.make_tiled_copy_B if b_operand else cute.make_tiled_copy_A)(
            mma.ldmatrix_atom(self.dtype, transpose), tiled_mma).get_slice(tidx)
        ld_a, ld_b, ld_bt = ld(False, False), ld(False, True), ld(True, True)
        sKt, sdS = transposed_view(sK), transposed_view(sdSt)
        # The query block's S^T, dP^T, dV and dK work runs in sub-blocks of sub_m queries
        # (its scores' registers: tile_n x sub_m), dQ on the whole block.
        subs = range(self.tile_m // self.sub_m)
        rows_of = lambda t, h: cute.local_tile(t, (self.sub_m, self.d), (h, 0))
        # S^T = K Q^T and dP^T = V dO^T: A from K / V, B from Q / dO (rows = queries, K-major)
        tSrK = thr.make_fragment_A(thr.partition_A(sK))
        sQ0, sdO0 = stage_of(sQ, 0), stage_of(sdO, 0)  # (the fragments' shapes: any stage's)
        tSrQ = thr.make_fragment_B(thr.partition_B(rows_of(sQ0, 0)))
        tSsK, tSsV = ld_a.partition_S(sK), ld_a.partition_S(sV)
        # (with a ring: per block, from its stage, by stage_views; without one they stay where
        # they were built before the ring: built together, ptxas spilled 16 bytes on sm_120a)
        if const_expr(not ring):
            tSsQ = [ld_b.partition_S(rows_of(sQ, h)) for h in subs]
            tSsdO = [ld_b.partition_S(rows_of(sdO, h)) for h in subs]
        # dV += P^T dO and dK += dS^T Q: B from dO^T / Q^T (d x queries, transposed reads), in
        # column parts (kv_cols wide each: one part's B fragments live at a time); a pass's
        # parts start at column pass * pass_cols (whole swizzle atoms: 64 columns)
        parts = range(self.pass_cols // self.kv_cols)
        part = lambda t, h, i: cute.local_tile(transposed_view(rows_of(t, h)),
                                                (self.kv_cols, self.sub_m), (i, 0))
        tVrdOt = thr.make_fragment_B(thr.partition_B(part(sdO0, 0, 0)))
        tKrQt = thr.make_fragment_B(thr.partition_B(part(sQ0, 0, 0)))
        # dQ = dS K (its own MMA layout: warps split the queries, and the columns when the
        # query block has fewer rows than 16 per warp): A from dS (dS^T read transposed), B from
        # K^T (d x keys, transposed reads). A warp's columns 16 adjacent ones where they tile
        # dq_cols (tiled_mma_grid: one ldmatrix.x4 reads a warp's B fragments of a k block; with
        # interleaved n8 atoms half of it was discarded): 1.03-1.05x at d = 128 with softcap
        dq_warps_n = cfg.num_warps // self.dq_warps_m
        dq_layout = (mma.tiled_mma_grid if self.dq_cols % (16 * dq_warps_n) == 0
                     else mma.tiled_mma_2d)
        dq_mma = dq_layout(self.dtype, self.dq_warps_m, dq_warps_n)
        thr_dq = dq_mma.get_slice(tidx)
        ld_dq_a = cute.make_tiled_copy_A(mma.ldmatrix_atom(self.dtype, True), dq_mma).get_slice(tidx)
        ld_dq_b = cute.make_tiled_copy_B(mma.ldmatrix_atom(self.dtype, True), dq_mma).get_slice(tidx)
        tQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tQsdS = ld_dq_a.partition_S(sdS)
        # (K^T's columns in chunks of dq_cols: kv_passes; else one chunk, the whole head dim)
        chunks = range(self.d // self.dq_cols)
        chunk = lambda c: cute.local_tile(sKt, (self.dq_cols, self.tile_n), (c, 0))
        tQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(chunk(0)))
        tQsKt = [ld_dq_b.partition_S(chunk(c)) for c in chunks]

        acc_S = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.sub_m)), Float32)
        acc_dP = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.sub_m)), Float32)
        acc_dK = [cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.kv_cols)), Float32)
                  for _ in parts]
        acc_dV = [cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.kv_cols)), Float32)
                  for _ in parts]
        for acc in acc_dK + acc_dV:
            acc.fill(0.0)
        acc_S_mn, acc_dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        coord_st = acc_mn_view(thr.partition_C(cute.make_identity_tensor((self.tile_n, self.sub_m))))
        coord_dq = acc_mn_view(thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, self.dq_cols))))
        tVrP = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.dtype)
        tKrdS = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_dP.layout), self.dtype)
        # dS^T into shared memory: the accumulator's own layout, pairs of 16-bit values
        st_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                num_bits_per_copy=2 * self.dtype.width), tiled_mma).get_slice(tidx)
        # (the whole tile's partition: a local_tile view of sub_m columns inside a swizzle atom
        # would address other elements, see copy_column_part)
        tSsdSt = st_ds.partition_D(sdSt)

        # (unrolled: a pass's columns are then fixed offsets, whole swizzle atoms)
        for kv_pass in cutlass.range_constexpr(cfg.kv_passes):
            col0 = kv_pass * len(parts)  # (this pass's first part, in kv_cols-wide parts)
            if const_expr(cfg.kv_passes > 1):
                for acc in acc_dK + acc_dV:
                    acc.fill(0.0)
            if const_expr(not ring):  # (with a ring: per block, from its stage)
                tVsdOt = [[ld_bt.partition_S(part(sdO, h, col0 + i)) for i in parts] for h in subs]
                tKsQt = [[ld_bt.partition_S(part(sQ, h, col0 + i)) for i in parts] for h in subs]
            if const_expr(ring):
                if const_expr(kv_pass > 0):
                    cute.arch.barrier()  # every warp is past the last pass's reads
                # the first query block into stage 0 (its LSE and D rows too; the loop's first
                # barrier makes them visible)
                if m_min < m_max:
                    load_q_block(m_min, 0)
                    self.load_lse_rows(gLSE2, gD, sLSE2[None, 0], sD[None, 0],
                                       m_min * self.tile_m, seqlen.seqlen_q, tidx)
            for m_block in cutlass.range(m_min, m_max, unroll=1):
                q_start = m_block * self.tile_m
                st = (m_block - m_min) % cfg.q_stages if const_expr(ring) else 0
                lse_next, d_next = self.block_start(load_q_block, gLSE2, gD, sLSE2, sD, m_block,
                                                    m_max, q_start, st, seqlen.seqlen_q, tidx)
                # (names of the loop's own: the views before it exist without a ring only)
                bQ, bdO, bdOt, bQt = (self.stage_views(stage_of(sQ, st), stage_of(sdO, st), ld_b,
                                                       ld_bt, rows_of, part, col0)
                                      if const_expr(ring) else (tSsQ, tSsdO, tVsdOt, tKsQt))
                for h in subs:
                    self.sub_block(tiled_mma, acc_S, acc_dP, acc_S_mn, acc_dP_mn, acc_dK, acc_dV,
                                   tSrK, tSrQ, tSsK, tSsV, bQ[h], bdO[h], tVrP, tKrdS, tVrdOt,
                                   tKrQt, bdOt[h], bQt[h], st_ds, tSsdSt, h, ld_a, ld_b, ld_bt,
                                   coord_st, rows_stage(sLSE2, st), rows_stage(sD, st),
                                   block_info, seqlen, key_start,
                                   q_start + h * self.sub_m, h * self.sub_m, score_scale,
                                   softmax_scale_log2, window_left, window_right)
                cute.arch.barrier()  # dS^T is in shared memory
                if const_expr(kv_pass == 0):  # dQ's share: in the first pass only
                    add = lambda: self.dq_share(dq_mma, thr_dq, tQrdS, tQrKt, tQsdS, tQsKt,
                                                ld_dq_a, ld_dq_b, coord_dq, dq_out, q_start,
                                                seqlen, softmax_scale)
                    self.add_dq_share(add, mSemaphore, mQ, seqlen, block_info, m_block, n_block,
                                      head_idx, batch_idx, tidx)
                self.block_end(sLSE2, sD, st, lse_next, d_next, tidx)
            if const_expr(cfg.kv_passes > 1):
                # this pass's columns of dK (scaled) and dV, straight from the registers
                scale = one_key.scale_for(cfg, softmax_scale, seqlen.seqlen_k)
                for i in cutlass.range_constexpr(len(parts)):
                    for e in cutlass.range_constexpr(cute.size(acc_dK[i])):
                        acc_dK[i][e] = acc_dK[i][e] * scale
                    for acc, m_out in ((acc_dK[i], mdK), (acc_dV[i], mdV)):
                        g_out = cute.local_tile(seqlen.k_view(m_out, head_idx, batch_idx),
                                                (self.tile_n, self.kv_cols), (n_block, col0 + i))
                        epilogue.store_acc(acc, g_out, thr, key_start, seqlen.seqlen_k,
                                           self.tile_n, self.kv_cols, self.dtype)

        if const_expr(cfg.kv_passes == 1):
            self.store_dk_dv(acc_dK, acc_dV, tiled_mma, sK, sV, mdK, mdV, seqlen, n_block,
                             head_idx, batch_idx, softmax_scale, tidx)

    @cute.jit
    def block_start(self, load_q_block, gLSE2, gD, sLSE2, sD, m_block, m_max, q_start, st,
                    seqlen_q, tidx):
        """The top of query block m_block (rows from q_start): its Q, dO, LSE and D rows in
        shared memory and every warp past the previous block's reads. With a ring this block's
        loads were issued a block ago, so the next block's go out now, into the other stage,
        and land while this one computes; its LSE and D rows come into registers (returned:
        block_end stores them)."""
        if const_expr(self.ring):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            lse_next, d_next = Float32(Float32.inf), Float32(0.0)
            if m_block + 1 < m_max:
                load_q_block(m_block + 1, 1 - st)
                row = q_start + self.tile_m + tidx
                if (tidx < self.tile_m) & (row < seqlen_q):
                    lse_next, d_next = gLSE2[row], gD[row]
        else:
            load_q_block(m_block, 0)
            self.load_lse_rows(gLSE2, gD, sLSE2, sD, q_start, seqlen_q, tidx)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            lse_next, d_next = None, None
        return lse_next, d_next

    @cute.jit
    def block_end(self, sLSE2, sD, st, lse_next, d_next, tidx):
        """The end of a query block: with a ring, the next block's LSE and D rows into their
        stage (last read a block ago; the next block_start's barrier orders this block's reads
        of the score tiles before the next block writes them); without one, a barrier: every
        warp is past its reads of Q, dO and the score tiles."""
        if const_expr(self.ring):
            if tidx < self.tile_m:
                sLSE2[tidx, 1 - st] = lse_next
                sD[tidx, 1 - st] = d_next
        else:
            cute.arch.barrier()

    @cute.jit
    def store_dk_dv(self, acc_dK: list, acc_dV: list, tiled_mma, sK, sV, mdK, mdV,
                    seqlen: SeqlenInfo, n_block, head_idx, batch_idx, softmax_scale, tidx):
        """dK (scaled) and dV out (each a list of column parts' accumulators of tiled_mma),
        staged through K's and V's buffers (K and V landed and every warp is past its reads,
        also when no query block saw this key block)."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        scale = one_key.scale_for(self.cfg, softmax_scale, seqlen.seqlen_k)
        for acc in acc_dK:
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * scale
        cols = self.d // len(acc_dK)
        for accs, s_buf, m_out in ((acc_dK, sK, mdK), (acc_dV, sV, mdV)):
            for i in cutlass.range_constexpr(len(accs)):
                epilogue.stage_o(accs[i], cute.local_tile(s_buf, (self.tile_n, cols), (0, i)),
                                 tiled_mma, tidx, self.dtype, stmatrix=False)
            cute.arch.barrier()
            g_out = cute.local_tile(seqlen.k_view(m_out, head_idx, batch_idx), (self.tile_n, self.d),
                                    (n_block, 0))
            epilogue.store_o(s_buf, g_out, n_block * self.tile_n, seqlen.seqlen_k, tidx,
                             self.dtype, self.d, self.tile_n, self.num_threads)

    def start_walk(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, sQ, sdO, sK, sV, seqlen: SeqlenInfo,
                   n_block, head_idx, head_idx_kv, batch_idx, window_left, window_right, tidx):
        """The walk's setup (traced inline): its query blocks [m_min, m_max), K and V's loads
        issued (rows past the keys zeroed), this head's LSE, D and dQ views, and load_q_block(m,
        stage) for Q and dO."""
        cfg = self.cfg
        block_info = BlockInfo(self.tile_m, self.tile_n, cfg.causal, cfg.local,
                               window_left, window_right)
        m_min, m_max = block_info.m_block_range(seqlen.seqlen_q, seqlen.seqlen_k, n_block)
        key_start = n_block * self.tile_n

        # global -> shared: K and V once (rows past the keys zeroed), Q and dO per block
        copy = mma.gmem_to_smem_copy(self.dtype, self.num_threads, self.d).get_slice(tidx)
        gK = cute.local_tile(seqlen.k_view(mK, head_idx_kv, batch_idx), (self.tile_n, self.d), (n_block, 0))
        gV = cute.local_tile(seqlen.k_view(mV, head_idx_kv, batch_idx), (self.tile_n, self.d), (n_block, 0))
        gQ = cute.local_tile(seqlen.q_view(mQ, head_idx, batch_idx), (self.tile_m, self.d), (None, 0))
        gdO = cute.local_tile(seqlen.q_view(mdO, head_idx, batch_idx), (self.tile_m, self.d), (None, 0))
        tKcK = copy.partition_S(cute.make_identity_tensor((self.tile_n, self.d)))
        tQcQ = copy.partition_S(cute.make_identity_tensor((self.tile_m, self.d)))
        keys_left = seqlen.seqlen_k - key_start
        # the tensors' own head dims: q's and k's, and v's and dO's (narrow_v: head_dim_v)
        cols = mQ.shape[1] if const_expr(cfg.padded) else None
        cols_v = mV.shape[1] if const_expr(cfg.narrow_v) else cols
        mma.load_rows(copy, copy.partition_S(gK), copy.partition_D(sK), tKcK, keys_left, cols=cols)
        mma.load_rows(copy, copy.partition_S(gV), copy.partition_D(sV), tKcK, keys_left,
                      cols=cols_v)
        cute.arch.cp_async_commit_group()
        # (with a ring: (CPY, M, K, stage), a stage sliced per block)
        tQgQ, tQsQ = copy.partition_S(gQ), copy.partition_D(sQ)
        tOgO, tOsO = copy.partition_S(gdO), copy.partition_D(sdO)
        gLSE2 = self.row_view(mLSE2, seqlen, head_idx, batch_idx)
        gD = self.row_view(mD, seqlen, head_idx, batch_idx)
        dq_out = self.dq_view(mdQacc, seqlen, head_idx, batch_idx)
        load_q_block = lambda m_block, st: self.load_q_block(
            copy, tQgQ, tQsQ, tOgO, tOsO, tQcQ, m_block, st, seqlen.seqlen_q, cols, cols_v)
        return block_info, m_min, m_max, key_start, gLSE2, gD, dq_out, load_q_block

    def dq_view(self, mdQacc: cute.Tensor, seqlen: SeqlenInfo, head_idx, batch_idx):
        """(head, row_stride, row0) of dQ's blocked accumulator (common/dq_blocks.py, one float
        a lane): 1.23-1.68x at d = 64 to 256 on the H200 over a row-major one
        (FlashAttention-2 permutes its accumulator for the same reason)."""
        return (dq_blocks.head_start(mdQacc, head_idx, self.d), mdQacc.stride[0],
                dq_blocks.first_row(mdQacc, seqlen, batch_idx, self.cfg.varlen_q))

    def add_dq_share(self, add, mSemaphore, mQ, seqlen: SeqlenInfo, block_info: BlockInfo,
                     m_block, n_block, head_idx, batch_idx, tidx):
        """add() (this key block's dQ share into query block m_block), in deterministic mode
        when it is this key block's turn (common/dq_order)."""
        cfg = self.cfg
        if const_expr(cfg.deterministic and not cfg.dq_splits):
            ptr = mSemaphore[head_idx, None].iterator + semaphore_slot(
                mSemaphore, seqlen, m_block, batch_idx, mQ.shape[0], self.tile_m, cfg.varlen_q)
            turn = key_block_turn(block_info, seqlen, m_block, n_block, cfg.descending_turns)
            in_turn(ptr, turn, tidx == 0, cute.arch.barrier, cute.arch.barrier, add)
        else:
            add()

    @cute.jit
    def sub_block(self, tiled_mma, acc_S, acc_dP, acc_S_mn, acc_dP_mn, acc_dK, acc_dV, tSrK,
                  tSrQ, tSsK, tSsV, tSsQ, tSsdO, tVrP, tKrdS, tVrdOt, tKrQt, tVsdOt, tKsQt, st_ds,
                  tSsdSt, h: cutlass.Constexpr, ld_a, ld_b, ld_bt, coord_st, sLSE2, sD,
                  block_info: BlockInfo,
                  seqlen: SeqlenInfo, key_start, q_start, row0: cutlass.Constexpr, score_scale,
                  softmax_scale_log2, window_left, window_right):
        """sub_m queries (from q_start; row0 within the block's shared tiles) against this
        CTA's keys: S^T and dP^T, P^T and dS^T (dS^T also into shared memory for dQ), then
        dV += P^T dO and dK += dS^T Q."""
        cfg = self.cfg
        acc_S.fill(0.0)
        mma.gemm(tiled_mma, acc_S, tSrK, tSrQ, tSsK, tSsQ, ld_a, ld_b)
        acc_dP.fill(0.0)
        mma.gemm(tiled_mma, acc_dP, tSrK, tSrQ, tSsV, tSsdO, ld_a, ld_b)
        # P^T and dS^T (masked entries: P = 0, so dS = 0)
        if const_expr(cfg.has_softcap):
            softcap_scores(acc_S, score_scale)
        if block_info.needs_mask_transposed(seqlen.seqlen_q, seqlen.seqlen_k, key_start,
                                            self.tile_n, q_start):
            apply_mask_transposed(acc_S_mn, coord_st, key_start, q_start, seqlen.seqlen_q,
                                  seqlen.seqlen_k, window_left, window_right, cfg.causal,
                                  cfg.local)
        probabilities_and_ds(acc_S_mn, acc_dP_mn, lambda c: row0 + coord_st[0, c][1], sLSE2, sD,
                             softmax_scale_log2, cfg.has_softcap, 1)
        convert_fragment(acc_S, tVrP)
        convert_fragment(acc_dP, tKrdS)
        # dS^T to shared memory for dQ: this sub-block's columns of the tile
        copy_column_part(st_ds, st_ds.retile(cute.make_tensor(tKrdS.iterator, acc_dP.layout)),
                         tSsdSt, h)
        # dV += P^T dO, dK += dS^T Q
        for i in cutlass.range_constexpr(len(acc_dV)):
            mma.gemm(tiled_mma, acc_dV[i], tVrP, tVrdOt, None, tVsdOt[i], None, ld_bt,
                     a_in_registers=True)
            mma.gemm(tiled_mma, acc_dK[i], tKrdS, tKrQt, None, tKsQt[i], None, ld_bt,
                     a_in_registers=True)

    @cute.jit
    def dq_share(self, tiled_mma, thr, tQrdS, tQrKt, tQsdS, tQsKt, ld_at, ld_bt, coord_dq, dq_out,
                 q_start, seqlen: SeqlenInfo, softmax_scale):
        """dQ's share of this key block for the query block at q_start: dS K (scaled), added to
        the float32 accumulator, rows inside the sequence only; in chunks of dq_cols columns
        (tQsKt: K^T's chunks, one GEMM each). dq_out: dq_view's (head, row_stride, row0); each
        red.global takes the thread's row address plus a constant (dq_blocks.step_offset)."""
        head, row_stride, row0 = dq_out
        steps = acc_mn_view(tiled_mma.get_slice(0).partition_C(
            cute.make_identity_tensor((self.tile_m, self.dq_cols))))
        assert steps[0, 0] == (0, 0), steps[0, 0]
        first_row, first_col = coord_dq[0, 0]
        seqlen_q = seqlen.seqlen_q
        # a sequence of one key has dQ = 0 exactly (common/one_key.py): no adds
        keep = seqlen.seqlen_k != 1 if const_expr(one_key.per_sequence(self.cfg)) else True
        if keep:
            for chunk in cutlass.range_constexpr(len(tQsKt)):
                acc_dQ = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_m, self.dq_cols)), Float32)
                acc_dQ.fill(0.0)
                mma.gemm(tiled_mma, acc_dQ, tQrdS, tQrKt, tQsdS, tQsKt[chunk], ld_at, ld_bt)
                acc_mn = acc_mn_view(acc_dQ)
                thread = head + dq_blocks.offset("single", row0 + q_start + first_row,
                                                 chunk * self.dq_cols + first_col, row_stride)
                for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                    if q_start + first_row + steps[r, 0][0] < seqlen_q:
                        at_row = thread + dq_blocks.step_offset("single", (steps[r, 0][0], 0),
                                                                row_stride)
                        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                            step_col = (0, steps[r, c][1])
                            red_add_f32(at_row + dq_blocks.step_offset("single", step_col, row_stride),
                                        acc_mn[r, c] * softmax_scale)

    def stage_views(self, sQs, sdOs, ld_b, ld_bt, rows_of, part, col0):
        """A stage's ldmatrix partitions, per sub-block: Q and dO as S^T's and dP^T's B operands,
        this pass's column parts of dO^T and Q^T as dV's and dK's."""
        subs = range(self.tile_m // self.sub_m)
        parts = range(self.pass_cols // self.kv_cols)
        return ([ld_b.partition_S(rows_of(sQs, h)) for h in subs],
                [ld_b.partition_S(rows_of(sdOs, h)) for h in subs],
                [[ld_bt.partition_S(part(sdOs, h, col0 + i)) for i in parts] for h in subs],
                [[ld_bt.partition_S(part(sQs, h, col0 + i)) for i in parts] for h in subs])

    @cute.jit
    def load_q_block(self, copy, tQgQ, tQsQ, tOgO, tOsO, tQcQ, m_block, st, seqlen_q, cols,
                     cols_v):
        """cp.async of query block m_block's Q and dO into stage st (rows past the sequence
        zeroed; columns past q's / dO's head dim too when cols / cols_v are given), one
        commit group."""
        rows_left = seqlen_q - m_block * self.tile_m
        if const_expr(self.ring):
            tQsQ, tOsO = tQsQ[None, None, None, st], tOsO[None, None, None, st]
        mma.load_rows(copy, tQgQ[None, None, None, m_block], tQsQ, tQcQ, rows_left, cols=cols)
        mma.load_rows(copy, tOgO[None, None, None, m_block], tOsO, tQcQ, rows_left, cols=cols_v)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_lse_rows(self, gLSE2, gD, sLSE2, sD, q_start, seqlen_q, tidx):
        """The query block's LSE and D rows into shared memory (+inf and 0 past the sequence:
        P = exp2(-inf) = 0 there), one thread a row."""
        if tidx < self.tile_m:
            if q_start + tidx < seqlen_q:
                sLSE2[tidx] = gLSE2[q_start + tidx]
                sD[tidx] = gD[q_start + tidx]
            else:
                sLSE2[tidx] = Float32.inf
                sD[tidx] = Float32(0.0)

    def row_view(self, mX: cute.Tensor, seqlen: SeqlenInfo, head_idx, batch_idx) -> cute.Tensor:
        """The (rows,) LSE or D of one head. Packed sequences are laid out padded
        (launch_common.bwd_preprocess): sequence b starts at (offset_q // tile_m + b) * tile_m."""
        if const_expr(self.cfg.varlen_q):
            start = (seqlen.offset_q // self.tile_m + batch_idx) * self.tile_m
            return cute.domain_offset((start,), mX[None, head_idx])
        return mX[None, head_idx, batch_idx]


@cute.jit
def probabilities_and_ds(acc_S_mn: cute.Tensor, acc_dP_mn: cute.Tensor, query_of, lse_rows,
                         d_rows, softmax_scale_log2, has_softcap: cutlass.Constexpr,
                         queries_mode: cutlass.Constexpr):
    """S -> P = exp2(S * scale_log2 - lse2) and dP -> dS = P (dP - D), in place, on (rows, cols)
    views of the score accumulators whose queries run along mode `queries_mode` (1: S^T, keys
    as rows; 0: queries as rows); query_of(i) is the i-th query's row in lse_rows / d_rows
    (masked entries: P = 0, so dS = 0; rows past the sequence: lse2 = +inf). With softcap, dS
    is multiplied by the cap's derivative 1 - t^2, clamped at 0: exact for real tanh values,
    and 0 for masked ones."""
    for a in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[queries_mode])):
        q = query_of(a)
        lse2, dsum = lse_rows[q], d_rows[q]
        for b in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1 - queries_mode])):
            rc = (b, a) if const_expr(queries_mode == 1) else (a, b)
            t = acc_S_mn[rc]
            p = cute.math.exp2(t * softmax_scale_log2 - lse2, fastmath=True)
            ds = p * (acc_dP_mn[rc] - dsum)
            if const_expr(has_softcap):
                ds = ds * cutlass.max(Float32(1.0) - t * t, Float32(0.0))
            acc_S_mn[rc] = p
            acc_dP_mn[rc] = ds


@cute.jit
def copy_column_part(copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, part: cutlass.Constexpr):
    """Copy a thread's fragment of a column part of a tile (src: (CPY, M, n), the part's MMA
    column steps) to part `part` of the whole tile's partition (dst: (CPY, M, N), N = n x parts).
    Slicing the whole tile's partition keeps the swizzled addresses right; a local_tile view of the
    part's columns does not when the part starts inside a swizzle atom (the DSL adds the view
    origin's swizzled offset to the swizzled offsets within the view, and the XOR does not
    distribute over that sum): with q_parts = 2 at d = 128, dQ read garbage that way."""
    steps = cute.size(src, mode=[2])
    for j in cutlass.range_constexpr(steps):
        cute.copy(copy, src[None, None, j], dst[None, None, part * steps + j])
