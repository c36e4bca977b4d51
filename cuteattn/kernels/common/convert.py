"""Packed float32 -> 16-bit conversion of register fragments.

`tensor.load().to(BFloat16)` converts one element per instruction for most fragment sizes, and
the unpacked 16-bit results each hold a full register until they are packed: for a 64x160 score
tile that is 40 extra live registers in the hottest loop, and the kernel spills. One
`cvt.rn.{bf16x2,f16x2}.f32` per pair writes the packed register directly.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def pack_f32x2(lo: Float32, hi: Float32, dtype: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """Two float32 rounded to nearest into one register of two 16-bit values (lo in the low
    half, as the MMA operand fragments expect)."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $2, $1;",  # the PTX instruction takes (hi, lo)
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def convert_fragment(src: cute.Tensor, dst: cute.Tensor):
    """dst (16-bit) = src (float32), element for element in register order. Both fragments
    must be compact in the same order (dst is typically src's layout over other storage)."""
    n: cutlass.Constexpr = cute.size(src)
    dst_pairs = cute.recast_tensor(cute.make_tensor(dst.iterator, cute.make_layout(n)), Int32)
    for i in cutlass.range_constexpr(n // 2):
        dst_pairs[i] = pack_f32x2(src[2 * i], src[2 * i + 1], dst.element_type)


@dsl_user_op
def pack_f32x4_e4m3(b0: Float32, b1: Float32, b2: Float32, b3: Float32, *, loc=None,
                    ip=None) -> Int32:
    """Four float32 rounded to nearest (saturating) into one register of four e4m3 bytes, b0 in
    the lowest byte."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (b0, b1, b2, b3)],
        "{\n.reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"  # (hi byte, lo byte)
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi};\n}",
        "=r,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def fp8_p_fragment(acc: cute.Tensor, dst: cute.Tensor):
    """dst (the e4m3 A operand of a k32 wgmma, ((4, 2, 2), 1, K/32)) = acc (a float32 wgmma
    accumulator, ((2, 2, N/8), 1, 1)), each thread's own values only, in another order.

    A thread holds accumulator columns 2t, 2t+1 of every 8-column group (t = lane % 4) for rows
    r and r + 8, but the fp8 A operand wants columns 4t..4t+3 of every 16-column half. Rather
    than move values between threads, the thread's four columns {2t, 2t+1, 8+2t, 9+2t} of each
    16-key group stand in for slots 4t..4t+3: the A operand's slot s of a 16-key group holds key
    FP8_KEY_ORDER[s], and V's rows (the B operand's k) are stored in that order too (launch.py
    writes V transposed so). Register word w of dst = (row half h, k half kh, k block c), w =
    h + 2 kh + 4 c; its bytes are accumulator values f, f+1, f+4, f+5 with f = 2h + 8kh + 16c."""
    n: cutlass.Constexpr = cute.size(acc)
    words = cute.recast_tensor(cute.make_tensor(dst.iterator, cute.make_layout(n)), Int32)
    for w in cutlass.range_constexpr(n // 4):
        f = 2 * (w % 2) + 8 * ((w // 2) % 2) + 16 * (w // 4)
        words[w] = pack_f32x4_e4m3(acc[f], acc[f + 1], acc[f + 4], acc[f + 5])


# Slot s of each 16-key group of the fp8 P V GEMM holds key FP8_KEY_ORDER[s] (fp8_p_fragment):
# thread t's slots 4t..4t+3 are its accumulator columns 2t, 2t+1, 8+2t, 9+2t.
FP8_KEY_ORDER = tuple(8 * ((s % 4) // 2) + 2 * (s // 4) + s % 2 for s in range(16))
