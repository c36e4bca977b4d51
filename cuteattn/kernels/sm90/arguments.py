"""The sm90 kernels' runtime arguments, declared once: the forward's (ARGUMENTS) and the
backward's (BWD_ARGUMENTS).

`FlashFwdSm90.__call__` takes ARGUMENTS, in this order, then the stream (`FlashBwdSm90.__call__`
BWD_ARGUMENTS). The machinery that derives fakes, launch tuples and signature checks from a
declaration is common/arguments.py; the helpers here default to the forward's declaration.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8

from ..common import arguments as common
from ..common.arguments import (FLOAT32, INT32, NO_SPARSE, NO_VARLEN, OPTIONAL_TENSOR,
                                SCALAR_TYPES, SPARSE, STREAM, TENSOR, VARLEN, Arg, Group,
                                SparseMetadata, VarlenMetadata, int32_vector, key_side, lse_rows,
                                query_side)

__all__ = ["ARGUMENTS", "BWD_ARGUMENTS", "FP8_VALUE_ARGUMENTS", "MASK_BLOCKS_ARGUMENTS", "SCALARS", "Arg", "Binder", "FLOAT32", "Fp8Descales",
           "Group", "INT32", "ModTensors", "NO_FP8", "NO_MOD", "NO_SPARSE", "NO_VARLEN", "OPTIONAL_TENSOR", "SCALAR_TYPES", "STREAM", "TENSOR",
           "SparseMetadata", "VarlenMetadata",
           "fakes", "flat", "group_names", "names"]

class Fp8Descales(NamedTuple):
    """fp8 inputs' descales (FlashAttention-3's), float32 (b, h_k), 1.0 where not given; with
    packed keys, where each sequence's keys start in V^T (int32 (batch + 1,), fp8_value.py)."""
    q: Any = None
    k: Any = None
    v: Any = None
    cu_seqlens_v: Any = None


NO_FP8 = Fp8Descales()


def _in_dtype(declared, dtype_of):
    """A q/k/v/o fake as `declared` builds it, in dtype_of(cfg): fp8 tensors cross into the
    kernel as their bytes (uint8; the kernel reads them as e4m3), fp8's out is bf16."""
    def fake(cfg, sym, align, memspace):
        return declared(dataclasses.replace(cfg, dtype=dtype_of(cfg)), sym, align, memspace)
    return fake


_bytes_if_fp8 = lambda cfg: Uint8 if cfg.fp8 else cfg.dtype


def _value_side(cfg, sym, align, memspace):
    """v: as k (with d_v), or for fp8 transposed in bytes, (b, h_k, d_v, keys padded to 16) or
    packed (h_k, d_v, total16) (fp8_value.py), unless the kernel transposes it
    (fp8_v_in_kernel: as k, in bytes)."""
    if not cfg.fp8:
        return key_side("head_dim_v")(cfg, sym, align, memspace)
    if cfg.fp8_v_in_kernel:
        return key_side("head_dim_v")(dataclasses.replace(cfg, dtype=Uint8), sym, align, memspace)
    shape = ((sym["hk"], cfg.head_dim_v, sym["tk16"]) if cfg.varlen_k
             else (sym["bk"], sym["hk"], cfg.head_dim_v, sym["sk16"]))
    return common.fake_tensor(Uint8, shape, align, memspace)


def _descale(cfg, sym, align, memspace):
    if not cfg.fp8:
        return None
    return common.fake_tensor(Float32, (sym["bd"], sym["hk"]), align, memspace)


FP8 = Group("fp8", Fp8Descales, (
    Arg("mQDescale", OPTIONAL_TENSOR, _descale, align=4),
    Arg("mKDescale", OPTIONAL_TENSOR, _descale, align=4),
    Arg("mVDescale", OPTIONAL_TENSOR, _descale, align=4),
    Arg("mCuSeqlensV", OPTIONAL_TENSOR, lambda cfg, sym, align, memspace: common.fake_tensor(
        Int32, (cute.sym_int(),), align, memspace)
        if cfg.fp8 and cfg.varlen_k and not cfg.fp8_v_in_kernel else None, align=4),
))

class ModTensors(NamedTuple):
    """The tensors traced mods read (common/mods.py): a mask_mod's two, a score_mod's two,
    None past their counts."""
    mask0: Any = None
    mask1: Any = None
    score0: Any = None
    score1: Any = None


NO_MOD = ModTensors()


def _mod_tensor(i):
    def fake(cfg, sym, align, memspace):
        mod = getattr(cfg, "mask_mod" if i < 2 else "score_mod", None)
        if mod is None or i % 2 >= len(mod.tensors):
            return None
        from ..common.mods import TENSOR_DTYPES
        dtype, rank = mod.tensors[i % 2]
        return common.fake_tensor(TENSOR_DTYPES[dtype], tuple(cute.sym_int() for _ in range(rank)),
                                  align, memspace)
    return fake


