"""Compile-only search (no GPU needed) for the widest key block that compiles without register
spills, per head dim and variant kind, for the sm90 forward. Prints one line per
(head_dim, local, varlen, softcap). The worst case of each kind is compiled: both dtypes, and
causal on and off where the mask is not local. Usage:
    CUTE_DSL_ARCH=sm_90a python benchmarks/dev_tile_search.py [packed]
`packed` searches the tiles of config.PACKED_CONVERT. Takes a few minutes on 2 cores.
"""
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402

from cuteattn.kernels.sm90 import config  # noqa: E402
from cuteattn.kernels.sm90.compile import compile_fwd_with_report  # noqa: E402

PACKED = "packed" in sys.argv
CANDIDATES = ({64: [128, 112, 96, 80, 64], 96: [176, 160, 144, 128], 128: [176, 160, 144, 128],
               192: [112, 96], 256: [80, 64]} if PACKED else
              {64: [96, 80], 96: [128, 112, 96], 128: [128, 112, 96], 192: [112, 96],
               256: [80, 64]})


def spill_free(d, tile_n, local, varlen, softcap):
    table = config._TILES_PACKED if PACKED else config._TILES
    saved, saved_caps = table[d], dict(config._TILE_N_CAPS)
    table[d] = (saved[0], tile_n, saved[2])
    config._TILE_N_CAPS.clear()
    try:
        for dtype in (cutlass.Float16, cutlass.BFloat16):
            for causal in ((False,) if local else (False, True)):
                cfg = config.fwd_config(dtype, d, d, causal, local, softcap, varlen, varlen,
                                        packed_convert=PACKED)
                info = compile_fwd_with_report(cfg)[1]
                if info.get("spill_store_bytes", 1) or info.get("spill_load_bytes", 1):
                    return False
        return True
    finally:
        table[d] = saved
        config._TILE_N_CAPS.update(saved_caps)


for d, tiles in CANDIDATES.items():
    for local in (False, True):
        for varlen in (False, True):
            for softcap in (False, True):
                best = next((t for t in tiles if spill_free(d, t, local, varlen, softcap)), None)
                print(f"d={d} local={local:d} varlen={varlen:d} softcap={softcap:d}: "
                      f"{best if best else 'none spill-free'}", flush=True)
