"""common/softmax.exp2_poly, the softmax's exp2 on the FMA pipe: its arithmetic emulated in
float32 on the CPU (error, the clamp, -inf), and on the GPU the PTX itself, bit for bit against
that emulation."""
import os

import pytest
import torch

import cutlass
import cutlass.cute as cute

from cuteattn.kernels.common import softmax

THREADS = 128
MAGIC = 12582912.0  # 1.5 * 2^23


def exp2_poly_emulated(x: torch.Tensor) -> torch.Tensor:
    """exp2_poly's instructions one by one in float32 (each rounded to nearest, as its PTX)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    x = torch.maximum(x, f32(-127.0))
    t = x + f32(MAGIC)
    f = x - (t - f32(MAGIC))
    p = f * f32(softmax.EXP2_POLY_C3) + f32(softmax.EXP2_POLY_C2)
    p = p * f + f32(softmax.EXP2_POLY_C1)
    p = p * f + f32(1.0)
    bits = p.view(torch.int32).long() + (t.view(torch.int32).long() << 23)
    bits = ((bits + 2 ** 31) % 2 ** 32) - 2 ** 31  # (the 32-bit add wraps)
    return bits.to(torch.int32).view(torch.float32)


def probe_inputs() -> torch.Tensor:
    edges = [-float("inf"), -1000.0, -127.0, -126.75, -126.5, -126.0, -125.5, -0.5, 0.0, 0.5,
             7.999, 8.0, 15.5, 16.0]
    grid = torch.linspace(-130.0, 17.0, 1 << 20, dtype=torch.float64)
    return torch.cat([torch.tensor(edges, dtype=torch.float64), grid]).float()


def check_values(x: torch.Tensor, y: torch.Tensor):
    assert not torch.isnan(y).any() and not torch.isinf(y).any()
    exact = torch.exp2(x.double())
    normal = x > -126.0
    rel = ((y.double() - exact).abs() / exact)[normal]
    assert rel.max().item() <= 1.05e-4, rel.max().item()
    assert (y[x <= -127.0] == 0).all()                      # -inf (a masked score) gives 0
    assert (y[~normal] <= 2.0 ** -126).all() and (y >= 0).all()


def test_emulated_exp2_poly_error_and_edges():
    x = probe_inputs()
    y = exp2_poly_emulated(x)
    check_values(x, y)
    ints = torch.arange(-126, 17, dtype=torch.float32)     # whole powers of two come out exact
    assert torch.equal(exp2_poly_emulated(ints), torch.exp2(ints))


class Exp2PolyProbe:
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        n = cute.size(mX)
        self.kernel(mX, mY).launch(grid=[(n + THREADS - 1) // THREADS, 1, 1],
                                   block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        if i < cute.size(mX):
            mY[i] = softmax.exp2_poly(mX[i])


def compile_probe():
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_fake_compact_tensor
    n = cute.sym_int()
    fake = lambda: make_fake_compact_tensor(cutlass.Float32, (n,))
    return cute.compile(Exp2PolyProbe(), fake(), fake(), cuda.CUstream(0))


@pytest.mark.compile
def test_exp2_poly_compiles_for_sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    compile_probe()


@pytest.mark.gpu
def test_exp2_poly_on_the_gpu_matches_its_emulation():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from cutlass.cute.runtime import from_dlpack
    x = probe_inputs()
    xd = x.cuda()
    yd = torch.full_like(xd, float("nan"))
    compile_probe()(from_dlpack(xd), from_dlpack(yd), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    y = yd.cpu()
    check_values(x, y)
    assert torch.equal(y.view(torch.int32), exp2_poly_emulated(x).view(torch.int32))
