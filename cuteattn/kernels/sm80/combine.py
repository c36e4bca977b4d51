"""The combine kernel: exact attention from split-KV partial results (the decode kernel's
float32 partial outputs over disjoint key ranges, normalised within each range, and their LSE),
with a learnable sink counted once. What reference.merge_partials computes, in one launch
instead of half a dozen PyTorch operations; the same merge serves context parallelism later.

One warp per output row (batch, query, head): the row's split LSEs, a split a lane, give the
merged LSE by warp reductions (the maximum first, so the exponentials stay in range; a split
that saw no key has LSE -inf and weight 0), then each lane sums its d_v / 32 columns of the
weighted partial outputs, several splits' loads in flight at once, and writes them in the
output dtype. At batch 1 there are few rows (32 heads: 32 warps), so the time is load latency. Plain loads and stores only: it runs on every arch from sm_80 on.
"""
import math
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

WARPS = 4  # rows per CTA
AT_ONCE = 16  # splits whose partial rows a warp loads at once (latency, not bandwidth, bounds it)
# ... in the decode kernel's folded merge (Sm80FwdConfig.fold_combine): fewer, so that the merge,
# compiled into the decode kernel, fits its register bound (16 spilled at 168 on sm_90a)
AT_ONCE_FOLDED = 4
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


@dataclass(frozen=True)
class CombineConfig:
    dtype: type        # the output's (cutlass.BFloat16 or cutlass.Float16)
    head_dim_v: int    # a multiple of 32 (each lane takes d_v / 32 columns)
    has_sink: bool = False


class CombineSplits:
    def __init__(self, cfg: CombineConfig):
        assert cfg.head_dim_v % 32 == 0, cfg
        self.cfg = cfg
        self.cols = cfg.head_dim_v // 32  # columns per lane

    @cute.jit
    def __call__(
        self,
        mOPartial: cute.Tensor,    # float32 (splits, b, s_q, h, d_v)
        mLSEPartial: cute.Tensor,  # float32 (splits, b, h, s_q)
        mSink: Optional[cute.Tensor],  # float32 (h,): a logit per query head (has_sink)
        mO: cute.Tensor,           # (b, s_q, h, d_v) in dtype
        mLSE: cute.Tensor,         # float32 (b, h, s_q)
        num_splits: Int32,
        stream: cuda.CUstream,
    ):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOPartial, mLSEPartial, mSink, mO, mLSE, num_splits).launch(
            grid=[(rows + WARPS - 1) // WARPS, 1, 1], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOPartial: cute.Tensor, mLSEPartial: cute.Tensor,
               mSink: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = block * WARPS + tidx // 32
        batch, seqlen_q, heads = mO.shape[0], mO.shape[1], mO.shape[2]
        if row < batch * seqlen_q * heads:
            h = row % heads
            q = (row // heads) % seqlen_q
            b = row // (heads * seqlen_q)
            merge_row(mOPartial, mLSEPartial, mSink, mO, mLSE, num_splits, b, q, h, lane,
                      self.cols, self.cfg.dtype, self.cfg.has_sink, AT_ONCE)


@cute.jit
def merge_row(mOPartial: cute.Tensor, mLSEPartial: cute.Tensor, mSink, mO: cute.Tensor,
              mLSE: cute.Tensor, num_splits: Int32, b, q, h, lane, cols: cutlass.Constexpr,
              dtype: cutlass.Constexpr, has_sink: cutlass.Constexpr, at_once: cutlass.Constexpr):
    """One output row (b, q, h) merged by one warp (`lane`: its lane): the row's split LSEs, a
    split a lane, and `cols` = d_v / 32 columns a lane of the weighted partial rows; O in
    `dtype`, the merged LSE in mLSE. Tensors in CombineSplits' layouts. The combine kernel
    runs it for every row; the decode kernel (Sm80FwdConfig.fold_combine) for its tile's rows
    in the CTA that stores the tile's last split."""
    # the merged LSE: max first, then the sum of exponentials relative to it. Lane l
    # takes splits l, l + 32, ...; split l's LSE stays in a register (`own`), read once
    # for the max, the sum and its weight (each read is a round trip to L2: at batch 1
    # the kernel is a chain of them, not bandwidth)
    own = -Float32.inf
    if lane < num_splits:
        own = mLSEPartial[lane, b, h, q]
    top = own
    for s in cutlass.range(lane + 32, num_splits, 32, unroll=1):
        top = cute.arch.fmax(top, mLSEPartial[s, b, h, q])
    top = cute.arch.warp_reduction_max(top)
    if const_expr(has_sink):
        top = cute.arch.fmax(top, mSink[h])
    safe_top = top
    if top == -Float32.inf:
        safe_top = Float32(0.0)
    total = cute.math.exp2((own - safe_top) * LOG2E, fastmath=True)
    for s in cutlass.range(lane + 32, num_splits, 32, unroll=1):
        total += cute.math.exp2((mLSEPartial[s, b, h, q] - safe_top) * LOG2E, fastmath=True)
    total = cute.arch.warp_reduction_sum(total)
    if const_expr(has_sink):
        total += cute.math.exp2((mSink[h] - safe_top) * LOG2E, fastmath=True)
    lse = -Float32.inf
    if total > 0.0:
        lse = safe_top + cute.math.log2(total, fastmath=True) * LN2
    safe_lse = lse
    if lse == -Float32.inf:
        safe_lse = Float32(0.0)
    # the output: each split's rows weighted by exp(lse_s - lse) (0 when no key). Lane l
    # computes split base + l's weight, the warp takes them in turn (a shuffle), `at_once`
    # splits' rows at a time: all their loads first, then the sums, so the loads are in
    # flight together (a group past the last split reloads the last split's row, whose
    # weight there is 0: no branch between the loads)
    acc = cute.make_rmem_tensor(cols, Float32)
    acc.fill(0.0)
    parts = cute.make_rmem_tensor((cols, at_once), Float32)
    for base in cutlass.range(0, num_splits, 32, unroll=1):
        mine = Float32(0.0)
        if base + lane < num_splits and lse != -Float32.inf:
            lse_s = own
            if base > 0:
                lse_s = mLSEPartial[base + lane, b, h, q]
            mine = cute.math.exp2((lse_s - safe_lse) * LOG2E, fastmath=True)
        count = cutlass.min(num_splits - base, 32)
        for group in cutlass.range(0, count, at_once, unroll=1):
            for j in cutlass.range_constexpr(at_once):
                split = base + cutlass.min(group + j, count - 1)
                cute.autovec_copy(cute.local_tile(mOPartial[split, b, q, h, None],
                                                  (cols,), (lane,)), parts[None, j])
            for j in cutlass.range_constexpr(at_once):
                weight = cute.arch.shuffle_sync(mine, group + j)  # (0 past count)
                for c in cutlass.range_constexpr(cols):
                    acc[c] = acc[c] + weight * parts[c, j]
    out = cute.make_rmem_tensor(cols, dtype)
    out.store(acc.load().to(dtype))
    cute.autovec_copy(out, cute.local_tile(mO[b, q, h, None], (cols,), (lane,)))
    if lane == 0:
        mLSE[b, h, q] = lse
