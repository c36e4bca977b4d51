"""Views of MMA accumulator fragments.

A Hopper wgmma accumulator fragment has, per thread, the shape ((2, 2, N/8), MMA_M, MMA_N): a
pair of adjacent columns, the two row halves (row g and g+8), and one entry per 8-column block.
An Ampere mma.sync (m16n8k16) accumulator has the same thread ownership with the 8-column blocks
in the last mode instead: ((2, 2), MMA_M, N/8). Softmax wants either as (rows, cols); the P.V GEMM
wants the same values as an A operand, whose fragment is ((2, 2, 2), MMA_M, K/16): each 16-wide k
block is two adjacent 8-column blocks of the accumulator. All are pure re-indexings of the same
registers.
"""
import cutlass.cute as cute


def acc_mn_layout(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)), or for mma.sync ((2, 2), M, N) -> ((2, M), (2, N)):
    rows first, columns second."""
    s, d = layout.shape, layout.stride
    if len(s[0]) == 2:
        return cute.make_layout(((s[0][1], s[1]), (s[0][0], s[2])),
                                stride=((d[0][1], d[1]), (d[0][0], d[2])))
    return cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )


def acc_mn_view(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, acc_mn_layout(t.layout))


def acc_to_a_operand_layout(layout: cute.Layout) -> cute.Layout:
    """((2, 2, V), M, 1) accumulator -> ((2, 2, 2), M, V/2) A-operand fragment of a k16 MMA; for
    mma.sync ((2, 2), M, N) -> ((2, 2, 2), M, N/2)."""
    s, d = layout.shape, layout.stride
    if len(s[0]) == 2:
        assert s[2] % 2 == 0, f"unexpected accumulator layout {layout}"
        return cute.make_layout(((s[0][0], s[0][1], 2), s[1], s[2] // 2),
                                stride=((d[0][0], d[0][1], d[2]), d[1], 2 * d[2]))
    assert s[0][2] % 2 == 0 and s[2] == 1, f"unexpected accumulator layout {layout}"
    return cute.make_layout(
        ((s[0][0], s[0][1], 2), s[1], s[0][2] // 2),
        stride=((d[0][0], d[0][1], d[0][2]), d[1], 2 * d[0][2]),
    )


# Global tensors arrive in FlashAttention's layouts; kernels index them sequence-first, so that a
# tile's modes come first: q/k/o (b, s, h, d) -> (s, d, h, b), packed (total, h, d) -> (total, d, h);
# V is seen transposed, (d, s, h, b) / (d, total, h), as the MN-major B operand of P V; LSE
# (b, h, s) -> (s, h, b), packed (h, total) -> (total, h). Views only: no data moves.
def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def seq_major(t: cute.Tensor, packed: bool) -> cute.Tensor:
    return _select(t, [0, 2, 1] if packed else [1, 3, 2, 0])


def seq_major_transposed(t: cute.Tensor, packed: bool) -> cute.Tensor:
    return _select(t, [2, 0, 1] if packed else [3, 1, 2, 0])


def lse_seq_major(t: cute.Tensor, packed: bool) -> cute.Tensor:
    return _select(t, [1, 0] if packed else [2, 1, 0])


def transposed_view(t: cute.Tensor) -> cute.Tensor:
    """The (cols, rows) view of a (rows, cols) tile (swizzled shared memory included): element
    (j, i) of the view is element (i, j) of t. The mma.sync forward reads V (keys, d) as the
    (d, keys) B operand of P V this way, with a transposing ldmatrix."""
    rows, cols = t.shape
    return cute.composition(t, cute.make_ordered_layout((cols, rows), order=(1, 0)))


def pack_heads_into_rows(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """Pack-GQA's view of a sequence-major tensor (mode 0: the sequence; `head_mode`: the query
    heads): the `group` query heads that share a kv head become rows, (group, seqlen) with the
    head fastest, and the head mode counts kv heads. Packed row p of kv head j is query head
    j * group + p % group at position p // group. A view: no data moves."""
    s, d = t.layout.shape, t.layout.stride
    shape = [(group, s[0])] + list(s[1:])
    stride = [(d[head_mode], d[0])] + list(d[1:])
    shape[head_mode] = s[head_mode] // group
    stride[head_mode] = d[head_mode] * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


def keys_last_transposed(t: cute.Tensor, packed: bool) -> cute.Tensor:
    """V stored transposed, (b, h_k, d_v, keys) or packed (h_k, d_v, total) (the fp8 forward's:
    sm90/fp8_value.py writes it), seen as (d_v, keys, h_k, b) / (d_v, total, h_k) like
    seq_major_transposed's view, the keys contiguous."""
    return _select(t, [1, 2, 0] if packed else [2, 3, 1, 0])
