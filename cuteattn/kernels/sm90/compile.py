"""Compiles the sm90 forward for a static configuration, against symbolic shapes.

Tensors are described with fake tensors whose sizes and strides are symbolic (only the head
dim is static and unit-stride), so the cubin serves every batch, sequence length, head count and
memory layout with a contiguous head dim. This needs no GPU: with CUTE_DSL_ARCH=sm_90a the same
function runs in CI.
"""
from ..compile_common import compile_kernel, ptxas_report
from . import arguments
from .fwd import FlashFwdSm90, Sm90FwdConfig


def fake_arguments(cfg: Sm90FwdConfig, memspace=None) -> tuple:
    """Symbolic stand-ins for the kernel's arguments but the stream, as arguments.ARGUMENTS
    declares them: tensors (None for varlen metadata the config does not use) and scalar
    placeholders. A `memspace` other than global memory only serves host-side tests of the
    argument binding."""
    return arguments.fakes(cfg, memspace)


def compile_fwd(cfg: Sm90FwdConfig, options: str = "", tvm_ffi: bool = False,
                mod_fns: tuple = (None, None)):
    """Returns the compiled kernel. Call it with the arguments arguments.ARGUMENTS declares, then
    the stream: cute runtime tensors, Int32 and Float32 scalars and a CUstream; or, with `tvm_ffi`,
    torch tensors and Python numbers and no stream (TVM-FFI passes the caller's current stream).
    kernels/sm90/launch.py builds both (launch_arguments). mod_fns: the functions cfg.mask_mod
    and cfg.score_mod key (common/mods.py), traced into the kernel."""
    return compile_kernel(FlashFwdSm90(cfg, mod_fns), fake_arguments(cfg), options, tvm_ffi)


def compile_fwd_with_report(cfg: Sm90FwdConfig, tvm_ffi: bool = False,
                            mod_fns: tuple = (None, None)):
    """compile_fwd, plus what ptxas reported (ptxas_report)."""
    return ptxas_report(lambda: compile_fwd(cfg, options="remarks{ptx}", tvm_ffi=tvm_ffi,
                                            mod_fns=mod_fns))


# ---- the backward ----

def fake_bwd_arguments(cfg) -> tuple:
    """Symbolic stand-ins for FlashBwdSm90's arguments but the stream (arguments.BWD_ARGUMENTS)."""
    return arguments.fakes(cfg, entries=arguments.BWD_ARGUMENTS)


def compile_bwd(cfg, options: str = "", tvm_ffi: bool = False, mask_mod_fn=None,
                score_mod_fn=None):
    """The compiled backward kernel for cfg (bwd.Sm90BwdConfig), like compile_fwd (mask_mod_fn,
    score_mod_fn: the functions cfg.mask_mod and cfg.score_mod key)."""
    from .bwd import FlashBwdSm90
    return compile_kernel(FlashBwdSm90(cfg, mask_mod_fn, score_mod_fn), fake_bwd_arguments(cfg),
                          options, tvm_ffi)
