"""The compiled kernel's signature against what the launch hands it at run time, without a GPU.

Kernels are compiled against symbolic fake tensors (kernels/sm90/arguments.py, through compile.py)
and called with runtime tensors built by kernels/sm90/launch.py. If the two disagree on which
extents and strides are dynamic, the runtime values bind to the wrong symbols and the kernel reads
the wrong memory (that happened: packed k/v saw their sequence and head strides swapped). Here a
host-only probe with the kernel's argument list is compiled from the same fakes, called with
launch.launch_arguments, and writes back the shapes, strides and scalars it received, for
comparison with what was passed. Both call paths are covered: cute runtime tensors (DLPack) and
TVM-FFI (torch tensors as they are; the probe is compiled for host memory there, since TVM-FFI
checks the device of each tensor). The declaration itself (arguments.ARGUMENTS) is checked against
the kernel's parameter list, and the probe's parameters against the declaration.
"""
import inspect
from typing import Optional

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402

from cuteattn.spec import AttentionSpec  # noqa: E402
from cuteattn.kernels.sm90 import arguments, launch  # noqa: E402
from cuteattn.kernels.launch_common import mod_key  # noqa: E402
from cuteattn.kernels.sm90.arguments import (Fp8Descales, ModTensors, SparseMetadata,  # noqa: E402
                                             VarlenMetadata)
from cuteattn.kernels.sm90.compile import fake_arguments  # noqa: E402
from cuteattn.kernels.sm90.config import fwd_config  # noqa: E402
from cuteattn.kernels.sm90.fwd import FlashFwdSm90  # noqa: E402
from cuteattn.kernels.launch_common import BWD_PER_CALL  # noqa: E402
from cuteattn.kernels.launch_common import to_cute as _to_cute  # noqa: E402


# The kernel's parameter list, written out (the DSL compiles from annotations); its names are
# checked against arguments.ARGUMENTS below, so the probe cannot drift from the declaration.
@cute.jit
def probe(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
          mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
          mSeqUsedQ: Optional[cute.Tensor], mSeqUsedK: Optional[cute.Tensor],
          mFullCount: Optional[cute.Tensor], mFullIndex: Optional[cute.Tensor],
          mPartialCount: Optional[cute.Tensor], mPartialIndex: Optional[cute.Tensor],
          mQDescale: Optional[cute.Tensor], mKDescale: Optional[cute.Tensor],
          mVDescale: Optional[cute.Tensor], mCuSeqlensV: Optional[cute.Tensor],
          mModTensor0: Optional[cute.Tensor], mModTensor1: Optional[cute.Tensor],
          mModTensor2: Optional[cute.Tensor], mModTensor3: Optional[cute.Tensor],
          mPageTable: Optional[cute.Tensor], mSink: Optional[cute.Tensor],
          mTileCounter: cute.Tensor,
          qhead_per_kvhead: Int32, score_scale: Float32, softmax_scale_log2: Float32,
          window_left: Int32, window_right: Int32, max_ctas: Int32, l2_group: Int32,
          l2_small_groups: Int32,
          info: cute.Tensor):
    i = 0
    for t in (mQ, mK, mV, mO, mLSE, mFullCount, mFullIndex, mPartialCount, mPartialIndex,
              mQDescale, mKDescale, mVDescale, mModTensor0, mModTensor1, mModTensor2,
              mModTensor3, mPageTable, mSink):
        if cutlass.const_expr(t is not None):
            for m in cutlass.range_constexpr(cute.rank(t)):
                info[i] = Int64(t.shape[m])
                info[i + 1] = Int64(t.stride[m])
                i += 2
    for t in (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mCuSeqlensV, mTileCounter):
        if cutlass.const_expr(t is not None):
            info[i] = Int64(t.shape[0])
            info[i + 1] = Int64(t[1])
            i += 2
    for x in (qhead_per_kvhead, window_left, window_right, max_ctas, l2_group, l2_small_groups):
        info[i] = Int64(x)
        i += 1
    for x in (score_scale, softmax_scale_log2):  # to micro-units, to compare as integers
        info[i] = Int64(x * 1e6)
        i += 1


