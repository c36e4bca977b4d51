"""`python -m cuteattn.bench`: cuteattn beside its peers, a table, a JSON record, optionally a plot.

Run from the project root: the default JSON path is benchmarks/results/<date>-<commit>-<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import warnings

import torch

from cuteattn import compile_cache
from cuteattn.bench import report, shapes
from cuteattn.bench.peers import check, implementations, make_inputs
from cuteattn.bench.timing import first_call, gpu_busy_ms, graph_replay_ms, median_ms


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cuteattn.bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="on a GPU, a few d=128 cells instead of the full grid (without CUDA the "
                        "benchmark always runs the reference path on tiny d=64 shapes)")
    p.add_argument("--varlen", action="store_true",
                   help="also run the varlen cells (16 heads, d=128, 16384 tokens: 8x2048 and skewed; "
                        "with --bwd their backward alone)")
    p.add_argument("--bwd", action="store_true",
                   help="the backward alone (the forward grid's shapes; with --quick, d=128 only), "
                        "instead of the forward grid")
    p.add_argument("--surface", action="store_true",
                   help="also the head dims no compiled kernel has: d=192/dv=128 (16 heads) and "
                        "d=80 (24 heads), 16k tokens, 4k and 16k, causal and not")
    p.add_argument("--mods", action="store_true",
                   help="FlexAttention mods traced into the kernel (a document mask_mod, a sliding "
                        "window, ALiBi as a score_mod; B=1, H=16, d=128, S 8k/16k), with and "
                        "without block-sparse lists, beside torch's flex_attention, instead of "
                        "the forward grid; with --bwd the backward alone (cells of kind "
                        "'mods_bwd')")
    p.add_argument("--sparse", action="store_true",
                   help="block-sparse forward (B=1, H=12, d=128, S 8k/32k; dense, 50%% and 90%% of "
                        "256x256 logical blocks left out; physical 128x128, 128x64, 64x64) beside "
                        "flash-attn-4's block-sparse path, instead of the forward grid; with "
                        "--bwd the backward alone (cells of kind 'sparse_bwd')")
    p.add_argument("--fp8", action="store_true",
                   help="the forward grid on float8_e4m3fn inputs with descales, our bf16 forward "
                        "on the same values beside it, instead of the forward grid")
    p.add_argument("--decode", action="store_true",
                   help="decoding over a KV cache (GB/s of K/V read): bf16, 32 query heads over 8, "
                        "d=128, one new row, pages of 16 and 128 and contiguous, instead of the "
                        "forward grid")
    p.add_argument("--fp8-kv", action="store_true",
                   help="with --decode: the caches in float8_e4m3fn with per-(batch, kv head) "
                        "descales, GQA 32/8 and 32/4, our bf16-cache decode of the same values "
                        "beside it (cells' kv_dtype; GB/s count the fp8 bytes for both)")
    p.add_argument("--path", choices=["sm80"],
                   help="run cuteattn's calls on this kernel path on any GPU that can (sm80: the "
                        "portable mma.sync path; sets CUTEATTN_PATH); cells record it as 'path'")
    p.add_argument("--json", metavar="PATH",
                   help="where to write the JSON (default on a GPU: "
                        "benchmarks/results/<date>-<shortcommit>-<device>.json; on CPU: none)")
    p.add_argument("--plot", metavar="PNG", nargs="?", const="",
                   help="write a bar chart (default path: the JSON path with .png)")
    p.add_argument("--commit", help="commit to record when this tree is not a git checkout")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per cell (median taken)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per cell, the implementations in turn (median of the rounds)")
    return p.parse_args(argv)


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def compile_stats():
    try:
        return dict(compile_cache.stats())
    except Exception:  # no kernels on this machine: nothing to count
        return None


def run_cell(cell: shapes.Cell, device: torch.device, iters: int, rounds: int = 1) -> dict:
    """Each implementation's first call and check, then `rounds` rounds of timing that take the
    implementations in turn (so none is timed only right after its own check, or only first), the
    cell's rate from the median of its rounds' medians (all rounds' times kept in `round_ms`)."""
    x = make_inputs(cell, device)
    result = dict(label=cell.label(), cell=cell.to_json(), metric=cell.metric, rates={},
                  check={}, skipped={}, first_call_s={}, compiles=None)
    timed = {}
    for name, fn in implementations(cell, x, device).items():
        if isinstance(fn, str):
            result["skipped"][name] = fn
            continue
        ours = name.startswith("cuteattn")
        before = compile_stats() if ours and device.type == "cuda" else None
        try:
            seconds, out = first_call(fn, device)
            if ours:
                result["first_call_s"][name] = round(seconds, 4)
            if before is not None:
                after = compile_stats()
                result["compiles"] = after["compiles"] - before["compiles"]
                # a first call that loaded its kernel from the disk cache timed a load, not a compile
                result["disk_loads"] = after["disk_loads"] - before["disk_loads"]
                # registers and spills of the variants this cell compiled (the issue asks for them)
                result["kernels"] = {
                    compile_cache.key_text(key): info for key, info in after["kernel_info"].items()
                    if key not in before["kernel_info"]}
            result["check"][name] = check(cell, x, out, getattr(fn, "state", {}).get("dout"))
            del out
        except Exception as e:  # one failing implementation must not end the run
            result["skipped"][name] = _reason(e)
            continue
        timed[name] = fn
    round_ms = {}
    for _ in range(rounds):
        for name, fn in list(timed.items()):
            try:
                round_ms.setdefault(name, []).append(median_ms(fn, device, iters=iters))
                if cell.kind == "decode" and device.type == "cuda":  # also as a CUDA-graph replay
                    graph = name + report.GRAPH
                    if graph not in result["skipped"]:
                        try:
                            round_ms.setdefault(graph, []).append(graph_replay_ms(fn, device, iters=iters))
                        except Exception as e:  # a peer that cannot be captured
                            result["skipped"][graph] = _reason(e)
            except Exception as e:
                result["skipped"][name] = _reason(e)
                round_ms.pop(name, None)
                del timed[name]
    for name, times in round_ms.items():
        ms = statistics.median(times)
        result["rates"][name] = float(f"{cell.rate(ms):.4g}")  # 4 significant digits, never 0
        if not name.endswith(report.GRAPH):
            result.setdefault("cell_ms", {})[name] = round(ms, 4)  # the median time itself
        if rounds > 1:
            result.setdefault("round_ms", {})[name] = [round(t, 4) for t in times]
    if "builders" in x:  # block-sparse: the metadata builders, on the GPU, apart from the kernel
        try:
            # (GPU time, the report's share; and the Python call's, which a model's step
            # overlaps with earlier GPU work)
            result["builder_ms"] = round(gpu_busy_ms(x["builders"], device, iters=iters), 4)
            result["builder_call_ms"] = round(median_ms(x["builders"], device, iters=iters), 4)
        except Exception as e:
            result["skipped"]["builders"] = f"{type(e).__name__}: {str(e)[:200]}"
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda")
        if args.decode:
            grid = shapes.decode_grid(quick=args.quick, fp8_kv=args.fp8_kv)
        elif args.fp8:
            grid = shapes.fp8_grid(quick=args.quick)
        elif args.sparse:
            grid = shapes.sparse_grid(quick=args.quick, bwd=args.bwd)
        elif args.mods:
            grid = shapes.mods_grid(quick=args.quick, bwd=args.bwd)
        elif args.bwd:
            grid = shapes.bwd_grid(quick=args.quick)
        else:
            grid = shapes.quick_grid() if args.quick else shapes.default_grid()
        if args.varlen:
            grid += shapes.varlen_grid(bwd=args.bwd and not (args.sparse or args.mods))
        if args.surface:
            grid += shapes.surface_grid()
        device_name = torch.cuda.get_device_name(device)
    else:
        print("no CUDA device: timing cuteattn's PyTorch reference path on tiny shapes (no peers)")
        device, grid, device_name = torch.device("cpu"), shapes.cpu_grid(), "cpu"
        warnings.simplefilter("ignore")  # the fallback warning is the point here, not news

    if args.path:
        os.environ["CUTEATTN_PATH"] = args.path  # dispatch.PATH_ENV
    results = []
    for cell in grid:
        results.append(run_cell(cell, device, args.iters, args.rounds))
        r = results[-1]
        if args.path:
            r["path"] = args.path
        print(f"  {r['label']}: " + ", ".join(f"{n} {report.fmt(v)}" for n, v in r["rates"].items()), flush=True)

    impls = []
    for r in results:
        impls += [n for n in list(r["rates"]) + list(r["skipped"]) if n not in impls]
    print()
    report.print_table(results, impls)
    failed = [(r["label"], n) for r in results for n, c in r["check"].items() if not c["ok"]]
    for label, name in failed:
        print(f"CHECK FAILED: {name} on {label}")

    commit, dirty = report.git_commit(os.getcwd())
    commit = args.commit or commit
    date = datetime.date.today().isoformat()
    json_path = args.json
    if json_path is None and cuda:
        slug = report.device_slug(device_name)
        suffix = f"-{args.path}" if args.path else ""
        json_path = os.path.join("benchmarks", "results", f"{date}-{commit}-{slug}{suffix}.json")
    meta = dict(commit=commit, dirty=dirty, date=date, device=device_name, torch=torch.__version__,
                path=args.path or "default",
                **(report.sm_clocks() if cuda else {"sm_clock": None, "sm_clock_max": None}))
    if args.fp8 and cuda:  # the ceiling the fp8 cells are read against
        from cuteattn.bench.peers import fp8_gemm_tflops
        try:
            meta["fp8_gemm_tflops"] = round(fp8_gemm_tflops(device), 1)
            print(f"fp8 GEMM (torch._scaled_mm, 8192^3): {meta['fp8_gemm_tflops']} TFLOP/s")
        except Exception as e:  # an older torch without _scaled_mm's keywords
            meta["fp8_gemm_tflops"] = f"{type(e).__name__}: {e}"[:200]
    if json_path:
        report.write_json(json_path, meta, results)
        print(f"wrote {json_path}")
    if args.plot is not None:
        png = args.plot or (os.path.splitext(json_path)[0] + ".png" if json_path else "bench.png")
        title = f"{device_name}, commit {commit}, {date}"
        print(f"wrote {png}" if report.plot(png, results, impls, title) else "matplotlib not importable: no plot")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
