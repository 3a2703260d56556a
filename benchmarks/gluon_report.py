"""Compile the Gluon forward variants for Hopper (sm_90a) on any machine, no GPU needed, and
report what ptxas and the SASS say: registers at entry, the setmaxnreg budgets of the
warp-specialized partitions, spills, shared memory, wgmma waits (N > 0: a matmul left in
flight), HGMMA count, ptxas warnings.

    python benchmarks/gluon_report.py                                # every variant, D=64/128, causal
    python benchmarks/gluon_report.py --variants ws --head-dims 128 --modes local fold --dump DIR
    python benchmarks/gluon_report.py --case ws:128:1:bf16:1:0 --json rows.json   # one exact case

Cases: variant:D:causal:dtype:normalize:fold[:mask], D a head dim or "D/Dv" (v's head dim apart
from q/k's, e.g. 192/128), mask "window" (a sliding window) or "rows" (per-row bounds of packed
documents), each optionally with "+bias" (or "bias" alone: a key bias, a key padding mask's);
without it, dense or causal by `causal`. Runs with
TRITON_INTERPRET unset (interpreted kernels patch triton.language in-process, which breaks Gluon
compilation afterwards).
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

from ringflash.kernels import gluon_forward as gf  # noqa: E402

MODES = {"local": (True, False), "fold": (False, True), "fold_normalize": (True, True)}


def parse_case(text: str) -> tuple:
    v, d, c, dt, n, f, *mask = text.split(":")
    dims = tuple(int(x) for x in d.split("/"))
    return v, dims if len(dims) > 1 else dims[0], bool(int(c)), dt, bool(int(n)), bool(int(f)), *mask[:1]


def one(case: tuple, dump: str | None = None) -> dict:
    variant, D, causal, dtype, normalize, fold, *mask = case
    mask = mask[0] if mask else ""
    # "bias", or a mask with "+bias": a key bias (a key padding mask's) beside it
    kinds = mask.split("+")
    key_bias = "bias" in kinds
    mask = "+".join(k for k in kinds if k != "bias")
    D, Dv = D if isinstance(D, tuple) else (D, None)
    try:
        row = gf.hopper_report(
            gf.config_for(D, variant, head_dim_v=Dv),
            D,
            causal=causal,
            dtype=dtype,
            normalize=normalize,
            fold=fold,
            dump=Path(dump) / variant if dump else None,
            mask=mask,
            head_dim_v=Dv,
            key_bias=key_bias,
        )
        row["problems"] = gf.report_problems(row)
    except Exception as e:  # reported as a row: the caller decides
        row = {
            "error": f"{type(e).__name__}: {e}"[:4000],
            "D": D,
            "causal": causal,
            "mask": mask,
            "dtype": dtype,
            "normalize": normalize,
            "fold": fold,
        }
    row["name"] = variant
    return row


def line(r: dict) -> str:
    dims = f"{r['D']}" if r.get("Dv") is None else f"{r['D']}/{r['Dv']}"
    mask = "+".join(filter(None, (r["mask"], "bias" if r.get("key_bias") else "")))
    head = (
        f"{r['name']:9s} D={dims:<7s} causal={int(r['causal'])} {mask or '-':6s} {r['dtype']} "
        f"norm={int(r['normalize'])} fold={int(r['fold'])}"
    )
    if "error" in r:
        return f"{head} ERROR {r['error'][:300]}"
    c = r["config"]
    return (
        f"{head} {c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['stages']} regs={r['regs']} "
        f"setmaxnreg={r['setmaxnreg'] or '-'} sass_regs={r['sass_regs']} spills={r['spill_bytes']} "
        f"loop_spills={r['loop_spills']} "
        f"shared={r['shared']} "
        f"waits={r['sass_waits']} hgmma={r['hgmma']} warnings={r['warnings'] or '-'} "
        f"{'OK' if not r['problems'] else 'PROBLEMS ' + '; '.join(r['problems'])}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(gf.VARIANTS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(gf.HEAD_DIMS))
    ap.add_argument("--modes", nargs="+", default=["local"], choices=list(MODES))
    ap.add_argument("--causal", nargs="+", type=int, default=[1], choices=[0, 1])
    masks = ["", "window", "rows", "bias", "window+bias", "rows+bias"]
    ap.add_argument("--masks", nargs="+", default=[""], choices=masks,
                    help="'' (dense or causal), a sliding window, per-row document bounds; +bias: with a key "
                         "bias (a key padding mask's)")  # fmt: skip
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument(
        "--case", action="append", default=[], help="variant:D:causal:dtype:normalize:fold[:mask] (repeatable)"
    )
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--dump", help="write PTX, TTGIR and SASS here")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not gf.HAS_GLUON:
        sys.exit(f"Gluon not importable: {gf.GLUON_ERROR}")
    cases = [parse_case(c) for c in args.case] or [
        (v, D, bool(c), args.dtype, *MODES[m], mask)
        for v in args.variants
        for D in args.head_dims
        if gf.padded_head_dim(D) in gf.VARIANTS[v]
        for m in args.modes
        for c in args.causal
        for mask in args.masks
    ]
    if args.jobs > 1 and len(cases) > 1:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            rows = list(ex.map(one, cases, [args.dump] * len(cases)))
    else:
        rows = [one(c, args.dump) for c in cases]
    for r in rows:
        print(line(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    sys.exit(1 if any("error" in r or r["problems"] for r in rows) else 0)


if __name__ == "__main__":
    main()
