"""Compile-only tests of the KV-cache update kernel (kernels/common/kv_append.py) for sm_90a,
without a GPU: every switch (append, rotary kinds, rotary dtypes, positional q, paged and
cache_batch_idx caches, fp8 caches) compiles without spills, and the fp8 cache's values are
converted by the hardware's saturating cvt, rotation's products rounded as PyTorch's."""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported

import pytest

cutlass = pytest.importorskip("cutlass")
pytestmark = pytest.mark.compile

from cuteattn.kernels.common import arguments as common_arguments  # noqa: E402
from cuteattn.kernels.common.kv_append import KvAppend, KvAppendConfig  # noqa: E402
from cuteattn.kernels.compile_common import compile_kernel  # noqa: E402
from cuteattn.kernels.sm80 import arguments  # noqa: E402

BF16, FP16, FP32 = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
CASES = {
    "append": KvAppendConfig(BF16, 128, 128, True),
    "append-paged-gptj": KvAppendConfig(BF16, 128, 128, True, "interleaved", FP32, True, paged=True),
    "append-batch-idx-neox-fp16": KvAppendConfig(FP16, 64, 64, True, "neox", FP16, False, batch_idx=True),
    "rotary-only": KvAppendConfig(BF16, 128, 128, False, "neox", BF16, True),
    "fp8-e4m3-paged": KvAppendConfig(BF16, 128, 128, True, cache_fp8="e4m3", paged=True),
    "fp8-e5m2-gptj-d256": KvAppendConfig(BF16, 256, 256, True, "interleaved", FP32, True, cache_fp8="e5m2"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compile_kv_append(name, capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = CASES[name]
    fakes = common_arguments.fakes(cfg, arguments.KV_APPEND_ARGUMENTS, None)
    assert len(fakes) == len(arguments.KV_APPEND_ARGUMENTS)
    ptx = compile_kernel(KvAppend(cfg), fakes, "--keep-ptx remarks{ptx}").__ptx__
    assert ("cvt.rn.satfinite." in ptx) == (cfg.cache_fp8 is not None)
    # rotation's products rounded on their own (mul.rn: never fused into an fma), as PyTorch's
    assert ("mul.rn.f32" in ptx) == (cfg.rotary is not None)
    assert not re.search(r"\bmul\.f32", ptx)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", capfd.readouterr().err)]
    assert spills and max(spills) == 0
