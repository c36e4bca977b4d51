"""VSA's block-sparse builder in one launch: from top-k key block indices per query block (B|1,
H|1, nq, k), the lists a block-sparse kernel walks, at the logical block size or already
expanded to a finer physical one (sparse.from_topk(..., physical=)).

sparse.from_topk followed by sparse.expand is its reference: a few dozen PyTorch operations
whose host time (about 0.36 ms a call on an H200's host, whatever the size) was 22-32% of the
90%-sparse forward's kernel time at 32k tokens and 3-4x it at 8k.

A CTA takes one logical query block of one (batch|1, head|1) and walks the key blocks in
rounds of `threads` (a thread each): shared memory holds a byte per key block of the round,
set by all threads from the row's k indices (an index outside [0, num_kv_blocks) sets
nothing, a repeated one the same byte), then each thread counts the selected blocks before
its own (the row of bytes, read as broadcasts) to place its block: logical block n, the j-th
selected, becomes fine blocks n*rk .. n*rk+rk-1 at entries j*rk .. j*rk+rk-1 of each of the
query block's rq fine rows. The lists come out in increasing block order, as
sparse._compact's; only the first `count` entries of each are written (no kernel reads
further). The other kind's counts (partial when the selected blocks are full, or full) are
zero.
"""
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint8


@dataclass(frozen=True)
class TopkListsConfig:
    """The static configuration of one compiled builder (its compile key)."""
    index_bits: int = 64  # the top-k indices' integer width (torch.topk gives int64)
    threads: int = 128    # key blocks a round (a thread each)

    @property
    def index_dtype(self):
        return Int64 if self.index_bits == 64 else Int32


class TopkLists:
    def __init__(self, cfg: TopkListsConfig):
        assert cfg.index_bits in (32, 64) and cfg.threads % 32 == 0
        self.cfg = cfg

    @cute.jit
    def __call__(self, mIndices: cute.Tensor, mCount: cute.Tensor, mIndex: cute.Tensor,
                 mOtherCount: cute.Tensor, num_kv_blocks: Int32, rq: Int32, rk: Int32,
                 stream: cuda.CUstream):
        """mIndices (B|1, H|1, nq, k); out: int32 counts mCount (B|1, H|1, nq * rq) and lists
        mIndex (B|1, H|1, nq * rq, >= num_kv_blocks * rk) of the selected blocks, mOtherCount
        (B|1, H|1, nq * rq) the other kind's counts (zeros)."""
        batch, heads, nq, _ = mIndices.shape
        self.kernel(mIndices, mCount, mIndex, mOtherCount, num_kv_blocks, rq, rk).launch(
            grid=[nq, heads, batch], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIndices, mCount, mIndex, mOtherCount, num_kv_blocks: Int32, rq: Int32,
               rk: Int32):
        threads = self.cfg.threads
        m, h, b = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        k = mIndices.shape[3]
        smem = cutlass.memory.SmemAllocator()
        seen = smem.allocate_tensor(Uint8, cute.make_layout(threads), 16)
        listed = Int32(0)  # selected key blocks of the rounds before
        for n0 in cutlass.range(0, num_kv_blocks, threads, unroll=1):
            cute.arch.sync_threads()  # (the previous round's reads are done)
            seen[tidx] = Uint8(0)
            cute.arch.sync_threads()
            last = cutlass.min(n0 + threads, num_kv_blocks)
            for j in cutlass.range(tidx, k, threads, unroll=1):
                idx = mIndices[b, h, m, j]
                if (idx >= self.cfg.index_dtype(n0)) & (idx < self.cfg.index_dtype(last)):
                    seen[Int32(idx) - n0] = Uint8(1)
            cute.arch.sync_threads()
            before, total = Int32(0), Int32(0)
            for r in cutlass.range(threads, unroll=1):
                s = Int32(seen[r])
                total += s
                if r < tidx:
                    before += s
            if seen[tidx] != Uint8(0):
                entry = (listed + before) * rk
                block = (n0 + tidx) * rk
                for i in cutlass.range(rq, unroll=1):
                    for t in cutlass.range(rk, unroll=1):
                        mIndex[b, h, m * rq + i, entry + t] = block + t
            listed += total
        for i in cutlass.range(tidx, rq, threads, unroll=1):
            mCount[b, h, m * rq + i] = listed * rk
            mOtherCount[b, h, m * rq + i] = Int32(0)
