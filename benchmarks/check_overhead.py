"""What the ring's per-call rank-agreement check costs, on one device.

    python -m benchmarks.check_overhead --json benchmarks/results/check_overhead_h200.json
    python -m benchmarks.check_overhead --smoke          # tiny CPU run (CI keeps it working)

Every ring call first checks, in one small all_gather, that all ranks passed the same call
(ringflash.comm.agree_across_ranks). This times it as a model meets it: --layers attention
calls in a row (ringflash.flash_attn_func, B=1, causal, bf16 on a GPU), each followed by the
check, on the host clock over the whole row (one synchronize at the end), for
  none   no check
  nccl   the check over an NCCL group: a GPU all_gather read back by the host, which waits for
         every kernel queued before it (the queue drains at every layer)
  gloo   the check over a gloo group (CPU tensors; what ringflash.dist_env.init_from_env sets
         up beside NCCL): the GPU queue keeps running
overhead per call = (row time - none) / layers, in microseconds. One process: the groups have
one rank, so the collective runs but no network does; --pair adds the check's latency between
two processes of this host over gloo (CPU only), the network term at two ranks.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringflash
from benchmarks.common import device_name, host_seconds, result_meta, write_json
from ringflash import ring
from ringflash.comm import agree_across_ranks

FIELDS = dict.fromkeys(ring._FIELD_NAMES, 1)


def check(group, device):
    agree_across_ranks(group, FIELDS, None, "ring_flash_attn_func", device=device)


def row_seconds(layer, after, layers, repeats, device):
    """Median host seconds of `layers` x (layer(); after()), synchronized once at the end."""

    def step():
        layer()
        after()

    return host_seconds(step, device, calls=layers, repeats=repeats, warmup=layers) * layers


def single_process(args, device):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    groups = {"gloo": dist.new_group([0], backend="gloo")}
    if device.type == "cuda":
        groups["nccl"] = dist.new_group([0], backend="nccl")
    rows = []
    for S in args.seqlens:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (
            torch.randn(1, S, args.heads, args.head_dim, device=device, dtype=dtype, generator=g) for _ in range(3)
        )

        def layer():
            with torch.no_grad():
                ringflash.flash_attn_func(q, k, v, causal=True)

        base = row_seconds(layer, lambda: None, args.layers, args.repeats, device)
        row = {"seq_len": S, "layers": args.layers, "none_ms": base * 1e3}
        for name, group in groups.items():
            t = row_seconds(layer, lambda group=group: check(group, device), args.layers, args.repeats, device)
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_overhead_us"] = (t - base) / args.layers * 1e6
        # the check alone, nothing queued on the GPU
        for name, group in groups.items():
            t = row_seconds(lambda: None, lambda group=group: check(group, device), args.layers, args.repeats, device)
            row[f"{name}_alone_us"] = t / args.layers * 1e6
        rows.append(row)
    dist.destroy_process_group()
    return rows


def _pair_worker(rank, init_file, calls, result_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    for _ in range(20):
        check(None, cpu)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        check(None, cpu)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        Path(result_file).write_text(str(elapsed / calls))
    dist.destroy_process_group()


def pair_latency_us(calls: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        init_file, result = os.path.join(d, "init"), os.path.join(d, "result")
        mp.spawn(_pair_worker, args=(init_file, calls, result), nprocs=2)
        return float(Path(result).read_text()) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pair", action="store_true", help="also time the check between two gloo processes")
    ap.add_argument("--pair-calls", type=int, default=500)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.layers, args.repeats, args.pair_calls = [64], 2, 16, 4, 2, 20
    rows = single_process(args, device)
    pair = pair_latency_us(args.pair_calls) if args.pair else None
    print(f"check overhead on {device_name(device)}: {args.layers} layers, H={args.heads}, D={args.head_dim}, causal")
    names = [n for n in ("nccl", "gloo") if f"{n}_ms" in rows[0]]
    print(
        f"{'S':>7} {'none ms':>9} "
        + " ".join(f"{n + ' ms':>9} {n + ' us/call':>13} {n + ' alone us':>14}" for n in names)
    )
    for r in rows:
        cells = " ".join(f"{r[f'{n}_ms']:9.3f} {r[f'{n}_overhead_us']:13.1f} {r[f'{n}_alone_us']:14.1f}" for n in names)
        print(f"{r['seq_len']:7d} {r['none_ms']:9.3f} {cells}")
    if pair is not None:
        print(f"the check between two processes over gloo (CPU): {pair:.1f} us per call")
    if args.json:
        write_json(args.json, {"meta": result_meta(device), "rows": rows, "gloo_pair_us": pair})


if __name__ == "__main__":
    main()
