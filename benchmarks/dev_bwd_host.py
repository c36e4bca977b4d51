"""The backward's host time per call: torch.autograd.grad of cuteattn's forward, and
api.backward called directly (what its autograd formula runs), beside flash-attn-4's
autograd.grad; then where the autograd call's host time goes (cProfile, its backward run in the
calling thread) and its CPU-side ops (torch.profiler). Calls are queued without synchronisation, so at a tiny shape the time per
call is the host's. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_bwd_host.py [--shape 1,128,16,128] [--causal]
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cuteattn import api, flash_attn_func, ops


def per_call_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,128,16,128")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    b, s, h, d = map(int, args.shape.split(","))
    q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    out, lse = flash_attn_func(q, k, v, causal=args.causal, strict=True, return_lse=True)
    dout = torch.randn_like(out)
    grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    qd, kd, vd, od, ld = (t.detach() for t in (q, k, v, out, lse))
    scale, causal, left, right, softcap = ops._normalised(q, None, args.causal, (-1, -1), 0.0)
    direct = lambda: api.backward(dout, qd, kd, vd, od, ld, scale, causal, (left, right), softcap,
                                  False, True)
    rows = {"cuteattn autograd.grad": per_call_us(grad), "cuteattn api.backward": per_call_us(direct)}
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
        fout = fa4(q, k, v, causal=args.causal)
        fout = fout[0] if isinstance(fout, tuple) else fout
        rows["fa4 autograd.grad"] = per_call_us(
            lambda: torch.autograd.grad(fout, (q, k, v), dout, retain_graph=True))
    except Exception as e:
        print(f"fa4 not measured: {type(e).__name__}: {e}")
    for name, us in rows.items():
        print(f"{name:<24} {us:8.1f} us/call  (shape {args.shape}, causal={args.causal})")
    # the autograd call with its backward in this thread (the engine runs it on a device
    # thread otherwise, which cProfile would not see)
    with torch.autograd.set_multithreading_enabled(False):
        rows_1t = per_call_us(grad)
        print(f"{'cuteattn autograd.grad, backward in the calling thread':<24} {rows_1t:8.1f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            grad()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue()[-6000:])
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20):
            grad()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
