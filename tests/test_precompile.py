"""`python -m cuteattn.precompile` on a machine without a GPU: the variants it picks, and a real
run that fills a fresh cache directory which a second run then only loads from."""
import json
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


def test_softcap_combines_with_a_mask():
    """Gemma 2's layers: softcap with causal, and with a sliding window (variants of their own)."""
    specs = dict(precompile.variants(precompile.parse_args(
        ["--head-dim", "256", "--mask", "causal_softcap", "--mask", "local_softcap", "--backward"])))
    causal, local = specs["bwd d256 bf16 causal_softcap"], specs["bwd d256 bf16 local_softcap"]
    assert (causal.causal, causal.local, causal.has_softcap, causal.softcap) == (True, False, True, 30.0)
    assert (local.causal, local.local, local.has_softcap, local.window_left) == (False, True, True, 128)
    assert causal.compile_key() != specs["bwd d256 bf16 local_softcap"].compile_key()


def test_a_target_name_that_is_no_arch_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "hopper")
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "1")
    with pytest.raises(SystemExit, match="CUTE_DSL_ARCH: 'hopper': expected an arch like sm_86"):
        precompile.main(["--head-dim", "64"])


def test_an_explicit_arch_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTEATTN_DISK_CACHE", "1")
    with pytest.raises(SystemExit, match="CUTE_DSL_ARCH: 'hopper': expected an arch like sm_86"):
        precompile.main(["--head-dim", "64", "--arch", "hopper"])


def test_surface_and_block_sparse_variants():
    """--head-dim-v and --sparse: the MLA-style pair and block-sparse forwards (a coarser block
    shape as the kernel block its lists run on); none for packed layouts, no backward."""
    specs = dict(precompile.variants(precompile.parse_args(
        ["--head-dim", "192", "--head-dim-v", "128", "--mask", "causal", "--sparse", "256x256",
         "--sparse", "128x64", "--varlen", "--backward"])))
    assert "fwd d192v128 bf16 causal long" in specs and "bwd d192v128 bf16 causal varlen" in specs
    sparse = {label: s for label, s in specs.items() if label.startswith("sparse")}
    assert sorted(sparse) == ["sparse 128x128 d192v128 bf16 causal", "sparse 128x64 d192v128 bf16 causal"]
    s = sparse["sparse 128x128 d192v128 bf16 causal"]
    assert (s.head_dim, s.head_dim_v, s.sparse_q_block, s.sparse_kv_block, s.kind) == (192, 128, 128, 128, "fwd")
    with pytest.raises(SystemExit, match="QxK"):
        precompile.variants(precompile.parse_args(["--head-dim", "64", "--sparse", "big"]))


def test_head_dim_is_required():
    with pytest.raises(SystemExit):
        precompile.parse_args([])


