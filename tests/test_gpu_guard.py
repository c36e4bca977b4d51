"""Memory safety of the GPU kernels: no write outside out / lse, whatever the varlen metadata.

Every call gets out and lse as views in the middle of larger buffers whose guard regions hold a
bit pattern, and q, k, v as views in the middle of NaN-filled buffers; after the call (and a wait
that reports a hang instead of blocking forever) every guard element must still hold its pattern.
  (a) good fixed-length and varlen calls: guards intact and the output passes FlashAttention's rule
      (a read outside q, k or v would also bring NaN into it);
  (b) bad varlen metadata without validate=True (cu_seqlens past the total, negative, decreasing;
      max_seqlen too small; seqused negative, too large, huge): the call returns without raising,
      finishes, causes no illegal memory access and leaves every guard intact. Values inside out
      and lse are unspecified for such calls and not checked;
  (c) a good call after bad ones in the same process is still correct (no corrupted kernel state,
      e.g. the tile counter).
strict=True everywhere, so the kernel, never the reference, serves the call. BAD_CASES and
varlen_inputs are shared with tests/gpu_sanitize.py, which runs these calls under compute-sanitizer.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from cuteattn import flash_attn_func, flash_attn_varlen_func
from cuteattn.reference import attention_ref, attention_varlen_ref
from cuteattn.testing import assert_close_fa, assert_lse_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16, FP16 = torch.bfloat16, torch.float16
# guard bit patterns: a finite value around out / lse, NaN around the inputs
OUT_PATTERN = {BF16: 0x5A5A, FP16: 0x5A5A, torch.float32: 0x5A5A5A5A}
NAN_PATTERN = {BF16: 0x7FA5, FP16: 0x7E5A}
INT_VIEW = {2: torch.int16, 4: torch.int32}
HANG_TIMEOUT_S = 60
# False: no guard regions, each tensor exactly its own allocation (tests/gpu_sanitize.py sets this
# under compute-sanitizer, whose memcheck then sees every access outside a tensor)
GUARDS = True


class Guarded:
    """A tensor of `shape` in the middle of a buffer with at least `guard` elements each side
    holding `pattern` (as bits). The guard is a multiple of 64 elements: the view stays 16-byte
    aligned (128 bytes and more), so the API hands it to the kernel as it is, not a copy."""

    def __init__(self, shape, dtype, pattern, guard=4096):
        self.n = math.prod(shape)
        self.g = max(-(-self.n // 64) * 64, guard) if GUARDS else 0
        self.buf = torch.empty(2 * self.g + self.n, dtype=dtype, device="cuda")
        self.bits = self.buf.view(INT_VIEW[self.buf.element_size()])
        self.pattern = pattern
        self.bits.fill_(pattern)
        self.t = self.buf[self.g : self.g + self.n].view(shape)

    def assert_intact(self, name):
        for side, bits in (("before", self.bits[: self.g]), ("after", self.bits[self.g + self.n :])):
            bad = (bits != self.pattern).nonzero()
            if bad.numel():
                raise AssertionError(
                    f"{name}: {bad.numel()} guard elements {side} the tensor were overwritten "
                    f"(first at {int(bad[0]) - (self.g if side == 'before' else 0)} elements from it)"
                )


def guarded_input(shape, dtype):
    """Random values in a view surrounded by NaN."""
    x = Guarded(shape, dtype, NAN_PATTERN[dtype])
    x.t.normal_()
    return x


def guarded_outputs(out_shape, lse_shape, dtype):
    """NaN-poisoned out and lse views (an unwritten element fails the reference check) inside
    pattern guards."""
    out = Guarded(out_shape, dtype, OUT_PATTERN[dtype])
    lse = Guarded(lse_shape, torch.float32, OUT_PATTERN[torch.float32])
    out.t.fill_(float("nan"))
    lse.t.fill_(float("nan"))
    return out, lse


def finish(timeout=None):
    """Wait for the GPU; a kernel still running after `timeout` (default HANG_TIMEOUT_S) seconds is
    a hang: stop the session (every later test would queue behind it). Raises on an illegal memory
    access."""
    timeout = HANG_TIMEOUT_S if timeout is None else timeout
    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > timeout:
            pytest.exit(f"a GPU kernel did not finish within {timeout} s (a hang)", returncode=3)
        time.sleep(0.002)
    torch.cuda.synchronize()


def assert_all_intact(buffers: dict):
    for name, g in buffers.items():
        g.assert_intact(name)


# ---- (a) good calls ----

FIXED_CASES = [  # (dtype, d, (h, hk), mask, (seqlen_q, seqlen_k))
    (BF16, 64, (4, 4), "none", (1, 1)),
    (FP16, 64, (8, 2), "window", (1023, 113)),
    (BF16, 128, (8, 2), "causal", (17, 17)),
    (BF16, 128, (8, 2), "none", (1023, 1023)),
    (FP16, 128, (4, 4), "window", (17, 113)),
    (BF16, 256, (8, 2), "window", (113, 203)),
    (FP16, 256, (8, 2), "causal", (1023, 17)),
    (BF16, 256, (4, 4), "none", (113, 1)),
]
MASKS = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(64, 0))}


def fixed_id(case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    return f"{str(dtype)[6:]}-d{d}-h{h}:{hk}-{mask}-{sq}x{sk}"


def good_fixed(dtype, d, h, hk, sq, sk, b=2, **kw):
    """One good flash_attn_func call on guarded buffers: guards intact, output right."""
    q, k, v = (guarded_input((b, s, n, d), dtype) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    out, lse = guarded_outputs((b, sq, h, d), (b, h, sq), dtype)
    flash_attn_func(q.t, k.t, v.t, **kw, return_lse=True, strict=True, out=out.t, lse=lse.t)
    finish()
    assert_all_intact(dict(out=out, lse=lse, q=q, k=k, v=v))
    ref, ref_lse = attention_ref(q.t, k.t, v.t, **kw)
    lowprec, _ = attention_ref(q.t, k.t, v.t, **kw, upcast=False)
    assert_close_fa(out.t, ref, lowprec)
    assert_lse_close(lse.t, ref_lse)


@pytest.mark.parametrize("case", FIXED_CASES, ids=fixed_id)
def test_fixed_good_call_stays_inside(seed, case):
    dtype, d, (h, hk), mask, (sq, sk) = case
    good_fixed(dtype, d, h, hk, sq, sk, **MASKS[mask])


def cu(lens):
    return [0, *torch.tensor(lens).cumsum(0).tolist()]


def varlen_inputs(cu_q, cu_k, h, hk, d, dtype, total_q=None, total_k=None):
    """Guarded q, k, v, out, lse for packed sequences; totals default to cu's last values."""
    total_q = cu_q[-1] if total_q is None else total_q
    total_k = cu_k[-1] if total_k is None else total_k
    q = guarded_input((total_q, h, d), dtype)
    k, v = (guarded_input((total_k, hk, d), dtype) for _ in range(2))
    out, lse = guarded_outputs((total_q, h, d), (h, total_q), dtype)
    return dict(q=q, k=k, v=v, out=out, lse=lse)


