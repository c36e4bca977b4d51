"""The backward's preprocess in one pass, for both backward families: D = rowsum(dO * O) in
float32 and the LSE in log2 units (+inf where the forward's was -inf, so the row's
probabilities are 0), written into the row layout the backward kernels load with TMA
(launch_common.bwd_preprocess describes it; that PyTorch version is this kernel's reference).

A CTA takes `rows` query rows of one (sequence, head): each row's dO and O are read once, in
16-byte vectors by a group of lanes that reduce their partial sums with butterfly shuffles, and
the group's first lane writes the row's D and LSE. Rows past seqused_q get D 0 and LSE +inf (the
forward never wrote their out and lse). Packed sequences are found as the main kernels find them
(tile_scheduler.varlen_tile_coord); every row read or written lies inside its sequence.
"""
import math
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Float64, Int32, const_expr

from .layout import lse_seq_major, seq_major
from .seqlen_info import sequence_range
from .tile_scheduler import varlen_tile_coord

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class PreprocessConfig:
    """The static configuration of one compiled preprocess kernel (its compile key)."""
    dtype: type                 # dO's and O's: cutlass.BFloat16 or cutlass.Float16
    head_dim_v: int
    tile_m: int                 # the backward kernel's query block: packed rows are laid out by it
    varlen_q: bool = False
    has_seqused_q: bool = False
    rows: int = 64              # query rows per CTA
    threads: int = 128


class BwdPreprocess:
    def __init__(self, cfg: PreprocessConfig):
        self.cfg = cfg
        self.vec = 128 // cfg.dtype.width                   # elements per 16-byte load
        vectors = cfg.head_dim_v // self.vec
        # the lanes sharing a row: a power of two (they reduce by butterflies) that divides the
        # row's vectors (d_v = 96: 12 vectors, 4 lanes of 3)
        self.lanes_per_row = math.gcd(vectors, 16)
        # an odd count of vectors (a padded head dim such as 72 or 120) gives one lane a row:
        # fewer threads, so that a pass still covers whole rows of the block
        self.threads = min(cfg.threads, cfg.rows * self.lanes_per_row)
        self.rows_per_pass = self.threads // self.lanes_per_row
        assert cfg.rows % self.rows_per_pass == 0 and cfg.head_dim_v % self.vec == 0

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,      # (b, s, h, dv) or (total, h, dv) when varlen_q
        mdO: cute.Tensor,     # like mO
        mLSE: cute.Tensor,    # (b, h, s) or (h, total) float32: the forward's
        mLSE2: cute.Tensor,   # (b, h, rows_pad) or (h, rows_pad) float32, zeroed: LSE * log2(e)
        mD: cute.Tensor,      # like mLSE2: rowsum(dO * O)
        mCuSeqlensQ: Optional[cute.Tensor],  # int32 (batch + 1,) when varlen_q
        mSeqUsedQ: Optional[cute.Tensor],    # int32 (batch,) when has_seqused_q
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        mO, mdO = seq_major(mO, cfg.varlen_q), seq_major(mdO, cfg.varlen_q)
        mLSE, mLSE2, mD = (lse_seq_major(t, cfg.varlen_q) for t in (mLSE, mLSE2, mD))
        heads = mO.shape[2]
        if const_expr(cfg.varlen_q):
            batch = mCuSeqlensQ.shape[0] - 1
            grid = [(mO.shape[0] + cfg.rows - 1) // cfg.rows + batch, heads, 1]
        else:
            batch = mO.shape[3]
            grid = [(mO.shape[0] + cfg.rows - 1) // cfg.rows, heads, batch]
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mCuSeqlensQ, mSeqUsedQ, batch).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mCuSeqlensQ, mSeqUsedQ, batch: Int32):
        cfg = self.cfg
        m_block, head, batch_idx = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        in_range = True
        if const_expr(cfg.varlen_q):
            # the blocks of every sequence's rows, seqused or not (rows past it get D 0, LSE +inf)
            m_block, batch_idx = varlen_tile_coord(m_block, mCuSeqlensQ, None, batch, mO.shape[0],
                                                   cfg.rows, False)
            in_range = batch_idx < batch
            batch_idx = cutlass.min(batch_idx, batch - 1)
        offset, length = sequence_range(batch_idx, mO.shape[0], mCuSeqlensQ, None)
        used = length
        if const_expr(cfg.has_seqused_q):
            used = cutlass.min(cutlass.max(mSeqUsedQ[batch_idx], 0), length)
        if in_range & (m_block * cfg.rows < length):
            if const_expr(cfg.varlen_q):
                o, do = (cute.domain_offset((offset, 0), t[None, None, head]) for t in (mO, mdO))
                lse = cute.domain_offset((offset,), mLSE[None, head])
                start = (offset // cfg.tile_m + batch_idx) * cfg.tile_m  # the kernels' row_view
                lse2, dsum = (cute.domain_offset((start,), t[None, head]) for t in (mLSE2, mD))
            else:
                o, do = (t[None, None, head, batch_idx] for t in (mO, mdO))
                lse, lse2, dsum = (t[None, head, batch_idx] for t in (mLSE, mLSE2, mD))
            self.rows_of_block(o, do, lse, lse2, dsum, m_block, length, used, tidx)

    @cute.jit
    def rows_of_block(self, o, do, lse, lse2, dsum, m_block, length, used, tidx):
        cfg = self.cfg
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cfg.dtype, num_bits_per_copy=128)
        tiled = cute.make_tiled_copy_tv(
            atom, cute.make_layout((self.rows_per_pass, self.lanes_per_row),
                                   stride=(self.lanes_per_row, 1)),
            cute.make_layout((1, self.vec)))
        thr = tiled.get_slice(tidx)
        tile = (cfg.rows, cfg.head_dim_v)
        tOgO = thr.partition_S(cute.local_tile(o, tile, (m_block, 0)))
        tOgdO = thr.partition_S(cute.local_tile(do, tile, (m_block, 0)))
        tOcO = thr.partition_S(cute.make_identity_tensor(tile))
        rO = cute.make_rmem_tensor_like(tOgO[None, 0, None], cfg.dtype)
        rdO = cute.make_rmem_tensor_like(rO, cfg.dtype)
        first_row = m_block * cfg.rows
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            row = first_row + tOcO[0, m, 0][0]
            # The sum in float64, rounded to float32 once: D is subtracted from dP (a float32
            # wgmma sum of the same products) in dS = P * (dP - D), where the two cancel when a
            # row's probability sits on few keys; a float32 sum here adds its own rounding
            # (~ulp of |D|) to that difference. Each product of two 16-bit floats is exact in
            # float32; the kernel is bound by memory, so the wider adds cost nothing measurable.
            acc = Float64(0.0)
            if row < length:
                cute.autovec_copy(tOgO[None, m, None], rO)
                cute.autovec_copy(tOgdO[None, m, None], rdO)
                prod = (rO.load().to(Float32) * rdO.load().to(Float32)).to(Float64)
                acc = prod.reduce(cute.ReductionOp.ADD, Float64(0.0), 0)
            acc = cute.arch.warp_reduction_sum(acc, threads_in_group=self.lanes_per_row)
            if (tidx % self.lanes_per_row == 0) & (row < length):
                d = Float32(0.0)
                l2 = Float32.inf
                if row < used:
                    d = acc.to(Float32)
                    if lse[row] != -Float32.inf:
                        l2 = lse[row] * LOG2E
                dsum[row] = d
                lse2[row] = l2
