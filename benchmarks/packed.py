"""Packed documents and sliding windows on one device: ringflash.flash_attn_varlen_func and
flash_attn_func(window_size=...) beside FlexAttention (compiled, document / sliding-window
block masks), SDPA cuDNN run once per document, and our own dense causal kernel at the same
total length, all in one run.

    python -m benchmarks.packed --json packed.json            # one GPU: 16K and 64K, both mixes
    python -m benchmarks.packed --smoke                       # CPU: tiny sizes, the code paths only

TFLOP/s are counted over the visible (query, key) pairs only: 4 * H * D * pairs for the forward,
3.5x that for forward + backward. Document mixes (lengths drawn until the total is reached, the
last one cut to fit; numpy default_rng(seed)):
  longtail: log-uniform in [128, 32768] tokens;  short: log-uniform in [64, 2048] tokens;
  fixed:N (e.g. --mixes fixed:1024): documents of N tokens each (the last one shorter).
--v-head-dim sets v's head dim apart (MLA: --head-dim 192 --v-head-dim 128; FLOPs then count
QK^T at D and PV at Dv). The sliding-window row is causal with a window of W keys
(window_size=(W - 1, 0)); its "predicted" time is the visible pairs at the dense causal
kernel's rate at the same length.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import ringflash
from benchmarks.common import bench_ms, device_name, write_json
from ringflash.kernels import configs

MIXES = {"longtail": (128, 32768), "short": (64, 2048)}


def document_lengths(mix: str, total: int, seed: int) -> list[int]:
    """Lengths log-uniform in MIXES[mix] summing to total (the last one cut to fit); mix
    "fixed:N": N tokens each."""
    if mix.startswith("fixed:"):
        n = int(mix.split(":")[1])
        return [n] * (total // n) + ([total % n] if total % n else [])
    lo, hi = MIXES[mix]
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def causal_pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def window_pairs(n: int, width: int) -> int:
    """Visible pairs of causal attention over n tokens where each sees its last `width` keys."""
    return sum(min(i + 1, width) for i in range(n))


def step(call, inputs, do, mode):
    """A callable running call() without gradients ("fwd") or call() then backward."""
    if mode == "fwd":

        def run():
            with torch.no_grad():
                call()

        return run

    def run_bwd():
        for t in inputs:
            t.grad = None
        outs = call()
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        dos = do if isinstance(do, (list, tuple)) else [do]
        torch.autograd.backward(outs, dos)

    return run_bwd


def parse_variant(text: str) -> dict:
    """'fwd=128,64,8,3,tma;dq=...' -> {kind: KernelConfig} for configs.override: block_m,
    block_n, num_warps, num_stages, then flags (tma; plain: dK/dV without the combined row
    statistics); 'gluon=ws2_n64' (a Gluon
    forward variant) or 'gluon=none' (the Triton forward); 'gluon_bwd=ws2_lag' (the fused
    backward at any size, packed documents included) or 'gluon_bwd=none' (the two passes)."""
    out = {}
    for part in text.split(";"):
        kind, spec = part.split("=")
        if kind in ("gluon", "gluon_bwd"):
            out[kind] = None if spec == "none" else spec
            continue
        fields = spec.split(",")
        flags = set(fields[4:])
        out[kind] = configs.KernelConfig(*map(int, fields[:4]), tma="tma" in flags,
                                         combined_stats="plain" not in flags)  # fmt: skip
    return out


def variant_ms(fn, variant, device) -> float:
    """bench_ms of fn under the --variants override `variant` (None: the defaults); a variant
    whose kernel does not compile or launch (a sweep's tiles too large for shared memory) is
    reported and timed as nan, so one bad shape does not end the sweep."""
    if variant is None:
        return bench_ms(fn, device)
    try:
        with configs.override(**parse_variant(variant)):
            return bench_ms(fn, device)
    except Exception as e:  # triton's OutOfResources and compile errors
        print(f"variant {variant}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def flex_fns(T, H, device, dtype):
    """(compiled flex_attention, create_block_mask), or None where FlexAttention is unavailable."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    if torch.device(device).type != "cuda":
        return None
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def measure(args, device, dtype):
    H, D = args.heads, args.head_dim
    Dv = args.v_head_dim or D
    rows = []
    flex = None
    for total in args.totals:
        g = torch.Generator(device=device).manual_seed(0)
        mk = lambda d: torch.randn(total, H, d, device=device, dtype=dtype, generator=g)  # noqa: E731
        q, k, v, do = mk(D).requires_grad_(), mk(D).requires_grad_(), mk(Dv).requires_grad_(), mk(Dv)
        # (1, H, T, D) copies for SDPA / Flex, made once outside the timings
        bhsd = [t.detach().permute(1, 0, 2)[None].contiguous().requires_grad_() for t in (q, k, v)]
        do_bhsd = do.permute(1, 0, 2)[None].contiguous()
        if flex is None:
            flex = not args.no_peers and "flex" in args.peers and flex_fns(total, H, device, dtype)
        dense_pairs = total * (total + 1) // 2
        cases = []
        for mix in args.mixes:
            lengths = document_lengths(mix, total, args.seed)
            cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
            cases.append((f"docs:{mix}", lengths, cu, causal_pairs(lengths)))
        for mode in args.modes:
            scale = 3.5 if mode == "fwd+bwd" else 1.0
            flop = lambda pairs: 2 * H * (D + Dv) * pairs * scale  # noqa: E731 (QK^T at D, PV at Dv)
            dense = step(
                lambda: ringflash.flash_attn_func(q[None], k[None], v[None], causal=True), (q, k, v), do[None], mode
            )
            dense_ms = bench_ms(dense, device)
            dense_rate = flop(dense_pairs) / dense_ms / 1e9
            rows.append(
                dict(
                    case="dense causal",
                    total=total,
                    mode=mode,
                    impl="ringflash",
                    ms=dense_ms,
                    pairs=dense_pairs,
                    tflops=dense_rate,
                )
            )
            for name, lengths, cu, pairs in cases:
                impls = {
                    "ringflash": step(
                        lambda cu=cu: ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True),
                        (q, k, v),
                        do,
                        mode,
                    )
                }
                if device.type == "cuda" and not args.no_peers and "cudnn" in args.peers:
                    impls["cudnn per doc"] = step(
                        lambda cu=cu: per_document_sdpa(bhsd, cu), bhsd, per_document_grads(do_bhsd, cu), mode
                    )
                if flex:
                    mask = document_block_mask(flex[1], cu, total, device)
                    impls["flex"] = step(lambda m=mask: flex[0](*bhsd, block_mask=m), bhsd, do_bhsd, mode)
                timed = [(impl, fn, None) for impl, fn in impls.items()]
                timed += [(f"rf[{v}]", impls["ringflash"], v) for v in args.variants]
                for impl, fn, variant in timed:
                    ms = variant_ms(fn, variant, device)
                    rows.append(
                        dict(
                            case=name,
                            total=total,
                            mode=mode,
                            impl=impl,
                            ms=ms,
                            pairs=pairs,
                            docs=len(lengths),
                            keys_per_row=pairs / total,
                            tflops=flop(pairs) / ms / 1e9,
                            vs_dense_rate=flop(pairs) / ms / 1e9 / dense_rate,
                        )
                    )
            if total in args.window_totals:
                W = args.window
                pairs = window_pairs(total, W)
                impls = {
                    "ringflash": step(
                        lambda: ringflash.flash_attn_func(
                            q[None], k[None], v[None], causal=True, window_size=(W - 1, 0)
                        ),
                        (q, k, v),
                        do[None],
                        mode,
                    )
                }
                if flex:
                    mask = window_block_mask(flex[1], W, total, device)
                    impls["flex"] = step(lambda m=mask: flex[0](*bhsd, block_mask=m), bhsd, do_bhsd, mode)
                predicted_ms = flop(pairs) / dense_rate / 1e9
                timed = [(impl, fn, None) for impl, fn in impls.items()]
                timed += [(f"rf[{v}]", impls["ringflash"], v) for v in args.variants]
                for impl, fn, variant in timed:
                    ms = variant_ms(fn, variant, device)
                    rows.append(
                        dict(
                            case=f"window:{W}",
                            total=total,
                            mode=mode,
                            impl=impl,
                            ms=ms,
                            pairs=pairs,
                            tflops=flop(pairs) / ms / 1e9,
                            predicted_ms=predicted_ms,
                            vs_predicted=ms / predicted_ms,
                        )
                    )
    return rows


