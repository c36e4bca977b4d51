"""Global-memory atomics the DSL has no wrapper for: float32 pair reductions (the backward's dQ
accumulation) and the acquire/release pair of a semaphore (its deterministic mode)."""
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result, args, text, constraints):
    return llvm.inline_asm(result, args, text, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*ptr += a, *(ptr + 1) += b, one vector reduction (8-byte aligned ptr; sm_90)."""
    _asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip),
                Float32(b).ir_value(loc=loc, ip=ip)],
         "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f")


@dsl_user_op
def red_add_f32(ptr: cute.Pointer, a: Float32, *, loc=None, ip=None) -> None:
    """*ptr += a (a float32 reduction; every arch from sm_80 on)."""
    _asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip)],
         "red.global.add.f32 [$0], $1;", "l,f")


@dsl_user_op
def ld_acquire(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """An int32 load with acquire semantics at GPU scope (a semaphore's wait)."""
    return Int32(_asm(T.i32(), [ptr.toint(loc=loc, ip=ip).ir_value()],
                      "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l"))


@dsl_user_op
def red_release(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """*ptr += value with release semantics at GPU scope (a semaphore's signal)."""
    _asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
         "red.release.gpu.global.add.s32 [$0], $1;", "l,r")


@dsl_user_op
def block_idx_x_again(*, loc=None, ip=None) -> Int32:
    """blockIdx.x read anew (an asm with side effects: the compiler neither merges it with an
    earlier read nor keeps values derived from one alive until here)."""
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %ctaid.x;", "=r"))
