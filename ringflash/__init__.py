"""ringflash: exact multi-GPU sequence-parallel ring attention with Triton flash kernels."""
from .local import flash_attn_func
from .merge import merge_attn_states

__all__ = ["flash_attn_func", "merge_attn_states"]
__version__ = "0.1.0"
