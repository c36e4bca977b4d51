"""GPU fp8 (e4m3) forward on sm_90a: flash_attn_func with FlashAttention-3's descales, against the
float32 reference on the dequantized inputs, with FlashAttention's rule whose low-precision side is
a plain PyTorch fp8 computation (the scores from the GPU's own fp8 GEMM, torch._scaled_mm with
its fast accumulation, probabilities rounded to e4m3 before P V: testing.fp8_attention_emulated),
for the output and the LSE alike, never a loosened constant.

strict=True (a call the kernel does not serve fails), outputs NaN-poisoned (out= / lse=). Covers
head dims 64-256, every mask kind, GQA and MQA, odd lengths, random per-(batch, kv head) descales,
missing descales, large-magnitude inputs (no inf/NaN when the descales are right), an fp16 out=.
"""
import pytest
import torch

from cuteattn import flash_attn_func
from cuteattn.reference import attention_ref, dequantize_fp8
from cuteattn.testing import assert_close_fa, assert_lse_close_fa, fp8_attention_emulated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (the fp8 forward is Hopper's)")]

E4M3 = torch.float8_e4m3fn
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(300, 100)),
         "softcap": dict(softcap=20.0)}


def fp8_inputs(b, sq, sk, h, hk, d, magnitude=2.0, descales=True):
    """Random fp8 q, k, v (values of about `magnitude`) and (b, hk) descales in [0.5, 1.5)."""
    make = lambda s, heads: (torch.randn(b, s, heads, d, device="cuda") * magnitude).clamp(
        -448, 448).to(E4M3)  # (e4m3's range: torch turns values past it into NaN)
    q, k, v = make(sq, h), make(sk, hk), make(sk, hk)
    ds = tuple(torch.rand(b, hk, device="cuda") + 0.5 if descales else None for _ in range(3))
    return q, k, v, ds


def check(q, k, v, ds, out_dtype=torch.bfloat16, **kw):
    b, sq, h, d = q.shape
    out = torch.full((b, sq, h, d), float("nan"), device="cuda", dtype=out_dtype)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    got, got_lse = flash_attn_func(q, k, v, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                   return_lse=True, strict=True, out=out, lse=lse, **kw)
    assert got is out and got_lse is lse
    ref, ref_lse = attention_ref(*(dequantize_fp8(x, s) for x, s in zip((q, k, v), ds)), **kw)
    emulated, emulated_lse = fp8_attention_emulated(q, k, v, ds, **kw)
    assert_close_fa(out.float(), ref, emulated)
    assert_lse_close_fa(lse, ref_lse, emulated_lse)


CASES = [(d, m) for d in (64, 96, 128, 192, 256) for m in MASKS]
SEQLENS = [(1000, 1000), (700, 1100), (129, 65), (1, 300), (2048, 2048)]


@pytest.mark.parametrize("d,mask", CASES, ids=[f"d{d}-{m}" for d, m in CASES])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_fp8_forward(seed, d, mask, sq, sk):
    q, k, v, ds = fp8_inputs(2, sq, sk, 8, 2, d)
    check(q, k, v, ds, **MASKS[mask])


@pytest.mark.parametrize("h,hk", [(8, 8), (8, 1)], ids=["mha", "mqa"])
def test_fp8_head_ratios(seed, h, hk):
    q, k, v, ds = fp8_inputs(2, 513, 777, h, hk, 128)
    check(q, k, v, ds, causal=True)


def test_fp8_without_descales(seed):
    """A missing descale means 1.0."""
    q, k, v, ds = fp8_inputs(1, 300, 300, 4, 2, 128, descales=False)
    check(q, k, v, ds)


def test_fp8_repeated_call_returns_bf16(seed):
    """The second call with one signature takes the launch shortcut: its output is still bf16
    (it once allocated out in q's dtype, fp8)."""
    q, k, v, _ = fp8_inputs(1, 300, 300, 4, 2, 128, descales=False)
    first, second = flash_attn_func(q, k, v), flash_attn_func(q, k, v)
    assert first.dtype == second.dtype == torch.bfloat16 and torch.equal(first, second)


def test_fp8_large_magnitudes(seed):
    """Values near e4m3's top (448) with small descales: scores stay finite (the descales enter
    the float32 scale, not the fp8 values)."""
    q, k, v, _ = fp8_inputs(1, 400, 400, 4, 2, 128, magnitude=150.0)
    ds = tuple(torch.full((1, 2), 0.01, device="cuda") for _ in range(3))
    check(q, k, v, ds, causal=True)


def test_fp8_fp16_out(seed):
    """An fp16 out= buffer is written (the kernel's bf16 result converted)."""
    q, k, v, ds = fp8_inputs(1, 257, 257, 4, 2, 64)
    check(q, k, v, ds, out_dtype=torch.float16)


def test_fp8_varlen_declines_strict(seed):
    """Packed fp8 sequences have no kernel yet: strict mode names it (the default path serves
    them on the reference)."""
    from cuteattn import flash_attn_varlen_func
    q, k, v, ds = fp8_inputs(1, 256, 256, 4, 2, 64)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="fp8 with packed sequences"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 156, 156, strict=True)


@pytest.mark.parametrize("b,s,hk,dv", [(1, 1, 1, 64), (2, 37, 3, 128), (1, 1000, 2, 256),
                                       (3, 64, 4, 128), (1, 4097, 8, 64)])
def test_value_transpose_kernel_matches_torch(seed, b, s, hk, dv):
    """fp8_value.py's kernel writes exactly what the PyTorch gather writes: every byte, the key
    order, the zero keys past the end; also from a strided view (a packed kv tensor's v)."""
    from cuteattn.kernels.sm90.launch import fp8_value_operand, fp8_value_operand_torch
    kv = (torch.randn(b, s, 2, hk, dv, device="cuda") * 3).clamp(-448, 448).to(E4M3)
    for v in (kv[:, :, 1].contiguous(), kv[:, :, 1]):
        assert torch.equal(fp8_value_operand(v), fp8_value_operand_torch(v))
