"""Compiles the sm80 forward for a static configuration against symbolic shapes (like
kernels/sm90/compile.py: no GPU needed; CUTE_DSL_ARCH picks the target, sm_80 to sm_120a)."""
import cuda.bindings.driver as cuda

import cutlass.cute as cute
from cutlass.runtime import make_fake_stream

from ..sm90.compile import ptxas_report
from . import arguments
from .combine import CombineConfig, CombineSplits
from .fwd import FlashFwdSm80, Sm80FwdConfig


def compile_fwd(cfg: Sm80FwdConfig, options: str = "", tvm_ffi: bool = False):
    """The compiled kernel; call it with arguments.ARGUMENTS' values then the stream (cute
    runtime values), or with TVM-FFI torch tensors and numbers and no stream."""
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(FlashFwdSm80(cfg), *arguments.fakes(cfg), stream, options=options)


def compile_fwd_with_report(cfg: Sm80FwdConfig, tvm_ffi: bool = False, keep_ptx: bool = False):
    """compile_fwd, plus ptxas' register and spill report (sm90/compile.ptxas_report).
    `keep_ptx`: the result's __ptx__ holds the PTX (also written to the working directory)."""
    options = "--keep-ptx remarks{ptx}" if keep_ptx else "remarks{ptx}"
    return ptxas_report(lambda: compile_fwd(cfg, options=options, tvm_ffi=tvm_ffi))


def compile_combine(cfg: CombineConfig, options: str = "", tvm_ffi: bool = False):
    """The compiled combine kernel; called with arguments.COMBINE_ARGUMENTS' values, like
    compile_fwd's result."""
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(CombineSplits(cfg), *arguments.combine_fakes(cfg), stream, options=options)


def compile_bwd(cfg, options: str = "", tvm_ffi: bool = False):
    """The compiled backward kernel (bwd.Sm80BwdConfig); called with arguments.BWD_ARGUMENTS'
    values, like compile_fwd's result."""
    from .bwd import FlashBwdSm80
    if tvm_ffi:
        stream = make_fake_stream(use_tvm_ffi_env_stream=True)
        options = (options + " --enable-tvm-ffi").strip()
    else:
        stream = cuda.CUstream(0)
    return cute.compile(FlashBwdSm80(cfg), *arguments.bwd_fakes(cfg), stream, options=options)


def compile_bwd_with_report(cfg, tvm_ffi: bool = False, keep_ptx: bool = False):
    options = "--keep-ptx remarks{ptx}" if keep_ptx else "remarks{ptx}"
    return ptxas_report(lambda: compile_bwd(cfg, options=options, tvm_ffi=tvm_ffi))