MOD = Group("mod", ModTensors, (
    Arg("mModTensor0", OPTIONAL_TENSOR, _mod_tensor(0), align=4),
    Arg("mModTensor1", OPTIONAL_TENSOR, _mod_tensor(1), align=4),
    Arg("mModTensor2", OPTIONAL_TENSOR, _mod_tensor(2), align=4),
    Arg("mModTensor3", OPTIONAL_TENSOR, _mod_tensor(3), align=4),
))

ARGUMENTS = (
    Arg("mQ", TENSOR, _in_dtype(query_side("head_dim"), _bytes_if_fp8)),
    Arg("mK", TENSOR, _in_dtype(key_side("head_dim"), _bytes_if_fp8)),
    Arg("mV", TENSOR, _value_side),
    Arg("mO", TENSOR, _in_dtype(query_side("head_dim_v"), lambda cfg: cfg.o_dtype)),
    Arg("mLSE", TENSOR, lse_rows, align=4),
    VARLEN,
    SPARSE,
    FP8,
    MOD,
    # paged keys (Sm90FwdConfig.page_size): int32 (b, max_pages), each sequence's pages
    Arg("mPageTable", OPTIONAL_TENSOR, lambda cfg, sym, align, memspace: common.fake_tensor(
        Int32, (sym["table_b"], sym["pages"]), align, memspace) if cfg.page_size else None, align=4),
    # learnable sinks (Sm90FwdConfig.has_sink): float32 (h,), a logit per query head
    Arg("mSink", OPTIONAL_TENSOR, lambda cfg, sym, align, memspace: common.fake_tensor(
        Float32, (sym["h"],), align, memspace) if cfg.has_sink else None, align=4),
    # int32 (2,), zero between launches: the dynamic tile scheduler's counter (fwd.py)
    Arg("mTileCounter", TENSOR, int32_vector(), align=4),
    Arg("qhead_per_kvhead", INT32),
    Arg("score_scale", FLOAT32),          # softmax_scale, or softmax_scale / softcap
    Arg("softmax_scale_log2", FLOAT32),   # log2(e) * (softmax_scale, or softcap)
    Arg("window_left", INT32),            # 1 << 30: unbounded
    Arg("window_right", INT32),
    Arg("max_ctas", INT32),               # persistent grid size
    Arg("l2_group", INT32),               # pairs per small group of the causal tile order
    Arg("l2_small_groups", INT32),        # how many small groups
)


# ---- the fp8 forward's V transpose (fp8_value.py) ----

def _value_bytes(cfg, sym, align, memspace):
    """fp8 V's bytes: (b, s, h_k, d_v), or (total_k, h_k, d_v) packed."""
    shape = ((sym["total_k"], sym["hk"], cfg.head_dim_v) if cfg.varlen
             else (sym["bk"], sym["sk"], sym["hk"], cfg.head_dim_v))
    return common.fake_tensor(Uint8, shape, align, memspace)


def _value_transposed(cfg, sym, align, memspace):
    """V^T's bytes: (b, h_k, d_v, s16), or (h_k, d_v, total16) packed."""
    shape = ((sym["hk"], cfg.head_dim_v, sym["tk16"]) if cfg.varlen
             else (sym["bk"], sym["hk"], cfg.head_dim_v, sym["sk16"]))
    return common.fake_tensor(Uint8, shape, align, memspace)


def _packed_offsets(cfg, sym, align, memspace):
    return common.fake_tensor(Int32, (sym["batch1"],), align, memspace) if cfg.varlen else None


FP8_VALUE_ARGUMENTS = (
    Arg("mV", TENSOR, _value_bytes),
    Arg("mVt", TENSOR, _value_transposed),
    Arg("mCuSeqlensK", OPTIONAL_TENSOR, _packed_offsets, align=4),
    Arg("mCuSeqlensV", OPTIONAL_TENSOR, _packed_offsets, align=4),  # (written)
    Arg("max_seqlen", INT32),
)

# sparse.from_mask_mod's evaluation (common/mask_blocks.py): the mod's tensors, the block states
MASK_BLOCKS_ARGUMENTS = (
    Arg("mModTensor0", OPTIONAL_TENSOR, _mod_tensor(0), align=4),
    Arg("mModTensor1", OPTIONAL_TENSOR, _mod_tensor(1), align=4),
    Arg("mState", TENSOR, lambda cfg, sym, align, memspace: common.fake_tensor(
        Int32, (sym["b"], sym["h"], sym["nq"], sym["nk"]), align, memspace), align=4),
    Arg("seqlen_q", INT32),
    Arg("seqlen_k", INT32),
)


def _lists_table(*names, needed=lambda cfg: True):
    """An int32 table of the block-sparse lists (list_transpose.py), its extents by name."""
    def fake(cfg, sym, align, memspace):
        if not needed(cfg):
            return None
        return common.fake_tensor(Int32, tuple(sym[n] for n in names), align, memspace)
    return fake


