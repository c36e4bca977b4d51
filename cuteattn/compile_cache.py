"""Compiled kernels by static configuration: in memory for the life of the process, and on disk
so that the next process loads them instead of compiling.

`cute.compile` never caches and takes seconds, so every kernel variant is compiled once, on first
use, and looked up by its key afterwards. Keys hold only static configuration (for the sm90
forward: the family and its frozen kernel config); sizes are runtime arguments of the compiled
kernel, so a new batch or sequence length never recompiles. The lock keeps two threads from
compiling the same variant twice.

Disk (on unless CUTEATTN_DISK_CACHE=0; directory CUTEATTN_CACHE_DIR, default ~/.cache/cuteattn):
kernels compiled for TVM-FFI are exported as object files (`export_to_c`) under a directory named by a
fingerprint of everything that shapes the code besides the key: the sources of the kernel's family
(`module_sources`: the modules its compile step imports, not every kernel file, so an edit to
another family's kernel evicts nothing here), the DSL and TVM-FFI versions, and the target
architecture. A changed source or version lands in a new directory, so a stale kernel is never
loaded. Within it a file is named by a hash of the key's stable text (`key_text`). Files are
written to a temporary name and renamed, so a concurrent reader sees a whole file or none; one
that fails to load is compiled again and replaced, with a CacheWarning; a directory that cannot
be written (read-only, full, not a directory) leaves kernels in memory only, with one CacheWarning.
"""
import ast
import ctypes
import dataclasses
import enum
import hashlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Hashable, Iterable, Optional, Tuple

_lock = threading.Lock()
_kernels: Dict[Hashable, object] = {}
_stats = {"compiles": 0, "hits": 0, "disk_loads": 0, "compile_seconds": {}, "kernel_info": {}}

_EXPORT_NAME = "cuteattn_kernel"
_unwritable_warned = False


class CacheWarning(UserWarning):
    """The disk cache could not be read or written; kernels are compiled (again) instead."""
_PACKAGE = "cuteattn"
_PACKAGE_ROOT = Path(__file__).parent


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


def module_sources(module: str, root: Path = _PACKAGE_ROOT) -> Tuple[Path, ...]:
    """The .py files of `module` (dotted, under cuteattn) and of every cuteattn module it imports,
    transitively: what a kernel compiled by `module` can depend on.

    Found by reading the import statements of the sources (ast), not from sys.modules after an
    import: the answer is then the same whatever the process happened to import before (importing
    any cuteattn module also runs cuteattn/__init__, which pulls in the whole API), it counts
    imports inside functions, and it needs nothing importable. Imports outside cuteattn (the DSL,
    the standard library) are covered by the versions in the fingerprint. Parent packages'
    __init__ files are not followed unless imported by name: they hold no kernel code, and
    cuteattn/__init__ would make every API edit evict every kernel. `root`: the directory of the
    cuteattn package (tests pass a copy)."""
    found: Dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = _module_file(name, root)
        if path is None or name in found:
            continue
        found[name] = path
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        pending.extend(_imported_modules(path, package, root))
    return tuple(sorted(found.values()))


