"""`python -m cuteattn.precompile` on a machine without a GPU: the variants it picks, and a real
run that fills a fresh cache directory which a second run then only loads from."""
import os
import subprocess
import sys

import pytest

from cuteattn import precompile


def labels(argv):
    return [label for label, _ in precompile.variants(precompile.parse_args(argv))]


def test_variants_cover_the_options():
    assert labels(["--head-dim", "128"]) == [
        "fwd d128 bf16 none short", "fwd d128 bf16 none long",
        "fwd d128 bf16 causal short", "fwd d128 bf16 causal long"]
    many = labels(["--head-dim", "64", "--head-dim", "96", "--dtype", "fp16", "--dtype", "bf16",
                   "--mask", "local", "--varlen", "--seqused", "--backward", "--deterministic"])
    # 2 head dims x 2 dtypes x 1 mask x 2 layouts x (2 forward tile classes + 2 backward)
    assert len(many) == 2 * 2 * 2 * 4
    assert "bwd d96 fp16 local varlen seqused deterministic" in many
    specs = dict(precompile.variants(precompile.parse_args(["--head-dim", "64", "--backward"])))
    assert specs["bwd d64 bf16 causal"].kind == "bwd" and specs["fwd d64 bf16 none long"].seqlen_q > 2048


def test_head_dim_is_required():
    with pytest.raises(SystemExit):
        precompile.parse_args([])


@pytest.mark.compile
def test_fills_the_cache_then_loads_from_it(tmp_path):
    pytest.importorskip("tvm_ffi")
    env = dict(os.environ, CUTEATTN_CACHE_DIR=str(tmp_path), CUTEATTN_DISK_CACHE="1")
    env.pop("CUTE_DSL_ARCH", None)  # the command picks sm_90a itself without a GPU
    cmd = [sys.executable, "-m", "cuteattn.precompile", "--head-dim", "64", "--mask", "causal",
           "--backward"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    # d=64 has a short-sequence tile: two forward variants and one backward, all compiled
    assert "3 compiled, 0 already on disk" in first.stdout, first.stdout
    assert len(list(tmp_path.rglob("*.o"))) == 3
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "0 compiled, 3 already on disk" in second.stdout, second.stdout


@pytest.mark.compile
def test_portable_path_for_another_target(tmp_path):
    """--path sm80 --arch sm_120a: the portable kernels compiled for sm_120 (its tiles and
    register parts), into the cache directory of that target."""
    pytest.importorskip("tvm_ffi")
    env = dict(os.environ, CUTEATTN_CACHE_DIR=str(tmp_path), CUTEATTN_DISK_CACHE="1")
    env.pop("CUTE_DSL_ARCH", None)
    env.pop("CUTEATTN_PATH", None)
    cmd = [sys.executable, "-m", "cuteattn.precompile", "--head-dim", "128", "--mask", "causal",
           "--backward", "--path", "sm80", "--arch", "sm_120a"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    # one forward config serves both tile classes (the portable tiles do not depend on the
    # length): one forward and one backward compiled
    assert "2 compiled, 0 already on disk" in run.stdout, run.stdout
    assert len(list(tmp_path.rglob("*.o"))) == 2
