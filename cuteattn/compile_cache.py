"""Compiled kernels by static configuration, held in memory for the life of the process.

`cute.compile` never caches and takes seconds, so every kernel variant is compiled once, on first
use, and looked up by its key afterwards. Keys hold only static configuration (dtype, head dim,
mask kind, ...); sizes are runtime arguments of the compiled kernel, so a new batch or sequence
length never recompiles. The lock keeps two threads from compiling the same variant twice.
"""
import threading
import time
from typing import Callable, Dict, Hashable

_lock = threading.Lock()
_kernels: Dict[Hashable, object] = {}
_stats = {"compiles": 0, "hits": 0, "compile_seconds": {}, "kernel_info": {}}


def get_or_compile(key: Hashable, build: Callable[[], object]):
    """`build()` returns the compiled kernel, or (kernel, info) where info is a dict of what the
    compiler reported (registers, spills), kept for stats()."""
    fn = _kernels.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _kernels.get(key)
        if fn is None:
            start = time.perf_counter()
            fn = build()
            if isinstance(fn, tuple):
                fn, info = fn
                _stats["kernel_info"][key] = dict(info)
            _stats["compile_seconds"][key] = time.perf_counter() - start
            _stats["compiles"] += 1
            _kernels[key] = fn
        else:
            _stats["hits"] += 1
    return fn


def stats() -> dict:
    """Counts of compilations and cache hits; per compiled variant (by key) the seconds it took
    to compile and what the compiler reported (registers, spill bytes)."""
    return {"compiles": _stats["compiles"], "hits": _stats["hits"],
            "compile_seconds": dict(_stats["compile_seconds"]),
            "kernel_info": {k: dict(v) for k, v in _stats["kernel_info"].items()}}


def clear() -> None:
    with _lock:
        _kernels.clear()
