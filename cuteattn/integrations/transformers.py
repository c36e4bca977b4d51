"""Hugging Face transformers: `attn_implementation="cuteattn"`.

    import cuteattn.integrations.transformers  # registers "cuteattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cuteattn",
                                                 dtype=torch.bfloat16)

Importing this module registers an attention function (transformers' AttentionInterface) and the
padding-mask format FlashAttention uses (the 2-D mask, or none when nothing is padded), for any
model that routes attention through that interface (Llama, Qwen2/3, Mistral, Gemma, ...). Each
call becomes one cuteattn call:
  - no padding: flash_attn_func on the (batch, seqlen, heads, head_dim) views;
  - a padded batch (a 2-D attention mask with zeros): the real tokens are gathered into packed
    sequences, run through flash_attn_varlen_func, and scattered back (padding rows get 0);
  - padding-free packed batches (batch 1, sequences concatenated): from the `cu_seq_lens_q/k`
    and `max_length_q/k` a data collator passes, or found where `position_ids` restart;
causal from the module, GQA as the model's heads are, sliding window as FlashAttention's
(sliding_window - 1) keys to the left, softcap, the scaling and attention sinks (`s_aux`, as
gpt-oss has them: cuteattn's learnable_sink) passed through. Gradients flow
through cuteattn's autograd. transformers is not a dependency of cuteattn: install it yourself.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from cuteattn.api import flash_attn_func, flash_attn_varlen_func

NAME = "cuteattn"
_HALF = (torch.float16, torch.bfloat16)


def _lengths_to_cu(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpad(x: torch.Tensor, mask: torch.Tensor):
    """x (batch, seqlen, heads, d), mask (batch, seqlen) bool: the real tokens packed in order
    (total, heads, d), their flat indices, cu_seqlens and the longest length (a host read, as
    every unpadding FlashAttention caller does)."""
    lengths = mask.sum(-1, dtype=torch.int32)
    indices = mask.reshape(-1).nonzero().reshape(-1)
    return x.reshape(-1, *x.shape[2:])[indices], indices, _lengths_to_cu(lengths), int(lengths.max())


def _packed_from_position_ids(position_ids: torch.Tensor):
    """(cu_seqlens, longest) of sequences concatenated in one row: each restarts its positions."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().reshape(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)])
    return cu, int(cu.diff().max())


def _is_packed(position_ids, batch: int) -> bool:
    if position_ids is None or batch != 1 or position_ids.shape[-1] <= 1:
        return False
    expected = torch.arange(position_ids.shape[-1], device=position_ids.device) + position_ids.min()
    return bool((position_ids.reshape(-1) != expected).any())


_warned_cast = False


def cuteattn_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling=None, sliding_window=None, softcap=None, is_causal=None,
                               s_aux=None, **kwargs):
    """transformers' attention-function signature: q/k/v (batch, heads, seqlen, head_dim);
    returns ((batch, seqlen, heads, head_dim), None)."""
    global _warned_cast
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("cuteattn does not return attention weights "
                                  "(output_attentions=True): use attn_implementation='eager'")
    batch, _, seqlen_q, _ = query.shape
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, d) views
    out_dtype = q.dtype
    if q.dtype not in _HALF:  # e.g. layer norms kept in float32: compute in 16 bits, as FA does
        target = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else torch.bfloat16
        if not _warned_cast:
            _warned_cast = True
            warnings.warn(f"cuteattn: attention inputs in {q.dtype} are cast to {target} (load "
                          "the model in bfloat16 or float16 to avoid the casts)", stacklevel=2)
        q, k, v = (t.to(target) for t in (q, k, v))
    causal = bool(module.is_causal if is_causal is None else is_causal) and seqlen_q > 1
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    common = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                  softcap=softcap or 0.0, deterministic=bool(kwargs.get("deterministic", False)),
                  learnable_sink=None if s_aux is None else s_aux.float())

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is not None:  # a padded batch: 2-D mask over the keys (cache included)
        mask_k = attention_mask.to(torch.bool)
        mask_q = mask_k[:, -seqlen_q:]
        qp, idx_q, cu_q, max_q = _unpad(q, mask_q)
        kp, _, cu_k, max_k = _unpad(k, mask_k)
        vp = v.reshape(-1, *v.shape[2:])[mask_k.reshape(-1).nonzero().reshape(-1)]
        packed = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, max_q, max_k, **common)
        out = packed.new_zeros((batch * seqlen_q, *packed.shape[1:]))
        out[idx_q] = packed
        out = out.view(batch, seqlen_q, *packed.shape[1:])
    elif cu_q is not None and cu_k is not None:  # padding-free, lengths from the collator
        max_q, max_k = (int(kwargs.get(n)) for n in ("max_length_q", "max_length_k"))
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q,
                                     max_k, **common).view(batch, seqlen_q, *q.shape[2:])
    elif _is_packed(kwargs.get("position_ids"), batch):  # padding-free, lengths from positions
        cu, longest = _packed_from_position_ids(kwargs["position_ids"])
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu, cu, longest, longest, **common).view(
            batch, seqlen_q, *q.shape[2:])
    else:
        out = flash_attn_func(q, k, v, **common)
    return out.to(out_dtype), None


def register() -> None:
    """Registers "cuteattn" with transformers (done on import; again is harmless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionInterface.register(NAME, cuteattn_attention_forward)
    # FlashAttention's mask format: the 2-D padding mask, or None when nothing is padded
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


register()
