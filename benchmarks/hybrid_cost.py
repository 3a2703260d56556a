"""The hybrid split's cost model as a table: 1-64 nodes of 8 GPUs, each head-group size U.

    python -m benchmarks.hybrid_cost                          # defaults below
    python -m benchmarks.hybrid_cost --seq 4194304 --inter-gbps 25 --kernel-tflops 380
    python -m benchmarks.hybrid_cost --json benchmarks/results/hybrid_cost_model.json

For each node count and each U that splits the heads (U divides 8: a head group stays inside
a node), R = GPUs / U, it prints ringflash.cost.hybrid_step_time's prediction of one
forward+backward: compute, the exposed all-to-all and ring time, the total, the efficiency
(compute / total) and which U it recommends.

THIS IS A MODEL, NOT A MEASUREMENT: nothing here ran on several GPUs. Measured inputs: the
default kernel rate (440 TFLOP/s forward+backward, ringflash on one H200, causal, 16K-64K
tokens) and the order of the NVLink rate (two H200s, ~345 GB/s each way in a ring
send/recv). Modelled only: the InfiniBand rate (nominal 400 Gb/s per GPU), the all-to-all's
time (bytes / NVLink rate + latency, no contention), the hops' overlap with compute, and a
kernel rate that stays constant at the per-rank sizes (measure it with
benchmarks/hybrid_compute.py on one GPU and pass --kernel-tflops). The ringflash.cost
docstring lists the terms.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import write_json
from ringflash.cost import Links, recommend_head_group

NODES = (1, 2, 4, 8, 16, 32, 64)


def table(args) -> list[dict]:
    links = Links(args.intra_gbps, args.inter_gbps, args.latency_us * 1e-6)
    rows = []
    for nodes in args.nodes:
        best, times = recommend_head_group(
            args.seq,
            args.heads,
            args.kv_heads,
            args.head_dim,
            nodes * args.gpus_per_node,
            batch=args.batch,
            causal=not args.full,
            gpus_per_node=args.gpus_per_node,
            links=links,
            kernel_tflops=args.kernel_tflops,
        )
        for t in times:
            rows.append(
                {"nodes": nodes, **asdict(t), "total": t.total, "efficiency": t.efficiency, "best": t.U == best}
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1 << 20, help="the whole sequence's tokens (default 1M)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--full", action="store_true", help="non-causal (default causal)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    ap.add_argument("--intra-gbps", type=float, default=400.0, help="NVLink GB/s per direction per GPU")
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="network GB/s per GPU (400 Gb/s = 50)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="per all-to-all or ring hop")
    ap.add_argument("--kernel-tflops", type=float, default=440.0, help="local kernels, forward+backward")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = table(args)
    print(
        f"MODEL (not measured): S={args.seq} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"B={args.batch} {'full' if args.full else 'causal'}; NVLink {args.intra_gbps} GB/s, network "
        f"{args.inter_gbps} GB/s per GPU, kernels {args.kernel_tflops} TFLOP/s fwd+bwd"
    )
    print(f"{'nodes':>5} {'R':>4} {'U':>2} {'compute ms':>11} {'a2a ms':>8} {'ring ms':>8} {'total ms':>9} {'eff':>5}")
    for r in rows:
        print(
            f"{r['nodes']:>5} {r['R']:>4} {r['U']:>2} {r['compute'] * 1e3:>11.2f} {r['all_to_all'] * 1e3:>8.2f} "
            f"{r['ring_exposed'] * 1e3:>8.2f} {r['total'] * 1e3:>9.2f} {r['efficiency']:>5.2f}"
            + ("  <- recommended" if r["best"] else "")
        )
    write_json(Path(args.json) if args.json else None, {"args": vars(args), "model_only": True, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
