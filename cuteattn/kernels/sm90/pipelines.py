"""Warp-specialised Hopper kernels: TMA pipelines between one producer warp and the consumer
warpgroups, and the register split between them."""
import cutlass.cute as cute
import cutlass.pipeline as pipeline

WG_THREADS = 128  # threads of a warpgroup
WG_ROWS = 64  # rows of one consumer warpgroup's wgmma tile


def make_tma_pipeline(barrier_storage, num_stages: int, tx_bytes: int, consumer_warps: int):
    """A ring of `num_stages` shared-memory stages filled by TMA (one producer thread issues,
    `tx_bytes` land per stage) and released by every consumer warp. The barriers are
    initialised without a sync (the kernel syncs once after all its pipelines exist)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage.data_ptr(), num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes, defer_sync=True)


@cute.jit
def arm_fix_barrier(pipes, state, fix_barrier, nbytes: int) -> None:
    """The producer warp, before a stage's TMA copies that it must fix up before the consumers
    read them (rows past a sequence's end zeroed): waits until the stage is free in each of
    `pipes`, then (re)initialises fix_barrier (one arrival) to expect the copies' `nbytes`.
    The copies then land on fix_barrier; the warp waits on it (phase 0), fixes the stage and
    arrives on each pipe's full barrier itself (no bytes expected there)."""
    for pipe in pipes:
        pipe.sync_object_empty.wait(state.index, state.phase)
    with cute.arch.elect_one():
        cute.arch.mbarrier_init(fix_barrier, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_warp()
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(fix_barrier, nbytes)


def register_split(num_consumer_wg: int, busy_producer: bool) -> tuple:
    """(producer, consumer) registers per thread after setmaxnreg. The producer only issues TMA,
    so registers move to the consumers; ptxas keeps the producer's code within its budget, and
    a producer with more work per tile (the varlen prefix sum: `busy_producer`) spilled at 24.
    setmaxnreg can only redistribute what the CTA was launched with (ptxas caps a thread at
    65536 / threads, rounded down to 8): asking for more makes the consumers' increase wait
    forever (2 consumer warpgroups with a 32-register producer hung), hence the check."""
    producer, consumer = {1: (40, 232) if busy_producer else (24, 240),
                          2: (40, 232) if busy_producer else (24, 240), 3: (32, 160)}[num_consumer_wg]
    threads = WG_THREADS * (1 + num_consumer_wg)
    launch = (65536 // threads) // 8 * 8
    assert WG_THREADS * (producer + num_consumer_wg * consumer) <= launch * threads, \
        "register split exceeds the launch allocation"
    return producer, consumer
