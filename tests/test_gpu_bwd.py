"""GPU backward (dq, dk, dv through torch autograd) against the float32 reference's autograd,
FlashAttention's rule: each gradient's max error is at most twice that of the same computation
in plain low-precision PyTorch, plus a floor.

strict=True everywhere: a case the backward kernel does not serve fails instead of passing on the
reference. The caching allocator is filled with NaN before each backward, so a gradient element
the kernels fail to write shows up as NaN.
"""
import itertools

import pytest
import torch

from cuteattn import dispatch, flash_attn_func, flash_attn_varlen_func
from cuteattn.reference import attention_ref, attention_varlen_ref
from cuteattn.testing import assert_close_fa

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 96, 128, 192, 256]  # (over 128: the split-head-dim kernel)
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA, MQA
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(64, 32)),
    "left": dict(window_size=(100, -1)),
    "right": dict(window_size=(-1, 17)),
    "softcap": dict(softcap=30.0),
    "softcap_causal": dict(softcap=5.0, causal=True),
}
SEQLENS = [(1, 1), (63, 63), (65, 129), (129, 65), (700, 700), (1, 64), (64, 1), (256, 512),
           (1031, 1031)]


def cases():
    """Every (head_dim, mask, seqlens) triple; dtype and head layout cycle over them."""
    out = []
    for (i_d, d), (i_m, mask), (i_s, sl) in itertools.product(
            enumerate(HEAD_DIMS), enumerate(MASKS), enumerate(SEQLENS)):
        out.append((DTYPES[(i_d + i_m + i_s) % 2], d, HEADS[(i_d + i_m + 2 * i_s) % 3], mask, sl))
    return out


CASES = cases()


