"""Where a decode step's time goes: host time per call (the enqueue loop's wall clock, no sync)
against the GPU's (queued events, CUDA-graph replay), and the kernels' own durations from the
torch profiler. A queued time above the replay's with host time near it means the GPU waits on
the host between calls. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_decode_overhead.py [--append] [--page 16] [--cprofile]
(--cprofile: the host functions' own and cumulative time over 300 steps instead).
Shapes: bf16, 32/8 heads, d=128, seqlen_q 1; batch x cache 1 x 131072 and 8 x 32768."""
import sys
import time

import torch

from cuteattn import flash_attn_with_kvcache
from cuteattn.bench.timing import graph_replay_ms, median_ms

append = "--append" in sys.argv
page = int(sys.argv[sys.argv.index("--page") + 1]) if "--page" in sys.argv else 0
dev = torch.device("cuda")
for batch, length in ((1, 131072), (8, 32768)):
    h, hk, d = 32, 8, 128
    q = torch.randn(batch, 1, h, d, device=dev, dtype=torch.bfloat16)
    if page:
        pages = batch * length // page
        kc = torch.randn(pages, page, hk, d, device=dev, dtype=torch.bfloat16)
        table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, -1)
    else:
        kc = torch.randn(batch, length, hk, d, device=dev, dtype=torch.bfloat16)
        table = None
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), length - 1 if append else length, device=dev, dtype=torch.int32)
    kn = torch.randn(batch, 1, hk, d, device=dev, dtype=torch.bfloat16) if append else None
    vn = torch.randn_like(kn) if append else None

    def step():
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                       strict=True)
    step()
    torch.cuda.synchronize()
    if "--cprofile" in sys.argv:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            step()
        prof.disable()
        torch.cuda.synchronize()
        print(f"b{batch} x {length}: host profile, 300 steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        break
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    queued = median_ms(step, dev, iters=50) * 1e3
    graph = graph_replay_ms(step, dev, iters=50) * 1e3
    gb = 2 * batch * length * hk * d * 2 / 1e9
    print(f"b{batch} x {length} page {page} append {append}: host {host_us:.1f} us/call, "
          f"queued {queued:.1f} us ({gb / queued * 1e6:.0f} GB/s), graph {graph:.1f} us "
          f"({gb / graph * 1e6:.0f} GB/s)", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            print(f"    {e.key[:90]:<90} {e.count:>4} x {getattr(e, "device_time", 0) or e.cuda_time:.1f} us")
