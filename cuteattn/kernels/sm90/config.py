"""Tile shapes of the sm90 forward per head dim (all fit 227 KB of shared memory and 240
registers per consumer thread; see docs/perf-log.md for how they were chosen)."""
import dataclasses

from ..launch_common import compiled_width
from .fwd import Sm90FwdConfig

# head_dim -> (consumer warpgroups, keys per block, K/V stages). P is converted to 16 bits with
# one packed cvt per pair (common/convert.py), which frees enough registers for FA3's wide key
# blocks (d=64: 192x128, d=128: 128x176), spill-free (tests/test_compile_sm90.py). d=80 and 96
# run three warpgroups (192 query rows) on narrower key blocks, as FA3 does at d<=96: measured
# 1.02-1.16x of 128x176 (docs/perf-log.md, eleventh session). Their 144 keys with P through
# shared memory (FA3's way: register P spills there) ran 0.97-1.00x of 112: rejected.
TILES = {
    64: (3, 128, 4),
    80: (3, 112, 2),
    96: (3, 112, 2),
    128: (2, 176, 2),
    192: (2, 112, 2),
    256: (2, 80, 2),
}
# (head_dim, head_dim_v) -> tile where v is narrower: O's accumulator is smaller, so the key
# block can widen (d=192 with v 128, MLA prefill: 128 keys, 1.02-1.03x of 112)
NARROW_V_TILES = {(192, 128): (2, 128, 2)}
SUPPORTED_HEAD_DIMS = tuple(TILES)
SMEM_LIMIT = 227 * 1024
# A head dim between those runs at its own width rounded up to WIDTH_STEP columns (the 16-bit
# wgmma k step; TMA zero-fills the columns past the tensor's), on the tiles of the next width
# of TILES at or above it (tile_anchor): fewer columns need fewer registers and less shared
# memory, so that tile fits. Measured against padding to that width in docs/perf-log.md.
WIDTH_STEP = 16


