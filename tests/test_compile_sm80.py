"""Compile-only tests of the sm80 (mma.sync) forward for every real target: sm_80, sm_86,
sm_89, sm_100a (datacenter Blackwell runs this path) and sm_120a, each with its own
shared-memory budget (sm_90a too: how the path runs on Hopper). One subprocess per target (the DSL
reads CUTE_DSL_ARCH once, at import) compiles the variants and reports, per variant, the PTX
target, which instructions the PTX holds, and ptxas' registers and spills.

The backward's variants (every head dim and mask kind, packed forms; the config its launch
takes, the first candidate that compiles spill-free for the target) and the decode kernel's
(flash_attn_with_kvcache: paged and contiguous caches, split-KV,
cache_batch_idx, cache_leftpad) are compiled the same way. Checked: the code is for that target; it uses mma.sync, ldmatrix and cp.async and none of
Hopper's instructions (wgmma, stmatrix, TMA, setmaxnreg: the path must run on GPUs without them,
and an stmatrix store of an mma.sync accumulator scrambles it); nothing spills; the tile fits the
target's shared memory.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
pytestmark = pytest.mark.compile

from cuteattn.kernels.sm80 import config  # noqa: E402
from cuteattn.kernels.sm80 import launch as sm80_launch  # noqa: E402

PROBE = Path(__file__).with_name("sm80_compile_probe.py")
# (sm_100a: datacenter Blackwell, B200, which runs this path until it has tcgen05 kernels)
TARGETS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90a": (9, 0), "sm_100a": (10, 0),
           "sm_120a": (12, 0)}
MASKS = ("none", "causal", "local", "softcap")
HEAD_DIMS = config.SUPPORTED_HEAD_DIMS
# every head dim with a rotating mask kind, every mask kind at d=128, fp16, and varlen
VARIANTS = ([["bf16", d, MASKS[i % 4], False] for i, d in enumerate(HEAD_DIMS)]
            + [["bf16", 128, m, False] for m in MASKS if m != MASKS[HEAD_DIMS.index(128) % 4]]
            + [["bf16", 192, "local", False], ["bf16", 192, "none", True],
               ["bf16", 256, "local", False], ["fp16", 256, "causal", False],
               ["fp16", 64, "causal", False], ["bf16", 128, "causal", True],
               ["fp16", 256, "none", True],
               # head dims between the compiled widths (padded) and v narrower than q/k
               ["bf16", "80/80", "causal", False], ["fp16", "192/128", "local", True],
               ["bf16", "72/40", "softcap", False], ["bf16", "256/128", "none", False],
               ["fp16", "112/112", "none", True],
               # forms whose earlier tiles spill on sm_100a (config.TILES' last tiles serve)
               ["bf16", 64, "causal", True], ["bf16", 192, "softcap", True],
               ["fp16", 192, "local", False],
               # a learnable sink (the epilogue's denominator)
               ["bf16", 128, "causal", "sink"], ["fp16", 64, "none", "sink,varlen"],
               ["bf16", 256, "local", "sink"]]
            # the decode kernel (flash_attn_with_kvcache): contiguous and paged caches, splits
            + [["bf16", 128, "none", "decode"], ["bf16", 128, "causal", "decode,split,bidx,leftpad"],
               ["fp16", 64, "local", "decode,page=16,split"], ["bf16", 96, "softcap", "decode,page=128"],
               ["bf16", 192, "causal", "decode,page=32,split"], ["fp16", 256, "none", "decode,split"],
               # pack-GQA
               ["bf16", 128, "none", "decode,split,gqa=8"], ["bf16", 128, "causal", "decode,page=16,gqa=4"],
               ["fp16", 256, "local", "decode,split,gqa=2"], ["bf16", 64, "softcap", "decode,page=64,split,gqa=16"],
               # 16-key blocks of d = 96 (two warps), and the paged prefill (packed q)
               ["bf16", 96, "causal", "decode,page=16,gqa=4"], ["bf16", 128, "causal", "decode,page=16,varlen"],
               ["fp16", 192, "local", "decode,page=128,varlen"],
               ["bf16", 96, "causal", "decode,page=16,varlen,sink"],
               # an fp8 cache (sm_89 on: its conversion is in hardware)
               ["bf16", 128, "none", "decode,split,gqa=4,fp8=e4m3"],
               ["bf16", 128, "causal", "decode,page=16,gqa=8,fp8=e4m3"],
               ["fp16", 64, "softcap", "decode,page=128,split,fp8=e5m2"],
               ["bf16", 192, "local", "decode,page=32,split,gqa=2,fp8=e4m3"],
               ["bf16", 256, "none", "decode,split,bidx,leftpad,fp8=e5m2"],
               # a 16-row tile whose warps split each key block (steps of <= 16 rows a kv head)
               ["bf16", 128, "none", "decode,page=128,split,gqa=4,splitkeys"],
               ["fp16", 64, "causal", "decode,page=16,gqa=8,splitkeys"],
               ["bf16", 192, "local", "decode,split,gqa=2,splitkeys"],
               ["bf16", 128, "softcap", "decode,bidx,leftpad,splitkeys"],
               ["bf16", 128, "none", "decode,page=128,split,gqa=4,fp8=e4m3,splitkeys"],
               ["fp16", 128, "causal", "decode,page=16,gqa=8,fp8=e5m2,splitkeys"],
               # ... with the CTAs an SM of small grids (config.decode_ctas_per_sm): an fp8
               # cache's 2-stage ring for 3, a bf16 cache's 4-stage ring for 1
               ["bf16", 128, "none", "decode,page=16,gqa=4,fp8=e4m3,splitkeys,ctas=3"],
               ["bf16", 128, "causal", "decode,page=128,split,gqa=4,splitkeys,ctas=1"],
               # ... the merge folded into the last split's CTA (config.decode_folds)
               ["bf16", 128, "none", "decode,split,fold,gqa=4,splitkeys"],
               ["fp16", 256, "causal", "decode,page=128,split,fold,gqa=2"],
               ["bf16", 128, "none", "decode,page=16,split,fold,gqa=8,fp8=e4m3,splitkeys,ctas=3"],
               ["fp16", 64, "none", "decode,bidx,leftpad,gqa=8,fp8=e5m2,splitkeys,ctas=3"],
               ["bf16", 192, "local", "decode,page=128,gqa=2,fp8=e4m3,splitkeys"],
               # ... paged at other page sizes (V's copy reusing K's page lookup; before the
               # fp8 copies were 16 bytes a thread, the 3-CTA fp8 entry spilled on sm_89)
               ["fp16", 128, "causal", "decode,page=32,gqa=8,splitkeys"],
               ["bf16", 64, "local", "decode,page=64,split"],
               ["fp16", 64, "causal", "decode,page=16,gqa=8,fp8=e5m2,splitkeys,ctas=3"],
               ["bf16", 128, "none", "decode,page=16,split,gqa=4,fp8=e4m3,splitkeys,ctas=3"],
               # (the warp-local fp8 tile, registers bounded for 3 CTAs an SM, with softcap)
               ["bf16", 128, "softcap", "decode,page=16,split,gqa=4,fp8=e4m3,splitkeys,ctas=3"],
               # (a bf16 q's warp-local tile takes its MMAs in fp16)
               ["bf16", 128, "none", "decode,page=128,split,gqa=4,fp8=e4m3,splitkeys"],
               ["bf16", 64, "causal", "decode,page=16,gqa=8,fp8=e5m2,splitkeys,ctas=3"]]
            # the backward: every head dim and mask kind, varlen, fp16
            + [["bf16", d, m, "bwd"] for d in (64, 96, 128) for m in MASKS]
            + [["bf16", 128, "causal", "bwd,varlen"], ["fp16", 96, "local", "bwd,varlen"],
               ["fp16", 128, "softcap", "bwd"], ["bf16", 64, "none", "bwd,varlen"],
               ["bf16", 128, "causal", "bwd,deterministic"],
               ["bf16", 64, "local", "bwd,varlen,deterministic"],
               # head dims between the widths, padded (80 on 96, 112 on 128, 40 on 64)
               ["bf16", 96, "causal", "bwd,padded"], ["fp16", 128, "none", "bwd,varlen,padded"],
               ["bf16", 128, "causal", "bwd,padded"],
               ["bf16", 64, "local", "bwd,padded,deterministic"],
               # over 128: one pass of 64 keys on the warp grids where 163 KB holds them
               # (bwd_grid.py; dQ in two halves at d=256), else dK and dV in 64-column passes
               # (launch_bwd.WIDE_HEAD_DIMS) on the 99 KB targets' tiles
               ["bf16", 192, "causal", "bwd,varlen"], ["fp16", 192, "softcap", "bwd"],
               ["fp16", 256, "softcap", "bwd"], ["bf16", 256, "causal", "bwd"],
               ["bf16", 256, "local", "bwd,deterministic"], ["fp16", 192, "none", "bwd,padded"],
               ["bf16", 256, "none", "bwd,varlen"], ["bf16", 192, "local", "bwd,deterministic"],
               # forms whose first config spilled on some target (a later candidate serves:
               # launch_bwd.bwd_configs): fp16 d=128 on the grid's ring (sm_80/90a/100a), d=128
               # softcap deterministic (sm_90a), fp16 d=256 packed (sm_90a/100a), d=96
               # deterministic (sm_120a), packed keys only or seqused only at d=128 (sm_100a/120a),
               # packed sequences at d=128 (sm_100a/120a: 32 queries a block)
               ["fp16", 128, "none", "bwd"], ["fp16", 128, "causal", "bwd"],
               ["bf16", 128, "softcap", "bwd,deterministic"], ["fp16", 256, "softcap", "bwd,varlen"],
               ["fp16", 256, "causal", "bwd,seqused"], ["bf16", 96, "local", "bwd,deterministic"],
               ["bf16", 128, "none", "bwd,varlen_k"], ["fp16", 128, "causal", "bwd,seqused"],
               ["bf16", 128, "softcap", "bwd,varlen,deterministic"],
               # v narrower than q and k (MLA's 192 / 128, and 128 / 64), read zero-filled
               ["bf16", "192/128", "causal", "bwd"], ["fp16", "128/64", "none", "bwd,varlen"],
               ["bf16", "96/64", "local", "bwd,deterministic"],
               # deterministic dQ in descending turns or in split accumulators at head dims
               # the default gives the other form (launch_bwd.DQ_SPLITS_MAX_DIM)
               ["bf16", 128, "causal", "bwd,deterministic,descending"],
               ["fp16", 64, "local", "bwd,varlen,deterministic,descending"],
               ["bf16", 256, "causal", "bwd,seqused,deterministic,descending"],
               ["bf16", 128, "none", "bwd,deterministic,splits"],
               ["fp16", 64, "causal", "bwd,varlen,deterministic,splits"],
               ["bf16", 96, "softcap", "bwd,varlen_k,deterministic,splits"],
               ["bf16", 256, "local", "bwd,deterministic,splits"]]
            # the split-KV combine kernel
            + [["bf16", 128, "none", "combine"], ["fp16", 96, "sink", "combine"],
               ["bf16", 256, "sink", "combine"]])
# Known spills, per target: each must still spill (so a fix shows here and the entry goes).
KNOWN_SPILLS = {}


@pytest.mark.parametrize("target", list(TARGETS))
def test_compile_sm80_fwd(target, tmp_path):
    smem = config.SMEM_BY_CAPABILITY[TARGETS[target]]
    env = {**os.environ, "CUTE_DSL_ARCH": target,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    served = VARIANTS
    if TARGETS[target] < sm80_launch.FP8_MIN_CAPABILITY:  # (the decode family declines fp8)
        served = [v for v in served if "fp8" not in str(v[3])]
    run = subprocess.run([sys.executable, str(PROBE), json.dumps(served), str(smem)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    results = json.loads(lines[-1][len("RESULT "):])
    assert [r["variant"] for r in results] == served
    for r in results:
        where = f"{target} {r['variant']} tile {r['tile']}"
        assert r["targets"] == [target], where
        assert r["smem"] <= smem, where
        known_spill = r["variant"] in KNOWN_SPILLS.get(target, [])
        assert "registers" in r and (known_spill or r["spill_store_bytes"] == 0), f"{where} spills: {r}"
        marks = r["marks"]
        combine = r["variant"][3] == "combine"  # plain loads and stores, no MMA
        for needed in ("mma.sync.aligned.m16n8k16", "cp.async.cg.shared.global"):
            assert marks[needed] != combine, f"{where}: {needed}"
        # (the warp-local fp8 tile's operands come from plain shared loads)
        assert marks["ldmatrix"] != (combine or r.get("warp_local", False)), where
        # (a bf16 q's warp-local tile takes its MMAs in fp16: the cache's bytes convert once)
        assert r.get("f16_operands", False) == (r.get("warp_local", False) and r["variant"][0] == "bf16"), where
        for hopper in ("wgmma", "stmatrix", "cp.async.bulk", "setmaxnreg"):
            assert not marks[hopper], f"{where}: uses {hopper}"
        assert marks["tanh.approx"] == (r["variant"][2] == "softcap"), where
        fp8 = next((f[4:] for f in str(r["variant"][3]).split(",") if f.startswith("fp8=")), None)
        for fmt in ("e4m3", "e5m2"):  # an fp8 cache converted in hardware, in its format
            assert marks[f"cvt.rn.f16x2.{fmt}x2"] == (fp8 == fmt), where
        if combine:
            continue
        assert "registers" in r and r["registers"] <= 255, where
        if known_spill:
            assert r["spill_store_bytes"] > 0, f"{where}: no longer spills; drop it from KNOWN_SPILLS"
            continue
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, f"{where} spills: {r}"
