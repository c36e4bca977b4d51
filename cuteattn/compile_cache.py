"""Compiled kernels by static configuration: in memory for the life of the process, and on disk
so that the next process loads them instead of compiling.

`cute.compile` never caches and takes seconds, so every kernel variant is compiled once, on first
use, and looked up by its key afterwards. Keys hold only static configuration (dtype, head dim,
mask kind, tile shape, ...); sizes are runtime arguments of the compiled kernel, so a new batch or
sequence length never recompiles. The lock keeps two threads from compiling the same variant twice.

Disk (on unless CUTEATTN_DISK_CACHE=0; directory CUTEATTN_CACHE_DIR, default ~/.cache/cuteattn):
kernels compiled for TVM-FFI are exported as object files (`export_to_c`) under a directory named by a
fingerprint of everything that shapes the code: cuteattn's kernel sources, the DSL and TVM-FFI
versions, and the target architecture. A changed source or version lands in a new directory, so a
stale kernel is never loaded. Files are written to a temporary name and renamed, so a concurrent
reader sees a whole file or none; one that fails to load is compiled again and replaced.
"""
import ctypes
import hashlib
import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Hashable

_lock = threading.Lock()
_kernels: Dict[Hashable, object] = {}
_stats = {"compiles": 0, "hits": 0, "disk_loads": 0, "compile_seconds": {}, "kernel_info": {}}

_EXPORT_NAME = "cuteattn_kernel"
_KERNEL_SOURCES = Path(__file__).parent / "kernels"


def disk_cache_enabled() -> bool:
    """On by default (GPU-verified at 89f8884: the GPU suite ran on kernels loaded from disk);
    CUTEATTN_DISK_CACHE=0 turns it off."""
    return os.environ.get("CUTEATTN_DISK_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _target_arch() -> str:
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch
    if torch.cuda.is_available():  # named as CUTE_DSL_ARCH would name it (sm_90a on Hopper)
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    return "unknown"


def fingerprint() -> str:
    """A hash of what the compiled code depends on besides the key."""
    import cutlass
    h = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCES.rglob("*.py")):
        h.update(str(path.relative_to(_KERNEL_SOURCES)).encode())
        h.update(path.read_bytes())
    try:
        import tvm_ffi
        tvm_version = tvm_ffi.__version__
    except ImportError:
        tvm_version = "none"
    h.update(f"cutlass={cutlass.__version__};tvm_ffi={tvm_version};arch={_target_arch()}".encode())
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    root = os.environ.get("CUTEATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuteattn")
    return Path(root) / fingerprint()


_runtime_loaded = False


def _load_runtime_libraries() -> None:
    """Exported kernels resolve the DSL runtime's symbols when loaded: load those libraries
    into the global namespace first (the loader does not)."""
    global _runtime_loaded
    if _runtime_loaded:
        return
    import cutlass.cute as cute
    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def _paths(key: Hashable):
    name = hashlib.sha256(pickle.dumps(key)).hexdigest()[:32]
    folder = cache_dir()
    return folder / f"{name}.o", folder / f"{name}.json"


def _load_from_disk(key: Hashable):
    """(fn, info) from disk, or None when absent or unloadable."""
    obj, meta = _paths(key)
    if not obj.exists():
        return None
    try:
        import cutlass.cute as cute
        _load_runtime_libraries()
        module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
        fn = getattr(module, _EXPORT_NAME)
        info = json.loads(meta.read_text()) if meta.exists() else {}
        return fn, info
    except Exception:  # a damaged or foreign file: compile again, and overwrite it
        return None


def _save_to_disk(key: Hashable, fn, info: dict) -> None:
    obj, meta = _paths(key)
    try:
        obj.parent.mkdir(parents=True, exist_ok=True)
        tmp = obj.with_name(f"{obj.stem}.{os.getpid()}.{threading.get_ident()}.tmp.o")
        fn.export_to_c(object_file_path=str(tmp), function_name=_EXPORT_NAME)
        meta.write_text(json.dumps(info))
        os.replace(tmp, obj)
    except Exception:  # a read-only or full disk, or a failed export, only costs a compile later
        pass


def get_or_compile(key: Hashable, build: Callable[[], object], persist: bool = False):
    """`build()` returns the compiled kernel, or (kernel, info) where info is a dict of what the
    compiler reported (registers, spills), kept for stats(). `persist`: the kernel was compiled
    for TVM-FFI, so it may be kept on disk (when the disk cache is enabled)."""
    fn = _kernels.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _kernels.get(key)
        if fn is not None:
            _stats["hits"] += 1
            return fn
        on_disk = persist and disk_cache_enabled()
        loaded = _load_from_disk(key) if on_disk else None
        if loaded is not None:
            fn, info = loaded
            _stats["disk_loads"] += 1
        else:
            start = time.perf_counter()
            fn = build()
            info = {}
            if isinstance(fn, tuple):
                fn, info = fn
            _stats["compile_seconds"][key] = time.perf_counter() - start
            _stats["compiles"] += 1
            if on_disk:
                _save_to_disk(key, fn, info)
        if info:
            _stats["kernel_info"][key] = dict(info)
        _kernels[key] = fn
    return fn


def stats() -> dict:
    """Counts of compilations, disk loads and cache hits; per compiled variant (by key) the
    seconds it took to compile and what the compiler reported (registers, spill bytes)."""
    return {"compiles": _stats["compiles"], "hits": _stats["hits"],
            "disk_loads": _stats["disk_loads"],
            "compile_seconds": dict(_stats["compile_seconds"]),
            "kernel_info": {k: dict(v) for k, v in _stats["kernel_info"].items()}}


def clear() -> None:
    """Forget the in-memory kernels (the disk cache stays)."""
    with _lock:
        _kernels.clear()
