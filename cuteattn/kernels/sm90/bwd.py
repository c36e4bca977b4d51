"""Hopper (sm_90a) attention backward: dQ, dK, dV from Q, K, V, dO, the forward's LSE and
D = rowsum(dO * O) (the preprocess, launch_bwd.py).

A CTA owns one block of `tile_n` keys of one (batch, query head) and walks the query blocks that
see it (`tile_m` rows each), so dK and dV stay in registers for the whole walk and are written
once; dQ gets a share from every key block and is accumulated in float32 in global memory.
In each CTA:
  - warpgroup 0 is the producer: one warp loads K and V once, then Q, dO and the block's LSE and
    D rows of each query block into a `num_stages`-deep ring (TMA, mbarrier pipelines);
  - warpgroups 1 and 2 are consumers, each owning 64 of the keys. Per query block, each
    recomputes its scores transposed, S^T = K Q^T (keys as the wgmma M mode, FA3's "swapAB"), so
    that P^T and dS^T land in registers already shaped as the A operand of dV += P^T dO and
    dK += dS^T Q (register-A wgmma: P and dS never go through shared memory for these two):
        S^T = K Q^T,  P^T = exp2(S^T * scale_log2 - lse_log2),  dP^T = V dO^T,
        dS^T = P^T * (dP^T - D),  dV += P^T dO,  dK += dS^T Q,  dQ = dS K.
    dQ needs dS with the queries as rows, so dS^T is also written to shared memory (a double
    buffer, so one barrier per block suffices) and both warpgroups compute half of dQ's columns
    (or warpgroup 0 all of them: `dq_single_wg`; or, in 128-row query steps, 64 of the rows
    each: `dq_split_rows`) from it and K, then add their float32 share to the dQ accumulator:
    staged in shared memory and added by one TMA reduce-add a warpgroup (`dq_tma`, FA3's
    way; issued by the producer warpgroup's second warp, the dQ writer, `dq_writer`), or where
    that does not fit with vector reductions (red.global.add.v2.f32).
Head dims over 128 (`split_d`): dK and dV of 64 keys each would need 2d float32 registers a
thread, so a CTA owns 64 keys, which both warpgroups share: each computes S^T and dP^T for half
of the block's queries, writes P^T and dS^T to shared memory, and after one barrier takes half
of the head dim's columns of dV += P^T dO, dK += dS^T Q (A operands from shared memory) and of
dQ = dS K. At d=256 that is 64 + 64 accumulator registers of dK and dV a thread.
Deterministic mode (and plain d=256 without a mask, where it measured faster) orders those
additions: the key blocks of a (batch, head) add into a query block one after the other, in
key-block order, through a semaphore per query block (the CTAs
of lower key blocks are launched first, so waiting on them cannot deadlock). With dQ by TMA the
wait is not the consumers': the producer warpgroup's second warp (the dQ writer) takes each
staged share, waits for the turn, issues the reduce-add, frees the box once it is read and
passes the turn once it is complete, while the consumers go on to the next query block.

softmax_scale is applied once at the end (dK) and per block to the dQ share; softcap multiplies
dS by its derivative (common/score_mod.softcap_grad's rule, the scale applied later). Masks are
FlashAttention's (bottom-right causal, sliding window), applied element-wise only on blocks that
cross an edge.
"""
import enum
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import dq_blocks, epilogue, named_barriers
from ..common.block_info import BlockInfo, DenseRows
from ..common.block_sparse import SparseBlocks, SparseRows
from ..common.convert import convert_fragment
from ..common.dq_order import in_turn, key_block_turn, launch_order_block, semaphore_slot
from ..common.global_atomics import red_add_f32x2
from ..common.layout import acc_mn_view, acc_to_a_operand_layout, lse_seq_major, seq_major
from ..common.mask import apply_mask_transposed
from ..common.one_key import gradient_scale, per_sequence
from ..common.mods import KernelMod, apply_mask_mod, traced, value_and_grad
from ..common.score_mod import softcap_scores
from ..common.seqlen_info import SeqlenInfo
from ..common.tile_scheduler import backward_block_coord, varlen_tile_coord
from .gemm import gemm_async
from .pipelines import WG_ROWS, WG_THREADS, arm_fix_barrier, make_tma_pipeline, register_split

NUM_CONSUMER_WG = 2
# A deterministic wait gives up after this many polls (seconds of spinning): metadata that lies
# (overlapping packed sequences) can make two key blocks share a semaphore, and a wrong order of
# additions is better than a hang.


class BwdBarrier(enum.IntEnum):
    """Named barriers of the backward (0 is __syncthreads)."""
    DS_READY = 1   # both consumer warpgroups wrote their dS^T rows (dQ GEMM may read them)
    KV_FREE = 2    # both are past their last dQ GEMM (K's buffer may stage dK)
    DQ_ORDER = 3   # deterministic: the turn of this key block to add into a query block
    DQ_DONE = 4    # deterministic: every consumer's additions are issued and fenced
    DQ_STAGED = 5  # (dq_tma; + the warpgroup) its dQ share is in shared memory for the TMA
                   # (dq_writer: one barrier, the consumers' shares for the writer warp)
    DQ_FREE = 7    # (dq_writer) the last reduce-add has read the boxes: they may be rewritten


