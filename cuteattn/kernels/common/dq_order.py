"""Deterministic dQ: the key blocks of a (batch, head) add their float32 shares into a query
block one after the other, in key-block order, through a semaphore per query block (both
backward kernels' deterministic mode). The CTAs of lower key blocks are launched first (grid x is
the key block, fastest), so waiting on them cannot deadlock; a bounded spin guards anyway.

Descending turns (under a causal or windowed mask): a query block's key blocks add from the
last down, and the grid launches a sequence's key blocks from its last (`launch_order_block`),
so again a block waits only on blocks launched before it. Key block n meets its first query
block on the diagonal, where it is the last key block, so its walk starts without a wait; in
ascending order every key block's turn there came after all lower ones, and the walk became a
staircase (the sm90 deterministic causal backward ran at 0.42-0.55x of the plain one).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .global_atomics import ld_acquire, red_release
from .seqlen_info import SeqlenInfo

SPIN_LIMIT = 1 << 22


@cute.jit
def semaphore_slot(mSemaphore: cute.Tensor, seqlen: SeqlenInfo, m_block, batch_idx, rows_q,
                   tile_m: cutlass.Constexpr, varlen_q: cutlass.Constexpr):
    """The semaphore of query block m_block of this sequence: batch-major blocks for fixed
    lengths (rows_q: the fixed length); for packed ones offset_q // tile_m + batch_idx +
    m_block, distinct across sequences whose rows do not overlap. Clamped into the tensor."""
    slot = batch_idx * ((rows_q + tile_m - 1) // tile_m) + m_block
    if cutlass.const_expr(varlen_q):
        slot = seqlen.offset_q // tile_m + batch_idx + m_block
    return cutlass.min(slot, mSemaphore.shape[1] - 1)


def launch_order_block(grid_block, seqlen_k, tile_n: int, descending: bool):
    """The key block of grid block `grid_block` (fixed-length layouts; packed keys number their
    blocks in tile_scheduler.varlen_tile_coord, `reverse` there): with descending turns the
    sequence's last comes first. Decide whether the grid block is in range before this."""
    if cutlass.const_expr(descending):
        return (seqlen_k + tile_n - 1) // tile_n - 1 - grid_block
    return grid_block


def key_block_turn(block_info, seqlen: SeqlenInfo, m_block, n_block, descending: bool):
    """How many key blocks add into query block m_block before key block n_block does: those
    below it (ascending) or above it (descending) among the consecutive key blocks that see it
    (BlockInfo.first_key_block / last_key_block)."""
    if cutlass.const_expr(descending):
        return block_info.last_key_block(seqlen.seqlen_q, seqlen.seqlen_k, m_block) - n_block
    return n_block - block_info.first_key_block(seqlen.seqlen_q, seqlen.seqlen_k, m_block)


@cute.jit
def in_turn(ptr, turn, leader, wait_all, done_all, add):
    """Runs `add` (this thread's additions; None for a thread without any) once the semaphore at
    `ptr` counts `turn` earlier key blocks, then counts this one: the `leader` thread polls and
    signals, `wait_all` / `done_all` are the barriers of every thread that adds."""
    if leader:
        seen = ld_acquire(ptr)
        polls = Int32(0)
        while (seen != turn) & (polls < SPIN_LIMIT):
            seen = ld_acquire(ptr)
            polls = polls + 1
    wait_all()
    if cutlass.const_expr(add is not None):
        add()
    cute.arch.fence_acq_rel_gpu()
    done_all()
    if leader:
        red_release(ptr, Int32(1))
