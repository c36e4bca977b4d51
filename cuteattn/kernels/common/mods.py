"""FlexAttention's mask_mod and score_mod compiled into a kernel.

A mask_mod(b, h, q_idx, kv_idx) -> bool, or a score_mod(score, b, h, q_idx, kv_idx) -> score,
written with Python operators (comparisons, + - * / // %, & | ~), indexing of torch tensors
(document ids, prefix lengths, ALiBi slopes: ones it closes over or module-level ones it names)
and torch's element-wise functions that TorchInKernel lists (torch.tanh for a softcap,
torch.where, ...) is traced by the DSL with the kernel's own index values: each such tensor
becomes a kernel argument (a cute tensor in its place while tracing), and everything else it
reads (closure constants, module-level numbers it names) becomes part of the kernel's compile
key, so a changed constant compiles anew. A mod that calls other torch functions (or tensor
methods, such as .abs()) or is otherwise not traceable keeps running on the reference (the API
says why).

`KernelMod` is that key (a frozen dataclass, the config field of a kernel that applies the
mod; launch_common.mod_key reads a function into one); `apply_mask_mod` and `apply_score_mod`
apply them to a score tile; `value_and_grad` traces a score_mod with its derivative (Dual).
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from .mask import column_span

MAX_TENSORS = 2  # tensors a mod may read (kernel arguments: a mask_mod's mModTensor0, 1; a
# score_mod's mModTensor2, 3)
# the dtypes of those tensors, by name, and their DSL types (int64 tensors, as torch.arange
# makes them, reach the kernel as int32: launch_common.mod_tensors_of converts them)
TENSOR_DTYPES = {"int32": cutlass.Int32, "float32": cutlass.Float32}


@dataclass(frozen=True)
class KernelMod:
    """A mask_mod or score_mod as a compile key (launch_common.mod_key builds it from the
    function)."""
    kind: str               # "mask_mod" or "score_mod"
    name: str               # the function's name, for messages and key text
    code: str               # digest of its code (marshal of the code object)
    constants: tuple        # its closure's other values and the module-level numbers it names
    tensors: tuple          # (dtype name, rank) of each tensor it reads, in argument order
    tensor_cells: tuple     # the closure slots holding tensors, in order
    tensor_names: tuple     # then the module-level names holding tensors, in order


def traced(fn, mod: KernelMod, cute_tensors: tuple):
    """fn with the tensors it reads replaced by `cute_tensors` (in mod.tensors' order), and the
    torch module it names by TorchInKernel: what the kernel calls while it is traced."""
    cells = list(fn.__closure__ or ())
    for slot, t in zip(mod.tensor_cells, cute_tensors):
        cells[slot] = types.CellType(t)
    names = dict(zip(mod.tensor_names, cute_tensors[len(mod.tensor_cells):]))
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if isinstance(value, types.ModuleType) and value.__name__ == "torch":
            names[name] = TorchInKernel
    scope = {**fn.__globals__, **names} if names else fn.__globals__
    return types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                              tuple(cells) or None)


def _float(x):
    return x if isinstance(x, Float32) else Float32(x)


class Dual:
    """A score and its derivative by the raw score (forward-mode differentiation): what the
    backward passes a score_mod as `score`, so that tracing the user's function also traces
    d mod / d score (a score_mod's gradient). Arithmetic with plain values (indices, tensor
    elements, constants) keeps the derivative's chain rule; comparisons compare the values."""

    def __init__(self, value, deriv):
        self.v, self.d = _float(value), _float(deriv)

    @staticmethod
    def parts(x):
        return (x.v, x.d) if isinstance(x, Dual) else (_float(x), Float32(0.0))

    def __add__(self, other):
        v, d = Dual.parts(other)
        return Dual(self.v + v, self.d + d)

    __radd__ = __add__

    def __sub__(self, other):
        v, d = Dual.parts(other)
        return Dual(self.v - v, self.d - d)

    def __rsub__(self, other):
        v, d = Dual.parts(other)
        return Dual(v - self.v, d - self.d)

    def __mul__(self, other):
        v, d = Dual.parts(other)
        return Dual(self.v * v, self.d * v + self.v * d)

    __rmul__ = __mul__

    def __truediv__(self, other):
        v, d = Dual.parts(other)
        return Dual(self.v / v, (self.d * v - self.v * d) / (v * v))

    def __rtruediv__(self, other):
        v, d = Dual.parts(other)
        return Dual(v / self.v, (d * self.v - v * self.d) / (self.v * self.v))

    def __neg__(self):
        return Dual(-self.v, -self.d)

    def __lt__(self, other):
        return self.v < Dual.parts(other)[0]

    def __le__(self, other):
        return self.v <= Dual.parts(other)[0]

    def __gt__(self, other):
        return self.v > Dual.parts(other)[0]

    def __ge__(self, other):
        return self.v >= Dual.parts(other)[0]


def _unary(x, f, df):
    """f(x), and for a Dual the chain rule with df(value, f(value))."""
    if isinstance(x, Dual):
        y = f(x.v)
        return Dual(y, x.d * df(x.v, y))
    return f(_float(x))


def _both_tensors(name, a, b):
    """torch.minimum/maximum refuse a Python number; so does the traced form, so that a mod
    behaves the same in the kernel and in the reference (which runs it in eager torch)."""
    if any(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        raise TypeError(f"torch.{name} takes two tensors, as in eager torch; for a constant "
                        f"bound write torch.clamp(x, {'max' if name == 'minimum' else 'min'}=c)")


class TorchInKernel:
    """What `torch.<function>` means inside a traced mod. FlexAttention's mods apply torch's
    element-wise functions to index and score tensors; the kernel calls a mod on one element at
    a time, so each function here is the DSL's scalar operation (transcendentals in the fast
    approximate forms the kernel's own softcap uses). A function not listed leaves the mod
    untraceable (the reference then serves it, saying so)."""

    @staticmethod
    def tanh(x):
        return _unary(x, lambda v: cute.math.tanh(v, fastmath=True),
                      lambda v, y: Float32(1.0) - y * y)

    @staticmethod
    def exp(x):
        return _unary(x, lambda v: cute.math.exp(v, fastmath=True), lambda v, y: y)

    @staticmethod
    def exp2(x):
        return _unary(x, lambda v: cute.math.exp2(v, fastmath=True),
                      lambda v, y: y * Float32(0.6931471805599453))

    @staticmethod
    def log(x):
        return _unary(x, lambda v: cute.math.log(v, fastmath=True), lambda v, y: Float32(1.0) / v)

    @staticmethod
    def log2(x):
        return _unary(x, lambda v: cute.math.log2(v, fastmath=True),
                      lambda v, y: Float32(1.4426950408889634) / v)

    @staticmethod
    def sqrt(x):
        return _unary(x, lambda v: cute.math.sqrt(v, fastmath=True),
                      lambda v, y: Float32(0.5) / y)

    @staticmethod
    def sigmoid(x):
        return _unary(x, lambda v: Float32(1.0) / (Float32(1.0) + cute.math.exp(-v, fastmath=True)),
                      lambda v, y: y * (Float32(1.0) - y))

    @staticmethod
    def abs(x):
        if isinstance(x, Dual):
            return TorchInKernel.where(x.v < Float32(0.0), -x, x)
        return cutlass.max(x, -x)

    @staticmethod
    def _smaller(a, b):
        if isinstance(a, Dual) or isinstance(b, Dual):
            return TorchInKernel.where(a <= b, a, b)
        return cutlass.min(a, b)

    @staticmethod
    def _larger(a, b):
        if isinstance(a, Dual) or isinstance(b, Dual):
            return TorchInKernel.where(a >= b, a, b)
        return cutlass.max(a, b)

    @staticmethod
    def minimum(a, b):
        _both_tensors("minimum", a, b)
        return TorchInKernel._smaller(a, b)

    @staticmethod
    def maximum(a, b):
        _both_tensors("maximum", a, b)
        return TorchInKernel._larger(a, b)

    @staticmethod
    def clamp(x, min=None, max=None):
        if min is not None:
            x = TorchInKernel._larger(x, min)
        if max is not None:
            x = TorchInKernel._smaller(x, max)
        return x

    @staticmethod
    def where(condition, a, b):
        if isinstance(a, Dual) or isinstance(b, Dual):
            (av, ad), (bv, bd) = Dual.parts(a), Dual.parts(b)
            return Dual(cutlass.select_(condition, av, bv), cutlass.select_(condition, ad, bd))
        if isinstance(a, Float32) or isinstance(b, Float32) or isinstance(a, float) or isinstance(b, float):
            a, b = _float(a), _float(b)
        return cutlass.select_(condition, a, b)


@cute.jit
def apply_mask_mod(acc_mn: cute.Tensor, coord_mn: cute.Tensor, row_start: Int32, col_start: Int32,
                   seqlen_q: Int32, seqlen_k: Int32, batch_idx: Int32, head_idx: Int32,
                   mod: cutlass.Constexpr, transposed: cutlass.Constexpr = False,
                   cols: cutlass.Constexpr = None):
    """Sets to -inf the scores whose (batch, head, query, key) mod(b, h, q_idx, kv_idx) refuses.
    `acc_mn` / `coord_mn`: the (rows, cols) views of the score tile and of its identity tensor,
    queries as rows, or with `transposed` keys as rows (the backward's S^T). The mod is called
    only inside the sequence: a tile's rows and keys run past its end (those scores the
    sequence bounds mask anyway), and a mod indexing a tensor of the sequence's length
    (document ids) must not read past it. cols: mask.apply_mask's."""
    first, stop = column_span(acc_mn, cols)
    rows_len, cols_len = (seqlen_k, seqlen_q) if cutlass.const_expr(transposed) else (seqlen_q, seqlen_k)
    row_room, col_room = rows_len - row_start, cols_len - col_start  # (one compare an element)
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row_idx = row_start + coord_mn[r, 0][0]
        row_inside = coord_mn[r, 0][0] < row_room
        for c in cutlass.range_constexpr(first, stop):
            col_idx = col_start + coord_mn[0, c][1]
            if row_inside & (coord_mn[0, c][1] < col_room):
                q_idx, kv_idx = (col_idx, row_idx) if cutlass.const_expr(transposed) else (row_idx, col_idx)
                keep = mod(batch_idx, head_idx, q_idx, kv_idx)
                if cutlass.const_expr(isinstance(keep, bool)):  # (a mod that ignores its indices)
                    if cutlass.const_expr(not keep):
                        acc_mn[r, c] = -Float32.inf
                else:
                    acc_mn[r, c] = Float32(cutlass.select_(keep, acc_mn[r, c], -Float32.inf))


def value_and_grad(mod, score, batch_idx, head_idx, q_idx, kv_idx):
    """(mod(score, ...), d mod / d score): the score_mod traced with a Dual score (a mod that
    ignores its score has derivative 0)."""
    return Dual.parts(mod(Dual(score, Float32(1.0)), batch_idx, head_idx, q_idx, kv_idx))


@cute.jit
def apply_score_mod(acc_mn: cute.Tensor, coord_mn: cute.Tensor, row_start: Int32,
                    col_start: Int32, seqlen_q: Int32, seqlen_k: Int32, batch_idx: Int32,
                    head_idx: Int32, scale: Float32, mod: cutlass.Constexpr,
                    cols: cutlass.Constexpr = None):
    """The scores as FlexAttention's score_mod sees them, scaled by `scale` (softmax_scale), then
    replaced by mod(score, b, h, q_idx, kv_idx): what the softmax then takes (its exponent's
    scale is log2(e) alone). Called only inside the sequence, as apply_mask_mod; the scores
    past it are left to the sequence bounds' mask, applied after. cols: mask.apply_mask's."""
    first, stop = column_span(acc_mn, cols)
    q_room, kv_room = seqlen_q - row_start, seqlen_k - col_start
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        q_idx = row_start + coord_mn[r, 0][0]
        row_inside = coord_mn[r, 0][0] < q_room
        for c in cutlass.range_constexpr(first, stop):
            kv_idx = col_start + coord_mn[0, c][1]
            if row_inside & (coord_mn[0, c][1] < kv_room):
                acc_mn[r, c] = Float32(mod(acc_mn[r, c] * scale, batch_idx, head_idx, q_idx,
                                           kv_idx))
