"""The compile cache's disk layer, on the CPU: a host-JIT function compiled for TVM-FFI goes to
disk and comes back in a "new process" (an emptied memory cache) without compiling, still
computing the right thing; damaged files are recompiled; a changed kernel source moves the cache
to a new directory, but only for the family whose sources changed; nothing is written unless
asked for; keys (kernel configs included) have a stable text."""
import shutil
from pathlib import Path

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


# this file: the probe's source, what its compiled code depends on
SOURCES = (Path(__file__),)


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
    check_adds(compile_cache.get_or_compile(key, build_add_k, persist=True, sources=SOURCES), 3)
    assert compile_cache.stats()["compiles"] == 1
    assert len(list(fresh.rglob("*.o"))) == 1
    compile_cache.clear()  # as a new process would start
    check_adds(compile_cache.get_or_compile(key, must_not_compile, persist=True, sources=SOURCES), 5)
    stats = compile_cache.stats()
    assert stats["compiles"] == 1 and stats["disk_loads"] == 1
    assert stats["kernel_info"][key] == {"registers": 42}  # what the compiler reported, kept
    compile_cache.get_or_compile(key, must_not_compile, persist=True, sources=SOURCES)
    assert compile_cache.stats()["hits"] == 1  # and from then on, memory


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_file_is_compiled_again_and_replaced(fresh, damage):
    key = ("probe", "add_k", 2, damage)
    compile_cache.get_or_compile(key, build_add_k, persist=True, sources=SOURCES)
    (obj,) = fresh.rglob("*.o")
    data = obj.read_bytes()
    obj.write_bytes(b"not an object file" if damage == "garbage" else data[: len(data) // 2])
    compile_cache.clear()
    with pytest.warns(compile_cache.CacheWarning, match="could not be loaded"):
        fn = compile_cache.get_or_compile(key, build_add_k, persist=True, sources=SOURCES)
    check_adds(fn, 1)
    assert compile_cache.stats()["compiles"] == 2
    compile_cache.clear()
    check_adds(compile_cache.get_or_compile(key, must_not_compile, persist=True, sources=SOURCES), 2)


def test_unwritable_directory_keeps_kernels_in_memory_with_one_warning(fresh, monkeypatch):
    """A cache directory that cannot be created (a file stands in its way; as root, permission
    bits would not stop the write): one CacheWarning, the kernels still work."""
    blocker = fresh / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("CUTEATTN_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(compile_cache, "_unwritable_warned", False)
    with pytest.warns(compile_cache.CacheWarning, match="stay in memory only"):
        check_adds(compile_cache.get_or_compile(("probe", "ro", 1), build_add_k, persist=True,
                                                sources=SOURCES), 4)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", compile_cache.CacheWarning)  # said once, not per kernel
        check_adds(compile_cache.get_or_compile(("probe", "ro", 2), build_add_k, persist=True,
                                                sources=SOURCES), 5)
    assert compile_cache.stats()["compiles"] == 2


_CONCURRENT = """
import sys
sys.path.insert(0, {tests!r})
import test_compile_cache as t
from cuteattn import compile_cache
fn = compile_cache.get_or_compile(("probe", "concurrent"), t.build_add_k, persist=True,
                                  sources=t.SOURCES)
t.check_adds(fn, 7)
print("STATS", compile_cache.stats()["compiles"], compile_cache.stats()["disk_loads"])
"""


@pytest.mark.compile
def test_two_processes_compiling_at_once(fresh):
    """Two processes compile the same kernel into one cache directory at the same time: both
    work, and a third process loads the file they left instead of compiling."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, CUTEATTN_DISK_CACHE="1", CUTEATTN_CACHE_DIR=str(fresh))
    code = _CONCURRENT.format(tests=str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(list(fresh.rglob("*.o"))) == 1 and not list(fresh.rglob("*.tmp*"))
    third = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0 and "STATS 0 1" in third.stdout, third.stdout + third.stderr


def test_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("CUTEATTN_DISK_CACHE", raising=False)
    assert compile_cache.disk_cache_enabled()
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv("CUTEATTN_DISK_CACHE", off)
        assert not compile_cache.disk_cache_enabled()


def test_nothing_written_unless_enabled_and_persistable(fresh, monkeypatch):
    compile_cache.get_or_compile(("probe", "no-persist"), build_add_k, persist=False)
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "0")
    compile_cache.get_or_compile(("probe", "disabled"), build_add_k, persist=True, sources=SOURCES)
    assert not list(fresh.rglob("*.o"))


def test_persisting_needs_sources(fresh):
    with pytest.raises(TypeError, match="sources"):
        compile_cache.get_or_compile(("probe", "no-sources"), build_add_k, persist=True)


def test_kernel_source_change_moves_the_cache(fresh, tmp_path_factory):
    sources = tmp_path_factory.mktemp("kernels")
    (sources / "fwd.py").write_text("# version 1\n")
    before = compile_cache.cache_dir([sources / "fwd.py"])
    (sources / "fwd.py").write_text("# version 2\n")
    after = compile_cache.cache_dir([sources / "fwd.py"])
    assert after != before
    assert after.parent == before.parent == fresh


SM90_COMPILE = "cuteattn.kernels.sm90.compile"


def test_sm90_forward_sources_are_what_its_kernel_imports():
    from cuteattn.kernels.sm90 import launch
    root = Path(compile_cache.__file__).parent
    names = {p.relative_to(root).as_posix() for p in launch.sources()}
    assert {"kernels/sm90/compile.py", "kernels/sm90/fwd.py", "kernels/sm90/arguments.py",
            "kernels/common/softmax.py", "kernels/common/tile_scheduler.py"} <= names
    # the config is in the key, the launch policy is runtime arguments, the API compiles nothing
    assert not names & {"kernels/sm90/config.py", "kernels/sm90/launch.py", "api.py",
                        "__init__.py", "dispatch.py"}


def test_fingerprint_follows_the_family_sources_only(tmp_path):
    """On a copy of the package: editing a module the sm90 forward's kernel imports changes its
    fingerprint; editing another family's kernel, the config or the launch policy does not."""
    real = Path(compile_cache.__file__).parent
    root = tmp_path / "cuteattn"
    shutil.copytree(real / "kernels", root / "kernels", ignore=shutil.ignore_patterns("__pycache__"))

    def fp():
        return compile_cache.fingerprint(compile_cache.module_sources(SM90_COMPILE, root=root))

    base = fp()
    for unrelated in ("sm80/fwd.py", "sm90/config.py", "sm90/launch.py"):
        with open(root / "kernels" / unrelated, "a") as f:
            f.write("# edited\n")
        assert fp() == base, unrelated
    with open(root / "kernels" / "common" / "softmax.py", "a") as f:  # imported by sm90/fwd.py
        f.write("# edited\n")
    assert fp() != base


def test_key_text_is_stable_and_names_dtypes():
    import torch
    from cuteattn.kernels.sm90 import launch
    from cuteattn.spec import AttentionSpec
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=True,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         seqlen_q=4096)
    cfg = launch.sm90_config(spec)
    text = compile_cache.key_text(("sm90", "fwd", True, cfg))
    assert text.startswith("'sm90'/'fwd'/True/Sm90FwdConfig(dtype=BFloat16, head_dim=128, ")
    assert "dynamic_tiles=True" in text and "<" not in text  # no object reprs (addresses)
    other = launch.sm90_config(AttentionSpec(**{**spec.__dict__, "dtype": torch.float16}))
    assert compile_cache.key_text(("sm90", "fwd", True, other)) != text
    with pytest.raises(TypeError):
        compile_cache.key_text(("sm90", object()))