def expected(tensors, spec, sparse=(), descales=(), mod=(), table=(), sink=()):
    out = []
    for t in (*tensors[:5], *sparse, *descales, *mod, *table, *sink):
        for n, st in zip(t.shape, t.stride()):
            out += [n, st]
    for t in tensors[5:]:
        if t is not None:
            out += [t.shape[0], int(t[1])]
    score_scale, scale_log2, left, right = launch.kernel_scalars(spec)
    out += [spec.qhead_per_kvhead, left, right, launch.max_ctas(spec), *launch.l2_groups(spec)]
    out += [int(score_scale * 1e6), int(scale_log2 * 1e6)]
    return out


MOD_TABLE = None  # (the module-level tensor _mod_reading's mod names)


def _mod_reading(lengths, table):
    global MOD_TABLE
    MOD_TABLE = table

    def mod(b, h, q_idx, kv_idx):
        return (lengths[b] > kv_idx) & (MOD_TABLE[b, kv_idx] >= 0.0)
    return mod


def _alibi(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def packed(total, h, d, dtype=torch.bfloat16):
    return torch.randn(total, h, d, dtype=dtype)


def qkv_views(b, s, h, d):
    """q, k, v as strided views of one packed qkv tensor, as many models produce them."""
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.bfloat16)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


@pytest.mark.parametrize("tvm_ffi", [False, True], ids=["dlpack", "tvm-ffi"])
@pytest.mark.parametrize("layout", ["fixed", "fixed-qkv-views", "gqa", "varlen", "varlen-seqused",
                                    "block-sparse", "fp8", "fp8-varlen", "mask-mod", "paged", "sink"])
