"""Hardware counters of one attention call, ours beside SDPA's cuDNN backend, read by Nsight
Compute (ncu): where a kernel's time goes when the timing alone cannot say (tensor-pipe busy
share, issue slots, warp stall reasons).

    python -m benchmarks.kernel_counters --out DIR --head-dims 64 128 --seqlen 16384 --modes fwd bwd
    python -m benchmarks.kernel_counters --out DIR --seqlen 4096 --modes fwd --impls gluon=ws2_s3 gluon=ws2_p
    python -m benchmarks.kernel_counters --out DIR --head-dims 192 --v-head-dim 128 --modes bwd   # MLA's dims
    python -m benchmarks.kernel_counters --out DIR --head-dims 128 --seqlen 4096 --causal yes --modes bwd --source \
        --impls gluon_bwd=ws2_lag_grouped_down gluon_bwd=ws2_lag_grouped_down_pc   # stalls per SASS instruction
    python -m benchmarks.kernel_counters --out DIR --head-dims 64 --seqlen 8192 --causal no --modes bwd \
        --batch 4 --impls ringflash ringflash_nothing_hidden   # a key padding mask's own cost (all False)

runs `ncu` once per (implementation, head dim, causal, mode) on this script's --call mode (one
warmed-up call between cudaProfilerStart and Stop; for "bwd" only the backward of a forward made
outside the range), keeps each report (DIR/*.ncu-rep) and its raw metrics (DIR/*.csv), and prints
per kernel longer than 50 us: duration, SM and tensor-pipe busy shares, issue slots busy, and the
largest warp stall reasons (cycles per issued instruction). ncu runs with --clock-control none,
so the clocks are the ones the timed benchmarks see. Needs a GPU whose counters ncu can read.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

IMPLS = ("ringflash", "sdpa_cudnn")  # and gluon=VARIANT / gluon_bwd=VARIANT: ours with that Gluon kernel variant
MORE_IMPLS = ("ringflash_nothing_hidden",)  # ours with an all-False key padding mask (bench_local.call_of)
SECTIONS = (
    "SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "SchedulerStats", "WarpStateStats",
    "Occupancy", "LaunchStats",
)  # fmt: skip
STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def one_call(impl, D, S, causal, mode, heads, batch, Dv=None):
    """Warm up, then run one call (fwd) or one backward (bwd) inside the profiler's range;
    impl gluon=VARIANT / gluon_bwd=VARIANT: ours with that Gluon forward / backward variant; Dv:
    v's head dim (default D)."""
    from ringflash.kernels import configs

    for kind in ("gluon", "gluon_bwd"):
        if impl.startswith(kind + "="):
            with configs.override(**{kind: impl.split("=", 1)[1]}):
                return one_call("ringflash", D, S, causal, mode, heads, batch, Dv)

    import torch

    from benchmarks.bench_local import make_inputs, runner

    qkv, sdpa = make_inputs(batch, S, heads, D, torch.bfloat16, "cuda", Dv=Dv)
    tensors = qkv if impl.startswith("ringflash") else sdpa
    fwd_bwd = runner(impl, tensors, causal, "fwd+bwd")
    for _ in range(3):
        fwd_bwd()
    if mode == "fwd":
        call = runner(impl, tensors, causal, "fwd")
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        call()
    else:
        # the forward outside the range: rebuild its output with a graph, then time the backward
        for t in tensors:
            t.grad = None
        out = _forward(impl, tensors, causal)
        do = torch.randn_like(out)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        out.backward(do)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _forward(impl, tensors, causal):
    from benchmarks.bench_local import call_of

    return call_of(impl, tensors, causal)()


def read_raw(csv_path):
    """[(kernel name, {metric: value string}, {metric: unit})] from ncu's raw CSV page."""
    rows = list(csv.reader(csv_path.read_text().splitlines()))
    if len(rows) < 3:
        return []
    head, units = rows[0], dict(zip(rows[0], rows[1]))
    return [(d.get("Kernel Name", "?"), d, units) for d in (dict(zip(head, r)) for r in rows[2:])]


