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
_stats = {"compiles": 0, "hits": 0, "compile_seconds": {}}


def get_or_compile(key: Hashable, build: Callable[[], object]):
    fn = _kernels.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _kernels.get(key)
        if fn is None:
            start = time.perf_counter()
            fn = build()
            _stats["compile_seconds"][key] = time.perf_counter() - start
            _stats["compiles"] += 1
            _kernels[key] = fn
        else:
            _stats["hits"] += 1
    return fn


def stats() -> dict:
    """Counts of compilations and cache hits, and the seconds each variant took to compile."""
    return {"compiles": _stats["compiles"], "hits": _stats["hits"],
            "compile_seconds": dict(_stats["compile_seconds"])}


def clear() -> None:
    with _lock:
        _kernels.clear()
