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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)  # (a natural-log logit, such as a sink, in exp2 units)
# The lag a forward with lazy_rescale gives OnlineSoftmax.max_lag_log2: a row's max lags by up
# to 8 (exp2 units), so 16-bit P stays below 2^8
MAX_LAG_LOG2 = 8.0

# 2^f on [-1/2, 1/2] as 1 + f (C1 + f (C2 + f C3)): relative error 1.0e-4 (float32 Horner;
# fitted for this file, the constant term kept at exactly 1 so that exp2_poly(-127) is 0)
EXP2_POLY_C1, EXP2_POLY_C2, EXP2_POLY_C3 = 0.6932829022407532, 0.24221037328243256, 0.05500858277082443


def _f32_hex(x: float) -> str:
    import struct
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


@dsl_user_op
def exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and integer pipes instead of the MUFU unit (16 results a clock an SM on
    Hopper, which a softmax of small head dims or fp8 GEMMs waits on; FlashAttention-4 splits
    its exponentials the same way on Blackwell). x is clamped to -127 (so -inf gives exactly 0,
    as ex2 does); j = round(x) by the 1.5 * 2^23 shifter, 2^(x - j) by the polynomial, and j
    added to its exponent field. Relative error 1e-4: below the 16- and 8-bit P's rounding,
    and the row sums' share of it moves the LSE by 1e-4 at most."""
    magic = _f32_hex(12582912.0)
    return Float32(llvm.inline_asm(
        T.f32(),
        [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .f32 x, t, j, f, p;\n.reg .b32 tb, pb;\n"
        "max.f32 x, $1, 0fC2FE0000;\n"          # -127
        f"add.rn.f32 t, x, {magic};\n"          # the low bits of t: round(x)
        f"sub.rn.f32 j, t, {magic};\n"
        "sub.rn.f32 f, x, j;\n"
        f"fma.rn.f32 p, f, {_f32_hex(EXP2_POLY_C3)}, {_f32_hex(EXP2_POLY_C2)};\n"
        f"fma.rn.f32 p, p, f, {_f32_hex(EXP2_POLY_C1)};\n"
        "fma.rn.f32 p, p, f, 0f3F800000;\n"
        "mov.b32 tb, t;\nmov.b32 pb, p;\n"
        "shl.b32 tb, tb, 23;\n"
        "add.s32 pb, pb, tb;\n"
        "mov.b32 $0, pb;\n}",
        "=f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def use_exp2_poly(column: int, per16: int) -> bool:
    """Whether a row fragment's column takes exp2_poly: per16 of every 16, spread evenly."""
    return (column * per16) % 16 < per16


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
    # of every 16 probabilities of a row, this many are exp2_poly's (the rest the MUFU's)
    exp2_poly_per16: cutlass.Constexpr[int] = 0

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, p_max_log2: float = 0.0,
               max_lag_log2: float = 0.0, exp2_poly_per16: int = 0) -> "OnlineSoftmax":
        make = lambda: cute.make_rmem_tensor(num_rows, Float32)
        return OnlineSoftmax(scale_log2, num_rows, make(), make(), make(), p_max_log2,
                             max_lag_log2, exp2_poly_per16)

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
                x = acc_mn[r, c] * self.scale_log2 - offset
                p = Float32(0.0)
                if cutlass.const_expr(use_exp2_poly(c, self.exp2_poly_per16)):
                    p = exp2_poly(x)
                else:
                    p = cute.math.exp2(x, fastmath=True)
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
