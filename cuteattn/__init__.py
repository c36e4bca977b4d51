"""cuteattn: FlashAttention-compatible attention kernels written with the CuTe DSL."""

__version__ = "0.1.0"

from cuteattn.api import FallbackWarning, flash_attn_func, flash_attn_varlen_func
from cuteattn.kvcache import flash_attn_with_kvcache
from cuteattn.packed import (flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                             flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "FallbackWarning",
           "__version__"]
