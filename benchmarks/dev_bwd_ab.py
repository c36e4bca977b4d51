"""A/B of one launch_bwd constant (a module constant bwd_config reads), in one process: both
values compiled, timed alternately on the same inputs, TFLOP/s of the backward per cell, and
whether their gradients agree. Exits 3 when the second value loses on the geometric mean.
Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_bwd_ab.py NAME A B [--deterministic] [--d 64,128]
        [--rounds 3] [--path sm80] [--softcap 30] [--window 256,0]
A value is an int or a comma-separated tuple of ints. e.g. `NATIVE_WIDTH_MAX 64 96 --d 80`
(d=80 padded to 96 against its own width); --path sm80 for the portable path's constants.
NAME1+NAME2 sets several constants to the same values together."""
import argparse
import math
import statistics
import sys

import torch

import os

from cuteattn import api, dispatch, flash_attn_func, flash_attn_varlen_func
from cuteattn.bench import peers, shapes
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms


def value(text: str):
    parts = tuple(int(x) for x in text.split(","))
    return parts if len(parts) > 1 else parts[0]


def short(cfg) -> str:
    """The fields of a backward config that tell its kernels apart, the switches left out."""
    keys = ("head_dim", "tile_m", "tile_n", "num_warps", "kv_passes", "q_stages", "grid")
    return " ".join(f"{k}={getattr(cfg, k)}" for k in keys if hasattr(cfg, k))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("a", type=value)
    ap.add_argument("b", type=value)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--path", choices=["sm80"], help="the portable path's backward")
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--noncausal-only", action="store_true")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--window", type=value, default=None, help="window_size: LEFT,RIGHT")
    ap.add_argument("--varlen", action="store_true",
                    help="the packed-sequence cells (bench --varlen --bwd's) instead of the grid")
    args = ap.parse_args()
    if args.path:
        os.environ[dispatch.PATH_ENV] = args.path
        from cuteattn.kernels.sm80 import launch_bwd
    else:
        from cuteattn.kernels.sm90 import launch_bwd
    arms = {f"{args.name}={args.a}".replace(" ", ""): args.a,
            f"{args.name}={args.b}".replace(" ", ""): args.b}
    kw = dict(deterministic=args.deterministic, strict=True, softcap=args.softcap)
    if args.window is not None:
        kw["window_size"] = args.window
    cells = [Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, c)
             for d in map(int, args.d.split(",")) for s in map(int, args.seqlens.split(","))
             for c in (False, True)]
    if args.varlen:
        cells = shapes.varlen_grid(bwd=True)
    if args.causal_only:
        cells = [c for c in cells if c.causal]
    if args.noncausal_only:
        cells = [c for c in cells if not c.causal]
    print(f"{'cell':<40} " + " ".join(f"{a:>14}" for a in arms) + "  b/a", flush=True)
    ratios = []
    for cell in cells:
        x = peers.make_inputs(cell, torch.device("cuda"))
        q, k, v = x["q"], x["k"], x["v"]
        if cell.lens is None:
            attend = lambda: flash_attn_func(q, k, v, causal=cell.causal, **kw)
        else:
            attend = lambda: flash_attn_varlen_func(**x, causal=cell.causal, **kw)
        dout = torch.randn_like(attend())
        grads, rates = {}, {arm: [] for arm in arms}
        for _ in range(args.rounds):
            for arm, setting in arms.items():
                for name in args.name.split("+"):  # (NAME1+NAME2: set together)
                    setattr(launch_bwd, name, setting)
                api._launches.clear()  # (launches hold their config)
                run = lambda: torch.autograd.grad(attend(), (q, k, v), dout)
                grads[arm] = run()  # compiles this arm's kernel on first use
                if len(rates[arm]) == 0:  # which backward kernel this arm ran
                    cfgs = [short(launch.cfg) for sig, (spec, launch) in api._launches.items()
                            if spec.kind == "bwd" and hasattr(launch, "cfg")]
                    print(f"  {arm}: {cfgs}", flush=True)
                fwd = median_ms(attend, torch.device("cuda"))
                both = median_ms(run, torch.device("cuda"))
                rates[arm].append(cell.rate(max(both - fwd, 1e-6)))
        first, second = (grads[arm] for arm in arms)
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(first, second))
        a, b = (statistics.median(rates[arm]) for arm in arms)
        print(f"{cell.label():<40} {a:14.1f} {b:14.1f}  {b / a:6.3f}  (max |grad diff| {diff:.2e})",
              flush=True)
        ratios.append(b / a)
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{args.name} {args.b} / {args.a}: {min(ratios):.3f}-{max(ratios):.3f}, geometric mean {geo:.3f}")
    sys.exit(0 if geo > 1.0 else 3)


if __name__ == "__main__":
    main()
