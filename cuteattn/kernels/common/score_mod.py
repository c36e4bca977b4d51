"""Score modifiers: what happens to a raw score tile before the mask and the softmax, with the
backward twin each needs (the derivative through the modifier).

Softcap maps a raw score s (= q . k) to S' = softcap * tanh(s * softmax_scale / softcap). The
kernel folds the constants: it multiplies raw scores by `score_scale` = softmax_scale / softcap,
takes tanh (t), and the softmax's exp2 factor becomes softcap * log2(e) (launch.py passes both).
The backward receives dL/dS' and needs dL/ds = dL/dS' * softmax_scale * (1 - t^2), from the same
t values (recomputed, or kept from the forward).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def softcap_scores(acc: cute.Tensor, score_scale: Float32):
    """In place: acc = tanh(acc * score_scale) (the softcap factor is folded into the softmax)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = cute.math.tanh(acc[i] * score_scale, fastmath=True)


@cute.jit
def softcap_grad(dS: cute.Tensor, tanh_scores: cute.Tensor, softmax_scale: Float32):
    """The backward twin, in place: dS = dL/dS' (by the capped scores) becomes dL/ds (by the raw
    scores q . k): dS * softmax_scale * (1 - t^2), t = `softcap_scores`' output."""
    for i in cutlass.range_constexpr(cute.size(dS)):
        t = tanh_scores[i]
        dS[i] = dS[i] * softmax_scale * (Float32(1.0) - t * t)

