"""Tile shapes of the sm80 forward per head dim, for the shared memory of the running arch.

Shared memory per block (opt-in): sm_80 (A100) 163 KB, sm_86/sm_89/sm_120 99 KB, sm_90 227 KB
(the path runs on Hopper for testing). A config that does not fit is never chosen: each head dim
lists its tiles from the preferred one down, and the first that fits is taken.

The launch takes the first listed tile that fits and compiles without register spills for the
target (compile_common.first_spill_free: the target's compiler decides, per variant; the last
tile is taken whatever it reports), and tests/test_compile_sm80.py checks that every variant's
choice is spill-free on every target. LOCAL_TILES narrows the list with a sliding window (two
column limits per row live: at d = 192 the 128-row tile spilled 4 bytes).
Measured on an H200 (docs/perf-log.md): 16 rows per warp (8 warps on 128 rows) costs ldmatrix
traffic; 32 rows per warp is faster, and compiles spill-free at d = 64, 96 and 128 with a
2-stage K/V ring (at d = 96 and 128 with 32-key blocks).
"""
import dataclasses
import math

import cutlass

from ..launch_common import compiled_width
from . import mma
from .combine import AT_ONCE_FOLDED
from .fwd import KEYS_PER_WARP, Sm80FwdConfig

TILES = {  # head_dim -> [(tile_m, tile_n, num_warps[, kv_stages]), ...], preferred first
    # d = 64: 32 rows per warp (4 warps on 128 rows) ran 1.12x the 8-warp tile on an H200 with
    # 8 bytes of spill; a 2-stage K/V ring makes it spill-free on sm_80 (not yet GPU-run)
    # (the last tile of each list: for a target whose compiler spills on every other one, as
    # sm_100a's did at d=64 with packed queries on all three 128-row tiles until the packed
    # tile coordinates were marked warp-uniform; benchmarks/dev_spill_sweep.py finds them)
    64: [(128, 64, 4, 2), (128, 128, 8), (128, 64, 4), (64, 64, 4)],
    # d = 96: the same tile, spill-free on sm_80/86/90a/100a/120a: 1.02-1.29x the 8-warp 64-key
    # tile on an H100 (64-key blocks on 4 warps ran faster still but spill 24-40 bytes)
    96: [(128, 32, 4, 2), (128, 64, 8), (64, 64, 4)],
    # d = 128: 32 rows per warp with 32-key blocks and a 2-stage ring is spill-free on sm_80/86/
    # 90a/120a with the lagging row max; it ran 1.01-1.24x the 8-warp 128-key tile on an H100
    # (the 1k causal cell most; 64-key blocks spill 100-350 bytes)
    128: [(128, 32, 4, 2), (128, 128, 8), (128, 64, 8), (64, 64, 4)],
    192: [(128, 64, 8), (64, 64, 4), (64, 32, 4)],
    # At d = 256 each warp's output is 128 registers whatever the tile (16 rows x 256). 64-key
    # blocks ran 1.45x faster than 16-key blocks on an H200 (254 registers, no spill there) but
    # spilled 4-76 bytes on some targets' variants (sm_80 fp16 varlen, sm_120a fp16 causal):
    # those take the next tile that compiles spill-free. 16-key blocks stay near 225 everywhere.
    256: [(64, 64, 4), (64, 32, 4), (64, 16, 4)],
}
LOCAL_TILES = {  # with a sliding window
    192: [(64, 64, 4), (64, 32, 4)],
}
SUPPORTED_HEAD_DIMS = tuple(TILES)
# The forward's row max lags (Sm80FwdConfig.lazy_rescale) at this head dim: two A/Bs on the H200
# (bf16, 1k-16k) gave +0.4-4.1% in all twelve d=128 cells; d=64 0.98-1.02, d=256 0.99-1.00
LAZY_RESCALE_HEAD_DIMS = (128,)
# Split decode steps merge in their last split's CTA (fold_combine; no combine launch) where that
# merge is short: its warps take the tile's rows in turn, each row over the splits
# AT_ONCE_FOLDED at a time, a chain of dependent L2 round trips after the tile's last key block
# (the combine kernel has a warp a row and 16 splits at a time). A/Bs (H200, graph replays): 9
# such steps a warp (4 rows over 33 splits) gained 2.6-3.6%, 34 (8 rows over 66) lost 2-8%
# before this bound; with it, batch 1 +0.7-2.9%, batch 8 0.99-1.01x (0: never folds, the A/B's
# "off")
FOLD_MAX_STEPS = 16

