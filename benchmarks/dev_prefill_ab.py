"""A/B of the paged-prefill candidates in one process: the bench's prefill cells (2048
queries over a 16k-key paged cache, causal; pages of 16 and 128) timed with each variant,
interleaved per cell and repeated, beside our fixed-length forward on the same keys.
Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_prefill_ab.py FLAG ... [--rounds 3] [--path sm80]
FLAG names a constant of cuteattn/kernels/sm90/config.py (with --path sm80: sm80/config.py,
every call on the portable kernels) set True for that variant, or NAME=VALUE sets it to a
Python literal without commas (a comma separates a variant's flags; e.g.
PAGED_GATHER_MIN_ROWS=1000000000: no gather; LAZY_RESCALE_HEAD_DIMS=() with --path sm80);
'base': the defaults. Prints each variant's time, its ratio to the first, and
the fixed-length forward's time over it (the issue's metric: >= 0.9)."""
import ast
import os
import sys

if "--path" in sys.argv:
    os.environ["CUTEATTN_PATH"] = sys.argv[sys.argv.index("--path") + 1]
import torch

from cuteattn import api
from cuteattn.bench import peers, shapes
from cuteattn.bench.timing import median_ms
if os.environ.get("CUTEATTN_PATH") == "sm80":
    from cuteattn.kernels.sm80 import config
else:
    from cuteattn.kernels.sm90 import config

rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
options = {sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a in ("--rounds", "--path")}
args = [a for a in sys.argv[1:] if not a.startswith("--") and a not in options]
variants = [tuple(f for f in a.split(",") if f != "base") for a in args] or [()]
name_of = lambda f: f.split("=")[0]
defaults = {name_of(f): getattr(config, name_of(f)) for v in variants for f in v}
dev = torch.device("cuda")


def set_variant(v):
    for name, value in defaults.items():
        setattr(config, name, value)
    for f in v:
        name, _, value = f.partition("=")
        setattr(config, name, ast.literal_eval(value) if value else True)
    api._launches.clear()


for cell in shapes.prefill_grid():
    impls = peers._prefill(cell, peers._decode_inputs(cell, dev, torch.bfloat16), dev)
    fixed = median_ms(impls["cuteattn-fixed"], dev)
    best = {}
    for _ in range(rounds):
        for v in variants:
            set_variant(v)
            impls["cuteattn"]()
            best[v] = min(best.get(v, 1e9), median_ms(impls["cuteattn"], dev))
    base = best[variants[0]]
    row = "  ".join(f"{'+'.join(v) or 'base'} {best[v] * 1e3:6.0f} us ({base / best[v]:.3f}x, "
                    f"fixed/paged {fixed / best[v]:.3f})" for v in variants)
    print(f"prefill page{cell.page_size}: fixed {fixed * 1e3:6.0f} us  {row}", flush=True)
