"""Compile-only search (no GPU needed) for the widest key block that compiles without register
spills, per head dim and variant kind, for the sm90 forward; what config.TILE_N_CAPS holds.
Prints one line per (head_dim, local, varlen, softcap). The worst case of each kind is compiled:
both dtypes, causal on and off where the mask is not local, long and short tiles. Usage:
    CUTE_DSL_ARCH=sm_90a python benchmarks/dev_tile_search.py [d=128] [softcap]
Takes a few minutes on 2 cores.
"""
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402

from cuteattn.kernels.sm90 import config  # noqa: E402
from cuteattn.kernels.sm90.compile import compile_fwd_with_report  # noqa: E402

CANDIDATES = {64: [128, 112, 96, 80, 64], 80: [112, 96, 80, 64], 96: [112, 96, 80, 64], 128: [176, 160, 144, 128, 112, 96],
              192: [112, 96, 80], 256: [80, 64]}
DIMS = [int(a[2:]) for a in sys.argv[1:] if a.startswith("d=")] or list(CANDIDATES)
SOFTCAP = (True,) if "softcap" in sys.argv else (False, True)


def spill_free(d, tile_n, local, varlen, softcap):
    saved_caps = dict(config.TILE_N_CAPS)
    tables = [config.TILES] + ([config.SHORT_TILES] if d in config.SHORT_TILES else [])
    saved = [t[d] for t in tables]
    for t in tables:
        t[d] = (t[d][0], min(tile_n, t[d][1]), t[d][2])  # a cap only narrows
    config.TILE_N_CAPS.clear()
    try:
        for seqlen in (8192, 1024):
            for dtype in (cutlass.Float16, cutlass.BFloat16):
                for causal in ((False,) if local else (False, True)):
                    cfg = config.fwd_config(dtype, d, d, causal, local, softcap, varlen, varlen,
                                            max_seqlen_q=seqlen)
                    info = compile_fwd_with_report(cfg)[1]
                    if info.get("spill_store_bytes", 1) or info.get("spill_load_bytes", 1):
                        return False
        return True
    finally:
        for t, s in zip(tables, saved):
            t[d] = s
        config.TILE_N_CAPS.update(saved_caps)


for d in DIMS:
    for local in (False, True):
        for varlen in (False, True):
            for softcap in SOFTCAP:
                best = next((t for t in CANDIDATES[d] if spill_free(d, t, local, varlen, softcap)), None)
                print(f"d={d} local={local:d} varlen={varlen:d} softcap={softcap:d}: "
                      f"{best if best else 'none spill-free'}", flush=True)
