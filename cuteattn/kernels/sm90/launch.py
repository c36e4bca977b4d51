"""The sm90 forward family: which specs it serves, and how a call becomes a launch.

The host side of kernels/sm90 (the one module here that imports torch): the spec becomes the
kernel's static configuration (config.py), which is the compile key; the compiled kernel comes
from the compile cache; the launch policy (persistent grid size, the causal tile order's L2 groups,
the tile counter) and the scalar arguments are worked out once per Launch, so that a repeated
call only converts its tensors and launches. No host synchronisation, no per-call compilation.
dispatch.py registers the family (families.py lists it) when an sm90 device first asks.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import cutlass
import torch

from ... import compile_cache
from ..._checks import FP8
from ...sparse import KERNEL_BLOCKS
from ...spec import AttentionSpec
from ..launch_common import (CUTLASS_DTYPES, aligned16, call_kernel, kernel_scalars, l2_groups, sm_count,
                            to_runtime, unserved_dtype_or_dims, unserved_form, use_tvm_ffi)
from ..common.convert import FP8_KEY_ORDER
from ..compile_common import first_spill_free
from ..sm80 import launch as sm80_launch
from . import arguments, config
from .arguments import (NO_FP8, NO_MOD, NO_SPARSE, NO_VARLEN, Fp8Descales, ModTensors,
                        SparseMetadata, VarlenMetadata)

ARCH, KIND = "sm90", "fwd"
# the kernel's q/k/v dtypes: fp16/bf16, and fp8 (FlashAttention-3's, with descales; out in bf16)
KERNEL_DTYPES = {**CUTLASS_DTYPES, FP8: cutlass.Float8E4M3FN}


def sm90_config(spec: AttentionSpec):
    """The kernel's static configuration for spec (config.fwd_config: the tiles depend on the
    sequence length class too, config.SHORT_SEQLEN)."""
    return config.fwd_config(
        KERNEL_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.causal, spec.local,
        # (paged keys: the pages are the batch mode, their counts always in seqused_k)
        spec.has_softcap, spec.varlen_q, spec.varlen_k and not spec.paged_kv, spec.has_seqused_q,
        spec.has_seqused_k or spec.paged_kv, max_seqlen_q=spec.seqlen_q,
        sparse_block=(spec.sparse_q_block, spec.sparse_kv_block) if spec.sparse_q_block else None,
        mask_mod=spec.mask_mod, score_mod=spec.score_mod,
        page_size=spec.page_size if spec.paged_kv else 0, has_sink=spec.has_sink,
    )


# The compiled code depends on compile.py and what it imports (fwd.py, arguments.py, common/):
# the disk cache's fingerprint covers those. Not config.py (its choices are in the key) nor this
# file (its choices are runtime arguments).
COMPILE_MODULE = "cuteattn.kernels.sm90.compile"


@functools.lru_cache(maxsize=None)
def sources() -> tuple:
    """The files the family's compiled code depends on (compile_cache.module_sources)."""
    return compile_cache.module_sources(COMPILE_MODULE)


def _compiled(cfg, tvm_ffi: bool, mod_fns: tuple = (None, None)):
    """The compiled kernel for cfg. The key is the frozen config itself: every field of it
    changes the code, and nothing else does (sizes and scales are runtime arguments; a mod's
    key stands for its function, in mod_fns, traced on a miss)."""
    def build():
        from .compile import compile_fwd_with_report
        compile_one = lambda c: compile_fwd_with_report(c, tvm_ffi=tvm_ffi, mod_fns=mod_fns)
        if cfg.mask_mod is None and cfg.score_mod is None:
            return compile_one(cfg)
        # a traced mod's registers depend on the user's function: the widest tile that
        # compiles without spills (the host side does not depend on tile_n)
        _, compiled, report = first_spill_free(config.narrower_tiles(cfg), compile_one)
        return compiled, report
    key = (ARCH, KIND, tvm_ffi, cfg)
    return compile_cache.get_or_compile(key, build, persist=tvm_ffi, sources=sources())


