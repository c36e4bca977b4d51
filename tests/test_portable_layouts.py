"""The views the portable (mma.sync) kernels are built on, run on the CPU through the DSL's host
JIT: the mma.sync accumulator's (rows, cols) and A-operand views (common/layout.py), pack-GQA's
rows (layout.pack_heads_into_rows, mask.apply_mask's rows_per_query) and the transposed view.
Each is checked against an independent construction in PyTorch."""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402

from cutlass._mlir.dialects import arith, llvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

from cuteattn.kernels.common.layout import (acc_mn_layout, acc_to_a_operand_layout,  # noqa: E402
                                            pack_heads_into_rows, seq_major, transposed_view)
from cuteattn.kernels.common.mask import apply_mask  # noqa: E402
from cuteattn.kernels.launch_common import to_cute  # noqa: E402

M_BLOCKS, N_BLOCKS = 2, 4  # an mma.sync accumulator of 2 x 4 m16n8 tiles per thread


@cute.jit
def accumulator_views(mn_index: cute.Tensor, a_index: cute.Tensor):
    """For a compact ((2, 2), M, N) accumulator: mn_index[r, c] = the register index of row r,
    column c of the (rows, cols) view; a_index[v, m, k] = that of the A-operand view's entry."""
    acc = cute.make_layout(((2, 2), M_BLOCKS, N_BLOCKS))
    mn = acc_mn_layout(acc)
    a = acc_to_a_operand_layout(acc)
    for r in cutlass.range_constexpr(2 * M_BLOCKS):
        for c in cutlass.range_constexpr(2 * N_BLOCKS):
            mn_index[r, c] = Int32(cute.crd2idx((r, c), mn))
    for v in cutlass.range_constexpr(8):
        for m in cutlass.range_constexpr(M_BLOCKS):
            for k in cutlass.range_constexpr(N_BLOCKS // 2):
                a_index[v, m, k] = Int32(cute.crd2idx((v, m, k), a))


def test_mma_sync_accumulator_views():
    """m16n8k16: register (c, h, m, n) of a thread holds row h * 8 + (lane / 4) of m-tile m and
    column pair element c of n-tile n. The (rows, cols) view must order rows (h, m) and columns
    (c, n); the A operand of a k16 MMA takes n-tiles 2k and 2k + 1 as its two k halves, in the
    order (c, h, k half)."""
    mn = torch.zeros(2 * M_BLOCKS, 2 * N_BLOCKS, dtype=torch.int32)
    a = torch.zeros(8, M_BLOCKS, N_BLOCKS // 2, dtype=torch.int32)
    fn = cute.compile(accumulator_views, to_cute(mn, 4), to_cute(a, 4))
    fn(to_cute(mn, 4), to_cute(a, 4))
    reg = lambda c, h, m, n: c + 2 * h + 4 * m + 4 * M_BLOCKS * n  # the compact layout
    for h in range(2):
        for m in range(M_BLOCKS):
            for c in range(2):
                for n in range(N_BLOCKS):
                    assert mn[h + 2 * m, c + 2 * n] == reg(c, h, m, n)
    for c in range(2):
        for h in range(2):
            for half in range(2):
                for m in range(M_BLOCKS):
                    for k in range(N_BLOCKS // 2):
                        assert a[c + 2 * h + 4 * half, m, k] == reg(c, h, m, 2 * k + half)


G, S, HK, B, D = 4, 3, 2, 2, 8


@cute.jit
def packed_rows(mQ: cute.Tensor, out: cute.Tensor):
    """out[b, j, p, col] = the pack-GQA view's element (packed row p, col, kv head j, batch b)."""
    packed = pack_heads_into_rows(seq_major(mQ, False), G, 2)
    for b in cutlass.range_constexpr(B):
        for j in cutlass.range_constexpr(HK):
            for p in cutlass.range_constexpr(G * S):
                for col in cutlass.range_constexpr(D):
                    out[b, j, p, col] = packed[p, col, j, b]


def test_pack_gqa_rows_are_query_heads_at_positions():
    """Packed row p of kv head j is query head j * G + p % G at position p // G."""
    q = torch.randn(B, S, HK * G, D)
    out = torch.zeros(B, HK, G * S, D)
    fn = cute.compile(packed_rows, to_cute(q, 4), to_cute(out, 4))
    fn(to_cute(q, 4), to_cute(out, 4))
    for p in range(G * S):
        for j in range(HK):
            assert torch.equal(out[:, j, p], q[:, p // G, j * G + p % G])


ROWS, COLS = 16, 8


@cute.jit
def masked_tile(scores: cute.Tensor, row_start: Int32, col_start: Int32, seqlen_q: Int32,
                seqlen_k: Int32, left: Int32, right: Int32, group: cutlass.Constexpr,
                causal: cutlass.Constexpr, local: cutlass.Constexpr):
    acc = cute.make_rmem_tensor((ROWS, COLS), Float32)
    for r in cutlass.range_constexpr(ROWS):
        for c in cutlass.range_constexpr(COLS):
            acc[r, c] = scores[r, c]
    apply_mask(acc, cute.make_identity_tensor((ROWS, COLS)), row_start, col_start, seqlen_q,
               seqlen_k, left, right, causal, local, group)
    for r in cutlass.range_constexpr(ROWS):
        for c in cutlass.range_constexpr(COLS):
            scores[r, c] = acc[r, c]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal,local,left,right", [(True, False, 1 << 30, 0),
                                                      (False, True, 3, 1),
                                                      (False, False, 1 << 30, 1 << 30)])
def test_mask_of_packed_rows_is_the_mask_of_their_positions(group, causal, local, left, right):
    """With pack-GQA, tile row r (from row_start) is query position (row_start + r) // group;
    the mask is FlashAttention's bottom-right one of that position."""
    seqlen_q, seqlen_k, row_start, col_start = 9, 13, 8, 4
    scores = torch.randn(ROWS, COLS)
    got = scores.clone()
    fn = cute.compile(masked_tile, to_cute(got, 4), *([Int32(0)] * 6), group, causal, local)
    fn(to_cute(got, 4), Int32(row_start), Int32(col_start), Int32(seqlen_q), Int32(seqlen_k),
       Int32(left), Int32(right))
    q = (row_start + torch.arange(ROWS)) // group
    k = col_start + torch.arange(COLS)
    off = seqlen_k - seqlen_q
    visible = (k[None, :] < seqlen_k).expand(ROWS, COLS).clone()
    if causal:
        visible &= k[None, :] <= q[:, None] + off
    if local:
        visible &= (k[None, :] <= q[:, None] + off + right) & (k[None, :] >= q[:, None] + off - left)
    want = torch.where(visible, scores, torch.tensor(float("-inf")))
    assert torch.equal(got, want)


@cute.jit
def transposed(src: cute.Tensor, out: cute.Tensor):
    view = transposed_view(src)
    for j in cutlass.range_constexpr(5):
        for i in cutlass.range_constexpr(3):
            out[j, i] = view[j, i]


def test_transposed_view():
    src = torch.randn(3, 5)
    out = torch.zeros(5, 3)
    fn = cute.compile(transposed, to_cute(src, 4), to_cute(out, 4))
    fn(to_cute(src, 4), to_cute(out, 4))
    assert torch.equal(out, src.T)



TILE_N, TILE_M, WARPS = 64, 64, 4  # the portable backward's dS^T tile (keys x queries)


@dsl_user_op
def small_int_as_bf16(x: Int32, *, loc=None, ip=None) -> cutlass.BFloat16:
    """x (an integer exact in bf16: |x| < 256) as bf16, from the top half of its float32 bits.
    A plain float32 -> bf16 conversion in the DSL's host JIT calls __truncsfbf2, which some
    toolchains' runtime libraries lack ("Symbols not found: __truncsfbf2")."""
    bits = llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    high = arith.trunci(T.i16(), arith.shrui(bits, arith.constant(T.i32(), 16, loc=loc, ip=ip),
                                             loc=loc, ip=ip), loc=loc, ip=ip)
    return cutlass.BFloat16(llvm.bitcast(cutlass.BFloat16.mlir_type, high, loc=loc, ip=ip))


@cute.jit
def ds_written_in_parts(buf: cute.Tensor, part_cols: cutlass.Constexpr, which: cutlass.Constexpr):
    """The backward's dS^T store, thread by thread: each thread's fragment of each column part
    (sub-block) of the (keys, queries) tile, holding the key (which = 0) or the query (which = 1: the tile's column; the identity view of a part keeps whole-tile coordinates)
    of each element, stored with bwd.copy_column_part into the swizzled tile over buf."""
    from cuteattn.kernels.sm80 import mma
    from cuteattn.kernels.sm80.bwd import copy_column_part
    tile = cute.make_tensor(buf.iterator, mma.smem_layout(cutlass.BFloat16, TILE_N, TILE_M))
    tiled_mma = mma.tiled_mma(cutlass.BFloat16, WARPS)
    coords = cute.make_identity_tensor((TILE_N, TILE_M))
    for t in cutlass.range(32 * WARPS):
        st = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16,
                                                        num_bits_per_copy=32), tiled_mma).get_slice(t)
        dst = st.partition_D(tile)
        for h in cutlass.range_constexpr(TILE_M // part_cols):
            part = st.partition_D(cute.local_tile(coords, (TILE_N, part_cols), (0, h)))
            frag = cute.make_rmem_tensor(part.shape, cutlass.BFloat16)
            for i in cutlass.range_constexpr(cute.size(part)):
                frag[i] = small_int_as_bf16(Int32(part[i][0] if which == 0 else part[i][1]))
            copy_column_part(st, frag, dst, h)


@cute.jit
def read_whole(buf: cute.Tensor, out: cute.Tensor):
    from cuteattn.kernels.sm80 import mma
    tile = cute.make_tensor(buf.iterator, mma.smem_layout(cutlass.BFloat16, TILE_N, TILE_M))
    for r in cutlass.range_constexpr(TILE_N):
        for c in cutlass.range_constexpr(TILE_M):
            out[r, c] = tile[r, c]


@pytest.mark.parametrize("part_cols", [64, 32, 16])
def test_ds_sub_blocks_land_where_dq_reads_them(part_cols):
    """The backward writes dS^T in sub-blocks of part_cols query columns (q_parts > 1) and dQ
    reads the whole swizzled tile: every element must land at its (key, query) of the tile.
    (A local_tile view of each part's columns got this wrong inside a swizzle atom: dQ was NaN
    at d = 128 in the GPU suite.)"""
    got = []
    for which in (0, 1):
        buf = torch.full((TILE_N * TILE_M,), float("nan"), dtype=torch.bfloat16)
        out = torch.zeros(TILE_N, TILE_M, dtype=torch.bfloat16)
        cute.compile(ds_written_in_parts, to_cute(buf, 16), part_cols, which)(to_cute(buf, 16))
        cute.compile(read_whole, to_cute(buf, 16), to_cute(out, 2))(to_cute(buf, 16), to_cute(out, 2))
        got.append(out.float())
    keys, queries = torch.meshgrid(torch.arange(TILE_N).float(), torch.arange(TILE_M).float(), indexing="ij")
    assert torch.equal(got[0], keys)
    assert torch.equal(got[1], queries)
