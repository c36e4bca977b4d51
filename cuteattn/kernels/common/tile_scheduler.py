"""Tile orders (which (query block, head, batch) a linear tile index stands for) and the tile
walk every warp role of a persistent CTA shares (`TileWalk`).

Fixed-length batches (`fixed_tile_coord`): causal and windowed tiles go longest first (LPT), in
groups of (batch, head) pairs whose K/V fit in L2 together; other tiles keep the query block
fastest, so one head's tiles run together.

Packed variable-length batches (`varlen_tile_coord`): the grid holds one CTA per query block that can exist: ceil(total_q / tile_m) + batch is an upper
bound on sum_b ceil(len_b / tile_m), known on the host without reading cu_seqlens (no sync). Each
CTA finds its sequence by a prefix sum over the per-sequence block counts, 32 sequences at a time
with one warp's shuffles, so a skewed batch costs no idle CTAs beyond that small slack (which exit
at once) instead of max_seqlen_q x batch tiles.
"""
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from .seqlen_info import sequence_range


@cute.jit
def fixed_tile_coord(tile: Int32, num_m_blocks: Int32, num_heads: Int32, batch: Int32,
                     group_pairs: Int32, small_groups: Int32, unit: Int32,
                     lpt: cutlass.Constexpr):
    """(m_block, head_idx, batch_idx) of tile `tile` in [0, num_m_blocks * num_heads * batch).

    lpt (causal, windowed): tiles differ in cost, so the last query blocks (the most keys) go
    first. Doing that over every (batch, head) at once would run one query block of every head
    together, whose K/V overflow L2 at long sequences (4k tokens, 64 heads: 128 MB), so each
    block re-reads its keys from HBM. The pairs are instead taken in groups sized to fit L2
    (kernels/launch_common.balanced_l2_groups: `small_groups` groups of `group_pairs` pairs, then groups of
    `group_pairs + unit`): within a group the query blocks go from last to first, the pair
    fastest; groups follow each other. Balanced, because a short last group leaves the end of
    the launch to a few long tiles while most CTAs idle (4k tokens, d=256: 32 pairs in groups
    of 6 left 2 pairs, 64 tiles for 132 SMs). Pairs are numbered batch-major, head fastest, so
    GQA heads that share K/V sit together.
    Otherwise: query block fastest, then head, then batch.
    """
    if cutlass.const_expr(lpt):
        small_tiles = small_groups * group_pairs * num_m_blocks
        pairs_here = group_pairs
        first_pair = Int32(0)
        rank = tile
        if tile >= small_tiles:
            pairs_here = group_pairs + unit
            rank = tile - small_tiles
            first_pair = small_groups * group_pairs
        group = rank // (pairs_here * num_m_blocks)
        rank = rank - group * pairs_here * num_m_blocks
        first_pair = first_pair + group * pairs_here
        m_block = num_m_blocks - 1 - rank // pairs_here
        pair = first_pair + rank % pairs_here
    else:
        m_block = tile % num_m_blocks
        pair = tile // num_m_blocks
    return m_block, pair % num_heads, pair // num_heads


def backward_block_coord(heads_interleaved: Int32):
    """(key block, head, batch) of a backward CTA (its block index). Grid x interleaves the key
    blocks of `heads_interleaved` heads (x = key block * heads_interleaved + the head's place in
    its group), grid y the groups of heads, z the batch (packed key blocks: 0). In deterministic
    mode a key block's dQ turns follow the one before it in the same head by a round trip
    chain; interleaving heads launches those neighbours that many CTAs apart, so that they
    start no closer than the chain lets them run (launch_bwd.BwdLaunch.heads_interleaved)."""
    x, y, z = cute.arch.block_idx()
    return x // heads_interleaved, y * heads_interleaved + x % heads_interleaved, z


@cute.jit
def varlen_tile_coord(tile: Int32, mCuSeqlensQ, mSeqUsedQ, batch: Int32, total_q: Int32,
                      tile_m: cutlass.Constexpr, reverse: cutlass.Constexpr):
    """(m_block, batch_idx) of packed tile `tile`; batch_idx == batch when past the last block.
    `reverse` numbers each sequence's blocks from its end (the heavy blocks of a causal mask
    first). Every lane of the warp must call this (warp shuffles)."""
    lane = cute.arch.lane_idx()
    tiles_before = Int32(0)       # blocks of the sequences in earlier chunks
    found_batch = batch
    found_m = Int32(0)
    num_chunks = (batch + 31) // 32
    for chunk in cutlass.range(num_chunks, unroll=1):
        b = chunk * 32 + lane
        n = Int32(0)
        if b < batch:
            # the kernel's clamped length (seqlen_info.py), so both count the same blocks
            n = (sequence_range(b, total_q, mCuSeqlensQ, mSeqUsedQ)[1] + tile_m - 1) // tile_m
        incl = n  # inclusive prefix sum of n over the lanes
        for k in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, offset=1 << k)
            if lane >= (1 << k):
                incl = incl + up
        start = tiles_before + incl - n
        hit = (tile >= start) & (tile < start + n)
        cand_b = batch
        cand_m = Int32(0)
        if hit:
            cand_b = b
            cand_m = tile - start
            if cutlass.const_expr(reverse):
                cand_m = n - 1 - cand_m
        # exactly one lane of one chunk hits (or none past the end): min picks it out
        cand_b = cute.arch.warp_reduction(cand_b, lambda x, y: cutlass.min(x, y))
        cand_m = cute.arch.warp_reduction(cand_m, lambda x, y: cutlass.max(x, y))
        if cand_b < found_batch:
            found_batch = cand_b
            found_m = cand_m
        tiles_before = tiles_before + cute.arch.shuffle_sync(incl, offset=31)
    # every lane holds the same values (warp reductions); saying so lets ptxas keep what is
    # derived from them (loop bounds, pipeline stages, wgmma descriptors) in uniform registers
    return cute.arch.make_warp_uniform(found_m), cute.arch.make_warp_uniform(found_batch)