# The kernel's grid is persistent: one CTA per SM walks the tiles (fwd.py says why; one CTA per
# tile measured 2-11% slower, docs/perf-log.md). Host-only callers (tests) have no SMs to count.
_ONE_CTA_PER_TILE = (1 << 31) - 1


def max_ctas(spec: AttentionSpec) -> int:
    """The persistent grid's size: one CTA per SM (a CTA fills an SM's shared memory)."""
    if spec.device_index < 0:
        return _ONE_CTA_PER_TILE
    return sm_count(spec.device_index)


# The counter a dynamically scheduled kernel draws its tiles from (fwd.py: dynamic_tiles). The
# kernel leaves it at zero when it ends, but two launches running at once must not share one,
# so there is one per (device, stream). Kernels without dynamic tiles ignore it: one per device.
_tile_counters: dict = {}


def tile_counter(device_index: int, per_stream: bool) -> torch.Tensor:
    stream = torch.cuda.current_stream(device_index).cuda_stream if (
        per_stream and device_index >= 0) else None
    key = (device_index, stream)
    counter = _tile_counters.get(key)
    if counter is None:
        device = torch.device("cuda", device_index) if device_index >= 0 else torch.device("cpu")
        counter = _tile_counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def launch_scalars(spec: AttentionSpec) -> dict:
    """The kernel's scalar arguments by name (arguments.SCALARS), as Python numbers."""
    score_scale, scale_log2, left, right = kernel_scalars(spec)
    small, num_small = l2_groups(spec)
    return dict(qhead_per_kvhead=spec.qhead_per_kvhead, score_scale=score_scale,
                softmax_scale_log2=scale_log2, window_left=left, window_right=right,
                max_ctas=max_ctas(spec), l2_group=small, l2_small_groups=num_small)


# The kernel's arguments each call passes, in the order a launch passes them (the varlen group
# as its VarlenMetadata fields); the scalars come from launch_scalars. arguments.Binder puts
# both in the kernel's order.
PER_CALL = ("mQ", "mK", "mV", "mO", "mLSE", *arguments.group_names("varlen"),
            *arguments.group_names("sparse"), *arguments.group_names("fp8"),
            *arguments.group_names("mod"), "mPageTable", "mSink", "mTileCounter")


def _binder(scalars: dict, tvm_ffi: bool) -> arguments.Binder:
    return arguments.Binder(PER_CALL, scalars, None if tvm_ffi else to_runtime)


def launch_arguments(spec: AttentionSpec, q, k, v, out, lse, varlen: VarlenMetadata = NO_VARLEN,
                     tvm_ffi: bool = False, scalars: Optional[dict] = None,
                     counter: Optional[torch.Tensor] = None,
                     sparse: SparseMetadata = NO_SPARSE, fp8: Fp8Descales = NO_FP8,
                     mod: ModTensors = NO_MOD, page_table=None, sink=None) -> tuple:
    """The compiled kernel's arguments, less the stream, in the order arguments.ARGUMENTS
    declares: cute runtime tensors and scalars, or for TVM-FFI as they are.
    `scalars`: launch_scalars(spec), when the caller kept them."""
    if counter is None:
        counter = tile_counter(spec.device_index, per_stream=False)
    bind = _binder(launch_scalars(spec) if scalars is None else scalars, tvm_ffi)
    return bind(q, k, v, out, lse, *varlen, *sparse, *fp8, *mod, page_table, sink, counter)


