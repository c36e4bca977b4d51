"""Kernel arguments, declared once per kernel: the machinery every family's declaration uses.

A kernel family lists its kernel's parameters (after self, before the stream) as a tuple of `Arg`
and `Group` entries (kernels/sm90/arguments.py, kernels/sm80/arguments.py). Everything that has
to agree with that parameter list derives from the declaration: the symbolic fakes the kernel is
compiled against (`fakes`), the argument tuple a launch passes (`Binder`; the DLPack path converts
each value by the kind declared here) and the signature tests (tests/test_kernel_arguments.py). A
parameter added to a kernel is then one entry, not four edits that can disagree (they did: a
scalar was passed that the kernel no longer read).

Torch-free, like the kernels: the launch path hands torch tensors to these descriptors, not the
other way round.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Optional

import cutlass.cute as cute
from cutlass import Float32, Int32

# Argument kinds. An optional tensor is None when the config does not use it (the kernel is
# specialised on its absence); scalars are runtime values of one compiled kernel.
TENSOR = "tensor"
OPTIONAL_TENSOR = "optional tensor"
INT32 = "Int32"
FLOAT32 = "Float32"
SCALAR_TYPES = {INT32: Int32, FLOAT32: Float32}

# The kernel's last parameter. Not an entry of ARGUMENTS because the two call paths supply it
# differently: DLPack calls pass torch's current stream, TVM-FFI calls none (the compiled function
# takes the caller's current stream from the environment).
STREAM = "stream"


class VarlenMetadata(NamedTuple):
    """The packed-sequence tensors, one value on the Python side (None where not given);
    the kernel takes them as four positional parameters."""
    cu_seqlens_q: Any = None  # int32 (batch + 1,): q's rows of sequence b start at [b]
    cu_seqlens_k: Any = None
    seqused_q: Any = None     # int32 (batch,): rows of sequence b actually used
    seqused_k: Any = None


NO_VARLEN = VarlenMetadata()


class SparseMetadata(NamedTuple):
    """Block-sparse lists (cuteattn.sparse.BlockSparseMask), the kernel's four parameters: per
    (batch|1, head|1, query block) a count and an index list of full and of partial key blocks."""
    full_count: Any = None     # int32 (B|1, H|1, nq)
    full_index: Any = None     # int32 (B|1, H|1, nq, nk)
    partial_count: Any = None
    partial_index: Any = None


NO_SPARSE = SparseMetadata()


class Arg(NamedTuple):
    """One kernel parameter. `fake(cfg, symbols, align, memspace)` builds its compile-time stand-in
    (tensors only; None where the config has no such tensor); `align` is the byte alignment its
    base is promised, by the fake and by the runtime tensor a DLPack launch builds."""
    name: str
    kind: str
    fake: Optional[Callable] = None
    align: int = 16


class Group(NamedTuple):
    """Parameters that travel as one NamedTuple on the Python side (`type`), flattened in order."""
    name: str
    type: type
    members: tuple


# ---- how each tensor's fake is built from the config ----

class _Symbols(dict):
    """Symbolic extents shared between the fakes of one compile: q, o and lse have the same
    heads and rows, k and v the same keys. "h" and "hk" come first so that the symbols are
    created in the order earlier builds created them."""

    def __init__(self):
        super().__init__(h=cute.sym_int(), hk=cute.sym_int())

    def __missing__(self, name):
        value = self[name] = cute.sym_int()
        return value


def fake_tensor(dtype, shape, align, memspace):
    """A tensor of `shape` whose last mode is contiguous and every other stride symbolic.

    Every extent is symbolic, the head dim included, because that is how a runtime tensor marked
    with `mark_layout_dynamic` arrives: a static extent here would shift the runtime's dynamic
    values against the compiled signature (seen as swapped strides on 3-D tensors). The kernel
    takes its head dim from the static configuration, not from the tensor. Strides are promised
    to be multiples of `align` bytes (TMA needs 16; launch.py copies any tensor that is not).
    """
    div = max((align * 8) // dtype.width, 1)  # (an element wider than align: any stride)
    strides = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
    shape = tuple(cute.sym_int() if isinstance(x, int) else x for x in shape)
    where = {} if memspace is None else {"memspace": memspace}
    return cute.runtime.make_fake_tensor(dtype, shape, strides, assumed_align=align, **where)


def query_side(head_dim_field):
    """q and out: (total_q, h, d) packed, else (b, s_q, h, d)."""
    def fake(cfg, sym, align, memspace):
        d = getattr(cfg, head_dim_field)
        shape = ((sym["total_q"], sym["h"], d) if cfg.varlen_q
                 else (sym["b"], sym["sq"], sym["h"], d))
        return fake_tensor(cfg.dtype, shape, align, memspace)
    return fake


def key_side(head_dim_field):
    """k and v: (total_k, h_k, d) packed, else (b, s_k, h_k, d)."""
    def fake(cfg, sym, align, memspace):
        d = getattr(cfg, head_dim_field)
        shape = ((sym["total_k"], sym["hk"], d) if cfg.varlen_k
                 else (sym["bk"], sym["sk"], sym["hk"], d))
        return fake_tensor(cfg.dtype, shape, align, memspace)
    return fake


def lse_rows(cfg, sym, align, memspace):
    """float32, (h, total_q) packed, else (b, h, s_q): contiguous along the rows."""
    shape = (sym["h"], sym["total_q"]) if cfg.varlen_q else (sym["b"], sym["h"], sym["sq"])
    return fake_tensor(Float32, shape, align, memspace)


def int32_vector(used_when=None):
    """A 1-D int32 tensor; with `used_when` (a config field) None unless that field is set."""
    def fake(cfg, sym, align, memspace):
        if used_when is not None and not getattr(cfg, used_when):
            return None
        return fake_tensor(Int32, (cute.sym_int(),), align, memspace)
    return fake


# the packed-sequence tensors, in both kernels' parameter lists
VARLEN = Group("varlen", VarlenMetadata, (
    Arg("mCuSeqlensQ", OPTIONAL_TENSOR, int32_vector("varlen_q"), align=4),
    Arg("mCuSeqlensK", OPTIONAL_TENSOR, int32_vector("varlen_k"), align=4),
    Arg("mSeqUsedQ", OPTIONAL_TENSOR, int32_vector("has_seqused_q"), align=4),
    Arg("mSeqUsedK", OPTIONAL_TENSOR, int32_vector("has_seqused_k"), align=4),
))


def block_counts(cfg, sym, align, memspace):
    """int32 (B|1, H|1, nq): a block-sparse kernel's counts (None when dense). Extents of their
    own: the full and partial lists may broadcast over different modes."""
    if not cfg.sparse:
        return None
    return fake_tensor(Int32, tuple(cute.sym_int() for _ in range(3)), align, memspace)


def block_lists(cfg, sym, align, memspace):
    """int32 (B|1, H|1, nq, nk): a block-sparse kernel's index lists (None when dense)."""
    if not cfg.sparse:
        return None
    return fake_tensor(Int32, tuple(cute.sym_int() for _ in range(4)), align, memspace)


