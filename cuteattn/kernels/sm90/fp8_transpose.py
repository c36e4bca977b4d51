"""V's transpose inside the fp8 forward, in shared memory (so that fp8 V needs no separate pass
over HBM; fp8_value.py's pass remains for the sequences and pages this does not serve).

An fp8 wgmma takes both operands K-major, so the P V GEMM wants V with its keys contiguous,
while V arrives (and TMA copies it) with its head dim contiguous. `transpose_v` turns one
stage of V, as TMA wrote it into sK's kind of layout (a key's row contiguous), into the P V
GEMM's B operand layout (a head-dim column's keys contiguous), with each 16-key group's keys in
common/convert.FP8_KEY_ORDER, the order P's registers already hold them in (fp8_p_fragment).

FlashAttention-3's form: ldmatrix.trans reads 16-bit pairs of keys, byte permutes split them
per column, stmatrix writes them. It replaced a form of 4-byte word transposes (32 loads and
stores a 16-key x 4-column unit) that took ~1.8x the instructions: 1.03-1.04x at d=64, even at
d=128 (docs/perf-log.md, thirtieth session).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.convert import FP8_KEY_ORDER
from .fp8_value import byte_perm

# A warp's unit is a 16-key group x 32 columns (512 bytes). ldmatrix.x4.trans reads four 8x8
# 16-bit matrices, matrix m at keys 8 (m % 2) .. + 7 and the 16-byte column chunk m // 2; with
# .trans, lane t's register of matrix m holds keys 2i and 2i + 1 (i = t % 4) at columns 2c and
# 2c + 1 of its chunk (c = t // 4). So R0 / R1 (keys 0-7 / 8-15 of the group) hold the bytes
# of keys {2i, 2i + 1, 2i + 8, 2i + 9} - slot quad i of FP8_KEY_ORDER - for two columns:
# prmt 0x6420 picks column 2c's four, 0x7531 column 2c + 1's; R2 / R3 the same 16 columns on.
# stmatrix.x4 (not .trans) then stores lane t's word at V^T row (that column), bytes 4i: its
# matrices' rows are V^T rows 2r, 2r + 1, 16 + 2r, 17 + 2r (r = the providing lane % 8).
LDMATRIX_KEYS, LDMATRIX_COLUMNS = 16, 32
assert all(FP8_KEY_ORDER[4 * i:4 * i + 4] == (2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9)
           for i in range(4))


@dsl_user_op
def ldmatrix_x4_trans(smem_addr: Int32, *, loc=None, ip=None) -> tuple:
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: this lane's four registers; smem_addr:
    the shared-memory address of the row this lane provides (lane // 8: its matrix)."""
    regs = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(Int32(llvm.extractvalue(T.i32(), regs, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def stmatrix_x4(smem_addr: Int32, r0: Int32, r1: Int32, r2: Int32, r3: Int32, *, loc=None,
                ip=None) -> None:
    """stmatrix.sync.aligned.m8n8.x4.shared.b16 of this lane's four registers (smem_addr: the
    row this lane provides)."""
    llvm.inline_asm(
        None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (smem_addr, r0, r1, r2, r3)],
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def transpose_v(sV: cute.Tensor, sVt: cute.Tensor, thread: Int32, threads: cutlass.Constexpr):
    """sV: one stage of V, (tile_n keys, d_v) bytes in sK's layout; sVt: one stage of the P V
    GEMM's B operand, (d_v, tile_n) bytes, keys contiguous (tile_n a multiple of 16, d_v of 32:
    the fp8 tiles'). `thread` in [0, threads): the threads that share the work (a multiple of
    32). One ldmatrix.x4.trans, four byte permutes and one stmatrix.x4 a warp per 16 keys x 32
    columns.

    Addresses: in both layouts (sK's and V^T's swizzled K-major layouts at the fp8 tiles) an
    offset is the XOR of its coordinates' bit fields' offsets, e.g. sV's (16 g + r, 32 b + c) =
    (16 g, 32 b) ^ (r, c) for r < 16, c < 32, as the swizzle XORs bits and the fields never
    carry into each other (tests/test_gpu_fp8_transpose.py checks it, on the CPU, for every fp8
    config). So a unit's lane addresses are its base XOR a lane constant: one LOP3, where
    crd2idx of the whole coordinate took a dozen integer instructions (with signed division),
    enough to take issue slots from the consumers' softmax."""
    tile_n: cutlass.Constexpr = cute.size(sV, mode=[0])
    column_blocks: cutlass.Constexpr = cute.size(sV, mode=[1]) // LDMATRIX_COLUMNS
    units: cutlass.Constexpr = (tile_n // LDMATRIX_KEYS) * column_blocks
    lane = thread % 32
    matrix, row = lane // 8, lane % 8
    # the row this lane provides, within a unit: ldmatrix's (key, column chunk) of V, stmatrix's
    # V^T row
    load_lane = cute.crd2idx((8 * (matrix % 2) + row, 16 * (matrix // 2)), sV.layout)
    store_lane = cute.crd2idx((16 * (matrix // 2) + 2 * row + matrix % 2, 0), sVt.layout)
    v_base = sV.iterator.toint()
    vt_base = sVt.iterator.toint()
    for unit in cutlass.range(thread // 32, units, threads // 32, unroll=1):
        group, block = unit // column_blocks, unit % column_blocks
        load = cute.crd2idx((LDMATRIX_KEYS * group, LDMATRIX_COLUMNS * block), sV.layout) ^ load_lane
        store = cute.crd2idx((LDMATRIX_COLUMNS * block, LDMATRIX_KEYS * group), sVt.layout) ^ store_lane
        r0, r1, r2, r3 = ldmatrix_x4_trans(v_base + load)
        stmatrix_x4(vt_base + store, byte_perm(r0, r1, 0x6420), byte_perm(r0, r1, 0x7531),
                    byte_perm(r2, r3, 0x6420), byte_perm(r2, r3, 0x7531))
