"""Tile shapes of the sm90 forward per head dim (all fit 227 KB of shared memory and 240
registers per consumer thread; see docs/perf-log.md for how they were chosen)."""
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
# spill-free when compiled (tests/test_compile_sm90.py). Off until measured on a GPU: the
# switch and its tiles were written when this session's device time had run out.
PACKED_CONVERT = False
_TILES_PACKED = {
    64: (3, 128, 4),
    96: (2, 176, 2),
    128: (2, 176, 2),
    192: (2, 112, 2),
    256: (2, 80, 2),
}

# sliding-window variants that need a narrower key block
_LOCAL_TILE_N = {64: 96}
# packed-batch variants that need a narrower key block
_VARLEN_TILE_N = {128: 112}


def fwd_config(dtype, head_dim: int, head_dim_v: int, causal: bool, local: bool,
               has_softcap: bool, varlen_q: bool, varlen_k: bool,
               has_seqused_q: bool = False, has_seqused_k: bool = False,
               packed_convert: bool | None = None) -> Sm90FwdConfig:
    packed = PACKED_CONVERT if packed_convert is None else packed_convert
    num_wg, tile_n, stages = (_TILES_PACKED if packed else _TILES)[head_dim]
    if local:
        # The window mask keeps two column limits per row live: a narrower block stays spill-free.
        tile_n = _LOCAL_TILE_N.get(head_dim, tile_n)
    if varlen_q or varlen_k:
        # The per-sequence offsets and lengths stay live through the mainloop; at d=128 that is
        # the few registers that make 128-wide blocks spill (4-12 bytes), 112 does not.
        tile_n = min(tile_n, _VARLEN_TILE_N.get(head_dim, tile_n))
    return Sm90FwdConfig(
        dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, tile_n=tile_n, num_wg=num_wg,
        num_stages=stages, causal=causal, local=local, has_softcap=has_softcap,
        varlen_q=varlen_q, varlen_k=varlen_k, has_seqused_q=has_seqused_q,
        has_seqused_k=has_seqused_k,
        # Taking turns pays when the softmax is a large share of a block's time (small d);
        # at d > 128 the GEMMs dominate and the turns only add waiting (FA3's finding too).
        pingpong=head_dim <= 128,
        packed_convert=packed,
    )
