"""The sm80 kernel families dispatch registers (dispatch.FAMILY_MODULES): the forward, the
backward and the decode kernel (flash_attn_with_kvcache)."""
from .launch import DECODE, FORWARD
from .launch_bwd import BACKWARD

FAMILIES = (FORWARD, BACKWARD, DECODE)
