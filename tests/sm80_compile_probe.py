"""Compiles sm80 forward variants for one target arch and prints what ptxas and the PTX say, as
JSON (one process per target: the DSL reads CUTE_DSL_ARCH once, at import).
    CUTE_DSL_ARCH=sm_86 python tests/sm80_compile_probe.py '[[dtype, d, mask, form], ...]' SMEM
form: varlen (a bool) for the forward ("sink[,varlen]": with a learnable sink),
"bwd[,varlen|,varlen_k|,seqused][,deterministic[,descending|,splits]][,padded]" for the
backward (the config the launch takes: the first spill-free candidate; "fallback" its index;
"descending" / "splits": that deterministic dQ form at any head dim, through
launch_bwd.DQ_SPLITS_MAX_DIM), "combine" for the
split-KV combine kernel (d: d_v; mask:
"sink" or "none"), or "decode[,page=N][,split[,fold]][,bidx][,leftpad][,gqa=G][,fp8=e4m3|e5m2][,splitkeys][,ctas=N]"
for the decode kernel (fp8=: an fp8 cache) ("decode,page=N,varlen[,sink]": the paged prefill, packed q).
Run by tests/test_compile_sm80.py."""
import json
import re
import sys

import cutlass

from cuteattn.kernels.sm80.combine import CombineConfig
from cuteattn.kernels.sm80.compile import (compile_bwd_with_report, compile_combine,
                                           compile_fwd_with_report)
from cuteattn.kernels.compile_common import first_spill_free, ptxas_report
from cuteattn.kernels.sm80 import config as sm80_config
from cuteattn.kernels.sm80.config import decode_config, fwd_configs

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# what the PTX must (not) hold: the sm_80 instructions, and none of Hopper's
MARKS = ("mma.sync.aligned.m16n8k16", "ldmatrix", "cp.async.cg.shared.global", "wgmma",
         "stmatrix", "cp.async.bulk", "setmaxnreg", "tanh.approx", "cvt.rn.f16x2.e4m3x2",
         "cvt.rn.f16x2.e5m2x2")
FP8 = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}


def bwd_configs_of(dtype, d, causal, local, softcap, form, smem=163 * 1024, dv=None):
    """The backward family's candidate configs for these switches on this target
    (launch_bwd.bwd_configs; the launch takes the first that compiles spill-free). form:
    "varlen" packed q and k with seqused, "varlen_k" packed keys only, "seqused" fixed length
    with seqused_q/k; "deterministic"."""
    import os
    import torch
    from cuteattn.kernels.sm80 import launch_bwd
    from cuteattn.spec import AttentionSpec
    major = int(re.match(r"sm_(\d+?)\d[a-z]?$", os.environ["CUTE_DSL_ARCH"])[1])
    flags = form.split(",")
    varlen, seqused = "varlen" in flags, "varlen" in flags or "seqused" in flags
    spec = AttentionSpec(dtype=torch.bfloat16 if dtype is cutlass.BFloat16 else torch.float16,
                         head_dim=d, head_dim_v=d if dv is None else dv, causal=causal,
                         local=local, has_softcap=softcap,
                         varlen_q=varlen, varlen_k=varlen or "varlen_k" in flags,
                         has_seqused_q=seqused, has_seqused_k=seqused, kind="bwd",
                         deterministic="deterministic" in flags)
    # a deterministic dQ form at any head dim: "descending" the turns (launch_bwd's
    # DQ_SPLITS_MAX_DIM 0), "splits" the split accumulators (256); else the default's
    saved = launch_bwd.DQ_SPLITS_MAX_DIM
    if "descending" in flags or "splits" in flags:
        launch_bwd.DQ_SPLITS_MAX_DIM = 256 if "splits" in flags else 0
    try:
        cfgs = launch_bwd.bwd_configs(spec, major, smem)
    finally:
        launch_bwd.DQ_SPLITS_MAX_DIM = saved
    if "descending" in flags or "splits" in flags:
        assert all((c.descending_turns, c.dq_splits) == ("descending" in flags, "splits" in flags)
                   for c in cfgs), (form, cfgs[0])
    return cfgs


