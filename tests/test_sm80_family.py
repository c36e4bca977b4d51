"""The sm80 family on the CPU: its tiles fit each arch's shared memory, the preferred tile is
taken where it fits, and the family's reasons for what it does not serve."""
import dataclasses

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cuteattn.kernels.sm80 import config  # noqa: E402
from cuteattn.kernels.sm80 import launch as sm80_launch  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402


@pytest.fixture(autouse=True)
def sm80_path(monkeypatch):
    """The path asked for by name (what a Hopper GPU needs to run it)."""
    monkeypatch.setenv("CUTEATTN_PATH", "sm80")


def test_configs_of_another_target_on_the_gpu_at_hand(monkeypatch):
    """CUTEATTN_SM80_CONFIGS picks the configs a target would run (its capability, its shared
    memory, never more than the device's), so a GPU of another arch can verify them."""
    monkeypatch.setattr(sm80_launch, "_device_smem", lambda index: 227 * 1024)
    monkeypatch.setenv(sm80_launch.CONFIGS_ENV, "sm_120a")
    assert sm80_launch.target_capability(0) == (12, 0)
    assert sm80_launch.smem_limit(0) == 99 * 1024
    monkeypatch.setenv(sm80_launch.CONFIGS_ENV, "sm_80")
    assert sm80_launch.smem_limit(0) == 163 * 1024
    monkeypatch.setattr(sm80_launch, "_device_smem", lambda index: 100 * 1024)
    assert sm80_launch.smem_limit(0) == 100 * 1024
    monkeypatch.setenv(sm80_launch.CONFIGS_ENV, "ampere")
    with pytest.raises(ValueError, match="CUTEATTN_SM80_CONFIGS"):
        sm80_launch.target_capability(0)


def make_spec(**kw):
    fields = dict(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=False, local=False,
                  has_softcap=False, varlen_q=False, varlen_k=False, batch=2, seqlen_q=64,
                  seqlen_k=64, nheads=4, nheads_k=4, softmax_scale=0.1, device_index=-1)
    return AttentionSpec(**{**fields, **kw})


@pytest.mark.parametrize("capability", sorted(config.SMEM_BY_CAPABILITY))
@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("local", [False, True])
def test_a_tile_fits_every_arch(capability, d, local):
    smem = config.SMEM_BY_CAPABILITY[capability]
    cfg = config.fwd_config(cutlass.BFloat16, d, d, False, local, False, False, False,
                            smem_limit=smem)
    assert cfg.smem_bytes() <= smem
    assert cfg.tile_m % (16 * cfg.num_warps) == 0 and cfg.tile_n % 16 == 0
    # the first listed tile that fits is the one taken
    tiles = config.LOCAL_TILES.get(d, config.TILES[d]) if local else config.TILES[d]
    stages = lambda t: t[3] if len(t) > 3 else 1
    fitting = [t for t in tiles
               if (t[0] * d + stages(t) * t[1] * 2 * d) * 2 <= smem]
    assert (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.kv_stages) == (*fitting[0][:3], stages(fitting[0]))


def test_d64_prefers_32_rows_per_warp_with_a_ring():
    """d = 64: 128 x 64 on 4 warps with two K/V stages first; where a fitting tile spills, the
    launch moves on to the 8-warp tile (compile_common.first_spill_free), and last to 64
    rows (what sm_100a's compiler builds spill-free with packed queries)."""
    configs = config.fwd_configs(cutlass.BFloat16, 64, 64, False, False, False, False, False,
                                 smem_limit=99 * 1024)
    assert [(c.tile_m, c.tile_n, c.num_warps, c.kv_stages) for c in configs] == [
        (128, 64, 4, 2), (128, 128, 8, 1), (128, 64, 4, 1), (64, 64, 4, 1)]


def test_no_tile_fits_a_tiny_shared_memory(monkeypatch):
    with pytest.raises(ValueError, match="no sm80 forward tile for head_dim 256 fits 32768"):
        config.fwd_config(cutlass.BFloat16, 256, 256, False, False, False, False, False,
                          smem_limit=32 * 1024)
    monkeypatch.setattr(sm80_launch, "smem_limit", lambda device_index: 32 * 1024)
    reason = sm80_launch.FORWARD.can_implement(make_spec(head_dim=256, head_dim_v=256))
    assert reason == "no sm80 forward tile for head_dim 256 fits 32768 bytes of shared memory"
    assert sm80_launch.FORWARD.can_implement(make_spec(head_dim=64, head_dim_v=64)) is None


@pytest.mark.parametrize("fields,reason", [
    (dict(head_dim=264, head_dim_v=264), "head_dim 264 is wider than the sm80 forward's widest (256)"),
    (dict(head_dim=64, head_dim_v=128),
     "head_dim_v 128 > head_dim 64 is not supported by the sm80 forward (head_dim_v <= head_dim)"),
    (dict(head_dim=80, head_dim_v=80, paged_kv=True, varlen_q=True, page_size=16),
     "head_dim 80 is not supported by the sm80 forward (supported: 64, 96, 128, 192, 256)"),
    (dict(dtype=torch.float32), "dtype torch.float32 is not supported by the sm80 forward (fp16, bf16)"),
])
def test_sm80_forward_reasons(fields, reason):
    assert sm80_launch.FORWARD.can_implement(make_spec(**fields)) == reason


@pytest.mark.parametrize("d,dv", [(80, 80), (192, 128), (72, 40), (8, 8), (256, 128)])
def test_sm80_forward_pads_other_head_dims(d, dv):
    """Any head dim up to 256 (a multiple of 8) and any head_dim_v up to it run on the next
    compiled widths, padded in the kernel (flag `padded`) exactly when a tensor's is narrower."""
    assert sm80_launch.FORWARD.can_implement(make_spec(head_dim=d, head_dim_v=dv)) is None
    cfg = config.fwd_config(cutlass.BFloat16, d, dv, False, False, False, False, False,
                            smem_limit=163 * 1024)
    widths = config.SUPPORTED_HEAD_DIMS
    assert (cfg.head_dim, cfg.head_dim_v) == tuple(min(w for w in widths if w >= x) for x in (d, dv))
    assert cfg.padded == ((d, dv) != (cfg.head_dim, cfg.head_dim_v))


@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
def test_sm80_forward_serves_supported_problems(d):
    for mask in (dict(), dict(causal=True), dict(local=True, window_left=64, window_right=0),
                 dict(has_softcap=True, softcap=30.0), dict(varlen_q=True, varlen_k=True),
                 dict(has_sink=True), dict(has_sink=True, varlen_q=True, varlen_k=True)):
        spec = make_spec(head_dim=d, head_dim_v=d, **mask)
        assert sm80_launch.FORWARD.can_implement(spec) is None
        assert all(c.has_sink == spec.has_sink for c in sm80_launch.sm80_configs(spec))


def test_launch_scalars_match_the_kernel_arguments():
    from cuteattn.kernels.sm80 import arguments
    scalars = sm80_launch.launch_scalars(make_spec(causal=True))
    every = {a.name for a in arguments.common.flat(arguments.ARGUMENTS)}
    assert set(scalars) | {"num_splits"} == {a.name for a in arguments.SCALARS}
    # the forward fixes one split; the decode kernel passes the split count per call
    assert set(sm80_launch.PER_CALL) | set(scalars) | {"num_splits"} == every
    assert set(sm80_launch.DECODE_PER_CALL) | set(scalars) == every


