"""Where the tensors lie, and what it costs: one block forward and one block backward timed
with the same data at several addresses, round after round. A slow address that stays slow
in every round is placement (the tensors' memory); a spread that moves between rounds with
the address held is time (clocks, the card). benchmarks.mask_cost saw the same plain call on
the same data 6-15% apart between timings of one process, two-valued.

    python -m benchmarks.placement --head-dims 128 --seqlen 8192 --batch 4 --causal 0
    python -m benchmarks.placement --smoke        # tiny CPU run (CI keeps it working)

Parts, each timed at --candidates addresses (the others held at their first):
  fwd:out     the forward's output and row statistics
  fwd:in      q, k, v
  bwd:in      q, k, v, dO, the row statistics and delta
  bwd:grads   dK, dV and the blocked float32 dQ accumulator (ringflash.dq_sum)
The backward is the fused kernel's accumulating form (dQ into a caller's accumulator, dK and
dV added to), as a ring step runs it. Memory: about 7 + 12 x --candidates copies of q (21 GB
at the defaults).
A part's even candidates are allocations of their own; its odd ones views into one larger
buffer at offsets that are not multiples of a page (1 KiB steps). The table gives each
candidate's median over the rounds, its range, and its address modulo 2 MiB; a part's line
ends with the spread of the medians (max / min) beside the median spread within a candidate,
and a second line gives every timing in the order it ran, over the part's median. On one H100
the slow timings came in phases a few timings apart, fading over the run, whichever address
was timed: time, not placement, and --clocks showed the phases to be the SM clock's dips
(benchmarks/NOTES.md, "Our timings move between runs").
--clocks adds each timing's SM clock and power (nvidia-smi every 50 ms, one sampler a part),
the clocks in timing order, and the correlation of the ms with the clock's period:

    python -m benchmarks.placement --head-dims 128 --seqlen 8192 --batch 4 --causal 0 --clocks
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import ClockSampler, bench_device, bench_ms, device_name, in_rounds, write_json
from ringflash.dq_sum import DQSum
from ringflash.local import attention_delta, block_backward, block_forward
from ringflash.masks import CAUSAL, FULL, BlockMask
from ringflash.merge import SoftmaxState

PARTS = ("fwd:out", "fwd:in", "bwd:in", "bwd:grads")
PAGE = 2 << 20


def placed(like: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n tensors equal to `like` (same shape, dtype, contents) at different addresses: even
    indices allocations of their own, odd ones views into one buffer at 1 KiB offsets that
    grow by 1 KiB + one tensor each (never a multiple of a page apart)."""
    nbytes = like.numel() * like.element_size()
    odd = n // 2
    step = nbytes + 1024
    pool = torch.empty(odd * step + odd * 1024 + 1024, dtype=torch.uint8, device=like.device)
    out = []
    for i in range(n):
        if i % 2 == 0:
            t = torch.empty_like(like)
        else:
            j = i // 2
            off = j * step + (j + 1) * 1024
            t = pool[off : off + nbytes].view(like.dtype).view(like.shape)
        out.append(t.copy_(like))
    return out


def page_offset(t: torch.Tensor) -> int:
    return t.data_ptr() % PAGE


