"""AttentionSpec: the normalised attention problem.

The API builds one from the user's tensors and arguments; dispatch decides which kernel family
serves it (by device arch and `kind`); `compile_key` is its static part: everything a compiled
kernel could be specialised on. (The compile cache itself is keyed by the family's kernel config,
which is derived from these fields.) Sizes (batch, sequence lengths, head counts) are deliberately
absent from the key: one compiled kernel serves every shape.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3",
               torch.float8_e5m2: "fp8_e5m2"}

# What a spec asks for: the forward now; the backward, decode (a few queries against a long
# cache) and the combine of split results later. Each kind has its own kernel families.
KINDS = ("fwd", "bwd", "decode", "combine")


@dataclass(frozen=True)
class AttentionSpec:
    # static: part of the compile key
    dtype: torch.dtype            # q, k and v dtype (fp16, bf16; fp8 e4m3, whose out is bf16)
    head_dim: int                 # d of q and k
    head_dim_v: int               # d of v and out
    causal: bool                  # bottom-right aligned causal (window right == 0, left unbounded)
    local: bool                   # a sliding window is active (either side bounded), not causal
    has_softcap: bool             # scores pass through softcap * tanh(s / softcap)
    varlen_q: bool                # q is packed (total_q, h, d) with cu_seqlens_q
    varlen_k: bool                # k/v are packed (total_k, h_k, d) with cu_seqlens_k
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    kind: str = "fwd"             # one of KINDS: which kernel family serves the spec
    deterministic: bool = False   # bwd: bitwise-reproducible gradients (ordered dQ additions)
    has_sink: bool = False        # a learnable sink logit per query head (gpt-oss)
    paged_kv: bool = False        # k/v in pages of a cache, through a block table
    has_kv_batch_idx: bool = False  # decode: k/v rows picked per sequence (cache_batch_idx)
    has_leftpad_k: bool = False   # decode: keys start at a per-sequence offset (cache_leftpad)
    # decode: the cache's dtype where it differs from q's (an fp8 cache, with per-(batch, kv
    # head) descales); None: q's
    kv_dtype: Optional[torch.dtype] = None
    # block-sparse (cuteattn.sparse): the (query, key) block shape of its lists; 0: dense
    sparse_q_block: int = 0
    sparse_kv_block: int = 0
    # FlexAttention's mask_mod traced into the kernel (kernels/common/mask_mod.KernelMod:
    # the function's code, constants and tensor kinds; its `fn` attribute the function)
    mask_mod: Optional[object] = None
    score_mod: Optional[object] = None   # likewise, a score_mod
    # dynamic: not in the key (one kernel serves every value)
    batch: int = 0
    seqlen_q: int = 0             # max_seqlen_q for varlen
    seqlen_k: int = 0             # max_seqlen_k for varlen
    nheads: int = 0
    nheads_k: int = 0
    softmax_scale: float = 1.0
    window_left: Optional[int] = None   # None: unbounded; negative: an edge past the diagonal
    window_right: Optional[int] = None
    softcap: float = 0.0
    device_index: int = -1        # -1: CPU
    page_size: int = 0            # paged k/v: keys per page (0: not paged)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"AttentionSpec.kind must be one of {KINDS}; got {self.kind!r}")

    @property
    def mods_or_lists(self) -> bool:
        """A traced mask_mod / score_mod or block-sparse lists (forms some kernels decline)."""
        return bool(self.sparse_q_block) or self.mask_mod is not None or self.score_mod is not None

    @property
    def qhead_per_kvhead(self) -> int:
        return self.nheads // self.nheads_k

    def compile_key(self) -> tuple:
        """The static configuration: everything a compiled kernel is specialised on."""
        return (
            self.kind,
            DTYPE_NAMES[self.dtype],
            self.head_dim,
            self.head_dim_v,
            self.causal,
            self.local,
            self.has_softcap,
            self.varlen_q,
            self.varlen_k,
            self.has_seqused_q,
            self.has_seqused_k,
            self.deterministic,
            self.has_sink,
            self.paged_kv,
            self.has_kv_batch_idx,
            self.has_leftpad_k,
            None if self.kv_dtype is None else DTYPE_NAMES[self.kv_dtype],
            self.sparse_q_block,
            self.sparse_kv_block,
            self.mask_mod,
            self.score_mod,
        )
