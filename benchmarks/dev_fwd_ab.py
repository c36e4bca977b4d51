"""A/B of an sm90 forward switch in one process: each cell of the forward bench's grids (default
d=64/128/256, the surface rows d=80/96/192, the varlen cells) timed with the switch off and on,
interleaved and repeated (best of rounds), with the ratio on/off; exits 3 if the geometric mean
loses. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_fwd_ab.py FLAG [--rounds N] [--grid default,surface,varlen]
        [--fp16] [--path sm80] [--set NAME=VALUE] [--d 128,256]    (--grid fp8: the fp8
        forward's cells, --grid sparse: the block-sparse bench's; --d: only those head dims)
FLAG names a boolean constant of cuteattn/kernels/sm90/config.py (sm80/config.py with --path
sm80, which runs the portable kernels); off is False, on is True. NAME=A,B compares two values
of a numeric constant of that config or of cuteattn/kernels/launch_common.py (host-side
choices such as L2_SHARE: no recompile), "off" being A. --set NAME=VALUE fixes another constant
of that config for both sides (e.g. a candidate on while its bound is compared)."""
import math
import os
import sys

argv = sys.argv[1:]
opt = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
path = opt("--path", "sm90")
if path != "sm90":
    os.environ["CUTEATTN_PATH"] = path

import torch  # noqa: E402

from cuteattn import api
from cuteattn.bench import peers, shapes
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import config as sm90_config  # noqa: E402
from cuteattn.kernels.sm80 import config as sm80_config  # noqa: E402
from cuteattn.kernels import launch_common  # noqa: E402

config = sm80_config if path == "sm80" else sm90_config
flag, values = argv[0], (False, True)
if "=" in flag:
    flag, pair = flag.split("=")
    values = tuple(float(v) if "." in v else int(v) for v in pair.split(","))
    if not hasattr(config, flag):
        config = launch_common
if "--set" in argv:
    name, value = opt("--set", "").split("=")
    literal = {"True": True, "False": False}
    owner = next(c for c in (sm80_config if path == "sm80" else sm90_config, launch_common)
                 if hasattr(c, name))
    setattr(owner, name, literal[value] if value in literal
            else float(value) if "." in value else int(value))
rounds = int(opt("--rounds", 2))
grids = opt("--grid", "default,surface,varlen").split(",")
dev = torch.device("cuda")
cells = []
for g in grids:
    cells += {"default": shapes.default_grid, "surface": shapes.surface_grid,
              "varlen": shapes.varlen_grid, "fp8": shapes.fp8_grid,
              "sparse": shapes.sparse_grid}[g]()
if "--d" in argv:  # only these head dims (comma-separated)
    cells = [c for c in cells if str(c.d) in opt("--d", "").split(",")]
if "--fp16" in argv:
    import dataclasses
    cells = [dataclasses.replace(c, dtype="fp16") for c in cells]


def use(on: bool):
    setattr(config, flag, values[on])
    api._launches.clear()


logs = []
for cell in cells:
    x = peers.make_inputs(cell, dev)
    fn = (peers._fp8(cell, x, dev)["cuteattn"] if cell.kind == "fp8"
          else peers._sparse(cell, x, dev)["cuteattn"] if cell.kind == "sparse"
          else peers._cuteattn(cell, x, strict=True))
    best = {}
    for _ in range(rounds):
        for on in (False, True):
            use(on)
            fn()
            best[on] = min(best.get(on, 1e9), median_ms(fn, dev))
    ratio = best[False] / best[True]
    logs.append(math.log(ratio))
    print(f"{cell.label():40s} off {cell.rate(best[False]):7.1f} on {cell.rate(best[True]):7.1f} "
          f"TFLOP/s  on/off {ratio:.3f}", flush=True)
gm = math.exp(sum(logs) / len(logs))
print(f"{flag}: geometric mean {gm:.4f} over {len(logs)} cells")
sys.exit(3 if gm < 1.0 else 0)
