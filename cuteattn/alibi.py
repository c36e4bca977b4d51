"""FlashAttention-2's `alibi_slopes`: a bias of -slope * |i + seqlen_k - seqlen_q - j| added to
the (scaled, softcapped) score of query i and key j, slope per head ((nheads,)) or per sequence
and head ((batch, nheads)), float32; the slopes take no gradient.

It runs as a score_mod (FlexAttention's form, common/mods.py): on Hopper traced into the
forward and backward kernels, elsewhere the reference. The offset seqlen_k - seqlen_q is a
tensor the mod reads (per sequence: packed ones have their own lengths), so new lengths never
compile a new kernel; where it is 0 for every sequence of a fixed-length call, the mod reads
none.
"""
import torch


def check(alibi_slopes, q: torch.Tensor, batch: int, nheads: int) -> None:
    """FlashAttention-2's rules: a float32 tensor on q's device, (nheads,) or (batch, nheads),
    unit stride in the heads."""
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor; got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32; got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device ({q.device}); got "
                         f"{alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or "
                         f"(batch, nheads) = ({batch}, {nheads}); got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.numel() > 1 and alibi_slopes.stride(-1) != 1:
        raise ValueError("alibi_slopes must have unit stride in its last (heads) dimension")


def key_offsets(q, k, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                seqused_k=None):
    """seqlen_k - seqlen_q per sequence (int32, on the device, no sync), or None where a
    fixed-length call has equal lengths. A packed side's lengths come from its cu_seqlens, a
    batched one's from its tensor, either replaced by seqused where given (the masks align to
    those)."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if not packed and seqused_q is None and seqused_k is None:
        if k.shape[1] == q.shape[1]:
            return None
        return torch.full((q.shape[0],), k.shape[1] - q.shape[1], dtype=torch.int32,
                          device=q.device)

    def lengths(x, cu, used):
        if used is not None:
            return used
        if cu is not None:
            return cu[1:] - cu[:-1]
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.int32, device=x.device)
    return (lengths(k, cu_seqlens_k, seqused_k) - lengths(q, cu_seqlens_q, seqused_q)).to(
        torch.int32)


def score_mod(alibi_slopes: torch.Tensor, offsets):
    """The score_mod adding FlashAttention-2's bias (offsets: key_offsets')."""
    slopes = alibi_slopes.detach()
    if slopes.dim() == 1 and offsets is None:
        def alibi_bias(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * torch.abs(q_idx - kv_idx)
    elif slopes.dim() == 1:
        def alibi_bias(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * torch.abs(q_idx + offsets[b] - kv_idx)
    elif offsets is None:
        def alibi_bias(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * torch.abs(q_idx - kv_idx)
    else:
        def alibi_bias(score, b, h, q_idx, kv_idx):
            return score - slopes[b, h] * torch.abs(q_idx + offsets[b] - kv_idx)
    return alibi_bias
