"""The sm80 (mma.sync) forward on the GPU: the forward and varlen suites of the sm90 kernels, run
with CUTEATTN_PATH=sm80, so that on a Hopper GPU the portable path (compiled for the running
arch, sm_80 instructions only) is what serves every call. strict=True everywhere: a case the path
does not serve fails instead of passing on the reference; outputs are poisoned with NaN."""
import pytest
import torch

from cuteattn import api, dispatch, flash_attn_func

from test_gpu_fwd import CASES, case_id, run_case
from test_gpu_fwd import run_and_check as run_fixed
from test_gpu_varlen import LENS_K, LENS_Q
from test_gpu_varlen import MASKS as VARLEN_MASKS
from test_gpu_varlen import run_and_check as run_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def sm80_path(monkeypatch):
    monkeypatch.setenv(dispatch.PATH_ENV, "sm80")


def test_the_sm80_path_serves_the_calls(seed):
    """The path variable really routes calls to the sm80 family (and a later call without it
    to the device's own kernels, despite the same call signature)."""
    from cuteattn.kernels.sm80 import launch as sm80_launch
    q = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    api._launches.clear()
    flash_attn_func(q, q, q, causal=True, strict=True)
    flash_attn_func(q, q, q, causal=True, strict=True)  # the signature fast path
    (spec, launch), = api._launches.values()
    assert isinstance(launch, sm80_launch.Launch)
    major, _ = torch.cuda.get_device_capability()
    if major not in dispatch.ARCH_BY_MAJOR or dispatch.ARCH_BY_MAJOR[major] == "sm80":
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(dispatch.PATH_ENV)
        flash_attn_func(q, q, q, causal=True, strict=True)
    assert any(not isinstance(launch, sm80_launch.Launch) for _, launch in api._launches.values())


def test_hopper_decodes_with_the_portable_kernel_by_default(seed, monkeypatch):
    """Without CUTEATTN_PATH the device's own families serve: flash_attn_with_kvcache runs the
    decode kernel on every arch from sm_80 on, Hopper included (strict: no reference)."""
    monkeypatch.delenv(dispatch.PATH_ENV)
    for b, sq, s_new, h, hk, d, cap, lens, extra in DECODE_CASES[:3]:
        run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(seed, case):
    run_case(case)


