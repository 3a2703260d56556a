"""Packed documents on the ring, every rank's schedule replayed on one GPU (no network).

    python -m benchmarks.packed_ring_replay --json benchmarks/results/packed_ring_replay_h200.json
    python -m benchmarks.packed_ring_replay --smoke          # tiny CPU run (CI keeps it working)

For each total length and ring size P, one long-tailed document mix (lengths log-uniform in
[128, 32768], numpy default_rng(--seed), the last cut to fit; benchmarks.packed.document_lengths)
is laid out by ringflash.balanced_layout(cu_seqlens, P) (causal; --window W adds a causal window
of W keys, window_size=(W - 1, 0)). Each rank r's forward+backward runs on this GPU as
ring_flash_attn_varlen_func would run it, the K/V blocks of the other ranks copied in
(ringflash.testing.ReplayComm) instead of received, on a side stream beside the kernels as a
network transfer would run (the copies still take this GPU's memory bandwidth; "inline": the
same copies on the compute stream, an upper bound on their cost). Reported per (S, P):
  max/mean   the busiest rank's replayed time over the mean rank's (1.00: even)
  eff        single-GPU flash_attn_varlen_func forward+backward on the whole batch / P, over the
             busiest rank's replayed time: the ring efficiency before any network time
  hops       ring steps that send K/V (layout.hops - 1), and the bytes each rank sends: hops x
             the longest shard's K/V (the ring sends blocks padded to it); beside it what a
             zigzag layout of every document (2P pieces each) would send: P - 1 shards' K/V
  own calls  ringflash.balance.OWN_CALL_WORK: from this much work a document's share of a step
             gets kernel calls of its own (--own-call-work-log2 varies it)
  pred       the layout's own prediction of max/mean from its visible pairs (layout.work), in
             total and at its most uneven step
  by device time (--kernels) max/mean and eff again from each rank's kernels' summed device
             time under torch.profiler (no host time: the host clock's spread left out), the
             replay's stand-ins for the network counted in; then "less the transfers": the same
             without the device time of those stand-ins (the K/V copies and the zeroed dK/dV
             accumulators that arrive in place of another rank's), so before any network
             time as eff is (the copies' memory traffic still slows the kernels beside them);
             and per step max/mean: for each ring step the busiest rank's device time inside
             that step (less the transfers) over the mean rank's, forward and backward
             together ("both"), then each apart ("-": no ring loop ran, as where every
             document is whole and each rank's call is the local one)
--balance-slack varies ringflash.balance.BALANCE_SLACK (the layout: how many documents stay
whole; printed when not the default); --polish-moves varies ringflash.balance.POLISH_MOVES (how
many moves improve a bounded window's deal; 0: the deal alone); --neighbour-pair-cost varies
ringflash.balance.NEIGHBOUR_PAIR_COST (the polish's price of a neighbour's pair, a rank's own =
1); --max-reach varies ringflash.balance.MAX_REACH (1: a bounded window's pieces window-long);
--crop-step-calls varies ringflash.balance.CROP_STEP_CALLS (1: each ring step after the first
calls the kernels over the rows and keys that see each other only); --gather-max-steps varies
ringflash.balance.GATHER_MAX_STEPS (2: a bounded window's ring of steps 0 and 1 computed in one
call once the neighbour's block has come; the replay's transfers are copies on this GPU, so what
the gathered ring gives up, their overlap with the steps, is not in its figures);
--forward-group-steps varies ringflash.balance.FORWARD_GROUP_STEPS (the forward's steps after
the first in calls over runs of that many blocks; a run's call waits for its last block, which
these figures do not show either). --layouts balanced document-
zigzag also replays every document cut over every rank in 2P zigzag chunks
(ringflash.balance.document_zigzag_layout), as the context-parallel peers shard packed
documents, with the same kernels: the layout's own share of the result; "few-ranks" (an
experiment: benchmarks.common.few_rank_layout) cuts each document the balanced layout cuts over
a few consecutive ranks instead of all. With --kernels, "in lockstep" is the efficiency (less
the transfers) if every ring step of the forward and of the backward lasted as long as its
busiest rank's part: the sum over them of the per-step maximum, plus the most any rank spends
outside the steps; it is at most the busiest rank's efficiency, which assumes no rank waits. "by
the ring's dependencies" lets each step wait only for the block it computes on
(benchmarks.common.ring_time on the measured steps: the forward's K/V as its sender started the
step before, the backward's dK/dV as its sender finished it), each rank's time outside the steps
added after; it lies between the two. "two-ranks" (the same experiment) cuts every such document
over two ranks, offsets chosen by the kernel programs' cost model: the ring runs steps 0, 1 and
P - 1 only. Times are host-clock medians (benchmarks.common.host_seconds) of --repeats timings
of --calls calls in a row, the device synchronized before and after each timing, after a warm-
up: with --calls 1 (default) a host-bound rank's host time shows, and varies with the host; more
calls in a row let the host run ahead of the device as a training loop's next layers would."""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
from pathlib import Path
from unittest import mock

