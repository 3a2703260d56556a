"""The attention weights softmax(q k^T * scale + mask) of this rank's queries over all keys,
computed only when asked for (RingMultiheadAttention's need_weights=True), in a second pass
from the attention's own final log-sum-exp: p = exp(s - lse). Plain torch; it materializes
(B, Hq, Sq_local, S) scores, which is the size of what it returns.
"""

from __future__ import annotations

import torch

from .comm import group_rank_world
from .dense import gather_sequence
from .layout import local_positions
from .masks import local_offsets
from .merge import state_dtype


def attention_weights(q, k, lse, *, scale, causal=False, key_bias=None, group=None, layout="zigzag", local=False):
    """Weights of the queries q (B, Sq, Hq, D) over every key of the sequence whose shard on
    this rank is k (B, Sk, Hkv, D), given the attention's lse (B, Hq, Sq), natural log (from
    flash_attn_func / ring_flash_attn_func with return_lse=True and the same scale, causal
    flag and key_bias (B, Sk), the additive bias of the keys, -inf for a padded key).

    Returns (B, Hq, Sq, S) in q's dtype, S = Sk x world, the keys in global (unsharded)
    order; a query that sees no key has weights 0 (as its output is 0). One device: causal
    aligns bottom-right as flash_attn_func. World > 1: every rank gathers every rank's k (and
    key bias) with `layout` (collectives every rank must call); causal by global positions.
    Differentiable in q and k (and through lse); on the ring the gradients of the gathered
    keys are summed back to their owners. Memory: the (B, Hq, Sq, S) result plus one float32
    copy of it and the gathered keys. local=True: k are keys every rank holds whole (no
    gathering, whatever the world).
    """
    _, world = (0, 1) if local else group_rank_world(group)
    B, Sq, Hq, D = q.shape
    acc = state_dtype(q.dtype)
    if world > 1:
        k = gather_sequence(k, group=group, layout=layout)
        if key_bias is not None:
            key_bias = gather_sequence(key_bias, group=group, layout=layout)
        q_pos = local_positions(Sq * world, group=group, layout=layout, device=q.device)
    else:
        q_pos = torch.arange(Sq, device=q.device) + local_offsets(Sq, k.shape[1])[0]
    S, Hkv = k.shape[1], k.shape[2]
    qg = q.to(acc).reshape(B, Sq, Hkv, Hq // Hkv, D)
    s = torch.einsum("bihgd,bjhd->bhgij", qg, k.to(acc)).reshape(B, Hq, Sq, S) * scale
    if key_bias is not None:
        s = s + key_bias.to(acc)[:, None, None, :]
    if causal:
        future = torch.arange(S, device=q.device)[None, :] > q_pos[:, None]
        s = s.masked_fill(future, float("-inf"))
    lse = lse.to(acc)[..., None]
    seen = ~torch.isneginf(lse)
    p = torch.exp(s - torch.where(seen, lse, torch.zeros_like(lse)))
    return torch.where(seen, p, torch.zeros_like(p)).to(q.dtype)
