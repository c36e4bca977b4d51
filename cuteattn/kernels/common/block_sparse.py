"""The key blocks a query tile visits under block-sparse attention (cuteattn.sparse's lists):
its full blocks, then its partial ones, read from the (batch|1, head|1, query block) lists.

The block iterator of a dense tile is a range (block_info.n_block_range); this is the other
iterator of the same shape: a count and "the i-th block". A listed block past the sequence's
end (an expansion of a coarser mask lists some) holds no key: it is visited as the block just
past the end, which TMA fills with zeros and the sequence-end mask removes, so it adds nothing;
so is any index outside [0, nk). Counts are clamped into [0, nk]. As in seqlen_info, lying lists
can give wrong values but never a load outside k/v.
"""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def _clamp(x, lo, hi):  # (plain min/max: no branch)
    return cutlass.max(cutlass.min(x, hi), lo)


class _Visits:
    """The count queries of a visit order of `num_blocks` visits."""

    def count(self):
        return self.num_blocks

    def any(self):
        return self.num_blocks > 0

    def none(self):
        return self.num_blocks <= 0


@dataclass(frozen=True)
class SparseBlocks(_Visits):
    full_index: cute.Tensor     # (nk,) this tile's full blocks (the first num_full entries)
    partial_index: cute.Tensor  # (nk,) its partial blocks
    num_full: Int32
    num_blocks: Int32           # full + partial
    end_block: Int32            # the first key block past the sequence's end

    @staticmethod
    def create(mFullCount: cute.Tensor, mFullIndex: cute.Tensor, mPartialCount: cute.Tensor,
               mPartialIndex: cute.Tensor, batch_idx: Int32, head_idx: Int32, m_block: Int32,
               seqlen_k: Int32, tile_n: int):
        """The lists of query block m_block of (batch_idx, head_idx); a batch or head mode of
        extent 1 is broadcast."""
        b = cutlass.min(batch_idx, mFullCount.shape[0] - 1)
        h = cutlass.min(head_idx, mFullCount.shape[1] - 1)
        m = cutlass.min(m_block, mFullCount.shape[2] - 1)
        nk = mFullIndex.shape[3]
        num_full = _clamp(mFullCount[b, h, m], 0, nk)
        num_partial = _clamp(mPartialCount[b, h, m], 0, nk)
        return SparseBlocks(mFullIndex[b, h, m, None], mPartialIndex[b, h, m, None], num_full,
                            num_full + num_partial, (seqlen_k + tile_n - 1) // tile_n)

    def first(self):
        return self.block(Int32(0))

    @cute.jit
    def step(self, i: Int32, parts: cutlass.Constexpr) -> Int32:
        """The i-th of the listed blocks' `parts` equal sub-blocks, in order (the backward's
        64-row steps through 128-row query blocks)."""
        if cutlass.const_expr(parts == 1):
            return self.block(i)
        return self.block(i // parts) * parts + i % parts

    @cute.jit
    def block(self, i: Int32) -> Int32:
        """The i-th key block to visit (0 <= i < num_blocks)."""
        n = Int32(0)
        if i < self.num_full:
            n = self.full_index[i]
        else:
            n = self.partial_index[i - self.num_full]
        if (n < 0) | (n > self.end_block):
            n = self.end_block
        return n


@dataclass(frozen=True)
class SparseBlockPairs(_Visits):
    """The visit order of a block-sparse tile whose lists name key blocks of half its width
    (64-key lists on 128-key tiles, Sm90FwdConfig.sparse_pairs): visit i is two listed blocks,
    its keys' halves, taken in list order, full blocks paired with full ones and partial with
    partial (a visit takes the mask_mod or not as a whole). A list of odd length leaves its
    last visit's second half empty: that half is the block just past the sequence's end (no
    key; TMA fills it with zeros or the sequence-end mask removes it), as is any index outside
    [0, nk). The methods of SparseBlocks, block(i) naming visit i (its blocks: halves)."""
    lists: SparseBlocks            # end_block counts half-width blocks
    num_full: Int32                # visits of full blocks (the first ones)
    num_blocks: Int32              # visits

    @staticmethod
    def create(*lists_args):
        """SparseBlocks.create's arguments, tile_n the lists' (half-width) block."""
        lists = SparseBlocks.create(*lists_args)
        num_full = (lists.num_full + 1) // 2
        return SparseBlockPairs(lists, num_full,
                                num_full + (lists.num_blocks - lists.num_full + 1) // 2)

    def first(self):
        return Int32(0)

    def block(self, i: Int32) -> Int32:
        return i

    @cute.jit
    def half(self, i: Int32, h: Int32) -> Int32:
        """The listed block that fills half h (0 or 1) of visit i."""
        lists = self.lists
        n = lists.end_block
        if i < self.num_full:
            j = 2 * i + h
            if j < lists.num_full:
                n = lists.full_index[j]
        else:
            j = 2 * (i - self.num_full) + h
            if j < lists.num_blocks - lists.num_full:
                n = lists.partial_index[j]
        if (n < 0) | (n > lists.end_block):
            n = lists.end_block
        return n

    def halves(self, i: Int32) -> tuple:
        return self.half(i, Int32(0)), self.half(i, Int32(1))


@dataclass(frozen=True)
class SparseRows:
    """The backward's query steps of a key block under block-sparse attention: the query blocks
    its transposed lists name (sparse.transpose), each as `parts` steps of the kernel's rows
    (block_info.DenseRows is the dense order with these methods)."""
    lists: SparseBlocks
    parts: int

    def start(self):
        return Int32(0)

    def stop(self):
        return self.lists.num_blocks * self.parts

    def block(self, it):
        return self.lists.step(it, self.parts)

    def stage(self, it):
        return it % 2
