"""Score modifiers and their backward twins (common/score_mod.py), run on the CPU through the
DSL's host JIT and compared with PyTorch's autograd of the same formula."""
import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from cuteattn.kernels.common.score_mod import softcap_grad, softcap_scores  # noqa: E402
from cuteattn.kernels.launch_common import to_cute as _to_cute  # noqa: E402

N = 32


@cute.jit
def softcap_both(scores: cute.Tensor, grad: cute.Tensor, score_scale: Float32,
                 softmax_scale: Float32):
    """scores <- tanh(scores * score_scale); grad <- dL/ds from dL/dS' (in registers, as the
    kernels hold them)."""
    t = cute.make_rmem_tensor(N, Float32)
    g = cute.make_rmem_tensor(N, Float32)
    for i in cutlass.range_constexpr(N):
        t[i] = scores[i]
        g[i] = grad[i]
    softcap_scores(t, score_scale)
    softcap_grad(g, t, softmax_scale)
    for i in cutlass.range_constexpr(N):
        scores[i] = t[i]
        grad[i] = g[i]


@pytest.mark.parametrize("softcap,softmax_scale", [(30.0, 0.125), (5.0, 0.0883), (50.0, 1.0)])
def test_softcap_and_its_gradient_match_autograd(softcap, softmax_scale):
    torch.manual_seed(0)
    s = (torch.randn(N) * 80).requires_grad_()     # raw scores q . k, some far into saturation
    upstream = torch.randn(N)                        # dL/dS'
    capped = softcap * torch.tanh(s * softmax_scale / softcap)   # FlashAttention's softcap
    capped.backward(upstream)

    scores, grad = s.detach().clone(), upstream.clone()
    fn = cute.compile(softcap_both, _to_cute(scores, 4), _to_cute(grad, 4), Float32(0.0),
                      Float32(0.0))
    fn(_to_cute(scores, 4), _to_cute(grad, 4), Float32(softmax_scale / softcap),
       Float32(softmax_scale))
    # the forward hook leaves t; the kernel's exp2 factor carries the softcap multiplier
    torch.testing.assert_close(scores * softcap, capped.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, s.grad, rtol=1e-5, atol=1e-6)
