"""Which kernel family serves an AttentionSpec on a device.

A family is what one architecture offers for one kind of problem (spec.kind: "fwd", later
"bwd", "decode", "combine"): it says whether it serves a spec (`can_implement`: None, or the
reason it does not) and turns a spec it serves into a callable launch (`launch`). Families are
registered here under (arch, kind): those of an arch's module (its FAMILIES) when a device of that
arch first asks, others by `register`. This module knows nothing of any kernel beyond the table
of modules per arch, so the CPU path and other architectures never import the DSL or a kernel
they cannot run.

The API asks `can_implement(spec, device)` and either calls `launch(spec, device)` or falls back
to the reference, quoting the reason (a warning, or an error in strict mode).
"""
from __future__ import annotations

import importlib
import os
import re
from typing import Callable, Dict, Optional, Protocol, Tuple

import torch

from .spec import AttentionSpec

# Compute capability major -> the arch name families register under. The only place a device's
# capability is looked at: the families themselves are per arch. "sm80" is the mma.sync path
# (Ampere, Ada, Blackwell, Thor); "sm90" the Hopper kernels. Datacenter Blackwell (sm_100/103)
# and Thor (sm_110) take the mma.sync path until they have kernels of their own (tcgen05): the
# kernels verified on Hopper, compiled for the target (spill-free for sm_100a:
# tests/test_compile_sm80.py; not the same machine code, LLVM and ptxas lower them per target),
# far faster than the reference they fell back to before.
ARCH_BY_MAJOR = {8: "sm80", 9: "sm90", 10: "sm80", 11: "sm80", 12: "sm80"}

# arch -> the module whose FAMILIES serve that arch, imported on the first spec for a device of
# that arch (so the DSL is imported only where a kernel can run).
FAMILY_MODULES = {"sm80": "cuteattn.kernels.sm80.families",
                  "sm90": "cuteattn.kernels.sm90.families"}

# CUTEATTN_PATH=sm80 sends every device of compute capability 8.0 or later to the mma.sync path
# (compiled for the running arch, with sm_80 instructions only): how that path is tested and
# measured on a Hopper GPU. Read at each dispatch; launches made earlier keep their path.
PATH_ENV = "CUTEATTN_PATH"
PATH_MIN_MAJOR = {"sm80": 8}


class KernelFamily(Protocol):
    arch: str  # the arch name it registers under ("sm90")
    kind: str  # the AttentionSpec.kind it serves ("fwd")

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        """None when the family serves spec, else the reason it does not (for the user)."""

    def launch(self, spec: AttentionSpec) -> Callable:
        """The callable launch for spec: (q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_q=None, seqused_k=None) -> None, writing out and lse on the current stream."""


_families: Dict[Tuple[str, str], KernelFamily] = {}
_import_errors: Dict[str, str] = {}


def register(arch: str, kind: str, family: KernelFamily) -> None:
    """Make `family` the one that serves `kind` problems on `arch` (a later call replaces it)."""
    _families[(arch, kind)] = family


def target_capability(target: str) -> Tuple[int, int]:
    """(major, minor) of a compile target's name (CUTE_DSL_ARCH style: sm_86, sm_90a, sm_120a):
    for callers that choose kernels without a GPU (precompile, compile-only configs)."""
    match = re.fullmatch(r"sm_(\d+?)(\d)[a-z]?", target)
    if not match:
        raise ValueError(f"{target!r}: expected an arch like sm_86, sm_90a or sm_120a")
    return int(match[1]), int(match[2])


def arch_name(major: int, minor: int) -> Tuple[Optional[str], Optional[str]]:
    """(arch name, None), or (None, the reason no kernel runs on compute capability major.minor).
    CUTEATTN_PATH, when set, names the path instead of the capability."""
    path = os.environ.get(PATH_ENV)
    if path:
        if path not in PATH_MIN_MAJOR:
            return None, (f"{PATH_ENV}={path!r} names no kernel path (paths: "
                          f"{', '.join(sorted(PATH_MIN_MAJOR))})")
        if major < PATH_MIN_MAJOR[path]:
            return None, f"{PATH_ENV}={path} needs sm_{PATH_MIN_MAJOR[path]}0 or later, not sm_{major}{minor}"
        return path, None
    arch = ARCH_BY_MAJOR.get(major)
    if arch is None:
        served = ", ".join(sorted(ARCH_BY_MAJOR.values()))
        return None, f"no kernel for sm_{major}{minor} (cuteattn has kernels for: {served})"
    return arch, None


def _load(arch: str) -> Optional[str]:
    """Registers the families of arch's module (importing it on first use); the reason if it
    cannot be imported. The module lists its families (FAMILIES) rather than registering them as
    a side effect of its import, so they are registered again into a registry that was replaced
    (tests swap it) and the module needs no import of this one."""
    module = FAMILY_MODULES.get(arch)
    if module is None or arch in _import_errors:
        return _import_errors.get(arch)
    try:
        families = importlib.import_module(module).FAMILIES
    except ImportError as e:  # the DSL missing, say: a reason to fall back, not a crash
        _import_errors[arch] = f"the {arch} kernels could not be imported ({type(e).__name__}: {e})"
        return _import_errors[arch]
    for family in families:
        register(arch=family.arch, kind=family.kind, family=family)
    return None


def lookup(arch: str, kind: str) -> Tuple[Optional[KernelFamily], Optional[str]]:
    """(family, None), or (None, the reason there is none for (arch, kind))."""
    family = _families.get((arch, kind))
    if family is None:
        reason = _load(arch)
        if reason is not None:
            return None, reason
        family = _families.get((arch, kind))
    if family is None:
        return None, f"no {kind} kernel for {arch}"
    return family, None


def _family(spec: AttentionSpec, device: torch.device) -> Tuple[Optional[KernelFamily], Optional[str]]:
    if device.type != "cuda":
        return None, f"no kernel for device type {device.type!r}"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    arch, reason = arch_name(*torch.cuda.get_device_capability(device))
    if reason is not None:
        return None, reason
    return lookup(arch, spec.kind)


def can_implement(spec: AttentionSpec, device: torch.device) -> Optional[str]:
    """None when a kernel serves spec on device, else the reason (for the user)."""
    family, reason = _family(spec, device)
    return reason if family is None else family.can_implement(spec)


def launch(spec: AttentionSpec, device: torch.device) -> Callable:
    """The launch for spec on device (compiled now if this is its first use). Only for a spec
    can_implement accepted."""
    family, reason = _family(spec, device)
    if family is None:
        raise RuntimeError(f"cuteattn: {reason}")
    return family.launch(spec)
