"""Compile-only tests of the sm90 backward: trace and compile its variants for sm_90a without a GPU
(CUTE_DSL_ARCH), check the Hopper instructions are there and what ptxas says about spills.

Every head dim the backward serves, every mask kind, both dtypes, packed sequences with seqused,
and deterministic mode, as launch_bwd.bwd_config configures them.
"""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytestmark = pytest.mark.compile  # deselected by a plain `pytest -q`; .ci/run runs them

from cuteattn.kernels.sm90 import launch_bwd  # noqa: E402
from cuteattn.kernels.sm90.compile import compile_bwd  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402

MASKS = ("none", "causal", "local", "softcap")


def make_spec(dtype, d, mask, varlen=False, seqused=False, deterministic=False):
    return AttentionSpec(
        dtype=dtype, head_dim=d, head_dim_v=d, causal=mask == "causal", local=mask == "local",
        has_softcap=mask == "softcap", varlen_q=varlen, varlen_k=varlen, has_seqused_q=seqused,
        has_seqused_k=seqused, kind="bwd", deterministic=deterministic, softmax_scale=d ** -0.5,
        window_left=64 if mask == "local" else None, window_right=0 if mask == "local" else None,
        softcap=30.0 if mask == "softcap" else 0.0)


CASES = (
    [(torch.bfloat16, d, m, False, False, False) for d in launch_bwd.SUPPORTED_HEAD_DIMS for m in MASKS]
    + [(torch.float16, 128, "causal", False, False, False),
       (torch.float16, 96, "softcap", False, False, False),
       (torch.bfloat16, 128, "causal", False, False, True),
       (torch.bfloat16, 64, "local", False, False, True),
       (torch.bfloat16, 128, "causal", True, False, False),
       # packed d=128 with dQ by TMA at the 24 / 240 register split
       (torch.float16, 128, "none", True, True, False),
       # and with softcap, or causal with seqused (dQ by TMA since the indices are uniform)
       (torch.bfloat16, 128, "softcap", True, False, False),
       (torch.bfloat16, 128, "causal", True, True, False),
       (torch.bfloat16, 64, "softcap", True, False, False),
       (torch.bfloat16, 96, "none", True, True, False),
       (torch.bfloat16, 128, "local", True, True, True),
       # batched q/k with seqused only (FlashAttention-4's form)
       (torch.float16, 128, "causal", False, True, False), (torch.bfloat16, 64, "local", False, True, True),
       # head dims over 128 (split_d): fp16, packed with seqused, deterministic
       (torch.float16, 256, "causal", False, False, False), (torch.bfloat16, 256, "local", True, True, True),
       (torch.bfloat16, 192, "causal", True, False, True), (torch.float16, 192, "softcap", False, True, False),
       # d=192 adds dQ by TMA (its box beside two Q/dO stages), d=256 by reductions (with a
       # mask: without one it takes the deterministic kernel)
       (torch.bfloat16, 192, "local", True, True, False),
       # head dims up to 96 at their own 16-column width (launch_bwd.NATIVE_WIDTH_MAX)
       (torch.bfloat16, 80, "causal", True, False, False), (torch.float16, 80, "local", False, False, True),
       (torch.bfloat16, 80, "softcap", False, True, False), (torch.bfloat16, 48, "none", False, False, False),
       (torch.float16, 16, "causal", True, True, True)]
)

# Variants ptxas spills a few bytes in, with their spill-store bytes: a ratchet, so that any new
# spill or a growing one fails, and a variant that stops spilling must be taken off this list.
# Empty since the packed kernels' tile coordinates and warpgroup indices are warp-uniform (the
# packed variants spilled 4-16 bytes before: their sequence offsets stay live across the loop).
KNOWN_SPILLS = {}


