"""Where a packed-document call's time goes on one GPU: wall time per call beside the kernels'
own time (torch.profiler), for many short documents and the long-tailed mix.

    python -m benchmarks.profile_packed > profile_packed.txt
    python -m benchmarks.profile_packed --cases 65536:short --callers   # which op or autograd node calls each
    python -m benchmarks.profile_packed --cases 16384:fixed:16384 --head-dim 256   # one causal document

Diagnostic, not a benchmark: the profiler's tables are printed as they come. Wall time well
above the kernels' time means host work (checks, mask building, launches) decides the speed.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import ringflash
from benchmarks.packed import document_lengths


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["16384:short", "65536:short", "16384:longtail"], help="TOTAL:MIX")
    ap.add_argument("--callers", action="store_true", help="also the device time by enclosing operators")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    dev, H, D = "cuda", 32, args.head_dim
    for case in args.cases:
        total, mix = int(case.split(":")[0]), case.split(":", 1)[1]
        lengths = document_lengths(mix, total, 0)
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=dev)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(total, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for mode in ("fwd", "fwd+bwd"):

            def run():
                if mode == "fwd":
                    with torch.no_grad():
                        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
                else:
                    q.grad = k.grad = v.grad = None
                    ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True).backward(do)

            for _ in range(3):
                run()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                run()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 20 * 1e3
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    run()
                torch.cuda.synchronize()
            table = prof.key_averages()
            print(f"=== total {total} mix {mix} docs {len(lengths)} mode {mode}: wall {wall:.3f} ms per call")
            print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
            print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
            if args.callers:
                print_callers(prof)


def callers(prof, cuda: bool = True, depth: int = 4) -> list[tuple[str, float]]:
    """The operators that took time, each with the chain of operators and autograd nodes around
    it (the profiler's parents, innermost first), by their self device time (us, summed over the
    profiled calls; with cuda=False their self CPU time), most first: which layer asked for a
    copy or a fill. (Python stacks, with_stack=True, came back empty for these events on one
    H200's torch.)"""
    spent = collections.Counter()
    for e in prof.events():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, parent = [e.name], e.cpu_parent
        while parent is not None and len(chain) <= depth:
            chain.append(parent.name)
            parent = parent.cpu_parent
        spent[" < ".join(chain)] += us
    return spent.most_common()


def print_callers(prof) -> None:
    for chain, us in callers(prof)[:15]:
        print(f"  {us / 1e3:9.3f} ms  {chain}")


if __name__ == "__main__":
    main()