import numpy as np
import torch

import ringflash
import ringflash.ring as ring_module
from benchmarks.common import (
    DOCUMENTS_BACKWARDS,
    DOCUMENTS_FORWARDS,
    add_align_args,
    bench_device,
    cuts_aligned,
    dependent_ring_ms,
    device_name,
    few_rank_layout,
    host_seconds,
    kv_bytes_sent,
    profiled_kernels,
    result_meta,
    write_json,
)
from benchmarks.common import documents_backward as common_documents_backward
from benchmarks.common import documents_forward as common_documents_forward
from benchmarks.packed import document_lengths
from ringflash.ring import _ring_kv, _RingAttn, check_packed_call
from ringflash.testing import ReplayComm


def timed(fn, device, repeats, calls=1):
    """Median milliseconds per call over `repeats` timings of `calls` calls, after one warm-up."""
    return host_seconds(fn, device, repeats=repeats, calls=calls) * 1e3


TRANSFER = "replayed transfer"  # the profiler's name for ReplayComm's stand-ins for the network
STEP = "ring step "  # ... and the prefix of its names for the ring loop's steps (STEP + "3 forward")
PHASES = ("forward", "backward")


class _LabelledComm(ReplayComm):
    """ReplayComm whose exchanges (its stand-ins for the network's transfers) run inside a
    torch.profiler.record_function(TRANSFER) block, so their device time can be told apart."""

    def _exchange(self, *args):
        with torch.profiler.record_function(TRANSFER):
            super()._exchange(*args)


def replay_rank(q, k, v, do, cu, layout, rank, world, window, overlap, grad_chunks=None, grad_accum_dtype=None):
    """One forward+backward of `rank`'s ring schedule; returns a callable. overlap: as
    ReplayComm's; grad_chunks, grad_accum_dtype: as ring_flash_attn_varlen_func's."""
    idx = [layout.positions(r, device=q.device) for r in range(world)]
    # padded as the ring call pads them (to the longest shard where blocks travel)
    blocks = [(layout.pad_block(k[i], r)[None], layout.pad_block(v[i], r)[None]) for r, i in enumerate(idx)]
    ql = q[idx[rank]].detach().requires_grad_()
    kl, vl = blocks[rank][0].detach().requires_grad_(), blocks[rank][1].detach().requires_grad_()
    dol = do[idx[rank]][None]
    _, spec = check_packed_call(
        ql, k[idx[rank]], v[idx[rank]], cu, layout, True, None, window, False, grad_accum_dtype, grad_chunks, 0.0, None,
        "ring_flash_attn_varlen_func", world, rank,
    )  # fmt: skip

    def run():
        ql.grad = kl.grad = vl.grad = None
        comm = _LabelledComm(rank, world, blocks, record=False, overlap=overlap)
        out, _ = _RingAttn.apply(ql[None], kl, vl, None, spec, comm)
        out.backward(dol)

    return run


