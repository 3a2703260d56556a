"""A model of a causal one-tile launch's tail: how much longer than an even share of the work
the multiprocessors take when the hardware starts programs in the grid's order. Pure Python, CPU.

    python -m benchmarks.tile_order_model                                  # the forward's shapes
    python -m benchmarks.tile_order_model --seqlens 8192 16384 --rows 128 --head-dim 128

The hardware starts a grid's programs in launch order (program_id(0) fastest), each on the first
multiprocessor free: list scheduling. A causal query tile i (of n, heaviest first, as
_gluon_fwd._tile's REVERSE takes them) costs its key blocks (n - i, in tiles of --rows keys)
plus --fixed (set-up and output per tile). The model assumes one program per multiprocessor at a
time, as the warp-specialized kernels run. Orders:
  by head   the grid's own (B x Hq heads one after another), the order before the grouping;
  grouped   every head of a group's tile i before any of its tile i + 1, groups of
            gluon_forward.heads_per_group's count for bf16 K / V of --head-dim (the group's
            K/V within gluon_forward.TILE_ORDER_L2_BYTES);
  short 1st grouped, the group of the heads left over first rather than last;
  all       every head's tile i before any head's tile i + 1 (longest first).
Reported: each order's finish time over the even share (sum of costs / multiprocessors).
"""

from __future__ import annotations

import argparse
import heapq


def finish_time(costs, processors: int) -> float:
    """When the last of `costs` (in launch order) ends, each started on the first free one."""
    free = [0.0] * processors
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def launch_costs(tiles: int, heads: int, heads_per_group: int, fixed: float, short_first: bool = False) -> list[float]:
    """Tile costs in launch order: groups of heads_per_group heads (the heads left over a group
    of their own, last or with short_first first), within a group tile by tile (heaviest
    first), each over the group's heads."""
    groups = [heads_per_group] * (heads // heads_per_group)
    if heads % heads_per_group:
        groups.insert(0 if short_first else len(groups), heads % heads_per_group)
    return [tiles - i + fixed for group in groups for i in range(tiles) for _ in range(group)]


def tail(seqlen: int, rows: int, heads: int, heads_per_group: int, processors: int, fixed: float,
         short_first: bool = False) -> float:  # fmt: skip
    """Finish time over the even share for a causal launch of seqlen keys and queries."""
    costs = launch_costs(-(-seqlen // rows), heads, heads_per_group, fixed, short_first)
    return finish_time(costs, processors) / (sum(costs) / processors)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 192], help="query rows a tile (192: ws3)")
    ap.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=32, help="B x Hq")
    ap.add_argument("--processors", type=int, default=132, help="multiprocessors (an H200: 132)")
    ap.add_argument("--fixed", type=float, default=0.3, help="a tile's fixed cost, in key blocks")
    args = ap.parse_args(argv)
    from ringflash.kernels import gluon_forward as gf
    from ringflash.kernels.tiles import MASK_WINDOW

    causal_one_tile = gf.config_for(64, "ws2_s3")  # (any config that groups heads)
    print(f"{'S':>6} {'rows':>4} {'D':>4} {'group':>5} | {'by head':>8} {'grouped':>8} {'short 1st':>9} {'all':>8}")
    for seqlen in args.seqlens:
        for rows in args.rows:
            for d in args.head_dim:
                # the launcher's count for bf16 K and V of head dim d
                group = gf.heads_per_group(causal_one_tile, MASK_WINDOW.value, False, args.heads, seqlen, 2 * (d + d))
                orders = ((1, False), (group, False), (group, True), (args.heads, False))
                figures = [tail(seqlen, rows, args.heads, g, args.processors, args.fixed, first) for g, first in orders]
                print(f"{seqlen:6d} {rows:4d} {d:4d} {group:5d} | " + " ".join(f"{f:8.3f}" for f in figures[:2])
                      + f" {figures[2]:9.3f} {figures[3]:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
