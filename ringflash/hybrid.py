"""Hybrid sequence parallelism: heads by all-to-all inside a head group, the ring across rings.

The ranks form an R x U grid: `group` is this rank's ring (R ranks), `head_group` the U ranks
that share its ring position (typically one node's GPUs). The sequence is laid out over the R
ring positions by the layout, and each ring position's shard is cut contiguously into U equal
pieces held by the head group's ranks in their group-rank order (ringflash.layout).

A call: one all-to-all over head_group turns each rank's (S/(RU) tokens, all heads) into
(S/R tokens = its ring position's whole shard, Hq/U query heads and the K/V heads those
need); the one ring engine (ring._RingAttn) runs over `group` on those heads, its float32
state across hops as always; one all-to-all brings out (and lse) back to (S/(RU) tokens, all
heads). The all-to-all is its own adjoint, so the backward runs the same exchanges in reverse.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._checks import AttnDims, check_bool, key_bias_from_mask
from .comm import (
    LocalComm,
    RingComm,
    check_backend_device,
    group_rank_world,
    resolve_group,
    resolve_groups,
    validated_across_grid,
)
from .dropout import Dropout, agreed_seed, all_dropped, check_dropout
from .merge import state_dtype
from .ops import _Saved
from .schedule import chunks_per_rank, is_balanced


class HeadPlan(NamedTuple):
    """Which heads each head-group rank computes: q heads [u * q_per, (u + 1) * q_per) and the
    kv heads kv_of(u); kv_per kv heads per rank (Hkv / U, or 1 replicated when Hkv < U)."""

    q_per: int
    kv_per: int
    kv_ranks_per_head: int  # how many ranks share (replicate) one kv head: 1 when Hkv >= U

    def q_of(self, u: int) -> slice:
        return slice(u * self.q_per, (u + 1) * self.q_per)

    def kv_of(self, u: int) -> slice:
        h = u // self.kv_ranks_per_head * self.kv_per
        return slice(h, h + self.kv_per)


def _working_sizes(Hq: int, Hkv: int) -> list[int]:
    return [n for n in range(1, Hq + 1) if Hq % n == 0 and (Hkv % n == 0 or n % Hkv == 0)]


def head_plan(Hq: int, Hkv: int, U: int, api: str) -> HeadPlan:
    """The heads split over a head group of U ranks (Hq % Hkv == 0 already checked).

    Hkv >= U needs Hkv % U == 0: Hkv / U kv heads per rank. Hkv < U needs U % Hkv == 0: each
    rank's Hq / U query heads fall in one kv group, whose kv head it receives (U / Hkv ranks
    hold a copy; their gradients are summed back to the owner). Hq % U == 0 always."""
    fits_kv = (Hkv >= U and Hkv % U == 0) or (Hkv < U and U % Hkv == 0)
    if Hq % U or not fits_kv:
        why = f"{Hq} q heads are not divisible by {U}" if Hq % U else f"{Hkv} k/v heads and {U} divide neither way"
        raise ValueError(
            f"{api}: a head_group of {U} ranks cannot split q heads {Hq} / k/v heads {Hkv} ({why}); "
            f"head_group sizes that work: {_working_sizes(Hq, Hkv)}"
        )
    if Hkv >= U:
        return HeadPlan(Hq // U, Hkv // U, 1)
    return HeadPlan(Hq // U, 1, U // Hkv)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x (U, ...) contiguous: row j goes to rank j of `group`; returns (U, ...) whose row j came
    from rank j (no autograd)."""
    out = torch.empty_like(x)
    try:
        dist.all_to_all_single(out, x, group=resolve_group(group))
    except RuntimeError as e:
        raise RuntimeError(
            f"ringflash: the head all-to-all of rank {dist.get_rank()} failed; a rank may have died or "
            f"stopped calling, or the process group timed out: {e}"
        ) from e
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all on several tensors at once; the exchange is its own adjoint (row j of rank
    i's output is row i of rank j's input), so the backward is the same exchange of the
    gradients. One node for all of them: a rank whose loss uses only some outputs still takes
    part in every exchange (missing gradients are zeros)."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(all_to_all(x.contiguous(), group) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(all_to_all(g.contiguous(), ctx.group) for g in grads))


