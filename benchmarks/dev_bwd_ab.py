"""A/B of the backward's dQ paths in one process (bwd.Sm90BwdConfig.dq_store "red" against
"bulk"): both compiled side by side, timed alternately on the same inputs, TFLOP/s printed per
cell. Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_bwd_ab.py [rounds]"""
import statistics
import sys

import torch

from cuteattn import flash_attn_func
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import launch_bwd


def main(rounds: int = 3) -> None:
    cells = [Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, c)
             for d in (64, 128) for s in (1024, 4096, 16384) for c in (False, True)]
    print(f"{'cell':<40} {'red':>8} {'bulk':>8}  bulk/red")
    for cell in cells:
        shape = lambda s, h: (cell.batch, s, h, cell.d)
        q = torch.randn(shape(cell.seqlen_q, cell.nheads), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        k = torch.randn(shape(cell.seqlen_k, cell.nheads_k), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=cell.causal, strict=True)
        dout = torch.randn_like(out)
        rates = {"red": [], "bulk": []}
        for _ in range(rounds):
            for store in rates:
                launch_bwd.DQ_STORE = store
                run = lambda: torch.autograd.grad(
                    flash_attn_func(q, k, v, causal=cell.causal, strict=True), (q, k, v), dout)
                run()  # compiles this path's kernel on first use
                # the forward is timed too: subtract it
                fwd = median_ms(lambda: flash_attn_func(q, k, v, causal=cell.causal, strict=True),
                                torch.device("cuda"))
                both = median_ms(run, torch.device("cuda"))
                rates[store].append(cell.rate(max(both - fwd, 1e-6)))
        red, bulk = (statistics.median(rates[s]) for s in ("red", "bulk"))
        print(f"{cell.label():<40} {red:8.1f} {bulk:8.1f}  {bulk / red:6.3f}")
    launch_bwd.DQ_STORE = "red"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
