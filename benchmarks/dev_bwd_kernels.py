"""Where a backward call's time goes: per implementation and cell, the median event time of one
call (as the bench times it) beside the GPU time of each kernel it launched (torch.profiler),
so a host-bound cell or one slow kernel shows. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_bwd_kernels.py [--d 128] [--seqlen 1024,4096]
        [--impls cuteattn,fa4] [--deterministic] [--sparse 0.9 [--block 128,128]] [--cprofile]
(--sparse: the block-sparse backward's cells instead, B=1, H=12, d=128, that fraction of the
logical 256 x 256 blocks left out, physical blocks --block. --cprofile: also the host
functions' own and cumulative time over 50 calls, for a call slower than its kernels.)
"""
import argparse
import collections
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from cuteattn.bench import peers
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import median_ms

ITERS = 10


def kernel_times(fn) -> dict:
    """name -> microseconds of GPU time per call, over ITERS profiled calls."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    times = collections.Counter()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name[:60]] += evt.device_time_total / ITERS
    return dict(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="128")
    ap.add_argument("--seqlen", default="1024,4096")
    ap.add_argument("--impls", default="cuteattn,fa4")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--sparse", type=float, help="the sparse_bwd cells at this sparsity")
    ap.add_argument("--block", default="128,128", help="--sparse's physical block (q,k)")
    ap.add_argument("--cprofile", action="store_true", help="the host time's functions too")
    args = ap.parse_args()
    device = torch.device("cuda")
    for d in map(int, args.d.split(",")):
        for s in map(int, args.seqlen.split(",")):
            for causal in ((False,) if args.sparse is not None else (False, True)):
                if args.sparse is not None:
                    bq, bk = map(int, args.block.split(","))
                    cell = Cell("sparse_bwd", d, 1, 12, 12, s, s, False, sparsity=args.sparse,
                                block_q=bq, block_k=bk)
                else:
                    cell = Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s, causal)
                x = peers.make_inputs(cell, device)
                impls = peers.implementations(cell, x, device)
                for name in args.impls.split(","):
                    if args.deterministic and name == "cuteattn":
                        name = "cuteattn-deterministic"
                    fn = impls.get(name)
                    if not callable(fn):
                        print(f"{name}: {fn}")
                        continue
                    fn()
                    ms = median_ms(fn, device)
                    tflops = cell.rate(ms)
                    kt = kernel_times(fn)
                    gpu_us = sum(kt.values())
                    print(f"d={d} s={s} causal={causal} {name}: {ms * 1e3:.0f} us/call "
                          f"({tflops:.0f} TFLOP/s), kernels {gpu_us:.0f} us", flush=True)
                    for kname, us in sorted(kt.items(), key=lambda kv: -kv[1]):
                        print(f"    {us:8.1f} us  {kname}")
                    if args.cprofile:
                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(50):
                            fn()
                        torch.cuda.synchronize()
                        prof.disable()
                        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
                        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
                del x, impls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
