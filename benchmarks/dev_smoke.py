"""Developer smoke test of the sm90 forward, bypassing the public API: every head dim and mask
kind on a few odd shapes, errors against a float32 reference, then a quick timing. Prints one
line per case; exits non-zero on any failure. Run on the GPU machine:
    PYTHONPATH=$PWD python3 benchmarks/dev_smoke.py [dlpack] [unpacked] [sweep] [nocheck] [quick]
        [grid] [dims=64,128,256] [o_path=auto|q_buffer|own_buffer|v_stage]
        [tiles=128:2x128x2,64:2x128x4] [l2=1,0] [causal_only] [noalt] [split]
`dlpack` and `unpacked` turn off the switches dispatch.USE_TVM_FFI and config.PACKED_CONVERT for
this run (both on by default), to compare against the older paths in one device call.
`nocheck` skips the correctness cases, `quick` the host-time and varlen timings, `dims=` picks
the head dims timed, `o_path=` config.O_PATH, `tiles=` other tile shapes to time beside the
configured ones (at every length), `l2=` other group sizes of the causal tile order (0: one
group), `causal_only` only the causal cells, `noalt` none of the alternatives below but
`split` (the split mask loop). Every timing also runs the alternatives the
configuration has switches for (long-sequence tiles at short lengths, the other O paths, the
split mask loop), and
with `grid` the same kernel with one CTA per tile (dispatch.PERSISTENT off).
"""
import math
import sys

import torch

from cuteattn import dispatch, compile_cache
from cuteattn.bench.timing import median_ms
from cuteattn.reference import attention_ref
from cuteattn.spec import AttentionSpec


def ref(q, k, v, scale, causal, wl, wr, softcap, upcast=True):
    return attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=(wl, wr),
                         softcap=softcap, upcast=upcast)