def test_strided_inputs(seed):
    """q, k, v as views of one packed qkv tensor (row strides of 3 heads), and a custom scale."""
    qkv = torch.randn(2, 333, 3, 8, 128, device="cuda", dtype=torch.float16)
    run_fixed(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale=0.05, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2)])
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_varlen(seed, dtype, d, h, hk, mask):
    run_varlen(LENS_Q, LENS_K, h, hk, d, dtype, **VARLEN_MASKS[mask])


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_varlen_seqused(seed, mask):
    used_q = torch.tensor([1, 0, 20, 64, 0, 100, 129, 650], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([100, 3, 0, 700, 1, 0, 128, 10], dtype=torch.int32, device="cuda")
    run_varlen(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, seqused_q=used_q, seqused_k=used_k,
               **VARLEN_MASKS[mask])


# ---- the decode kernel (flash_attn_with_kvcache) on the sm80 path ----

def run_kvcache(b, sq, s_new, h, hk, d, cap, lens, page=None, splits=1, causal=False,
                window=(-1, -1), softcap=0.0, rotary=None, batch_idx=False, leftpad=None,
                dtype=torch.bfloat16, sink=False, cache_dtype=None, descales=True, q_scale=1.0,
                cache_scale=4.0, k_scale=1.0, poison=False):
    """flash_attn_with_kvcache (strict: the kernel must serve it) against the reference on a
    copy of the caches: the output by FlashAttention's rule, the LSE, and the caches after the
    append compared exactly. cache_dtype: an fp8 cache (values / descale, random per-(batch, kv
    head) descales, or none with descales=False), the new tokens quantized into it. q_scale,
    cache_scale: q's magnitude (randn times it) and an fp8 cache's stored values'. k_scale:
    K's real magnitude, through the descales of an fp8 cache (its stored bytes unchanged) and
    the new keys (q_scale 1e5 with k_scale 1e-5: q past fp16's range, scores as at 1).
    poison: every cache row no sequence owns (past its length after the append, before its
    leftpad, rows and pages no sequence maps) holds NaN or Inf, as an uninitialised cache may."""
    from cuteattn import flash_attn_with_kvcache
    from cuteattn.reference import attention_kvcache_ref
    from cuteattn.testing import assert_close_fa, assert_lse_close
    dev = "cuda"
    q = (torch.randn(b, sq, h, d, device=dev) * q_scale).to(dtype)
    k_new = v_new = None
    if s_new:
        k_new = (torch.randn(b, s_new, hk, d, device=dev) * k_scale).to(dtype)
        v_new = torch.randn(b, s_new, hk, d, device=dev, dtype=dtype)
    block_table = idx = None
    if page:
        pages_per_seq = -(-cap // page)
        n_pages = b * pages_per_seq + 3
        k_cache = torch.randn(n_pages, page, hk, d, device=dev, dtype=dtype)
        block_table = torch.randperm(n_pages, device=dev)[: b * pages_per_seq].reshape(b, pages_per_seq).int()
    else:
        k_cache = torch.randn(b + 2, cap, hk, d, device=dev, dtype=dtype)
        if batch_idx:
            idx = torch.randperm(b + 2, device=dev)[:b].int()
    v_cache = torch.randn_like(k_cache)
    k_descale = v_descale = None
    if cache_dtype is not None:
        # stored values up to ~16; with descales up to 8.5 the real values reach ~140 (scores
        # far outside bf16's comfortable range if the descales were applied before the MMA)
        k_cache, v_cache = ((k_cache * cache_scale).to(cache_dtype),
                            (v_cache * cache_scale).to(cache_dtype))
        if descales:
            k_descale = (torch.rand(b, hk, device=dev) * 8 + 0.5) * k_scale
            v_descale = torch.rand(b, hk, device=dev) * 8 + 0.5
    cos = sin = None
    if rotary is not None:
        rd = d // 2
        ang = torch.arange(cap + 8, device=dev).float()[:, None] / 10000 ** (torch.arange(0, rd, 2, device=dev).float() / rd)
        cos, sin = ang.cos(), ang.sin()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device=dev)
    if poison:
        poison_cache(k_cache, v_cache, block_table, idx, pad, [n + s_new for n in lens], page)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    low_k, low_v = k_cache.clone(), v_cache.clone()
    kw = dict(causal=causal, window_size=window, softcap=softcap,
              learnable_sink=torch.randn(h, device=dev) if sink else None)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cos, sin, lens_t, idx, pad, block_table,
        rotary_interleaved=rotary == "interleaved", num_splits=splits, return_softmax_lse=True,
        strict=True, validate=True, k_descale=k_descale, v_descale=v_descale, **kw)
    common = (q, None, None, k_new, v_new, cos, sin, lens_t, idx, pad, block_table)
    ref_kw = dict(kw, descales=(k_descale, v_descale), rotary_interleaved=rotary == "interleaved")
    ref, ref_lse = attention_kvcache_ref(*common[:1], ref_k, ref_v, *common[3:], **ref_kw)
    lowprec, _ = attention_kvcache_ref(*common[:1], low_k, low_v, *common[3:], upcast=False,
                                       **ref_kw)
    assert not torch.isnan(out).any() and not torch.isinf(out).any()
    bits = lambda t: t.view(torch.uint8)  # (bitwise: a poisoned cache's NaN are not equal)
    assert torch.equal(bits(k_cache), bits(ref_k)) and torch.equal(bits(v_cache), bits(ref_v)), \
        "the append differs"
    assert_close_fa(out, ref, lowprec)
    assert_lse_close(lse, ref_lse)


