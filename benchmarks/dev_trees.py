"""The backward's (--forward: the forward's) TFLOP/s per cell with whichever cuteattn is on
PYTHONPATH: for A/B between two source trees (a copy of the last commit's package beside the
working tree) where no switch inside one tree can select the change. Run the trees alternately
in separate processes (the disk cache makes a tree's second round start warm) and compare with
--compare.
Usage (GPU):
    PYTHONPATH=TREE python3 benchmarks/dev_trees.py --label base [--path sm80]
        [--dtypes fp16,bf16] [--d 128] [--masks none,softcap,causal] [--seqlens 4096,16384]
        [--varlen [--softcap] [--seqused]] [--forward] [--deterministic] >> runs.jsonl
    python3 benchmarks/dev_trees.py --compare runs.jsonl base new
Cells: 16k tokens, 2048 / d heads (the bench's grid); softcap 30; MASKS' window (256, 0)."""
import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict

# (window: a sliding window of 256 keys behind each query; its TFLOP/s count a full cell's
# pairs, so only its ratio between trees means anything)
MASKS = {"none": {}, "causal": dict(causal=True), "softcap": dict(softcap=30.0),
         "window": dict(window_size=(256, 0))}


def measure(args) -> None:
    import torch
    from cuteattn import dispatch, flash_attn_func
    from cuteattn.bench import peers, shapes
    from cuteattn.bench.shapes import Cell
    if args.path:
        os.environ[dispatch.PATH_ENV] = args.path
    dev = torch.device("cuda")
    det = " det" if args.deterministic else ""
    if args.varlen:  # the packed cells of bench --varlen --bwd (bf16; --d 128: 16 heads)
        from cuteattn import flash_attn_varlen_func
        form = (" softcap" if args.softcap else "") + (" seqused" if args.seqused else "")
        import dataclasses
        cells = [dataclasses.replace(c, d=d, nheads=2048 // d, nheads_k=2048 // d)
                 for d in map(int, args.d.split(",")) for c in shapes.varlen_grid(bwd=not args.forward)]
        for cell in cells:
            x = peers.make_inputs(cell, dev)
            extra = dict(softcap=30.0) if args.softcap else {}
            if args.seqused:  # every sequence's whole length, as seqused tensors
                used = (x["cu_seqlens_q"][1:] - x["cu_seqlens_q"][:-1]).to(torch.int32)
                extra.update(seqused_q=used, seqused_k=used.clone())
            attend = lambda: flash_attn_varlen_func(**x, causal=cell.causal, strict=True,
                                                    deterministic=args.deterministic, **extra)
            time_cell(args, cell, attend, (x["q"], x["k"], x["v"]),
                      f"{args.path or 'sm90'} varlen {cell.label()}{form}{det}")
        return
    for dtype in args.dtypes.split(","):
        for d in map(int, args.d.split(",")):
            for s in map(int, args.seqlens.split(",")):
                for mask in args.masks.split(","):
                    kw = MASKS[mask]
                    cell = Cell("bwd", d, 16384 // s, 2048 // d, 2048 // d, s, s,
                                kw.get("causal", False), dtype=dtype)
                    x = peers.make_inputs(cell, dev)
                    q, k, v = x["q"], x["k"], x["v"]
                    attend = lambda: flash_attn_func(q, k, v, strict=True,
                                                     deterministic=args.deterministic, **kw)
                    time_cell(args, cell, attend, (q, k, v),
                              f"{args.path or 'sm90'} {dtype} d{d} {s} {mask}{det}")


def time_cell(args, cell, attend, inputs, name: str) -> None:
    """One JSON line: the backward's TFLOP/s (forward and backward, less the forward), or with
    --forward the forward's (cell.rate counts the forward's FLOPs for a forward cell)."""
    import dataclasses
    import torch
    import cuteattn
    from cuteattn.bench.timing import median_ms
    dev = torch.device("cuda")
    if args.forward:
        attend()
        ms = median_ms(attend, dev)
        cell = dataclasses.replace(cell, kind="varlen" if args.varlen else "fwd")  # (its FLOPs)
    else:
        dout = torch.randn_like(attend())
        run = lambda: torch.autograd.grad(attend(), inputs, dout)
        run()
        fwd, both = median_ms(attend, dev), median_ms(run, dev)
        ms = max(both - fwd, 1e-6)
    print(json.dumps(dict(label=args.label, tree=os.path.dirname(cuteattn.__file__), cell=name,
                          tflops=cell.rate(ms))), flush=True)


def compare(path: str, a: str, b: str) -> None:
    rates = defaultdict(lambda: defaultdict(list))
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            rates[r["cell"]][r["label"]].append(r["tflops"])
    ratios = []
    for cell, by in rates.items():
        if a in by and b in by:
            x, y = statistics.median(by[a]), statistics.median(by[b])
            ratios.append(y / x)
            print(f"{cell:<36} {a} {x:7.1f} {by[a]}  {b} {y:7.1f} {by[b]}  {y / x:.3f}")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{b} / {a}: {min(ratios):.3f}-{max(ratios):.3f}, geometric mean {geo:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label")
    ap.add_argument("--path", choices=["sm80"])
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--d", default="128")
    ap.add_argument("--masks", default="none,causal")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--varlen", action="store_true", help="the packed cells instead")
    ap.add_argument("--forward", action="store_true", help="time the forward, not the backward")
    ap.add_argument("--deterministic", action="store_true", help="deterministic=True calls")
    ap.add_argument("--softcap", action="store_true", help="with --varlen: softcap 30")
    ap.add_argument("--seqused", action="store_true",
                    help="with --varlen: seqused_q / seqused_k tensors (each sequence's length)")
    ap.add_argument("--compare", nargs=3, metavar=("JSONL", "A", "B"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        measure(args)


if __name__ == "__main__":
    sys.exit(main())
