"""Weak and strong scaling of the ring, from bench_ring.py JSON files: a markdown table and an
SVG plot (written directly: no plotting library needed).

    python benchmarks/plot_scaling.py benchmarks/results/scaling_*.json --out benchmarks/results/scaling.svg

A row is weak scaling when S == P * --weak-local (default 32K tokens per GPU) and strong scaling
when S == --strong (default 256K); other rows are ignored. Each series is one (kind, K/V heads,
causal) at one --mode (default fwd+bwd), against P. Left panel: per-GPU TFLOP/s of the ring
(solid) and of context_parallel with cuDNN (dashed, same colour) where the file has it; right
panel: ring efficiency (ring / the same rank's work without communication).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def load_series(paths, weak_local, strong, mode):
    """{(kind, kv_heads, causal): {P: row's per-GPU TFLOP/s dict}}"""
    series = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        P, kv = data["meta"]["world"], data["meta"]["kv_heads"]
        for row in data["rows"]:
            if row["mode"] != mode:
                continue
            kinds = [k for k, hit in (("weak", row["S"] == P * weak_local), ("strong", row["S"] == strong)) if hit]
            for kind in kinds:
                series.setdefault((kind, kv, row["causal"]), {})[P] = row["tflops_per_gpu"]
    return dict(sorted(series.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])))


def label(key, heads):
    kind, kv, causal = key
    return f"{kind}, H {heads}/{kv}, {'causal' if causal else 'non-causal'}"


def table(series, heads):
    lines = [
        "| series | P | ring TFLOP/s per GPU | efficiency | CP cuDNN | ring / CP cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    for key, points in series.items():
        for P, t in sorted(points.items()):
            cp = t.get("cp_cudnn")
            lines.append(
                f"| {label(key, heads)} | {P} | {t['ring']:.0f} | {t['ring'] / t['local']:.2f} | "
                + (f"{cp:.0f} | {t['ring'] / cp:.2f} |" if cp else "- | - |")
            )
    return "\n".join(lines)


def svg(series, heads, mode):
    W, H, pad = 460, 300, 50  # one panel
    worlds = sorted({P for points in series.values() for P in points}) or [1]
    lo, hi = math.log2(worlds[0]), math.log2(worlds[-1])
    x = lambda P: pad + (math.log2(P) - lo) / ((hi - lo) or 1) * (W - 2 * pad)
    peak = max([t.get(k, 0) for points in series.values() for t in points.values() for k in ("ring", "cp_cudnn")] + [1])
    panels = [
        ("per-GPU TFLOP/s, " + mode, lambda t: t["ring"], lambda t: t.get("cp_cudnn"), peak * 1.1),
        ("ring efficiency", lambda t: t["ring"] / t["local"], lambda t: None, 1.05),
    ]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 24 * len(series) + 20}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for i, (title, ring_y, peer_y, top) in enumerate(panels):
        ox = i * W
        y = lambda v: H - pad + 10 - v / top * (H - 2 * pad)
        out.append(f'<text x="{ox + W / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>')
        out.append(f'<line x1="{ox + pad}" y1="{y(0)}" x2="{ox + W - pad}" y2="{y(0)}" stroke="black"/>')
        out.append(f'<line x1="{ox + pad}" y1="{y(0)}" x2="{ox + pad}" y2="{y(top)}" stroke="black"/>')
        for P in worlds:
            out.append(f'<text x="{ox + x(P)}" y="{y(0) + 15}" text-anchor="middle">P={P}</text>')
        for j in range(6):
            v = top * j / 5
            out.append(
                f'<text x="{ox + pad - 5}" y="{y(v) + 4}" text-anchor="end">{v:.2f}</text>'
                if top < 2
                else f'<text x="{ox + pad - 5}" y="{y(v) + 4}" text-anchor="end">{v:.0f}</text>'
            )
            out.append(f'<line x1="{ox + pad}" y1="{y(v)}" x2="{ox + W - pad}" y2="{y(v)}" stroke="#ddd"/>')
        for n, points in enumerate(series.values()):
            colour = COLOURS[n % len(COLOURS)]
            for get, dash in ((ring_y, ""), (peer_y, ' stroke-dasharray="5,3"')):
                pts = [(P, get(t)) for P, t in sorted(points.items()) if get(t) is not None]
                if pts:
                    path = " ".join(f"{ox + x(P):.1f},{y(v):.1f}" for P, v in pts)
                    out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
                    out += [f'<circle cx="{ox + x(P):.1f}" cy="{y(v):.1f}" r="3" fill="{colour}"/>' for P, v in pts]
    for n, key in enumerate(series):
        yy = H + 10 + 24 * n
        out.append(
            f'<line x1="{pad}" y1="{yy}" x2="{pad + 30}" y2="{yy}" stroke="{COLOURS[n % len(COLOURS)]}" '
            'stroke-width="2"/>'
        )
        out.append(f'<text x="{pad + 38}" y="{yy + 4}">{label(key, heads)} (dashed: context_parallel cuDNN)</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--weak-local", type=int, default=32768)
    ap.add_argument("--strong", type=int, default=262144)
    ap.add_argument("--mode", default="fwd+bwd", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--out", type=Path, help="the SVG to write")
    args = ap.parse_args()
    heads = {json.loads(p.read_text())["meta"]["heads"] for p in args.json}
    if len(heads) != 1:
        raise SystemExit(f"plot_scaling.py: the files mix query head counts {sorted(heads)}")
    heads = heads.pop()
    series = load_series(args.json, args.weak_local, args.strong, args.mode)
    if not series:
        raise SystemExit("plot_scaling.py: no weak- or strong-scaling rows in these files")
    print(table(series, heads))
    if args.out:
        args.out.write_text(svg(series, heads, args.mode))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
