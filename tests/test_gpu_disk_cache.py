"""The disk cache on a GPU (`pytest -m gpu`): a first process compiles a kernel and exports it,
a second process (fresh memory cache) loads it without compiling and computes the right answer.
It passed on the H200 at 89f8884; since then the disk cache is on by default."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CHILD = r"""
import json, torch
from cuteattn import compile_cache, flash_attn_func
from cuteattn.reference import attention_ref
from cuteattn.testing import assert_close_fa
torch.manual_seed(0)
q, k, v = [torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
out = flash_attn_func(q, k, v, causal=True, strict=True)
ref, _ = attention_ref(q, k, v, causal=True)
low, _ = attention_ref(q, k, v, causal=True, upcast=False)
assert_close_fa(out, ref, low)
s = compile_cache.stats()
print(json.dumps({"compiles": s["compiles"], "disk_loads": s["disk_loads"]}))
"""


def run_child(env):
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_kernel_from_disk(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTEATTN_DISK_CACHE="1", CUTEATTN_CACHE_DIR=str(tmp_path),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert run_child(env) == {"compiles": 1, "disk_loads": 0}
    assert list(tmp_path.rglob("*.o"))
    assert run_child(env) == {"compiles": 0, "disk_loads": 1}
