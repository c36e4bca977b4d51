"""The compiled kernel's signature against what dispatch hands it at run time, without a GPU.

Kernels are compiled against symbolic fake tensors (kernels/sm90/compile.py) and called with
runtime tensors built by dispatch._to_cute. If the two disagree on which extents and strides are
dynamic, the runtime values bind to the wrong symbols and the kernel reads the wrong memory (that
happened: packed k/v saw their sequence and head strides swapped). Here a host-only probe with the
kernel's argument list is compiled from the same fakes, called the way dispatch calls kernels, and
writes back the shapes and strides it received, for comparison with torch's.
"""
from typing import Optional

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int64  # noqa: E402

from cuteattn.dispatch import _to_cute  # noqa: E402
from cuteattn.kernels.sm90.compile import fake_arguments  # noqa: E402
from cuteattn.kernels.sm90.config import fwd_config  # noqa: E402


@cute.jit
def probe(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
          mCuQ: Optional[cute.Tensor], mCuK: Optional[cute.Tensor],
          mUsedQ: Optional[cute.Tensor], mUsedK: Optional[cute.Tensor], info: cute.Tensor):
    i = 0
    for t in (mQ, mK, mV, mO, mLSE):
        for m in cutlass.range_constexpr(cute.rank(t)):
            info[i] = Int64(t.shape[m])
            info[i + 1] = Int64(t.stride[m])
            i += 2
    for t in (mCuQ, mCuK, mUsedQ, mUsedK):
        if cutlass.const_expr(t is not None):
            info[i] = Int64(t.shape[0])
            info[i + 1] = Int64(t[1])
            i += 2


def expected(tensors):
    out = []
    for t in tensors[:5]:
        for n, st in zip(t.shape, t.stride()):
            out += [n, st]
    for t in tensors[5:]:
        if t is not None:
            out += [t.shape[0], int(t[1])]
    return out


def packed(total, h, d, dtype=torch.bfloat16):
    return torch.randn(total, h, d, dtype=dtype)


def qkv_views(b, s, h, d):
    """q, k, v as strided views of one packed qkv tensor, as many models produce them."""
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.bfloat16)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


@pytest.mark.parametrize("layout", ["fixed", "fixed-qkv-views", "gqa", "varlen", "varlen-seqused"])
def test_runtime_tensors_bind_to_compiled_signature(layout):
    varlen = layout.startswith("varlen")
    cfg = fwd_config(cutlass.BFloat16, 128, 128, False, False, False, varlen, varlen,
                     has_seqused_q=layout == "varlen-seqused", has_seqused_k=layout == "varlen-seqused")
    if layout == "fixed":
        q, k, v = (torch.randn(2, 96, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    elif layout == "fixed-qkv-views":
        q, k, v = qkv_views(3, 40, 4, 128)
    elif layout == "gqa":
        q = torch.randn(2, 33, 8, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 71, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    else:
        q, k, v = packed(300, 4, 128), packed(500, 2, 128), packed(500, 2, 128)
    o = torch.empty(q.shape, dtype=q.dtype)
    if varlen:
        lse = torch.empty(q.shape[1], q.shape[0])
        cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
        cu_k = torch.tensor([0, 250, 500], dtype=torch.int32)
        used = (torch.tensor([90, 7], dtype=torch.int32), torch.tensor([250, 3], dtype=torch.int32)) \
            if layout == "varlen-seqused" else (None, None)
    else:
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
        cu_q = cu_k = None
        used = (None, None)
    tensors = (q, k, v, o, lse, cu_q, cu_k, *used)
    info = torch.full((64,), -1, dtype=torch.int64)
    compiled = cute.compile(probe, *fake_arguments(cfg), _to_cute(info, 8))
    compiled(*(_to_cute(t) for t in tensors[:4]), _to_cute(lse, 4),
             *(_to_cute(t, 4) for t in tensors[5:]), _to_cute(info, 8))
    want = expected(tensors)
    assert info[: len(want)].tolist() == want
