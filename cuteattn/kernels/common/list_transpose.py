"""The block-sparse backward's transposed lists in one launch: from the forward's lists (per query
block, its full and partial key blocks) the lists its key blocks walk (per key block, the query
blocks that attend it, full or partial), or for lists of 64-key blocks walked in pairs, each
pair's list (the query blocks either half attends, as partial blocks) and the halves' table
(int32 (nk, nq): whether key block n attends query block m).

sparse.transpose / transpose_paired are its reference: a few dozen PyTorch operations, whose
host time (about 0.9 ms a backward on an H200's host) was most of an 8k, 90%-sparse backward
whose kernel takes 0.25 ms.

A CTA takes `threads` consecutive key blocks (a thread each) of one (batch|1, head|1) and walks
the query blocks in rounds of `rows`: shared memory holds a byte per (query block, key block)
of the round, 0, 1 (partial) or 2 (full), written by all threads from the forward's lists
(partial ones first, then full ones over them: a block listed as both counts as full;
duplicates write the same byte), then each thread reads its key block's column in query order
and appends to its lists. Entries past a list's count are not read; counts are clamped into
[0, nk]; a listed key block outside [0, nk) is left out (the forward visits such an entry as
a block of no keys). Only the first `count` entries of each output list are written.
"""
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8, const_expr

FULL, PARTIAL = 2, 1  # a (query block, key block) byte of shared memory; 0: not attended


@dataclass(frozen=True)
class ListTransposeConfig:
    """The static configuration of one compiled transposition (its compile key)."""
    paired: bool        # the pairs' lists and the halves' table (lists of 64-key blocks)
    threads: int = 128  # key blocks a CTA (even: a pair's two halves are in one CTA)
    rows: int = 256     # query blocks a round holds in shared memory (rows x threads bytes)


class ListTranspose:
    def __init__(self, cfg: ListTransposeConfig):
        assert cfg.threads % 64 == 0
        self.cfg = cfg

    @cute.jit
    def __call__(self, mFullCount: cute.Tensor, mFullIndex: cute.Tensor,
                 mPartialCount: cute.Tensor, mPartialIndex: cute.Tensor,
                 mOutFullCount: cute.Tensor, mOutFullIndex: cute.Tensor,
                 mOutPartialCount: cute.Tensor, mOutPartialIndex: cute.Tensor,
                 mHalves, stream: cuda.CUstream):
        """In: int32 counts (B|1, H|1, nq) and lists (B|1, H|1, nq, nk). Out: counts (B|1, H|1,
        rows) and lists (B|1, H|1, rows, nq), rows nk or (paired) the pairs, ceil(nk / 2);
        mHalves (paired): int32 (B|1, H|1, nk, nq), else None."""
        batch, heads, _, nk = mFullIndex.shape
        chunks = (nk + self.cfg.threads - 1) // self.cfg.threads
        self.kernel(mFullCount, mFullIndex, mPartialCount, mPartialIndex, mOutFullCount,
                    mOutFullIndex, mOutPartialCount, mOutPartialIndex, mHalves).launch(
            grid=[chunks, heads, batch], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mFullCount, mFullIndex, mPartialCount, mPartialIndex, mOutFullCount,
               mOutFullIndex, mOutPartialCount, mOutPartialIndex, mHalves):
        cfg = self.cfg
        chunk, h, b = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        nq, nk = mFullIndex.shape[2], mFullIndex.shape[3]
        first = chunk * cfg.threads  # this CTA's first key block
        n = first + tidx             # this thread's key block
        pair = first // 2 + tidx     # (paired) this thread's pair, for the first half of them
        pairs = (nk + 1) // 2
        smem = cutlass.memory.SmemAllocator()
        seen = smem.allocate_tensor(
            Uint8, cute.make_layout((cfg.rows, cfg.threads), stride=(cfg.threads, 1)), 16)
        num_full, num_partial = Int32(0), Int32(0)
        for m0 in cutlass.range(0, nq, cfg.rows, unroll=1):
            rows = cutlass.min(nq - m0, cfg.rows)
            cute.arch.sync_threads()  # (the previous round's reads are done)
            for r in cutlass.range(rows, unroll=1):
                seen[r, tidx] = Uint8(0)
            cute.arch.sync_threads()
            self.mark(mPartialCount, mPartialIndex, seen, b, h, m0, rows, first, nk, tidx, PARTIAL)
            cute.arch.sync_threads()
            self.mark(mFullCount, mFullIndex, seen, b, h, m0, rows, first, nk, tidx, FULL)
            cute.arch.sync_threads()
            for r in cutlass.range(rows, unroll=1):
                m = m0 + r
                if const_expr(cfg.paired):
                    if n < nk:
                        mHalves[b, h, n, m] = cutlass.select_(seen[r, tidx] != Uint8(0), Int32(1), Int32(0))
                    if (tidx < cfg.threads // 2) & (pair < pairs):
                        either = seen[r, 2 * tidx] | seen[r, 2 * tidx + 1]
                        if either != Uint8(0):
                            mOutPartialIndex[b, h, pair, num_partial] = m
                            num_partial += 1
                elif n < nk:
                    state = seen[r, tidx]
                    if state == Uint8(FULL):
                        mOutFullIndex[b, h, n, num_full] = m
                        num_full += 1
                    elif state == Uint8(PARTIAL):
                        mOutPartialIndex[b, h, n, num_partial] = m
                        num_partial += 1
        if const_expr(cfg.paired):
            if (tidx < cfg.threads // 2) & (pair < pairs):
                mOutFullCount[b, h, pair] = Int32(0)
                mOutPartialCount[b, h, pair] = num_partial
        elif n < nk:
            mOutFullCount[b, h, n] = num_full
            mOutPartialCount[b, h, n] = num_partial

    @cute.jit
    def mark(self, mCount, mIndex, seen, b, h, m0, rows, first, nk, tidx, state: cutlass.Constexpr):
        """seen[m - m0, key block - first] = state for the listed key blocks of this CTA's
        chunk, over the round's query blocks (all threads share each list's entries)."""
        for r in cutlass.range(rows, unroll=1):
            count = cutlass.max(cutlass.min(mCount[b, h, m0 + r], nk), 0)
            for j in cutlass.range(tidx, count, self.cfg.threads, unroll=1):
                col = mIndex[b, h, m0 + r, j] - first
                if (col >= 0) & (col < self.cfg.threads) & (col + first < nk):
                    seen[r, col] = Uint8(state)
