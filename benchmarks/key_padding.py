"""Key padding masks' cost: ringflash with a key padding mask on the Gluon kernels
(configs.GLUON_KEY_BIAS), alone and with each of its two savings: _plain, each row's zero-bias
span computed without the bias (configs.PLAIN_ZERO_BIAS_KEYS); _cut, the trailing padding's key
blocks skipped (configs.GLUON_CUT_KEY_PADDING); _cut_plain, both. Beside them the Triton kernels
with the mask, ringflash without a mask and SDPA with the same mask as a boolean attn_mask (its
memory-efficient backend, the one that takes a mask; cuDNN's takes none), in the same run.

    python -m benchmarks.key_padding --json benchmarks/results/key_padding_h200.json
    python -m benchmarks.key_padding --modes bwd --hides-nothing   # the mask's own cost, backward alone
    python -m benchmarks.key_padding --smoke        # tiny CPU run (CI keeps it working)

A right-padded batch: B rows, row b holding S - b * S / (2 B) real keys (the rest padding,
hidden from every query); --hides-nothing: a mask of B x S False (every key visible, each
row's bias all zeros). Modes: fwd, fwd+bwd, bwd (the backward alone, of one forward kept).
Prints TFLOP/s of the attention as if every pair were computed
(forward 4*B*H*S*S*D, half for causal; forward+backward 3.5x, backward 2.5x) and time ratios (above 1: the
second is faster): each saving over the plain Gluon path, the Gluon path over the Triton one,
over ringflash without a mask (also with the spans: the mask's own cost) and over SDPA with the
mask. Medians of triton.testing.do_bench on the GPU, each impl timed --rounds times round-robin
(each round starting one impl later: the GPU's clocks drift over a run) and the median kept;
spread: the largest max / min of one impl's rounds in the row."""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.bench_local import make_inputs
from benchmarks.common import add_local_args, attention_flops, bench_device, bench_ms, device_name, step_fn, write_json
from ringflash import flash_attn_func
from ringflash.kernels import configs


def right_padding(B: int, S: int, device) -> torch.Tensor:
    """(B, S) bool, True = padding: row b holds S - b * S // (2 B) real keys."""
    real = torch.tensor([S - b * S // (2 * B) for b in range(B)], device=device)
    return torch.arange(S, device=device)[None, :] >= real[:, None]


def runner(impl, tensors, causal, mask, mode):
    q, k, v = tensors
    do = torch.randn_like(q)
    flags = dict(
        GLUON_KEY_BIAS=impl.startswith("gluon"),
        GLUON_CUT_KEY_PADDING="cut" in impl,
        PLAIN_ZERO_BIAS_KEYS="plain" in impl,
    )

    def flagged(fn):  # (the backward too: it decides by the flags when it runs)
        def run():
            with mock.patch.multiple(configs, **flags):
                return fn()

        return run

    if impl == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.EFFICIENT_ATTENTION if q.is_cuda else SDPBackend.MATH
        S = q.shape[2]
        keep = ~mask[:, None, None, :]  # SDPA's bool mask: True = may attend
        if causal:
            keep = keep & torch.ones(S, S, dtype=torch.bool, device=q.device).tril()

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    else:
        kpm = None if impl == "no_mask" else mask
        call = flagged(lambda: flash_attn_func(q, k, v, causal=causal, key_padding_mask=kpm))
    return flagged(step_fn(call, (q, k, v), do, mode))  # ("bwd": its forward runs here, flagged)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd", "bwd"), default=["fwd", "fwd+bwd"])
    ap.add_argument("--hides-nothing", action="store_true", help="a mask of all False: the mask's own cost")
    ap.add_argument("--rounds", type=int, default=3, help="timings of each impl, round-robin; the median is reported")
    add_local_args(ap, [4096, 8192])
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    B, seqlens, dims, H = (2, [64], [16], 2) if args.smoke else (args.batch, args.seqlens, args.head_dims, args.heads)
    impls = ("gluon", "gluon_plain", "gluon_cut", "gluon_cut_plain", "triton", "no_mask", "sdpa")
    ratios = dict(  # name: (numerator's time, denominator's, column): above 1, the second is faster
        plain_over_gluon=("gluon", "gluon_plain", "plain/g"),
        cut_over_gluon=("gluon", "gluon_cut", "cut/g"),
        both_over_gluon=("gluon", "gluon_cut_plain", "both/g"),
        gluon_over_triton=("triton", "gluon", "g/triton"),
        gluon_over_no_mask=("no_mask", "gluon", "g/nomask"),
        plain_over_no_mask=("no_mask", "gluon_plain", "plain/nomask"),
        both_over_no_mask=("no_mask", "gluon_cut_plain", "both/nomask"),
        gluon_over_sdpa=("sdpa", "gluon", "g/sdpa"),
    )
    rows = []
    print(f"{'D':>4} {'S':>6} {'causal':>6} {'mode':>8} " + " ".join(f"{i:>15}" for i in impls)
          + "".join(f" {c:>12}" for _, _, c in ratios.values()) + f" {'spread':>8}")  # fmt: skip
    for D in dims:
        for S in seqlens:
            mask = right_padding(B, S, device)
            if args.hides_nothing:
                mask = torch.zeros_like(mask)
            for causal in (False, True):
                for mode in args.modes:
                    ours, sdpa = make_inputs(B, S, H, D, dtype, device)
                    flops = attention_flops(B, H, S, D, causal, mode)
                    fns = {i: runner(i, sdpa if i == "sdpa" else ours, causal, mask, mode) for i in impls}
                    times = {i: [] for i in impls}
                    for r in range(args.rounds):  # round-robin, each round from the next impl: clocks drift
                        for i in impls[r % len(impls) :] + impls[: r % len(impls)]:
                            times[i].append(bench_ms(fns[i], device))
                    ms = {i: statistics.median(t) for i, t in times.items()}
                    spread = max(max(t) / min(t) for t in times.values())
                    tf = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
                    row = dict(B=B, D=D, S=S, H=H, causal=causal, mode=mode, ms=ms, tflops=tf, rounds=times,
                               spread=spread, hides_nothing=args.hides_nothing)  # fmt: skip
                    row.update({r: ms[a] / ms[b] for r, (a, b, _) in ratios.items()})
                    rows.append(row)
                    print(
                        f"{D:>4} {S:>6} {causal!s:>6} {mode:>8} " + " ".join(f"{tf[i]:15.1f}" for i in impls)
                        + "".join(f" {row[r]:12.3f}" for r in ratios) + f" {spread:8.3f}",
                        flush=True,
                    )  # fmt: skip
    write_json(args.json, dict(device=device_name(device), dtype=str(dtype), rows=rows))


if __name__ == "__main__":
    main()