def run(b, sq, sk, h, hk, d, dtype, causal=False, wl=-1, wr=-1, softcap=0.0):
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, sq), float("nan"), device=dev)
    scale = 1 / math.sqrt(d)
    local = (wl >= 0 or wr >= 0) and not causal
    spec = AttentionSpec(dtype=dtype, head_dim=d, head_dim_v=d, causal=causal, local=local,
                         has_softcap=softcap > 0, varlen_q=False, varlen_k=False, batch=b,
                         seqlen_q=sq, seqlen_k=sk, nheads=h, nheads_k=hk, softmax_scale=scale,
                         window_left=wl, window_right=wr, softcap=softcap, device_index=0)
    dispatch.forward(spec, q, k, v, out, lse)
    torch.cuda.synchronize()
    o_ref, lse_ref = ref(q, k, v, scale, causal, wl, wr, softcap)
    o_pt, _ = ref(q, k, v, scale, causal, wl, wr, softcap, upcast=False)
    err = (out.float() - o_ref).abs().max().item()
    err_pt = (o_pt.float() - o_ref).abs().max().item()
    fin = torch.isfinite(lse_ref)
    lse_ok = torch.equal(torch.isfinite(lse), fin) and (
        (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-2 if fin.any() else True)
    ok = (not math.isnan(err)) and err <= 2 * err_pt + 1e-5 and lse_ok
    return ok, err, err_pt, lse_ok


def bench(f, iters=20):
    """Median ms, timed like `python -m cuteattn.bench` (calls queued back to back, no sync
    between them), so these numbers compare with the benchmark's."""
    return median_ms(f, torch.device("cuda"), iters=iters)


# `tiles=128:2x128x2,64:2x128x4`: head dim -> other (warpgroups, tile_n, stages) to time
ALT_TILES = {}
for _arg in sys.argv:
    if _arg.startswith("tiles="):
        for _item in _arg[6:].split(","):
            _d, _tile = _item.split(":")
            ALT_TILES.setdefault(int(_d), []).append(tuple(int(x) for x in _tile.split("x")))

L2_GROUPS = next((tuple(int(x) for x in a[3:].split(",")) for a in sys.argv if a.startswith("l2=")), ())
CAUSAL_ONLY = "causal_only" in sys.argv
ALTS = "noalt" not in sys.argv  # `noalt`: no other tile classes or O paths


def time_one(d, s, causal, fa4):
    b, h = 16384 // s, 2048 // d
    q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda")
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=d, head_dim_v=d, causal=causal,
                         local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                         batch=b, seqlen_q=s, seqlen_k=s, nheads=h, nheads_k=h,
                         softmax_scale=d ** -0.5, device_index=0)
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    launch = dispatch.Launch(spec)
    res = {"cuteattn": flops / bench(lambda: launch(q, k, v, out, lse)) / 1e9}
    if "grid" in sys.argv:
        dispatch.PERSISTENT = False  # the same kernel with one CTA per tile, for comparison
        grid = dispatch.Launch(spec)
        dispatch.PERSISTENT = True
        res["per-tile grid"] = flops / bench(lambda: grid(q, k, v, out, lse)) / 1e9
    from cuteattn.kernels.sm90 import config
    if ALTS and config.SHORT_TILES and s <= config.SHORT_SEQLEN and d in config._TILES_SHORT:
        config.SHORT_TILES = False  # the long-sequence tile, for comparison
        long_tiles = dispatch.Launch(spec)
        config.SHORT_TILES = True
        res["long-seq tile"] = flops / bench(lambda: long_tiles(q, k, v, out, lse)) / 1e9
    if causal:  # `l2=1,0`: other (batch, head) group sizes of the causal tile order (0: all)
        default_group = dispatch.l2_group
        for group in L2_GROUPS:
            dispatch.l2_group = lambda _spec, g=group: g if g > 0 else b * h
            other_order = dispatch.Launch(spec)
            dispatch.l2_group = default_group
            res[f"l2 group {group}"] = flops / bench(lambda: other_order(q, k, v, out, lse)) / 1e9
    table = config._TILES_PACKED if config.PACKED_CONVERT else config._TILES
    for tile in ALT_TILES.get(d, ()):  # other tile shapes, at every length
        saved_tile, saved_short = table[d], config.SHORT_TILES
        table[d], config.SHORT_TILES = tile, False
        alt = dispatch.Launch(spec)
        table[d], config.SHORT_TILES = saved_tile, saved_short
        res[f"tile {'x'.join(map(str, tile))}"] = flops / bench(lambda: alt(q, k, v, out, lse)) / 1e9
    saved = config.O_PATH  # the other ways out for O, for comparison, where they apply
    timed = dispatch.sm90_config(spec).o_path
    res = {f"cuteattn[{timed}]": res.pop("cuteattn"), **res}
    for path in config.O_PATHS if ALTS else ():
        config.O_PATH = path
        if path != timed and dispatch.sm90_config(spec).o_path == path:
            other = dispatch.Launch(spec)
            res[f"O {path}"] = flops / bench(lambda: other(q, k, v, out, lse)) / 1e9
    config.O_PATH = saved
    if (ALTS or "split" in sys.argv) and not config.SPLIT_MASK_LOOP:  # the loop split around masks
        config.SPLIT_MASK_LOOP = True
        split = dispatch.Launch(spec)
        config.SPLIT_MASK_LOOP = False
        res["split mask loop"] = flops / bench(lambda: split(q, k, v, out, lse)) / 1e9
    if ALTS and timed == "own_buffer" and not config.TMA_STORE_O:  # O written by TMA stores instead
        config.TMA_STORE_O = True
        tma = dispatch.Launch(spec)
        config.TMA_STORE_O = False
        res["O tma store"] = flops / bench(lambda: tma(q, k, v, out, lse)) / 1e9
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        g = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        res["cudnn"] = flops / bench(g) / 1e9
    if fa4 is not None:
        res["fa4"] = flops / bench(lambda: fa4(q, k, v, causal=causal)) / 1e9
    return res


def host_overhead(fa4):
    """Host microseconds per call (no sync: the GPU runs behind), small causal problem: what a
    caller's CPU pays per attention call, ours through the public API beside the peers'."""
    import time
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from cuteattn import flash_attn_func
    q, k, v = [torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    fns = {"cuteattn flash_attn_func": lambda: flash_attn_func(q, k, v, causal=True),
           "sdpa cudnn": cudnn}
    if fa4 is not None:
        fns["fa4"] = lambda: fa4(q, k, v, causal=True)
    for name, f in fns.items():
        f()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            f()
        host_us = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"host us/call {name}: {host_us:.1f}", flush=True)


