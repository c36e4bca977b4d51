"""Host time per call (no synchronisation between calls) of cuteattn's entry points beside torch
SDPA (cuDNN, flash) and flash-attn-4, on tiny inputs so that the GPU is never the bottleneck:
the time the calling thread spends to launch one attention call.

    python benchmarks/host_overhead.py [--iters 2000]

Prints microseconds per call (median of 5 rounds) as a table; a 32-layer model pays this 32 times
a step.
"""
import argparse
import statistics
import time
import warnings

import torch


def per_call_us(fn, iters: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    from cuteattn import flash_attn_func, flash_attn_varlen_func
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, 128, 16, 128, device=dev, dtype=bf16)
    k = torch.randn(1, 128, 16, 128, device=dev, dtype=bf16)
    qp, kp = q[0], k[0]
    cu = torch.tensor([0, 128], dtype=torch.int32, device=dev)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    impls = {
        # strict=True: a fallback to the reference raises instead of being timed as a call
        "cuteattn flash_attn_func": lambda: flash_attn_func(q, k, k, causal=True, strict=True),
        "cuteattn flash_attn_varlen_func": lambda: flash_attn_varlen_func(
            qp, kp, kp, cu, cu, 128, 128, causal=True, strict=True),
    }
    for name, backend in (("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return sdpa(qt, kt, kt, is_causal=True)
        impls[name] = run
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4, flash_attn_varlen_func as fa4v
        impls["fa4 flash_attn_func"] = lambda: fa4(q, k, k, causal=True)
        impls["fa4 flash_attn_varlen_func"] = lambda: fa4v(
            qp, kp, kp, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128,
            causal=True)
    except Exception as e:  # not installed here
        print(f"flash-attn-4 not importable ({type(e).__name__}): not measured")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flash-attn-4's compile-time UserWarnings
        rows = [(name, per_call_us(fn, args.iters)) for name, fn in impls.items()]
    width = max(len(n) for n, _ in rows)
    print(f"{'call'.ljust(width)}  host us/call ({torch.cuda.get_device_name()})")
    for name, us in rows:
        print(f"{name.ljust(width)}  {us:8.1f}")


if __name__ == "__main__":
    main()
