"""The warp-level MMA model (sm_80 and later: mma.sync m16n8k16, ldmatrix, cp.async) as the sm80
kernels use it: swizzled shared-memory layouts, the tiled MMA, 16-byte global -> shared copies
and a GEMM that loads each k block's fragments from shared memory one block ahead.

Only sm_80 instructions appear here, so the same code runs on Ampere, Ada, consumer Blackwell
(sm_120) and, for testing, on Hopper.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync, warp

MMA_ROWS = 16  # rows of one warp's m16n8k16 MMA
COPY_BITS = 128  # one cp.async / vector store moves 16 bytes


def atom_width_bytes(dtype, row_elems: int) -> int:
    """The widest of 128, 64, 32 bytes that divides a row of `row_elems` elements."""
    return next(w for w in (128, 64, 32) if row_elems * dtype.width // 8 % w == 0)


def smem_layout_atom(dtype, row_elems: int) -> cute.ComposedLayout:
    """The swizzled (8, w) atom of a row-major tile whose rows hold `row_elems` elements: w is
    atom_width_bytes, and the XOR swizzle spreads the 16-byte chunks of 8 consecutive rows over
    distinct banks, so both the cp.async writes (along rows) and the ldmatrix reads (8 rows of
    one chunk column) are conflict-free."""
    width_bytes = atom_width_bytes(dtype, row_elems)
    swizzle_bits = {128: 3, 64: 2, 32: 1}[width_bytes]
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, 3, 3), 0,
        cute.make_ordered_layout((8, width_bytes * 8 // dtype.width), order=(1, 0)))


def smem_layout(dtype, rows: int, cols: int, stages: int = 0) -> cute.ComposedLayout:
    """A (rows, cols) tile, or with `stages` a (rows, cols, stages) ring of them.

    Views of part of such a tile (local_tile, domain offsets) address correctly only when they
    start on a whole swizzle atom (8 rows; a multiple of the atom's row width in columns): the
    DSL adds the swizzled offset of the view's origin to the swizzled offsets inside it, and the
    XOR does not distribute over that sum. Slicing a thread's partition of the whole tile is
    always right (bwd.copy_column_part)."""
    atom = smem_layout_atom(dtype, cols)
    if stages:
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def tiled_mma(dtype, num_warps: int) -> cute.TiledMma:
    """num_warps warps stacked along M, each an m16n8k16 MMA with float32 accumulators (a warp
    owns rows w*16 .. w*16+15 of every (num_warps * 16)-row slab of the tile)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (num_warps, 1, 1),
        permutation_mnk=(num_warps * MMA_ROWS, 16, 16))


def rows_per_copy_pass(dtype, num_threads: int, cols: int) -> int:
    """Rows one pass of gmem_to_smem_copy covers."""
    return num_threads // (atom_width_bytes(dtype, cols) * 8 // COPY_BITS)


def tiled_mma_2d(dtype, warps_m: int, warps_n: int) -> cute.TiledMma:
    """warps_m x warps_n warps, each an m16n8k16 MMA: warps_m along M, warps_n along N (a warp's
    atoms 16 columns wide at least: with one warp along N, two n8 atoms side by side)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * MMA_ROWS, max(16, warps_n * 8), 16))


def tiled_mma_grid(dtype, warps_m: int, warps_n: int) -> cute.TiledMma:
    """warps_m x warps_n warps, each owning two n8 atoms side by side (16 adjacent columns) of
    every (warps_m * 16, warps_n * 16) tile, so that one ldmatrix.x4 reads a warp's B fragments
    of a k block (with one n8 atom a warp per tile the x4's second half would be discarded)."""
    cols = cute.make_layout((8, warps_n, 2), stride=(1, 16, 8))
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * MMA_ROWS, cols, 16))


def gmem_to_smem_copy(dtype, num_threads: int, cols: int) -> cute.TiledCopy:
    """cp.async of 16 bytes per thread over a (rows, cols) tile: a row's chunks are read by
    consecutive threads (coalesced), `num_threads` threads cover num_threads / (chunks per atom
    row) rows per pass."""
    vec = COPY_BITS // dtype.width
    threads_per_row = atom_width_bytes(dtype, cols) * 8 // COPY_BITS
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(
        atom, cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)))