def per_document_sdpa(bhsd, cu):
    """SDPA (cuDNN) causal attention, one call per document, on (1, H, T, D) slices."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = bhsd
    bounds = cu.tolist()
    outs = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True))
    return outs


def per_document_grads(do_bhsd, cu):
    bounds = cu.tolist()
    return [do_bhsd[:, :, a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


# create_block_mask evaluates mask_mod over the whole total x total grid unless compiled:
# 128K tokens make a 16 Gi-element mask and its temporaries (~128 GiB); compiled, it works
# block by block. Small totals stay eager (no compile time).
EAGER_MASK_ELEMENTS = 1 << 30


def block_mask(create_block_mask, mask_mod, total, device):
    compile_mask = total * total > EAGER_MASK_ELEMENTS
    return create_block_mask(mask_mod, None, None, total, total, device=device, _compile=compile_mask)


def document_block_mask(create_block_mask, cu, total, device):
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), (cu[1:] - cu[:-1]).long())

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return block_mask(create_block_mask, mask_mod, total, device)


def window_block_mask(create_block_mask, width, total, device):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < width)

    return block_mask(create_block_mask, mask_mod, total, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--totals", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), help=f"{list(MIXES)} or fixed:N")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--window", type=int, default=4096, help="sliding window width in keys")
    ap.add_argument("--window-totals", type=int, nargs="*", default=[65536])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument(
        "--v-head-dim", type=int, default=None, help="v's head dim (default: --head-dim), e.g. 128 beside 192"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="extra ringflash rows with other block shapes, e.g. "
        "'fwd=128,64,8,3,tma;dq=128,64,8,3,tma;dkdv=64,128,8,3,tma', or another forward: "
        "'gluon=none' (the Triton kernel), 'gluon=ws2_s3' (a Gluon variant), 'gluon_bwd=none' / 'gluon_bwd=ws2_lag' "
        "(the backward's two passes / the fused one forced)",
    )
    ap.add_argument("--no-peers", action="store_true", help="ringflash and its --variants only")
    ap.add_argument(
        "--peers", nargs="+", default=["flex", "cudnn"], choices=["flex", "cudnn"], help="which peers run beside it"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args()
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.totals, args.window_totals, args.window, args.heads, args.head_dim = [256], [256], 32, 2, 16
        args.modes = ["fwd"]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    rows = measure(args, device, dtype)
    write_json(
        args.json,
        {
            "meta": {
                "device": device_name(device),
                "torch": torch.__version__,
                "heads": args.heads,
                "head_dim": args.head_dim,
                "v_head_dim": args.v_head_dim or args.head_dim,
                "dtype": str(dtype),
                "seed": args.seed,
                "mixes": {m: MIXES.get(m, m) for m in args.mixes},
                "date": time.strftime("%Y-%m-%d"),
            },
            "rows": rows,
        },
    )
    print(f"\nvisible-pair TFLOP/s (H={args.heads}, D={args.head_dim}, Dv={args.v_head_dim or args.head_dim}, {dtype})")
    print(
        f"{'case':>14} {'total':>6} {'mode':>8} {'impl':>14} {'ms':>9} {'TFLOP/s':>8} {'vs dense':>8} {'vs pred':>7} "
        f"{'keys/row':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:>14} {r['total']:>6} {r['mode']:>8} {r['impl']:>14} {r['ms']:9.3f} {r['tflops']:8.1f} "
            f"{r.get('vs_dense_rate', float('nan')):8.2f} {r.get('vs_predicted', float('nan')):7.2f} "
            f"{r.get('keys_per_row', float('nan')):8.0f}"
        )
    print("\nringflash speed over the peer's (time ratio, > 1: ringflash faster)")
    by = {(r["case"], r["total"], r["mode"], r["impl"]): r["ms"] for r in rows}
    for (case, total, mode, impl), ms in by.items():
        if impl != "ringflash" and (case, total, mode, "ringflash") in by:
            print(f"{case:>14} {total:>6} {mode:>8} vs {impl:>14}: {ms / by[case, total, mode, 'ringflash']:5.2f}x")


if __name__ == "__main__":
    main()
