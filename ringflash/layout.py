"""shard / unshard / local_positions for the "contiguous" and "zigzag" layouts.

contiguous: rank r holds the r-th of P equal slices. zigzag: the sequence is cut into 2P
chunks and rank r holds chunks r and 2P-1-r, so causal work is equal on every rank at every
ring step. shard(x) == x[:, local_positions(...)] in both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import check_tensor
from .comm import group_rank_world, resolve_group, validated_across_ranks
from .schedule import LAYOUTS, check_divisible, check_layout, segments


def _norm_dim(x: torch.Tensor, dim: int, api: str) -> int:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{api}: dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x, *, group=None, layout="zigzag", dim=1):
    """This rank's part of the full tensor x along `dim` (differentiable).

    x: any shape with the sequence on `dim` (default 1, as in (B, S, H, D)); its length must
    divide into world_size (contiguous) or 2 * world_size (zigzag) equal chunks.
    """
    api = "shard"
    check_tensor("x", x, api)
    check_layout(layout, api)
    dim = _norm_dim(x, dim, api)
    rank, world = group_rank_world(group)
    check_divisible(x.shape[dim], world, layout, api)
    return _shard_of(x, rank, world, layout, dim)


def _shard_of(x, rank, world, layout, dim=1):
    local_len = x.shape[dim] // world
    parts = [x.narrow(dim, s.global_start, s.length) for s in segments(layout, rank, world, local_len)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _split(x, world, layout, dim=1):
    """Every rank's shard of the full tensor x, in rank order."""
    return [_shard_of(x, r, world, layout, dim) for r in range(world)]


def _place(pieces, layout, dim=1):
    """Inverse of _split: rank-ordered shards back into sequence order."""
    world, local_len = len(pieces), pieces[0].shape[dim]
    placed = []
    for r, piece in enumerate(pieces):
        for s in segments(layout, r, world, local_len):
            placed.append((s.global_start, piece.narrow(dim, s.local_start, s.length)))
    return torch.cat([p for _, p in sorted(placed, key=lambda t: t[0])], dim)


def local_positions(seq_len, *, group=None, layout="zigzag", device=None):
    """The global token indices this rank holds, in local order: int64 tensor (seq_len / P,).
    Use it for RoPE and position embeddings of the local shard."""
    api = "local_positions"
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"{api}: seq_len must be a positive int, got {seq_len!r}")
    check_layout(layout, api)
    rank, world = group_rank_world(group)
    check_divisible(seq_len, world, layout, api)
    segs = segments(layout, rank, world, seq_len // world)
    return torch.cat([torch.arange(s.global_start, s.global_start + s.length, device=device) for s in segs])


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, group, layout, dim):
        rank, world = group_rank_world(group)
        ctx.args = (group, layout, dim)
        pieces = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(pieces, x_local.contiguous(), group=resolve_group(group))
        return _place(pieces, layout, dim)

    @staticmethod
    def backward(ctx, grad_full):
        group, layout, dim = ctx.args
        return shard(grad_full, group=group, layout=layout, dim=dim), None, None, None


def unshard(x_local, *, group=None, layout="zigzag", dim=1):
    """Gather every rank's part and restore sequence order (the inverse of shard).

    Differentiable. The gathered tensor is treated as the same value on every rank: the
    gradient reaching x_local is this rank's part of this rank's gradient (so computing one
    loss from the unsharded tensor on every rank gives single-device gradients).
    All ranks must pass equal shapes and the same layout and dim (checked: a mismatch raises
    on every rank); the local length must divide into the layout's chunks.
    """
    api = "unshard"
    rank, world = group_rank_world(group)
    device = getattr(x_local, "device", None)

    def validate_rank():
        check_tensor("x_local", x_local, api)
        check_layout(layout, api)
        d = _norm_dim(x_local, dim, api)
        if world > 1 and layout == "zigzag" and x_local.shape[d] % 2:
            raise ValueError(f"{api}: local length {x_local.shape[d]} on dim {d} must be even for layout 'zigzag'")
        return {"layout": LAYOUTS.index(layout), "dim": d, "ndim": x_local.dim()}, d

    names = ("layout", "dim", "ndim")
    dim = validated_across_ranks(
        group, api, validate_rank, names, device=device, show=lambda name, v: LAYOUTS[v] if name == "layout" else str(v)
    )
    if world == 1:
        return x_local
    # all_gather needs equal shapes: agree on every size, now that the rank count is agreed
    sizes = {f"size[{i}]": n for i, n in enumerate(x_local.shape)}
    validated_across_ranks(group, api, lambda: (sizes, None), tuple(sizes), device=device)
    return _Unshard.apply(x_local, group, layout, dim)