def test_runtime_tensors_bind_to_compiled_signature(layout, tvm_ffi):
    if tvm_ffi:
        pytest.importorskip("tvm_ffi")
    varlen = layout.startswith("varlen") or layout in ("fp8-varlen", "paged")
    seqused = layout in ("varlen-seqused", "paged")
    page = 128 if layout == "paged" else 0
    block = (128, 64) if layout == "block-sparse" else None
    fp8 = layout.startswith("fp8")
    # a mask_mod reading a 1-D int32 tensor it closes over and a 2-D float32 module-level one
    # and a score_mod reading a float32 tensor (ALiBi's slopes)
    mod_tensors = (torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32), torch.rand(3, 7),
                   torch.rand(4), None) if layout == "mask-mod" else ()
    keys = dict(mask_mod=mod_key(_mod_reading(*mod_tensors[:2])),
                score_mod=mod_key(_alibi(mod_tensors[2]), "score_mod")) if mod_tensors else {}
    cfg = fwd_config(cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16, 128, 128, False, False, True, varlen, varlen and not page,
                     has_seqused_q=seqused, has_seqused_k=seqused, sparse_block=block,
                     page_size=page, has_sink=layout == "sink", **keys)
    sink = (torch.randn(4),) if layout == "sink" else ()  # float32 (nheads,)
    # block-sparse lists: counts broadcast over the batch, index lists per (batch, head)
    sparse = (torch.tensor([[[1, 2]]], dtype=torch.int32),
              torch.zeros(2, 4, 2, 5, dtype=torch.int32)[..., :4],  # a padded last mode
              torch.tensor([[[0, 1]], [[1, 0]]], dtype=torch.int32).repeat(1, 4, 1),
              torch.zeros(1, 4, 2, 4, dtype=torch.int32)) if block else ()
    if layout in ("fixed", "block-sparse", "mask-mod", "sink"):
        q, k, v = (torch.randn(2, 96, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    elif layout == "fp8":  # as the launch hands them over: bytes, V transposed (fp8_value_operand)
        q = torch.randn(2, 33, 8, 128).to(torch.float8_e4m3fn)
        k, v = (torch.randn(2, 71, 2, 128).to(torch.float8_e4m3fn) for _ in range(2))
    elif layout == "fixed-qkv-views":
        q, k, v = qkv_views(3, 40, 4, 128)
    elif layout == "gqa":
        q = torch.randn(2, 33, 8, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 71, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    elif layout == "paged":  # 5 pages of 128 keys, the pages in the batch mode's place
        q = packed(300, 4, 128)
        k, v = (torch.randn(5, page, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    else:
        q, k, v = packed(300, 4, 128), packed(500, 2, 128), packed(500, 2, 128)
        if fp8:
            q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    o = torch.empty(q.shape, dtype=torch.bfloat16)
    if varlen:
        lse = torch.empty(q.shape[1], q.shape[0])
        cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
        cu_k = None if page else torch.tensor([0, 250, 500], dtype=torch.int32)
        used = (torch.tensor([90, 7], dtype=torch.int32), torch.tensor([250, 3], dtype=torch.int32)) \
            if seqused else (None, None)
    else:
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1])
        cu_q = cu_k = None
        used = (None, None)
    descales = tuple(torch.rand(2, 2) + 0.5 for _ in range(3)) if fp8 else ()
    table = (torch.tensor([[4, 0, 2], [1, 3, 0]], dtype=torch.int32),) if page else ()
    cu_v = None
    if fp8:
        v, cu_v = launch.fp8_value_operand(v, cu_k)
        q, k = q.view(torch.uint8), k.view(torch.uint8)
    spec = AttentionSpec(dtype=torch.float8_e4m3fn if fp8 else q.dtype, head_dim=128, head_dim_v=128, causal=False, local=True,
                         has_softcap=True, varlen_q=varlen, varlen_k=varlen, seqlen_q=200,
                         nheads=q.shape[-2], nheads_k=k.shape[-2], softmax_scale=0.125,
                         window_left=17, window_right=None, softcap=30.0)
    counter = torch.tensor([0, 7], dtype=torch.int32)  # [1] is what the probe reads back
    tensors = (q, k, v, o, lse, cu_q, cu_k, *used, cu_v, counter)
    info = torch.full((128,), -1, dtype=torch.int64)
    varlen_args = VarlenMetadata(cu_q, cu_k, *used)
    if tvm_ffi:
        from cutlass.cute.typing import AddressSpace
        fakes = fake_arguments(cfg, memspace=AddressSpace.generic)
        fake_info = cute.runtime.make_fake_tensor(Int64, (128,), (1,), assumed_align=8,
                                                  memspace=AddressSpace.generic)
        compiled = cute.compile(probe, *fakes, fake_info, options="--enable-tvm-ffi")
        compiled(*launch.launch_arguments(spec, q, k, v, o, lse, varlen_args, tvm_ffi=True,
                                          counter=counter, sparse=SparseMetadata(*sparse),
                                          fp8=Fp8Descales(*descales, cu_v) if fp8 else Fp8Descales(),
                                          mod=ModTensors(*mod_tensors), page_table=(table or (None,))[0],
                                          sink=(sink or (None,))[0]),
                 info)
    else:
        compiled = cute.compile(probe, *fake_arguments(cfg), _to_cute(info, 8))
        compiled(*launch.launch_arguments(spec, q, k, v, o, lse, varlen_args, counter=counter,
                                          sparse=SparseMetadata(*sparse),
                                          fp8=Fp8Descales(*descales, cu_v) if fp8 else Fp8Descales(),
                                          mod=ModTensors(*mod_tensors), page_table=(table or (None,))[0],
                                          sink=(sink or (None,))[0]),
                 _to_cute(info, 8))
    want = expected((q, k, v, *tensors[3:]), spec, sparse, descales,
                    [t for t in mod_tensors if t is not None], table, sink)
    got = info[: len(want)].tolist()
    assert got[:-2] == want[:-2]  # every extent, stride, index value and integer scalar
    # the two float32 scalars (in micro-units): equal up to float32 rounding
    assert got[-2:] == pytest.approx(want[-2:], rel=1e-6)


def parameter_names(fn) -> list:
    return [p for p in inspect.signature(inspect.unwrap(fn)).parameters if p != "self"]


def test_declaration_matches_kernel_signature():
    """arguments.ARGUMENTS is the kernel's parameter list: same names, same order, then the
    stream."""
    assert list(arguments.names()) + [arguments.STREAM] == parameter_names(FlashFwdSm90.__call__)


def test_probe_matches_declaration():
    assert parameter_names(probe) == list(arguments.names()) + ["info"]


def test_declaration_drives_fakes_and_launch_arguments():
    """One fake and one launch argument per declared parameter; optional tensors exactly where
    the config uses them; scalars in declared order, converted to the declared DSL types."""
    spec = AttentionSpec(dtype=torch.bfloat16, head_dim=64, head_dim_v=64, causal=True, local=False,
                         has_softcap=False, varlen_q=True, varlen_k=True, has_seqused_k=True,
                         batch=2, seqlen_q=10, seqlen_k=10, nheads=4, nheads_k=2,
                         softmax_scale=0.125)
    cfg = launch.sm90_config(spec)
    fakes = fake_arguments(cfg)
    declared = arguments.flat()
    assert len(fakes) == len(declared)
    optional = {a.name: f for a, f in zip(declared, fakes) if a.kind == arguments.OPTIONAL_TENSOR}
    assert [name for name, f in optional.items() if f is None] == [
        "mSeqUsedQ", "mFullCount", "mFullIndex", "mPartialCount", "mPartialIndex",
        "mQDescale", "mKDescale", "mVDescale", "mCuSeqlensV", "mModTensor0", "mModTensor1",
        "mModTensor2", "mModTensor3", "mPageTable", "mSink"]
    q = torch.randn(20, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(20, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 20], dtype=torch.int32)
    used = torch.tensor([10, 3], dtype=torch.int32)
    lse = torch.empty(4, 20)
    varlen = VarlenMetadata(cu, cu, None, used)
    counter = torch.zeros(2, dtype=torch.int32)
    plain = launch.launch_arguments(spec, q, k, k, q, lse, varlen, tvm_ffi=True, counter=counter)
    names = arguments.names()
    assert len(plain) == len(names)
    by_name = dict(zip(names, plain))
    assert by_name["mQ"] is q and by_name["mLSE"] is lse and by_name["mTileCounter"] is counter
    assert (by_name["mCuSeqlensQ"], by_name["mSeqUsedQ"], by_name["mSeqUsedK"]) == (cu, None, used)
    scalars = launch.launch_scalars(spec)
    assert tuple(scalars) == tuple(a.name for a in arguments.SCALARS)
    assert [by_name[a.name] for a in arguments.SCALARS] == list(scalars.values())
    converted = launch.launch_arguments(spec, q, k, k, q, lse, varlen, counter=counter)
    for a, x in zip(declared, converted):
        if a.kind in arguments.SCALAR_TYPES:
            assert type(x) is arguments.SCALAR_TYPES[a.kind], a.name
        elif by_name[a.name] is None:
            assert x is None, a.name
        else:
            assert not isinstance(x, torch.Tensor), a.name  # a cute runtime tensor


def test_binder_lays_out_by_name_in_any_order():
    """Values given in another order land where the declaration puts them; a missing or unknown
    name is an error when the binder is made, not a wrong launch."""
    names = arguments.names()
    scalars = {a.name: i for i, a in enumerate(arguments.SCALARS)}
    per_call = tuple(reversed([n for n in names if n not in scalars]))
    values = tuple(f"value of {n}" for n in per_call)
    laid_out = arguments.Binder(per_call, scalars)(*values)
    assert laid_out == tuple(dict(zip(per_call, values), **scalars)[n] for n in names)
    with pytest.raises(ValueError, match="mTileCounter"):
        arguments.Binder(per_call[1:], scalars)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        arguments.Binder(per_call, {**scalars, "max_seqlen_q": 1})


# ---- the backward ----

from cuteattn.kernels.sm90 import launch_bwd  # noqa: E402
from cuteattn.kernels.sm90.bwd import FlashBwdSm90  # noqa: E402
from cuteattn.kernels.sm90.compile import fake_bwd_arguments  # noqa: E402


@cute.jit
def probe_bwd(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
              mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
              mdV: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
              mCuSeqlensK: Optional[cute.Tensor], mSeqUsedQ: Optional[cute.Tensor],
              mSeqUsedK: Optional[cute.Tensor], mSemaphore: cute.Tensor,
              mFullCount: Optional[cute.Tensor], mFullIndex: Optional[cute.Tensor],
              mPartialCount: Optional[cute.Tensor], mPartialIndex: Optional[cute.Tensor],
              mKeyHalves: Optional[cute.Tensor], mDqTurns: Optional[cute.Tensor],
              mModTensor0: Optional[cute.Tensor], mModTensor1: Optional[cute.Tensor],
              mModTensor2: Optional[cute.Tensor], mModTensor3: Optional[cute.Tensor],
              qhead_per_kvhead: Int32, softmax_scale: Float32, score_scale: Float32,
              softmax_scale_log2: Float32, window_left: Int32, window_right: Int32,
              num_n_blocks: Int32, heads_interleaved: Int32, info: cute.Tensor):
    i = 0
    for t in (mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore):
        for m in cutlass.range_constexpr(cute.rank(t)):
            info[i] = Int64(t.shape[m])
            info[i + 1] = Int64(t.stride[m])
            i += 2
    for t in (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK):
        if cutlass.const_expr(t is not None):
            info[i] = Int64(t.shape[0])
            info[i + 1] = Int64(t[1])
            i += 2
    for t in (mFullCount, mFullIndex, mPartialCount, mPartialIndex, mKeyHalves, mDqTurns,
              mModTensor0, mModTensor1, mModTensor2, mModTensor3):
        if cutlass.const_expr(t is not None):
            for m in cutlass.range_constexpr(cute.rank(t)):
                info[i] = Int64(t.shape[m])
                i += 1
    for x in (qhead_per_kvhead, window_left, window_right, num_n_blocks, heads_interleaved):
        info[i] = Int64(x)
        i += 1
    for x in (softmax_scale, score_scale, softmax_scale_log2):
        info[i] = Int64(x * 1e6)
        i += 1


def test_bwd_declaration_matches_kernel_and_probe():
    names = list(arguments.names(arguments.BWD_ARGUMENTS))
    assert names + [arguments.STREAM] == parameter_names(FlashBwdSm90.__call__)
    assert parameter_names(probe_bwd) == names + ["info"]
    assert list(BWD_PER_CALL) == [n for n in names if n in BWD_PER_CALL]
    assert [n for n in names if n not in BWD_PER_CALL][:10] == [
        "mFullCount", "mFullIndex", "mPartialCount", "mPartialIndex", "mKeyHalves", "mDqTurns",
        "mModTensor0", "mModTensor1", "mModTensor2", "mModTensor3"]


@pytest.mark.parametrize("tvm_ffi", [False, True], ids=["dlpack", "tvm-ffi"])
@pytest.mark.parametrize("layout", ["fixed-gqa", "qkv-views", "varlen-seqused"])
def test_bwd_runtime_tensors_bind_to_compiled_signature(layout, tvm_ffi, monkeypatch):
    """A BwdLaunch call (its preprocess, buffers and binding) against the backward's fakes: the
    probe, compiled from them, reads back every extent, stride and scalar it was handed."""
    if tvm_ffi:
        pytest.importorskip("tvm_ffi")
    varlen = layout.startswith("varlen")
    if layout == "fixed-gqa":
        q = torch.randn(2, 33, 8, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 71, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    elif layout == "qkv-views":
        q, k, v = (t[..., :64] for t in qkv_views(3, 40, 4, 64))
    else:
        q, k, v = packed(300, 4, 64), packed(500, 2, 64), packed(500, 2, 64)
    spec = AttentionSpec(dtype=q.dtype, head_dim=64, head_dim_v=64, causal=False, local=True,
                         has_softcap=True, varlen_q=varlen, varlen_k=varlen, has_seqused_q=varlen,
                         has_seqused_k=varlen, nheads=q.shape[-2], nheads_k=k.shape[-2],
                         softmax_scale=0.125, window_left=17, window_right=None, softcap=30.0,
                         kind="bwd", deterministic=True)
    cfg = launch_bwd.bwd_config(spec)
    info = torch.full((120,), -1, dtype=torch.int64)
    if tvm_ffi:
        from cutlass.cute.typing import AddressSpace
        fakes = arguments.fakes(cfg, AddressSpace.generic, arguments.BWD_ARGUMENTS)
        fake_info = cute.runtime.make_fake_tensor(Int64, (120,), (1,), assumed_align=8,
                                                  memspace=AddressSpace.generic)
        compiled = cute.compile(probe_bwd, *fakes, fake_info, options="--enable-tvm-ffi")
        run = lambda *args: compiled(*args, info)
    else:
        compiled = cute.compile(probe_bwd, *fake_bwd_arguments(cfg), _to_cute(info, 8))
        run = lambda *args: compiled(*args[:-1], _to_cute(info, 8))  # the stream: not a param
    monkeypatch.setattr(launch_bwd, "use_tvm_ffi", lambda: tvm_ffi)
    monkeypatch.setattr(launch_bwd, "_compiled", lambda cfg, tvm, mask_mod_fn=None, score_mod_fn=None: run)
    bl = launch_bwd.BwdLaunch(spec)
    seen = {}
    bind = bl.bind
    bl.bind = lambda *values: seen.setdefault("values", values) and bind(*values)
    if not tvm_ffi:  # the DLPack path passes the stream of a CUDA device: not here
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
            "S", (), {"cuda_stream": 0})())
    o = torch.randn(q.shape, dtype=q.dtype)
    dout = torch.randn(q.shape, dtype=q.dtype)
    if varlen:
        lse = torch.randn(q.shape[1], q.shape[0])
        cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
        cu_k = torch.tensor([0, 250, 500], dtype=torch.int32)
        used_q, used_k = torch.tensor([90, 7], dtype=torch.int32), torch.tensor([250, 3], dtype=torch.int32)
        bl(dout, q, k, v, o, lse, cu_q, cu_k, used_q, used_k)
    else:
        lse = torch.randn(q.shape[0], q.shape[2], q.shape[1])
        bl(dout, q, k, v, o, lse)
    values = seen["values"]
    tensors, (cu_q, cu_k, used_q, used_k), semaphore = values[:9], values[9:13], values[13]
    n_blocks, heads_interleaved = values[-2:]
    assert heads_interleaved == 1  # (CPU tensors: one head's key blocks after another)
    assert values[14:-2] == (None,) * 10  # no block-sparse lists, tables nor mod tensors: dense
    want = []
    for t in (*tensors, semaphore):
        for n, st in zip(t.shape, t.stride()):
            want += [n, st]
    for t in (cu_q, cu_k, used_q, used_k):
        if t is not None:
            want += [t.shape[0], int(t[1])]
    score_scale, scale_log2, left, right = launch.kernel_scalars(spec)
    want += [spec.qhead_per_kvhead, left, right, n_blocks, heads_interleaved]
    want += [int(spec.softmax_scale * 1e6), int(score_scale * 1e6), int(scale_log2 * 1e6)]
    got = info[: len(want)].tolist()
    assert got[:-3] == want[:-3]
    assert got[-3:] == pytest.approx(want[-3:], rel=1e-6)
    assert tensors[7].shape[-2] == spec.nheads  # dk per query head, summed afterwards


def test_deterministic_backward_interleaves_heads(monkeypatch):
    """Deterministic turns in key-block order: the grid interleaves G heads' key blocks, G the
    smallest divisor of the heads with G >= 2 x SMs / (query steps a walk); 1 under a causal
    mask (descending turns), without deterministic mode, or on the CPU."""
    from types import SimpleNamespace
    monkeypatch.setattr(launch_bwd, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch_bwd, "_compiled", lambda *a, **k: None)

    def interleaved(seqlen, heads=16, causal=False, deterministic=True, device="cuda"):
        spec = AttentionSpec(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=causal,
                             local=False, has_softcap=False, varlen_q=False, varlen_k=False,
                             nheads=heads, nheads_k=heads, softmax_scale=0.1, kind="bwd",
                             deterministic=deterministic)
        q = SimpleNamespace(device=SimpleNamespace(type=device, index=0),
                            shape=(1, seqlen, heads, 128))
        return launch_bwd.BwdLaunch(spec).heads_interleaved(q, None)

    # 64-row query steps: 1k 16 steps (want 17), 4k 64 (want 5), 8k 128 (want 3), 16k 256
    # (>= the SMs: none)
    assert [interleaved(s) for s in (1024, 4096, 8192, 16384)] == [16, 8, 4, 1]
    assert interleaved(4096, heads=12) == 6 and interleaved(1024, heads=12) == 12
    assert interleaved(4096, causal=True) == 1 and interleaved(4096, deterministic=False) == 1
    assert interleaved(4096, device="cpu") == 1


def test_aligned16_keeps_aligned_tensors_and_copies_the_rest():
    """launch_common.aligned16: a tensor whose base and leading strides are 16-byte multiples is
    passed as it is (no copy, same storage); a misaligned stride (a non-contiguous view) or base
    pointer gets a copy with the same values."""
    from cuteattn.kernels.launch_common import aligned16
    x = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    assert aligned16(x) is x
    # a view whose rows are 24 elements apart but only 7 used (48 bytes: aligned) stays
    wide = torch.randn(5, 24, dtype=torch.bfloat16)[:, :7]
    assert aligned16(wide) is wide
    # a transposed view (rows 1 element apart, 2 bytes): a contiguous copy, same values
    odd = torch.randn(8, 5, dtype=torch.bfloat16).t()
    got = aligned16(odd)
    assert got.is_contiguous() and got.data_ptr() != odd.data_ptr() and torch.equal(got, odd)
    # a base pointer off by one element: copied to an aligned one
    shifted = torch.randn(65, dtype=torch.float32)[1:].view(8, 8)
    got = aligned16(shifted)
    assert got.data_ptr() % 16 == 0 and torch.equal(got, shifted)
