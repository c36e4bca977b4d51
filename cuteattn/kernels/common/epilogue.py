"""Epilogues: LSE and O (or the backward's dK and dV) of a block of rows to global memory, for
every kernel family (`rows` and `threads`: a Hopper consumer warpgroup's 64 rows and 128 threads,
or an mma.sync CTA's whole tile).

LSE goes straight from the registers of the threads that own column 0. O goes registers ->
shared memory (in the MMA's own layout) -> registers -> global memory with 16-byte stores, so a
row's bytes leave together; only rows inside the sequence are written (`seqlen_info` clamps the
sequence to the tensor, so no row outside `out` is ever touched).
"""
import math

import cutlass
import cutlass.cute as cute

from .convert import convert_fragment
from .layout import acc_mn_view
from .seqlen_info import SeqlenInfo



@cute.jit
def store_lse(lse, gLSE: cute.Tensor, thr_mma_pv, head_dim_v: cutlass.Constexpr, row_start,
              seqlen_q, rows: cutlass.Constexpr):
    """lse: this thread's rows' values; gLSE: the (seqlen_q,) LSE of this head; thr_mma_pv
    covers `rows` rows from row_start."""
    coord = acc_mn_view(thr_mma_pv.partition_C(cute.make_identity_tensor((rows, head_dim_v))))
    if coord[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = row_start + coord[r, 0][0]
            if row < seqlen_q:
                gLSE[row] = lse[r]


@cute.jit
def store_acc(acc: cute.Tensor, gO: cute.Tensor, thr_mma, row_start, seqlen_q,
              rows: cutlass.Constexpr, cols: cutlass.Constexpr, dtype: cutlass.Constexpr = None,
              column: cutlass.Constexpr = None):
    """The float32 accumulator (in `dtype` if given) straight from the registers (no staging)
    into gO, the (rows, cols) block at row_start, rows at or past seqlen_q skipped: split-KV
    partial outputs, and the portable backward's dK / dV column passes (whose K and V buffers
    are still in use). `column`: the gO column of an accumulator column, where the kernel's
    fragments hold the columns in another order."""
    coord = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((rows, cols))))
    acc_mn = acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = coord[r, 0][0]
        if row_start + row < seqlen_q:
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                col = coord[r, c][1] if cutlass.const_expr(column is None) else column(coord[r, c][1])
                if cutlass.const_expr(dtype is None):
                    gO[row, col] = acc_mn[r, c]
                else:
                    gO[row, col] = acc_mn[r, c].to(dtype)


@cute.jit
def stage_o(acc_O: cute.Tensor, sO: cute.Tensor, tiled_mma_pv, tidx, dtype: cutlass.Constexpr,
            stmatrix: cutlass.Constexpr = True):
    """acc_O (float32) -> the MMA's (rows, d_v) tile of shared memory, in dtype (one packed cvt
    per pair: the element-wise conversion left fp16 d=64 causal spilling). `stmatrix` (Hopper's
    matrix store) is for wgmma accumulators only: it is chosen by the kernel's code path, never
    by the device, because on an mma.sync accumulator it scrambles the values. mma.sync kernels
    store each thread's pairs with 32-bit stores."""
    rO = cute.make_rmem_tensor_like(acc_O, dtype)
    convert_fragment(acc_O, rO)
    if cutlass.const_expr(stmatrix):
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    else:
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype,
                                         num_bits_per_copy=2 * dtype.width)
    thr_copy = cute.make_tiled_copy_C(store_atom, tiled_mma_pv).get_slice(tidx)
    cute.copy(thr_copy, thr_copy.retile(rO), thr_copy.partition_D(sO))


@cute.jit
def store_o(sO: cute.Tensor, gO: cute.Tensor, row_start, seqlen_q, tidx,
            dtype: cutlass.Constexpr, head_dim_v: cutlass.Constexpr, rows: cutlass.Constexpr,
            threads: cutlass.Constexpr, cols=None):
    """sO (rows, d_v) -> gO (the block of O at row_start), by `threads` threads, 16 bytes per
    thread per copy, rows at or past seqlen_q skipped; with `cols` (out's head dim, narrower
    than d_v when it is padded; a multiple of the 16-byte vector) columns from there too."""
    vec = 128 // dtype.width
    # The thread layout must tile (rows, d_v) exactly: d_v = 96 has 12 vectors per row, so 4
    # threads share a row and each stores 3 vectors.
    threads_per_row = math.gcd(head_dim_v // vec, 32)
    rows_per_pass = threads // threads_per_row
    copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    tiled_copy = cute.make_tiled_copy_tv(
        copy_atom,
        cute.make_layout((rows_per_pass, threads_per_row), stride=(threads_per_row, 1)),
        cute.make_layout((1, vec)),
    )
    thr_copy = tiled_copy.get_slice(tidx)
    tOsO = thr_copy.partition_S(sO)
    tOgO = thr_copy.partition_D(gO)
    tOcO = thr_copy.partition_S(cute.make_identity_tensor((rows, head_dim_v)))
    tOrO = cute.make_rmem_tensor_like(tOsO, dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
        if row_start + tOcO[0, m, 0][0] < seqlen_q:
            if cutlass.const_expr(cols is None):
                cute.copy(copy_atom, tOrO[None, m, None], tOgO[None, m, None])
            else:
                for k in cutlass.range_constexpr(cute.size(tOrO, mode=[2])):
                    if tOcO[0, m, k][1] < cols:
                        cute.copy(copy_atom, tOrO[None, m, k], tOgO[None, m, k])


def lse_view(mLSE: cute.Tensor, seqlen: SeqlenInfo, head_idx, batch_idx) -> cute.Tensor:
    """The (seqlen_q,) LSE of one head: mLSE is (s, h, b), or (total, h) when q is packed."""
    if cutlass.const_expr(seqlen.varlen_q):
        return cute.domain_offset((seqlen.offset_q,), mLSE[None, head_idx])
    return mLSE[None, head_idx, batch_idx]
