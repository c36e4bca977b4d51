"""FlashAttention's packed entry points (CPU, reference path): the same results as the unpacked
calls on the views, gradients into the packed tensor, clear errors for a wrong packing."""

import pytest
import torch

import cuteattn
from cuteattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                      flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                      flash_attn_varlen_qkvpacked_func)


pytestmark = pytest.mark.usefixtures("quiet_fallback")


def test_top_level_names():
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                 "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "FallbackWarning"):
        assert name in cuteattn.__all__ and hasattr(cuteattn, name)
    assert isinstance(cuteattn.__version__, str) and cuteattn.__version__.count(".") == 2


def test_qkvpacked_equals_unpacked_with_gradients(seed):
    qkv = torch.randn(2, 37, 3, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, softcap=5.0, return_lse=True)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref, ref_lse = flash_attn_func(q, k, v, causal=True, softcap=5.0, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), g)
    dq, dk, dv = torch.autograd.grad(ref, (q, k, v), g)
    assert torch.equal(dqkv, torch.stack((dq, dk, dv), dim=2))


def test_kvpacked_equals_unpacked_gqa(seed):
    q = torch.randn(2, 20, 8, 64, dtype=torch.float16)
    kv = torch.randn(2, 33, 2, 2, 64, dtype=torch.float16)
    out = flash_attn_kvpacked_func(q, kv, window_size=(8, 2))
    assert torch.equal(out, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], window_size=(8, 2)))


def test_varlen_packed_equal_unpacked(seed):
    cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    qkv = torch.randn(17, 3, 4, 64, dtype=torch.bfloat16)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True)
    q, k, v = qkv.unbind(1)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=True))
    kv = torch.randn(23, 2, 2, 64, dtype=torch.bfloat16)
    cu_k = torch.tensor([0, 10, 11, 23], dtype=torch.int32)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 12, 12, return_lse=True)
    ref = flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu, cu_k, 12, 12, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_packed_return_attn_probs(seed):
    """return_attn_probs passes through to FlashAttention-2's triple (out, lse, None)."""
    qkv = torch.randn(2, 19, 3, 4, 64, dtype=torch.bfloat16)
    out, lse, probs = flash_attn_qkvpacked_func(qkv, 0.0, None, True, return_attn_probs=True)
    ref = flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
    assert probs is None and torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    flat = qkv[0]
    out, lse, probs = flash_attn_varlen_qkvpacked_func(flat, cu, 12, return_attn_probs=True)
    ref = flash_attn_varlen_qkvpacked_func(flat, cu, 12, return_lse=True)
    assert probs is None and torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


@pytest.mark.parametrize("fn,args,match", [
    (flash_attn_qkvpacked_func, (torch.randn(2, 5, 2, 4, 64),), r"qkv must have shape \(batch, seqlen, 3"),
    (flash_attn_qkvpacked_func, (torch.randn(2, 5, 4, 64),), r"qkv must have shape"),
    (flash_attn_kvpacked_func, (torch.randn(2, 5, 4, 64), torch.randn(2, 5, 3, 4, 64)), r"kv must have shape"),
    (flash_attn_varlen_qkvpacked_func, ([1, 2], torch.zeros(2, dtype=torch.int32), 1), r"qkv must be a torch.Tensor"),
])
def test_wrong_packing_is_a_clear_error(fn, args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        fn(*args)
