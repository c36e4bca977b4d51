"""sparse.from_mask_mod's evaluation in one launch: which (query block, key block) pairs of blocks a
mask_mod lets through entirely, partly or not at all.

The PyTorch form evaluates the mod over every (query, key) pair as broadcast tensors and reduces
them (a few passes over a boolean tensor of seqlen_q x seqlen_k per batch and head, in chunks):
memory traffic that cost as much as the attention kernel the lists then serve. Here a CTA takes
one block pair of one (batch, head), its threads call the traced mod on the pairs (keys fastest,
so a document-id lookup reads consecutive ids), and a vote per warp and a word per warp in
shared memory reduce them to the pair's state: 0 none, 1 some, 2 all. Pairs past either
sequence's end are not evaluated (as in the PyTorch form, they count for neither). The mod is
traced as common/mods.py describes (the same KernelMod key; its tensors are arguments).
"""
from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .mods import KernelMod, traced

NONE, SOME, ALL = 0, 1, 2  # a block pair's state


@dataclass(frozen=True)
class MaskBlocksConfig:
    """The static configuration of one compiled evaluation (its compile key)."""
    mask_mod: KernelMod
    q_block: int
    kv_block: int
    threads: int = 256


class MaskBlocks:
    def __init__(self, cfg: MaskBlocksConfig, mask_mod_fn):
        assert cfg.threads % 32 == 0
        self.cfg = cfg
        self.mask_mod_fn = mask_mod_fn

    @cute.jit
    def __call__(self, mModTensor0, mModTensor1, mState: cute.Tensor, seqlen_q: Int32,
                 seqlen_k: Int32, stream: cuda.CUstream):
        """mState: int32 (batch, heads, query blocks, key blocks), written (NONE / SOME / ALL);
        the mod's tensors as common/mods.traced takes them."""
        batch, heads, nq, nk = mState.shape
        self.kernel(mModTensor0, mModTensor1, mState, seqlen_q, seqlen_k).launch(
            grid=[nk, nq, batch * heads], block=[self.cfg.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mModTensor0, mModTensor1, mState: cute.Tensor, seqlen_q: Int32,
               seqlen_k: Int32):
        cfg = self.cfg
        n_block, m_block, bh = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        heads = mState.shape[1]
        batch_idx, head_idx = bh // heads, bh % heads
        mod = traced(self.mask_mod_fn, cfg.mask_mod,
                     (mModTensor0, mModTensor1)[:len(cfg.mask_mod.tensors)])
        q_first, kv_first = m_block * cfg.q_block, n_block * cfg.kv_block
        # the rows and keys of this block pair inside the sequences
        rows = cutlass.min(seqlen_q - q_first, cfg.q_block)
        keys = cutlass.min(seqlen_k - kv_first, cfg.kv_block)
        some, every = Int32(0), Int32(1)
        # the block's pairs, keys fastest, a static count (a division by the static kv_block is a
        # multiply and shift; by the runtime count of keys it would be a long sequence)
        for i in cutlass.range(tidx, cfg.q_block * cfg.kv_block, cfg.threads, unroll=1):
            r, c = i // cfg.kv_block, i % cfg.kv_block
            if (r < rows) & (c < keys):
                keep = mod(batch_idx, head_idx, q_first + r, kv_first + c)
                if const_expr(isinstance(keep, bool)):  # (a mod that ignores its indices)
                    some, every = Int32(1 if keep else 0) | some, Int32(1 if keep else 0) & every
                else:
                    hit = cutlass.select_(keep, Int32(1), Int32(0))
                    some, every = some | hit, every & hit
        smem = cutlass.memory.SmemAllocator()
        warps = cfg.threads // 32
        votes = smem.allocate_tensor(Int32, cute.make_layout((2, warps), stride=(warps, 1)), 4)
        some_w = cute.arch.vote_any_sync(some != 0)
        every_w = cute.arch.vote_all_sync(every != 0)
        lane, warp = tidx % 32, tidx // 32
        if lane == 0:
            votes[0, warp] = cutlass.select_(some_w, Int32(1), Int32(0))
            votes[1, warp] = cutlass.select_(every_w, Int32(1), Int32(0))
        cute.arch.sync_threads()
        if tidx == 0:
            any_pair, all_pairs = Int32(0), Int32(1)
            for w in cutlass.range_constexpr(warps):
                any_pair, all_pairs = any_pair | votes[0, w], all_pairs & votes[1, w]
            state = Int32(NONE)
            if any_pair != 0:
                state = cutlass.select_(all_pairs != 0, Int32(ALL), Int32(SOME))
            mState[batch_idx, head_idx, m_block, n_block] = state
