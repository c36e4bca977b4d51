"""Runs one benchmark cell a few times through the public API, for a profiler to capture. On the
GPU machine, e.g. the forward:
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:FlashFwdSm90 \\
        --launch-skip 2 --launch-count 1 python3 benchmarks/dev_profile.py 128 4096 1
or the backward with stalls per source line (kernels compiled with line information):
    CUTE_DSL_LINEINFO=1 ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        -k regex:FlashBwdSm90 --launch-skip 2 --launch-count 1 --export $OUT/bwd \\
        python3 benchmarks/dev_profile.py 128 16384 0 bwd
or the bench's paged prefill cell (2048 queries over a 16k-key paged cache, causal) at a page
size, e.g. pages of 16 against 128:
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:FlashFwdSm90 \
        --launch-skip 2 --launch-count 1 python3 benchmarks/dev_profile.py prefill 16
Arguments: head_dim seqlen causal(0/1) [fwd|bwd [fa4|det|sdpa]]; fa4 runs flash-attn-4's kernels
instead of ours (its backward kernel matches -k regex:BackwardSm90), det our deterministic
backward, sdpa PyTorch's flash backend (FlashAttention-2, mma.sync; its backward kernel matches
-k regex:flash_bwd_dq_dk_dv: the portable path's peer, ours with CUTEATTN_PATH=sm80);
batch x seqlen = 16384 tokens, nheads x d = 2048 (d=80 and 96: 24 heads, as the bench's surface
rows, d=192: 16), bf16; head_dim/head_dim_v for a narrower v (e.g. `192/128 16384 1`, the bench's
MLA row). e.g. d=80's forward beside FlashAttention-4's: `80 4096 0 fwd` and `80 4096 0 fwd fa4`.
Or: prefill page_size. Or the fp8 forward: `128 16384 0 fp8` (e4m3 q, k, v), with
`... fp8 CONFIG_NAME=1` setting a constant of kernels/sm90/config.py first (a candidate switch).
"""
import sys

import torch

from cuteattn import flash_attn_func

if sys.argv[1] == "prefill":
    from cuteattn.bench import peers, shapes
    cell = next(c for c in shapes.prefill_grid() if c.page_size == int(sys.argv[2]))
    dev = torch.device("cuda")
    step = peers._prefill(cell, peers._decode_inputs(cell, dev, torch.bfloat16), dev)["cuteattn"]
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    sys.exit(0)

d, _, dv = sys.argv[1].partition("/")  # head_dim or head_dim/head_dim_v
d, dv, s, causal = int(d), int(dv or d), int(sys.argv[2]), sys.argv[3] == "1"
backward = len(sys.argv) > 4 and sys.argv[4] == "bwd"
deterministic = sys.argv[5:6] == ["det"]
attend = lambda q, k, v: flash_attn_func(q, k, v, causal=causal, strict=True,
                                         deterministic=deterministic)
if sys.argv[5:6] == ["fa4"]:
    from flash_attn.cute.interface import flash_attn_func as fa4
    first = lambda r: r[0] if isinstance(r, tuple) else r  # (out, lse)
    attend = lambda q, k, v: first(fa4(q, k, v, causal=causal))
if sys.argv[5:6] == ["sdpa"]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        is_causal=causal).transpose(1, 2)
b, h = 16384 // s, {80: 24, 96: 24, 192: 16}.get(d, 2048 // d)
q, k, v = [torch.randn(b, s, h, width, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
           for width in (d, d, dv)]
if sys.argv[4:5] == ["fp8"]:
    from cuteattn.kernels.sm90 import config
    for name, value in (a.split("=") for a in sys.argv[5:]):
        setattr(config, name, type(getattr(config, name))(int(value)))
    q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
for _ in range(4):
    out = attend(q, k, v)
    if backward:
        out.backward(torch.ones_like(out))
torch.cuda.synchronize()
