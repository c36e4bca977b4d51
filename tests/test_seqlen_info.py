"""The sequence geometry every kernel reads metadata through (common/seqlen_info.py), run on
the CPU through the DSL's host JIT: whatever cu_seqlens and seqused hold, a sequence's rows
stay inside the tensor (the memory-safety guarantee of the kernels rests on this one function).
"""
import random

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from cuteattn.kernels.common.seqlen_info import sequence_range  # noqa: E402
from cuteattn.kernels.launch_common import to_cute as _to_cute  # noqa: E402


@cute.jit
def ranges(out: cute.Tensor, cu: cute.Tensor, used: cute.Tensor, total: Int32, batch: Int32,
           with_cu: cutlass.Constexpr, with_used: cutlass.Constexpr):
    for b in cutlass.range(batch, unroll=1):
        offset, length = sequence_range(b, total, cu if with_cu else None,
                                        used if with_used else None)
        out[b, 0] = offset
        out[b, 1] = length


def expected(cu, used, total, batch):
    """The documented rule: start in [0, total], end in [start, total], seqused in
    [0, total - start]; without cu_seqlens a fixed length `total`."""
    rows = []
    for b in range(batch):
        start, length = 0, total
        if cu is not None:
            start = min(max(cu[b], 0), total)
            length = min(max(cu[b + 1], start), total) - start
        if used is not None:
            length = min(max(used[b], 0), total - start)
        rows.append((start, length))
    return rows


CASES = [  # (cu_seqlens or None, seqused or None, total rows)
    ([0, 3, 8], None, 8),                       # good
    ([0, 4, 20], None, 12),                     # the end past the total
    ([0, 4, 4000], None, 12),
    ([-8, 4, 12], None, 12),                    # a negative start
    ([0, 8, 4, 12], None, 12),                  # decreasing
    ([-(2 ** 31) + 1, 0, 2 ** 31 - 1], None, 12),
    ([0, 5, 12], [7, -3], 12),                  # seqused past the sequence, negative
    ([0, 5, 12], [2 ** 30, 2 ** 31 - 1], 12),
    (None, [3, -1, 100, 0], 64),                # fixed length with seqused
]


@pytest.mark.parametrize("cu,used,total", CASES, ids=[str(i) for i in range(len(CASES))])
def test_sequence_range_stays_inside_the_tensor(cu, used, total):
    batch = len(cu) - 1 if cu is not None else len(used)
    out = torch.full((batch, 2), -7, dtype=torch.int32)
    cu_t = torch.tensor(cu if cu is not None else [0], dtype=torch.int32)
    used_t = torch.tensor(used if used is not None else [0], dtype=torch.int32)
    fn = cute.compile(ranges, _to_cute(out, 4), _to_cute(cu_t, 4), _to_cute(used_t, 4),
                      Int32(total), Int32(batch), cu is not None, used is not None)
    fn(_to_cute(out, 4), _to_cute(cu_t, 4), _to_cute(used_t, 4), Int32(total), Int32(batch))
    got = [tuple(r) for r in out.tolist()]
    assert got == expected(cu, used, total, batch)
    for start, length in got:  # the guarantee itself, independent of the formula
        assert 0 <= start <= total and 0 <= length and start + length <= total


def test_sequence_range_random_metadata():
    rng = random.Random(0)
    out = torch.zeros(9, 2, dtype=torch.int32)
    cu_t = torch.zeros(10, dtype=torch.int32)
    used_t = torch.zeros(9, dtype=torch.int32)
    fn = cute.compile(ranges, _to_cute(out, 4), _to_cute(cu_t, 4), _to_cute(used_t, 4),
                      Int32(0), Int32(9), True, True)
    for _ in range(200):
        total = rng.randint(0, 300)
        cu = [rng.randint(-400, 400) for _ in range(10)]
        used = [rng.randint(-400, 400) for _ in range(9)]
        cu_t.copy_(torch.tensor(cu))
        used_t.copy_(torch.tensor(used))
        fn(_to_cute(out, 4), _to_cute(cu_t, 4), _to_cute(used_t, 4), Int32(total), Int32(9))
        assert [tuple(r) for r in out.tolist()] == expected(cu, used, total, 9)
