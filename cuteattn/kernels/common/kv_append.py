"""The KV-cache update before a decode kernel attends, in one launch: the new tokens k and v
written into the cache (rotated, and for an fp8 cache quantized by their descales), q rotated,
and each sequence's used length (cache_seqlens + seqlen_new). kvcache.append_and_rotate's
PyTorch steps (a dozen small kernels) are its reference and its CPU path.

A CTA takes one head z of one token row i of one sequence b: q's head z of row i (rotated at
cache_seqlens[b] + i, or at cache_seqlens[b] when the mask is not positional) when rotary
embedding is on, and the new tokens' kv head z of row i, written at position
cache_seqlens[b] + i of the sequence (its cache row cache_batch_idx[b], or its page
block_table[b, p // page_size]). A CTA a head, not a row: at batch 1 one CTA walked every
head's features in 16 dependent rounds of loads and stores (7.6 us of a 130 us decode step).
The threads walk the head's features; a rotated feature reads its pair's partner (interleaved:
2j, 2j+1; GPT-NeoX: j, j + rotary_dim / 2) and cos / sin at the position, in float32, as the reference.
Memory safety: a position outside the cache, a page id outside the cache or a cache row outside
it is not written, and a rotary position past cos / sin's rows reads their last row (the
reference path raises on such values; validate=True checks them first).
"""
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dataclass(frozen=True)
class KvAppendConfig:
    """The static configuration of one compiled update (its compile key)."""
    dtype: type                     # q, k, v: cutlass.BFloat16 or Float16
    head_dim: int
    head_dim_v: int
    append: bool                    # new k / v given
    rotary: Optional[str] = None    # None, "interleaved" (GPT-J) or "neox"
    rotary_dtype: Optional[type] = None  # cos / sin's
    positional: bool = False        # q rotated at cache_seqlens + i (causal or windowed)
    paged: bool = False
    batch_idx: bool = False         # cache_batch_idx (contiguous caches)
    cache_fp8: Optional[str] = None  # None, "e4m3" or "e5m2": the cache's bytes
    threads: int = 128