@dataclass(frozen=True)
class TileWalk:
    """The linear tiles one CTA of a persistent grid visits, the same sequence for every warp
    role, so that their pipeline states stay in step across tiles.

    Round robin (`counter` None): tiles blockIdx.x, + gridDim.x, ...: no communication, for
    tiles of equal cost. Dynamic: the first tile is blockIdx.x and each next one is drawn from a
    global counter by the producer warp as soon as it has issued this tile's loads, then handed
    to the consumers through a shared-memory slot guarded by an mbarrier pipeline (`handoff`:
    full = the slot holds the next tile, empty = every consumer thread has read it). A CTA that
    drew short tiles draws more of them. The last CTA to run out zeroes the counter for the next
    launch (kernel boundaries order that for the stream).
    Why mbarriers, not a pair of named barriers (bar.sync / bar.arrive): the writer's own
    mbarrier arrive releases its slot write to the waiting readers, in the PTX memory model and
    in compute-sanitizer's racecheck alike; with named barriers racecheck reported the slot's
    write and read as a race on every varlen call whose consumers wait for the next tile at once
    (the packed grid's spare tiles), which would hide real races in its reports.
    """
    num_tiles: Int32
    counter: Optional[cute.Tensor]       # int32 (2,): [tiles drawn, CTAs done]
    slot: Optional[cute.Tensor]          # shared int32 (1,): the hand-off slot
    handoff: Optional[pipeline.PipelineAsync]  # producer warp -> every consumer thread

    @staticmethod
    def make_handoff(barrier_storage, consumer_threads: int) -> pipeline.PipelineAsync:
        """The slot's pipeline: one stage, filled by the producer warp's 32 threads (lane 0
        writes) and emptied by `consumer_threads` threads. Initialised without a sync (the
        kernel syncs once after all its pipelines exist)."""
        return pipeline.PipelineAsync.create(
            barrier_storage=barrier_storage.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
            defer_sync=True)

    @cute.jit
    def walk(self, producer: cutlass.Constexpr, tile_info: cutlass.Constexpr,
             visit: cutlass.Constexpr, q_state, kv_state):
        """For each of this CTA's tiles, in the role of the producer warp or of a consumer:
        tile_info(tile) -> (m_block, head_idx, batch_idx, in_range, seqlen), and for a tile in
        range visit(m_block, head_idx, batch_idx, seqlen, q_state, kv_state) -> (q_state,
        kv_state). Every role skips the same tiles. Returns the final states."""
        role = pipeline.PipelineUserType.Producer if producer else pipeline.PipelineUserType.Consumer
        slot_state = pipeline.make_pipeline_state(role, 1)
        tile = cute.arch.block_idx()[0]
        while tile < self.num_tiles:
            m_block, head_idx, batch_idx, in_range, seqlen = tile_info(tile)
            if in_range:
                q_state, kv_state = visit(m_block, head_idx, batch_idx, seqlen, q_state, kv_state)
            if cutlass.const_expr(self.counter is None):
                tile = tile + cute.arch.grid_dim()[0]
            elif cutlass.const_expr(producer):
                tile = self._draw_and_hand_off(slot_state)
                slot_state.advance()
            else:
                tile = self._take(slot_state)
                slot_state.advance()
        return q_state, kv_state

    @cute.jit
    def _draw_and_hand_off(self, slot_state) -> Int32:
        lane = cute.arch.lane_idx()
        ctas = cute.arch.grid_dim()[0]
        drawn = Int32(0)
        if lane == 0:
            drawn = cute.arch.atomic_add(self.counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        nxt = cute.arch.shuffle_sync(drawn, 0) + ctas  # the first tiles were blockIdx.x
        if nxt >= self.num_tiles:
            if lane == 0:
                # this CTA's draws are over; the last CTA to get here resets the counter
                cute.arch.fence_acq_rel_gpu()
                done = cute.arch.atomic_add(self.counter.iterator + 1, Int32(1), sem="acq_rel",
                                            scope="gpu")
                if done == ctas - 1:
                    self.counter[0] = Int32(0)
                    self.counter[1] = Int32(0)
        self.handoff.producer_acquire(slot_state)
        if lane == 0:
            self.slot[0] = nxt
        # each lane arrives; the stage is full once all 32 have, lane 0 after its write
        self.handoff.producer_commit(slot_state)
        return nxt

    @cute.jit
    def _take(self, slot_state) -> Int32:
        self.handoff.consumer_wait(slot_state)
        # (one slot read by every thread: the same tile in every lane; told to ptxas as in
        # varlen_tile_coord, without it a packed forward's descriptors cost ~100 instructions
        # a key block)
        nxt = cute.arch.make_warp_uniform(self.slot[0])
        self.handoff.consumer_release(slot_state)
        return nxt
