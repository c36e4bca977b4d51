"""The GPU's SM clock and power while one forward cell runs back to back, per implementation: does
our kernel lose clock under the power limit where another keeps it? (The bench's sustained rounds
put some cells 6-8% below flash-attn-4 that run within 2% of it, or ahead, as one call alone.)
Each implementation runs for `seconds` of queued calls while nvidia-smi samples every 50 ms;
the implementations go in turn, then again in reverse order. On the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/dev_clock_log.py 192/128 4096 1 [seconds]
(head_dim or head_dim/head_dim_v, seqlen, causal 0/1; batch x seqlen = 16384 tokens, the bench's
heads for that head dim.)
"""
import statistics
import subprocess
import sys
import time

import torch

from cuteattn.bench import peers, shapes

d, _, dv = sys.argv[1].partition("/")
d, dv, seqlen, causal = int(d), int(dv or d), int(sys.argv[2]), sys.argv[3] == "1"
seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
heads = {80: 24, 96: 24, 192: 16}.get(d, shapes.HIDDEN // d)
cell = shapes.Cell("fwd", d, shapes.TOKENS // seqlen, heads, heads, seqlen, seqlen, causal,
                   dv=None if dv == d else dv)
dev = torch.device("cuda")
x = peers.make_inputs(cell, dev)
impls = {name: fn for name, fn in peers.implementations(cell, x, dev).items()
         if not isinstance(fn, str) and name != "sdpa-flash"}
for fn in impls.values():
    fn()
torch.cuda.synchronize()


def run(name, fn):
    """(ms a call, median SM MHz, median W, max temperature C) over `seconds` of queued calls."""
    began = time.perf_counter()
    while time.perf_counter() - began < 0.3:  # the clocks settle on this kernel first
        fn()
        torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, began = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - began < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    mhz, watts, temp = ([float(r[i]) for r in rows] for i in range(3))
    return start.elapsed_time(end) / calls, statistics.median(mhz), statistics.median(watts), max(temp)


print(f"{cell.label()}: {seconds} s of calls each")
for order in (list(impls), list(reversed(impls))):
    for name in order:
        ms, mhz, watts, temp = run(name, impls[name])
        print(f"  {name:12s} {ms * 1e3:8.1f} us a call  {cell.rate(ms):7.1f} TFLOP/s  "
              f"SM {mhz:6.0f} MHz  {watts:5.0f} W  {temp:3.0f} C", flush=True)

# Then each call timed alone (CUDA events around it), as the bench's rounds do (the previous
# call's inputs and outputs partly in L2) and with L2 flushed before it (a 512 MB write between
# calls, outside the events), as one cold call under Nsight Compute sees it.
flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)


def per_call_us(fn, flushed, iters=40):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        if flushed:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


print("per call, median of 40 (us): warm L2 / flushed L2")
for order in (list(impls), list(reversed(impls))):
    for name in order:
        warm, cold = per_call_us(impls[name], False), per_call_us(impls[name], True)
        print(f"  {name:12s} {warm:8.1f} {cold:8.1f}", flush=True)
