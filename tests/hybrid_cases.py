"""Shared by the hybrid tests: the R x U grid of process groups, and one hybrid call checked
against the float64 oracle (run on every rank of a world)."""

import torch
import torch.distributed as dist

from ringflash import (
    balanced_layout,
    flash_attn_func,
    local_positions,
    ring_flash_attn_func,
    ring_flash_attn_varlen_func,
    shard,
    unshard,
)

from oracle import assert_within, plain_errors, reference, rel_rms
from ring_cases import full_inputs, packed_case, padding_mask

_GRIDS = {}  # per process: (R, U) -> (ring group, head group) of this rank; new_group is collective


def grid(R, U):
    """Ring groups {u, U + u, 2U + u, ...} and head groups of consecutive ranks {rU, ..., rU + U - 1}
    (one node's GPUs under the usual placement); this rank's (group, head_group)."""
    if (R, U) not in _GRIDS:
        me = dist.get_rank()
        rings = [dist.new_group([r * U + u for r in range(R)]) for u in range(U)]
        heads = [dist.new_group([r * U + u for u in range(U)]) for r in range(R)]
        _GRIDS[R, U] = (rings[me % U], heads[me // U])
    return _GRIDS[R, U]


def hybrid_vs_oracle(
    rank, world, R, U, layout, causal, B, chunk, Hq, Hkv, mask, seed, return_lse=True, window_size=(-1, -1), Dv=None
):
    """Dv: v's head dim (default q and k's, 16)."""
    group, head_group = grid(R, U)
    S, D = 2 * R * U * chunk, 16
    q, k, v, do = full_inputs(B, S, S, Hq, Hkv, D, torch.float32, seed, Dv)
    kpm = padding_mask(mask, B, S, seed)
    ref = reference(q, k, v, do, causal=causal, window_size=window_size, key_padding_mask=kpm)
    plain = plain_errors(q, k, v, do, ref, causal=causal, window_size=window_size, key_padding_mask=kpm)
    sh = lambda t, dim=1: shard(t, group=group, head_group=head_group, layout=layout, dim=dim)
    pos = local_positions(S, group=group, head_group=head_group, layout=layout)
    assert torch.equal(sh(q), q[:, pos]) and pos.numel() == S // (R * U)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    res = ring_flash_attn_func(
        ql,
        kl,
        vl,
        causal=causal,
        window_size=window_size,
        group=group,
        head_group=head_group,
        layout=layout,
        key_padding_mask=None if kpm is None else sh(kpm),
        return_lse=return_lse,
    )
    out, lse = res if return_lse else (res, None)
    assert out.shape == (*ql.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    tag = f"R{R}xU{U} {layout} causal={causal} window_size={window_size} {Hq}/{Hkv} mask={mask}"
    assert_within(f"out {tag}", out, sh(ref[0]), plain["out"])
    if lse is not None:
        assert lse.shape == (B, Hq, S // (R * U)) and lse.dtype == torch.float32
        assert_within(f"lse {tag}", lse, sh(ref[1], dim=2), plain["lse"], sum_len=S)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert g.shape == {"dq": ql, "dk": kl, "dv": vl}[name].shape
        assert_within(f"{name} {tag}", g, sh(r), plain[name])
    # reassembled on every rank (unshard is differentiable: one loss, single-device gradients)
    assert_within(
        f"unshard(out) {tag}", unshard(out, group=group, head_group=head_group, layout=layout), ref[0], plain["out"]
    )
    assert_within(
        f"unshard(dk) {tag}", unshard(grads[1], group=group, head_group=head_group, layout=layout), ref[3], plain["dk"]
    )


def hybrid_precision(rank, world, R, U, Hq, Hkv):
    """bf16 inputs, relative RMS error against float64: the hybrid call reassembled within
    1.2x of one device's, the bound the plain ring meets at the same rank count
    (test_ring.test_precision_does_not_fall_with_ranks). With Hkv < U the replicated heads'
    dK/dV are summed from U / Hkv partial gradients in float32 and rounded once
    (hybrid._HybridAttn.backward; rounded each, dK came out at 1.4x one device's error)."""
    group, head_group = grid(R, U)
    q, k, v, do = full_inputs(1, 64 * world, 64 * world, Hq, Hkv, 32, torch.bfloat16, 11)
    ref = reference(q, k, v, do, causal=True)
    plain = plain_errors(q, k, v, do, ref, causal=True)
    ref = [ref[0], *ref[2:]]
    names = ("out", "dq", "dk", "dv")
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out1 = flash_attn_func(qs, ks, vs, causal=True)
    one = (out1, *torch.autograd.grad(out1, (qs, ks, vs), do))
    err1 = [rel_rms(x, r) for x, r in zip(one, ref)]
    sh = lambda t: shard(t, group=group, head_group=head_group)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out = ring_flash_attn_func(ql, kl, vl, causal=True, group=group, head_group=head_group)
    g = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    hybrid = [unshard(x, group=group, head_group=head_group) for x in (out, *g)]
    # both within 2x the plain bf16 computation's error, then the hybrid within 1.2x one device's
    for name, x1, xh, r in zip(names, one, hybrid, ref):
        assert_within(f"one device {name}", x1, r, plain[name])
        assert_within(f"R{R} x U{U} {name}", xh, r, plain[name])
    errw = [rel_rms(x, r) for x, r in zip(hybrid, ref)]
    for name, e1, ew in zip(names, err1, errw):
        assert ew <= 1.2 * e1, f"{name}: R{R} x U{U} error {ew:.3e} vs one device {e1:.3e}"


def hybrid_varlen_vs_oracle(rank, world, R, U, lengths, causal, window_size, Hq, Hkv, dtype, seed, named=None):
    """Packed documents with a head_group: a balanced layout over the R ring positions (or the
    named layout `named`), each position's shard cut into U pieces (unequal when it does not
    divide); out, lse, dq, dk, dv reassembled against the float64 oracle run one document at a
    time. Returns this rank's piece length and whether its head group's pieces differ in length."""
    group, head_group = grid(R, U)
    cu, cu_t, q, k, v, do, ref, plain = packed_case(lengths, causal, window_size, Hq, Hkv, dtype, seed)
    L = balanced_layout(cu, R, causal=causal, window_size=window_size) if named is None else named
    T, kw = cu[-1], dict(causal=causal, window_size=window_size)
    grid_kw = dict(group=group, head_group=head_group, layout=L)
    sh = lambda t, dim=0: shard(t, dim=dim, **grid_kw)
    pos = local_positions(T, **grid_kw)
    assert torch.equal(sh(q), q[pos])
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out, lse = ring_flash_attn_varlen_func(ql, kl, vl, cu_t, return_lse=True, **grid_kw, **kw)
    assert out.shape == ql.shape and out.dtype == dtype and lse.shape == (Hq, ql.shape[0])
    grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    tag = f"R{R}xU{U} causal={causal} window_size={window_size} {Hq}/{Hkv} {dtype}"
    for name, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
        assert_within(f"{name} {tag}", unshard(got, dim=0, **grid_kw), r, plain[name])
        assert_within(f"{name} (shard) {tag}", got, sh(r), plain[name])
    assert_within(f"lse {tag}", unshard(lse, dim=1, **grid_kw), ref[1], plain["lse"], sum_len=1)
    if named is not None:
        return ql.shape[0], False
    pieces = L.head_pieces(dist.get_rank(group) if R > 1 else 0, U)
    return ql.shape[0], len({pieces.local_len(u) for u in range(U)}) > 1
