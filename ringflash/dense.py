"""Attention under an arbitrary (query, key) mask: the exact, slower path.

Structured masks (causal, windows, documents, key padding) run in the kernels and around the
ring. A mask given as a full (L, S) pattern has no such structure, so this path materializes
the scores of this rank's L_local queries over all S keys, in plain torch: memory
B x H x L_local x S in the state dtype (twice, scores and probabilities), and with more than
one rank every rank gathers every rank's K and V (S x Hkv x D each), whose gradients are summed
back to their owners. Differentiable in q, k, v.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops
from ._checks import _shape, check_mask_not_differentiated, check_tensor
from .comm import group_rank_world, resolve_group
from .layout import _place, _shard_of
from .merge import state_dtype


class _GatherSequence(torch.autograd.Function):
    """Every rank's shard along dim 1, in global order (layout); backward: the gradient of
    the whole sequence summed over the ranks, this rank's rows of it."""

    @staticmethod
    def forward(ctx, x, group, layout):
        ctx.group, ctx.layout = group, layout
        _, world = group_rank_world(group)
        pieces = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(pieces, x.contiguous(), group=resolve_group(group))
        return _place(pieces, layout, 1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=resolve_group(ctx.group))
        rank, world = group_rank_world(ctx.group)
        return _shard_of(grad, rank, world, ctx.layout, 1), None, None


def gather_sequence(x, *, group=None, layout="zigzag"):
    """x (B, S_local, ...) on every rank -> (B, S, ...) in global order; identity on one rank.
    Differentiable: each rank's gradient of the gathered tensor reaches the owners' rows."""
    _, world = group_rank_world(group)
    return x if world == 1 else _GatherSequence.apply(x, group, layout)


def pair_bias(attn_mask, batch: int, heads: int, q_len: int, k_len: int, device, dtype, api: str):
    """attn_mask as torch's nn.MultiheadAttention documents it, (L, S) or (batch * heads, L, S),
    bool (True: the pair may not attend) or float (added to the scores), as an additive bias
    (1, 1, L, S) or (batch, heads, L, S) in `dtype`. Not differentiated: a float mask that
    requires grad raises."""
    check_tensor("attn_mask", attn_mask, api)
    if attn_mask.dim() == 2:
        want = (q_len, k_len)
    elif attn_mask.dim() == 3:
        want = (batch * heads, q_len, k_len)
    else:
        raise ValueError(f"{api}: attn_mask must be 2-D or 3-D, got shape {_shape(attn_mask)}")
    if tuple(attn_mask.shape) != want:
        raise ValueError(
            f"{api}: attn_mask must have shape (L, S) = {(q_len, k_len)} or (batch * num_heads, L, S) = "
            f"{(batch * heads, q_len, k_len)} (L: this rank's queries, S: all keys), got {_shape(attn_mask)}"
        )
    if attn_mask.device != device:
        raise ValueError(f"{api}: attn_mask is on {attn_mask.device}, the queries on {device}")
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(want, dtype=dtype, device=device).masked_fill_(attn_mask, float("-inf"))
    elif attn_mask.is_floating_point():
        check_mask_not_differentiated("attn_mask", attn_mask, api)
        bias = attn_mask.detach().to(dtype)
    else:
        raise TypeError(f"{api}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    return bias.view(1, 1, q_len, k_len) if attn_mask.dim() == 2 else bias.view(batch, heads, q_len, k_len)


def dense_attention(q, k, v, bias, *, scale, group=None, layout="zigzag", extra_kv=None, dropout=None):
    """softmax(q k^T * scale + bias) v of this rank's queries over every key of the sequence.

    q (B, L, Hq, D); k, v (B, S_local, Hkv, D), this rank's shard (the whole sequence on one
    rank); bias broadcastable to (B, Hq, L, S), S = S_local x world, keys in global order, in
    the state dtype (-inf: the pair does not attend). Returns out (B, L, Hq, D) and the
    weights (B, Hq, L, S), both in q's dtype; a query that sees no key gets output 0 and
    weights 0 (torch's gives NaN), with zero gradients. extra_kv: optional (k, v)
    (B, n, Hkv, D) held by every rank, appended after the gathered keys (bias then covers
    S + n columns). dropout: optional (seed, p, q_idx), seed an int or an int64 scalar tensor:
    the probabilities are multiplied by ringflash.dropout.keep_mask(seed, p, ...) / (1 - p) of
    the pairs (global query index q_idx (L,), key index 0..S+n-1) before they weigh v, and
    returned so, as torch's.
    """
    acc = state_dtype(q.dtype)
    k, v = gather_sequence(k, group=group, layout=layout), gather_sequence(v, group=group, layout=layout)
    if extra_kv is not None:
        k, v = torch.cat([k, extra_kv[0]], 1), torch.cat([v, extra_kv[1]], 1)
    B, L, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.to(acc).reshape(B, L, Hkv, G, D)
    s = torch.einsum("bihgd,bjhd->bhgij", qg, k.to(acc)).reshape(B, Hq, L, S) * scale + bias
    # amax refuses an empty key dim: with no keys every row sees none (-inf)
    m = s.amax(dim=-1, keepdim=True) if S else s.new_full((B, Hq, L, 1), float("-inf"))
    p = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    l = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(l > 0, l, torch.ones_like(l))
    if dropout is not None:
        seed, rate, q_idx = dropout
        seed = seed if torch.is_tensor(seed) else torch.tensor(seed, dtype=torch.int64)
        keep = ops.dropout_keep(seed, rate, B, Hq, q_idx.to(q.device), S)
        p = p * keep * (0.0 if rate >= 1.0 else 1.0 / (1.0 - rate))
    out = torch.einsum("bhgij,bjhd->bihgd", p.reshape(B, Hkv, G, L, S), v.to(acc)).reshape(B, L, Hq, v.shape[-1])
    return out.to(q.dtype), p.to(q.dtype)