# Opt-in shared memory per block by compute capability, for compile-only callers (a launch asks
# the device). sm_90 is here for the H100/H200, where the path is tested; sm_100/103 (B200,
# B300) and sm_110 (Thor) have Hopper's 227 KB, so they take the tiles tested there.
SMEM_BY_CAPABILITY = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                      (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                      (10, 3): 227 * 1024, (11, 0): 227 * 1024, (12, 0): 99 * 1024,
                      (12, 1): 99 * 1024}


def fwd_configs(dtype, head_dim: int, head_dim_v: int, causal: bool, local: bool,
                has_softcap: bool, varlen_q: bool, varlen_k: bool, has_seqused_q: bool = False,
                has_seqused_k: bool = False, smem_limit: int = 99 * 1024,
                has_sink: bool = False) -> list:
    """The configs of the listed tiles that fit `smem_limit` bytes, preferred first (the launch
    takes the first that compiles spill-free); ValueError if none fits. head_dim / head_dim_v:
    the tensors' (a multiple of 8 up to 256, head_dim_v <= head_dim), run on the next compiled
    widths (launch_common.compiled_width), the kernel padding them."""
    true_dims = (head_dim, head_dim_v)
    head_dim, head_dim_v = (compiled_width(x, SUPPORTED_HEAD_DIMS) for x in true_dims)
    padded = true_dims != (head_dim, head_dim_v)
    tiles = LOCAL_TILES.get(head_dim, TILES[head_dim]) if local else TILES[head_dim]
    configs = [Sm80FwdConfig(
        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, padded=padded, tile_m=tile_m,
        tile_n=tile_n,
        num_warps=warps, causal=causal, local=local, has_softcap=has_softcap,
        varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_q=has_seqused_q,
        has_seqused_k=has_seqused_k, kv_stages=stages[0] if stages else 1, has_sink=has_sink,
        lazy_rescale=head_dim in LAZY_RESCALE_HEAD_DIMS)
        for tile_m, tile_n, warps, *stages in tiles]
    configs = [cfg for cfg in configs if cfg.smem_bytes() <= smem_limit]
    if not configs:
        raise ValueError(f"no sm80 forward tile for head_dim {head_dim} fits {smem_limit} bytes "
                         "of shared memory")
    return configs


def fwd_config(*args, **kwargs) -> Sm80FwdConfig:
    """The preferred config that fits (fwd_configs' first)."""
    return fwd_configs(*args, **kwargs)[0]


# The CTA-wide fp8 decode tile (not split keys) converts a key block of at most this many
# elements (keys x head dim): 64 x 128 fits 255 registers, 64 x 192 spilled 44 bytes on sm_90a
# (where its ring fits 172 KB of shared memory; on 99 KB targets the ring already took 32-key
# blocks).
FP8_CONVERTED_BLOCK_ELEMS = 64 * 128

# Decoding (flash_attn_with_kvcache): a few query rows against a long cache, bound by memory.
# 64-row tiles (4 warps) waste less on one-row queries than 128; wide key blocks keep more of
# the cache in flight per barrier (as register room allows). A paged cache keeps the key block
# wide when each copy pass's rows fit a page (a page lookup per pass), else narrows it to a
# divisor of the page size (one page lookup per block).
DECODE_TILES = {  # head_dim -> (tile_m, tile_n, num_warps)
    64: (64, 64, 4),
    96: (64, 64, 4),
    128: (64, 64, 4),  # 128-key blocks compiled at 255 registers on sm_80: no margin
    192: (64, 64, 4),
    256: (64, 16, 4),
}


