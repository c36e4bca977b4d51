"""Decode GB/s against num_splits (0 = the split heuristic's choice) on the bench's decode
cells where the heuristic splits (batch 1 and 8): CUDA-graph replays, one process. Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_decode_splits.py [--fp8] [SPLITS,...]"""
import sys

import torch

from cuteattn import flash_attn_with_kvcache
from cuteattn.bench import peers
from cuteattn.bench.shapes import Cell
from cuteattn.bench.timing import graph_replay_ms

fp8 = "--fp8" in sys.argv
given = [a for a in sys.argv[1:] if not a.startswith("--")]
counts = [int(s) for s in given[0].split(",")] if given else [0, 8, 16, 24, 32, 33, 48, 64, 66, 96, 128]
dev = torch.device("cuda")
for batch, length in ((1, 131072), (8, 32768)):
    for page in (16, 128, None):
        cell = Cell("decode", 128, batch, 32, 8, 1, length, False, page_size=page,
                    kv_dtype="fp8_e4m3" if fp8 else None)
        x = peers._decode_inputs(cell, dev, torch.bfloat16)
        nbytes = x["k"].numel() * x["k"].element_size() * 2
        extra = dict(k_descale=x["k_descale"], v_descale=x["v_descale"]) if fp8 else {}
        row = []
        for s in counts:
            fn = lambda: flash_attn_with_kvcache(x["q"], x["k"], x["v"], cache_seqlens=x["lens"],
                                                 block_table=x["table"], num_splits=s,
                                                 strict=True, **extra)
            fn()
            ms = min(graph_replay_ms(fn, dev, iters=50) for _ in range(2))
            row.append(f"{s}:{nbytes / ms / 1e6:.0f}")
        print(f"b{batch} L{length} page{page} {'fp8' if fp8 else 'bf16'}: " + " ".join(row), flush=True)
        del x
        torch.cuda.empty_cache()
