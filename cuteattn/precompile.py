"""`python -m cuteattn.precompile`: compile the kernel variants a model needs into the disk cache
before the first step, so that no process stalls compiling (3-7 s a variant) when it starts.

    python -m cuteattn.precompile --head-dim 128 --dtype bf16 --mask causal --varlen --backward
    python -m cuteattn.precompile --head-dim 192 --head-dim-v 128 --mask causal   (MLA prefill)
    python -m cuteattn.precompile --head-dim 128 --sparse 128x128 --mask none     (block-sparse)

Works on a machine without a GPU: the kernels are compiled for the target architecture
(`--arch`, default sm_90a there, sm_86 with `--path sm80`; the GPU's own where there is one),
the kernels that target's calls run (Hopper's on sm_90a, the portable mma.sync kernels with the
target's tiles elsewhere, or anywhere with `--path sm80`), and the cache directory
(CUTEATTN_CACHE_DIR, default ~/.cache/cuteattn) can then be copied to the GPU machines of the same
architecture and package versions. The variants: every combination of the given head dims,
dtypes and masks, batched and (with --varlen) packed, each forward tile class (short and long
sequences), and with --backward the backward (deterministic too with --deterministic); with
--sparse the block-sparse forward for those block shapes (a coarser one, such as 256x256, as the
kernel block it is expanded to); sizes, head counts and GQA ratios never need a variant of their
own. Head dims between the compiled widths (80, 112, ...) compile the padded kernel they run on.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# softcap combines with a causal mask or a window (Gemma 2: softcap with causal and sliding-window
# layers): each combination is a variant of its own
MASKS = ("none", "causal", "local", "softcap", "causal_softcap", "local_softcap")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cuteattn.precompile",
                                description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, action="append", required=True,
                   help="head dim of q/k/v (repeat for several)")
    p.add_argument("--head-dim-v", type=int,
                   help="v's head dim, when it differs from q/k's (at most the head dim)")
    p.add_argument("--sparse", action="append", metavar="QxK",
                   help="also block-sparse forwards with lists of QxK blocks (repeat for several)")
    p.add_argument("--dtype", action="append", choices=("bf16", "fp16"),
                   help="repeat for several (default: bf16)")
    p.add_argument("--mask", action="append", choices=MASKS,
                   help="repeat for several (default: none and causal); local is any sliding "
                        "window, softcap any softcap > 0, causal_softcap and local_softcap "
                        "both together")
    p.add_argument("--varlen", action="store_true", help="also packed (flash_attn_varlen_func)")
    p.add_argument("--seqused", action="store_true", help="packed calls pass seqused_q/seqused_k")
    p.add_argument("--backward", action="store_true", help="also the backward (training)")
    p.add_argument("--deterministic", action="store_true",
                   help="the backward with deterministic=True too")
    p.add_argument("--arch", help="target when there is no GPU (default: CUTE_DSL_ARCH if "
                                  "set, else sm_90a, with --path sm80 sm_86): sm_90a takes the Hopper kernels, sm_80, "
                                  "sm_86, sm_89, sm_100a, sm_103a, sm_110a, sm_120a or sm_121a "
                                  "the portable ones")
    p.add_argument("--path", choices=("default", "sm80"), default="default",
                   help="sm80: the portable mma.sync kernels (what CUTEATTN_PATH=sm80 and GPUs "
                        "other than Hopper run) on any target")
    return p.parse_args(argv)


def variants(args) -> list:
    """(label, spec) for every kernel the options ask for."""
    import torch
    from cuteattn.spec import AttentionSpec
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    # the GPU's, where there is one: configs that depend on the device (the portable path's
    # tiles follow its shared memory) are then the ones its calls will use
    device_index = 0 if torch.cuda.is_available() else -1
    from cuteattn import sparse
    blocks = [sparse.kernel_block(*_block_shape(b)) for b in args.sparse or []]
    out = []
    layouts = [(False, False)] + ([(True, args.seqused)] if args.varlen else [])
    for d in args.head_dim:
        dv = args.head_dim_v or d
        for dt in args.dtype or ["bf16"]:
            for mask in args.mask or ["none", "causal"]:
                for varlen, seqused in layouts:
                    base = dict(
                        dtype=dtypes[dt], head_dim=d, head_dim_v=dv,
                        causal=mask.startswith("causal"), local=mask.startswith("local"),
                        has_softcap=mask.endswith("softcap"), varlen_q=varlen, varlen_k=varlen,
                        has_seqused_q=seqused, has_seqused_k=seqused, batch=1,
                        nheads=1, nheads_k=1, softmax_scale=d ** -0.5,
                        window_left=128 if mask.startswith("local") else None,
                        window_right=0 if mask.startswith("local") else None,
                        softcap=30.0 if mask.endswith("softcap") else 0.0, device_index=device_index)
                    name = (f"d{d}{f'v{dv}' if dv != d else ''} {dt} {mask}{' varlen' if varlen else ''}"
                            f"{' seqused' if seqused else ''}")
                    for seqlen in (1024, 1 << 20):  # the short and the long tile class
                        out.append((f"fwd {name} {'short' if seqlen == 1024 else 'long'}",
                                    AttentionSpec(**base, seqlen_q=seqlen, seqlen_k=seqlen)))
                    if args.backward:
                        for det in (False, True) if args.deterministic else (False,):
                            out.append((f"bwd {name}{' deterministic' if det else ''}",
                                        AttentionSpec(**base, kind="bwd", deterministic=det)))
                    for bq, bk in ([] if varlen else blocks):
                        out.append((f"sparse {bq}x{bk} {name}", AttentionSpec(
                            **base, seqlen_q=1 << 16, seqlen_k=1 << 16, sparse_q_block=bq,
                            sparse_kv_block=bk)))
    return out


def _block_shape(text: str) -> tuple:
    try:
        q, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--sparse takes QxK block shapes, such as 128x128; got {text!r}")
    return q, k


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    portable = args.path == "sm80"
    if not torch.cuda.is_available():  # before cutlass loads
        # an explicit --arch wins over a CUTE_DSL_ARCH already set; that one over the default
        if args.arch:
            os.environ["CUTE_DSL_ARCH"] = args.arch
        else:
            os.environ.setdefault("CUTE_DSL_ARCH", "sm_86" if portable else "sm_90a")
    if portable:
        os.environ["CUTEATTN_PATH"] = "sm80"  # (dispatch.PATH_ENV) the families serve it
    from cuteattn import compile_cache, dispatch
    if not compile_cache.disk_cache_enabled():
        print("the disk cache is off (CUTEATTN_DISK_CACHE=0): nothing to fill", file=sys.stderr)
        return 2
    from cuteattn.kernels.launch_common import use_tvm_ffi
    if not use_tvm_ffi():
        print("only kernels compiled for TVM-FFI are kept on disk: pip install apache-tvm-ffi "
              "(the tvm-ffi extra)", file=sys.stderr)
        return 2
    # the kernels the target's calls run: dispatch's path for its compute capability
    try:
        capability = (torch.cuda.get_device_capability(0) if torch.cuda.is_available() else
                      dispatch.target_capability(os.environ["CUTE_DSL_ARCH"]))
    except ValueError as e:
        raise SystemExit(f"--arch / CUTE_DSL_ARCH: {e}")
    arch, reason = dispatch.arch_name(*capability)
    if arch is None:
        print(f"nothing to compile: {reason}", file=sys.stderr)
        return 2
    todo = variants(args)
    done = {}
    start = time.perf_counter()
    for i, (label, spec) in enumerate(todo, 1):
        family, reason = dispatch.lookup(arch, spec.kind)
        reason = reason or family.can_implement(spec)
        if reason is None:
            before = compile_cache.stats()
            t0 = time.perf_counter()
            family.launch(spec)  # compiles, or loads what the cache holds, and stores it
            after = compile_cache.stats()
            how = ("compiled" if after["compiles"] > before["compiles"] else
                   "on disk already" if after["disk_loads"] > before["disk_loads"] else "shared")
            status = f"{how} ({time.perf_counter() - t0:.1f} s)"
        else:
            status = f"skipped: {reason}"
        done[label] = status
        bar = "#" * (30 * i // len(todo))
        print(f"\r[{bar:<30}] {i}/{len(todo)} {label}: {status}", flush=True)
    stats = compile_cache.stats()
    print(f"{stats['compiles']} compiled, {stats['disk_loads']} already on disk, in "
          f"{time.perf_counter() - start:.0f} s, under {compile_cache.cache_dir(()).parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
