"""FlashAttention's packed entry points: q, k and v (or k and v) stacked in one tensor, as
attention layers with a fused QKV projection produce them. Each splits its packed tensor into
views (no copy: the kernels take strided q, k and v) and calls flash_attn_func or
flash_attn_varlen_func, so everything those check, support and return applies. Gradients flow
back into the packed tensor through autograd.
"""
from __future__ import annotations

import torch

from cuteattn.api import flash_attn_func, flash_attn_varlen_func


def _unpack(name: str, t, count: int, dim: int, layout: str):
    """The `count` views of `t` along `dim`, after checking it is a tensor of that layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t)}")
    rank = len(layout.split(","))
    if t.dim() != rank or t.shape[dim] != count:
        raise ValueError(f"{name} must have shape {layout} with {count} in dimension {dim}; "
                         f"got {tuple(t.shape)}")
    return t.unbind(dim)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, **extras):
    """flash_attn_func on qkv (batch, seqlen, 3, nheads, head_dim). `extras`: flash_attn_func's
    own keywords (return_lse, strict, out, lse)."""
    q, k, v = _unpack("qkv", qkv, 3, 2, "(batch, seqlen, 3, nheads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **extras)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, **extras):
    """flash_attn_func on q (batch, seqlen_q, nheads, head_dim) and kv
    (batch, seqlen_k, 2, nheads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, 2, "(batch, seqlen_k, 2, nheads_k, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, **extras)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, **extras):
    """flash_attn_varlen_func on qkv (total, 3, nheads, head_dim), q and k sharing cu_seqlens
    and max_seqlen. `extras`: flash_attn_varlen_func's own keywords (seqused_q, seqused_k,
    return_lse, validate, strict, out, lse)."""
    q, k, v = _unpack("qkv", qkv, 3, 1, "(total, 3, nheads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs, **extras)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False, **extras):
    """flash_attn_varlen_func on q (total_q, nheads, head_dim) and kv
    (total_k, 2, nheads_k, head_dim)."""
    k, v = _unpack("kv", kv, 2, 1, "(total_k, 2, nheads_k, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **extras)