class Launch:
    """The compiled kernel for one spec with its scalar arguments worked out: calling it costs
    only the per-tensor work (alignment check, argument conversion) and the launch itself.
    The API keeps one per distinct call signature, so a repeated call skips everything else."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.tvm_ffi = use_tvm_ffi()
        cfg = sm90_config(spec)
        self.fn = _compiled(cfg, self.tvm_ffi, (getattr(spec.mask_mod, "fn", None),
                                                getattr(spec.score_mod, "fn", None)))
        self.scalars = launch_scalars(spec)
        self.bind = _binder(self.scalars, self.tvm_ffi)
        self.dynamic_tiles = cfg.dynamic_tiles
        self.v_in_kernel = cfg.fp8_v_in_kernel  # (fp8: V's transpose inside the kernel)

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, sparse: SparseMetadata = NO_SPARSE,
                 descales=(None, None, None), mod_tensors=(), page_table=None,
                 learnable_sink=None) -> None:
        """sparse: the block-sparse lists (int32, contiguous in their last mode) when the spec
        is block-sparse. descales: fp8 inputs' (q, k, v) descales, float32 (batch, nheads_k);
        None = 1.0. mod_tensors: the tensors traced mods read, ModTensors' order
        (launch_common.mod_tensors_of). page_table: paged keys' int32 (batch, max_pages) (k, v:
        the pages (num_pages, page_size, h_k, d); the key counts in seqused_k).
        learnable_sink: float32 (nheads,) when the spec has a sink."""
        fp8 = NO_FP8
        if page_table is not None:
            page_table = page_table.contiguous()  # (the kernel takes its pages' mode contiguous)
        if self.spec.dtype == FP8:
            # the bytes cross into the kernel (arguments.py); V transposed for the fp8 P V GEMM,
            # here or inside the kernel (Sm90FwdConfig.fp8_v_in_kernel)
            if self.v_in_kernel:
                v, cu_v = v.view(torch.uint8), None
            else:
                v, cu_v = fp8_value_operand(v, cu_seqlens_k, self.spec.seqlen_k)
                if seqused_k is not None:
                    zero_value_keys_past(v, cu_v, seqused_k)
            q, k = q.view(torch.uint8), k.view(torch.uint8)
            batch = (cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else
                     cu_seqlens_k.shape[0] - 1 if cu_seqlens_k is not None else q.shape[0])
            fp8 = Fp8Descales(*(self._ones(batch, k.shape[-2], q.device) if x is None else x
                                for x in descales), cu_v)
        q, k, v = aligned16(q), aligned16(k), aligned16(v)
        out_k = aligned16(out) if out.dtype == torch.bfloat16 or self.spec.dtype != FP8 else (
            torch.empty_like(out, dtype=torch.bfloat16))  # (fp8's out is bf16 in the kernel)
        counter = tile_counter(self.spec.device_index, per_stream=self.dynamic_tiles)
        # the varlen values in VarlenMetadata's order, as PER_CALL has them
        args = self.bind(q, k, v, out_k, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                         *sparse, *fp8, *ModTensors(*mod_tensors), page_table, learnable_sink,
                         counter)
        call_kernel(self.fn, self.tvm_ffi, args, q.device)
        if out_k is not out:
            out.copy_(out_k)

    def _ones(self, batch: int, nheads_k: int, device) -> torch.Tensor:
        """A missing descale: ones of (batch, nheads_k), kept for the next call."""
        shape = (batch, nheads_k)
        ones = getattr(self, "_ones_cache", None)
        if ones is None or tuple(ones.shape) != shape or ones.device != device:
            ones = self._ones_cache = torch.ones(shape, dtype=torch.float32, device=device)
        return ones


def forward(spec: AttentionSpec, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
            seqused_q=None, seqused_k=None) -> None:
    """Launches the forward kernel on the current stream: writes `out` and `lse` (float32)."""
    Launch(spec)(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)


def fp8_value_operand(v: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None,
                      max_seqlen_k: int = 0) -> tuple:
    """fp8 V as the fp8 P V GEMM takes it (its operands must both be K-major): (V^T, cu_v).
    Batched V (batch, seqlen_k, nheads_k, d_v) -> its bytes transposed to (batch, nheads_k,
    d_v, seqlen_k rounded up to 16, the extra keys zero), cu_v None; packed V (total_k,
    nheads_k, d_v) with cu_seqlens_k -> (nheads_k, d_v, columns), each sequence's keys from
    column cu_v[b] (int32 (batch + 1,)), rounded up to 16 keys, the columns past the last
    sequence zero. The keys of each 16-key group are in FP8_KEY_ORDER (convert.fp8_p_fragment
    says why). On a GPU one pass of fp8_value.py's kernel (which also writes cu_v; max_seqlen_k
    only sizes its grid: a grid-stride loop covers longer sequences); fp8_value_operand_torch
    elsewhere, and as its reference."""
    if not v.is_cuda or v.numel() == 0:
        return fp8_value_operand_torch(v, cu_seqlens_k)
    from .fp8_value import Fp8ValueConfig
    varlen = cu_seqlens_k is not None
    dv = v.shape[-1]
    if varlen:
        batch, hk = cu_seqlens_k.shape[0] - 1, v.shape[1]
        columns = -(-(v.shape[0] + 16 * batch) // 16) * 16  # each sequence rounded up: a bound
        vt = torch.zeros((hk, dv, columns), dtype=torch.uint8, device=v.device)
        cu_v = torch.empty(batch + 1, dtype=torch.int32, device=v.device)
    else:
        b, s, hk, _ = v.shape
        vt = torch.empty((b, hk, dv, -(-s // 16) * 16), dtype=torch.uint8, device=v.device)
        cu_v, max_seqlen_k = None, s
    tvm_ffi = use_tvm_ffi()
    values = (aligned16(v.view(torch.uint8)), vt, cu_seqlens_k, cu_v, max(max_seqlen_k, 1))
    args = values if tvm_ffi else tuple(
        to_runtime(a, x) for a, x in zip(arguments.FP8_VALUE_ARGUMENTS, values))
    call_kernel(_compiled_fp8_value(Fp8ValueConfig(dv, varlen=varlen), tvm_ffi), tvm_ffi, args,
                v.device)
    return vt, cu_v


def _compiled_fp8_value(cfg, tvm_ffi: bool):
    def build():
        from ..compile_common import compile_kernel
        from .fp8_value import Fp8ValueTranspose
        return compile_kernel(Fp8ValueTranspose(cfg), arguments.fakes(
            cfg, entries=arguments.FP8_VALUE_ARGUMENTS), tvm_ffi=tvm_ffi), {}
    return compile_cache.get_or_compile(("sm90", "fp8_value", tvm_ffi, cfg), build, persist=tvm_ffi,
                                        sources=_fp8_value_sources())


@functools.lru_cache(maxsize=None)
def _fp8_value_sources() -> tuple:
    return compile_cache.module_sources("cuteattn.kernels.sm90.fp8_value")


def fp8_value_operand_torch(v: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor] = None) -> tuple:
    """fp8_value_operand in PyTorch: a gather per call (per sequence when packed, reading
    cu_seqlens_k to the host), ten times slower than the kernel on an H200 (docs/perf-log.md)."""
    if cu_seqlens_k is not None:
        cu = [min(max(int(x), 0), v.shape[0]) for x in cu_seqlens_k.tolist()]
        hk, dv = v.shape[1], v.shape[2]
        columns = -(-(v.shape[0] + 16 * (len(cu) - 1)) // 16) * 16
        vt = torch.zeros((hk, dv, columns), dtype=torch.uint8, device=v.device)
        starts = [0]
        for b in range(len(cu) - 1):  # clamped as the kernels clamp (seqlen_info.sequence_range)
            offset = cu[b]
            length = min(max(cu[b + 1], offset), v.shape[0]) - offset
            one, _ = fp8_value_operand_torch(v[offset:offset + length].unsqueeze(0))
            vt[:, :, starts[-1]:starts[-1] + one.shape[-1]] = one[0]
            starts.append(starts[-1] + one.shape[-1])
        return vt, torch.tensor(starts, dtype=torch.int32, device=v.device)
    b, s, hk, dv = v.shape
    x = v.view(torch.uint8)
    s16 = -(-s // 16) * 16
    if s16 != s:
        padded = torch.zeros((b, s16, hk, dv), dtype=torch.uint8, device=v.device)
        padded[:, :s] = x
        x = padded
    order = _key_order(v.device)
    groups = x.view(b, s16 // 16, 16, hk, dv).permute(0, 3, 4, 1, 2)  # (b, hk, dv, G, 16)
    return groups[..., order].reshape(b, hk, dv, s16), None


def zero_value_keys_past(vt: torch.Tensor, cu_v: Optional[torch.Tensor],
                         seqused_k: torch.Tensor) -> None:
    """fp8 V^T (fp8_value_operand's) with each sequence's keys from its seqused_k on set to
    0, in place: they are memory the call does not own (NaN and Inf possible), and a P of 0
    times NaN is NaN in the P V GEMM (the bf16 kernels zero those rows themselves,
    fwd.Sm90FwdConfig.zeroes_v_past_end). A column's key: its 16-key group's start plus
    FP8_KEY_ORDER[its slot]; packed, each sequence's columns start at cu_v[b] (a multiple of
    16). A few small kernels, no sync."""
    col = torch.arange(vt.shape[-1], device=vt.device)
    order = _key_order(vt.device)
    if cu_v is None:  # (b, h_k, d_v, s16)
        key = col - col % 16 + order[col % 16]
        vt.masked_fill_((key[None, :] >= seqused_k[:, None].long())[:, None, None, :], 0)
        return
    seq = (torch.searchsorted(cu_v.long(), col, right=True) - 1).clamp(0, seqused_k.shape[0] - 1)
    within = col - cu_v.long()[seq]
    key = within - within % 16 + order[within % 16]
    vt.masked_fill_((key >= seqused_k.long()[seq])[None, None, :], 0)


@functools.lru_cache(maxsize=None)
def _key_order(device) -> torch.Tensor:
    return torch.tensor(FP8_KEY_ORDER, dtype=torch.long, device=device)


def unserved_mods(spec: AttentionSpec) -> Optional[str]:
    """The reason the forward does not trace spec's mask_mod / score_mod, or None (also
    without them)."""
    mods = [m for m in (spec.mask_mod, spec.score_mod) if m is not None]
    if not mods:
        return None
    if spec.score_mod is not None and spec.has_softcap:
        return "softcap with a score_mod: no sm90 kernel (write the softcap in the score_mod)"
    if not all(hasattr(m, "fn") for m in mods):
        return "mask_mod / score_mod: the function is not attached to the spec"
    return None


def unserved_fp8(spec: AttentionSpec) -> Optional[str]:
    """The reason the fp8 forward does not take spec (an fp8 spec), or None."""
    if spec.head_dim not in config.FP8_TILES or spec.head_dim_v != spec.head_dim:
        return (f"fp8 at head_dim {spec.head_dim} (head_dim_v {spec.head_dim_v}): the sm90 fp8 "
                f"forward takes head dims {', '.join(map(str, config.FP8_TILES))} (multiples "
                f"of its 32-column k step), head_dim_v equal")
    if spec.sparse_q_block:
        return "fp8 block-sparse: no sm90 fp8 kernel yet"
    if spec.mask_mod is not None or spec.score_mod is not None:
        return "fp8 with a mask_mod / score_mod: no sm90 fp8 kernel yet"
    return None


class Sm90Forward:
    """The kernel family of ("sm90", "fwd") (dispatch.KernelFamily). A paged prefill
    (flash_attn_varlen_func(block_table=)) it reads itself where config.paged_tile_n finds a
    key block for the page size (a TMA copy per block, or per page slice of a block); other
    pages, and the forms it declines there, it hands to the portable kernel, compiled for
    sm_90a, which gathers rows per page."""
    arch, kind = ARCH, KIND

    def can_implement(self, spec: AttentionSpec) -> Optional[str]:
        if spec.paged_kv:
            return None if unserved_paged(spec) is None else PAGED_PREFILL.can_implement(spec)
        if spec.dtype == FP8:
            return unserved_fp8(spec) or unserved_form(spec, ARCH, "forward")
        return (unserved_dtype_or_dims(spec, ARCH, "forward", config.SUPPORTED_HEAD_DIMS,
                                       padded_dims=True)
                or unserved_form(spec, ARCH, "forward", mods=True, sinks=not spec.mods_or_lists)
                or unserved_sparse(spec) or unserved_mods(spec))

    def launch(self, spec: AttentionSpec):
        if spec.paged_kv and unserved_paged(spec) is not None:
            return PAGED_PREFILL.launch(spec)
        if gathers_pages(spec):
            return GatheredPagesLaunch(spec)
        return Launch(spec)


def gathers_pages(spec: AttentionSpec) -> bool:
    """Whether a paged prefill the sm90 forward serves gathers its pages first
    (config.PAGED_GATHER_MIN_ROWS says when)."""
    if not spec.paged_kv or not config.sliced_pages(spec.page_size):
        return False
    keys = -(-spec.seqlen_k // spec.page_size) * spec.page_size
    nbytes = (spec.batch * keys * spec.nheads_k * (spec.head_dim + spec.head_dim_v)
              * spec.dtype.itemsize)
    return (spec.seqlen_q * spec.qhead_per_kvhead >= config.PAGED_GATHER_MIN_ROWS
            and nbytes <= config.PAGED_GATHER_MAX_BYTES)


class GatheredPagesLaunch:
    """A paged prefill over pages smaller than a key block, by gathering (gathers_pages): each
    sequence's first ceil(max_seqlen_k / page) pages copied into batched (batch, keys, h_k, d)
    K and V (one index_select each), then the batched-keys kernel (packed q, seqused_k) on
    them. Rows past a sequence's keys hold whatever its pages held there (or, for table entries
    past its pages, a page clamped into the cache): the kernel reads no key past seqused_k."""

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.pages = -(-spec.seqlen_k // spec.page_size)
        self.inner = Launch(dataclasses.replace(
            spec, paged_kv=False, page_size=0, varlen_k=False, has_seqused_k=True,
            seqlen_k=self.pages * spec.page_size))

    def __call__(self, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, page_table=None, learnable_sink=None) -> None:
        batch, pages = page_table.shape[0], min(self.pages, page_table.shape[1])
        if pages == 0 or k.shape[0] == 0:  # (no key to gather: the pages' own kernel)
            Launch(self.spec)(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                              seqused_k, page_table=page_table, learnable_sink=learnable_sink)
            return
        # (entries past a sequence's pages may hold anything: FlashAttention pads tables freely)
        index = page_table[:, :pages].clamp(0, k.shape[0] - 1).reshape(-1)
        gather = lambda x: x.index_select(0, index).view(batch, pages * x.shape[1], *x.shape[2:])
        self.inner(q, gather(k), gather(v), out, lse, cu_seqlens_q, None, seqused_q, seqused_k,
                   learnable_sink=learnable_sink)


def unserved_paged(spec: AttentionSpec) -> Optional[str]:
    """The reason the sm90 forward does not read a paged prefill's pages itself, or None."""
    if not spec.varlen_q or spec.page_size <= 0:
        return "paged keys need packed q (flash_attn_varlen_func) and a page size"
    if spec.dtype == FP8 or spec.mods_or_lists:
        return "paged keys with fp8, block-sparse lists or mods: no sm90 kernel"
    form = dataclasses.replace(spec, paged_kv=False, varlen_k=True, has_seqused_k=True)
    # (a learnable sink: the epilogue's, whatever the keys' layout)
    reason = (unserved_dtype_or_dims(form, ARCH, "forward", config.SUPPORTED_HEAD_DIMS,
                                     padded_dims=True)
              or unserved_form(form, ARCH, "forward", sinks=True))
    if reason is not None:
        return reason
    try:
        sm90_config(spec)
    except ValueError as e:  # pages no key block fits (config.paged_tile_n)
        return str(e)
    return None


def unserved_sparse(spec: AttentionSpec) -> Optional[str]:
    """The reason the block-sparse kernel does not take spec, or None (also for dense specs)."""
    if not spec.sparse_q_block:
        return None
    block = (spec.sparse_q_block, spec.sparse_kv_block)
    if block not in KERNEL_BLOCKS:
        shapes = ", ".join(f"{q}x{k}" for q, k in KERNEL_BLOCKS)
        return f"block-sparse blocks of {block[0]}x{block[1]}: the sm90 kernel takes {shapes}"
    if spec.head_dim > config.SPARSE_MAX_HEAD_DIM:
        return (f"block-sparse at head_dim {spec.head_dim}: the sm90 kernel takes head dims up "
                f"to {config.SPARSE_MAX_HEAD_DIM}")
    # packed sequences: the lists' batch mode is the sequence, their blocks count from its
    # start (FlashAttention-4's varlen semantics); the kernel's tiles already index them so
    return None


PAGED_PREFILL = sm80_launch.FORWARD
FORWARD = Sm90Forward()
