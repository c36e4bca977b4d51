"""Element-wise masking of a score tile (sequence end, causal, sliding window)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def column_span(acc_mn: cute.Tensor, cols) -> tuple:
    """(first, stop) of the columns of a (rows, cols) accumulator view to visit: all for None,
    else cols itself. A half of the view's columns is a half of the tile's: a wgmma
    accumulator's column mode is (2, N/8, 1), adjacent pairs then 8-column blocks
    (layout.acc_mn_layout), so its first half of indices holds the blocks of the first N/2."""
    return (0, cute.size(acc_mn, mode=[1])) if cutlass.const_expr(cols is None) else cols


@cute.jit
def apply_mask(acc_mn: cute.Tensor, coord_mn: cute.Tensor, row_start: Int32, col_start: Int32,
               seqlen_q: Int32, seqlen_k: Int32, window_left: Int32, window_right: Int32,
               causal: cutlass.Constexpr, local: cutlass.Constexpr,
               rows_per_query: cutlass.Constexpr = 1, cols: cutlass.Constexpr = None):
    """Sets masked scores to -inf. `acc_mn` is a (rows, cols) view of the accumulator and
    `coord_mn` the matching view of the tile's identity tensor, giving (row, col) in the tile.
    rows_per_query > 1: pack-GQA's rows (that many query heads per position), row r being
    query position r // rows_per_query. cols: (first, stop) of the view's columns to mask
    (column_span; None: all), key col_start + col for each."""
    first, stop = column_span(acc_mn, cols)
    off = seqlen_k - seqlen_q
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = row_start + coord_mn[r, 0][0]
        if cutlass.const_expr(rows_per_query > 1):
            row = row // rows_per_query
        col_hi = seqlen_k - col_start  # exclusive, relative to the tile
        if cutlass.const_expr(causal):
            col_hi = cutlass.min(col_hi, row + off + 1 - col_start)
        if cutlass.const_expr(local):
            col_hi = cutlass.min(col_hi, row + off + window_right + 1 - col_start)
            col_lo = row + off - window_left - col_start  # inclusive
            for c in cutlass.range_constexpr(first, stop):
                col = coord_mn[0, c][1]
                if (col >= col_hi) | (col < col_lo):
                    acc_mn[r, c] = -Float32.inf
        else:
            for c in cutlass.range_constexpr(first, stop):
                if coord_mn[0, c][1] >= col_hi:
                    acc_mn[r, c] = -Float32.inf


@cute.jit
def apply_mask_transposed(acc_mn: cute.Tensor, coord_mn: cute.Tensor, key_start: Int32,
                          q_start: Int32, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
                          window_right: Int32, causal: cutlass.Constexpr, local: cutlass.Constexpr):
    """apply_mask for a transposed score tile (keys as rows, queries as columns: the backward's
    S^T). Also masks queries past seqlen_q: the backward sums over them (into dK and dV), where
    the forward only left them unwritten."""
    off = seqlen_k - seqlen_q
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        key = key_start + coord_mn[r, 0][0]
        for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
            q = q_start + coord_mn[0, c][1]
            masked = (key >= seqlen_k) | (q >= seqlen_q)
            if cutlass.const_expr(causal):
                masked = masked | (key > q + off)
            if cutlass.const_expr(local):
                masked = masked | (key > q + off + window_right) | (key < q + off - window_left)
            if masked:
                acc_mn[r, c] = -Float32.inf
