"""Compiles sm80 forward variants for one target arch and prints what ptxas and the PTX say, as
JSON (one process per target: the DSL reads CUTE_DSL_ARCH once, at import).
    CUTE_DSL_ARCH=sm_86 python tests/sm80_compile_probe.py '[[dtype, d, mask, varlen], ...]' SMEM
Run by tests/test_compile_sm80.py."""
import json
import re
import sys

import cutlass

from cuteattn.kernels.sm80.compile import compile_fwd_with_report
from cuteattn.kernels.sm80.config import fwd_config

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# what the PTX must (not) hold: the sm_80 instructions, and none of Hopper's
MARKS = ("mma.sync.aligned.m16n8k16", "ldmatrix", "cp.async.cg.shared.global", "wgmma",
         "stmatrix", "cp.async.bulk", "setmaxnreg", "tanh.approx")


def main():
    variants, smem = json.loads(sys.argv[1]), int(sys.argv[2])
    out = []
    for dtype, d, mask, varlen in variants:
        cfg = fwd_config(DTYPES[dtype], d, d, mask == "causal", mask == "local", mask == "softcap",
                         varlen, varlen, smem_limit=smem)
        compiled, info = compile_fwd_with_report(cfg, keep_ptx=True)
        ptx = compiled.__ptx__
        out.append(dict(variant=[dtype, d, mask, varlen], tile=[cfg.tile_m, cfg.tile_n, cfg.num_warps],
                        smem=cfg.smem_bytes(), targets=re.findall(r"\.target (\S+)", ptx),
                        marks={m: m in ptx for m in MARKS}, **info))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