class _KVToRing(torch.autograd.Function):
    """The K/V all-to-all and the ring as one node, for kv heads replicated over several ranks
    in a 16-bit dtype: k_rows / v_rows (U, B, Lmax, h, D) arrive in float32, travel in `dtype`,
    and the gradients come back unrounded (the ring's float32 accumulators, exchanged in
    float32), so that the copies' gradients are summed before the one rounding to `dtype`
    (autograd between the ring and the exchange would round each copy's first). lens: the head
    group's piece lengths; ring_len: the length K/V travel the ring at (packed documents: the
    longest ring shard)."""

    @staticmethod
    def forward(ctx, head_group, dtype, lens, ring_len, q_r, k_rows, v_rows, key_bias, spec, comm):
        from .ring import _RingAttn

        k_r, v_r = (
            _pad_rows(_ring_shard(all_to_all(t.to(dtype).contiguous(), head_group), lens), ring_len)
            for t in (k_rows, v_rows)
        )
        ring_ctx = _Saved()  # _RingAttn's forward and backward run as plain functions, as in ops
        out, lse = _RingAttn.forward(ring_ctx, q_r, k_r, v_r, key_bias, spec, comm)
        ring_ctx.kv_grad_dtype = torch.float32
        ctx.ring_ctx, ctx.head_group, ctx.lens = ring_ctx, head_group, lens
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .ring import _RingAttn

        dq, dk_r, dv_r = _RingAttn.backward(ctx.ring_ctx, dout, dlse)[:3]
        ctx.ring_ctx = None
        n = sum(ctx.lens)
        dk, dv = (all_to_all(_from_ring_shard(g[:, :n], ctx.lens), ctx.head_group) for g in (dk_r, dv_r))
        return None, None, None, None, dq, dk, dv, None, None, None


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, L, ...) with zero rows appended on dim 1 up to n (x itself when L = n)."""
    extra = n - x.shape[1]
    return x if extra == 0 else torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], 1)


def _from_ring_shard(x: torch.Tensor, lens) -> torch.Tensor:
    """The inverse of _ring_shard: (B, sum(lens), ...) -> (U, B, max(lens), ...) contiguous, row
    j the j-th piece (lens[j] rows) padded with zeros."""
    B, n, U = x.shape[0], x.shape[1], len(lens)
    if len(set(lens)) == 1:  # equal pieces: one reshape
        return x.reshape(B, U, n // U, *x.shape[2:]).transpose(0, 1).contiguous()
    return torch.stack([_pad_rows(p, max(lens)) for p in x.split(list(lens), 1)])


def _to_heads(x: torch.Tensor, of, U: int, rows: int) -> torch.Tensor:
    """(U, B, rows, h, D) rows for rank u': this rank's tokens (padded to `rows`) at heads
    of(u') (stacked: a head sent to several ranks is copied, and autograd sums its gradients
    back)."""
    x = _pad_rows(x, rows)
    return torch.stack([x[:, :, of(j)] for j in range(U)])


def _ring_shard(x: torch.Tensor, lens) -> torch.Tensor:
    """(U, B, max(lens), ...) received rows, one per head-group rank in order, lens[j] of them
    real -> (B, sum(lens), ...): the ring position's shard."""
    U, B, L = x.shape[:3]
    if all(n == L for n in lens):
        return x.transpose(0, 1).reshape(B, U * L, *x.shape[3:])
    return torch.cat([x[j, :, :n] for j, n in enumerate(lens)], 1)


