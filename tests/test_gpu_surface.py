"""GPU forward of the rest of FlashAttention's forward surface against the float32 reference:
head_dim_v != head_dim, head dims between the compiled widths (run padded), FlashAttention-4's
negative window edges, and flash_attn_varlen_func with batched q/k and seqused only or with one
side packed.

strict=True everywhere (a call the kernels do not serve fails instead of passing on the
reference); outputs are poisoned with NaN, so any element the kernel does not write fails, and
the padded head dims check that nothing is written past out's head dim (a guard column).
`path` runs each case on the device's own kernels and on the portable (sm80) path where it
serves the form.
"""
import itertools

import pytest
import torch

from cuteattn import api, dispatch, flash_attn_func, flash_attn_varlen_func
from cuteattn.reference import attention_ref, attention_varlen_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.bfloat16, torch.float16]
MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(64, 32)),
    "softcap": dict(softcap=30.0),
}
SEQLENS = [(113, 203), (203, 113), (1023, 1023), (1, 64), (700, 700)]
# (head_dim, head_dim_v): MLA-style prefill (192, 128), (128, 64), and head dims between the
# compiled widths (64, 96, 128, 192, 256), for q/k and for v, down to 8
DIMS = [(192, 128), (128, 64), (80, 80), (32, 32), (8, 8), (72, 40), (112, 112), (160, 160),
        (200, 200), (256, 128), (48, 48), (240, 232), (160, 128), (144, 112)]


def surface_cases():
    out = []
    for (i_d, dims), (i_m, mask) in itertools.product(enumerate(DIMS), enumerate(MASKS)):
        sl = SEQLENS[(i_d + 2 * i_m) % len(SEQLENS)]
        heads = [(4, 4), (8, 2), (6, 1)][(i_d + i_m) % 3]
        out.append((DTYPES[(i_d + i_m) % 2], dims, heads, mask, sl))
    return out


CASES = surface_cases()


def case_id(case):
    dtype, (d, dv), (h, hk), mask, (sq, sk) = case
    return f"{str(dtype)[6:]}-d{d}v{dv}-h{h}:{hk}-{mask}-{sq}x{sk}"


def check_fixed(q, k, v, **kw):
    """flash_attn_func into NaN-poisoned out / lse buffers, against the reference. out is a
    view of a wider buffer whose last column is a guard: a kernel that stores past out's head
    dim (a padded width) writes into it."""
    b, sq, h, _ = q.shape
    dv = v.shape[-1]
    buf = torch.full((b, sq, h, dv + 8), float("nan"), device=q.device, dtype=q.dtype)
    out = buf[..., :dv]
    lse = torch.full((b, h, sq), float("nan"), device=q.device)
    flash_attn_func(q, k, v, **kw, return_lse=True, strict=True, out=out, lse=lse)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    lowprec, _ = attention_ref(q, k, v, **kw, upcast=False)
    assert_close_fa(out, ref, lowprec)
    assert_lse_close(lse, ref_lse)
    assert torch.isnan(buf[..., dv:]).all(), "the kernel wrote past out's head dim"


