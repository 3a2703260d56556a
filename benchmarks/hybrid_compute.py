"""One GPU: a hybrid rank's compute, at Hq / U heads and S / R tokens, replayed (no network).

    python -m benchmarks.hybrid_compute --json benchmarks/results/hybrid_compute_h200.json
    python -m benchmarks.hybrid_compute --smoke                     # CPU, toy sizes

With a head group of U ranks and a ring of R, each rank runs the ring's schedule on Hq / U
query heads (and their kv heads) for the S / R tokens of its ring position. The all-to-all
cannot be shown on one GPU, but this compute can: ringflash.testing.replay_ring plays ring
rank 0 (zigzag, causal: every rank does the same work) on full tensors of those heads, the
K/V blocks copied in place of received. Its TFLOP/s is the kernel rate the cost model
(ringflash.cost, benchmarks/hybrid_cost.py --kernel-tflops) should use at that split, beside
the model's own prediction of the compute term at its default rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import attention_flops, bench_device, bench_ms, write_json
from ringflash.cost import hybrid_step_time, kv_heads_per_rank
from ringflash.testing import replay_ring


def measure(S, Hq, Hkv, D, R, U, *, device, dtype, causal=True):
    hq, hkv = Hq // U, kv_heads_per_rank(Hq, Hkv, U)
    g = torch.Generator(device=device).manual_seed(0)
    q, do = (torch.randn(1, S, hq, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(1, S, hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    ms = bench_ms(lambda: replay_ring(q, k, v, do, world=R, causal=causal, ranks=[0]), device)
    flops = attention_flops(1, hq, S, D, causal, "fwd+bwd") / R  # rank 0's share
    model = hybrid_step_time(S, Hq, Hkv, D, R, U, causal=causal).compute
    return {
        "S": S,
        "R": R,
        "U": U,
        "q_heads": hq,
        "kv_heads": hkv,
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "model_ms": model * 1e3,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1 << 18)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rings", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--head-groups", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.rings, args.head_groups = 64, 4, 2, 16, [2], [1, 2, 4]
    device, dtype = bench_device(args.smoke)
    rows = []
    print(f"per-rank compute, replayed on {device} ({dtype}); model_ms: ringflash.cost at 440 TFLOP/s")
    print(f"{'S':>8} {'R':>3} {'U':>2} {'hq':>3} {'hkv':>3} {'ms':>9} {'TFLOP/s':>8} {'model_ms':>9}")
    for R in args.rings:
        for U in args.head_groups:
            r = measure(args.seq, args.heads, args.kv_heads, args.head_dim, R, U, device=device, dtype=dtype)
            rows.append(r)
            print(
                f"{r['S']:>8} {R:>3} {U:>2} {r['q_heads']:>3} {r['kv_heads']:>3} {r['ms']:>9.2f} "
                f"{r['tflops']:>8.2f} {r['model_ms']:>9.2f}"
            )
    write_json(Path(args.json) if args.json else None, {"args": vars(args), "device": device.type, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