def _exchange_and_ring(q, k, v, key_bias, spec, comm, plan, head_group, lens_q, lens_k, ring_len, return_lse):
    """The hybrid call once validated: q (B, lens_q[u], Hq, D), k, v (B, lens_k[u], Hkv, D / Dv) this
    rank's tokens; the head all-to-all, the ring over the ring position's shard at this rank's
    heads (K/V padded to ring_len rows), the all-to-all back. Returns out (B, lens_q[u], Hq, Dv)
    and lse (B, Hq, lens_q[u]) or None."""
    from .ring import _RingAttn

    U, Lq, Lk = len(lens_q), max(lens_q), max(lens_k)
    B, L = q.shape[:2]
    if plan.kv_ranks_per_head > 1 and k.dtype in (torch.float16, torch.bfloat16):
        # replicated kv heads: their copies' gradients are summed in float32, rounded once
        (qs,) = _AllToAll.apply(head_group, _to_heads(q, plan.q_of, U, Lq))
        k_rows, v_rows = (_to_heads(t.float(), plan.kv_of, U, Lk) for t in (k, v))
        q_r = _ring_shard(qs, lens_q)
        out_r, lse_r = _KVToRing.apply(head_group, k.dtype, lens_k, ring_len, q_r, k_rows, v_rows, key_bias, spec, comm)
    else:
        qs, ks, vs = _AllToAll.apply(
            head_group, _to_heads(q, plan.q_of, U, Lq), _to_heads(k, plan.kv_of, U, Lk), _to_heads(v, plan.kv_of, U, Lk)
        )
        k_r, v_r = (_pad_rows(_ring_shard(t, lens_k), ring_len) for t in (ks, vs))
        out_r, lse_r = _RingAttn.apply(_ring_shard(qs, lens_q), k_r, v_r, key_bias, spec, comm)

    # back: (B, sum(lens_q), h, D) -> rows per head-group rank (its tokens) -> (B, L, Hq, D)
    h = plan.q_per
    if return_lse:
        rows = (_from_ring_shard(out_r, lens_q), _from_ring_shard(lse_r.transpose(1, 2), lens_q))
        out_got, lse_got = _AllToAll.apply(head_group, *rows)
        lse = lse_got[:, :, :L].permute(1, 0, 3, 2).reshape(B, U * h, L)
    else:
        (out_got,) = _AllToAll.apply(head_group, _from_ring_shard(out_r, lens_q))
        lse = None
    return out_got[:, :, :L].permute(1, 2, 0, 3, 4).reshape(B, L, U * h, -1), lse


def hybrid_attn(
    q,
    k,
    v,
    *,
    causal,
    softmax_scale,
    window_size=(-1, -1),
    group,
    head_group,
    layout,
    key_padding_mask,
    return_lse,
    grad_accum_dtype,
    grad_chunks,
    dropout_p=0.0,
    generator=None,
):
    """ring_flash_attn_func with a head_group (see its docstring and README: Hybrid). Dropout:
    the keep mask of the global query heads (this rank's start at u * Hq / U), one seed for the
    whole grid (its first rank's)."""
    from .ring import _FIELD_NAMES, _show_field, _signature, ring_call_spec

    api = "ring_flash_attn_func"
    group, head_group = resolve_groups(group, head_group, api)
    _, R = group_rank_world(group)
    _, U = group_rank_world(head_group)
    device = getattr(q, "device", None)

    def validate():
        check_bool("return_lse", return_lse, api)
        p = check_dropout(dropout_p, generator, api)
        if is_balanced(layout):
            raise ValueError(f"{api}: a balanced layout (packed documents) goes with ring_flash_attn_varlen_func")
        dims, spec, _ = ring_call_spec(
            q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, api, window_size
        )
        plan = head_plan(dims.heads_q, dims.heads_kv, U, api)
        for g, n in ((group, R), (head_group, U)):
            if n > 1:
                check_backend_device(g, q.device, api)
        if R > 1:
            parts = chunks_per_rank(layout)
            for name, n in (("q", dims.seqlen_q), ("k/v", dims.seqlen_k)):
                if n * U % parts:
                    raise ValueError(
                        f"{api}: {name} local length {n} x head_group size {U} must be a multiple of {parts} "
                        f"for layout {layout!r}"
                    )
        if grad_chunks is not None and grad_chunks > plan.kv_per:
            raise ValueError(
                f"{api}: grad_chunks {grad_chunks} exceeds the {plan.kv_per} k/v head(s) each rank holds "
                f"with a head_group of {U}"
            )
        fields = _signature(q, k, v, spec, key_padding_mask is not None, p)
        return fields, (spec, plan, p)

    spec, plan, p = validated_across_grid(
        group, head_group, api, validate, _FIELD_NAMES, device=device, show=_show_field
    )
    if R == 1:  # one ring position: every layout is the identity
        spec = dataclasses.replace(spec, layout="contiguous")
    if 0.0 < p < 1.0:  # the grid's first rank's seed: over the ring, then over the head group
        seed = agreed_seed(device, group, head_group, generator=generator)
        u, _ = group_rank_world(head_group)
        spec = dataclasses.replace(spec, dropout=Dropout(seed, p, h0=u * plan.q_per))

    # the key padding mask of the ring position's whole shard (no gradient)
    mask_r = None
    if key_padding_mask is not None:
        m = key_padding_mask.to(torch.uint8) if key_padding_mask.dtype == torch.bool else key_padding_mask
        got = all_to_all(m.unsqueeze(0).expand(U, *m.shape).contiguous(), head_group)
        mask_r = got.transpose(0, 1).reshape(m.shape[0], U * m.shape[1])
        mask_r = mask_r.bool() if key_padding_mask.dtype == torch.bool else mask_r

    B, L, Lk = q.shape[0], q.shape[1], k.shape[1]
    comm = RingComm(group) if R > 1 else LocalComm()
    dims = AttnDims(B, U * L, U * Lk, plan.q_per, plan.kv_per, q.shape[-1], v.shape[-1])
    key_bias = key_bias_from_mask(mask_r, dims, q.device, api, state_dtype(q.dtype))
    out, lse = _exchange_and_ring(
        q, k, v, key_bias, spec, comm, plan, head_group, (L,) * U, (Lk,) * U, U * Lk, return_lse
    )
    out = all_dropped(out, p)
    return (out, lse) if return_lse else out


