"""Developer check of the varlen path against the fixed-length path of the same kernel."""
import torch

from cuteattn import dispatch
from cuteattn.spec import AttentionSpec


def spec_for(varlen, b, s, h, d):
    return AttentionSpec(dtype=torch.bfloat16, head_dim=d, head_dim_v=d, causal=False, local=False,
                         has_softcap=False, varlen_q=varlen, varlen_k=varlen, batch=b, seqlen_q=s,
                         seqlen_k=s, nheads=h, nheads_k=h, softmax_scale=d ** -0.5, device_index=0)


torch.manual_seed(0)
b, s, h, d = 2, 128, 2, 128
q, k, v = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
out = torch.full_like(q, float("nan"))
lse = torch.full((b, h, s), float("nan"), device="cuda")
dispatch.forward(spec_for(False, b, s, h, d), q, k, v, out, lse)
cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device="cuda")
qv, kv, vv = [t.reshape(b * s, h, d) for t in (q, k, v)]
outv = torch.full_like(qv, float("nan"))
lsev = torch.full((h, b * s), float("nan"), device="cuda")
dispatch.forward(spec_for(True, b, s, h, d), qv, kv, vv, outv, lsev, cu_seqlens_q=cu, cu_seqlens_k=cu)
torch.cuda.synchronize()
ov = outv.reshape(b, s, h, d)
print("fixed vs varlen out max diff", (out.float() - ov.float()).abs().max().item())
print("nan in varlen out", outv.isnan().sum().item(), "lse nan", lsev.isnan().sum().item())
lv = lsev.reshape(h, b, s).permute(1, 0, 2)
print("lse diff", (lse - lv).abs().max().item())
for bb in range(b):
    for hh in range(h):
        print(bb, hh, "out diff", (out[bb, :, hh].float() - ov[bb, :, hh].float()).abs().max().item(),
              "lse diff", (lse[bb, hh] - lv[bb, hh]).abs().max().item())
print("row0 fixed", out[0, 0, 0, :4].tolist(), "varlen", ov[0, 0, 0, :4].tolist())
# is the varlen output a permutation (wrong head/row/sequence)?
flat_f = out.float().reshape(-1, d)
for name, idx in (("b0 s0 h0", (0, 0, 0)), ("b1 s5 h1", (1, 5, 1))):
    row = ov[idx].float()
    hit = ((flat_f - row).abs().max(dim=1).values < 1e-3).nonzero().flatten().tolist()
    print(name, "varlen row equals fixed rows (flat index b*s*h + s*h + h):", hit[:5])
