"""A/B of the backward's GEMM order (bwd.Sm90BwdConfig.dq_before_dk: dQ's GEMM issued before
dK's, dQ's additions made while dK's runs) against dK's first and every GEMM waited for, in one
process: both compiled, timed alternately on the same inputs, TFLOP/s of the backward per cell,
and whether their gradients agree. Exits 3 when the new order loses on the geometric mean.
Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_bwd_ab.py [rounds]"""
import math
import statistics
import sys

import torch

from cuteattn import api, flash_attn_func
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import launch_bwd

ARMS = {"dk_first": False, "dq_first": True}


def main(rounds: int = 3) -> None:
    cells = [Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, c)
             for d in (64, 128, 256) for s in (1024, 4096, 16384) for c in (False, True)]
    print(f"{'cell':<40} {'dk_first':>9} {'dq_first':>8}  dq_first/dk_first", flush=True)
    ratios = []
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
            for arm, dq_first in ARMS.items():
                launch_bwd.DQ_BEFORE_DK = dq_first
                api._launches.clear()  # (launches hold their config)
                run = lambda: torch.autograd.grad(
                    flash_attn_func(q, k, v, causal=cell.causal, strict=True), (q, k, v), dout)
                grads[arm] = run()  # compiles this arm's kernel on first use
                fwd = median_ms(lambda: flash_attn_func(q, k, v, causal=cell.causal, strict=True),
                                torch.device("cuda"))
                both = median_ms(run, torch.device("cuda"))
                rates[arm].append(cell.rate(max(both - fwd, 1e-6)))
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(grads["dk_first"], grads["dq_first"]))
        a, b = (statistics.median(rates[arm]) for arm in ARMS)
        print(f"{cell.label():<40} {a:8.1f} {b:8.1f}  {b / a:6.3f}  (max |grad diff| {diff:.2e})",
              flush=True)
        ratios.append(b / a)
    launch_bwd.DQ_BEFORE_DK = True
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"dq_first / dk_first: {min(ratios):.3f}-{max(ratios):.3f}, geometric mean {geo:.3f}")
    sys.exit(0 if geo > 1.0 else 3)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
