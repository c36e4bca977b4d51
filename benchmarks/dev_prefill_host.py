"""Host time of a paged prefill call (flash_attn_varlen_func with block_table=), the enqueue
loop's wall clock without a sync, beside the GPU's time for the same call; 'kept' is the call
as it runs (its launch kept per spec), 'chosen each call' clears the kept launches before every
call, which is the work each call did before they were kept. Small shapes, where the host is
the limit: batch 4 x 64 queries over 1024 keys each, 32 / 8 heads, d=128, bf16, causal.
Usage (GPU): PYTHONPATH=$PWD python3 benchmarks/dev_prefill_host.py"""
import time

import torch

from cuteattn import api, flash_attn_varlen_func
from cuteattn.bench.timing import median_ms

dev = torch.device("cuda")
batch, sq, sk, h, hk, d = 4, 64, 1024, 32, 8, 128
for page in (16, 128):
    q = torch.randn(batch * sq, h, d, device=dev, dtype=torch.bfloat16)
    pages = batch * sk // page
    kc = torch.randn(pages, page, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, -1)
    cu_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * sq
    cu_k = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * sk
    call = lambda: flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, sq, sk, causal=True,
                                          block_table=table, strict=True)
    for arm, before in (("kept", lambda: None), ("chosen each call", api._launches.clear)):
        for _ in range(20):
            before()
            call()
        torch.cuda.synchronize()
        n = 300
        start = time.perf_counter()
        for _ in range(n):
            before()
            call()
        host_us = (time.perf_counter() - start) / n * 1e6
        torch.cuda.synchronize()
        gpu_us = median_ms(call, dev) * 1e3
        print(f"page {page:3d} {arm:17s} host {host_us:7.1f} us a call, GPU {gpu_us:7.1f} us",
              flush=True)
