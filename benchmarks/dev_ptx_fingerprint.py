"""Prints a hash of the PTX of a few sm90 forward and backward variants, compiled without a GPU, with kernel
names normalised. Run it at two commits: equal hashes mean the refactor between them did not
change the generated code, so a GPU verification of the first carries over to the second.
    PYTHONPATH=$PWD python benchmarks/dev_ptx_fingerprint.py
"""
import hashlib
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402

from cuteattn.kernels.sm90.bwd import Sm90BwdConfig  # noqa: E402
from cuteattn.kernels.sm90.compile import compile_bwd, compile_fwd  # noqa: E402
from cuteattn.kernels.sm90.config import fwd_config  # noqa: E402

VARIANTS = [  # (head_dim, causal, local, varlen, max_seqlen_q, softcap)
    (128, True, False, False, 4096, False), (64, True, False, False, 1024, False),
    (128, False, False, True, 4096, False), (64, False, True, False, 4096, False),
    (256, False, False, False, 4096, False), (128, True, False, True, 700, True),
    (96, False, True, False, 4096, True),
]

for d, causal, local, varlen, seqlen, softcap in VARIANTS:
    cfg = fwd_config(cutlass.BFloat16, d, d, causal, local, softcap, varlen, varlen, max_seqlen_q=seqlen)
    ptx = compile_fwd(cfg, options="--keep-ptx", tvm_ffi=True).__ptx__
    body = ptx[ptx.index(".entry"):]
    body = re.sub(r"\.entry \S+", ".entry K", body)
    body = re.sub(r"\w*cutlass\w*", "N", body)
    print(f"d={d} causal={causal:d} local={local:d} varlen={varlen:d} seqlen={seqlen} softcap={softcap:d}: "
          f"{hashlib.sha1(body.encode()).hexdigest()[:12]} ({len(body)} chars)", flush=True)


BWD_VARIANTS = [  # Sm90BwdConfig fields beyond dtype (as launch_bwd.bwd_config sets them)
    dict(head_dim=128, causal=True), dict(head_dim=64), dict(head_dim=128, deterministic=True),
    dict(head_dim=96, dq_single_wg=True, has_softcap=True, local=True),
    dict(head_dim=128, varlen_q=True, varlen_k=True, has_seqused_q=True, has_seqused_k=True),
]

for fields in BWD_VARIANTS:
    ptx = compile_bwd(Sm90BwdConfig(dtype=cutlass.BFloat16, **fields), options="--keep-ptx",
                      tvm_ffi=True).__ptx__
    body = ptx[ptx.index(".entry"):]
    body = re.sub(r"\.entry \S+", ".entry K", body)
    body = re.sub(r"\w*cutlass\w*", "N", body)
    print(f"bwd {fields}: {hashlib.sha1(body.encode()).hexdigest()[:12]} ({len(body)} chars)",
          flush=True)
