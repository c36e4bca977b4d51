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

from .convert import pack_f32x2


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


# The backward keeps the derivative (1 - t^2) of each score between the softmax and dS, where
# registers are scarcest (two 64x64 float32 tiles live beside dK and dV): packed in fp16, whose
# relative precision (2^-11) is finer than the 16-bit dS it scales, half the registers of float32.

@cute.jit
def softcap_slopes(tanh_scores: cute.Tensor, slopes: cute.Tensor):
    """slopes (fp16, the same register order) = 1 - t^2 of `softcap_scores`' output t."""
    n: cutlass.Constexpr = cute.size(tanh_scores)
    pairs = cute.recast_tensor(cute.make_tensor(slopes.iterator, cute.make_layout(n)), cutlass.Int32)
    for i in cutlass.range_constexpr(n // 2):
        t0, t1 = tanh_scores[2 * i], tanh_scores[2 * i + 1]
        pairs[i] = pack_f32x2(Float32(1.0) - t0 * t0, Float32(1.0) - t1 * t1, cutlass.Float16)


@cute.jit
def apply_softcap_slopes(dS: cute.Tensor, slopes: cute.Tensor):
    """In place: dS (by the capped score / softmax_scale) becomes the gradient by the raw score
    times softmax_scale: dS * (1 - t^2). softcap_grad's rule, with the scale applied later."""
    flat = cute.make_tensor(slopes.iterator, cute.make_layout(cute.size(dS)))
    for i in cutlass.range_constexpr(cute.size(dS)):
        dS[i] = dS[i] * Float32(flat[i])
