"""Compile-only tests of the sm90 forward: trace and compile kernel variants for sm_90a without a
GPU (CUTE_DSL_ARCH), and check what the compiler made of them: the Hopper instructions are there
(TMA, wgmma, register reallocation) and nothing spills to local memory.

Covers every head dim and every mask kind at least once, both dtypes, and the varlen switch.
"""
import dataclasses
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytestmark = pytest.mark.compile  # deselected by a plain `pytest -q`; .ci/run runs them

from cuteattn.kernels.sm90 import launch as sm90_launch  # noqa: E402
from cuteattn.kernels.sm90.compile import compile_fwd  # noqa: E402
from cuteattn.kernels.sm90.config import FP8_TILES, SUPPORTED_HEAD_DIMS  # noqa: E402
from cuteattn.spec import AttentionSpec  # noqa: E402

MASKS = ("none", "causal", "local", "softcap")
CASES = (
    # every head dim with a rotating mask kind, bf16
    [(torch.bfloat16, d, MASKS[i % 4], False) for i, d in enumerate(SUPPORTED_HEAD_DIMS)]
    # every mask kind at d=128, and the ones the rotation above missed at d=64
    + [(torch.bfloat16, 128, m, False) for m in MASKS if m != MASKS[2]]
    + [(torch.bfloat16, 64, m, False) for m in ("causal", "local")]
    # fp16
    + [(torch.float16, 64, "none", False), (torch.float16, 256, "causal", False)]
    # packed variable-length batches
    + [(torch.bfloat16, 128, "causal", True), (torch.bfloat16, 64, "local", True),
       (torch.float16, 256, "none", True)]
)


def make_spec(dtype, d, mask, varlen, seqlen_q=4096):
    """seqlen_q picks the tile class: long (the main tiles) by default, short at <= 2048."""
    return AttentionSpec(
        dtype=dtype, head_dim=d, head_dim_v=d, causal=mask == "causal", local=mask == "local",
        seqlen_q=seqlen_q, seqlen_k=seqlen_q,
        has_softcap=mask == "softcap", varlen_q=varlen, varlen_k=varlen,
        softmax_scale=d ** -0.5, window_left=64 if mask == "local" else None,
        window_right=0 if mask == "local" else None, softcap=30.0 if mask == "softcap" else 0.0,
    )


@pytest.mark.parametrize("dtype,d,mask,varlen", CASES,
                         ids=[f"{str(c[0])[6:]}-d{c[1]}-{c[2]}{'-varlen' if c[3] else ''}" for c in CASES])
