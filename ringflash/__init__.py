"""ringflash: exact multi-GPU sequence-parallel ring attention with Triton flash kernels."""

from . import nn
from .balance import BalancedLayout, balanced_layout
from .layout import local_positions, shard, unshard
from .local import flash_attn_func, flash_attn_varlen_func
from .merge import merge_attn_states
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "ring_flash_attn_func",
    "ring_flash_attn_varlen_func",
    "balanced_layout",
    "BalancedLayout",
    "merge_attn_states",
    "shard",
    "unshard",
    "local_positions",
    "nn",
]
__version__ = "0.1.0"