def decode_work_tiles(batch: int, nheads: int, nheads_k: int, seqlen_q: int) -> int:
    """The decode grid's tiles before any split: 64 rows, which with pack-GQA (a power-of-two
    GQA ratio) hold every query head of a kv head."""
    g = nheads // nheads_k
    if g > 1 and 64 % g == 0:
        return batch * nheads_k * -(-seqlen_q * g // 64)
    return batch * nheads * -(-seqlen_q // 64)



def decode_ctas_per_sm(fp8_cache: bool, gathers_pages: bool, tiles: int, sms: int,
                       smem_limit: int, warp_local: bool = False) -> int:
    """The decode kernel's CTAs an SM: its K/V ring is sized to fit that share of the shared
    memory (decode_stages), and the split-KV count (kvcache._splits) counts slots with it.
    2, except where the tiles leave the GPU to split-KV (fewer than 80% of the slots, as
    kvcache.split_count counts them at that many an SM). There an fp8 cache runs 3 (2 ring
    stages; its step is latency-bound at 8 warps an SM), except on the warp-local tile
    (`warp_local`: Sm80FwdConfig.warp_local, fragments converted in registers) where its key
    blocks do not gather pages, and a bf16/fp16 cache whose key blocks
    do not gather pages (contiguous, or pages holding whole blocks) runs 1 (a 4-stage ring,
    fewer splits to merge) on a GPU of Hopper's shared memory (over 200 KB a CTA; 100 KB GPUs
    would fit only 2 stages at d=128, unmeasured: they keep 2). Measured at d=128 on an H200
    (docs/perf-log.md): fp8 3 ran
    1.04-1.26x where the grid splits, 0.81-0.97x where the tiles alone fill the GPU (a partial
    last wave); bf16 1 ran 1.01-1.03x at pages of 128 keys and contiguous, 0.90-0.96x at pages
    of 16 (gathered blocks want the second CTA's loads in flight). The warp-local tile at 2
    against 3 where the grid splits: 1.04-1.11x contiguous and at pages of 128, 0.94-0.95x at
    pages of 16."""
    if fp8_cache:
        return 3 if tiles < 0.8 * 3 * sms and (gathers_pages or not warp_local) else 2
    return 1 if not gathers_pages and tiles < 0.8 * sms and smem_limit > 200 * 1024 else 2


def decode_grid(spec, sms: int, smem_limit: int) -> tuple:
    """A decode step's (work tiles, CTAs an SM) for an AttentionSpec on a GPU of `sms` SMs and
    that opt-in shared memory a CTA: the one derivation that the launch (ring size) and
    kvcache._splits (split count) share."""
    tiles = decode_work_tiles(spec.batch, spec.nheads, spec.nheads_k, spec.seqlen_q or 1)
    page = spec.page_size if spec.paged_kv else 0
    # (a head dim without a decode kernel, d=80: the reference serves it; its count is moot)
    tile_n = DECODE_TILES[spec.head_dim][1] if spec.head_dim in DECODE_TILES else 64
    gathers = page % tile_n != 0
    fp8 = spec.kv_dtype is not None
    # (the warp-local tile, as decode_config gives it a split-keys step of 64-key blocks)
    local = (fp8 and decode_split_keys(spec) and not spec.varlen_q
             and DECODE_TILES.get(spec.head_dim, (0, 0, 1))[1:] == (64, 4)
             and warp_local_fp8(cutlass.BFloat16, spec.head_dim, spec.head_dim_v, fp8))
    return tiles, decode_ctas_per_sm(fp8, gathers, tiles, sms, smem_limit, local)


def warps_for_key_block(dtype, head_dim: int, head_dim_v: int, tile_n: int, warps: int) -> int:
    """The most warps (at most `warps`) whose 16-byte loads tile a key block of tile_n rows:
    one pass of all threads covers num_threads / (threads per row) rows, which must divide
    tile_n (a 16-key block of d = 96 rows: 64 threads, not 128)."""
    while warps > 1 and any(tile_n % mma.rows_per_copy_pass(dtype, 32 * warps, cols)
                            for cols in (head_dim, head_dim_v)):
        warps //= 2
    return warps


def pack_gqa_group(qhead_per_kvhead: int, tile_m: int) -> int:
    """The pack-GQA group of a decode tile: all query heads of a kv head as rows of one tile
    when their count divides the tile's rows (a power of two up to tile_m), else 1 (no
    packing: each query head its own tiles, the kv head's K/V read once per query head)."""
    g = qhead_per_kvhead
    return g if g > 1 and tile_m % g == 0 else 1


def decode_folds(spec, split_keys: bool, seqlen_q: int, num_splits: int) -> bool:
    """Whether a split decode step merges in its last split's CTA (Sm80FwdConfig.fold_combine):
    where its warps' chains of loads are FOLD_MAX_STEPS at most, the tile's rows (query
    positions x packed heads) over its 4 warps."""
    tile_m = 16 if split_keys else DECODE_TILES.get(spec.head_dim, (64,))[0]
    rows = min(tile_m, seqlen_q * decode_pack_group(spec, split_keys))
    steps = -(-rows // 4) * -(-num_splits // AT_ONCE_FOLDED)
    return steps <= FOLD_MAX_STEPS


def decode_pack_group(spec, split_keys: bool) -> int:
    """The pack-GQA group decode_config gives a decode step's kernel (packed q, the paged
    prefill, never packs): its tile's rows are 16 on the split-keys tile, else DECODE_TILES'."""
    if spec.varlen_q:
        return 1
    tile_m = 16 if split_keys else DECODE_TILES.get(spec.head_dim, (64,))[0]
    return pack_gqa_group(spec.qhead_per_kvhead, tile_m)


def decode_config(dtype, head_dim: int, head_dim_v: int, causal: bool, local: bool,
                  has_softcap: bool, kv_batch_idx: bool, leftpad_k: bool, page_size: int,
                  split_kv: bool, qhead_per_kvhead: int = 1, varlen_q: bool = False,
                  has_seqused_q: bool = False, smem_limit: int = 99 * 1024,
                  kv_fp8=None, split_keys: bool = False, ctas_per_sm: int = 2,
                  fold_combine: bool = False) -> Sm80FwdConfig:
    """The decode kernel's config: q against a cache whose used length is seqused_k;
    page_size 0 for a contiguous cache; the GQA ratio picks the pack-GQA group (a compile-time
    constant: one kernel per ratio that packs). With varlen_q (packed q: the paged prefill of
    flash_attn_varlen_func(block_table=)) the same tiles, without pack-GQA. kv_fp8: an fp8
    cache's format (Sm80FwdConfig.kv_fp8; its ring has at least 2 stages). split_keys: a
    16-row tile whose warps split each key block (Sm80FwdConfig.split_keys), where the key
    block is 16 keys a warp (else the usual tile); with an fp8 cache that tile's warps load and
    convert their own keys (Sm80FwdConfig.warp_local: 1.10-1.34x on a contiguous fp8 cache,
    0.98-1.03x paged; neutral for bf16, 0.98-1.00x, so not used there). ctas_per_sm:
    decode_stages' (decode_ctas_per_sm). fold_combine: with split_kv (batched q), each tile's
    last split merges the tile's rows (Sm80FwdConfig.fold_combine)."""
    tile_m, tile_n, warps = DECODE_TILES[head_dim]
    gather = False
    if page_size % tile_n:  # (a contiguous cache has page_size 0) a block would span pages
        passes = [mma.rows_per_copy_pass(dtype, 32 * warps, cols) for cols in (head_dim, head_dim_v)]
        if all(page_size % rows == 0 for rows in passes):
            gather = True  # a page lookup per copy pass (FlashFwdSm80.load_block_pages)
        else:
            tile_n = math.gcd(tile_n, page_size)  # pages are multiples of 16 keys
            warps = warps_for_key_block(dtype, head_dim, head_dim_v, tile_n, warps)
    cfg = fwd_config(dtype, head_dim, head_dim_v, causal, local, has_softcap, varlen_q, False,
                     has_seqused_q=has_seqused_q, has_seqused_k=True, smem_limit=1 << 30)
    cfg = dataclasses.replace(cfg, tile_m=tile_m, tile_n=tile_n, num_warps=warps,
                               kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k,
                               paged_kv=page_size > 0, gather_pages=gather, split_kv=split_kv,
                               fold_combine=split_kv and fold_combine and not varlen_q,
                               lazy_rescale=False,  # (measured on the forward's tiles only)
                               pack_gqa=1 if varlen_q else pack_gqa_group(qhead_per_kvhead, tile_m),
                               kv_fp8=kv_fp8)

    def narrower(cfg):  # half the key block (a page that held whole blocks still does, and a
        # gathered block's copy passes only get fewer rows)
        warps = warps_for_key_block(dtype, head_dim, head_dim_v, cfg.tile_n // 2, cfg.num_warps)
        return dataclasses.replace(cfg, tile_n=cfg.tile_n // 2, num_warps=warps)

    stages = decode_stages(cfg, smem_limit, ctas_per_sm)
    while kv_fp8 is not None and stages < 2 and cfg.tile_n > 16:
        # an fp8 cache's ring needs 2 stages besides its converted block (d = 192 in 99 KB)
        cfg = narrower(cfg)
        stages = decode_stages(cfg, smem_limit, ctas_per_sm)
    if kv_fp8 is not None and stages < 2:
        raise ValueError(f"an fp8 cache at head_dim {head_dim}: its K/V ring does not fit "
                         f"{smem_limit} bytes of shared memory")
    cfg = dataclasses.replace(cfg, kv_stages=stages)
    # (16 rows must hold whole copy passes of q and o: not at d=96, 32 rows a pass)
    passes_fit = all(16 % mma.rows_per_copy_pass(dtype, 32 * cfg.num_warps, cols) == 0
                     for cols in (head_dim, head_dim_v))
    if (split_keys and passes_fit and not varlen_q and cfg.tile_n == 16 * cfg.num_warps
            and stages >= 2):
        local = warp_local_fp8(dtype, head_dim, head_dim_v, kv_fp8)
        split = dataclasses.replace(cfg, tile_m=16, split_keys=True, warp_local=local,
                                    f16_operands=local and dtype is cutlass.BFloat16,
                                    pack_gqa=pack_gqa_group(qhead_per_kvhead, 16))
        split = dataclasses.replace(split, kv_stages=decode_stages(split, smem_limit, ctas_per_sm))
        if local:  # (registers bounded for the CTAs an SM that its shared memory allows)
            split = dataclasses.replace(split, min_ctas_per_sm=min(
                ctas_per_sm, smem_limit // split.smem_bytes()))
        return split
    while kv_fp8 is not None and cfg.tile_n * head_dim > FP8_CONVERTED_BLOCK_ELEMS:
        # the CTA-wide tile converts whole key blocks in registers
        cfg = narrower(cfg)
        cfg = dataclasses.replace(cfg, kv_stages=decode_stages(cfg, smem_limit, ctas_per_sm))
    return cfg


def warp_local_fp8(dtype, head_dim: int, head_dim_v: int, kv_fp8) -> bool:
    """Whether the split-keys tile over this cache takes Sm80FwdConfig.warp_local: an fp8
    cache at head dims of multiples of 64 (a lane's runs of K's and V's rows), whose 16-byte
    copy passes (twice byte_copy_like's rows) tile a warp's keys."""
    return (kv_fp8 is not None and head_dim % 64 == 0 and head_dim_v % 64 == 0
            and all(KEYS_PER_WARP % (2 * mma.rows_per_copy_pass(dtype, 32, cols)) == 0
                    for cols in (head_dim, head_dim_v)))


def decode_split_keys(spec) -> bool:
    """Whether a decode step asks for the 16-row split-keys tile (Sm80FwdConfig.split_keys):
    at most 16 rows a kv head, all its query heads packed (decode_config may still decline)."""
    group = pack_gqa_group(spec.qhead_per_kvhead, 16)
    return group == spec.qhead_per_kvhead and (spec.seqlen_q or 0) * group <= 16


def decode_stages(cfg: Sm80FwdConfig, smem_limit: int, ctas_per_sm: int = 2) -> int:
    """K/V blocks in flight for decoding (bound by reading the cache): the most of 4, 3, 2 whose
    ring fits the shared memory's share of one of ctas_per_sm CTAs, else the most that fit,
    else 1."""
    fits = lambda stages, budget: dataclasses.replace(cfg, kv_stages=stages).smem_bytes() <= budget
    for budget in (smem_limit // ctas_per_sm, smem_limit):
        for stages in (4, 3, 2):
            if fits(stages, budget):
                return stages
    return 1