"""Online softmax over accumulator rows, in the exp2 domain.

Scores are kept raw; `scale_log2` (softmax_scale * log2(e), or softcap * log2(e) when the scores
were already squashed by tanh) is folded into the single FMA that feeds exp2. Each thread owns
whole rows of a quad (4 lanes share a row), so row maxima need two butterfly shuffles and row sums
are kept per thread until `finalize`, where they are reduced once.
"""
import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)  # (a natural-log logit, such as a sink, in exp2 units)
# The lag a forward with lazy_rescale gives OnlineSoftmax.max_lag_log2: a row's max lags by up
# to 8 (exp2 units), so 16-bit P stays below 2^8
MAX_LAG_LOG2 = 8.0


@dataclass(frozen=True)
class OnlineSoftmax:
    scale_log2: Float32
    num_rows: cutlass.Constexpr[int]
    row_max: cute.Tensor     # running max of raw scores, per row
    row_sum: cute.Tensor     # running sum of exp2, per thread (reduced over the quad at the end)
    row_scale: cute.Tensor   # the last step's rescale factor of the output, per row
    # probabilities relative to the row max are 2^p_max_log2 at most (FA3's max offset: 8 for
    # fp8 P, so that e4m3 keeps more of them normal); the LSE takes it out again
    p_max_log2: cutlass.Constexpr[float] = 0.0
    # A row keeps its max until a block's scores exceed it by more than this (in exp2 units), so
    # the probabilities reach 2^max_lag_log2 at most (FA4's rescale threshold on sm100); when no
    # row of a warp moved its max, the warp skips rescaling the output (rescale). 0: every rise.
    max_lag_log2: cutlass.Constexpr[float] = 0.0

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, p_max_log2: float = 0.0,
               max_lag_log2: float = 0.0) -> "OnlineSoftmax":
        make = lambda: cute.make_rmem_tensor(num_rows, Float32)
        return OnlineSoftmax(scale_log2, num_rows, make(), make(), make(), p_max_log2,
                             max_lag_log2)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_mn: cute.Tensor):
        """Turns the scores `acc_mn` (rows, cols) into unnormalised probabilities in place and
        records in `row_scale` the factor the running output must be multiplied by."""
        ncols = cute.size(acc_mn, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            prev_max = self.row_max[r]
            cur_max = prev_max
            for c in cutlass.range_constexpr(ncols):
                cur_max = cute.arch.fmax(cur_max, acc_mn[r, c])
            cur_max = cute.arch.warp_reduction_max(cur_max, threads_in_group=4)
            if cutlass.const_expr(self.max_lag_log2 != 0.0):
                # (both -inf: NaN, not >=, and the max stays -inf)
                if (prev_max - cur_max) * self.scale_log2 >= -self.max_lag_log2:
                    cur_max = prev_max
            self.row_max[r] = cur_max
            # A row with no visible key so far keeps max -inf: subtract 0 instead, so that
            # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
            safe_max = cur_max
            if cur_max == -Float32.inf:
                safe_max = Float32(0.0)
            offset = safe_max * self.scale_log2
            scale = cute.math.exp2(prev_max * self.scale_log2 - offset, fastmath=True)
            if cutlass.const_expr(self.max_lag_log2 != 0.0):
                if cur_max == prev_max:  # exactly 1: rescale's test
                    scale = Float32(1.0)
            self.row_scale[r] = scale
            row_sum = Float32(0.0)
            if cutlass.const_expr(self.p_max_log2 != 0.0):
                offset = offset - self.p_max_log2
            for c in cutlass.range_constexpr(ncols):
                p = cute.math.exp2(acc_mn[r, c] * self.scale_log2 - offset, fastmath=True)
                acc_mn[r, c] = p
                row_sum += p
            self.row_sum[r] = self.row_sum[r] * scale + row_sum

    @cute.jit
    def rescale(self, acc_o_mn: cute.Tensor):
        if cutlass.const_expr(self.max_lag_log2 != 0.0):
            moved = self.row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, self.num_rows):
                moved = moved | (self.row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(moved):
                self.multiply(acc_o_mn)
        else:
            self.multiply(acc_o_mn)

    @cute.jit
    def multiply(self, acc_o_mn: cute.Tensor):
        for r in cutlass.range_constexpr(self.num_rows):
            for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                acc_o_mn[r, c] = acc_o_mn[r, c] * self.row_scale[r]

    @cute.jit
    def finalize(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, out_scale=None, sink_log2=None):
        """Normalises the output rows and writes each row's natural-log LSE into `lse`.
        A row that saw no key gets output 0 and LSE -inf. `out_scale` (fp8's v descale)
        multiplies every output value too. `sink_log2` (a learnable sink's logit times log2(e)):
        one more term of every row's denominator, carrying no value (gpt-oss); summed relative
        to the larger of it and the row's offset, so that neither can overflow the other."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            inv = Float32(0.0)
            row_lse = -Float32.inf
            if cutlass.const_expr(sink_log2 is not None):
                # the probabilities were taken relative to this offset (step's safe max)
                safe_max = self.row_max[r]
                if safe_max == -Float32.inf:
                    safe_max = Float32(0.0)
                offset = safe_max * self.scale_log2 - self.p_max_log2
                top = cute.arch.fmax(offset, sink_log2)
                down = cute.math.exp2(offset - top, fastmath=True)
                total = total * down + cute.math.exp2(sink_log2 - top, fastmath=True)
                inv = cute.arch.rcp_approx(total) * down
                if cutlass.const_expr(out_scale is not None):
                    inv = inv * out_scale
                row_lse = (top + cute.math.log2(total, fastmath=True)) * LN2
            else:
                if total > 0.0:
                    inv = cute.arch.rcp_approx(total)
                    if cutlass.const_expr(out_scale is not None):
                        inv = inv * out_scale
                    row_lse = self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)
                    if cutlass.const_expr(self.p_max_log2 != 0.0):
                        row_lse = row_lse - self.p_max_log2
                    row_lse = row_lse * LN2
            lse[r] = row_lse
            for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                acc_o_mn[r, c] = acc_o_mn[r, c] * inv