def test_declaration_matches_kernel_signature():
    """sm80/arguments.ARGUMENTS is FlashFwdSm80's parameter list: same names, same order, then
    the stream; and one fake per parameter, the varlen tensors only where the config uses them."""
    import inspect
    from cuteattn.kernels.common import arguments as common
    from cuteattn.kernels.sm80 import arguments
    from cuteattn.kernels.sm80.fwd import FlashFwdSm80
    params = [p for p in inspect.signature(inspect.unwrap(FlashFwdSm80.__call__)).parameters
              if p != "self"]
    assert list(common.names(arguments.ARGUMENTS)) + [common.STREAM] == params
    for varlen in (False, True):
        cfg = config.fwd_config(cutlass.BFloat16, 128, 128, True, False, False, varlen, varlen)
        fakes = arguments.fakes(cfg)
        assert len(fakes) == len(params) - 1
        by_name = dict(zip(common.names(arguments.ARGUMENTS), fakes))
        assert (by_name["mCuSeqlensQ"] is not None) == varlen
        assert by_name["mSeqUsedQ"] is None and by_name["mSeqUsedK"] is None


# ---- the decode family (flash_attn_with_kvcache) ----

def decode_spec(**kw):
    return make_spec(**{**dict(kind="decode", seqlen_q=1, seqlen_k=4096, has_seqused_k=True), **kw})


def test_decode_serves_the_cache_forms():
    for form in (dict(), dict(paged_kv=True, page_size=16), dict(has_kv_batch_idx=True),
                 dict(has_leftpad_k=True), dict(causal=True, paged_kv=True, page_size=256),
                 dict(local=True, window_left=64, window_right=0), dict(has_softcap=True, softcap=5.0),
                 dict(has_sink=True)):
        assert sm80_launch.DECODE.can_implement(decode_spec(**form)) is None, form


@pytest.mark.parametrize("fields,reason", [
    (dict(head_dim=80, head_dim_v=80), "head_dim 80 (v: 80) is not supported by the sm80 decode kernel"),
    (dict(dtype=torch.float32), "dtype torch.float32 is not supported by the sm80 decode kernel"),
])
def test_decode_reasons(fields, reason):
    assert sm80_launch.DECODE.can_implement(decode_spec(**fields)).startswith(reason)


@pytest.mark.parametrize("target,served", [("sm_80", False), ("sm_86", False), ("sm_89", True),
                                           ("sm_90a", True), ("sm_120a", True)])
@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_decode_reads_an_fp8_cache_from_sm89(monkeypatch, target, served, cache):
    """An fp8 cache is converted in hardware (cvt ...e4m3x2 / e5m2x2, sm_89 on): older targets
    decline it with the reason; its spec's compile key holds the cache's dtype."""
    monkeypatch.setenv("CUTE_DSL_ARCH", target)
    spec = decode_spec(kv_dtype=cache)
    reason = sm80_launch.DECODE.can_implement(spec)
    assert (reason is None) if served else "needs sm_89 or later" in reason
    assert spec.compile_key() != decode_spec().compile_key()
    assert "a torch.float16 cache" in sm80_launch.DECODE.can_implement(decode_spec(kv_dtype=torch.float16))


@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
def test_decode_fp8_ring_fits_and_counts_its_bytes(d):
    """An fp8 cache's config: a ring of at least 2 stages of bytes plus one converted K/V block,
    counted in smem_bytes, within sm_86's 99 KB (and half of it when 2 CTAs fit)."""
    cfg = config.decode_config(cutlass.BFloat16, d, d, False, False, False, False, False, 16, True,
                               4, kv_fp8=cutlass.Float8E4M3FN)
    dense = config.decode_config(cutlass.BFloat16, d, d, False, False, False, False, False, 16,
                                 True, 4)
    kv_block = cfg.tile_n * 2 * d
    assert cfg.kv_stages >= 2 and cfg.smem_bytes() <= 99 * 1024
    assert cfg.smem_bytes() == cfg.tile_m * d * 2 + cfg.kv_stages * kv_block + kv_block * 2
    assert cfg.kv_stages >= dense.kv_stages  # (bytes: at least as deep a ring)


@pytest.mark.parametrize("page", [16, 32, 48, 128, 256, 1024])
@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
def test_decode_key_blocks_read_whole_pages(page, d):
    """A paged key block lies inside one page (one lookup per block), or, gathering pages, each
    of its copy passes does (one lookup per pass): the block stays as wide as the tile's."""
    from cuteattn.kernels.sm80 import mma
    from cuteattn.kernels.sm80.fwd import FlashFwdSm80
    cfg = config.decode_config(cutlass.BFloat16, d, d, False, False, False, False, False, page, True)
    assert cfg.tile_n % 16 == 0 and cfg.paged_kv and cfg.split_kv
    if cfg.gather_pages:
        assert page % cfg.tile_n != 0 and cfg.tile_n == config.DECODE_TILES[d][1]
        assert page % mma.rows_per_copy_pass(cfg.dtype, cfg.num_threads, d) == 0
    else:
        assert page % cfg.tile_n == 0
    if d in (64, 128):  # 64-key blocks at every page size
        assert cfg.tile_n == 64
    assert cfg.has_seqused_k and not cfg.varlen_q and not cfg.varlen_k
    FlashFwdSm80(cfg)  # its copy passes fit the tile (asserted at construction)


@pytest.mark.parametrize("smem", [163 * 1024, 99 * 1024], ids=["sm_80", "99KB"])
def test_decode_split_keys_config(smem):
    """Decoding's split-keys tile: a 16-row tile, 16 keys a warp of a 64-key ring
    stage, the pack-GQA group at 16 rows; where a copy pass of q or o would not fit 16 rows
    (d=96) or no ring fits (d=256's 16-key blocks), the usual tile."""
    from cuteattn.kernels.sm80.fwd import KEYS_PER_WARP, FlashFwdSm80
    args = (False, False, False, False, False, 128, True)
    for d, gqa in ((64, 8), (128, 4), (128, 16)):
        cfg = config.decode_config(cutlass.BFloat16, d, d, *args, gqa, smem_limit=smem,
                                   split_keys=True)
        assert cfg.split_keys and (cfg.tile_m, cfg.tile_n) == (16, KEYS_PER_WARP * cfg.num_warps)
        assert cfg.pack_gqa == gqa and cfg.kv_stages >= 2 and cfg.smem_bytes() <= smem
        FlashFwdSm80(cfg)
    for d in (96, 256):
        cfg = config.decode_config(cutlass.BFloat16, d, d, *args, 4, smem_limit=smem,
                                   split_keys=True)
        assert not cfg.split_keys and cfg.tile_m == config.DECODE_TILES[d][0]
    off = config.decode_config(cutlass.BFloat16, 128, 128, *args, 4, smem_limit=smem)
    assert not off.split_keys and off.tile_m == 64


def test_decode_takes_split_keys_only_for_steps_of_16_rows():
    """DecodeLaunch chooses the split-keys tile for steps whose rows a kv head (seqlen_q x
    the GQA group, all packed) fit 16; not for longer steps or groups pack-GQA cannot pack."""
    take = lambda sq, h, hk: sm80_launch.DecodeLaunch(make_spec(
        kind="decode", seqlen_q=sq, nheads=h, nheads_k=hk, has_seqused_k=True)).split_keys
    assert take(1, 32, 8) and take(4, 32, 8) and take(1, 16, 1)
    assert not take(5, 32, 8) and not take(1, 12, 4) and not take(1, 32, 1)