def kernel_width(d: int) -> int:
    """The column count the kernel runs head dim d (at most 256) at."""
    return -(-d // WIDTH_STEP) * WIDTH_STEP


def tile_anchor(width: int) -> int:
    """The width of TILES (and the tables keyed like it) whose tiles `width` runs on."""
    return compiled_width(width, SUPPORTED_HEAD_DIMS)

# Short sequences (at most SHORT_SEQLEN queries) favour smaller tiles: fewer rows wasted past
# the end (a 192-row tile covers 1024 queries in 6 blocks, the last a third full) and, under a
# causal mask, less of each block masked away. Measured in docs/perf-log.md. Only these head
# dims have a short-sequence tile; the others use TILES at every length.
SHORT_SEQLEN = 2048
SHORT_TILES = {
    64: (2, 128, 4),
    128: (2, 128, 3),
}

# Variants that need a narrower key block than TILES' to compile without spills:
# (head_dim, local, varlen) -> (widest tile_n without softcap, with softcap). Found by
# benchmarks/dev_tile_search.py (compile-only, both dtypes, causal on and off), because register
# pressure, not shared memory, limits these: the window keeps two column limits per row live,
# varlen keeps the sequence's offsets and lengths (and its producer and consumers split the
# registers 40/232, pipelines.register_split says why), softcap its scale. Spill-freedom is not
# monotonic in the tile (ptxas's choices), so where softcap on and off disagree the narrower
# serves both. (d=64 and d=128's packed and windowed rows widened since the packed indices
# are warp-uniform: searched again on those sources.)
TILE_N_CAPS = {
    (64, True, False): (112, 112),
    (64, True, True): (112, 112),
    (80, False, False): (112, 80),
    (80, False, True): (112, 96),
    (80, True, False): (96, 96),
    (80, True, True): (80, 80),
    (96, False, False): (112, 96),
    (96, False, True): (96, 96),
    (96, True, False): (96, 96),
    (96, True, True): (80, 64),
    (128, False, True): (176, 160),
    (128, True, False): (160, 144),
    (128, True, True): (144, 144),
    (192, True, True): (96, 96),
    (256, True, True): (64, 64),
}


# fp8 (e4m3) q/k/v: head_dim -> (consumer warpgroups, keys per block, K/V stages). The P V
# GEMM's k step is 32 keys, so key blocks are multiples of 32, and the S GEMM's is 32 head-dim
# columns, so head dims are too (d=80 is not: fp8 declines it); the ring's bytes are half the
# 16-bit kernel's, O (bf16) has a buffer of its own. Spill-free (tests/test_compile_sm90.py).
# d=128 and 256: the widest blocks measured fastest at 16k (docs/perf-log.md: 128x192 906
# TFLOP/s against 856 for 128x160, 128x224 893; d=256 128x128 1183 against 1104 for 128x96).
FP8_TILES = {
    64: (3, 128, 4),
    96: (2, 128, 3),
    128: (2, 192, 2),
    192: (2, 96, 2),
    256: (2, 128, 2),
}
# fp8 at up to FP8_SHORT_SEQLEN[head dim] queries: SHORT_TILES' 128-row shapes, for the same
# reasons (rows wasted past the end, causal blocks masked). At 1k, against FP8_TILES' (3 rounds):
# d=64 1.00 / 1.09x, d=128 1.12 / 1.05x (full / causal); at 2048, d=64 0.92 / 0.96x, d=128
# 1.01 / 1.05x, so d=64 stops at 1k and d=128 goes to 2k (docs/perf-log.md, thirty-first session)
FP8_SHORT_SEQLEN = {64: 1024, 128: 2048}
FP8_SHORT_TILES = {64: (2, 128, 4), 128: (2, 128, 3)}
# fp8 variants that spill at FP8_TILES' block: (head_dim, local, packed) -> widest spill-free
# tile_n (TILE_N_CAPS' limits apply too, rounded down to 32)
FP8_TILE_N_CAPS = {(256, True, False): 96, (256, False, True): 96}
# V transposed inside the fp8 kernel (Sm90FwdConfig.fp8_v_in_kernel) for up to this many queries
# (max_seqlen_q), where its staging ring fits beside the tile (d <= 192 at FP8_TILES' blocks;
# d=256 and paged caches keep the pass over HBM). The pass costs per key, the transposing warps a
# share of every block (their issue slots beside the softmax). Against the pass of 16-byte
# vectors (fp8_value.py, ~3.9 TB/s): 1k 1.04x at d=64, 0.98 / 1.07x at d=128 (full / causal);
# 4k 0.98-0.99x at d=64, 0.90 / 0.96x at d=128; 16k even (docs/perf-log.md, thirtieth session).
FP8_V_IN_KERNEL_MAX_SEQLEN_Q = 1024


# Dense tiles with a traced mask_mod or score_mod (common/mods.py): the widest spill-free key
# block for the mods tests/test_mods.py compiles (a window with constants, a document mask
# indexing a tensor, ALiBi); block-sparse tiles are the lists' blocks. (d=80 / 96 with three
# warpgroups: a document mask spills at 112 / 96 keys, so the search starts where it stops.)
MASK_MOD_TILE_N = {64: 96, 80: 96, 96: 80, 128: 128, 192: 96, 256: 64}
BOTH_MODS_TILE_N = {64: 64}  # (a mask_mod and a score_mod together)


# Block-sparse lists take the block shapes of sparse.KERNEL_BLOCKS (the tile is the block: FA4's
# and VSA's physical shapes). Wider head dims than SPARSE_MAX_HEAD_DIM do not fit the ring.
SPARSE_MAX_HEAD_DIM = 128


# Paged keys. Pages of a multiple of 64 keys hold whole key blocks (one TMA copy a block): tile_n
# divides the page size, the widest of these within the head dim's tile. Smaller pages (vLLM's
# 16) are slices of a block, one TMA copy a (page, swizzle atom's columns) slice: tile_n a
# multiple of the page size. The kernel's widths there are multiples of 64 (one 128-byte atom,
# 64 columns, a copy): other head dims run padded to the next multiple of 64 (TMA zero-fills the
# columns past the cache's), where their own width would take 2-4x the copies (d=96's atom is
# 32 columns, d=80's 16; fwd.swizzle_atom_cols). Which is faster is unmeasured.
PAGED_TILE_N = (128, 64)
SLICED_PAGE_WIDTH = 64


# Pages smaller than a key block cost the TMA unit one copy per (page, 64 columns): 44 copies
# for a 176-key block at d=128, and the paged prefill ran at 0.74x of the fixed-length forward
# (docs/perf-log.md). A paged prefill with at least PAGED_GATHER_MIN_ROWS query rows a kv head
# (max_seqlen_q x the GQA group, which the gather's one pass over the keys must pay for) gathers
# each sequence's pages into contiguous batched K and V, if they take at most
# PAGED_GATHER_MAX_BYTES, and runs the batched-keys kernel on them (launch.GatheredPagesLaunch).
PAGED_GATHER_MIN_ROWS = 2048
PAGED_GATHER_MAX_BYTES = 1 << 30


def sliced_pages(page_size: int) -> bool:
    """Whether pages of page_size keys are read as slices of a key block (not whole blocks)."""
    return page_size % min(PAGED_TILE_N) != 0


def paged_width(width: int, page_size: int) -> int:
    """The kernel's width for a head dim of `width` columns reading pages of page_size keys."""
    if not sliced_pages(page_size):
        return width
    return -(-width // SLICED_PAGE_WIDTH) * SLICED_PAGE_WIDTH


def paged_tile_n(tile_n: int, page_size: int):
    """The key block for pages of page_size keys, at most tile_n; None if the kernel cannot
    read such pages (the widths are paged_width's)."""
    if not sliced_pages(page_size):
        fits = [n for n in PAGED_TILE_N if n <= tile_n and page_size % n == 0]
        return max(fits) if fits else None
    if page_size % 16 or page_size > tile_n:
        return None
    return tile_n - tile_n % page_size


def fwd_config(dtype, head_dim: int, head_dim_v: int, causal: bool, local: bool,
               has_softcap: bool, varlen_q: bool, varlen_k: bool,
               has_seqused_q: bool = False, has_seqused_k: bool = False,
               max_seqlen_q: int | None = None, sparse_block: tuple | None = None,
               mask_mod=None, score_mod=None, page_size: int = 0,
               has_sink: bool = False) -> Sm90FwdConfig:
    """head_dim / head_dim_v: the tensors' (any multiple of 8 up to 256, head_dim_v <= head_dim);
    the kernel runs them at kernel_width, on the tiles of their tile_anchor. max_seqlen_q (the
    longest query sequence, when known) picks the short-sequence tiles. page_size: keys in
    pages (paged_tile_n says which sizes the kernel reads; others raise ValueError)."""
    true_dv = head_dim_v
    head_dim, head_dim_v = kernel_width(head_dim), kernel_width(head_dim_v)
    if page_size:
        head_dim, head_dim_v = paged_width(head_dim, page_size), paged_width(head_dim_v, page_size)
    anchor, anchor_v = tile_anchor(head_dim), tile_anchor(head_dim_v)
    fp8 = dtype.width == 8
    num_wg, tile_n, stages = (FP8_TILES if fp8 else TILES)[anchor]
    if not fp8 and (anchor, anchor_v) in NARROW_V_TILES:
        num_wg, tile_n, stages = NARROW_V_TILES[anchor, anchor_v]
    if (not fp8 and anchor in SHORT_TILES and max_seqlen_q is not None
            and max_seqlen_q <= SHORT_SEQLEN):
        num_wg, tile_n, stages = SHORT_TILES[anchor]
    if (fp8 and anchor in FP8_SHORT_TILES and max_seqlen_q is not None
            and max_seqlen_q <= FP8_SHORT_SEQLEN[anchor]):
        num_wg, tile_n, stages = FP8_SHORT_TILES[anchor]
    # (seqused on batched q/k keeps lengths live as packing does: the varlen caps serve it)
    packed = varlen_q or varlen_k or has_seqused_q or has_seqused_k
    caps = TILE_N_CAPS.get((anchor, local, packed))
    if caps is not None:
        tile_n = min(tile_n, caps[1] if has_softcap else caps[0])
        if fp8:
            tile_n -= tile_n % 32
    if fp8:
        tile_n = min(tile_n, FP8_TILE_N_CAPS.get((anchor, local, packed), tile_n))
    if mask_mod is not None or score_mod is not None:  # (more registers live per score)
        tile_n = min(tile_n, MASK_MOD_TILE_N.get(anchor, tile_n))
    if mask_mod is not None and score_mod is not None:
        tile_n = min(tile_n, BOTH_MODS_TILE_N.get(anchor, tile_n))
    if page_size:
        paged = paged_tile_n(tile_n, page_size)
        if paged is None:
            raise ValueError(f"pages of {page_size} keys: the sm90 forward reads pages of a "
                             f"multiple of 64 keys, or of a multiple of 16 up to its key block "
                             f"({tile_n} keys at head_dim {head_dim})")
        tile_n = paged
    cfg = Sm90FwdConfig(
        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, clip_o=true_dv != head_dim_v,
        tile_n=tile_n, num_wg=num_wg,
        num_stages=stages, causal=causal, local=local, has_softcap=has_softcap,
        varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_q=has_seqused_q,
        has_seqused_k=has_seqused_k,
        # Taking turns pays when the softmax is a large share of a block's time (small d);
        # at d > 128 the GEMMs dominate and the turns only add waiting (FA3's finding too).
        pingpong=head_dim <= 128,
        # Causal, windowed and varlen tiles differ in cost: draw them from a counter.
        dynamic_tiles=causal or local or varlen_q,
        mask_mod=mask_mod, score_mod=score_mod, page_size=page_size, has_sink=has_sink,
        # The row max may lag (OnlineSoftmax.max_lag_log2; not with fp8's P, which uses that
        # headroom): it pays on the three-warpgroup tiles, whose softmax is the largest share
        # of a block, and at d=256, whose rescale of the widest O sits between P V GEMMs with no
        # turns to hide it (+1-4% and +2-9% non-causal); two-warpgroup tiles at d=64-192 ran
        # 0.93-1.01x with it (docs/perf-log.md, twenty-seventh session).
        lazy_rescale=not fp8 and (num_wg == 3 or anchor == 256),
    )
    if sparse_block is not None:
        return sparse_config(cfg, *sparse_block)
    if fp8:  # O (bf16) cannot be staged in the fp8 Q or V buffers
        cfg = dataclasses.replace(cfg, o_path="own_buffer")
        # (not with seqused_k: the pass's V^T gets the keys past it zeroed, launch.py's
        # zero_value_keys_past, where the staging ring would hold whatever memory is there)
        if (not page_size and not has_seqused_k and max_seqlen_q is not None
                and max_seqlen_q <= FP8_V_IN_KERNEL_MAX_SEQLEN_Q):
            in_kernel = dataclasses.replace(cfg, fp8_v_in_kernel=True)
            if in_kernel.smem_bytes() <= SMEM_LIMIT:
                cfg = in_kernel
        return cfg
    return with_o_path(cfg)


def sparse_config(dense: Sm90FwdConfig, q_block: int, kv_block: int) -> Sm90FwdConfig:
    """The block-sparse variant of a dense config: the tile is the lists' block, the K/V ring as
    deep as shared memory allows (up to 4), tiles from the counter (their costs differ). Where
    O would be staged in Q's buffer (128x64: no V stage holds a 128-row O), it takes a buffer
    of its own at the same depth if that fits, so the next tile's Q loads during this tile's
    epilogue: +2-7% at 128x64 (H100). Where O goes to a V stage, an own buffer lost: at
    128x128 it needs a shallower ring (2 stages against 3: 0.96-1.03x), at 64x64 it ran 0.98x
    at the same depth (docs/perf-log.md, forty-fifth session). Lists of 64-key blocks run on
    128-key tiles, two listed blocks a visit (Sm90FwdConfig.sparse_pairs): 128x64 +5-12%,
    64x64 +1-3% (H100, forty-sixth session); not with seqused_k, whose V fix-up past the
    sequence's end (finish_v_past_end) takes whole blocks. O leaves by TMA where TMA's bounds
    are its rows' (Sm90FwdConfig.tma_o_store): a block-sparse tile's fixed cost fell 13%, the
    90% cells +3-4% (H100, forty-seventh session)."""
    tile_n, pairs = kv_block, False
    if kv_block == 64 and not (dense.page_size or dense.has_seqused_k):
        tile_n, pairs = 128, True
    for stages in (4, 3, 2):
        cfg = with_o_path(dataclasses.replace(
            dense, sparse=True, sparse_pairs=pairs,
            tma_o_store=not (dense.varlen_q or dense.has_seqused_q or dense.clip_o),
            num_wg=q_block // 64, tile_n=tile_n,
            num_stages=stages,
            pingpong=q_block > 64 and dense.head_dim <= 128, dynamic_tiles=True, o_path="q_buffer",
            lazy_rescale=dense.lazy_rescale and q_block // 64 == 3))
        if cfg.smem_bytes() <= SMEM_LIMIT:
            own = dataclasses.replace(cfg, o_path="own_buffer")
            if cfg.o_path == "q_buffer" and own.smem_bytes() <= SMEM_LIMIT:
                return own
            return cfg
    raise ValueError(f"no K/V ring for block-sparse {q_block}x{kv_block} at head_dim {dense.head_dim}")


def narrower_tiles(cfg: Sm90FwdConfig) -> list:
    """cfg, then the same kernel with key blocks 16 narrower each time (down to 32), each with
    its O staging chosen again: the candidates for a traced mod (compile_common.
    first_spill_free), whose register need depends on the user's function. A block-sparse
    config keeps its block (the lists' shape)."""
    if cfg.sparse:
        return [cfg]
    return [cfg] + [with_o_path(dataclasses.replace(cfg, tile_n=n, o_path="q_buffer"))
                    for n in range(cfg.tile_n - 16, 31, -16)]


def with_o_path(cfg: Sm90FwdConfig) -> Sm90FwdConfig:
    """Where O is staged (Sm90FwdConfig.o_path), the first that applies: its own buffer, where
    it fits beside Q and the K/V ring (d <= 96, and the widths between the tile anchors above
    it: 112, 144, 160); the ring stage of the tile's last K block (dense tiles that are causal
    or have a ring of three stages or more) or of its last V block, where one stage holds the
    whole O tile (tile_n >= tile_m: d = 128, d=192 with v 128); else Q's buffer. The first
    three free Q's buffer after the tile's last QK GEMM, so the next tile's Q loads during this
    tile's last P V GEMM and epilogue (measured in docs/perf-log.md: +4-11% at d=64).
    The K stage spares a warpgroup the wait for the others' last P V before its epilogue (it
    waits for their last QK GEMM instead), but holds the K stage through the epilogue, so the
    next tile's first K load waits for it. Causal tiles, the shorter, gain: d=128 1k +4%, 16k
    +2-3%, d=192/128 4k +7%, 16k +3%; full ones lose 2-3% at 16k (d=128, d=192/128: two
    stages, so the next tile's second K load waits too), and block-sparse tiles ran even
    (0.998; H100, docs/perf-log.md, forty-eighth session). Full tiles with a third stage (d=128
    up to 2k queries) gain: 1k +2.6-3.6% in three runs, packed 8 x 2048 even (0.993; H100,
    forty-ninth session). Not measured, so not taken: windows, paged keys, traced mods."""
    if cfg.head_dim <= 96 or cfg.head_dim not in SUPPORTED_HEAD_DIMS:
        with_o = dataclasses.replace(cfg, o_path="own_buffer")
        if with_o.smem_bytes() <= SMEM_LIMIT:
            return with_o
    v_stage_bytes = cfg.tile_n * cfg.head_dim_v * cfg.dtype.width // 8
    if cfg.tile_n >= cfg.tile_m and v_stage_bytes % 1024 == 0:
        k_stage_bytes = cfg.tile_n * cfg.head_dim * cfg.dtype.width // 8
        dense = not (cfg.local or cfg.sparse or cfg.page_size) and (
            cfg.mask_mod is None and cfg.score_mod is None)
        takes_k_stage = cfg.causal or cfg.num_stages >= 3
        if dense and takes_k_stage and cfg.num_wg <= 2 and k_stage_bytes % 1024 == 0:
            return dataclasses.replace(cfg, o_path="k_stage")
        return dataclasses.replace(cfg, o_path="v_stage")
    return cfg
