"""Compile the Gluon backward (ringflash/kernels/gluon_backward.py) for Hopper (sm_90a) on any
machine, no GPU needed, and report what ptxas and the SASS say for every supported case:
registers at entry, the setmaxnreg budgets of the partitions, spills and stack, shared memory,
wgmma waits (N > 0: a matmul left in flight), HGMMA count, vectorized dQ atomics
(REDG.E.ADD.F32x2), ptxas warnings (C75xx: wgmma serialized). Exit code 1 on any problem.

    python benchmarks/gluon_bwd_report.py                       # every variant x causal x dtype x accumulate
    python benchmarks/gluon_bwd_report.py --variants ws2 --causal 1 --dtypes bf16 --dump DIR --json rows.json

Runs with TRITON_INTERPRET unset (interpreted kernels patch triton.language in-process, which
breaks Gluon compilation afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringflash.kernels import gluon_backward as gb  # noqa: E402


def one(case: tuple, dump: str | None = None) -> dict:
    variant, D, causal, dtype, accumulate, group, window_left, rows, Dv, key_bias = case
    try:
        row = gb.hopper_report(
            gb.config_for(D, variant),
            D,
            causal=causal,
            dtype=dtype,
            accumulate=accumulate,
            group=group,
            dump=Path(dump) / variant if dump else None,
            window_left=window_left,
            rows=rows,
            head_dim_v=Dv,
            key_bias=key_bias,
        )
        row["problems"] = gb.report_problems(row)
    except Exception as e:  # reported as a row: the caller decides
        row = {"error": f"{type(e).__name__}: {e}"[:4000], "D": D, "Dv": Dv or D, "causal": causal, "dtype": dtype}
        row.update(accumulate=accumulate, group=group, window_left=window_left, rows=rows, key_bias=key_bias)
    row["name"] = variant
    return row


def line(r: dict) -> str:
    dims = f"{r['D']}" if r.get("Dv", r["D"]) == r["D"] else f"{r['D']}/{r['Dv']}"
    head = f"{r['name']:7s} D={dims:<3s} causal={int(r['causal'])} {r['dtype']} acc={int(r['accumulate'])}"
    if r.get("window_left") is not None:
        head += f" window_left={r['window_left']}"
    if r.get("rows"):
        head += " rows"
    if r.get("key_bias"):
        head += " key_bias"
    if "error" in r:
        return f"{head} ERROR {r['error'][-600:]}"
    c = r["config"]
    return (
        f"{head} {c['block_m']}x{c['block_n']} s{c['stages']} regs={r['regs']} "
        f"setmaxnreg={r['setmaxnreg'] or '-'} sass_regs={r['sass_regs']} spills={r['spill_bytes']} "
        f"loop_spills={r['loop_spills']} "
        f"stack={r['stack_bytes']} shared={r['shared']} waits={r['sass_waits']} hgmma={r['hgmma']} "
        f"red.v2={r['red_v2']} red.v4={r.get('red_v4', 0)} sass_lines={r['sass_lines']} "
        f"warnings={r['warnings'] or '-'} "
        f"{'OK' if not r['problems'] else 'PROBLEMS ' + '; '.join(r['problems'])}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(gb.VARIANTS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(gb.HEAD_DIMS))
    ap.add_argument("--v-head-dim", type=int, help="v's head dim (default: each --head-dims'), e.g. 128 beside 192")
    ap.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument(
        "--accumulate", nargs="+", type=int, default=[0, 1], choices=[0, 1], help="1: float32 dk/dv added to"
    )
    ap.add_argument("--group", type=int, default=4, help="q heads per kv head of the compiled case")
    ap.add_argument("--window-left", type=int, help="a sliding window of this left reach (right: 0 if causal)")
    ap.add_argument("--rows", action="store_true", help="packed documents' per-row bounds (--causal then unused)")
    ap.add_argument("--key-bias", action="store_true", help="with a key bias (a key padding mask's)")
    ap.add_argument("--jobs", type=int, default=1, help="compile processes (the CPU machine is shared: 1-2)")
    ap.add_argument("--dump", help="write PTX, TTGIR, SASS and ptxas's log here")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not gb.HAS_GLUON:
        sys.exit(f"Gluon not importable: {gb.GLUON_ERROR}")
    cases = [
        (v, D, bool(c), dt, bool(a), args.group, args.window_left, args.rows, args.v_head_dim, args.key_bias)
        for v in args.variants
        for D in args.head_dims
        if gb.padded_head_dim(D) in gb.VARIANTS[v]
        for c in args.causal
        for dt in args.dtypes
        for a in args.accumulate
    ]
    if args.jobs > 1 and len(cases) > 1:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            rows = []
            for r in ex.map(one, cases, [args.dump] * len(cases)):
                print(line(r), flush=True)
                rows.append(r)
    else:
        rows = []
        for c in cases:
            rows.append(one(c, args.dump))
            print(line(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    bad = [r for r in rows if "error" in r or r["problems"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} cases OK", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
