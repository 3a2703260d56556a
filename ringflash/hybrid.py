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

A call runs as the autograd Function _HybridAttn below when eager (ops.hybrid: without the
operators' dispatch), and as the operators ops.hybrid_fwd / ops.hybrid_bwd under torch.compile,
which run the same Function's forward and backward as plain functions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._checks import AttnDims, check_bool, key_bias_from_mask
from .balance import pad_rows
from .comm import (
    check_backend_device,
    group_rank_world,
    resolve_group,
    resolve_groups,
    validated_across_grid,
    warn_placement,
)
from .dropout import all_dropped, check_dropout, operator_dropout
from .local import first_order_only, packed_outputs, without_autocast
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


def _from_ring_shard(x: torch.Tensor, lens) -> torch.Tensor:
    """The inverse of _ring_shard: (B, sum(lens), ...) -> (U, B, max(lens), ...) contiguous, row
    j the j-th piece (lens[j] rows) padded with zeros."""
    B, n, U = x.shape[0], x.shape[1], len(lens)
    if len(set(lens)) == 1:  # equal pieces: one reshape
        return x.reshape(B, U, n // U, *x.shape[2:]).transpose(0, 1).contiguous()
    return torch.stack([pad_rows(p, max(lens)) for p in x.split(list(lens), 1)])


def _to_heads(x: torch.Tensor, of, U: int, rows: int) -> torch.Tensor:
    """(U, B, rows, h, D) rows for rank u': this rank's tokens (padded to `rows`) at heads
    of(u') (stacked: a head sent to several ranks is copied; _kv_from_heads sums its gradients
    back)."""
    x = pad_rows(x, rows)
    return torch.stack([x[:, :, of(j)] for j in range(U)])


def _ring_shard(x: torch.Tensor, lens) -> torch.Tensor:
    """(U, B, max(lens), ...) received rows, one per head-group rank in order, lens[j] of them
    real -> (B, sum(lens), ...): the ring position's shard."""
    U, B, L = x.shape[:3]
    if all(n == L for n in lens):
        return x.transpose(0, 1).reshape(B, U * L, *x.shape[3:])
    return torch.cat([x[j, :, :n] for j, n in enumerate(lens)], 1)


def _from_heads(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of _to_heads where the heads of(u') are disjoint and in order: rows
    (U, B, >= n, h, ...), row j this rank's tokens at rank j's heads -> (B, n, U h, ...)."""
    return rows[:, :, :n].movedim(0, 2).flatten(2, 3).contiguous()


def _kv_from_heads(rows: torch.Tensor, n: int, plan: HeadPlan, dtype) -> torch.Tensor:
    """The adjoint of _to_heads for the kv heads: rows (U, B, >= n, kv_per, D) of gradients,
    row j for the heads kv_of(j) -> (B, n, Hkv, D) in `dtype`, the copies of a replicated head
    summed in the rows' dtype first (float32 for 16-bit heads: one rounding)."""
    c = plan.kv_ranks_per_head
    if c > 1:  # ranks j c .. j c + c - 1 hold copies of kv head j
        rows = rows[:, :, :n].unflatten(0, (-1, c)).sum(1)
    return _from_heads(rows, n).to(dtype)


def _ring_key_bias(mask: torch.Tensor, head_group, U: int, dtype) -> torch.Tensor:
    """This rank's key padding mask (B, Lk) -> the key bias (B, U Lk) of its ring position's
    whole shard, in `dtype` (one all-to-all: each rank sends every rank its piece)."""
    m = mask.to(torch.uint8) if mask.dtype == torch.bool else mask
    got = all_to_all(m.unsqueeze(0).expand(U, *m.shape).contiguous(), head_group)
    mask_r = got.transpose(0, 1).reshape(m.shape[0], U * m.shape[1])
    mask_r = mask_r.bool() if mask.dtype == torch.bool else mask_r
    B, n = mask_r.shape
    return key_bias_from_mask(mask_r, AttnDims(B, n, n, 1, 1, 1, 1), mask.device, "ring_flash_attn_func", dtype)


class _HybridAttn(torch.autograd.Function):
    """A call with a head group once validated and agreed: the head all-to-all, the ring over the
    ring position's shard at this rank's heads, the all-to-all back; its backward runs the same
    exchanges in reverse. Eager calls apply it (ops.hybrid); the operators ops.hybrid_fwd /
    hybrid_bwd run its forward and backward as plain functions, an ops._Saved in place of ctx, so
    that both run this one body."""

    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, key_padding_mask, spec, comm, plan, head_group, lens_q, lens_k, ring_len, return_lse):
        """q (B, lens_q[u], Hq, D), k, v (B, lens_k[u], Hkv, D / Dv) this rank's tokens,
        key_padding_mask (B, lens_k[u]) or None; K/V travel the ring padded to ring_len rows.
        Returns out (B, lens_q[u], Hq, Dv) and lse (B, Hq, lens_q[u]) float32, or None without
        return_lse; saves the ring's tensors (q_r, k_r, v_r, out_r, m, l, key bias or None)."""
        from .ring import _RingAttn

        U, Lq, Lk = len(lens_q), max(lens_q), max(lens_k)
        L = q.shape[1]
        key_bias = None
        if key_padding_mask is not None:
            key_bias = _ring_key_bias(key_padding_mask, head_group, U, state_dtype(q.dtype))
        q_r = _ring_shard(all_to_all(_to_heads(q, plan.q_of, U, Lq), head_group), lens_q)
        k_r, v_r = (
            pad_rows(_ring_shard(all_to_all(_to_heads(t, plan.kv_of, U, Lk), head_group), lens_k), ring_len)
            for t in (k, v)
        )
        ring_ctx = _Saved()
        out_r, lse_r = _RingAttn.forward(ring_ctx, q_r, k_r, v_r, key_bias, spec, comm)
        # back: (B, sum(lens_q), h, D) -> rows per head-group rank (its tokens) -> (B, L, Hq, D)
        out = _from_heads(all_to_all(_from_ring_shard(out_r, lens_q), head_group), L)
        lse = None
        if return_lse:
            lse = _from_heads(all_to_all(_from_ring_shard(lse_r.transpose(1, 2), lens_q), head_group), L)
            lse = lse.transpose(1, 2).contiguous()
        ctx.spec, ctx.comm, ctx.plan, ctx.head_group = spec, comm, plan, head_group
        ctx.lens_q, ctx.lens_k, ctx.return_lse, ctx.q_len, ctx.kv_len = lens_q, lens_k, return_lse, L, k.shape[1]
        ctx.backend = ring_ctx.backend  # the forward's, for the backward: the same arithmetic in both
        ctx.set_materialize_grads(False)  # a missing gradient becomes zeros only where an exchange needs it
        ctx.save_for_backward(*ring_ctx.saved_tensors)
        return out, lse

    @staticmethod
    @first_order_only
    @without_autocast
    def backward(ctx, dout, dlse):
        """dq, dk, dv (this rank's tokens, as the forward's q, k, v) given the gradients of out
        and lse (None: zeros). An all-to-all is its own adjoint: row j of rank i's output is row
        i of rank j's input. Every rank takes part in every exchange, whatever gradients it
        has. Replicated 16-bit kv heads: the ring's dK/dV come back unrounded (float32, and
        travel so) and their copies are summed before the one rounding to the inputs' dtype."""
        from .ring import _RingAttn

        saved = ctx.saved_tensors
        q_r, k_r, v_r, out_r = saved[:4]
        plan, head_group, lens_q, lens_k = ctx.plan, ctx.head_group, ctx.lens_q, ctx.lens_k
        U, Lq = len(lens_q), max(lens_q)
        B, L = q_r.shape[0], ctx.q_len
        if dout is None:
            dout = out_r.new_zeros(B, L, U * out_r.shape[2], out_r.shape[3])
        do_r = _ring_shard(all_to_all(_to_heads(dout, plan.q_of, U, Lq), head_group), lens_q)
        dlse_r = None
        if ctx.return_lse:
            if dlse is None:
                dlse = q_r.new_zeros(B, U * q_r.shape[2], L, dtype=saved[4].dtype)
            dlse_r = _ring_shard(all_to_all(_to_heads(dlse.transpose(1, 2), plan.q_of, U, Lq), head_group), lens_q)
            dlse_r = dlse_r.transpose(1, 2)
        ring_ctx = _Saved(saved_tensors=saved, spec=ctx.spec, comm=ctx.comm, backend=ctx.backend)
        if plan.kv_ranks_per_head > 1 and k_r.dtype in (torch.float16, torch.bfloat16):
            ring_ctx.kv_grad_dtype = torch.float32
        dq_r, dk_r, dv_r = _RingAttn.backward(ring_ctx, do_r, dlse_r)[:3]
        dq = _from_heads(all_to_all(_from_ring_shard(dq_r, lens_q), head_group), L)
        n = sum(lens_k)
        dk, dv = (
            _kv_from_heads(all_to_all(_from_ring_shard(g[:, :n], lens_k), head_group), ctx.kv_len, plan, k_r.dtype)
            for g in (dk_r, dv_r)
        )
        return (dq, dk, dv) + (None,) * 9


def _validated(group, head_group, api: str, validate, device, caller_fields=()):
    """(validate()'s result, the operator's agree list). caller_fields: the names validate()
    returns after the call's own (ring._agreed_names). Eager: agreed over the grid now
    (comm.validated_across_grid), agree empty. Traced by torch.compile: this rank's checks run
    now and the grid agreement inside the operator when it runs (dynamo cannot trace a
    collective whose result decides), agree this rank's signature."""
    from .ring import _agreed_names, _show_field

    if torch.compiler.is_compiling():
        fields, result = validate()
        return result, list(fields.values())
    names = _agreed_names(caller_fields)
    result = validated_across_grid(group, head_group, api, validate, names, device=device, show=_show_field)
    warn_placement(group, head_group)
    return result, []


def _call(
    q, k, v, key_padding_mask, cu_seqlens, group, head_group, spec, p, generator, lens_q, lens_k, ring_len, return_lse,
    agree,
):  # fmt: skip
    """The validated call (ops.hybrid: the operator under torch.compile, _HybridAttn eager):
    q (B, lens_q[u], Hq, D), k, v (B, lens_k[u], Hkv, D); returns out and lse (or None)."""
    from . import ops
    from .local import backend_name

    layout = spec.layout if isinstance(spec.layout, str) else spec.layout.code
    out, lse = ops.hybrid(
        q, k, v, key_padding_mask, cu_seqlens, resolve_group(group).group_name, resolve_group(head_group).group_name,
        *ops.window_args(spec.window), spec.scale, *operator_dropout(p, generator), layout,
        -1 if spec.grad_chunks is None else spec.grad_chunks, spec.grad_accum,
        "" if torch.compiler.is_compiling() else backend_name(q.device), spec.deterministic, list(lens_q),
        list(lens_k), ring_len, return_lse, agree,
    )  # fmt: skip
    return all_dropped(out, p), lse


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
    deterministic=False,
    caller_fields=None,
):
    """ring_flash_attn_func with a head_group (see its docstring and README: Hybrid). Dropout:
    the keep mask of the global query heads (this rank's start at u * Hq / U), one seed for the
    whole grid (its first rank's). caller_fields: as ring._ring_flash_attn's, agreed with the
    call's own fields (the same row as a call without a head group sends)."""
    from .ring import _signature, ring_call_spec

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
            q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, api, window_size,
            deterministic,
        )  # fmt: skip
        _check_grid(group, head_group, R, U, dims.heads_q, dims.heads_kv, grad_chunks, q.device, api)
        if R > 1:
            parts = chunks_per_rank(layout)
            for name, n in (("q", dims.seqlen_q), ("k/v", dims.seqlen_k)):
                if n * U % parts:
                    raise ValueError(
                        f"{api}: {name} local length {n} x head_group size {U} must be a multiple of {parts} "
                        f"for layout {layout!r}"
                    )
        fields = _signature(q, k, v, spec, key_padding_mask is not None, p)
        return {**fields, **(caller_fields or {})}, (spec, p)

    (spec, p), agree = _validated(group, head_group, api, validate, device, tuple(caller_fields or ()))
    if R == 1:  # one ring position: every layout is the identity
        spec = dataclasses.replace(spec, layout="contiguous")
    L, Lk = q.shape[1], k.shape[1]
    out, lse = _call(
        q, k, v, key_padding_mask, None, group, head_group, spec, p, generator, (L,) * U, (Lk,) * U, U * Lk,
        return_lse, agree,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _check_grid(group, head_group, R, U, heads_q, heads_kv, grad_chunks, device, api) -> None:
    """What a call with a head group checks of the grid on this rank: the heads split over U
    (head_plan), each group's backend carrying `device`, grad_chunks within the kv heads a
    rank holds."""
    plan = head_plan(heads_q, heads_kv, U, api)
    for g, n in ((group, R), (head_group, U)):
        if n > 1:
            check_backend_device(g, device, api)
    if grad_chunks is not None and grad_chunks > plan.kv_per:
        raise ValueError(
            f"{api}: grad_chunks {grad_chunks} exceeds the {plan.kv_per} k/v head(s) each rank holds "
            f"with a head_group of {U}"
        )


def hybrid_varlen_attn(
    q, k, v, cu_seqlens, *, layout, causal, softmax_scale, window_size, group, head_group, return_lse,
    grad_accum_dtype, grad_chunks, dropout_p, generator, deterministic=False,
):  # fmt: skip
    """ring_flash_attn_varlen_func with a head_group: q (n, Hq, D), k, v (n, Hkv, D) this rank's
    piece of its ring position's shard of a balanced layout over the R ring positions
    (shard(..., layout=layout, head_group=head_group, dim=0)); the ring runs the packed
    documents over the ring positions' whole shards at Hq / U heads."""
    from .ring import _signature, check_packed_call

    api = "ring_flash_attn_varlen_func"
    group, head_group = resolve_groups(group, head_group, api)
    r, R = group_rank_world(group)
    u, U = group_rank_world(head_group)
    device = getattr(q, "device", None)

    def validate():
        p, spec = check_packed_call(
            q, k, v, cu_seqlens, layout, causal, softmax_scale, window_size, return_lse, grad_accum_dtype,
            grad_chunks, dropout_p, generator, api, R, r, head_pieces=(u, U), deterministic=deterministic,
        )  # fmt: skip
        _check_grid(group, head_group, R, U, q.shape[1], k.shape[1], grad_chunks, q.device, api)
        shapes = (
            q.new_empty(1, layout.max_local_len, *q.shape[1:]),
            k.new_empty(1, layout.max_local_len, *k.shape[1:]),
            v.new_empty(1, layout.max_local_len, *v.shape[1:]),
        )
        return _signature(*shapes, spec, False, p, grads=(q, k, v)), (spec, p)

    (spec, p), agree = _validated(group, head_group, api, validate, device)
    # under torch.compile a cu_seqlens tensor's values are checked inside the operator
    cu_check = cu_seqlens if torch.compiler.is_compiling() and isinstance(cu_seqlens, torch.Tensor) else None
    lens = layout.head_piece_lens(r, U)
    # the ring position's K/V rows padded as the plain varlen ring pads them
    out, lse = _call(
        q[None], k[None], v[None], None, cu_check, group, head_group, spec, p, generator, lens, lens,
        layout.block_len(r, spec.window), return_lse, agree,
    )  # fmt: skip
    return packed_outputs(out, lse, return_lse)
