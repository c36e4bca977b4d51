"""V of the fp8 forward, transposed in one pass: (b, s, h_k, d_v) bytes -> (b, h_k, d_v, s16)
bytes (s16: s rounded up to 16, the extra keys zero), the keys of every 16-key group in
common/convert.FP8_KEY_ORDER (fwd.py's fp8 switch says why). Packed sequences (varlen):
(total_k, h_k, d_v) -> (h_k, d_v, total16), sequence b's keys from column cu16[b], each
sequence rounded up to 16 keys (so that its 16-key groups start with it), cu16 (batch + 1,)
written here for the forward kernel. launch.fp8_value_operand_torch is the reference.

Memory-bound (one read and one write of V), so both sides move whole 16-byte vectors: a CTA
takes KEYS keys of one (sequence, kv head) and reads their rows into shared memory (a warp's
loads cover whole rows); then each thread takes one 16-key group x 4 columns unit: 16 words
from shared memory (the 16 keys' bytes at those 4 columns, in FP8_KEY_ORDER), four 4x4 byte
transposes by `prmt`, and each column's 16 keys written as one vector. A warp's units are 8
groups x 4 column words, so its stores cover 4 V^T rows x 128 contiguous bytes; shared memory
rotates each group's 16-byte chunks by the group (word_at) so that those 8 groups' reads of one
column word fall in different banks. (The first form read and wrote 4-byte words, its stores
each a different V^T row: 0.39-0.45 TB/s, over half the fp8 forward's time at d=256 and 1k
keys; docs/perf-log.md, thirtieth session.) Sequences are clamped as the attention kernels
clamp them (sequence_range), and no write goes past the output's last column, whatever
cu_seqlens_k holds.
"""
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..common.convert import FP8_KEY_ORDER
from ..common.seqlen_info import sequence_range

KEYS = 128  # keys per CTA block: eight 16-key groups, a 128-byte run of each V^T row
GROUPS = KEYS // 16
LOADS_IN_FLIGHT = 8  # 16-byte loads a thread issues before it stores them to shared memory


@dataclass(frozen=True)
class Fp8ValueConfig:
    """The static configuration of one compiled transpose (its compile key)."""
    head_dim_v: int             # a multiple of 16
    varlen: bool = False        # packed sequences (cu_seqlens_k)
    threads: int = 128


