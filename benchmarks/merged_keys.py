"""One call over every key a rank needs, against its ring steps' calls (packed documents).

    python -m benchmarks.merged_keys --totals 131072 --world 8 --kv-heads 8 --window 4096
    python -m benchmarks.merged_keys --smoke          # tiny CPU run (CI keeps it working)

An experiment for bounded windows, where a balanced layout's rank needs its own keys and one
neighbour's (ring steps 0 and 1): would one kernel call over both, once the neighbour's block
has arrived, beat the two step calls and their merge? For each rank r of
ringflash.balanced_layout over the long-tailed mix of benchmarks.packed_ring_replay (same
seed and sizes), device time under torch.profiler, per call over --calls calls:
  ring     r's replayed ring forward+backward (benchmarks.packed_ring_replay.replay_rank), less
           its stand-ins for the network's transfers
  merged   r's queries against the keys of every rank its ring steps reach, gathered in global
           order into one buffer (the gather and the neighbours' dK/dV rows picked out again
           counted in), one local forward+backward over per-row bounds (masks.held_bounds: each
           row's visible keys are one interval there; BalancedLayout.gather_plan, the plan of the
           ring's gathered path), key blocks most query blocks first as a
           ring step's (RowBounds.key_order; --grid-order: the grid's, as a one-device call's);
           no transfer, no merge
and beside them the whole batch's one-device call / P by device time (the ring's efficiency
reference, as the replay computes it). The merged call gives up what the ring overlaps (the
neighbour's block arriving during step 0's compute); on NVLink that block is ~0.1-0.3 ms.
Each merged row's output and dQ are checked against the one-device call's rows (max abs
difference printed; the smoke run asserts it within float32 rounding)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import ringflash
from benchmarks.common import bench_device, device_name, profiled_kernels, result_meta, write_json
from benchmarks.packed_ring_replay import measured_kernels, packed_batch, replay_rank
from ringflash.local import backend_for, local_backward, local_forward
from ringflash.masks import BlockMask, key_block_order, window_from
from ringflash.schedule import ring_steps


def device_ms(run, device, calls: int) -> float:
    """run()'s kernels' summed device time per call (after one call outside the profile)."""
    run()
    rows, _ = profiled_kernels(run, device, calls)
    return sum(ms for _, _, ms in rows) / calls


def merged_call(q, k, v, do, layout, rank, world, window, key_order=True):
    """A callable: `rank`'s queries against the keys of every rank its ring steps reach, in one
    local forward+backward over the keys and bounds of the layout's own plan for that call
    (BalancedLayout.gather_plan, the module docstring's "merged"); it returns (out, dq) in the
    rows of the rank's positions. key_order: the key blocks most query blocks first (as a ring
    step's), else in the grid's order (the plan's, as a one-device call's)."""
    n_q = layout.local_len(rank)
    steps = ring_steps(layout, world, n_q, layout.block_len(rank, window), window)
    plan = layout.gather_plan(rank, steps, window, q.device)
    bounds = plan.bounds
    if key_order:
        order = key_block_order(bounds.q_lo.cpu(), bounds.q_hi.cpu()).to(q.device)
        bounds = bounds._replace(key_order=order)
    mask = BlockMask(bounds=bounds)
    # the gathered keys' global positions, block by block into the plan's rows
    keys = torch.empty(plan.keys, dtype=torch.int64, device=q.device)
    for step, rows in zip(steps, plan.rows):
        keys[rows] = layout.positions((rank - step) % world, device=q.device)
    # the other ranks' rows of the gathered keys (steps[0] is 0: the rank's own block), whose
    # dK / dV would go back to their ranks
    theirs = torch.cat([torch.zeros(0, dtype=torch.int64, device=q.device), *plan.rows[1:]])
    rows = layout.positions(rank, device=q.device)
    q_r, do_r = q.index_select(0, rows)[None], do.index_select(0, rows)[None]
    backend, scale = backend_for(q.device), 1 / math.sqrt(q.shape[-1])

    def run():
        k_m, v_m = k.index_select(0, keys)[None], v.index_select(0, keys)[None]
        state = local_forward(q_r, k_m, v_m, None, mask, scale=scale, backend=backend)
        dq, dk, dv = local_backward(
            q_r, k_m, v_m, state.o, state.m, state.l, None, do_r, None, mask, scale=scale, backend=backend
        )
        dk.index_select(1, theirs), dv.index_select(1, theirs)
        return state.o[0], dq[0]

    return run


def whole_call(q, k, v, do, cu, window_size):
    """A callable: the whole batch's one-device forward+backward; returns (out, dq)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        q.grad = k.grad = v.grad = None
        out = ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, window_size=window_size)
        out.backward(do)
        return out.detach(), q.grad

    return run