def _labelled_ring_kv(*args, **kwargs):
    """ring._ring_kv, each step's loop body inside record_function(STEP + "<step> <phase>"),
    the phase "backward" where autograd runs a node (the ring's backward), else "forward": the
    generator stays suspended inside the block while the caller computes the step."""
    phase = PHASES[torch._C._current_autograd_node() is not None]
    for item in _ring_kv(*args, **kwargs):
        with torch.profiler.record_function(f"{STEP}{item[0]} {phase}"):
            yield item


def measured_kernels(
    run, device, calls: int = 1
) -> tuple[list[tuple[str, int, float]], float, float, dict[tuple[int, str], float]]:
    """run()'s kernels by device time under torch.profiler (on the CPU: its operators by CPU
    time), after one call outside the profile, per call over `calls` calls profiled in a row
    (one call's figures move with the GPU's clock: at 512K one rank's single call came out
    12-16% slow in every kernel); then from one profile with the host's events
    (common.profiled_kernels' split) the total, the part of it that the replayed transfers took
    (TRANSFER), and {(step, phase): the part inside that ring step's forward or backward less
    its transfers}: one profile for every figure that is subtracted from another, since the
    copies beside the kernels last longer or shorter from run to run (one rank's in one run
    took 1.26 ms in the first profile and 0.23 in the second, which showed as a millisecond
    outside the steps)."""
    run()
    with mock.patch.object(ring_module, "_ring_kv", _labelled_ring_kv):
        kernels, split = profiled_kernels(
            run, device, calls, blocks=lambda name: name == TRANSFER or name.startswith(STEP)
        )
    kernels = [(name, n // calls, ms / calls) for name, n, ms in kernels]
    steps = {}
    for name, ms in split.items():
        if name is not None and name.startswith(STEP):
            step, phase = name[len(STEP) :].split()
            steps[int(step), phase] = ms / calls
    return kernels, sum(split.values()) / calls, split.get(TRANSFER, 0.0) / calls, steps


def print_kernel_times(kernels, label: str, per: int = 1, total_ms: float = 0.0, transfer_ms: float = 0.0) -> None:
    """One line: total_ms (measured_kernels' total) and the six largest of `kernels` (from
    measured_kernels' first profile), each divided by `per`, and the replayed transfers' share
    of the total."""
    print(
        f"  {label}: {total_ms / per:.2f} ms"
        + (f" (the replay's transfers {transfer_ms / per:.2f})" if transfer_ms else "")
        + ": "
        + ", ".join(f"{name[:28]} x{n} {ms / per:.2f}" for name, n, ms in kernels[:6]),
        flush=True,
    )


def print_kernels(q, k, v, do, cu, layout, world, window, chunks, label, calls=1):
    """Each rank's replayed forward+backward: its kernels (print_kernel_times); returns each
    rank's kernels' summed device time, its replayed transfers' part of it, and {phase: its
    device time inside each ring step's forward or backward less the transfers, a list over
    the steps 0..world-1 (0.0 for a step that does not run)}, ms."""
    totals, transfers, by_step = [], [], []
    for r in range(world):
        run = replay_rank(q, k, v, do, cu, layout, r, world, window, True, chunks)
        kernels, total_ms, transfer_ms, steps = measured_kernels(run, q.device, calls)
        print_kernel_times(kernels, f"[{label}] rank {r}", total_ms=total_ms, transfer_ms=transfer_ms)
        totals.append(total_ms)
        transfers.append(transfer_ms)
        by_step.append({phase: [steps.get((s, phase), 0.0) for s in range(world)] for phase in PHASES})
    return totals, transfers, by_step


def measure(args, device, dtype):
    rows = []
    kernels = itertools.product(args.documents_forward, args.documents_backward, args.totals)
    for documents_forward, documents_backward, total in kernels:
        # the single-GPU call takes the same kernels
        with common_documents_forward(documents_forward), common_documents_backward(documents_backward):
            rows += measure_total(args, device, dtype, total, documents_forward, documents_backward)
    return rows


# the ringflash.balance constants the options of these names vary (--balance-slack etc.), each
# held over its variant's whole replay: the constant, its type, what it sets
BALANCE_KNOBS = {
    "balance_slack": (
        "BALANCE_SLACK", float,
        "how far above an equal share a whole document may leave a rank: more keeps more documents whole, fewer cut "
        "into small pieces",
    ),
    "polish_moves": ("POLISH_MOVES", int, "at most this many moves improve a bounded window's deal; 0: the deal alone"),
    "neighbour_pair_cost": (
        "NEIGHBOUR_PAIR_COST", float, "the polish prices a neighbour's pair at this many of a rank's own",
    ),
    "max_reach": (
        "MAX_REACH", int,
        "a bounded window's pieces down to the window / this where a rank's share is a few windows: a query then "
        "reaches up to this many pieces away; 1: window-long pieces",
    ),
    "crop_step_calls": (
        "CROP_STEP_CALLS", int,
        "1: a ring step's per-row-bounds call over the rows and keys that see each other only; 0: over every row",
    ),
    "gather_max_steps": (
        "GATHER_MAX_STEPS", int,
        "a ring of 2 to this many steps computes each rank's attention in one call once every block has come; "
        "0: never",
    ),
    "forward_group_steps": (
        "FORWARD_GROUP_STEPS", int,
        "the forward computes the blocks of its steps after the first in calls over this many at once; 1: a call "
        "a step",
    ),
}  # fmt: skip


def add_balance_knob_args(ap: argparse.ArgumentParser) -> None:
    """--balance-slack etc. (BALANCE_KNOBS): each takes variants of its ringflash.balance constant."""
    for name, (constant, kind, what) in BALANCE_KNOBS.items():
        ap.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            nargs="+",
            help=f"variants of ringflash.balance.{constant} ({what})",
        )


def balance_variants(args) -> list[tuple[dict, dict]]:
    """Every combination of the values add_balance_knob_args' options were given (an option not
    given: its constant as it is): ({option name: value}, {constant: value}, the latter for
    mock.patch.multiple(ringflash.balance, ...))."""
    defaults = {name: getattr(ringflash.balance, constant) for name, (constant, _, _) in BALANCE_KNOBS.items()}
    variants = []
    for values in itertools.product(*(getattr(args, name, None) or [None] for name in BALANCE_KNOBS)):
        knobs = {name: defaults[name] if x is None else x for name, x in zip(BALANCE_KNOBS, values)}
        variants.append((knobs, {BALANCE_KNOBS[name][0]: x for name, x in knobs.items()}))
    return variants


# --layouts: how the documents are laid out over the ranks ("few-ranks": an experiment)
LAYOUTS = {
    "balanced": ringflash.balanced_layout,
    "document-zigzag": ringflash.balance.document_zigzag_layout,
    "few-ranks": few_rank_layout,
    "two-ranks": functools.partial(few_rank_layout, ranks=2, cost="programs"),
}


def packed_batch(args, total, device, dtype):
    """The replayed batch: the long-tailed document mix of `total` tokens (args.seed), its
    cu_seqlens as a list and as an int32 tensor, and q, k, v, dO (total, heads, head_dim) from a
    generator seeded alike everywhere (args.heads / kv_heads / head_dim); and the attention's
    window_size (causal; args.window: a causal window of that many keys)."""
    lengths = document_lengths("longtail", total, args.seed)
    cu_list = [0, *np.cumsum(lengths).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda h: torch.randn(total, h, args.head_dim, device=device, dtype=dtype, generator=g)  # noqa: E731
    q, k, v, do = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
    window = (-1, -1) if args.window is None else (args.window - 1, 0)
    return lengths, cu_list, cu, (q, k, v, do), window


def measure_total(args, device, dtype, total, documents_forward, documents_backward):
    rows = []
    label = f"{documents_forward} fwd, {documents_backward} bwd"
    lengths, cu_list, cu, (q, k, v, do), window = packed_batch(args, total, device, dtype)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def single():
        qg.grad = kg.grad = vg.grad = None
        ringflash.flash_attn_varlen_func(qg, kg, vg, cu, cu, causal=True, window_size=window).backward(do)

    single_ms = timed(single, device, args.repeats, args.calls)
    single_device_ms = single_forward_device_ms = None

    def single_forward():
        with torch.no_grad():
            ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True, window_size=window)

    if args.kernels:  # the one-GPU call's kernels over P, beside each rank's below
        single_kernels, single_device_ms, _, _ = measured_kernels(single, device, args.kernel_calls)
        # its forward alone: what a rank's step forwards (rank_step_forward_ms) add up against
        single_forward_device_ms = measured_kernels(single_forward, device, args.kernel_calls)[1]
        for world in args.worlds:
            print_kernel_times(single_kernels, f"[{label}] one GPU / {world}", per=world, total_ms=single_device_ms)
    variants = itertools.product(
        args.layouts,
        args.worlds,
        balance_variants(args),
        args.own_call_work_log2 or [None],
        args.grad_chunks or [None],
        args.grad_accum_dtypes or [None],
    )
    defaults = {name: getattr(ringflash.balance, constant) for name, (constant, _, _) in BALANCE_KNOBS.items()}
    for layout_name, world, (knobs, constants), own_log2, chunks, accum_name in variants:
        accum = {None: None, "float32": torch.float32, "input": dtype}[accum_name]
        own = ringflash.balance.OWN_CALL_WORK if own_log2 is None else 2.0**own_log2
        # the balance constants of the variant hold for its whole replay: the layout's build and
        # every ring call's step plans (OWN_CALL_WORK, CROP_STEP_CALLS)
        with mock.patch.multiple(ringflash.balance, OWN_CALL_WORK=own, **constants):
            with cuts_aligned(args.align, args.align_min_piece):
                layout = LAYOUTS[layout_name](cu_list, world, causal=True, window_size=window)
            per_rank, inline = (
                [
                    timed(
                        replay_rank(q, k, v, do, cu, layout, r, world, window, overlap, chunks, accum),
                        device,
                        args.repeats,
                        args.calls,
                    )
                    for r in range(world)
                ]
                if overlap or not args.no_inline
                else None
                for overlap in (True, False)
            )
            rank_device = rank_compute = transfers = lockstep = dependent = None
            by_step = {}  # "both" and each phase: [rank][step] ms
            step_uneven_device = {}  # ...and each step's busiest rank over its mean rank
            if args.kernels:
                rank_device, transfers, phased = print_kernels(
                    q, k, v, do, cu, layout, world, window, chunks, label, args.kernel_calls
                )
                rank_compute = [t - x for t, x in zip(rank_device, transfers)]
                by_step["both"] = [[f + b for f, b in zip(r["forward"], r["backward"])] for r in phased]
                by_step.update({phase: [r[phase] for r in phased] for phase in PHASES})
                for name, ranks in by_step.items():
                    per_step = [[ranks[r][s] for r in range(world)] for s in range(world)]
                    step_uneven_device[name] = [max(w) / statistics.mean(w) if any(w) else None for w in per_step]
                # ranks in lockstep (each step of the forward and of the backward waits for its slowest
                # rank), less the transfers: the sum over those steps of the busiest rank's time inside
                # it, plus the most any rank spends outside the steps (the call's set-up and finish)
                steps = by_step["both"]
                outside = [c - sum(steps[r]) for r, c in enumerate(rank_compute)]
                lockstep = max(outside) + sum(
                    max(by_step[phase][r][s] for r in range(world)) for phase in PHASES for s in range(world)
                )
                # ...and by the ring's own dependencies (common.ring_time) from each rank's measured
                # steps, forward and backward, its time outside the steps added after them
                dependent = dependent_ring_ms(by_step["forward"], by_step["backward"], rank_compute)
            work = [sum(layout.work(r, s) for s in range(world)) for r in range(world)]
            step_work = [[layout.work(r, s) for r in range(world)] for s in range(world)]
            step_uneven = max(max(w) / statistics.mean(w) for w in step_work if any(w))
            hops = layout.hops - 1
            # every document cut in 2P zigzag pieces: each rank holds total / P tokens, and every
            # step has work, so P - 1 hops each send that shard's K/V
            zigzag_bytes = (world - 1) * total // world * args.kv_heads * args.head_dim * 2 * q.element_size()
            row = dict(
                layout=layout_name,
                total=total,
                world=world,
                docs=len(lengths),
                window=args.window,
                single_ms=single_ms,
                rank_ms=per_rank,
                max_over_mean=max(per_rank) / statistics.mean(per_rank),
                efficiency=single_ms / world / max(per_rank),
                own_call_work=own,
                **knobs,
                grad_chunks=chunks,
                grad_accum_dtype=accum_name,
                documents_forward=documents_forward,
                documents_backward=documents_backward,
                rank_ms_inline_copies=inline,
                efficiency_inline_copies=inline and single_ms / world / max(inline),
                predicted_max_over_mean=max(work) / statistics.mean(work),
                predicted_step_max_over_mean=step_uneven,
                hops=hops,
                bytes_sent_per_rank=kv_bytes_sent(layout, args.kv_heads, args.head_dim, q.element_size()),
                zigzag_per_doc_bytes_per_rank=zigzag_bytes,
                local_lens=[layout.local_len(r) for r in range(world)],
                # --kernels: the same by the kernels' summed device time (no host time, no gaps)
                rank_device_ms=rank_device,
                device_max_over_mean=rank_device and max(rank_device) / statistics.mean(rank_device),
                device_efficiency=rank_device and single_device_ms / world / max(rank_device),
                # ...and without the replay's stand-ins for the network (TRANSFER)
                rank_transfer_ms=transfers,
                device_max_over_mean_less_transfers=rank_compute and max(rank_compute) / statistics.mean(rank_compute),
                device_efficiency_less_transfers=rank_compute and single_device_ms / world / max(rank_compute),
                # ...and with the ranks in lockstep: each step as long as its busiest rank's
                device_efficiency_lockstep=lockstep and single_device_ms / world / lockstep,
                # ...and with each step waiting only for the block it computes on (common.ring_time)
                device_efficiency_ring_dependencies=dependent and single_device_ms / world / dependent,
                # ...and inside each ring step, forward and backward together, then apart: [rank][step]
                # ms, and each step's max/mean over the ranks
                rank_step_device_ms=by_step.get("both"),
                device_step_max_over_mean=step_uneven_device.get("both"),
                **{f"rank_step_{phase}_ms": by_step.get(phase) for phase in PHASES},
                single_forward_device_ms=single_forward_device_ms,
                **{f"device_step_max_over_mean_{phase}": step_uneven_device.get(phase) for phase in PHASES},
            )
            rows.append(row)
            print(
                f"S={total:>7} P={world} docs={len(lengths):>3} window={args.window}"
                + ("" if layout_name == "balanced" else f" layout={layout_name}")
                + ": ranks "
                + " ".join(f"{t:.2f}" for t in per_rank)
                + f" ms; max/mean {row['max_over_mean']:.3f} (pred {row['predicted_max_over_mean']:.3f}, "
                f"step {step_uneven:.3f}); single/P {single_ms / world:.2f} ms, eff {row['efficiency']:.3f}"
                + (f" (inline {row['efficiency_inline_copies']:.3f}); " if inline else "; ")
                + f"own calls from 2^{math.log2(own):.0f}"
                + "".join(f", {name.replace('_', ' ')} {x}" for name, x in knobs.items() if x != defaults[name])
                + ("" if chunks is None else f", grad_chunks {chunks}")
                + ("" if accum_name is None else f", grad_accum_dtype {accum_name}")
                + f"; documents {label}"
                + (
                    ""
                    if rank_device is None
                    else f"; by device time max/mean {row['device_max_over_mean']:.3f}, "
                    f"eff {row['device_efficiency']:.3f}"
                    f" (less the transfers: max/mean {row['device_max_over_mean_less_transfers']:.3f}, "
                    f"eff {row['device_efficiency_less_transfers']:.3f}"
                    + f", in lockstep {row['device_efficiency_lockstep']:.3f}"
                    + f", by the ring's dependencies {row['device_efficiency_ring_dependencies']:.3f}"
                    + "; per step max/mean "
                    + "; ".join(
                        f"{name} " + " ".join("-" if u is None else f"{u:.3f}" for u in uneven)
                        for name, uneven in step_uneven_device.items()
                    )
                    + ")"
                )
                + f"; hops {hops}, "
                f"{row['bytes_sent_per_rank'] / 2**20:.1f} MiB sent per rank (zigzag per document "
                f"{zigzag_bytes / 2**20:.1f})",
                flush=True,
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=None, help="a causal window of this many keys")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layouts",
        nargs="+",
        default=["balanced"],
        choices=list(LAYOUTS),
        help="variants: ringflash.balanced_layout, or every document cut over every rank as the context-parallel "
        "peers cut packed documents (ringflash.balance.document_zigzag_layout)",
    )
    add_align_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1, help="calls in a row per timing (see the docstring)")
    ap.add_argument(
        "--own-call-work-log2",
        type=float,
        nargs="+",
        help="variants of ringflash.balance.OWN_CALL_WORK (log2; inf: every document in the per-row-bounds call)",
    )
    add_balance_knob_args(ap)
    ap.add_argument("--grad-chunks", type=int, nargs="+", help="variants of grad_chunks (default: the ring's own)")
    ap.add_argument(
        "--grad-accum-dtypes",
        nargs="+",
        choices=["float32", "input"],
        help="variants of grad_accum_dtype (default: the ring's own, float32); input: the inputs' "
        "16-bit dtype, which halves the travelling dK/dV's bytes at a precision cost",
    )
    ap.add_argument(
        "--documents-backward",
        nargs="+",
        default=["default"],
        choices=DOCUMENTS_BACKWARDS,
        help="variants: the packed documents' backward as configured, the fused Gluon kernel where it runs, "
        "or the two Triton passes",
    )
    ap.add_argument(
        "--documents-forward",
        nargs="+",
        default=["default"],
        choices=DOCUMENTS_FORWARDS,
        help="variants: the packed documents' forward as configured, the Gluon kernel wherever it runs (any keys "
        "per row), the Triton kernel, or as configured by the keys per row that sees a key (a neighbour's "
        "block: configs.GLUON_DOCUMENTS_SEEING_ROWS)",
    )
    ap.add_argument("--kernels", action="store_true", help="print each rank's kernels by device time (CUDA)")
    ap.add_argument(
        "--kernel-calls", type=int, default=1, help="--kernels: calls profiled in a row per rank, figures per call"
    )
    ap.add_argument("--no-inline", action="store_true", help="skip the inline-copies timing")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    args = ap.parse_args()
    if args.kernel_calls < 1:
        ap.error(f"--kernel-calls must be at least 1, got {args.kernel_calls}")
    device, dtype = bench_device(args.smoke)
    if args.smoke:
        args.totals, args.worlds, args.heads, args.kv_heads, args.head_dim, args.repeats = [512], [2], 2, 1, 16, 1
    print(f"packed ring replay on {device_name(device)}: H={args.heads}/{args.kv_heads}, D={args.head_dim}, {dtype}")
    rows = measure(args, device, dtype)
    if args.json:
        meta = result_meta(device, **dict(vars(args), json=None))
        write_json(args.json, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
