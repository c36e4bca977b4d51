"""A/B of sm90 forward tiles: each `config.TILES` setting of one head dim, compiled and timed
alternately in one process (median of 3 rounds), FlashAttention-4 beside (plain masks only).
Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_fwd_tiles.py D/DV WG,KEYS,STAGES ... [--softcap]
        [--window] [--varlen] [--short | --vit] [--warm]
e.g. `80/80 2,176,2 3,112,2 3,112,3`. Shapes: 16k tokens at 4k and 16k (--short: 1k and 2k;
--vit: 257, 577 and 1025 tokens, 256 / 128 / 64 images), 24 heads (16 at d=192). The head
dim's TILE_N_CAPS are dropped, so each setting runs its key block as given. --warm only
compiles (run one per setting at once first; the disk cache keeps them)."""
import statistics
import sys

import torch
from cuteattn import api, flash_attn_func, flash_attn_varlen_func
from cuteattn.kernels.sm90 import config
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.bench import peers
flags = {a for a in sys.argv[1:] if a.startswith("--")}
warm = "--warm" in flags
args = [a for a in sys.argv[1:] if not a.startswith("--")]
d, dv = map(int, args[0].split("/"))
settings = [tuple(map(int, s.split(","))) for s in args[1:]]
caps = {k: v for k, v in config.TILE_N_CAPS.items() if k[0] == d}
heads = 16 if d == 192 else 24
dev = torch.device("cuda")
shapes = ([(1, 300)] if warm else [(16, 1024), (8, 2048)] if "--short" in flags
          else [(256, 257), (128, 577), (64, 1025)] if "--vit" in flags
          else [(4, 4096), (1, 16384)])
kw = {}
if "--softcap" in flags:
    kw["softcap"] = 30.0
if "--window" in flags:
    kw["window_size"] = (1024, 0)
varlen = "--varlen" in flags
tag = "".join(f.strip("-")[0] for f in sorted(flags - {"--warm", "--short", "--vit"}))
for b, s in shapes:
    for causal in ((False,) if "--window" in flags else (False, True)):
        cell = Cell("fwd", d, b, heads, heads, s, s, causal, dv=None if dv == d else dv)
        q = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, s, heads, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, s, heads, dv, device=dev, dtype=torch.bfloat16)
        if varlen:
            cu = torch.arange(0, (b + 1) * s, s, device=dev, dtype=torch.int32)
            fn = lambda: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                                causal=causal, strict=True, **kw)
        else:
            fn = lambda: flash_attn_func(q, k, v, causal=causal, strict=True, **kw)
        def use(st):  # (the short-sequence and narrower-v tables too, where they hold d)
            config.TILES[d] = st
            if d in config.SHORT_TILES:
                config.SHORT_TILES[d] = st
            if (d, dv) in config.NARROW_V_TILES:
                config.NARROW_V_TILES[d, dv] = st
            for key in caps:
                config.TILE_N_CAPS.pop(key, None)
            api._launches.clear()
        rates = {st: [] for st in settings}
        for rnd in range(1 if warm else 3):
            for st in settings:
                use(st)
                fn()
                if not warm:
                    rates[st].append(cell.rate(median_ms(fn, dev)))
        if warm:
            continue
        row = [statistics.median(rates[st]) for st in settings]
        fa = peers._fa4(cell, dict(q=q, k=k, v=v)) if not kw and not varlen else None
        fa4 = cell.rate(median_ms(fa, dev)) if callable(fa) else float("nan")
        print(f"d{d}/{dv}{tag} b{b} {s} {'causal' if causal else 'full  '} " + " ".join(
            f"{str(st):>14} {r:6.1f}" for st, r in zip(settings, row)) + f"   fa4 {fa4:6.1f}", flush=True)