def measure(args, device, dtype):
    rows = []
    for total in args.totals:
        lengths, cu_list, cu, (q, k, v, do), window_size = packed_batch(args, total, device, dtype)
        window = window_from(True, window_size, "merged_keys")
        layout = ringflash.balanced_layout(cu_list, args.world, causal=True, window_size=window_size)
        whole = whole_call(q, k, v, do, cu, window_size)
        out_ref, dq_ref = whole()
        one_gpu = device_ms(whole, device, args.calls) / args.world
        print(f"S={total} P={args.world} window={args.window}: one device / P {one_gpu:.2f} ms", flush=True)
        ranks = []
        for r in range(args.world):
            ring_ms, transfer_ms = measured_kernels(
                replay_rank(q, k, v, do, cu, layout, r, args.world, window_size, True), device, args.calls
            )[1:3]
            run = merged_call(q, k, v, do, layout, r, args.world, window, not args.grid_order)
            merged_ms = device_ms(run, device, args.calls)
            out, dq = run()
            pos = layout.positions(r, device=device)
            out_err = float((out.float() - out_ref[pos].float()).abs().max()) if len(pos) else 0.0
            dq_err = float((dq.float() - dq_ref[pos].float()).abs().max()) if len(pos) else 0.0
            ranks.append(
                {
                    "rank": r,
                    "ring_ms": ring_ms - transfer_ms,
                    "merged_ms": merged_ms,
                    "out_err": out_err,
                    "dq_err": dq_err,
                }
            )
            print(
                f"  rank {r}: ring {ring_ms - transfer_ms:.2f} ms (transfers {transfer_ms:.2f} more), merged "
                f"{merged_ms:.2f} ms ({merged_ms / (ring_ms - transfer_ms):.3f}x); max |diff| against the "
                f"one-device call: out {out_err:.2e}, dq {dq_err:.2e}",
                flush=True,
            )
        busiest_ring = max(x["ring_ms"] for x in ranks)
        busiest_merged = max(x["merged_ms"] for x in ranks)
        print(
            f"S={total} P={args.world}: busiest rank ring {busiest_ring:.2f} / merged {busiest_merged:.2f} ms; "
            f"efficiency by device time (one device / P over the busiest rank) ring {one_gpu / busiest_ring:.3f}, "
            f"merged {one_gpu / busiest_merged:.3f}",
            flush=True,
        )
        rows.append(
            {
                "total": total,
                "world": args.world,
                "window": args.window,
                "grid_order": args.grid_order,
                "one_gpu_ms": one_gpu,
                "ranks": ranks,
            }
        )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[131072])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=4096, help="a causal window of this many keys (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=3, help="calls profiled in a row, figures per call")
    ap.add_argument("--grid-order", action="store_true", help="the merged call's key blocks in the grid's order")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    if args.smoke:
        args.totals, args.world, args.heads, args.kv_heads, args.head_dim, args.calls = [512], 2, 2, 1, 16, 1
        args.window = 96
    if args.window == 0:
        args.window = None
    print(f"merged keys on {device_name(device)}: H={args.heads}/{args.kv_heads}, D={args.head_dim}, {dtype}")
    rows = measure(args, device, dtype)
    if args.smoke:
        # float32 on the CPU: both sides the same kernels' arithmetic over different blocks
        worst = max(max(x["out_err"], x["dq_err"]) for row in rows for x in row["ranks"])
        assert worst < 1e-4, f"the merged call's rows differ from the one-device call's by {worst}"
    if args.json:
        write_json(args.json, {"meta": result_meta(device, **dict(vars(args), json=None)), "rows": rows})


if __name__ == "__main__":
    main()
