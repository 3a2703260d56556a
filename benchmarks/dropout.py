"""Attention dropout's cost: ringflash with dropout_p = 0 and p, beside SDPA's FLASH_ATTENTION
backend with the same dropout_p (it draws its own mask), in the same run.

    python -m benchmarks.dropout --json benchmarks/results/dropout_h200.json
    python -m benchmarks.dropout --smoke           # tiny CPU run (CI keeps it working)

Prints TFLOP/s of the attention (forward 4*B*H*S*S*D, half for causal; forward+backward 3.5x;
the dropped pairs counted as computed) and the ratios: dropout / no dropout for ringflash, and
ringflash / SDPA at the same p. Medians of triton.testing.do_bench on the GPU.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_local import make_inputs
from benchmarks.common import add_local_args, attention_flops, bench_device, bench_ms, device_name, step_fn, write_json
from ringflash import flash_attn_func


def runner(impl, tensors, causal, p, mode):
    q, k, v = tensors
    do = torch.randn_like(q)
    if impl == "ringflash":
        call = lambda: flash_attn_func(q, k, v, causal=causal, dropout_p=p)  # noqa: E731
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)

    return step_fn(call, (q, k, v), do, mode)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=float, default=0.1)
    add_local_args(ap, [4096, 16384])
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    seqlens, dims, H = ([64], [16], 2) if args.smoke else (args.seqlens, args.head_dims, args.heads)
    rows = []
    print(f"{'D':>4} {'S':>6} {'causal':>6} {'mode':>8} {'p=0':>7} {'p':>7} {'sdpa p':>7} {'p/p0':>6} {'/sdpa':>6}")
    for D in dims:
        for S in seqlens:
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    ours, sdpa = make_inputs(1, S, H, D, dtype, device)
                    flops = attention_flops(1, H, S, D, causal, mode)
                    ms = {
                        "p0": bench_ms(runner("ringflash", ours, causal, 0.0, mode), device),
                        "p": bench_ms(runner("ringflash", ours, causal, args.p, mode), device),
                        "sdpa_p": bench_ms(runner("sdpa", sdpa, causal, args.p, mode), device),
                    }
                    tf = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
                    row = dict(D=D, S=S, causal=causal, mode=mode, p=args.p, ms=ms, tflops=tf,
                               dropout_cost=ms["p"] / ms["p0"], vs_sdpa=ms["sdpa_p"] / ms["p"])  # fmt: skip
                    rows.append(row)
                    print(
                        f"{D:>4} {S:>6} {causal!s:>6} {mode:>8} {tf['p0']:7.1f} {tf['p']:7.1f} {tf['sdpa_p']:7.1f} "
                        f"{row['dropout_cost']:6.2f} {row['vs_sdpa']:6.2f}",
                        flush=True,
                    )
    write_json(args.json, dict(device=device_name(device), dtype=str(dtype), rows=rows))


if __name__ == "__main__":
    main()
