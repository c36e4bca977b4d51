"""The sm80 forward's runtime arguments, declared once (common/arguments.py says what derives
from a declaration). `FlashFwdSm80.__call__` takes ARGUMENTS, in this order, then the stream."""
from ..common import arguments as common
from ..common.arguments import (FLOAT32, INT32, TENSOR, VARLEN, Arg, key_side, lse_rows,
                                query_side)

ARGUMENTS = (
    Arg("mQ", TENSOR, query_side("head_dim")),
    Arg("mK", TENSOR, key_side("head_dim")),
    Arg("mV", TENSOR, key_side("head_dim_v")),
    Arg("mO", TENSOR, query_side("head_dim_v")),
    Arg("mLSE", TENSOR, lse_rows, align=4),
    VARLEN,
    Arg("qhead_per_kvhead", INT32),
    Arg("score_scale", FLOAT32),          # softmax_scale, or softmax_scale / softcap
    Arg("softmax_scale_log2", FLOAT32),   # log2(e) * (softmax_scale, or softcap)
    Arg("window_left", INT32),            # 1 << 30: unbounded
    Arg("window_right", INT32),
    Arg("l2_group", INT32),               # pairs per small group of the causal tile order
    Arg("l2_small_groups", INT32),        # how many small groups
)
SCALARS = tuple(a for a in common.flat(ARGUMENTS) if a.kind in common.SCALAR_TYPES)


def fakes(cfg) -> tuple:
    return common.fakes(cfg, ARGUMENTS)
