"""Tile work of packed documents on the ring, counted on the host (no GPU, no kernels run).

    python -m benchmarks.packed_ring_tiles                      # S=128K long-tailed, P = 4, 8
    python -m benchmarks.packed_ring_tiles --totals 16384 --worlds 2 --head-dim 16

For one long-tailed document mix (benchmarks.packed.document_lengths, as packed_ring_replay's),
each rank's ring schedule over ringflash.balanced_layout (or --layout's) is replayed with the kernels replaced by
a counter: for every block with per-row bounds, the (query, key) pairs the fused backward's
programs cover (one program per --block-n keys, visiting the --block-m query rows from the
first to the last row that sees one of its keys) against the visible pairs. Printed per rank:
covered / visible, and covered / (the one-GPU call's covered / P): how much of a ring rank's
extra kernel time cutting documents into pieces can explain (per kv head; GQA scales both).

Beside it a time model that also charges each program that runs (a key block some query
sees) a fixed cost of --fixed-steps query-block steps (its K/V loads, pipeline fill and drain,
dK/dV stores): model = sum over programs of (steps + F), over the one-GPU call's / P. F from
the fused backward's kernel-alone speed at 4K and 16K keys, non-causal, B=1, H=32 (64 and 256
steps a program): speed ratio r = (1 + F / 64) / (1 + F / 256), so F = (r - 1) / (1/64 - r/256);
one H200 (results/gluon_bwd_grouped_d128_h200.txt, D=128: 518-520 and 563-566 TFLOP/s, r = 1.087,
F = 7.6; the d64 file: r = 1.049, F = 4.3). A ring step's programs walk few query blocks, so
this fixed cost weighs on them more than on the one-GPU call's.

Then, step by step, each ring step's busiest rank over its mean rank by the same model, and with
--measured (a `packed_ring_replay --kernels --json` file) the replay's measured per-step figure
for the same total and P beside it; and the same for the forward's calls, whose programs are
query tiles (--forward-tile rows) walking key blocks, charged --fixed-steps key blocks a tile.
Each rank's line also gives its forward's covered pairs and model over the one-GPU forward's / P
and, with --measured, the rank's step forwards' summed device ms (over the one-GPU forward's / P
where the file has single_forward_device_ms): a step's query tiles walk few key blocks, so the
fixed cost a tile (its Q and incoming-state loads, its state stores) weighs there most.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import ringflash.local as local_module
import ringflash.ring as ring_module
from benchmarks.common import FIXED_STEPS, add_align_args, cuts_aligned
from benchmarks.layout_balance import measure as balance_of
from benchmarks.packed import document_lengths
from benchmarks.packed_ring_replay import LAYOUTS, replay_rank
from ringflash.masks import CAUSAL, document_bounds


def covered_pairs(q_lo, q_hi, n_q, n_k, q_start, block_m, block_n):
    """(pairs covered by key-block programs, visible pairs, programs that run) of a block whose
    key rows are seen by the query positions [q_lo, q_hi) (RowBounds.q_lo / q_hi, int tensors),
    query rows starting at position q_start."""
    lo = (q_lo.long() - q_start).clamp(0, n_q)
    hi = (q_hi.long() - q_start).clamp(0, n_q)
    visible = int((hi - lo).clamp(min=0).sum())
    covered = programs = 0
    for first in range(0, n_k, block_n):
        l, h = lo[first : first + block_n], hi[first : first + block_n]
        seen = h > l
        if seen.any():
            m0, m1 = int(l[seen].min()) // block_m, -(-int(h[seen].max()) // block_m)
            covered += (m1 - m0) * block_m * block_n
            programs += 1
    return covered, visible, programs


def model_steps(covered, programs, block_m, block_n, fixed_steps):
    """The time model's cost in query-block steps: every covered step plus fixed_steps a program."""
    return covered / (block_m * block_n) + fixed_steps * programs


