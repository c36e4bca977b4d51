"""Compiles the sm90 forward for a static configuration, against symbolic shapes.

Tensors are described with fake tensors whose sizes and strides are symbolic (only the head
dim is static and unit-stride), so the cubin serves every batch, sequence length, head count and
memory layout with a contiguous head dim. This needs no GPU: with CUTE_DSL_ARCH=sm_90a the same
function runs in CI.
"""
import contextlib
import io
import os
import re
import tempfile

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.runtime import make_fake_stream

from .fwd import FlashFwdSm90, Sm90FwdConfig


def _where(memspace):
    return {} if memspace is None else {"memspace": memspace}


def _fake(dtype, shape, memspace=None, align=16):
    """A tensor of `shape` whose last mode is contiguous and every other stride symbolic.

    Every extent is symbolic, the head dim included, because that is how a runtime tensor marked
    with `mark_layout_dynamic` arrives: a static extent here would shift the runtime's dynamic
    values against the compiled signature (seen as swapped strides on 3-D tensors). The kernel
    takes its head dim from the static configuration, not from the tensor. Strides are promised
    to be multiples of 16 bytes (TMA needs it; dispatch makes a copy of any tensor that is not).
    """
    div = (align * 8) // dtype.width
    strides = tuple(cute.sym_int64(divisibility=div) for _ in shape[:-1]) + (1,)
    shape = tuple(cute.sym_int() if isinstance(x, int) else x for x in shape)
    return cute.runtime.make_fake_tensor(dtype, shape, strides, assumed_align=align, **_where(memspace))


def _fake_lse(shape, memspace=None):
    """LSE is float32, contiguous in its last mode (the sequence)."""
    strides = tuple(cute.sym_int64() for _ in shape[:-1]) + (1,)
    return cute.runtime.make_fake_tensor(Float32, shape, strides, assumed_align=4, **_where(memspace))


def _fake_vector(memspace=None):
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), (1,), assumed_align=4,
                                         **_where(memspace))


def fake_arguments(cfg: Sm90FwdConfig, memspace=None):
    """Symbolic stand-ins for (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    tile_counter).
    A `memspace` other than global memory only serves host-side tests of the argument binding."""
    sym, m = cute.sym_int, memspace
    h, hk = sym(), sym()
    if cfg.varlen_q:
        total_q = sym()
        q = _fake(cfg.dtype, (total_q, h, cfg.head_dim), m)
        o = _fake(cfg.dtype, (total_q, h, cfg.head_dim_v), m)
        lse = _fake_lse((h, total_q), m)
    else:
        b, sq = sym(), sym()
        q = _fake(cfg.dtype, (b, sq, h, cfg.head_dim), m)
        o = _fake(cfg.dtype, (b, sq, h, cfg.head_dim_v), m)
        lse = _fake_lse((b, h, sq), m)
    if cfg.varlen_k:
        total_k = sym()
        k = _fake(cfg.dtype, (total_k, hk, cfg.head_dim), m)
        v = _fake(cfg.dtype, (total_k, hk, cfg.head_dim_v), m)
    else:
        bk, sk = sym(), sym()
        k = _fake(cfg.dtype, (bk, sk, hk, cfg.head_dim), m)
        v = _fake(cfg.dtype, (bk, sk, hk, cfg.head_dim_v), m)
    cu_q = _fake_vector(m) if cfg.varlen_q else None
    cu_k = _fake_vector(m) if cfg.varlen_k else None
    used_q = _fake_vector(m) if cfg.has_seqused_q else None
    used_k = _fake_vector(m) if cfg.has_seqused_k else None
    return q, k, v, o, lse, cu_q, cu_k, used_q, used_k, _fake_vector(m)


def compile_fwd(cfg: Sm90FwdConfig, options: str = "", tvm_ffi: bool = False):
    """Returns the compiled kernel. Call it with (q, k, v, out, lse, cu_q, cu_k, used_q, used_k,
    tile_counter, max_seqlen_q, qhead_per_kvhead, score_scale, softmax_scale_log2, window_left, window_right,
    max_ctas, l2_group, l2_small_groups, stream): cute runtime tensors and scalars; or, with `tvm_ffi`, torch tensors and Python
    numbers and no stream (TVM-FFI passes the caller's current stream)."""
    kernel = FlashFwdSm90(cfg)
    args = fake_arguments(cfg)
    scalars = (Int32(1), Int32(1), Float32(1.0), Float32(1.0), Int32(0), Int32(0), Int32(1), Int32(1), Int32(1))
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(kernel, *args, *scalars, stream, options=options)


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_fwd_with_report(cfg: Sm90FwdConfig, tvm_ffi: bool = False):
    """compile_fwd, plus what ptxas reported: {'registers': per-thread registers at launch,
    'spill_store_bytes', 'spill_load_bytes'} (empty if ptxas said nothing). The report goes to
    stderr (Python's, and fd 2 for anything native), so both are captured while compiling."""
    saved = os.dup(2)
    py_err = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stderr(py_err):  # the DSL writes its remarks here
                compiled = compile_fwd(cfg, options="remarks{ptx}", tvm_ffi=tvm_ffi)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace") + py_err.getvalue()
    info = {}
    used, spill = _PTXAS_USED.findall(text), _PTXAS_SPILL.findall(text)
    if used:
        info["registers"] = max(int(x) for x in used)
    if spill:
        info["spill_store_bytes"] = max(int(a) for a, _ in spill)
        info["spill_load_bytes"] = max(int(b) for _, b in spill)
    return compiled, info