def byte_copy_like(dtype, num_threads: int, cols: int) -> cute.TiledCopy:
    """cp.async of the bytes of a (rows, cols) tile of 8-bit elements, in the chunks
    gmem_to_smem_copy(dtype, ...) gives each thread of a `dtype` tile: the same threads on the
    same (row, column) coordinates, so a thread can convert the bytes it loaded into its own
    chunks of the `dtype` tile (an fp8 KV cache). 8-byte copies (cp.async.ca)."""
    vec = COPY_BITS // dtype.width
    threads_per_row = atom_width_bytes(dtype, cols) * 8 // COPY_BITS
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS),
                               cutlass.Uint8, num_bits_per_copy=8 * vec)
    return cute.make_tiled_copy_tv(
        atom, cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0)),
        cute.make_layout((1, vec)))


def byte_copy_wide(dtype, num_threads: int, cols: int) -> cute.TiledCopy:
    """cp.async of 16 bytes a thread over a (rows, cols) tile of 8-bit elements (16-byte
    cp.async.cg, where byte_copy_like's are 8-byte .ca): each thread takes 16 consecutive
    elements of a row, two of gmem_to_smem_copy(dtype)'s chunks, so a pass covers twice the
    rows of byte_copy_like's."""
    vec = 2 * COPY_BITS // dtype.width
    threads_per_row = atom_width_bytes(dtype, cols) * 8 // COPY_BITS // 2
    threads = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    load = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                               cutlass.Uint8, num_bits_per_copy=8 * vec)
    return cute.make_tiled_copy_tv(load, threads, cute.make_layout((1, vec)))


def ldmatrix_atom(dtype, transpose: bool) -> cute.CopyAtom:
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)


@cute.jit
def gemm(tiled_mma, acc, frag_a, frag_b, smem_a, smem_b, copy_a, copy_b,
         a_in_registers: cutlass.Constexpr = False):
    """acc += A B over every k block. B's (and, unless `a_in_registers`, A's) fragments come
    from shared memory (smem_a/smem_b: the thread's ldmatrix partitions) one k block ahead of
    the MMAs that use them, so the loads overlap the math. (Loading each block just before its
    MMAs, to keep one block's fragments live instead of two, did not lower ptxas' register use
    at d_v = 256: it schedules the loads early either way.)"""
    view_b = copy_b.retile(frag_b)
    k_blocks: cutlass.Constexpr = cute.size(frag_b, mode=[2])
    view_a = None
    if cutlass.const_expr(not a_in_registers):
        view_a = copy_a.retile(frag_a)
        cute.copy(copy_a, smem_a[None, None, 0], view_a[None, None, 0])
    cute.copy(copy_b, smem_b[None, None, 0], view_b[None, None, 0])
    for k in cutlass.range_constexpr(k_blocks):
        if cutlass.const_expr(k + 1 < k_blocks):
            if cutlass.const_expr(not a_in_registers):
                cute.copy(copy_a, smem_a[None, None, k + 1], view_a[None, None, k + 1])
            cute.copy(copy_b, smem_b[None, None, k + 1], view_b[None, None, k + 1])
        cute.gemm(tiled_mma, acc, frag_a[None, None, k], frag_b[None, None, k], acc)


@cute.jit
def load_rows(thr_copy, tXgX, tXsX, tXcX, rows_left, bounded: cutlass.Constexpr = True,
              cols=None):
    """cp.async of one tile's rows into shared memory (tXgX/tXsX/tXcX: the thread's partitions
    of the source, the buffer and the tile's identity). `bounded`: only rows below `rows_left`
    (the sequence's rows from the tile's first) are read; the others are zeroed, so no value
    past the sequence (garbage, NaN) reaches an MMA operand. `cols` (the tensor's head dim,
    narrower than the tile's when padded; a multiple of the 16-byte vector): only columns below
    it are read, the others zeroed, so q.k and p.v stay exact."""
    if cutlass.const_expr(cols is not None):
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                inside = tXcX[0, m, k][1] < cols
                if cutlass.const_expr(bounded):
                    inside = inside & (tXcX[0, m, k][0] < rows_left)
                if inside:
                    cute.copy(thr_copy, tXgX[None, m, k], tXsX[None, m, k])
                else:
                    tXsX[None, m, k].fill(0)
    elif cutlass.const_expr(bounded):
        for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(thr_copy, tXgX[None, m, None], tXsX[None, m, None])
            else:
                tXsX[None, m, None].fill(0)
    else:
        cute.copy(thr_copy, tXgX, tXsX)
