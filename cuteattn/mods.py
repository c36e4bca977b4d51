"""Ready-made FlexAttention mods: mask_mod(b, h, q_idx, kv_idx) -> bool and
score_mod(score, b, h, q_idx, kv_idx) -> score.

Each is written the way the kernels trace (Python operators, indexing of the tensors it closes
over, torch's element-wise functions), so `flash_attn_func(..., mask_mod=document(ids))` runs
on the GPU kernel, and the same function works in `torch.nn.attention.flex_attention` and in
`cuteattn.sparse.from_mask_mod`. Indices are positions within the sequence, top-left aligned
as FlexAttention counts them (flash_attn_func's own `causal=True` is bottom-right aligned:
the two agree when seqlen_q == seqlen_k). A mod's constants (a window size, a softcap) are part
of the compiled kernel's key: a new value compiles a new kernel once, then it is cached.
"""
from __future__ import annotations

import torch

__all__ = ["causal", "sliding_window", "document", "document_from_lengths", "prefix_lm",
           "alibi", "softcap"]


def causal():
    """Each query sees the keys up to its own position."""
    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return causal_mask


def sliding_window(left: int, right: int = 0):
    """Keys from `left` positions before the query to `right` after it (right=0: causal)."""
    if left < 0 or right < 0:
        raise ValueError(f"sliding_window needs left, right >= 0; got ({left}, {right})")

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)
    return sliding_window_mask


def document(doc_ids: torch.Tensor, causal: bool = False):
    """Packed documents: a query sees the keys of its own document (and, with causal, only up
    to itself). doc_ids: int (seqlen,) on the GPU that runs the attention, the document of each
    position (the same ids for q and k)."""
    if doc_ids.dim() != 1 or doc_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"doc_ids must be a 1-D int32/int64 tensor; got {tuple(doc_ids.shape)} "
                         f"{doc_ids.dtype}")
    if causal:
        def document_causal_mask(b, h, q_idx, kv_idx):
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)
        return document_causal_mask

    def document_mask(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return document_mask


def document_from_lengths(lengths, device=None, causal: bool = False):
    """document() for documents of these lengths packed one after another."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.dim() != 1 or (lengths < 0).any():
        raise ValueError(f"lengths must be a 1-D list of non-negative ints; got {lengths.tolist()}")
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(torch.int32)
    return document(ids.to(device), causal)


def prefix_lm(prefix_lengths: torch.Tensor):
    """Prefix-LM: sequence b's first prefix_lengths[b] positions are seen by every query (a
    bidirectional prefix), the rest causally. prefix_lengths: int (batch,)."""
    if prefix_lengths.dim() != 1 or prefix_lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prefix_lengths must be a 1-D int32/int64 tensor; got "
                         f"{tuple(prefix_lengths.shape)} {prefix_lengths.dtype}")

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_lengths[b])
    return prefix_lm_mask


def alibi(num_heads: int, device=None):
    """ALiBi's bias as a score_mod: score + slope[h] * (kv_idx - q_idx), the slopes of the
    paper (2^(-8 (h + 1) / num_heads)), float32 on `device`."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive; got {num_heads}")
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)],
                          dtype=torch.float32, device=device)

    def alibi_bias(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_bias


def softcap(cap: float):
    """Gemma-2's logit softcap as a score_mod: cap * tanh(score / cap) (the same as
    flash_attn_func's softcap=cap; as a score_mod it combines with other mods)."""
    if not cap > 0:
        raise ValueError(f"softcap needs cap > 0; got {cap}")
    cap = float(cap)

    def softcap_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_score
