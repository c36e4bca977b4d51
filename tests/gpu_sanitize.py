"""Runs small calls of every kernel family under compute-sanitizer (a script, not a pytest module).

    python3 tests/gpu_sanitize.py [--tool memcheck|racecheck|synccheck|initcheck|all]
        [--groups fixed,varlen,bwd,bad] [--jobs 3] [--out DIR] [--line-info] [--skip-warmup]

Groups of cases (each case a few calls of a few hundred tokens at most, racecheck is slow):
  fixed   flash_attn_func, d 64/96/128/192/256: no mask, causal, window, softcap; MHA, GQA, MQA
  varlen  flash_attn_varlen_func, d 64/128/256 causal and not, lengths [0, 1, 63, 0, 129, 700],
          8 q heads over 2 kv heads; seqused
  bwd     the backward (dq, dk, dv through autograd), d 64/96/128 with the fixed group's masks,
          deterministic, varlen with seqused
  bad     tests/test_gpu_guard.py's bad metadata (validate=False) on its three configs
  surface padded head dims, head_dim_v < head_dim, negative window edges, one side packed,
          seqused on batched q/k (tests/test_gpu_surface.py's varlen helper)
  sparse  block-sparse lists at every physical block shape, a causal mask on top, lying lists,
          packed sequences (with seqused_k), the backward (128x128 lists)
  portable  the mma.sync path (CUTEATTN_PATH=sm80): the fixed group's forward cases, varlen with
          seqused, the decode kernel's cases (tests/test_gpu_sm80.DECODE_CASES), a paged
          prefill, the backward (d 64/128, the fixed masks, deterministic, varlen), bad metadata
The parent first runs every group once without the sanitizer (in parallel), so that each kernel is
compiled and stored in the disk cache (the compile step makes CUDA API calls the sanitizer would
report); then, per tool, one `compute-sanitizer --tool X --error-exitcode 1 python3 THIS --child
CASE...` process per group. It parses "ERROR SUMMARY: N errors" / "RACECHECK SUMMARY: ... (N errors,
M warnings)", prints a table tool x group, writes each process's log and summary.json to --out
(default $OUT, else a new temporary directory), and exits 1 if anything failed.
A device command may run 10 minutes: run the tools in separate commands, the first warming the
disk cache (`--tool memcheck`), the next ones with `--skip-warmup` (the cache is on the machine).

Children run with CUTEATTN_DISK_CACHE=1 and PYTORCH_NO_CUDA_MEMORY_CACHING=1 (each tensor its own
cudaMalloc, so memcheck sees an access just past one); under the sanitizer without guard regions
(test_gpu_guard.GUARDS = False), in the warm-up with them (guards and outputs checked there).
--line-info passes CUTE_DSL_LINEINFO=1 to every child: the DSL then compiles kernels with line
information, so that reports name source lines (the disk cache keeps such kernels apart).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
ALL_TOOLS = ("memcheck", "racecheck", "synccheck")
TOOL_FLAGS = {"racecheck": ["--racecheck-report", "analysis"]}


# ---- the cases ----

def cases() -> dict:
    """name -> callable running that case's calls; every call checks its own result. Building the
    table imports torch and cuteattn but touches no GPU (the parent only reads the names)."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    import torch
    import test_gpu_guard as g

    bf16, fp16 = torch.bfloat16, torch.float16
    out = {}
    fixed_masks = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(64, 32)),
                   "softcap": dict(softcap=30.0, causal=True)}
    heads = {"none": (4, 4), "causal": (8, 2), "window": (8, 2), "softcap": (4, 1)}
    sizes = {"none": (130, 257), "causal": (257, 257), "window": (200, 300), "softcap": (193, 64)}
    for d in (64, 96, 128, 192, 256):
        for mask, kw in fixed_masks.items():
            (h, hk), (sq, sk) = heads[mask], sizes[mask]
            out[f"fixed_d{d}_{mask}"] = lambda d=d, h=h, hk=hk, sq=sq, sk=sk, kw=kw: g.good_fixed(
                bf16, d, h, hk, sq, sk, b=1, **kw)
    out["fixed_fp16_d128_causal"] = lambda: g.good_fixed(fp16, 128, 8, 2, 129, 257, b=1, causal=True)
    lens_q, lens_k = [0, 1, 63, 0, 129, 700], [5, 0, 63, 129, 1, 700]
    for d in (64, 128, 256):
        for causal in (False, True):
            out[f"varlen_d{d}_{'causal' if causal else 'none'}"] = (
                lambda d=d, causal=causal: g.good_varlen(d, 8, 2, lens_q=lens_q, lens_k=lens_k,
                                                         causal=causal))
    out["varlen_d64_window"] = lambda: g.good_varlen(  # (the packed windowed key block)
        64, 8, 2, lens_q=lens_q, lens_k=lens_k, window_size=(64, 0))
    out["varlen_d128_window_seqused"] = lambda: g.good_varlen(
        128, 8, 2, lens_q=lens_q, lens_k=lens_k, used_q=[0, 1, 10, 0, 129, 300],
        used_k=[5, 0, 0, 100, 1, 700], window_size=(64, 0))
    # the fp8 forward (V transposed by fp8_value_operand, descales)
    import test_gpu_fp8 as t8
    fp8_cases = {"d128_causal": (128, dict(causal=True), 257, 257),
                 "d256_window": (256, dict(window_size=(64, 32)), 200, 300),
                 "d64_softcap": (64, dict(softcap=30.0, causal=True), 193, 61)}
    for name, (d, kw, sq, sk) in fp8_cases.items():
        out[f"fp8_{name}"] = lambda d=d, kw=kw, sq=sq, sk=sk: t8.check(
            *t8.fp8_inputs(1, sq, sk, 8, 2, d), **kw)
    out["fp8_varlen_d128_causal"] = lambda: t8.test_fp8_varlen(0, 128, "causal")  # (packed V^T)
    out["fp8_value_transpose_packed"] = lambda: t8.test_value_transpose_kernel_packed(0, [1000, 1, 0, 257, 64])
    # (up to 1024 queries the kernel transposes V itself: the staging ring, the transposing
    # warps' pipelines, the tile hand-off with them; several tiles a CTA here)
    out["fp8_d128_causal_two_sequences"] = lambda: t8.check(
        *t8.fp8_inputs(2, 700, 700, 8, 2, 128), causal=True)
    # packed sequences at d=64 (config.FP8_SHORT_TILES: two warpgroups, 4 stages)
    out["fp8_varlen_d64_window"] = lambda: t8.check_varlen(64, "window")
    # traced mods (a tensor-reading mask_mod on dense tiles and on lists; ALiBi; gradients)
    import test_gpu_mods as tm
    out["mods_document_dense"] = lambda: tm.test_dense_tiles(0, "document", 128, True, 700)
    out["mods_prefix_lists"] = lambda: tm.test_block_sparse_partial_blocks(0, "prefix", (128, 128))
    out["mods_alibi_document"] = lambda: tm.test_score_mods(0, "alibi", 64, True)
    out["mods_gradients"] = lambda: tm.test_mask_mod_gradients(0, "document", 128, True)
    out["mods_score_gradients"] = lambda: tm.test_score_mod_gradients(0, "softcap", 128, True)
    out["mods_packed_gradients"] = lambda: tm.test_packed_sequences_with_mods_gradients(
        0, "both", 64, True)
    out["mods_blocks_kernel"] = lambda: tm.test_mask_mod_blocks_kernel_matches_torch(
        0, "document", (128, 64), (63, 1031))  # (from_mask_mod's kernel, short last blocks)
    # the backward (dq, dk, dv through autograd, checked against the reference's gradients)
    import test_gpu_bwd as tb
    for d in (64, 96, 128):
        for mask, kw in fixed_masks.items():
            (h, hk), (sq, sk) = heads[mask], sizes[mask]
            out[f"bwd_d{d}_{mask}"] = lambda d=d, h=h, hk=hk, sq=sq, sk=sk, kw=kw: _bwd_fixed(
                tb, bf16, d, h, hk, sq, sk, **kw)
    out["bwd_d128_causal_deterministic"] = lambda: _bwd_fixed(
        tb, bf16, 128, 8, 2, 257, 257, deterministic=True, causal=True)
    out["bwd_varlen_d128_causal"] = lambda: _bwd_varlen(tb, lens_q, lens_k, causal=True)
    # padded head dims: the 96 kernel at 80 (q/k/v/dO read zero-filled, buffers at 96)
    out["bwd_d80_causal"] = lambda: _bwd_fixed(tb, bf16, 80, 8, 2, 257, 257, causal=True)
    out["bwd_varlen_d80"] = lambda: _bwd_varlen(tb, lens_q, lens_k, d=80)
    # head dims over 128: the warpgroups split the head dim (P^T and dS^T through shared memory)
    out["bwd_d256_causal_deterministic"] = lambda: _bwd_fixed(
        tb, bf16, 256, 8, 2, 257, 257, deterministic=True, causal=True)
    out["bwd_d192_window"] = lambda: _bwd_fixed(tb, bf16, 192, 4, 4, 129, 300, window_size=(64, 32))
    # plain d=256: dQ by the blocked reductions beside two Q/dO stages
    out["bwd_d256_none"] = lambda: _bwd_fixed(tb, bf16, 256, 8, 2, 257, 300)
    out["bwd_varlen_d176_padded_causal"] = lambda: _bwd_varlen(tb, lens_q, lens_k, d=176, causal=True)
    out["bwd_varlen_d224_padded_causal"] = lambda: _bwd_varlen(tb, lens_q, lens_k, d=224, causal=True)
    # rows past seqused zeroed by the producer before the GEMMs (NaN and Inf there)
    out["bwd_seqused_only_nan_past_the_end"] = lambda: tb.test_bwd_seqused_only(0, "causal", 128, True)
    out["bwd_varlen_d64_window_seqused_deterministic"] = lambda: _bwd_varlen(
        tb, lens_q, lens_k, d=64, deterministic=True, window_size=(64, 0),
        seqused_q=torch.tensor([0, 1, 10, 0, 129, 300], dtype=torch.int32, device="cuda"),
        seqused_k=torch.tensor([5, 0, 0, 100, 1, 700], dtype=torch.int32, device="cuda"))
    # packed forms that take dQ by TMA and the writer warp (packed softcap d=128), and d=64's
    # 128-row query steps over packed sequences
    out["bwd_varlen_d128_softcap"] = lambda: _bwd_varlen(tb, lens_q, lens_k, softcap=30.0)
    out["bwd_varlen_d64_causal"] = lambda: _bwd_varlen(tb, lens_q, lens_k, d=64, causal=True)
    for i, cfg in enumerate(g.BAD_CONFIGS):
        for name, case in g.BAD_CASES.items():
            out[f"bad{i}_{name}"] = lambda case=case, cfg=cfg: g.run_bad(case, **cfg)
    # the forward surface: padded head dims and head_dim_v < head_dim (outputs end where their
    # allocation ends, so a store past the head dim is an access memcheck sees), negative window
    # edges, one side packed, seqused on batched q/k
    import test_gpu_surface as su
    small_q, small_k = [1, 0, 63, 129, 300], [129, 65, 0, 300, 64]
    for d, dv in ((80, 80), (72, 40), (192, 128), (8, 8)):
        out[f"surface_varlen_d{d}v{dv}_causal"] = lambda d=d, dv=dv: su.run_varlen(
            small_q, small_k, 8, 2, d, dv, bf16, causal=True)
    out["surface_window_negative"] = lambda: su.run_varlen(
        small_q, small_k, 8, 2, 64, 64, fp16, window_size=(None, -5))
    out["surface_one_side_packed"] = lambda: su.run_varlen(
        small_q, small_k, 8, 2, 128, 128, bf16, batched_k=True, causal=True)
    # block-sparse: every physical block shape, mixed lists, a causal mask on top, lying lists
    import test_gpu_sparse as sp
    for bq, bk in sp.BLOCKS:
        out[f"sparse_{bq}x{bk}"] = lambda bq=bq, bk=bk: sp.check(
            *sp.inputs(1, 333, 400, 4, 2, 128, bf16), sp.random_lists(1, 4, 333, 400, (bq, bk), 3))
    out["sparse_causal_d64"] = lambda: sp.check(
        *sp.inputs(2, 300, 300, 4, 4, 64, fp16), sp.random_lists(2, 4, 300, 300, (128, 64), 2),
        causal=True)
    # (pairs of 64-key blocks at head dims of 64- and 32-byte swizzle atoms: narrower copies)
    out["sparse_pairs_d96"] = lambda: sp.check(
        *sp.inputs(1, 333, 400, 4, 2, 96, bf16), sp.random_lists(1, 4, 333, 400, (128, 64), 3))
    out["sparse_pairs_d80"] = lambda: sp.check(
        *sp.inputs(1, 333, 400, 4, 2, 80, fp16), sp.random_lists(1, 4, 333, 400, (64, 64), 3),
        causal=True)
    out["sparse_lying_lists"] = lambda: sp.test_lying_lists_stay_inside_the_tensors(0)
    out["sparse_packed_64x64"] = lambda: sp.test_packed_sequences(0, (64, 64), "causal")
    # (seqused_k: V past it zeroed in shared memory wherever its block is listed)
    out["sparse_packed_seqused_128x64"] = lambda: sp.test_packed_sequences_seqused_k_nan_past_it(
        0, (128, 64))
    out["sparse_packed_backward_128x64"] = lambda: sp.test_packed_sequences_backward(
        0, (128, 64), "none")
    out["sparse_backward_causal"] = lambda: sp.check_grads(
        *sp.inputs(1, 333, 400, 4, 2, 128, bf16), sp.random_lists(1, 4, 333, 400, (128, 128), 2),
        causal=True)
    out["sparse_backward_64x64_paired"] = lambda: sp.check_grads(  # (an odd last key block)
        *sp.inputs(1, 333, 320, 4, 2, 64, bf16), sp.random_lists(1, 4, 333, 320, (64, 64), 2))
    out["sparse_backward_deterministic"] = lambda: sp.check_grads(
        *sp.inputs(1, 333, 400, 4, 2, 128, bf16), sp.random_lists(1, 4, 333, 400, (128, 128), 2),
        deterministic=True)
    for bits, dtype in ((64, torch.int64), (32, torch.int32)):  # VSA's builder (topk_lists.py)
        out[f"sparse_topk_lists_int{bits}"] = lambda dtype=dtype: \
            sp.test_topk_lists_kernel_equals_the_pytorch_form(0, (64, 64), False, dtype)
    # learnable sinks on the sm90 forward and backward (tests/test_gpu_sinks.py)
    import test_gpu_sinks as sinks_tests
    out["surface_sink_causal"] = lambda: sinks_tests.test_rows_without_keys_and_large_sinks(0)
    out["surface_sink_packed"] = lambda: sinks_tests.test_sink_with_packed_sequences(0, True)
    # paged keys read by the sm90 forward (TMA per block from its page; NaN past the ends)
    out["surface_paged_d128_causal"] = lambda: su.run_paged_prefill(128, 128, causal=True)
    out["surface_paged_d64_page64"] = lambda: su.run_paged_prefill(64, 64)
    out["surface_paged_d128_page16"] = lambda: su.run_paged_prefill(16, 128, causal=True)
    out["surface_paged_sink_page64"] = lambda: su.run_paged_prefill(
        64, 128, causal=True, sink=torch.randn(8, device="cuda") * 2)
    out["surface_seqused_only"] = lambda: su.run_varlen(
        small_q, small_k, 8, 2, 128, 128, bf16, batched_q=True, batched_k=True,
        seqused_q=su.used([1, 0, 20, 129, 250]), seqused_k=su.used([100, 3, 0, 300, 1]))
    # V's rows past seqused_k zeroed in shared memory (NaN and Inf there), and small pages
    # gathered into batched K / V first (kernels/sm90/launch.py: GatheredPagesLaunch)
    out["surface_seqused_nan_past_the_end"] = lambda: su.run_varlen(
        small_q, small_k, 8, 2, 128, 128, bf16, batched_q=False, batched_k=True, causal=True,
        seqused_k=su.used([100, 3, 0, 300, 1]), poison=True)
    out["surface_paged_gathered_page16"] = _with_config(
        lambda: su.run_paged_prefill(16, 128, causal=True, pad_table=True),
        "PAGED_GATHER_MIN_ROWS", 0, family="sm90")
    # the portable (mma.sync) path, chosen with CUTEATTN_PATH=sm80: the forward, the decode
    # kernel (flash_attn_with_kvcache), the paged prefill, and the bad-metadata cases
    import test_gpu_sm80 as ts
    for d in (64, 96, 128, 192, 256):
        for mask, kw in fixed_masks.items():
            (h, hk), (sq, sk) = heads[mask], sizes[mask]
            out[f"portable_fixed_d{d}_{mask}"] = _on_sm80(
                lambda d=d, h=h, hk=hk, sq=sq, sk=sk, kw=kw: g.good_fixed(bf16, d, h, hk, sq, sk, b=1, **kw))
    out["portable_varlen_d128_window_seqused"] = _on_sm80(lambda: g.good_varlen(
        128, 8, 2, lens_q=lens_q, lens_k=lens_k, used_q=[0, 1, 10, 0, 129, 300],
        used_k=[5, 0, 0, 100, 1, 700], window_size=(64, 0)))
    for i, case in enumerate(ts.DECODE_CASES):
        b, sq, s_new, h, hk, d, cap, lens, extra = case
        out[f"portable_decode{i}"] = _on_sm80(lambda a=case[:8], extra=extra: ts.run_kvcache(*a, **extra))
    for i in (1, 3, 4, 7):  # an fp8 cache (its byte ring): paged, odd pages, new tokens, splits
        out[f"portable_decode_fp8_{i}"] = _on_sm80(
            lambda case=ts.FP8_DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8]))
    for i in (0, 1, 2):  # 2 CTAs an SM, as grids that fill the GPU run (these small ones: 1 or 3)
        out[f"portable_decode_two_ctas{i}"] = _on_sm80(_two_ctas_per_sm(
            lambda case=ts.DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8])))
    for i in (0, 1):
        out[f"portable_decode_fp8_two_ctas{i}"] = _on_sm80(_two_ctas_per_sm(
            lambda case=ts.FP8_DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8])))
    for i in (0, 2, 8):  # the warp-local tile (lanes read each other's bytes of the ring):
        # contiguous, splits of page 128, batch_idx + leftpad; and at 3 CTAs an SM
        out[f"portable_decode_fp8_local{i}"] = _on_sm80(
            lambda case=ts.FP8_DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8]))
        out[f"portable_decode_fp8_three_ctas{i}"] = _on_sm80(_with_config(
            lambda case=ts.FP8_DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8]),
            "decode_ctas_per_sm", lambda *args: 3))
    for i in (0, 1):  # the warp-local tile's MMAs in fp16 at q past fp16's range: Q's scale
        out[f"portable_decode_fp8_f16_{i}"] = _on_sm80(
            lambda case=ts.FP8_DECODE_CASES[i]: ts.run_kvcache(*case[:8], **case[8], q_scale=1e5,
                                                              k_scale=1e-5))
    for i in (0, 2, 4, 8):  # the merge folded into each tile's last split (config.decode_folds):
        # paged 128, rotary + page 16, d=192 causal, an fp8 cache with a split count chosen
        out[f"portable_decode_folded{i}"] = _on_sm80(_with_config(
            lambda case=ts.SPLIT_CASES[i]: ts.run_kvcache(*case[:8], **case[8]), "FOLD_MAX_STEPS",
            1 << 30))
    for i in range(len(ts.MANY_SPLIT_CASES)):  # the folded merge over more splits than lanes
        out[f"portable_decode_folded_many{i}"] = _on_sm80(_with_config(
            lambda case=ts.MANY_SPLIT_CASES[i]: ts.run_kvcache(*case[:8], **case[8]),
            "FOLD_MAX_STEPS", 1 << 30))
    import test_gpu_kv_append as tka  # the KV-cache update kernel: paged + rotary, fp8 + batch_idx
    for i in (1, 7):
        out[f"portable_kv_append{i}"] = lambda i=i: tka.test_kv_append_kernel_matches_torch_steps(0, tka.CASES[i])
    out["portable_paged_prefill_causal"] = _on_sm80(lambda: ts.test_paged_prefill(0, 16, True, 128))
    out["portable_paged_prefill_d96"] = _on_sm80(lambda: ts.test_paged_prefill(0, 128, False, 96))
    for d in (64, 128):  # the portable backward: the bwd group's masks, deterministic, varlen
        for mask, kw in fixed_masks.items():
            (h, hk), (sq, sk) = heads[mask], sizes[mask]
            out[f"portable_bwd_d{d}_{mask}"] = _on_sm80(
                lambda d=d, h=h, hk=hk, sq=sq, sk=sk, kw=kw: _bwd_fixed(tb, bf16, d, h, hk, sq, sk, **kw))
    out["portable_bwd_d80_causal_padded"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 80, 8, 2, 257, 257, causal=True))
    out["portable_bwd_d128_causal_deterministic"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 128, 8, 2, 257, 257, deterministic=True, causal=True))
    # head dims over 128: one pass of 64 x 64 tiles on the warp grids (bwd_grid.py) where
    # shared memory holds them, as on the GPU this runs on (the 99 KB targets: column passes)
    out["portable_bwd_d256_causal"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 256, 8, 2, 257, 257, causal=True))
    out["portable_bwd_d192_window"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 192, 8, 2, 200, 300, window_size=(64, 32)))
    # the last fallback tiles (launch_bwd.bwd_configs: 32 queries a block, with the Q/dO ring),
    # which sm_100a and sm_12x take with packed sequences at d=128
    out["portable_bwd_varlen_d128_causal_small_tile"] = _on_sm80(_with_env(
        "CUTEATTN_SM80_BWD_FALLBACK", "4", lambda: _bwd_varlen(tb, lens_q, lens_k, d=128, causal=True)))
    out["portable_bwd_varlen_d176_deterministic"] = _on_sm80(lambda: _bwd_varlen(
        tb, lens_q, lens_k, d=176, deterministic=True))
    # d=128 deterministic packed: the warp grid where it fits without spilling (launch_bwd)
    out["portable_bwd_varlen_d128_causal_deterministic"] = _on_sm80(lambda: _bwd_varlen(
        tb, lens_q, lens_k, d=128, causal=True, deterministic=True))
    out["portable_bwd_varlen_d64_window_seqused"] = _on_sm80(lambda: _bwd_varlen(
        tb, lens_q, lens_k, d=64, window_size=(64, 0),
        seqused_q=torch.tensor([0, 1, 10, 0, 129, 300], dtype=torch.int32, device="cuda"),
        seqused_k=torch.tensor([5, 0, 0, 100, 1, 700], dtype=torch.int32, device="cuda")))
    # v narrower than q and k: v and dO read zero-filled past their head dim
    out["portable_bwd_d192_v128_causal"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 192, 8, 2, 200, 300, dv=128, causal=True))
    out["portable_bwd_d128_v64_window"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 128, 8, 2, 257, 257, dv=64, window_size=(64, 32)))
    # both deterministic dQ forms at every head dim (launch_bwd.DQ_SPLITS_MAX_DIM 0: turns,
    # descending under masks; 256: split accumulators): 16 heads, so 8 splits (132 SMs) over
    # 9-18 key blocks walk 2-3 each; a window leaving key blocks that no query sees; packed
    # sequences
    for name, max_dim in (("descending_turns", 0), ("dq_splits", 256)):
        out[f"portable_bwd_d128_causal_{name}"] = _on_sm80(_with_dq_form(max_dim, lambda: _bwd_fixed(
            tb, bf16, 128, 16, 4, 200, 1100, deterministic=True, causal=True)))
        out[f"portable_bwd_d192_window_{name}"] = _on_sm80(_with_dq_form(max_dim, lambda: _bwd_fixed(
            tb, bf16, 192, 16, 2, 200, 1100, deterministic=True, window_size=(64, 32))))
        out[f"portable_bwd_varlen_d64_causal_{name}"] = _on_sm80(_with_dq_form(
            max_dim, lambda: _bwd_varlen(tb, lens_q, lens_k, d=64, causal=True, deterministic=True)))
    out["portable_bwd_d96_none_dq_splits"] = _on_sm80(lambda: _bwd_fixed(
        tb, bf16, 96, 16, 4, 300, 1100, deterministic=True))  # (the default form there)
    for i, cfg in enumerate(g.BAD_CONFIGS):
        for name, case in g.BAD_CASES.items():
            out[f"portable_bad{i}_{name}"] = _on_sm80(lambda case=case, cfg=cfg: g.run_bad(case, **cfg))
    return out


