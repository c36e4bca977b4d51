"""Times candidate tiles of the portable (sm80) forward on the GPU at hand, beside SDPA's flash
backend (FlashAttention-2), to choose config.TILES. Each candidate replaces the head dim's tile
list, so the normal launch path compiles and runs it; registers and spills are printed (a
spilling tile still runs: the timing says whether it matters). Usage (GPU):
    PYTHONPATH=$PWD python3 benchmarks/dev_sm80_tiles.py [--compile-only d tm tn w] [--jobs 12] [--d 64,128]
Without --compile-only it first compiles every candidate in parallel processes (each stores its
kernel in the disk cache), then times them all in this process.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

os.environ["CUTEATTN_PATH"] = "sm80"

CANDIDATES = {  # head_dim -> [(tile_m, tile_n, warps[, kv_stages])], the current choice first
    64: [(128, 64, 4, 2), (128, 64, 4, 3)],
    # (128, 32, 4, 2/3): 32 rows a warp, spill-free on sm_80/86/90a/100a/120a (at d=128 with
    # the lagging max); (128, 64, 4, 2) spills there, timed for what the spill costs
    96: [(128, 32, 4, 2), (128, 32, 4, 3), (128, 64, 4, 2), (128, 64, 8)],
    # (128, 128, 8): 128 keys a block on 8 warps, the d=128 choice before 32 rows a warp
    128: [(128, 32, 4, 2), (128, 32, 4, 3), (128, 64, 4, 2), (128, 128, 8), (128, 64, 8)],
    256: [(64, 64, 4), (64, 64, 4, 2), (128, 64, 8), (64, 32, 4, 2)],
}
SHAPES = [(b, s, c) for b, s in ((16, 1024), (4, 4096), (1, 16384)) for c in (False, True)]
# (batch, seqlen, causal) at 2048 / d heads: the bench's forward grid


def inputs(d, batch, seqlen):
    shape = (batch, seqlen, 2048 // d, d)
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def use_tile(d, tile):
    from cuteattn import api
    from cuteattn.kernels.sm80 import config
    config.TILES[d] = [tile]  # (a 4th element: kv_stages)
    config.LOCAL_TILES.pop(d, None)
    api._launches.clear()


def compile_only(d, tile):
    from cuteattn import flash_attn_func
    use_tile(d, tile)
    for causal in (False, True):
        q, k, v = inputs(d, 1, 128)
        flash_attn_func(q, k, v, causal=causal, strict=True)
    torch.cuda.synchronize()


def main():
    args = sys.argv[1:]
    if args and args[0] == "--compile-only":
        compile_only(int(args[1]), tuple(int(x) for x in args[2:]))
        return
    jobs = int(args[args.index("--jobs") + 1]) if "--jobs" in args else 12
    if "--d" in args:  # only these head dims
        keep = {int(x) for x in args[args.index("--d") + 1].split(",")}
        for d in set(CANDIDATES) - keep:
            del CANDIDATES[d]
    todo = [(d, t) for d, tiles in CANDIDATES.items() for t in tiles]
    run = lambda dt: subprocess.run([sys.executable, __file__, "--compile-only", str(dt[0]),
                                     *map(str, dt[1])], capture_output=True, text=True)
    with ThreadPoolExecutor(jobs) as pool:
        for (d, t), r in zip(todo, pool.map(run, todo)):
            if r.returncode:
                print(f"d={d} {t}: compile failed: {r.stderr.strip().splitlines()[-1:]}", flush=True)

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from cuteattn import compile_cache, flash_attn_func
    from cuteattn.bench.timing import median_ms
    dev = torch.device("cuda")
    print(f"{'d':>4} {'tile':<16} {'regs':>5} {'spill':>6}  " +
          "  ".join(f"b{b} s{s} {'causal' if c else 'full':<6}" for b, s, c in SHAPES), flush=True)
    fa2 = {}
    for d, tiles in CANDIDATES.items():
        for tile in tiles:
            use_tile(d, tile)
            cells, report = [], {}
            for b, s, causal in SHAPES:
                q, k, v = inputs(d, b, s)
                flops = 4 * b * s * s * (2048 // d) * d / (2 if causal else 1)
                before = set(compile_cache.stats()["kernel_info"])
                try:
                    out = flash_attn_func(q, k, v, causal=causal, strict=True)
                except Exception as e:  # noqa: BLE001 (a tile the kernel rejects)
                    cells.append(f"rejected: {str(e).splitlines()[0][:80]}")
                    break
                new = [i for key, i in compile_cache.stats()["kernel_info"].items() if key not in before]
                if new and not causal:
                    report = new[0]
                ref = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
                ok = (out.float() - ref.float()).abs().max().item() < 3e-2
                ms = median_ms(lambda: flash_attn_func(q, k, v, causal=causal, strict=True), dev)
                if (d, b, s, causal) not in fa2:
                    def flash():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
                    flash()
                    fa2[(d, b, s, causal)] = flops / median_ms(flash, dev) / 1e9
                rate = flops / ms / 1e9
                cells.append(f"{rate:6.1f} ({rate / fa2[(d, b, s, causal)]:.2f}x){'' if ok else '!'}")
            print(f"{d:>4} {str(tile):<16} {report.get('registers', '?'):>5} "
                  f"{report.get('spill_store_bytes', '?'):>6}  " + "  ".join(cells), flush=True)
    print("TFLOP/s (ratio to SDPA flash = FlashAttention-2); '!' = output differs from SDPA")


if __name__ == "__main__":
    main()