def time_varlen():
    """The benchmark's varlen cells: persistent grid against one CTA per tile, beside FA4."""
    from cuteattn.bench import shapes
    from cuteattn.bench.peers import implementations, make_inputs
    device = torch.device("cuda")
    for cell in shapes.varlen_grid():
        x = make_inputs(cell, device)
        fns = implementations(cell, x, device)
        res = {}
        for persistent in (True, False):
            dispatch.PERSISTENT = persistent
            name = "cuteattn" if persistent else "per-tile grid"
            res[name] = cell.flops() / bench(fns["cuteattn"]) / 1e9
        dispatch.PERSISTENT = True
        if callable(fns.get("fa4")):
            res["fa4"] = cell.flops() / bench(fns["fa4"]) / 1e9
        print(f"time {cell.label()}: " + "  ".join(f"{k} {v:4.0f}" for k, v in res.items()), flush=True)


def main():
    from cuteattn.kernels.sm90 import config
    dispatch.USE_TVM_FFI = "dlpack" not in sys.argv
    config.PACKED_CONVERT = "unpacked" not in sys.argv
    config.O_PATH = next((a[7:] for a in sys.argv if a.startswith("o_path=")), config.O_PATH)
    print("switches:", {"USE_TVM_FFI": dispatch.USE_TVM_FFI, "PACKED_CONVERT": config.PACKED_CONVERT,
                        "O_PATH": config.O_PATH})
    fails = 0
    cases = []
    for d in (() if "nocheck" in sys.argv else (64, 96, 128, 192, 256)):
        for (sq, sk) in ((1, 1), (17, 17), (113, 203), (1023, 1023), (128, 17), (300, 64)):
            for mask in ("none", "causal", "window", "softcap"):
                cases.append((d, sq, sk, mask))
    for dtype in (torch.bfloat16, torch.float16):
        for i, (d, sq, sk, mask) in enumerate(cases):
            if dtype == torch.float16 and i % 3:
                continue
            h, hk = ((4, 4), (8, 2), (4, 1))[i % 3]
            kw = dict(causal=mask == "causal")
            if mask == "window":
                kw.update(wl=64, wr=32)
            if mask == "softcap":
                kw.update(softcap=30.0)
            try:
                ok, err, err_pt, lse_ok = run(2, sq, sk, h, hk, d, dtype, **kw)
            except Exception as e:  # report and go on: one broken variant must not hide others
                ok, err, err_pt, lse_ok = False, float("nan"), float("nan"), False
                print("EXC", type(e).__name__, str(e)[:300])
            fails += not ok
            print(f"{'ok ' if ok else 'BAD'} {str(dtype)[6:]:8s} d={d:3d} sq={sq:4d} sk={sk:4d} h={h}:{hk} "
                  f"{mask:8s} err={err:.2e} pt={err_pt:.2e} lse={'ok' if lse_ok else 'BAD'}", flush=True)
    print("compile stats:", {k: v for k, v in compile_cache.stats().items() if k != "compile_seconds"})
    # quick timing: bf16, 16k tokens, h*d = 2048; tile candidates per head dim, beside SDPA and FA4
    try:
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception as e:  # the peer is optional
        print("fa4 unavailable:", type(e).__name__, e)
        fa4 = None
    if "quick" not in sys.argv:  # `quick`: only the fixed-length timings
        host_overhead(fa4)
        time_varlen()
    table = config._TILES_PACKED if config.PACKED_CONVERT else config._TILES  # the active tiles
    dims = next((tuple(int(x) for x in a[5:].split(",")) for a in sys.argv if a.startswith("dims=")),
                (64, 128, 256))
    candidates = {d: [table[d]] for d in dims}
    if "sweep" in sys.argv:  # tile candidates to compare (keep each under 227 KB of smem)
        candidates = {64: [table[64], (2, 128, 4)], 128: [table[128], (2, 128, 3), (2, 128, 2)],
                      256: [table[256], (2, 64, 2)]}
        config.SHORT_TILES = False  # every length runs the tile being swept
        print("sweep: short-sequence tiles off, each candidate runs at every length")
    for d, tiles in candidates.items():
        for tile in tiles:
            table[d] = tile
            compile_cache.clear()
            for causal in ((True,) if CAUSAL_ONLY else (False, True)):
                for s in (1024, 4096, 16384):
                    res = time_one(d, s, causal, fa4 if tile == tiles[0] else None)
                    print(f"time d={d} tile={tile} s={s:5d} causal={causal:d}: " +
                          "  ".join(f"{k} {v:4.0f}" for k, v in res.items()), flush=True)
        table[d] = tiles[0]
    print("FAILURES:", fails)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
