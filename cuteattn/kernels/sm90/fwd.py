"""Hopper (sm_90a) attention forward: TMA loads, wgmma GEMMs, warp specialization.

A tile is `num_wg * 64` query rows of one (batch, head). The grid is persistent: at most
`max_ctas` CTAs (one per SM) walk the tiles (common/tile_scheduler.TileWalk: round robin, or
drawn from a counter when tiles differ in cost), so the next tile's K/V (and then Q) loads
overlap this tile's last GEMMs and its epilogue. In each CTA:
  - warpgroup 0 is the producer: one warp issues TMA loads of Q (once per tile) and of K and V
    blocks into a `num_stages`-deep ring of shared-memory buffers, guarded by mbarrier pipelines
    whose states run on across tiles;
  - warpgroups 1..num_wg are consumers: each owns 64 query rows, computes S = Q K^T with wgmma
    from shared memory, masks and turns S into probabilities P in registers (online softmax in the
    exp2 domain), and accumulates O += P V with a register-A wgmma.
Key blocks are visited from the last to the first, so the blocks that need masking (sequence
end, causal diagonal) come first and the row maxima are set by real scores early; the block
iterator (common/block_info.key_block_runs) runs the unmasked middle without mask code.

Everything shape-like (batch, sequence lengths, head counts, window sizes, scale) is a runtime
value: one compiled kernel serves every shape with the same static configuration.
"""
import enum
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import epilogue, named_barriers
from ..common.block_info import BlockInfo, DenseBlocks
from ..common.block_sparse import SparseBlockPairs, SparseBlocks
from ..common.convert import convert_fragment, fp8_p_fragment
from ..common.layout import (acc_mn_view, acc_to_a_operand_layout, keys_last_transposed,
                             lse_seq_major, seq_major, seq_major_transposed)
from ..common.mask import apply_mask
from ..common.mods import KernelMod, apply_mask_mod, apply_score_mod, traced
from ..common.score_mod import softcap_scores
from ..common.seqlen_info import SeqlenInfo
from ..common.softmax import LOG2E, MAX_LAG_LOG2, OnlineSoftmax
from ..common.tile_scheduler import TileWalk, fixed_tile_coord, varlen_tile_coord
from .gemm import PingPong, gemm_async
from .fp8_transpose import transpose_v
from .pipelines import WG_ROWS, WG_THREADS, arm_fix_barrier, make_tma_pipeline, register_split




# fp8_v_in_kernel: the producer warpgroup's warps 1-3 transpose V (warp 0 issues the TMA copies)
TRANSPOSE_WARPS = 3
TRANSPOSE_THREADS = 32 * TRANSPOSE_WARPS

# fp8 P is exp2(s - row max) scaled by 2^8 (at most 256 of e4m3's 448), so that small
# probabilities keep e4m3's normal precision (FA3's max offset); the row sums carry the same factor
FP8_P_MAX_LOG2 = 8.0


class FwdBarrier(enum.IntEnum):
    """Named barriers of the forward (0 is __syncthreads)."""
    EPILOGUE = 1       # + wg: one consumer warpgroup's O staging (ids 1..3)
    TURN = 4           # + wg: the GEMM turn of consumer warpgroup wg (ids 4..6)
    ALL_CONSUMERS = 7  # every consumer is past its last GEMM (O into a V stage they all read)
    K_DONE = 8         # + wg: warpgroup wg's last QK GEMM is done (O into that K stage; 8, 9)


def swizzle_atom_cols(dtype, cols: int) -> int:
    """The columns of the shared-memory swizzle atom that sm90_utils' layouts tile a row of
    `cols` elements with (the widest of 128, 64 and 32 bytes dividing the row): the width of
    one TMA copy where a key block arrives in slices (Sm90FwdConfig.key_slice), so that each
    slice of a stage is the copy box's own layout. 16-bit: 64 at d=64/128/192/256, 32 at d=96,
    16 at d=80."""
    row_bits = cols * dtype.width
    for atom_bits in (1024, 512, 256):
        if row_bits % atom_bits == 0:
            return atom_bits // dtype.width
    raise ValueError(f"no swizzle atom divides a row of {cols} {dtype.__name__} elements")


@dataclass(frozen=True)
class Sm90FwdConfig:
    """The static configuration of one compiled forward kernel: every field changes the code,
    and the config itself is the compile key."""
    dtype: type                 # q/k/v: cutlass.BFloat16, Float16, or Float8E4M3FN (fp8)
    head_dim: int
    head_dim_v: int
    tile_n: int                 # keys per block
    num_wg: int                 # consumer warpgroups (64 query rows each)
    num_stages: int             # depth of the K/V ring
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    pingpong: bool = True        # consumer warpgroups take turns issuing GEMMs
    dynamic_tiles: bool = False  # tiles from a global counter instead of round robin
    # Where O is staged on its way to global memory (config.py chooses): Q's buffer (the next
    # tile's Q loads only once the epilogue has read O back), a buffer of its own, the ring
    # stage of the tile's last V block, or that of its last K block ("k_stage": the last K
    # block's stage is held past its QK GEMM until the epilogue; a warpgroup waits only for the
    # others' last QK GEMM, not their last P V). The last three free Q's buffer after the
    # tile's last QK GEMM, so the next tile's Q loads under this one's last P V GEMM and
    # epilogue.
    o_path: str = "q_buffer"
    # out's head dim may be narrower than head_dim_v (a head dim padded to the next compiled
    # width: launch_common.compiled_width): O's columns past it are not stored. q, k and v need
    # nothing: TMA fills the columns past their head dim with zeros.
    clip_o: bool = False
    # block-sparse (common/block_sparse.py): the tile visits the key blocks its lists name, the
    # full ones then the partial ones (a partial block's element mask is the call's masks and
    # the mask_mod); tile_m and tile_n are the lists' block shape (but see sparse_pairs)
    sparse: bool = False
    # block-sparse lists of key blocks half the tile's width (64-key lists, 128-key tiles):
    # each visit is two listed blocks, one a half (common/block_sparse.SparseBlockPairs), so a
    # narrow list runs at the wide tile's rate; tile_n is then twice the lists' key block
    sparse_pairs: bool = False
    # O leaves shared memory by a TMA store, issued by one warp a consumer warpgroup, instead
    # of the threads' 16-byte global stores, whose drain held the next tile's first accesses
    # ~1000 cycles (block-sparse tiles, config.sparse_config; docs/perf-log.md). Only where
    # TMA's bounds are the rows' (no packed q, seqused_q or clipped O).
    tma_o_store: bool = False
    # FlexAttention's mask_mod traced into the kernel (common/mods.py: its key; the function
    # itself is handed to FlashFwdSm90 for tracing): applied to every block of a dense tile, to
    # the partial blocks of a block-sparse one
    mask_mod: Optional[KernelMod] = None
    # FlexAttention's score_mod, likewise, on every score before the masks (the softmax's
    # exponent then takes log2(e) alone: the launch passes it)
    score_mod: Optional[KernelMod] = None
    # Keys in pages of this many rows (flash_attn_varlen_func(block_table=), packed q): K and V
    # arrive as the cache's pages (num_pages, page_size, h_k, d), like batched keys with a
    # page in the batch's place; each key block lies inside one page (tile_n divides
    # page_size), found through mPageTable; the keys' count is seqused_k. 0: not paged.
    page_size: int = 0
    # a learnable sink per query head (gpt-oss): float32 mSink (h,), one more term of every
    # row's softmax denominator, with no value (OnlineSoftmax.finalize)
    has_sink: bool = False
    # a row keeps its max until scores pass it by MAX_LAG_LOG2, and a warp whose rows all kept
    # theirs skips O's rescale (OnlineSoftmax.max_lag_log2; config.py says where)
    lazy_rescale: bool = False
    # fp8 only: V arrives as it is, (keys, d_v) rows, TMA copies each block into a staging
    # ring, and the producer warpgroup's other three warps transpose it into the P V GEMM's
    # operand (fp8_transpose.py), instead of launch.py's pass over HBM before the kernel
    fp8_v_in_kernel: bool = False

    @property
    def tile_m(self) -> int:
        return WG_ROWS * self.num_wg

    @property
    def fp8(self) -> bool:
        """fp8 (e4m3) q/k/v with FlashAttention-3's descales, out in bf16. Both operands of an
        fp8 wgmma must be K-major, so V arrives transposed, (b, h_k, d_v, keys) with the keys of
        each 16-key group in FP8_KEY_ORDER (launch.py writes it): P's float32 registers are then
        already the A operand's, each thread's own values in another order (fp8_p_fragment)."""
        return self.dtype.width == 8

    @property
    def zeroes_v_past_end(self) -> bool:
        """Whether the rows of the last key block past the sequence's keys are memory the call
        does not own (the rest of a page; rows past seqused_k, e.g. an uninitialised cache's
        NaN and Inf): the producer zeroes V's there (load_kv, finish_v_past_end), since P is 0
        there but 0 x NaN is NaN; K's need nothing (the mask selects -inf over any score).
        (fp8 with seqused_k takes V^T from the pass, whose keys past it
        launch.zero_value_keys_past zeroes.)"""
        return bool(self.page_size) or (self.has_seqused_k and not self.fp8)

    @property
    def key_slice(self) -> int:
        """Keys a TMA copy of a K/V block takes when the block's keys come from several places
        (0: one copy a block): a page's, for pages smaller than a block; a listed block's, for
        sparse_pairs (each half from its own block)."""
        if self.page_size and self.page_size < self.tile_n:
            return self.page_size
        return self.tile_n // 2 if self.sparse_pairs else 0

    @property
    def o_dtype(self) -> type:
        return cutlass.BFloat16 if self.fp8 else self.dtype

    def smem_bytes(self) -> int:
        elem = self.dtype.width // 8
        q = self.tile_m * self.head_dim * elem
        o = self.tile_m * self.head_dim_v * self.o_dtype.width // 8 if self.o_path == "own_buffer" else 0
        kv = self.num_stages * self.tile_n * (self.head_dim + self.head_dim_v) * elem
        if self.fp8_v_in_kernel:  # V's staging ring
            kv += self.num_stages * self.tile_n * self.head_dim_v * elem
        return q + o + kv + 1024  # + barriers and alignment