def clock_correlation(in_order: list[dict]) -> float:
    """Pearson's r between the timings' ms and their SM clocks' periods (1 / MHz): near 1 when
    the slow timings are the low-clock ones; NaN where a timing had no sample or nothing varied."""
    pairs = [(t["ms"], 1 / t["sm_mhz"]) for t in in_order if t["sm_mhz"] > 0]
    if len(pairs) < 3 or len(pairs) < len(in_order):
        return math.nan
    try:
        return statistics.correlation(*zip(*pairs))
    except statistics.StatisticsError:  # a constant column
        return math.nan


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4, help="each times every candidate (the order reversed every other)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--clocks", action="store_true", help="the SM clock and power during each timing (nvidia-smi)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args()
    if args.candidates < 2 or args.rounds < 1:
        ap.error(f"--candidates must be >= 2 and --rounds >= 1, got {args.candidates} and {args.rounds}")
    device, dtype = bench_device(args.smoke)
    if args.clocks and (device.type != "cuda" or shutil.which("nvidia-smi") is None):
        ap.error("--clocks needs a GPU and nvidia-smi")
    B, S, H, dims = (1, 64, 2, [16]) if args.smoke else (args.batch, args.seqlen, args.heads, args.head_dims)
    n, rounds = (2, 1) if args.smoke else (args.candidates, args.rounds)
    rows = []
    print(f"{'D':>4} {'causal':>6} {'part':>9} {'cand':>4} {'@2MiB':>8} {'median ms':>10} {'min':>8} {'max':>8}")
    for D in dims:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(B, S, H, D, device=device, dtype=dtype, generator=g) for _ in range(4))
        scale = 1 / math.sqrt(D)
        for causal in map(bool, args.causal):
            mask = BlockMask(window=CAUSAL if causal else FULL)
            state = SoftmaxState.empty(torch.empty_like(q))
            block_forward(q, k, v, state, mask, scale=scale, fold=False, normalize=True)
            delta = attention_delta(state.o, do)
            dk, dv = torch.empty_like(k), torch.empty_like(v)

            def forward(q, k, v, state):
                block_forward(q, k, v, state, mask, scale=scale, fold=False, normalize=True)

            def backward(q, k, v, m, l, do, delta, dq_sum, dk, dv):
                block_backward(q, k, v, m, l, do, delta, dq_sum.part(), dk, dv, mask, scale=scale, accumulate=True,
                               whole_call=True)  # fmt: skip

            def grads_sum():
                dq_sum = DQSum(q.shape, torch.float32, q.device, scale)
                dq_sum.blocked() if device.type == "cuda" else dq_sum.natural()
                return dq_sum

            calls = {}
            if "fwd:out" in args.parts:
                outs, ml = placed(state.o, n), placed(torch.stack([state.m, state.l]), n)
                stats = [SoftmaxState(o, *t.unbind(0)) for o, t in zip(outs, ml)]
                calls["fwd:out"] = [(lambda s=s: forward(q, k, v, s), s.o) for s in stats]
            if "fwd:in" in args.parts:
                ins = list(zip(*(placed(t, n) for t in (q, k, v))))
                calls["fwd:in"] = [(lambda t=t: forward(*t, state), t[0]) for t in ins]
            if "bwd:in" in args.parts:
                ins = list(zip(*(placed(t, n) for t in (q, k, v, state.m, state.l, do, delta))))
                one = grads_sum()
                calls["bwd:in"] = [(lambda t=t: backward(*t, one, dk, dv), t[0]) for t in ins]
            if "bwd:grads" in args.parts:
                grads = list(zip([grads_sum() for _ in range(n)], placed(dk, n), placed(dv, n)))
                calls["bwd:grads"] = [
                    (lambda g=g: backward(q, k, v, state.m, state.l, do, delta, *g), g[1]) for g in grads
                ]
            for part, cands in calls.items():
                in_order, spans = [], []  # each timing as it ran: a slow phase in time shows here
                sampler = ClockSampler(device.index or 0) if args.clocks else contextlib.nullcontext()
                with sampler:
                    for r, i in in_rounds(range(len(cands)), rounds):
                        t0 = time.perf_counter()
                        in_order.append(dict(round=r, candidate=i, ms=bench_ms(cands[i][0], device)))
                        spans.append((t0, time.perf_counter()))
                if args.clocks:
                    for timing, span in zip(in_order, spans):
                        clocks = sampler.between(*span)
                        timing.update(sm_mhz=clocks["sm_mhz"], power_w=clocks["power_w"])
                times = [[t["ms"] for t in in_order if t["candidate"] == i] for i in range(len(cands))]
                medians = [statistics.median(t) for t in times]
                head = f"{D:>4} {causal!s:>6} {part:>9}"
                for i, t in enumerate(times):
                    print(f"{head} {i:>4} {page_offset(cands[i][1]):>8x} {medians[i]:10.3f} {min(t):8.3f} "
                          f"{max(t):8.3f}", flush=True)  # fmt: skip
                between = max(medians) / min(medians)
                within = statistics.median(max(t) / min(t) for t in times)
                print(f"{head}  medians' spread {between:.3f}, within a candidate {within:.3f}", flush=True)
                overall = statistics.median(t["ms"] for t in in_order)
                relative = " ".join(f"{t['ms'] / overall:.2f}" for t in in_order)
                print(f"{head}  in timing order, x the median: {relative}", flush=True)
                if args.clocks:
                    print(f"{head}  SM MHz in timing order: " + " ".join(f"{t['sm_mhz']:.0f}" for t in in_order),
                          flush=True)  # fmt: skip
                    print(f"{head}  ms against 1 / MHz, correlation {clock_correlation(in_order):.2f}", flush=True)
                offsets = [page_offset(c[1]) for c in cands]
                rows.append(dict(D=D, S=S, B=B, H=H, causal=causal, part=part, ms=times, page_offsets=offsets,
                                 between=between, within=within, in_order=in_order))  # fmt: skip
    write_json(args.json, dict(device=device_name(device), dtype=str(dtype), rows=rows))


if __name__ == "__main__":
    main()