def i32(values):
    return None if values is None else torch.tensor(values, dtype=torch.int32, device="cuda")


def run_varlen(bufs, cu_q, cu_k, max_q, max_k, used_q=None, used_k=None, validate=False, **kw):
    """One call on the guarded buffers; returns after the GPU finished, with every guard checked."""
    flash_attn_varlen_func(
        bufs["q"].t, bufs["k"].t, bufs["v"].t, i32(cu_q), i32(cu_k), max_q, max_k,
        seqused_q=i32(used_q), seqused_k=i32(used_k), return_lse=True, strict=True,
        validate=validate, out=bufs["out"].t, lse=bufs["lse"].t, **kw,
    )
    finish()
    assert_all_intact(bufs)


def check_varlen_output(bufs, cu_q, cu_k, used_q=None, used_k=None, **kw):
    q, k, v, out, lse = (bufs[n].t for n in ("q", "k", "v", "out", "lse"))
    ref_args = (q, k, v, i32(cu_q), i32(cu_k), i32(used_q), i32(used_k))
    ref, ref_lse = attention_varlen_ref(*ref_args, **kw)
    lowprec, _ = attention_varlen_ref(*ref_args, **kw, upcast=False)
    for b, start in enumerate(cu_q[:-1]):
        rows = slice(start, start + (used_q[b] if used_q is not None else cu_q[b + 1] - start))
        assert_close_fa(out[rows], ref[rows], lowprec[rows], name=f"out of sequence {b}")
        assert_lse_close(lse[:, rows], ref_lse[:, rows], name=f"lse of sequence {b}")


LENS_Q = [1, 17, 0, 113, 1023, 12]
LENS_K = [17, 1023, 113, 0, 1, 12]  # sequence 3 has queries and no key, sequence 2 the reverse


def good_varlen(d, h=8, hk=2, dtype=BF16, used_q=None, used_k=None, lens_q=LENS_Q, lens_k=LENS_K,
                **kw):
    """One good flash_attn_varlen_func call on guarded buffers: guards intact, output right."""
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    bufs = varlen_inputs(cu_q, cu_k, h, hk, d, dtype)
    run_varlen(bufs, cu_q, cu_k, max(lens_q), max(lens_k), used_q, used_k, validate=True, **kw)
    check_varlen_output(bufs, cu_q, cu_k, used_q, used_k, **kw)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_varlen_good_call_stays_inside(seed, d, mask):
    good_varlen(d, **MASKS[mask])


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_varlen_seqused_good_call_stays_inside(seed, mask):
    good_varlen(128, used_q=[1, 0, 0, 100, 1023, 5], used_k=[17, 1000, 113, 0, 0, 12], **MASKS[mask])


def test_varlen_empty_last_sequence(seed):
    """cu_seqlens [0, 12, 12] (batch 2, total 12): a valid edge, the last sequence empty."""
    good_varlen(128, h=4, hk=4, lens_q=[12, 0], lens_k=[12, 0], causal=True)


# ---- (b) bad metadata, validate=False ----

