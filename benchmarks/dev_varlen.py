"""Developer check of the varlen switches: q packed, k packed, both, neither; against torch."""
import itertools

import torch

from cuteattn.kernels.sm90 import launch
from cuteattn.spec import AttentionSpec

torch.manual_seed(0)
b, s, h, d = 2, 200, 2, 128
q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
sc = d ** -0.5
ref = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * sc, -1)
ref_o = torch.einsum("bhqk,bkhd->bqhd", ref, v.float())
ref_lse = torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * sc, -1)  # b h s
cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")
for vq, vk in itertools.product((False, True), repeat=2):
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=d, head_dim_v=d, causal=False, local=False,
                         has_softcap=False, varlen_q=vq, varlen_k=vk, batch=b, seqlen_q=s,
                         seqlen_k=s, nheads=h, nheads_k=h, softmax_scale=sc, device_index=0)
    qq = q.reshape(b * s, h, d) if vq else q
    kk, vv = (k.reshape(b * s, h, d), v.reshape(b * s, h, d)) if vk else (k, v)
    out = torch.full_like(qq, float("nan"))
    lse = torch.full((h, b * s) if vq else (b, h, s), float("nan"), device="cuda")
    try:
        launch.forward(spec, qq, kk, vv, out, lse, cu_seqlens_q=cu if vq else None,
                       cu_seqlens_k=cu if vk else None)
        torch.cuda.synchronize()
    except Exception as e:
        print(vq, vk, "EXC", type(e).__name__, str(e)[:200])
        continue
    o = out.reshape(b, s, h, d).float()
    l = lse.reshape(h, b, s).permute(1, 0, 2) if vq else lse
    for bb in range(b):
        err = (o[bb] - ref_o[bb]).abs()
        bad_rows = (err.amax(dim=(1, 2)) > 0.05).nonzero().flatten().tolist()
        print(f"varlen_q={vq:d} varlen_k={vk:d} batch {bb}: out err {err.max().item():.3g} "
              f"nan {o[bb].isnan().sum().item()} lse err {(l[bb] - ref_lse[bb]).abs().max().item():.3g} "
              f"bad rows {bad_rows[:8]}{'...' if len(bad_rows) > 8 else ''} ({len(bad_rows)})")