@dataclass(frozen=True)
class Sm90BwdConfig:
    """The static configuration of one compiled backward kernel (the compile key)."""
    dtype: type                  # cutlass.BFloat16 or cutlass.Float16
    head_dim: int
    tile_m: int = 64             # query rows per step
    tile_n: int = 128            # keys per CTA, 64 per consumer warpgroup
    num_stages: int = 2          # depth of the Q/dO ring
    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_q: bool = False
    has_seqused_k: bool = False
    deterministic: bool = False
    dq_single_wg: bool = False   # warpgroup 0 computes all of dQ (d=96: halves would be 48 wide)
    # block-sparse: the query block of the transposed lists (a key block, tile_n keys, visits
    # the query blocks they name, each as sparse_q_block // tile_m steps); 0: dense
    sparse_q_block: int = 0
    # block-sparse lists of 64-key blocks: a key block (two of them) walks their union
    # (sparse.transpose_paired), each warpgroup (64 keys) leaving out the query blocks its own
    # 64-key block does not attend
    sparse_kv_half: bool = False
    # FlexAttention's mask_mod traced in (common/mods.py), as the forward applies it: every
    # step of a dense key block, the partial query blocks of a block-sparse one
    mask_mod: Optional[KernelMod] = None
    # FlexAttention's score_mod traced in with its derivative (common/mods.Dual): the scores
    # become mod(s * softmax_scale) as in the forward, dS is multiplied by d mod / d score
    score_mod: Optional[KernelMod] = None
    # head dims over 128 (dK and dV of 64 keys by d in float32 would be 2d registers a thread
    # if each warpgroup owned its keys): a key block of 64, which both warpgroups share. They
    # split the head dim for dK, dV and dQ (d / 2 columns each: 64 + 64 accumulator registers
    # at d=256) and the queries for S^T and dP^T (tile_m / 2 each); P^T and dS^T go through
    # shared memory (the dK / dV GEMMs need every query of the block as their K mode).
    split_d: bool = False
    # dQ's GEMM issued before dK's, and dQ's additions made while dK's GEMM runs
    dq_before_dk: bool = False
    # dQ's share staged in shared memory (float32) and added by one TMA reduce-add a
    # warpgroup (FlashAttention-3's way), instead of 16 vector reductions a thread: the profile
    # has the consumers waiting on the load/store unit to take those. Rows past the sequence
    # are 0 there (their P is masked), so the tile is added whole.
    dq_tma: bool = False
    # (dq_tma) the reduce-adds issued by a warp of the producer warpgroup, not by the consumers:
    # it waits for the staged shares, issues, and frees the boxes once read (a consumer warp
    # that issued waited for its warpgroup to stage first: 1.00-1.10x without it). In
    # deterministic mode it also takes the turns: in the consumers a turn cost a semaphore
    # poll, the reduce-add's completion and a release, each a round trip to L2, every query
    # block (0.49-0.77x of the plain backward that way); the writer overlaps them with the next
    # block.
    dq_writer: bool = False
    # a learnable sink joins every row's softmax denominator (the forward's LSE holds it): a
    # sequence of one key then has dQ and dK, which common/one_key.gradient_scale would zero
    has_sink: bool = False

    @property
    def sparse(self) -> bool:
        return self.sparse_q_block > 0

    @property
    def prefetch_lse(self) -> bool:
        """The thread's LSE rows read from shared memory into registers right after the S^T
        GEMM is issued, not where the exponentials use them after its wait (ncu had 6% of
        d=128's stall samples on the first exponential's FFMA waiting for its LSE load):
        0.997-1.022x at d=128. Not in 128-row query steps (d=64), which spill 20-32 bytes with
        it, nor with packed sequences (48-84 bytes at d=128) or a mod (a prefix-LM mask_mod
        spilled), nor with block-sparse lists (not timed with it); D's rows too spilled 12-28
        bytes at d=128."""
        return self.tile_m == 64 and not (self.varlen_q or self.varlen_k or self.sparse
                                          or self.mask_mod is not None
                                          or self.score_mod is not None)

    @property
    def interleaves_heads(self) -> bool:
        """Deterministic turns in key-block order: the launch may interleave the key blocks of
        several heads in the grid (launch_bwd.BwdLaunch.heads_interleaved; 1 for the others)."""
        return self.deterministic and not self.descending_turns and not self.sparse

    @property
    def dq_split_rows(self) -> bool:
        """Query steps of 128 rows: the warpgroups split dQ by rows (64 each, every column)."""
        return self.tile_m > WG_ROWS

    @property
    def dq_cols(self) -> int:
        """dQ columns per warpgroup that computes them."""
        if self.dq_single_wg or self.dq_split_rows:
            return self.head_dim
        return self.head_dim // NUM_CONSUMER_WG

    @property
    def dq_atoms(self) -> tuple:
        """The dQ GEMM's warpgroups: along the rows (dq_split_rows) or the columns."""
        return (self.dq_wgs, 1, 1) if self.dq_split_rows else (1, self.dq_wgs, 1)

    @property
    def dq_box(self) -> tuple:
        """(rows, cols) of one warpgroup's share of dQ (dq_tma: one TMA box)."""
        return (WG_ROWS if self.dq_split_rows else self.tile_m, self.dq_cols)

    @property
    def descending_turns(self) -> bool:
        """Deterministic dQ under a causal or windowed mask: a query block's key blocks add in
        descending order, and the grid launches a sequence's key blocks from the last. Key
        block n reaches a query block m_min(n) steps into its walk, which comes later for
        higher n; in ascending order every key block waited for block 0 to arrive last (the
        deterministic causal backward ran at 0.42-0.55x of the plain one). A block waits only
        on higher key blocks, which launch first, so the wait cannot deadlock."""
        return self.deterministic and (self.causal or self.local) and not self.sparse

    @property
    def wg_keys(self) -> int:
        """Keys of the block each consumer warpgroup covers (split_d: all of them)."""
        return self.tile_n if self.split_d else WG_ROWS

    @property
    def dq_wgs(self) -> int:
        """Consumer warpgroups that compute dQ."""
        return 1 if self.dq_single_wg else NUM_CONSUMER_WG

    def smem_bytes(self) -> int:
        elem = self.dtype.width // 8
        qdo = 2 * self.num_stages * self.tile_m * self.head_dim
        kv = 2 * self.tile_n * self.head_dim
        ds = 2 * self.tile_m * self.tile_n * (2 if self.split_d else 1)  # (and P^T)
        rows = 2 * self.num_stages * self.tile_m * 4  # LSE and D
        dq = self.tile_m * self.head_dim * 4 if self.dq_tma else 0
        return (qdo + kv + ds) * elem + rows + dq + 1024


