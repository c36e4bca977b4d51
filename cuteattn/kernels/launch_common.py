"""Host-side helpers every kernel family's launch uses (torch and the DSL's runtime, no kernel
code): dtype mapping, the kernel's scalar conventions, tensors to cute runtime tensors, the
call path (TVM-FFI or DLPack), and device facts (SM count, L2 size) for launch policies."""
from __future__ import annotations

import functools
import math
from typing import Optional

import cutlass
import torch

from ..spec import AttentionSpec
from .common import arguments

UNBOUNDED = 1 << 30  # an unbounded window side as the kernels see it
LOG2E = 1.0 / math.log(2.0)
CUTLASS_DTYPES = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}


# Call the kernels through TVM-FFI: torch tensors and Python numbers go straight in and the
# stream comes from torch, ~1 us per call instead of ~95 us of DLPack conversion (host-only
# probe on the CPU). GPU-verified at c5a578c (136 cases correct, docs/perf-log.md).
# Without apache-tvm-ffi installed, or with this set to False, calls go through DLPack.
USE_TVM_FFI = True


def use_tvm_ffi() -> bool:
    if not USE_TVM_FFI:
        return False
    try:
        import tvm_ffi  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def call_kernel(fn, tvm_ffi: bool, args: tuple, device: torch.device) -> None:
    """Run a compiled kernel on the current stream: TVM-FFI takes torch's stream itself; the
    DLPack path passes it last."""
    if tvm_ffi:
        fn(*args)
    else:
        import cuda.bindings.driver as cuda
        fn(*args, cuda.CUstream(torch.cuda.current_stream(device).cuda_stream))


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_per_sm(device_index: int) -> int:
    """Shared memory an SM holds for its CTAs (each CTA's share plus 1 KB the system keeps)."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_multiprocessor",
                   props.shared_memory_per_block_optin + 1024)


@functools.lru_cache(maxsize=None)
def l2_bytes(device_index: int) -> int:
    if device_index < 0:
        return 50 << 20  # an H100/H200's, for host-only callers (tests)
    return torch.cuda.get_device_properties(device_index).L2_cache_size


# The share of L2 a group of the causal tile order may fill with its K/V (the rest for the next
# group's first tiles, Q and O). FlashAttention-4's sm90 order fills all of it, rounded down to
# a power of two of heads (4 heads of d=192/128 at 16k where this gives 2).
L2_SHARE = 0.5


def l2_group(spec: AttentionSpec) -> int:
    """(batch, head) pairs per group of the causal/windowed tile order (common/tile_scheduler.py):
    as many as have K/V in L2_SHARE of the L2, in whole GQA groups, at least one."""
    elem = spec.dtype.itemsize
    kv_head_bytes = max(spec.seqlen_k, 1) * (spec.head_dim + spec.head_dim_v) * elem
    kv_heads = max(1, int(l2_bytes(spec.device_index) * L2_SHARE) // kv_head_bytes)
    return kv_heads * spec.qhead_per_kvhead


def balanced_l2_groups(pairs: int, max_pairs: int, unit: int) -> tuple:
    """(pairs per small group, number of small groups) of the causal tile order: as few groups
    as `max_pairs` per group allows, their sizes within one `unit` (the pairs sharing K/V under
    GQA) of each other; the groups after the small ones have `unit` more pairs."""
    units = max(pairs // unit, 1)
    num_groups = -(-units // max(max_pairs // unit, 1))
    return units // num_groups * unit, num_groups - units % num_groups


def l2_groups(spec: AttentionSpec, packed: bool = False) -> tuple:
    """(pairs per small group, number of small groups): l2_group's budget, balanced. packed: the
    kernel packs every query head of a kv head into its tiles (pack-GQA), so its pairs are
    (batch, kv head), one K/V each: the groups must count those, or the tile order (which
    walks batch x nheads_k pairs) would hand most tiles to pairs past the batch and leave query
    blocks of the real ones unvisited."""
    if packed:
        return balanced_l2_groups(max(spec.batch * spec.nheads_k, 1),
                                  max(l2_group(spec) // spec.qhead_per_kvhead, 1), 1)
    return balanced_l2_groups(max(spec.batch * spec.nheads, 1), l2_group(spec),
                              spec.qhead_per_kvhead)


def to_cute(t: Optional[torch.Tensor], align: int = 16):
    if t is None:
        return None
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.ndim - 1)


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """TMA (and the kernel's compiled promise) needs a 16-byte aligned base and strides that are
    multiples of 16 bytes. Tensors that are not (odd views, storage offsets) are copied."""
    unit = 16 // t.element_size()
    if t.data_ptr() % 16 == 0:
        for st in t.stride()[:-1]:  # (a plain loop: a decode step makes four of these checks)
            if st % unit:
                break
        else:
            return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def kernel_scalars(spec: AttentionSpec):
    """(score_scale, softmax_scale_log2, window_left, window_right) as the kernel takes them."""
    if spec.score_mod is not None:
        # the kernel scales the scores itself for the score_mod, whose results are final
        score_scale, scale_log2 = spec.softmax_scale, LOG2E
    elif spec.has_softcap:
        # s' = softcap * tanh(s * scale / softcap); exp(s') = exp2(tanh(...) * softcap * log2 e)
        score_scale = spec.softmax_scale / spec.softcap
        scale_log2 = spec.softcap * LOG2E
    else:
        score_scale = spec.softmax_scale
        scale_log2 = spec.softmax_scale * LOG2E
    left = UNBOUNDED if spec.window_left is None else spec.window_left
    right = UNBOUNDED if spec.window_right is None else spec.window_right
    return score_scale, scale_log2, left, right


def to_runtime(arg: arguments.Arg, value):
    """A value as the DLPack call path passes it: a cute runtime tensor or a DSL scalar."""
    if arg.kind in arguments.SCALAR_TYPES:
        return arguments.SCALAR_TYPES[arg.kind](value)
    return to_cute(value, arg.align)


def compiled_width(d: int, widths) -> Optional[int]:
    """The narrowest compiled head-dim width at least d (None: wider than every width). A head
    dim between widths runs on the next one up: TMA fills the columns past the tensor's head dim
    with zeros (so q.k and p.v are exact) and the O store leaves them out."""
    return min((w for w in widths if w >= d), default=None)


def unserved_dtype_or_dims(spec: AttentionSpec, arch: str, who: str, head_dims,
                           padded_dims: bool = False, narrower_v: bool = False) -> Optional[str]:
    """The reason the `arch` `who` ("forward", "backward") does not take spec's dtype or head
    dims, or None. Without `padded_dims`, q's head dim must be one of `head_dims` and v's equal
    to it; with it (a kernel that pads, see compiled_width) any head dim up to the widest, and
    v's any up to q's. A backward takes v's head dim equal to q's, or with `narrower_v` (one
    that reads each tensor zero-filled past its own width: sm90's TMA) any up to q's."""
    if spec.dtype not in CUTLASS_DTYPES:
        return f"dtype {spec.dtype} is not supported by the {arch} {who} (fp16, bf16)"
    supported = ", ".join(map(str, head_dims))
    if who == "backward":
        # a padding backward runs a head dim between widths on the next one up, with its
        # gradient buffers at that width (BackwardLaunch); with narrower_v, v and dO at their
        # own head dim inside that width (read zero-filled: their columns past it add nothing
        # to dP = dO V^T and come out 0 in dV, which bwd_postprocess cuts to v's width)
        served = (compiled_width(spec.head_dim, head_dims) is not None if padded_dims
                  else spec.head_dim in head_dims)
        v_served = (spec.head_dim_v <= spec.head_dim if narrower_v
                    else spec.head_dim_v == spec.head_dim)
        if not served or not v_served:
            return (f"head_dim {spec.head_dim} (head_dim_v {spec.head_dim_v}) has no {arch} "
                    f"backward kernel yet (supported: {supported}"
                    f"{', and head dims between them padded to the next' if padded_dims else ''}"
                    f"; head_dim_v {'at most' if narrower_v else 'equal to'} head_dim)")
        return None
    if padded_dims:
        if compiled_width(spec.head_dim, head_dims) is None:
            return (f"head_dim {spec.head_dim} is wider than the {arch} {who}'s widest "
                    f"({max(head_dims)})")
        if spec.head_dim_v > spec.head_dim:
            return (f"head_dim_v {spec.head_dim_v} > head_dim {spec.head_dim} is not supported by "
                    f"the {arch} {who} (head_dim_v <= head_dim)")
        return None
    if spec.head_dim not in head_dims:
        return (f"head_dim {spec.head_dim} is not supported by the {arch} {who} "
                f"(supported: {supported})")
    if spec.head_dim_v != spec.head_dim:
        return (f"head_dim_v {spec.head_dim_v} != head_dim {spec.head_dim} is not supported "
                f"by the {arch} {who}")
    return None


def unserved_form(spec: AttentionSpec, arch: str, who: str, mods: bool = False,
                  sinks: bool = False) -> Optional[str]:
    """The reason the `arch` `who` ("forward", "backward") does not take spec's form, or None:
    a learnable sink (unless `sinks`); paged keys; a mask_mod or score_mod (unless `mods`: the
    family traces them)."""
    if (spec.mask_mod is not None or spec.score_mod is not None) and not mods:
        return f"mask_mod / score_mod: no {arch} {who} traces them yet"
    if spec.has_sink and not sinks:
        return f"learnable attention sinks: no {arch} {who} takes them yet"
    if spec.paged_kv:
        return f"paged keys (block_table): no {arch} {who} reads pages yet"
    return None


# ---- the backward's PyTorch steps, shared by the backward families ----

def _rows_padded(rows: int) -> int:
    return (rows + 3) // 4 * 4


def bwd_preprocess(dout, out, lse, cu_seqlens_q=None, seqused_q=None, tile_m: int = 64):
    """bwd_preprocess_torch's results, by one CuTe kernel on a GPU (common/bwd_preprocess.py:
    one pass over dO and O, where the PyTorch steps make float32 copies of both)."""
    if not out.is_cuda or out.dtype not in CUTLASS_DTYPES:
        return bwd_preprocess_torch(dout, out, lse, cu_seqlens_q, seqused_q, tile_m)
    if cu_seqlens_q is None:
        shape = (*lse.shape[:-1], _rows_padded(lse.shape[-1]))
    else:
        batch = cu_seqlens_q.shape[0] - 1
        shape = (lse.shape[0], _rows_padded(lse.shape[1] + tile_m * (batch + 1)) + 4)
    lse2 = torch.zeros(shape, dtype=torch.float32, device=lse.device)
    dsum = torch.zeros(shape, dtype=torch.float32, device=lse.device)
    from .common.bwd_preprocess import PreprocessConfig
    cfg = PreprocessConfig(CUTLASS_DTYPES[out.dtype], out.shape[-1], tile_m,
                           varlen_q=cu_seqlens_q is not None, has_seqused_q=seqused_q is not None)
    tvm_ffi = use_tvm_ffi()
    values = (aligned16(out), aligned16(dout), lse, lse2, dsum, cu_seqlens_q, seqused_q)
    args = values if tvm_ffi else tuple(
        to_runtime(a, v) for a, v in zip(arguments.PREPROCESS_ARGUMENTS, values))
    call_kernel(_compiled_preprocess(cfg, tvm_ffi), tvm_ffi, args, out.device)
    return lse2, dsum


@functools.lru_cache(maxsize=None)
def _preprocess_sources() -> tuple:
    from .. import compile_cache
    return compile_cache.module_sources("cuteattn.kernels.common.bwd_preprocess")


def _compiled_preprocess(cfg, tvm_ffi: bool):
    from .. import compile_cache

    def build():
        from .common.bwd_preprocess import BwdPreprocess
        from .compile_common import compile_kernel
        return compile_kernel(BwdPreprocess(cfg), arguments.fakes(cfg, arguments.PREPROCESS_ARGUMENTS),
                              tvm_ffi=tvm_ffi), {}
    return compile_cache.get_or_compile(("common", "bwd_preprocess", tvm_ffi, cfg), build,
                                        persist=tvm_ffi, sources=_preprocess_sources())


def bwd_preprocess_torch(dout, out, lse, cu_seqlens_q=None, seqused_q=None, tile_m: int = 64):
    """(lse_log2, dsum), float32 (b, h, s_pad) with s_pad = s rounded up to a multiple of 4, pad
    rows 0. Packed (cu_seqlens_q given): (h, rows) with sequence b's rows starting at row
    (cu_seqlens_q[b] // tile_m + b) * tile_m (the backward kernels' row_view; for sm90 TMA tiles of
    these rows must start 16-byte aligned), computed on the device (no sync).
    Rows past seqused_q get LSE +inf and D 0: the forward never wrote their out and lse (any bits,
    NaN included), and the kernel, which masks them (P = 0), must not multiply a NaN by that 0."""
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    d = (dout.float() * out.float()).sum(-1).transpose(-1, -2)  # (b, h, s) or (h, total)
    if seqused_q is not None:
        if cu_seqlens_q is None:  # (b, h, s): row i of batch b is used if i < seqused_q[b]
            unused = torch.arange(lse.shape[-1], device=lse.device) >= seqused_q[:, None, None]
        else:  # (h, total): row r of sequence b is used if r - cu_seqlens_q[b] < seqused_q[b]
            row = torch.arange(lse.shape[-1], device=lse.device)
            b = (torch.searchsorted(cu_seqlens_q, row.to(torch.int32), right=True) - 1).clamp(
                0, max(seqused_q.shape[0] - 1, 0))
            unused = (row - cu_seqlens_q.long()[b]) >= seqused_q.long()[b]
        lse2 = lse2.masked_fill(unused, float("inf"))
        d = d.masked_fill(unused, 0.0)
    if cu_seqlens_q is None:
        rows = lse.shape[-1]
        shape = (*lse.shape[:-1], _rows_padded(rows))
        lse2_p = torch.zeros(shape, dtype=torch.float32, device=lse.device)
        dsum_p = torch.zeros(shape, dtype=torch.float32, device=lse.device)
        lse2_p[..., :rows] = lse2
        dsum_p[..., :rows] = d
        return lse2_p, dsum_p
    h, total = lse.shape
    batch = cu_seqlens_q.shape[0] - 1
    dump = _rows_padded(total + tile_m * (batch + 1))  # past every sequence's slot
    row = torch.arange(total, device=lse.device)
    b = torch.searchsorted(cu_seqlens_q, row.to(torch.int32), right=True) - 1
    inside = (b >= 0) & (b < batch)
    b = b.clamp(0, max(batch - 1, 0))
    start = cu_seqlens_q.long()[b]
    target = torch.where(inside, (start // tile_m + b) * tile_m + (row - start), dump)
    lse2_p = torch.zeros((h, dump + 4), dtype=torch.float32, device=lse.device)
    dsum_p = torch.zeros((h, dump + 4), dtype=torch.float32, device=lse.device)
    lse2_p[:, target] = lse2
    dsum_p[:, target] = d
    return lse2_p, dsum_p


def bwd_buffers(spec: AttentionSpec, q, k, width: int):
    """(dK and dV per query head in q's dtype: zeroed where some rows are written by no key
    block (packed sequences, seqused)), with the kernel's head-dim width: a head dim between
    compiled widths gets buffers at the next width, whose extra columns the kernel fills (with
    zeros: q, k, v and dO are read zero-filled past their head dim) and bwd_postprocess drops.
    (dQ's accumulator: BackwardLaunch.dq_accumulator.)"""
    dkv_shape = (*k.shape[:-2], spec.nheads, width)
    alloc = torch.zeros if (spec.varlen_k or spec.has_seqused_k) else torch.empty
    return (alloc(dkv_shape, dtype=q.dtype, device=q.device),
            alloc(dkv_shape, dtype=q.dtype, device=q.device))


def bwd_postprocess(dq, dk, dv, q, k, v, ratio: int):
    """(dq, dk and dv summed over the query heads of each kv head), each at its tensor's head
    dim (contiguous) when the buffers are wider (bwd_buffers)."""
    d, d_v = q.shape[-1], v.shape[-1]
    if ratio > 1:
        group = (*k.shape[:-2], k.shape[-2], ratio, dk.shape[-1])
        dk = dk.view(group).sum(-2)
        dv = dv.view(group).sum(-2)
    if dk.shape[-1] != d:
        dk = dk[..., :d].contiguous()
    if dv.shape[-1] != d_v:
        dv = dv[..., :d_v].contiguous()
    return dq, dk, dv


# What each backward call passes, in this order (the scalars fixed per spec come from the launch)
BWD_PER_CALL = ("mQ", "mK", "mV", "mdO", "mLSE2", "mD", "mdQacc", "mdK", "mdV",
                *arguments.group_names("varlen", arguments.backward_arguments()), "mSemaphore",
                "num_n_blocks", "heads_interleaved")


class BackwardLaunch:
    """A compiled backward kernel for one spec (either family: the kernels share their
    arguments, common/arguments.backward_arguments, and their tiling facts tile_m, tile_n and
    deterministic). A call runs the three steps on the current stream, no host sync:
    bwd_preprocess, the kernel (one CTA per key block), bwd_postprocess."""

    def __init__(self, spec: AttentionSpec, cfg, fn, tvm_ffi: bool, entries):
        self.spec, self.cfg, self.fn, self.tvm_ffi = spec, cfg, fn, tvm_ffi
        score_scale, scale_log2, left, right = kernel_scalars(spec)
        fixed = dict(qhead_per_kvhead=spec.qhead_per_kvhead, softmax_scale=spec.softmax_scale,
                     score_scale=score_scale, softmax_scale_log2=scale_log2, window_left=left,
                     window_right=right)
        # a family whose kernel takes block-sparse lists (sm90) is passed them after mSemaphore
        self.sparse_names = tuple(n for n in ("mFullCount", "mFullIndex", "mPartialCount",
                                              "mPartialIndex", "mKeyHalves", "mDqTurns")
                                  if n in arguments.names(entries))
        # and a traced mask_mod's and score_mod's tensors after them (common/mods.py)
        self.mod_names = tuple(n for n in ("mModTensor0", "mModTensor1", "mModTensor2",
                                           "mModTensor3") if n in arguments.names(entries))
        per_call = (*BWD_PER_CALL[:-2], *self.sparse_names, *self.mod_names, *BWD_PER_CALL[-2:])
        self.bind = arguments.Binder(per_call, fixed, entries, None if tvm_ffi else to_runtime)
        # batched keys that are one key: dQ and dK exactly 0, by their scale (common/one_key.py;
        # packed keys and seqused_k: the kernel's per-sequence scale)
        self.bind_one_key = None if spec.has_sink else arguments.Binder(
            per_call, {**fixed, "softmax_scale": 0.0}, entries, None if tvm_ffi else to_runtime)

    def __call__(self, dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, sparse: tuple = (), mod_tensors: tuple = (),
                 sink=None):
        """(dq, dk, dv), and dsink after them when a learnable sink (float32 (nheads,)) is
        given. sparse: a block-sparse spec's transposed lists (sparse.transpose of the
        forward's: per key block, the query blocks that see it), in SparseMetadata's order; for
        lists of 64-key blocks the pairs' lists and the halves' table (sparse.transpose_paired).
        mod_tensors: the tensors a traced mask_mod reads (mod_tensors_of)."""
        spec, cfg = self.spec, self.cfg
        q, k, v, dout = (aligned16(t) for t in (q, k, v, dout))
        lse2, dsum = bwd_preprocess(dout, out, lse, cu_seqlens_q, seqused_q, cfg.tile_m)
        # the grid's key blocks from k's layout, the semaphores from q's (one side may be packed)
        if cu_seqlens_k is not None:
            n_blocks = k.shape[0] // cfg.tile_n + cu_seqlens_k.shape[0] - 1  # >= sum ceil(len / tile_n)
        else:
            n_blocks = -(-k.shape[1] // cfg.tile_n)
        splits = self.dq_splits(q, k, cu_seqlens_q, cu_seqlens_k)
        dq_acc, dq_arg = self.dq_accumulator(q, cfg.head_dim, max(splits, 1))
        dk, dv = bwd_buffers(spec, q, k, cfg.head_dim)
        if cu_seqlens_q is not None:
            slots = q.shape[0] // cfg.tile_m + 2 * (cu_seqlens_q.shape[0] - 1) + 1  # (dq_order)
        else:
            slots = q.shape[0] * -(-q.shape[1] // cfg.tile_m)
        semaphore = (torch.zeros((spec.nheads, slots), dtype=torch.int32, device=q.device)
                     if cfg.deterministic and not splits
                     else _unused_semaphores(q.device, spec.nheads))
        if splits and n_blocks > 0:
            n_blocks = splits  # (grid x: the splits, each walking its key blocks)
        if n_blocks > 0:
            lists = tuple(sparse) + (None,) * (len(self.sparse_names) - len(sparse))
            lists += tuple(mod_tensors) + (None,) * (len(self.mod_names) - len(mod_tensors))
            one_key = (cu_seqlens_k is None and seqused_k is None and k.shape[1] == 1
                       and self.bind_one_key is not None)
            bind = self.bind_one_key if one_key else self.bind
            args = bind(q, k, v, dout, lse2, dsum, dq_arg, dk, dv, cu_seqlens_q,
                        cu_seqlens_k, seqused_q, seqused_k, semaphore, *lists, n_blocks,
                        self.heads_interleaved(q, cu_seqlens_q))
            call_kernel(self.fn, self.tvm_ffi, args, q.device)
        grads = bwd_postprocess(self.dq_from_accumulator(dq_acc, q), dk, dv, q, k, v,
                                spec.qhead_per_kvhead)
        return grads if sink is None else (*grads, sink_gradient(sink, lse2, dsum))

    def dq_blocks(self):
        """The order of dQ's accumulator: None (rows of q's layout), or the kernel's blocks of 8
        rows (common/dq_blocks.py) for additions of one float a lane ("single") or of pairs
        ("pairs")."""
        return None

    def dq_splits(self, q, k, cu_seqlens_q, cu_seqlens_k) -> int:
        """How many dQ accumulators a deterministic kernel with split accumulators
        (cfg.dq_splits) takes; 0 for the other kernels (one accumulator)."""
        return 0

    def dq_accumulator(self, q, width: int, splits: int = 1) -> tuple:
        """(buffer, the kernel's mdQacc): dQ's float32 accumulator, zeroed, shaped like q at the
        kernel's head-dim width; in blocks, the buffer's rows (q's, every sequence's one after
        another) rounded up to a multiple of 8 and the kernel given a q-shaped view of its
        first rows; `splits` such accumulators one after another (the kernel finds the others
        past the first: FlashBwdSm80.split_walk)."""
        if self.dq_blocks() is None:
            assert splits == 1
            dq_acc = torch.zeros((*q.shape[:-1], width), dtype=torch.float32, device=q.device)
            return dq_acc, dq_acc
        rows = q.shape[:-2].numel()
        buffer = torch.zeros((splits * ((rows + 7) // 8 * 8), q.shape[-2], width),
                             dtype=torch.float32, device=q.device)
        return buffer, buffer[:rows].view(*q.shape[:-1], width)

    def dq_from_accumulator(self, dq_acc, q):
        """dq in q's dtype, shape and head dim (contiguous) from dq_accumulator's buffer; from
        blocks, put back in row order by the same single copy that converts it (split
        accumulators summed first, in their order: torch's sum is deterministic)."""
        blocks = self.dq_blocks()
        if blocks is None:
            return dq_acc[..., :q.shape[-1]].to(q.dtype).contiguous()
        rows8 = (q.shape[:-2].numel() + 7) // 8 * 8
        if dq_acc.shape[0] > rows8:
            dq_acc = dq_acc.view(dq_acc.shape[0] // rows8, rows8, *dq_acc.shape[1:]).sum(0)
        rows8, heads, width = dq_acc.shape
        dq = torch.empty((rows8, heads, width), dtype=q.dtype, device=q.device)
        if blocks == "single":  # (row group, head, column block, parity, row, pair)
            src = dq_acc.view(rows8 // 8, heads, width // 8, 2, 8, 4).permute(0, 4, 1, 2, 5, 3)
            dq.view(rows8 // 8, 8, heads, width // 8, 4, 2).copy_(src)
        else:  # "pairs": (row group, head, column block, row, column)
            src = dq_acc.view(rows8 // 8, heads, width // 8, 8, 8).permute(0, 3, 1, 2, 4)
            dq.view(rows8 // 8, 8, heads, width // 8, 8).copy_(src)
        dq = dq[:q.shape[:-2].numel()].view(*q.shape[:-1], width)
        return dq if width == q.shape[-1] else dq[..., :q.shape[-1]].contiguous()

    def heads_interleaved(self, q, cu_seqlens_q) -> int:
        """How many heads' key blocks the grid interleaves (a divisor of nheads): the key blocks
        of a head launch this many CTAs apart. 1: a head's key blocks one after another."""
        return 1


@functools.lru_cache(maxsize=64)
def _unused_semaphores(device: torch.device, nheads: int) -> torch.Tensor:
    """The semaphore argument of a backward that is not deterministic: the kernels read and
    write it only in deterministic mode, so one zeroed (nheads, 1) tensor serves every call
    (no allocation and memset a call)."""
    return torch.zeros((nheads, 1), dtype=torch.int32, device=device)


def sink_gradient(sink, lse2, dsum) -> torch.Tensor:
    """The learnable sink's gradient from the preprocess's rows: the sink is a softmax column
    carrying no value, so dsink[h] = -sum over rows of P_sink * D with P_sink = exp(sink[h] - lse)
    (the forward's LSE includes the sink; lse2 is it in log2 units) and D = rowsum(dO * O).
    Rows the kernel leaves out (past seqused_q: lse2 +inf, D 0) and padding rows (lse2 and D 0)
    add nothing; P_sink <= 1 on real rows, so the clamp only keeps padding rows finite.
    lse2 and dsum: (b, h, rows) or packed (h, rows); returns float32 (h,)."""
    head_dim = lse2.dim() - 2
    shape = [1] * lse2.dim()
    shape[head_dim] = -1
    p_sink = torch.exp2((sink.float().view(shape) * LOG2E - lse2).clamp(max=0.0))
    terms = p_sink * dsum
    return -terms.sum(dim=tuple(i for i in range(terms.dim()) if i != head_dim))


# ---- FlexAttention's mask_mod / score_mod traced into a kernel (common/mods.py) ----

class UnsupportedMod(ValueError):
    """Why a mask_mod or score_mod cannot be compiled into a kernel (the reference serves it)."""


_CONSTANT_TYPES = (bool, int, float, str)
MOD_ARGS = {"mask_mod": "(b, h, q_idx, kv_idx)", "score_mod": "(score, b, h, q_idx, kv_idx)"}


def _mod_dtype(kind: str, t: torch.Tensor, what: str) -> str:
    from .common.mods import TENSOR_DTYPES
    dtype = str(t.dtype).replace("torch.", "").replace("int64", "int32")
    if dtype not in TENSOR_DTYPES:
        raise UnsupportedMod(f"{kind} reads {what}, a {t.dtype} tensor (kernels take int32, "
                             f"int64 and float32)")
    return dtype


def mod_key(fn, kind: str = "mask_mod"):
    """The KernelMod of `fn`, a mask_mod or score_mod (`kind`): its code, the constants and
    tensor kinds it reads; or UnsupportedMod saying why it cannot be compiled into a kernel."""
    import hashlib
    import marshal
    import types
    from .common.mods import MAX_TENSORS, KernelMod
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        raise UnsupportedMod(f"{kind} is not a plain Python function")
    if code.co_argcount != MOD_ARGS[kind].count(",") + 1:
        raise UnsupportedMod(f"{kind} must take {MOD_ARGS[kind]}")
    constants, tensors, cells, names = [], [], [], []
    for slot, cell in enumerate(fn.__closure__ or ()):
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            what = f"closure variable {code.co_freevars[slot]!r}"
            tensors.append((_mod_dtype(kind, value, what), value.dim()))
            cells.append(slot)
        elif isinstance(value, _CONSTANT_TYPES) or value is None:
            constants.append(value)
        else:
            raise UnsupportedMod(f"{kind} closes over a {type(value).__name__} "
                                 f"({code.co_freevars[slot]!r})")
    for name in code.co_names:
        value = fn.__globals__.get(name)
        if isinstance(value, torch.Tensor):  # a module-level tensor: an argument too
            tensors.append((_mod_dtype(kind, value, f"the module-level {name!r}"), value.dim()))
            names.append(name)
        elif isinstance(value, _CONSTANT_TYPES):
            constants.append((name, value))
    if len(tensors) > MAX_TENSORS:
        raise UnsupportedMod(f"{kind} reads {len(tensors)} tensors (kernels take at most "
                             f"{MAX_TENSORS})")
    digest = hashlib.sha1(marshal.dumps(code)).hexdigest()[:16]
    return KernelMod(kind, code.co_name, digest, tuple(constants), tuple(tensors), tuple(cells),
                     tuple(names))


def mod_tensors_of(fn, key) -> list:
    """The tensors mod `fn` reads, as its kernel takes them (key: mod_key(fn)): the closure's,
    then the module-level ones; int64 as int32, each contiguous."""
    found = [fn.__closure__[slot].cell_contents for slot in key.tensor_cells]
    found += [fn.__globals__[name] for name in key.tensor_names]
    return [(t.int() if t.dtype == torch.int64 else t).contiguous() for t in found]


_UNTRACEABLE_BLOCKS: dict = {}  # KernelMod -> why mask_blocks.py could not trace it


def mask_mod_blocks(fn, batch: int, heads: int, seqlen_q: int, seqlen_k: int, q_block: int,
                    kv_block: int, device: torch.device) -> Optional[torch.Tensor]:
    """sparse.from_mask_mod's evaluation in one launch (common/mask_blocks.py): int32 (batch,
    heads, query blocks, key blocks) of 0 (no pair attended), 1 (some), 2 (all); None when the
    mod cannot be compiled into a kernel (the PyTorch form then evaluates it)."""
    from .common.mask_blocks import MaskBlocks, MaskBlocksConfig
    from .sm90 import arguments as sm90_arguments
    try:
        key = mod_key(fn, "mask_mod")
    except UnsupportedMod:
        return None
    if key in _UNTRACEABLE_BLOCKS:
        return None
    cfg = MaskBlocksConfig(key, q_block, kv_block)
    tvm_ffi = use_tvm_ffi()
    try:
        compiled = compiled_common("mask_blocks", lambda: MaskBlocks(cfg, fn), cfg,
                                   sm90_arguments.MASK_BLOCKS_ARGUMENTS, tvm_ffi)
    except Exception as e:  # the DSL could not trace it (a torch call, an unsupported operator)
        _UNTRACEABLE_BLOCKS[key] = f"{type(e).__name__}: {e}"
        return None
    tensors = mod_tensors_of(fn, key)
    if any(t.device != device for t in tensors):  # (the PyTorch form says what is wrong)
        return None
    state = torch.empty(batch, heads, -(-seqlen_q // q_block), -(-seqlen_k // kv_block),
                        dtype=torch.int32, device=device)
    values = (*tensors, *[None] * (2 - len(tensors)), state, seqlen_q, seqlen_k)
    launch_common(compiled, tvm_ffi, sm90_arguments.MASK_BLOCKS_ARGUMENTS, values, device)
    return state


# ---- the small kernels of common/ (mask_blocks, list_transpose, topk_lists, kv_append) ----

@functools.lru_cache(maxsize=None)
def _common_sources(module: str) -> tuple:
    from .. import compile_cache
    return compile_cache.module_sources(f"cuteattn.kernels.common.{module}")


def compiled_common(module: str, make_kernel, cfg, entries, tvm_ffi: bool):
    """The compiled kernel of common/<module>.py for `cfg` (its compile key; on the TVM-FFI path
    kept on disk too): make_kernel() builds the kernel object, `entries` its arguments."""
    from .. import compile_cache

    def build():
        from .common import arguments as common_arguments
        from .compile_common import compile_kernel
        fakes = common_arguments.fakes(cfg, entries, None)
        return compile_kernel(make_kernel(), fakes, tvm_ffi=tvm_ffi), {}
    return compile_cache.get_or_compile(("common", module, tvm_ffi, cfg), build,
                                        persist=tvm_ffi, sources=_common_sources(module))


def launch_common(compiled, tvm_ffi: bool, entries, values: tuple, device) -> None:
    """One launch of a compiled common/ kernel on `values`, in `entries`' order (the DLPack
    path converts each by its declared kind)."""
    args = values if tvm_ffi else tuple(to_runtime(a, x) for a, x in zip(entries, values))
    call_kernel(compiled, tvm_ffi, args, device)


# ---- the block-sparse backward's transposed lists (common/list_transpose.py) ----

def transpose_lists(lists: tuple, paired: bool) -> tuple:
    """sparse.transpose (paired: transpose_paired) of a mask's four kernel list tensors
    (api._kernel_lists: int32, unit last stride) in one launch: the transposed (or the pairs')
    four list tensors, and with `paired` the halves' table (else None). Only the first count
    entries of each output list are written (the kernels read no further)."""
    from .common.list_transpose import ListTranspose, ListTransposeConfig
    from .sm90 import arguments as sm90_arguments
    full_count, full_index = lists[0], lists[1]
    batch, heads, nq, nk = full_index.shape
    rows = (nk + 1) // 2 if paired else nk
    device = full_index.device
    counts = torch.empty(2, batch, heads, rows, dtype=torch.int32, device=device)
    indices = torch.empty(2, batch, heads, rows, nq, dtype=torch.int32, device=device)
    halves = (torch.empty(batch, heads, nk, nq, dtype=torch.int32, device=device)
              if paired else None)
    out = (counts[0], indices[0], counts[1], indices[1])
    tvm_ffi = use_tvm_ffi()
    cfg, entries = ListTransposeConfig(paired), sm90_arguments.LIST_TRANSPOSE_ARGUMENTS
    compiled = compiled_common("list_transpose", lambda: ListTranspose(cfg), cfg, entries, tvm_ffi)
    launch_common(compiled, tvm_ffi, entries, (*lists, *out, halves), device)
    return out, halves


# ---- VSA's block-sparse builder (common/topk_lists.py) ----

def topk_lists(indices: torch.Tensor, num_kv_blocks: int, rq: int, rk: int,
               partial: bool) -> tuple:
    """sparse.from_topk's four list tensors (full count, full index, partial count, partial
    index) from (B|1, H|1, nq, k) int32/int64 indices on a GPU, in one launch: the selected
    blocks as full (or with `partial`, partial) lists expanded rq x rk (1 x 1: the logical
    blocks), the other kind's lists empty. Only the first count entries of each list are
    written (the kernels read no further)."""
    from .common.topk_lists import TopkLists, TopkListsConfig
    from .sm90 import arguments as sm90_arguments
    batch, heads, nq, _ = indices.shape
    device = indices.device
    counts = torch.empty(2, batch, heads, nq * rq, dtype=torch.int32, device=device)
    lists = torch.empty(2, batch, heads, nq * rq, num_kv_blocks * rk, dtype=torch.int32,
                        device=device)
    chosen, other = (1, 0) if partial else (0, 1)
    tvm_ffi = use_tvm_ffi()
    cfg = TopkListsConfig(64 if indices.dtype == torch.int64 else 32)
    entries = sm90_arguments.TOPK_LISTS_ARGUMENTS
    compiled = compiled_common("topk_lists", lambda: TopkLists(cfg), cfg, entries, tvm_ffi)
    launch_common(compiled, tvm_ffi, entries, (indices.contiguous(), counts[chosen],
                                               lists[chosen], counts[other], num_kv_blocks, rq, rk),
                  device)
    return counts[0], lists[0], counts[1], lists[1]


# ---- the KV-cache update before a decode kernel (common/kv_append.py) ----

_FP8_CACHE_KINDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


class KvAppendLaunch:
    """kvcache.append_and_rotate on a GPU in one launch (common/kv_append.py), for calls of one
    form: what a decode step's signature fixes (dtypes, head dims, which of k / rotary /
    batch_idx / pages are given, the rotary layout) is decided here once, so that a step only
    allocates the outputs and launches (kvcache.DecodeStep keeps one)."""

    def __init__(self, q, k_cache, v_cache, k, rotary_cos, cache_batch_idx, block_table,
                 positional: bool, interleaved: bool):
        from .common.kv_append import KvAppend, KvAppendConfig
        from .sm80 import arguments as sm80_arguments
        self.fp8 = _FP8_CACHE_KINDS.get(k_cache.dtype)
        rotary = None if rotary_cos is None else ("interleaved" if interleaved else "neox")
        self.cfg = cfg = KvAppendConfig(
            CUTLASS_DTYPES[q.dtype], q.shape[-1], v_cache.shape[-1], append=k is not None,
            rotary=rotary, rotary_dtype=None if rotary is None else _ROTARY_DTYPES[rotary_cos.dtype],
            positional=positional, paged=block_table is not None,
            batch_idx=cache_batch_idx is not None and block_table is None, cache_fp8=self.fp8)
        self.tvm_ffi = use_tvm_ffi()
        self.entries = sm80_arguments.KV_APPEND_ARGUMENTS
        self.compiled = compiled_common("kv_append", lambda: KvAppend(cfg), cfg, self.entries,
                                        self.tvm_ffi)

    def __call__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                 cache_batch_idx, block_table, descales=(None, None)):
        """Returns (q rotated, or q itself without rotary; the used lengths, int32 (batch,)).
        cache_seqlens: an int32 (batch,) tensor."""
        cfg = self.cfg
        q_rot = torch.empty_like(q) if cfg.rotary else None
        used = torch.empty(q.shape[0], dtype=torch.int32, device=q.device)
        if self.fp8:
            ones = None
            if descales[0] is None or descales[1] is None:
                ones = torch.ones(q.shape[0], k_cache.shape[2], dtype=torch.float32, device=q.device)
            descales = tuple(ones if x is None else x for x in descales)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            descales = (None, None)
        contiguous = lambda t: None if t is None else t.contiguous()
        values = (q.contiguous(), q_rot, contiguous(k), contiguous(v), k_cache, v_cache,
                  cache_seqlens.contiguous(), contiguous(cache_batch_idx) if cfg.batch_idx else None,
                  contiguous(block_table), contiguous(rotary_cos), contiguous(rotary_sin), *descales,
                  used)
        launch_common(self.compiled, self.tvm_ffi, self.entries, values, q.device)
        return (q if q_rot is None else q_rot), used


_ROTARY_DTYPES = {torch.float32: cutlass.Float32, torch.bfloat16: cutlass.BFloat16,
                  torch.float16: cutlass.Float16}