class KvAppend:
    def __init__(self, cfg: KvAppendConfig):
        assert cfg.append or cfg.rotary is not None
        self.cfg = cfg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQRot: Optional[cute.Tensor], mK: Optional[cute.Tensor],
                 mV: Optional[cute.Tensor], mKCache: cute.Tensor, mVCache: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mBatchIdx: Optional[cute.Tensor],
                 mBlockTable: Optional[cute.Tensor], mCos: Optional[cute.Tensor],
                 mSin: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
                 mVDescale: Optional[cute.Tensor], mSeqUsed: cute.Tensor, stream: cuda.CUstream):
        """q (b, sq, h, d), its rotated copy; new k / v (b, s_new, h_k, d / d_v); the caches
        (rows or pages, capacity or page size, h_k, d / d_v), fp8 ones as uint8; int32 (b,)
        lengths in, used lengths out; cos / sin (positions, rotary_dim / 2); fp8 descales
        float32 (b, h_k)."""
        rows, heads = 0, 0
        if const_expr(self.cfg.append):
            rows, heads = mK.shape[1], mK.shape[2]
        if const_expr(self.cfg.rotary is not None):
            rows, heads = cutlass.max(rows, mQ.shape[1]), cutlass.max(heads, mQ.shape[2])
        self.kernel(mQ, mQRot, mK, mV, mKCache, mVCache, mCacheSeqlens, mBatchIdx, mBlockTable,
                    mCos, mSin, mKDescale, mVDescale, mSeqUsed).launch(
            grid=[rows, mQ.shape[0], heads], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ, mQRot, mK, mV, mKCache, mVCache, mCacheSeqlens, mBatchIdx, mBlockTable,
               mCos, mSin, mKDescale, mVDescale, mSeqUsed):
        cfg = self.cfg
        i, b, head = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        old = mCacheSeqlens[b]
        s_new = 0
        if const_expr(cfg.append):
            s_new = mK.shape[1]
        if (i == 0) & (head == 0) & (tidx == 0):
            mSeqUsed[b] = old + s_new
        if const_expr(cfg.rotary is not None):
            if (i < mQ.shape[1]) & (head < mQ.shape[2]):
                pos = old + i if const_expr(cfg.positional) else old
                x = mQ[b, i, head, None]
                for f in cutlass.range(tidx, cfg.head_dim, cfg.threads, unroll=1):
                    mQRot[b, i, head, f] = self.rotated(x, f, pos, mCos, mSin).to(cfg.dtype)
        if const_expr(cfg.append):
            if (i < s_new) & (head < mK.shape[2]):
                self.append_row(mK, mV, mKCache, mVCache, mBatchIdx, mBlockTable, mCos, mSin,
                                mKDescale, mVDescale, b, i, head, old + i, tidx)

    @cute.jit
    def append_row(self, mK, mV, mKCache, mVCache, mBatchIdx, mBlockTable, mCos, mSin,
                   mKDescale, mVDescale, b, i, head, pos, tidx):
        """Head `head` of new token row i of sequence b into the caches at sequence position
        pos."""
        cfg = self.cfg
        row, slot = b, pos
        valid = pos >= 0
        if const_expr(cfg.paged):
            page_size = mKCache.shape[1]
            page_of = pos // page_size
            valid = valid & (page_of < mBlockTable.shape[1])
            row = Int32(-1)
            if valid:
                row = mBlockTable[b, page_of]
            slot = pos % page_size
        elif const_expr(cfg.batch_idx):
            row = mBatchIdx[b]
        valid = valid & (row >= 0) & (row < mKCache.shape[0]) & (slot < mKCache.shape[1])
        if valid:
            x = mK[b, i, head, None]
            for f in cutlass.range(tidx, cfg.head_dim, cfg.threads, unroll=1):
                value = x[f].to(Float32)
                if const_expr(cfg.rotary is not None):
                    # rounded to k's dtype first, as the reference stores a rotated k
                    value = self.rotated(x, f, pos, mCos, mSin).to(cfg.dtype).to(Float32)
                self.store(mKCache, mKDescale, row, slot, head, f, b, value)
            for f in cutlass.range(tidx, cfg.head_dim_v, cfg.threads, unroll=1):
                self.store(mVCache, mVDescale, row, slot, head, f, b, mV[b, i, head, f].to(Float32))

    @cute.jit
    def store(self, mCache, mDescale, row, slot, head, f, b, value: Float32):
        cfg = self.cfg
        if const_expr(cfg.cache_fp8 is not None):
            if const_expr(mDescale is not None):
                value = value / mDescale[b, head]
            mCache[row, slot, head, f] = fp8_byte(value, cfg.cache_fp8 == "e5m2").to(Uint8)
        else:
            mCache[row, slot, head, f] = value.to(cfg.dtype)

    @cute.jit
    def rotated(self, x: cute.Tensor, f, pos, mCos, mSin) -> Float32:
        """Feature f of the row x (one head), rotated at position pos (float32)."""
        cfg = self.cfg
        half = mCos.shape[1]  # rotary_dim / 2
        out = x[f].to(Float32)
        if f < 2 * half:
            # the pair's first feature takes x c - partner s, the second x c + partner s
            if const_expr(cfg.rotary == "interleaved"):
                second = f % 2
                j, partner = f // 2, f + 1 - 2 * second
            else:
                second = f // half
                j, partner = f - half * second, f + half - 2 * half * second
            # (a position past the table, which the host checks reject where they can see the
            # lengths, reads its last row: never outside it)
            row = cutlass.max(cutlass.min(pos, mCos.shape[0] - 1), 0)
            c, s = mCos[row, j].to(Float32), mSin[row, j].to(Float32)
            sign = Float32(2 * second - 1)
            # each product rounded on its own, as PyTorch's x1 * c - x2 * s: a multiply-add
            # that ptxas contracts into one fma rounds once, and its result (rounded to k's
            # dtype) then differs from the reference's in a few elements in 10^4
            out = mul_rn(out, c) + sign * mul_rn(x[partner].to(Float32), s)
        return out


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded to nearest; its explicit rounding keeps ptxas from fusing it into an fma."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.f32 $0, $1, $2;",
        "=f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def fp8_byte(x: Float32, e5m2: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """x rounded to nearest (saturating) to e4m3 (or e5m2), in the low byte."""
    kind = "e5m2x2" if e5m2 else "e4m3x2"
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b16 h;\n"
        f"cvt.rn.satfinite.{kind}.f32 h, 0f00000000, $1;\n"
        "cvt.u32.u16 $0, h;\n}",
        "=r,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))
