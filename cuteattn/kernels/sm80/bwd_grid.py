"""The portable backward on two-dimensional warp grids (where its tiles fit; bwd.py serves the rest).

bwd.py's warps split the keys, 16 rows a warp, so every B fragment an ldmatrix reads feeds one
16-row MMA: the kernel issues 0.7-0.75 ldmatrix a MMA and is bound by the shared-memory pipe
(docs/perf-log.md, beside FlashAttention-2 under ncu). Here each GEMM gets its own warp grid
with 32-row warp tiles, so a fragment feeds two MMAs, at the price of P going through shared
memory beside dS (the GEMMs that read them are not on the warps that computed them):

    S = Q K^T, dP = dO V^T       2 x 4 warps (queries x keys), 32 x tile_n/4 a warp
    P = exp2(S * scale_log2 - lse2), dS = P (dP - D)    -> sP, sdS (queries x keys)
    dV += P^T dO, dK += dS^T Q   tile_n/32 x 8/(tile_n/32) warps (keys x columns), 32 keys a
                                 warp: d/2 columns with 128 keys, d/4 with 64 (over d = 128)
    dQ  = dS K                   2 x 4 warps (queries x columns; 4 x 2 where the columns do not
                                 come in 64s: d = 96), added with red.global

Per query block: Q, dO (and LSE, D) land; S and dP; P and dS to shared memory; one barrier;
dV, dK and dQ read them. The rest (loads, ring of Q/dO stages, masks, softcap, varlen,
seqused, deterministic dQ order, padded head dims, dK/dV epilogue) is bwd.py's. Every head dim
in one pass over dK's and dV's columns: 64 x 128 tiles up to d = 128 (dK and dV of 32 keys x
d/2 columns a warp: d/2 registers each a thread), 64 x 64 over it (d/4 each: 64 at d = 256,
as FlashAttention-2 runs it).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..common import epilogue
from ..common.convert import convert_fragment
from ..common.layout import acc_mn_view, transposed_view
from ..common.mask import apply_mask
from ..common.score_mod import softcap_scores
from ..common.seqlen_info import SeqlenInfo
from . import mma
from .bwd import FlashBwdSm80, Sm80BwdConfig, probabilities_and_ds


class FlashBwdSm80Grid(FlashBwdSm80):
    p_in_smem = True

    def __init__(self, cfg: Sm80BwdConfig):
        assert cfg.num_warps == 8 and cfg.kv_passes == 1 and cfg.tile_m in (64, 128), cfg
        assert cfg.tile_n in (64, 128), cfg
        super().__init__(cfg)
        if self.d > 192:  # (dQ's whole 64 x 256 accumulator spilled 12-48 bytes: two halves)
            self.dq_cols = 128
        # warps_m x warps_n of each GEMM: 32 rows a warp where the tile has them (each A
        # fragment feeds two MMAs); a warp's columns come in 16-wide steps (tiled_mma_grid)
        self.sdp_grid = (2, 4)
        self.kv_grid = (self.tile_n // 32, 8 // (self.tile_n // 32))
        self.dq_grid = (2, 4) if self.dq_cols % 64 == 0 else (4, 2)
        for (warps_m, warps_n), rows, cols in ((self.sdp_grid, self.tile_m, self.tile_n),
                                               (self.kv_grid, self.tile_n, self.d),
                                               (self.dq_grid, self.tile_m, self.dq_cols)):
            assert rows % (16 * warps_m) == 0 and cols % (16 * warps_n) == 0, (cfg, rows, cols)

    def score_layout(self):
        """P's and dS's shared-memory tiles: (tile_m queries, tile_n keys)."""
        return mma.smem_layout(self.dtype, self.tile_m, self.tile_n)

    @cute.jit
    def key_block(self, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore, sQ, sdO, sK, sV,
                  sdS, sLSE2, sD, seqlen: SeqlenInfo, n_block, head_idx, head_idx_kv, batch_idx,
                  softmax_scale, score_scale, softmax_scale_log2, window_left, window_right,
                  tidx, sP=None):
        """One CTA: K and V in, the walk over the query blocks, dK and dV out."""
        cfg = self.cfg
        block_info, m_min, m_max, key_start, gLSE2, gD, dq_out, load_q_block = self.start_walk(
            mQ, mK, mV, mdO, mLSE2, mD, mdQacc, sQ, sdO, sK, sV, seqlen, n_block, head_idx,
            head_idx_kv, batch_idx, window_left, window_right, tidx)
        ring = self.ring
        stage_of = lambda t, st: t[None, None, st] if const_expr(ring) else t
        rows_stage = lambda t, st: t[None, st] if const_expr(ring) else t

        ldm = lambda transpose: mma.ldmatrix_atom(self.dtype, transpose)
        # S = Q K^T and dP = dO V^T: A from Q / dO, B from K / V (all K-major: plain ldmatrix)
        sdp_mma = mma.tiled_mma_grid(self.dtype, *self.sdp_grid)
        thr_sdp = sdp_mma.get_slice(tidx)
        ld_sdp_a = cute.make_tiled_copy_A(ldm(False), sdp_mma).get_slice(tidx)
        ld_sdp_b = cute.make_tiled_copy_B(ldm(False), sdp_mma).get_slice(tidx)
        sQ0, sdO0 = stage_of(sQ, 0), stage_of(sdO, 0)  # (the fragments' shapes: any stage's)
        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ0))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tSsK, tSsV = ld_sdp_b.partition_S(sK), ld_sdp_b.partition_S(sV)
        # dV += P^T dO and dK += dS^T Q: A from P^T / dS^T, B from dO^T / Q^T (transposed reads)
        kv_mma = mma.tiled_mma_grid(self.dtype, *self.kv_grid)
        thr_kv = kv_mma.get_slice(tidx)
        ld_kv_a = cute.make_tiled_copy_A(ldm(True), kv_mma).get_slice(tidx)
        ld_kv_b = cute.make_tiled_copy_B(ldm(True), kv_mma).get_slice(tidx)
        sPt, sdSt = transposed_view(sP), transposed_view(sdS)
        tVrPt = thr_kv.make_fragment_A(thr_kv.partition_A(sPt))
        tVrdOt = thr_kv.make_fragment_B(thr_kv.partition_B(transposed_view(sdO0)))
        tVsPt, tKsdSt = ld_kv_a.partition_S(sPt), ld_kv_a.partition_S(sdSt)
        # dQ = dS K: A from dS (plain), B from K^T (transposed), in chunks of dq_cols columns
        dq_mma = mma.tiled_mma_grid(self.dtype, *self.dq_grid)
        thr_dq = dq_mma.get_slice(tidx)
        ld_dq_a = cute.make_tiled_copy_A(ldm(False), dq_mma).get_slice(tidx)
        ld_dq_b = cute.make_tiled_copy_B(ldm(True), dq_mma).get_slice(tidx)
        tQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tQsdS = ld_dq_a.partition_S(sdS)
        sKt = transposed_view(sK)
        chunk = lambda c: cute.local_tile(sKt, (self.dq_cols, self.tile_n), (c, 0))
        tQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(chunk(0)))
        tQsKt = [ld_dq_b.partition_S(chunk(c)) for c in range(self.d // self.dq_cols)]
        coord_dq = acc_mn_view(thr_dq.partition_C(cute.make_identity_tensor((self.tile_m, self.dq_cols))))

        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_kv.partition_shape_C((self.tile_n, self.d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_kv.partition_shape_C((self.tile_n, self.d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        acc_S_mn, acc_dP_mn = acc_mn_view(acc_S), acc_mn_view(acc_dP)
        coord_s = acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        # P and dS into shared memory: the accumulator's own layout, pairs of 16-bit values
        st_s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                num_bits_per_copy=2 * self.dtype.width), sdp_mma).get_slice(tidx)
        tPsP, tSsdS = st_s.partition_D(sP), st_s.partition_D(sdS)

        if const_expr(ring):
            # the first query block into stage 0 (its LSE and D rows too; the loop's first
            # barrier makes them visible)
            if m_min < m_max:
                load_q_block(m_min, 0)
                self.load_lse_rows(gLSE2, gD, sLSE2[None, 0], sD[None, 0],
                                   m_min * self.tile_m, seqlen.seqlen_q, tidx)
        for m_block in cutlass.range(m_min, m_max, unroll=1):
            q_start = m_block * self.tile_m
            st = (m_block - m_min) % cfg.q_stages if const_expr(ring) else 0
            lse_next, d_next = self.block_start(load_q_block, gLSE2, gD, sLSE2, sD, m_block, m_max,
                                                q_start, st, seqlen.seqlen_q, tidx)
            sQs, sdOs = stage_of(sQ, st), stage_of(sdO, st)
            # S and dP
            acc_S.fill(0.0)
            mma.gemm(sdp_mma, acc_S, tSrQ, tSrK, ld_sdp_a.partition_S(sQs), tSsK, ld_sdp_a, ld_sdp_b)
            if const_expr(cfg.has_softcap):
                softcap_scores(acc_S, score_scale)
            if block_info.needs_mask_transposed(seqlen.seqlen_q, seqlen.seqlen_k, key_start,
                                                self.tile_n, q_start):
                apply_mask(acc_S_mn, coord_s, q_start, key_start, seqlen.seqlen_q,
                           seqlen.seqlen_k, window_left, window_right, cfg.causal, cfg.local)
            acc_dP.fill(0.0)
            mma.gemm(sdp_mma, acc_dP, tSrQ, tSrK, ld_sdp_a.partition_S(sdOs), tSsV, ld_sdp_a, ld_sdp_b)
            probabilities_and_ds(acc_S_mn, acc_dP_mn, lambda r: coord_s[r, 0][0],
                                 rows_stage(sLSE2, st), rows_stage(sD, st), softmax_scale_log2,
                                 cfg.has_softcap, 0)
            convert_fragment(acc_S, rP)
            convert_fragment(acc_dP, rdS)
            cute.copy(st_s, st_s.retile(rP), tPsP)
            cute.copy(st_s, st_s.retile(rdS), tSsdS)
            cute.arch.barrier()  # P and dS are in shared memory
            # dV += P^T dO, dK += dS^T Q
            mma.gemm(kv_mma, acc_dV, tVrPt, tVrdOt, tVsPt,
                     ld_kv_b.partition_S(transposed_view(sdOs)), ld_kv_a, ld_kv_b)
            mma.gemm(kv_mma, acc_dK, tVrPt, tVrdOt, tKsdSt,
                     ld_kv_b.partition_S(transposed_view(sQs)), ld_kv_a, ld_kv_b)
            # dQ's share
            add = lambda: self.dq_share(dq_mma, thr_dq, tQrdS, tQrKt, tQsdS, tQsKt, ld_dq_a,
                                        ld_dq_b, coord_dq, dq_out, q_start, seqlen,
                                        softmax_scale)
            self.add_dq_share(add, mSemaphore, mQ, seqlen, block_info, m_block, n_block,
                              head_idx, batch_idx, tidx)
            self.block_end(sLSE2, sD, st, lse_next, d_next, tidx)

        self.store_dk_dv([acc_dK], [acc_dV], kv_mma, sK, sV, mdK, mdV, seqlen, n_block, head_idx,
                         batch_idx, softmax_scale, tidx)
