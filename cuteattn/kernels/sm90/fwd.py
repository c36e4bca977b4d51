"""Hopper (sm_90a) attention forward: TMA loads, wgmma GEMMs, warp specialization.

A tile is `num_wg * 64` query rows of one (batch, head). The grid is persistent: at most
`max_ctas` CTAs (one per SM) walk the tiles, so the next tile's K/V (and then Q) loads overlap
this tile's last GEMMs and its epilogue, and no CTA pays a launch per tile. Equal-cost tiles are
dealt round robin (`blockIdx.x, + gridDim.x, ...`); tiles of unequal cost (causal, windowed,
varlen) are handed out one at a time from a global counter (`dynamic_tiles`), so a CTA that
drew short tiles takes more of them. In each CTA:
  - warpgroup 0 is the producer: one warp issues TMA loads of Q (once per tile) and of K and V
    blocks into a `num_stages`-deep ring of shared-memory buffers, guarded by mbarrier pipelines
    whose states run on across tiles;
  - warpgroups 1..num_wg are consumers: each owns 64 query rows, computes S = Q K^T with wgmma
    from shared memory, masks and turns S into probabilities P in registers (online softmax in the
    exp2 domain), and accumulates O += P V with a register-A wgmma.
Key blocks are visited from the last to the first, so the blocks that need masking (sequence
end, causal diagonal) come first and the row maxima are set by real scores early.

Everything shape-like (batch, sequence lengths, head counts, window sizes, scale) is a runtime
value: one compiled kernel serves every shape with the same static configuration.
"""
import math
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

from ..common.block_info import BlockInfo
from ..common.convert import convert_fragment
from ..common.layout import acc_mn_view, acc_to_a_operand_layout
from ..common.mask import apply_mask
from ..common.seqlen_info import SeqlenInfo
from ..common.softmax import OnlineSoftmax
from ..common.tile_scheduler import fixed_tile_coord, varlen_tile_coord

WG_ROWS = 64  # rows of one consumer warpgroup's wgmma tile
WG_THREADS = 128
# Named barriers: 0 is __syncthreads; 1..3 guard each consumer's epilogue; 4..6 are the GEMM
# turns; 7 and 8 hand the next tile from the producer warp to the consumers; 9 gathers every
# consumer before O overwrites the V stage they all read (o_path "v_stage").
BAR_TILE_READY = 7
BAR_TILE_FREE = 8
BAR_ALL_CONSUMERS = 9


@dataclass(frozen=True)
class Sm90FwdConfig:
    """The static configuration of one compiled forward kernel."""
    dtype: type                 # cutlass.BFloat16 or cutlass.Float16
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
    # Where O is staged on its way to global memory (config.O_PATHS): Q's buffer (the next
    # tile's Q loads only once the epilogue has read O back), a buffer of its own, or the
    # ring stage of the tile's last V block. The last two free Q's buffer after the tile's last
    # QK GEMM, so the next tile's Q loads under this one's last P V GEMM and epilogue.
    o_path: str = "q_buffer"
    # O from its own buffer to global memory by one TMA store per warpgroup (fixed-length only:
    # the descriptor covers one (batch, head) grid, and it clips rows past the sequence end)
    tma_store_o: bool = False
    # The key-block loop in up to three runs (masked blocks at the top, unmasked middle, masked
    # left edge) so that the middle carries no mask code, instead of one loop that checks each
    # block (block_info.unmasked_blocks says why)
    split_mask_loop: bool = False
    packed_convert: bool = False  # P to 16 bits with one cvt per pair (see common/convert.py)

    @property
    def tile_m(self) -> int:
        return WG_ROWS * self.num_wg

    def smem_bytes(self) -> int:
        elem = self.dtype.width // 8
        q = self.tile_m * self.head_dim * elem
        o = self.tile_m * self.head_dim_v * elem if self.o_path == "own_buffer" else 0
        kv = self.num_stages * self.tile_n * (self.head_dim + self.head_dim_v) * elem
        return q + o + kv + 1024  # + barriers and alignment


