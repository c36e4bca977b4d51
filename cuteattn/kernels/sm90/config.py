"""Tile shapes of the sm90 forward per head dim (all fit 227 KB of shared memory and 240
registers per consumer thread; see docs/perf-log.md for how they were chosen)."""
import dataclasses

from .fwd import Sm90FwdConfig

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)

# head_dim -> (consumer warpgroups, keys per block, K/V stages)
_TILES = {
    64: (3, 96, 4),
    96: (2, 128, 2),
    128: (2, 128, 2),
    192: (2, 112, 2),
    256: (2, 80, 2),
}

# Converting P with one packed cvt per pair (common/convert.py) frees ~1 register per two score
# columns, enough for the wider key blocks FA3 uses (d=64: 192x128, d=96/128: 128x176), all
# spill-free when compiled (tests/test_compile_sm90.py). GPU-verified at c5a578c; the tiles'
# timings are in docs/perf-log.md. False restores the unpacked path and its tiles.
PACKED_CONVERT = True
_TILES_PACKED = {
    64: (3, 128, 4),
    96: (2, 176, 2),
    128: (2, 176, 2),
    192: (2, 112, 2),
    256: (2, 80, 2),
}

# Where O is staged on its way out (Sm90FwdConfig.o_path), in order of preference:
#   "own_buffer": its own shared-memory buffer, where it fits beside Q and the K/V ring (d <= 96);
#   "v_stage": the ring stage of the tile's last V block, where one stage holds the whole O tile
#     (tile_n >= tile_m: d = 128);
#   "q_buffer": Q's buffer (every other head dim; GPU-verified at fde8789).
# The first two free Q's buffer after the tile's last QK GEMM, so the next tile's Q loads during
# this tile's last P V GEMM and epilogue rather than after them. "auto" picks the first that
# applies; a name picks that one where it applies and "q_buffer" elsewhere (for comparisons).
# "auto" is GPU-verified (418 passed at 26d114e) and measured in docs/perf-log.md.
O_PATHS = ("q_buffer", "own_buffer", "v_stage")
O_PATH = "auto"
# With O in its own buffer and fixed lengths, one TMA store per warpgroup writes it out
# (Sm90FwdConfig.tma_store_o) instead of 16-byte stores by every thread; the buffer's next
# writer waits for the store to have read it. GPU-verified, but no faster than the threads'
# stores (docs/perf-log.md): off.
TMA_STORE_O = False

# The key-block loop split so that the blocks that need no element mask run without its code
# (Sm90FwdConfig.split_mask_loop). In the single loop, ptxas predicates the mask into every
# iteration: at d=128 128x128 the loop body has 620 instructions against 455 in FA4's (SASS of
# both, compiled here), 66 of them selects. The GPU suite passes with it and it gains 1-3% at
# d=128 (docs/perf-log.md), but with softcap some variants spill: off until those are fixed
# and a bench has run with it.
SPLIT_MASK_LOOP = False
SMEM_LIMIT = 227 * 1024

# Short sequences (at most SHORT_SEQLEN queries) favour smaller tiles: fewer rows wasted past
# the end (a 192-row tile covers 1024 queries in 6 blocks, the last a third full) and, under a
# causal mask, less of each block masked away. Measured in docs/perf-log.md. Only these head
# dims have a short-sequence tile; the others use their table's at every length.
SHORT_SEQLEN = 2048
SHORT_TILES = True
_TILES_SHORT = {
    64: (2, 128, 4),
    128: (2, 128, 3),
}

# Variants that need a narrower key block than their table's to compile without spills:
# (packed_convert, head_dim, local, varlen) -> (widest tile_n without softcap, with softcap).
# Found by benchmarks/dev_tile_search.py (compile-only, both dtypes, causal on and off), because
# register pressure, not shared memory, limits these: the window keeps two column limits per row
# live, varlen keeps the sequence's offsets and lengths (and its producer and consumers split the
# registers 40/232, fwd.py says why), softcap its scale. Spill-freedom is not monotonic in the
# tile (ptxas's choices), so where softcap on and off disagree the narrower serves both.
_TILE_N_CAPS = {
    (False, 64, False, True): (80, 80),
    (False, 128, False, True): (112, 112),
    (False, 128, True, True): (112, 112),
    (False, 192, False, False): (96, 96),
    (False, 192, False, True): (96, 96),
    (False, 256, False, True): (64, 64),
    (True, 64, False, True): (112, 112),
    (True, 64, True, False): (96, 96),
    (True, 64, True, True): (80, 80),
    (True, 96, True, False): (160, 160),
    (True, 96, True, True): (128, 128),
    (True, 128, True, False): (160, 160),
    (True, 128, True, True): (128, 128),
    (True, 192, True, True): (96, 96),
    (True, 256, True, True): (64, 64),
}


def fwd_config(dtype, head_dim: int, head_dim_v: int, causal: bool, local: bool,
               has_softcap: bool, varlen_q: bool, varlen_k: bool,
               has_seqused_q: bool = False, has_seqused_k: bool = False,
               packed_convert: bool | None = None, max_seqlen_q: int | None = None) -> Sm90FwdConfig:
    """max_seqlen_q (the longest query sequence, when known) picks the short-sequence tiles."""
    packed = PACKED_CONVERT if packed_convert is None else packed_convert
    num_wg, tile_n, stages = (_TILES_PACKED if packed else _TILES)[head_dim]
    if (SHORT_TILES and packed and head_dim in _TILES_SHORT and max_seqlen_q is not None
            and max_seqlen_q <= SHORT_SEQLEN):
        num_wg, tile_n, stages = _TILES_SHORT[head_dim]
    caps = _TILE_N_CAPS.get((packed, head_dim, local, varlen_q or varlen_k))
    if caps is not None:
        tile_n = min(tile_n, caps[1] if has_softcap else caps[0])
    cfg = Sm90FwdConfig(
        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, tile_n=tile_n, num_wg=num_wg,
        num_stages=stages, causal=causal, local=local, has_softcap=has_softcap,
        varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_q=has_seqused_q,
        has_seqused_k=has_seqused_k,
        # Taking turns pays when the softmax is a large share of a block's time (small d);
        # at d > 128 the GEMMs dominate and the turns only add waiting (FA3's finding too).
        pingpong=head_dim <= 128,
        packed_convert=packed,
        # Causal, windowed and varlen tiles differ in cost: draw them from a counter.
        dynamic_tiles=causal or local or varlen_q,
        split_mask_loop=SPLIT_MASK_LOOP,
    )
    return _with_o_path(cfg, O_PATH)


def _with_o_path(cfg: Sm90FwdConfig, wanted: str) -> Sm90FwdConfig:
    if wanted in ("auto", "own_buffer") and cfg.head_dim <= 96:
        with_o = dataclasses.replace(cfg, o_path="own_buffer",
                                     tma_store_o=TMA_STORE_O and not cfg.varlen_q)
        if with_o.smem_bytes() <= SMEM_LIMIT:
            return with_o
    v_stage_bytes = cfg.tile_n * cfg.head_dim_v * cfg.dtype.width // 8
    if wanted in ("auto", "v_stage") and cfg.tile_n >= cfg.tile_m and v_stage_bytes % 1024 == 0:
        return dataclasses.replace(cfg, o_path="v_stage")
    return cfg
