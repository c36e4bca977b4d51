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


# fp8 bytes to 16-bit values without conversion instructions (F2F runs at a quarter of the
# integer rate: converting an fp8 KV cache through cvt.f16x2.e4m3x2, cvt.f32.f16 and
# cvt.bf16x2.f32 cost the decode kernel more than its MMAs). Each byte goes to the top of a
# 16-bit half (prmt), its exponent and mantissa shift into the 16-bit format's fields and the
# sign stays on top; the value is then 2^-bias of the byte's (subnormals included: they land on
# the 16-bit format's subnormals), so one packed FMA by 2^bias makes it exact. Non-finite
# bytes read as large finite values (e4m3's NaN as +-480) except e5m2 into fp16, which is the
# byte shifted up, inf and NaN included. (format, dtype) -> (shift, field mask of a half, 2^bias
# as a packed pair, or None when the shifted byte is the value)
FP8_TO_16BIT = {
    ("e4m3", "bf16"): (4, 0x07F007F0, 0x7B807B80),   # 2^120
    ("e5m2", "bf16"): (3, 0x0FE00FE0, 0x77807780),   # 2^112
    ("e4m3", "f16"): (1, 0x3F803F80, 0x5C005C00),    # 2^8
    ("e5m2", "f16"): (0, None, None),
}
_PAIR_SELECTORS = (0x1404, 0x3424)  # bytes 0, 1 / 2, 3 of a word to the top of each half


@dsl_user_op
def fp8x2_to_16bit(word: Int32, pair: cutlass.Constexpr, fmt: cutlass.Constexpr,
                   dtype: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """Bytes 2 pair and 2 pair + 1 of `word` (fp8 in `fmt`, "e4m3" or "e5m2") as two `dtype`
    values (cutlass.BFloat16 or Float16) in one register, the lower byte in the low half."""
    kind = "bf16" if dtype is cutlass.BFloat16 else "f16"
    shift, mask, scale = FP8_TO_16BIT[fmt, kind]
    lines = [f"prmt.b32 z, $1, 0, {_PAIR_SELECTORS[pair]:#x};"]
    if scale is None:
        lines.append("mov.b32 $0, z;")
    else:
        lines += [f"shr.b32 y, z, {shift};",
                  f"and.b32 y, y, {mask:#x};",
                  "and.b32 z, z, 0x80008000;",
                  "or.b32 y, y, z;",
                  f"mov.b32 s, {scale:#x};",
                  "mov.b32 c, 0x80008000;",  # (-0: x * 2^bias + -0 is x * 2^bias, signed zeros too)
                  f"fma.rn.{kind}x2 $0, y, s, c;"]
    return Int32(llvm.inline_asm(
        T.i32(),
        [Int32(word).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 z, y, s, c;\n" + "\n".join(lines) + "\n}",
        "=r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def convert_fp8_fragment(src: cute.Tensor, dst: cute.Tensor, fmt: cutlass.Constexpr):
    """dst (16-bit) = src (fp8 bytes in `fmt`), element for element in register order; both
    compact in the same order, four elements a word."""
    n: cutlass.Constexpr = cute.size(src)
    words = cute.recast_tensor(cute.make_tensor(src.iterator, cute.make_layout(n)), Int32)
    pairs = cute.recast_tensor(cute.make_tensor(dst.iterator, cute.make_layout(n)), Int32)
    for w in cutlass.range_constexpr(n // 4):
        pairs[2 * w] = fp8x2_to_16bit(words[w], 0, fmt, dst.element_type)
        pairs[2 * w + 1] = fp8x2_to_16bit(words[w], 1, fmt, dst.element_type)
