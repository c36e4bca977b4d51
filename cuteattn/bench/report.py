"""Reporting: the console table, the JSON record and the optional bar chart."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess

# never peers; the first present is "ours" ("cuteattn-append": a decode step that also appends;
# "cuteattn-lists": a mods cell run on block-sparse lists)
OURS = ("cuteattn", "cuteattn (reference)", "cuteattn-deterministic", "cuteattn-append",
        "cuteattn-lists")


GRAPH = " graph"  # the suffix of a rate timed as CUDA-graph replays (decode cells)


def ratio_to_best_peer(rates: dict, graph: bool = False, check: dict | None = None) -> float | None:
    """Ours over the best peer, queued calls against queued calls (graph: replays against replays).
    check: the cell's checks by implementation; a peer whose output failed its check is no
    comparison (a wrong result is not a rate) and is left out."""
    suffix = GRAPH if graph else ""
    timed = {n[:len(n) - len(suffix)]: v for n, v in rates.items()
             if n.endswith(GRAPH) == graph and v}
    ours = next((timed[n] for n in OURS if timed.get(n)), None)
    wrong = {n for n, c in (check or {}).items() if not c.get("ok", True)}
    peers = [v for n, v in timed.items() if n not in OURS and n not in wrong]
    return ours / max(peers) if ours and peers else None


def fmt(rate: float) -> str:
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.3g}"


UNITS = {"tflops": "TFLOP/s (algorithmic, exact attended pairs)",
         "gbps": "GB/s (bytes of K and V read, decode)"}


def print_table(results: list[dict], impls: list[str]) -> None:
    """One row per cell: its rate (TFLOP/s, or GB/s for decode) per implementation ('-'
    unavailable, '!' failed its check)."""
    label_w = max([len("cell")] + [len(r["label"]) for r in results])
    widths = [max(10, len(n)) for n in impls]
    head = f"{'cell':<{label_w}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(impls, widths)) + "  vs best peer"
    print(head)
    print("-" * len(head))
    for r in results:
        cols = []
        for n, w in zip(impls, widths):
            value = r["rates"].get(n)
            mark = "" if r["check"].get(n, {}).get("ok", True) else "!"
            cols.append(f"{'-' if value is None else fmt(value) + mark:>{w}}")
        ratio = ratio_to_best_peer(r["rates"], check=r["check"])
        print(f"{r['label']:<{label_w}}  " + "  ".join(cols) + f"  {'-' if ratio is None else f'{ratio:.2f}x':>13}")
    units = "; ".join(UNITS[m] for m in dict.fromkeys(r["metric"] for r in results))
    print(f"{units}; '!' = output failed the check against the float32 reference (such a peer "
          "is not a comparison: the ratio leaves it out); '-' = not run (see the JSON's 'skipped').")
    for kind, s in summary(results).items():
        print(f"{kind}: {s['cells']} cells, ratio to the best peer {s['min']:.2f}-{s['max']:.2f}x, "
              f"geometric mean {s['geomean']:.2f}x, {s['at_least_1x']} at or above 1.00x")
    for timing, (low, high) in fp8_step_ratios(results).items():
        print(f"fp8 cache: a step takes {low:.2f}-{high:.2f}x the time of the same step over a "
              f"bf16 cache ({timing})")
    shares = builder_shares(results)
    if shares:
        print("block-sparse builders (GPU time: top-k lists expanded, or from_mask_mod) as a share "
              "of cuteattn's kernel time: " + ", ".join(f"{label} {share:.1%}" for label, share in shares))


def builder_shares(results: list[dict]) -> list:
    """(label, builder time / cuteattn's time) of the block-sparse cells that timed both."""
    out = []
    for r in results:
        ours = r["rates"].get("cuteattn")
        if r.get("builder_ms") is None or not ours:
            continue
        cell_ms = r.get("cell_ms", {}).get("cuteattn")  # (the median time behind its rate)
        if cell_ms:
            out.append((r["label"], r["builder_ms"] / cell_ms))
    return out


def fp8_step_ratios(results: list[dict]) -> dict:
    """The fp8-cache decode cells' step time over the bf16-cache step's (both rated on the
    same bytes, so the inverse of their rates' ratio): {"queued calls" | "CUDA-graph replays":
    (lowest, highest)}, over the cells that timed both."""
    out = {}
    for timing, suffix in (("queued calls", ""), ("CUDA-graph replays", GRAPH)):
        ratios = [r["rates"]["cuteattn-bf16-cache" + suffix] / r["rates"]["cuteattn" + suffix]
                  for r in results
                  if r["rates"].get("cuteattn" + suffix) and r["rates"].get("cuteattn-bf16-cache" + suffix)]
        if ratios:
            out[timing] = (min(ratios), max(ratios))
    return out


def summary(results: list[dict]) -> dict:
    """Per cell kind ("fwd", "varlen"): how many cells have a ratio to the best peer, its range,
    its geometric mean and how many reach 1.00x (what the speed targets are stated in)."""
    by_kind: dict = {}
    for r in results:
        ratio = ratio_to_best_peer(r["rates"], check=r.get("check"))
        if ratio is not None:
            by_kind.setdefault(r["cell"].get("kind", "fwd"), []).append(ratio)
        ratio = ratio_to_best_peer(r["rates"], graph=True, check=r.get("check"))
        if ratio is not None:
            by_kind.setdefault(r["cell"].get("kind", "fwd") + " (CUDA-graph replays)", []).append(ratio)
    return {kind: {"cells": len(rs), "min": min(rs), "max": max(rs),
                   "geomean": math.exp(sum(math.log(x) for x in rs) / len(rs)),
                   "at_least_1x": sum(x >= 1.0 for x in rs)}
            for kind, rs in by_kind.items()}


def git_commit(root: str) -> tuple[str, bool]:
    """(short commit, dirty) of the tree at root, or ('unknown', False) outside a git checkout.
    Dirty: a tracked file's content differs from the commit's; a file's executable bit alone
    does not count (copies of a tree, as to a benchmark machine, often lose it)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-c", "core.fileMode=false", "status", "--porcelain",
                                 "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def sm_clocks() -> dict:
    """Current and max SM clock (MHz) from nvidia-smi, where it is available."""
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True, timeout=20,
        ).stdout.splitlines()[0]
        current, top = (x.strip() for x in line.split(","))
        return {"sm_clock": current, "sm_clock_max": top}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"sm_clock": None, "sm_clock_max": None}


def device_slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "device"


def write_json(path: str, meta: dict, results: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cells = [dict(r["cell"], **{r["metric"]: r["rates"]}, check=r["check"], skipped=r["skipped"],
                  first_call_s=r["first_call_s"], compiles=r.get("compiles"),
                  disk_loads=r.get("disk_loads"), kernels=r.get("kernels"),
                  **({"path": r["path"]} if "path" in r else {}),
                  **({"round_ms": r["round_ms"]} if "round_ms" in r else {}),
                  **{k: r[k] for k in ("builder_ms", "builder_call_ms") if k in r}) for r in results]
    with open(path, "w") as f:
        json.dump(dict(meta, summary=summary(results), cells=cells), f, indent=1)
        f.write("\n")


def plot(path: str, results: list[dict], impls: list[str], title: str) -> bool:
    """Grouped bars of TFLOP/s per cell; False when matplotlib is not importable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    width = 0.8 / max(1, len(impls))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(results) * max(1, len(impls)) / 2), 4.5))
    for i, name in enumerate(impls):
        xs = [j + i * width for j in range(len(results))]
        ax.bar(xs, [r["rates"].get(name) or 0 for r in results], width, label=name)
    ax.set_xticks([j + width * (len(impls) - 1) / 2 for j in range(len(results))])
    ax.set_xticklabels([r["label"] for r in results], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(" / ".join(dict.fromkeys(UNITS[r["metric"]].split(" (")[0] for r in results)))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