def test_kvcache_hands_an_fp8_cache_and_its_descales_to_the_kernel(monkeypatch):
    """With an fp8 cache the decode spec carries the cache's dtype, the new tokens are appended
    quantized (value / descale, as the reference stores them) and the launch gets the descales."""
    from cuteattn import api, flash_attn_with_kvcache, kvcache
    from cuteattn.reference import _store
    seen = {}

    class Recorder:
        def __call__(self, q, k_cache, v_cache, out, lse, seqused_k, kv_batch_idx, leftpad,
                     page_table, num_splits, learnable_sink=None, k_descale=None, v_descale=None):
            seen.update(k_descale=k_descale, v_descale=v_descale, k_cache=k_cache)
            out.zero_()
            lse.zero_()

    monkeypatch.setattr(api, "_select_kernel", lambda spec, device: (seen.update(spec=spec) or Recorder(), None))
    monkeypatch.setattr(kvcache, "_decode_launches", {})
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache = (torch.randn(2, 32, 2, 64) * 3).to(torch.float8_e4m3fn)
    v_cache = k_cache.clone()
    k, v = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16), torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    kd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 30], dtype=torch.int32),
                            k_descale=kd, v_descale=vd)
    assert seen["spec"].kv_dtype == torch.float8_e4m3fn and seen["spec"].dtype == torch.bfloat16
    assert seen["k_descale"] is kd and seen["v_descale"] is vd and seen["k_cache"] is k_cache
    for i, n in enumerate((3, 30)):
        assert torch.equal(k_cache[i, n], _store(k[i, 0], torch.float8_e4m3fn, kd[i].view(2, 1)))
        assert torch.equal(v_cache[i, n], _store(v[i, 0], torch.float8_e4m3fn, vd[i].view(2, 1)))


def test_kvcache_dispatches_to_the_decode_family(monkeypatch):
    """flash_attn_with_kvcache builds a decode spec with the cache's forms and hands the kernel
    the appended cache (a recording launch stands in for the GPU)."""
    from cuteattn import api, flash_attn_with_kvcache
    seen = {}

    class Recorder:
        def __call__(self, q, k_cache, v_cache, out, lse, seqused_k, kv_batch_idx, leftpad,
                     page_table, num_splits, learnable_sink=None):
            seen.update(q=q, seqused_k=seqused_k, page_table=page_table, splits=num_splits)
            out.zero_()
            lse.zero_()

    def select(spec, device):
        seen["spec"] = spec
        return Recorder(), None

    from cuteattn import kvcache
    monkeypatch.setattr(api, "_select_kernel", select)
    monkeypatch.setattr(kvcache, "_decode_launches", {})  # (kept launches stay with this test)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[3, 1, 5], [0, 2, 4]], dtype=torch.int32)
    k = torch.randn(2, 1, 2, 64, dtype=torch.bfloat16)
    out = flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k, k, cache_seqlens=torch.tensor(
        [3, 40], dtype=torch.int32), block_table=table, causal=True, num_splits=4)
    spec = seen["spec"]
    assert spec.kind == "decode" and spec.paged_kv and spec.page_size == 16 and spec.causal
    assert spec.has_seqused_k and not spec.has_kv_batch_idx and not spec.has_leftpad_k
    assert seen["seqused_k"].tolist() == [4, 41] and seen["splits"] == 4
    assert seen["page_table"] is table and out.shape == (2, 1, 8, 64)
    # the new key of sequence 0 at position 3: page table[0][0] = 3, row 3; of sequence 1 at
    # position 40: page table[1][40 // 16] = 4, row 40 % 16 = 8
    assert torch.equal(k_cache[3, 3], k[0, 0]) and torch.equal(k_cache[4, 8], k[1, 0])
    # a second step reuses the launch made for the spec: no second kernel choice
    seen.pop("spec")
    flash_attn_with_kvcache(q, k_cache, k_cache.clone(), k, k, cache_seqlens=torch.tensor(
        [4, 41], dtype=torch.int32), block_table=table, causal=True, num_splits=4)
    assert "spec" not in seen and seen["seqused_k"].tolist() == [5, 42]


@pytest.mark.parametrize("ratio,group", [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (64, 64),
                                         (6, 1), (7, 1), (128, 1)])
def test_pack_gqa_group(ratio, group):
    """Every query head of a kv head shares a 64-row decode tile when the ratio divides it."""
    cfg = config.decode_config(cutlass.BFloat16, 128, 128, False, False, False, False, False, 0,
                               False, ratio)
    assert cfg.pack_gqa == group and cfg.tile_m % group == 0


@pytest.mark.parametrize("page", [16, 48, 128])
@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
def test_paged_prefill_is_served_with_pages_read_whole(page, d):
    """flash_attn_varlen_func(block_table=): packed q, keys in pages (lengths as seqused_k)."""
    from cuteattn.kernels.sm80.fwd import FlashFwdSm80
    spec = make_spec(head_dim=d, head_dim_v=d, varlen_q=True, varlen_k=True, paged_kv=True,
                     page_size=page, causal=True)
    assert sm80_launch.FORWARD.can_implement(spec) is None
    cfg, = sm80_launch.sm80_configs(spec)  # (one candidate: the decode tiles)
    assert cfg.paged_kv and cfg.varlen_q and not cfg.varlen_k and cfg.has_seqused_k
    assert (page % cfg.tile_n == 0 or cfg.gather_pages) and cfg.pack_gqa == 1
    FlashFwdSm80(cfg)
    # a learnable sink: the epilogue's denominator, as in the forward
    with_sink = make_spec(head_dim=d, head_dim_v=d, varlen_q=True, varlen_k=True, paged_kv=True,
                          page_size=page, has_sink=True)
    assert sm80_launch.FORWARD.can_implement(with_sink) is None
    cfg, = sm80_launch.sm80_configs(with_sink)
    assert cfg.has_sink and cfg.paged_kv


def test_paged_varlen_dispatches_to_the_forward_with_pages(monkeypatch):
    """flash_attn_varlen_func(block_table=) hands the kernel the pages, the page table, the
    key lengths as seqused_k (from cu_seqlens_k on the device) and a learnable sink; a
    recording launch stands in."""
    from cuteattn import api, flash_attn_varlen_func
    seen = {}

    def launch(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, page_table=None,
               learnable_sink=None):
        seen.update(cu_k=cu_k, used_k=used_k, table=page_table, k=k, sink=learnable_sink)
        out.zero_()
        lse.zero_()

    def select(spec, device):
        seen["spec"] = spec
        return launch, None

    monkeypatch.setattr(api, "_select_kernel", select)
    q = torch.randn(7, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(5, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[4, 0], [1, 3]], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 31], dtype=torch.int32)
    out = flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 4, 20, causal=True, block_table=table)
    spec = seen["spec"]
    assert spec.paged_kv and spec.page_size == 16 and spec.varlen_q and spec.causal
    assert seen["cu_k"] is None and seen["used_k"].tolist() == [20, 11]
    assert seen["table"] is table and seen["k"] is cache and out.shape == (7, 4, 64)
    assert seen["sink"] is None
    sink = torch.randn(4)
    flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 4, 20, block_table=table,
                           learnable_sink=sink)
    assert seen["spec"].has_sink and seen["sink"] is sink


# ---- the backward family ----

