"""The sm80 kernel families dispatch registers (dispatch.FAMILY_MODULES): the forward and the
decode kernel (flash_attn_with_kvcache)."""
from .launch import DECODE, FORWARD

FAMILIES = (FORWARD, DECODE)
