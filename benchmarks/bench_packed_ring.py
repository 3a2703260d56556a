"""Packed documents on the ring over the process group, layout by layout: the ring's own time,
network included, beside the one-GPU call on the whole batch over P.

    ringflash-run -m benchmarks.bench_packed_ring --layouts balanced two-ranks --json packed_ring.json
    ringflash-run --nproc 2 --backend gloo -m benchmarks.bench_packed_ring --smoke     # CPU, toy sizes

The document mix is packed_ring_replay's (long-tailed lengths, benchmarks.packed.document_lengths,
--seed), causal (--window W: a causal window of W keys). For each total and layout
(packed_ring_replay.LAYOUTS: the balanced layout, every document cut over every rank, and the
experimental few-rank cuts), every rank runs ring_flash_attn_varlen_func forward+backward on
its shard; the time is the median of --iters on each rank, then the slowest rank. Beside it each
rank runs flash_attn_varlen_func forward+backward on the whole batch (the same on every rank;
slowest rank, over P): ring efficiency = (one-GPU time / P) / ring time, what
packed_ring_replay's three device-time figures bracket on one GPU (the busiest rank, the ring's
dependencies, lockstep). Also printed: the bytes of K/V each rank sends (hops x the longest
shard's K/V). The ringflash.balance options of packed_ring_replay (--forward-group-steps,
--gather-max-steps, ...) vary those constants here too, each variant held over its layout's
build and its timed calls on every rank: what the replay on one GPU cannot show (a gathered
call's wait for its blocks) shows here.

    ringflash-run -m benchmarks.bench_packed_ring --layouts balanced --forward-group-steps 1 4
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from unittest import mock

import ringflash
from benchmarks.common import kv_bytes_sent, run_meta, start_ring, step_fn, timed_on_ranks, write_json
from benchmarks.packed_ring_replay import BALANCE_KNOBS, LAYOUTS, add_balance_knob_args, balance_variants, packed_batch
from ringflash import flash_attn_varlen_func, ring_flash_attn_varlen_func, shard
from ringflash.dist_env import close


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[131072])
    ap.add_argument("--layouts", nargs="+", default=["balanced", "two-ranks"], choices=list(LAYOUTS))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=None, help="a causal window of this many keys")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="toy sizes (CPU with gloo)")
    add_balance_knob_args(ap)
    args = ap.parse_args()
    rank, world, device, dtype = start_ring(args, "bench_packed_ring", timeout_s=900)
    if args.smoke:
        args.totals, args.heads, args.head_dim, args.iters, args.warmup = [1024], 2, 16, 2, 1
    args.kv_heads = args.kv_heads or args.heads
    args.batch = 1  # (run_meta's field: packed documents are one row)
    rows = []
    for total in args.totals:
        # the same batch on every rank (its generator seeded alike)
        lengths, cu_list, cu, (q, k, v, do), window = packed_batch(args, total, device, dtype)
        kw = dict(causal=True, window_size=window)
        whole = [t.detach().requires_grad_() for t in (q, k, v)]
        one_gpu = timed_on_ranks(
            step_fn(lambda: flash_attn_varlen_func(*whole, cu, cu, **kw), whole, do, "fwd+bwd"),
            iters=args.iters, warmup=args.warmup, device=device,
        )  # fmt: skip
        for name, (knobs, constants) in itertools.product(args.layouts, balance_variants(args)):
            # the variant's constants hold for its layout's build and every timed call
            with mock.patch.multiple(ringflash.balance, **constants):
                try:
                    layout = LAYOUTS[name](cu_list, world, **kw)
                except ValueError as e:  # (the experimental cuts take causal attention without a window only)
                    if rank == 0:
                        print(f"S={total} P={world} layout={name}: skipped ({e})", flush=True)
                    continue
                local = [shard(t, layout=layout, dim=0).detach().requires_grad_() for t in (q, k, v)]
                local_do = shard(do, layout=layout, dim=0)

                def call():
                    return ring_flash_attn_varlen_func(*local, cu, layout=layout, **kw)

                ring = timed_on_ranks(
                    step_fn(call, local, local_do, "fwd+bwd"), iters=args.iters, warmup=args.warmup, device=device
                )
            row = dict(
                total=total,
                world=world,
                layout=name,
                **knobs,
                docs=len(lengths),
                window=args.window,
                ring_ms=ring,
                one_gpu_ms=one_gpu,
                efficiency=one_gpu / world / ring,
                hops=layout.hops - 1,
                bytes_sent_per_rank=kv_bytes_sent(layout, args.kv_heads, args.head_dim, q.element_size()),
                local_lens=[layout.local_len(r) for r in range(world)],
            )
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        meta = run_meta(args, world, device, dtype, seed=args.seed, window=args.window)
        write_json(args.json, {"meta": meta, "rows": rows})
        print(f"\npacked ring over the process group, P={world}, H={args.heads}/{args.kv_heads}, D={args.head_dim}, "
              f"{dtype}, forward+backward")  # fmt: skip
        varied = [n for n in BALANCE_KNOBS if getattr(args, n, None)]  # the constants given on the command line
        print(f"{'S':>7} {'layout':>16} {' '.join(varied)} | {'ring ms':>9} {'one GPU / P':>11} {'eff':>6} | "
              f"{'hops':>4} {'MiB sent':>9}")  # fmt: skip
        for r in rows:
            knob_values = " ".join(f"{r[n]!s:>{len(n)}}" for n in varied)
            print(
                f"{r['total']:>7} {r['layout']:>16} {knob_values} | {r['ring_ms']:9.2f} "
                f"{r['one_gpu_ms'] / world:11.2f} {r['efficiency']:6.3f} | {r['hops']:>4} "
                f"{r['bytes_sent_per_rank'] / 2**20:9.1f}"
            )
    close()


if __name__ == "__main__":
    main()
