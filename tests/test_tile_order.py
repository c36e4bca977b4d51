"""The fixed-length tile order (kernels/common/tile_scheduler.fixed_tile_coord), run on the CPU
through the DSL's host JIT: every (query block, head, batch) is visited exactly once, whatever
the L2 group size and GQA unit, the groups are balanced (no short last group), and causal tiles
go longest first within a group. A tile visited twice or never is a silent wrong answer that small GPU test shapes (one
group) would not reach.
"""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from cuteattn.kernels.launch_common import balanced_l2_groups, l2_group, to_cute as _to_cute  # noqa: E402
from cuteattn.kernels.common.tile_scheduler import fixed_tile_coord  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402


@cute.jit
def tile_order(out: cute.Tensor, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
               group_pairs: Int32, small_groups: Int32, unit: Int32, lpt: cutlass.Constexpr):
    for t in cutlass.range(num_m_blocks * num_heads * batch, unroll=1):
        m, h, b = fixed_tile_coord(t, num_m_blocks, num_heads, batch, group_pairs, small_groups,
                                   unit, lpt)
        out[t, 0] = m
        out[t, 1] = h
        out[t, 2] = b


def run(num_m, heads, batch, max_pairs, unit, lpt):
    out = torch.full((num_m * heads * batch, 3), -1, dtype=torch.int32)
    fn = cute.compile(tile_order, _to_cute(out, 4), *([Int32(1)] * 6), lpt)
    group_pairs, small_groups = balanced_l2_groups(heads * batch, max_pairs, unit)
    fn(_to_cute(out, 4), Int32(num_m), Int32(heads), Int32(batch), Int32(group_pairs),
       Int32(small_groups), Int32(unit))
    return out


# (query blocks, heads, batch, most pairs per L2 group, GQA unit): budgets that divide the
# pairs, that do not (a remainder to spread), larger than all pairs, one pair per group, and
# GQA units of 4
SHAPES = [(1, 1, 1, 1, 1), (8, 16, 16, 50, 1), (32, 16, 4, 12, 1), (7, 3, 5, 4, 1),
          (5, 4, 3, 100, 1), (9, 6, 1, 6, 1), (32, 8, 4, 6, 1), (3, 5, 1, 1, 1),
          (6, 8, 3, 12, 4), (4, 16, 1, 8, 4)]


@pytest.mark.parametrize("pairs,max_pairs,unit", [(32, 6, 1), (64, 12, 1), (16, 3, 1), (7, 3, 1),
                                                  (5, 100, 1), (48, 12, 4), (64, 8, 4), (8, 4, 4)])
def test_balanced_groups(pairs, max_pairs, unit):
    small, num_small = balanced_l2_groups(pairs, max_pairs, unit)
    units, small_units = pairs // unit, small // unit
    num_big = (units - num_small * small_units) // (small_units + 1)
    sizes = [small] * num_small + [small + unit] * num_big
    assert sum(sizes) == pairs and num_small >= 1 and small % unit == 0
    assert max(sizes) <= max(max_pairs, unit), "a group over the L2 budget"
    assert len(sizes) == -(-units // max(max_pairs // unit, 1)), "more groups than needed"
    if pairs == 32 and max_pairs == 6:  # the d=256 4k causal bench cell: not 5 x 6 + 2
        assert sizes == [5, 5, 5, 5, 6, 6]


@pytest.mark.parametrize("lpt", [False, True], ids=["query-block-fastest", "lpt"])
@pytest.mark.parametrize("num_m,heads,batch,max_pairs,unit", SHAPES)
def test_every_tile_once(num_m, heads, batch, max_pairs, unit, lpt):
    out = run(num_m, heads, batch, max_pairs, unit, lpt)
    seen = {tuple(row) for row in out.tolist()}
    assert len(seen) == out.shape[0], "a tile is visited twice"
    assert seen == {(m, h, b) for m in range(num_m) for h in range(heads) for b in range(batch)}


@pytest.mark.parametrize("num_m,heads,batch,max_pairs,unit", SHAPES)
def test_lpt_groups_longest_first(num_m, heads, batch, max_pairs, unit):
    out = run(num_m, heads, batch, max_pairs, unit, True).tolist()
    small, num_small = balanced_l2_groups(heads * batch, max_pairs, unit)
    start, first_pair = 0, 0
    while start < len(out):
        size = small if first_pair < small * num_small else small + unit
        n = size * num_m
        chunk = out[start:start + n]
        # this group holds exactly its pairs, each with every query block
        assert {b * heads + h for _, h, b in chunk} == set(range(first_pair, first_pair + size))
        ms = [m for m, _, _ in chunk]
        assert ms == sorted(ms, reverse=True), "query blocks must go from last to first"
        start += n
        first_pair += size
    assert first_pair == heads * batch


def test_l2_group_fits_half_the_cache_in_whole_gqa_groups():
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=True,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         batch=4, seqlen_q=4096, seqlen_k=4096, nheads=32, nheads_k=8)
    # 4096 keys x (128 + 128) x 2 bytes = 2 MiB per KV head; half of 50 MiB holds 12 of them
    assert l2_group(spec) == 12 * 4
    long = AttentionSpec(**{**spec.__dict__, "seqlen_k": 1 << 22})
    assert l2_group(long) == 4  # at least one KV head (with its GQA group)


def run_with(num_m, heads, batch, group_pairs, small_groups, unit, lpt=True):
    out = torch.full((num_m * heads * batch, 3), -1, dtype=torch.int32)
    fn = cute.compile(tile_order, _to_cute(out, 4), *([Int32(1)] * 6), lpt)
    fn(_to_cute(out, 4), Int32(num_m), Int32(heads), Int32(batch), Int32(group_pairs),
       Int32(small_groups), Int32(unit))
    return out


@pytest.mark.parametrize("batch,nheads,nheads_k,seqlen_q,seqlen_k", [
    (1, 32, 8, 32, 4096),     # a causal chunk of 32 tokens, GQA 4: 2 query blocks of 64 rows
    (2, 16, 2, 20, 65536),    # GQA 8, 160 rows: 3 blocks; one kv head's K/V per L2 group
    (3, 8, 4, 100, 1024),     # GQA 2
])
def test_packed_decode_grid_visits_every_tile(batch, nheads, nheads_k, seqlen_q, seqlen_k):
    """The decode kernel with pack-GQA walks (batch, kv head) pairs, its tiles holding every
    query head of one: sm80 launch_scalars must size the causal order's L2 groups in those
    pairs (sized in query heads, a chunk of 32 tokens at GQA 4 left its first 64 rows unwritten)."""
    from cuteattn.kernels.sm80 import config
    from cuteattn.kernels.sm80.launch import launch_scalars
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=True,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         has_seqused_k=True, kind="decode", batch=batch, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k, device_index=-1)
    group = config.decode_pack_group(spec, split_keys=False)
    assert group == nheads // nheads_k
    num_m = -(-seqlen_q * group // config.DECODE_TILES[128][0])
    s = launch_scalars(spec, group)
    out = run_with(num_m, nheads_k, batch, s["l2_group"], s["l2_small_groups"], 1)
    seen = {tuple(row) for row in out.tolist()}
    assert seen == {(m, h, b) for m in range(num_m) for h in range(nheads_k) for b in range(batch)}
