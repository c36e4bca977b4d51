"""The sm90 kernel families dispatch registers (dispatch.FAMILY_MODULES): the forward
(launch.py) and the backward (launch_bwd.py)."""
from .launch import FORWARD
from .launch_bwd import BACKWARD

FAMILIES = (FORWARD, BACKWARD)
