"""Local (single-GPU) attention speed: ringflash beside SDPA's FLASH_ATTENTION and
CUDNN_ATTENTION backends, in the same run.

    python -m benchmarks.bench_local --json benchmarks/results/local_h200.json
    python -m benchmarks.bench_local --tune            # sweep block shapes at S=16K (--head-dims picks)
    python -m benchmarks.bench_local --smoke           # tiny CPU run (CI keeps it working)

Prints TFLOP/s (forward 4*B*H*S*S*D, half for causal; forward+backward 3.5x) and the ratio to
each peer. Medians of triton.testing.do_bench on the GPU: each call timed alone, after a cache
flush, so a call whose host time exceeds its device time shows that host time. --steady N also
times N calls in a row on the host clock (one synchronize at the end, median of 5), as a
model's layers run: the host's time then overlaps the device's, and a call costs the larger of
the two; a second table gives those ratios. --graphs also times each call captured in a CUDA
graph and replayed (do_bench's median again): every call's device work without its host time,
as a model captured with torch.cuda.graph runs it; a table of its own.

    python -m benchmarks.bench_local --seqlens 4096 --steady 20
    python -m benchmarks.bench_local --seqlens 4096 8192 --graphs
    python -m benchmarks.bench_local --head-dims 192 --v-head-dim 128 --triton-forward   # MLA's dims

--clocks samples the SM clock and power draw (nvidia-smi, every 50 ms; the instantaneous power
reading where the driver has it) while each impl is timed, after a first call outside the
samples (a compile or a cuDNN plan), and prints their medians in a table of their own;
--idle-gap SECONDS idles before each timing, so that no impl starts on the heat of the one
before:

    python -m benchmarks.bench_local --seqlens 65536 --head-dims 128 --clocks --idle-gap 1

--rounds N times every impl N times, round-robin with the order reversed every other round, and
keeps each one's median (with each round's ms and the slowest over the fastest, `spread`, in
the JSON and a table): one do_bench holds only rep / call-time calls (one at 64K
forward+backward), and a GPU at its power limit swings its clock over a run (one H100: timings
5-15% slow in the dips, cuDNN's as much as ours; benchmarks.placement --clocks).

    python -m benchmarks.bench_local --seqlens 16384 --head-dims 128 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import ClockSampler, attention_flops, bench_ms, host_seconds, in_rounds, step_fn, write_json
from ringflash import flash_attn_func
from ringflash.kernels import configs
from ringflash.kernels.configs import KernelConfig
from ringflash.testing import capture_graph


def make_inputs(B, S, H, D, dtype, device, seed=0, Dv=None):
    """q, k (B, S, H, D) and v (B, S, H, Dv, default D), and SDPA's copies of them."""
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = [torch.randn(B, S, H, d, device=device, dtype=dtype, generator=g).requires_grad_() for d in (D, D, Dv or D)]
    # SDPA gets its own (B, H, S, D) contiguous copies
    sdpa = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in qkv]
    return qkv, sdpa


def call_of(impl, tensors, causal):
    """The zero-argument forward call of `impl` on q, k, v (B, S, H, D; SDPA's impls take them
    (B, H, S, D)). ringflash_nothing_hidden: ours with a key padding mask of all False, the
    mask's own cost."""
    q, k, v = tensors
    if impl == "ringflash":
        return lambda: flash_attn_func(q, k, v, causal=causal)
    if impl == "ringflash_nothing_hidden":
        mask = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool, device=k.device)
        return lambda: flash_attn_func(q, k, v, causal=causal, key_padding_mask=mask)
    if impl == "ringflash_triton_fwd":  # the portable Triton forward in place of the Gluon one

        def call():
            with configs.override(gluon=None):
                return flash_attn_func(q, k, v, causal=causal)

        return call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_math": SDPBackend.MATH,
    }[impl]

    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return call


def runner(impl, tensors, causal, mode):
    q, _, v = tensors
    do = q.new_empty(*q.shape[:-1], v.shape[-1]).normal_()  # the output's shape (v's head dim)
    return step_fn(call_of(impl, tensors, causal), tensors, do, mode)


