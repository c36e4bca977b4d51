"""Where a batch's rows start and how many there are, for q and for k.

Built once per tile: fixed-length batches index the batch mode, packed (varlen) batches read
cu_seqlens (and optionally seqused) and shift the sequence mode. The mainloop only ever asks this
object for lengths and for a (seqlen, d) view of one head, so variable length stays out of it.
"""
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    varlen_q: cutlass.Constexpr[bool]
    varlen_k: cutlass.Constexpr[bool]

    @staticmethod
    def create(
        batch_idx: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
    ):
        varlen_q = mCuSeqlensQ is not None
        varlen_k = mCuSeqlensK is not None
        offset_q = Int32(0) if cutlass.const_expr(not varlen_q) else mCuSeqlensQ[batch_idx]
        offset_k = Int32(0) if cutlass.const_expr(not varlen_k) else mCuSeqlensK[batch_idx]
        if cutlass.const_expr(mSeqUsedQ is not None):
            seqlen_q = mSeqUsedQ[batch_idx]
        elif cutlass.const_expr(varlen_q):
            seqlen_q = mCuSeqlensQ[batch_idx + 1] - offset_q
        else:
            seqlen_q = seqlen_q_static
        if cutlass.const_expr(mSeqUsedK is not None):
            seqlen_k = mSeqUsedK[batch_idx]
        elif cutlass.const_expr(varlen_k):
            seqlen_k = mCuSeqlensK[batch_idx + 1] - offset_k
        else:
            seqlen_k = seqlen_k_static
        return SeqlenInfo(offset_q, offset_k, seqlen_q, seqlen_k, varlen_q, varlen_k)

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
        return self._head_view(mX, self.varlen_k, self.offset_k, head_idx, batch_idx)

    def vt_view(self, mVt: cute.Tensor, head_idx, batch_idx) -> cute.Tensor:
        """(d, seqlen_k) view of one head of V, seen transposed (d is the contiguous mode)."""
        if cutlass.const_expr(self.varlen_k):
            return cute.domain_offset((0, self.offset_k), mVt[None, None, head_idx])
        return mVt[None, None, head_idx, batch_idx]
