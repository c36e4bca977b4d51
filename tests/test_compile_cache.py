"""The compile cache's disk layer, on the CPU: a host-JIT function compiled for TVM-FFI goes to
disk and comes back in a "new process" (an emptied memory cache) without compiling, still
computing the right thing; damaged files are recompiled; a changed kernel source moves the cache
to a new directory; nothing is written unless asked for."""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.typing import AddressSpace  # noqa: E402

from cuteattn import compile_cache  # noqa: E402


@cute.jit
def add_k(x: cute.Tensor, n: Int32, k: Int32):
    for i in cutlass.range(n, unroll=1):
        x[i] = x[i] + k


def build_add_k():
    fake = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4,
                                         memspace=AddressSpace.generic)
    fn = cute.compile(add_k, fake, Int32(0), Int32(0), options="--enable-tvm-ffi")
    return fn, {"registers": 42}


def must_not_compile():
    raise AssertionError("compiled although the disk cache holds this kernel")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty in-memory cache and counters, the disk cache on, in a temporary directory."""
    monkeypatch.setattr(compile_cache, "_kernels", {})
    monkeypatch.setattr(compile_cache, "_stats", {"compiles": 0, "hits": 0, "disk_loads": 0,
                                                  "compile_seconds": {}, "kernel_info": {}})
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "1")
    monkeypatch.setenv("CUTEATTN_CACHE_DIR", str(tmp_path))
    return tmp_path


def check_adds(fn, k):
    x = torch.arange(6, dtype=torch.int32)
    fn(x, 6, k)
    assert x.tolist() == [i + k for i in range(6)]


def test_second_process_loads_instead_of_compiling(fresh):
    key = ("probe", "add_k", 1)
    check_adds(compile_cache.get_or_compile(key, build_add_k, persist=True), 3)
    assert compile_cache.stats()["compiles"] == 1
    assert len(list(fresh.rglob("*.o"))) == 1
    compile_cache.clear()  # as a new process would start
    check_adds(compile_cache.get_or_compile(key, must_not_compile, persist=True), 5)
    stats = compile_cache.stats()
    assert stats["compiles"] == 1 and stats["disk_loads"] == 1
    assert stats["kernel_info"][key] == {"registers": 42}  # what the compiler reported, kept
    compile_cache.get_or_compile(key, must_not_compile, persist=True)
    assert compile_cache.stats()["hits"] == 1  # and from then on, memory


def test_damaged_file_is_compiled_again_and_replaced(fresh):
    key = ("probe", "add_k", 2)
    compile_cache.get_or_compile(key, build_add_k, persist=True)
    (obj,) = fresh.rglob("*.o")
    obj.write_bytes(b"not an object file")
    compile_cache.clear()
    check_adds(compile_cache.get_or_compile(key, build_add_k, persist=True), 1)
    assert compile_cache.stats()["compiles"] == 2
    compile_cache.clear()
    check_adds(compile_cache.get_or_compile(key, must_not_compile, persist=True), 2)


def test_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("CUTEATTN_DISK_CACHE", raising=False)
    assert compile_cache.disk_cache_enabled()
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv("CUTEATTN_DISK_CACHE", off)
        assert not compile_cache.disk_cache_enabled()


def test_nothing_written_unless_enabled_and_persistable(fresh, monkeypatch):
    compile_cache.get_or_compile(("probe", "no-persist"), build_add_k, persist=False)
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "0")
    compile_cache.get_or_compile(("probe", "disabled"), build_add_k, persist=True)
    assert not list(fresh.rglob("*.o"))


def test_kernel_source_change_moves_the_cache(fresh, monkeypatch, tmp_path_factory):
    sources = tmp_path_factory.mktemp("kernels")
    (sources / "fwd.py").write_text("# version 1\n")
    monkeypatch.setattr(compile_cache, "_KERNEL_SOURCES", sources)
    before = compile_cache.cache_dir()
    (sources / "fwd.py").write_text("# version 2\n")
    assert compile_cache.cache_dir() != before
    assert compile_cache.cache_dir().parent == before.parent == fresh
