"""Test oracles: plain attention that materializes every score, in any dtype."""
from __future__ import annotations

import math

import torch


def naive_attention(q, k, v, *, scale=None, causal=False, q_pos=None, k_pos=None, dtype=None, key_padding_mask=None):
    """Attention computed the obvious way, in `dtype` (default float64), differentiable.

    q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D). Causal masks use global positions q_pos / k_pos
    (default: bottom-right alignment). key_padding_mask (B, Sk): bool (True = ignored) or
    float (added to the scores). Returns out (B, Sq, Hq, D) and lse (B, Hq, Sq); a row
    with no visible key gives 0 and -inf.
    """
    dtype = dtype or torch.float64
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if key_padding_mask is not None:
        m = key_padding_mask.to(s.device)
        bias = torch.zeros(m.shape, dtype=dtype, device=s.device).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        s = s + bias[:, None, None, :]
    if causal:
        if q_pos is None:
            q_pos = torch.arange(Sq) + (Sk - Sq)
            k_pos = torch.arange(Sk)
        visible = q_pos.to(s.device)[:, None] >= k_pos.to(s.device)[None, :]
        s = s.masked_fill(~visible, float("-inf"))
    # rows that see no key: output 0, lse -inf, zero gradients (and no NaN from autograd)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s.float() if dtype in (torch.float16, torch.bfloat16) else s, dim=-1).to(dtype)
    p = torch.exp(s - lse[..., None]).masked_fill(empty, 0.0)
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def max_err(a, b) -> float:
    """Max abs difference, treating equal infinities as equal."""
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    return torch.where(same_inf, torch.zeros_like(a), (a - b).abs()).max().item()


def assert_within(name, got, ref64, plain, factor=2.0, sum_len=None):
    """got's error against the float64 reference is at most `factor` x that of the plain
    same-dtype computation, with a floor of a few ulps of a sum of `sum_len` terms (default: a
    head_dim-long dot product); the plain result can be exact by luck, e.g. dq = 0 when each
    query sees a single key."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err = max_err(got, ref64)
    finite = ref64[torch.isfinite(ref64)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    eps = torch.finfo(got.dtype if got.dtype != torch.float64 else torch.float32).eps
    sum_len = sum_len or (got.shape[-1] if got.dim() == 4 else 1)
    bound = factor * max(max_err(plain, ref64), 4 * eps * max(scale, 1.0) * sum_len**0.5)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (plain {max_err(plain, ref64):.3e})"
