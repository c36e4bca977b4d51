"""The kernel's block geometry (which key blocks a query tile visits, which of them it masks),
run on the CPU through the DSL's host JIT and checked against a brute-force mask.

A key block skipped while some query of the tile sees one of its keys, or a block processed
without the element mask while some element must be masked, is a silent wrong answer; the GPU
tests see only their shapes, this sees every block of many more.
"""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from cuteattn.kernels.launch_common import UNBOUNDED as _UNBOUNDED, to_cute as _to_cute  # noqa: E402
from cuteattn.kernels.common.block_info import BlockInfo  # noqa: E402

MAX_N_BLOCKS = 48
UNMASKED = 2 + 4 * MAX_N_BLOCKS


@cute.jit
def geometry(out: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
             window_right: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
             causal: cutlass.Constexpr, local: cutlass.Constexpr):
    """out[m] = (n_min, n_max, needs_mask of (block n, warpgroup w) at 2 + 4 n + w, then the
    unmasked block range [lo, hi) of warpgroup w at UNMASKED + 2 w)."""
    info = BlockInfo(tile_m, tile_n, causal, local, window_left, window_right)
    for m in cutlass.range((seqlen_q + tile_m - 1) // tile_m, unroll=1):
        n_min, n_max = info.n_block_range(seqlen_q, seqlen_k, m)
        out[m, 0] = n_min
        out[m, 1] = n_max
        for n in cutlass.range(MAX_N_BLOCKS, unroll=1):
            for w in cutlass.range_constexpr(tile_m // 64):
                out[m, 2 + 4 * n + w] = Int32(
                    info.needs_mask(seqlen_q, seqlen_k, m * tile_m + w * 64, 64, n))
        for w in cutlass.range_constexpr(tile_m // 64):
            lo, hi = info.unmasked_blocks(seqlen_q, seqlen_k, m * tile_m + w * 64, 64)
            out[m, UNMASKED + 2 * w] = lo
            out[m, UNMASKED + 2 * w + 1] = hi


def visible(sq, sk, causal, left, right):
    """The reference mask (bottom-right aligned), -1 = unbounded side."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i + off
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


TILES = [(128, 128), (128, 80), (192, 96), (128, 112)]
MASKS = [("none", -1, -1), ("causal", -1, 0), ("local", 64, 32), ("local", 0, 0),
         ("local", 200, -1), ("local", -1, 50)]
LENGTHS = [(1, 1), (17, 300), (300, 17), (128, 128), (1000, 1023), (700, 129), (129, 700)]


@pytest.mark.parametrize("tile_m,tile_n", TILES, ids=[f"{m}x{n}" for m, n in TILES])
@pytest.mark.parametrize("mask,left,right", MASKS, ids=[f"{m}{l},{r}" for m, l, r in MASKS])
def test_block_range_and_mask_flags(tile_m, tile_n, mask, left, right):
    causal, local = mask == "causal", mask == "local"
    out = torch.zeros(64, UNMASKED + 8, dtype=torch.int32)
    compiled = cute.compile(geometry, _to_cute(out, 4), Int32(0), Int32(0), Int32(0), Int32(0),
                            tile_m, tile_n, causal, local)
    for sq, sk in LENGTHS:
        assert (sk + tile_n - 1) // tile_n <= MAX_N_BLOCKS
        out.fill_(-7)
        compiled(_to_cute(out, 4), Int32(sq), Int32(sk),
                 Int32(_UNBOUNDED if left < 0 else left), Int32(_UNBOUNDED if right < 0 else right))
        ok = visible(sq, sk, causal, left, right)
        for m in range((sq + tile_m - 1) // tile_m):
            n_min, n_max = out[m, 0].item(), out[m, 1].item()
            rows = slice(m * tile_m, min((m + 1) * tile_m, sq))
            for n in range((sk + tile_n - 1) // tile_n + 1):
                cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
                where = f"sq={sq} sk={sk} m_block={m} n_block={n}"
                if ok[rows, cols].any():
                    assert n_min <= n < n_max, f"{where}: visible keys but the block is skipped"
                if not n_min <= n < n_max:
                    continue
                for w in range(tile_m // 64):
                    r0 = m * tile_m + w * 64
                    if r0 >= sq:
                        continue  # rows past the sequence are never stored
                    wg_rows = slice(r0, min(r0 + 64, sq))
                    # a masked element: invisible, or a key column past the sequence end
                    must_mask = (~ok[wg_rows, cols]).any() or (n + 1) * tile_n > sk
                    flag = out[m, 2 + 4 * n + w].item()
                    # the block iterator (key_block_runs) runs the blocks in [lo, hi) unmasked
                    lo, hi = out[m, UNMASKED + 2 * w].item(), out[m, UNMASKED + 2 * w + 1].item()
                    if must_mask:
                        assert flag == 1, f"{where} warpgroup {w}: masked elements but no element mask"
                        assert not lo <= n < hi, \
                            f"{where} warpgroup {w}: masked elements in the unmasked run [{lo}, {hi})"
                    if flag == 0:  # and the run is exactly the blocks the check passes
                        assert lo <= n < hi, \
                            f"{where} warpgroup {w}: unmasked block outside the unmasked run [{lo}, {hi})"


@cute.jit
def block_runs(out: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
               window_right: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
               causal: cutlass.Constexpr, local: cutlass.Constexpr):
    """out[m, w] = the key block each iteration of warpgroup w visits, run by run: for
    iteration i, 2 * i holds the block and 2 * i + 1 whether its run masks (iteration 0, the
    caller's, is checked with needs_mask)."""
    info = BlockInfo(tile_m, tile_n, causal, local, window_left, window_right)
    for m in cutlass.range((seqlen_q + tile_m - 1) // tile_m, unroll=1):
        n_min, n_max = info.n_block_range(seqlen_q, seqlen_k, m)
        for w in cutlass.range_constexpr(tile_m // 64):
            row_start = m * tile_m + w * 64
            if n_max > n_min:
                out[m, w, 0] = n_max - 1
                out[m, w, 1] = Int32(info.needs_mask(seqlen_q, seqlen_k, row_start, 64, n_max - 1))
            runs = info.key_block_runs(seqlen_q, seqlen_k, row_start, 64, n_min, n_max)
            for r in cutlass.range_constexpr(len(runs)):
                first, stop, masked = runs[r]
                for i in cutlass.range(first, stop, unroll=1):
                    out[m, w, 2 * i] = n_max - 1 - i
                    out[m, w, 2 * i + 1] = Int32(1 if masked else 0)


@pytest.mark.parametrize("tile_m,tile_n", TILES[:2], ids=[f"{m}x{n}" for m, n in TILES[:2]])
@pytest.mark.parametrize("mask,left,right", MASKS, ids=[f"{m}{l},{r}" for m, l, r in MASKS])
def test_block_iterator_visits_each_block_once_and_masks_where_needed(tile_m, tile_n, mask, left, right):
    """The mainloop's iterations (the first block, then key_block_runs' runs) visit exactly the
    blocks [n_min, n_max) from the top down, each once, and every block run without the
    element mask has no masked element."""
    causal, local = mask == "causal", mask == "local"
    out = torch.zeros(64, 2, 2 * MAX_N_BLOCKS, dtype=torch.int32)
    compiled = cute.compile(block_runs, _to_cute(out, 4), Int32(0), Int32(0), Int32(0), Int32(0),
                            tile_m, tile_n, causal, local)
    for sq, sk in LENGTHS:
        out.fill_(-7)
        compiled(_to_cute(out, 4), Int32(sq), Int32(sk),
                 Int32(_UNBOUNDED if left < 0 else left), Int32(_UNBOUNDED if right < 0 else right))
        ok = visible(sq, sk, causal, left, right)
        for m in range((sq + tile_m - 1) // tile_m):
            rows_all = ok[m * tile_m:(m + 1) * tile_m]
            cols_seen = torch.nonzero(rows_all.any(0)).flatten()
            for w in range(tile_m // 64):
                r0 = m * tile_m + w * 64
                visits = out[m, w, 0::2]
                masks = out[m, w, 1::2]
                n_visits = int((visits != -7).sum())
                blocks = visits[:n_visits].tolist()
                where = f"sq={sq} sk={sk} m_block={m} warpgroup {w}"
                assert (visits[n_visits:] == -7).all(), f"{where}: a gap in the iterations"
                if cols_seen.numel():  # the tile's blocks, from the top down, each once
                    top = int(cols_seen.max()) // tile_n
                    assert blocks[0] == top and blocks == list(range(top, top - n_visits, -1)), \
                        f"{where}: visits {blocks}"
                    assert int(cols_seen.min()) // tile_n >= blocks[-1], f"{where}: a visible block is never visited"
                if r0 >= sq:
                    continue
                wg_rows = slice(r0, min(r0 + 64, sq))
                for n, flag in zip(blocks, masks[:n_visits].tolist()):
                    cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
                    must_mask = (~ok[wg_rows, cols]).any() or (n + 1) * tile_n > sk
                    assert flag == 1 or not must_mask, f"{where} block {n}: run without the mask needs it"


@cute.jit
def backward_geometry(out: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, window_left: Int32,
                      window_right: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                      causal: cutlass.Constexpr, local: cutlass.Constexpr):
    """The backward's view: out[n, 0:2] = m_block_range(n); out[m, 2:4] = (first_key_block(m),
    last_key_block(m)), the key blocks whose range holds query block m (deterministic turns)."""
    info = BlockInfo(tile_m, tile_n, causal, local, window_left, window_right)
    for n in cutlass.range((seqlen_k + tile_n - 1) // tile_n, unroll=1):
        m_min, m_max = info.m_block_range(seqlen_q, seqlen_k, n)
        out[n, 0] = m_min
        out[n, 1] = m_max
    for m in cutlass.range((seqlen_q + tile_m - 1) // tile_m, unroll=1):
        out[m, 2] = info.first_key_block(seqlen_q, seqlen_k, m)
        out[m, 3] = info.last_key_block(seqlen_q, seqlen_k, m)


BWD_TILES = [(64, 128), (64, 64), (128, 128)]


@pytest.mark.parametrize("tile_m,tile_n", BWD_TILES, ids=[f"{m}x{n}" for m, n in BWD_TILES])
@pytest.mark.parametrize("mask,left,right", MASKS, ids=[f"{m}{l},{r}" for m, l, r in MASKS])
def test_backward_block_ranges_and_turns(tile_m, tile_n, mask, left, right):
    """Each key block visits every query block whose rows see one of its keys (m_block_range),
    and the key blocks visiting a query block are exactly [first_key_block, last_key_block],
    consecutive: the deterministic backward numbers its turns from either end."""
    causal, local = mask == "causal", mask == "local"
    out = torch.zeros(64, 4, dtype=torch.int32)
    compiled = cute.compile(backward_geometry, _to_cute(out, 4), Int32(0), Int32(0), Int32(0),
                            Int32(0), tile_m, tile_n, causal, local)
    for sq, sk in LENGTHS:
        out.fill_(-7)
        compiled(_to_cute(out, 4), Int32(sq), Int32(sk),
                 Int32(_UNBOUNDED if left < 0 else left), Int32(_UNBOUNDED if right < 0 else right))
        ok = visible(sq, sk, causal, left, right)
        n_blocks, m_blocks = (sk + tile_n - 1) // tile_n, (sq + tile_m - 1) // tile_m
        visits = {m: [] for m in range(m_blocks)}
        for n in range(n_blocks):
            m_min, m_max = out[n, 0].item(), out[n, 1].item()
            cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
            for m in range(m_blocks):
                rows = slice(m * tile_m, min((m + 1) * tile_m, sq))
                if ok[rows, cols].any():
                    assert m_min <= m < m_max, f"sq={sq} sk={sk} n={n} m={m}: visible but skipped"
                if m_min <= m < m_max:
                    visits[m].append(n)
        for m, ns in visits.items():
            if not ns:
                continue
            where = f"sq={sq} sk={sk} m_block={m}"
            assert ns == list(range(ns[0], ns[-1] + 1)), f"{where}: visiting key blocks {ns} not consecutive"
            assert (out[m, 2].item(), out[m, 3].item()) == (ns[0], ns[-1]), \
                f"{where}: turns from {out[m, 2].item()}..{out[m, 3].item()}, visitors {ns[0]}..{ns[-1]}"
