"""FLOP counts of the attention operators (ringflash.ops), for torch.utils.flop_counter.FlopCounterMode.

A call counts the matrix products of the attention its mask defines, at 2 FLOPs a
multiply-add, over the (query, key) pairs the mask lets attend ("pairs"), per query head:

    forward   2 x pairs x Hq x (D + Dv)        scores, then probabilities x V
    backward  2 x pairs x Hq x (3 D + 2 Dv)    torch's count for SDPA's backward: the scores
                                               again, dP, dV, dQ and dK

so a causal call counts about half a full one, and a window or packed documents count only
what they keep. torch's own formula for scaled_dot_product_attention counts every pair
whatever is_causal says: compare the two with that in mind. Not counted: dropout, the softmax,
and a key bias or key padding mask, whose hidden keys are data (the call counts as unmasked).
On a ring every rank counts its own queries against every key of the sequence (what its steps
compute, whichever rank holds the keys); with a head group, its heads after the exchange.
Packed documents whose cu_seqlens hold no values (meta or fake tensors) count as one
sequence.

The counts are closed forms over runs of positions (balance._pairs), in Python integers; the
only values read are cu_seqlens', as the operator read them (_checks.cu_values). Meta and fake
calls read none, so the counts hold under torch's FakeTensorMode too.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from ._checks import cu_values
from .balance import _pairs
from .masks import Window, window_of_args


def _values(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[tuple, tuple] | None:
    """Packed documents' boundaries as the operator read them (_checks.cu_values: no second
    read of a GPU tensor), or None where a tensor holds no values (meta, fake)."""
    from torch._subclasses.fake_tensor import is_fake

    if any(cu.is_meta or is_fake(cu) for cu in (cu_q, cu_k)):
        return None
    return cu_values(cu_q, cu_k, "flash_attn_varlen_func")


def local_pairs(q, k, cu_q, cu_k, q_start: int, k_start: int, window: Window) -> int:
    """Pairs of a one-device call (flash_fwd's arguments): B x the window's pairs of query
    positions q_start.. against key positions k_start.., or, packed, each document's query rows
    against its keys, aligned bottom-right (ringflash.masks.document_bounds)."""
    values = None if cu_q is None else _values(cu_q, cu_k)
    if values is None:
        n_q, n_k = q.shape[1], k.shape[1]
        return q.shape[0] * _pairs(q_start, n_q, k_start, n_k, window)
    values_q, values_k = values
    total = 0
    for d in range(len(values_q) - 1):
        shift = values_k[d + 1] - values_q[d + 1]  # query row i sits at key position i + shift
        total += _pairs(values_q[d] + shift, values_q[d + 1] - values_q[d], values_k[d], values_k[d + 1] - values_k[d],
                        window)  # fmt: skip
    return total


def ring_pairs(layout, rank: int, world: int, q_rows: int, k_total: int, window: Window) -> int:
    """Pairs of ring position `rank`'s queries (`q_rows` rows in `layout`) against every key of
    the sequence (k_total positions from 0); with a balanced layout of packed documents, each
    run of queries against its own document's keys."""
    from .schedule import is_balanced, segments

    count = 0
    for seg in segments(layout, rank, world, q_rows):
        lo, hi = (layout.cu_seqlens[seg.doc], layout.cu_seqlens[seg.doc + 1]) if is_balanced(layout) else (0, k_total)
        count += _pairs(seg.global_start, seg.length, lo, hi - lo, window)
    return count


def _ring_pairs(group_name: str, layout_text: str, q_rows: int, k_rows: int, left: int, right: int) -> int:
    """ring_pairs of a ring operator's call: this rank of the group named `group_name` ("": one
    rank), q_rows and k_rows its ring position's query and key rows."""
    from .comm import group_rank_world
    from .ops import _layout
    from .schedule import is_balanced

    layout = _layout(layout_text)
    if group_name:
        from torch.distributed.distributed_c10d import _resolve_process_group

        rank, world = group_rank_world(_resolve_process_group(group_name))
    else:
        rank, world = 0, 1
    k_total = layout.total if is_balanced(layout) else world * k_rows
    return ring_pairs(layout, rank, world, q_rows, k_total, window_of_args(left, right))


def _forward(pairs: int, heads: int, d: int, dv: int) -> int:
    return 2 * pairs * heads * (d + dv)


def _backward(pairs: int, heads: int, d: int, dv: int) -> int:
    return 2 * pairs * heads * (3 * d + 2 * dv)


def _flash(q, k, v, cu_q, cu_k, q_start, k_start, left, right) -> tuple[int, int, int, int]:
    pairs = local_pairs(q, k, cu_q, cu_k, q_start, k_start, window_of_args(left, right))
    return pairs, q.shape[2], q.shape[3], v.shape[3]


def _ring(q, k, v, group_name, layout, left, right) -> tuple[int, int, int, int]:
    pairs = q.shape[0] * _ring_pairs(group_name, layout, q.shape[1], k.shape[1], left, right)
    return pairs, q.shape[2], q.shape[3], v.shape[3]


def _hybrid(q_r, v, group_name, layout, left, right, lens_q, lens_k) -> tuple[int, int, int, int]:
    """This rank's count after the head exchange: its heads of q_r (B, rows, heads, D), the
    ring's queries, over the ring position's sum(lens_q) query and sum(lens_k) key rows."""
    pairs = q_r.shape[0] * _ring_pairs(group_name, layout, sum(lens_q), sum(lens_k), left, right)
    return pairs, q_r.shape[2], q_r.shape[3], v.shape[3]


def register(namespace: str) -> None:
    """Registers the formulas for the operators of `namespace` (ringflash.ops.NAMESPACE)."""
    ops = getattr(torch.ops, namespace)

    @register_flop_formula(ops.flash_fwd, get_raw=True)
    def _(q, k, v, key_bias, cu_q, cu_k, q_start, k_start, left, right, *rest, out_val=None):
        return _forward(*_flash(q, k, v, cu_q, cu_k, q_start, k_start, left, right))

    @register_flop_formula(ops.flash_bwd, get_raw=True)
    def _(q, k, v, out, m, l, do, dlse, key_bias, cu_q, cu_k, q_start, k_start, left, right, *rest, out_val=None):
        return _backward(*_flash(q, k, v, cu_q, cu_k, q_start, k_start, left, right))

    @register_flop_formula(ops.ring_fwd, get_raw=True)
    def _(q, k, v, key_bias, cu_seqlens, group_name, left, right, scale, p, seed, layout, *rest, out_val=None):
        return _forward(*_ring(q, k, v, group_name, layout, left, right))

    @register_flop_formula(ops.ring_bwd, get_raw=True)
    def _(q, k, v, out, m, l, do, dlse, key_bias, group_name, left, right, scale, p, seed, layout, *rest, out_val=None):
        return _backward(*_ring(q, k, v, group_name, layout, left, right))

    @register_flop_formula(ops.hybrid_fwd, get_raw=True)
    def _(q, k, v, mask, cu, group_name, head_group_name, left, right, scale, p, seed, layout, *rest, out_val=None):
        lens_q, lens_k = rest[4:6]  # after grad_chunks, grad_accum, backend, deterministic
        return _forward(*_hybrid(out_val[2], v, group_name, layout, left, right, lens_q, lens_k))

    @register_flop_formula(ops.hybrid_bwd, get_raw=True)
    def _(q_r, k_r, v_r, out_r, m, l, key_bias, dout, dlse, group_name, head_group_name, left, right, scale, p, seed,
          layout, *rest, out_val=None):  # fmt: skip
        lens_q, lens_k = rest[4:6]
        return _backward(*_hybrid(q_r, v_r, group_name, layout, left, right, lens_q, lens_k))
