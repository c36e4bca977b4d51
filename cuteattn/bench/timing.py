"""Timing: CUDA events on a GPU (median of per-iteration times after a warm-up), wall clock on CPU."""
from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_call(fn, device: torch.device):
    """(seconds, result) of one call including completion: for cuteattn's first call, mostly the compile."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


# On a GPU the warm-up also lasts this long: after an idle spell (a cell's kernel compiling for
# seconds) the clocks take a while to come back, and five calls of a 1k-token backward (~1.5 ms)
# left one cell at 284 TFLOP/s that ran at 440 in a run without the compile before it.
MIN_WARMUP_S = 0.2


def median_ms(fn, device: torch.device, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of one call of fn (already called once, so no compile inside)."""
    _sync(device)
    began, calls = time.perf_counter(), 0
    while calls < warmup or (device.type == "cuda" and time.perf_counter() - began < MIN_WARMUP_S):
        fn()
        calls += 1
        _sync(device)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


# A spin of this many GPU clock cycles (~1-2 ms) runs before each timed call of gpu_busy_ms:
# longer than a Python call takes to enqueue its kernels, so the GPU never waits for the host
HOST_COVER_CYCLES = 2_000_000


def gpu_busy_ms(fn, device: torch.device, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds the GPU spends on one call of fn's kernels, without the host's time to
    launch them: each call's start event is queued behind a spin kernel, so fn's kernels are
    already queued when the GPU reaches it (for small work, such as the block-sparse builders,
    whose Python call takes longer than their kernels; median_ms would time the call). On CPU,
    median_ms."""
    if device.type != "cuda":
        return median_ms(fn, device, warmup, iters)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        torch.cuda._sleep(HOST_COVER_CYCLES)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graph_replay_ms(fn, device: torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of one replay of a CUDA graph holding one call of fn, captured after
    warm-up calls on a side stream: the launch cost a serving engine pays when it replays its
    decoding step (raises if fn cannot be captured, e.g. it reads a device value on the host)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, device, warmup=warmup, iters=iters)
