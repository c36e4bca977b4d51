"""V's transpose inside the fp8 forward, in shared memory (issue: fp8 V without the separate
pass over HBM that fp8_value.py makes today).

An fp8 wgmma takes both operands K-major, so the P V GEMM wants V with its keys contiguous,
while V arrives (and TMA copies it) with its head dim contiguous. `transpose_v` turns one
stage of V, as TMA wrote it into sK's kind of layout (a key's row contiguous), into the P V
GEMM's B operand layout (a head-dim column's keys contiguous), with each 16-key group's keys in
common/convert.FP8_KEY_ORDER, the order P's registers already hold them in (fp8_p_fragment).

The work unit is fp8_value.py's: a 16-key group x 4 head-dim columns. A thread reads the
group's 16 key rows at those 4 columns as 16 words (in FP8_KEY_ORDER), four at a time, makes a
4x4 byte transpose of each four with `prmt`, and writes the 4 columns' 16 keys as 4 words
each. Both layouts swizzle 16-byte chunks, so a word at a column (or key) multiple of 4 never
straddles a chunk: its address is its first byte's, read from the layout (so a stage comes as
a tensor of a plain pointer and the swizzled layout, not of a swizzled pointer). How the units
sit on a warp's lanes is chosen for shared memory's banks (LANE_COLUMNS below).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.convert import FP8_KEY_ORDER
from .fp8_value import byte_perm

GROUP = 16  # keys of one FP8_KEY_ORDER group
# A warp's 32 units: 8 column words (lanes a = lane % 8) x 4 key groups (b = lane // 8), each
# lane's group turned by a >> 1 and its slot quads visited in the order j = jj ^ turn, turn =
# (a ^ b) % 4. Shared memory serves 32 banks of 4 bytes a cycle; a transposed store's row is 4
# columns' bytes apart, so lanes on consecutive column words of one key group (the plain order)
# hit 2 rows modulo the swizzle's 8 and one word of each: 16-way conflicts on every store,
# which made the transpose slower than the GEMMs it feeds (0.56x at d=128 16k). This order
# brings each fp8 tile's layouts to 1-2.5 wavefronts an access (a host simulation over their
# layouts: 3-8.5x fewer than the plain order).
LANE_COLUMNS, LANE_GROUPS = 8, 4
# slot 4j + i of a group holds key 8 (i // 2) + 2j + i % 2: rows r_i ^ 2j, r_i = 8 (i // 2) + i % 2
assert FP8_KEY_ORDER == tuple(8 * (i // 2) + 2 * j + i % 2 for j in range(4) for i in range(4))


@cute.jit
def transpose_v(sV: cute.Tensor, sVt: cute.Tensor, thread: Int32, threads: cutlass.Constexpr):
    """sV: one stage of V, (tile_n keys, d_v) bytes in sK's layout; sVt: one stage of the P V
    GEMM's B operand, (d_v, tile_n) bytes, keys contiguous. `thread` in [0, threads): the
    threads that share the work (a multiple of 32).

    Addresses: in both layouts (sK's and V^T's swizzled K-major layouts at the fp8 tiles) a
    word's offset is the XOR of its coordinates' bit fields' offsets, e.g. sV's (16 g + r, 4 c)
    = (16 g, 4 c) ^ (r, 0) for r < 16, as the swizzle XORs bits and the fields never carry into
    each other (tests/test_gpu_fp8_transpose.py checks it, on the CPU, for every fp8 config).
    So a unit's 32 addresses are its two base offsets XOR constants of the trace: one LOP3 an
    access, where crd2idx of the whole coordinate took a dozen integer instructions (with
    signed division), enough to take issue slots from the consumers' softmax."""
    tile_n: cutlass.Constexpr = cute.size(sV, mode=[0])
    words: cutlass.Constexpr = cute.size(sV, mode=[1]) // 4  # column words a key row has
    groups: cutlass.Constexpr = tile_n // GROUP
    # the units padded to whole warp blocks (8 column words x 4 groups); lanes past the tile idle
    column_blocks: cutlass.Constexpr = -(-words // LANE_COLUMNS)
    group_blocks: cutlass.Constexpr = -(-groups // LANE_GROUPS)
    lane = thread % 32
    a, b = lane % LANE_COLUMNS, lane // LANE_COLUMNS
    turn = (a ^ b) % 4
    # the lane's turn, in each layout: rows 2 turn of V, keys 4 turn of V^T
    load_turn = cute.crd2idx((2 * turn, 0), sV.layout)
    store_turn = cute.crd2idx((0, 4 * turn), sVt.layout)
    for block in cutlass.range(thread // 32, column_blocks * group_blocks, threads // 32, unroll=1):
        group = (block // column_blocks) * LANE_GROUPS + (b + a // 2) % LANE_GROUPS
        col = (block % column_blocks) * LANE_COLUMNS + a
        if group < groups and col < words:
            load_base = cute.crd2idx((GROUP * group, 4 * col), sV.layout) ^ load_turn
            store_base = cute.crd2idx((4 * col, GROUP * group), sVt.layout) ^ store_turn
            for jj in cutlass.range_constexpr(4):
                # slots 4j..4j+3, j = jj ^ turn: a 4x4 byte transpose of their four words (one
                # per key, the 4 columns' bytes) into one word per column (4 keys' bytes); four
                # words at a time, so that the producer warpgroup's few registers hold them
                a0, a1, a2, a3 = (word_at(sV.iterator, load_base ^ cute.crd2idx(
                    ((8 * (i // 2) + i % 2) ^ (2 * jj), 0), sV.layout)) for i in range(4))
                ab_lo, ab_hi = byte_perm(a0, a1, 0x5140), byte_perm(a0, a1, 0x7362)
                cd_lo, cd_hi = byte_perm(a2, a3, 0x5140), byte_perm(a2, a3, 0x7362)
                out = (byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632),
                       byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632))
                for byte in cutlass.range_constexpr(4):
                    set_word(sVt.iterator, store_base ^ cute.crd2idx((byte, 4 * jj), sVt.layout),
                             out[byte])


@cute.jit
def word_at(base: cute.Pointer, byte_offset: Int32) -> Int32:
    """The 32-bit word at byte_offset (a multiple of 4) from base (a byte pointer, 4-aligned)."""
    word = cute.recast_ptr(base + cute.assume(byte_offset, divby=4), dtype=Int32)
    return cute.make_tensor(word, cute.make_layout(1))[0]


@cute.jit
def set_word(base: cute.Pointer, byte_offset: Int32, value: Int32):
    word = cute.recast_ptr(base + cute.assume(byte_offset, divby=4), dtype=Int32)
    cute.make_tensor(word, cute.make_layout(1))[0] = value


# ---- candidate (Sm90FwdConfig.fp8_transpose_ldmatrix, off): FlashAttention-3's form ----
# A warp's unit is a 16-key group x 32 columns (512 bytes). ldmatrix.x4.trans reads four 8x8
# 16-bit matrices, matrix m at keys 8 (m % 2) .. + 7 and the 16-byte column chunk m // 2; with
# .trans, lane t's register of matrix m holds keys 2i and 2i + 1 (i = t % 4) at columns 2c and
# 2c + 1 of its chunk (c = t // 4). So R0 / R1 (keys 0-7 / 8-15 of the group) hold the bytes
# of keys {2i, 2i + 1, 2i + 8, 2i + 9} - slot quad i of FP8_KEY_ORDER - for two columns:
# prmt 0x6420 picks column 2c's four, 0x7531 column 2c + 1's; R2 / R3 the same 16 columns on.
# stmatrix.x4 (not .trans) then stores lane t's word at V^T row (that column), bytes 4i: its
# matrices' rows are V^T rows 2r, 2r + 1, 16 + 2r, 17 + 2r (r = the providing lane % 8).
LDMATRIX_KEYS, LDMATRIX_COLUMNS = 16, 32


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
def transpose_v_ldmatrix(sV: cute.Tensor, sVt: cute.Tensor, thread: Int32,
                         threads: cutlass.Constexpr):
    """transpose_v's work (same arguments, same result) in FlashAttention-3's form: one
    ldmatrix.x4.trans, four byte permutes and one stmatrix.x4 a warp per 16 keys x 32 columns.
    Addresses compose by XOR as in transpose_v (tests/test_gpu_fp8_transpose.py)."""
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