def _on_sm80(fn):
    """fn run with CUTEATTN_PATH=sm80 (the portable path serves every call)."""
    return _with_env("CUTEATTN_PATH", "sm80", fn)


def _with_env(name: str, value: str, fn):
    """fn run with the environment variable set (read when a call's launch is built), then
    unset."""
    def run():
        os.environ[name] = value
        try:
            fn()
        finally:
            del os.environ[name]
    return run


def _with_dq_form(max_dim: int, fn):
    """fn run with the portable backward's launch_bwd.DQ_SPLITS_MAX_DIM at `max_dim`, then the
    default again; the launches kept per spec are dropped before and after."""
    def run():
        from cuteattn import api
        from cuteattn.kernels.sm80 import launch_bwd
        chosen = launch_bwd.DQ_SPLITS_MAX_DIM
        launch_bwd.DQ_SPLITS_MAX_DIM = max_dim
        api._launches.clear()
        try:
            fn()
        finally:
            launch_bwd.DQ_SPLITS_MAX_DIM = chosen
            api._launches.clear()
    return run


def _two_ctas_per_sm(fn):
    """fn run with config.decode_ctas_per_sm held at 2, then restored."""
    return _with_config(fn, "decode_ctas_per_sm", lambda *args: 2)


def _with_config(fn, name: str, value, family: str = "sm80"):
    """fn run with the family's config `name` (kernels/sm80 or sm90 config.py) set to value,
    then restored; the calls' launches are dropped before and after (sm80: the decode steps',
    sm90: the forward's), so each side compiles and launches its own variant."""
    def launches():
        from cuteattn import api, kvcache
        return (api._launches,) if family == "sm90" else (kvcache._decode_launches, kvcache._steps)

    def run():
        import importlib
        config = importlib.import_module(f"cuteattn.kernels.{family}.config")
        chosen = getattr(config, name)
        setattr(config, name, value)
        for cache in launches():
            cache.clear()
        try:
            fn()
        finally:
            setattr(config, name, chosen)
            for cache in launches():
                cache.clear()
    return run