def case_id(case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    return f"{str(dtype)[6:]}-d{d}-h{h}:{hk}-{mask}-{sq}x{sk}"


def poison_allocator():
    """Fill the allocator's free memory with NaN: the gradients' buffers are carved from it."""
    free, _ = torch.cuda.mem_get_info()
    junk = torch.full((min(free // 8, 1 << 28),), float("nan"), device="cuda")
    del junk


def reference_grads(fn, inputs, dout, **kw):
    """(float32 reference grads, low-precision grads) of fn(*inputs, **kw)[0] against dout."""
    leaves32 = [t.detach().float().requires_grad_() for t in inputs]
    out, _ = fn(*leaves32, **kw)
    out.backward(dout.float())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out_low, _ = fn(*leaves, upcast=False, **kw)
    out_low.backward(dout)
    return [t.grad for t in leaves32], [t.grad for t in leaves]


def check_grads(got, ref, low, names=("dq", "dk", "dv"), rows=None):
    for g, r, lo, name in zip(got, ref, low, names):
        assert g.dtype == lo.dtype and g.shape == r.shape, name
        if rows is not None:
            g, r, lo = g[rows], r[rows], lo[rows]
        assert_close_fa(g, r, lo, name=name)


def run_fixed(dtype, d, h, hk, sq, sk, deterministic=False, dv=None, **kw):
    b = 2
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, dv or d, device="cuda", dtype=dtype, requires_grad=True)
    out = flash_attn_func(q, k, v, deterministic=deterministic, strict=True, **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, (q, k, v), dout)
    return (q, k, v), dout, got


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bwd(seed, case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    kw = MASKS[mask]
    inputs, dout, got = run_fixed(dtype, d, h, hk, sq, sk, **kw)
    ref, low = reference_grads(attention_ref, inputs, dout, **kw)
    check_grads(got, ref, low)


def test_bwd_strided_qkv(seed):
    """q, k, v as views of one packed qkv tensor (FlashAttention's qkvpacked layout)."""
    b, s, h, d = 2, 300, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv.unbind(2)
    out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.07, strict=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    ref, low = reference_grads(attention_ref, (q, k, v), dout, causal=True, softmax_scale=0.07)
    check_grads(dqkv.unbind(2), ref, low)


DETERMINISTIC = [(128, "none", 1031, 1031), (128, "causal", 1031, 1031), (128, "window", 1031, 1031),
                 (256, "causal", 1031, 1031), (192, "window", 1031, 1031),
                 # (causal and windowed masks add in descending key-block order: unequal lengths
                 # move the diagonal, one-sided windows end the ranges on one side only)
                 (64, "causal", 700, 1031), (128, "softcap_causal", 1031, 300), (96, "left", 513, 900),
                 (64, "right", 900, 513),
                 # dQ's turns taken by the writer warp (Sm90BwdConfig.dq_writer): d=64 in 128-row
                 # steps (a box per warpgroup by rows), and 4k keys (32 key blocks a head, 64
                 # query blocks: long chains of turns on every query block); d=256 without a
                 # mask (its box beside one Q/dO stage; plain d=256 without a mask runs it too)
                 (64, "none", 2049, 2049), (128, "none", 4096, 4096), (256, "none", 1031, 1031)]


@pytest.mark.parametrize("d,mask,sq,sk", DETERMINISTIC)
def test_bwd_deterministic_is_bitwise_reproducible(seed, d, mask, sq, sk):
    """deterministic=True: five backward passes give bitwise-identical gradients (and right)."""
    kw = MASKS[mask]
    inputs, dout, first = run_fixed(torch.bfloat16, d, 8, 2, sq, sk, deterministic=True, **kw)
    q, k, v = inputs
    for _ in range(4):
        out = flash_attn_func(q, k, v, deterministic=True, strict=True, **kw)
        again = torch.autograd.grad(out, (q, k, v), dout)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    ref, low = reference_grads(attention_ref, inputs, dout, **kw)
    check_grads(first, ref, low)


def test_rows_without_keys_get_zero_gradient(seed):
    """A window that leaves some query rows without any key: their dq is 0, never NaN."""
    kw = dict(window_size=(0, 0))  # query i sees key i + (sk - sq) only: rows i < sq - sk see none
    inputs, dout, got = run_fixed(torch.bfloat16, 64, 4, 4, 300, 100, **kw)
    assert torch.equal(got[0][:, :200], torch.zeros_like(got[0][:, :200]))
    ref, low = reference_grads(attention_ref, inputs, dout, **kw)
    check_grads(got, ref, low)


# sequences of one key: every query row sees it (or, under causal and windows, nothing)
ONE_KEY = [(64, dict(window_size=(0, 0)), 300, 1), (128, dict(causal=True, softcap=5.0), 129, 1),
           (192, {}, 64, 1), (256, dict(window_size=(100, -1)), 64, 1)]


ONE_KEY_IDS = ["d64-window0,0-300x1", "d128-causal-softcap-129x1", "d192-none-64x1",
               "d256-left-64x1"]


@pytest.mark.parametrize("d,kw,sq,sk", ONE_KEY, ids=ONE_KEY_IDS)
def test_one_key_sequences_get_exactly_zero_dq_and_dk(seed, d, kw, sq, sk):
    """A softmax over one score is 1 whatever the score, so dS, dq and dk are exactly 0 when
    the sequence has one key (common/one_key.gradient_scale). P (dP - D) would leave ~1e-5 in
    dk (D is the rowsum of dO times the rounded O), over FlashAttention's floor."""
    inputs, dout, got = run_fixed(torch.bfloat16, d, 8, 2, sq, sk, **kw)
    assert torch.equal(got[0], torch.zeros_like(got[0])), got[0].abs().max()
    assert torch.equal(got[1], torch.zeros_like(got[1])), got[1].abs().max()
    ref, low = reference_grads(attention_ref, inputs, dout, **kw)
    check_grads(got, ref, low)


def test_one_key_sequence_among_packed_ones(seed):
    """The same per sequence of a packed batch: sequence 4 (65 queries over one key) gets dq
    and dk exactly 0, the others their gradients."""
    got, ref, low = run_varlen(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, causal=False)
    q_rows, k_rows = slice(sum(LENS_Q[:4]), sum(LENS_Q[:5])), slice(sum(LENS_K[:4]), sum(LENS_K[:5]))
    assert LENS_K[4] == 1
    assert torch.equal(got[0][q_rows], torch.zeros_like(got[0][q_rows]))
    assert torch.equal(got[1][k_rows], torch.zeros_like(got[1][k_rows]))
    assert got[0].abs().max() > 0 and got[1].abs().max() > 0
    check_grads(got, ref, low)


# ---- packed (varlen) ----

LENS_Q = [1, 0, 63, 64, 65, 128, 129, 700]
LENS_K = [129, 65, 0, 700, 1, 64, 128, 63]  # sequence 2: queries and no key; 1: keys, no query


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def run_varlen(lens_q, lens_k, h, hk, d, dtype, seqused_q=None, seqused_k=None,
               deterministic=False, dv=None, **kw):
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, dv or d, device="cuda", dtype=dtype, requires_grad=True)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                 seqused_q=seqused_q, seqused_k=seqused_k, strict=True,
                                 deterministic=deterministic, **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, seqused_q,
                                                          seqused_k, **a)
    ref, low = reference_grads(ref_fn, (q, k, v), dout, **kw)
    return got, ref, low


VARLEN_MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(128, 0)),
                "softcap": dict(softcap=20.0)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2)])
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_bwd_varlen(seed, dtype, d, h, hk, mask):
    got, ref, low = run_varlen(LENS_Q, LENS_K, h, hk, d, dtype, **VARLEN_MASKS[mask])
    check_grads(got, ref, low)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_bwd_varlen_seqused(seed, mask):
    """Rows past seqused get gradient 0 (they take no part in the forward)."""
    used_q = torch.tensor([1, 0, 20, 64, 0, 100, 129, 650], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([100, 65, 0, 1, 1, 30, 128, 63], dtype=torch.int32, device="cuda")
    got, ref, low = run_varlen(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, seqused_q=used_q,
                               seqused_k=used_k, **VARLEN_MASKS[mask])
    check_grads(got, ref, low)


def test_bwd_varlen_deterministic(seed):
    """Packed sequences, deterministic=True: repeated backward passes agree bitwise."""
    lens = [300, 0, 1031, 65]
    q = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_q = cu(lens)
    grads = []
    for _ in range(5):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_q, max(lens), max(lens), causal=True,
                                     deterministic=True, strict=True)
        if not grads:
            dout = torch.randn_like(out)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for again in grads[1:]:
        for a, b in zip(grads[0], again):
            assert torch.equal(a, b)
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu_q, cu_q, **a)
    ref, low = reference_grads(ref_fn, (q, k, v), dout, causal=True)
    check_grads(grads[0], ref, low)