def rank_pairs(q, k, v, do, cu, layout, rank, world, block_m, block_n, forward_tile=(128, 128)):
    """(covered, visible, programs) over every per-row-bounds block of rank's schedule (the dK/dV
    calls, one per task and step, at the smallest kv-head chunk: each block counted once), in
    total and, as a list over the ring steps 0..world-1, step by step; then the same list for
    the forward's calls, whose programs are query tiles of forward_tile[0] rows walking key
    blocks of forward_tile[1] (the Gluon forward's 128 x 128)."""
    by_step = [[0, 0, 0] for _ in range(world)]
    forward_by_step = [[0, 0, 0] for _ in range(world)]
    current = [0]  # the ring step the backward's loop is in

    def stepping(*args, **kwargs):
        for item in real_ring_kv(*args, **kwargs):
            current[0] = item[0]
            yield item

    def count(q_, k_, v_, mask, **kw):
        if mask.bounds is not None:
            counted = covered_pairs(mask.bounds.q_lo, mask.bounds.q_hi, q_.shape[1], k_.shape[1], mask.q_start,
                                    block_m, block_n)  # fmt: skip
            for i, n in enumerate(counted):
                by_step[current[0]][i] += n
        return False

    def count_forward(q_, k_, v_, state, mask, **kw):
        if mask.bounds is not None:  # the same count with the sides swapped: query tiles walk keys
            counted = covered_pairs(mask.bounds.k_lo, mask.bounds.k_hi, k_.shape[1], q_.shape[1], mask.k_start,
                                    forward_tile[1], forward_tile[0])  # fmt: skip
            for i, n in enumerate(counted):
                forward_by_step[current[0]][i] += n
        return True

    def count_whole(q_, k_, v_, m, l, do_, delta, dq, dk, dv, mask, **kw):
        return count(q_, k_, v_, mask)

    real_ring_kv = ring_module._ring_kv
    # a ring of one step runs as the local call (local_forward / local_backward): its one block
    # is step 0's, counted through the local module's block operations
    with (
        mock.patch.object(ring_module, "fuses_backward", count),
        mock.patch.object(ring_module, "block_backward", lambda *a, **kw: True),
        mock.patch.object(ring_module, "block_forward", count_forward),
        mock.patch.object(local_module, "block_forward", count_forward),
        mock.patch.object(local_module, "block_backward", count_whole),
        mock.patch.object(ring_module, "_ring_kv", stepping),
    ):
        replay_rank(q, k, v, do, cu, layout, rank, world, (-1, -1), overlap=False)()
    total = tuple(sum(step[i] for step in by_step) for i in range(3))
    return total, [tuple(step) for step in by_step], [tuple(step) for step in forward_by_step]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[131072])
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--head-dim", type=int, default=16, help="only the schedule's chunking reads it")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default="balanced", choices=list(LAYOUTS), help="as packed_ring_replay --layouts'")
    ap.add_argument("--fixed-steps", type=float, default=FIXED_STEPS,
                    help="the time model's fixed cost of a program, in query-block steps (docstring)")  # fmt: skip
    ap.add_argument(
        "--forward-tile",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("ROWS", "KEYS"),
        help="the forward's query tile and key block (Gluon 128 x 128; Triton on documents 64 x 64)",
    )
    ap.add_argument("--measured", help="a packed_ring_replay --kernels --json file: its per-step max/mean beside")
    add_align_args(ap)
    args = ap.parse_args()
    for total in args.totals:
        lengths = document_lengths("longtail", total, args.seed)
        cu_list = [0, *np.cumsum(lengths).tolist()]
        cu = torch.tensor(cu_list, dtype=torch.int32)
        b = document_bounds(cu, cu, CAUSAL)
        single, single_vis, single_programs = covered_pairs(b.q_lo, b.q_hi, total, total, 0, args.block_m,
                                                            args.block_n)  # fmt: skip
        single_model = model_steps(single, single_programs, args.block_m, args.block_n, args.fixed_steps)
        # the forward's: query tiles walking key blocks (the sides swapped, as count_forward's)
        single_forward = covered_pairs(b.k_lo, b.k_hi, total, total, 0, args.forward_tile[1], args.forward_tile[0])
        single_forward_model = model_steps(single_forward[0], single_forward[2], *args.forward_tile, args.fixed_steps)
        print(f"S={total} docs={len(lengths)} one GPU: covered / visible {single / single_vis:.3f}, "
              f"{single_programs} programs")  # fmt: skip
        q, k, v, do = (torch.zeros(total, 1, args.head_dim) for _ in range(4))
        for world in args.worlds:
            with cuts_aligned(args.align, args.align_min_piece):
                layout = LAYOUTS[args.layout](cu_list, world, causal=True)
            bal = balance_of(layout)
            print(
                f"  P={world} balance: worst step max/mean {bal['step']:.3f}, ring time over an even split "
                f"{bal['time']:.3f} (visible pairs)"
            )
            step_models, forward_models = [], []  # [rank][step]
            for rank in range(world):
                (c, vis, programs), by_step, forward_by_step = rank_pairs(
                    q, k, v, do, cu, layout, rank, world, args.block_m, args.block_n, tuple(args.forward_tile)
                )
                model = model_steps(c, programs, args.block_m, args.block_n, args.fixed_steps)
                step_models.append([model_steps(sc, sp, args.block_m, args.block_n, args.fixed_steps)
                                    for sc, _, sp in by_step])  # fmt: skip
                forward_models.append(
                    [model_steps(sc, sp, *args.forward_tile, args.fixed_steps) for sc, _, sp in forward_by_step]
                )
                forward_covered = sum(sc for sc, _, _ in forward_by_step)
                print(
                    f"  P={world} rank {rank}: covered / visible {c / max(vis, 1):.3f}, "
                    f"covered / (one GPU's / P) {c / (single / world):.3f}, {programs} programs, "
                    f"model (F={args.fixed_steps:g}) / (one GPU's / P) {model / (single_model / world):.3f}; "
                    f"forward: covered / (one GPU's / P) {forward_covered / (single_forward[0] / world):.3f}, "
                    f"model / (one GPU's / P) {sum(forward_models[-1]) / (single_forward_model / world):.3f}"
                    + _measured_forward(args.measured, total, world, rank),
                    flush=True,
                )
            lockstep = sum(max(m[s] for m in step_models) for s in range(world))
            print(f"  P={world} ranks in lockstep (each step its busiest rank's): model / (one GPU's / P) "
                  f"{lockstep / (single_model / world):.3f}")  # fmt: skip
            print(f"  P={world} each step's busiest rank over its mean: model (F={args.fixed_steps:g}) "
                  + " ".join(_uneven([m[s] for m in step_models]) for s in range(world))
                  + _measured_steps(args.measured, total, world))  # fmt: skip
            tile = "{} x {}".format(*args.forward_tile)
            print(f"  P={world} the forward's tiles ({tile}), each step: model (F={args.fixed_steps:g} key-block "
                  "steps a tile) " + " ".join(_uneven([m[s] for m in forward_models]) for s in range(world))
                  + _measured_steps(args.measured, total, world, "forward"))  # fmt: skip


