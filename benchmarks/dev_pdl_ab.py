"""A/B of the sm90 forward's programmatic dependent launch (config.PDL) as a stream of calls
runs it: the time of N queued calls between one pair of events (no event between calls, which
could hold a dependent launch back), back to back and with a small PyTorch kernel between
calls, as a model's other ops sit between its attention calls (that kernel does not trigger the
launch early, so only our set-up overlaps its end). On the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/dev_pdl_ab.py [--rounds N] [--grid default,sparse] [--d 128]
"""
import math
import sys

import torch

from cuteattn import api
from cuteattn.bench import peers, shapes
from cuteattn.kernels.sm90 import config

argv = sys.argv[1:]
opt = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
rounds = int(opt("--rounds", 3))
dev = torch.device("cuda")
cells = []
for g in opt("--grid", "default").split(","):
    cells += {"default": shapes.default_grid, "surface": shapes.surface_grid,
              "varlen": shapes.varlen_grid, "sparse": shapes.sparse_grid}[g]()
if "--d" in argv:
    cells = [c for c in cells if str(c.d) in opt("--d", "").split(",")]
CALLS = 50
other = torch.zeros(1 << 20, device=dev)  # 4 MB: a few microseconds of an elementwise kernel


def stream_ms(fn, between: bool) -> float:
    """Milliseconds a call of fn takes in a stream of CALLS queued calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn()
        if between:
            other.add_(1.0)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


logs = {False: [], True: []}
for cell in cells:
    x = peers.make_inputs(cell, dev)
    fn = (peers._sparse(cell, x, dev)["cuteattn"] if cell.kind == "sparse"
          else peers._cuteattn(cell, x, strict=True))
    best = {}
    for _ in range(rounds):
        for between in (False, True):
            for on in (False, True):
                config.PDL = on
                api._launches.clear()
                fn()
                key = (between, on)
                best[key] = min(best.get(key, 1e9), stream_ms(fn, between))
    line = f"{cell.label():40s}"
    for between in (False, True):
        ratio = best[(between, False)] / best[(between, True)]
        logs[between].append(math.log(ratio))
        line += (f" | {'with op' if between else 'alone'}: off {best[(between, False)] * 1e3:8.1f}"
                 f" on {best[(between, True)] * 1e3:8.1f} us on/off {ratio:.3f}")
    print(line, flush=True)
for between in (False, True):
    gm = math.exp(sum(logs[between]) / len(logs[between]))
    print(f"PDL {'with an op between calls' if between else 'back to back'}: geometric mean "
          f"{gm:.4f} over {len(logs[between])} cells")
