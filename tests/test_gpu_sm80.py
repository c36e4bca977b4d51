"""The sm80 (mma.sync) forward on the GPU: the forward and varlen suites of the sm90 kernels, run
with CUTEATTN_PATH=sm80, so that on a Hopper GPU the portable path (compiled for the running
arch, sm_80 instructions only) is what serves every call. strict=True everywhere: a case the path
does not serve fails instead of passing on the reference; outputs are poisoned with NaN."""
import pytest
import torch

from cuteattn import api, dispatch, flash_attn_func

from test_gpu_fwd import CASES, case_id, run_case
from test_gpu_fwd import run_and_check as run_fixed
from test_gpu_varlen import LENS_K, LENS_Q
from test_gpu_varlen import MASKS as VARLEN_MASKS
from test_gpu_varlen import run_and_check as run_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def sm80_path(monkeypatch):
    monkeypatch.setenv(dispatch.PATH_ENV, "sm80")


def test_the_sm80_path_serves_the_calls(seed):
    """The path variable really routes calls to the sm80 family (and a later call without it
    to the device's own kernels, despite the same call signature)."""
    from cuteattn.kernels.sm80 import launch as sm80_launch
    q = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    api._launches.clear()
    flash_attn_func(q, q, q, causal=True, strict=True)
    flash_attn_func(q, q, q, causal=True, strict=True)  # the signature fast path
    (spec, launch), = api._launches.values()
    assert isinstance(launch, sm80_launch.Launch)
    major, _ = torch.cuda.get_device_capability()
    if major not in dispatch.ARCH_BY_MAJOR or dispatch.ARCH_BY_MAJOR[major] == "sm80":
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(dispatch.PATH_ENV)
        flash_attn_func(q, q, q, causal=True, strict=True)
    assert any(not isinstance(launch, sm80_launch.Launch) for _, launch in api._launches.values())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fwd(seed, case):
    run_case(case)


def test_strided_inputs(seed):
    """q, k, v as views of one packed qkv tensor (row strides of 3 heads), and a custom scale."""
    qkv = torch.randn(2, 333, 3, 8, 128, device="cuda", dtype=torch.float16)
    run_fixed(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], softmax_scale=0.05, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("h, hk", [(8, 8), (8, 2)])
@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_varlen(seed, dtype, d, h, hk, mask):
    run_varlen(LENS_Q, LENS_K, h, hk, d, dtype, **VARLEN_MASKS[mask])


@pytest.mark.parametrize("mask", list(VARLEN_MASKS))
def test_varlen_seqused(seed, mask):
    used_q = torch.tensor([1, 0, 20, 64, 0, 100, 129, 650], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([100, 3, 0, 700, 1, 0, 128, 10], dtype=torch.int32, device="cuda")
    run_varlen(LENS_Q, LENS_K, 8, 2, 128, torch.bfloat16, seqused_q=used_q, seqused_k=used_k,
               **VARLEN_MASKS[mask])