def poison_cache(k_cache, v_cache, block_table, idx, leftpad, ends, page):
    """NaN or Inf (alternate rows; an fp8 cache's NaN byte) in every cache row outside the
    sequences' [leftpad, end) key ranges, in place."""
    owned = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    for b, end in enumerate(ends):
        start = 0 if leftpad is None else int(leftpad[b])
        if block_table is not None:  # (row pos of sequence b: page table[b, pos // page])
            pos = torch.arange(start, end, device=k_cache.device)
            owned.view(-1)[block_table[b, pos // page].long() * page + pos % page] = True
        else:
            owned[b if idx is None else int(idx[b]), start:end] = True
    for t in (k_cache, v_cache):
        if t.element_size() == 1:  # fp8: 0x7f is NaN in e4m3, +NaN in e5m2
            t.view(torch.uint8)[~owned] = 0x7F
            continue
        bad = torch.full(t.shape[2:], float("nan"), dtype=t.dtype, device=t.device)
        flat, mask = t.view(-1, *t.shape[2:]), (~owned).view(-1)
        rows = mask.nonzero().flatten()
        flat[rows[0::2]] = bad
        flat[rows[1::2]] = float("inf")


DECODE_CASES = [
    # (b, sq, s_new, h, hk, d, cap, lens, extra)
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict()),
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict(page=16)),
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict(page=128, splits=3)),
    (2, 1, 1, 16, 1, 64, 4096, [4095, 2000], dict(page=48, splits=0)),
    (2, 4, 4, 16, 4, 128, 700, [7, 696], dict(causal=True, rotary="interleaved")),
    (2, 4, 4, 16, 4, 128, 700, [7, 696], dict(causal=True, rotary="neox", page=16, splits=5)),
    (3, 300, 0, 8, 8, 96, 2048, [300, 1000, 2048], dict(causal=True, splits=2)),
    (2, 5, 2, 8, 2, 256, 512, [100, 300], dict(window=(64, 0), softcap=20.0)),
    (2, 5, 2, 8, 2, 192, 512, [100, 300], dict(page=32, splits=4, causal=True)),
    (3, 2, 1, 8, 2, 128, 600, [50, 200, 400], dict(batch_idx=True, leftpad=[0, 7, 399])),
    (2, 1, 1, 8, 2, 64, 256, [255, 0], dict(dtype=torch.float16, splits=8)),
    # a GQA ratio that does not divide the tile (no pack-GQA), and learnable sinks
    (2, 3, 1, 12, 2, 128, 300, [10, 250], dict(causal=True)),
    (3, 1, 1, 32, 4, 128, 2048, [0, 900, 2047], dict(sink=True)),
    (2, 2, 2, 8, 8, 64, 512, [100, 400], dict(sink=True, splits=3, page=16, causal=True)),
    # pack-GQA over several 64-row query blocks in the causal / windowed tile order (chunked
    # prefill through the cache: the order's L2 groups must count kv heads, not query heads)
    (2, 32, 32, 32, 8, 128, 1024, [5, 900], dict(causal=True)),
    (2, 20, 0, 16, 2, 64, 2048, [2000, 700], dict(window=(256, 0), page=16)),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"case{i}" for i in range(len(DECODE_CASES))])
def test_kvcache(seed, case):
    """(Steps of at most 16 rows a kv head, seqlen_q x a GQA group that packs, run on the
    16-row tile whose warps split the keys; the others on the 64-row tile.)"""
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DECODE_CASES = [  # the decode cases' forms over an fp8 cache (with bf16 or fp16 q)
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict(cache_dtype=E4M3)),
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict(cache_dtype=E4M3, page=16)),
    (4, 1, 1, 32, 8, 128, 1024, [0, 1, 517, 1023], dict(cache_dtype=E5M2, page=128, splits=3)),
    (2, 1, 1, 16, 1, 64, 4096, [4095, 2000], dict(cache_dtype=E4M3, page=48, splits=0)),
    (2, 4, 4, 16, 4, 128, 700, [7, 696], dict(cache_dtype=E4M3, causal=True, rotary="neox")),
    (3, 300, 0, 8, 8, 96, 2048, [300, 1000, 2048], dict(cache_dtype=E4M3, causal=True, splits=2)),
    (2, 5, 2, 8, 2, 256, 512, [100, 300], dict(cache_dtype=E4M3, window=(64, 0), softcap=20.0)),
    (2, 5, 2, 8, 2, 192, 512, [100, 300], dict(cache_dtype=E5M2, page=32, splits=4, causal=True)),
    (3, 2, 1, 8, 2, 128, 600, [50, 200, 400], dict(cache_dtype=E4M3, batch_idx=True,
                                                   leftpad=[0, 7, 399])),
    (2, 1, 1, 8, 2, 64, 256, [255, 0], dict(cache_dtype=E4M3, dtype=torch.float16, splits=8)),
    (3, 1, 1, 32, 4, 128, 2048, [0, 900, 2047], dict(cache_dtype=E4M3, sink=True)),
    (2, 1, 1, 32, 8, 128, 333, [1, 332], dict(cache_dtype=E4M3, descales=False)),
]