def hybrid_varlen_attn(
    q, k, v, cu_seqlens, *, layout, causal, softmax_scale, window_size, group, head_group, return_lse,
    grad_accum_dtype, grad_chunks, dropout_p, generator,
):  # fmt: skip
    """ring_flash_attn_varlen_func with a head_group: q (n, Hq, D), k, v (n, Hkv, D) this rank's
    piece of its ring position's shard of a balanced layout over the R ring positions
    (shard(..., layout=layout, head_group=head_group, dim=0)); the ring runs the packed
    documents over the ring positions' whole shards at Hq / U heads."""
    from .ring import _FIELD_NAMES, _show_field, _signature, check_packed_call

    api = "ring_flash_attn_varlen_func"
    group, head_group = resolve_groups(group, head_group, api)
    r, R = group_rank_world(group)
    u, U = group_rank_world(head_group)
    device = getattr(q, "device", None)

    def validate():
        p, spec = check_packed_call(
            q, k, v, cu_seqlens, layout, causal, softmax_scale, window_size, return_lse, grad_accum_dtype,
            grad_chunks, dropout_p, generator, api, R, r, head_pieces=(u, U),
        )  # fmt: skip
        plan = head_plan(q.shape[1], k.shape[1], U, api)
        for g, n in ((group, R), (head_group, U)):
            if n > 1:
                check_backend_device(g, q.device, api)
        if grad_chunks is not None and grad_chunks > plan.kv_per:
            raise ValueError(
                f"{api}: grad_chunks {grad_chunks} exceeds the {plan.kv_per} k/v head(s) each rank holds "
                f"with a head_group of {U}"
            )
        shapes = (
            q.new_empty(1, layout.max_local_len, *q.shape[1:]),
            k.new_empty(1, layout.max_local_len, *k.shape[1:]),
            v.new_empty(1, layout.max_local_len, *v.shape[1:]),
        )
        return _signature(*shapes, spec, False, p), (spec, plan, p)

    spec, plan, p = validated_across_grid(
        group, head_group, api, validate, _FIELD_NAMES, device=device, show=_show_field
    )
    if 0.0 < p < 1.0:
        seed = agreed_seed(device, group, head_group, generator=generator)
        spec = dataclasses.replace(spec, dropout=Dropout(seed, p, h0=u * plan.q_per))
    lens = tuple(piece.local_len(j) for piece in (layout.head_pieces(r, U),) for j in range(U))
    comm = RingComm(group) if R > 1 else LocalComm()
    out, lse = _exchange_and_ring(
        q[None], k[None], v[None], None, spec, comm, plan, head_group, lens, lens, layout.max_local_len, return_lse
    )
    out = all_dropped(out, p)
    return (out[0], lse[0]) if return_lse else out[0]