def _precompile(tmp_path, *args, timeout=600):
    """`python -m cuteattn.precompile ARGS` in a fresh process, into the cache under tmp_path,
    with no target or path from the environment (the command picks sm_90a without a GPU)."""
    env = dict(os.environ, CUTEATTN_CACHE_DIR=str(tmp_path), CUTEATTN_DISK_CACHE="1")
    env.pop("CUTE_DSL_ARCH", None)
    env.pop("CUTEATTN_PATH", None)
    return subprocess.run([sys.executable, "-m", "cuteattn.precompile", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.compile
def test_fills_the_cache_then_loads_from_it(tmp_path):
    pytest.importorskip("tvm_ffi")
    args = ["--head-dim", "64", "--mask", "causal", "--backward"]
    first = _precompile(tmp_path, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    # d=64 has a short-sequence tile: two forward variants and one backward, all compiled
    assert "3 compiled, 0 already on disk" in first.stdout, first.stdout
    assert len(list(tmp_path.rglob("*.o"))) == 3
    second = _precompile(tmp_path, *args)
    assert second.returncode == 0 and "0 compiled, 3 already on disk" in second.stdout, second.stdout


@pytest.mark.compile
def test_fills_surface_and_block_sparse_variants(tmp_path):
    """A head dim with a narrower v (d=80 with v 64, one variant for both
    tile classes) and a block-sparse forward, compiled into the cache."""
    pytest.importorskip("tvm_ffi")
    run = _precompile(tmp_path, "--head-dim", "80", "--head-dim-v", "64", "--mask", "causal",
                      "--sparse", "128x64")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 compiled, 0 already on disk" in run.stdout, run.stdout
    assert "sparse 128x64 d80v64 bf16 causal: compiled" in run.stdout, run.stdout


@pytest.mark.compile
def test_portable_path_for_another_target(tmp_path):
    """--path sm80 --arch sm_120a: the portable kernels compiled for sm_120 (its tiles and
    register parts), into the cache directory of that target."""
    pytest.importorskip("tvm_ffi")
    run = _precompile(tmp_path, "--head-dim", "128", "--mask", "causal", "--backward", "--path",
                      "sm80", "--arch", "sm_120a")
    assert run.returncode == 0, run.stdout + run.stderr
    # one forward config serves both tile classes (the portable tiles do not depend on the
    # length): the forward's first candidate at d=128 (32 rows a warp) compiles spill-free for
    # sm_120a, so it is the forward; then the backward
    assert "long: shared" in run.stdout, run.stdout
    assert "2 compiled, 0 already on disk" in run.stdout, run.stdout
    assert len(list(tmp_path.rglob("*.o"))) == 2


@pytest.mark.compile
def test_spilling_candidates_are_kept_on_disk_with_their_reports(tmp_path):
    """sm_100a's compiler spills 8 bytes at d=192 with causal and softcap on the 128-row portable
    tile (kernels/sm80/config.py): it is compiled once to learn that and kept on disk with its
    report, and the next tile (64 rows) is the forward; a second process compiles nothing."""
    pytest.importorskip("tvm_ffi")
    args = ["--head-dim", "192", "--mask", "causal_softcap", "--path", "sm80", "--arch", "sm_100a"]
    first = _precompile(tmp_path, *args, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    # one config for both tile classes: the spilling tile and the one taken
    assert "2 compiled, 0 already on disk" in first.stdout, first.stdout
    reports = [json.loads(p.read_text()) for p in tmp_path.rglob("*.json")]
    assert sorted(r["spill_store_bytes"] > 0 for r in reports) == [False, True], reports
    assert len(list(tmp_path.rglob("*.o"))) == 2
    second = _precompile(tmp_path, *args, timeout=900)
    assert second.returncode == 0 and "0 compiled, 2 already on disk" in second.stdout, second.stdout


def test_blackwell_target_takes_the_portable_kernels(tmp_path):
    """--arch sm_100a without --path: a B200's calls run the portable kernels (dispatch's path
    for compute capability 10.0), so those are compiled, with the 227 KB tiles (Hopper's wgmma
    kernels would not build for sm_100a)."""
    pytest.importorskip("tvm_ffi")
    run = _precompile(tmp_path, "--head-dim", "128", "--mask", "causal", "--backward", "--arch",
                      "sm_100a")
    assert run.returncode == 0, run.stdout + run.stderr
    # one forward config (both tile classes: the portable tiles do not depend on the length):
    # its first candidate at d=128 causal compiles spill-free for sm_100a; then the backward
    assert "long: shared" in run.stdout and "bwd d128 bf16 causal: compiled" in run.stdout, run.stdout
    assert "2 compiled, 0 already on disk" in run.stdout, run.stdout


def test_a_target_without_kernels_is_a_clear_error(tmp_path):
    run = _precompile(tmp_path, "--head-dim", "128", "--arch", "sm_75")
    assert run.returncode == 2 and "nothing to compile: no kernel for sm_75" in run.stderr, run.stderr
    assert not list(tmp_path.rglob("*.o"))
