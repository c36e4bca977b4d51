"""The packed varlen tile order (common/tile_scheduler.varlen_tile_coord) on the GPU: it needs
warp shuffles, which the CPU's host JIT cannot run (tests/test_tile_order.py covers the
fixed-length order on the CPU). One warp per tile index maps it to (query block, sequence);
the result must be exactly the enumeration the kernel relies on: every block of every sequence
once, in sequence order, its blocks reversed when `reverse`, spare tiles past the end, and
lengths clamped as common/seqlen_info.sequence_range clamps them (bad metadata included).
"""
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from cuteattn.kernels.common.tile_scheduler import varlen_tile_coord  # noqa: E402
from cuteattn.kernels.launch_common import to_cute as _to_cute  # noqa: E402

TILE_M = 128


@cute.kernel
def _coords_kernel(out: cute.Tensor, cu: cute.Tensor, batch: Int32, total: Int32,
                   reverse: cutlass.Constexpr):
    tile = cute.arch.block_idx()[0]
    m_block, batch_idx = varlen_tile_coord(tile, cu, None, batch, total, TILE_M, reverse)
    if cute.arch.lane_idx() == 0:
        out[tile, 0] = m_block
        out[tile, 1] = batch_idx


@cute.jit
def coords(out: cute.Tensor, cu: cute.Tensor, batch: Int32, total: Int32, tiles: Int32,
           reverse: cutlass.Constexpr):
    _coords_kernel(out, cu, batch, total, reverse).launch(grid=[tiles, 1, 1], block=[32, 1, 1])


def expected(cu, total, reverse, tiles):
    rows = []
    for b in range(len(cu) - 1):
        start = min(max(cu[b], 0), total)
        length = min(max(cu[b + 1], start), total) - start
        n = -(-length // TILE_M)
        rows += [((n - 1 - m) if reverse else m, b) for m in range(n)]
    rows = rows[:tiles]
    return rows + [(None, len(cu) - 1)] * (tiles - len(rows))


def lengths_to_cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


CASES = {
    "skewed": lengths_to_cu([4096, 512, 3072, 1, 1024, 700, 2560, 0, 1536]),
    "empties": lengths_to_cu([0, 1, 63, 0, 129, 700]),
    "many": lengths_to_cu([random.Random(1).randint(0, 300) for _ in range(77)]),  # 3 chunks of 32
    "past_total": [0, 4, 20],
    "negative_start": [-8, 4, 12],
    "decreasing": [0, 8, 4, 12],
}


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_tile_order(name, reverse):
    cu = CASES[name]
    total = 12 if name in ("past_total", "negative_start", "decreasing") else cu[-1]
    batch = len(cu) - 1
    tiles = -(-total // TILE_M) + batch  # the kernel's grid bound (fwd.py)
    out = torch.full((tiles, 2), -7, dtype=torch.int32, device="cuda")
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    fn = cute.compile(coords, _to_cute(out, 4), _to_cute(cu_t, 4), Int32(batch), Int32(total),
                      Int32(tiles), reverse)
    fn(_to_cute(out, 4), _to_cute(cu_t, 4), Int32(batch), Int32(total), Int32(tiles))
    got = [tuple(r) for r in out.cpu().tolist()]
    want = expected(cu, total, reverse, tiles)
    for t, (g, w) in enumerate(zip(got, want)):
        if w[0] is None:  # a spare tile: only "past the last sequence" matters
            assert g[1] == batch, f"tile {t}: {g}, expected a spare tile"
        else:
            assert g == w, f"tile {t}: {g}, expected {w}"
