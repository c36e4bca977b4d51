"""The portable attention forward: mma.sync (m16n8k16), ldmatrix and cp.async only, so one code
path serves sm_80, sm_86, sm_89 and sm_120 (and runs on Hopper, where it is tested).

One CTA computes one tile: `tile_m` query rows of one (batch, head) against every key block they
see, visited from the last to the first (the masked blocks first, as in the sm90 forward; the
block iterator runs the unmasked middle without mask code). Every warp owns rows of the tile;
all warps load. The key loop is FlashAttention-2's single-buffered pipeline: while S = Q K^T of
block n is computed, V of block n loads; while O += P V is computed, K of block n - 1 loads
(cp.async groups, one __syncthreads at each hand-over).

Rows past a sequence's end are never read into registers that matter: K rows past seqlen_k are
masked to -inf before the softmax, and V rows past it are zeroed in shared memory (0 * garbage
could be NaN). Shapes (batch, lengths, heads, window, scale) are runtime values: one compiled
kernel serves every shape of its static configuration.
"""
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, const_expr

from ..common import epilogue
from ..common.block_info import BlockInfo
from ..common.convert import convert_fragment
from ..common.global_atomics import block_idx_x_again
from ..common.layout import (acc_mn_view, acc_to_a_operand_layout, lse_seq_major,
                             pack_heads_into_rows, seq_major, transposed_view)
from ..common.mask import apply_mask
from ..common.score_mod import softcap_scores
from ..common.seqlen_info import SeqlenInfo
from ..common.softmax import LOG2E, MAX_LAG_LOG2, OnlineSoftmax
from ..common.tile_scheduler import fixed_tile_coord, varlen_tile_coord
from . import mma
from .combine import AT_ONCE_FOLDED, merge_row


@dataclass(frozen=True)
class Sm80FwdConfig:
    """The static configuration of one compiled forward kernel (the compile key)."""
    dtype: type                 # cutlass.BFloat16 or cutlass.Float16
    head_dim: int
    head_dim_v: int
    tile_m: int                 # query rows per CTA
    tile_n: int                 # keys per block
    num_warps: int
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    # KV-cache forms (flash_attn_with_kvcache): k/v rows of batch kv_batch_idx[b]; keys starting
    # at leftpad_k[b]; k/v in pages of a cache, one page lookup per key block (tile_n divides the
    # page size) or, with gather_pages, per copy pass of the block's rows (a block spans pages:
    # the pass's rows, rows_per_copy_pass of them, must divide the page size); keys in
    # num_splits ranges written as float32 partial outputs with their LSE (merged afterwards
    # by their LSE).
    kv_batch_idx: bool = False
    leftpad_k: bool = False
    paged_kv: bool = False
    gather_pages: bool = False
    split_kv: bool = False
    # With split_kv (no sink): the CTA that stores a tile's last split merges the tile's rows
    # (combine.merge_row) instead of a combine kernel after it; each tile counts its stored
    # splits in mSplitCounts (int32, zero, left at zero by the last one).
    fold_combine: bool = False
    # Pack-GQA: the query heads sharing a kv head (this many, a divisor of tile_m) are rows of
    # one tile, so a tile reads its K/V once for all of them (decoding: one query row per head).
    pack_gqa: int = 1
    # K/V blocks in flight: 1 is FlashAttention-2's pipeline (V loads under S = Q K^T, the next K
    # under O += P V); kv_stages >= 2 is a ring of that many K/V buffers, kv_stages - 1 blocks
    # loading ahead of the one computed (decoding, bound by reading the cache, needs them).
    kv_stages: int = 1
    # q/k/v's head dims may be narrower than head_dim / head_dim_v (padded to these compiled
    # widths): their loads zero-fill the columns past them and the O store leaves those out
    padded: bool = False
    # An fp8 KV cache (decoding): cutlass.Float8E4M3FN or Float8E5M2, the format of k/v's bytes
    # (passed as uint8). The ring of kv_stages blocks holds the bytes as loaded; each block is
    # converted to `dtype` in one K/V buffer before its MMAs; the per-(batch, kv head) descales
    # scale the scores (k's, folded into the softmax scale) and the output (v's).
    kv_fp8: Optional[type] = None
    # Decoding's few rows: a 16-row tile whose warps split each key block (16 keys a warp,
    # each its own online softmax and output rows), merged through shared memory at the end,
    # instead of warps stacked on rows that are mostly padding (a 64-row tile holds 4 rows of
    # a GQA-4 decode step: 4x the MMAs and every warp reading all of K and V by ldmatrix).
    # Measured on the H200: 1.24-1.29x an fp8 cache's step, 1.02-1.09x a bf16 one.
    split_keys: bool = False
    # With split_keys and an fp8 cache (head dims multiples of 64): each warp loads its own
    # keys of every block, with its own lanes, 16 bytes a thread (mma.byte_copy_wide,
    # cp.async.cg), so the key loop syncs warps, not the CTA (one CTA barrier for Q, at the
    # first block); and K's and V's MMA fragments are converted straight from the ring of
    # bytes (a lane reads runs of its warp's rows, whoever loaded them), with no converted
    # buffer, no ldmatrix and one warp sync a block. The fragments' head-dim order is permuted
    # so that a lane's bytes are contiguous (q_fragment, fragment_column); the ring's rows are
    # padded by FRAGMENT_ROW_PAD bytes so that those runs are read without bank conflicts.
    # Measured on the H200 (docs/perf-log.md): the warp-local loads 1.10-1.34x a contiguous
    # fp8 step, the 16-byte copies 1.18-1.78x the 8-byte ones, the fragments 1.00-1.13x the
    # converted buffer. (A bf16 step ran 0.98-1.00x with warp-local loads: it keeps the CTA's.)
    warp_local: bool = False
    # With warp_local and a bf16 q (measured 1.01-1.14x the fp8 step where the tiles fill the
    # GPU, 0.98-1.02x on split grids; docs/perf-log.md): both MMAs in fp16, so that the
    # cache's bytes take one conversion a pair (cvt e4m3x2/e5m2x2 -> f16x2, exact) instead of
    # three more to bf16. Q's fragment is rounded to fp16 once a tile
    # (scaled by the power of two that puts its largest magnitude just under 2^15, the scores
    # scaled back), P is rounded to fp16 times 2^F16_P_LOG2 (the output's scale takes it out)
    # so that fp16 keeps small probabilities normal: both operands hold at least bf16's bits.
    f16_operands: bool = False
    lazy_rescale: bool = False  # A/B: OnlineSoftmax.max_lag_log2 = MAX_LAG_LOG2 (16-bit P)
    # A launch bound: ptxas fits the registers to this many CTAs an SM (0: unbounded). The
    # warp-local tile at d=128 takes 194 registers unbounded, 168 without spills at 3.
    min_ctas_per_sm: int = 0
    # a learnable sink per query head (gpt-oss): float32 mSink (h,), one more term of each row's
    # denominator in the epilogue (OnlineSoftmax.finalize); a tile's rows are one query head
    # (not with pack_gqa or split_kv: decoding merges the sink in its combine kernel)
    has_sink: bool = False

    @property
    def kv_elem_bytes(self) -> int:
        return 1 if self.kv_fp8 is not None else self.dtype.width // 8

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        """Q (reused for O), kv_stages K and V blocks (with kv_fp8: of bytes, and one K/V block
        converted to `dtype`)."""
        elem = self.dtype.width // 8
        kv_block = self.tile_n * (self.head_dim + self.head_dim_v)
        if self.warp_local:  # (padded rows of bytes, nothing converted in shared memory)
            kv_block = self.tile_n * (self.head_dim + self.head_dim_v + 2 * FRAGMENT_ROW_PAD)
        converted = kv_block * elem if self.kv_fp8 is not None and not self.warp_local else 0
        return (self.tile_m * self.head_dim * elem + self.kv_stages * kv_block * self.kv_elem_bytes
                + converted)


KEYS_PER_WARP = 16  # Sm80FwdConfig.split_keys: each warp's share of a key block
FRAGMENT_ROW_PAD = 16  # bytes after each row of the ring with warp_local (bank spread)
F16_P_LOG2 = 15  # f16_operands: P in [0, 1] rounded to fp16 as 2^15 P (fp16's top power of two)
Q_F16_MAX_LOG2 = 14  # f16_operands: Q's largest magnitude scaled into [2^14, 2^15)


