"""The sm90 kernel families dispatch registers (dispatch.FAMILY_MODULES): the forward
(launch.py) and the backward (launch_bwd.py), and decoding (flash_attn_with_kvcache) by the
portable mma.sync decode kernel, compiled for sm_90a: decoding is bound by reading the cache,
and that kernel is verified on Hopper (tests/test_gpu_sm80.py)."""
from ..sm80.launch import Sm80Decode
from .launch import FORWARD
from .launch_bwd import BACKWARD

DECODE = Sm80Decode(arch="sm90")

FAMILIES = (FORWARD, BACKWARD, DECODE)
