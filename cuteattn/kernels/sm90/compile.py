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
from cutlass.runtime import make_fake_stream

from . import arguments
from .fwd import FlashFwdSm90, Sm90FwdConfig


def fake_arguments(cfg: Sm90FwdConfig, memspace=None) -> tuple:
    """Symbolic stand-ins for the kernel's arguments but the stream, as arguments.ARGUMENTS
    declares them: tensors (None for varlen metadata the config does not use) and scalar
    placeholders. A `memspace` other than global memory only serves host-side tests of the
    argument binding."""
    return arguments.fakes(cfg, memspace)


def compile_fwd(cfg: Sm90FwdConfig, options: str = "", tvm_ffi: bool = False):
    """Returns the compiled kernel. Call it with the arguments arguments.ARGUMENTS declares, then
    the stream: cute runtime tensors, Int32 and Float32 scalars and a CUstream; or, with `tvm_ffi`,
    torch tensors and Python numbers and no stream (TVM-FFI passes the caller's current stream).
    kernels/sm90/launch.py builds both (launch_arguments)."""
    kernel = FlashFwdSm90(cfg)
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(kernel, *fake_arguments(cfg), stream, options=options)


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(compile_fn):
    """(compile_fn(), what ptxas reported): {'registers': per-thread registers at launch,
    'spill_store_bytes', 'spill_load_bytes'} (empty if ptxas said nothing). compile_fn must pass
    the "remarks{ptx}" option. The report goes to stderr (Python's, and fd 2 for anything native),
    so both are captured while compiling."""
    saved = os.dup(2)
    py_err = io.StringIO()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stderr(py_err):  # the DSL writes its remarks here
                compiled = compile_fn()
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


def compile_fwd_with_report(cfg: Sm90FwdConfig, tvm_ffi: bool = False):
    """compile_fwd, plus what ptxas reported (ptxas_report)."""
    return ptxas_report(lambda: compile_fwd(cfg, options="remarks{ptx}", tvm_ffi=tvm_ffi))


# ---- the backward ----

def fake_bwd_arguments(cfg) -> tuple:
    """Symbolic stand-ins for FlashBwdSm90's arguments but the stream (arguments.BWD_ARGUMENTS)."""
    return arguments.fakes(cfg, entries=arguments.BWD_ARGUMENTS)


def compile_bwd(cfg, options: str = "", tvm_ffi: bool = False):
    """The compiled backward kernel for cfg (bwd.Sm90BwdConfig), like compile_fwd."""
    from .bwd import FlashBwdSm90
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(FlashBwdSm90(cfg), *fake_bwd_arguments(cfg), stream, options=options)