POISON_CASES = ([f"case{i}" for i in (0, 1, 2, 4, 5, 7, 8, 9, 12, 14)]
                + [f"fp8case{i}" for i in (1, 2, 8)])


@pytest.mark.parametrize("name", POISON_CASES)
def test_kvcache_cache_past_lengths_holds_nan(seed, name):
    """Cache rows no sequence owns (an uninitialised cache's NaN and Inf) never reach out or
    lse: pages of 16 / 48 / 128, splits, rotary append, leftpad and cache rows, a sink, fp8."""
    cases = FP8_DECODE_CASES if name.startswith("fp8") else DECODE_CASES
    b, sq, s_new, h, hk, d, cap, lens, extra = cases[int(name.rpartition("case")[2])]
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, poison=True, **extra)


@pytest.mark.parametrize("case", DECODE_CASES + FP8_DECODE_CASES,
                         ids=[f"case{i}" for i in range(len(DECODE_CASES))]
                         + [f"fp8case{i}" for i in range(len(FP8_DECODE_CASES))])
def test_kvcache_two_ctas_per_sm(seed, case, monkeypatch):
    """The decode cases at 2 CTAs an SM, as a grid that fills the GPU runs them (these cases'
    small grids otherwise take 1 for bf16 or 3 for an fp8 cache: config.decode_ctas_per_sm):
    the ring sized for half the shared memory, split counts for 2 CTAs an SM."""
    from cuteattn import kvcache
    from cuteattn.kernels.sm80 import config
    monkeypatch.setattr(config, "decode_ctas_per_sm", lambda *args: 2)
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    monkeypatch.setattr(kvcache, "_steps", {})
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)


SPLIT_CASES = [c for c in DECODE_CASES + FP8_DECODE_CASES if c[-1].get("splits", 1) != 1]


# More splits than a warp's lanes (32: the merge weighs them in rounds of 32), as batch 1 over a
# long cache splits
MANY_SPLIT_CASES = [
    (1, 1, 1, 32, 8, 128, 4096, [4091], dict(splits=48)),
    (1, 1, 0, 16, 2, 64, 8192, [8000], dict(page=16, splits=70)),
    (1, 1, 1, 32, 8, 128, 4096, [4000], dict(cache_dtype=E4M3, splits=40)),
]


@pytest.mark.parametrize("case", SPLIT_CASES + MANY_SPLIT_CASES,
                         ids=[f"split{i}" for i in range(len(SPLIT_CASES))]
                         + [f"many{i}" for i in range(len(MANY_SPLIT_CASES))])
def test_kvcache_folded_combine(seed, case, monkeypatch):
    """The split decode cases with the merge in each tile's last split (config.decode_folds; a
    sink keeps the combine kernel), twice (the second call finds the counters the first left),
    and every split counter back at zero after them."""
    from cuteattn import kvcache
    from cuteattn.kernels.sm80 import config, launch
    monkeypatch.setattr(config, "FOLD_MAX_STEPS", 1 << 30)  # every split step folds
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    monkeypatch.setattr(kvcache, "_steps", {})
    monkeypatch.setattr(launch, "_split_counts", {})
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    for _ in range(2):
        run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)
    torch.cuda.synchronize()
    if extra.get("splits", 1) > 1 and not extra.get("sink"):  # (the folded kernel ran)
        assert launch._split_counts
    assert all(int(c.abs().sum()) == 0 for c in launch._split_counts.values())


@pytest.mark.parametrize("case", FP8_DECODE_CASES, ids=[f"fp8case{i}" for i in range(len(FP8_DECODE_CASES))])
def test_kvcache_fp8(seed, case):
    """An fp8 cache read by the decode kernel (converted in shared memory, descales folded into
    the scores' scale and the output), against the reference on the dequantized cache."""
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)


