"""Score modifiers: what happens to a raw score tile before the mask and the softmax, with the
backward twin each needs (the derivative through the modifier).

Softcap maps a score s to softcap * tanh(s * scale / softcap). The kernel folds the constants:
it multiplies raw scores by `score_scale` = scale / softcap, takes tanh, and the softmax's
exp2 factor becomes softcap * log2(e) (dispatch passes both). The backward receives dP/dS' for
the capped score S' and needs dP/dS = dS' * (1 - tanh^2) * scale, with the same tanh values.
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
def softcap_grad(dS: cute.Tensor, tanh_scores: cute.Tensor, softcap: Float32):
    """The backward twin, in place: dS (the gradient of the loss by the capped scores, in units
    of the exp2 domain's softcap factor) becomes the gradient by the raw scores times `scale`:
    dS * softcap * (1 - t^2), t = the forward's tanh values (`softcap_scores` output)."""
    for i in cutlass.range_constexpr(cute.size(dS)):
        t = tanh_scores[i]
        dS[i] = dS[i] * softcap * (Float32(1.0) - t * t)
