"""Every backward (or, with --fwd, forward) form of the portable path through the launch's own
choice (the first candidate config that compiles spill-free) for one target, without a GPU:
prints the config taken, its registers and any spill. The compile test
(tests/test_compile_sm80.py) samples these forms; this walks all of them (head dims, masks,
dtypes, packed forms, deterministic or a learnable sink).
    CUTE_DSL_ARCH=sm_100a PYTHONPATH=$PWD python benchmarks/dev_spill_sweep.py [--fwd] [bf16,fp16] [64,...,256]
Forms: plain; packed q and k with seqused; packed keys only; packed queries only; seqused only;
deterministic (backward) or a sink (forward). A line ends in SPILL where even the last
candidate spills."""
import itertools
import os
import re
import sys

import torch

from cuteattn.kernels.compile_common import first_spill_free
from cuteattn.kernels.sm80 import launch_bwd
from cuteattn.kernels.launch_common import CUTLASS_DTYPES
from cuteattn.kernels.sm80.compile import compile_bwd_with_report, compile_fwd_with_report
from cuteattn.kernels.sm80.config import SMEM_BY_CAPABILITY, fwd_configs
from cuteattn.spec import AttentionSpec

FORMS = {"plain": {}, "packed": dict(varlen_q=True, varlen_k=True, has_seqused_q=True, has_seqused_k=True),
         "packed_k": dict(varlen_k=True), "packed_q": dict(varlen_q=True),
         "seqused": dict(has_seqused_q=True, has_seqused_k=True), "det": dict(deterministic=True)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main():
    target = os.environ["CUTE_DSL_ARCH"]
    match = re.fullmatch(r"sm_(\d+?)(\d)[a-z]?", target)
    major, minor = int(match[1]), int(match[2])
    smem = SMEM_BY_CAPABILITY[(major, minor)]
    fwd = "--fwd" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--fwd"]
    dtypes = (args[0] if args else "bf16,fp16").split(",")
    dims = [int(x) for x in (args[1] if len(args) > 1 else "64,96,128,192,256").split(",")]
    compiled = {}
    compile_with_report = compile_fwd_with_report if fwd else compile_bwd_with_report
    forms = {**FORMS, "sink": dict(has_sink=True)} if fwd else FORMS
    if fwd:
        forms.pop("det")

    def report(cfg):
        if cfg not in compiled:
            compiled[cfg] = compile_with_report(cfg)[1]
        return None, compiled[cfg]
    spills = 0
    for dt, d, mask, form in itertools.product(dtypes, dims, ("none", "causal", "local", "softcap"), forms):
        masks = dict(causal=mask == "causal", local=mask == "local", has_softcap=mask == "softcap")
        flags = {**dict(varlen_q=False, varlen_k=False, has_seqused_q=False, has_seqused_k=False),
                 **forms[form]}
        if fwd:
            cfgs = fwd_configs(CUTLASS_DTYPES[DTYPES[dt]], d, d, *masks.values(), flags["varlen_q"],
                               flags["varlen_k"], flags["has_seqused_q"], flags["has_seqused_k"],
                               smem_limit=smem, has_sink=flags.get("has_sink", False))
            cfg, _, info = first_spill_free(cfgs, report)
            spilled = info.get("spill_store_bytes", 0)
            spills += bool(spilled)
            print(target, dt, d, mask, form, f"candidate {cfgs.index(cfg)}/{len(cfgs)}",
                  (cfg.tile_m, cfg.tile_n, cfg.num_warps), info.get("registers"),
                  f"SPILL {spilled}" if spilled else "", flush=True)
            continue
        spec = AttentionSpec(dtype=DTYPES[dt], head_dim=d, head_dim_v=d, kind="bwd", **masks, **flags)
        cfgs = launch_bwd.bwd_configs(spec, major, smem)
        cfg, _, info = first_spill_free(cfgs, report)
        spilled = info.get("spill_store_bytes", 0)
        spills += bool(spilled)
        print(target, dt, d, mask, form, f"candidate {cfgs.index(cfg)}/{len(cfgs)}",
              (cfg.tile_m, cfg.tile_n, cfg.num_warps, "grid" if cfg.grid else f"passes {cfg.kv_passes}",
               f"q_parts {cfg.q_parts}", f"ring {cfg.q_stages}"), info.get("registers"),
              f"SPILL {spilled}" if spilled else "", flush=True)
    print(f"{target}: {spills} forms spill")


if __name__ == "__main__":
    main()
