"""A model of a packed ring step's fused backward launch in persistent programs: when its last
program ends if the key blocks are handed out in the grid's order (key blocks, then heads: the
ws2_lag_pc variant) or most query blocks first, each block's heads side by side (ws2_lag_pch,
masks.RowBounds.key_order). Pure Python, CPU.

    python -m benchmarks.key_order_model                       # 128K, P = 8, a 4K causal window
    python -m benchmarks.key_order_model --window 0            # causal documents, no window
    python -m benchmarks.key_order_model --totals 32768 --worlds 4

For each rank and ring step of balanced_layout over the long-tailed document mix that
benchmarks.packed_ring_replay replays (--seed), the step's per-row-bounds call (the bounds
BalancedLayout.step_plan gives the kernels): a key block of 128 keys costs (query blocks of 64
rows its keys' hull spans) x (q heads a kv head) steps, plus --fixed for its K / V load and
dK / dV store (a block that no query sees: --fixed alone), for each of --kv-heads; started on
the first free one of --processors programs (list scheduling: tile_order_model.finish_time).
Reported per step: each rank's finish time in the grid's order / most first, in steps, and
the even share (all steps over the programs), the bound no order beats.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.packed import document_lengths
from benchmarks.tile_order_model import finish_time
from ringflash import balanced_layout
from ringflash.masks import key_block_order, key_block_spans


def block_steps(q_lo, q_hi, group: int) -> list[int]:
    """Per key block of KEY_ORDER_BLOCK keys: the steps of one head's program (query blocks of
    KEY_ORDER_ROWS rows the hull of its keys' [q_lo, q_hi) spans, masks.key_block_spans, times
    the group)."""
    return (key_block_spans(torch.as_tensor(q_lo), torch.as_tensor(q_hi)) * group).tolist()


def finish_times(bounds, kv_heads: int, group: int, processors: int, fixed: float) -> tuple[float, float, float]:
    """(grid order, most first, even share) of one launch over `bounds` (masks.RowBounds)."""
    cost = [s + fixed for s in block_steps(bounds.q_lo, bounds.q_hi, group)]
    grid = [c for _ in range(kv_heads) for c in cost]
    order = key_block_order(bounds.q_lo, bounds.q_hi).tolist()
    heavy = [cost[b] for b in order for _ in range(kv_heads)]
    return finish_time(grid, processors), finish_time(heavy, processors), sum(grid) / processors


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[131072])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8])
    ap.add_argument("--window", type=int, default=4096, help="a causal window of this many keys (0: causal)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--processors", type=int, default=132, help="persistent programs (an H200: 132)")
    ap.add_argument("--fixed", type=float, default=2.0, help="a key block's fixed cost, in steps")
    args = ap.parse_args(argv)
    window = (-1, -1) if args.window <= 0 else (args.window - 1, 0)
    group = args.heads // args.kv_heads
    for total in args.totals:
        for world in args.worlds:
            for seed in args.seeds:
                cu = [0, *np.cumsum(document_lengths("longtail", total, seed)).tolist()]
                layout = balanced_layout(cu, world, causal=True, window_size=window)
                n_k = max(layout.local_len(r) for r in range(world))
                print(f"S={total} P={world} window={args.window or 'causal'} seed={seed}: per rank, grid order / "
                      f"most first / even share (steps of one program)")  # fmt: skip
                for step in range(layout.hops):
                    rows = []
                    for rank in range(world):
                        plan = layout.step_plan(rank, step, layout.window, n_k, "cpu", args.heads * 128)
                        if plan.bounds is not None:
                            rows.append(finish_times(plan.bounds, args.kv_heads, group, args.processors, args.fixed))
                    if rows:
                        gain = max(g for g, _, _ in rows) / max(h for _, h, _ in rows)
                        print(f"  step {step}: " + "  ".join(f"{g:.0f}/{h:.0f}/{e:.0f}" for g, h, e in rows)
                              + f"  | busiest rank grid / most first {gain:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