# the block-sparse lists, in the sm90 forward's parameter list
SPARSE = Group("sparse", SparseMetadata, (
    Arg("mFullCount", OPTIONAL_TENSOR, block_counts, align=4),
    Arg("mFullIndex", OPTIONAL_TENSOR, block_lists, align=4),
    Arg("mPartialCount", OPTIONAL_TENSOR, block_counts, align=4),
    Arg("mPartialIndex", OPTIONAL_TENSOR, block_lists, align=4),
))


# ---- the backward kernels' (sm90 and sm80) ----

def key_side_per_query_head(cfg, sym, align, memspace):
    """dk and dv: like k, with the query heads (the launch sums them per kv head under GQA)."""
    shape = ((sym["total_k"], sym["h"], cfg.head_dim) if cfg.varlen_k
             else (sym["bk"], sym["sk"], sym["h"], cfg.head_dim))
    return fake_tensor(cfg.dtype, shape, align, memspace)


def rows_padded(cfg, sym, align, memspace):
    """LSE (log2 units) and D, float32: like lse, with the rows padded
    (launch_common.bwd_preprocess), an extent of their own."""
    shape = (sym["h"], sym["rows_pad"]) if cfg.varlen_q else (sym["b"], sym["h"], sym["rows_pad"])
    return fake_tensor(Float32, shape, align, memspace)


def dq_accumulator(cfg, sym, align, memspace):
    """float32, shaped like q."""
    shape = ((sym["total_q"], sym["h"], cfg.head_dim) if cfg.varlen_q
             else (sym["b"], sym["sq"], sym["h"], cfg.head_dim))
    return fake_tensor(Float32, shape, align, memspace)


def semaphores(cfg, sym, align, memspace):
    """int32 (h, slots): one per query block (deterministic mode; a (h, 1) stand-in otherwise)."""
    return fake_tensor(Int32, (sym["h"], cute.sym_int()), align, memspace)