def fwd_config_of(dtype, d, mask, form, smem):
    """The forward's config (or its candidates, the launch's order) for a variant's form: the
    forward (form True / False: packed or not), "sink[,varlen]" or "decode[,...]"."""
    masks = (mask == "causal", mask == "local", mask == "softcap")
    if isinstance(form, str) and form.startswith("sink"):  # the forward with a learnable sink
        varlen = "varlen" in form
        cfg = fwd_configs(DTYPES[dtype], d, d, *masks, varlen, varlen, smem_limit=smem,
                          has_sink=True)
    elif isinstance(form, str):  # the decode kernel: "decode[,page=N][,split][,bidx][,leftpad]"
        flags = dict(f.split("=") if "=" in f else (f, "1") for f in form.split(","))
        cfg = decode_config(DTYPES[dtype], d, d, *masks, "bidx" in flags, "leftpad" in flags,
                            int(flags.get("page", 0)), "split" in flags, int(flags.get("gqa", 1)),
                            varlen_q="varlen" in flags, has_seqused_q="varlen" in flags,
                            smem_limit=smem, kv_fp8=FP8.get(flags.get("fp8")),
                            split_keys="splitkeys" in flags, ctas_per_sm=int(flags.get("ctas", 2)),
                            fold_combine="fold" in flags)
        if "sink" in flags:  # (the paged prefill's learnable sink: its epilogue's)
            import dataclasses
            cfg = dataclasses.replace(cfg, has_sink=True)
    else:  # the forward, varlen or not: the launch's choice, the first spill-free tile
        # (d may be "d/dv": head dims the kernel pads, or v narrower than q/k)
        dq, dv = map(int, d.split("/")) if isinstance(d, str) else (d, d)
        cfg = fwd_configs(DTYPES[dtype], dq, dv, *masks, form, form, smem_limit=smem)
    return cfg


def main():
    variants, smem = json.loads(sys.argv[1]), int(sys.argv[2])
    out = []
    for dtype, d, mask, form in variants:
        masks = (mask == "causal", mask == "local", mask == "softcap")
        if form == "combine":  # the split-KV combine kernel; mask "sink" or "none"
            cfg = CombineConfig(DTYPES[dtype], d, mask == "sink")
            compiled, info = ptxas_report(lambda: compile_combine(cfg, options="--keep-ptx remarks{ptx}"))
            ptx = compiled.__ptx__
            out.append(dict(variant=[dtype, d, mask, form], tile=[], smem=0,
                            targets=re.findall(r"\.target (\S+)", ptx),
                            marks={m: m in ptx for m in MARKS}, **info))
            continue
        if isinstance(form, str) and form.startswith("bwd"):
            # "padded": a head dim 16 narrower, run on this width with zero-filled loads (the
            # config the launch picks for it, which may differ from this width's own)
            # (d may be "d/dv": v's head dim narrower than q's, read zero-filled as padded)
            narrower = 16 if "padded" in form else 0
            width, dv = map(int, d.split("/")) if isinstance(d, str) else (d, d)
            cfgs = bwd_configs_of(DTYPES[dtype], width - narrower, *masks, form, smem,
                                  dv=dv - narrower)
            cfg, compiled, info = first_spill_free(
                cfgs, lambda c: compile_bwd_with_report(c, keep_ptx=True))
            assert (cfg.head_dim, cfg.padded) == (width, narrower > 0 or dv != width), (d, form, cfg)
            ptx = compiled.__ptx__
            out.append(dict(variant=[dtype, d, mask, form], fallback=cfgs.index(cfg),
                            tile=[cfg.tile_m, cfg.tile_n, cfg.num_warps],
                            smem=cfg.smem_bytes(), targets=re.findall(r"\.target (\S+)", ptx),
                            marks={m: m in ptx for m in MARKS}, **info))
            continue
        cfg = fwd_config_of(dtype, d, mask, form, smem)
        if isinstance(cfg, list):
            cfg, compiled, info = first_spill_free(
                cfg, lambda c: compile_fwd_with_report(c, keep_ptx=True))
        else:
            compiled, info = compile_fwd_with_report(cfg, keep_ptx=True)
        ptx = compiled.__ptx__
        out.append(dict(variant=[dtype, d, mask, form], tile=[cfg.tile_m, cfg.tile_n, cfg.num_warps],
                        smem=cfg.smem_bytes(), targets=re.findall(r"\.target (\S+)", ptx),
                        marks={m: m in ptx for m in MARKS}, warp_local=cfg.warp_local,
                        f16_operands=cfg.f16_operands, **info))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
