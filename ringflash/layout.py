"""shard / unshard / local_positions for the "contiguous" and "zigzag" layouts.

contiguous: rank r holds the r-th of P equal slices. zigzag: the sequence is cut into 2P
chunks and rank r holds chunks r and 2P-1-r, so causal work is equal on every rank at every
ring step. shard(x) == x[:, local_positions(...)] in both. A balance.BalancedLayout
(ringflash.balanced_layout, packed documents) is accepted wherever a layout name is: it says
itself which positions each rank holds (shard sizes may then differ between ranks), and shard
and local_positions need no communication with it.


With a head_group of U ranks (ringflash.hybrid), the layout places the sequence over the R
ranks of `group` (the ring positions) as above, then each ring position's shard is cut
contiguously into U equal pieces, held by the head group's ranks in their group-rank order
(with a balanced layout, whose shards need not divide by U: U contiguous pieces whose lengths
differ by at most one, BalancedLayout.head_pieces).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import check_tensor
from .comm import (
    group_rank_world,
    resolve_group,
    resolve_groups,
    resolve_groups_or_error,
    validated_across_grid,
    validated_across_ranks,
)
from .schedule import check_divisible, check_layout, is_balanced, layout_code, segments, show_layout_code


def _norm_dim(x: torch.Tensor, dim: int, api: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{api}: dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{api}: dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x, *, group=None, layout="zigzag", dim=1, head_group=None):
    """This rank's part of the full tensor x along `dim` (differentiable).

    x: any shape with the sequence on `dim` (default 1, as in (B, S, H, D); 0 for packed
    (total, H, D) tensors); its length must divide into world_size (contiguous) or
    2 * world_size (zigzag) equal chunks, world_size being R x U with a head_group (the
    module docstring gives the token mapping), or be a balanced layout's total.
    """
    api = "shard"
    check_tensor("x", x, api)
    check_layout(layout, api)
    dim = _norm_dim(x, dim, api)
    group, head_group = resolve_groups(group, head_group, api)
    rank, world = group_rank_world(group)
    u, U = _head_rank(head_group, layout, api)
    if is_balanced(layout):
        _check_balanced(layout, x.shape[dim], world, api)
        return x.index_select(dim, _balanced_positions(layout, rank, u, U, x.device))
    check_divisible(x.shape[dim], world * U, layout, api)
    part = _shard_of(x, rank, world, layout, dim)
    n = part.shape[dim] // U
    return part if U == 1 else part.narrow(dim, u * n, n)


def _head_rank(head_group, layout, api: str) -> tuple[int, int]:
    return (0, 1) if head_group is None else group_rank_world(head_group)


def _balanced_positions(layout, rank: int, u: int, U: int, device) -> torch.Tensor:
    """The global positions held by head-group rank u of ring position `rank`: its piece of
    the ring position's positions (BalancedLayout.head_pieces; all of them when U = 1)."""
    pos = layout.positions(rank, device=device)
    if U == 1:
        return pos
    (piece,) = layout.head_pieces(rank, U).pieces[u] or (None,)
    return pos[:0] if piece is None else pos[piece.global_start : piece.global_start + piece.length]


def _check_balanced(
    layout, seq_len: int, world: int, api: str, what: str = "the tensor has", ranks: str = "the group has"
) -> None:
    """what, ranks: how the caller's length and world size read in the error ("the tensor has",
    "seq_len is"; "the group has", "world is")."""
    if layout.world != world:
        raise ValueError(f"{api}: the layout was built for {layout.world} ranks, {ranks} {world}")
    if seq_len != layout.total:
        raise ValueError(f"{api}: the layout covers {layout.total} tokens, {what} {seq_len}")


def _shard_of(x, rank, world, layout, dim=1):
    local_len = x.shape[dim] // world
    parts = [x.narrow(dim, s.global_start, s.length) for s in segments(layout, rank, world, local_len)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim) if parts else x.narrow(dim, 0, 0)


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


def local_positions(seq_len, *, group=None, layout="zigzag", device=None, head_group=None):
    """The global token indices this rank holds, in local order: int64 tensor (seq_len / P,),
    P = R x U with a head_group. Use it for RoPE and position embeddings of the local shard.
    seq_len 0 gives an empty tensor, as shard() gives an empty sequence empty shards."""
    api = "local_positions"
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"{api}: seq_len must be a non-negative int, got {seq_len!r}")
    check_layout(layout, api)
    group, head_group = resolve_groups(group, head_group, api)
    rank, world = group_rank_world(group)
    u, U = _head_rank(head_group, layout, api)
    if is_balanced(layout):
        _check_balanced(layout, seq_len, world, api, what="seq_len is")
        return _balanced_positions(layout, rank, u, U, device)
    check_divisible(seq_len, world * U, layout, api)
    segs = segments(layout, rank, world, seq_len // world)
    pos = torch.cat([torch.arange(s.global_start, s.global_start + s.length, device=device) for s in segs])
    n = pos.numel() // U
    return pos[u * n : (u + 1) * n]


# every torch dtype by a number that is the same in every process (the agreement sends ints)
_DTYPES = {d: i for i, d in enumerate(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))}
_DTYPE_NAMES = {i: str(d) for d, i in _DTYPES.items()}


def _device_code(device: torch.device) -> int:
    """A device type as an int that is the same in every process (the agreement sends ints)."""
    return int.from_bytes(device.type.encode()[:7], "little")