def decode_configs_made(monkeypatch) -> list:
    """The decode kernels' configs launched from here on (config.decode_config's results)."""
    from cuteattn.kernels.sm80 import config
    made, real = [], config.decode_config
    monkeypatch.setattr(config, "decode_config", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    return made


@pytest.mark.parametrize("case", FP8_DECODE_CASES, ids=[f"fp8case{i}" for i in range(len(FP8_DECODE_CASES))])
def test_kvcache_fp8_three_ctas(seed, case, monkeypatch):
    """The fp8 cases at 3 CTAs an SM (the ring sized for it; the warp-local tile's registers
    bounded to fit: 168 at d=128), as split grids over pages of 16 run them. The split-keys
    steps at head dims of multiples of 64 take the warp-local tile (K and V converted into
    their fragments in registers)."""
    from cuteattn import kvcache
    from cuteattn.kernels.sm80 import config
    monkeypatch.setattr(config, "decode_ctas_per_sm", lambda *args: 3)
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    monkeypatch.setattr(kvcache, "_steps", {})
    made = decode_configs_made(monkeypatch)
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra)
    assert made and all(c.warp_local == (c.split_keys and d % 64 == 0) for c in made), made
    if d in (64, 128) and sq * (h // hk) <= 16:
        assert any(c.warp_local and c.min_ctas_per_sm == 3 for c in made), made


# (q scale, k scale) for a bf16 q: ordinary; past fp16's range (65504) and in fp16's subnormal
# range, K's real magnitude the inverse (through the descales), so the scores are as at 1 (at
# scores of 1e5 float32 holds the LSE to ~0.01, whatever the kernel: measured, an absolute
# check of 1e-3 fails either way)
F16_MAGNITUDES = {"q1": (1.0, 1.0), "q1e5": (1e5, 1e-5), "q1e-6": (1e-6, 1e6)}
F16_CASES = [pytest.param(case, mag, id=f"fp8case{i}-{mag}") for i, case in enumerate(FP8_DECODE_CASES)
             for mag in F16_MAGNITUDES
             if case[8].get("dtype", torch.bfloat16) == torch.bfloat16
             and (mag == "q1" or case[8].get("descales", True))]


@pytest.mark.parametrize("case, magnitude", F16_CASES)
def test_kvcache_fp8_f16_operands(seed, case, magnitude, monkeypatch):
    """The fp8 cases with a bf16 q at magnitudes fp16 cannot hold: the warp-local tile runs its
    MMAs in fp16 (Q's fragment scaled by a power of two, P as 2^15 P), so q of 1e5 or 1e-6
    must come out as at 1; every split-keys step at head dims of multiples of 64 takes it."""
    from cuteattn import kvcache
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    monkeypatch.setattr(kvcache, "_steps", {})
    made = decode_configs_made(monkeypatch)
    b, sq, s_new, h, hk, d, cap, lens, extra = case
    q_scale, k_scale = F16_MAGNITUDES[magnitude]
    run_kvcache(b, sq, s_new, h, hk, d, cap, lens, **extra, q_scale=q_scale, k_scale=k_scale)
    assert made and all(c.f16_operands == c.warp_local for c in made), made
    if d in (64, 128) and sq * (h // hk) <= 16:
        assert any(c.f16_operands for c in made), made


@pytest.mark.parametrize("tile", ["warp_local", "cta"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_cache_values_read_exactly(seed, dtype, fmt, tile, monkeypatch):
    """Every finite fp8 byte read back exactly: with one cached key the softmax weight is 1, so the output is
    that key's value row (v's descale 1), value for value, subnormals included. Two kv heads of
    d=128 hold the 256 bytes (the non-finite ones replaced by 0), four query heads each. One
    query position runs the warp-local tile (fragments converted in registers, output columns
    permuted; MMAs in fp16 for a bf16 q), five (20 rows a kv head) the CTA-wide one (a
    converted buffer in shared memory)."""
    from cuteattn import flash_attn_with_kvcache, kvcache
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    monkeypatch.setattr(kvcache, "_steps", {})
    made = decode_configs_made(monkeypatch)
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    byte = torch.where(torch.isfinite(byte.view(fmt).float()), byte, torch.zeros_like(byte))
    v_cache = byte.view(fmt).view(1, 1, 2, 128).cuda()  # (batch, one key, kv heads, d)
    k_cache = torch.zeros_like(v_cache)
    sq = 5 if tile == "cta" else 1
    q = torch.randn(1, sq, 8, 128, device="cuda", dtype=dtype)
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, strict=True)
    want = v_cache.to(dtype).repeat_interleave(4, dim=2).expand(1, sq, 8, 128)
    assert torch.equal(out.float(), want.float())
    assert made and all(c.warp_local == (tile != "cta") for c in made), made
    assert all(c.f16_operands == (tile != "cta" and dtype == torch.bfloat16) for c in made), made


@pytest.mark.parametrize("page", [16, 48, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [96, 128])
def test_paged_prefill(seed, page, causal, d):
    """flash_attn_varlen_func(block_table=) on the sm80 path: packed q against keys in shuffled
    pages (one page shared by two sequences' tables is read, never written), against the
    varlen reference on the keys gathered by hand (d=96: 32-row copy passes, so 16-key blocks
    on 2 warps over pages of 16 and 48)."""
    from cuteattn import flash_attn_varlen_func
    from cuteattn.reference import attention_varlen_ref
    from cuteattn.testing import assert_close_fa, assert_lse_close
    lens_q, lens_k = [1, 63, 200, 0], [130, 63, 700, 5]
    h, hk = 8, 2
    pages_per_seq = -(-max(lens_k) // page)
    n_pages = len(lens_k) * pages_per_seq + 2
    cache_k = torch.randn(n_pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    table = torch.randperm(n_pages, device="cuda")[: len(lens_k) * pages_per_seq]
    table = table.reshape(len(lens_k), pages_per_seq).int()
    table[3, 0] = table[0, 0]  # a shared first page (prefix sharing)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, cache_k, cache_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      causal=causal, block_table=table, return_lse=True,
                                      strict=True, validate=True)
    # the keys of each sequence gathered from its pages, packed
    keys, values = [], []
    for b, n in enumerate(lens_k):
        rows = table[b].long()
        keys.append(cache_k[rows].reshape(-1, hk, d)[:n])
        values.append(cache_v[rows].reshape(-1, hk, d)[:n])
    k, v = torch.cat(keys), torch.cat(values)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)
    lowprec, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=False)
    assert_close_fa(out, ref, lowprec)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("dv", [64, 96, 128, 256])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("splits", [5, 37])
def test_combine_kernel_equals_the_reference_merge(seed, dv, sink, splits):
    """The split-KV combine kernel against reference.merge_partials on random partials, some
    splits (and one whole row) with LSE -inf: the merged output within float32 rounding
    (bf16 output), the LSE to 1e-5. 37 splits: more than a lane each (a second round of 32)
    and a last group of rows only partly used."""
    from cuteattn.kernels.sm80 import launch as sm80_launch
    from cuteattn.kernels.sm80.combine import CombineConfig
    from cuteattn.kernels.sm80 import arguments
    from cuteattn.kernels.common.arguments import Binder
    from cuteattn.kernels.launch_common import call_kernel, to_runtime, use_tvm_ffi
    from cuteattn.reference import merge_partials
    b, sq, h = 2, 3, 8
    o_part = torch.randn(splits, b, sq, h, dv, device="cuda")
    lse_part = torch.randn(splits, b, h, sq, device="cuda") * 3
    lse_part[1] = float("-inf")           # a split that saw no key
    lse_part[:, 0, 2, 1] = float("-inf")  # a row no split saw
    sink_t = torch.randn(h, device="cuda") if sink else None
    out = torch.full((b, sq, h, dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((b, h, sq), float("nan"), device="cuda")
    tvm = use_tvm_ffi()
    fn = sm80_launch._compiled_combine(CombineConfig(cutlass_bf16(), dv, sink), tvm)
    bind = Binder(("mOPartial", "mLSEPartial", "mSink", "mO", "mLSE", "num_splits"), {},
                  arguments.COMBINE_ARGUMENTS, None if tvm else to_runtime)
    call_kernel(fn, tvm, bind(o_part, lse_part, sink_t, out, lse, splits), out.device)
    want, want_lse = merge_partials(o_part, lse_part, sink_t)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def cutlass_bf16():
    import cutlass
    return cutlass.BFloat16


# ---- the backward on the sm80 path (forward and backward both portable) ----

import test_gpu_bwd as tb  # noqa: E402
from cuteattn.kernels.sm80.launch_bwd import SUPPORTED_HEAD_DIMS as BWD_HEAD_DIMS  # noqa: E402

# the sm90 suite's cases at the head dims the portable backward compiles (64 to 256)
BWD_CASES = [c for c in tb.CASES if c[1] in BWD_HEAD_DIMS]
BWD_DETERMINISTIC = [c for c in tb.DETERMINISTIC if c[0] in BWD_HEAD_DIMS]


@pytest.mark.parametrize("case", BWD_CASES, ids=tb.case_id)
def test_bwd(seed, case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    kw = tb.MASKS[mask]
    inputs, dout, got = tb.run_fixed(dtype, d, h, hk, sq, sk, **kw)
    ref, low = tb.reference_grads(tb.attention_ref, inputs, dout, **kw)
    tb.check_grads(got, ref, low)


def test_bwd_strided_qkv_and_rows_without_keys(seed):
    tb.test_bwd_strided_qkv(seed)
    tb.test_rows_without_keys_get_zero_gradient(seed)


@pytest.mark.parametrize("d,kw,sq,sk", tb.ONE_KEY, ids=tb.ONE_KEY_IDS)
def test_bwd_one_key_sequences_get_exactly_zero_dq_and_dk(seed, d, kw, sq, sk):
    tb.test_one_key_sequences_get_exactly_zero_dq_and_dk(seed, d, kw, sq, sk)


def test_bwd_one_key_sequence_among_packed_ones(seed):
    tb.test_one_key_sequence_among_packed_ones(seed)


@pytest.mark.parametrize("d", BWD_HEAD_DIMS)
@pytest.mark.parametrize("mask", list(tb.VARLEN_MASKS))
def test_bwd_varlen(seed, d, mask):
    got, ref, low = tb.run_varlen(tb.LENS_Q, tb.LENS_K, 8, 2, d, torch.bfloat16,
                                  **tb.VARLEN_MASKS[mask])
    tb.check_grads(got, ref, low)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_bwd_varlen_seqused(seed, mask):
    tb.test_bwd_varlen_seqused(seed, mask)


@pytest.mark.parametrize("d,mask,sq,sk", BWD_DETERMINISTIC)
def test_bwd_deterministic_is_bitwise_reproducible(seed, d, mask, sq, sk):
    tb.test_bwd_deterministic_is_bitwise_reproducible(seed, d, mask, sq, sk)


def test_bwd_varlen_deterministic(seed):
    tb.test_bwd_varlen_deterministic(seed)


@pytest.mark.parametrize("case", tb.PADDED, ids=tb.padded_id)
def test_bwd_padded_head_dims(seed, case):
    tb.test_bwd_padded_head_dims(seed, case)


@pytest.mark.parametrize("dims", tb.NARROW_V, ids=lambda x: f"d{x[0]}v{x[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "softcap_causal"])
def test_bwd_head_dim_v_narrower(seed, dims, mask):
    """v narrower than q and k (MLA's 192 / 128 among them): v and dO read zero-filled."""
    tb.test_bwd_head_dim_v_narrower(seed, dims, mask)


def test_bwd_head_dim_v_narrower_varlen_deterministic(seed):
    tb.test_bwd_head_dim_v_narrower_varlen_deterministic(seed)


# launch_bwd.DQ_SPLITS_MAX_DIM settings that put every head dim on one deterministic dQ form:
# turns (descending under masks) or split accumulators
DQ_FORMS = {"turns": 0, "splits": 256}


@pytest.fixture
def dq_form(monkeypatch):
    """Puts the portable backward's deterministic dQ on one form at every head dim for a test
    (the launches kept per spec dropped before and after, so its configs compile and run)."""
    from cuteattn.kernels.sm80 import launch_bwd

    def take(form):
        monkeypatch.setattr(launch_bwd, "DQ_SPLITS_MAX_DIM", DQ_FORMS[form])
        api._launches.clear()
    yield take
    api._launches.clear()


# Both deterministic dQ forms at every head dim (the defaults take one a head dim,
# launch_bwd.DQ_SPLITS_MAX_DIM): every deterministic case, gradients right and bitwise
# reproducible (b=2 x 8 heads: 8 splits, so the 9-32 key blocks of the cases are walked 2-4 a
# split)
@pytest.mark.parametrize("form", list(DQ_FORMS))
@pytest.mark.parametrize("d,mask,sq,sk", BWD_DETERMINISTIC)
def test_bwd_deterministic_dq_forms(seed, dq_form, form, d, mask, sq, sk):
    dq_form(form)
    tb.test_bwd_deterministic_is_bitwise_reproducible(seed, d, mask, sq, sk)


@pytest.mark.parametrize("form", list(DQ_FORMS))
def test_bwd_varlen_deterministic_dq_forms(seed, dq_form, form):
    dq_form(form)
    tb.test_bwd_varlen_deterministic(seed)