def test_backward_serves_and_declines_with_reasons(monkeypatch):
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.kernels.sm80.bwd import FlashBwdSm80
    for d in launch_bwd.SUPPORTED_HEAD_DIMS:
        for form in (dict(), dict(causal=True), dict(local=True, window_left=10, window_right=0),
                     dict(has_softcap=True, softcap=3.0), dict(varlen_q=True, varlen_k=True)):
            spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d, **form)
            assert launch_bwd.BACKWARD.can_implement(spec) is None, (d, form)
            det = make_spec(kind="bwd", head_dim=d, head_dim_v=d, deterministic=True, **form)
            assert launch_bwd.BACKWARD.can_implement(det) is None, (d, form)
            assert launch_bwd.bwd_config(det).deterministic
            cfg = launch_bwd.bwd_config(spec)
            FlashBwdSm80(cfg)  # its copies and MMA layouts fit the tile
            assert cfg.smem_bytes() <= 163 * 1024
            if d <= 128:  # (over 128 the tile is by the target's shared memory: the passes' test)
                small = launch_bwd.bwd_config(spec, 8, 99 * 1024)
                FlashBwdSm80(small)
                assert small.smem_bytes() <= 99 * 1024
    reasons = {
        "head_dim 264 (head_dim_v 264) has no sm80 backward": dict(head_dim=264, head_dim_v=264),
        "head_dim 64 (head_dim_v 128) has no sm80 backward": dict(head_dim=64, head_dim_v=128),
    }
    # v narrower than q (MLA's 192 / 128): v and dO read zero-filled, as a padded head dim
    for d, dv in ((192, 128), (128, 64), (96, 40), (80, 64)):
        spec = make_spec(kind="bwd", head_dim=d, head_dim_v=dv, causal=True)
        assert launch_bwd.BACKWARD.can_implement(spec) is None, (d, dv)
        cfg = launch_bwd.bwd_config(spec)
        assert cfg.padded and cfg.head_dim == launch_bwd.compiled_width(d, launch_bwd.SUPPORTED_HEAD_DIMS)
    assert launch_bwd.BACKWARD.can_implement(make_spec(kind="bwd", has_sink=True)) is None
    for reason, fields in reasons.items():
        assert launch_bwd.BACKWARD.can_implement(make_spec(kind="bwd", **fields)).startswith(reason)
    monkeypatch.delenv("CUTEATTN_PATH")  # the family's own archs serve it without asking by name
    assert launch_bwd.BACKWARD.can_implement(make_spec(kind="bwd")) is None


def test_backward_over_128_in_column_passes():
    """Head dims over 128 where the grids' 64 x 64 tile does not fit (the 99 KB targets): dK
    and dV in 64-column passes, the tile the first that fits, its copies and MMA layouts valid;
    padded widths between 128 and 256 too; the family serves them."""
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.kernels.sm80.bwd import FlashBwdSm80
    smem = 99 * 1024
    for d, width in ((192, 192), (256, 256), (160, 192), (200, 256)):
        for form in (dict(), dict(causal=True), dict(varlen_q=True, varlen_k=True),
                     dict(deterministic=True)):
            spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d, **form)
            cfg = launch_bwd.bwd_config(spec, 8, smem)
            assert (cfg.head_dim, cfg.kv_passes, cfg.padded) == (width, width // 64, d != width)
            assert (cfg.kv_parts, cfg.q_parts, cfg.grid) == (1, 1, False)
            assert cfg.smem_bytes() <= smem
            FlashBwdSm80(cfg)
    big = launch_bwd.bwd_config(make_spec(kind="bwd", head_dim=256, head_dim_v=256), 8, smem)
    assert (big.tile_m, big.tile_n) == (32, 32)
    wide = make_spec(kind="bwd", head_dim=192, head_dim_v=192)
    assert launch_bwd.BACKWARD.can_implement(wide) is None
    assert launch_bwd.bwd_config(wide, 8, smem).kv_passes == 3


def test_backward_rings_q_and_do_where_they_fit():
    """Q and dO in two buffers (the next query block's loads in flight during this one's GEMMs)
    where the target's shared memory holds both; one buffer where it does not."""
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.kernels.sm80.bwd import FlashBwdSm80
    from cuteattn.kernels.sm80.bwd_grid import FlashBwdSm80Grid
    stages = lambda d, smem: launch_bwd.bwd_config(
        make_spec(kind="bwd", head_dim=d, head_dim_v=d), 8, smem).q_stages
    # sm_80's 163 KB: every width but 256 (K, V, P, dS and two Q/dO stages: 209 KB)
    assert [stages(d, 163 * 1024) for d in (64, 96, 128, 192, 256)] == [2, 2, 2, 2, 1]
    # 99 KB: d=64 (81 KB) and d=256's 32 x 32 tile (98.5 KB); not d=96/128/192 (113 / 105 /
    # 100.5 KB)
    assert [stages(d, 99 * 1024) for d in (64, 96, 128, 192, 256)] == [2, 1, 1, 1, 2]
    for d in (64, 128, 256):
        for smem in (99 * 1024, 163 * 1024, 227 * 1024):
            cfg = launch_bwd.bwd_config(make_spec(kind="bwd", head_dim=d, head_dim_v=d,
                                                  causal=True), 8, smem)
            assert cfg.smem_bytes() <= smem
            (FlashBwdSm80Grid if cfg.grid else FlashBwdSm80)(cfg)


def test_backward_pads_head_dims_between_widths(monkeypatch):
    """The portable backward runs a head dim between its widths on the next one up (padded
    loads; launch_common.bwd_buffers gives the gradient buffers that width)."""
    from cuteattn.kernels.sm80 import launch_bwd
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_86")
    for d, width in ((8, 64), (40, 64), (80, 96), (112, 128)):
        spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d)
        assert launch_bwd.BACKWARD.can_implement(spec) is None
        cfg = launch_bwd.bwd_config(spec)
        assert cfg.head_dim == width and cfg.padded
        assert not launch_bwd.bwd_config(make_spec(kind="bwd", head_dim=width, head_dim_v=width)).padded
    assert launch_bwd.BACKWARD.can_implement(make_spec(kind="bwd", head_dim=128, head_dim_v=64)) is None
    assert "head_dim_v 72" in launch_bwd.BACKWARD.can_implement(
        make_spec(kind="bwd", head_dim=64, head_dim_v=72))  # (v wider than q: the reference)


def test_backward_declaration_matches_kernel_signature():
    import inspect
    from cuteattn.kernels.common import arguments as common
    from cuteattn.kernels.launch_common import BWD_PER_CALL
    from cuteattn.kernels.sm80 import arguments
    from cuteattn.kernels.sm80.bwd import FlashBwdSm80
    params = [p for p in inspect.signature(inspect.unwrap(FlashBwdSm80.__call__)).parameters
              if p != "self"]
    assert list(common.names(arguments.BWD_ARGUMENTS)) + [common.STREAM] == params
    fixed = {"qhead_per_kvhead", "softmax_scale", "score_scale", "softmax_scale_log2",
             "window_left", "window_right"}
    # both backward kernels take the common list; sm90's has the block-sparse lists and a
    # traced mask_mod's tensors too
    from cuteattn.kernels.sm90 import arguments as sm90_arguments
    sparse = (common.group_names("sparse", (common.SPARSE,))
              + common.group_names("sparse_backward", (sm90_arguments.SPARSE_BACKWARD,))
              + common.group_names("bwd_mod", (sm90_arguments.BWD_MOD,)))
    assert common.names(arguments.BWD_ARGUMENTS) == tuple(
        n for n in sm90_arguments.names(sm90_arguments.BWD_ARGUMENTS) if n not in sparse)
    assert set(BWD_PER_CALL) | fixed == set(common.names(arguments.BWD_ARGUMENTS))


