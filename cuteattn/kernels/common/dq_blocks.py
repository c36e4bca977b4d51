"""dQ's float32 accumulator in blocks of 8 rows, so that each atomic addition of a warp writes
whole 128-byte lines (the backward kernels that add dQ with red.global).

An m16n8 accumulator (mma.sync and wgmma alike) gives lane l rows l / 4 (and + 8) and columns
2 (l % 4) and + 1 of each 8-column step: one addition of a warp covers 8 rows x 8 columns. In
a row-major accumulator those are 8 rows, 8 lines. Here the buffer's rows (every sequence's,
one after another, as launch_common.BackwardLaunch.dq_accumulator allocates them) come in
groups of 8, each group's 8 x d floats of a head together, in 8-column blocks of 64 floats:
- "single" (red.global.add.f32, one float a lane: sm80): ordered (column parity, row, column
  pair), so an addition's 32 floats are adjacent, one line;
- "pairs" (red.global.add.v2.f32: sm90): ordered (row, column), an addition's 32 pairs two
  adjacent lines.
BackwardLaunch.dq_from_accumulator puts the rows back in order.

A fragment's element is its thread's first (coordinate (0, 0)) plus thread 0's coordinate of
that element (static): rows step in 8s and columns in 8s plus the pair's 0 or 1, inside the
blocks' linear parts, so an element's offset is the thread's plus a constant (step_offset).
"""
import cutlass
from cutlass import const_expr


def head_start(mdQacc, head_idx, width: int):
    """Where head head_idx's blocks start (mdQacc: (rows, width, heads[, batch]), seq-major)."""
    return mdQacc.iterator + head_idx * 8 * width


def first_row(mdQacc, seqlen, batch_idx, varlen_q: bool):
    """The buffer row of this sequence's first query: packed, its offset; fixed length, batch
    x seqlen (the blocks count the buffer's rows, not the sequence's)."""
    return seqlen.offset_q if const_expr(varlen_q) else batch_idx * mdQacc.shape[0]


def offset(order: str, row, col, row_stride):
    """Where (row, col) of one head is, in floats from head_start: 8-row groups row_stride x 8
    apart, 8-column blocks of 64 floats in `order`."""
    group = (row // 8) * (8 * row_stride) + (col // 8) * 64
    if const_expr(order == "single"):
        return group + (col % 2) * 32 + (row % 8) * 4 + (col // 2) % 4
    return group + (row % 8) * 8 + col % 8


def step_offset(order: str, step, row_stride):
    """offset() of thread 0's coordinate `step` of a fragment (static; checked to lie in the
    blocks' linear parts): what an element adds to its thread's first element's offset."""
    row, col = step
    assert row % 8 == 0 and col % 8 in ((0, 1) if order == "single" else (0,)), step
    return offset(order, row, col, row_stride)
