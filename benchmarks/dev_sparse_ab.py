"""The block-sparse forward's open questions, timed in one process on the GPU:
  1. 64-row tiles with one or two CTAs per SM (config.SPARSE_CTAS_PER_SM), alternately on the
     same inputs;
  2. host time: each cell as plain calls (what the bench times) and as CUDA-graph replays (GPU
     time alone), to tell a host-bound cell from a slow kernel.
Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_sparse_ab.py [rounds]"""
import statistics
import sys

import torch

from cuteattn import api, flash_attn_func
from cuteattn.bench.peers import _sparse_inputs
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms
from cuteattn.kernels.sm90 import config

DEVICE = torch.device("cuda")


def graph_ms(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(rounds: int = 3) -> None:
    print(f"{'cell':<34} {'1 CTA/SM':>9} {'2 CTAs/SM':>9}   (TFLOP/s, 64x64 tiles)")
    for s in (8192, 32768):
        for p in (0.0, 0.5, 0.9):
            cell = Cell("sparse", 128, 1, 12, 12, s, s, False, sparsity=p, block_q=64, block_k=64)
            x = _sparse_inputs(cell, DEVICE, torch.bfloat16)
            call = lambda: flash_attn_func(x["q"], x["k"], x["v"], block_sparse=x["blocks"], strict=True)
            rates = {1: [], 2: []}
            for _ in range(rounds):
                for ctas in rates:
                    config.SPARSE_CTAS_PER_SM = ctas
                    api._launches.clear()
                    call()
                    rates[ctas].append(cell.rate(median_ms(call, DEVICE)))
            print(f"S={s} {int(p * 100)}% 64x64{'':<18} {statistics.median(rates[1]):>9.1f} "
                  f"{statistics.median(rates[2]):>9.1f}", flush=True)
    config.SPARSE_CTAS_PER_SM = 2
    api._launches.clear()
    print(f"\n{'cell':<34} {'calls':>9} {'graph':>9}   (TFLOP/s)")
    for s in (8192, 32768):
        for p in (0.0, 0.9):
            for bq, bk in ((128, 128), (128, 64), (64, 64)):
                cell = Cell("sparse", 128, 1, 12, 12, s, s, False, sparsity=p, block_q=bq, block_k=bk)
                x = _sparse_inputs(cell, DEVICE, torch.bfloat16)
                call = lambda: flash_attn_func(x["q"], x["k"], x["v"], block_sparse=x["blocks"],
                                               strict=True)
                call()
                print(f"S={s} {int(p * 100)}% {bq}x{bk}{'':<18} {cell.rate(median_ms(call, DEVICE)):>9.1f} "
                      f"{cell.rate(graph_ms(call)):>9.1f}", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