class Fp8ValueTranspose:
    def __init__(self, cfg: Fp8ValueConfig):
        assert cfg.head_dim_v % 16 == 0 and cfg.threads % 32 == 0
        self.cfg = cfg
        self.words = cfg.head_dim_v // 4     # 32-bit words per key row
        self.chunks = cfg.head_dim_v // 16   # 16-byte chunks per key row

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor],
                 mCuSeqlensV: Optional[cute.Tensor], max_seqlen: Int32, stream: cuda.CUstream):
        """mV: uint8 (b, s, h_k, d_v), or (total_k, h_k, d_v) packed, the fp8 values' bytes;
        mVt: uint8 (b, h_k, d_v, s16), or (h_k, d_v, total16) packed; packed: mCuSeqlensK
        int32 (batch + 1,) in, mCuSeqlensV int32 (batch + 1,) out; max_seqlen: the longest
        sequence (sizes the grid; at least 1). Both byte tensors' base and strides other than
        the last are multiples of 16 (launch_common.aligned16)."""
        if const_expr(self.cfg.varlen):
            batch, heads = mCuSeqlensK.shape[0] - 1, mV.shape[1]
        else:
            batch, heads = mV.shape[0], mV.shape[2]
        blocks = (max_seqlen + KEYS - 1) // KEYS
        self.kernel(mV, mVt, mCuSeqlensK, mCuSeqlensV, mV.shape[-3] if const_expr(not self.cfg.varlen)
                    else mV.shape[0], mVt.shape[-1], batch).launch(
            grid=[blocks, heads, batch], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor],
               mCuSeqlensV: Optional[cute.Tensor], rows: Int32, columns: Int32, batch: Int32):
        cfg = self.cfg
        n_block, head, batch_idx = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        s_rows = smem.allocate_tensor(Int32, cute.make_layout(KEYS * self.words), 128)
        s_base = s_rows.iterator.toint()
        offset, length = sequence_range(batch_idx, rows, mCuSeqlensK, None)
        length16 = (length + 15) // 16 * 16
        out_start = Int32(0)
        if const_expr(cfg.varlen):
            out_start = self.packed_start(mCuSeqlensK, batch_idx, rows, smem, tidx)
            if (n_block == 0) & (head == 0) & (tidx == 0):
                mCuSeqlensV[batch_idx] = out_start
                if batch_idx == batch - 1:
                    mCuSeqlensV[batch] = out_start + length16
        assert (KEYS * self.chunks) % cfg.threads == 0
        per_thread: cutlass.Constexpr = KEYS * self.chunks // cfg.threads  # 16-byte loads a block
        # a grid-stride loop over key blocks: max_seqlen only sizes the grid, so a caller's
        # max_seqlen_k below the true longest sequence still transposes every key
        stride = cute.arch.grid_dim()[0] * KEYS
        for first in cutlass.range(n_block * KEYS, length16, stride, unroll=1):
            # the block's key rows, 16 bytes a thread at a time (chunk fastest: a warp's loads
            # are whole rows); keys past the sequence read as zero
            for batch_start in cutlass.range_constexpr(0, per_thread, LOADS_IN_FLIGHT):
                loaded = []
                for i in cutlass.range_constexpr(min(LOADS_IN_FLIGHT, per_thread - batch_start)):
                    vector = tidx + (batch_start + i) * cfg.threads
                    key, chunk = vector // self.chunks, vector % self.chunks
                    w0, w1, w2, w3 = Int32(0), Int32(0), Int32(0), Int32(0)
                    if first + key < length:
                        row = (mV[offset + first + key, head, None] if const_expr(cfg.varlen)
                               else mV[batch_idx, first + key, head, None])
                        w0, w1, w2, w3 = load_v4(row.iterator + 16 * chunk)
                    loaded.append((key, chunk, w0, w1, w2, w3))
                for key, chunk, w0, w1, w2, w3 in loaded:
                    store_shared_v4(s_base + 4 * self.word_at(key, 4 * chunk), w0, w1, w2, w3)
            cute.arch.sync_threads()
            # one (16-key group, 4 columns) unit a thread: groups fastest across a warp
            for unit in cutlass.range(tidx, GROUPS * self.words, cfg.threads, unroll=1):
                group, col = unit % GROUPS, unit // GROUPS
                column = out_start + first + 16 * group  # its first key in the output
                if (first + 16 * group < length16) & (column + 16 <= columns):
                    rows16 = [s_rows[self.word_at(16 * group + FP8_KEY_ORDER[s], col)]
                              for s in range(16)]
                    words = []  # words[j][byte]: column 4 col + byte, keys of slots 4j..4j+3
                    for j in cutlass.range_constexpr(4):
                        # slots 4j..4j+3: a 4x4 byte transpose of their four words (one per
                        # key, the 4 columns' bytes) into one word per column (4 keys' bytes)
                        a, b, c, d = (rows16[4 * j + i] for i in range(4))
                        ab_lo, ab_hi = byte_perm(a, b, 0x5140), byte_perm(a, b, 0x7362)
                        cd_lo, cd_hi = byte_perm(c, d, 0x5140), byte_perm(c, d, 0x7362)
                        words.append((byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632),
                                      byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632)))
                    for byte in cutlass.range_constexpr(4):
                        out_row = (mVt[head, 4 * col + byte, None] if const_expr(cfg.varlen)
                                   else mVt[batch_idx, head, 4 * col + byte, None])
                        store_v4(out_row.iterator + column, *(words[j][byte] for j in range(4)))
            cute.arch.sync_threads()  # the next block overwrites s_rows

    @cute.jit
    def word_at(self, key, word) -> Int32:
        """The shared-memory word index of (key, word): each 16-key group's 16-byte chunks
        rotated by the group, so that a warp's 8 groups reading one column word hit
        different banks (rows of 16 keys apart share their banks otherwise)."""
        chunk = (word // 4 + key // 16) % self.chunks
        return key * self.words + 4 * chunk + word % 4

    @cute.jit
    def packed_start(self, mCuSeqlensK, batch_idx, rows, smem, tidx) -> Int32:
        """Where sequence batch_idx's keys start in the packed output: the earlier sequences'
        lengths, each rounded up to 16, summed by the CTA's threads."""
        cfg = self.cfg
        partial = Int32(0)
        for i in cutlass.range(tidx, batch_idx, cfg.threads, unroll=1):
            _, length = sequence_range(i, rows, mCuSeqlensK, None)
            partial += (length + 15) // 16 * 16
        partial = cute.arch.warp_reduction_sum(partial)
        warps = cfg.threads // 32
        sums = smem.allocate_tensor(Int32, cute.make_layout(warps), 4)
        if tidx % 32 == 0:
            sums[tidx // 32] = partial
        cute.arch.sync_threads()
        total = Int32(0)
        for w in cutlass.range_constexpr(warps):
            total += sums[w]
        return total


def _asm(result, args, text, constraints):
    return llvm.inline_asm(result, args, text, constraints, has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def load_v4(ptr: cute.Pointer, *, loc=None, ip=None) -> tuple:
    """16 bytes from global memory (ptr 16-byte aligned) as four words, by the read-only path."""
    regs = _asm(llvm.StructType.get_literal([T.i32()] * 4), [ptr.toint(loc=loc, ip=ip).ir_value()],
                "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return tuple(Int32(llvm.extractvalue(T.i32(), regs, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def store_v4(ptr: cute.Pointer, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None):
    """Four words to global memory as one 16-byte store (ptr 16-byte aligned)."""
    _asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(),
                *(Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d))],
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r")


@dsl_user_op
def store_shared_v4(addr: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None):
    """Four words to shared memory (addr: a 16-byte aligned shared-memory address)."""
    _asm(None, [Int32(x).ir_value(loc=loc, ip=ip) for x in (addr, a, b, c, d)],
         "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r")


@cute.jit
def byte_perm(a: Int32, b: Int32, selector: cutlass.Constexpr) -> Int32:
    """prmt.b32: byte i of the result is byte (nibble i of selector) of the pair (a: 0-3, b: 4-7)."""
    return Int32(cute.arch.prmt(a, b, selector))