def backward_arguments(extra: tuple = ()) -> tuple:
    """A backward kernel's parameters: the tensors, the varlen group, the semaphores of the
    deterministic mode, `extra` (a family's own tensors), the scalars."""
    return (
        Arg("mQ", TENSOR, query_side("head_dim")),
        Arg("mK", TENSOR, key_side("head_dim")),
        Arg("mV", TENSOR, key_side("head_dim")),
        Arg("mdO", TENSOR, query_side("head_dim")),
        Arg("mLSE2", TENSOR, rows_padded, align=4),
        Arg("mD", TENSOR, rows_padded, align=4),
        Arg("mdQacc", TENSOR, dq_accumulator),
        Arg("mdK", TENSOR, key_side_per_query_head),
        Arg("mdV", TENSOR, key_side_per_query_head),
        VARLEN,
        Arg("mSemaphore", TENSOR, semaphores, align=4),
        *extra,
        Arg("qhead_per_kvhead", INT32),
        Arg("softmax_scale", FLOAT32),
        Arg("score_scale", FLOAT32),          # softmax_scale, or softmax_scale / softcap
        Arg("softmax_scale_log2", FLOAT32),   # log2(e) * (softmax_scale, or softcap)
        Arg("window_left", INT32),            # 1 << 30: unbounded
        Arg("window_right", INT32),
        Arg("num_n_blocks", INT32),           # grid x: key blocks (per sequence, or a packed bound)
        Arg("heads_interleaved", INT32),      # grid x interleaves this many heads' key blocks
    )


# the backward's preprocess (common/bwd_preprocess.py), for both families
PREPROCESS_ARGUMENTS = (
    Arg("mO", TENSOR, query_side("head_dim_v")),
    Arg("mdO", TENSOR, query_side("head_dim_v")),
    Arg("mLSE", TENSOR, lse_rows, align=4),
    Arg("mLSE2", TENSOR, rows_padded, align=4),
    Arg("mD", TENSOR, rows_padded, align=4),
    Arg("mCuSeqlensQ", OPTIONAL_TENSOR, int32_vector("varlen_q"), align=4),
    Arg("mSeqUsedQ", OPTIONAL_TENSOR, int32_vector("has_seqused_q"), align=4),
)


# a group's members pair with its NamedTuple's fields by position
assert len(VARLEN.members) == len(VARLEN.type._fields)
assert len(SPARSE.members) == len(SPARSE.type._fields)


def flat(entries) -> tuple:
    """Every Arg in the kernel's parameter order (groups expanded)."""
    return tuple(a for e in entries for a in (e.members if isinstance(e, Group) else (e,)))


def names(entries) -> tuple:
    """The kernel's parameter names, less self and the stream."""
    return tuple(a.name for a in flat(entries))


def fakes(cfg, entries, memspace=None) -> tuple:
    """Compile-time stand-ins for every argument but the stream, in order: symbolic tensors (None
    for the optional ones the config does not use) and placeholder scalars (their values are not
    compiled in). A `memspace` other than global memory only serves host-side tests."""
    sym = _Symbols()
    return tuple(SCALAR_TYPES[a.kind](0) if a.kind in SCALAR_TYPES
                 else a.fake(cfg, sym, a.align, memspace) for a in flat(entries))


def group_names(group: str, entries) -> tuple:
    """The parameter names of a group's members, in the order of its NamedTuple's fields."""
    (entry,) = (e for e in entries if isinstance(e, Group) and e.name == group)
    return tuple(a.name for a in entry.members)


class Binder:
    """Lays out the kernel's positional arguments, less the stream, from the values a launch
    knows when it is made (`fixed`, by parameter name: the scalars) and those each call passes
    (`per_call`: parameter names, in the order the call passes them). The layout is worked out
    here, once, from the declaration: a call costs a tuple build (looking each value up by name
    on every call cost ~1 us, as much as the whole TVM-FFI call). `convert(arg, value)`, when
    given, turns values into what the call path needs (launch.py's DLPack path: cute tensors,
    Int32, Float32); the fixed ones are converted here, once."""

    def __init__(self, per_call: tuple, fixed: dict, entries, convert: Optional[Callable] = None):
        by_name = {a.name: a for a in flat(entries)}
        given = tuple(per_call) + tuple(fixed)
        if sorted(given) != sorted(by_name):
            raise ValueError(f"values for {given}; the kernel takes {tuple(by_name)}")
        self._per_call = tuple(by_name[n] for n in per_call)
        self._fixed = tuple(v if convert is None else convert(by_name[n], v)
                            for n, v in fixed.items())
        self._convert = convert
        order = tuple(given.index(n) for n in by_name)
        self._pick = None if order == tuple(range(len(order))) else operator.itemgetter(*order)

    def __call__(self, *values) -> tuple:
        if self._convert is not None:
            values = tuple(map(self._convert, self._per_call, values))
        args = values + self._fixed
        return args if self._pick is None else self._pick(args)