def test_sm120_serves_packed_sequences_at_d128_on_smaller_tiles(monkeypatch):
    """sm_12x's compiler spills at d=128 with packed sequences on the 64-query tiles; the
    candidates after them (32 queries a block) compile spill-free there
    (tests/test_compile_sm80.py), so the family serves those calls rather than declining."""
    from cuteattn.kernels.sm80 import launch_bwd
    monkeypatch.setattr(launch_bwd, "_major", lambda spec: 12)
    packed = make_spec(kind="bwd", varlen_q=True, varlen_k=True)
    assert launch_bwd.BACKWARD.can_implement(packed) is None
    tiles = [(c.tile_m, c.tile_n, c.num_warps) for c in launch_bwd.bwd_configs(packed, 12, 99 * 1024)]
    assert tiles[0] == (64, 64, 4) and tiles[1:] == [(32, 64, 4)] * (len(tiles) - 1)
    assert launch_bwd.BACKWARD.can_implement(make_spec(kind="bwd")) is None
    # (d=128 without packed sequences: 32 x 64 x 4 tiles in two 16-query sub-blocks)
    cfg = launch_bwd.bwd_config(make_spec(kind="bwd"), 12, 99 * 1024)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.q_parts) == (32, 64, 4, 2)
    assert launch_bwd.bwd_config(make_spec(kind="bwd", head_dim=96, head_dim_v=96), 12,
                                 99 * 1024).q_parts == 4


def test_the_first_spill_free_candidate_is_taken():
    """compile_common.first_spill_free: the first candidate whose compile reports no spill; the
    last candidate when every one spills; candidates after the choice are not compiled."""
    from cuteattn.kernels.compile_common import first_spill_free
    spills = {"a": 8, "b": 0, "c": 0}
    compiled = []

    def compile_with_report(cfg):
        compiled.append(cfg)
        return f"kernel {cfg}", {"registers": 255, "spill_store_bytes": spills[cfg]}

    assert first_spill_free(["a", "b", "c"], compile_with_report)[:2] == ("b", "kernel b")
    assert compiled == ["a", "b"]
    spills.update(b=4, c=16)
    assert first_spill_free(["a", "b", "c"], compile_with_report)[0] == "c"
    assert first_spill_free(["a"], compile_with_report)[0] == "a"


def test_d256_prefers_64_key_blocks_and_lists_narrower_ones():
    """d = 256: 64-key blocks first (faster where they compile spill-free), then 32 and 16."""
    configs = config.fwd_configs(cutlass.BFloat16, 256, 256, False, False, False, False, False,
                                 smem_limit=99 * 1024)
    assert [(c.tile_m, c.tile_n, c.num_warps) for c in configs] == [(64, 64, 4), (64, 32, 4), (64, 16, 4)]


