"""The fixed-length tile order (kernels/common/tile_scheduler.fixed_tile_coord), run on the CPU
through the DSL's host JIT: every (query block, head, batch) is visited exactly once, whatever
the L2 group size (including a short last group), and causal tiles go longest first within a
group. A tile visited twice or never is a silent wrong answer that small GPU test shapes (one
group) would not reach.
"""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from cuteattn.dispatch import _to_cute, l2_group  # noqa: E402
from cuteattn.kernels.common.tile_scheduler import fixed_tile_coord  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402


@cute.jit
def tile_order(out: cute.Tensor, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
               group: Int32, lpt: cutlass.Constexpr):
    for t in cutlass.range(num_m_blocks * num_heads * batch, unroll=1):
        m, h, b = fixed_tile_coord(t, num_m_blocks, num_heads, batch, group, lpt)
        out[t, 0] = m
        out[t, 1] = h
        out[t, 2] = b


def run(num_m, heads, batch, group, lpt):
    out = torch.full((num_m * heads * batch, 3), -1, dtype=torch.int32)
    fn = cute.compile(tile_order, _to_cute(out, 4), Int32(1), Int32(1), Int32(1), Int32(1), lpt)
    fn(_to_cute(out, 4), Int32(num_m), Int32(heads), Int32(batch), Int32(group))
    return out


SHAPES = [(1, 1, 1, 1), (8, 16, 16, 50), (32, 16, 4, 12), (7, 3, 5, 4), (5, 4, 3, 100), (9, 6, 1, 6)]


@pytest.mark.parametrize("lpt", [False, True], ids=["query-block-fastest", "lpt"])
@pytest.mark.parametrize("num_m,heads,batch,group", SHAPES)
def test_every_tile_once(num_m, heads, batch, group, lpt):
    out = run(num_m, heads, batch, group, lpt)
    seen = {tuple(row) for row in out.tolist()}
    assert len(seen) == out.shape[0], "a tile is visited twice"
    assert seen == {(m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch)}


@pytest.mark.parametrize("num_m,heads,batch,group", SHAPES)
def test_lpt_groups_longest_first(num_m, heads, batch, group):
    out = run(num_m, heads, batch, group, True).tolist()
    pairs = heads * batch
    start = 0
    for first_pair in range(0, pairs, group):
        n = min(group, pairs - first_pair) * num_m
        chunk = out[start:start + n]
        # this group holds exactly its pairs, each with every query block
        assert {b * heads + h for _, h, b in chunk} == set(range(first_pair, first_pair + n // num_m))
        ms = [m for m, _, _ in chunk]
        assert ms == sorted(ms, reverse=True), "query blocks must go from last to first"
        start += n


def test_l2_group_fits_half_the_cache_in_whole_gqa_groups():
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=True,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         batch=4, seqlen_q=4096, seqlen_k=4096, nheads=32, nheads_k=8)
    # 4096 keys x (128 + 128) x 2 bytes = 2 MiB per KV head; half of 50 MiB holds 12 of them
    assert l2_group(spec) == 12 * 4
    long = AttentionSpec(**{**spec.__dict__, "seqlen_k": 1 << 22})
    assert l2_group(long) == 4  # at least one KV head (with its GQA group)