# ---- FlashAttention-4's forms: negative window edges, batched q/k with seqused only ----

NEGATIVE_WINDOWS = [(None, -7), (-7, None), (20, -4), (130, -129)]


@pytest.mark.parametrize("window", NEGATIVE_WINDOWS, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_negative_window_edges(seed, window, d):
    """Rows and keys whose window is empty get gradient 0 (never NaN)."""
    for dtype, (sq, sk) in ((torch.bfloat16, (113, 203)), (torch.float16, (203, 113))):
        inputs, dout, got = run_fixed(dtype, d, 8, 2, sq, sk, window_size=window)
        ref, low = reference_grads(attention_ref, inputs, dout, window_size=window)
        check_grads(got, ref, low)


@pytest.mark.parametrize("poison", [False, True], ids=["", "nan-past-the-end"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_seqused_only(seed, mask, d, poison):
    """flash_attn_varlen_func on batched q/k/v whose true lengths are seqused_q/k: gradients of
    the used rows; the unused rows of q, k and v get 0. poison: the rows past seqused hold NaN
    and Inf (memory the call does not own); the reference sees them clean."""
    b, sq, sk, h, hk = 4, 300, 257, 8, 2
    used_q = torch.tensor([300, 1, 0, 150], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([257, 64, 10, 0], dtype=torch.int32, device="cuda")
    kw = MASKS[mask]
    leaves = [torch.randn(b * s, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for s, n in ((sq, h), (sk, hk), (sk, hk))]
    clean = leaves
    if poison:
        leaves = [t.detach().clone().requires_grad_() for t in clean]
        with torch.no_grad():
            for t, s, used in zip(leaves, (sq, sk, sk), (used_q, used_k, used_k)):
                for i, n in enumerate(used.tolist()):
                    t[i * s + n:(i + 1) * s:2] = float("nan")
                    t[i * s + n + 1:(i + 1) * s:2] = float("inf")
    q, k, v = leaves[0].view(b, sq, h, d), leaves[1].view(b, sk, hk, d), leaves[2].view(b, sk, hk, d)
    out = flash_attn_varlen_func(q, k, v, None, None, sq, sk, seqused_q=used_q, seqused_k=used_k,
                                 strict=True, **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, leaves, dout)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sq
    cu_k = torch.arange(b + 1, dtype=torch.int32, device="cuda") * sk
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, used_q, used_k, **a)
    # the reference's rows past seqused_q have out 0: their dout does not matter
    ref, low = reference_grads(ref_fn, clean, dout.reshape(b * sq, h, d), **kw)
    check_grads(got, ref, low)


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("side", ["q packed", "k packed"])
def test_bwd_one_side_packed(seed, mask, side):
    """cu_seqlens on one side only, the other batched (max length rows per sequence)."""
    lens_q, lens_k = [1, 0, 63, 129, 300], [129, 65, 0, 300, 64]
    b, h, hk, d = len(lens_q), 8, 2, 128
    if side == "k packed":
        lens_q = [max(lens_q)] * b
    else:
        lens_k = [max(lens_k)] * b
    sq, sk = max(lens_q), max(lens_k)
    kw = MASKS[mask] if mask != "window" else dict(window_size=(40, 10))
    leaves = [torch.randn(sum(lens), n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for lens, n in ((lens_q, h), (lens_k, hk), (lens_k, hk))]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    if side == "k packed":
        call = (leaves[0].view(b, sq, h, d), leaves[1], leaves[2], None, cu_k)
    else:
        call = (leaves[0], leaves[1].view(b, sk, hk, d), leaves[2].view(b, sk, hk, d), cu_q, None)
    out = flash_attn_varlen_func(*call, sq, sk, strict=True, **kw)
    dout = torch.randn_like(out)
    poison_allocator()
    got = torch.autograd.grad(out, leaves, dout)
    ref_fn = lambda q_, k_, v_, **a: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, **a)
    ref, low = reference_grads(ref_fn, leaves, dout.reshape(-1, h, d), **kw)
    check_grads(got, ref, low)


# ---- the preprocess kernel against its PyTorch reference ----

@pytest.mark.parametrize("form", ["fixed", "fixed-seqused", "packed", "packed-seqused"])
@pytest.mark.parametrize("dv", [64, 96, 128, 40, 80, 120])  # (40, 120: one lane a row; 80: two)
def test_preprocess_kernel_equals_the_pytorch_steps(seed, form, dv):
    """launch_common.bwd_preprocess (the CuTe kernel on a GPU) against bwd_preprocess_torch: the
    same LSE in log2 units (+inf where the forward's was -inf or past seqused) and the same D
    (float32 sums in another order), pad rows 0; rows past seqused hold NaN in out, as a forward
    may leave them, and must not leak."""
    from cuteattn.kernels import launch_common
    packed, used = form.startswith("packed"), form.endswith("seqused")
    lens = [1, 0, 63, 64, 130, 700]
    b, h = len(lens), 4
    if packed:
        out = torch.randn(sum(lens), h, dv, device="cuda", dtype=torch.bfloat16)
        lse = torch.randn(h, sum(lens), device="cuda") * 3
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    else:
        out = torch.randn(b, 700, h, dv, device="cuda", dtype=torch.float16)
        lse = torch.randn(b, h, 700, device="cuda") * 3
        cu = None
    dout = torch.randn_like(out)
    lse.view(-1)[::7] = float("-inf")  # rows that saw no key
    seqused = None
    if used:
        seqused = torch.tensor([1, 0, 10, 64, 0, 333], dtype=torch.int32, device="cuda")
        if packed:
            for i, (start, n) in enumerate(zip(cu.tolist(), seqused.tolist())):
                out[start + n:start + lens[i]] = float("nan")
        else:
            for i, n in enumerate(seqused.tolist()):
                out[i, n:] = float("nan")
    got = launch_common.bwd_preprocess(dout, out, lse, cu, seqused, 64)
    want = launch_common.bwd_preprocess_torch(dout, out, lse, cu, seqused, 64)
    for g, w, name in zip(got, want, ("lse2", "dsum")):
        assert g.shape == w.shape and not torch.isnan(g).any(), name
        assert torch.equal(torch.isinf(g), torch.isinf(w)), name
        finite = torch.isfinite(w)
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-5, atol=1e-4, msg=name)


# ---- head dims between the compiled widths (on sm90 up to 96 at their own width rounded up to
# 16 columns, wider ones on the next width's kernel; on the portable path the next width) ----

# (head_dim, mask, (h, hk), (sq, sk)): widths 16 to 256, each with another mask
PADDED = [(80, "none", (4, 4), (113, 203)), (80, "causal", (8, 2), (700, 700)),
          (40, "window", (6, 1), (203, 113)), (8, "causal", (4, 4), (65, 129)),
          (112, "softcap", (4, 2), (1023, 1023)), (72, "right", (4, 4), (1, 64)),
          (120, "none", (6, 3), (129, 65)), (160, "causal", (4, 2), (300, 300)),
          (224, "window", (4, 4), (129, 257))]


def padded_id(case):
    d, mask, (h, hk), (sq, sk) = case
    return f"d{d}-{mask}-h{h}:{hk}-{sq}x{sk}"


def _padded_served():
    from cuteattn.spec import AttentionSpec
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=80, head_dim_v=80, causal=False,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False, batch=1,
                         seqlen_q=64, seqlen_k=64, nheads=1, nheads_k=1, softmax_scale=0.1,
                         device_index=torch.cuda.current_device(), kind="bwd")
    return dispatch.can_implement(spec, torch.device("cuda")) is None


@pytest.mark.parametrize("case", PADDED, ids=padded_id)
def test_bwd_padded_head_dims(seed, case):
    """Gradients at a head dim between the compiled widths: the kernel reads q, k, v and dO
    zero-filled to its width, its buffers have that width, and the gradients come back at
    the tensors' head dim, contiguous, against the float32 reference (both families pad; run
    with CUTEATTN_PATH=sm80 for the portable one). Where a family does not pad, strict mode
    must name the head dim instead."""
    d, mask, (h, hk), (sq, sk) = case
    if not _padded_served():
        with pytest.raises(Exception, match=f"head_dim {d}"):
            run_fixed(torch.bfloat16, d, h, hk, sq, sk, **MASKS[mask])
        return
    dtype = DTYPES[PADDED.index(case) % 2]
    inputs, dout, got = run_fixed(dtype, d, h, hk, sq, sk, **MASKS[mask])
    assert all(g.shape == t.shape and g.is_contiguous() for g, t in zip(got, inputs))
    ref, low = reference_grads(attention_ref, inputs, dout, **MASKS[mask])
    check_grads(got, ref, low)


def test_bwd_padded_varlen_deterministic(seed):
    """A head dim between the compiled widths (80) with packed sequences (empty ones included) and
    deterministic=True: bitwise-equal over repeats, and right."""
    if not _padded_served():
        pytest.skip("this path's backward does not pad head dims (test_bwd_padded_head_dims "
                    "checks that it declines them)")
    runs = []
    for _ in range(3):
        torch.manual_seed(seed)  # the same inputs each time
        runs.append(run_varlen(LENS_Q, LENS_K, 8, 2, 80, torch.bfloat16, deterministic=True,
                               causal=True))
    got, ref, low = runs[0]
    for again, _, _ in runs[1:]:
        for a, b in zip(got, again):
            assert torch.equal(a, b)
    check_grads(got, ref, low)


NARROW_V = [(128, 64), (128, 96), (96, 64), (64, 32), (80, 40), (112, 56), (192, 128), (256, 128)]


@pytest.mark.parametrize("dims", NARROW_V, ids=lambda x: f"d{x[0]}v{x[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "softcap_causal"])
def test_bwd_head_dim_v_narrower(seed, dims, mask):
    """Gradients with v narrower than q/k (head_dim_v < head_dim): the kernel of q's width
    reads v and dO zero-filled past their own head dim; dV comes back at v's, dQ and dK at
    q's, against the float32 reference."""
    d, dv = dims
    dtype = DTYPES[NARROW_V.index(dims) % 2]
    inputs, dout, got = run_fixed(dtype, d, 8, 2, 203, 317, dv=dv, **MASKS[mask])
    assert got[2].shape == inputs[2].shape and got[2].is_contiguous()
    ref, low = reference_grads(attention_ref, inputs, dout, **MASKS[mask])
    check_grads(got, ref, low)


def test_bwd_head_dim_v_narrower_varlen_deterministic(seed):
    """The same with packed sequences (an empty one) and deterministic dQ, bitwise repeatable."""
    lens_q, lens_k = [0, 1, 63, 129, 700], [5, 0, 63, 700, 129]
    runs = []
    for _ in range(2):
        torch.manual_seed(seed)  # (the same inputs both times)
        runs.append(run_varlen(lens_q, lens_k, 8, 2, 128, torch.bfloat16, dv=64,
                               deterministic=True, causal=True))
    got, ref, low = runs[0]
    assert got[2].shape[-1] == 64
    check_grads(got, ref, low)
    assert all(torch.equal(a, b) for a, b in zip(got, runs[1][0]))