def test_compile_sm90_fwd(dtype, d, mask, varlen, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory
    cfg = sm90_launch.sm90_config(make_spec(dtype, d, mask, varlen))
    assert cfg.smem_bytes() <= 227 * 1024, f"{cfg} needs {cfg.smem_bytes()} bytes of shared memory"
    compiled = compile_fwd(cfg, options="--keep-ptx remarks{ptx}")
    ptx = compiled.__ptx__
    assert "wgmma.mma_async" in ptx, "the GEMMs must be Hopper wgmma"
    assert "cp.async.bulk.tensor" in ptx, "Q/K/V must be loaded with TMA"
    assert "setmaxnreg" in ptx, "registers must move from the producer to the consumers"
    assert "cvt.rn.bf16x2.f32" in ptx or "cvt.rn.f16x2.f32" in ptx, "P must be converted in pairs"
    if mask == "softcap":
        assert "tanh.approx" in ptx
    report = capfd.readouterr().err
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills, f"ptxas did not report register use:\n{report[-2000:]}"
    assert max(spills) == 0, f"{cfg} spills registers:\n{report[-2000:]}"


def test_compile_key_ignores_sizes():
    a = make_spec(torch.bfloat16, 128, "causal", False, seqlen_q=100)
    b = AttentionSpec(**{**a.__dict__, "batch": 7, "seqlen_q": 2048, "seqlen_k": 17,
                         "nheads": 32, "nheads_k": 8, "softmax_scale": 0.3})
    assert a.compile_key() == b.compile_key()
    assert sm90_launch.sm90_config(a) == sm90_launch.sm90_config(b)
    # past config.SHORT_SEQLEN queries only the tile shape changes (a second variant, not one
    # per length)
    c = AttentionSpec(**{**b.__dict__, "seqlen_q": 2049})
    d = AttentionSpec(**{**b.__dict__, "seqlen_q": 1 << 20})
    cfg_b, cfg_c = sm90_launch.sm90_config(b), sm90_launch.sm90_config(c)
    assert cfg_c == sm90_launch.sm90_config(d) and cfg_c != cfg_b
    tile = ("num_wg", "tile_n", "num_stages")
    assert {k: v for k, v in cfg_b.__dict__.items() if k not in tile} == \
        {k: v for k, v in cfg_c.__dict__.items() if k not in tile}


def test_kernel_scalars_fold_softcap_and_windows():
    spec = make_spec(torch.bfloat16, 128, "softcap", False)
    score_scale, scale_log2, left, right = sm90_launch.kernel_scalars(spec)
    assert score_scale == pytest.approx(spec.softmax_scale / 30.0)
    assert scale_log2 == pytest.approx(30.0 / 0.6931471805599453)
    assert left == right == 1 << 30  # unbounded sides
    local = make_spec(torch.bfloat16, 128, "local", False)
    assert sm90_launch.kernel_scalars(local)[2:] == (64, 0)


@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_register_split_fits_launch(d):
    """The producer/consumer register split must fit what the CTA is launched with, or the
    consumers' setmaxnreg.inc waits forever (a hang on the GPU, invisible to the compiler)."""
    from cuteattn.kernels.sm90.fwd import FlashFwdSm90
    kernel = FlashFwdSm90(sm90_launch.sm90_config(make_spec(torch.bfloat16, d, "none", False)))
    launch = (65536 // kernel.num_threads) // 8 * 8 * kernel.num_threads
    used = 128 * (kernel.producer_regs + kernel.cfg.num_wg * kernel.consumer_regs)
    assert used <= launch


def test_compile_report_reads_registers_and_spills():
    """What the benchmark records per variant: ptxas's register count and spill bytes."""
    from cuteattn.kernels.sm90.compile import compile_fwd_with_report
    cfg = sm90_launch.sm90_config(make_spec(torch.bfloat16, 128, "causal", False))
    compiled, info = compile_fwd_with_report(cfg)
    assert compiled is not None
    assert 128 <= info["registers"] <= 255
    assert info["spill_store_bytes"] == 0 and info["spill_load_bytes"] == 0


def test_compile_for_tvm_ffi(tmp_path, monkeypatch):
    """The kernel compiles for the TVM-FFI call path (torch tensors in, the stream from torch)."""
    pytest.importorskip("tvm_ffi")
    monkeypatch.chdir(tmp_path)
    cfg = sm90_launch.sm90_config(make_spec(torch.bfloat16, 128, "causal", True))
    compiled = compile_fwd(cfg, options="--keep-ptx", tvm_ffi=True)
    assert "wgmma.mma_async" in compiled.__ptx__


from cuteattn.kernels.sm90.config import SHORT_SEQLEN, SHORT_TILES  # noqa: E402

WORST = [(d, local, varlen, seqlen) for d in SUPPORTED_HEAD_DIMS for local in (False, True)
         for varlen in (False, True)
         for seqlen in ((4096, SHORT_SEQLEN) if d in SHORT_TILES else (4096,))]


@pytest.mark.parametrize("d,local,varlen,seqlen", WORST,
                         ids=[f"d{d}{'-local' if l else '-causal'}{'-varlen' if v else ''}"
                              f"{'-short' if s <= SHORT_SEQLEN else ''}" for d, l, v, s in WORST])
def test_worst_case_variants_do_not_spill(d, local, varlen, seqlen, capfd, tmp_path, monkeypatch):
    """The register-hungriest variant of each kind, as the launch configures it: fp16, softcap,
    causal (where the mask is not a window), packed or not. config.TILE_N_CAPS must keep all of
    them spill-free (found by benchmarks/dev_tile_search.py)."""
    monkeypatch.chdir(tmp_path)
    spec = AttentionSpec(
        dtype=torch.float16, head_dim=d, head_dim_v=d, causal=not local, local=local,
        has_softcap=True, varlen_q=varlen, varlen_k=varlen, softmax_scale=d ** -0.5,
        seqlen_q=seqlen, seqlen_k=seqlen,
        window_left=64 if local else None, window_right=16 if local else 0, softcap=20.0)
    cfg = sm90_launch.sm90_config(spec)
    compile_fwd(cfg, options="remarks{ptx}")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


O_PATH_CASES = [("own_buffer", 64, "causal", False, 1024), ("own_buffer", 64, "none", False, 4096),
                 ("own_buffer", 64, "local", True, 1024), ("own_buffer", 96, "softcap", False, 4096),
                 ("own_buffer", 96, "local", True, 4096),
                 ("k_stage", 128, "causal", False, 1024), ("k_stage", 128, "causal", True, 4096),
                 ("k_stage", 128, "none", False, 1024), ("k_stage", 128, "none", True, 2048),
                 ("k_stage", 128, "softcap", False, 1024),
                 ("v_stage", 128, "none", False, 4096),
                 ("v_stage", 128, "local", True, 4096), ("v_stage", 128, "softcap", True, 4096),
                 ("k_stage", 128, "softcap", True, 1024),
                 ("q_buffer", 192, "causal", False, 4096), ("q_buffer", 256, "local", True, 4096),
                 ("own_buffer", 112, "none", False, 4096), ("own_buffer", 160, "causal", True, 4096)]


@pytest.mark.parametrize("path,d,mask,varlen,seqlen", O_PATH_CASES,
                         ids=[f"{p}-d{d}-{m}{'-varlen' if v else ''}-{s}" for p, d, m, v, s in O_PATH_CASES])
def test_compile_o_paths(path, d, mask, varlen, seqlen, capfd, tmp_path, monkeypatch):
    """config.with_o_path stages O in its own buffer where it fits, else in the last K stage
    (causal, or a ring of three stages) or V stage where one holds the O tile, else in Q's
    buffer; each fits shared memory and compiles without spills."""
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    cfg = sm90_launch.sm90_config(make_spec(torch.float16, d, mask, varlen, seqlen_q=seqlen))
    assert cfg.o_path == path and cfg.smem_bytes() <= config.SMEM_LIMIT
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx and "stmatrix" in ptx and "st.global.v4.b32" in ptx
    # TMA rewrites a ring stage after the epilogue's generic-proxy reads of O: they need a fence
    assert ("fence.proxy.async" in ptx) == (path in ("v_stage", "k_stage"))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


# FlashAttention's forward surface beyond the compiled widths: head_dim_v != head_dim, head dims
# padded to the next width (the O store then clips its columns), one side packed, seqused on
# batched q/k. (d, dv, mask, varlen_q, varlen_k, seqused, softcap)
SURFACE_CASES = [(192, 128, "causal", False, False, False, True), (192, 128, "local", True, True, False, True),
                 (128, 64, "none", False, False, False, False), (128, 64, "local", False, False, False, True),
                 (80, 80, "causal", False, False, False, True), (80, 80, "local", True, True, True, True),
                 (72, 40, "none", True, True, False, False), (8, 8, "causal", False, False, False, False),
                 (200, 200, "local", False, False, False, True), (256, 128, "causal", True, True, False, True),
                 (128, 128, "causal", True, False, True, True), (128, 128, "local", False, True, True, True),
                 (64, 64, "causal", False, False, True, True),
                 # widths between the tile anchors, on the next anchor's tiles
                 (112, 112, "causal", False, False, False, False), (112, 112, "local", True, True, False, True),
                 (160, 144, "none", False, False, False, True), (48, 48, "causal", True, True, False, False),
                 (224, 224, "local", False, False, False, True), (32, 16, "none", False, False, False, False)]


@pytest.mark.parametrize(
    "d,dv,mask,varlen_q,varlen_k,seqused,softcap", SURFACE_CASES,
    ids=[f"d{d}v{dv}-{m}{'-q' if vq else ''}{'-k' if vk else ''}{'-used' if u else ''}{'-cap' if c else ''}"
         for d, dv, m, vq, vk, u, c in SURFACE_CASES])
def test_compile_surface_variants(d, dv, mask, varlen_q, varlen_k, seqused, softcap, capfd,
                                  tmp_path, monkeypatch):
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    spec = AttentionSpec(
        dtype=torch.float16, head_dim=d, head_dim_v=dv, causal=mask == "causal",
        local=mask == "local", has_softcap=softcap, varlen_q=varlen_q, varlen_k=varlen_k,
        has_seqused_q=seqused, has_seqused_k=seqused, softmax_scale=d ** -0.5, seqlen_q=4096,
        seqlen_k=4096, window_left=64 if mask == "local" else None,
        window_right=-16 if mask == "local" else None, softcap=20.0 if softcap else 0.0)
    assert sm90_launch.FORWARD.can_implement(spec) is None
    cfg = sm90_launch.sm90_config(spec)
    assert (cfg.head_dim, cfg.head_dim_v) == (config.kernel_width(d), config.kernel_width(dv))
    assert cfg.clip_o == (dv % 16 != 0) and cfg.smem_bytes() <= config.SMEM_LIMIT
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


# Block-sparse variants (config.sparse_config): every physical block shape, both head dims the
# issue asks for, each mask kind, fp16 (the register-hungrier dtype). (d, q_block, kv_block, mask)
SPARSE_CASES = [(d, bq, bk, m) for (bq, bk), d, m in
                [((128, 128), 128, "none"), ((128, 128), 64, "causal"), ((128, 128), 128, "softcap"),
                 ((128, 64), 128, "local"), ((128, 64), 64, "none"), ((128, 64), 128, "softcap"),
                 ((64, 64), 128, "causal"), ((64, 64), 64, "local"), ((64, 64), 80, "softcap"),
                 ((128, 64), 96, "none")]]
# (with packed sequences: the lists per sequence)
SPARSE_CASES = [c + (False,) for c in SPARSE_CASES] + [
    (128, 128, 128, "causal", True), (64, 128, 64, "none", True), (128, 64, 64, "local", True)]


@pytest.mark.parametrize("d,bq,bk,mask,varlen", SPARSE_CASES,
                         ids=[f"d{d}-{bq}x{bk}-{m}{'-varlen' if v else ''}"
                              for d, bq, bk, m, v in SPARSE_CASES])
def test_compile_block_sparse(d, bq, bk, mask, varlen, capfd, tmp_path, monkeypatch):
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    spec = AttentionSpec(
        dtype=torch.float16, head_dim=d, head_dim_v=d, causal=mask == "causal",
        local=mask == "local", has_softcap=mask == "softcap", varlen_q=varlen, varlen_k=varlen,
        has_seqused_k=varlen,
        softmax_scale=d ** -0.5, seqlen_q=4096, seqlen_k=4096,
        window_left=64 if mask == "local" else None, window_right=0 if mask == "local" else None,
        softcap=20.0 if mask == "softcap" else 0.0, sparse_q_block=bq, sparse_kv_block=bk)
    assert sm90_launch.FORWARD.can_implement(spec) is None
    cfg = sm90_launch.sm90_config(spec)
    # (64-key lists in pairs on 128-key tiles, where chosen: not with seqused_k)
    assert cfg.sparse_pairs == (bk == 64 and not varlen)
    assert cfg.sparse and cfg.dynamic_tiles
    assert (cfg.tile_m, cfg.tile_n) == (bq, 2 * bk if cfg.sparse_pairs else bk)
    assert cfg.varlen_q == cfg.varlen_k == cfg.has_seqused_k == varlen
    assert cfg.smem_bytes() <= config.SMEM_LIMIT
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


def test_key_slices_are_swizzle_atoms_wide():
    """Where a key block arrives in slices (a pair's halves, small pages), each TMA copy is one
    swizzle atom of the stage's layout wide: the atom sm90_utils picks for the operand's row
    (K-major K, MN-major V^T), so the copies tile the stage exactly (the pipeline expects the
    whole block's bytes: a 64-column copy at d=96 left 32 columns out and the tile never
    started)."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum
    from cuteattn.kernels.sm90.fwd import swizzle_atom_cols
    atom_bytes = {"SW128": 128, "SW64": 64, "SW32": 32}
    for dtype in (cutlass.BFloat16, cutlass.Float8E4M3FN):
        for cols in range(16, 257, 16):
            for major in (LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR):
                kind = sm90_utils.get_smem_layout_atom(major, dtype, cols).name.split("_")[-1]
                if kind == "INTER":  # (rows under 32 bytes: no swizzle, no slices served)
                    with pytest.raises(ValueError, match="no swizzle atom"):
                        swizzle_atom_cols(dtype, cols)
                else:
                    assert swizzle_atom_cols(dtype, cols) == atom_bytes[kind] * 8 // dtype.width
    assert [swizzle_atom_cols(cutlass.BFloat16, d) for d in (64, 80, 96, 128, 192, 256)] == [
        64, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("paired", [False, True], ids=["128-key", "paired"])
def test_compile_list_transpose(paired, capfd, tmp_path, monkeypatch):
    """The backward's list transposition (common/list_transpose.py): shared-memory bytes, no
    spills; the halves' table stored only for paired lists."""
    from cuteattn.kernels.common import arguments as common_arguments
    from cuteattn.kernels.common.list_transpose import ListTranspose, ListTransposeConfig
    from cuteattn.kernels.compile_common import compile_kernel
    from cuteattn.kernels.sm90 import arguments as sm90_arguments
    monkeypatch.chdir(tmp_path)
    cfg = ListTransposeConfig(paired)
    fakes = common_arguments.fakes(cfg, sm90_arguments.LIST_TRANSPOSE_ARGUMENTS, None)
    assert (fakes[-1] is not None) == paired
    ptx = compile_kernel(ListTranspose(cfg), fakes, options="--keep-ptx remarks{ptx}").__ptx__
    assert "st.shared.u8" in ptx or "st.shared.b8" in ptx
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


@pytest.mark.parametrize("index_bits", [64, 32])
def test_compile_topk_lists(index_bits, capfd, tmp_path, monkeypatch):
    """VSA's builder (common/topk_lists.py): a byte a key block in shared memory, the indices
    compared at their width, no spills."""
    from cuteattn.kernels.common import arguments as common_arguments
    from cuteattn.kernels.common.topk_lists import TopkLists, TopkListsConfig
    from cuteattn.kernels.compile_common import compile_kernel
    from cuteattn.kernels.sm90 import arguments as sm90_arguments
    monkeypatch.chdir(tmp_path)
    cfg = TopkListsConfig(index_bits)
    fakes = common_arguments.fakes(cfg, sm90_arguments.TOPK_LISTS_ARGUMENTS, None)
    ptx = compile_kernel(TopkLists(cfg), fakes, options="--keep-ptx remarks{ptx}").__ptx__
    assert "st.shared.u8" in ptx or "st.shared.b8" in ptx
    # (int64 indices compared at their width: a huge index is out of range, not wrapped)
    assert ("setp.lt.s64" in ptx or "setp.ge.s64" in ptx) == (index_bits == 64)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


def test_block_sparse_reasons():
    """What the block-sparse kernel declines, each with its reason (the API then falls back)."""
    base = dict(dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=False, local=False,
                has_softcap=False, varlen_q=False, varlen_k=False, softmax_scale=0.1,
                sparse_q_block=128, sparse_kv_block=128)
    can = lambda **kw: sm90_launch.FORWARD.can_implement(AttentionSpec(**{**base, **kw}))
    assert can() is None
    assert can(sparse_q_block=256, sparse_kv_block=256).startswith(
        "block-sparse blocks of 256x256: the sm90 kernel takes 128x128, 128x64, 64x64")
    assert can(head_dim=192, head_dim_v=192).startswith("block-sparse at head_dim 192")
    assert can(varlen_q=True, varlen_k=True) is None  # (per sequence: FlashAttention-4's form)


FP8_CASES = [(d, m, v) for d in FP8_TILES for m in MASKS for v in (False, True)]  # (d=80: declined)


@pytest.mark.parametrize("d,mask,varlen", FP8_CASES,
                         ids=[f"d{d}-{m}{'-varlen' if v else ''}" for d, m, v in FP8_CASES])
def test_compile_fp8_fwd(d, mask, varlen, capfd, tmp_path, monkeypatch):
    """Every fp8 forward variant that takes V^T from the pass over HBM (4096 queries: past
    config.FP8_V_IN_KERNEL_MAX_SEQLEN_Q): e4m3 wgmma for both GEMMs (V K-major), P packed to e4m3
    four at a time, bf16 out, no spills."""
    monkeypatch.chdir(tmp_path)
    spec = make_spec(torch.float8_e4m3fn, d, mask, varlen)
    assert sm90_launch.FORWARD.can_implement(spec) is None
    cfg = sm90_launch.sm90_config(spec)
    assert cfg.fp8 and cfg.tile_n % 32 == 0 and cfg.o_path == "own_buffer"
    assert not cfg.fp8_v_in_kernel
    assert cfg.smem_bytes() <= 227 * 1024
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "e4m3.e4m3" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "cvt.rn.bf16x2.f32" in ptx  # (O)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


FP8_IN_KERNEL_CASES = [(d, m, v) for d in FP8_TILES if d != 256 for m in MASKS
                       for v in (False, True)]  # (d=256: the staging ring does not fit)


@pytest.mark.parametrize("d,mask,varlen", FP8_IN_KERNEL_CASES,
                         ids=[f"d{d}-{m}{'-varlen' if v else ''}" for d, m, v in FP8_IN_KERNEL_CASES])
def test_compile_fp8_fwd_v_in_kernel(d, mask, varlen, capfd, tmp_path, monkeypatch):
    """The fp8 forward with V transposed by its producer warpgroup (up to
    config.FP8_V_IN_KERNEL_MAX_SEQLEN_Q queries): the staging ring fits, the transposes
    (ldmatrix.trans, stmatrix) are there, no spills; longer query sequences take the pass over
    HBM."""
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    bound = config.FP8_V_IN_KERNEL_MAX_SEQLEN_Q
    assert not sm90_launch.sm90_config(make_spec(torch.float8_e4m3fn, d, mask, varlen,
                                                 seqlen_q=bound + 1)).fp8_v_in_kernel
    cfg = sm90_launch.sm90_config(make_spec(torch.float8_e4m3fn, d, mask, varlen, seqlen_q=bound))
    assert cfg.fp8_v_in_kernel and cfg.smem_bytes() <= 227 * 1024
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "e4m3.e4m3" in ptx and "prmt.b32" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "stmatrix.sync" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


FP8_SHORT_PASS_CASES = [(d, m, v) for d in (128,) for m in MASKS for v in (False, True)]


@pytest.mark.parametrize("d,mask,varlen", FP8_SHORT_PASS_CASES,
                         ids=[f"d{d}-{m}{'-varlen' if v else ''}" for d, m, v in FP8_SHORT_PASS_CASES])
def test_compile_fp8_fwd_short_tiles_with_the_pass(d, mask, varlen, capfd, tmp_path, monkeypatch):
    """fp8 between the in-kernel transpose's bound and config.FP8_SHORT_SEQLEN (d=128: 1025-2048
    queries): the short tile with V^T from the pass over HBM, spill-free; past that bound the
    long tile."""
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    bound = config.FP8_SHORT_SEQLEN[d]
    assert bound > config.FP8_V_IN_KERNEL_MAX_SEQLEN_Q
    short = config.FP8_SHORT_TILES[d]
    cfg = sm90_launch.sm90_config(make_spec(torch.float8_e4m3fn, d, mask, varlen, seqlen_q=bound))
    assert (cfg.num_wg, cfg.num_stages) == (short[0], short[2]) and not cfg.fp8_v_in_kernel
    longer = sm90_launch.sm90_config(make_spec(torch.float8_e4m3fn, d, mask, varlen,
                                               seqlen_q=bound + 1))
    assert (longer.num_wg, longer.tile_n, longer.num_stages) != (cfg.num_wg, cfg.tile_n,
                                                                 cfg.num_stages)
    compile_fwd(cfg, options="remarks{ptx}")
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"


def test_fp8_reasons():
    """What the fp8 forward declines (the API then falls back to the reference)."""
    import dataclasses
    can = lambda **kw: sm90_launch.FORWARD.can_implement(
        dataclasses.replace(make_spec(torch.float8_e4m3fn, 128, "none", False), **kw))
    assert can() is None
    assert can(varlen_q=True, varlen_k=True) is None and can(has_seqused_k=True) is None
    assert can(head_dim=80, head_dim_v=80).startswith("fp8 at head_dim 80")
    assert can(head_dim_v=64).startswith("fp8 at head_dim 128 (head_dim_v 64)")
    assert can(sparse_q_block=128, sparse_kv_block=128).startswith("fp8 block-sparse")


def test_paged_prefill_routes():
    """A paged prefill: the sm90 forward reads pages itself, of a multiple of 64 keys (its key
    blocks inside a page) or of a multiple of 16 up to its key block (a block's slices from
    their pages, at widths padded to a multiple of 64); other pages, and forms it declines
    with pages, go to the portable kernel
    (the sm80 family's rules and launch): packed q with a page size, compiled head dims."""
    import dataclasses
    from cuteattn.kernels.sm80 import launch as sm80_launch
    paged = dataclasses.replace(make_spec(torch.bfloat16, 128, "causal", True), paged_kv=True,
                                page_size=16)
    assert sm90_launch.PAGED_PREFILL is sm80_launch.FORWARD
    assert sm90_launch.FORWARD.can_implement(paged) is None
    # pages wider than any key block that are not whole blocks: the portable kernel's
    wide_pages = dataclasses.replace(paged, page_size=240)
    assert sm90_launch.FORWARD.can_implement(wide_pages) is None  # (the portable kernel's)
    assert sm90_launch.unserved_paged(wide_pages).startswith("pages of 240 keys")
    assert sm90_launch.FORWARD.can_implement(dataclasses.replace(
        wide_pages, head_dim=80, head_dim_v=80)).startswith("head_dim 80 is not supported by the sm80")
    for page, d, width in ((64, 128, 128), (128, 128, 128), (256, 64, 64), (128, 80, 80),
                           (16, 128, 128), (32, 256, 256), (16, 64, 64), (16, 96, 128),
                           (16, 80, 128), (48, 112, 128), (16, 144, 192), (16, 40, 64)):
        spec = dataclasses.replace(paged, page_size=page, head_dim=d, head_dim_v=d)
        assert sm90_launch.unserved_paged(spec) is None
        cfg = sm90_launch.sm90_config(spec)
        assert cfg.page_size == page
        # pages that slice a key block: 64-column copies, so the kernel runs padded
        assert (cfg.head_dim, cfg.head_dim_v) == (width, width)
        assert page % cfg.tile_n == 0 if page >= 64 else cfg.tile_n % page == 0
    assert sm90_launch.FORWARD.can_implement(dataclasses.replace(paged, varlen_q=False)) == (
        "paged keys need packed q (flash_attn_varlen_func) and a page size")
    # a learnable sink: the sm90 forward reads the pages too (the sink is its epilogue's)
    with_sink = dataclasses.replace(paged, has_sink=True)
    assert sm90_launch.unserved_paged(with_sink) is None and sm90_launch.sm90_config(with_sink).has_sink


def test_paged_prefill_gathers_small_pages_when_the_rows_pay_for_it(monkeypatch):
    """Pages that slice a key block are gathered into batched K / V first when a kv head has
    config.PAGED_GATHER_MIN_ROWS query rows (max_seqlen_q x the GQA group) and the copy fits
    config.PAGED_GATHER_MAX_BYTES; pages of whole key blocks never are."""
    import dataclasses
    from cuteattn.kernels.sm90 import config
    # the bench's prefill cell: 4 x 2048 queries, 32 / 8 heads, over 16k keys in pages of 16
    cell = dataclasses.replace(make_spec(torch.bfloat16, 128, "causal", True), paged_kv=True,
                               page_size=16, batch=4, nheads=32, nheads_k=8, seqlen_q=2048,
                               seqlen_k=16384)
    assert sm90_launch.gathers_pages(cell)  # (4 x 16384 x 8 x 256 x 2 bytes: 256 MiB)
    assert not sm90_launch.gathers_pages(dataclasses.replace(cell, page_size=128))
    assert not sm90_launch.gathers_pages(dataclasses.replace(cell, page_size=64))
    assert sm90_launch.gathers_pages(dataclasses.replace(cell, page_size=48))
    rows = config.PAGED_GATHER_MIN_ROWS // 4  # (4 query heads a kv head)
    assert sm90_launch.gathers_pages(dataclasses.replace(cell, seqlen_q=rows))
    assert not sm90_launch.gathers_pages(dataclasses.replace(cell, seqlen_q=rows - 1))
    monkeypatch.setattr(config, "PAGED_GATHER_MAX_BYTES", 256 * 2 ** 20 - 1)
    assert not sm90_launch.gathers_pages(cell)
    assert not sm90_launch.gathers_pages(dataclasses.replace(cell, paged_kv=False, page_size=0))


PAGED_CASES = [(64, 64, "none"), (64, 128, "causal"), (96, 256, "none"), (128, 128, "causal"),
               (128, 128, "window"), (128, 256, "softcap"), (192, 128, "causal"), (256, 128, "none"),
               (128, 16, "causal"), (128, 16, "window"), (64, 16, "none"), (256, 32, "causal"),
               (192, 48, "softcap"), (128, 16, "causal-sink"), (64, 128, "sink"), (112, 128, "causal"),
               (112, 16, "causal")]


@pytest.mark.parametrize("d,page,mask", PAGED_CASES, ids=[f"d{d}-page{p}-{m}" for d, p, m in PAGED_CASES])
def test_compile_paged_forward(d, page, mask, capfd, tmp_path, monkeypatch):
    """The forward reading keys from pages (a TMA copy per key block, the block found through
    the page table; the last page's rows past the sequence zeroed in V): spill-free, and the
    V block with the sequence's end published by a plain arrive after its own barrier."""
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    causal, local, softcap = (mask in ("causal", "softcap", "causal-sink"), mask == "window",
                              mask == "softcap")
    cfg = config.fwd_config(cutlass.BFloat16, d, d, causal, local, softcap, True, False,
                            has_seqused_k=True, page_size=page, has_sink=mask.endswith("sink"))
    assert page % cfg.tile_n == 0 if page >= 64 else cfg.tile_n % page == 0
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.init" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


@pytest.mark.parametrize("dv", [64, 128, 256])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "packed"])
def test_compile_fp8_value_transpose(dv, varlen, capfd, tmp_path, monkeypatch):
    """V's transpose for the fp8 forward (fp8_value.py): byte transposes by prmt, no spills."""
    from cuteattn.kernels.compile_common import compile_kernel
    from cuteattn.kernels.sm90 import arguments
    from cuteattn.kernels.sm90.fp8_value import Fp8ValueConfig, Fp8ValueTranspose
    monkeypatch.chdir(tmp_path)
    cfg = Fp8ValueConfig(dv, varlen=varlen)
    ptx = compile_kernel(Fp8ValueTranspose(cfg), arguments.fakes(cfg, entries=arguments.FP8_VALUE_ARGUMENTS),
                         "--keep-ptx remarks{ptx}").__ptx__
    assert ptx.count("prmt.b32") >= 32 and "st.global" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0