@pytest.mark.parametrize("d", config.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("capability", sorted(config.SMEM_BY_CAPABILITY))
def test_decode_ring_fits_the_device(d, capability):
    """The decode kernel keeps kv_stages K/V blocks in flight: as many (up to 4) as fit half the
    device's shared memory (two CTAs per SM), else as many as fit."""
    smem = config.SMEM_BY_CAPABILITY[capability]
    cfg = config.decode_config(cutlass.BFloat16, d, d, False, False, False, False, False, 16, True,
                               4, smem_limit=smem)
    size = lambda stages: dataclasses.replace(cfg, kv_stages=stages).smem_bytes()
    assert 1 <= cfg.kv_stages <= 4 and cfg.smem_bytes() <= smem
    if size(2) <= smem // 2:  # two CTAs per SM: the most stages that keep them
        assert cfg.smem_bytes() <= smem // 2 and (cfg.kv_stages == 4 or size(cfg.kv_stages + 1) > smem // 2)
    elif size(2) <= smem:  # one CTA: the most stages that fit
        assert cfg.kv_stages == 4 or size(cfg.kv_stages + 1) > smem
    else:
        assert cfg.kv_stages == 1
    if d in (64, 128, 256):  # the common head dims get a ring everywhere
        assert cfg.kv_stages >= 2


H200_SMEM = 227 * 1024


def test_decode_ctas_per_sm_where_split_kv_makes_the_grid():
    """config.decode_ctas_per_sm: where the tiles leave the GPU to split-KV, 3 CTAs an SM for an
    fp8 cache (a ring that fits a third of the shared memory) but on the warp-local tile over
    pages that hold whole key blocks, and 1 for a bf16 cache whose key blocks do not gather
    pages; 2 otherwise (the tiles fill the GPU alone: the bench's batch 64 over 8 kv heads, 128
    over 4; or 16-key pages)."""
    tiles = lambda b, hk: config.decode_work_tiles(b, 32, hk, 1)
    assert tiles(8, 8) == 64 and tiles(1, 4) == 4 and config.decode_work_tiles(2, 12, 4, 1) == 24
    for b, hk in ((1, 8), (8, 4), (8, 8)):
        assert config.decode_ctas_per_sm(True, False, tiles(b, hk), 132, H200_SMEM) == 3
        assert config.decode_ctas_per_sm(True, True, tiles(b, hk), 132, H200_SMEM) == 3
        assert config.decode_ctas_per_sm(True, False, tiles(b, hk), 132, H200_SMEM, True) == 2
        assert config.decode_ctas_per_sm(True, True, tiles(b, hk), 132, H200_SMEM, True) == 3
        assert config.decode_ctas_per_sm(False, False, tiles(b, hk), 132, H200_SMEM) == 1
        assert config.decode_ctas_per_sm(False, True, tiles(b, hk), 132, H200_SMEM) == 2
    for b, hk in ((64, 8), (128, 4)):
        for fp8, gathers in ((True, False), (False, False), (False, True)):
            assert config.decode_ctas_per_sm(fp8, gathers, tiles(b, hk), 132, H200_SMEM) == 2
    # (between: 4 x 32 kv heads is 128 tiles, over 80% of 132 slots: bf16 2, fp8 still 3)
    assert config.decode_ctas_per_sm(False, False, 128, 132, H200_SMEM) == 2
    assert config.decode_ctas_per_sm(True, False, 128, 132, H200_SMEM) == 3
    # (a 100 KB GPU keeps 2 for bf16: 1 was measured on the H200 only)
    assert config.decode_ctas_per_sm(False, False, 4, 84, 99 * 1024) == 2
    args = (False, False, False, False, False, 128, True, 4)
    three = config.decode_config(cutlass.BFloat16, 128, 128, *args, smem_limit=227 * 1024,
                                 kv_fp8=cutlass.Float8E4M3FN, split_keys=True, ctas_per_sm=3)
    two = config.decode_config(cutlass.BFloat16, 128, 128, *args, smem_limit=227 * 1024,
                               kv_fp8=cutlass.Float8E4M3FN, split_keys=True)
    # (the warp-local tile: padded rows of bytes, nothing converted in shared memory; its
    # registers bounded for the CTAs an SM)
    assert three.warp_local and two.warp_local and (three.min_ctas_per_sm, two.min_ctas_per_sm) == (3, 2)
    assert three.kv_stages == 3 and 3 * three.smem_bytes() <= 227 * 1024 < 3 * two.smem_bytes()
    one = config.decode_config(cutlass.BFloat16, 128, 128, *args, smem_limit=227 * 1024,
                               split_keys=True, ctas_per_sm=1)
    assert one.kv_stages == 4


@pytest.mark.parametrize("page, fp8, gathers", [(0, False, False), (128, False, False),
                                                (64, False, False), (16, False, True),
                                                (16, True, True), (0, True, False)])
def test_decode_grid_reads_the_spec(page, fp8, gathers):
    """config.decode_grid: the spec's tiles, and the CTAs an SM from its cache (fp8 or not) and
    whether its pages hold whole key blocks (d=128: 64 keys); kvcache._splits counts with it."""
    spec = AttentionSpec(batch=1, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=8, head_dim=128,
                         head_dim_v=128, dtype=torch.bfloat16, causal=True, local=False,
                         has_softcap=False, varlen_q=False, varlen_k=False, paged_kv=page > 0, page_size=page,
                         kv_dtype=torch.float8_e4m3fn if fp8 else None)
    # (one query row over GQA 4 at d=128: the split-keys tile, warp-local over an fp8 cache)
    assert config.decode_grid(spec, 132, H200_SMEM) == (
        8, config.decode_ctas_per_sm(fp8, gathers, 8, 132, H200_SMEM, fp8))
    # a head dim without a decode kernel (the reference serves it) still gets a count
    unserved = dataclasses.replace(spec, head_dim=80, head_dim_v=80)
    assert config.decode_grid(unserved, 132, H200_SMEM)[0] == 8


def test_decode_warp_local_config():
    """The split-keys tile of an fp8 cache loads (and converts) each warp's keys by its own
    lanes (warp_local; a warp's copy passes tile its 16 keys at d 64/128/192); a bf16 cache's
    tile does not (measured neutral), and no tile off the split-keys one does."""
    from cuteattn.kernels.sm80.fwd import FlashFwdSm80
    args = (False, False, False, False, False, 16, True)
    for d, gqa in ((64, 8), (128, 4), (192, 2)):
        cfg = config.decode_config(cutlass.BFloat16, d, d, *args, gqa, smem_limit=227 * 1024,
                                   kv_fp8=cutlass.Float8E4M3FN, split_keys=True)
        assert cfg.split_keys and cfg.warp_local
        FlashFwdSm80(cfg)
        plain = config.decode_config(cutlass.BFloat16, d, d, *args, gqa, smem_limit=227 * 1024,
                                     split_keys=True)
        assert plain.split_keys and not plain.warp_local
    off = config.decode_config(cutlass.BFloat16, 96, 96, *args, 4, smem_limit=227 * 1024,
                               kv_fp8=cutlass.Float8E4M3FN, split_keys=True)
    assert not off.split_keys and not off.warp_local


@pytest.mark.parametrize("nheads_k,num_splits,folds", [
    (8, 33, True),    # 4 packed rows, one a warp, 9 steps of 4 splits: the merge folds
    (4, 66, False),  # 8 rows, two a warp, 17 steps each: the combine kernel merges
    (8, 128, False),  # 32 steps
    (8, 2, True),
])
def test_decode_folds_only_short_merges(monkeypatch, nheads_k, num_splits, folds):
    """The folded merge's rule (config.decode_folds): the merge goes into the decode kernel's
    last split where its warps' chains of partial-row loads are FOLD_MAX_STEPS at most; never
    at 0 (an A/B's "off")."""
    spec = decode_spec(nheads=32, nheads_k=nheads_k)
    split_keys = config.decode_split_keys(spec)
    assert config.decode_folds(spec, split_keys, 1, num_splits) == folds
    monkeypatch.setattr(config, "FOLD_MAX_STEPS", 0)
    assert not config.decode_folds(spec, split_keys, 1, num_splits)


@pytest.mark.parametrize("capability", sorted(config.SMEM_BY_CAPABILITY))
def test_backward_layout_per_head_dim(capability):
    """The backward's layout: the two-dimensional warp grids (bwd_grid.py, 8 warps) where their
    tile fits the target's shared memory: 163 KB and more: 128 keys up to d=128, except d=128
    with a window, a padded head dim or packed sequences (they spill there), 64 keys
    over 128 (one pass); 99 KB: d=64 only. bwd.py's keys-as-rows layout elsewhere, with dQ on
    2 x 4 warps on its 8-warp tiles.
    Q and dO in a ring where it fits, except the grid's d=256 with packed sequences. Every
    chosen config fits the target's shared memory."""
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.kernels.sm80.bwd_grid import FlashBwdSm80Grid
    smem = config.SMEM_BY_CAPABILITY[capability]
    major = capability[0]
    big = smem >= 163 * 1024
    packed = dict(varlen_q=True, varlen_k=True)
    softcap = dict(has_softcap=True, softcap=30.0)
    # (head dim, switches, the grid's keys a CTA with 163 KB and more, with 99 KB; 0: bwd.py)
    for d, kw, keys_big, keys_small in [
            (64, {}, 128, 128), (64, dict(local=True), 128, 128), (64, softcap, 128, 128),
            (64, packed, 128, 128), (128, {}, 128, 0), (128, dict(causal=True, deterministic=True), 128, 0),
            (128, dict(local=True), 0, 0), (128, softcap, 128, 0), (128, packed, 0, 0),
            (112, {}, 0, 0), (96, {}, 128, 0), (80, {}, 128, 0), (192, {}, 64, 0),
            (192, dict(local=True), 64, 0), (160, packed, 64, 0), (256, {}, 64, 0),
            (256, softcap, 64, 0), (224, {}, 64, 0), (256, packed, 64, 0)]:
        spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d, **kw)
        cfg = launch_bwd.bwd_config(spec, major, smem)
        where = (capability, d, kw, cfg)
        keys = keys_big if big else keys_small
        assert cfg.smem_bytes() <= smem, where
        assert cfg.grid == (keys > 0), where
        assert cfg.dq_warps_m == (2 if cfg.num_warps == 8 else 0), where
        if cfg.grid:
            # (d=64 in 128-query blocks where they fit with the ring: not softcap or packed)
            tall = d == 64 and big and "softcap" not in kw and "varlen_q" not in kw
            assert (cfg.num_warps, cfg.kv_passes, cfg.tile_m, cfg.tile_n) == (
                8, 1, 128 if tall else 64, keys), where
            FlashBwdSm80Grid(cfg)  # (its tile asserts hold)
        if cfg.grid and cfg.head_dim == 256:  # (208 KB with a ring: the H200's 227 KB only)
            assert cfg.q_stages == (2 if smem >= 208 * 1024 and "varlen_q" not in kw else 1), where