def fragment_column(p: int, width: int) -> int:
    """warp_local's order of O's columns: accumulator column p (of `width`) holds output
    column fragment_column(p). Lane g of the P V MMA's B operand holds column g of every 8-column
    n block; mapped so, those are the width/8 consecutive columns from g * width / 8 of V's rows,
    which the lane reads as one run."""
    return (width // 8) * (p % 8) + p // 8


class FlashFwdSm80:
    def __init__(self, cfg: Sm80FwdConfig):
        # O is staged in Q's buffer: dv <= d
        assert cfg.head_dim_v <= cfg.head_dim, "head_dim_v > head_dim is not supported"
        assert not (cfg.padded and (cfg.paged_kv or cfg.pack_gqa > 1)), "padded: forward only"
        assert cfg.kv_fp8 is None or (cfg.kv_stages >= 2 and not cfg.padded), "fp8: a decode ring"
        # (a lane's runs: d/4 bytes of a K row, d_v/8 of a V row, in 16- or 8-byte loads)
        assert not cfg.warp_local or (cfg.kv_fp8 is not None and cfg.head_dim % 64 == 0
                                      and cfg.head_dim_v % 64 == 0), cfg
        assert cfg.head_dim % 16 == 0 and cfg.tile_n % 16 == 0
        if cfg.split_keys:  # (16 rows; a warp per 16 keys of a ring stage)
            assert cfg.tile_m == mma.MMA_ROWS and cfg.tile_n == KEYS_PER_WARP * cfg.num_warps
            assert cfg.kv_stages >= 2 and not cfg.has_sink, cfg
            if cfg.warp_local:  # (a warp's copy passes tile its keys; no padded columns)
                assert not cfg.padded, cfg
                for cols in (cfg.head_dim, cfg.head_dim_v):
                    assert KEYS_PER_WARP % mma.rows_per_copy_pass(cfg.dtype, 32, cols) == 0, cfg
        else:
            assert not cfg.warp_local, cfg
            assert cfg.tile_m % (mma.MMA_ROWS * cfg.num_warps) == 0
        assert cfg.tile_m % cfg.pack_gqa == 0 and not (cfg.pack_gqa > 1 and cfg.varlen_q)
        # every copy pass of the loads (and of the O store) lies inside the tile
        for rows, cols in ((cfg.tile_m, cfg.head_dim), (cfg.tile_n, cfg.head_dim),
                           (cfg.tile_n, cfg.head_dim_v)):
            assert rows % mma.rows_per_copy_pass(cfg.dtype, cfg.num_threads, cols) == 0, cfg
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.num_threads = cfg.num_threads
        self.group = cfg.pack_gqa      # query rows per query position (pack-GQA)
        self.fp8 = cfg.kv_fp8 is not None  # an fp8 cache (decoding)
        self.fragments = cfg.warp_local  # (K's and V's operands converted into registers)
        assert not cfg.f16_operands or cfg.warp_local, cfg
        self.mma_dtype = cutlass.Float16 if cfg.f16_operands else cfg.dtype  # (the MMAs' operands)
        # the output column of an accumulator column where the warp-local tile permutes them
        self.o_column = (lambda p: fragment_column(p, cfg.head_dim_v)) if self.fragments else None
        self.tile_q = cfg.tile_m // cfg.pack_gqa  # query positions per tile

    # ------------------------------------------------------------------------------------------
    # Host side. The argument list is declared once, in arguments.py.
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,      # (b, s_q, h, d) or (total_q, h, d) when varlen_q
        mK: cute.Tensor,      # (b, s_k, h_k, d) or (total_k, h_k, d) when varlen_k
        mV: cute.Tensor,      # like mK, with d_v
        mO: cute.Tensor,      # like mQ, with d_v
        mLSE: cute.Tensor,    # (b, h, s_q) or (h, total_q), float32
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mKvBatchIdx: Optional[cute.Tensor],   # int32 (b,): the k/v batch row of sequence b
        mLeftpadK: Optional[cute.Tensor],     # int32 (b,): where sequence b's keys start
        mPageTable: Optional[cute.Tensor],    # int32 (b, max_pages); k/v (pages, page_size, h_k, d)
        mOPartial: Optional[cute.Tensor],     # float32 (splits, b, s_q, h, d_v) (split_kv)
        mLSEPartial: Optional[cute.Tensor],   # float32 (splits, b, h, s_q) (split_kv)
        mSplitCounts: Optional[cute.Tensor],  # int32 (>= tiles,), zero (fold_combine)
        mKDescale: Optional[cute.Tensor],     # float32 (b, h_k): an fp8 cache's (kv_fp8)
        mVDescale: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],         # float32 (h,): learnable sinks (has_sink)
        qhead_per_kvhead: Int32,
        score_scale: Float32,
        softmax_scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        num_splits: Int32,                    # key ranges per tile (split_kv; else 1)
        l2_group: Int32,
        l2_small_groups: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        # the merge's views: the tensors as the combine kernel takes them (fold_combine)
        merge_views = ((mOPartial, mLSEPartial, mO, mLSE) if const_expr(cfg.fold_combine)
                       else (None, None, None, None))
        mQ, mO = seq_major(mQ, cfg.varlen_q), seq_major(mO, cfg.varlen_q)
        # paged k/v (pages, page_size, h_k, d) are seen as batched with a page as the batch
        mK, mV = seq_major(mK, cfg.varlen_k), seq_major(mV, cfg.varlen_k)
        mLSE = lse_seq_major(mLSE, cfg.varlen_q)
        if const_expr(cfg.split_kv):
            mOPartial = cute.make_tensor(mOPartial.iterator,
                                         cute.select(mOPartial.layout, mode=[2, 4, 3, 1, 0]))
            mLSEPartial = cute.make_tensor(mLSEPartial.iterator,
                                           cute.select(mLSEPartial.layout, mode=[3, 2, 1, 0]))
        if const_expr(self.group > 1):  # rows (query head in group, position); heads: kv heads
            mQ, mO = (pack_heads_into_rows(t, self.group, 2) for t in (mQ, mO))
            mLSE = pack_heads_into_rows(mLSE, self.group, 1)
            if const_expr(cfg.split_kv):
                mOPartial = pack_heads_into_rows(mOPartial, self.group, 2)
                mLSEPartial = pack_heads_into_rows(mLSEPartial, self.group, 1)

        sQ_layout = mma.smem_layout(self.dtype, self.tile_m, self.d)
        # a stage mode for the ring, or none (an fp8 cache's ring holds bytes, converted into
        # one K/V buffer)
        ring = cfg.kv_stages if const_expr(cfg.kv_stages > 1 and not self.fp8) else 0
        sK_layout = mma.smem_layout(self.dtype, self.tile_n, self.d, stages=ring)
        sV_layout = mma.smem_layout(self.dtype, self.tile_n, self.dv, stages=ring)
        SharedStorage = self.shared_storage(sQ_layout, sK_layout, sV_layout)

        num_heads = mQ.shape[2]  # kv heads with pack-GQA
        if const_expr(cfg.varlen_q):
            batch = mCuSeqlensQ.shape[0] - 1
            # an upper bound on the packed query blocks (tile_scheduler.varlen_tile_coord)
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m + batch
            num_tiles = num_m_blocks * num_heads
        else:
            batch = mQ.shape[3]
            num_m_blocks = (cute.size(mQ, mode=[0]) + self.tile_m - 1) // self.tile_m
            num_tiles = num_m_blocks * num_heads * batch

        if const_expr(cfg.split_kv):
            num_tiles = num_tiles * num_splits

        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mKvBatchIdx, mLeftpadK, mPageTable, mOPartial, mLSEPartial, mKDescale, mVDescale,
            mSink, mSplitCounts, *merge_views, qhead_per_kvhead, num_m_blocks, num_heads, batch,
            l2_group, l2_small_groups, score_scale, softmax_scale_log2, window_left, window_right,
            num_splits, sQ_layout, sK_layout, sV_layout, SharedStorage,
        ).launch(
            grid=[num_tiles, 1, 1],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=cfg.min_ctas_per_sm,
            # (a bound of more than one CTA would ask the device for its shared memory)
            preferred_smem_carveout=100 if const_expr(cfg.min_ctas_per_sm > 1) else None,
        )

    def shared_storage(self, sQ_layout, sK_layout, sV_layout):
        """The kernel's shared memory (a plain Python function: the struct's fields depend on
        the configuration, and a jit function's `if` would be traced, not taken)."""
        dtype, staged = self.dtype, self.cfg.kv_stages * self.tile_n  # keys an fp8 ring holds
        pad = FRAGMENT_ROW_PAD if self.fragments else 0

        @cute.struct
        class SharedStorage:
            # 1024-byte aligned: a swizzle period (8 rows of 128 bytes) starts on a bank boundary
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024]
            if not self.fragments:  # (the warp-local tile converts into registers)
                sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]
            if self.fp8:
                sK8: cute.struct.Align[cute.struct.MemRange[Uint8, staged * (self.d + pad)], 128]
                sV8: cute.struct.Align[cute.struct.MemRange[Uint8, staged * (self.dv + pad)], 128]
        return SharedStorage

    def ring_layout(self, cols: int) -> cute.Layout:
        """An fp8 cache's ring of bytes as loaded, (keys, cols, stage): rows of `cols` bytes
        (padded by FRAGMENT_ROW_PAD with warp_local), a stage after the other."""
        row = cols + (FRAGMENT_ROW_PAD if self.fragments else 0)
        return cute.make_layout((self.tile_n, cols, self.cfg.kv_stages),
                                stride=(row, 1, row * self.tile_n))

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mKvBatchIdx: Optional[cute.Tensor], mLeftpadK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor], mOPartial: Optional[cute.Tensor],
        mLSEPartial: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor], mSink: Optional[cute.Tensor],
        mSplitCounts: Optional[cute.Tensor], mOPartialRows: Optional[cute.Tensor],
        mLSEPartialRows: Optional[cute.Tensor], mORows: Optional[cute.Tensor],
        mLSERows: Optional[cute.Tensor],
        qhead_per_kvhead: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
        l2_group: Int32, l2_small_groups: Int32, score_scale: Float32, softmax_scale_log2: Float32,
        window_left: Int32, window_right: Int32, num_splits: Int32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        split = Int32(0)
        if const_expr(cfg.split_kv):  # a tile's splits are neighbours in the grid
            split = tile % num_splits
            tile = tile // num_splits
        # Tile order: causal and windowed tiles longest first (common/tile_scheduler.py); the
        # hardware hands out CTAs in index order, so the heavy tiles start first.
        lpt = cfg.causal or cfg.local
        if const_expr(cfg.varlen_q):
            head_idx = tile // num_m_blocks
            m_block, batch_idx = varlen_tile_coord(tile % num_m_blocks, mCuSeqlensQ, mSeqUsedQ,
                                                   batch, mQ.shape[0], self.tile_m, lpt)
        else:
            # (with pack-GQA a tile's head is a kv head: nothing to group for L2)
            m_block, head_idx, batch_idx = fixed_tile_coord(
                tile, num_m_blocks, num_heads, batch, l2_group, l2_small_groups,
                qhead_per_kvhead if const_expr(self.group == 1) else 1, lpt)
        tile_valid = batch_idx < batch  # the packed grid has a few spare tiles past the end
        batch_idx = cutlass.min(batch_idx, batch - 1)
        # keys per sequence: the rows of k, or with pages all of a sequence's pages
        rows_k = mK.shape[0]
        if const_expr(cfg.paged_kv):
            rows_k = mPageTable.shape[1] * mK.shape[0]
        rows_q = mQ.shape[0] if const_expr(self.group == 1) else mQ.shape[0][1]  # positions
        seqlen = SeqlenInfo.create(batch_idx, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK,
                                   mSeqUsedQ, mSeqUsedK, mLeftpadK)
        # the k/v batch row (a cache row; clamped into the cache: memory safety)
        kv_batch = batch_idx
        if const_expr(cfg.kv_batch_idx):
            kv_batch = cutlass.min(cutlass.max(mKvBatchIdx[batch_idx], 0), mK.shape[3] - 1)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = sV = None
        if const_expr(not self.fragments):
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sV_layout)
        head_idx_kv = head_idx // qhead_per_kvhead if const_expr(self.group == 1) else head_idx
        staging = None
        v_descale = None
        if const_expr(self.fp8):
            # the ring of bytes as loaded (without warp_local, only the thread that loaded a
            # chunk reads it back)
            staging = (storage.sK8.get_tensor(self.ring_layout(self.d)),
                       storage.sV8.get_tensor(self.ring_layout(self.dv)))
            # the descales of this sequence's kv head: k's scales the raw scores (inside the
            # softcap when there is one), v's the output
            k_descale = mKDescale[batch_idx, head_idx_kv]
            v_descale = mVDescale[batch_idx, head_idx_kv]
            if const_expr(cfg.has_softcap):
                score_scale = score_scale * k_descale
            else:
                softmax_scale_log2 = softmax_scale_log2 * k_descale
        if tile_valid & (m_block * self.tile_q < seqlen.seqlen_q):
            self.attend(mQ, mK, mV, mO, mLSE, mPageTable, mOPartial, mLSEPartial, sQ, sK, sV,
                        seqlen, m_block, head_idx, head_idx_kv, batch_idx,
                        kv_batch, split, num_splits, score_scale, softmax_scale_log2,
                        window_left, window_right, tidx, staging, v_descale,
                        mSink[head_idx] * Float32(LOG2E) if const_expr(cfg.has_sink) else None)
            if const_expr(cfg.fold_combine):
                self.merge_if_last(mSplitCounts, (mOPartialRows, mLSEPartialRows, mORows, mLSERows),
                                   sQ, num_splits, seqlen, m_block, head_idx, batch_idx, tidx)

    @cute.jit
    def merge_if_last(self, mSplitCounts, merge_views, sQ, num_splits, seqlen: SeqlenInfo,
                      m_block, head_idx, batch_idx, tidx):
        """fold_combine, after this split's partials are stored: the tile's split count goes up
        by one; the CTA that brings it to num_splits (every other split's partials are stored
        by then) resets it and merges the tile's rows, a warp a row (combine.merge_row)."""
        # each thread's partial stores ordered before the count (the release half; the count
        # itself is acq_rel, and the merging CTA fences again before it reads)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        # the tile's counter: the tile index from the CTA index read anew (the one from the
        # kernel's start, kept alive through the key loop, cost the 16-row tile a register)
        tile = block_idx_x_again() // num_splits
        # Q's buffer is past its last read (the barrier above): it carries the verdict
        verdict = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=Int32), cute.make_layout(1))
        if tidx == 0:
            stored = cute.arch.atomic_add(mSplitCounts.iterator + tile, Int32(1), sem="acq_rel",
                                          scope="gpu")
            last = Int32(0)
            if stored == num_splits - 1:
                last = Int32(1)
                mSplitCounts[tile] = Int32(0)  # every split has counted: zero for the next call
            verdict[0] = last
        cute.arch.barrier()
        if verdict[0] != 0:
            cute.arch.fence_acq_rel_gpu()
            mOPartial, mLSEPartial, mO, mLSE = merge_views
            warp, lane = tidx // 32, tidx % 32
            for r in cutlass.range(warp, self.tile_m, self.cfg.num_warps, unroll=1):
                row = m_block * self.tile_m + r  # (packed: query head in group fastest)
                q, h = row, head_idx
                if const_expr(self.group > 1):
                    q, h = row // self.group, head_idx * self.group + row % self.group
                if q < seqlen.seqlen_q:
                    merge_row(mOPartial, mLSEPartial, None, mO, mLSE, num_splits, batch_idx, q,
                              h, lane, self.dv // 32, self.dtype, False, AT_ONCE_FOLDED)

    @cute.jit
    def attend(self, mQ, mK, mV, mO, mLSE, mPageTable, mOPartial, mLSEPartial, sQ, sK, sV,
               seqlen: SeqlenInfo, m_block, head_idx, head_idx_kv, batch_idx, kv_batch, split,
               num_splits, score_scale, softmax_scale_log2, window_left, window_right, tidx,
               staging=None, v_descale=None, sink_log2=None):
        """One tile (with split_kv, one key range of it): load, the key loop, the epilogue.
        staging, v_descale: an fp8 cache's ring of bytes (K's, V's) and v's descale. sink_log2:
        the tile's query head's learnable sink, times log2(e) (cfg.has_sink)."""
        cfg = self.cfg
        # the block geometry is over query positions (tile_q of them per tile with pack-GQA);
        # loads, stores and the element mask over the tile's rows
        block_info = BlockInfo(self.tile_q, self.tile_n, cfg.causal, cfg.local,
                               window_left, window_right)
        n_min, n_max = block_info.n_block_range(seqlen.seqlen_q, seqlen.seqlen_k, m_block)
        if const_expr(cfg.split_kv):
            # split `split` takes its share of whole key blocks (the last ones may be empty:
            # their partial output is 0 with LSE -inf, which the merge weighs 0)
            per_split = (n_max - n_min + num_splits - 1) // num_splits
            n_min = n_min + split * per_split
            n_max = cutlass.min(n_max, n_min + per_split)
        row_start = m_block * self.tile_m  # the tile's first row (packed with pack-GQA)
        q_start = m_block * self.tile_q    # its first query position
        rows_q = seqlen.seqlen_q * self.group  # the sequence's rows

        # Global -> shared copies (every thread takes part; with warp_local each warp copies its
        # own keys of K and V, by its lanes)
        local = cfg.warp_local
        own = tidx // 32  # (with warp_local: the warp whose keys this thread copies)
        copy_q = mma.gmem_to_smem_copy(self.dtype, self.num_threads, self.d).get_slice(tidx)
        kv_threads, kv_tidx = (32, tidx % 32) if const_expr(local) else (self.num_threads, tidx)
        kv_rows = KEYS_PER_WARP if const_expr(local) else self.tile_n  # (a thread's copy tile)
        copy_k = (mma.gmem_to_smem_copy(self.dtype, kv_threads, self.d).get_slice(kv_tidx)
                  if const_expr(local) else copy_q)
        copy_v = mma.gmem_to_smem_copy(self.dtype, kv_threads, self.dv).get_slice(kv_tidx)
        gQ = cute.local_tile(seqlen.q_view(mQ, head_idx, batch_idx), (self.tile_m, self.d), (m_block, 0))
        tQgQ, tQsQ = copy_q.partition_S(gQ), copy_q.partition_D(sQ)
        # (with a ring: per stage)
        tKsK = tVsV = None
        if const_expr(not self.fragments):
            tKsK, tVsV = copy_k.partition_D(sK), copy_v.partition_D(sV)
        tQcQ = copy_q.partition_S(cute.make_identity_tensor((self.tile_m, self.d)))
        tKcK = copy_k.partition_S(cute.make_identity_tensor((kv_rows, self.d)))
        tVcV = copy_v.partition_S(cute.make_identity_tensor((kv_rows, self.dv)))
        load_block = partial(self.load_warp_block, warp=own) if const_expr(local) else self.load_block
        if const_expr(cfg.paged_kv):
            # one head of the cache, (page_size, d, pages); the sequence's row of the table
            kv_k, kv_v = mK[None, None, head_idx_kv, None], mV[None, None, head_idx_kv, None]
            pages = mPageTable[batch_idx, None]
        else:
            kv_k = seqlen.k_view(mK, head_idx_kv, kv_batch)
            kv_v = seqlen.k_view(mV, head_idx_kv, kv_batch)
            pages = None
        ring = cfg.kv_stages > 1
        tKsK8 = tVsV8 = None
        if const_expr(self.fp8):
            # the loads fill the ring of bytes: with warp_local 16 bytes a lane; else in the
            # converted buffer's chunks (8 keys' elements a thread), the thread that loads a
            # chunk converting it
            if const_expr(local):
                copy_k8, copy_v8 = (mma.byte_copy_wide(self.dtype, kv_threads, cols).get_slice(kv_tidx)
                                    for cols in (self.d, self.dv))
            else:
                copy_k8 = mma.byte_copy_like(self.dtype, kv_threads, self.d).get_slice(kv_tidx)
                copy_v8 = mma.byte_copy_like(self.dtype, kv_threads, self.dv).get_slice(kv_tidx)
            staged = [self.warp_rows(x, own) if const_expr(local) else x for x in staging]
            tKsK8, tVsV8 = copy_k8.partition_D(staged[0]), copy_v8.partition_D(staged[1])
            tKcK8 = copy_k8.partition_S(cute.make_identity_tensor((kv_rows, self.d)))
            tVcV8 = copy_v8.partition_S(cute.make_identity_tensor((kv_rows, self.dv)))
            load_k = partial(load_block, copy_k8, kv_k, pages, tKsK8, tKcK8,
                             seqlen.seqlen_k, self.d)
            load_v = partial(load_block, copy_v8, kv_v, pages, tVsV8, tVcV8,
                             seqlen.seqlen_k, self.dv)
        else:
            load_k = partial(load_block, copy_k, kv_k, pages, tKsK, tKcK, seqlen.seqlen_k,
                             self.d)
            load_v = partial(load_block, copy_v, kv_v, pages, tVsV, tVcV, seqlen.seqlen_k,
                             self.dv)
        # MMA partitions: S = Q K^T from shared memory, O += P V with P in registers.
        # (split_keys: a one-warp MMA on this warp's keys; mma_tidx its lane)
        warp = tidx // 32
        mma_tidx = tidx % 32 if const_expr(cfg.split_keys) else tidx
        tiled_mma = mma.tiled_mma(self.mma_dtype, 1 if const_expr(cfg.split_keys) else cfg.num_warps)
        thr_mma = tiled_mma.get_slice(mma_tidx)
        keys = KEYS_PER_WARP if const_expr(cfg.split_keys) else self.tile_n
        ld_q = ld_k = ld_v = tSsQ = tSsK = tOsVt = ring_k = ring_v = None
        if const_expr(self.fragments):
            # every operand in registers: Q's for the tile (q_fragment, at the first block),
            # K's and V's a block at a time from the ring (scores_from_ring, v_fragment)
            tSrQ = cute.make_rmem_tensor(thr_mma.partition_shape_A((self.tile_m, self.d)),
                                         self.mma_dtype)
            tSrK = cute.make_rmem_tensor(thr_mma.partition_shape_B((keys, self.d)), self.mma_dtype)
            tOrVt = cute.make_rmem_tensor(thr_mma.partition_shape_B((self.dv, keys)), self.mma_dtype)
            ring_k, ring_v = (self.warp_rows(x, warp) for x in staging)
        else:
            # the stage-0 views build the MMA fragments (a stage is a whole tile: swizzle-safe)
            sK0 = sK[None, None, 0] if const_expr(ring and not self.fp8) else sK
            sV0 = sV[None, None, 0] if const_expr(ring and not self.fp8) else sV
            sK0, sV0 = self.warp_keys(sK0, warp), self.warp_keys(sV0, warp)
            sVt = transposed_view(sV0)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK0))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            ld_q = cute.make_tiled_copy_A(mma.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(mma_tidx)
            ld_k = cute.make_tiled_copy_B(mma.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(mma_tidx)
            ld_v = cute.make_tiled_copy_B(mma.ldmatrix_atom(self.dtype, True), tiled_mma).get_slice(mma_tidx)
            tSsQ, tSsK, tOsVt = ld_q.partition_S(sQ), ld_k.partition_S(sK0), ld_v.partition_S(sVt)

        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, keys)), Float32)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.dv)), Float32)
        acc_O.fill(0.0)
        acc_S_mn, acc_O_mn = acc_mn_view(acc_S), acc_mn_view(acc_O)
        coord_S = cute.make_identity_tensor((self.tile_m, self.tile_n))
        if const_expr(cfg.split_keys):  # (the block's coordinates of this warp's keys)
            coord_S = cute.local_tile(coord_S, (self.tile_m, keys), (0, warp))
        coord_S_mn = acc_mn_view(thr_mma.partition_C(coord_S))
        tOrP = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.mma_dtype)
        softmax = OnlineSoftmax.create(
            softmax_scale_log2, cute.size(acc_S_mn, mode=[0]),
            max_lag_log2=MAX_LAG_LOG2 if const_expr(cfg.lazy_rescale and not cfg.f16_operands) else 0.0)
        q_unscale = None  # (f16_operands: Q's scale undone)
        if const_expr(cfg.f16_operands):
            q_unscale = cute.make_rmem_tensor((1,), Float32)
        softmax.reset()

        ops = SimpleNamespace(
            tiled_mma=tiled_mma, acc_S=acc_S, acc_O=acc_O, acc_S_mn=acc_S_mn, acc_O_mn=acc_O_mn,
            coord_S_mn=coord_S_mn, tOrP=tOrP, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tSsQ=tSsQ,
            tSsK=tSsK, tOsVt=tOsVt, ld_q=ld_q, ld_k=ld_k, ld_v=ld_v, sK=sK, sV=sV, warp=warp,
            tKsK=tKsK, tVsV=tVsV, tKsK8=tKsK8, tVsV8=tVsV8, sQ=sQ, ring_k=ring_k, ring_v=ring_v,
            lane=tidx % 32, q_unscale=q_unscale)
        key_block = self.key_block
        if const_expr(ring):
            key_block = self.key_block_fp8 if const_expr(self.fp8) else self.key_block_ring
        if const_expr(self.fragments):
            key_block = self.key_block_fragments
        block = partial(key_block, ops=ops,
                        softmax=softmax, load_k=load_k, load_v=load_v,
                        block_info=block_info, seqlen=seqlen, row_start=row_start,
                        q_start=q_start, n_min=n_min, n_max=n_max,
                        score_scale=score_scale, window_left=window_left,
                        window_right=window_right)

        if n_max > n_min:
            # Q and the first (top) key block, bounded by the sequence ends.
            mma.load_rows(copy_q, tQgQ, tQsQ, tQcQ, rows_q - row_start, True,
                          cols=mQ.shape[1] if const_expr(cfg.padded) else None)
            if const_expr(ring):
                # the top block (K and V) then kv_stages - 2 more, a commit group each (empty past
                # n_min, so that every iteration can wait for "all but the newest kv_stages - 2")
                page = load_k(n_max - 1, True, 0)
                load_v(n_max - 1, True, 0, page=page)
                cute.arch.cp_async_commit_group()
                for i in cutlass.range_constexpr(1, cfg.kv_stages - 1):
                    if n_max - 1 - i >= n_min:
                        page = load_k(n_max - 1 - i, False, i)
                        load_v(n_max - 1 - i, False, i, page=page)
                    cute.arch.cp_async_commit_group()
            else:
                load_k(n_max - 1, True)
                cute.arch.cp_async_commit_group()
            block(n_max - 1, mask=None, top=True)
            runs = block_info.key_block_runs(seqlen.seqlen_q, seqlen.seqlen_k, q_start,
                                             self.tile_q, n_min, n_max)
            for run in cutlass.range_constexpr(len(runs)):
                first, stop, mask = runs[run]
                for i in cutlass.range(first, stop, unroll=1):
                    block(n_max - 1 - i, mask=mask, top=False)

        # Epilogue: rows that saw no key get O = 0 and LSE = -inf (softmax.finalize).
        if const_expr(ring):
            cute.arch.cp_async_wait_group(0)  # (the last groups are empty; none left in flight)
        if const_expr(cfg.split_keys):  # warp 0 takes the other warps' rows in; it alone stores
            self.merge_warps(acc_O, softmax, thr_mma, staging[0] if const_expr(self.fragments)
                             else sK, warp, mma_tidx)
        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        softmax.finalize(acc_O_mn, lse, None, sink_log2)
        if const_expr(self.fp8):
            if const_expr(cfg.f16_operands):  # (P V summed 2^F16_P_LOG2 P)
                v_descale = v_descale * Float32(2.0 ** -F16_P_LOG2)
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                acc_O[i] = acc_O[i] * v_descale
        if const_expr(cfg.split_kv):
            # float32 partials straight from the registers (decode tiles are a few rows)
            def store_partials():
                epilogue.store_lse(lse, epilogue.lse_view(mLSEPartial[None, None, None, split],
                                                          seqlen, head_idx, batch_idx),
                                   thr_mma, self.dv, row_start, rows_q, self.tile_m)
                gO = cute.local_tile(seqlen.q_view(mOPartial[None, None, None, None, split],
                                                   head_idx, batch_idx),
                                     (self.tile_m, self.dv), (m_block, 0))
                epilogue.store_acc(acc_O, gO, thr_mma, row_start, rows_q, self.tile_m, self.dv,
                                   column=self.o_column)
            self.by_storing_warps(store_partials, warp)
        else:
            self.by_storing_warps(lambda: epilogue.store_lse(
                lse, epilogue.lse_view(mLSE, seqlen, head_idx, batch_idx), thr_mma, self.dv,
                row_start, rows_q, self.tile_m), warp)
            cute.arch.barrier()  # every warp is past its reads of Q's buffer: O is staged there
            sO = cute.make_tensor(sQ.iterator, sQ.layout)
            if const_expr(self.dv != self.d):  # (tile_m, dv) over Q's buffer
                sO = cute.make_tensor(sQ.iterator, mma.smem_layout(self.dtype, self.tile_m, self.dv))
            if const_expr(self.fragments):  # (O's columns in fragment_column's order)
                self.by_storing_warps(lambda: epilogue.store_acc(
                    acc_O, sO, thr_mma, 0, self.tile_m, self.tile_m, self.dv, self.dtype,
                    column=self.o_column), warp)
            else:
                self.by_storing_warps(lambda: epilogue.stage_o(
                    acc_O, sO, tiled_mma, mma_tidx, self.dtype, stmatrix=False), warp)
            cute.arch.barrier()
            gO = cute.local_tile(seqlen.q_view(mO, head_idx, batch_idx), (self.tile_m, self.dv),
                                 (m_block, 0))
            epilogue.store_o(sO, gO, row_start, rows_q, tidx, self.dtype, self.dv,
                             self.tile_m, self.num_threads,
                             cols=mO.shape[1] if const_expr(cfg.padded) else None)

    @cute.jit
    def by_storing_warps(self, store, warp):
        """store() by the warps that hold the tile's results: all of them, or with split_keys
        warp 0 (which merged the others' rows in)."""
        if const_expr(self.cfg.split_keys):
            if warp == 0:
                store()
        else:
            store()

    def warp_rows(self, x: cute.Tensor, warp) -> cute.Tensor:
        """warp_keys of a buffer with or without a stage mode ((keys, cols[, stages]))."""
        if const_expr(cute.rank(x) == 2):
            return self.warp_keys(x, warp)
        return cute.local_tile(x, (KEYS_PER_WARP, cute.size(x, mode=[1]), cute.size(x, mode=[2])),
                               (warp, 0, 0))

    def block_sync(self, top: cutlass.Constexpr):
        """The key loop's barrier: the CTA's, or with warp_local the warp's (all a block's
        shared data is the warp's own then) except at the first block, whose barrier also
        makes Q, loaded by every thread, visible to all."""
        if const_expr(self.cfg.warp_local and not top):
            cute.arch.sync_warp()
        else:
            cute.arch.barrier()

    def warp_keys(self, x: cute.Tensor, warp) -> cute.Tensor:
        """With split_keys, this warp's KEYS_PER_WARP rows of a (keys, cols) K or V buffer (a
        view starting on a whole swizzle atom); else the buffer."""
        if const_expr(not self.cfg.split_keys):
            return x
        return cute.local_tile(x, (KEYS_PER_WARP, cute.size(x, mode=[1])), (warp, 0))

    @cute.jit
    def merge_warps(self, acc_O: cute.Tensor, softmax: OnlineSoftmax, thr_mma, sK: cute.Tensor,
                    warp, lane):
        """split_keys' epilogue: warp 0's rows become the whole key range's. Each warp's rows
        are an online softmax over its keys (its max, its sum, its output relative to them);
        warp 0 rescales every warp's to the largest max and adds them up, then its softmax
        state is the merged one (finalize as usual). The other warps' outputs come through
        K's buffer (the loop is over), a few columns a round so that they fit it."""
        cfg = self.cfg
        warps: cutlass.Constexpr = cfg.num_warps
        rows: cutlass.Constexpr = softmax.num_rows
        coord = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.dv))))
        acc_mn = acc_mn_view(acc_O)
        cols: cutlass.Constexpr = cute.size(acc_mn, mode=[1])
        # scratch: (max, sum) per (warp, row), then the other warps' values of a round
        scratch_floats: cutlass.Constexpr = cute.cosize(sK.layout) * sK.element_type.width // 32
        stats_floats: cutlass.Constexpr = 2 * warps * self.tile_m
        per_round: cutlass.Constexpr = (scratch_floats - stats_floats) // ((warps - 1) * 32 * rows)
        chunk: cutlass.Constexpr = max(c for c in range(1, cols + 1)
                                       if cols % c == 0 and c <= per_round)
        base = cute.recast_ptr(sK.iterator, dtype=Float32)
        stats = cute.make_tensor(base, cute.make_layout((2, warps, self.tile_m)))
        values = cute.make_tensor(base + stats_floats,
                                  cute.make_layout((32, rows, chunk, warps - 1)))
        cute.arch.barrier()  # every warp is past its last reads of K and V
        for r in cutlass.range_constexpr(rows):
            total = cute.arch.warp_reduction_sum(softmax.row_sum[r], threads_in_group=4)
            if lane % 4 == 0:
                stats[0, warp, coord[r, 0][0]] = softmax.row_max[r]
                stats[1, warp, coord[r, 0][0]] = total
        cute.arch.barrier()
        # warp 0: each warp's weight per row, 2^((its max - the largest) * scale); a warp whose
        # keys were all masked (max -inf) weighs 0, and so does every warp of a row none saw
        weights = cute.make_rmem_tensor((rows, warps), Float32)
        if warp == 0:
            for r in cutlass.range_constexpr(rows):
                row = coord[r, 0][0]
                top = stats[0, 0, row]
                for w in cutlass.range_constexpr(1, warps):
                    top = cute.arch.fmax(top, stats[0, w, row])
                merged_sum = Float32(0.0)
                for w in cutlass.range_constexpr(warps):
                    weight = Float32(0.0)
                    if stats[0, w, row] != -Float32.inf:
                        weight = cute.math.exp2((stats[0, w, row] - top) * softmax.scale_log2,
                                                fastmath=True)
                    weights[r, w] = weight
                    if const_expr(w > 0):
                        merged_sum += weight * stats[1, w, row]
                softmax.row_max[r] = top
                softmax.row_sum[r] = softmax.row_sum[r] * weights[r, 0]
                if lane % 4 == 0:  # (finalize sums the quad's partial sums)
                    softmax.row_sum[r] = softmax.row_sum[r] + merged_sum
                for c in cutlass.range_constexpr(cols):
                    acc_mn[r, c] = acc_mn[r, c] * weights[r, 0]
        for c0 in cutlass.range_constexpr(0, cols, chunk):
            if warp > 0:
                for r in cutlass.range_constexpr(rows):
                    for c in cutlass.range_constexpr(chunk):
                        values[lane, r, c, warp - 1] = acc_mn[r, c0 + c]
            cute.arch.barrier()
            if warp == 0:
                for w in cutlass.range_constexpr(1, warps):
                    for r in cutlass.range_constexpr(rows):
                        for c in cutlass.range_constexpr(chunk):
                            acc_mn[r, c0 + c] = acc_mn[r, c0 + c] + weights[r, w] * values[lane, r, c, w - 1]
            cute.arch.barrier()

    @cute.jit
    def key_block(self, n_block, ops: SimpleNamespace, softmax: OnlineSoftmax, load_k, load_v,
                  block_info: BlockInfo, seqlen: SeqlenInfo, row_start, q_start, n_min, n_max,
                  score_scale, window_left, window_right, mask: cutlass.Constexpr,
                  top: cutlass.Constexpr):
        """One key block (K[n_block] has landed or is in flight): V loads under S = Q K^T, the
        next K under O += P V. `mask` as in scores_to_probs; `top`: the first block visited, the
        only one that can hold the sequence end (its V rows past the end are zeroed)."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # K (and Q) visible to all; every warp is past the last P V
        load_v(n_block, top)
        cute.arch.cp_async_commit_group()
        ops.acc_S.fill(0.0)
        mma.gemm(ops.tiled_mma, ops.acc_S, ops.tSrQ, ops.tSrK, ops.tSsQ, ops.tSsK, ops.ld_q, ops.ld_k)
        self.scores_to_probs(ops.acc_S, ops.acc_S_mn, ops.coord_S_mn, softmax, block_info, seqlen,
                             row_start, q_start, n_block, score_scale, window_left, window_right,
                             mask)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # V visible to all; every warp is past its reads of K
        if n_block > n_min:
            load_k(n_block - 1, False)
        cute.arch.cp_async_commit_group()
        softmax.rescale(ops.acc_O_mn)
        convert_fragment(ops.acc_S, ops.tOrP)
        mma.gemm(ops.tiled_mma, ops.acc_O, ops.tOrP, ops.tOrVt, None, ops.tOsVt, None, ops.ld_v,
                 a_in_registers=True)

    @cute.jit
    def key_block_ring(self, n_block, ops: SimpleNamespace, softmax: OnlineSoftmax, load_k, load_v,
                       block_info: BlockInfo, seqlen: SeqlenInfo, row_start, q_start, n_min,
                       n_max, score_scale, window_left, window_right, mask: cutlass.Constexpr,
                       top: cutlass.Constexpr):
        """key_block with a ring of kv_stages K/V buffers: block n_block (the j-th visited, in
        stage j % kv_stages) has landed once all but the newest kv_stages - 2 commit groups have;
        after the barrier every warp is past the previous block's reads, so its stage takes the
        block kv_stages - 1 ahead. One barrier per block."""
        stages = self.cfg.kv_stages
        j = n_max - 1 - n_block
        stage = j % stages
        cute.arch.cp_async_wait_group(stages - 2)
        self.block_sync(top)
        ahead = n_block - (stages - 1)
        if ahead >= n_min:
            page = load_k(ahead, False, (j + stages - 1) % stages)
            load_v(ahead, False, (j + stages - 1) % stages, page=page)
        cute.arch.cp_async_commit_group()
        sK = self.warp_keys(ops.sK[None, None, stage], ops.warp)
        sV = self.warp_keys(ops.sV[None, None, stage], ops.warp)
        tSsK = ops.ld_k.partition_S(sK)
        tOsVt = ops.ld_v.partition_S(transposed_view(sV))
        ops.acc_S.fill(0.0)
        mma.gemm(ops.tiled_mma, ops.acc_S, ops.tSrQ, ops.tSrK, ops.tSsQ, tSsK, ops.ld_q, ops.ld_k)
        self.scores_to_probs(ops.acc_S, ops.acc_S_mn, ops.coord_S_mn, softmax, block_info, seqlen,
                             row_start, q_start, n_block, score_scale, window_left, window_right,
                             mask)
        softmax.rescale(ops.acc_O_mn)
        convert_fragment(ops.acc_S, ops.tOrP)
        mma.gemm(ops.tiled_mma, ops.acc_O, ops.tOrP, ops.tOrVt, None, tOsVt, None, ops.ld_v,
                 a_in_registers=True)

    @cute.jit
    def key_block_fp8(self, n_block, ops: SimpleNamespace, softmax: OnlineSoftmax, load_k, load_v,
                      block_info: BlockInfo, seqlen: SeqlenInfo, row_start, q_start, n_min,
                      n_max, score_scale, window_left, window_right, mask: cutlass.Constexpr,
                      top: cutlass.Constexpr):
        """key_block_ring for an fp8 cache: block n_block's bytes (the j-th visited, in stage
        j % kv_stages) have landed for this thread once all but the newest kv_stages - 2 of its
        commit groups have; after the first barrier every warp is past the previous block's
        reads of the converted buffer, and each thread converts the chunks it loaded. The block
        kv_stages - 1 ahead then loads into the stage the thread converted one block ago (no
        other thread reads a thread's chunks). The second barrier makes the conversion visible."""
        stages = self.cfg.kv_stages
        j = n_max - 1 - n_block
        stage = j % stages
        cute.arch.cp_async_wait_group(stages - 2)
        self.block_sync(top)
        self.convert_chunks(ops.tKsK8[None, None, None, stage], ops.tKsK)
        self.convert_chunks(ops.tVsV8[None, None, None, stage], ops.tVsV)
        ahead = n_block - (stages - 1)
        if ahead >= n_min:
            page = load_k(ahead, False, (j + stages - 1) % stages)
            load_v(ahead, False, (j + stages - 1) % stages, page=page)
        cute.arch.cp_async_commit_group()
        self.block_sync(False)  # (the conversion visible)
        ops.acc_S.fill(0.0)
        mma.gemm(ops.tiled_mma, ops.acc_S, ops.tSrQ, ops.tSrK, ops.tSsQ, ops.tSsK, ops.ld_q,
                 ops.ld_k)
        self.scores_to_probs(ops.acc_S, ops.acc_S_mn, ops.coord_S_mn, softmax, block_info, seqlen,
                             row_start, q_start, n_block, score_scale, window_left, window_right,
                             mask)
        softmax.rescale(ops.acc_O_mn)
        convert_fragment(ops.acc_S, ops.tOrP)
        mma.gemm(ops.tiled_mma, ops.acc_O, ops.tOrP, ops.tOrVt, None, ops.tOsVt, None, ops.ld_v,
                 a_in_registers=True)

    @cute.jit
    def key_block_fragments(self, n_block, ops: SimpleNamespace, softmax: OnlineSoftmax, load_k,
                            load_v, block_info: BlockInfo, seqlen: SeqlenInfo, row_start,
                            q_start, n_min, n_max, score_scale, window_left, window_right,
                            mask: cutlass.Constexpr, top: cutlass.Constexpr):
        """key_block_fp8 on the warp-local tile: once all but the newest kv_stages - 2 of every
        lane's commit groups have landed, the warp's sync makes the stage's bytes visible to all
        its lanes; each reads its runs of them into K's and V's fragments (Q's at the first
        block). The block kv_stages - 1 ahead then loads into the stage read one block ago. One
        sync a block, no shared-memory write."""
        stages = self.cfg.kv_stages
        j = n_max - 1 - n_block
        stage = j % stages
        cute.arch.cp_async_wait_group(stages - 2)
        self.block_sync(top)
        if const_expr(top):
            self.q_fragment(ops.sQ, ops.tSrQ, ops.lane, ops.q_unscale)
        ops.acc_S.fill(0.0)
        self.scores_from_ring(ops.ring_k[None, None, stage], ops, ops.lane)
        if const_expr(self.cfg.f16_operands):  # (before softcap and the softmax)
            for i in cutlass.range_constexpr(cute.size(ops.acc_S)):
                ops.acc_S[i] = ops.acc_S[i] * ops.q_unscale[0]
        # (V's bytes read after S's MMAs are issued, so that K's and V's fragments are not live
        # together: 194 registers against 201 unbounded at d=128)
        self.v_fragment(ops.ring_v[None, None, stage], ops.tOrVt, ops.lane)
        ahead = n_block - (stages - 1)
        if ahead >= n_min:
            page = load_k(ahead, False, (j + stages - 1) % stages)
            load_v(ahead, False, (j + stages - 1) % stages, page=page)
        cute.arch.cp_async_commit_group()
        self.scores_to_probs(ops.acc_S, ops.acc_S_mn, ops.coord_S_mn, softmax, block_info, seqlen,
                             row_start, q_start, n_block, score_scale, window_left, window_right,
                             mask)
        softmax.rescale(ops.acc_O_mn)
        if const_expr(self.cfg.f16_operands):
            # 2^15 P (exact): fp16 keeps P's small values normal. (Not the softmax's max offset:
            # with scores of 1e8 the offset's rounding moved the exponent by more than 1 and
            # the row's largest P overflowed fp16.)
            for i in cutlass.range_constexpr(cute.size(ops.acc_S)):
                ops.acc_S[i] = ops.acc_S[i] * Float32(2.0 ** F16_P_LOG2)
        convert_fragment(ops.acc_S, ops.tOrP)
        for k in cutlass.range_constexpr(cute.size(ops.tOrVt, mode=[2])):
            cute.gemm(ops.tiled_mma, ops.acc_O, ops.tOrP[None, None, k], ops.tOrVt[None, None, k],
                      ops.acc_O)

    # The warp-local tile's operands. Lane (g, t) = (lane // 4, lane % 4) of an m16n8k16 MMA holds, of
    # each k block, A's rows g, g + 8 and B's column g, at k slots 2t, 2t + 1, 2t + 8, 2t + 9.
    # S = Q K^T sums over the head dim in any order, so slot (k block s, j-th of those four)
    # stands for head-dim column (d / 4) t + 4 s + j, the same in Q and K: a lane's columns of a
    # K row are then d / 4 consecutive bytes. O's columns are permuted (fragment_column) for
    # the same reason on V's rows.
    @cute.jit
    def q_fragment(self, sQ: cute.Tensor, tSrQ: cute.Tensor, lane, q_unscale: cute.Tensor):
        """Q's A operand, in the permuted head-dim order, from its (swizzled) buffer; kept in
        registers for the tile. Value v of a k block, (v0, v1, v2) = (v % 2, v // 2 % 2, v // 4):
        row + 8 v1, head-dim column + v0 + 2 v2. With f16_operands the values are rounded to
        fp16, first scaled by the power of two that brings the warp's largest magnitude into
        [2^14, 2^15) (fp16's 11 bits then hold every value down to 2^-29 of it, more than
        bf16's 8); q_unscale[0] gets its inverse."""
        g, t = lane // 4, lane % 4
        values = tSrQ  # (with f16_operands: q's values first)
        if const_expr(self.cfg.f16_operands):
            values = cute.make_rmem_tensor(tSrQ.shape, self.dtype)
        for s in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            for v in cutlass.range_constexpr(8):
                values[v, 0, s] = sQ[g + 8 * ((v // 2) % 2),
                                     (self.d // 4) * t + 4 * s + 2 * (v // 4) + v % 2]
        if const_expr(self.cfg.f16_operands):
            top = Float32(0.0)
            for i in cutlass.range_constexpr(cute.size(values)):
                top = cute.arch.fmax(top, abs(Float32(values[i])))
            top = cute.arch.warp_reduction_max(top)
            # 2^(Q_F16_MAX_LOG2 - e) for top in [2^e, 2^(e+1)), from the float's exponent bits
            # (exact; clamped so that both powers are normal floats: an all-zero Q any)
            bits = cute.make_rmem_tensor((1,), Float32)
            bits[0] = top
            exponent = (cute.recast_tensor(bits, Int32)[0] >> 23) & 0xFF
            shift = cutlass.min(cutlass.max(exponent - (127 + Q_F16_MAX_LOG2), -112), 112)
            scales = cute.make_rmem_tensor((2,), Int32)
            scales[0] = (127 - shift) << 23
            scales[1] = (127 + shift) << 23
            scale = cute.recast_tensor(scales, Float32)
            for i in cutlass.range_constexpr(cute.size(values)):
                tSrQ[i] = (Float32(values[i]) * scale[0]).to(cutlass.Float16)
            q_unscale[0] = scale[1]

    @cute.jit
    def scores_from_ring(self, ring: cute.Tensor, ops: SimpleNamespace, lane):
        """acc_S += Q K^T with K's B operand (this warp's 16 keys) from one stage of the ring:
        key g + 8 n of n block n is its row's d/4 bytes from (d/4) t, each k block's four
        converted just before its MMAs."""
        g, t = lane // 4, lane % 4
        run: cutlass.Constexpr = self.d // 4
        raw = [self.ring_run(ring, g + 8 * n, run * t, run)
               for n in range(cute.size(ops.tSrK, mode=[1]))]
        for s in cutlass.range_constexpr(cute.size(ops.tSrK, mode=[2])):
            for n in cutlass.range_constexpr(cute.size(ops.tSrK, mode=[1])):
                values = self.converted(cute.local_tile(raw[n], (4,), (s,)))
                for v in cutlass.range_constexpr(4):
                    ops.tSrK[v, n, s] = values[v]
            cute.gemm(ops.tiled_mma, ops.acc_S, ops.tSrQ[None, None, s], ops.tSrK[None, None, s],
                      ops.acc_S)

    @cute.jit
    def v_fragment(self, ring: cute.Tensor, tOrVt: cute.Tensor, lane):
        """V's B operand of P V from one stage of the ring: slot v of the 16 keys (key
        2t + v % 2 + 8 (v // 2)) at n block n is column fragment_column(8 n + g) of that key's
        row: the row's d_v/8 bytes from (d_v/8) g, converted."""
        g, t = lane // 4, lane % 4
        run: cutlass.Constexpr = self.dv // 8
        for v in cutlass.range_constexpr(4):
            values = self.converted(self.ring_run(ring, 2 * t + v % 2 + 8 * (v // 2), run * g, run))
            for n in cutlass.range_constexpr(cute.size(tOrVt, mode=[1])):
                tOrVt[v, n, 0] = values[n]

    @cute.jit
    def ring_run(self, ring: cute.Tensor, row, col, run: cutlass.Constexpr) -> cute.Tensor:
        """`run` bytes of a ring row from column col (a multiple of run), in registers."""
        raw = cute.make_rmem_tensor((run,), Uint8)
        cute.autovec_copy(cute.local_tile(ring, (1, run), (row, col // run))[0, None], raw)
        return raw

    @cute.jit
    def converted(self, raw: cute.Tensor) -> cute.Tensor:
        """Bytes in the cache's fp8 format as the MMAs' values (exact)."""
        values = cute.make_rmem_tensor(raw.shape, self.mma_dtype)
        values.store(cute.recast_tensor(raw, self.cfg.kv_fp8).load().to(self.mma_dtype))
        return values

    @cute.jit
    def convert_chunks(self, src, dst):
        """This thread's chunks of one staged block (bytes in the cfg.kv_fp8 format) into the
        converted buffer, as `dtype` (exact: every e4m3 and e5m2 value is a bf16 and an fp16
        value; the conversion goes through f16x2, in hardware from sm_89 on)."""
        # a copy pass's rows at a time (fewer live registers than the whole block)
        for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
            raw = cute.make_rmem_tensor_like(src[None, m, None])
            cute.autovec_copy(src[None, m, None], raw)
            values = cute.make_rmem_tensor_like(dst[None, m, None])
            values.store(cute.recast_tensor(raw, self.cfg.kv_fp8).load().to(self.dtype))
            cute.autovec_copy(values, dst[None, m, None])

    @cute.jit
    def load_block(self, thr_copy, mX, pages, tXsX, tXcX, seqlen_k, cols: cutlass.Constexpr,
                   n_block, bounded: cutlass.Constexpr, stage=None, page=None):
        """K or V block n_block into its shared buffer (rows past seqlen_k zeroed if `bounded`).
        mX: the (keys, cols) rows of this head; or, paged, the cache's (page_size, cols, pages)
        with `pages` the sequence's row of the page table (tile_n divides the page size, so a
        block lies in one page: one lookup, clamped into the table and the cache). `page` and
        the None returned keep load_warp_block's signature: here V's copy looks its page up
        again (holding K's lookup for it was neutral on the H200, and put the bf16 kernel past
        its 168-register cap on sm_80-89)."""
        if const_expr(self.cfg.kv_stages > 1):
            tXsX = tXsX[None, None, None, stage]
        if const_expr(self.cfg.gather_pages):
            self.load_block_pages(thr_copy, mX, pages, tXsX, tXcX, seqlen_k, cols, n_block, bounded)
            return None
        if const_expr(self.cfg.paged_kv):
            page, run = self.page_of(mX, pages, n_block * self.tile_n, self.tile_n)
            gX = cute.local_tile(mX[None, None, page], (self.tile_n, cols), (run, 0))
        else:
            gX = cute.local_tile(mX, (self.tile_n, cols), (n_block, 0))
        mma.load_rows(thr_copy, thr_copy.partition_S(gX), tXsX, tXcX,
                       seqlen_k - n_block * self.tile_n, bounded,
                       cols=mX.shape[1] if const_expr(self.cfg.padded) else None)
        return None

    @cute.jit
    def page_of(self, mX, pages, first_key, rows: cutlass.Constexpr):
        """(page, index of the `rows`-key run within it) of the run from first_key (inside one
        page): the page from the sequence's row of the table, clamped into the table and the
        cache (mX: its (page_size, cols, pages))."""
        page_size = mX.shape[0]
        slot = cutlass.min(first_key // page_size, pages.shape[0] - 1)
        page = cutlass.min(cutlass.max(pages[slot], 0), mX.shape[2] - 1)
        return page, (first_key % page_size) // rows

    @cute.jit
    def load_warp_block(self, thr_copy, mX, pages, tXsX, tXcX, seqlen_k, cols: cutlass.Constexpr,
                        n_block, bounded: cutlass.Constexpr, stage=None, page=None, *, warp):
        """load_block with warp_local: this warp's KEYS_PER_WARP keys of block n_block into its
        rows of the stage (tXsX, tXcX: its lanes' partitions of those rows). Pages are
        multiples of 16 keys, so the warp's keys lie in one page: one lookup, returned, which
        V's copy of the block takes as `page` (one table read and page-size division a block,
        not two: 1.01-1.03x an fp8 paged step, which is latency-bound)."""
        tXsX = tXsX[None, None, None, stage]
        first_key = n_block * self.tile_n + warp * KEYS_PER_WARP
        if const_expr(self.cfg.paged_kv):
            if const_expr(page is None):
                page = self.page_of(mX, pages, first_key, KEYS_PER_WARP)
            gX = cute.local_tile(mX[None, None, page[0]], (KEYS_PER_WARP, cols), (page[1], 0))
        else:
            gX = cute.local_tile(mX, (KEYS_PER_WARP, cols), (first_key // KEYS_PER_WARP, 0))
        mma.load_rows(thr_copy, thr_copy.partition_S(gX), tXsX, tXcX, seqlen_k - first_key,
                      bounded)
        return page

    @cute.jit
    def load_block_pages(self, thr_copy, mX, pages, tXsX, tXcX, seqlen_k, cols: cutlass.Constexpr,
                         n_block, bounded: cutlass.Constexpr):
        """load_block for a key block that spans pages: each copy pass (a run of
        rows_per_copy_pass keys, all in one page since that run divides the page size) looks up
        its own page, clamped into the table and the cache. Keeps key blocks wide at small
        pages (one barrier per 64 keys at page 16, not per 16)."""
        rows_per_pass = self.tile_n // cute.size(tXsX, mode=[1])
        rows_left = seqlen_k - n_block * self.tile_n
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            page, run = self.page_of(mX, pages, n_block * self.tile_n + m * rows_per_pass,
                                     rows_per_pass)
            gX = cute.local_tile(mX[None, None, page], (rows_per_pass, cols), (run, 0))
            src = thr_copy.partition_S(gX)
            if const_expr(bounded):
                if tXcX[0, m, 0][0] < rows_left:
                    cute.copy(thr_copy, src[None, 0, None], tXsX[None, m, None])
                else:
                    tXsX[None, m, None].fill(0)
            else:
                cute.copy(thr_copy, src[None, 0, None], tXsX[None, m, None])

    @cute.jit
    def scores_to_probs(self, acc_S, acc_S_mn, coord_S_mn, softmax: OnlineSoftmax,
                        block_info: BlockInfo, seqlen: SeqlenInfo, row_start, q_start, n_block,
                        score_scale, window_left, window_right, mask: cutlass.Constexpr):
        """softcap, mask and online softmax of one score block (probabilities left in acc_S).
        mask: True or False when the block iterator knows whether the block needs the element
        mask, None to check."""
        cfg = self.cfg
        if const_expr(cfg.has_softcap):
            softcap_scores(acc_S, score_scale)
        apply = lambda: apply_mask(acc_S_mn, coord_S_mn, row_start, n_block * self.tile_n,
                                   seqlen.seqlen_q, seqlen.seqlen_k, window_left, window_right,
                                   cfg.causal, cfg.local, self.group)
        if const_expr(mask is None):
            if block_info.needs_mask(seqlen.seqlen_q, seqlen.seqlen_k, q_start, self.tile_q,
                                     n_block):
                apply()
        elif const_expr(mask):
            apply()
        softmax.step(acc_S_mn)
