"""Fills the disk cache (compile_cache, CUTEATTN_DISK_CACHE) with every sm90 forward variant the
GPU tests and the benchmark use, compiled here for sm_90a without a GPU. Carried to the GPU machine
(about 90 KB per variant), it turns most of the GPU tests' time, compiling, into loading:
    CUTEATTN_CACHE_DIR=$PWD/.kcache python benchmarks/dev_build_cache.py [processes]
then, on the GPU machine: CUTEATTN_DISK_CACHE=1 CUTEATTN_CACHE_DIR=$PWD/.kcache ...
(carry `.kcache`). NAME=VALUE arguments set constants of kernels/sm90/config.py first (a
candidate's variants for its GPU tests and A/B, e.g. FP8_V_IN_KERNEL_MAX_SEQLEN_Q=0). Subsets:
--fp8 only the fp8 (e4m3) variants, --surface the surface rows' (d=192 / v=128, d=80, d=96),
--varlen the varlen cells', --dynamic the counter-drawn tiles' (causal, window, packed) at
d=64 / 128, --bench the forward bench's default and fp8 grids' (what dev_fwd_ab.py times),
--sparse the block-sparse bench's. The cache directory is keyed by a fingerprint of the sm90 forward's sources
(launch.sources()), the DSL and TVM-FFI versions and the architecture, so a mismatch only means
compiling as before.
"""
import itertools
import os
import sys
from multiprocessing import Pool

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["CUTEATTN_DISK_CACHE"] = "1"

import torch  # noqa: E402

MASKS = {  # name -> (causal, local, softcap)
    "none": (False, False, False), "causal": (True, False, False), "local": (False, True, False),
    "softcap": (False, False, True), "softcap_causal": (True, False, True),
    "softcap_local": (False, True, True),
}


def specs():
    from cuteattn.spec import AttentionSpec
    for dtype, d, mask, varlen, seqlen in itertools.product(
            (torch.bfloat16, torch.float16), (64, 80, 96, 128, 192, 256), MASKS, (False, True),
            (1024, 4096)):
        causal, local, softcap = MASKS[mask]
        for seqused in ((False, True) if varlen else (False,)):
            yield AttentionSpec(
                dtype=dtype, head_dim=d, head_dim_v=d, causal=causal, local=local,
                has_softcap=softcap, varlen_q=varlen, varlen_k=varlen, has_seqused_q=seqused,
                has_seqused_k=seqused, seqlen_q=seqlen, seqlen_k=seqlen, softmax_scale=d ** -0.5,
                softcap=30.0 if softcap else 0.0)


def surface_specs():
    """The forward bench's surface cells (d=192 with d_v=128, d=80, d=96; 4k and 16k, causal
    and not), in both 16-bit dtypes (the GPU tests' surface cases run fp16 too)."""
    from cuteattn.bench.shapes import surface_grid
    from cuteattn.spec import AttentionSpec
    for dtype, cell in itertools.product((torch.bfloat16, torch.float16), surface_grid()):
        dv = cell.dv or cell.d
        yield AttentionSpec(
            dtype=dtype, head_dim=cell.d, head_dim_v=dv, causal=cell.causal,
            local=False, has_softcap=False, varlen_q=False, varlen_k=False,
            seqlen_q=cell.seqlen_q, seqlen_k=cell.seqlen_k, softmax_scale=cell.d ** -0.5)


FP8_MASKS = ("none", "causal", "local", "softcap")  # the fp8 tests' and benchmark's masks


def fp8_specs():
    from cuteattn.spec import AttentionSpec
    for d, mask, varlen, seqlen in itertools.product(
            (64, 96, 128, 192, 256), FP8_MASKS, (False, True), (1024, 4096)):
        causal, local, softcap = MASKS[mask]
        yield AttentionSpec(
            dtype=torch.float8_e4m3fn, head_dim=d, head_dim_v=d, causal=causal, local=local,
            has_softcap=softcap, varlen_q=varlen, varlen_k=varlen, seqlen_q=seqlen,
            seqlen_k=seqlen, softmax_scale=d ** -0.5, softcap=30.0 if softcap else 0.0)


