"""The associative log-sum-exp merge of two partial attention states."""
from __future__ import annotations

import torch

from ._checks import _shape, check_tensor


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of `dtype`: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_attn_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets.

    o_a, o_b: (B, S, H, D), normalized outputs of each key set (any float dtype).
    lse_a, lse_b: (B, H, S), natural-log sum of exp(scores); -inf for a row that saw no key.
    Returns (o, lse) in float32, or float64 when an input is float64. Associative and
    commutative; a row empty on both sides gives o = 0 and lse = -inf, never NaN.
    """
    api = "merge_attn_states"
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        check_tensor(name, t, api)
        if not t.is_floating_point():
            raise TypeError(f"{api}: {name} must be floating point, got {t.dtype}")
    if o_a.dim() != 4 or o_a.shape != o_b.shape:
        raise ValueError(f"{api}: o_a and o_b must be equal 4-D (B, S, H, D), got {_shape(o_a)} and {_shape(o_b)}")
    B, S, H, _ = o_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != (B, H, S):
            raise ValueError(f"{api}: {name} must have shape (B, H, S) = {(B, H, S)} for o {_shape(o_a)}, got {_shape(t)}")
    devices = {t.device for t in (o_a, lse_a, o_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"{api}: all inputs must be on one device, got {sorted(map(str, devices))}")
    dtype = state_dtype(torch.promote_types(o_a.dtype, lse_a.dtype))
    dtype = torch.promote_types(dtype, state_dtype(torch.promote_types(o_b.dtype, lse_b.dtype)))
    return _merge(o_a.to(dtype), lse_a.to(dtype), o_b.to(dtype), lse_b.to(dtype))


def _merge(o_a, lse_a, o_b, lse_b):
    """merge_attn_states without validation or casts."""
    lse_max = torch.maximum(lse_a, lse_b)
    # Both sides empty: subtracting -inf from -inf would give NaN; any finite pivot works.
    pivot = torch.where(lse_max == float("-inf"), torch.zeros_like(lse_max), lse_max)
    w_a = torch.exp(lse_a - pivot)
    w_b = torch.exp(lse_b - pivot)
    total = w_a + w_b
    lse = pivot + torch.log(total)
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # weights (B, H, S) -> (B, S, H, 1) to scale o
    scale_a = (w_a * inv).transpose(1, 2).unsqueeze(-1)
    scale_b = (w_b * inv).transpose(1, 2).unsqueeze(-1)
    return o_a * scale_a + o_b * scale_b, lse
