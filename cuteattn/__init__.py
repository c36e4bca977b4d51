"""cuteattn: FlashAttention-compatible attention kernels written with the CuTe DSL."""

__version__ = "0.1.0"

from cuteattn.api import FallbackWarning, flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "FallbackWarning", "__version__"]
