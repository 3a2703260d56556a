"""How evenly ringflash.balanced_layout spreads the visible work, per ring step: a table over
many random document mixes, masks and ring sizes. Pure Python, CPU, no communication.

    python -m benchmarks.layout_balance                       # 40 mixes per family, worlds 2..16
    python -m benchmarks.layout_balance --mixes 10 --worlds 2 3 4 8 --json balance.json

For each layout L it takes w[s][r] = L.work(r, s), the visible (query, key) pairs rank r
computes at ring step s, and reports, worst over the mixes:
  step:  max over the steps with work of max_r w[s][r] / mean_r w[s][r] (the ring waits for the
         slowest rank at every step), with the step where it is worst;
  total: max_r sum_s w[s][r] / mean_r sum_s w[s][r];
  time:  sum_s max_r w[s][r] / (sum of all work / P): the ring's compute time against a
         perfectly even split (1.00 is ideal);
and L.hops (the ring steps run; 1: no K/V travels), min-max over the mixes and summed, so two
versions can be compared layout by layout (--json keeps every layout's figures).
Mixes (random.Random(seed)): tail: 40 lengths log-uniform in [1, 400] plus 0, 1 and 2000
tokens; wide: lengths log-uniform in [16, 8192] until 32768 tokens (the last one cut to fit);
long (only with --families long): benchmarks.packed's long tail, 128-32768 tokens until 131072
(numpy default_rng(seed)), the packed ring benchmarks' rows:

    python -m benchmarks.layout_balance --families long --masks "win(4095,0)" --worlds 4 8 --mixes 5
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from benchmarks.common import add_align_args, cuts_aligned, write_json
from benchmarks.packed import document_lengths
from ringflash import balanced_layout

MASKS = {  # name: (causal, window_size)
    "causal": (True, (-1, -1)),
    "full": (False, (-1, -1)),
    "win(31,0)": (True, (31, 0)),
    "win(100,0)": (True, (100, 0)),
    "win(31,31)": (False, (31, 31)),
    "win(-1,31)": (False, (-1, 31)),
    # a 4K sliding window (Mistral's) over the wide mix: a window as long as half a document and
    # as a rank's share, where window-long pieces are coarse
    "win(4095,0)": (True, (4095, 0)),
}


def mix(family: str, seed: int) -> list[int]:
    if family == "long":
        return document_lengths("longtail", 131072, seed)
    rng = random.Random(seed)
    if family == "tail":
        return [int(400 ** rng.random()) for _ in range(40)] + [0, 1, 2000]
    lengths = []
    while sum(lengths) < 32768:
        lengths.append(int(math.exp(rng.uniform(math.log(16), math.log(8192)))))
    lengths[-1] -= sum(lengths) - 32768
    return [n for n in lengths if n > 0]


def cu_of(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def measure(L) -> dict:
    P = L.world
    w = [[L.work(r, s) for r in range(P)] for s in range(P)]
    steps = [(max(ws) * P / sum(ws), s) for s, ws in enumerate(w) if sum(ws)]
    totals = [sum(w[s][r] for s in range(P)) for r in range(P)]
    everything = sum(totals)
    return {
        "step": max(steps)[0],
        "worst_step": max(steps)[1],
        "total": max(totals) * P / everything,
        "time": sum(max(ws) for ws in w) * P / everything,
        "hops": L.hops,
    }


def table(args) -> list[dict]:
    rows = []
    for name in args.masks:
        causal, window_size = MASKS[name]
        for world in args.worlds:
            runs = []
            for family in args.families:
                for seed in range(args.mixes):
                    with cuts_aligned(args.align, args.align_min_piece):
                        L = balanced_layout(cu_of(mix(family, seed)), world, causal=causal, window_size=window_size)
                    runs.append({"family": family, "seed": seed, **measure(L)})
            worst = max(runs, key=lambda x: x["step"])
            rows.append(
                {
                    "mask": name,
                    "world": world,
                    "step": worst["step"],
                    "worst_step": worst["worst_step"],
                    "total": max(x["total"] for x in runs),
                    "time": max(x["time"] for x in runs),
                    "hops_min": min(x["hops"] for x in runs),
                    "hops_max": max(x["hops"] for x in runs),
                    "hops_sum": sum(x["hops"] for x in runs),
                    "runs": runs,
                }
            )
    return rows


def timing(lengths, world: int, mask: str) -> float:
    """Best of 3 wall-clock seconds of one balanced_layout call."""
    causal, window_size = MASKS[mask]
    cu, best = cu_of(lengths), math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        balanced_layout(cu, world, causal=causal, window_size=window_size)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", type=int, default=40, help="random mixes per family (default 40)")
    ap.add_argument("--worlds", type=int, nargs="+", default=list(range(2, 17)))
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    ap.add_argument("--families", nargs="+", default=["tail", "wide"], choices=["tail", "wide", "long"])
    ap.add_argument("--json", type=Path, default=None)
    add_align_args(ap)
    args = ap.parse_args(argv)
    rows = table(args)
    names = " and ".join(args.families)
    print(f"worst over {len(args.families) * args.mixes} mixes per row ({names}, {args.mixes} seeds each)")
    print(f"{'mask':<11} {'P':>3} {'step (at)':>12} {'total':>7} {'time':>6}  hops min-max (sum)")
    for x in rows:
        at = f"{x['step']:.3f} ({x['worst_step']})"
        hops = f"{x['hops_min']}-{x['hops_max']} ({x['hops_sum']})"
        print(f"{x['mask']:<11} {x['world']:>3} {at:>12} {x['total']:>7.3f} {x['time']:>6.3f}  {hops}")
    rng = random.Random(0)
    tail = [int(400 ** rng.random()) for _ in range(2000)] + [2000]  # one long one cut, the rest whole
    wide = [int(math.exp(rng.uniform(math.log(16), math.log(8192)))) for _ in range(2000)]  # many cut
    for name, lengths in (("tail", tail), ("wide", wide)):
        for world in (8, 16):
            secs = ", ".join(f"{m} {timing(lengths, world, m):.3f} s" for m in ("causal", "win(31,0)", "win(31,31)"))
            print(f"balanced_layout, {len(lengths)} {name} documents on {world} ranks: {secs}")
    # the slowest polish found: long documents cut over many ranks under a short window
    long = document_lengths("longtail", 524288, 0)
    secs = ", ".join(f"{m} {timing(long, 32, m):.3f} s" for m in ("causal", "win(31,31)", "win(100,0)"))
    print(f"balanced_layout, {len(long)} long documents (512K tokens) on 32 ranks: {secs}")
    # and where a 4K window is a few rank shares' worth, so that pieces shorter than it are tried
    for total, world in ((131072, 16), (524288, 64)):
        long = document_lengths("longtail", total, 0)
        secs = timing(long, world, "win(4095,0)")
        print(f"balanced_layout, {len(long)} long documents ({total // 1024}K tokens) on {world} ranks: "
              f"win(4095,0) {secs:.3f} s")  # fmt: skip
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
