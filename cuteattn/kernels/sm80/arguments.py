"""The sm80 forward's runtime arguments, declared once (common/arguments.py says what derives
from a declaration). `FlashFwdSm80.__call__` takes ARGUMENTS, in this order, then the stream."""
import dataclasses
from typing import Any, NamedTuple

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from ..common import arguments as common
from ..common.arguments import (FLOAT32, INT32, OPTIONAL_TENSOR, TENSOR, VARLEN, Arg, Group,
                                fake_tensor, int32_vector, key_side, lse_rows, query_side)


class CacheMetadata(NamedTuple):
    """A KV cache's index tensors, the split-KV outputs and an fp8 cache's descales
    (flash_attn_with_kvcache), None where not used; the kernel takes them as eight positional
    parameters."""
    kv_batch_idx: Any = None  # int32 (b,): cache_batch_idx
    leftpad_k: Any = None     # int32 (b,): cache_leftpad
    page_table: Any = None    # int32 (b, max_pages): block_table
    o_partial: Any = None     # float32 (splits, b, s_q, h, d_v)
    lse_partial: Any = None   # float32 (splits, b, h, s_q)
    split_counts: Any = None  # int32 (>= tiles,): zero (fold_combine)
    k_descale: Any = None     # float32 (b, h_k): an fp8 cache's k descales
    v_descale: Any = None     # float32 (b, h_k): its v descales


NO_CACHE = CacheMetadata()


def _page_table(cfg, sym, align, memspace):
    if not cfg.paged_kv:
        return None
    return fake_tensor(Int32, (sym["b"], cute.sym_int()), align, memspace)


def _o_partial(cfg, sym, align, memspace):
    if not cfg.split_kv:
        return None
    return fake_tensor(Float32, (sym["splits"], sym["b"], sym["sq"], sym["h"], cfg.head_dim_v),
                       align, memspace)


def _lse_partial(cfg, sym, align, memspace):
    if not cfg.split_kv:
        return None
    return fake_tensor(Float32, (sym["splits"], sym["b"], sym["h"], sym["sq"]), align, memspace)


def _split_counts(cfg, sym, align, memspace):
    if not cfg.fold_combine:
        return None
    return fake_tensor(Int32, (cute.sym_int(),), align, memspace)


def _descale(cfg, sym, align, memspace):
    if cfg.kv_fp8 is None:
        return None
    return fake_tensor(Float32, (cute.sym_int(), cute.sym_int()), align, memspace)  # (b, h_k)


def cache_side(head_dim_field):
    """k and v as key_side declares them; an fp8 cache's as its bytes (uint8: torch tensors of
    fp8 cross into the kernel as their storage, the kernel reads them as cfg.kv_fp8)."""
    declared = key_side(head_dim_field)

    def fake(cfg, sym, align, memspace):
        if cfg.kv_fp8 is None:
            return declared(cfg, sym, align, memspace)
        return declared(dataclasses.replace(cfg, dtype=Uint8), sym, align, memspace)
    return fake


CACHE = Group("cache", CacheMetadata, (
    Arg("mKvBatchIdx", OPTIONAL_TENSOR, int32_vector("kv_batch_idx"), align=4),
    Arg("mLeftpadK", OPTIONAL_TENSOR, int32_vector("leftpad_k"), align=4),
    Arg("mPageTable", OPTIONAL_TENSOR, _page_table, align=4),
    Arg("mOPartial", OPTIONAL_TENSOR, _o_partial),
    Arg("mLSEPartial", OPTIONAL_TENSOR, _lse_partial, align=4),
    Arg("mSplitCounts", OPTIONAL_TENSOR, _split_counts, align=4),
    Arg("mKDescale", OPTIONAL_TENSOR, _descale, align=4),
    Arg("mVDescale", OPTIONAL_TENSOR, _descale, align=4),
))
assert len(CACHE.members) == len(CACHE.type._fields)

ARGUMENTS = (
    Arg("mQ", TENSOR, query_side("head_dim")),
    Arg("mK", TENSOR, cache_side("head_dim")),    # or paged: (pages, page_size, h_k, d)
    Arg("mV", TENSOR, cache_side("head_dim_v")),
    Arg("mO", TENSOR, query_side("head_dim_v")),
    Arg("mLSE", TENSOR, lse_rows, align=4),
    VARLEN,
    CACHE,
    # learnable sinks (Sm80FwdConfig.has_sink): float32 (h,), a logit per query head
    Arg("mSink", OPTIONAL_TENSOR, lambda cfg, sym, align, memspace: fake_tensor(
        Float32, (sym["h"],), align, memspace) if cfg.has_sink else None,
        align=4),
    Arg("qhead_per_kvhead", INT32),
    Arg("score_scale", FLOAT32),          # softmax_scale, or softmax_scale / softcap
    Arg("softmax_scale_log2", FLOAT32),   # log2(e) * (softmax_scale, or softcap)
    Arg("window_left", INT32),            # 1 << 30: unbounded
    Arg("window_right", INT32),
    Arg("num_splits", INT32),             # key ranges per tile (split_kv; else 1)
    Arg("l2_group", INT32),               # pairs per small group of the causal tile order
    Arg("l2_small_groups", INT32),        # how many small groups
)
SCALARS = tuple(a for a in common.flat(ARGUMENTS) if a.kind in common.SCALAR_TYPES)