def measure(impl, tensors, B, H, S, D, causal, mode, device, steady=0, graphs=False, clocks=False, idle_gap=0.0):
    """do_bench's median (ms, tflops); with steady=N also steady_ms / steady_tflops: N calls in
    a row on the host clock, per call (median of 5 repeats); with graphs also graph_ms /
    graph_tflops: do_bench's median of the call captured in a CUDA graph and replayed (a
    capture that fails gives graph_error). D: the head dim FLOPs are counted at ((D + Dv) / 2
    when v's differs: exact for the forward's two matmuls). clocks: also sm_mhz, power_w, the
    medians sampled during do_bench (ClockSampler), after a first call outside the samples (a
    compile on the host leaves the GPU idle for seconds); idle_gap: seconds idle before it."""
    flops = attention_flops(B, H, S, D, causal, mode)
    try:
        step = runner(impl, tensors, causal, mode)
        if clocks or idle_gap:  # the first call (a kernel's compile, a cuDNN plan) neither sampled nor in the idle gap
            step()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        time.sleep(idle_gap)
        with ClockSampler(torch.cuda.current_device()) if clocks else contextlib.nullcontext() as sampler:
            ms = bench_ms(step, device)
        result = {"impl": impl, "ms": ms, "tflops": flops / ms / 1e9}
        if clocks:
            result.update(sm_mhz=sampler.result["sm_mhz"], power_w=sampler.result["power_w"])
        if steady:
            steady_ms = host_seconds(step, device, calls=steady, repeats=5, warmup=3) * 1e3
            result.update(steady_ms=steady_ms, steady_tflops=flops / steady_ms / 1e9)
    except Exception as e:  # a peer backend may not support a shape; say so
        return {"impl": impl, "error": f"{type(e).__name__}: {str(e)[:120]}"}
    if graphs:
        try:
            graph_ms = bench_ms(capture_graph(step)[0].replay, device)
            result.update(graph_ms=graph_ms, graph_tflops=flops / graph_ms / 1e9)
        except Exception as e:
            result["graph_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    return result


def over_rounds(results: list[dict]) -> dict:
    """One impl's measure() results over --rounds: the first's, with each time (ms, steady_ms,
    graph_ms) and clock reading the median over the rounds, its TFLOP/s from that median, and
    rounds_ms / spread (the slowest round's ms over the fastest's); a round's error wins."""
    first = results[0]
    if len(results) == 1 or any("error" in r for r in results):
        return next((r for r in results if "error" in r), first)
    out = dict(first)
    for key in ("ms", "steady_ms", "graph_ms", "sm_mhz", "power_w"):
        values = [r[key] for r in results if key in r]
        if len(values) == len(results):
            out[key] = statistics.median(values)
            if key.endswith("ms"):  # the same FLOPs each round
                rate = key[: -len("ms")] + "tflops"
                out[rate] = first[rate] * first[key] / out[key]
    out["rounds_ms"] = [r["ms"] for r in results]
    out["spread"] = max(out["rounds_ms"]) / min(out["rounds_ms"])
    return out


def run_table(args, device, dtype):
    rows = []
    peers = ["sdpa_flash", "sdpa_cudnn"] if device == "cuda" else ["sdpa_math"]
    if args.triton_forward:
        peers.append("ringflash_triton_fwd")
    for D in args.head_dims:
        Dv = args.v_head_dim or D
        for S in args.seqlens:
            qkv, sdpa = make_inputs(args.batch, S, args.heads, D, dtype, device, Dv=Dv)
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    res = {"D": D, "Dv": Dv, "S": S, "causal": causal, "mode": mode}
                    shape = (args.batch, args.heads, S, (D + Dv) / 2, causal, mode, device, args.steady, args.graphs,
                             args.clocks, args.idle_gap)  # fmt: skip
                    impls = ["ringflash", *peers]
                    runs = {impl: [] for impl in impls}
                    for _, impl in in_rounds(impls, args.rounds):
                        runs[impl].append(measure(impl, qkv if impl.startswith("ringflash") else sdpa, *shape))
                    res.update((impl, over_rounds(runs[impl])) for impl in impls)
                    rows.append(res)
                    print(json.dumps(res), flush=True)
            del qkv, sdpa
    return rows


KC = KernelConfig
CANDIDATES = {  # fwd: the sixth sweep (scale folded into exp2's FMA); dkdv, dq: the third (earlier: NOTES.md)
    "fwd": {
        64: [
            KC(128, 64, 4, 4, tma=True),
            KC(128, 64, 4, 3, tma=True),
            KC(128, 128, 8, 3, tma=True),
            KC(128, 128, 4, 3, tma=True),
        ],
        128: [
            KC(128, 128, 8, 3, tma=True),
            KC(128, 128, 8, 2, tma=True),
            KC(128, 128, 8, 4, tma=True),
            KC(128, 128, 8, 3, tma=True, warp_specialize=True),
            KC(128, 64, 4, 3, tma=True, warp_specialize=True),
            KC(128, 64, 8, 4, tma=True),
        ],
    },
    "dkdv": {
        64: [
            KC(32, 128, 4, 3),
            KC(32, 128, 4, 3, tma=True),
            KC(64, 128, 8, 3, tma=True),
            KC(64, 64, 4, 3, tma=True),
            KC(32, 64, 4, 3, tma=True),
        ],
        # D=256: the built-in 32x64 spills 348 bytes (causal; 152 not); 16x64 spills 0-16 and
        # keeps wgmma's 64 rows (keys); 32-key tiles spill nothing but run under wgmma's 64 rows
        # (python -m benchmarks.kernel_report --kind dkdv --head-dims 256 --shape ...)
        256: [
            KC(32, 64, 8, 2),
            KC(32, 64, 8, 2, tma=True),
            KC(16, 64, 8, 2, tma=True),
            KC(16, 64, 8, 3, tma=True),
            KC(32, 32, 8, 2, tma=True),
            KC(64, 32, 8, 2, tma=True),
        ],
        128: [
            KC(64, 128, 8, 3),
            KC(64, 128, 8, 3, tma=True),
            KC(64, 128, 8, 2, tma=True),
            KC(32, 128, 8, 3, tma=True),
            KC(32, 128, 4, 3, tma=True),
            KC(64, 64, 4, 3, tma=True),
        ],
    },
    "dq": {
        64: [KC(128, 32, 4, 3), KC(128, 32, 4, 3, tma=True), KC(128, 64, 4, 3, tma=True), KC(64, 64, 4, 3, tma=True)],
        256: [KC(64, 32, 8, 2), KC(64, 32, 8, 2, tma=True), KC(64, 64, 8, 2, tma=True)],
        128: [
            KC(128, 64, 8, 3),
            KC(128, 64, 8, 3, tma=True),
            KC(128, 64, 8, 4, tma=True),
            KC(128, 128, 8, 2, tma=True),
            KC(64, 64, 4, 3, tma=True),
        ],
    },
}


def tune(args, device, dtype):
    """Time each candidate block shape at S = args.tune_seqlen; print the best per kernel and,
    with --write-configs, save the best (summed over causal and not) for RINGFLASH_KERNEL_CONFIGS."""
    S, B, H = args.tune_seqlen, args.batch, args.heads
    rows, chosen = [], {}
    for kind in args.tune_kinds:
        for D, cands in CANDIDATES[kind].items():
            if D not in args.head_dims:
                continue
            qkv, _ = make_inputs(B, S, H, D, dtype, device)
            mode = "fwd" if kind == "fwd" else "fwd+bwd"
            score = {}
            for causal in (False, True):
                best = None
                for cfg in cands:
                    # kernels swept earlier in this run use their best shape for this head dim
                    best_so_far = {k: by_d[D] for k, by_d in chosen.items() if D in by_d}
                    with configs.override(**{**best_so_far, kind: cfg}):
                        r = measure("ringflash", qkv, B, H, S, D, causal, mode, device)
                    r.update(kind=kind, D=D, causal=causal, config=cfg.__dict__)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if "tflops" in r and (best is None or r["tflops"] > best["tflops"]):
                        best = r
                    score[cfg] = score.get(cfg, 0.0) + r.get("tflops", float("-inf"))
                print(
                    f"BEST {kind} D={D} causal={causal}: {best and best['config']} "
                    f"{best and round(best['tflops'], 1)} TFLOP/s ({mode})",
                    flush=True,
                )
            chosen.setdefault(kind, {})[D] = max(score, key=score.get)
            del qkv
    if args.write_configs:
        configs.write_configs(str(args.write_configs), chosen)
        print(f"wrote {args.write_configs}: {chosen}")
    return rows


def print_table(rows, key="tflops"):
    """TFLOP/s by `key`: "tflops" (do_bench), "steady_tflops" (--steady) or "graph_tflops"
    (--graphs); D/Dv where v's head dim differs; with --triton-forward, ours with the Triton
    forward beside."""
    triton_fwd = any("ringflash_triton_fwd" in r for r in rows)
    print(
        f"\n{'D':>7} {'S':>6} {'causal':>6} {'mode':>8} | {'ringflash':>9} {'flash':>7} {'cudnn':>7} | "
        f"{'vs flash':>8} {'vs cudnn':>8}"
        + (f" | {'triton fwd':>10} {'vs it':>6}" if triton_fwd else "")
        + {"tflops": "", "steady_tflops": "   (calls in a row)", "graph_tflops": "   (replayed CUDA graphs)"}[key]
    )
    for r in rows:
        rf = r["ringflash"].get(key, float("nan"))
        fl = r.get("sdpa_flash", r.get("sdpa_math", {})).get(key, float("nan"))
        cu = r.get("sdpa_cudnn", {}).get(key, float("nan"))
        dims = f"{r['D']}" if r.get("Dv", r["D"]) == r["D"] else f"{r['D']}/{r['Dv']}"
        line = (
            f"{dims:>7} {r['S']:>6} {str(r['causal']):>6} {r['mode']:>8} | {rf:9.1f} {fl:7.1f} {cu:7.1f} | "
            f"{rf / fl:8.2f} {rf / cu:8.2f}"
        )
        if triton_fwd:
            tr = r.get("ringflash_triton_fwd", {}).get(key, float("nan"))
            line += f" | {tr:10.1f} {rf / tr:6.2f}"
        print(line)


def print_clocks(rows):
    """--clocks' table: each impl's median SM clock (MHz) and power draw (W) while timed."""
    impls = [i for i in ("ringflash", "sdpa_flash", "sdpa_cudnn") if any(i in r for r in rows)]
    print(f"\n{'D':>7} {'S':>6} {'causal':>6} {'mode':>8} | " + " | ".join(f"{i + ' MHz, W':>24}" for i in impls))
    for r in rows:
        cells = [f"{r.get(i, {}).get('sm_mhz', math.nan):>14.0f} {r.get(i, {}).get('power_w', math.nan):9.0f}"
                 for i in impls]  # fmt: skip
        print(f"{r['D']:>7} {r['S']:>6} {str(r['causal']):>6} {r['mode']:>8} | " + " | ".join(cells))


def print_spreads(rows):
    """--rounds' table: each impl's slowest round over its fastest (1.00: every round alike)."""
    impls = [i for i in ("ringflash", "sdpa_flash", "sdpa_cudnn", "sdpa_math") if any(i in r for r in rows)]
    print(f"\n{'D':>7} {'S':>6} {'causal':>6} {'mode':>8} | " + " ".join(f"{i:>10}" for i in impls) + "   (spread)")
    for r in rows:
        cells = [f"{r.get(i, {}).get('spread', math.nan):10.3f}" for i in impls]
        print(f"{r['D']:>7} {r['S']:>6} {str(r['causal']):>6} {r['mode']:>8} | " + " ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--v-head-dim", type=int, help="v's head dim (default: each --head-dims'), e.g. 128 beside 192")
    ap.add_argument("--triton-forward", action="store_true", help="also time ours with the Triton forward")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-kinds", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    ap.add_argument("--tune-seqlen", type=int, default=16384)
    ap.add_argument("--write-configs", type=Path, help="with --tune: save the best configs (JSON)")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    ap.add_argument("--steady", type=int, default=0, metavar="N", help="also time N calls in a row (host clock)")
    ap.add_argument("--graphs", action="store_true", help="also time each call replayed from a CUDA graph (GPU)")
    ap.add_argument("--clocks", action="store_true", help="sample the SM clock and power while timing (nvidia-smi)")
    ap.add_argument("--idle-gap", type=float, default=0.0, metavar="S", help="seconds idle before each timing")
    ap.add_argument("--rounds", type=int, default=1, help="time each impl this many times, round-robin (medians)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.graphs and device != "cuda":
        ap.error("--graphs needs a GPU (CUDA graphs)")
    if args.clocks and (device != "cuda" or shutil.which("nvidia-smi") is None):
        ap.error("--clocks needs a GPU and nvidia-smi")
    if args.idle_gap < 0:
        ap.error(f"--idle-gap must be >= 0 seconds, got {args.idle_gap}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.smoke:
        args.seqlens, args.head_dims, args.heads, dtype = [64], [32], 2, torch.float32
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "batch": args.batch,
        "heads": args.heads,
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out = {"meta": meta}
    if args.tune:
        out["tune"] = tune(args, device, dtype)
    else:
        out["rows"] = run_table(args, device, dtype)
    write_json(args.json, out)
    if "rows" in out:
        print_table(out["rows"])
        if args.steady:
            print_table(out["rows"], "steady_tflops")
        if args.graphs:
            print_table(out["rows"], "graph_tflops")
        if args.clocks:
            print_clocks(out["rows"])
        if args.rounds > 1:
            print_spreads(out["rows"])


if __name__ == "__main__":
    main()