def bench_specs():
    """The cells of the forward bench's default and fp8 grids (bf16 and e4m3, d 64/128/256,
    1k/4k/16k, causal and not)."""
    from cuteattn.spec import AttentionSpec
    for dtype, d, seqlen, causal in itertools.product(
            (torch.bfloat16, torch.float8_e4m3fn), (64, 128, 256), (1024, 4096, 16384),
            (False, True)):
        yield AttentionSpec(
            dtype=dtype, head_dim=d, head_dim_v=d, causal=causal, local=False,
            has_softcap=False, varlen_q=False, varlen_k=False, seqlen_q=seqlen,
            seqlen_k=seqlen, softmax_scale=d ** -0.5)


def varlen_specs():
    """The forward bench's varlen cells (bf16, d=128, packed, causal and not)."""
    from cuteattn.bench.shapes import varlen_grid
    from cuteattn.spec import AttentionSpec
    for cell in varlen_grid():
        yield AttentionSpec(
            dtype=torch.bfloat16, head_dim=cell.d, head_dim_v=cell.d, causal=cell.causal,
            local=False, has_softcap=False, varlen_q=True, varlen_k=True,
            seqlen_q=cell.seqlen_q, seqlen_k=cell.seqlen_k, softmax_scale=cell.d ** -0.5)


def dynamic_specs():
    """The specs() whose tiles come from the counter (causal, window, packed) at d=64 and 128:
    a tile-order candidate's GPU tests."""
    return (s for s in specs() if s.head_dim in (64, 128) and (s.causal or s.local or s.varlen_q))


def sparse_specs():
    """The block-sparse bench's kernels (bf16, d=128, every physical block shape)."""
    from cuteattn.sparse import KERNEL_BLOCKS
    from cuteattn.spec import AttentionSpec
    for q_block, kv_block in KERNEL_BLOCKS:
        yield AttentionSpec(
            dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=False, local=False,
            has_softcap=False, varlen_q=False, varlen_k=False, seqlen_q=8192, seqlen_k=8192,
            softmax_scale=128 ** -0.5, sparse_q_block=q_block, sparse_kv_block=kv_block)


def build(cfg):
    from cuteattn.kernels.sm90 import launch
    launch._compiled(cfg, tvm_ffi=True)
    return 1


def main():
    from cuteattn import compile_cache
    from cuteattn.kernels.sm90 import launch
    from cuteattn.kernels.sm90 import config
    args = [a for a in sys.argv[1:] if "=" not in a and not a.startswith("--")]
    for name, value in (a.split("=") for a in sys.argv[1:] if "=" in a):
        assert hasattr(config, name), f"kernels/sm90/config.py has no {name}"
        setattr(config, name, type(getattr(config, name))(int(value)))
    unique = {}
    every = (fp8_specs() if "--fp8" in sys.argv else bench_specs() if "--bench" in sys.argv
             else sparse_specs() if "--sparse" in sys.argv
             else surface_specs() if "--surface" in sys.argv
             else varlen_specs() if "--varlen" in sys.argv
             else dynamic_specs() if "--dynamic" in sys.argv
             else itertools.chain(specs(), surface_specs(), fp8_specs()))
    for spec in every:  # one per compiled variant (the tile class folds lengths together)
        unique[launch.sm90_config(spec)] = None  # the config is the compile key
    processes = int(args[0]) if args else os.cpu_count()
    print(f"{len(unique)} variants into {compile_cache.cache_dir(launch.sources())}", flush=True)
    with Pool(processes) as pool:
        done = sum(pool.imap_unordered(build, unique))
    print(f"built {done}", flush=True)


if __name__ == "__main__":
    main()