class FlashFwdSm90:
    def __init__(self, cfg: Sm90FwdConfig, mod_fns: tuple = (None, None)):
        """mod_fns: the functions cfg.mask_mod and cfg.score_mod key (traced with the kernel's
        indices)."""
        self.mask_mod_fn, self.score_mod_fn = mod_fns
        assert (cfg.mask_mod is None) == (self.mask_mod_fn is None)
        assert (cfg.score_mod is None) == (self.score_mod_fn is None)
        assert not (cfg.score_mod is not None and (cfg.has_softcap or cfg.fp8))
        # O is staged in Q's buffer, each warpgroup's rows inside its own Q slice: dv <= d
        assert cfg.head_dim_v <= cfg.head_dim, "head_dim_v > head_dim is not supported"
        assert cfg.tile_n % 16 == 0 and cfg.head_dim % 16 == 0 and cfg.head_dim_v % 16 == 0
        # fp8: the GEMMs' k step is 32 (keys for P V, head-dim columns for Q K^T: a d=80
        # kernel compiled without complaint and computed wrong outputs on the GPU); O (bf16)
        # has a buffer of its own
        assert not cfg.fp8 or (cfg.tile_n % 32 == 0 and cfg.head_dim % 32 == 0
                               and cfg.o_path == "own_buffer" and not cfg.sparse)
        assert not cfg.fp8_v_in_kernel or (cfg.fp8 and not cfg.page_size
                                           and cfg.head_dim_v % 32 == 0)
        # (a pair's halves each end somewhere: the one V fix-up of the sequence's last block,
        # finish_v_past_end, does not apply; the lists of packed keys with seqused_k take
        # 64-key tiles)
        assert not cfg.sparse_pairs or (cfg.sparse and cfg.tile_n == 128
                                        and not cfg.zeroes_v_past_end)
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.o_dtype = cfg.o_dtype
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.num_wg = cfg.num_wg
        self.num_threads = WG_THREADS * (1 + cfg.num_wg)
        self.producer_regs, self.consumer_regs = register_split(
            cfg.num_wg, busy_producer=cfg.varlen_q or cfg.varlen_k or cfg.fp8_v_in_kernel)
        self.pingpong = PingPong(cfg.pingpong, cfg.num_wg, FwdBarrier.TURN)

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, TMA descriptors, launch. The argument list is declared once, in
    # arguments.py (compile fakes and launch arguments derive from it; a test checks this).
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,      # (b, s_q, h, d) or (total_q, h, d) when varlen_q
        mK: cute.Tensor,      # (b, s_k, h_k, d) or (total_k, h_k, d) when varlen_k
        mV: cute.Tensor,      # like mK, with d_v; fp8: (b, h_k, d_v, keys) (Sm90FwdConfig.fp8)
        mO: cute.Tensor,      # like mQ, with d_v
        mLSE: cute.Tensor,    # (b, h, s_q) or (h, total_q), float32
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mFullCount: Optional[cute.Tensor],     # block-sparse lists (cfg.sparse), see
        mFullIndex: Optional[cute.Tensor],     # common/arguments.SparseMetadata
        mPartialCount: Optional[cute.Tensor],
        mPartialIndex: Optional[cute.Tensor],
        mQDescale: Optional[cute.Tensor],      # fp8: float32 (b, h_k) descales of q, k, v
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        mCuSeqlensV: Optional[cute.Tensor],    # fp8, packed keys: sequences' starts in V^T
        mModTensor0: Optional[cute.Tensor],    # the tensors cfg.mask_mod reads
        mModTensor1: Optional[cute.Tensor],
        mModTensor2: Optional[cute.Tensor],    # the tensors cfg.score_mod reads
        mModTensor3: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],     # paged keys: int32 (b, max_pages) page ids
        mSink: Optional[cute.Tensor],          # float32 (h,): learnable sinks (cfg.has_sink)
        mTileCounter: cute.Tensor,  # int32 (2,), zero between launches (dynamic_tiles only)
        qhead_per_kvhead: Int32,
        score_scale: Float32,      # multiplies raw scores (softmax_scale, or scale / softcap)
        softmax_scale_log2: Float32,  # log2(e) * (softmax_scale, or softcap)
        window_left: Int32,
        window_right: Int32,
        max_ctas: Int32,           # persistent grid size (SMs); >= the tile count: one tile each
        l2_group: Int32,           # (batch, head) pairs per small L2 group of the causal order
        l2_small_groups: Int32,    # how many small groups (then groups of l2_group + GQA ratio)
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        if const_expr(cfg.fp8):  # fp8 q, k, v arrive as their bytes (arguments.py)
            mQ, mK, mV = [cute.make_tensor(cute.recast_ptr(t.iterator, dtype=self.dtype), t.layout)
                          for t in (mQ, mK, mV)]
        mQ, mO = seq_major(mQ, cfg.varlen_q), seq_major(mO, cfg.varlen_q)
        mLSE = lse_seq_major(mLSE, cfg.varlen_q)
        mK = seq_major(mK, cfg.varlen_k)
        # V as the B operand of P V: (d_v, keys, h_k, b); keys contiguous (K-major) for fp8;
        # fp8_v_in_kernel: V's rows as TMA copies them, (keys, d_v, h_k, b) like K
        if const_expr(cfg.fp8_v_in_kernel):
            mVt = seq_major(mV, cfg.varlen_k)
        elif const_expr(cfg.fp8):
            mVt = keys_last_transposed(mV, cfg.varlen_k)
        else:
            mVt = seq_major_transposed(mV, cfg.varlen_k)
        v_major = cute.nvgpu.OperandMajorMode.K if const_expr(cfg.fp8) else cute.nvgpu.OperandMajorMode.MN

        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, v_major,
            Float32, (1, 1, 1), (WG_ROWS, self.dv), warpgroup.OperandSource.RMEM,
        )
        # Shared memory: Q has one (64, d) slice per consumer warpgroup; K and V a ring of stages.
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.d), self.dtype, self.num_wg)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.d), self.dtype, cfg.num_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR if const_expr(cfg.fp8) else LayoutEnum.COL_MAJOR,
            (WG_ROWS, self.dv, self.tile_n), self.dtype, cfg.num_stages)
        # fp8_v_in_kernel: V's staging ring, laid out as K's (a key's row contiguous); else
        # unused (sVt's layout stands in for the kernel's argument)
        sVrows_layout = sVt_layout
        if const_expr(cfg.fp8_v_in_kernel):
            sVrows_layout = sm90_utils.make_smem_layout_b(
                LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.dv), self.dtype, cfg.num_stages)
        # O's staging: one (64, dv) slice per consumer warpgroup (Q's layout when dv == d)
        sO_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.dv), self.o_dtype, self.num_wg)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.slice_(sQ_layout, (None, None, 0)), (WG_ROWS, self.d))
        k_box, v_box = cute.slice_(sK_layout, (None, None, 0)), cute.slice_(sVt_layout, (None, None, 0))
        k_tile, v_tile = (self.tile_n, self.d), (self.dv, self.tile_n)
        if const_expr(cfg.fp8_v_in_kernel):
            v_box, v_tile = cute.slice_(sVrows_layout, (None, None, 0)), (self.tile_n, self.dv)
        if const_expr(cfg.key_slice):
            # keys from several places (a block's pages, a pair's halves): one (key_slice,
            # swizzle atom's columns) slice a copy (load, copy_key_slices)
            k_tile = (cfg.key_slice, swizzle_atom_cols(self.dtype, self.d))
            v_tile = (swizzle_atom_cols(self.dtype, self.dv), cfg.key_slice)
            k_box = cute.slice_(sm90_utils.make_smem_layout_b(
                LayoutEnum.ROW_MAJOR, (WG_ROWS, *k_tile), self.dtype, 1), (None, None, 0))
            v_box = cute.slice_(sm90_utils.make_smem_layout_b(
                LayoutEnum.COL_MAJOR, (WG_ROWS, *v_tile), self.dtype, 1), (None, None, 0))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, k_box, k_tile)
        tma_atom_v, tma_vt = cpasync.make_tiled_tma_atom(tma_load, mVt, v_box, v_tile)
        tma_store_o = (None, None)
        if const_expr(cfg.tma_o_store):
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.slice_(sO_layout, (None, None, 0)),
                (WG_ROWS, self.dv))
            tma_store_o = (tma_atom_o, tma_o)
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sVt_layout, (None, None, 0)))
        self.shared_storage = self.shared_storage_type(sQ_layout, sK_layout, sVt_layout, sO_layout,
                                                       sVrows_layout)

        num_heads = mQ.shape[2]
        if const_expr(cfg.varlen_q):
            batch = mCuSeqlensQ.shape[0] - 1
            # an upper bound on the packed query blocks (see tile_scheduler.varlen_tile_coord)
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m + batch
            num_tiles = num_m_blocks * num_heads
        else:
            batch = mQ.shape[3]
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
            num_tiles = num_m_blocks * num_heads * batch

        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_vt, mO, tma_store_o, mLSE,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mFullCount, mFullIndex, mPartialCount, mPartialIndex,
            (mQDescale, mKDescale, mVDescale, mCuSeqlensV), (mModTensor0, mModTensor1, mModTensor2, mModTensor3),
            mPageTable, mSink, mTileCounter,
            # (paged: a sequence's keys are at most its table's pages)
            mQ.shape[0], mPageTable.shape[1] * cfg.page_size if const_expr(cfg.page_size) else mK.shape[0],
            qhead_per_kvhead, num_m_blocks, num_heads, batch, num_tiles,
            l2_group, l2_small_groups, score_scale, softmax_scale_log2, window_left, window_right,
            tiled_mma_pv, sQ_layout, sK_layout, sVt_layout, sO_layout, sVrows_layout,
        ).launch(
            grid=[cutlass.min(num_tiles, max_ctas), 1, 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def make_tiled_mma_qk(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), (WG_ROWS, self.tile_n),
        )

    def shared_storage_type(self, sQ_layout, sK_layout, sVt_layout, sO_layout, sVrows_layout):
        """The shared-memory layout (plain Python: the O buffer and V's staging ring are
        compile-time options)."""
        q_elems, k_elems, v_elems = (cute.cosize(x) for x in (sQ_layout, sK_layout, sVt_layout))
        stages = self.cfg.num_stages
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, k_elems], 1024],
            "sVt": cute.struct.Align[cute.struct.MemRange[self.dtype, v_elems], 1024],
            "mbar_tile": cute.struct.MemRange[cutlass.Int64, 2],
            # the V block that runs past the sequence's keys lands here first (load_kv with
            # v_past_end), then is published on the V pipeline's barrier (zeroes_v_past_end)
            "mbar_v_fix": cute.struct.MemRange[cutlass.Int64, 1],
            "next_tile": cute.struct.MemRange[Int32, 1],  # the tile hand-off slot (TileWalk)
        }
        if self.cfg.o_path == "own_buffer":
            fields["sO"] = cute.struct.Align[
                cute.struct.MemRange[self.o_dtype, cute.cosize(sO_layout)], 1024]
        if self.cfg.fp8_v_in_kernel:
            fields["mbar_vrows"] = cute.struct.MemRange[cutlass.Int64, 2 * stages]
            fields["sVrows"] = cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sVrows_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom, mVt: cute.Tensor,
        mO: cute.Tensor, tma_store_o: tuple, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mFullCount: Optional[cute.Tensor], mFullIndex: Optional[cute.Tensor],
        mPartialCount: Optional[cute.Tensor], mPartialIndex: Optional[cute.Tensor],
        fp8_args: tuple,  # (q, k, v descales, cu_seqlens_v)
        mod_tensors: tuple, mPageTable: Optional[cute.Tensor], mSink: Optional[cute.Tensor],
        mTileCounter: cute.Tensor,
        rows_q: Int32, rows_k: Int32, qhead_per_kvhead: Int32,
        num_m_blocks: Int32, num_heads: Int32, batch: Int32, num_tiles: Int32,
        l2_group: Int32, l2_small_groups: Int32, score_scale: Float32, softmax_scale_log2: Float32,
        window_left: Int32, window_right: Int32,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        sVrows_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.tma_o_store):
                cpasync.prefetch_descriptor(tma_store_o[0])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        consumer_warps = 4 * self.num_wg  # TMA pipelines count one release per consumer warp
        pipeline_q = make_tma_pipeline(storage.mbar_q, 1, self.q_bytes, consumer_warps)
        pipeline_k = make_tma_pipeline(storage.mbar_k, cfg.num_stages, self.k_bytes, consumer_warps)
        # V's rows land in the staging ring (pipeline_vrows: TMA -> the transposing warps), which
        # publish V^T to the consumers (pipeline_v) (fp8_v_in_kernel); else TMA fills V^T
        pipeline_vrows = None
        tile_readers = WG_THREADS * self.num_wg  # the threads that take each next tile
        if const_expr(cfg.fp8_v_in_kernel):
            pipeline_vrows = make_tma_pipeline(storage.mbar_vrows, cfg.num_stages, self.v_bytes,
                                               TRANSPOSE_WARPS)
            pipeline_v = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_v.data_ptr(), num_stages=cfg.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, TRANSPOSE_THREADS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS * self.num_wg),
                defer_sync=True)
            tile_readers += TRANSPOSE_THREADS
        else:
            pipeline_v = make_tma_pipeline(storage.mbar_v, cfg.num_stages, self.v_bytes, consumer_warps)
        handoff = None
        if const_expr(cfg.dynamic_tiles):
            handoff = TileWalk.make_handoff(storage.mbar_tile, tile_readers)
        # Make the barrier initialisation visible to every warp before anyone waits on it.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        sVrows = None
        if const_expr(cfg.fp8_v_in_kernel):
            sVrows = storage.sVrows.get_tensor(sVrows_layout.outer, swizzle=sVrows_layout.inner)
        # O's staging buffer (Sm90FwdConfig.o_path): Q's, its own, or, as a function of the
        # ring stage, the V stage of the tile's last block; (64, dv) slices in sO_layout.
        sO_q = sQ  # O over Q's buffer (also the v_stage path's, for a tile without keys)
        if const_expr(self.dv != self.d):
            # each warpgroup's O inside its own Q slice: a warpgroup stages O while the others
            # may still read their Q
            sO_q = self.o_in_q_slices(storage, sQ_layout, sO_layout)
        sO = sO_q
        if const_expr(cfg.o_path == "own_buffer"):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        if const_expr(cfg.o_path in ("v_stage", "k_stage")):
            in_v = const_expr(cfg.o_path == "v_stage")
            ring_start = storage.sVt.data_ptr() if in_v else storage.sK.data_ptr()
            stage_elems = (self.v_bytes if in_v else self.k_bytes) * 8 // self.dtype.width
            # (stages start on 1024-byte boundaries, as the 128-byte swizzle needs)
            sO = lambda stage: cute.make_tensor(
                cute.recast_ptr(ring_start + cute.assume(stage * stage_elems, divby=512),
                                sO_layout.inner, dtype=self.dtype), sO_layout.outer)

        block_info = BlockInfo(self.tile_m, self.tile_n, cfg.causal, cfg.local,
                               window_left, window_right)
        walk = TileWalk(num_tiles, mTileCounter if const_expr(cfg.dynamic_tiles) else None,
                        storage.next_tile.get_tensor(cute.make_layout(1)), handoff)
        tile_info = lambda tile: self.tile_info(
            tile, num_m_blocks, num_heads, batch, l2_group, l2_small_groups, qhead_per_kvhead,
            rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        # the key blocks a tile visits (DenseBlocks or SparseBlocks)
        visit = lambda seqlen, m_block, head_idx, batch_idx: self.visit_order(
            block_info, seqlen, m_block, head_idx, batch_idx,
            (mFullCount, mFullIndex, mPartialCount, mPartialIndex))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                load_tile = lambda m_block, head_idx, batch_idx, seqlen, q_state, kv_state: self.load(
                    tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK,
                    sVrows if const_expr(cfg.fp8_v_in_kernel) else sVt, pipeline_q, pipeline_k,
                    pipeline_vrows if const_expr(cfg.fp8_v_in_kernel) else pipeline_v,
                    q_state, kv_state, seqlen,
                    lambda: visit(seqlen, m_block, head_idx, batch_idx),
                    m_block, head_idx, head_idx // qhead_per_kvhead, batch_idx, fp8_args[3],
                    mPageTable, storage.mbar_v_fix.data_ptr() if const_expr(cfg.zeroes_v_past_end) else None)
                walk.walk(True, tile_info, load_tile,
                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                          pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages))
            if const_expr(cfg.fp8_v_in_kernel):
                if warp_idx > 0:
                    # a stage of each ring as a plain tensor in its swizzled layout (transpose_v
                    # composes its addresses from the layout; the rings' tensors above carry
                    # their swizzle in the pointer instead)
                    stage_bytes = self.v_bytes
                    stage_of = lambda ring, layout: lambda stage: cute.make_tensor(
                        ring.data_ptr() + cute.assume(stage * stage_bytes, divby=1024),
                        cute.slice_(layout, (None, None, 0)))
                    self.walk_transposes(walk, tile_info, visit,
                                         stage_of(storage.sVrows, sVrows_layout),
                                         stage_of(storage.sVt, sVt_layout), pipeline_vrows,
                                         pipeline_v, tidx - 32)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = (warp_idx // 4) - 1
            self.pingpong.start(wg)
            consume_tile = lambda m_block, head_idx, batch_idx, seqlen, q_state, kv_state: self.consume(
                tiled_mma_pv, sQ, sK, sVt, sO, sO_q, mO, tma_store_o, mLSE,
                pipeline_q, pipeline_k, pipeline_v, q_state, kv_state, seqlen,
                block_info, lambda: visit(seqlen, m_block, head_idx, batch_idx), score_scale,
                softmax_scale_log2, window_left, window_right, fp8_args, mod_tensors,
                m_block, head_idx, head_idx // qhead_per_kvhead, batch_idx, wg, tidx % WG_THREADS,
                mSink)
            # K and V advance together over a whole tile: one state carries both across tiles
            walk.walk(False, tile_info, consume_tile,
                      pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
                      pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages))
            if const_expr(cfg.tma_o_store):
                if (tidx % WG_THREADS) // 32 == 0:  # this warpgroup's O stores are complete
                    cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def walk_transposes(self, walk, tile_info, visit, rows_stage, vt_stage, pipeline_vrows,
                        pipeline_v, thread):
        """The producer warpgroup's warps 1-3 (fp8_v_in_kernel): every tile's V blocks from the
        staging ring into V^T, in the loader's order (`thread`: 0..TRANSPOSE_THREADS-1;
        rows_stage / vt_stage: stage -> that stage's tensor)."""
        transpose_tile = lambda m_block, head_idx, batch_idx, seqlen, rows_state, vt_state: (
            self.transpose_tile(rows_stage, vt_stage, pipeline_vrows, pipeline_v, rows_state, vt_state,
                                visit(seqlen, m_block, head_idx, batch_idx), thread))
        walk.walk(False, tile_info, transpose_tile,
                  pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.num_stages),
                  pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.num_stages))

    @cute.jit
    def transpose_tile(self, rows_stage, vt_stage, pipeline_vrows, pipeline_v, rows_state,
                       vt_state, visit, thread):
        """The transposing warps (fp8_v_in_kernel), one tile: each V block the loader copied
        into the staging ring, in V^T's stage of the same index (the rings advance together),
        published to the consumers after a proxy fence (wgmma reads shared memory through the
        async proxy). Returns the advanced states."""
        for _ in cutlass.range(visit.count(), unroll=1):
            pipeline_vrows.consumer_wait(rows_state)
            pipeline_v.producer_acquire(vt_state)
            transpose_v(rows_stage(rows_state.index), vt_stage(vt_state.index), thread,
                        TRANSPOSE_THREADS)
            cute.arch.fence_proxy("async.shared", space="cta")
            pipeline_v.producer_commit(vt_state)
            cute.arch.sync_warp()  # the warp's reads of the staging stage are done: one release
            pipeline_vrows.consumer_release(rows_state)
            rows_state.advance()
            vt_state.advance()
        return rows_state, vt_state

    def visit_order(self, block_info: BlockInfo, seqlen: SeqlenInfo, m_block, head_idx,
                    batch_idx, sparse_lists: tuple):
        """The key blocks the tile visits: a dense tile its block range from the last block
        down (DenseBlocks), a block-sparse one its full blocks, then its partial ones."""
        if const_expr(self.cfg.sparse_pairs):
            return SparseBlockPairs.create(*sparse_lists, batch_idx, head_idx, m_block,
                                           seqlen.seqlen_k, self.cfg.key_slice)
        if const_expr(self.cfg.sparse):
            return SparseBlocks.create(*sparse_lists, batch_idx, head_idx, m_block,
                                       seqlen.seqlen_k, self.tile_n)
        return DenseBlocks(*block_info.n_block_range(seqlen.seqlen_q, seqlen.seqlen_k, m_block))

    def o_in_q_slices(self, storage, sQ_layout, sO_layout):
        """(64, dv, num_wg) O staging over Q's buffer with Q's slice stride, so that warpgroup
        wg's O lies in wg's Q slice (dv < d: O's own layout would pack the slices closer)."""
        one = cute.slice_(sO_layout, (None, None, 0))
        q_slice = cute.cosize(cute.slice_(sQ_layout, (None, None, 0)))
        outer = cute.make_layout((*one.outer.shape, self.num_wg), stride=(*one.outer.stride, q_slice))
        return storage.sQ.get_tensor(outer, swizzle=sO_layout.inner)

    # Tile order (the linear tile index a CTA walks): common/tile_scheduler.py.
    @cute.jit
    def tile_info(self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
                  l2_group: Int32, l2_small_groups: Int32, qhead_per_kvhead: Int32,
                  rows_q: Int32, rows_k: Int32,
                  mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                  mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor]):
        """(m_block, head_idx, batch_idx, in_range, seqlen) of linear tile `tile`; in_range is
        False for the packed grid's spare tiles and for blocks past their sequence's end."""
        lpt = self.cfg.causal or self.cfg.local
        if const_expr(self.cfg.varlen_q):
            head_idx = tile // num_m_blocks
            m_block, batch_idx = varlen_tile_coord(tile % num_m_blocks, mCuSeqlensQ, mSeqUsedQ,
                                                   batch, rows_q, self.tile_m, lpt)
        else:
            m_block, head_idx, batch_idx = fixed_tile_coord(
                tile, num_m_blocks, num_heads, batch, l2_group, l2_small_groups, qhead_per_kvhead,
                lpt)
        tile_valid = batch_idx < batch  # the packed grid has a few spare tiles past the last block
        batch_idx = cutlass.min(batch_idx, batch - 1)
        seqlen = SeqlenInfo.create(batch_idx, rows_q, rows_k,
                                   mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        in_range = tile_valid & (m_block * self.tile_m < seqlen.seqlen_q)
        return m_block, head_idx, batch_idx, in_range, seqlen

    @cute.jit
    def load(self, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sVt,
             pipeline_q, pipeline_k, pipeline_v, q_state, kv_state, seqlen: SeqlenInfo,
             visit, m_block, head_idx, head_idx_kv, batch_idx, mCuSeqlensV=None,
             mPageTable=None, v_fix_barrier=None):
        """Producer warp, one tile: the first K and V block, then Q (one TMA per consumer
        warpgroup), then the other K and V blocks. The first block goes before Q because its
        ring slots free up during the previous tile's last GEMMs, while Q's buffer is only free
        once the previous tile's epilogue is done with it. Returns the advanced states."""
        cfg = self.cfg
        gQ = cute.local_tile(seqlen.q_view(mQ, head_idx, batch_idx), (WG_ROWS, self.d), (None, 0))
        one = cute.make_layout(1)
        # the K / V blocks of a (head, batch) view, as TMA sources
        k_blocks = lambda view: cpasync.tma_partition(
            tma_atom_k, 0, one, cute.group_modes(sK, 0, 2),
            cute.group_modes(cute.local_tile(view, (self.tile_n, self.d), (None, 0)), 0, 2))
        v_blocks = lambda view: cpasync.tma_partition(
            tma_atom_v, 0, one, cute.group_modes(sVt, 0, 2),
            cute.group_modes(cute.local_tile(view, (self.dv, self.tile_n), (0, None)), 0, 2))
        if const_expr(cfg.fp8_v_in_kernel):  # (sVt: the staging ring; V's rows as K's)
            v_blocks = lambda view: cpasync.tma_partition(
                tma_atom_v, 0, one, cute.group_modes(sVt, 0, 2),
                cute.group_modes(cute.local_tile(view, (self.tile_n, self.dv), (None, 0)), 0, 2))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        # copy_k / copy_v(n_block, stage, barrier, where): the TMA copies of a key block into a
        # stage; where = lookup(n_block), read before the producer waits for the stage (pages
        # smaller than a block: the block's page ids, so that the table read's latency hides
        # under the wait; otherwise unused)
        lookup = lambda n_block: n_block
        if const_expr(cfg.page_size and cfg.page_size < self.tile_n):
            copy_k, copy_v, lookup = self.page_slice_copies(
                tma_atom_k, mK, sK, tma_atom_v, mVt, sVt, mPageTable, batch_idx, head_idx_kv,
                seqlen.seqlen_k)
        elif const_expr(cfg.sparse_pairs):
            # (visit i's blocks: lane h reads half h's, before the producer's wait; `visit` is
            # the tile's visit order by the time a copy runs: built below)
            copy_k, copy_v = self.pair_copies(
                tma_atom_k, seqlen.k_view(mK, head_idx_kv, batch_idx), sK, tma_atom_v,
                seqlen.vt_view(mVt, head_idx_kv, batch_idx), sVt)
            lookup = lambda i: visit.half(i, cutlass.min(cute.arch.lane_idx(), 1))
        elif const_expr(cfg.page_size):
            # each block from its page (the table's), in the page's place of the batch mode
            num_pages = mK.shape[3]
            tKsK, _ = k_blocks(mK[None, None, head_idx_kv, 0])
            tVsV, _ = v_blocks(mVt[None, None, head_idx_kv, 0])

            def copy_k(n_block, stage, barrier, where):
                page, block = self.paged_block(mPageTable, batch_idx, n_block, num_pages)
                src = k_blocks(mK[None, None, head_idx_kv, page])[1][None, block]
                cute.copy(tma_atom_k, src, tKsK[None, stage], tma_bar_ptr=barrier)

            def copy_v(n_block, stage, barrier, where):
                page, block = self.paged_block(mPageTable, batch_idx, n_block, num_pages)
                src = v_blocks(mVt[None, None, head_idx_kv, page])[1][None, block]
                cute.copy(tma_atom_v, src, tVsV[None, stage], tma_bar_ptr=barrier)
        else:
            tKsK, tKgK = k_blocks(seqlen.k_view(mK, head_idx_kv, batch_idx))
            if const_expr(cfg.fp8_v_in_kernel):
                vt = seqlen.k_view(mVt, head_idx_kv, batch_idx)
            elif const_expr(cfg.fp8 and cfg.varlen_k):
                # fp8 V^T: each sequence's keys from a 16-aligned column (fp8_value.py), not cu_seqlens_k's
                vt = cute.domain_offset((0, mCuSeqlensV[batch_idx]), mVt[None, None, head_idx_kv])
            else:
                vt = seqlen.vt_view(mVt, head_idx_kv, batch_idx)
            tVsV, tVgV = v_blocks(vt)
            copy_k = lambda n_block, stage, barrier, where: cute.copy(
                tma_atom_k, tKgK[None, n_block], tKsK[None, stage], tma_bar_ptr=barrier)
            copy_v = lambda n_block, stage, barrier, where: cute.copy(
                tma_atom_v, tVgV[None, n_block], tVsV[None, stage], tma_bar_ptr=barrier)
        load_kv = lambda state, n_block, v_past_end: self.load_kv(
            copy_k, copy_v, pipeline_k, pipeline_v, state, n_block, v_past_end, v_fix_barrier,
            lookup(n_block))

        visit = visit()  # (built here: where it is computed sets the code's order)
        n_blocks = visit.count()
        # Rows past the sequence's keys (inside its last page, or past seqused_k) are whatever
        # that memory holds (maybe NaN), and their P of 0 times NaN is NaN in the P V GEMM; that
        # block (only ever the first visited: blocks are visited from the last down) has V's
        # rows zeroed before the consumers see it (finish_v_past_end; cfg.zeroes_v_past_end)
        past_end = cutlass.Boolean(False)
        first_stage = kv_state.index
        if n_blocks > 0:
            first = visit.first()
            if const_expr(cfg.zeroes_v_past_end):
                past_end = (first + 1) * self.tile_n > seqlen.seqlen_k
            kv_state = load_kv(kv_state, first, past_end)
        pipeline_q.producer_acquire(q_state)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.copy(tma_atom_q, tQgQ[None, m_block * self.num_wg + wg], tQsQ[None, wg],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        q_state.advance()
        # the keys of block n_block before the sequence's end (a listed block may lie wholly
        # past it; a dense tile's first block holds keys)
        valid_keys = lambda n_block: seqlen.seqlen_k - n_block * self.tile_n
        if const_expr(cfg.sparse):
            valid_keys = lambda n_block: cutlass.max(seqlen.seqlen_k - n_block * self.tile_n, 0)
        if const_expr(cfg.zeroes_v_past_end):
            if past_end:
                self.finish_v_past_end(sVt, pipeline_v, first_stage, v_fix_barrier,
                                       valid_keys(visit.first()))
        for i in cutlass.range(1, n_blocks, unroll=1):
            if const_expr(cfg.zeroes_v_past_end and cfg.sparse):
                # a block-sparse list may name the block with the sequence's end (or one past
                # it) anywhere, not first: each such block's V is fixed up as it lands
                n_block = visit.block(i)
                stage = kv_state.index
                past_end = (n_block + 1) * self.tile_n > seqlen.seqlen_k
                kv_state = load_kv(kv_state, n_block, past_end)
                if past_end:
                    self.finish_v_past_end(sVt, pipeline_v, stage, v_fix_barrier,
                                           valid_keys(n_block))
            else:
                kv_state = load_kv(kv_state, visit.block(i), False)
        return q_state, kv_state

    @cute.jit
    def load_kv(self, copy_k, copy_v, pipeline_k, pipeline_v, kv_state, n_block,
                v_past_end=False, v_fix_barrier=None, where=None):
        """K and V of block n_block (copy_k, copy_v: its TMA copies) into the ring's next stage.
        With v_past_end (cfg.zeroes_v_past_end), V lands on v_fix_barrier instead of the V
        pipeline's barrier: finish_v_past_end then zeroes the rows past the sequence's end and
        publishes the stage."""
        pipeline_k.producer_acquire(kv_state)
        copy_k(n_block, kv_state.index, pipeline_k.producer_get_barrier(kv_state), where)
        if const_expr(self.cfg.zeroes_v_past_end):
            if v_past_end:
                arm_fix_barrier((pipeline_v,), kv_state, v_fix_barrier, self.v_bytes)
                copy_v(n_block, kv_state.index, v_fix_barrier, where)
            else:
                pipeline_v.producer_acquire(kv_state)
                copy_v(n_block, kv_state.index, pipeline_v.producer_get_barrier(kv_state), where)
        else:
            pipeline_v.producer_acquire(kv_state)
            copy_v(n_block, kv_state.index, pipeline_v.producer_get_barrier(kv_state), where)
        kv_state.advance()
        return kv_state

    def page_slice_copies(self, tma_atom_k, mK, sK, tma_atom_v, mVt, sVt, mPageTable,
                          batch_idx, head_idx_kv, seqlen_k):
        """(copy_k, copy_v, lookup) for pages smaller than a key block (Sm90FwdConfig.page_size
        < tile_n): copy_key_slices for K and for V, from the pages block_page_ids (the lookup)
        finds."""
        page = self.cfg.page_size
        cols_k, cols_v = swizzle_atom_cols(self.dtype, self.d), swizzle_atom_cols(self.dtype, self.dv)
        k_pages, vt_pages = mK[None, None, head_idx_kv, None], mVt[None, None, head_idx_kv, None]
        copy_k = lambda n_block, stage, barrier, lane_pid: self.copy_key_slices(
            tma_atom_k, lambda pid, j: cute.local_tile(k_pages[None, None, pid], (page, cols_k), (0, j)),
            sK, stage, barrier, lane_pid, False)
        copy_v = lambda n_block, stage, barrier, lane_pid: self.copy_key_slices(
            tma_atom_v, lambda pid, j: cute.local_tile(vt_pages[None, None, pid], (cols_v, page), (j, 0)),
            sVt, stage, barrier, lane_pid, True)
        lookup = lambda n_block: self.block_page_ids(mPageTable, batch_idx, seqlen_k, n_block,
                                                     mK.shape[3])
        return copy_k, copy_v, lookup

    @cute.jit
    def block_page_ids(self, mPageTable, batch_idx, seqlen_k, n_block, num_pages):
        """Lane i's value: the page of key block n_block's slice i (page_size keys), read from
        the table by every lane at once (the whole producer warp runs this); a slice wholly
        past the sequence, or an entry outside the cache, gets num_pages (past the cache's end,
        where TMA reads zeros). One read a slice, one after another, held each slice's copies
        up by the read's latency (the page-16 prefill ran at half the speed of page 128)."""
        page = self.cfg.page_size
        slices = self.tile_n // page  # (at most 16: pages are >= 16 keys, blocks <= 256)
        first = n_block * self.tile_n + cutlass.min(cute.arch.lane_idx(), slices - 1) * page
        entry = mPageTable[batch_idx, cutlass.min(first // page, mPageTable.shape[1] - 1)]
        valid = (first < seqlen_k) & (entry >= 0) & (entry < num_pages)
        return cutlass.select_(valid, entry, num_pages)

    def pair_copies(self, tma_atom_k, k_view, sK, tma_atom_v, vt_view, sVt):
        """(copy_k, copy_v) for block-sparse pairs (Sm90FwdConfig.sparse_pairs): each half of a
        block from its listed block (lane h's value of lane_blocks: half h's), by
        copy_key_slices."""
        half = self.cfg.key_slice
        cols_k, cols_v = swizzle_atom_cols(self.dtype, self.d), swizzle_atom_cols(self.dtype, self.dv)
        copy_k = lambda i, stage, barrier, lane_blocks: self.copy_key_slices(
            tma_atom_k, lambda n, j: cute.local_tile(k_view, (half, cols_k), (n, j)),
            sK, stage, barrier, lane_blocks, False)
        copy_v = lambda i, stage, barrier, lane_blocks: self.copy_key_slices(
            tma_atom_v, lambda n, j: cute.local_tile(vt_view, (cols_v, half), (j, n)),
            sVt, stage, barrier, lane_blocks, True)
        return copy_k, copy_v

    @cute.jit
    def copy_key_slices(self, tma_atom, source, sX, stage, barrier, lane_pid,
                        transposed: cutlass.Constexpr):
        """A key block into `stage` from several places, one key_slice-key slice each: slice i
        from source(lane i's value of lane_pid, j) (a page of the cache, or a pair's listed
        block), its head dim one swizzle atom's columns (j) a TMA copy (the atom's box is one
        swizzle atom wide, so a slice of the stage's layout is the box's own layout). sX: K's
        ring, or with `transposed` V^T's (source then gives (columns, key_slice) tiles of V^T).
        The copies must cover the stage: the pipeline's barrier expects the whole block's bytes,
        so a column left out (a 64-column copy at d=96 did) would stall the consumers for ever."""
        page = self.cfg.key_slice
        one = cute.make_layout(1)
        width = self.dv if const_expr(transposed) else self.d
        cols = swizzle_atom_cols(self.dtype, width)
        assert width % cols == 0 and self.tile_n % page == 0, (width, cols, self.tile_n, page)
        for i in cutlass.range_constexpr(self.tile_n // page):
            pid = cute.arch.shuffle_sync(lane_pid, i)
            for j in cutlass.range_constexpr(width // cols):
                src = source(pid, j)
                if const_expr(transposed):
                    dst = cute.local_tile(sX[None, None, stage], (cols, page), (j, i))
                else:
                    dst = cute.local_tile(sX[None, None, stage], (page, cols), (i, j))
                t_dst, t_src = cpasync.tma_partition(tma_atom, 0, one, cute.group_modes(dst, 0, 2),
                                                     cute.group_modes(src, 0, 2))
                cute.copy(tma_atom, t_src, t_dst, tma_bar_ptr=barrier)

    @cute.jit
    def finish_v_past_end(self, sVt, pipeline_v, stage, v_fix_barrier, valid):
        """The producer warp, once V of the block with the sequence's end has landed on
        v_fix_barrier: its keys from `valid` on set to zero, made visible to the consumers'
        wgmma (the async proxy), then the V pipeline's barrier of that stage arrived on (no
        bytes expected: the phase completes)."""
        lane = cute.arch.lane_idx()
        cute.arch.mbarrier_wait(v_fix_barrier, 0)
        stale = (self.tile_n - valid) * self.dv
        for i in cutlass.range(lane, stale, 32, unroll=1):
            sVt[i % self.dv, valid + i // self.dv, stage] = self.dtype(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(pipeline_v.sync_object_full.get_barrier(stage))

    @cute.jit
    def paged_block(self, mPageTable, batch_idx, n_block, num_pages):
        """(page, block within the page) of key block n_block of sequence batch_idx: the page
        from the table (an id outside the cache becomes num_pages, past its end, where TMA
        reads zeros)."""
        cfg = self.cfg
        key = n_block * self.tile_n
        page = mPageTable[batch_idx, key // cfg.page_size]
        page = cutlass.select_((page >= 0) & (page < num_pages), page, num_pages)
        return page, (key % cfg.page_size) // self.tile_n

    @cute.jit
    def consume(self, tiled_mma_pv, sQ, sK, sVt, sO, sO_q, mO, tma_store_o, mLSE,
                pipeline_q, pipeline_k, pipeline_v, q_state, kv_state,
                seqlen: SeqlenInfo, block_info: BlockInfo, visit,
                score_scale, softmax_scale_log2, window_left, window_right, fp8_args, mod_tensors,
                m_block, head_idx, head_idx_kv, batch_idx, wg, tidx, mSink=None):
        """One consumer warpgroup, one tile: 64 query rows against every visible key block, then
        the epilogue. Returns the advanced pipeline states."""
        cfg = self.cfg
        visit = visit()
        out_scale = None
        if const_expr(cfg.fp8):
            # the scores of fp8 q and k are (q k^T) q_descale k_descale: the product joins the
            # scale the scores take first (before softcap's tanh, else the exponent's)
            mQDescale, mKDescale, mVDescale, _ = fp8_args
            qk_descale = mQDescale[batch_idx, head_idx_kv] * mKDescale[batch_idx, head_idx_kv]
            if const_expr(cfg.has_softcap):
                score_scale = score_scale * qk_descale
            else:
                softmax_scale_log2 = softmax_scale_log2 * qk_descale
            out_scale = mVDescale[batch_idx, head_idx_kv]
        thr_mma_qk = self.make_tiled_mma_qk().get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))[None, None, None, wg]
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_S = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((WG_ROWS, self.tile_n)))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((WG_ROWS, self.dv)))
        acc_O.fill(0.0)
        acc_S_mn = acc_mn_view(acc_S)
        acc_O_mn = acc_mn_view(acc_O)
        coord_S_mn = acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((WG_ROWS, self.tile_n))))
        if const_expr(cfg.fp8):  # P in the fp8 A operand's own fragment (fp8_p_fragment)
            tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((WG_ROWS, self.tile_n)), self.dtype)
            to_p = lambda: fp8_p_fragment(acc_S, tOrP)
        else:
            tOrP = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.dtype)
            to_p = lambda: convert_fragment(acc_S, tOrP)

        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_S_mn, mode=[0]),
                                       FP8_P_MAX_LOG2 if const_expr(cfg.fp8) else 0.0,
                                       MAX_LAG_LOG2 if const_expr(cfg.lazy_rescale) else 0.0)
        softmax.reset()
        row_start = m_block * self.tile_m + wg * WG_ROWS

        # O is zeroed above and always accumulated into. Set once here, outside any dynamic
        # region: the flag is an SSA value and must dominate every GEMM that reads it.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        gemm_qk = lambda stage: gemm_async(self.make_tiled_mma_qk(), acc_S, tSrQ,
                                           tSrK[None, None, None, stage], True)
        gemm_pv = lambda stage: gemm_async(tiled_mma_pv, acc_O, tOrP,
                                           tOrVt[None, None, None, stage], False)
        mod = score_mod = None
        if const_expr(cfg.mask_mod is not None):
            mod = traced(self.mask_mod_fn, cfg.mask_mod, mod_tensors[:len(cfg.mask_mod.tensors)])
        if const_expr(cfg.score_mod is not None):
            score_mod = traced(self.score_mod_fn, cfg.score_mod,
                               mod_tensors[2:2 + len(cfg.score_mod.tensors)])
        # mod_applies(i): whether the i-th visited block takes the mask_mod (a block-sparse
        # tile's partial blocks come after its full ones; a dense tile's blocks all take it)
        mod_applies = lambda i: (i >= visit.num_full) if const_expr(cfg.sparse) else True
        # listed(i): the i-th visited block's listed index (a pair of them: sparse_pairs), a
        # global load (block-sparse)
        listed = lambda i: visit.halves(i) if const_expr(cfg.sparse_pairs) else visit.block(i)
        scores_to_probs = lambda n_block, mask, applies: self.scores_to_probs(
            acc_S, acc_S_mn, coord_S_mn, softmax, block_info, seqlen, row_start, n_block,
            score_scale, window_left, window_right, mask, mod, applies, batch_idx, head_idx,
            score_mod)

        # V's state trails K's by one block inside the tile; both end the tile equal.
        k_state = kv_state.clone()
        v_state = kv_state.clone()
        # Q is loaded for every tile, even one without keys: its buffer may stage O.
        pipeline_q.consumer_wait(q_state)
        if visit.any():
            # First block: S = Q K^T alone. A block-sparse list's block index is a global load,
            # read before the block's waits so that it lands under them (read after S's wait,
            # where the mask needs it, its latency stood in every block's softmax: 0.94x of the
            # dense 128-key tile, docs/perf-log.md); a dense index is arithmetic, left in place.
            n_listed = listed(Int32(0)) if const_expr(cfg.sparse) else None
            pipeline_k.consumer_wait(k_state)
            self.pingpong.wait(wg)
            gemm_qk(k_state.index)
            self.pingpong.pass_on(wg)
            warpgroup.wait_group(0)
            if const_expr(cfg.o_path == "k_stage"):
                if visit.count() > 1:  # (the last block's K stage stages O: held)
                    pipeline_k.consumer_release(k_state)
            else:
                pipeline_k.consumer_release(k_state)
            k_state.advance()
            scores_to_probs(n_listed if const_expr(cfg.sparse) else visit.first(), None,
                            mod_applies(Int32(0)))
            to_p()
            # Steady state: the next block's S = Q K^T and this block's O += P V are both in
            # flight while this warpgroup waits for S, then the softmax of the next block runs
            # under the P V GEMM (intra-warpgroup overlap). The ping-pong turns make the consumer
            # warpgroups issue their GEMMs in turn, so one's softmax hides under the others' GEMMs.
            # step: one key block (mask: scores_to_probs's; applies: whether the mask_mod does)
            # (k_stage: every visit's K stage is released after its QK GEMM but the last's)
            release_k = lambda i: None
            if const_expr(cfg.o_path == "k_stage"):
                release_k = lambda i: i != visit.count() - 1
            step = lambda k_state, v_state, i, n_block, mask, applies: self.key_block_step(
                k_state, v_state, pipeline_k, pipeline_v, gemm_qk, gemm_pv,
                lambda: scores_to_probs(n_block, mask, applies),
                lambda: softmax.rescale(acc_O_mn), to_p, wg, release_k(i))
            if const_expr(cfg.sparse):
                # Listed blocks: the step is compiled twice, with the element mask (and the
                # mask_mod) and without, and each visit branches on its index, read one visit
                # ahead (the last one read again, in range). The unmasked copy is straight-line
                # code as a dense tile's middle run; with one copy checking each block inside,
                # 128x128 ran 0.98-1.05x and 64x64 0.88-0.94x of this (docs/perf-log.md).
                n_next = listed(cutlass.min(Int32(1), visit.count() - 1))
                for i in cutlass.range(1, visit.count(), unroll=1):
                    n_listed = n_next
                    n_next = listed(cutlass.min(i + 1, visit.count() - 1))
                    if self.visit_needs_mask(block_info, seqlen, row_start, n_listed,
                                             mod is not None and mod_applies(i)):
                        k_state, v_state = step(k_state, v_state, i, n_listed, None,
                                                mod_applies(i))
                    else:
                        k_state, v_state = step(k_state, v_state, i, n_listed, False, False)
            else:
                # a dense range: runs of blocks that need the mask or not, known at compile time
                runs = block_info.key_block_runs(seqlen.seqlen_q, seqlen.seqlen_k, row_start,
                                                 WG_ROWS, visit.n_min, visit.n_max)
                for run in cutlass.range_constexpr(len(runs)):
                    first, stop, mask = runs[run]
                    for i in cutlass.range(first, stop, unroll=1):
                        k_state, v_state = step(k_state, v_state, i, visit.block(i), mask,
                                                mod_applies(i))
            if const_expr(cfg.o_path != "q_buffer"):
                # every QK GEMM of this tile is done: the next tile's Q may load now, during
                # this tile's last P V and its epilogue
                pipeline_q.consumer_release(q_state)
            if const_expr(cfg.o_path == "k_stage" and self.num_wg > 1):
                # (the others may write their O over the last K block once this is past it)
                named_barriers.arrive(FwdBarrier.K_DONE + wg, 2 * WG_THREADS)
            # Last block's O += P V.
            pipeline_v.consumer_wait(v_state)
            gemm_pv(v_state.index)
            warpgroup.wait_group(0)
            if const_expr(cfg.o_path not in ("v_stage", "k_stage")):  # else O is staged there
                pipeline_v.consumer_release(v_state)
                v_state.advance()

        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        sink_log2 = mSink[head_idx] * Float32(LOG2E) if const_expr(cfg.has_sink) else None
        softmax.finalize(acc_O_mn, lse, out_scale, sink_log2)
        epilogue.store_lse(lse, epilogue.lse_view(mLSE, seqlen, head_idx, batch_idx), thr_mma_pv,
                           self.dv, row_start, seqlen.seqlen_q, WG_ROWS)
        store = lambda sO_all, wait_barrier, wait_threads: self.store_o(
            acc_O, sO_all, mO, seqlen, tiled_mma_pv, row_start, head_idx, batch_idx, wg, tidx,
            wait_barrier, wait_threads, tma_store_o)
        own = (FwdBarrier.EPILOGUE + wg, WG_THREADS)
        if const_expr(cfg.o_path in ("v_stage", "k_stage")):
            if visit.any():
                if const_expr(cfg.o_path == "v_stage"):
                    # every consumer read this V stage in its last GEMM: all must be past it
                    store(sO(v_state.index), FwdBarrier.ALL_CONSUMERS, WG_THREADS * self.num_wg)
                elif const_expr(self.num_wg > 1):
                    # the other warpgroup's last QK GEMM read this K stage (two warpgroups)
                    store(sO(v_state.index), FwdBarrier.K_DONE + 1 - wg, 2 * WG_THREADS)
                else:
                    store(sO(v_state.index), *own)
                # the generic-proxy reads of O must be ordered before TMA rewrites the stage
                cute.arch.fence_proxy("async.shared", space="cta")
                pipeline_v.consumer_release(v_state)
                if const_expr(cfg.o_path == "k_stage"):
                    # the last K block's (K and V of one block share a stage index)
                    pipeline_k.consumer_release(v_state)
            else:  # no V block held: O goes through Q's buffer, which no GEMM read
                store(sO_q, *own)
                pipeline_q.consumer_release(q_state)
        else:
            if const_expr(cfg.o_path == "own_buffer"):
                if visit.none():  # no GEMM read Q
                    pipeline_q.consumer_release(q_state)
            store(sO, *own)
            if const_expr(cfg.o_path == "q_buffer"):
                # the epilogue has read O back out of Q's buffer: the next tile's Q may land there
                pipeline_q.consumer_release(q_state)
        q_state.advance()
        return q_state, k_state

    @cute.jit
    def key_block_step(self, k_state, v_state, pipeline_k, pipeline_v, gemm_qk, gemm_pv,
                       scores, rescale, to_p, wg, release_k=None):
        """One key block of the mainloop (consume's steady state): its S = Q K^T with the
        previous block's O += P V, then its softmax (`scores`), O's rescale and P. Returns the
        advanced states. release_k (o_path "k_stage"): whether this block's K stage is released
        after its QK GEMM (not the tile's last: O is staged there, the epilogue releases it);
        None: always."""
        pipeline_k.consumer_wait(k_state)
        self.pingpong.wait(wg)
        gemm_qk(k_state.index)
        pipeline_v.consumer_wait(v_state)
        gemm_pv(v_state.index)
        self.pingpong.pass_on(wg)
        warpgroup.wait_group(1)
        if const_expr(release_k is None):
            pipeline_k.consumer_release(k_state)
        else:
            if release_k:
                pipeline_k.consumer_release(k_state)
        k_state.advance()
        scores()
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        v_state.advance()
        rescale()
        to_p()
        return k_state, v_state

    def visit_needs_mask(self, block_info: BlockInfo, seqlen: SeqlenInfo, row_start, n_block,
                         mod_applies):
        """Whether a block-sparse visit's scores need any element mask for this warpgroup's
        rows: the call's masks on its block (on either half of a pair), or the mask_mod
        (mod_applies)."""
        if const_expr(self.cfg.sparse_pairs):
            half = self.tile_n // 2
            needs = lambda n: block_info.needs_mask_keys(seqlen.seqlen_q, seqlen.seqlen_k,
                                                         row_start, WG_ROWS, n * half, half)
            return needs(n_block[0]) | needs(n_block[1]) | mod_applies
        return block_info.needs_mask(seqlen.seqlen_q, seqlen.seqlen_k, row_start, WG_ROWS,
                                     n_block) | mod_applies

    @cute.jit
    def scores_to_probs(self, acc_S, acc_S_mn, coord_S_mn, softmax: OnlineSoftmax,
                        block_info: BlockInfo, seqlen: SeqlenInfo, row_start, n_block,
                        score_scale, window_left, window_right, mask: cutlass.Constexpr,
                        mod=None, mod_applies=True, batch_idx=None, head_idx=None,
                        score_mod=None):
        """softcap, mask and online softmax of one score block (probabilities left in acc_S).
        mask: True or False when the block iterator knows whether the block needs the element
        mask, None to check. mod: the traced mask_mod (None: none), applied where mod_applies;
        score_mod: the traced score_mod (None: none), on the scaled scores before any mask.
        n_block: with sparse_pairs, the pair (a, b) of listed blocks in the tile's halves."""
        cfg = self.cfg
        if const_expr(cfg.has_softcap):
            softcap_scores(acc_S, score_scale)
        # the tile's key spans: (first key, col_start, cols), col_start + col being the key
        # of column col of the accumulator view's columns cols (mask.column_span)
        if const_expr(cfg.sparse_pairs):
            half, ncols = self.tile_n // 2, cute.size(acc_S_mn, mode=[1])
            spans = [(n_block[0] * half, n_block[0] * half, (0, ncols // 2)),
                     (n_block[1] * half, n_block[1] * half - half, (ncols // 2, ncols))]
        else:
            spans = [(n_block * self.tile_n, n_block * self.tile_n, None)]
        keys = self.tile_n // len(spans)
        for span in cutlass.range_constexpr(len(spans)):
            first_key, col_start, cols = spans[span]
            if const_expr(score_mod is not None):
                apply_score_mod(acc_S_mn, coord_S_mn, row_start, col_start, seqlen.seqlen_q,
                                seqlen.seqlen_k, batch_idx, head_idx, score_scale, score_mod, cols)
            apply = lambda: apply_mask(acc_S_mn, coord_S_mn, row_start, col_start,
                                       seqlen.seqlen_q, seqlen.seqlen_k, window_left, window_right,
                                       cfg.causal, cfg.local, cols=cols)
            if const_expr(mask is None):
                if block_info.needs_mask_keys(seqlen.seqlen_q, seqlen.seqlen_k, row_start,
                                              WG_ROWS, first_key, keys):
                    apply()
            elif const_expr(mask):
                apply()
            if const_expr(mod is not None):
                apply_mod = lambda: apply_mask_mod(acc_S_mn, coord_S_mn, row_start, col_start,
                                                   seqlen.seqlen_q, seqlen.seqlen_k, batch_idx,
                                                   head_idx, mod, cols=cols)
                if const_expr(isinstance(mod_applies, bool)):
                    if const_expr(mod_applies):
                        apply_mod()
                elif mod_applies:
                    apply_mod()
        softmax.step(acc_S_mn)

    @cute.jit
    def store_o(self, acc_O, sO_all, mO, seqlen: SeqlenInfo, tiled_mma_pv, row_start, head_idx,
                batch_idx, wg, tidx, wait_barrier, wait_threads: cutlass.Constexpr,
                tma_store_o=(None, None)):
        """O through this warpgroup's slice of `sO_all` to global memory. First every warp that
        read the buffer must be past it (`wait_barrier` over `wait_threads`): past its last GEMM
        (O in Q's buffer or a V stage), past its last QK GEMM (a K stage), or past its reads of
        the previous tile's O. With tma_o_store, one TMA store a warpgroup (tma_store_o: the
        atom and its tensor) instead of the threads' stores."""
        named_barriers.sync(wait_barrier, wait_threads)
        sO = sO_all[None, None, wg]
        epilogue.stage_o(acc_O, sO, tiled_mma_pv, tidx, self.o_dtype)
        if const_expr(self.cfg.tma_o_store):
            # the threads' shared-memory writes, before the TMA (async proxy) reads them; the
            # first warp issues the store and waits until it has read the buffer, so that its
            # release (the ring's or the next epilogue's barrier) frees it only then
            cute.arch.fence_proxy("async.shared", space="cta")
            named_barriers.sync(FwdBarrier.EPILOGUE + wg, WG_THREADS)
            if tidx // 32 == 0:
                tma_atom_o, tma_o = tma_store_o
                gO = cute.local_tile(seqlen.q_view(tma_o, head_idx, batch_idx), (WG_ROWS, self.dv),
                                     (None, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_atom_o, 0, cute.make_layout(1),
                                                   cute.group_modes(sO_all, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                cute.copy(tma_atom_o, tOsO[None, wg], tOgO[None, row_start // WG_ROWS])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            named_barriers.sync(FwdBarrier.EPILOGUE + wg, WG_THREADS)
            gO = cute.local_tile(seqlen.q_view(mO, head_idx, batch_idx), (WG_ROWS, self.dv),
                                 (row_start // WG_ROWS, 0))
            epilogue.store_o(sO, gO, row_start, seqlen.seqlen_q, tidx, self.o_dtype, self.dv,
                             WG_ROWS, WG_THREADS,
                             cols=mO.shape[1] if const_expr(self.cfg.clip_o) else None)
