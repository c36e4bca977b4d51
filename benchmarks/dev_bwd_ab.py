"""A/B of the backward's overlap (bwd.Sm90BwdConfig.overlap: the next query block's S^T / dP^T
GEMMs in flight under this block's dQ additions) against none, in one process: both compiled,
timed alternately on the same inputs, TFLOP/s of the backward per cell.
Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_bwd_ab.py [rounds]"""
import statistics
import sys

import torch

from cuteattn import api, flash_attn_func
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import launch_bwd

ARMS = {"none": {d: ("",) for d in launch_bwd.OVERLAPS}, "overlap": dict(launch_bwd.OVERLAPS)}


def main(rounds: int = 3) -> None:
    cells = [Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, c)
             for d in (64, 128) for s in (1024, 4096, 16384) for c in (False, True)]
    print(f"{'cell':<40} {'none':>8} {'overlap':>8}  overlap/none", flush=True)
    for cell in cells:
        shape = lambda s, h: (cell.batch, s, h, cell.d)
        q = torch.randn(shape(cell.seqlen_q, cell.nheads), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k = torch.randn(shape(cell.seqlen_k, cell.nheads_k), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn_like(flash_attn_func(q, k, v, causal=cell.causal, strict=True))
        grads, rates = {}, {arm: [] for arm in ARMS}
        for _ in range(rounds):
            for arm, overlaps in ARMS.items():
                launch_bwd.OVERLAPS = overlaps
                api._launches.clear()  # (launches hold their config)
                run = lambda: torch.autograd.grad(
                    flash_attn_func(q, k, v, causal=cell.causal, strict=True), (q, k, v), dout)
                grads[arm] = run()  # compiles this arm's kernel on first use
                fwd = median_ms(lambda: flash_attn_func(q, k, v, causal=cell.causal, strict=True),
                                torch.device("cuda"))
                both = median_ms(run, torch.device("cuda"))
                rates[arm].append(cell.rate(max(both - fwd, 1e-6)))
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(grads["none"], grads["overlap"]))
        a, b = (statistics.median(rates[arm]) for arm in ARMS)
        print(f"{cell.label():<40} {a:8.1f} {b:8.1f}  {b / a:6.3f}  (max |grad diff| {diff:.2e})",
              flush=True)
    launch_bwd.OVERLAPS = ARMS["overlap"]


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
