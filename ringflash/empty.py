"""Attention with no query row or no key: the result is known without a kernel or a ring.

An empty batch (or no query rows, or no heads) gives empty outputs; queries over no key get
output 0 and lse -inf, as a query that sees no key does everywhere in ringflash. Connected to
autograd, so a loss built on them back-propagates zero (or empty) gradients to q, k and v.
"""

from __future__ import annotations

import torch

from .merge import state_dtype


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        B, Sq, Hq, _ = q.shape
        out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((B, Hq, Sq), float("-inf"), dtype=state_dtype(q.dtype), device=q.device)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        return tuple(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes)


def empty_attention(q, k, v):
    """(out (B, Sq, Hq, Dv) zeros in q's dtype, lse (B, Hq, Sq) -inf in the state dtype) for
    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) where B, Sq, Hq or Sk is 0."""
    return _Empty.apply(q, k, v)
