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
from cuteattn.testing import (assert_close_fa, assert_lse_close_fa, fp8_attention_emulated,
                              rising_row_maxima_qk)

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
# (2048 queries: the last of d=128's short tiles; 2300: past every short-tile bound, ragged)
SEQLENS = [(1000, 1000), (700, 1100), (129, 65), (1, 300), (2048, 2048), (2300, 2600)]


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


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_fp8_rising_row_maxima(seed, d, causal):
    """Scores that climb along the keys, in steps of 0.7-1.3 (exp2 units) and jumps far past
    them now and then, each row at its own rate: the row max moves in most blocks, so O's
    rescale and P's offset change block to block (e4m3 P relative to each block's max)."""
    # steps of 0.5-0.93 every 97 keys (0.7-1.3 in exp2 units), jumps of 9.4-17 every 701
    q, k = rising_row_maxima_qk(2, 2111, 4, d, step=1.0, k_max=448.0)
    v = torch.randn_like(k)
    check(*(x.to(E4M3) for x in (q, k, v)), (None, None, None), causal=causal)


def test_fp8_fp16_out(seed):
    """An fp16 out= buffer is written (the kernel's bf16 result converted)."""
    q, k, v, ds = fp8_inputs(1, 257, 257, 4, 2, 64)
    check(q, k, v, ds, out_dtype=torch.float16)


@pytest.mark.parametrize("b,s,hk,dv", [(1, 1, 1, 64), (2, 37, 3, 128), (1, 1000, 2, 256),
                                       (3, 64, 4, 128), (1, 4097, 8, 64), (2, 300, 3, 96),
                                       (1, 129, 2, 192)])
def test_value_transpose_kernel_matches_torch(seed, b, s, hk, dv):
    """fp8_value.py's kernel writes exactly what the PyTorch gather writes: every byte, the key
    order, the zero keys past the end; also from a strided view (a packed kv tensor's v)."""
    from cuteattn.kernels.sm90.launch import fp8_value_operand, fp8_value_operand_torch
    kv = (torch.randn(b, s, 2, hk, dv, device="cuda") * 3).clamp(-448, 448).to(E4M3)
    for v in (kv[:, :, 1].contiguous(), kv[:, :, 1]):
        got, cu_v = fp8_value_operand(v)
        assert cu_v is None and torch.equal(got, fp8_value_operand_torch(v)[0])


@pytest.mark.parametrize("lens", [[5, 0, 16, 33], [1000, 1, 0, 257, 64], [0, 0]],
                         ids=["small", "mixed", "empty"])
def test_value_transpose_kernel_packed(seed, lens):
    """Packed sequences: the kernel's V^T and sequence starts equal the PyTorch reference's."""
    from cuteattn.kernels.sm90.launch import fp8_value_operand, fp8_value_operand_torch
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    v = (torch.randn(max(sum(lens), 1), 4, 128, device="cuda") * 3).clamp(-448, 448).to(E4M3)
    got, got_cu = fp8_value_operand(v, cu, max(lens))
    want, want_cu = fp8_value_operand_torch(v, cu)
    assert torch.equal(got_cu, want_cu) and torch.equal(got, want)
    # a max_seqlen_k below the longest sequence only shrinks the grid (grid-stride loop)
    got, got_cu = fp8_value_operand(v, cu, 1)
    assert torch.equal(got_cu, want_cu) and torch.equal(got, want)


VARLEN_MASKS = ["none", "causal", "window"]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", VARLEN_MASKS)
def test_fp8_varlen(seed, d, mask):
    """Packed fp8 sequences (empty ones, odd lengths, q and k lengths differing), against the
    batched check of each sequence on its own."""
    check_varlen(d, mask)


def check_varlen(d, mask):
    from cuteattn import flash_attn_varlen_func
    lens_q, lens_k = [0, 1, 63, 0, 129, 700], [5, 0, 63, 129, 1, 700]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda")
    q, k, v, _ = fp8_inputs(1, sum(lens_q), sum(lens_k), 8, 2, d, descales=False)
    q, k, v = q[0], k[0], v[0]  # packed (total, heads, d)
    ds = tuple(torch.rand(len(lens_q), 2, device="cuda") + 0.5 for _ in range(3))
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                      q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                      return_lse=True, strict=True, **MASKS[mask])
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        oq, ok = sum(lens_q[:b]), sum(lens_k[:b])
        one = (q[oq:oq + sq][None], k[ok:ok + sk][None], v[ok:ok + sk][None])
        sds = tuple(x[b:b + 1] for x in ds)
        ref, ref_lse = attention_ref(*(dequantize_fp8(x, s) for x, s in zip(one, sds)), **MASKS[mask])
        emulated, emulated_lse = fp8_attention_emulated(*one, sds, **MASKS[mask])
        assert_close_fa(out[oq:oq + sq][None].float(), ref, emulated)
        assert_lse_close_fa(lse[:, oq:oq + sq][None], ref_lse, emulated_lse)