def _module_file(name: str, root: Path) -> Optional[Path]:
    """The file of cuteattn module `name` under root, or None (not cuteattn's, or absent)."""
    if name != _PACKAGE and not name.startswith(_PACKAGE + "."):
        return None
    parts = name.split(".")[1:]
    for path in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def _imported_modules(path: Path, package: str, root: Path):
    """Dotted names `path` imports; for `from X import a` both X and X.a (a may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if node.module or node.level:
                yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def fingerprint(sources: Iterable[Path] = ()) -> str:
    """A hash of what the compiled code depends on besides the key: the given source files (by
    name and content), the DSL and TVM-FFI versions, and the target architecture."""
    import cutlass
    h = hashlib.sha256()
    for path in sorted(set(map(Path, sources))):
        try:
            name = path.relative_to(_PACKAGE_ROOT).as_posix()
        except ValueError:  # a file outside the package (a test's copy)
            name = path.as_posix()
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        import tvm_ffi
        tvm_version = tvm_ffi.__version__
    except ImportError:
        tvm_version = "none"
    # CUTE_DSL_LINEINFO=1 (the DSL's switch for source lines in the cubin, for compute-sanitizer
    # and ncu) changes the code object: such kernels get a directory of their own
    lineinfo = os.environ.get("CUTE_DSL_LINEINFO", "").strip() not in ("", "0")
    h.update(f"cutlass={cutlass.__version__};tvm_ffi={tvm_version};arch={_target_arch()};"
             f"lineinfo={lineinfo}".encode())
    return h.hexdigest()[:24]


def cache_dir(sources: Iterable[Path] = ()) -> Path:
    """The directory of the kernels whose code depends on `sources` (module_sources)."""
    root = os.environ.get("CUTEATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuteattn")
    return Path(root) / fingerprint(sources)


def key_text(key) -> str:
    """A key as stable text, the same in every process and Python version (pickle's bytes are
    not: they name classes by module path and change with the protocol): tuples joined by "/",
    frozen dataclasses (kernel configs) as Name(field=value, ...), classes (cutlass dtypes) by
    name. Also what stats() readers print a key as."""
    if isinstance(key, tuple):
        return "/".join(map(_part_text, key))
    return _part_text(key)


def _part_text(x) -> str:
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, type):
        return x.__name__
    if dataclasses.is_dataclass(x):
        fields = ", ".join(f"{f.name}={_part_text(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({fields})"
    if isinstance(x, (tuple, list, frozenset)):
        items = sorted(map(_part_text, x)) if isinstance(x, frozenset) else map(_part_text, x)
        return "(" + ", ".join(items) + ")"
    raise TypeError(f"compile_cache: no stable text for a key part of type {type(x).__name__}")


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


def _paths(key: Hashable, sources: Iterable[Path]):
    name = hashlib.sha256(key_text(key).encode()).hexdigest()[:32]
    folder = cache_dir(sources)
    return folder / f"{name}.o", folder / f"{name}.json"


def _load_from_disk(obj: Path, meta: Path):
    """(fn, info) from disk, or None when absent or unloadable (a CacheWarning then)."""
    if not obj.exists():
        return None
    try:
        import cutlass.cute as cute
        _load_runtime_libraries()
        module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
        fn = getattr(module, _EXPORT_NAME)
        info = json.loads(meta.read_text()) if meta.exists() else {}
        return fn, info
    except Exception as e:  # a damaged or foreign file: compile again, and overwrite it
        warnings.warn(f"cuteattn: the cached kernel {obj} could not be loaded ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); compiling it again",
                      CacheWarning, stacklevel=3)
        return None


def _save_to_disk(obj: Path, meta: Path, fn, info: dict) -> None:
    """Both files written under temporary names and renamed into place, so that a concurrent
    reader (another process compiling the same kernel) sees a whole file or none."""
    global _unwritable_warned
    suffix = f"{os.getpid()}.{threading.get_ident()}.tmp"
    tmp_obj, tmp_meta = obj.with_name(f"{obj.stem}.{suffix}.o"), meta.with_name(f"{meta.stem}.{suffix}")
    try:
        obj.parent.mkdir(parents=True, exist_ok=True)
        fn.export_to_c(object_file_path=str(tmp_obj), function_name=_EXPORT_NAME)
        tmp_meta.write_text(json.dumps(info))
        os.replace(tmp_meta, meta)
        os.replace(tmp_obj, obj)
    except Exception as e:  # read-only, full or not a directory: memory only, said once
        for tmp in (tmp_obj, tmp_meta):
            try:
                tmp.unlink()
            except OSError:
                pass
        if not _unwritable_warned:
            _unwritable_warned = True
            warnings.warn(f"cuteattn: cannot write the kernel cache under {obj.parent} "
                          f"({type(e).__name__}: {e}); compiled kernels stay in memory only "
                          "(set CUTEATTN_CACHE_DIR to a writable directory, or "
                          "CUTEATTN_DISK_CACHE=0 to silence this)", CacheWarning, stacklevel=3)


def get_or_compile(key: Hashable, build: Callable[[], object], persist: bool = False,
                   sources: Optional[Iterable[Path]] = None):
    """`build()` returns the compiled kernel, or (kernel, info) where info is a dict of what the
    compiler reported (registers, spills), kept for stats(). `persist`: the kernel was compiled
    for TVM-FFI, so it may be kept on disk (when the disk cache is enabled); it then needs
    `sources`, the files its code depends on besides the key (module_sources of the family's
    compile module), for the fingerprint of its directory. `key` must have a key_text."""
    if persist and sources is None:
        raise TypeError("compile_cache.get_or_compile: a persisted kernel needs its sources")
    fn = _kernels.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _kernels.get(key)
        if fn is not None:
            _stats["hits"] += 1
            return fn
        paths = _paths(key, sources) if persist and disk_cache_enabled() else None
        loaded = _load_from_disk(*paths) if paths else None
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
            if paths:
                _save_to_disk(*paths, fn, info)
        if info:
            _stats["kernel_info"][key] = dict(info)
        _kernels[key] = fn
    return fn


def kernel_info(key: Hashable) -> dict:
    """What the compiler reported for this key's kernel (registers, spill bytes; also for a
    kernel loaded from disk), {} if nothing was recorded."""
    return dict(_stats["kernel_info"].get(key, {}))


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
