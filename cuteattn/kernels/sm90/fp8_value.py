"""V of the fp8 forward, transposed in one pass: (b, s, h_k, d_v) bytes -> (b, h_k, d_v, s16)
bytes (s16: s rounded up to 16, the extra keys zero), the keys of every 16-key group in
common/convert.FP8_KEY_ORDER (fwd.py's fp8 switch says why). launch.fp8_value_operand's PyTorch
gather is this kernel's reference.

A CTA takes KEYS keys of one (batch, kv head): it reads their rows into shared memory as 32-bit
words (a warp reads whole rows, coalesced), then each thread takes one 4-column x 16-key block:
16 words from shared memory (the 16 keys' bytes at those 4 columns, in FP8_KEY_ORDER), four 4x4
byte transposes by `prmt` (8 each), and 4 columns' 16 bytes written as 4 words each. Threads with
consecutive column words read consecutive banks. Memory-bound: one read and one write of V.
"""
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.convert import FP8_KEY_ORDER

KEYS = 64  # keys per CTA (four 16-key groups)


@dataclass(frozen=True)
class Fp8ValueConfig:
    """The static configuration of one compiled transpose (its compile key)."""
    head_dim_v: int             # a multiple of 16
    threads: int = 128


class Fp8ValueTranspose:
    def __init__(self, cfg: Fp8ValueConfig):
        assert cfg.head_dim_v % 16 == 0
        self.cfg = cfg
        self.words = cfg.head_dim_v // 4  # 32-bit words per key row

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, stream: cuda.CUstream):
        """mV: uint8 (b, s, h_k, d_v), the fp8 values' bytes; mVt: uint8 (b, h_k, d_v, s16)."""
        v = as_words(mV, self.words)               # (b, s, h_k, d_v / 4)
        vt = as_words(mVt, mVt.shape[3] // 4)      # (b, h_k, d_v, s16 / 4)
        blocks = (mVt.shape[3] + KEYS - 1) // KEYS
        self.kernel(v, vt, mV.shape[1], mVt.shape[3]).launch(
            grid=[blocks, mV.shape[2], mV.shape[0]], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, v: cute.Tensor, vt: cute.Tensor, seqlen: Int32, seqlen16: Int32):
        cfg = self.cfg
        n_block, head, batch = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        s_rows = smem.allocate_tensor(Int32, cute.make_layout((KEYS, self.words), stride=(self.words, 1)), 16)
        first = n_block * KEYS
        # the block's key rows as words; keys past the sequence read as zero
        for w in cutlass.range(tidx, KEYS * self.words, cfg.threads, unroll=1):
            key, col = w // self.words, w % self.words
            value = Int32(0)
            if first + key < seqlen:
                value = v[batch, first + key, head, col]
            s_rows[key, col] = value
        cute.arch.sync_threads()
        # one (16-key group, 4 columns) block a thread: column word fastest across the threads
        for unit in cutlass.range(tidx, (KEYS // 16) * self.words, cfg.threads, unroll=1):
            group, col = unit // self.words, unit % self.words
            if first + 16 * group < seqlen16:
                rows = [s_rows[16 * group + FP8_KEY_ORDER[s], col] for s in range(16)]
                out_word = (first + 16 * group) // 4
                for j in cutlass.range_constexpr(4):
                    # slots 4j..4j+3: a 4x4 byte transpose of their four words (one per key, the
                    # 4 columns' bytes) into one word per column (the 4 keys' bytes)
                    a, b, c, d = rows[4 * j], rows[4 * j + 1], rows[4 * j + 2], rows[4 * j + 3]
                    ab_lo, ab_hi = byte_perm(a, b, 0x5140), byte_perm(a, b, 0x7362)
                    cd_lo, cd_hi = byte_perm(c, d, 0x5140), byte_perm(c, d, 0x7362)
                    columns = (byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632),
                               byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632))
                    for byte in cutlass.range_constexpr(4):
                        vt[batch, head, 4 * col + byte, out_word + j] = columns[byte]


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