def _bwd_fixed(tb, dtype, d, h, hk, sq, sk, dv=None, **kw):
    import torch
    b = 1
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, dv or d, device="cuda", dtype=dtype, requires_grad=True)
    from cuteattn import flash_attn_func
    out = flash_attn_func(q, k, v, strict=True, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    kw.pop("deterministic", None)
    tb.check_grads(got, *tb.reference_grads(tb.attention_ref, (q, k, v), dout, **kw))


def _bwd_varlen(tb, lens_q, lens_k, d=128, **kw):
    import torch
    torch.cuda.synchronize()
    tb.poison_allocator = lambda: None  # each tensor is its own allocation here
    got, ref, low = tb.run_varlen(lens_q, lens_k, 8, 2, d, torch.bfloat16, **kw)
    tb.check_grads(got, ref, low)


def group_of(case: str) -> str:
    return re.match(r"fp8|[a-z]+", case)[0]  # fixed_d64_none -> fixed, bad2_used_huge -> bad


def child(names: list, guards: bool) -> int:
    """Run the named cases in order; a failing case is reported and the rest still run."""
    all_cases = cases()
    import config_overrides  # a candidate's switches (pytest's conftest.py is not loaded here)
    import test_gpu_guard as g

    config_overrides.apply()
    from cuteattn import compile_cache

    g.GUARDS = guards
    g.HANG_TIMEOUT_S = 3600  # the parent's process timeout is the hang check here
    failed = []
    for name in names:
        start = time.monotonic()
        try:
            all_cases[name]()
            print(f"case {name} ok ({time.monotonic() - start:.1f} s)", flush=True)
        except Exception:  # an assertion, a CUDA error, pytest.exit (a hang): report, go on
            failed.append(name)
            print(f"case {name} FAILED\n{traceback.format_exc()}", flush=True)
    stats = compile_cache.stats()
    print("CHILD_RESULT " + json.dumps({"failed": failed, "compiles": stats["compiles"],
                                        "disk_loads": stats["disk_loads"]}), flush=True)
    return 1 if failed else 0


# ---- the parent ----

def is_ours(kernel: str) -> bool:
    """Our kernels' symbols carry their module path (kernel_cutlass_kernel_cuteattnkernels...)."""
    return "cuteattn" in kernel


def parse(log: str) -> dict:
    """Sanitizer summary and the child's own result from one process's output."""
    res = {}
    m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    if m:
        res.update(hazards=int(m[1]), errors=int(m[2]), warnings=int(m[3]))
        # Hazards inside other libraries' kernels (cuBLAS's nvjet GEMMs, run by the reference's
        # low-precision baseline) are not ours to fix: listed, not counted as our errors.
        foreign = [k for k in re.findall(r"Error: Race reported between \w+ access at (\S+?)\+0x", log)
                   if not is_ours(k)]
        if foreign:
            res["errors"] -= len(foreign)
            res["foreign"] = sorted(set(foreign))
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", log)
    if m and "errors" not in res:
        res["errors"] = int(m[1])
    m = re.search(r"^CHILD_RESULT (.*)$", log, re.M)
    if m:
        res["child"] = json.loads(m[1])
    return res


def run_one(cmd, env, log_path: Path, timeout: float) -> dict:
    start = time.monotonic()
    # own process group: on a timeout the sanitizer's target process is killed with it
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, rc = proc.communicate()[0], "timeout"
    log_path.write_text(" ".join(cmd) + "\n\n" + log)
    res = parse(log)
    res.update(rc=rc, seconds=round(time.monotonic() - start, 1), log=log_path.name)
    child_res = res.get("child")
    # (--error-exitcode also fires for hazards in others' kernels; parse() counts only ours)
    exit_ok = rc == 0 or (rc == 1 and bool(res.get("foreign")))
    res["ok"] = (exit_ok and child_res is not None and not child_res["failed"]
                 and res.get("errors", 0) == 0)
    return res


def cell(res: dict, sanitized: bool) -> str:
    if res["rc"] == "timeout":
        return "TIMEOUT"
    child_res = res.get("child")
    if child_res is None:
        return f"CRASH rc={res['rc']}"
    if sanitized and "errors" not in res:
        return f"NO SUMMARY rc={res['rc']}"
    text = f"{res.get('errors', 0)} err" if sanitized else "ran"
    if "warnings" in res:
        text += f", {res['warnings']} warn"
    if res.get("foreign"):
        text += f" (+{len(res['foreign'])} in others' kernels: {', '.join(res['foreign'])})"
    if child_res["failed"]:
        text += f", {len(child_res['failed'])} case(s) failed"
    if sanitized and child_res["compiles"]:
        text += f", {child_res['compiles']} compiled under the tool"
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs="+", metavar="CASE", help=argparse.SUPPRESS)
    ap.add_argument("--no-guards", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tool", choices=TOOLS + ("all",), default="all",
                    help="all = " + ", ".join(ALL_TOOLS))
    ap.add_argument("--groups", default="fixed,varlen,fp8,mods,bwd,bad,surface,sparse,portable", help="comma-separated subset")
    ap.add_argument("--cases", default="", help="only cases whose name contains one of these (comma-separated)")
    ap.add_argument("--jobs", type=int, default=3, help="processes at once (warm-up and sanitizer)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="log directory (default $OUT)")
    ap.add_argument("--line-info", action="store_true",
                    help="CUTE_DSL_LINEINFO=1: kernels compiled with source line information")
    ap.add_argument("--skip-warmup", action="store_true", help="the disk cache is already warm")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per process")
    ap.add_argument("--sanitizer", default=shutil.which("compute-sanitizer")
                    or "/usr/local/cuda/bin/compute-sanitizer")
    args = ap.parse_args()
    if args.child:
        return child(args.child, guards=not args.no_guards)

    groups = {}
    for name in cases():
        if group_of(name) in args.groups.split(",") and (
                not args.cases or any(c in name for c in args.cases.split(","))):
            groups.setdefault(group_of(name), []).append(name)
    if not groups:
        ap.error(f"no case matches --groups {args.groups} --cases {args.cases}")
    tools = list(ALL_TOOLS) if args.tool == "all" else [args.tool]
    if not (Path(args.sanitizer).is_file() or shutil.which(args.sanitizer)):
        ap.error(f"no compute-sanitizer at {args.sanitizer} (pass --sanitizer PATH)")
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_sanitize_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CUTEATTN_DISK_CACHE="1", PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.line_info:
        env["CUTE_DSL_LINEINFO"] = "1"
    me = [sys.executable, str(Path(__file__).resolve())]

    jobs = []  # (tool or "warmup", group, command)
    if not args.skip_warmup:
        jobs += [("warmup", grp, me + ["--child", *cs]) for grp, cs in groups.items()]
    for tool in tools:
        jobs += [(tool, grp, [args.sanitizer, "--tool", tool, "--error-exitcode", "1",
                              *TOOL_FLAGS.get(tool, []), *me, "--child", *cs, "--no-guards"])
                 for grp, cs in groups.items()]
    results = {}
    with ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        for stage in ["warmup", *tools]:  # the warm-up finishes before any sanitizer starts
            stage_jobs = [j for j in jobs if j[0] == stage]
            futures = {(t, grp): pool.submit(run_one, cmd, env, out_dir / f"{t}-{grp}.log", args.timeout)
                       for t, grp, cmd in stage_jobs}
            for key, fut in futures.items():
                results[key] = fut.result()
                print(f"{key[0]:>9} {key[1]:<7} {cell(results[key], key[0] != 'warmup'):<40} "
                      f"{results[key]['seconds']:>7.1f} s", flush=True)

    stages = [s for s in ["warmup", *tools] if any(k[0] == s for k in results)]
    width = max(24, *(len(cell(r, k[0] != "warmup")) + 2 for k, r in results.items()))
    lines = ["tool".ljust(10) + "".join(g.ljust(width) for g in groups)]
    for s in stages:
        lines.append(s.ljust(10) + "".join(cell(results[(s, g)], s != "warmup").ljust(width)
                                           for g in groups))
    table = "\n".join(lines)
    print("\n" + table)
    ok = all(r["ok"] for r in results.values())
    summary = {"ok": ok, "tools": tools, "groups": groups, "line_info": args.line_info,
               "results": {f"{t}/{g}": r for (t, g), r in results.items()}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "summary.txt").write_text(table + "\n")
    print(f"\nlogs: {out_dir}\n{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