SINK_CASES = [(64, "causal", False), (128, "none", True), (128, "window", False),
              (256, "causal", True), (96, "softcap", False)]


@pytest.mark.parametrize("d,mask,varlen", SINK_CASES,
                         ids=[f"d{d}-{m}{'-varlen' if v else ''}" for d, m, v in SINK_CASES])
def test_compile_forward_with_learnable_sink(d, mask, varlen, capfd, tmp_path, monkeypatch):
    """A learnable sink (gpt-oss) joins the epilogue's denominator: spill-free; the family
    takes sinks on its plain and packed forms (not with lists or mods yet)."""
    from cuteattn.kernels.sm90 import config
    monkeypatch.chdir(tmp_path)
    spec = AttentionSpec(
        dtype=torch.bfloat16, head_dim=d, head_dim_v=d, causal=mask == "causal",
        local=mask == "window", has_softcap=mask == "softcap", varlen_q=varlen, varlen_k=varlen,
        softmax_scale=d ** -0.5, window_left=64 if mask == "window" else None,
        window_right=0 if mask == "window" else None, softcap=20.0 if mask == "softcap" else 0.0,
        has_sink=True)
    assert sm90_launch.FORWARD.can_implement(spec) is None
    assert sm90_launch.FORWARD.can_implement(dataclasses.replace(
        spec, sparse_q_block=128, sparse_kv_block=128)).startswith("learnable attention sinks")
    cfg = sm90_launch.sm90_config(spec)
    assert cfg.has_sink and cfg.smem_bytes() <= config.SMEM_LIMIT
    ptx = compile_fwd(cfg, options="--keep-ptx remarks{ptx}").__ptx__
    assert "wgmma.mma_async" in ptx
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0, f"{cfg} spills"
