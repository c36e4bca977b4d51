"""One varlen forward + backward, synchronising after each step (for compute-sanitizer)."""
import sys
import torch
from cuteattn import flash_attn_varlen_func

lens = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,0,63,64,65,128,129,700").split(",")]
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
h, hk, d = 8, 8, 64
q = torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(sum(lens), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(sum(lens), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), strict=True)
torch.cuda.synchronize(); print("forward ok", flush=True)
g = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize(); print("backward ok", [x.isnan().any().item() for x in g], flush=True)