def _uneven(parts) -> str:
    return f"{max(parts) / statistics.mean(parts):.3f}" if any(parts) else "-"


def _measured_row(path, total, world, key) -> dict | None:
    """The first row for (total, world) that has `key` in the packed_ring_replay --kernels
    --json file `path` (None: no file, or no such row); the file read once."""
    if path is None:
        return None
    return next((r for r in _replay_rows(path) if r["total"] == total and r["world"] == world and r.get(key)), None)


@functools.lru_cache(maxsize=4)
def _replay_rows(path) -> list[dict]:
    return json.loads(Path(path).read_text())["rows"]


def _measured_forward(path, total, world, rank) -> str:
    """packed_ring_replay --kernels' measured forward device ms of `rank` (its step calls
    summed) for (total, world) from its --json file `path` (the file's first row of them: the
    first variant replayed), over its one-GPU call's forward kernels / P where the file has them
    (single_forward_device_ms)."""
    row = _measured_row(path, total, world, "rank_step_forward_ms")
    if row is None:
        return ""
    ms = sum(row["rank_step_forward_ms"][rank])
    single = row.get("single_forward_device_ms")
    return f"; measured {ms:.2f} ms" + (f" = {ms / (single / world):.3f} x one GPU's / P" if single else "")


def _measured_steps(path, total, world, phase=None) -> str:
    """packed_ring_replay --kernels' measured per-step max/mean for (total, world) from its
    --json file `path` (forward and backward together, or one `phase` apart), if it has it."""
    key = "device_step_max_over_mean" + ("" if phase is None else f"_{phase}")
    row = _measured_row(path, total, world, key)
    if row is None:
        return ""
    return f"; measured ({Path(path).name}) " + " ".join("-" if u is None else f"{u:.3f}" for u in row[key])


if __name__ == "__main__":
    main()
