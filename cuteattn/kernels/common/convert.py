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
