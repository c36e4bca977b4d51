"""The backward's exact gradient where a sequence has one key (both backward families).

There every query row sees that key or none, and the softmax of one score is 1 whatever the
score (softcap or a score_mod too; a mask_mod only leaves fewer keys), so dS is exactly 0 and
so are dQ = dS K and dK = dS^T Q. The kernels' P (dP - D) leaves ~1e-5 there instead (D is
rowsum(dO O) of the rounded O, dP the MMA's sum of the same products in another order). Not
with a learnable sink, which joins every row's denominator.

Both gradients are scaled by softmax_scale in the kernels, so a scale of 0 makes them exact:
for batched keys the launch passes 0 when the keys are one (launch_common.BackwardLaunch), at
no cost in the kernel. With packed keys or seqused_k (lengths on the GPU) the kernel decides per
sequence: sm90 takes gradient_scale once per CTA; the sm80 kernels leave out dQ's share (its
GEMM and atomic adds) and take gradient_scale for dK after the query loop (scale_for). Taken
once per CTA there too, the selected scale lived in a register through the loop, where the
kernel parameter is an operand from the constant bank, and moved ptxas' schedule (packed
causal d=128 0.97x on the H100). Zeroing the one-key rows of every block instead (longer
sequences' too: the causal diagonal's first row, windows of one key) cost registers in the
loop: packed d=128 spilled on sm90 and fp16 / bf16 d=128 went to slower sm80 tiles
(docs/perf-log.md).
"""
import cutlass
from cutlass import Float32, Int32


def gradient_scale(softmax_scale: Float32, seqlen_k: Int32) -> Float32:
    """dQ's and dK's scale for a sequence of seqlen_k keys: softmax_scale, or 0 for one key."""
    return cutlass.select_(seqlen_k == 1, Float32(0.0), softmax_scale)


def scale_for(cfg, softmax_scale: Float32, seqlen_k: Int32) -> Float32:
    """The gradient's scale in a kernel of this config, for use after the query loop (dK's
    epilogue): the select where the key lengths live on the GPU, else softmax_scale itself."""
    if cutlass.const_expr(per_sequence(cfg)):
        return gradient_scale(softmax_scale, seqlen_k)
    return softmax_scale


def per_sequence(cfg) -> bool:
    """Whether a backward kernel of this config zeroes dQ and dK per sequence: its key
    lengths live on the GPU (packed keys, seqused_k), and no learnable sink."""
    return (cfg.varlen_k or cfg.has_seqused_k) and not getattr(cfg, "has_sink", False)