def _num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


TIME_UNITS_US = {
    "ns": 1e-3,
    "us": 1.0,
    "ms": 1e3,
    "s": 1e6,
    "nsecond": 1e-3,
    "usecond": 1.0,
    "msecond": 1e3,
    "second": 1e6,
}


CLOCK_UNITS_MHZ = {"ghz": 1e3, "mhz": 1.0, "khz": 1e-3, "hz": 1e-6, "cycle/nsecond": 1e3, "cycle/second": 1e-6}


def summarize(name, d, units):
    """A kernel's duration (us), SM clock (MHz), SM busy %, tensor pipe busy % of the elapsed
    cycles (the tail where SMs idle included), issue slots busy %, DRAM busy %, L2 hit rate %,
    and the five largest stall reasons (warps stalled per issued instruction)."""
    dur, scale = _num(d.get("gpu__time_duration.sum")), TIME_UNITS_US.get(units.get("gpu__time_duration.sum"))
    clock = _num(d.get("gpc__cycles_elapsed.avg.per_second"))
    clock_scale = CLOCK_UNITS_MHZ.get(units.get("gpc__cycles_elapsed.avg.per_second", "").lower())
    clock_mhz = clock * clock_scale if clock is not None and clock_scale else None
    stalls = sorted(
        ((STALL.match(k).group(1), _num(v)) for k, v in d.items() if STALL.match(k) and _num(v)), key=lambda x: -x[1]
    )[:5]
    return {
        "kernel": name,
        "us": dur * scale if dur is not None and scale else None,
        "mhz": clock_mhz,
        "sm_pct": _num(d.get("sm__throughput.avg.pct_of_peak_sustained_elapsed")),
        "tensor_pct": _num(d.get("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed")),
        "issue_pct": _num(d.get("smsp__issue_active.avg.pct_of_peak_sustained_active")),
        # memory: DRAM busy, and the L2 hit rate (K / V tiles that several programs share)
        "dram_pct": _num(d.get("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")),
        "l2_hit_pct": _num(d.get("lts__t_sector_hit_rate.pct")),
        "stalls": stalls,
    }


def format_row(tag, s):
    stalls = " ".join(f"{k}={v:.2f}" for k, v in s["stalls"])
    return (
        f"{tag:36s} {s['kernel'][:28]:28s} {s['us']:9.1f} us {s['mhz'] or 0:5.0f} MHz  sm {s['sm_pct'] or 0:5.1f}%  "
        f"tensor {s['tensor_pct'] or 0:5.1f}%  issue {s['issue_pct'] or 0:5.1f}%  dram {s['dram_pct'] or 0:4.1f}%  "
        f"L2 hit {s['l2_hit_pct'] or 0:5.1f}%  stalls: {stalls}"
    )


