"""Errors at large scores against float64: ringflash's backends beside the plain baselines.

    TRITON_INTERPRET=1 python -m benchmarks.precision_large_scores          # CPU: torch + interpreter
    python -m benchmarks.precision_large_scores --backends triton --device cuda --dtype float32

q and k are scaled by --mag (30: |scores| ~ 1e4 at D=32, scale 1.0), seeds 1..--seeds, dO drawn
from the same seeded generator. For out, dq, dk, dv it prints the largest max-abs error over the
seeds of: each backend, plain autograd through a softmax ("plain"), and the flash algorithm
written plainly in the same dtype ("flash_plain": delta = rowsum(dO * out), P rebuilt from the
row max and normalizer). --baseline DIR adds an older copy of the package (imported as
ringflash_before), e.g. `git archive --prefix=ringflash_before/ REV:ringflash | tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from ringflash import flash_attn_func
from ringflash.local import use_backend
from ringflash.testing import flash_plain, max_err, naive_attention


def case(seed, mag, S, H, D, dtype, device):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, S, H, D, generator=g) for _ in range(4))
    return [t.to(device, dtype) for t in (q * mag, k * mag, v, do)]


def errors(fn, q, k, v, do, ref, scale):
    """fn(q, k, v, scale, do) -> (out, dq, dk, dv); their errors against ref."""
    return [max_err(x, r) for x, r in zip(fn(q, k, v, scale, do), ref)]


def forward_backward(attention, q, k, v, scale, do):
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = attention(qs, ks, vs, scale)
    return (out, *torch.autograd.grad(out, (qs, ks, vs), do))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    ap.add_argument("--baseline", type=Path, help="folder holding an older ringflash_before package")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--mag", type=float, default=30.0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seqlen", type=int, default=50)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    impls = {}
    for backend in args.backends:
        impls[backend] = lambda *a, b=backend: _with(b, flash_attn_func, *a)
    if args.baseline:
        sys.path.insert(0, str(args.baseline))
        before = importlib.import_module("ringflash_before")
        for backend in args.backends:
            impls[f"{backend} (before)"] = lambda *a, b=backend: _with_env(b, before.flash_attn_func, *a)
    plain = lambda q, k, v, s: naive_attention(q, k, v, scale=s, dtype=q.dtype)[0]
    impls["plain"] = lambda *a: forward_backward(plain, *a)
    worst = {name: [0.0] * 4 for name in [*impls, "flash_plain"]}
    for seed in range(1, args.seeds + 1):
        q, k, v, do = case(seed, args.mag, args.seqlen, args.heads, args.head_dim, dtype, args.device)
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        out = naive_attention(qr, kr, vr, scale=args.scale)[0]
        ref = [out, *torch.autograd.grad(out, (qr, kr, vr), do.double())]
        for name, fn in impls.items():
            worst[name] = [max(a, b) for a, b in zip(worst[name], errors(fn, q, k, v, do, ref, args.scale))]
        fp = flash_plain(q, k, v, do, scale=args.scale)
        errs = [max_err(x, r) for x, r in zip((fp[0], *fp[2:]), ref)]
        worst["flash_plain"] = [max(a, b) for a, b in zip(worst["flash_plain"], errs)]
    print(
        f"max abs error against float64 over seeds 1..{args.seeds}: q, k x {args.mag}, scale {args.scale}, "
        f"S={args.seqlen}, H={args.heads}, D={args.head_dim}, {args.dtype}, {args.device}"
    )
    print(f"{'':>16} | {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8}")
    for name, errs in worst.items():
        print(f"{name:>16} | " + " ".join(f"{e:8.1e}" for e in errs))


def _with(backend, fn, q, k, v, scale, do):
    with use_backend(backend):
        return forward_backward(lambda *a: fn(*a[:3], softmax_scale=a[3]), q, k, v, scale, do)


def _with_env(backend, fn, q, k, v, scale, do):
    """The older package chose its backend from RINGFLASH_BACKEND at every call."""
    import os

    old = os.environ.get("RINGFLASH_BACKEND")
    os.environ["RINGFLASH_BACKEND"] = backend
    try:
        return forward_backward(lambda *a: fn(*a[:3], softmax_scale=a[3]), q, k, v, scale, do)
    finally:
        if old is None:
            os.environ.pop("RINGFLASH_BACKEND")
        else:
            os.environ["RINGFLASH_BACKEND"] = old


if __name__ == "__main__":
    main()
