"""What a block-sparse tile costs besides its key blocks (issue 15: the 90% cells at S=8192 run
at ~0.45 of the dense rate a block). The block-sparse forward (bf16, B=1, d=128, S=8192,
128x128 blocks, every query block keeping the same number of random 256-key logical blocks,
as the sparse bench) timed over kept counts and head counts; a least-squares fit of

    time = launch + rounds * (tile + steps * step)

(rounds: tiles / SMs rounded up, steps: 128-key blocks a tile) splits the time into a fixed
cost a launch, a cost a tile beyond its blocks, and a cost a block. Each call is also timed
from a CUDA graph's replays and by the profiler's kernel duration, to show what of the event
time is the kernel. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_sparse_overhead.py [--seqlen S] [--block 128x128]
        [--on FLAG]    (--on: a boolean constant of kernels/sm90/config.py set True first)"""
import sys

import torch

from cuteattn import flash_attn_func, sparse
from cuteattn.bench.timing import graph_replay_ms, median_ms
from cuteattn.kernels.sm90 import config

argv = sys.argv[1:]
opt = lambda name, default: argv[argv.index(name) + 1] if name in argv else default
seqlen = int(opt("--seqlen", 8192))
block_q, block_k = map(int, opt("--block", "128x128").split("x"))
if "--on" in argv:
    setattr(config, opt("--on", ""), True)
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(dev).multi_processor_count
logical = 256
n = seqlen // logical


def call(heads: int, keep: int):
    q, k, v = (torch.randn(1, seqlen, heads, 128, device=dev, dtype=torch.bfloat16)
               for _ in range(3))
    top = torch.rand(1, heads, n, n, device=dev).topk(keep, dim=-1).indices
    blocks = sparse.expand(sparse.from_topk(top, n, logical, logical), block_q, block_k)
    return lambda: flash_attn_func(q, k, v, block_sparse=blocks, strict=True)


def kernel_us(fn) -> float:
    """The median duration of fn's kernels by the profiler (CUPTI), microseconds."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times = sorted(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA"
                   and "Memset" not in e.name)
    return times[len(times) // 2] if times else float("nan")


rows = []
print(f"S={seqlen} blocks {block_q}x{block_k}, {sms} SMs")
print(f"{'heads':>5} {'keep':>4} {'tiles':>5} {'rounds':>6} {'steps':>5} {'event_us':>9} "
      f"{'graph_us':>9} {'kernel_us':>9} {'TFLOP/s':>8}")
for heads in (12, 24, 48):
    for keep in (1, 2, 3, 4, 8, 16, 32):
        fn = call(heads, keep)
        fn()
        tiles = heads * seqlen // block_q
        rounds = -(-tiles // sms)
        steps = keep * logical // 128  # 128-key visits a tile (64-key lists go in pairs)
        ev = min(median_ms(fn, dev) for _ in range(3)) * 1e3
        gr = graph_replay_ms(fn, dev) * 1e3
        ku = kernel_us(fn)
        flops = 4 * heads * 128 * seqlen * keep * logical
        rows.append((rounds, steps, ku))
        print(f"{heads:5d} {keep:4d} {tiles:5d} {rounds:6d} {steps:5d} {ev:9.1f} {gr:9.1f} {ku:9.1f} "
              f"{flops / ev / 1e6:8.1f}")
        del fn
a = torch.tensor([[1.0, r, r * s] for r, s, _ in rows], dtype=torch.float64)
b = torch.tensor([t for *_, t in rows], dtype=torch.float64)
fit = torch.linalg.lstsq(a, b[:, None]).solution.flatten()
resid = (a @ fit - b).abs().max().item()
print(f"fit (kernel time): launch {fit[0]:.2f} us, tile {fit[1]:.2f} us, block step {fit[2]:.3f} us "
      f"(largest residual {resid:.1f} us)")