def blocked_offset(order, row, head, col, heads, width):
    """Where the backward kernels add dQ's (row, head, col) in the blocked accumulator
    (common/dq_blocks.py, written out): 8-row groups, a head's 8 x width floats together,
    8-column blocks of 64 floats ordered (column parity, row, column pair) for one float a
    lane ("single") or (row, column) for pairs."""
    group = (row // 8) * 8 * heads * width + head * 8 * width + (col // 8) * 64
    if order == "single":
        return group + (col % 2) * 32 + (row % 8) * 4 + (col // 2) % 4
    return group + (row % 8) * 8 + col % 8


@pytest.mark.parametrize("order", ["single", "pairs"])
@pytest.mark.parametrize("shape, width", [((2, 13, 3, 80), 96), ((24, 2, 64), 64)])
def test_blocked_dq_accumulator_reads_back_in_place(order, shape, width):
    """dq_from_accumulator undoes the kernels' blocked order: values put where a kernel adds
    (row, head, col) come back at (row, head, col), in q's dtype and head dim; rows not a
    multiple of 8 (fixed length 2 x 13) and packed rows (24) alike."""
    from cuteattn.kernels.launch_common import BackwardLaunch
    launch = BackwardLaunch.__new__(BackwardLaunch)  # (its dQ methods need no kernel)
    launch.dq_blocks = lambda: order
    q = torch.zeros(shape, dtype=torch.bfloat16)
    buffer, kernel_view = launch.dq_accumulator(q, width)
    assert kernel_view.shape == (*shape[:-1], width) and kernel_view.data_ptr() == buffer.data_ptr()
    rows, heads = q.shape[:-2].numel(), shape[-2]
    want = torch.randn(rows, heads, width)
    r, h, c = torch.meshgrid(torch.arange(rows), torch.arange(heads), torch.arange(width), indexing="ij")
    buffer.view(-1)[blocked_offset(order, r, h, c, heads, width).flatten()] = want.flatten()
    got = launch.dq_from_accumulator(buffer, q)
    assert got.shape == shape and got.dtype == q.dtype and got.is_contiguous()
    assert torch.equal(got, want.view(*shape[:-1], width)[..., :shape[-1]].to(q.dtype))


@pytest.mark.parametrize("shape", [(2, 13, 3, 64), (24, 2, 64)])
def test_split_dq_accumulators_are_summed_in_order(shape):
    """Split accumulators (Sm80BwdConfig.dq_splits): the buffer holds `splits` accumulators
    of the rows rounded up to 8, the kernel's view is the first one's; reading back sums them
    (in split order) into the single accumulator's result."""
    from cuteattn.kernels.launch_common import BackwardLaunch
    launch = BackwardLaunch.__new__(BackwardLaunch)
    launch.dq_blocks = lambda: "single"
    q = torch.zeros(shape, dtype=torch.float32)
    rows8 = (q.shape[:-2].numel() + 7) // 8 * 8
    buffer, kernel_view = launch.dq_accumulator(q, 64, splits=3)
    assert buffer.shape == (3 * rows8, shape[-2], 64) and not buffer.any()
    assert kernel_view.data_ptr() == buffer.data_ptr() and kernel_view.shape == shape
    parts = torch.randn(3, rows8, shape[-2], 64)
    buffer.copy_(parts.view(buffer.shape))
    single, _ = launch.dq_accumulator(q, 64)
    single.copy_(parts.sum(0))
    assert torch.equal(launch.dq_from_accumulator(buffer, q), launch.dq_from_accumulator(single, q))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 160, 192, 256])
def test_deterministic_dq_form_per_head_dim(monkeypatch, head_dim):
    """Deterministic dQ in split accumulators at compiled widths up to DQ_SPLITS_MAX_DIM (128;
    d=80 runs at 96, 160 at 192), above it in turns, descending under a causal or windowed mask
    only; every fallback candidate alike; a plain backward takes neither."""
    from cuteattn.kernels.sm80 import launch_bwd
    spec = lambda **kw: make_spec(kind="bwd", head_dim=head_dim, head_dim_v=head_dim, **kw)
    flags = lambda s: {(c.descending_turns, c.dq_splits) for c in launch_bwd.bwd_configs(s)}
    splits = head_dim <= 128
    for mask in (dict(causal=True), dict(local=True), {}):
        turns = {(bool(mask), False)}
        assert flags(spec(deterministic=True, **mask)) == ({(False, True)} if splits else turns)
        assert flags(spec(**mask)) == {(False, False)}
    monkeypatch.setattr(launch_bwd, "DQ_SPLITS_MAX_DIM", 0)  # (the tests' way to each form)
    assert flags(spec(deterministic=True, causal=True)) == {(True, False)}
    monkeypatch.setattr(launch_bwd, "DQ_SPLITS_MAX_DIM", 256)
    assert flags(spec(deterministic=True, causal=True)) == {(False, True)}


@pytest.mark.parametrize("batch, heads, seqlen, splits", [
    (1, 16, 16384, 8),    # 132 SMs x 1 CTA (8 warps) over 16 (batch, head) pairs
    (16, 16, 1024, 1),    # more pairs than CTAs the SMs hold: one split
    (1, 2, 512, 4),       # at most a sequence's key blocks (512 / 128)
    (1, 1, 1 << 20, 8)])  # DQ_SPLIT_BYTES: 4 GiB / (2^20 rows x 128 floats x 4 bytes)
def test_dq_split_count(monkeypatch, batch, heads, seqlen, splits):
    from cuteattn.kernels.sm80 import launch_bwd
    monkeypatch.setattr(launch_bwd, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_bwd, "shared_memory_per_sm", lambda index: 228 * 1024)
    launch = launch_bwd.BwdLaunch.__new__(launch_bwd.BwdLaunch)  # (no kernel compiled)
    launch.spec = make_spec(kind="bwd", head_dim=128, head_dim_v=128, nheads=heads,
                            nheads_k=heads, deterministic=True)
    launch.cfg = launch_bwd.bwd_config(launch.spec, 9, 227 * 1024)
    assert launch.cfg.dq_splits and launch.cfg.num_warps == 8 and launch.cfg.tile_n == 128
    q = torch.empty((batch, seqlen, heads, 128), device="meta")
    assert launch.dq_splits(q, q, None, None) == splits
    monkeypatch.setattr(launch_bwd, "DQ_SPLITS_MAX_DIM", 0)  # (turns: no splits)
    launch.cfg = launch_bwd.bwd_config(launch.spec, 9, 227 * 1024)
    assert launch.dq_splits(q, q, None, None) == 0


@pytest.mark.parametrize("lens, heads, splits", [
    ([2048] * 8, 16, 1),   # equal lengths: the (batch, head) pairs fill the SMs as at fixed length
    ([4096, 512, 3072, 1024, 2560, 1536, 2048, 1536], 16, 3),  # the longest: 132 x 4096 / (16 x 16384)
    ([8192] + [128] * 64, 16, 5),  # one long sequence among short ones: 132 x 8192 / (16 x 16384)
    ([100, 100], 1, 1)])   # at most the longest sequence's key blocks (not the total's)
def test_dq_split_count_packed(monkeypatch, lens, heads, splits):
    """Packed keys of unequal lengths: enough splits that the longest sequence's walk is not
    the whole backward's length (each split of a (sequence, head) walks its key blocks in
    turn), bounded by max_seqlen_k's key blocks."""
    from cuteattn.kernels.sm80 import launch_bwd
    monkeypatch.setattr(launch_bwd, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_bwd, "shared_memory_per_sm", lambda index: 228 * 1024)
    launch = launch_bwd.BwdLaunch.__new__(launch_bwd.BwdLaunch)  # (no kernel compiled)
    launch.spec = make_spec(kind="bwd", head_dim=128, head_dim_v=128, nheads=heads,
                            nheads_k=heads, deterministic=True, varlen_q=True, varlen_k=True,
                            batch=len(lens), seqlen_q=max(lens), seqlen_k=max(lens))
    launch.cfg = launch_bwd.bwd_config(launch.spec, 9, 227 * 1024)
    assert launch.cfg.dq_splits and launch.cfg.tile_n == 128
    q = torch.empty((sum(lens), heads, 128), device="meta")
    cu = torch.empty(len(lens) + 1, dtype=torch.int32, device="meta")
    assert launch.dq_splits(q, q, cu, cu) == splits


