"""The longest sequence whose ring attention forward+backward fits, and its peak memory per GPU.

    ringflash-run -m benchmarks.bench_ring_maxlen --json benchmarks/results/maxlen_2xh200_mha.json
    ringflash-run -m benchmarks.bench_ring_maxlen --kv-heads 8 --json ...         # GQA 32/8
    ringflash-run -m benchmarks.bench_ring_maxlen --grad-accum input ...  # 16-bit gradient accumulators
    ringflash-run --nproc 2 --backend gloo -m benchmarks.bench_ring_maxlen --smoke  # CPU

Causal, zigzag, bf16, B=1. It runs one forward+backward at each of --probe total lengths and
records every rank's peak allocated memory, fits peak = a + b * S_local over the probes (memory
must grow linearly with S; the fit's worst relative residual is printed), predicts the longest
S (a multiple of --step) whose peak stays under --fraction of the GPU's memory, and runs that
length once to confirm it, reporting its peak and time, unless that run would take longer than
--time-limit seconds (predicted from the longest probe, time ~ S^2): then the prediction is
reported as not confirmed. It does not search by running out of
memory: on NCCL one rank's OOM would leave the other waiting in the ring until the timeout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import add_shape_args, rank_inputs, run_meta, start_ring, write_json
from ringflash import ring_flash_attn_func
from ringflash.dist_env import close


def run_once(args, S, rank, world, device, dtype):
    """One forward+backward at total length S; returns (max peak GiB over ranks, seconds)."""
    q, k, v, do = rank_inputs(args, S // world, rank, device, dtype)
    accum = dtype if args.grad_accum == "input" else None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t0 = time.perf_counter()
    ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", grad_accum_dtype=accum).backward(do)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    stats = torch.tensor([peak / 2**30, seconds], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    del q, k, v, do
    if cuda:
        torch.cuda.empty_cache()
    return stats[0].item(), stats[1].item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--probe",
        type=int,
        nargs="+",
        default=[131072, 262144, 524288],
        help="total lengths measured for the linear fit",
    )
    add_shape_args(ap)
    ap.add_argument("--fraction", type=float, default=0.92, help="share of the GPU memory the peak may reach")
    ap.add_argument("--step", type=int, default=65536, help="the predicted length is a multiple of this")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=240.0,
        help="skip the confirming run when it is predicted to take longer (seconds)",
    )
    ap.add_argument(
        "--grad-accum",
        choices=["float32", "input"],
        default="float32",
        help="the ring's gradient accumulators: float32 (default) or the inputs' dtype",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="toy sizes (CPU with gloo), no prediction run")
    args = ap.parse_args()
    rank, world, device, dtype = start_ring(args, "bench_ring_maxlen", timeout_s=300)
    if args.smoke:
        args.probe, args.heads, args.head_dim = [32 * world, 64 * world], 2, 16
    args.kv_heads = args.kv_heads or args.heads
    rows = []
    for S in args.probe:
        peak, sec = run_once(args, S, rank, world, device, dtype)
        rows.append({"S": S, "S_local": S // world, "peak_gib": peak, "seconds": sec, "probe": True})
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows}
    if device.type == "cuda" and len(rows) >= 2:
        x = torch.tensor([r["S_local"] for r in rows], dtype=torch.float64)
        y = torch.tensor([r["peak_gib"] for r in rows], dtype=torch.float64)
        A = torch.stack([torch.ones_like(x), x], 1)
        a, b = torch.linalg.lstsq(A, y[:, None]).solution[:, 0].tolist()
        residual = ((A @ torch.tensor([a, b], dtype=torch.float64) - y).abs() / y).max().item()
        capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
        unit = args.step
        S_max = int((args.fraction * capacity - a) / b * world) // unit * unit
        result.update(
            fit={"gib_fixed": a, "gib_per_1k_tokens_local": b * 1024, "max_rel_residual": residual},
            capacity_gib=capacity,
            fraction=args.fraction,
            predicted_S=S_max,
        )
        if rank == 0:
            print(json.dumps({k: result[k] for k in ("fit", "capacity_gib", "predicted_S")}), flush=True)
        longest = rows[-1]
        predicted_seconds = longest["seconds"] * (S_max / longest["S"]) ** 2
        result["predicted_seconds"] = predicted_seconds
        if predicted_seconds <= args.time_limit:
            peak, sec = run_once(args, S_max, rank, world, device, dtype)
            rows.append(
                {
                    "S": S_max,
                    "S_local": S_max // world,
                    "peak_gib": peak,
                    "seconds": sec,
                    "probe": False,
                    "predicted_peak_gib": a + b * (S_max // world),
                }
            )
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
        elif rank == 0:
            print(
                f"S={S_max} not run: predicted {predicted_seconds:.0f} s > --time-limit {args.time_limit:.0f} s; "
                f"predicted peak {a + b * (S_max // world):.2f} GiB per GPU",
                flush=True,
            )
    if rank == 0:
        result["meta"] = run_meta(args, world, device, dtype, layout="zigzag", causal=True, grad_accum=args.grad_accum)
        write_json(args.json, result)
        print(
            f"\nring forward+backward, causal zigzag, P={world}, H={args.heads}/{args.kv_heads}, "
            f"D={args.head_dim}, {dtype}, {args.grad_accum} gradient accumulators: peak allocated per GPU "
            f"(max over ranks)"
        )
        print(f"{'S':>9} {'S_local':>9} {'peak GiB':>9} {'GiB/1K local':>12} {'seconds':>8}")
        for r in rows:
            print(
                f"{r['S']:>9} {r['S_local']:>9} {r['peak_gib']:9.2f} {r['peak_gib'] / r['S_local'] * 1024:12.4f} "
                f"{r['seconds']:8.1f}" + ("" if r["probe"] else "  <- longest predicted to fit")
            )
    close()


if __name__ == "__main__":
    main()
