"""Where a batch's rows start and how many there are, for q and for k.

Built once per tile: fixed-length batches index the batch mode, packed (varlen) batches read
cu_seqlens (and optionally seqused) and shift the sequence mode. The mainloop only ever asks this
object for lengths and for a (seqlen, d) view of one head, so variable length stays out of it.

Memory safety lives here: whatever the metadata holds, a sequence's rows are clamped into the
tensor it indexes. A packed sequence starts in [0, total] and ends in [start, total] (a negative
or decreasing length is empty); seqused is clamped into [0, rows left after the start]; a
fixed-length seqused into [0, seqlen]. Every row a kernel reads or writes is below `seqlen_*`,
so lying metadata can give wrong values inside the outputs but never an access outside q/k/v or
out/lse. The tile schedulers count blocks with the same function (`sequence_range`), so they and
the kernel agree on every sequence's length.
"""
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def sequence_range(batch_idx: Int32, total: Int32, mCuSeqlens: Optional[cute.Tensor],
                   mSeqUsed: Optional[cute.Tensor]):
    """(offset, length) of sequence `batch_idx`, clamped into [0, total) rows: `total` is the
    packed row count with cu_seqlens, else the fixed sequence length."""
    offset = Int32(0)
    length = total
    if cutlass.const_expr(mCuSeqlens is not None):
        offset = cutlass.min(cutlass.max(mCuSeqlens[batch_idx], 0), total)
        end = cutlass.min(cutlass.max(mCuSeqlens[batch_idx + 1], offset), total)
        length = end - offset
    if cutlass.const_expr(mSeqUsed is not None):
        length = cutlass.min(cutlass.max(mSeqUsed[batch_idx], 0), total - offset)
    return offset, length


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    varlen_q: cutlass.Constexpr[bool]
    varlen_k: cutlass.Constexpr[bool]
    shift_k: cutlass.Constexpr[bool] = False  # batched k starts at offset_k (a left pad)

    @staticmethod
    def create(
        batch_idx: Int32,
        rows_q: Int32,
        rows_k: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mLeftpadK: Optional[cute.Tensor] = None,
    ):
        """rows_q / rows_k: the sequence mode's extent of q / k (total rows when packed).
        mLeftpadK (a KV cache's cache_leftpad): sequence b's keys start that many rows in, so
        they are rows [leftpad, length) (the pad clamped into [0, length])."""
        offset_q, seqlen_q = sequence_range(batch_idx, rows_q, mCuSeqlensQ, mSeqUsedQ)
        offset_k, seqlen_k = sequence_range(batch_idx, rows_k, mCuSeqlensK, mSeqUsedK)
        if cutlass.const_expr(mLeftpadK is not None):
            pad = cutlass.min(cutlass.max(mLeftpadK[batch_idx], 0), seqlen_k)
            offset_k = offset_k + pad
            seqlen_k = seqlen_k - pad
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k,
                          mCuSeqlensQ is not None, mCuSeqlensK is not None,
                          mLeftpadK is not None)

    @staticmethod
    def _head_view(mX: cute.Tensor, varlen: bool, offset, head_idx, batch_idx) -> cute.Tensor:
        # fixed: mX is (seqlen, d, nheads, batch); varlen: (total, d, nheads)
        if cutlass.const_expr(varlen):
            return cute.domain_offset((offset, 0), mX[None, None, head_idx])
        return mX[None, None, head_idx, batch_idx]

    def q_view(self, mX: cute.Tensor, head_idx, batch_idx) -> cute.Tensor:
        """(seqlen_q, d) view of one head of a q-shaped tensor (q, o)."""
        return self._head_view(mX, self.varlen_q, self.offset_q, head_idx, batch_idx)

    def k_view(self, mX: cute.Tensor, head_idx, batch_idx) -> cute.Tensor:
        """(seqlen_k, d) view of one head of a k-shaped tensor."""
        if cutlass.const_expr(self.shift_k and not self.varlen_k):
            return cute.domain_offset((self.offset_k, 0), mX[None, None, head_idx, batch_idx])
        return self._head_view(mX, self.varlen_k, self.offset_k, head_idx, batch_idx)

    def vt_view(self, mVt: cute.Tensor, head_idx, batch_idx) -> cute.Tensor:
        """(d, seqlen_k) view of one head of V, seen transposed (d is the contiguous mode)."""
        if cutlass.const_expr(self.varlen_k):
            return cute.domain_offset((0, self.offset_k), mVt[None, None, head_idx])
        return mVt[None, None, head_idx, batch_idx]
