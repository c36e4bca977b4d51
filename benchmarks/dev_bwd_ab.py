"""A/B of the backward's query rows per step at d=64 (launch_bwd.D64_TILE_M: 64 or 128, the
latter FlashAttention-4's 128 x 128), in one process: both compiled, timed alternately on the
same inputs, TFLOP/s of the backward per cell (plain and deterministic), and whether their
gradients agree. Exits 3 when 128 loses on the geometric mean.
Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_bwd_ab.py [rounds]"""
import math
import statistics
import sys

import torch

from cuteattn import api, flash_attn_func
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import launch_bwd

ARMS = {"rows64": 64, "rows128": 128}


def main(rounds: int = 3) -> None:
    cells = [Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, c)
             for d in (64,) for s in (1024, 4096, 16384) for c in (False, True)]
    print(f"{'cell':<40} {'rows64':>9} {'rows128':>8}  128/64  (deterministic: 64, 128)", flush=True)
    ratios = []
    for cell in cells:
        shape = lambda s, h: (cell.batch, s, h, cell.d)
        q = torch.randn(shape(cell.seqlen_q, cell.nheads), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k = torch.randn(shape(cell.seqlen_k, cell.nheads_k), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        dout = torch.randn_like(flash_attn_func(q, k, v, causal=cell.causal, strict=True))
        grads, rates, det_rates = {}, {arm: [] for arm in ARMS}, {arm: [] for arm in ARMS}
        for _ in range(rounds):
            for arm, rows in ARMS.items():
                launch_bwd.D64_TILE_M = rows
                api._launches.clear()  # (launches hold their config)
                run = lambda: torch.autograd.grad(
                    flash_attn_func(q, k, v, causal=cell.causal, strict=True), (q, k, v), dout)
                grads[arm] = run()  # compiles this arm's kernel on first use
                fwd = median_ms(lambda: flash_attn_func(q, k, v, causal=cell.causal, strict=True),
                                torch.device("cuda"))
                both = median_ms(run, torch.device("cuda"))
                rates[arm].append(cell.rate(max(both - fwd, 1e-6)))
                det = lambda: torch.autograd.grad(flash_attn_func(
                    q, k, v, causal=cell.causal, deterministic=True, strict=True), (q, k, v), dout)
                det()
                det_rates[arm].append(cell.rate(max(median_ms(det, torch.device("cuda")) - fwd, 1e-6)))
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(grads["rows64"], grads["rows128"]))
        a, b = (statistics.median(rates[arm]) for arm in ARMS)
        da, db = (statistics.median(det_rates[arm]) for arm in ARMS)
        print(f"{cell.label():<40} {a:8.1f} {b:8.1f}  {b / a:6.3f}  ({da:.1f}, {db:.1f}; "
              f"max |grad diff| {diff:.2e})", flush=True)
        ratios.append(b / a)
    launch_bwd.D64_TILE_M = 128
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"128 / 64 rows: {min(ratios):.3f}-{max(ratios):.3f}, geometric mean {geo:.3f}")
    sys.exit(0 if geo > 1.0 else 3)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
