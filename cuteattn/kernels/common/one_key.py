"""The backward's exact gradient where a sequence has one key (both backward families).

There every query row sees that key or none, and the softmax of one score is 1 whatever the
score (softcap or a score_mod too; a mask_mod only leaves fewer keys), so dS is exactly 0 and
so are dQ = dS K and dK = dS^T Q. The kernels' P (dP - D) leaves ~1e-5 there instead (D is
rowsum(dO O) of the rounded O, dP the MMA's sum of the same products in another order). Not
with a learnable sink, which joins every row's denominator.

Both gradients are scaled by softmax_scale in the kernels, so a scale of 0 makes them exact:
for batched keys the launch passes 0 when the keys are one (launch_common.BackwardLaunch), at
no cost in the kernel; with packed keys or seqused_k (lengths on the GPU) the kernel takes
gradient_scale per sequence. Zeroing the one-key rows of every block instead (longer
sequences' too: the causal diagonal's first row, windows of one key) cost registers in the
loop: packed d=128 spilled on sm90 and fp16 / bf16 d=128 went to slower sm80 tiles
(docs/perf-log.md).
"""
import cutlass
from cutlass import Float32, Int32


def gradient_scale(softmax_scale: Float32, seqlen_k: Int32) -> Float32:
    """dQ's and dK's scale for a sequence of seqlen_k keys: softmax_scale, or 0 for one key."""
    return cutlass.select_(seqlen_k == 1, Float32(0.0), softmax_scale)


def per_sequence(cfg) -> bool:
    """Whether a backward kernel of this config takes gradient_scale per sequence: its key
    lengths live on the GPU (packed keys, seqused_k), and no learnable sink."""
    return (cfg.varlen_k or cfg.has_seqused_k) and not getattr(cfg, "has_sink", False)
