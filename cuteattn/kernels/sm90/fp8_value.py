"""V of the fp8 forward, transposed in one pass: (b, s, h_k, d_v) bytes -> (b, h_k, d_v, s16)
bytes (s16: s rounded up to 16, the extra keys zero), the keys of every 16-key group in
common/convert.FP8_KEY_ORDER (fwd.py's fp8 switch says why). Packed sequences (varlen):
(total_k, h_k, d_v) -> (h_k, d_v, total16), sequence b's keys from column cu16[b], each
sequence rounded up to 16 keys (so that its 16-key groups start with it), cu16 (batch + 1,)
written here for the forward kernel. launch.fp8_value_operand_torch is the reference.

A CTA takes KEYS keys of one (sequence, kv head): it reads their rows into shared memory as
32-bit words (a warp reads whole rows, coalesced), then each thread takes one 4-column x 16-key
block: 16 words from shared memory (the 16 keys' bytes at those 4 columns, in FP8_KEY_ORDER),
four 4x4 byte transposes by `prmt` (8 each), and the 4 columns' 16 bytes written as 4 words
each. Threads with consecutive column words read consecutive banks. Memory-bound: one read and
one write of V. Sequences are clamped as the attention kernels clamp them (sequence_range), and
no write goes past the output's last column, whatever cu_seqlens_k holds.
"""
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..common.convert import FP8_KEY_ORDER
from ..common.seqlen_info import sequence_range

KEYS = 64  # keys per CTA (four 16-key groups)


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
        self.words = cfg.head_dim_v // 4  # 32-bit words per key row

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor],
                 mCuSeqlensV: Optional[cute.Tensor], max_seqlen: Int32, stream: cuda.CUstream):
        """mV: uint8 (b, s, h_k, d_v), or (total_k, h_k, d_v) packed, the fp8 values' bytes;
        mVt: uint8 (b, h_k, d_v, s16), or (h_k, d_v, total16) packed; packed: mCuSeqlensK
        int32 (batch + 1,) in, mCuSeqlensV int32 (batch + 1,) out; max_seqlen: the longest
        sequence (sizes the grid; at least 1)."""
        v = as_words(mV, self.words)                 # (..., d_v / 4)
        vt = as_words(mVt, mVt.shape[-1] // 4)       # (..., s16 / 4)
        if const_expr(self.cfg.varlen):
            batch, heads = mCuSeqlensK.shape[0] - 1, mV.shape[1]
        else:
            batch, heads = mV.shape[0], mV.shape[2]
        blocks = (max_seqlen + KEYS - 1) // KEYS
        self.kernel(v, vt, mCuSeqlensK, mCuSeqlensV, mV.shape[-3] if const_expr(not self.cfg.varlen)
                    else mV.shape[0], mVt.shape[-1], batch).launch(
            grid=[blocks, heads, batch], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, v: cute.Tensor, vt: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor],
               mCuSeqlensV: Optional[cute.Tensor], rows: Int32, columns: Int32, batch: Int32):
        cfg = self.cfg
        n_block, head, batch_idx = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        s_rows = smem.allocate_tensor(Int32, cute.make_layout((KEYS, self.words), stride=(self.words, 1)), 16)
        offset, length = sequence_range(batch_idx, rows, mCuSeqlensK, None)
        length16 = (length + 15) // 16 * 16
        out_start = Int32(0)
        if const_expr(cfg.varlen):
            out_start = self.packed_start(mCuSeqlensK, batch_idx, rows, smem, tidx)
            if (n_block == 0) & (head == 0) & (tidx == 0):
                mCuSeqlensV[batch_idx] = out_start
                if batch_idx == batch - 1:
                    mCuSeqlensV[batch] = out_start + length16
        # a grid-stride loop over key blocks: max_seqlen only sizes the grid, so a caller's
        # max_seqlen_k below the true longest sequence still transposes every key
        stride = cute.arch.grid_dim()[0] * KEYS
        for first in cutlass.range(n_block * KEYS, length16, stride, unroll=1):
            # the block's key rows as words; keys past the sequence read as zero
            for w in cutlass.range(tidx, KEYS * self.words, cfg.threads, unroll=1):
                key, col = w // self.words, w % self.words
                value = Int32(0)
                if first + key < length:
                    if const_expr(cfg.varlen):
                        value = v[offset + first + key, head, col]
                    else:
                        value = v[batch_idx, first + key, head, col]
                s_rows[key, col] = value
            cute.arch.sync_threads()
            # one (16-key group, 4 columns) block a thread: column word fastest across threads
            for unit in cutlass.range(tidx, (KEYS // 16) * self.words, cfg.threads, unroll=1):
                group, col = unit // self.words, unit % self.words
                column = out_start + first + 16 * group  # its first key in the output
                if (first + 16 * group < length16) & (column + 16 <= columns):
                    rows16 = [s_rows[16 * group + FP8_KEY_ORDER[s], col] for s in range(16)]
                    for j in cutlass.range_constexpr(4):
                        # slots 4j..4j+3: a 4x4 byte transpose of their four words (one per
                        # key, the 4 columns' bytes) into one word per column (4 keys' bytes)
                        a, b, c, d = (rows16[4 * j + i] for i in range(4))
                        ab_lo, ab_hi = byte_perm(a, b, 0x5140), byte_perm(a, b, 0x7362)
                        cd_lo, cd_hi = byte_perm(c, d, 0x5140), byte_perm(c, d, 0x7362)
                        out = (byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632),
                               byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632))
                        for byte in cutlass.range_constexpr(4):
                            if const_expr(cfg.varlen):
                                vt[head, 4 * col + byte, column // 4 + j] = out[byte]
                            else:
                                vt[batch_idx, head, 4 * col + byte, column // 4 + j] = out[byte]
            cute.arch.sync_threads()  # the next block overwrites s_rows

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


def as_words(t: cute.Tensor, last) -> cute.Tensor:
    """A byte tensor (unit-stride last mode, other strides multiples of 16: arguments.py
    promises it) seen as 32-bit words."""
    layout = cute.make_layout((*t.shape[:-1], last),
                              stride=(*(st // 4 for st in t.stride[:-1]), 1))
    return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=Int32), layout)


@cute.jit
def byte_perm(a: Int32, b: Int32, selector: cutlass.Constexpr) -> Int32:
    """prmt.b32: byte i of the result is byte (nibble i of selector) of the pair (a: 0-3, b: 4-7)."""
    return Int32(cute.arch.prmt(a, b, selector))