def fakes(cfg) -> tuple:
    return common.fakes(cfg, ARGUMENTS)


# ---- the combine kernel's (combine.CombineSplits) ----

def _combine_o_partial(cfg, sym, align, memspace):
    return fake_tensor(Float32, (sym["splits"], sym["b"], sym["sq"], sym["h"], cfg.head_dim_v),
                       align, memspace)


def _combine_lse_partial(cfg, sym, align, memspace):
    return fake_tensor(Float32, (sym["splits"], sym["b"], sym["h"], sym["sq"]), align, memspace)


def _combine_sink(cfg, sym, align, memspace):
    return fake_tensor(Float32, (sym["h"],), align, memspace) if cfg.has_sink else None


def _combine_out(cfg, sym, align, memspace):
    return fake_tensor(cfg.dtype, (sym["b"], sym["sq"], sym["h"], cfg.head_dim_v), align, memspace)


def _combine_lse(cfg, sym, align, memspace):
    return fake_tensor(Float32, (sym["b"], sym["h"], sym["sq"]), align, memspace)


COMBINE_ARGUMENTS = (
    Arg("mOPartial", TENSOR, _combine_o_partial),
    Arg("mLSEPartial", TENSOR, _combine_lse_partial, align=4),
    Arg("mSink", OPTIONAL_TENSOR, _combine_sink, align=4),
    Arg("mO", TENSOR, _combine_out),
    Arg("mLSE", TENSOR, _combine_lse, align=4),
    Arg("num_splits", INT32),
)


def combine_fakes(cfg) -> tuple:
    return common.fakes(cfg, COMBINE_ARGUMENTS)


# ---- the KV-cache update's (common/kv_append.KvAppend) ----

def _append_rows(dtype_of, last_field, rows_key, needed=lambda cfg: True, heads="hk"):
    """A (b, rows, heads, d) tensor of the update: q and its rotated copy, new k / v."""
    def fake(cfg, sym, align, memspace):
        if not needed(cfg):
            return None
        return fake_tensor(dtype_of(cfg), (sym["b"], sym[rows_key], sym[heads], getattr(cfg, last_field)),
                           align, memspace)
    return fake


def _append_cache(last_field):
    """k_cache / v_cache: (rows or pages, capacity or page size, h_k, d); an fp8 one's bytes."""
    def fake(cfg, sym, align, memspace):
        dtype = Uint8 if cfg.cache_fp8 else cfg.dtype
        return fake_tensor(dtype, (sym["cache_rows"], sym["cache_len"], sym["hk"],
                                   getattr(cfg, last_field)), align, memspace)
    return fake


def _append_vector(needed=lambda cfg: True):
    def fake(cfg, sym, align, memspace):
        return fake_tensor(Int32, (sym["b"],), align, memspace) if needed(cfg) else None
    return fake


def _append_rotary(cfg, sym, align, memspace):
    if cfg.rotary is None:
        return None
    return fake_tensor(cfg.rotary_dtype, (sym["positions"], sym["half"]), align, memspace)


def _append_descale(cfg, sym, align, memspace):
    return fake_tensor(Float32, (sym["b"], sym["hk"]), align, memspace) if cfg.cache_fp8 else None


_dtype = lambda cfg: cfg.dtype
KV_APPEND_ARGUMENTS = (
    Arg("mQ", TENSOR, _append_rows(_dtype, "head_dim", "sq", heads="h")),
    Arg("mQRot", OPTIONAL_TENSOR, _append_rows(_dtype, "head_dim", "sq", lambda cfg: cfg.rotary is not None, heads="h")),
    Arg("mK", OPTIONAL_TENSOR, _append_rows(_dtype, "head_dim", "snew", lambda cfg: cfg.append)),
    Arg("mV", OPTIONAL_TENSOR, _append_rows(_dtype, "head_dim_v", "snew", lambda cfg: cfg.append)),
    Arg("mKCache", TENSOR, _append_cache("head_dim")),
    Arg("mVCache", TENSOR, _append_cache("head_dim_v")),
    Arg("mCacheSeqlens", TENSOR, _append_vector(), align=4),
    Arg("mBatchIdx", OPTIONAL_TENSOR, _append_vector(lambda cfg: cfg.batch_idx), align=4),
    Arg("mBlockTable", OPTIONAL_TENSOR, lambda cfg, sym, align, memspace: fake_tensor(
        Int32, (sym["b"], sym["pages"]), align, memspace) if cfg.paged else None, align=4),
    Arg("mCos", OPTIONAL_TENSOR, _append_rotary, align=4),
    Arg("mSin", OPTIONAL_TENSOR, _append_rotary, align=4),
    Arg("mKDescale", OPTIONAL_TENSOR, _append_descale, align=4),
    Arg("mVDescale", OPTIONAL_TENSOR, _append_descale, align=4),
    Arg("mSeqUsed", TENSOR, _append_vector(), align=4),
)


# ---- the backward's (bwd.FlashBwdSm80): the common list ----

BWD_ARGUMENTS = common.backward_arguments()


def bwd_fakes(cfg) -> tuple:
    return common.fakes(cfg, BWD_ARGUMENTS)
