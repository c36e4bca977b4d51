"""The sm80 kernel families dispatch registers (dispatch.FAMILY_MODULES): the forward."""
from .launch import FORWARD

FAMILIES = (FORWARD,)