@pytest.fixture(params=["own", "sm80"])
def path(request, monkeypatch):
    """The device's own kernels, or the portable path (CUTEATTN_PATH=sm80)."""
    if request.param == "sm80":
        monkeypatch.setenv(dispatch.PATH_ENV, "sm80")
    return request.param


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_head_dims(seed, path, case):
    """head_dim_v != head_dim and padded head dims, on both forward paths."""
    dtype, (d, dv), (h, hk), mask, (sq, sk) = case
    q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(2, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(2, sk, hk, dv, device="cuda", dtype=dtype)
    check_fixed(q, k, v, **MASKS[mask])


def test_head_dims_strided_and_scaled(seed, path):
    """A padded head dim in views of one packed qkv tensor, with a custom scale."""
    qkv = torch.randn(2, 333, 3, 8, 80, device="cuda", dtype=torch.bfloat16)
    check_fixed(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale=0.3, causal=True)


@pytest.mark.parametrize("d,dv", [(192, 128), (80, 80), (128, 64)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_head_dims_varlen(seed, path, d, dv, mask):
    lens_q, lens_k = [1, 0, 63, 129, 700], [129, 65, 0, 700, 64]
    run_varlen(lens_q, lens_k, 8, 2, d, dv, torch.bfloat16, **MASKS[mask])


# ---- FlashAttention-4's negative window edges ----

WINDOWS = [(None, -1), (None, -7), (-7, None), (20, -4), (-4, 20), (-3, 3), (130, -129)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("sq,sk", [(113, 203), (203, 113), (129, 129), (1, 64)])
def test_negative_window_edges(seed, path, window, sq, sk):
    """Rows whose window holds no key give out 0 and lse -inf."""
    q = torch.randn(2, sq, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
    check_fixed(q, k, v, window_size=window)


@pytest.mark.parametrize("window", [(None, -5), (-5, None)], ids=str)
def test_negative_window_edges_varlen(seed, window):
    run_varlen([1, 0, 63, 129, 700], [129, 65, 0, 700, 64], 8, 2, 64, 64, torch.float16,
               window_size=window)


# ---- flash_attn_varlen_func with batched sides ----

def cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def run_varlen(lens_q, lens_k, h, hk, d, dv, dtype, batched_q=False, batched_k=False,
               seqused_q=None, seqused_k=None, poison=False, **kw):
    """Packed (or, with batched_q / batched_k, (batch, max_len, ...) batched) q and k/v through
    flash_attn_varlen_func, against the varlen reference on the packed rows; rows past a
    sequence's used length are not compared (FlashAttention leaves them undefined). poison:
    the k / v rows past each sequence's seqused_k hold NaN and Inf (memory the call does not
    own, as an uninitialised cache's); the reference sees them clean."""
    b = len(lens_q)
    sq, sk = max(lens_q), max(lens_k)
    if batched_q:  # every sequence is max_len rows long: its true length is seqused_q
        lens_q = [sq] * b
    if batched_k:
        lens_k = [sk] * b
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), hk, dv, device="cuda", dtype=dtype)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    clean_k, clean_v = k, v
    if poison:
        k, v = k.clone(), v.clone()
        for i, (start, n) in enumerate(zip(cu_k.tolist()[:-1], lens_k)):
            first = start + int(seqused_k[i])
            for t in (k, v):
                t[first:start + n:2] = float("nan")
                t[first + 1:start + n:2] = float("inf")
    call_q = q.view(b, sq, h, d) if batched_q else q
    call_k, call_v = (k.view(b, sk, hk, d), v.view(b, sk, hk, dv)) if batched_k else (k, v)
    out = torch.full((*call_q.shape[:-1], dv), float("nan"), device="cuda", dtype=dtype)
    lse_shape = (b, h, sq) if batched_q else (h, q.shape[0])
    lse = torch.full(lse_shape, float("nan"), device="cuda")
    flash_attn_varlen_func(
        call_q, call_k, call_v, None if batched_q else cu_q, None if batched_k else cu_k, sq, sk,
        seqused_q=seqused_q, seqused_k=seqused_k, return_lse=True, strict=True, validate=True,
        out=out, lse=lse, **kw)
    ref_args = (q, clean_k, clean_v, cu_q, cu_k, seqused_q, seqused_k)
    ref, ref_lse = attention_varlen_ref(*ref_args, **kw)
    lowprec, _ = attention_varlen_ref(*ref_args, **kw, upcast=False)
    out = out.reshape(-1, h, dv)
    lse = lse.permute(1, 0, 2).reshape(h, -1) if batched_q else lse
    used_q = seqused_q.tolist() if seqused_q is not None else lens_q
    for i, start in enumerate(cu_q.tolist()[:-1]):
        rows = slice(start, start + used_q[i])
        assert_close_fa(out[rows], ref[rows], lowprec[rows], name=f"out of sequence {i}")
        assert_lse_close(lse[:, rows], ref_lse[:, rows], name=f"lse of sequence {i}")


LENS_Q = [1, 0, 63, 64, 65, 128, 129, 700]
LENS_K = [129, 65, 0, 700, 1, 64, 128, 63]
USED_Q = [1, 0, 20, 64, 0, 100, 129, 650]
USED_K = [100, 3, 0, 700, 1, 0, 128, 10]
VARLEN_MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(128, 0))}


def used(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
@pytest.mark.parametrize("d", [64, 128])
def test_seqused_only(seed, path, mask, d):
    """Batched (batch, seqlen, ...) q/k/v whose true lengths live on the GPU (seqused_q/k)."""
    run_varlen(LENS_Q, LENS_K, 8, 2, d, d, torch.bfloat16, batched_q=True, batched_k=True,
               seqused_q=used(USED_Q), seqused_k=used(USED_K), **VARLEN_MASKS[mask])


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
@pytest.mark.parametrize("form", ["batched", "k batched", "packed"])
def test_seqused_k_past_the_end_holds_nan(seed, path, mask, form):
    """Keys and values past seqused_k (memory the call does not own: an uninitialised cache
    holds NaN and Inf bit patterns) never reach out or lse."""
    run_varlen(LENS_Q, LENS_K, 8, 2, 128, 128, torch.bfloat16, batched_q=form == "batched",
               batched_k=form != "packed", seqused_q=used(USED_Q) if form == "batched" else None,
               seqused_k=used(USED_K), poison=True, **VARLEN_MASKS[mask])


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_seqused_k_only(seed, mask):
    run_varlen(LENS_Q, LENS_K, 8, 8, 128, 128, torch.float16, batched_q=True, batched_k=True,
               seqused_k=used(USED_K), **VARLEN_MASKS[mask])


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
@pytest.mark.parametrize("side", ["q packed", "k packed"])
def test_one_side_packed(seed, path, mask, side):
    """cu_seqlens on one side only, the other batched (FlashAttention-4's varlen tests' form)."""
    run_varlen(LENS_Q, LENS_K, 8, 2, 128, 128, torch.bfloat16, batched_q=side == "k packed",
               batched_k=side == "q packed", **VARLEN_MASKS[mask])


def test_one_side_packed_with_seqused(seed):
    run_varlen(LENS_Q, LENS_K, 8, 1, 64, 64, torch.float16, batched_k=True,
               seqused_q=used(USED_Q), seqused_k=used(USED_K), causal=True)


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_default_path(seed, page, causal, monkeypatch):
    """flash_attn_varlen_func(block_table=) on whatever path the GPU gets by default (on Hopper
    the sm90 forward hands it to the portable kernel): the portable path's own test, strict."""
    import test_gpu_sm80
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    test_gpu_sm80.test_paged_prefill(seed, page, causal, 128)


def run_paged_prefill(page, d, causal=False, window_size=(-1, -1), lens_q=(1, 63, 200, 0, 130),
                      lens_k=(130, 63, 700, 5, 1000), h=8, hk=2, sink=None, pad_table=False):
    """flash_attn_varlen_func(block_table=) on the default path, strict: packed q over keys in
    shuffled pages (one page in two sequences' tables), every cache row no sequence uses set
    to NaN (rows past a sequence's end inside its last page must not reach the output: P is 0
    there, but 0 x NaN is not), against the reference on the keys gathered by hand. pad_table:
    the table's entries past each sequence's pages hold -1 and ids past the cache (tables are
    padded with anything)."""
    pages_per_seq = -(-max(lens_k) // page)
    n_pages = len(lens_k) * pages_per_seq + 2
    cache_k = torch.full((n_pages, page, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    cache_v = cache_k.clone()
    table = torch.randperm(n_pages, device="cuda")[: len(lens_k) * pages_per_seq]
    table = table.reshape(len(lens_k), pages_per_seq).int()
    table[3, 0] = table[0, 0]  # a shared first page (prefix sharing): sequence 3 reads 0's keys
    keys, values = [], []
    for b, n in enumerate(lens_k):
        rows = table[b].long()
        if b != 3:
            for t in (cache_k, cache_v):
                flat = t[rows].reshape(-1, hk, d)
                flat[:n] = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
                t[rows] = flat.view(-1, page, hk, d)
        keys.append(cache_k[rows].reshape(-1, hk, d)[:n])
        values.append(cache_v[rows].reshape(-1, hk, d)[:n])
    if pad_table:
        for b, n in enumerate(lens_k):
            table[b, -(-n // page):] = torch.tensor([-1, 10 ** 6], dtype=torch.int32).repeat(
                pages_per_seq)[:pages_per_seq - -(-n // page)]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, cache_k, cache_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      causal=causal, window_size=window_size, block_table=table,
                                      learnable_sink=sink, return_lse=True, strict=True,
                                      validate=True)
    k, v = torch.cat(keys), torch.cat(values)
    assert not k.isnan().any()  # (the reference's keys: only rows the sequences use)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size,
                                        learnable_sink=sink)
    low, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size,
                                  learnable_sink=sink, upcast=False)
    assert_close_fa(out, ref, low)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("page", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("d", [64, 112, 128, 256])  # (112: its own width, 32-byte swizzle)
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_paged_prefill_pages_read_by_sm90(seed, page, d, mask, monkeypatch):
    """On Hopper the sm90 forward reads the pages itself: a TMA copy per key block from its
    page (pages of a multiple of 64 keys), or per (page, 64 columns) slice of a block (pages
    of 16 and 48 keys: a block spans pages, some wholly past a sequence's end)."""
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    kw = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(100, 30))}[mask]
    run_paged_prefill(page, d, **kw)


@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window", "sink"])
def test_paged_prefill_small_pages_gathered(seed, page, d, mask, monkeypatch):
    """Pages smaller than a key block gathered into batched K / V before the batched-keys
    kernel (launch.GatheredPagesLaunch; config.PAGED_GATHER_MIN_ROWS set to 0 so that these
    short sequences take it): shuffled and shared pages, NaN in every row no sequence owns,
    table entries past a sequence's pages holding -1 and ids past the cache."""
    from cuteattn.kernels.sm90 import config, launch
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    monkeypatch.setattr(config, "PAGED_GATHER_MIN_ROWS", 0)
    monkeypatch.setattr(api, "_launches", {})  # (launches kept per spec were chosen without it)
    calls = []
    run = launch.GatheredPagesLaunch.__call__
    monkeypatch.setattr(launch.GatheredPagesLaunch, "__call__",
                        lambda self, *a, **kw: calls.append(1) or run(self, *a, **kw))
    kw = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(100, 30)),
          "sink": dict(causal=True, sink=torch.randn(8, device="cuda") * 2)}[mask]
    run_paged_prefill(page, d, pad_table=True, **kw)
    assert calls, "the gathered path did not run"


@pytest.mark.parametrize("page,path", [(16, None), (128, None), (16, "sm80")])
def test_paged_prefill_with_a_learnable_sink(seed, page, path, monkeypatch):
    """A learnable sink with pages read by the sm90 forward, or by the portable kernel (the
    sink joins each row's denominator in the epilogue, whatever the keys' layout); sequences
    without keys get out 0 and lse = the sink."""
    if path is None:
        monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(dispatch.PATH_ENV, path)
    run_paged_prefill(page, 128, causal=True, sink=torch.randn(8, device="cuda") * 2)
