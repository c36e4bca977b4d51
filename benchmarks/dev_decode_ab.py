"""A/B of the portable decode kernel's compile-time candidates in one process: every decode
cell of the bench's grid (bf16 and the fp8 cache) timed by CUDA-graph replay with each
combination of config flags, interleaved per cell and repeated, so clocks and placement are
shared. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_decode_ab.py FLAG[,FLAG] ... [--rounds 2] [--quick] [--bf16 | --fp8]
        [--batch 1,8]
FLAG names a constant of cuteattn/kernels/sm80/config.py set True for that variant, or
NAME=INT sets it to that value, ctas=N runs every step at N CTAs an SM ('base': the defaults). Prints GB/s (cache bytes read / time) per cell and variant, and each variant's
ratio to the first."""
import sys

import torch

from cuteattn import kvcache
from cuteattn.bench import peers, shapes
from cuteattn.bench.timing import graph_replay_ms
from cuteattn.kernels.sm80 import config

args = [a for a in sys.argv[1:] if not a.startswith("--")]
rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2
batches = (sys.argv[sys.argv.index("--batch") + 1] if "--batch" in sys.argv else "")
args = [a for a in args if a not in (str(rounds), batches)]
variants = [tuple(f for f in a.split(",") if f != "base") for a in args] or [()]
setting = lambda f: (f.split("=")[0], int(f.split("=")[1])) if "=" in f else (f, True)
# ("ctas=N": every step at N CTAs an SM, config.decode_ctas_per_sm's rule replaced)
patch = lambda name, value: (("decode_ctas_per_sm", lambda *args: value) if name == "ctas"
                             else (name, value))
defaults = {patch(*setting(f))[0]: getattr(config, patch(*setting(f))[0])
            for v in variants for f in v}
quick = "--quick" in sys.argv
dev = torch.device("cuda")
cells = ([] if "--bf16" in sys.argv else shapes.decode_grid(quick, fp8_kv=True)) + [
    c for c in shapes.decode_grid(quick) if c.kind == "decode" and "--fp8" not in sys.argv]
if batches:  # only these batch sizes
    cells = [c for c in cells if str(c.batch) in batches.split(",")]


def set_variant(v):
    for name, value in defaults.items():
        setattr(config, name, value)
    for f in v:
        setattr(config, *patch(*setting(f)))
    kvcache._decode_launches.clear()
    kvcache._steps.clear()


for cell in cells:
    x = peers._decode_inputs(cell, dev, torch.bfloat16)
    fn = peers._decode(cell, x, dev)["cuteattn"]
    nbytes = x["k"].numel() * x["k"].element_size() * 2
    best = {}
    for _ in range(rounds):
        for v in variants:
            set_variant(v)
            fn()
            ms = graph_replay_ms(fn, dev, iters=50)
            best[v] = min(best.get(v, 1e9), ms)
    base = best[variants[0]]
    row = "  ".join(f"{'+'.join(v) or 'base'} {nbytes / best[v] / 1e6:7.0f} GB/s ({base / best[v]:.3f}x)"
                    for v in variants)
    print(f"b{cell.batch} L{cell.seqlen_k} hk{cell.nheads_k} page{cell.page_size} "
          f"{cell.kv_dtype or 'bf16'}: {row}", flush=True)
    del x
    torch.cuda.empty_cache()
