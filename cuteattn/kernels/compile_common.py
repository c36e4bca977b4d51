"""Compiling a kernel against symbolic arguments, for every family: the stream for the call
path (DLPack or TVM-FFI) and what ptxas reported. No GPU needed (CUTE_DSL_ARCH sets the target)."""
import contextlib
import io
import os
import re
import tempfile

import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass.runtime import make_fake_stream


def compile_kernel(kernel, fakes: tuple, options: str = "", tvm_ffi: bool = False):
    """cute.compile of kernel(*fakes, stream). With `tvm_ffi` the compiled function takes torch
    tensors and Python numbers and no stream (TVM-FFI passes the caller's current stream);
    otherwise cute runtime values and a CUstream.

    Kept artifacts (--keep-ptx, --keep-cubin: the result's __ptx__ / __cubin__) are written to a
    private directory, read into the result and removed: the DSL's default is one directory per
    process with files named by the (truncated) kernel name, where parallel compiles of two
    configs of one kernel read each other's PTX."""
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    if "--keep-" not in options or "--dump-dir" in options:
        return cute.compile(kernel, *fakes, stream, options=options)
    with tempfile.TemporaryDirectory(prefix="cuteattn-artifacts-") as dump_dir:
        return cute.compile(kernel, *fakes, stream, options=f"{options} --dump-dir={dump_dir}")


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


def from_candidate(candidates: list, env: str) -> list:
    """candidates from the index the environment variable `env` names on (clamped to the
    last; unset or 0: all of them). A testing knob: a GPU whose compiler builds the first
    candidate spill-free runs, and verifies, the fallbacks other targets' compilers take."""
    skip = int(os.environ.get(env, "0") or 0)
    return candidates[min(max(skip, 0), len(candidates) - 1):]


def first_spill_free(candidates: list, compile_with_report):
    """(config, compiled, report) of the first candidate config whose compile reports no
    register spill (the last candidate whatever it reports). compile_with_report(config) ->
    (compiled, report) with ptxas_report's keys. Tiles near the register limit spill on some
    targets and not on others; this lets the target's own compiler decide, per variant."""
    for i, cfg in enumerate(candidates):
        compiled, report = compile_with_report(cfg)
        if not report.get("spill_store_bytes") or i == len(candidates) - 1:
            return cfg, compiled, report
    raise ValueError("first_spill_free: no candidate config")