def test_fp8_one_side_packed_and_seqused(seed):
    """Packed q with batched k/v, and batched q/k/v with seqused_k only."""
    from cuteattn import flash_attn_varlen_func
    q, k, v, ds = fp8_inputs(2, 200, 300, 8, 2, 128)
    cu_q = torch.tensor([0, 200, 400], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q.reshape(400, 8, 128), k, v, cu_q, None, 200, 300, causal=True,
                                 q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], strict=True)
    ref, _ = attention_ref(*(dequantize_fp8(x, s) for x, s in zip((q, k, v), ds)), causal=True)
    emulated, _ = fp8_attention_emulated(q, k, v, ds, causal=True)
    assert_close_fa(out.view(2, 200, 8, 128).float(), ref, emulated)
    used = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, None, None, 200, 300, seqused_k=used,
                                 q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], strict=True)
    for b, n in enumerate(used.tolist()):
        one = (q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
        sds = tuple(x[b:b + 1] for x in ds)
        ref, _ = attention_ref(*(dequantize_fp8(x, s) for x, s in zip(one, sds)))
        emulated, _ = fp8_attention_emulated(*one, sds)
        assert_close_fa(out[b:b + 1].float(), ref, emulated)


@pytest.mark.parametrize("sq", [200, 1500])  # (both take the pass over V with seqused_k)
@pytest.mark.parametrize("form", ["batched", "packed"])
def test_fp8_seqused_k_past_the_end_holds_nan(seed, form, sq):
    """k / v past seqused_k hold NaN bytes (memory the call does not own): they never reach out
    (the pass's V^T has those keys zeroed, launch.zero_value_keys_past)."""
    from cuteattn import flash_attn_varlen_func
    q, k, v, ds = fp8_inputs(2, sq, 300, 8, 2, 128)
    used = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    clean_k, clean_v = k.clone(), v.clone()
    for t in (k, v):
        t.view(torch.uint8)[1, 17:] = 0x7F  # (e4m3's NaN)
    if form == "batched":
        out = flash_attn_varlen_func(q, k, v, None, None, sq, 300, seqused_k=used, causal=True,
                                     q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], strict=True)
    else:
        cu = lambda s: torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")
        out = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(sq),
                                     cu(300), sq, 300, seqused_k=used, causal=True,
                                     q_descale=ds[0], k_descale=ds[1], v_descale=ds[2],
                                     strict=True).view(2, sq, 8, 128)
    for b, n in enumerate(used.tolist()):
        one = (q[b:b + 1], clean_k[b:b + 1, :n], clean_v[b:b + 1, :n])
        sds = tuple(x[b:b + 1] for x in ds)
        ref, _ = attention_ref(*(dequantize_fp8(x, s) for x, s in zip(one, sds)), causal=True)
        emulated, _ = fp8_attention_emulated(*one, sds, causal=True)
        assert_close_fa(out[b:b + 1].float(), ref, emulated)


# ---- where V is transposed: inside the kernel up to FP8_V_IN_KERNEL_MAX_SEQLEN_Q queries (the
# cases above), by a pass over HBM before it for longer ones ----

def test_fp8_long_queries_take_the_pass_over_hbm(seed):
    """Past the in-kernel transpose's query bound, V^T comes from fp8_value's pass."""
    from cuteattn.kernels.sm90 import config, launch
    from cuteattn.spec import AttentionSpec
    sq = config.FP8_V_IN_KERNEL_MAX_SEQLEN_Q + 131
    spec = AttentionSpec(dtype=E4M3, head_dim=128, head_dim_v=128, causal=True, local=False,
                         has_softcap=False, varlen_q=False, varlen_k=False, seqlen_q=sq,
                         seqlen_k=sq, softmax_scale=128 ** -0.5)
    assert not launch.sm90_config(spec).fp8_v_in_kernel
    q, k, v, ds = fp8_inputs(1, sq, sq, 4, 1, 128)
    check(q, k, v, ds, causal=True)


def test_fp8_several_tiles_a_cta_and_mqa(seed):
    """Several tiles a CTA (the rings' phases over tiles, V's staging ring included), causal
    tiles from the counter, MQA."""
    q, k, v, ds = fp8_inputs(4, 1024, 1024, 16, 1, 128)  # (512 tiles: several a CTA)
    for _ in range(2):
        check(q, k, v, ds, causal=True)
