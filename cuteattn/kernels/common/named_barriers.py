"""Named barriers (bar.sync / bar.arrive with an id and a thread count).

Barrier 0 is __syncthreads; every other id a kernel uses is a member of that kernel family's
IntEnum, so no raw number appears in a kernel body. The thread count is always a multiple of 32:
a warp arrives as a whole, and these are *aligned* barriers (every lane of a warp executes the
same instruction together). For data handed from one role to another while the writer goes on
(bar.arrive after a write), prefer an mbarrier pipeline: tile_scheduler.TileWalk says why.
"""
import cutlass.cute as cute


def sync(barrier_id, threads: int) -> None:
    """Wait until `threads` threads (this one included) have arrived at `barrier_id`."""
    cute.arch.barrier(barrier_id=int(barrier_id) if isinstance(barrier_id, int) else barrier_id,
                      number_of_threads=threads)


def arrive(barrier_id, threads: int) -> None:
    """Count this thread's warp at `barrier_id` without waiting (a producer's signal)."""
    cute.arch.barrier_arrive(
        barrier_id=int(barrier_id) if isinstance(barrier_id, int) else barrier_id,
        number_of_threads=threads)