@pytest.mark.parametrize("order, lines", [("single", 1), ("pairs", 2)])
def test_blocked_dq_order_gives_each_warp_reduction_whole_lines(order, lines):
    """The values one red.global of a warp adds (lane l of an m16n8 accumulator: row l // 4 of
    an 8-row group, columns 2 (l % 4) + j of an 8-column block; one j an instruction with
    "single", both with "pairs") land on adjacent floats filling `lines` 128-byte lines."""
    lanes = torch.arange(32)
    for row0, col0, j in ((0, 0, 0), (8, 0, 1), (40, 24, 0), (16, 120, 1)):
        cols = [col0 + 2 * (lanes % 4) + j] if order == "single" else [
            col0 + 2 * (lanes % 4), col0 + 2 * (lanes % 4) + 1]
        offsets = torch.cat([blocked_offset(order, row0 + lanes // 4, 1, c, 4, 128) for c in cols])
        assert offsets.min() % 32 == 0
        assert torch.equal(offsets.sort().values, offsets.min() + torch.arange(32 * lines))


@pytest.mark.parametrize("major,smem", [(8, 163 * 1024), (8, 99 * 1024), (9, 227 * 1024),
                                        (10, 227 * 1024), (12, 99 * 1024)])
def test_backward_candidates_fall_back_to_smaller_register_needs(major, smem):
    """launch_bwd.bwd_configs: bwd_config first (what the rules pick), then configs that need
    fewer registers, the launch taking the first spill-free one (tests/test_compile_sm80.py
    compiles the forms whose first config spills on some target). Each fits the shared memory,
    none repeats, each builds its kernel's layouts; up to d=128 the last is 32 queries a
    block, over it bwd.py's 64-column passes."""
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.kernels.sm80.bwd import FlashBwdSm80
    from cuteattn.kernels.sm80.bwd_grid import FlashBwdSm80Grid
    packed = dict(varlen_q=True, varlen_k=True, has_seqused_q=True, has_seqused_k=True)
    for d in (64, 96, 128, 112, 192, 256):
        for kw in ({}, dict(causal=True), dict(has_softcap=True, softcap=30.0), packed,
                   dict(varlen_k=True), dict(deterministic=True, local=True, window_left=64)):
            spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d, **kw)
            cfgs = launch_bwd.bwd_configs(spec, major, smem)
            where = (major, smem, d, kw)
            assert cfgs[0] == launch_bwd.bwd_config(spec, major, smem), where
            assert len(set(cfgs)) == len(cfgs) and all(c.smem_bytes() <= smem for c in cfgs), where
            for cfg in cfgs:
                (FlashBwdSm80Grid if cfg.grid else FlashBwdSm80)(cfg)
            last = cfgs[-1]
            if d <= 128:
                assert (last.tile_m, last.tile_n, last.num_warps, last.q_parts, last.grid) == (
                    *launch_bwd.SMALL_TILE, 2, False), where
            else:
                assert last.kv_passes == last.head_dim // launch_bwd.PASS_COLS, where


def test_the_fallback_knob_starts_the_launch_later_in_the_candidates(monkeypatch):
    """CUTEATTN_SM80_BWD_FALLBACK=k: candidate k on (the last where there are fewer), so the
    H200 can run the configs other targets' compilers fall back to."""
    from cuteattn.kernels.sm80 import launch_bwd
    spec = make_spec(kind="bwd", causal=True, dtype=torch.float16)
    cfgs = launch_bwd.bwd_configs(spec, 9, 227 * 1024)
    assert len(cfgs) >= 3
    monkeypatch.delenv(launch_bwd.FALLBACK_ENV, raising=False)
    assert launch_bwd.launch_candidates(spec, 9, 227 * 1024) == cfgs
    monkeypatch.setenv(launch_bwd.FALLBACK_ENV, "2")
    assert launch_bwd.launch_candidates(spec, 9, 227 * 1024) == cfgs[2:]
    monkeypatch.setenv(launch_bwd.FALLBACK_ENV, "99")
    assert launch_bwd.launch_candidates(spec, 9, 227 * 1024) == cfgs[-1:]


def test_the_forward_fallback_knob_starts_later_in_the_candidates(monkeypatch):
    """CUTEATTN_SM80_FWD_FALLBACK=k: the forward's launch starts at candidate k (the last
    where there are fewer), so the H200 runs the smaller tiles other targets fall back to (d=64's
    64 x 64 x 4, which sm_100a takes with packed queries). Stand-in compiles: no spills."""
    compiled = []

    def fake_compiled(cfg, tvm_ffi):
        compiled.append(cfg)
        return object()
    monkeypatch.setattr(sm80_launch, "_compiled", fake_compiled)
    monkeypatch.setattr(sm80_launch.compile_cache, "kernel_info", lambda key: {"spill_store_bytes": 0})
    spec = make_spec(head_dim=64, head_dim_v=64, causal=True)
    cfgs = sm80_launch.sm80_configs(spec)
    monkeypatch.delenv(sm80_launch.FWD_FALLBACK_ENV, raising=False)
    assert sm80_launch.compiled_forward(spec, False)[0] == cfgs[0]
    monkeypatch.setenv(sm80_launch.FWD_FALLBACK_ENV, "99")
    cfg = sm80_launch.compiled_forward(spec, False)[0]
    assert cfg == cfgs[-1] and (cfg.tile_m, cfg.tile_n, cfg.num_warps) == (64, 64, 4)


def test_split_accumulators_through_the_launch(monkeypatch):
    """Split accumulators (d=128's deterministic form): a deterministic BwdLaunch call hands the kernel the split count as its grid
    x, no semaphores, and the first of `splits` accumulators laid one after another in one
    buffer, then sums them all into dq (CPU tensors; a stand-in kernel fills the buffer)."""
    from cuteattn.kernels.common import arguments as common_arguments
    from cuteattn.kernels.sm80 import launch_bwd
    seen = {}

    def kernel(*args):  # (the TVM-FFI call: the bound arguments, the stream left to TVM-FFI)
        seen.update(zip(common_arguments.names(launch_bwd.arguments.BWD_ARGUMENTS), args))
        buffer = torch.tensor([], dtype=torch.float32).set_(args[6].untyped_storage())
        buffer.fill_(1.0)  # every split's accumulator: 1 everywhere
    monkeypatch.setattr(launch_bwd, "use_tvm_ffi", lambda: True)
    monkeypatch.setattr(launch_bwd, "_compiled", lambda cfg, tvm_ffi: kernel)
    monkeypatch.setattr(launch_bwd.compile_cache, "kernel_info", lambda key: {"spill_store_bytes": 0})
    monkeypatch.setattr(launch_bwd, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_bwd, "shared_memory_per_sm", lambda index: 228 * 1024)
    b, s, h, d = 1, 1100, 16, 128
    spec = make_spec(kind="bwd", head_dim=d, head_dim_v=d, causal=True, deterministic=True,
                     nheads=h, nheads_k=h)
    launch = launch_bwd.BwdLaunch(spec)
    assert launch.cfg.dq_splits and launch.cfg.num_warps == 8 and launch.cfg.tile_n == 128
    q, k, v, out, dout = (torch.randn(b, s, h, d, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(b, h, s)
    dq, dk, dv = launch(dout, q, k, v, out, lse)
    assert seen["num_n_blocks"] == 8  # 132 SMs x 1 CTA over 16 heads; 9 key blocks
    assert tuple(seen["mSemaphore"].shape) == (h, 1)  # (the stand-in: no turns taken)
    assert seen["mdQacc"].shape == (b, s, h, d)
    assert seen["mdQacc"].untyped_storage().nbytes() == 8 * ((b * s + 7) // 8 * 8) * h * d * 4
    assert dq.shape == q.shape and torch.all(dq == 8)  # the eight splits summed
