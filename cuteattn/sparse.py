"""Block-sparse attention metadata, FlashAttention-4's and FlexAttention's form, and its builders.

A `BlockSparseMask` says, per (batch, head, query block), which key blocks a query block attends:
"full" blocks (every pair attended, no element mask) and "partial" blocks (the element mask, the
call's `mask_mod`, applies), each as a count and an index list (the first `count` entries are
the blocks; the rest is padding). Batch and head modes may be 1 (broadcast). Blocks are
`q_block` x `kv_block` tokens; the last block of each side may be short (sequence lengths need
not be multiples). Every builder runs on the tensors' device without a host sync:
  - `from_block_mask`: from a boolean (B, H, nq, nk) block mask (and optionally which of its
    blocks are partial);
  - `from_topk`: from top-k selected key block indices per query block (VSA's form);
  - `from_mask_mod`: by evaluating a mask_mod over every block: all pairs -> full, some ->
    partial, none -> left out;
  - `expand`: a logical mask at one block size as the same token pairs at a finer physical one.
`dense(...)` gives the (B, H, seqlen_q, seqlen_k) boolean mask the metadata means (what the
reference applies). A key block is listed at most once per query block, across both lists
(every builder's lists are so): the kernels read the lists without a sync, and the forward
would count a repeated block twice; the reference path, which reads them, refuses such lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


# The (query, key) block shapes the GPU kernel (sm90) takes: its tile is the block. A coarser
# mask whose blocks these divide (VSA's 256x256) is expanded to the largest that fits.
KERNEL_BLOCKS = ((128, 128), (128, 64), (64, 64))
# the backward kernel's key block: lists of narrower key blocks (64) are walked in pairs
# (transpose_paired)
BACKWARD_KEY_BLOCK = 128


def kernel_block(q_block: int, kv_block: int) -> tuple:
    """The block shape the GPU kernel runs lists of q_block x kv_block on: theirs when it takes
    it, else the largest of KERNEL_BLOCKS that divides it (the lists expanded, `expand`), else
    theirs (no kernel takes it: the call falls back, saying so)."""
    if (q_block, kv_block) in KERNEL_BLOCKS:
        return q_block, kv_block
    fits = [b for b in KERNEL_BLOCKS if q_block % b[0] == 0 and kv_block % b[1] == 0]
    return fits[0] if fits else (q_block, kv_block)


@dataclass(frozen=True)
class BlockSparseMask:
    q_block: int
    kv_block: int
    full_count: torch.Tensor       # int32 (B|1, H|1, nq)
    full_index: torch.Tensor       # int32 (B|1, H|1, nq, nk)
    partial_count: torch.Tensor    # int32 (B|1, H|1, nq)
    partial_index: torch.Tensor    # int32 (B|1, H|1, nq, nk)

    @property
    def num_blocks(self) -> tuple:
        """(nq, nk): query and key blocks."""
        return self.full_index.shape[2], self.full_index.shape[3]

    def block_masks(self) -> tuple:
        """(full, partial) boolean (B|1, H|1, nq, nk) block masks (a block listed as both counts
        as full)."""
        return _listed(self.full_count, self.full_index), _listed(self.partial_count, self.partial_index)

    def dense(self, seqlen_q: int, seqlen_k: int, mask_mod: Optional[Callable] = None,
              batch: Optional[int] = None, heads: Optional[int] = None,
              rows: Optional[tuple] = None) -> torch.Tensor:
        """(B, H, seqlen_q, seqlen_k) bool: pairs in full blocks, and pairs in partial blocks where
        mask_mod (b, h, q_idx, kv_idx) holds (all of them without a mask_mod). rows (first,
        count): only those query rows (the reference's blocks of rows)."""
        first, count = (0, seqlen_q) if rows is None else rows
        full, partial = self.block_masks()
        b0, b1 = first // self.q_block, -(-(first + count) // self.q_block)
        lead = first - b0 * self.q_block
        expand = lambda m: m[:, :, b0:b1].repeat_interleave(self.q_block, 2)[:, :, lead:lead + count] \
            .repeat_interleave(self.kv_block, 3)[:, :, :, :seqlen_k]
        out = expand(full)
        part = expand(partial & ~full)
        if mask_mod is not None:
            b = out.shape[0] if batch is None else batch
            h = out.shape[1] if heads is None else heads
            part = part & evaluate_mask_mod(mask_mod, b, h, count, seqlen_k, out.device,
                                            q_offset=first)
        out = out | part
        if batch is not None or heads is not None:
            out = out.expand(batch or out.shape[0], heads or out.shape[1], -1, -1)
        return out


def _listed(count: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The boolean block mask of (count, index) lists: the first `count` entries of each list.
    What the entries past it hold (zeros, repeats of a listed block) must not unset a listed
    block, so they go to a spare column that is cut off, and every entry scatters the one value
    True (scatter_ leaves unspecified which of two writes to one place wins)."""
    nk = index.shape[-1]
    valid = torch.arange(nk, device=index.device) < count.unsqueeze(-1).long()
    target = torch.where(valid, index.long().clamp(0, nk - 1), nk)
    mask = torch.zeros((*index.shape[:-1], nk + 1), dtype=torch.bool, device=index.device)
    mask.scatter_(-1, target, True)
    return mask[..., :nk]


def _compact(mask: torch.Tensor):
    """(count int32, index int32) of a boolean (..., nk) mask: the selected blocks first, in
    increasing order, then the unselected ones (padding), as a stable sort would place them,
    but by a running count and one scatter: a selected block goes to its rank among the
    selected, an unselected one after all of them at its rank among the unselected (a few
    elementwise kernels where a stable sort of every row is a segmented sort on the GPU)."""
    nk = mask.shape[-1]
    count = mask.sum(-1, dtype=torch.int32)
    selected_upto = torch.cumsum(mask, -1, dtype=torch.int32)  # selected blocks <= j
    blocks = torch.arange(nk, dtype=torch.int32, device=mask.device)
    target = torch.where(mask, selected_upto - 1, count.unsqueeze(-1) + blocks - selected_upto)
    index = torch.empty(mask.shape, dtype=torch.int32, device=mask.device)
    index.scatter_(-1, target.long(), blocks.expand_as(mask))
    return count, index


def from_block_mask(block_mask: torch.Tensor, q_block: int, kv_block: int,
                    partial: Optional[torch.Tensor] = None) -> BlockSparseMask:
    """From a boolean (B|1, H|1, nq, nk) mask of attended blocks; `partial` (same shape) marks
    those whose pairs the mask_mod decides (default: none, every attended block is full)."""
    _check_block_sizes(q_block, kv_block)
    if not isinstance(block_mask, torch.Tensor):
        raise TypeError(f"block_mask must be a torch.Tensor; got {type(block_mask)}")
    if block_mask.dtype != torch.bool or block_mask.dim() != 4:
        raise ValueError(f"block_mask must be a 4-D bool tensor (B, H, nq, nk); got "
                         f"{block_mask.dtype} {tuple(block_mask.shape)}")
    if partial is not None and (not isinstance(partial, torch.Tensor) or partial.dtype != torch.bool
                                or partial.shape != block_mask.shape
                                or partial.device != block_mask.device):
        raise ValueError(f"partial must be a bool tensor of block_mask's shape "
                         f"{tuple(block_mask.shape)} on its device; got "
                         f"{getattr(partial, 'dtype', type(partial))} "
                         f"{tuple(getattr(partial, 'shape', ()))}")
    if partial is None:  # (every block full: the empty partial lists _compact would give)
        full_count, full_index = _compact(block_mask)
        partial_count = torch.zeros_like(full_count)
        partial_index = torch.arange(block_mask.shape[-1], dtype=torch.int32,
                                     device=block_mask.device).expand(block_mask.shape).contiguous()
    else:
        partial = partial & block_mask
        full_count, full_index = _compact(block_mask & ~partial)
        partial_count, partial_index = _compact(partial)
    return BlockSparseMask(q_block, kv_block, full_count, full_index, partial_count, partial_index)


def transpose_paired(mask: BlockSparseMask) -> tuple:
    """transpose for a backward whose key blocks are pairs of mask's (lists of 64-key blocks
    walked by 128-key blocks): (the lists of the pairs, naming each query block that either key
    block of the pair attends, as partial blocks; int32 (B|1, H|1, nk, nq) whether key block
    n attends query block m, so that each half of a pair leaves out what it does not attend).
    Built on the device, no host sync; an odd last key block pairs with nothing."""
    full, partial = mask.block_masks()
    seen = (full | partial).transpose(-1, -2)  # (B|1, H|1, nk, nq)
    b, h, nk, nq = seen.shape
    padded = torch.zeros((b, h, nk + nk % 2, nq), dtype=torch.bool, device=seen.device)
    padded[:, :, :nk] = seen
    union = padded.view(b, h, (nk + 1) // 2, 2, nq).any(-2)
    return (from_block_mask(union, 2 * mask.kv_block, mask.q_block, partial=union),
            seen.to(torch.int32).contiguous())


def dq_turns(mask: BlockSparseMask, key_block: int = BACKWARD_KEY_BLOCK) -> torch.Tensor:
    """The deterministic backward's order: int32 (B|1, H|1, nq, nk), for each query block m and
    key block n (of key_block keys: mask's, or pairs of them) how many key blocks before n
    attend m, i.e. n's turn to add its share into m's dQ. Built on the device, no host sync."""
    full, partial = mask.block_masks()
    attends = full | partial
    if key_block == 2 * mask.kv_block:  # (64-key lists walked in pairs)
        b, h, nq, nk = attends.shape
        padded = torch.zeros((b, h, nq, nk + nk % 2), dtype=torch.bool, device=attends.device)
        padded[..., :nk] = attends
        attends = padded.view(b, h, nq, (nk + 1) // 2, 2).any(-1)
    count = attends.to(torch.int32)
    return (count.cumsum(-1, dtype=torch.int32) - count).contiguous()


def transpose(mask: BlockSparseMask) -> BlockSparseMask:
    """The same token pairs seen from the keys: per (batch|1, head|1, key block), the query
    blocks that attend it (full or partial as in mask), blocks of kv_block x q_block. What the
    backward's key blocks walk; built on the device, no host sync."""
    full, partial = mask.block_masks()
    partial = (partial & ~full).transpose(-1, -2)
    return from_block_mask(full.transpose(-1, -2) | partial, mask.kv_block, mask.q_block, partial)


def from_topk(indices: torch.Tensor, num_kv_blocks: int, q_block: int, kv_block: int,
              partial: bool = False, physical: Optional[tuple] = None) -> BlockSparseMask:
    """From (B|1, H|1, nq, k) selected key block indices per query block (VSA's top-k form;
    repeated indices count once; an index outside [0, num_kv_blocks), such as a -1 filling a
    row that selects fewer than k, selects nothing: checking them would need a sync);
    partial=True makes every selected block partial. physical: (q_block, kv_block) dividing
    the logical ones, to build the lists at that finer block size directly, the same as
    expand(from_topk(...), *physical). On a GPU one launch (kernels/common/topk_lists.py)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor; got {type(indices)}")
    if indices.dim() != 4 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be a 4-D int32/int64 tensor (B, H, nq, k); got "
                         f"{indices.dtype} {tuple(indices.shape)}")
    if isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be an int >= 1; got {num_kv_blocks!r}")
    _check_block_sizes(q_block, kv_block)
    fine = (q_block, kv_block) if physical is None else tuple(physical)
    if len(fine) != 2:
        raise ValueError(f"physical must be (q_block, kv_block); got {physical!r}")
    _check_finer(fine, (q_block, kv_block))
    if (indices.is_cuda and indices.numel() > 0
            and torch.cuda.get_device_capability(indices.device) >= (8, 0)):
        from .kernels.launch_common import topk_lists
        lists = topk_lists(indices, num_kv_blocks, q_block // fine[0], kv_block // fine[1],
                           partial)
        return BlockSparseMask(*fine, *lists)
    # (out-of-range indices go to a spare column, cut off)
    mask = torch.zeros((*indices.shape[:3], num_kv_blocks + 1), dtype=torch.bool,
                       device=indices.device)
    idx = indices.long()
    mask.scatter_(-1, torch.where((idx >= 0) & (idx < num_kv_blocks), idx, num_kv_blocks), True)
    mask = mask[..., :num_kv_blocks]
    logical = from_block_mask(mask, q_block, kv_block, mask if partial else None)
    return logical if physical is None else expand(logical, *fine)


def evaluate_mask_mod(mask_mod: Callable, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      device, q_offset: int = 0) -> torch.Tensor:
    """mask_mod(b, h, q_idx, kv_idx) over every pair, with broadcasting index tensors (b as
    (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, Sq, 1) from q_offset on, kv_idx (1, 1, 1, Sk)):
    (B, H, Sq, Sk) bool."""
    idx = lambda n, dim: torch.arange(n, device=device).view([-1 if i == dim else 1 for i in range(4)])
    out = mask_mod(idx(batch, 0), idx(heads, 1), idx(seqlen_q, 2) + q_offset, idx(seqlen_k, 3))
    return _mod_result(out, device, (batch, heads, seqlen_q, seqlen_k))


def _mod_result(out, device, shape: tuple) -> torch.Tensor:
    """A mask_mod's value over broadcasting indices as a (B, H, Sq, Sk) bool tensor, or a
    ValueError naming the mod when it does not broadcast to that shape."""
    out = torch.as_tensor(out, device=device).to(torch.bool)
    try:
        return out.expand(*shape)
    except RuntimeError:
        raise ValueError(f"mask_mod(b, h, q_idx, kv_idx) must broadcast its indices (shapes "
                         f"(B,1,1,1), (1,H,1,1), (1,1,Sq,1), (1,1,1,Sk)) to {shape}; it returned "
                         f"shape {tuple(out.shape)}") from None


# from_mask_mod evaluates this many (query, key) pairs at a time at most (per batch and head
# entry the mod distinguishes): a few block rows of a long sequence per step
MASK_MOD_CHUNK = 1 << 27


def from_mask_mod(mask_mod: Callable, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                  q_block: int, kv_block: int, device=None) -> BlockSparseMask:
    """By evaluating mask_mod over every block: all pairs attended -> full, some -> partial,
    none -> left out. On a GPU in one launch of a kernel the mod is traced into
    (_mask_mod_blocks_kernel); otherwise, or for a mod no kernel can trace, in PyTorch, as many
    query blocks at a time as keep the evaluated pairs within MASK_MOD_CHUNK, so memory stays
    bounded and a long sequence takes a few steps."""
    _check_block_sizes(q_block, kv_block)
    for name, n in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q),
                    ("seqlen_k", seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1; got {n!r}")
    state = _mask_mod_blocks_kernel(mask_mod, batch, heads, seqlen_q, seqlen_k, q_block,
                                    kv_block, device)
    if state is not None:
        attended = state > 0
        return from_block_mask(attended, q_block, kv_block, partial=attended & (state < 2))
    attended, full = mask_mod_blocks_torch(mask_mod, batch, heads, seqlen_q, seqlen_k, q_block,
                                           kv_block, device)
    return from_block_mask(attended, q_block, kv_block, partial=attended & ~full)


def mask_mod_blocks_torch(mask_mod: Callable, batch: int, heads: int, seqlen_q: int,
                          seqlen_k: int, q_block: int, kv_block: int, device=None) -> tuple:
    """from_mask_mod's evaluation in PyTorch (any mod, any device; the kernel's reference):
    booleans (batch, heads, query blocks, key blocks) (some pair attended, every pair)."""
    nq, nk = -(-seqlen_q // q_block), -(-seqlen_k // kv_block)
    pad_k = nk * kv_block - seqlen_k
    step = max(1, MASK_MOD_CHUNK // max(1, batch * heads * q_block * seqlen_k))
    idx = lambda n, dim, start=0: (torch.arange(n, device=device) + start).view(
        [-1 if j == dim else 1 for j in range(4)])
    any_rows, all_rows = [], []
    for first in range(0, nq, step):
        blocks = min(step, nq - first)
        start = first * q_block
        rows = min(blocks * q_block, seqlen_q - start)
        m = _mod_result(mask_mod(idx(batch, 0), idx(heads, 1), idx(rows, 2, start),
                                 idx(seqlen_k, 3)), device, (batch, heads, rows, seqlen_k))
        # rows past the query end and pairs past the key end count as "attended" for all()
        # and not for any()
        pad_q = blocks * q_block - rows
        m_all = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=True)
        m_any = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=False)
        shape = (batch, heads, blocks, q_block, nk, kv_block)
        any_rows.append(m_any.view(shape).any(dim=5).any(dim=3))
        all_rows.append(m_all.view(shape).all(dim=5).all(dim=3))
    return torch.cat(any_rows, dim=2), torch.cat(all_rows, dim=2)


def _mask_mod_blocks_kernel(mask_mod, batch, heads, seqlen_q, seqlen_k, q_block, kv_block,
                            device):
    """from_mask_mod's block states from one kernel launch (kernels/common/mask_blocks.py) on
    a CUDA GPU of sm_80 or later, for a mod that compiles into a kernel; else None (the PyTorch
    evaluation, mask_mod_blocks_torch, then serves)."""
    device = torch.device(device) if device is not None else None
    if (device is None or device.type != "cuda" or seqlen_q <= 0 or seqlen_k <= 0
            or torch.cuda.get_device_capability(device) < (8, 0)):
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from .kernels.launch_common import mask_mod_blocks
    return mask_mod_blocks(mask_mod, batch, heads, seqlen_q, seqlen_k, q_block, kv_block, device)


def expand(mask: BlockSparseMask, q_block: int, kv_block: int) -> BlockSparseMask:
    """The same token pairs at a finer physical block size (each logical block a multiple of the
    physical one): VSA's 256x256 logical mask served by 128x128, 128x64 or 64x64 tiles. The
    lists themselves are expanded, in their order: listed block j becomes fine blocks
    j*rk .. j*rk+rk-1 and each query block's row is repeated for its rq finer rows, so
    _compact's lists (increasing, then the unlisted) stay exactly what _compact of the fine
    masks would give, in a few elementwise kernels over the fine lists (no scan, no scatter)."""
    _check_finer((q_block, kv_block), (mask.q_block, mask.kv_block))
    rq, rk = mask.q_block // q_block, mask.kv_block // kv_block
    steps = torch.arange(rk, dtype=torch.int32, device=mask.full_index.device)

    def fine(count, index):
        index = (index.unsqueeze(-1) * rk + steps).flatten(-2) if rk > 1 else index
        if rq > 1:
            count, index = count.repeat_interleave(rq, 2), index.repeat_interleave(rq, 2)
        return (count * rk if rk > 1 else count), index

    return BlockSparseMask(q_block, kv_block, *fine(mask.full_count, mask.full_index),
                           *fine(mask.partial_count, mask.partial_index))


def _check_block_sizes(q_block: int, kv_block: int) -> None:
    for name, n in (("q_block", q_block), ("kv_block", kv_block)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or n % 16:
            raise ValueError(f"{name} must be a positive multiple of 16; got {n!r}")


def _check_finer(physical: tuple, logical: tuple) -> None:
    """physical (q_block, kv_block) must be valid blocks that divide the logical ones."""
    _check_block_sizes(*physical)
    if logical[0] % physical[0] or logical[1] % physical[1]:
        raise ValueError(f"physical blocks {physical[0]}x{physical[1]} must divide the logical "
                         f"{logical[0]}x{logical[1]}")


def check(mask: BlockSparseMask, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
          device) -> None:
    """The metadata's rules against a call (no sync): int32 tensors on q's device, batch/head
    modes of 1 or the call's, at least the blocks the sequences need (blocks past a sequence's
    end, as an expansion of a coarser mask leaves, hold no token and are ignored)."""
    if not isinstance(mask, BlockSparseMask):
        raise TypeError(f"block_sparse must be a cuteattn.sparse.BlockSparseMask; got {type(mask)}")
    _check_block_sizes(mask.q_block, mask.kv_block)
    nq, nk = -(-seqlen_q // mask.q_block), -(-seqlen_k // mask.kv_block)
    for name in ("full_count", "full_index", "partial_count", "partial_index"):
        if not isinstance(getattr(mask, name), torch.Tensor):
            raise TypeError(f"block_sparse.{name} must be a torch.Tensor; got "
                            f"{type(getattr(mask, name))}")
    for name in ("full_count", "full_index", "partial_count", "partial_index"):
        t = getattr(mask, name)
        if t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"block_sparse.{name} must be int32 on {device}; got {t.dtype} on {t.device}")
        rank = 3 if name.endswith("count") else 4
        want = (nq,) if rank == 3 else (nq, nk)
        if t.dim() != rank or any(got < need for got, need in zip(t.shape[2:], want)) \
                or t.shape[0] not in (1, batch) or t.shape[1] not in (1, heads):
            raise ValueError(f"block_sparse.{name} must have shape (1|{batch}, 1|{heads}, "
                             f"{', '.join(f'>={n}' for n in want)}) for these sequence lengths "
                             f"and blocks of {mask.q_block}x{mask.kv_block}; got {tuple(t.shape)}")
    for kind in ("full", "partial"):  # each count belongs to its list
        count, index = getattr(mask, f"{kind}_count"), getattr(mask, f"{kind}_index")
        if tuple(count.shape) != tuple(index.shape[:3]):
            raise ValueError(f"block_sparse.{kind}_count's shape {tuple(count.shape)} must be "
                             f"{kind}_index's first three modes {tuple(index.shape[:3])}")
    if tuple(mask.full_index.shape) != tuple(mask.partial_index.shape):
        # (the same batch and head modes too: the kernels index both lists with one (b, h),
        # clamped into the full lists' modes)
        raise ValueError(f"block_sparse.full_index and partial_index must have the same shape "
                         f"(batch, head, query blocks, key blocks modes); got "
                         f"{tuple(mask.full_index.shape)} and {tuple(mask.partial_index.shape)}")


def check_values(mask: BlockSparseMask) -> None:
    """The values (a sync; the reference path reads them anyway): counts within [0, nk], listed
    indices within [0, nk), no key block listed twice for one query block (in one list or in
    both)."""
    nk = mask.full_index.shape[-1]
    targets = []
    for kind in ("full", "partial"):
        count, index = getattr(mask, f"{kind}_count"), getattr(mask, f"{kind}_index")
        if bool(((count < 0) | (count > nk)).any()):
            raise ValueError(f"block_sparse.{kind}_count holds a count outside [0, {nk}]")
        listed = torch.arange(nk, device=index.device) < count.unsqueeze(-1).long()
        if bool((listed & ((index < 0) | (index >= nk))).any()):
            raise ValueError(f"block_sparse.{kind}_index lists a key block outside [0, {nk})")
        targets.append(torch.where(listed, index.long(), nk))  # (padding: a spare column)
    shape = torch.broadcast_shapes(*(t.shape for t in targets))
    times = torch.zeros((*shape[:-1], nk + 1), dtype=torch.int32, device=targets[0].device)
    for t in targets:
        times.scatter_add_(-1, t.expand(shape), torch.ones(shape, dtype=torch.int32,
                                                             device=t.device))
    if bool((times[..., :nk] > 1).any()):
        raise ValueError("block_sparse lists a key block more than once for one query block "
                         "(within a list, or as both full and partial): each block once")


def select_batch(mask: BlockSparseMask, b: int) -> BlockSparseMask:
    """Batch b's block lists (the broadcast ones when the batch mode is 1), as a batch of one."""
    pick = lambda t: t[b:b + 1] if t.shape[0] > 1 else t
    return BlockSparseMask(mask.q_block, mask.kv_block, pick(mask.full_count),
                           pick(mask.full_index), pick(mask.partial_count), pick(mask.partial_index))