class FlashFwdSm90:
    def __init__(self, cfg: Sm90FwdConfig):
        assert cfg.head_dim == cfg.head_dim_v, "head_dim_v != head_dim is not supported yet"
        assert cfg.tile_n % 16 == 0 and cfg.head_dim % 16 == 0
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.tile_m = cfg.tile_m
        self.tile_n = cfg.tile_n
        self.d = cfg.head_dim
        self.dv = cfg.head_dim_v
        self.num_wg = cfg.num_wg
        self.num_stages = cfg.num_stages
        self.num_threads = WG_THREADS * (1 + cfg.num_wg)
        self.tile_sync_threads = 32 + WG_THREADS * cfg.num_wg  # the producer warp + consumers
        # Registers move from the producer (which only issues TMA) to the consumers. ptxas keeps
        # the producer's code within its budget: with the persistent tile loop, the varlen
        # prefix sum made a 24-register producer spill, so varlen producers get 40 (and their
        # consumers 232: config._TILE_N_CAPS narrows the tiles that need more).
        varlen = cfg.varlen_q or cfg.varlen_k
        self.producer_regs, self.consumer_regs = {
            2: (40, 232) if varlen else (24, 240), 3: (32, 160)}[cfg.num_wg]
        # setmaxnreg can only redistribute the registers the CTA was launched with (ptxas caps
        # a thread at 65536 / threads, rounded down to 8): asking for more makes the consumers'
        # increase wait forever. (2 consumer warpgroups with a 32-register producer hung.)
        launch_regs = (65536 // self.num_threads) // 8 * 8
        assert WG_THREADS * (self.producer_regs + cfg.num_wg * self.consumer_regs) <= \
            launch_regs * self.num_threads, "register split exceeds the launch allocation"

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, TMA descriptors, launch
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
        mTileCounter: cute.Tensor,  # int32 (2,), zero between launches (dynamic_tiles only)
        max_seqlen_q: Int32,       # grid extent for varlen; ignored otherwise
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
        # Reorder modes so that the tile modes come first: (s, d, h, b) or (total, d, h);
        # V is seen transposed, (d, s, h, b), because it is the MN-major B operand of P.V.
        if const_expr(cfg.varlen_q):
            mQ, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1])) for t in (mQ, mO)]
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0]))
        else:
            mQ, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mO)]
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        if const_expr(cfg.varlen_k):
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
            mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))
        else:
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))

        tiled_mma_qk = self.make_tiled_mma_qk()
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), (WG_ROWS, self.dv), warpgroup.OperandSource.RMEM,
        )
        # Shared memory: Q has one (64, d) slice per consumer warpgroup; K and V a ring of stages.
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.d), self.dtype, self.num_wg)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (WG_ROWS, self.tile_n, self.d), self.dtype, self.num_stages)
        sVt_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (WG_ROWS, self.dv, self.tile_n), self.dtype, self.num_stages)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, cute.slice_(sQ_layout, (None, None, 0)), (WG_ROWS, self.d))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            tma_load, mK, cute.slice_(sK_layout, (None, None, 0)), (self.tile_n, self.d))
        tma_atom_v, tma_vt = cpasync.make_tiled_tma_atom(
            tma_load, mVt, cute.slice_(sVt_layout, (None, None, 0)), (self.dv, self.tile_n))
        tma_atom_o = None
        if const_expr(cfg.tma_store_o):  # O's smem slices have Q's layout
            tma_atom_o, mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.slice_(sQ_layout, (None, None, 0)),
                (WG_ROWS, self.dv))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sVt_layout, (None, None, 0)))

        self.shared_storage = self.shared_storage_type(sQ_layout, sK_layout, sVt_layout)

        if const_expr(cfg.varlen_q):
            num_heads = mQ.shape[2]
            batch = mCuSeqlensQ.shape[0] - 1
            # an upper bound on the packed query blocks (see tile_scheduler.varlen_tile_coord)
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m + batch
            num_tiles = num_m_blocks * num_heads
        else:
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
            num_heads = mQ.shape[2]
            batch = mQ.shape[3]
            num_tiles = num_m_blocks * num_heads * batch

        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_vt, tma_atom_o, mO, mLSE,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mTileCounter,
            mQ.shape[0], mK.shape[0], qhead_per_kvhead, num_m_blocks, num_heads, batch, num_tiles,
            l2_group, l2_small_groups, score_scale, softmax_scale_log2, window_left, window_right,
            tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sVt_layout,
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

    def shared_storage_type(self, sQ_layout, sK_layout, sVt_layout):
        """The shared-memory layout (plain Python: the O buffer is a compile-time option)."""
        q_elems, k_elems, v_elems = (cute.cosize(x) for x in (sQ_layout, sK_layout, sVt_layout))
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, k_elems], 1024],
            "sVt": cute.struct.Align[cute.struct.MemRange[self.dtype, v_elems], 1024],
            "next_tile": cute.struct.MemRange[Int32, 1],  # producer -> consumers (dynamic_tiles)
        }
        if self.cfg.o_path == "own_buffer":
            fields["sO"] = cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024]
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
        tma_atom_o: Optional[cute.CopyAtom], mO: cute.Tensor, mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mTileCounter: cute.Tensor,
        seqlen_q_static: Int32, seqlen_k_static: Int32, qhead_per_kvhead: Int32,
        num_m_blocks: Int32, num_heads: Int32, batch: Int32, num_tiles: Int32,
        l2_group: Int32, l2_small_groups: Int32, score_scale: Float32, softmax_scale_log2: Float32,
        window_left: Int32, window_right: Int32,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sVt_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.tma_store_o):
                cpasync.prefetch_descriptor(tma_atom_o)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipeline_q, pipeline_k, pipeline_v = self.make_pipelines(storage)
        # Make the barrier initialisation visible to every warp before anyone waits on it.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        sNextTile = storage.next_tile.get_tensor(cute.make_layout(1))
        # O's staging buffer (Sm90FwdConfig.o_path): Q's, its own, or, as a function of the
        # ring stage, the V stage of the tile's last block seen with Q's layout.
        sO = sQ
        if const_expr(cfg.o_path == "own_buffer"):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        if const_expr(cfg.o_path == "v_stage"):
            v_stage_elems = self.v_bytes * 8 // self.dtype.width
            # (stages start on 1024-byte boundaries, as the 128-byte swizzle needs)
            sO = lambda stage: cute.make_tensor(
                cute.recast_ptr(storage.sVt.data_ptr() + cute.assume(stage * v_stage_elems, divby=512),
                                sQ_layout.inner, dtype=self.dtype), sQ_layout.outer)

        block_info = BlockInfo(self.tile_m, self.tile_n, cfg.causal, cfg.local,
                               window_left, window_right)
        tile_stride = cute.arch.grid_dim()[0]
        first_tile = cute.arch.block_idx()[0]
        # Producer and consumers walk the same tiles and skip the same ones, so their pipeline
        # states stay in step across tiles.
        tile_info = lambda tile: self.tile_info(
            tile, num_m_blocks, num_heads, batch, l2_group, l2_small_groups, qhead_per_kvhead,
            seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                tile = first_tile
                while tile < num_tiles:
                    m_block, head_idx, batch_idx, in_range, seqlen = tile_info(tile)
                    if in_range:
                        n_min, n_max = block_info.n_block_range(seqlen.seqlen_q, seqlen.seqlen_k, m_block)
                        q_state, kv_state = self.load(
                            tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sVt,
                            pipeline_q, pipeline_k, pipeline_v, q_state, kv_state, seqlen, m_block,
                            head_idx, head_idx // qhead_per_kvhead, batch_idx, n_min, n_max)
                    tile = self.next_tile_producer(tile, tile_stride, num_tiles, mTileCounter,
                                                   sNextTile)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = (warp_idx // 4) - 1
            if const_expr(cfg.pingpong):
                if wg == 0:  # the first consumer warpgroup takes the first turn
                    cute.arch.barrier_arrive(barrier_id=4, number_of_threads=2 * WG_THREADS)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            # K and V advance together over a whole tile: one state carries both across tiles
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            if const_expr(cfg.dynamic_tiles):  # the next-tile slot starts free
                cute.arch.barrier_arrive(barrier_id=BAR_TILE_FREE, number_of_threads=self.tile_sync_threads)
            tile = first_tile
            while tile < num_tiles:
                m_block, head_idx, batch_idx, in_range, seqlen = tile_info(tile)
                if in_range:
                    n_min, n_max = block_info.n_block_range(seqlen.seqlen_q, seqlen.seqlen_k, m_block)
                    q_state, kv_state = self.consume(
                        tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_o, mO, mLSE,
                        pipeline_q, pipeline_k, pipeline_v, q_state, kv_state, seqlen,
                        block_info, score_scale, softmax_scale_log2, window_left, window_right,
                        m_block, head_idx, batch_idx, n_min, n_max, wg, tidx % WG_THREADS,
                    )
                tile = self.next_tile_consumer(tile, tile_stride, sNextTile)
            if const_expr(cfg.tma_store_o):  # the last O store must read shared memory before exit
                if tidx % WG_THREADS < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    # Which tile next. Round robin needs no communication. Dynamic: the producer warp draws the
    # next tile from the global counter as soon as it has issued this tile's loads, and hands it
    # to the consumers through one shared-memory slot guarded by two named barriers (READY: the
    # slot holds the next tile; FREE: the consumers have read it). The last CTA to run out of
    # tiles zeroes the counter for the next launch (kernel boundaries order that for the stream).
    @cute.jit
    def next_tile_producer(self, tile, tile_stride, num_tiles, mTileCounter, sNextTile):
        if const_expr(not self.cfg.dynamic_tiles):
            return tile + tile_stride
        lane = cute.arch.lane_idx()
        drawn = Int32(0)
        if lane == 0:
            drawn = cute.arch.atomic_add(mTileCounter.iterator, Int32(1), sem="relaxed", scope="gpu")
        nxt = cute.arch.shuffle_sync(drawn, 0) + tile_stride  # the first tile was blockIdx.x
        if nxt >= num_tiles:
            if lane == 0:
                # this CTA's draws are over; the last CTA to get here resets the counter
                cute.arch.fence_acq_rel_gpu()
                done = cute.arch.atomic_add(mTileCounter.iterator + 1, Int32(1), sem="acq_rel",
                                            scope="gpu")
                if done == tile_stride - 1:
                    mTileCounter[0] = Int32(0)
                    mTileCounter[1] = Int32(0)
        cute.arch.barrier(barrier_id=BAR_TILE_FREE, number_of_threads=self.tile_sync_threads)
        if lane == 0:
            sNextTile[0] = nxt
        cute.arch.barrier_arrive(barrier_id=BAR_TILE_READY, number_of_threads=self.tile_sync_threads)
        return nxt

    @cute.jit
    def next_tile_consumer(self, tile, tile_stride, sNextTile):
        if const_expr(not self.cfg.dynamic_tiles):
            return tile + tile_stride
        cute.arch.barrier(barrier_id=BAR_TILE_READY, number_of_threads=self.tile_sync_threads)
        nxt = sNextTile[0]
        cute.arch.barrier_arrive(barrier_id=BAR_TILE_FREE, number_of_threads=self.tile_sync_threads)
        return nxt

    # Tile order (the linear tile index a CTA walks): common/tile_scheduler.py.
    @cute.jit
    def tile_info(self, tile: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
                  l2_group: Int32, l2_small_groups: Int32, qhead_per_kvhead: Int32,
                  seqlen_q_static: Int32, seqlen_k_static: Int32,
                  mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                  mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor]):
        """(m_block, head_idx, batch_idx, in_range, seqlen) of linear tile `tile`; in_range is
        False for the packed grid's spare tiles and for blocks past their sequence's end."""
        if const_expr(self.cfg.varlen_q):
            head_idx = tile // num_m_blocks
            m_block, batch_idx = varlen_tile_coord(tile % num_m_blocks, mCuSeqlensQ, mSeqUsedQ,
                                                   batch, self.tile_m,
                                                   self.cfg.causal or self.cfg.local)
        else:
            m_block, head_idx, batch_idx = fixed_tile_coord(
                tile, num_m_blocks, num_heads, batch, l2_group, l2_small_groups, qhead_per_kvhead,
                self.cfg.causal or self.cfg.local)
        tile_valid = batch_idx < batch  # the packed grid has a few spare tiles past the last block
        batch_idx = cutlass.min(batch_idx, batch - 1)
        seqlen = SeqlenInfo.create(batch_idx, seqlen_q_static, seqlen_k_static,
                                   mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        in_range = tile_valid & (m_block * self.tile_m < seqlen.seqlen_q)
        return m_block, head_idx, batch_idx, in_range, seqlen

    def make_pipelines(self, storage):
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # TMA pipelines count one arrive per consumer warp on release.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_wg)
        make = lambda bar, stages, nbytes: pipeline.PipelineTmaAsync.create(
            barrier_storage=bar.data_ptr(), num_stages=stages, producer_group=producer,
            consumer_group=consumers, tx_count=nbytes, defer_sync=True)
        return (make(storage.mbar_q, 1, self.q_bytes),
                make(storage.mbar_k, self.num_stages, self.k_bytes),
                make(storage.mbar_v, self.num_stages, self.v_bytes))

    @cute.jit
    def load(self, tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sVt,
             pipeline_q, pipeline_k, pipeline_v, q_state, kv_state, seqlen: SeqlenInfo, m_block,
             head_idx, head_idx_kv, batch_idx, n_min, n_max):
        """Producer warp, one tile: the first K and V block, then Q (one TMA per consumer
        warpgroup), then the other K and V blocks. The first block goes before Q because its
        ring slots free up during the previous tile's last GEMMs, while Q's buffer is only free
        once the previous tile's epilogue is done with it. Returns the advanced states."""
        gQ = cute.local_tile(seqlen.q_view(mQ, head_idx, batch_idx), (WG_ROWS, self.d), (None, 0))
        gK = cute.local_tile(seqlen.k_view(mK, head_idx_kv, batch_idx), (self.tile_n, self.d), (None, 0))
        gVt = cute.local_tile(seqlen.vt_view(mVt, head_idx_kv, batch_idx), (self.dv, self.tile_n), (0, None))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, one, cute.group_modes(sVt, 0, 2), cute.group_modes(gVt, 0, 2))

        n_blocks = n_max - n_min
        if n_blocks > 0:
            kv_state = self.load_kv(tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV,
                                    pipeline_k, pipeline_v, kv_state, n_max - 1)
        pipeline_q.producer_acquire(q_state)
        for wg in cutlass.range_constexpr(self.num_wg):
            cute.copy(tma_atom_q, tQgQ[None, m_block * self.num_wg + wg], tQsQ[None, wg],
                      tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
        q_state.advance()
        for i in cutlass.range(1, n_blocks, unroll=1):
            kv_state = self.load_kv(tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV,
                                    pipeline_k, pipeline_v, kv_state, n_max - 1 - i)
        return q_state, kv_state

    @cute.jit
    def load_kv(self, tma_atom_k, tKgK, tKsK, tma_atom_v, tVgV, tVsV, pipeline_k, pipeline_v,
                kv_state, n_block):
        pipeline_k.producer_acquire(kv_state)
        cute.copy(tma_atom_k, tKgK[None, n_block], tKsK[None, kv_state.index],
                  tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
        pipeline_v.producer_acquire(kv_state)
        cute.copy(tma_atom_v, tVgV[None, n_block], tVsV[None, kv_state.index],
                  tma_bar_ptr=pipeline_v.producer_get_barrier(kv_state))
        kv_state.advance()
        return kv_state

    @cute.jit
    def consume(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, sO, tma_atom_o, mO, mLSE,
                pipeline_q, pipeline_k, pipeline_v, q_state, kv_state,
                seqlen: SeqlenInfo, block_info: BlockInfo,
                score_scale, softmax_scale_log2, window_left, window_right,
                m_block, head_idx, batch_idx, n_min, n_max, wg, tidx):
        """One consumer warpgroup, one tile: 64 query rows against every visible key block, then
        the epilogue. Returns the advanced pipeline states."""
        cfg = self.cfg
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_S = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((WG_ROWS, self.tile_n)))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((WG_ROWS, self.dv)))
        acc_O.fill(0.0)
        acc_S_mn = acc_mn_view(acc_S)
        acc_O_mn = acc_mn_view(acc_O)
        coord_S_mn = acc_mn_view(thr_mma_qk.partition_C(cute.make_identity_tensor((WG_ROWS, self.tile_n))))
        tOrP = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.dtype)
        tOrP_as_acc = cute.make_tensor(tOrP.iterator, acc_S.layout)

        softmax = OnlineSoftmax.create(softmax_scale_log2, cute.size(acc_S_mn, mode=[0]))
        softmax.reset()
        row_start = m_block * self.tile_m + wg * WG_ROWS

        tSrQ_wg = tSrQ[None, None, None, wg]
        # O is zeroed above and always accumulated into. Set once here, outside any dynamic
        # region: the flag is an SSA value and must dominate every GEMM that reads it.
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        gemm_qk = lambda stage: self.gemm_qk(tiled_mma_qk, acc_S, tSrQ_wg, tSrK, stage)
        gemm_pv = lambda stage: self.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrVt, stage)
        scores_to_probs = lambda n_block, mask=None: self.scores_to_probs(
            acc_S, acc_S_mn, coord_S_mn, softmax, block_info, seqlen, row_start, n_block,
            score_scale, window_left, window_right, mask)

        # V's state trails K's by one block inside the tile; both end the tile equal.
        k_state = kv_state.clone()
        v_state = kv_state.clone()
        # Q is loaded for every tile, even one without keys: its buffer stages O in the epilogue.
        pipeline_q.consumer_wait(q_state)
        if n_max > n_min:
            # First block: S = Q K^T alone.
            pipeline_k.consumer_wait(k_state)
            self.turn_wait(wg)
            gemm_qk(k_state.index)
            self.turn_pass(wg)
            warpgroup.wait_group(0)
            pipeline_k.consumer_release(k_state)
            k_state.advance()
            scores_to_probs(n_max - 1)
            self.probs_to_operand(acc_S, tOrP, tOrP_as_acc)
            # Steady state: the next block's S = Q K^T and this block's O += P V are both in
            # flight while this warpgroup waits for S, then the softmax of the next block runs
            # under the P V GEMM (intra-warpgroup overlap). The turn barriers make the consumer
            # warpgroups issue their GEMMs in turn, so one's softmax hides under the others' GEMMs.
            # Runs of iterations (first, last + 1, mask: True, False, or None to check each
            # block); iteration i visits block n_max - 1 - i.
            n_blocks = n_max - n_min
            runs = [(Int32(1), n_blocks, None)]
            if const_expr(cfg.split_mask_loop):
                # the blocks at or above `hi` (masked), the unmasked middle, and with a window
                # those below `lo` (masked)
                lo, hi = block_info.unmasked_blocks(seqlen.seqlen_q, seqlen.seqlen_k, row_start,
                                                    WG_ROWS)
                end_top = cutlass.max(cutlass.min(n_max - hi, n_blocks), 1)
                start_left = cutlass.max(cutlass.min(n_max - lo, n_blocks), end_top)
                runs = [(Int32(1), end_top, True), (end_top, start_left, False)]
                if const_expr(cfg.local):
                    runs.append((start_left, n_blocks, True))
            for run in cutlass.range_constexpr(len(runs)):
                first, stop, mask = runs[run]
                for i in cutlass.range(first, stop, unroll=1):
                    pipeline_k.consumer_wait(k_state)
                    self.turn_wait(wg)
                    gemm_qk(k_state.index)
                    pipeline_v.consumer_wait(v_state)
                    gemm_pv(v_state.index)
                    self.turn_pass(wg)
                    warpgroup.wait_group(1)
                    pipeline_k.consumer_release(k_state)
                    k_state.advance()
                    scores_to_probs(n_max - 1 - i, mask)
                    warpgroup.wait_group(0)
                    pipeline_v.consumer_release(v_state)
                    v_state.advance()
                    softmax.rescale(acc_O_mn)
                    self.probs_to_operand(acc_S, tOrP, tOrP_as_acc)
            if const_expr(cfg.o_path != "q_buffer"):
                # every QK GEMM of this tile is done: the next tile's Q may load now, during
                # this tile's last P V and its epilogue
                pipeline_q.consumer_release(q_state)
            # Last block's O += P V.
            pipeline_v.consumer_wait(v_state)
            gemm_pv(v_state.index)
            warpgroup.wait_group(0)
            if const_expr(cfg.o_path != "v_stage"):  # else the epilogue stages O there first
                pipeline_v.consumer_release(v_state)
                v_state.advance()

        lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
        softmax.finalize(acc_O_mn, lse)
        epilogue = lambda sO_buf, all_consumers: self.epilogue(
            acc_O, lse, sO_buf, tma_atom_o, mO, mLSE, seqlen, thr_mma_pv, tiled_mma_pv, row_start, head_idx,
            batch_idx, wg, tidx, all_consumers)
        if const_expr(cfg.o_path == "v_stage"):
            if n_max > n_min:
                epilogue(sO(v_state.index), True)
                # the generic-proxy reads of O must be ordered before TMA rewrites the stage
                cute.arch.fence_proxy("async.shared", space="cta")
                pipeline_v.consumer_release(v_state)
            else:  # no V block held: O goes through Q's buffer, which no GEMM read
                epilogue(sQ, False)
                pipeline_q.consumer_release(q_state)
        else:
            if const_expr(cfg.o_path == "own_buffer"):
                if n_max <= n_min:  # no GEMM read Q
                    pipeline_q.consumer_release(q_state)
            epilogue(sO, False)
            if const_expr(cfg.o_path == "q_buffer"):
                # the epilogue has read O back out of Q's buffer: the next tile's Q may land there
                pipeline_q.consumer_release(q_state)
        q_state.advance()
        return q_state, k_state

    @cute.jit
    def probs_to_operand(self, acc_S, tOrP, tOrP_as_acc):
        """P (float32, in the accumulator) -> the 16-bit A operand of the P V GEMM."""
        if const_expr(self.cfg.packed_convert):
            convert_fragment(acc_S, tOrP)
        else:
            tOrP_as_acc.store(acc_S.load().to(self.dtype))

    @cute.jit
    def gemm_qk(self, tiled_mma_qk, acc_S, tSrQ, tSrK, stage):
        """Issues S = Q K^T (K from ring stage `stage`) without waiting for it."""
        if const_expr(self.cfg.split_mask_loop):
            # A fresh MMA atom: its accumulate flag, set below, must be defined in the loop that
            # uses it, not carried from one staged loop into the next (IR dominance)
            tiled_mma_qk = self.make_tiled_mma_qk()
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(tiled_mma_qk, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
        warpgroup.commit_group()

    @cute.jit
    def gemm_pv(self, tiled_mma_pv, acc_O, tOrP, tOrVt, stage):
        """Issues O += P V (P from registers, V from ring stage `stage`) without waiting."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(tiled_mma_pv, acc_O, tOrP[None, None, k], tOrVt[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def scores_to_probs(self, acc_S, acc_S_mn, coord_S_mn, softmax: OnlineSoftmax,
                        block_info: BlockInfo, seqlen: SeqlenInfo, row_start, n_block,
                        score_scale, window_left, window_right, mask: cutlass.Constexpr = None):
        """softcap, mask and online softmax of one score block (probabilities left in acc_S).
        mask: True or False when the caller knows whether the block needs the element mask,
        None to check."""
        cfg = self.cfg
        if const_expr(cfg.has_softcap):
            for j in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[j] = cute.math.tanh(acc_S[j] * score_scale, fastmath=True)
        apply = lambda: apply_mask(acc_S_mn, coord_S_mn, row_start, n_block * self.tile_n,
                                   seqlen.seqlen_q, seqlen.seqlen_k, window_left, window_right,
                                   cfg.causal, cfg.local)
        if const_expr(mask is None):
            if block_info.needs_mask(seqlen.seqlen_q, seqlen.seqlen_k, row_start, WG_ROWS, n_block):
                apply()
        elif const_expr(mask):
            apply()
        softmax.step(acc_S_mn)

    def turn_wait(self, wg):
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=4 + wg, number_of_threads=2 * WG_THREADS)

    def turn_pass(self, wg):
        if const_expr(self.cfg.pingpong):
            nxt = wg + 1 if const_expr(self.num_wg == 1) else (wg + 1) % self.num_wg
            cute.arch.barrier_arrive(barrier_id=4 + nxt, number_of_threads=2 * WG_THREADS)

    @cute.jit
    def epilogue(self, acc_O, lse, sO_all, tma_atom_o, mO, mLSE, seqlen: SeqlenInfo, thr_mma_pv, tiled_mma_pv,
                 row_start, head_idx, batch_idx, wg, tidx, all_consumers: cutlass.Constexpr):
        """LSE straight from the registers of the threads that own column 0; O through shared
        memory (`sO_all`: this warpgroup's slice) with 16-byte stores, only for rows inside the
        sequence. `all_consumers`: every consumer warpgroup read the buffer, so all must be
        past their last GEMM before any overwrites it."""
        cfg = self.cfg
        seqlen_q = seqlen.seqlen_q
        # LSE
        coord_O_mn = acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((WG_ROWS, self.dv))))
        if const_expr(cfg.varlen_q):
            gLSE = cute.domain_offset((seqlen.offset_q,), mLSE[None, head_idx])
        else:
            gLSE = mLSE[None, head_idx, batch_idx]
        if coord_O_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = row_start + coord_O_mn[r, 0][0]
                if row < seqlen_q:
                    gLSE[row] = lse[r]

        # O: registers -> smem. Wait until every warp that read this buffer is past its last
        # GEMM (O in Q's buffer or a V stage), or past its reads of the previous tile's O (its
        # own buffer), before overwriting it.
        barrier_id = 1 + wg
        if const_expr(cfg.tma_store_o):  # the previous tile's O store has read this buffer
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(all_consumers):
            cute.arch.barrier(barrier_id=BAR_ALL_CONSUMERS, number_of_threads=WG_THREADS * self.num_wg)
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WG_THREADS)
        sO = sO_all[None, None, wg]
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_copy_r2s = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
        cute.copy(thr_copy_r2s, thr_copy_r2s.retile(rO), thr_copy_r2s.partition_D(sO))
        if const_expr(cfg.tma_store_o):
            # the generic-proxy writes must be visible to the TMA unit's reads
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WG_THREADS)
        if const_expr(cfg.tma_store_o):
            if tidx < 32:
                gO = cute.local_tile(seqlen.q_view(mO, head_idx, batch_idx), (WG_ROWS, self.dv), (None, 0))
                tOsO, tOgO = cpasync.tma_partition(
                    tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO_all, 0, 2),
                    cute.group_modes(gO, 0, 2))
                cute.copy(tma_atom_o, tOsO[None, wg], tOgO[None, row_start // WG_ROWS])
                cute.arch.cp_async_bulk_commit_group()
        else:
            self.store_o_from_smem(sO, mO, seqlen, row_start, head_idx, batch_idx, tidx)

    @cute.jit
    def store_o_from_smem(self, sO, mO, seqlen: SeqlenInfo, row_start, head_idx, batch_idx, tidx):
        """Shared memory -> global memory, 16 bytes per thread per copy, rows predicated."""
        seqlen_q = seqlen.seqlen_q
        vec = 128 // self.dtype.width
        # The thread layout must tile (64, d_v) exactly: d_v = 96 has 12 vectors per row, so 4
        # threads share a row and each stores 3 vectors.
        threads_per_row = math.gcd(self.dv // vec, 32)
        rows_per_pass = WG_THREADS // threads_per_row
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            copy_atom,
            cute.make_layout((rows_per_pass, threads_per_row), stride=(threads_per_row, 1)),
            cute.make_layout((1, vec)),
        )
        thr_copy = tiled_copy.get_slice(tidx)
        gO = cute.local_tile(seqlen.q_view(mO, head_idx, batch_idx), (WG_ROWS, self.dv), (row_start // WG_ROWS, 0))
        tOsO = thr_copy.partition_S(sO)
        tOgO = thr_copy.partition_D(gO)
        tOcO = thr_copy.partition_S(cute.make_identity_tensor((WG_ROWS, self.dv)))
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if row_start + tOcO[0, m, 0][0] < seqlen_q:
                cute.copy(copy_atom, tOrO[None, m, None], tOgO[None, m, None])
