"""GPU: the KV-cache update kernel (kernels/common/kv_append.py, one launch) against the PyTorch
steps it replaces (kvcache.append_and_rotate_torch), on clones of the same caches: every byte of
both caches (so nothing outside the new tokens' slots changes), the rotated q and the used
lengths, all bit for bit. Rotation is float32 in both, each product rounded on its own (the
kernel's products are mul.rn, which ptxas does not fuse into an fma with the sum).
Covers contiguous, paged (shuffled pages) and cache_batch_idx caches; no rotary, GPT-J and
GPT-NeoX rotary (partial rotary dims, float32 and bf16 cos/sin, positional or not); fp8 caches
(e4m3, e5m2, with and without descales); several new tokens, q rows without new tokens.
"""
import pytest
import torch

from cuteattn.kvcache import append_and_rotate, append_and_rotate_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CASES = [  # (dtype, d, layout, rotary, rotary dim, cos dtype, positional, cache dtype, descales, sq, s_new)
    (torch.bfloat16, 128, "contiguous", None, 0, None, False, None, False, 1, 1),
    (torch.bfloat16, 128, "paged", "interleaved", 128, torch.float32, True, None, False, 1, 1),
    (torch.float16, 64, "batch_idx", "neox", 32, torch.float16, False, None, False, 4, 3),
    (torch.bfloat16, 256, "paged", "neox", 128, torch.bfloat16, True, None, False, 2, 5),
    (torch.bfloat16, 128, "contiguous", "interleaved", 64, torch.float32, True, None, False, 3, 0),
    (torch.bfloat16, 128, "paged", None, 0, None, False, E4M3, True, 1, 1),
    (torch.bfloat16, 128, "contiguous", "neox", 128, torch.float32, True, E5M2, True, 1, 2),
    (torch.float16, 64, "batch_idx", None, 0, None, False, E4M3, False, 1, 4),
    # ~1.8e5 rotated fp16 values: a fused multiply-add would differ in the last place in a few
    (torch.float16, 128, "contiguous", "neox", 128, torch.float32, True, None, False, 48, 48),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_kv_append_kernel_matches_torch_steps(seed, case):
    dtype, d, layout, rotary, rd, cos_dtype, positional, cache_dtype, descales, sq, s_new = case
    if cache_dtype is not None and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an fp8 cache needs sm_89 (its conversions)")
    b, h, hk, page, cap = 3, 8, 2, 16, 96
    lens = torch.tensor([0, 37, cap - s_new], dtype=torch.int32, device="cuda")
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s_new, hk, d, device="cuda", dtype=dtype) if s_new else None
    v = torch.randn(b, s_new, hk, d, device="cuda", dtype=dtype) if s_new else None
    stored = cache_dtype or dtype
    batch_idx = table = None
    if layout == "paged":
        pages = b * cap // page + 3
        table = torch.randperm(pages, device="cuda")[: b * cap // page].view(b, -1).int()
        shape = (pages, page, hk, d)
    else:
        shape = (b + 2, cap, hk, d)
        if layout == "batch_idx":
            batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    k_cache = (torch.randn(shape, device="cuda") * 2).to(stored)
    v_cache = (torch.randn(shape, device="cuda") * 2).to(stored)
    cos = sin = None
    if rotary:
        angles = torch.rand(cap + 8, rd // 2, device="cuda") * 6.28
        cos, sin = angles.cos().to(cos_dtype), angles.sin().to(cos_dtype)
    ds = (torch.rand(b, hk, device="cuda") + 0.5, torch.rand(b, hk, device="cuda") + 0.5) \
        if descales else (None, None)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    results = [fn(q, kc, vc, k, v, cos, sin, lens, batch_idx, table, positional,
                  rotary == "interleaved", cap, ds)
               for fn, (kc, vc) in zip((append_and_rotate, append_and_rotate_torch), caches)]
    (q_got, used_got), (q_want, used_want) = results
    assert torch.equal(used_got, used_want)
    if rotary:
        assert q_got is not q
        assert torch.equal(q_got, q_want)
    else:
        assert q_got is q
    for got, want in zip(caches[0], caches[1]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
