"""Compiles the sm80 forward for a static configuration against symbolic shapes (like
kernels/sm90/compile.py: no GPU needed; CUTE_DSL_ARCH picks the target, sm_80 to sm_120a)."""
from ..compile_common import compile_kernel, ptxas_report
from . import arguments
from .combine import CombineConfig, CombineSplits
from .fwd import FlashFwdSm80, Sm80FwdConfig


def compile_fwd(cfg: Sm80FwdConfig, options: str = "", tvm_ffi: bool = False):
    """The compiled kernel; call it with arguments.ARGUMENTS' values then the stream (cute
    runtime values), or with TVM-FFI torch tensors and numbers and no stream."""
    return compile_kernel(FlashFwdSm80(cfg), arguments.fakes(cfg), options, tvm_ffi)


def compile_fwd_with_report(cfg: Sm80FwdConfig, tvm_ffi: bool = False, keep_ptx: bool = False):
    """compile_fwd, plus ptxas' register and spill report (compile_common.ptxas_report).
    `keep_ptx`: the result's __ptx__ holds the PTX (also written to the working directory)."""
    options = "--keep-ptx remarks{ptx}" if keep_ptx else "remarks{ptx}"
    return ptxas_report(lambda: compile_fwd(cfg, options=options, tvm_ffi=tvm_ffi))


def compile_combine(cfg: CombineConfig, options: str = "", tvm_ffi: bool = False):
    """The compiled combine kernel; called with arguments.COMBINE_ARGUMENTS' values, like
    compile_fwd's result."""
    return compile_kernel(CombineSplits(cfg), arguments.combine_fakes(cfg), options, tvm_ffi)


def compile_bwd(cfg, options: str = "", tvm_ffi: bool = False):
    """The compiled backward kernel (bwd.Sm80BwdConfig); called with arguments.BWD_ARGUMENTS'
    values, like compile_fwd's result."""
    from .bwd import FlashBwdSm80
    from .bwd_grid import FlashBwdSm80Grid
    kernel = FlashBwdSm80Grid(cfg) if cfg.grid else FlashBwdSm80(cfg)
    return compile_kernel(kernel, arguments.bwd_fakes(cfg), options, tvm_ffi)


def compile_bwd_with_report(cfg, tvm_ffi: bool = False, keep_ptx: bool = False):
    options = "--keep-ptx remarks{ptx}" if keep_ptx else "remarks{ptx}"
    return ptxas_report(lambda: compile_bwd(cfg, options=options, tvm_ffi=tvm_ffi))