def case_id(c):
    dtype, d, mask, varlen, seqused, det = c
    return (f"{str(dtype)[6:]}-d{d}-{mask}{'-varlen' if varlen else ''}"
            f"{'-seqused' if seqused else ''}{'-deterministic' if det else ''}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_compile_sm90_bwd(case, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory
    compile_and_check(case, capfd)


def compile_and_check(case, capfd):
    """Compile case's backward as bwd_config configures it; check its instructions and spills."""
    cfg = launch_bwd.bwd_config(make_spec(*case))
    assert cfg.smem_bytes() <= 227 * 1024, f"{cfg} needs {cfg.smem_bytes()} bytes of shared memory"
    ptx = compile_bwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx, "the GEMMs must be Hopper wgmma"
    assert "cp.async.bulk.tensor" in ptx, "Q, dO, K, V, LSE and D must be loaded with TMA"
    assert "setmaxnreg" in ptx, "registers must move from the producer to the consumers"
    if cfg.dq_tma:  # dQ's shares through shared memory, one TMA reduce-add per box
        assert "cp.reduce.async.bulk.tensor" in ptx and "red.global.add" not in ptx
    else:
        assert "red.global.add.v2.f32" in ptx, "dQ must accumulate with vector reductions"
    if cfg.deterministic:
        assert "ld.global.acquire.gpu" in ptx and "red.release.gpu" in ptx
    report = capfd.readouterr().err
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills, f"ptxas did not report register use:\n{report[-2000:]}"
    assert max(spills) == KNOWN_SPILLS.get(case, 0), f"{cfg} spill stores:\n{report[-2000:]}"
    return cfg


@pytest.mark.parametrize("d", [128, 256])
def test_compile_backward_with_learnable_sink(d, capfd, tmp_path, monkeypatch):
    """A learnable sink keeps a one-key sequence's dQ and dK (its softmax has the sink in its
    denominator, so common/one_key.gradient_scale must not zero them): its own compile key,
    spill-free."""
    monkeypatch.chdir(tmp_path)
    import dataclasses
    spec = dataclasses.replace(make_spec(torch.bfloat16, d, "causal"), has_sink=True)
    assert launch_bwd.BACKWARD.can_implement(spec) is None
    cfg = launch_bwd.bwd_config(spec)
    assert cfg.has_sink and not launch_bwd.bwd_config(make_spec(torch.bfloat16, d, "causal")).has_sink
    ptx = compile_bwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, spills


def test_plain_d256_adds_dq_by_blocked_reductions():
    """Plain d=256 adds dQ by the blocked reductions beside two Q/dO stages (1.15-1.31x the
    writer warp's turns beside one); deterministic mode keeps the turns. (CASES compiles it:
    bf16 d=256 "none".)"""
    cfg = lambda d, mask="none", det=False: launch_bwd.bwd_config(
        make_spec(torch.bfloat16, d, mask, deterministic=det))
    for mask in ("none", "softcap", "causal", "local"):
        plain = cfg(256, mask)
        assert not plain.deterministic and not plain.dq_tma and plain.num_stages == 2, mask
    ordered = cfg(256, det=True)
    assert ordered.deterministic and ordered.dq_tma and ordered.dq_writer and ordered.num_stages == 1


def test_dq_writer_wherever_dq_goes_by_tma():
    """The writer warp issues dQ's reduce-adds wherever dQ goes by TMA, packed sequences
    included; at d=128 dQ goes by TMA under every mask (windows, packed softcap, packed causal
    with seqused), not with packed sequences and block-sparse lists or mods."""
    cfg = lambda d, mask="causal", varlen=False, det=False, seqused=False: launch_bwd.bwd_config(
        make_spec(torch.bfloat16, d, mask, varlen=varlen, seqused=seqused, deterministic=det))
    for d in (64, 96, 128, 192):
        assert cfg(d).dq_tma and cfg(d).dq_writer
        assert cfg(d, "none").dq_writer
        assert cfg(d, varlen=True).dq_writer and cfg(d, "none", varlen=True).dq_before_dk
        assert cfg(d, varlen=True).dq_before_dk == (d != 64)  # (d=64's causal 128-row steps)
        assert cfg(d, varlen=True, det=True).dq_writer
    for mask, varlen, seqused in (("local", False, False), ("local", True, True),
                                  ("softcap", True, False), ("causal", True, True)):
        assert cfg(128, mask, varlen, seqused=seqused).dq_writer, (mask, varlen, seqused)
    import dataclasses
    lists = dataclasses.replace(make_spec(torch.bfloat16, 128, "causal", varlen=True),
                                sparse_q_block=128, sparse_kv_block=128)
    assert not launch_bwd.bwd_config(lists).dq_tma
    assert not cfg(256).dq_writer  # (d=256 plain: reductions)


def test_d64_takes_128_row_query_steps():
    """d=64 runs query steps of D64_TILE_M rows wherever dQ goes by TMA: fixed length, packed,
    seqused and windowed alike (CASES compiles packed softcap, windowed deterministic and
    windowed seqused ones); not with block-sparse lists, whose blocks are 64 or 128 rows."""
    import dataclasses
    cfg = lambda mask, varlen=False, seqused=False: launch_bwd.bwd_config(
        make_spec(torch.bfloat16, 64, mask, varlen=varlen, seqused=seqused))
    for mask in MASKS:
        for varlen, seqused in ((False, False), (True, False), (True, True), (False, True)):
            assert cfg(mask, varlen, seqused).tile_m == launch_bwd.D64_TILE_M, (mask, varlen, seqused)
    assert not cfg("causal", True).dq_before_dk and cfg("none", True).dq_before_dk
    lists = dataclasses.replace(make_spec(torch.bfloat16, 64, "causal"), sparse_q_block=64,
                                sparse_kv_block=128)
    assert launch_bwd.bwd_config(lists).tile_m == 64


def test_d96_takes_dq_in_one_warpgroup():
    """Split dQ columns set K's swizzle width (launch_bwd.bwd_config): d=96's halves would need
    a 32-byte swizzle, so one warpgroup computes all of dQ there; d=64 and 128 split it."""
    cfg = lambda d: launch_bwd.bwd_config(make_spec(torch.bfloat16, d, "none"))
    assert cfg(96).dq_single_wg and not cfg(128).dq_single_wg and not cfg(64).dq_single_wg


def test_dq_tma_over_128():
    """dQ by TMA over 128: at d=192 beside two Q/dO stages; d=256 by reductions (its box would
    leave one stage), but in deterministic mode by TMA beside one stage, the writer warp taking
    the turns (at every head dim)."""
    cfg = lambda d, det=False: launch_bwd.bwd_config(make_spec(torch.bfloat16, d, "causal",
                                                               deterministic=det))
    assert cfg(192).split_d and cfg(192).dq_tma and cfg(192).num_stages == 2 and cfg(192).dq_writer
    assert cfg(256).split_d and not cfg(256).dq_tma and cfg(256).num_stages == 2
    assert cfg(256, det=True).dq_tma and cfg(256, det=True).num_stages == 1
    assert all(cfg(d, det=True).dq_writer for d in (64, 96, 128, 192, 256))


# The block-sparse backward: a key block walks the query blocks of the transposed lists.
# (d, q_block, mask[, kv_block[, deterministic]]), fp16 (the register-hungrier dtype); lists of
# 64-key blocks are walked in pairs (sparse_kv_half)
SPARSE_CASES = [(128, 128, "none"), (64, 128, "causal"), (96, 128, "softcap"), (128, 128, "local"),
                (128, 64, "causal"), (64, 64, "softcap"), (128, 128, "causal", 64),
                (128, 64, "softcap", 64), (64, 64, "local", 64),
                # deterministic: each key block's turn from the dq_turns table
                (128, 128, "causal", 128, True), (64, 64, "none", 64, True),
                # packed sequences (the lists' batch mode the sequence)
                (128, 128, "causal", 128, False, True), (64, 64, "none", 64, False, True),
                (128, 128, "local", 64, False, True)]


# spill stores (bytes), a ratchet as KNOWN_SPILLS: empty since the warp-uniform packed indices
# (packed causal and local spilled 24 and 88 bytes before: sequence offsets and the lists' rows
# live across the walk)
SPARSE_KNOWN_SPILLS = {}


@pytest.mark.parametrize("case", SPARSE_CASES,
                         ids=[f"d{c[0]}-{c[1]}x{(c + (128,))[3]}-{c[2]}"
                              f"{'-det' if c[4:5] == (True,) else ''}{'-packed' if c[5:] else ''}"
                              for c in SPARSE_CASES])
def test_compile_block_sparse_backward(case, capfd, tmp_path, monkeypatch):
    import dataclasses
    monkeypatch.chdir(tmp_path)
    d, q_block, mask, kv_block, deterministic, packed = (case + (128, False, False))[:6] \
        if len(case) == 3 else (case + (False, False))[:6]
    spec = dataclasses.replace(make_spec(torch.float16, d, mask, varlen=packed), sparse_q_block=q_block,
                               sparse_kv_block=kv_block, deterministic=deterministic)
    assert launch_bwd.BACKWARD.can_implement(spec) is None
    cfg = launch_bwd.bwd_config(spec)
    assert cfg.sparse and cfg.sparse_q_block == q_block and cfg.sparse_kv_half == (kv_block == 64)
    assert cfg.deterministic == deterministic
    ptx = compile_bwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert ("ld.global.acquire.gpu" in ptx) == deterministic  # (the turn's semaphore polls)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == SPARSE_KNOWN_SPILLS.get(case, 0), f"{cfg} spills"


def test_block_sparse_backward_reasons():
    import dataclasses
    can = lambda **kw: launch_bwd.BACKWARD.can_implement(dataclasses.replace(
        make_spec(torch.bfloat16, 128, "none"), **{"sparse_q_block": 128, "sparse_kv_block": 128, **kw}))
    assert can() is None and can(sparse_q_block=64) is None
    assert can(sparse_kv_block=64) is None and can(sparse_q_block=64, sparse_kv_block=64) is None
    assert launch_bwd.bwd_config(dataclasses.replace(
        make_spec(torch.bfloat16, 128, "none"), sparse_q_block=64, sparse_kv_block=64)).sparse_kv_half
    assert can(sparse_kv_block=32).startswith("block-sparse backward of 128x32 blocks")
    assert can(deterministic=True) is None and can(deterministic=True, sparse_kv_block=64) is None
    assert can(varlen_q=True, varlen_k=True) is None and can(has_seqused_q=True) is None
    assert can(varlen_q=True, varlen_k=True, deterministic=True).startswith(
        "deterministic block-sparse backward with packed")


@pytest.mark.parametrize("dv,varlen,seqused", [(64, False, False), (96, True, True), (128, False, True),
                                               (128, True, False), (192, False, False), (256, True, True),
                                               # padded head dims: 2 lanes a row (80), one (40, 120)
                                               (80, False, False), (40, True, False), (120, False, True)])
def test_compile_bwd_preprocess(dv, varlen, seqused, capfd, tmp_path, monkeypatch):
    """The backward's preprocess kernel (one pass: D and the LSE in log2 units): 16-byte loads of
    dO and O, butterfly sums, no spills."""
    from cuteattn.kernels.common import arguments
    from cuteattn.kernels.common.bwd_preprocess import BwdPreprocess, PreprocessConfig
    from cuteattn.kernels.compile_common import compile_kernel
    monkeypatch.chdir(tmp_path)
    cfg = PreprocessConfig(cutlass.Float16, dv, 64, varlen_q=varlen, has_seqused_q=seqused)
    ptx = compile_kernel(BwdPreprocess(cfg), arguments.fakes(cfg, arguments.PREPROCESS_ARGUMENTS),
                         options="--keep-ptx remarks{ptx}").__ptx__
    assert "ld.global.v4" in ptx
    if BwdPreprocess(cfg).lanes_per_row > 1:  # (one lane a row: no butterflies)
        assert "shfl.sync.bfly" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0
