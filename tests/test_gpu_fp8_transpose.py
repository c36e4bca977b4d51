"""sm90/fp8_transpose.transpose_v on its own: a (tile_n, d_v) tile of fp8 bytes placed in shared
memory in sK's layout (as TMA would leave V there), transposed by 128 threads into the P V
GEMM's B operand layout, read back through that layout: column 16g + s of row r must hold key
16g + FP8_KEY_ORDER[s]'s byte r, for every fp8 forward tile's (tile_n, d_v).
The kernel also compiles without a GPU (test_transpose_compiles_for_sm90a, CPU)."""
import os

import pytest
import torch

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.tensor_utils import LayoutEnum

from cuteattn.kernels.common.convert import FP8_KEY_ORDER

THREADS = 128
SHAPES = [(128, 64), (128, 96), (192, 128), (96, 192), (128, 256), (64, 128), (160, 128)]


def layouts(tile_n: int, dv: int):
    """(sV, sVt) one-stage layouts as the fp8 forward builds them (fwd.py: sK's and sVt's)."""
    fp8 = cutlass.Float8E4M3FN
    s_v = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, tile_n, dv), fp8, 1)
    s_vt = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, dv, tile_n), fp8, 1)
    return cute.slice_(s_v, (None, None, 0)), cute.slice_(s_vt, (None, None, 0))


class TransposeProbe:
    def __init__(self, tile_n: int, dv: int):
        self.tile_n, self.dv = tile_n, dv

    @cute.jit
    def __call__(self, mV: cute.Tensor, mOut: cute.Tensor, stream):
        s_v, s_vt = layouts(self.tile_n, self.dv)
        self.kernel(mV, mOut, s_v, s_vt).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mOut: cute.Tensor, s_v: cute.ComposedLayout,
               s_vt: cute.ComposedLayout):
        from cuteattn.kernels.sm90.fp8_transpose import transpose_v
        tidx, _, _ = cute.arch.thread_idx()

        @cute.struct
        class Storage:
            sV: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(s_v)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, cute.cosize(s_vt)], 1024]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        # (as the forward makes a stage's tensors: the plain pointer, the swizzled layout)
        sV = cute.make_tensor(storage.sV.data_ptr(), s_v)
        sVt = cute.make_tensor(storage.sVt.data_ptr(), s_vt)
        for i in cutlass.range(tidx, self.tile_n * self.dv, THREADS, unroll=1):
            key, col = i // self.dv, i % self.dv
            sV[key, col] = mV[key, col]
        cute.arch.sync_threads()
        transpose_v(sV, sVt, tidx, THREADS)
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, self.tile_n * self.dv, THREADS, unroll=1):
            row, key = i // self.tile_n, i % self.tile_n
            mOut[row, key] = sVt[row, key]


def compile_probe(tile_n: int, dv: int):
    from cutlass.cute.runtime import make_fake_compact_tensor
    fake = lambda shape: make_fake_compact_tensor(cutlass.Uint8, shape, stride_order=(1, 0))
    import cuda.bindings.driver as cuda
    return cute.compile(TransposeProbe(tile_n, dv), fake((tile_n, dv)), fake((dv, tile_n)),
                        cuda.CUstream(0))


@pytest.mark.compile
@pytest.mark.parametrize("tile_n,dv", SHAPES[:3])
def test_transpose_compiles_for_sm90a(tile_n, dv, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    compile_probe(tile_n, dv)


def fp8_in_kernel_shapes() -> list:
    """(tile_n, d_v) of every fp8 forward config that transposes V in the kernel."""
    import dataclasses
    from cuteattn.kernels.sm90 import launch
    from cuteattn.spec import AttentionSpec
    shapes = set()
    for d in (64, 96, 128, 192, 256):
        for causal, local, softcap in ((False, False, False), (True, False, False),
                                       (False, True, False), (False, False, True)):
            for varlen in (False, True):
                for seqlen in (128, 1024, 4096):
                    spec = AttentionSpec(
                        dtype=torch.float8_e4m3fn, head_dim=d, head_dim_v=d, causal=causal,
                        local=local, has_softcap=softcap, varlen_q=varlen, varlen_k=varlen,
                        seqlen_q=seqlen, seqlen_k=seqlen, softmax_scale=d ** -0.5)
                    cfg = dataclasses.replace(launch.sm90_config(spec), fp8_v_in_kernel=True)
                    if cfg.smem_bytes() <= 227 * 1024:
                        shapes.add((cfg.tile_n, cfg.head_dim_v))
    return sorted(shapes)


XOR_VIOLATIONS = []  # (a jit function's arguments cannot be Python lists)


@cute.jit
def xor_fields_violations(tile_n: cutlass.Constexpr, dv: cutlass.Constexpr):
    """Appends to XOR_VIOLATIONS each coordinate where transpose_v's address rule fails: a row's
    offset is the XOR of its coordinates' fields' offsets (fp8_transpose.transpose_v). (Python
    comprehensions: the DSL leaves them to Python, where it would stage loops and branches.)"""
    s_v, s_vt = layouts(tile_n, dv)
    at = lambda layout, crd: int(cute.crd2idx(crd, layout))
    G = tile_n // 16
    assert dv % 32 == 0
    XOR_VIOLATIONS.extend(  # ldmatrix's rows: key k of a group, 16-byte column chunk cc
        ("V", g, u, k, cc) for g in range(G) for u in range(dv // 32)
        for k in range(16) for cc in (0, 16)
        if at(s_v, (16 * g + k, 32 * u + cc)) != at(s_v, (16 * g, 32 * u)) ^ at(s_v, (k, cc)))
    XOR_VIOLATIONS.extend(  # stmatrix's rows: V^T row dd of a 32-column unit
        ("V^T", g, u, dd) for g in range(G) for u in range(dv // 32)
        for dd in range(32)
        if at(s_vt, (32 * u + dd, 16 * g)) != at(s_vt, (32 * u, 16 * g)) ^ at(s_vt, (dd, 0)))


@pytest.mark.compile
def test_addresses_compose_by_xor_for_every_fp8_tile(monkeypatch):
    """transpose_v's addresses (a unit's base XOR constants) hold on each fp8 tile's layouts."""
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    shapes = fp8_in_kernel_shapes()
    assert (192, 128) in shapes and len(shapes) >= 8, shapes
    for tile_n, dv in shapes:
        XOR_VIOLATIONS.clear()
        xor_fields_violations(tile_n, dv)
        assert not XOR_VIOLATIONS, ((tile_n, dv), XOR_VIOLATIONS[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n,dv", SHAPES)
def test_transpose_puts_keys_in_fp8_key_order(tile_n, dv):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    from cutlass.cute.runtime import from_dlpack
    v = torch.randint(0, 256, (tile_n, dv), dtype=torch.uint8, device="cuda")
    out = torch.full((dv, tile_n), 0xAB, dtype=torch.uint8, device="cuda")
    fn = compile_probe(tile_n, dv)
    fn(from_dlpack(v), from_dlpack(out), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    order = torch.tensor([16 * (k // 16) + FP8_KEY_ORDER[k % 16] for k in range(tile_n)],
                         device="cuda")
    assert torch.equal(out, v[order].t())
