"""Deterministic dQ: the key blocks of a (batch, head) add their float32 shares into a query
block one after the other, in key-block order, through a semaphore per query block (both
backward kernels' deterministic mode). The CTAs of lower key blocks are launched first (grid x is
the key block, fastest), so waiting on them cannot deadlock; a bounded spin guards anyway. (The
sm90 kernel under a causal or windowed mask takes the key blocks in descending order and
launches them from the last: `Sm90BwdConfig.descending_turns`.)
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
