"""A key padding mask's own cost: ringflash's call with a mask that hides nothing (B x S False)
over the same call without one, timed in alternating pairs. Each timing takes a fresh forward,
the order flips every pair (the GPU's clock swings over a run: on one H100 at its 700 W limit
timings ran 5-15% slow in its dips, benchmarks.placement --clocks), and the median of the
pairs' ratios is printed with their range. Finer than benchmarks.key_padding, whose columns
run one after another: there two identical kernels on identical data have differed by 7-15%.

    python -m benchmarks.mask_cost --seqlens 8192 --head-dims 128 --causal 1 --modes bwd
    python -m benchmarks.mask_cost --smoke        # tiny CPU run (CI keeps it working)

Modes: bwd (the backward alone, of one forward), fwd+bwd, fwd."""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_local import make_inputs
from benchmarks.common import add_local_args, bench_device, bench_ms, device_name, in_rounds, step_fn, write_json
from ringflash import flash_attn_func


def timing(tensors, causal: bool, mask, mode: str, device) -> float:
    """Milliseconds of one call (bench_ms), with a forward of its own."""
    q, k, v = tensors
    call = lambda: flash_attn_func(q, k, v, causal=causal, key_padding_mask=mask)  # noqa: E731
    return bench_ms(step_fn(call, (q, k, v), torch.randn_like(q), mode), device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[0, 1])
    ap.add_argument("--modes", nargs="+", choices=("fwd", "fwd+bwd", "bwd"), default=["bwd"])
    ap.add_argument("--pairs", type=int, default=6, help="timed pairs a case (the order flips each pair)")
    add_local_args(ap, [8192])
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    B, seqlens, dims, H = (2, [64], [16], 2) if args.smoke else (args.batch, args.seqlens, args.head_dims, args.heads)
    rows = []
    print(f"{'D':>4} {'S':>6} {'causal':>6} {'mode':>8} {'mask/none':>10} {'min':>7} {'max':>7}")
    for D in dims:
        for S in seqlens:
            tensors, _ = make_inputs(B, S, H, D, dtype, device)
            hides_nothing = torch.zeros(B, S, dtype=torch.bool, device=device)
            for causal in map(bool, args.causal):
                for mode in args.modes:
                    timing(tensors, causal, hides_nothing, mode, device)  # (compiled before the pairs)
                    ms = [{} for _ in range(args.pairs)]
                    for p, name in in_rounds(("none", "mask"), args.pairs):
                        ms[p][name] = timing(tensors, causal, hides_nothing if name == "mask" else None, mode, device)
                    ratios = [t["mask"] / t["none"] for t in ms]
                    ratio = statistics.median(ratios)
                    rows.append(dict(B=B, D=D, S=S, H=H, causal=causal, mode=mode, ratio=ratio, ratios=ratios,
                                     ms=ms))  # fmt: skip
                    print(f"{D:>4} {S:>6} {causal!s:>6} {mode:>8} {ratio:10.3f} {min(ratios):7.3f} {max(ratios):7.3f}",
                          flush=True)  # fmt: skip
    write_json(args.json, dict(device=device_name(device), dtype=str(dtype), rows=rows))


if __name__ == "__main__":
    main()