# the backward's transposed lists (common/list_transpose.py): the forward's lists in, the key
# blocks' (or the pairs') out, and the halves' table of paired lists
LIST_TRANSPOSE_ARGUMENTS = (
    Arg("mFullCount", TENSOR, _lists_table("b", "h", "nq"), align=4),
    Arg("mFullIndex", TENSOR, _lists_table("b", "h", "nq", "nk"), align=4),
    Arg("mPartialCount", TENSOR, _lists_table("b", "h", "nq"), align=4),
    Arg("mPartialIndex", TENSOR, _lists_table("b", "h", "nq", "nk"), align=4),
    Arg("mOutFullCount", TENSOR, _lists_table("b", "h", "rows"), align=4),
    Arg("mOutFullIndex", TENSOR, _lists_table("b", "h", "rows", "nq"), align=4),
    Arg("mOutPartialCount", TENSOR, _lists_table("b", "h", "rows"), align=4),
    Arg("mOutPartialIndex", TENSOR, _lists_table("b", "h", "rows", "nq"), align=4),
    Arg("mHalves", OPTIONAL_TENSOR,
        _lists_table("b", "h", "nk", "nq", needed=lambda cfg: cfg.paired), align=4),
)

# VSA's builder (common/topk_lists.py): top-k key block indices in, one kind's lists out
TOPK_LISTS_ARGUMENTS = (
    Arg("mIndices", TENSOR, lambda cfg, sym, align, memspace: common.fake_tensor(
        cfg.index_dtype, (sym["b"], sym["h"], sym["nq"], sym["k"]), align, memspace), align=4),
    Arg("mCount", TENSOR, _lists_table("b", "h", "rows"), align=4),
    Arg("mIndex", TENSOR, _lists_table("b", "h", "rows", "nk"), align=4),
    Arg("mOtherCount", TENSOR, _lists_table("b", "h", "rows"), align=4),
    Arg("num_kv_blocks", INT32),
    Arg("rq", INT32),
    Arg("rk", INT32),
)

# ---- the backward's: the common list ----

class SparseBackward(NamedTuple):
    """The block-sparse backward's tables besides its lists (cuteattn.sparse): for lists of
    64-key blocks, whether key block n attends query block m (transpose_paired); in
    deterministic mode, each key block's turn to add into a query block's dQ (dq_turns)."""
    key_halves: Any = None  # int32 (B|1, H|1, nk64, nq)
    dq_turns: Any = None    # int32 (B|1, H|1, nq, nk)


def _int32_table(needed):
    def fake(cfg, sym, align, memspace):
        if not needed(cfg):
            return None
        return common.fake_tensor(Int32, tuple(cute.sym_int() for _ in range(4)), align, memspace)
    return fake


SPARSE_BACKWARD = Group("sparse_backward", SparseBackward, (
    Arg("mKeyHalves", OPTIONAL_TENSOR,
        _int32_table(lambda cfg: getattr(cfg, "sparse_kv_half", False)), align=4),
    Arg("mDqTurns", OPTIONAL_TENSOR,
        _int32_table(lambda cfg: getattr(cfg, "sparse", False) and cfg.deterministic), align=4),
))

class MaskModTensors(NamedTuple):
    """The backward's: the tensors a traced mask_mod reads, then a score_mod's (common/mods.py)."""
    t0: Any = None
    t1: Any = None
    t2: Any = None
    t3: Any = None


BWD_MOD = Group("bwd_mod", MaskModTensors, (
    Arg("mModTensor0", OPTIONAL_TENSOR, _mod_tensor(0), align=4),
    Arg("mModTensor1", OPTIONAL_TENSOR, _mod_tensor(1), align=4),
    Arg("mModTensor2", OPTIONAL_TENSOR, _mod_tensor(2), align=4),
    Arg("mModTensor3", OPTIONAL_TENSOR, _mod_tensor(3), align=4),
))

# (the transposed block-sparse lists and their tables; a mask_mod's tensors)
BWD_ARGUMENTS = common.backward_arguments(extra=(SPARSE, SPARSE_BACKWARD, BWD_MOD))


def flat(entries=ARGUMENTS) -> tuple:
    return common.flat(entries)


def names(entries=ARGUMENTS) -> tuple:
    return common.names(entries)


SCALARS = tuple(a for a in flat() if a.kind in SCALAR_TYPES)


def fakes(cfg, memspace=None, entries=ARGUMENTS) -> tuple:
    return common.fakes(cfg, entries, memspace)


def group_names(group: str, entries=ARGUMENTS) -> tuple:
    return common.group_names(group, entries)


def Binder(per_call: tuple, fixed: dict, convert: Optional[Callable] = None,
           entries=ARGUMENTS) -> common.Binder:
    return common.Binder(per_call, fixed, entries, convert)
