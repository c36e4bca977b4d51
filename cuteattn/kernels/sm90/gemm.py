"""wgmma GEMMs issued without waiting, and the ping-pong turns between consumer warpgroups."""
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from ..common import named_barriers


@cute.jit
def gemm_async(tiled_mma, acc, frag_a, frag_b, zero_init: cutlass.Constexpr):
    """Issues acc (+)= A B over every k block and commits it as one wgmma group; the caller
    waits (warpgroup.wait_group). `zero_init`: the first k block overwrites acc.
    With zero_init, pass a freshly made tiled MMA: its accumulate flag is set here, and a flag
    value made inside one loop may not be reused by the next loop (IR dominance), as it would be
    if one MMA object served the runs of a split key-block loop."""
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
        if cutlass.const_expr(zero_init):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
        cute.gemm(tiled_mma, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
    warpgroup.commit_group()


class PingPong:
    """Consumer warpgroups take turns issuing their GEMMs (FA3's ping-pong), so that one's
    softmax runs under the others' GEMMs. Warpgroup wg waits at barrier `first_barrier + wg` and
    passes the turn to the next; each barrier counts the two warpgroups of one hand-over."""

    def __init__(self, enabled: bool, num_wg: int, first_barrier: int, wg_threads: int = 128):
        self.enabled, self.num_wg = enabled, num_wg
        self.first_barrier, self.threads = int(first_barrier), 2 * wg_threads

    @cute.jit
    def start(self, wg):
        """The first consumer warpgroup takes the first turn."""
        if cutlass.const_expr(self.enabled):
            if wg == 0:
                named_barriers.arrive(self.first_barrier, self.threads)

    def wait(self, wg):
        if cutlass.const_expr(self.enabled):
            named_barriers.sync(self.first_barrier + wg, self.threads)

    def pass_on(self, wg):
        if cutlass.const_expr(self.enabled):
            nxt = wg + 1 if cutlass.const_expr(self.num_wg == 1) else (wg + 1) % self.num_wg
            named_barriers.arrive(self.first_barrier + nxt, self.threads)
