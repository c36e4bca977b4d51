"""The sm90 kernels' runtime arguments, declared once: the forward's (ARGUMENTS) and the
backward's (BWD_ARGUMENTS).

`FlashFwdSm90.__call__` takes ARGUMENTS, in this order, then the stream (`FlashBwdSm90.__call__`
BWD_ARGUMENTS). The machinery that derives fakes, launch tuples and signature checks from a
declaration is common/arguments.py; the helpers here default to the forward's declaration.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..common import arguments as common
from ..common.arguments import (FLOAT32, INT32, NO_SPARSE, NO_VARLEN, OPTIONAL_TENSOR,
                                SCALAR_TYPES, SPARSE, STREAM, TENSOR, VARLEN, Arg, Group,
                                SparseMetadata, VarlenMetadata, int32_vector, key_side, lse_rows,
                                query_side)

__all__ = ["ARGUMENTS", "BWD_ARGUMENTS", "SCALARS", "Arg", "Binder", "FLOAT32", "Group", "INT32",
           "NO_SPARSE", "NO_VARLEN", "OPTIONAL_TENSOR", "SCALAR_TYPES", "STREAM", "TENSOR",
           "SparseMetadata", "VarlenMetadata",
           "fakes", "flat", "group_names", "names"]

ARGUMENTS = (
    Arg("mQ", TENSOR, query_side("head_dim")),
    Arg("mK", TENSOR, key_side("head_dim")),
    Arg("mV", TENSOR, key_side("head_dim_v")),
    Arg("mO", TENSOR, query_side("head_dim_v")),
    Arg("mLSE", TENSOR, lse_rows, align=4),
    VARLEN,
    SPARSE,
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


# ---- the backward's: the common list ----

BWD_ARGUMENTS = common.backward_arguments(extra=(SPARSE,))  # (the transposed block-sparse lists)


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
