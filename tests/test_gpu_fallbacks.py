"""On the GPU, the forms no kernel serves yet run on the reference with CUDA tensors: a
FallbackWarning names the reason (strict mode raises it), and the result equals the same call
on the CPU. Catches device slips in the reference paths (an index tensor made on the CPU)."""
import dataclasses
import warnings

import pytest
import torch

import cuteattn
from cuteattn import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, sparse)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BF16 = torch.bfloat16
DEVICE = "cuda"  # (the cases' own logic can be tried on the CPU by setting "cpu")


def on(device, tensors):
    """The call's tensors on device (a block-sparse mask's too: its metadata must be on q's)."""
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device, copy=True)
        if isinstance(x, sparse.BlockSparseMask):
            return dataclasses.replace(x, **{f.name: move(getattr(x, f.name)) for f in dataclasses.fields(x)
                                             if isinstance(getattr(x, f.name), torch.Tensor)})
        return x
    return {n: move(t) for n, t in tensors.items()}


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def fixed(d=64, dv=64, sq=37, sk=41):
    return dict(q=torch.randn(2, sq, 4, d, dtype=BF16), k=torch.randn(2, sk, 2, d, dtype=BF16),
                v=torch.randn(2, sk, 2, dv, dtype=BF16))


def fp8_call():
    """fp8 at a head dim the fp8 kernel has no width for (its other forms: tests/test_gpu_fp8.py)."""
    t = {n: x.to(torch.float8_e4m3fn) for n, x in fixed(d=80, dv=80).items()}
    return dict(t, q_descale=torch.rand(2, 2) + 0.5, k_descale=torch.rand(2, 2) + 0.5,
                v_descale=torch.rand(2, 2) + 0.5)


CASES = {
    "head_dim_v 128 over 64": (flash_attn_func, lambda: fixed(d=64, dv=128), "head_dim_v 128 > head_dim 64"),
    # (sinks run on the sm90 kernels, tests/test_gpu_sinks.py; with block-sparse lists not yet)
    "sink with lists": (flash_attn_func, lambda: dict(
        fixed(sq=64, sk=64), learnable_sink=torch.randn(4),
        block_sparse=sparse.from_topk(torch.tensor([[[[0]]]]), 1, 128, 128)), "learnable sink"),
    "fp8 at head_dim 80": (flash_attn_func, fp8_call, "fp8 at head_dim 80"),
    # (a torch method on an index: the DSL's integers have none, so the kernel cannot trace it)
    "mask_mod": (flash_attn_func, lambda: dict(fixed(), mask_mod=lambda b, h, i, j: (i - j).abs() < 5),
                 "could not be traced"),
    "block sparse": (flash_attn_func, lambda: dict(fixed(sq=64, sk=64), block_sparse=sparse.from_topk(
        torch.tensor([[[[0], [1]]]]), 2, 32, 32)), "block-sparse blocks of 32x32"),
    # (pages wider than a key block and not whole blocks go to the portable kernel, which has
    # no d=80; pages of 16 at d=80 are the sm90 forward's, padded to 128 columns)
    "paged prefill, head_dim 80": (flash_attn_varlen_func, lambda: dict(
        q=torch.randn(12, 4, 80, dtype=BF16), k=torch.randn(5, 240, 2, 80, dtype=BF16),
        v=torch.randn(5, 240, 2, 80, dtype=BF16), cu_seqlens_q=cu([4, 8]),
        cu_seqlens_k=cu([20, 9]), max_seqlen_q=8, max_seqlen_k=20,
        block_table=torch.tensor([[3], [4]], dtype=torch.int32)), "head_dim 80"),
    "kv cache, head_dim 80": (flash_attn_with_kvcache, lambda: dict(
        q=torch.randn(2, 1, 4, 80, dtype=BF16), k_cache=torch.randn(2, 32, 2, 80, dtype=BF16),
        v_cache=torch.randn(2, 32, 2, 80, dtype=BF16), k=torch.randn(2, 1, 2, 80, dtype=BF16),
        v=torch.randn(2, 1, 2, 80, dtype=BF16), cache_seqlens=torch.tensor([3, 30], dtype=torch.int32),
        causal=True), "decode kernel"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_fallback_on_cuda_tensors(seed, name):
    fn, make, reason = CASES[name]
    args = make()
    cpu_args = on("cpu", args)  # (copies of the CPU tensors: the call may write into its own)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = fn(**on(DEVICE, args))
    if DEVICE == "cuda":
        assert any(issubclass(w.category, cuteattn.FallbackWarning) and reason in str(w.message)
                   for w in seen), [str(w.message) for w in seen]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = fn(**on("cpu", cpu_args))
    assert got.device.type == DEVICE
    assert torch.allclose(got.float().cpu(), want.float(), atol=2e-2), name
    with pytest.raises(RuntimeError, match="strict"):
        fn(**on(DEVICE, make()), strict=True)