# Base: 12 packed q and k tokens, cu_seqlens [0, 4, 12] (batch 2; [0, 4, 8, 12] where a case
# needs batch 3), max_seqlen 8. Each case overrides some of cu_seqlens_q/k, max_seqlen_q/k and
# seqused_q/k; q, k, v, out and lse keep their 12 rows.
TOTAL = 12
BAD_CASES = {
    "cuq_end_past_total": dict(cu_seqlens_q=[0, 4, 20]),
    "cuk_end_past_total": dict(cu_seqlens_k=[0, 4, 20]),
    "cuq_end_4000": dict(cu_seqlens_q=[0, 4, 4000]),
    "cuk_end_4000": dict(cu_seqlens_k=[0, 4, 4000]),
    "cuq_start_neg8": dict(cu_seqlens_q=[-8, 4, 12]),
    "cuk_start_neg8": dict(cu_seqlens_k=[-8, 4, 12]),
    "cuq_decreasing": dict(cu_seqlens_q=[0, 8, 4, 12]),
    "cuk_decreasing": dict(cu_seqlens_k=[0, 8, 4, 12]),
    "cuq_one_seq_longer_than_max": dict(cu_seqlens_q=[0, 12, 12]),
    "cuk_one_seq_longer_than_max": dict(cu_seqlens_k=[0, 12, 12]),
    "cuq_int32_min": dict(cu_seqlens_q=[-2**31 + 1, 0, 12]),
    "cuk_int32_min": dict(cu_seqlens_k=[-2**31 + 1, 0, 12]),
    "cuq_int32_max": dict(cu_seqlens_q=[0, 2**31 - 1, 12]),
    "cuk_int32_max": dict(cu_seqlens_k=[0, 2**31 - 1, 12]),
    "max_seqlen_q_1": dict(max_seqlen_q=1),
    "max_seqlen_k_1": dict(max_seqlen_k=1),
    "usedq_negative": dict(seqused_q=[-5, 8]),
    "usedk_negative": dict(seqused_k=[-5, 8]),
    "usedq_past_length": dict(seqused_q=[8, 100]),
    "usedk_past_length": dict(seqused_k=[8, 100]),
    "used_huge": dict(seqused_q=[2**30, 2**30], seqused_k=[2**30, 2**30]),
    "used_int32_min": dict(seqused_q=[0, -2**31], seqused_k=[-2**31, 0]),
    "everything_wrong": dict(cu_seqlens_q=[0, 4, 4000], cu_seqlens_k=[-8, 4, 12], max_seqlen_q=1,
                             seqused_k=[2**30, -1]),
}
# one config per mask kind: MHA causal d=128 (the repro), GQA non-causal and window
BAD_CONFIGS = [dict(h=4, hk=4, d=128, causal=True), dict(h=8, hk=2, d=256),
               dict(h=8, hk=2, d=64, window_size=(64, 0))]


def bad_call_args(case: dict):
    """(cu_q, cu_k, max_q, max_k, used_q, used_k) for one BAD_CASES entry."""
    cu_q, cu_k = case.get("cu_seqlens_q"), case.get("cu_seqlens_k")
    batch = len(cu_q or cu_k or [0, 0, 0]) - 1
    default = [0, 4, 12] if batch == 2 else [0, 4, 8, 12]
    return (cu_q or default, cu_k or default, case.get("max_seqlen_q", 8),
            case.get("max_seqlen_k", 8), case.get("seqused_q"), case.get("seqused_k"))


def run_bad(case: dict, h, hk, d, dtype=BF16, **kw):
    cu_q, cu_k, max_q, max_k, used_q, used_k = bad_call_args(case)
    bufs = varlen_inputs(cu_q, cu_k, h, hk, d, dtype, total_q=TOTAL, total_k=TOTAL)
    run_varlen(bufs, cu_q, cu_k, max_q, max_k, used_q, used_k, validate=False, **kw)


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_metadata_stays_inside(seed, name):
    for cfg in BAD_CONFIGS:
        run_bad(BAD_CASES[name], **cfg)


# ---- (c) a good call after bad ones ----

@pytest.mark.parametrize("cfg", BAD_CONFIGS, ids=lambda c: f"d{c['d']}-h{c['h']}:{c['hk']}")
def test_good_call_after_bad_calls(seed, cfg):
    cfg = dict(cfg)
    h, hk, d = cfg.pop("h"), cfg.pop("hk"), cfg.pop("d")
    mask_kw = cfg
    for name in ("cuq_end_4000", "cuk_int32_min", "everything_wrong", "used_huge"):
        run_bad(BAD_CASES[name], h, hk, d, **mask_kw)
    for used in (None, [3, 8]):  # the same compiled kernels as the bad calls, with and without seqused
        cu_q = cu_k = [0, 4, 12]
        bufs = varlen_inputs(cu_q, cu_k, h, hk, d, BF16)
        run_varlen(bufs, cu_q, cu_k, 8, 8, used, used, validate=True, **mask_kw)
        check_varlen_output(bufs, cu_q, cu_k, used, used, **mask_kw)
    good_fixed(BF16, d, h, hk, 77, 77, **mask_kw)  # fixed-length kernels share the tile counter