def source_summary(rep, csv_path, tag, top=25):
    """The report's per-instruction warp-state samples (ncu's source page, SASS) written to
    csv_path; returned: per opcode, then per instruction, the largest shares of all samples."""
    page = subprocess.run(
        ["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "source", "--print-source", "sass"],
        capture_output=True,
        text=True,
    )
    csv_path.write_text(page.stdout + page.stderr)
    rows = [r for r in csv.reader(page.stdout.splitlines()) if r]
    # one table per kernel of the report, each under its own header: the one with most samples
    tables = []
    for r in rows:
        if "Source" in r:
            tables.append((r, []))
        elif tables and len(r) == len(tables[-1][0]):
            tables[-1][1].append(r)
    best = None
    for names, body in tables:
        src = names.index("Source")
        samples = next((i for i, n in enumerate(names) if n.startswith("Warp Stall Sampling (All")), None)
        if samples is None:
            continue
        instrs = [(r[src], _num(r[samples]) or 0.0) for r in body]
        if best is None or sum(n for _, n in instrs) > sum(n for _, n in best):
            best = instrs
    if best is None:
        return [f"{tag}: no warp samples in the source page ({csv_path.name})"]
    instrs = best
    total = sum(n for _, n in instrs) or 1.0
    by_op = {}
    for text, n in instrs:
        words = text.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        by_op[op] = by_op.get(op, 0.0) + n
    out = [f"{tag}: warp samples by opcode (share of {total:.0f})"]
    out += [f"  {op:40s} {n / total:6.1%}" for op, n in sorted(by_op.items(), key=lambda x: -x[1])[:top]]
    out.append(f"{tag}: the instructions with the most samples")
    out += [f"  {n / total:6.1%}  {text[:110]}" for text, n in sorted(instrs, key=lambda x: -x[1])[:top]]
    return out


def run_all(args):
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for D in args.head_dims:
        for causal in (False, True) if args.causal == "both" else (args.causal == "yes",):
            for mode in args.modes:
                for impl in args.impls:
                    dims = f"d{D}" if args.v_head_dim is None else f"d{D}v{args.v_head_dim}"
                    tag = f"{impl.replace('=', '-')}_{dims}_s{args.seqlen}_{'causal' if causal else 'full'}_{mode}"
                    rep = out / tag
                    cmd = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "-f", "-o", str(rep)]
                    for s in SECTIONS + (("SourceCounters",) if args.source else ()):
                        cmd += ["--section", s]
                    call = [impl, str(D), str(args.seqlen), "causal" if causal else "full", mode]
                    cmd += [sys.executable, "-m", "benchmarks.kernel_counters", "--heads", str(args.heads),
                            "--batch", str(args.batch)]  # fmt: skip
                    if args.v_head_dim is not None:
                        cmd += ["--v-head-dim", str(args.v_head_dim)]
                    cmd += ["--call", *call]
                    log = subprocess.run(cmd, capture_output=True, text=True)
                    (out / f"{tag}.log").write_text(log.stdout + log.stderr)
                    if log.returncode != 0:
                        lines.append(f"{tag}: ncu failed (rc {log.returncode}), see {tag}.log")
                        continue
                    raw = subprocess.run(
                        ["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw"], capture_output=True, text=True
                    )
                    (out / f"{tag}.csv").write_text(raw.stdout)
                    for name, d, units in read_raw(out / f"{tag}.csv"):
                        s = summarize(name, d, units)
                        if s["us"] is None or s["us"] < 50:
                            continue
                        lines.append(format_row(tag, s))
                    if args.source:
                        lines += source_summary(rep, out / f"{tag}_sass.csv", tag)
                    print(tag, "done", flush=True)
    print("\n".join(lines))
    (out / "table.txt").write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for the reports and the table")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--v-head-dim", type=int, help="v's head dim (default: each --head-dims'), e.g. 128 beside 192")
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="B (benchmarks.mask_cost and key_padding time B=4)")
    ap.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    ap.add_argument("--modes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    ap.add_argument(
        "--impls", nargs="+", default=list(IMPLS), help=f"{' '.join(IMPLS)}, gluon=VARIANT or gluon_bwd=VARIANT"
    )
    ap.add_argument(
        "--source", action="store_true", help="also sample warp states per SASS instruction (ncu SourceCounters)"
    )
    ap.add_argument("--call", nargs=5, metavar=("IMPL", "D", "S", "CAUSAL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.call:
        impl, D, S, causal, mode = args.call
        one_call(impl, int(D), int(S), causal == "causal", mode, args.heads, args.batch, args.v_head_dim)
        return
    if args.out is None:
        ap.error("--out is required (the folder for the reports)")
    bad = [i for i in args.impls if i not in IMPLS + MORE_IMPLS and not i.startswith(("gluon=", "gluon_bwd="))]
    if bad:
        ap.error(f"--impls: unknown {bad}; take {' '.join(IMPLS + MORE_IMPLS)}, gluon=VARIANT or gluon_bwd=VARIANT")
    run_all(args)


if __name__ == "__main__":
    main()