def _show_layout_field(name, value):
    if name == "dtype":
        return _DTYPE_NAMES.get(value, str(value))
    if name == "device type":
        return value.to_bytes(7, "little").rstrip(b"\0").decode(errors="replace")
    if name != "layout":
        return str(value)
    return show_layout_code(value)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, group, layout, dim):
        rank, world = group_rank_world(group)
        ctx.args = (group, layout, dim)
        if is_balanced(layout):  # shards of different lengths: gather them padded to the longest
            pad = layout.max_local_len - x_local.shape[dim]
            padded = torch.cat([x_local, x_local.new_zeros(*x_local.shape[:dim], pad, *x_local.shape[dim + 1 :])], dim)
            pieces = [torch.empty_like(padded, memory_format=torch.contiguous_format) for _ in range(world)]
            dist.all_gather(pieces, padded.contiguous(), group=resolve_group(group))
            full = x_local.new_empty(*x_local.shape[:dim], layout.total, *x_local.shape[dim + 1 :])
            for r, piece in enumerate(pieces):
                positions = layout.positions(r, device=x_local.device)
                full.index_copy_(dim, positions, piece.narrow(dim, 0, positions.numel()))
            return full
        pieces = [torch.empty_like(x_local, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(pieces, x_local.contiguous(), group=resolve_group(group))
        return _place(pieces, layout, dim)

    @staticmethod
    def backward(ctx, grad_full):
        group, layout, dim = ctx.args
        return shard(grad_full, group=group, layout=layout, dim=dim), None, None, None


def _validated_unshard(x_local, layout, dim, world, api, device, place, group, head_group=None, error=None) -> int:
    """unshard's checks of this rank's x_local, agreed across `group` (with a head_group: across
    the grid): the layout, dim, ndim and dtype, then every size but a balanced layout's own
    lengths. place: (rank in group, rank in head_group, head_group size U); a balanced layout
    gives this rank its piece of the ring position's shard (all of it with U = 1). error: one
    found before (groups this rank cannot use), raised as its input's. Returns the dim,
    non-negative."""
    rank, u, U = place
    agreed = validated_across_ranks if head_group is None else validated_across_grid
    groups = (group,) if head_group is None else (group, head_group)

    def validate_rank():
        if error is not None:
            raise error
        check_tensor("x_local", x_local, api)
        check_layout(layout, api)
        d = _norm_dim(x_local, dim, api)
        if world > 1 and U == 1 and layout == "zigzag" and x_local.shape[d] % 2:  # (U > 1: a piece of it)
            raise ValueError(f"{api}: local length {x_local.shape[d]} on dim {d} must be even for layout 'zigzag'")
        if is_balanced(layout):
            _check_balanced(layout, layout.total, world, api)
            n = layout.local_len(rank) if U == 1 else layout.head_piece_lens(rank, U)[u]
            if x_local.shape[d] != n:
                where = f"rank {rank}" if U == 1 else f"ring position {rank}, head-group rank {u}"
                got = f"x_local has {x_local.shape[d]} on dim {d}"
                raise ValueError(f"{api}: the layout gives {where} {n} tokens, {got}")
        # the device type too: a rank whose tensor the group's backend cannot carry (or carries
        # by another backend) fails or waits in the all_gather alone
        fields = {"layout": layout_code(layout), "dim": d, "ndim": x_local.dim(), "dtype": _DTYPES[x_local.dtype],
                  "device type": _device_code(x_local.device)}  # fmt: skip
        return fields, d

    names = ("layout", "dim", "ndim", "dtype", "device type")
    d = agreed(*groups, api, validate_rank, names, device=device, show=_show_layout_field)
    if world > 1 or head_group is not None:
        # all_gather needs equal shapes: agree on every size (but the balanced layout's own
        # lengths), now that the rank count is agreed
        sizes = {f"size[{i}]": n for i, n in enumerate(x_local.shape) if not (is_balanced(layout) and i == d)}
        agreed(*groups, api, lambda: (sizes, None), tuple(sizes), device=device)
    return d


def unshard(x_local, *, group=None, layout="zigzag", dim=1, head_group=None):
    """Gather every rank's part and restore sequence order (the inverse of shard).

    Differentiable. The gathered tensor is treated as the same value on every rank: the
    gradient reaching x_local is this rank's part of this rank's gradient (so computing one
    loss from the unsharded tensor on every rank gives single-device gradients).
    All ranks must pass equal shapes and the same layout and dim (checked: a mismatch raises
    on every rank); the local length must divide into the layout's chunks. With a head_group,
    the head group's pieces are gathered first (their ring position's shard), then the ring's.
    """
    api = "unshard"
    # groups this rank cannot use: their error agreed over `group` as a bad x_local's would be
    group, head_group, error = resolve_groups_or_error(group, head_group, api)
    device = getattr(x_local, "device", None)
    if head_group is not None:
        # agreed over the whole grid before any gather: a rank's bad input then raises on every
        # rank, not only in its own head group while the other head groups wait in the ring's
        r, R = group_rank_world(group)
        u, U = group_rank_world(head_group)
        d = _validated_unshard(x_local, layout, dim, R, api, device, (r, u, U), group, head_group)
        pieces = "contiguous"
        if is_balanced(layout):  # pieces of unequal lengths: gathered as a layout of U ranks
            pieces = layout.head_pieces(r, U)
        x_local = unshard(x_local, group=head_group, layout=pieces, dim=d)
    rank, world = group_rank_world(group)
    dim = _validated_unshard(x_local, layout, dim, world, api, device, (rank, 0, 1), group, error=error)
    if world == 1:  # every layout of one rank is the identity
        return x_local
    return _Unshard.apply(x_local, group, layout, dim)
