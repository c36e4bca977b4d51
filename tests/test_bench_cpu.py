"""`python -m cuteattn.bench` on the CPU (the reference path, tiny shapes) and its summary line."""
import json
import math

from cuteattn.bench import __main__ as bench
from cuteattn.bench import report


def test_quick_bench_runs_on_cpu_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(path)]) in (0, None)
    record = json.loads(path.read_text())
    assert record["cells"] and all(c["gbps" if c["kind"] == "decode" else "tflops"]
                                   for c in record["cells"])
    assert {c["kind"] for c in record["cells"]} >= {"fwd", "varlen", "decode", "fp8", "sparse"}
    assert all(v > 0 for c in record["cells"] for v in c["gbps" if c["kind"] == "decode" else "tflops"].values())
    assert all(c["check"][name]["ok"] for c in record["cells"] for name in c["check"])
    assert "summary" in record
    assert "cuteattn" in capsys.readouterr().out


def test_path_option_is_recorded(tmp_path, monkeypatch):
    """--path sm80 sets the kernel path for the run and records it per cell and in the header."""
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--path", "sm80", "--json", str(path)]) in (0, None)
    record = json.loads(path.read_text())
    assert record["path"] == "sm80" and all(c["path"] == "sm80" for c in record["cells"])
    import os
    assert os.environ["CUTEATTN_PATH"] == "sm80"  # (conftest's fixture removes it afterwards)


def test_summary_ratio_range_geomean_and_target_count():
    def result(kind, ours, peer):
        return {"cell": {"kind": kind}, "rates": {"cuteattn": ours, "fa4": peer, "sdpa-cudnn": peer / 2}}

    s = report.summary([result("fwd", 90, 100), result("fwd", 110, 100), result("varlen", 50, 100),
                        {"cell": {"kind": "fwd"}, "rates": {"cuteattn": 5.0}}])  # no peer: left out
    assert s["fwd"]["cells"] == 2 and s["fwd"]["at_least_1x"] == 1
    assert math.isclose(s["fwd"]["geomean"], math.sqrt(0.9 * 1.1))
    assert (s["fwd"]["min"], s["fwd"]["max"]) == (0.9, 1.1)
    assert s["varlen"] == {"cells": 1, "min": 0.5, "max": 0.5, "geomean": 0.5, "at_least_1x": 0}


def test_graph_replay_rates_are_compared_among_themselves():
    """Decode cells carry rates timed as CUDA-graph replays ("<impl> graph"): queued calls are
    compared with queued calls, replays with replays, each with its own summary line."""
    rates = {"cuteattn": 2000.0, "fa4": 2500.0, "cuteattn graph": 3000.0, "fa4 graph": 2400.0,
             "sdpa graph": 1000.0}
    assert report.ratio_to_best_peer(rates) == 0.8
    assert report.ratio_to_best_peer(rates, graph=True) == 1.25
    assert report.ratio_to_best_peer({"cuteattn": 1.0, "cuteattn graph": 2.0}, graph=True) is None
    s = report.summary([{"cell": {"kind": "decode"}, "rates": rates}])
    assert s["decode"]["min"] == 0.8 and s["decode (CUDA-graph replays)"]["min"] == 1.25


def test_block_sparse_builders_are_reported_as_a_share_of_the_kernel():
    """The sparse cells' builder time (top-k lists, expanded) against cuteattn's median time."""
    from cuteattn.bench import report
    cell = dict(rates={"cuteattn": 640.0}, cell_ms={"cuteattn": 2.0}, check={}, metric="tflops",
                cell={"kind": "sparse"}, skipped={}, first_call_s={})
    results = [dict(cell, label="a", builder_ms=0.05), dict(cell, label="b"),
               dict(cell, label="c", builder_ms=0.1, rates={})]
    assert report.builder_shares(results) == [("a", 0.025)]


def test_fp8_cache_step_time_against_the_bf16_cache():
    """The fp8-cache decode cells report the step time over the bf16-cache step's (issue
    target: <= 0.6x): the inverse of their rates' ratio, queued and replayed apart."""
    from cuteattn.bench import report
    results = [{"rates": {"cuteattn": 4000.0, "cuteattn-bf16-cache": 2000.0,
                          "cuteattn graph": 2500.0, "cuteattn-bf16-cache graph": 2000.0}},
               {"rates": {"cuteattn": 2000.0, "cuteattn-bf16-cache": 1500.0}},
               {"rates": {"cuteattn": 3000.0, "sdpa": 3100.0}}]
    assert report.fp8_step_ratios(results) == {"queued calls": (0.5, 0.75),
                                               "CUDA-graph replays": (0.8, 0.8)}
    assert report.fp8_step_ratios(results[2:]) == {}


def test_a_peer_that_failed_its_check_is_no_comparison():
    """The ratio to the best peer leaves out a peer whose output failed the float32 check (FA4's
    block-sparse backward on sm90 returned wrong gradients and was still 'the best peer')."""
    failed = {"fa4": {"ok": False}, "sdpa": {"ok": True}}
    assert report.ratio_to_best_peer({"cuteattn": 2.0, "fa4": 8.0, "sdpa": 1.0}, check=failed) == 2.0
    assert report.ratio_to_best_peer({"cuteattn": 2.0, "fa4": 8.0}, check=failed) is None
    s = report.summary([{"cell": {"kind": "sparse_bwd"}, "rates": {"cuteattn": 2.0, "fa4": 8.0},
                         "check": failed}])
    assert s == {}


def test_mods_cells_count_their_pairs_and_run_on_cpu():
    """The "mods" cells: FLOPs over the pairs each mod lets through, and one cell end to end on
    the reference (checked against the float32 reference with the same mods)."""
    import torch
    from cuteattn.bench.shapes import SLIDING, Cell, attended_pairs, mods_grid, mod_pairs
    assert {c.mod for c in mods_grid(quick=True)} == {"document", "sliding", "alibi"}
    assert mod_pairs("document", 1024, True) == 4 * (256 * 257 // 2)
    assert mod_pairs("sliding", 4096, False) == attended_pairs(4096, 4096, False, (SLIDING, SLIDING))
    assert mod_pairs("alibi", 512, True) == 512 * 513 // 2
    for mod in ("document", "alibi"):
        cell = Cell("mods", 64, 1, 2, 2, 128, 128, True, mod=mod)
        result = bench.run_cell(cell, torch.device("cpu"), iters=1)
        assert result["rates"]["cuteattn (reference)"] > 0
        assert result["check"] and all(c["ok"] for c in result["check"].values())


def test_dirty_means_changed_content_not_a_lost_executable_bit(tmp_path):
    """git_commit's dirty flag: a copied tree whose scripts lost their executable bit is the
    commit's tree; an edited tracked file is not."""
    import shutil
    import subprocess
    import pytest
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    script = tmp_path / "run.sh"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    git("add", "run.sh")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert report.git_commit(str(tmp_path))[1] is False
    script.chmod(0o644)
    assert report.git_commit(str(tmp_path))[1] is False
    script.write_text("echo changed\n")
    assert report.git_commit(str(tmp_path))[1] is True
