"""Where the block-sparse forward's gap to flash-attn-4 at 128x128 blocks lies (issue 15). One
shape of the sparse bench (bf16, B=1, H=12, d=128, S given), every block kept, timed as:
    ours-sparse    the block-sparse kernel on lists of every 128x128 block (all full)
    ours-dense128  the dense forward forced to 128-key blocks (TILES[128] = (2, 128, 3): the
                   sparse kernel's tile without the lists and the tile counter)
    ours-dense     the dense forward's own tile (128 x 176)
    ours-dense128-counter   ours-dense128 with its tiles from the global counter, as the
                   block-sparse kernel takes them (Sm90FwdConfig.dynamic_tiles)
    ours-sparse-static      ours-sparse with its tiles dealt round robin instead
    fa4-sparse     flash-attn-4's block-sparse path on the same lists
    fa4-dense      flash-attn-4's dense forward
interleaved, best of rounds, in TFLOP/s. If ours-dense128 is near fa4-sparse the lists cost the
gap; if it is near ours-sparse the 128-key tile does (and the page-128 prefill, issue 12, shares
it). Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_sparse_gap.py [S ...] [--rounds N] [--only NAME]
--only NAME runs that one implementation a few times (for ncu -k). --power: each
implementation also runs alone for 3 s while nvidia-smi samples the SM clock and the board's
power (a kernel that draws more power a clock runs at lower clocks under the power limit: ncu's
single launches do not show it)."""
import dataclasses
import subprocess
import sys
import time

import torch

from cuteattn import api, flash_attn_func
from cuteattn.bench import peers
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import config

argv = sys.argv[1:]
opt = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
rounds = int(opt("--rounds", 2))
only = opt("--only", None)
values = {opt("--rounds", None), only}
seqlens = [int(a) for a in argv if a.isdigit() and a not in values] or [8192]
dev = torch.device("cuda")
own_tile = config.TILES[128]


plain_fwd_config = config.fwd_config
dynamic_tiles = {}  # the override of Sm90FwdConfig.dynamic_tiles in force (none: the config's)


def overridden_fwd_config(*args, **kwargs):
    cfg = plain_fwd_config(*args, **kwargs)
    return dataclasses.replace(cfg, **dynamic_tiles)


config.fwd_config = overridden_fwd_config


def with_tile(tile, fn, **override):
    """fn run on the 128 anchor's tile `tile`, with Sm90FwdConfig.dynamic_tiles overridden
    (override: dynamic_tiles=...)."""
    def run():
        if config.TILES[128] != tile or dynamic_tiles != override:
            config.TILES[128] = tile
            dynamic_tiles.clear()
            dynamic_tiles.update(override)
            api._launches.clear()
        return fn()
    return run


def power_run(name, fn, flops, seconds=3.0):
    """fn back to back for `seconds`, with the SM clock (MHz) and power (W) nvidia-smi saw
    meanwhile (its first 0.5 s dropped: the clocks settle) and the rate over the whole run."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    torch.cuda.synchronize()
    began, calls = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - began
    smi.terminate()
    samples = [tuple(map(float, line.split(","))) for line in smi.communicate()[0].splitlines()
               if line.count(",") == 1][5:]
    clock = sum(c for c, _ in samples) / max(len(samples), 1)
    power = sum(p for _, p in samples) / max(len(samples), 1)
    rate = flops * calls / elapsed / 1e12
    # (energy a FLOP: at the power limit the kernel that spends less a FLOP runs faster)
    print(f"  sustained {name:14s} {rate:7.1f} TFLOP/s  {clock:6.0f} MHz  {power:5.0f} W  "
          f"{power / rate:.3f} pJ/FLOP  ({len(samples)} samples)", flush=True)


for s in seqlens:
    cell = Cell("sparse", 128, 1, 12, 12, s, s, False, sparsity=0.0, block_q=128, block_k=128)
    x = peers.make_inputs(cell, dev)
    sparse_impls = peers._sparse(cell, x, dev)
    q, k, v = x["q"], x["k"], x["v"]
    impls = {
        "ours-sparse": with_tile(own_tile, sparse_impls["cuteattn"]),
        "ours-dense128": with_tile((2, 128, 3), lambda: flash_attn_func(q, k, v, strict=True)),
        "ours-dense": with_tile(own_tile, lambda: flash_attn_func(q, k, v, strict=True)),
        "ours-dense128-counter": with_tile((2, 128, 3), lambda: flash_attn_func(q, k, v, strict=True),
                                           dynamic_tiles=True),
        "ours-sparse-static": with_tile(own_tile, sparse_impls["cuteattn"], dynamic_tiles=False),
    }
    if callable(sparse_impls.get("fa4")):
        from flash_attn.cute.interface import flash_attn_func as fa4
        impls["fa4-sparse"] = sparse_impls["fa4"]
        impls["fa4-dense"] = lambda: fa4(q, k, v)
    if only:
        for _ in range(4):
            impls[only]()
        torch.cuda.synchronize()
        continue
    flops = 4 * s * s * 12 * 128
    best = {}
    for _ in range(rounds):
        for name, fn in impls.items():
            fn()
            best[name] = min(best.get(name, 1e9), median_ms(fn, dev))
    if "--power" in argv:
        for name, fn in impls.items():
            power_run(name, fn, flops)
    ref = best.get("fa4-sparse")
    for name, ms in best.items():
        rel = f"  {ref / ms:.3f}x fa4-sparse" if ref else ""
        print(f"S={s:6d} {name:14s} {flops / ms / 1e9:7.1f} TFLOP/s{rel}", flush=True)