def _k_major_layout(dtype, rows: int, cols: int, stages: int, major: int):
    """A swizzled (rows, cols[, stages]) shared-memory layout with cols contiguous, whose
    swizzle atom is at most `major` columns wide: a buffer read both as a K-major operand and,
    transposed, as an MN-major one sliced into `major`-wide pieces needs atoms that fit a piece."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))


def _transposed(storage_field, layout):
    """The buffer with its first two modes swapped (a view: same bytes, same swizzle)."""
    modes = [1, 0] + list(range(2, cute.rank(layout.outer)))
    return storage_field.get_tensor(cute.select(layout.outer, mode=modes), swizzle=layout.inner)


class FlashBwdSm90:
    def __init__(self, cfg: Sm90BwdConfig, mask_mod_fn=None, score_mod_fn=None):
        """mask_mod_fn / score_mod_fn: the functions cfg.mask_mod and cfg.score_mod key (traced
        with the kernel's indices)."""
        assert (cfg.mask_mod is None) == (mask_mod_fn is None)
        assert (cfg.score_mod is None) == (score_mod_fn is None)
        assert not (cfg.mask_mod is not None and cfg.sparse_kv_half)
        assert not (cfg.score_mod is not None and cfg.has_softcap)
        self.mask_mod_fn, self.score_mod_fn = mask_mod_fn, score_mod_fn
        assert cfg.tile_n == (WG_ROWS if cfg.split_d else NUM_CONSUMER_WG * WG_ROWS)
        assert not (cfg.split_d and (cfg.dq_single_wg or cfg.sparse or cfg.mask_mod is not None
                                     or cfg.score_mod is not None))
        assert cfg.head_dim % 16 == 0 and cfg.tile_m % 16 == 0
        # (deterministic dQ by TMA: the turns are the writer warp's, the reduce-adds being async)
        assert cfg.dq_tma or not cfg.dq_writer
        assert not (cfg.deterministic and cfg.dq_tma and not cfg.dq_writer)
        self.cfg = cfg
        self.dtype = cfg.dtype
        self.tile_m, self.tile_n, self.d = cfg.tile_m, cfg.tile_n, cfg.head_dim
        self.num_threads = WG_THREADS * (1 + NUM_CONSUMER_WG)
        # (dq_writer) the consumers that stage dQ and the writer warp, at DQ_STAGED / DQ_FREE
        self.dq_writer_threads = cfg.dq_wgs * WG_THREADS + 32
        self.consumer_threads = WG_THREADS * NUM_CONSUMER_WG
        # producer 24, consumers 240 (24 + 2 * 240 = 504, what a 384-thread CTA holds); packed
        # sequences with dQ by reductions take 40 / 232 (pipelines.register_split), those with
        # dQ by TMA need the consumers' 240 (at 232 d=128 spilled 60 bytes) and compile
        # spill-free at 24
        self.producer_regs, self.consumer_regs = register_split(
            NUM_CONSUMER_WG, busy_producer=(cfg.varlen_q or cfg.varlen_k) and not cfg.dq_tma)

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    def make_sdp(self):
        """S^T = K Q^T and dP^T = V dO^T: M = keys (one warpgroup per 64), N = queries; with
        split_d, M = the block's 64 keys and N split between the warpgroups."""
        K = cute.nvgpu.OperandMajorMode.K
        if const_expr(self.cfg.split_d):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K, K, Float32, (1, NUM_CONSUMER_WG, 1),
                (WG_ROWS, self.tile_m // NUM_CONSUMER_WG))
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K, K, Float32,
                                                 (NUM_CONSUMER_WG, 1, 1), (WG_ROWS, self.tile_m))

    def tiled_mmas(self):
        dt, K, MN = self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        sdp = self.make_sdp()
        # dV += P^T dO, dK += dS^T Q: M = keys, N = d, K = queries; A from registers (split_d:
        # from shared memory, P^T and dS^T read transposed out of (query, key) buffers, and N
        # split between the warpgroups).
        if const_expr(self.cfg.split_d):
            dkv = sm90_utils.make_trivial_tiled_mma(dt, dt, MN, MN, Float32, (1, NUM_CONSUMER_WG, 1),
                                                    (WG_ROWS, self.d // NUM_CONSUMER_WG))
        else:
            dkv = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, (NUM_CONSUMER_WG, 1, 1),
                                                    (WG_ROWS, self.d), warpgroup.OperandSource.RMEM)
        # dQ = dS K: M = queries, N = d (split between the warpgroups, or all in warpgroup 0).
        dq = sm90_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, self.cfg.dq_atoms,
                                               self.cfg.dq_box)
        return sdp, dkv, dq

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,      # (b, s_q, h, d) or (total_q, h, d) when varlen_q
        mK: cute.Tensor,      # (b, s_k, h_k, d) or (total_k, h_k, d) when varlen_k
        mV: cute.Tensor,      # like mK
        mdO: cute.Tensor,     # like mQ
        mLSE2: cute.Tensor,   # (b, h, s_q) or (h, total_q) float32: LSE * log2(e), +inf if empty
                              # (TMA-loaded: the row mode padded to a multiple of 4)
        mD: cute.Tensor,      # like mLSE2: rowsum(dO * O)
        mdQacc: cute.Tensor,  # like mQ, float32, zeroed: dQ accumulates here (scaled)
        mdK: cute.Tensor,     # like mK but with h heads (per query head; summed for GQA)
        mdV: cute.Tensor,     # like mdK
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: cute.Tensor,   # int32 (h, slots), zeroed (deterministic only)
        mFullCount: Optional[cute.Tensor],     # block-sparse (cfg.sparse): the transposed lists,
        mFullIndex: Optional[cute.Tensor],     # per key block the query blocks that see it
        mPartialCount: Optional[cute.Tensor],  # (common/arguments.SparseMetadata)
        mPartialIndex: Optional[cute.Tensor],
        mKeyHalves: Optional[cute.Tensor],     # int32 (B|1, H|1, nk64, nq) (sparse_kv_half)
        mDqTurns: Optional[cute.Tensor],       # int32 (B|1, H|1, nq, nk) (sparse, deterministic)
        mModTensor0: Optional[cute.Tensor],    # the tensors cfg.mask_mod reads
        mModTensor1: Optional[cute.Tensor],
        mModTensor2: Optional[cute.Tensor],    # the tensors cfg.score_mod reads
        mModTensor3: Optional[cute.Tensor],
        qhead_per_kvhead: Int32,
        softmax_scale: Float32,
        score_scale: Float32,      # multiplies raw scores (softmax_scale, or scale / softcap)
        softmax_scale_log2: Float32,  # log2(e) * (softmax_scale, or softcap)
        window_left: Int32,
        window_right: Int32,
        num_n_blocks: Int32,       # grid x: key blocks (per sequence, or packed bound)
        heads_interleaved: Int32,  # (tile_scheduler.backward_block_coord)
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        mQ, mdO, mdQacc = (seq_major(t, cfg.varlen_q) for t in (mQ, mdO, mdQacc))
        mK, mV, mdK, mdV = (seq_major(t, cfg.varlen_k) for t in (mK, mV, mdK, mdV))
        mLSE2, mD = lse_seq_major(mLSE2, cfg.varlen_q), lse_seq_major(mD, cfg.varlen_q)

        sdp, dkv, dq = self.tiled_mmas()
        dt = self.dtype
        # (split_d: Q, dO and V are also read, or written, in halves of the head dim)
        half_or_all = self.d // NUM_CONSUMER_WG if const_expr(cfg.split_d) else self.d
        sQ_layout = _k_major_layout(dt, self.tile_m, self.d, cfg.num_stages, half_or_all)
        sK_layout = _k_major_layout(dt, self.tile_n, self.d, None, cfg.dq_cols)
        sV_layout = _k_major_layout(dt, self.tile_n, self.d, None, half_or_all)
        sdS_layout = _k_major_layout(dt, self.tile_m, self.tile_n, 2, WG_ROWS)

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        stage = lambda layout: cute.slice_(layout, (None, None, 0))
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(tma_load, mQ, stage(sQ_layout), (self.tile_m, self.d))
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(tma_load, mdO, stage(sQ_layout), (self.tile_m, self.d))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(tma_load, mK, sK_layout, (self.tile_n, self.d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(tma_load, mV, sV_layout, (self.tile_n, self.d))
        # LSE and D of a query block travel with its Q and dO (1-D TMA tiles of tile_m rows)
        sRow_layout = cute.make_layout((self.tile_m, cfg.num_stages))
        row_stage = cute.slice_(sRow_layout, (None, 0))
        tma_atom_lse, tma_lse = cpasync.make_tiled_tma_atom(tma_load, mLSE2, row_stage, (self.tile_m,))
        tma_atom_dsum, tma_dsum = cpasync.make_tiled_tma_atom(tma_load, mD, row_stage, (self.tile_m,))
        dq_store = None
        if const_expr(cfg.dq_tma):
            # each dQ warpgroup's float32 share (cfg.dq_box), a box of the TMA reduce-add
            sdQ_layout = _k_major_layout(Float32, *cfg.dq_box, cfg.dq_wgs, cfg.dq_cols)
            tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, stage(sdQ_layout), cfg.dq_box)
            dq_store = (tma_atom_dq, tma_dq, sdQ_layout)
        self.q_bytes = cute.size_in_bytes(dt, stage(sQ_layout)) + self.tile_m * 4
        self.kv_bytes = 2 * cute.size_in_bytes(dt, sK_layout)
        self.shared_storage = self.shared_storage_type(
            sQ_layout, sK_layout, sV_layout, sdS_layout, sRow_layout,
            dq_store[2] if const_expr(cfg.dq_tma) else None)

        num_heads = mQ.shape[2]
        if const_expr(cfg.varlen_q):
            batch = mCuSeqlensQ.shape[0] - 1
        else:
            batch = mQ.shape[3]
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_lse, tma_lse, tma_atom_dsum, tma_dsum, mdQacc, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
            mSemaphore, mFullCount, mFullIndex, mPartialCount, mPartialIndex, mKeyHalves, mDqTurns,
            (mModTensor0, mModTensor1, mModTensor2, mModTensor3),
            mQ.shape[0], mK.shape[0], qhead_per_kvhead, batch,
            softmax_scale, score_scale, softmax_scale_log2, window_left, window_right,
            heads_interleaved, sdp, dkv, dq, sQ_layout, sK_layout, sV_layout, sdS_layout, sRow_layout, dq_store,
        ).launch(
            grid=[num_n_blocks * heads_interleaved, num_heads // heads_interleaved,
                  1 if const_expr(cfg.varlen_k) else batch],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def shared_storage_type(self, sQ_layout, sK_layout, sV_layout, sdS_layout, sRow_layout,
                            sdQ_layout=None):
        stages = self.cfg.num_stages
        q_elems, k_elems, ds_elems = (cute.cosize(x) for x in (sQ_layout, sK_layout, sdS_layout))
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_do": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_kv": cute.struct.MemRange[cutlass.Int64, 2],
            # (seqused) a block with rows past the sequence's lands here first, is zeroed past
            # them, then published on its pipeline's barrier (load_zeroing_rows_past)
            "mbar_fix": cute.struct.MemRange[cutlass.Int64, 1],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024],
            "sdO": cute.struct.Align[cute.struct.MemRange[self.dtype, q_elems], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, k_elems], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, k_elems], 1024],
            "sdS": cute.struct.Align[cute.struct.MemRange[self.dtype, ds_elems], 1024],
            "sLSE2": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128],
            "sD": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128],
        }
        if sdQ_layout is not None:  # dQ's float32 shares for the TMA reduce-add (dq_tma)
            fields["sdQ"] = cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
        if self.cfg.split_d:  # P^T, laid out as dS^T (a (query, key) buffer read transposed)
            fields["sP"] = cute.struct.Align[cute.struct.MemRange[self.dtype, ds_elems], 1024]
        return cute.struct(type("BwdSharedStorage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_atom_do: cute.CopyAtom, mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom, mV: cute.Tensor,
        tma_atom_lse: cute.CopyAtom, mLSE2: cute.Tensor,
        tma_atom_dsum: cute.CopyAtom, mD: cute.Tensor, mdQacc: cute.Tensor,
        mdK: cute.Tensor, mdV: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: cute.Tensor,
        mFullCount: Optional[cute.Tensor], mFullIndex: Optional[cute.Tensor],
        mPartialCount: Optional[cute.Tensor], mPartialIndex: Optional[cute.Tensor],
        mKeyHalves: Optional[cute.Tensor], mDqTurns: Optional[cute.Tensor], mod_tensors: tuple,
        rows_q: Int32, rows_k: Int32, qhead_per_kvhead: Int32, batch: Int32,
        softmax_scale: Float32, score_scale: Float32, softmax_scale_log2: Float32,
        window_left: Int32, window_right: Int32, heads_interleaved: Int32,
        sdp: cute.TiledMma, dkv: cute.TiledMma, dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout, sRow_layout: cute.Layout,
        dq_store: Optional[tuple],
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_lse, tma_atom_dsum):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.dq_tma):
                cpasync.prefetch_descriptor(dq_store[0])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        consumer_warps = 4 * NUM_CONSUMER_WG
        pipeline_q = make_tma_pipeline(storage.mbar_q, cfg.num_stages, self.q_bytes, consumer_warps)
        pipeline_do = make_tma_pipeline(storage.mbar_do, cfg.num_stages, self.q_bytes, consumer_warps)
        pipeline_kv = make_tma_pipeline(storage.mbar_kv, 1, self.kv_bytes, consumer_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE2, sD = storage.sLSE2.get_tensor(sRow_layout), storage.sD.get_tensor(sRow_layout)
        views = (sQ, sdO, sK, sV, sdS, _transposed(storage.sQ, sQ_layout),
                 _transposed(storage.sdO, sQ_layout), _transposed(storage.sK, sK_layout),
                 _transposed(storage.sdS, sdS_layout),
                 _transposed(storage.sP, sdS_layout) if const_expr(cfg.split_d) else None)
        sdQ = None
        if const_expr(cfg.dq_tma):
            sdQ = storage.sdQ.get_tensor(dq_store[2].outer, swizzle=dq_store[2].inner)

        # Which key block, head and batch this CTA owns (the heads interleaved only where the
        # launch may interleave them: the decode's registers cost spills elsewhere)
        n_block, head_idx, batch_idx = cute.arch.block_idx()
        if const_expr(cfg.interleaves_heads):
            n_block, head_idx, batch_idx = backward_block_coord(heads_interleaved)
        in_range = True
        if const_expr(cfg.varlen_k):
            n_block, batch_idx = varlen_tile_coord(n_block, mCuSeqlensK, mSeqUsedK, batch, rows_k,
                                                   self.tile_n, cfg.descending_turns)
            in_range = batch_idx < batch
            batch_idx = cutlass.min(batch_idx, batch - 1)
        seqlen = SeqlenInfo.create(batch_idx, rows_q, rows_k,
                                   mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        in_range = in_range & (n_block * self.tile_n < seqlen.seqlen_k)
        if const_expr(not cfg.varlen_k):  # (packed: varlen_tile_coord numbers them)
            n_block = launch_order_block(n_block, seqlen.seqlen_k, self.tile_n,
                                         cfg.descending_turns)
        block_info = BlockInfo(self.tile_m, self.tile_n, cfg.causal, cfg.local,
                               window_left, window_right)
        m_min, m_max = block_info.m_block_range(seqlen.seqlen_q, seqlen.seqlen_k, n_block)
        # the query steps this key block visits
        rows = DenseRows(m_min, m_max)
        if const_expr(cfg.sparse):
            rows = SparseRows(SparseBlocks.create(
                mFullCount, mFullIndex, mPartialCount, mPartialIndex, batch_idx, head_idx,
                n_block, seqlen.seqlen_q, cfg.sparse_q_block), cfg.sparse_q_block // self.tile_m)

        if in_range:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.load(tma_atom_q, mQ, tma_atom_do, mdO, tma_atom_k, mK, tma_atom_v, mV,
                              tma_atom_lse, mLSE2, tma_atom_dsum, mD,
                              sQ, sdO, sK, sV, sLSE2, sD, pipeline_q, pipeline_do, pipeline_kv, seqlen,
                              n_block, head_idx, head_idx // qhead_per_kvhead, batch_idx, rows,
                              storage.mbar_fix.data_ptr())
                if const_expr(cfg.dq_writer):
                    if warp_idx == 1:
                        self.write_dq(dq_store[0], dq_store[1], sdQ, seqlen, head_idx, batch_idx,
                                      rows, self.dq_order_of(mSemaphore, mDqTurns, seqlen,
                                                             block_info, n_block, head_idx,
                                                             batch_idx, rows_q), tidx % 32)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(sdp, dkv, dq, views, sLSE2, sD, mdQacc, mdK, mdV, mSemaphore,
                             pipeline_q, pipeline_do, pipeline_kv, seqlen, block_info,
                             softmax_scale, score_scale, softmax_scale_log2,
                             window_left, window_right, n_block, head_idx, batch_idx,
                             rows, rows_q, tidx - WG_THREADS, mKeyHalves, mDqTurns, mod_tensors,
                             (dq_store[0], dq_store[1], sdQ) if const_expr(cfg.dq_tma) else None)

    @cute.jit
    def load(self, tma_atom_q, mQ, tma_atom_do, mdO, tma_atom_k, mK, tma_atom_v, mV,
             tma_atom_lse, mLSE2, tma_atom_dsum, mD, sQ, sdO, sK, sV, sLSE2, sD, pipeline_q, pipeline_do, pipeline_kv, seqlen: SeqlenInfo,
             n_block, head_idx, head_idx_kv, batch_idx, rows, fix_barrier):
        """Producer warp: K and V of this CTA's key block, then Q and dO of each query block.
        With seqused, a block that runs past the sequence's rows has them zeroed before the
        consumers see it (load_zeroing_rows_past)."""
        cfg = self.cfg
        one = cute.make_layout(1)
        gK = cute.local_tile(seqlen.k_view(mK, head_idx_kv, batch_idx), (self.tile_n, self.d), (n_block, 0))
        gV = cute.local_tile(seqlen.k_view(mV, head_idx_kv, batch_idx), (self.tile_n, self.d), (n_block, 0))
        gQ = cute.local_tile(seqlen.q_view(mQ, head_idx, batch_idx), (self.tile_m, self.d), (None, 0))
        gdO = cute.local_tile(seqlen.q_view(mdO, head_idx, batch_idx), (self.tile_m, self.d), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tOsO, tOgO = cpasync.tma_partition(tma_atom_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
        gLSE2 = cute.local_tile(self.row_view(mLSE2, seqlen, head_idx, batch_idx), (self.tile_m,), (None,))
        gD = cute.local_tile(self.row_view(mD, seqlen, head_idx, batch_idx), (self.tile_m,), (None,))
        tLsL, tLgL = cpasync.tma_partition(tma_atom_lse, 0, one, sLSE2, gLSE2)
        tDsD, tDgD = cpasync.tma_partition(tma_atom_dsum, 0, one, sD, gD)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        copy_kv = lambda bar: (cute.copy(tma_atom_k, tKgK, tKsK, tma_bar_ptr=bar),
                               cute.copy(tma_atom_v, tVgV, tVsV, tma_bar_ptr=bar))
        if const_expr(cfg.has_seqused_k):
            if (n_block + 1) * self.tile_n > seqlen.seqlen_k:
                self.load_zeroing_rows_past((pipeline_kv,), kv_state, fix_barrier, self.kv_bytes,
                                            copy_kv, (sK, sV), seqlen.seqlen_k - n_block * self.tile_n)
            else:
                pipeline_kv.producer_acquire(kv_state)
                copy_kv(pipeline_kv.producer_get_barrier(kv_state))
        else:
            pipeline_kv.producer_acquire(kv_state)
            copy_kv(pipeline_kv.producer_get_barrier(kv_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.num_stages)
        for it in cutlass.range(rows.start(), rows.stop(), unroll=1):
            m_block = rows.block(it)
            copy_q = lambda bar: (
                cute.copy(tma_atom_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar),
                cute.copy(tma_atom_lse, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=bar))
            copy_do = lambda bar: (
                cute.copy(tma_atom_do, tOgO[None, m_block], tOsO[None, state.index], tma_bar_ptr=bar),
                cute.copy(tma_atom_dsum, tDgD[None, m_block], tDsD[None, state.index], tma_bar_ptr=bar))
            if const_expr(cfg.has_seqused_q):
                if (m_block + 1) * self.tile_m > seqlen.seqlen_q:
                    valid = seqlen.seqlen_q - m_block * self.tile_m
                    self.load_zeroing_rows_past(
                        (pipeline_q, pipeline_do), state, fix_barrier, 2 * self.q_bytes,
                        lambda bar: (copy_q(bar), copy_do(bar)),
                        (sQ[None, None, state.index], sdO[None, None, state.index]), valid)
                else:
                    pipeline_q.producer_acquire(state)
                    copy_q(pipeline_q.producer_get_barrier(state))
                    pipeline_do.producer_acquire(state)
                    copy_do(pipeline_do.producer_get_barrier(state))
            else:
                pipeline_q.producer_acquire(state)
                copy_q(pipeline_q.producer_get_barrier(state))
                pipeline_do.producer_acquire(state)
                copy_do(pipeline_do.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def load_zeroing_rows_past(self, pipes, state, fix_barrier, nbytes, copies, tensors, valid):
        """The producer warp, for a block with rows past the sequence's (seqused: memory the call
        does not own, maybe NaN or Inf, which a P or dS of 0 does not cancel in the GEMMs): the
        stage's TMA copies (copies(barrier), `nbytes` in all) land on fix_barrier instead of the
        full barriers of `pipes`, then the rows of `tensors` (the stage's (rows, cols) buffers)
        from `valid` on are set to 0, fenced for the wgmmas, and the stage is published in each
        pipe (an arrival, no bytes expected)."""
        arm_fix_barrier(pipes, state, fix_barrier, nbytes)
        copies(fix_barrier)
        cute.arch.mbarrier_wait(fix_barrier, 0)
        lane = cute.arch.lane_idx()
        for t in tensors:  # (a row at a time, the lanes across its columns: few live registers)
            rows, cols = cute.size(t, mode=[0]), cute.size(t, mode=[1])
            for r in cutlass.range(cutlass.max(valid, 0), rows, unroll=1):
                for c in cutlass.range_constexpr(0, cols, 32):
                    if c + lane < cols:
                        t[r, c + lane] = self.dtype(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            for pipe in pipes:
                cute.arch.mbarrier_arrive(pipe.sync_object_full.get_barrier(state.index))

    def row_view(self, mX: cute.Tensor, seqlen: SeqlenInfo, head_idx, batch_idx) -> cute.Tensor:
        """The (rows,) LSE or D of one head. Packed sequences are laid out padded
        (launch_common.bwd_preprocess): sequence b starts at (offset_q // tile_m + b) * tile_m, a
        multiple of tile_m, because a TMA tile of float32 rows must start 16-byte aligned (rows
        starting at odd offsets raised an illegal instruction)."""
        if const_expr(self.cfg.varlen_q):
            start = (seqlen.offset_q // self.tile_m + batch_idx) * self.tile_m
            return cute.domain_offset((start,), mX[None, head_idx])
        return mX[None, head_idx, batch_idx]

    @cute.jit
    def half_attends(self, mKeyHalves: cute.Tensor, batch_idx, head_idx, key_block, query_block):
        """Whether 64-key block key_block attends query block query_block (the table's batch and
        head modes broadcast when of extent 1; indices clamped into it)."""
        b = cutlass.min(batch_idx, mKeyHalves.shape[0] - 1)
        h = cutlass.min(head_idx, mKeyHalves.shape[1] - 1)
        n = cutlass.min(key_block, mKeyHalves.shape[2] - 1)
        m = cutlass.max(cutlass.min(query_block, mKeyHalves.shape[3] - 1), 0)
        return (key_block < mKeyHalves.shape[2]) & (mKeyHalves[b, h, n, m] != 0)

    @cute.jit
    def dq_turn(self, mDqTurns: cute.Tensor, batch_idx, head_idx, query_block, key_block):
        """How many key blocks before key_block add into query block query_block (batch and head
        modes broadcast when of extent 1; indices clamped into the table: lying tables can make
        a wait give up after its bounded spin, never read outside)."""
        b = cutlass.min(batch_idx, mDqTurns.shape[0] - 1)
        h = cutlass.min(head_idx, mDqTurns.shape[1] - 1)
        m = cutlass.max(cutlass.min(query_block, mDqTurns.shape[2] - 1), 0)
        n = cutlass.max(cutlass.min(key_block, mDqTurns.shape[3] - 1), 0)
        return mDqTurns[b, h, m, n]

    def dq_order_of(self, mSemaphore, mDqTurns, seqlen: SeqlenInfo, block_info: BlockInfo,
                    n_block, head_idx, batch_idx, rows_q):
        """Deterministic mode: query block -> (its semaphore, this key block's turn there): the
        key blocks before it that see the query block (block-sparse: counted in mDqTurns)."""
        cfg = self.cfg
        turn_of = lambda m_block: key_block_turn(block_info, seqlen, m_block, n_block,
                                                 cfg.descending_turns)
        if const_expr(cfg.sparse and cfg.deterministic):
            turn_of = lambda m_block: self.dq_turn(
                mDqTurns, batch_idx, head_idx, m_block // (cfg.sparse_q_block // self.tile_m),
                n_block)
        return lambda m_block: (
            mSemaphore[head_idx, None].iterator
            + semaphore_slot(mSemaphore, seqlen, m_block, batch_idx, rows_q, self.tile_m,
                             cfg.varlen_q),
            turn_of(m_block))

    @cute.jit
    def consume(self, sdp, dkv, dq, views, sLSE2, sD, mdQacc, mdK, mdV, mSemaphore,
                pipeline_q, pipeline_do, pipeline_kv, seqlen: SeqlenInfo, block_info: BlockInfo,
                softmax_scale, score_scale, softmax_scale_log2, window_left, window_right,
                n_block, head_idx, batch_idx, rows, rows_q, tidx, mKeyHalves=None,
                mDqTurns=None, mod_tensors=(None, None, None, None), dq_store=None):
        """Both consumer warpgroups (tidx in [0, 256)): the walk over the query blocks, then dK
        and dV out. mKeyHalves (sparse_kv_half): whether each 64-key block attends a listed
        query block; a warpgroup whose block does not leaves it out (all its scores masked)."""
        cfg = self.cfg
        if const_expr(per_sequence(cfg)):  # (dQ's and dK's scale; common/one_key.py)
            softmax_scale = gradient_scale(softmax_scale, seqlen.seqlen_k)
        sQ, sdO, sK, sV, sdS, sQt, sdOt, sKt, sdSt, sPt = views
        # warp-uniform (ptxas cannot see it from the thread index): the wgmma descriptors
        # derived from it stay in uniform registers (without it, R2URs and 64-bit adds around
        # every wgmma; packed sequences' steps 917 -> 668 instructions at d=128)
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_slice = wg * WG_THREADS
        wg_sdp, wg_dkv, wg_dq = (sdp.get_slice(wg_slice), dkv.get_slice(wg_slice),
                                   dq.get_slice(0 if const_expr(cfg.dq_single_wg) else wg_slice))
        thr_sdp, thr_dkv = sdp.get_slice(tidx), dkv.get_slice(tidx)
        # operands
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt))
        if const_expr(cfg.split_d):  # dV's and dK's A: P^T and dS^T from shared memory
            tVsPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(sPt))
            tKsdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(sdSt))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))
        # accumulators: S^T / dP^T per block, dK / dV over the walk
        shape_st = (self.tile_n, self.tile_m)
        acc_S = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(shape_st))
        acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(shape_st))
        acc_dV = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.d)))
        acc_dK = thr_dkv.make_fragment_C(thr_dkv.partition_shape_C((self.tile_n, self.d)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        tVrP = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.dtype)
        tKrdS = cute.make_rmem_tensor(acc_to_a_operand_layout(acc_S.layout), self.dtype)
        acc_S_mn, acc_dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        # (key, query) of each accumulator element, in the CTA's (tile_n, tile_m) block
        coord_st = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor(shape_st)))
        # where this thread's dS^T elements go in the (query, key) buffer, seen transposed
        tSsdSt = thr_sdp.partition_C(sdSt)
        tSsPt = thr_sdp.partition_C(sPt) if const_expr(cfg.split_d) else None
        # each 8 x 8 piece of the (key, query) fragment stored transposed: a row of the buffer
        # (a query) gets 8 contiguous keys, 16 bytes a lane (4 matrix stores a thread against
        # 32 scalar 16-bit ones: 1.02-1.08x at 4k, perf-log)
        store_t = cute.make_tiled_copy_C(cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            sdp).get_slice(tidx)
        tSsdSt = store_t.partition_D(sdSt)
        tSsPt = store_t.partition_D(sPt) if const_expr(cfg.split_d) else None

        # (red.global pairs into the blocked accumulator: its head, row stride and this
        # sequence's first row, common/dq_blocks.py)
        if const_expr(not cfg.dq_tma):
            gdQ = (dq_blocks.head_start(mdQacc, head_idx, self.d), mdQacc.stride[0],
                   dq_blocks.first_row(mdQacc, seqlen, batch_idx, cfg.varlen_q))
        else:
            # (TMA atom, this warpgroup's staged share, its boxes in global memory by query block)
            tma_atom_dq, tma_dq, sdQ = dq_store
            gdQ_boxes = cute.local_tile(seqlen.q_view(tma_dq, head_idx, batch_idx), cfg.dq_box,
                                        (None, None))
            tdQs, tdQg = cpasync.tma_partition(tma_atom_dq, 0, cute.make_layout(1),
                                               cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gdQ_boxes, 0, 2))
            dq_wg = 0 if const_expr(cfg.dq_single_wg) else wg
            # (the box's column, and its row within a query step, by the split)
            col_box, row_box = (0, dq_wg) if const_expr(cfg.dq_split_rows) else (dq_wg, 0)
            gdQ = (tma_atom_dq, tdQs[None, dq_wg], tdQg[None, None, col_box], sdQ[None, None, dq_wg],
                   row_box)  # (what reduce_dq takes in gdQ's place)
        # (dq_tma) the warp of each dQ warpgroup that issues its reduce-add
        # (warp-uniform for ptxas, as wg: it guards TMA issues inside the query loop)
        dq_issuer = cute.arch.make_warp_uniform((tidx % WG_THREADS) // 32) == 0
        num_cols = cute.size(acc_S_mn, mode=[1])
        lse_rows = cute.make_rmem_tensor(cute.make_layout(num_cols), Float32) if const_expr(
            cfg.prefetch_lse) else None
        key_start = n_block * self.tile_n + (0 if const_expr(cfg.split_d) else wg * WG_ROWS)

        order = self.dq_order_of(mSemaphore, mDqTurns, seqlen, block_info, n_block, head_idx,
                                 batch_idx, rows_q)

        dkv.set(warpgroup.Field.ACCUMULATE, True)
        make_sdp = self.make_sdp
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipeline_kv.consumer_wait(kv_state)  # always: K's buffer stages dK at the end
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        for it in cutlass.range(rows.start(), rows.stop(), unroll=1):
            m_block = rows.block(it)
            q_start = m_block * self.tile_m
            ds_stage = rows.stage(it)
            # this block's LSE and D by the query column c of the thread's fragment
            # (rows past the sequence hold +inf and 0, or another sequence's values, never
            # NaN: launch_common.bwd_preprocess; their P is 0 by the mask)
            lse2_of = lambda c: sLSE2[coord_st[0, c][1], state.index]
            dsum_of = lambda c: sD[coord_st[0, c][1], state.index]
            pipeline_q.consumer_wait(state)
            gemm_async(make_sdp(), acc_S, tSrK, tSrQ[None, None, None, state.index], True)
            if const_expr(cfg.prefetch_lse):
                for c in cutlass.range_constexpr(num_cols):
                    lse_rows[c] = sLSE2[coord_st[0, c][1], state.index]
                lse2_of = lambda c: lse_rows[c]
            pipeline_do.consumer_wait(state)
            gemm_async(make_sdp(), acc_dP, tPrV, tPrdO[None, None, None, state.index], True)
            # P^T = exp2(S^T * scale_log2 - lse_log2), masked entries 0; then
            # dS^T = P^T * (dP^T - D). With softcap both wait for dP, so that one pass has the
            # tanh t of each score for its derivative 1 - t^2 (kept over the wait, 32 more live
            # registers spilled); clamped at 0, which is exact for real t and zeroes masked ones.
            # A score_mod likewise waits for dP: one pass takes each raw score (the masks have
            # made it -inf where it is not attended) to P and dS with the mod's value and
            # derivative (no derivative kept per element over the wait).
            rows_per_col = cute.size(acc_S_mn, mode=[0])
            chained = cfg.has_softcap or cfg.score_mod is not None
            warpgroup.wait_group(0 if const_expr(chained) else 1)
            if const_expr(cfg.has_softcap):
                softcap_scores(acc_S, score_scale)
            if block_info.needs_mask_transposed(seqlen.seqlen_q, seqlen.seqlen_k, key_start,
                                                cfg.wg_keys, q_start):
                apply_mask_transposed(acc_S_mn, coord_st, n_block * self.tile_n, q_start,
                                      seqlen.seqlen_q, seqlen.seqlen_k, window_left,
                                      window_right, cfg.causal, cfg.local)
            if const_expr(cfg.mask_mod is not None):
                mod = traced(self.mask_mod_fn, cfg.mask_mod, mod_tensors[:len(cfg.mask_mod.tensors)])
                apply_mod = lambda: apply_mask_mod(
                    acc_S_mn, coord_st, n_block * self.tile_n, q_start, seqlen.seqlen_q,
                    seqlen.seqlen_k, batch_idx, head_idx, mod, transposed=True)
                if const_expr(cfg.sparse):  # the partial query blocks of the transposed lists
                    if it // (cfg.sparse_q_block // self.tile_m) >= rows.lists.num_full:
                        apply_mod()
                else:
                    apply_mod()
            if const_expr(cfg.sparse_kv_half):
                if not self.half_attends(mKeyHalves, batch_idx, head_idx, n_block * 2 + wg,
                                         m_block // (cfg.sparse_q_block // self.tile_m)):
                    acc_S.fill(-Float32.inf)  # P = 0, so dS = 0: nothing from this block
            if const_expr(cfg.score_mod is not None):
                # P = exp2(mod(s * scale) log2(e) - lse2), dS (by the scaled score) =
                # P (dP - D) mod'(s * scale); softmax_scale joins at dK and dQ. Only inside the
                # sequence and where no mask took the score (the mod reads its tensors there).
                score_mod = traced(self.score_mod_fn, cfg.score_mod,
                                   mod_tensors[2:2 + len(cfg.score_mod.tensors)])
                key0, q_room = n_block * self.tile_n, seqlen.seqlen_q - q_start
                for c in cutlass.range_constexpr(num_cols):
                    lse2, dsum = lse2_of(c), dsum_of(c)
                    q_inside = coord_st[0, c][1] < q_room
                    for r in cutlass.range_constexpr(rows_per_col):
                        s = acc_S_mn[r, c]
                        p, ds = Float32(0.0), Float32(0.0)
                        if q_inside & (key0 + coord_st[r, 0][0] < seqlen.seqlen_k) & (s != -Float32.inf):
                            y, g = value_and_grad(score_mod, s * score_scale, batch_idx, head_idx,
                                                  q_start + coord_st[0, c][1],
                                                  key0 + coord_st[r, 0][0])
                            p = cute.math.exp2(y * softmax_scale_log2 - lse2, fastmath=True)
                            ds = p * ((acc_dP_mn[r, c] - dsum) * g)
                        acc_S_mn[r, c] = p
                        acc_dP_mn[r, c] = ds
                convert_fragment(acc_S, tVrP)
            elif const_expr(cfg.has_softcap):
                for c in cutlass.range_constexpr(num_cols):
                    lse2, dsum = lse2_of(c), dsum_of(c)
                    for r in cutlass.range_constexpr(rows_per_col):
                        t = acc_S_mn[r, c]
                        p = cute.math.exp2(t * softmax_scale_log2 - lse2, fastmath=True)
                        slope = cutlass.max(Float32(1.0) - t * t, Float32(0.0))
                        acc_S_mn[r, c] = p
                        acc_dP_mn[r, c] = p * ((acc_dP_mn[r, c] - dsum) * slope)
                convert_fragment(acc_S, tVrP)
            else:
                for c in cutlass.range_constexpr(num_cols):
                    lse2 = lse2_of(c)
                    for r in cutlass.range_constexpr(rows_per_col):
                        acc_S_mn[r, c] = cute.math.exp2(
                            acc_S_mn[r, c] * softmax_scale_log2 - lse2, fastmath=True)
                convert_fragment(acc_S, tVrP)
                warpgroup.wait_group(0)
                for c in cutlass.range_constexpr(num_cols):
                    dsum = dsum_of(c)
                    for r in cutlass.range_constexpr(rows_per_col):
                        acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - dsum)
            convert_fragment(acc_dP, tKrdS)
            # dS^T rows into the dQ GEMM's buffer (this stage was last read two blocks ago,
            # before every consumer passed the previous block's DS_READY)
            rdS = cute.make_tensor(tKrdS.iterator, acc_dP.layout)
            cute.copy(store_t, store_t.retile(rdS), tSsdSt[None, None, None, ds_stage])
            if const_expr(cfg.split_d):  # P^T too: the dV GEMMs of both read every query's
                rP = cute.make_tensor(tVrP.iterator, acc_S.layout)
                cute.copy(store_t, store_t.retile(rP), tSsPt[None, None, None, ds_stage])
            # dK += dS^T Q: before dQ's GEMM, or (dq_before_dk) right after it, dQ's additions
            # under it; dS^T from registers, or (split_d) from shared memory after the barrier
            issue_dk = lambda: gemm_async(
                dkv, acc_dK, tKsdSt[None, None, None, ds_stage] if const_expr(cfg.split_d) else tKrdS,
                tKrQt[None, None, None, state.index], False)
            if const_expr(not cfg.split_d):  # dV += P^T dO (P^T from registers)
                gemm_async(dkv, acc_dV, tVrP, tVrdOt[None, None, None, state.index], False)
                if const_expr(not cfg.dq_before_dk):
                    issue_dk()
            cute.arch.fence_view_async_shared()  # dS^T's generic writes, before wgmma reads
            if const_expr(cfg.dq_tma and not cfg.dq_writer):
                if dq_issuer:  # the last block's reduce-add has read its staged share
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            named_barriers.sync(BwdBarrier.DS_READY, self.consumer_threads)
            if const_expr(cfg.split_d):  # this warpgroup's half of dV's and dK's columns
                gemm_async(dkv, acc_dV, tVsPt[None, None, None, ds_stage],
                           tVrdOt[None, None, None, state.index], False)
                if const_expr(not cfg.dq_before_dk):
                    issue_dk()
            then = issue_dk if const_expr(cfg.dq_before_dk) else None
            if const_expr(cfg.dq_single_wg):
                if wg == 0:
                    self.dq_step(dq, tQrdS, tQrKt, ds_stage, gdQ, order, seqlen.seqlen_q,
                                 softmax_scale, m_block, tidx, then)
                else:
                    if const_expr(then is not None):
                        then()
                    warpgroup.wait_group(0)
                    self.dq_order(order, m_block, tidx, None)
            else:
                self.dq_step(dq, tQrdS, tQrKt, ds_stage, gdQ, order, seqlen.seqlen_q,
                             softmax_scale, m_block, tidx, then)
            if const_expr(cfg.dq_before_dk):
                # dK's GEMM (issued after dQ's, run under dQ's additions) reads Q's stage: it
                # is done before the stage is freed for the producer's next TMA write
                warpgroup.wait_group(0)
            pipeline_q.consumer_release(state)
            pipeline_do.consumer_release(state)
            state.advance()
        # dK (scaled) and dV out, staged through K's and V's buffers once every consumer is
        # past its last dQ GEMM (they read all of K)
        warpgroup.wait_group(0)  # (dq_before_dk: the last dK GEMM)
        if const_expr(cfg.dq_writer):
            if tidx < cfg.dq_wgs * WG_THREADS:  # (the writer's last "free", so none is left over)
                named_barriers.sync(BwdBarrier.DQ_FREE, self.dq_writer_threads)
        elif const_expr(cfg.dq_tma):
            if dq_issuer:  # every reduce-add has read its box before shared memory goes
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[i] = acc_dK[i] * softmax_scale
        named_barriers.sync(BwdBarrier.KV_FREE, self.consumer_threads)
        # each warpgroup's (64, cols) piece: its keys (or, split_d, its half of the columns)
        cols = self.d // NUM_CONSUMER_WG if const_expr(cfg.split_d) else self.d
        piece = (0, wg) if const_expr(cfg.split_d) else (wg, 0)
        one_wg = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), (WG_ROWS, cols), warpgroup.OperandSource.RMEM)
        row_start = n_block * self.tile_n + piece[0] * WG_ROWS
        for acc, s_buf, m_out in ((acc_dK, sK, mdK), (acc_dV, sV, mdV)):
            s_wg = cute.local_tile(s_buf, (WG_ROWS, cols), piece)
            epilogue.stage_o(acc, s_wg, one_wg, tidx % WG_THREADS, self.dtype)
            named_barriers.sync(BwdBarrier.KV_FREE, self.consumer_threads)
            g_wg = cute.local_tile(seqlen.k_view(m_out, head_idx, batch_idx), (WG_ROWS, cols),
                                   (row_start // WG_ROWS, piece[1]))
            epilogue.store_o(s_wg, g_wg, row_start, seqlen.seqlen_k, tidx % WG_THREADS,
                             self.dtype, cols, WG_ROWS, WG_THREADS)

    @cute.jit
    def dq_step(self, dq, tQrdS, tQrKt, ds_stage, gdQ, order, seqlen_q, softmax_scale,
                m_block, tidx, then=None):
        """dQ's share of this key block for query block m_block: dS K, scaled, added to the
        float32 accumulator (rows inside the sequence only). `then`: issues dK's GEMM after
        dQ's, which the additions then wait for alone."""
        thr_dq = dq.get_slice(tidx)
        acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.tile_m, self.d)))
        fresh = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, self.cfg.dq_atoms, self.cfg.dq_box)
        gemm_async(fresh, acc_dQ, tQrdS[None, None, None, ds_stage], tQrKt, True)
        if const_expr(then is not None):
            then()
            warpgroup.wait_group(1)
        else:
            warpgroup.wait_group(0)
        if const_expr(self.cfg.dq_tma):
            self.reduce_dq(acc_dQ, gdQ, m_block, tidx, softmax_scale)
        else:
            tile = cute.make_identity_tensor((self.tile_m, self.d))
            coord = acc_mn_view(thr_dq.partition_C(tile))
            steps = acc_mn_view(dq.get_slice(0).partition_C(tile))
            acc_mn = acc_mn_view(acc_dQ)
            self.dq_order(order, m_block, tidx, lambda: self.add_dq(
                acc_mn, coord, steps, gdQ, m_block, seqlen_q, softmax_scale))

    @cute.jit
    def reduce_dq(self, acc_dQ, dq_box, m_block, tidx, softmax_scale):
        """dq_tma: this warpgroup's dQ share, scaled, into its shared-memory box, then one TMA
        reduce-add of the box into the accumulator: the writer warp's (dq_writer: the box is
        free once it says so, DQ_FREE), or (packed sequences in plain mode) issued by the
        warpgroup's first warp once the others have arrived (it waited for the last
        reduce-add's reads before DS_READY; the others go on without waiting)."""
        tma_atom, tdQs, tdQg, sdQ, row_box = dq_box
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            acc_dQ[i] = acc_dQ[i] * softmax_scale
        one_wg = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), self.cfg.dq_box)
        pairs = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
        thr_copy = cute.make_tiled_copy_C(pairs, one_wg).get_slice(tidx % WG_THREADS)
        if const_expr(self.cfg.dq_writer):  # the writer warp's last reduce-add has read the box
            named_barriers.sync(BwdBarrier.DQ_FREE, self.dq_writer_threads)
        cute.copy(thr_copy, thr_copy.retile(acc_dQ), thr_copy.partition_D(sdQ))
        cute.arch.fence_proxy("async.shared", space="cta")  # generic writes, before the TMA's reads
        if const_expr(self.cfg.dq_writer):  # it is the writer warp's to add, in turn
            named_barriers.arrive(BwdBarrier.DQ_STAGED, self.dq_writer_threads)
        else:
            staged = BwdBarrier.DQ_STAGED + tidx // WG_THREADS
            if cute.arch.make_warp_uniform((tidx % WG_THREADS) // 32) == 0:  # (consume's dq_issuer)
                named_barriers.sync(staged, WG_THREADS)
                boxes_per_step = self.tile_m // self.cfg.dq_box[0]
                cute.copy(tma_atom, tdQs, tdQg[None, m_block * boxes_per_step + row_box])
                cute.arch.cp_async_bulk_commit_group()
            else:
                named_barriers.arrive(staged, WG_THREADS)

    @cute.jit
    def write_dq(self, tma_atom_dq, tma_dq, sdQ, seqlen: SeqlenInfo, head_idx, batch_idx, rows,
                 order, lane):
        """dq_writer (the producer warpgroup's second warp): per query block of the walk, once
        the consumers have staged their dQ shares (DQ_STAGED), reduce-add the boxes into the
        accumulator and free them (DQ_FREE) once read; in deterministic mode only on this key
        block's turn, passed on once the additions are complete. The boxes start free."""
        cfg = self.cfg
        gdQ_boxes = cute.local_tile(seqlen.q_view(tma_dq, head_idx, batch_idx), cfg.dq_box,
                                    (None, None))
        tdQs, tdQg = cpasync.tma_partition(tma_atom_dq, 0, cute.make_layout(1),
                                           cute.group_modes(sdQ, 0, 2),
                                           cute.group_modes(gdQ_boxes, 0, 2))
        boxes_per_step = self.tile_m // cfg.dq_box[0]
        threads = self.dq_writer_threads
        named_barriers.arrive(BwdBarrier.DQ_FREE, threads)
        for it in cutlass.range(rows.start(), rows.stop(), unroll=1):
            m_block = rows.block(it)
            named_barriers.sync(BwdBarrier.DQ_STAGED, threads)

            def add():
                if const_expr(cfg.deterministic):
                    # (after the turn's acquire: the reduce-adds follow the earlier key blocks')
                    cute.arch.fence_proxy("async.global")
                for w in cutlass.range_constexpr(cfg.dq_wgs):
                    # (the box's column, and its row within a query step, by the split)
                    col_box, row_box = (0, w) if const_expr(cfg.dq_split_rows) else (w, 0)
                    cute.copy(tma_atom_dq, tdQs[None, w],
                              tdQg[None, m_block * boxes_per_step + row_box, col_box])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                named_barriers.arrive(BwdBarrier.DQ_FREE, threads)
                if const_expr(cfg.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0)  # complete: the next turn may add
                    cute.arch.fence_proxy("async.global")

            if const_expr(cfg.deterministic):
                ptr, turn = order(m_block)
                in_turn(ptr, turn, lane == 0, cute.arch.sync_warp, cute.arch.sync_warp, add)
            else:
                add()

    @cute.jit
    def add_dq(self, acc_mn, coord, steps, dq_out, m_block, seqlen_q, softmax_scale):
        """This thread's dQ share, rows inside the sequence only, a pair a red.global (coord:
        the thread's coordinates, steps: thread 0's) into the blocked accumulator (dq_out: its
        head, row stride and the sequence's first row; common/dq_blocks.py): each addition at
        the thread's row address plus a constant, a warp's addition two adjacent lines (in q's
        row layout it touched 8 rows: 1.14-1.29x measured, docs/perf-log.md)."""
        q_start = m_block * self.tile_m
        head, row_stride, row0 = dq_out
        assert steps[0, 0] == (0, 0), steps[0, 0]
        first_row, first_col = coord[0, 0]
        thread = head + dq_blocks.offset("pairs", row0 + q_start + first_row, first_col, row_stride)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            if q_start + first_row + steps[r, 0][0] < seqlen_q:
                at_row = thread + dq_blocks.step_offset("pairs", (steps[r, 0][0], 0), row_stride)
                for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 2):
                    at = at_row + dq_blocks.step_offset("pairs", (0, steps[r, c][1]), row_stride)
                    red_add_f32x2(at, acc_mn[r, c] * softmax_scale,
                                  acc_mn[r, c + 1] * softmax_scale)

    @cute.jit
    def dq_order(self, order, m_block, tidx, add):
        """Runs `add` (this thread's dQ additions; None for a warpgroup without any); in
        deterministic mode only on this key block's turn for query block m_block
        (`order(m_block)`: the semaphore and the turn), counting the turn done once every
        consumer's additions are visible."""
        if const_expr(not self.cfg.deterministic or self.cfg.dq_writer):  # (the writer's turns)
            if const_expr(add is not None):
                add()
        else:
            ptr, turn = order(m_block)
            in_turn(ptr, turn, tidx == 0,
                    lambda: named_barriers.sync(BwdBarrier.DQ_ORDER, self.consumer_threads),
                    lambda: named_barriers.sync(BwdBarrier.DQ_DONE, self.consumer_threads), add)
