"""Two versions of ringflash's local attention in one run, beside SDPA's cuDNN backend.

    git archive --prefix=ringflash_before/ OLD_COMMIT:ringflash | tar -x -C .baseline
    python -m benchmarks.compare_versions --baseline .baseline --json before_after.json

The baseline is a copy of an older ringflash package directory, imported under another name
(`ringflash_before`; the package uses relative imports only). Each (D, S, causal, mode) row
times the baseline, this checkout and SDPA cuDNN in turn, --repeats times in alternating order
so that a drift of the GPU's clock falls on both; the table gives medians, the ratio of this
checkout to the baseline and the spread of that ratio over the repeats. Extra variants of this
checkout (--variants qk_order combined+32x128 ...: see variant_context) are timed in the same
rotation. --kv-heads N gives k and v N heads (GQA; SDPA gets them repeated to the query heads).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.common import attention_flops, bench_ms, device_name, in_rounds, step_fn, write_json


def load_baseline(root: Path, name: str):
    """The package directory `root/name` imported as module `name`."""
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def sdpa(q, k, v, causal):
    """SDPA with the cuDNN backend on GPUs (its math backend on CPU, for the smoke run)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def variant_context(name, head_dim):
    """A context manager that makes this checkout run variant `name` at head_dim: "+"-joined
    changes of the dK/dV pass's config: qk_order (the forward's operand order), combined
    (probabilities from m + log2 l), 32x128 (32 query rows per tile, 8 warps, 3 stages); or
    of the forward: gluon=NAME (that Gluon forward variant), gluon=none (the Triton forward);
    of the backward: gluon_bwd=NAME (that fused variant, forced), gluon_bwd=none (the two passes),
    bwd_min_programs=N (configs.GLUON_BWD_MIN_PROGRAMS_PER_SM set to N, not forced: the fused
    backward's default choice with another occupancy threshold, call plans still replayed)."""
    from ringflash.kernels import configs

    if not name:
        return contextlib.nullcontext()
    base = configs.dkdv_config(max(16, 1 << (head_dim - 1).bit_length())).__dict__
    cfg, forced, constants = base.copy(), {}, {}
    for part in name.split("+"):
        if part.startswith("bwd_min_programs="):
            constants["GLUON_BWD_MIN_PROGRAMS_PER_SM"] = float(part.split("=", 1)[1])
        elif part == "qk_order":
            cfg["qk_order"] = True
        elif part == "combined":
            cfg["combined_stats"] = True
        elif part == "32x128":
            cfg.update(block_m=32, block_n=128, num_warps=8, num_stages=3)
        elif part.startswith(("gluon=", "gluon_bwd=")):
            kind, value = part.split("=", 1)
            forced[kind] = None if value == "none" else value
        else:
            raise ValueError(f"unknown variant part {part!r}")
    if cfg != base:
        forced["dkdv"] = configs.KernelConfig(**cfg)
    return _variant(forced, constants)


@contextlib.contextmanager
def _variant(forced: dict, constants: dict):
    """configs.override(**forced) with configs' module constants set to `constants` inside; the
    remembered calls forgotten on the way in and out (a call plan keeps the choices its first
    calls made under the constants then in force)."""
    from ringflash import local
    from ringflash.kernels import configs

    saved = {name: getattr(configs, name) for name in constants}
    local._CALLS.clear()
    try:
        for name, value in constants.items():
            setattr(configs, name, value)
        with configs.override(**forced):
            yield
    finally:
        for name, value in saved.items():
            setattr(configs, name, value)
        local._CALLS.clear()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="folder holding the old package directory")
    ap.add_argument("--baseline-name", default="ringflash_before")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, help="k's and v's heads (default: --heads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the tests keep it working)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.seqlens, args.head_dims, args.heads, args.repeats = [64], [32], 2, 2
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        raise SystemExit(f"--kv-heads {kv_heads} must divide --heads {args.heads}")
    import ringflash

    before = load_baseline(args.baseline, args.baseline_name)
    rows = []
    for D in args.head_dims:
        for S in args.seqlens:
            g = torch.Generator(device=device).manual_seed(0)
            qkv = [
                torch.randn(1, S, H, D, device=device, dtype=dtype, generator=g).requires_grad_()
                for H in (args.heads, kv_heads, kv_heads)
            ]
            # SDPA's heads all alike: k and v repeated to the query heads
            bhsd = [
                t.detach().repeat_interleave(args.heads // t.shape[2], dim=2).transpose(1, 2).contiguous() for t in qkv
            ]
            bhsd = [t.requires_grad_() for t in bhsd]
            do = torch.randn_like(qkv[0])
            do_bhsd = do.transpose(1, 2).contiguous()
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    impls = {
                        "before": (lambda c=causal: before.flash_attn_func(*qkv, causal=c), qkv, do, None),
                        "after": (lambda c=causal: ringflash.flash_attn_func(*qkv, causal=c), qkv, do, None),
                        "cudnn": (lambda c=causal: sdpa(*bhsd, c), bhsd, do_bhsd, None),
                    }
                    for name in args.variants:
                        impls[f"after:{name}"] = (
                            lambda c=causal: ringflash.flash_attn_func(*qkv, causal=c),
                            qkv,
                            do,
                            name,
                        )
                    times = {name: [] for name in impls}
                    for _, name in in_rounds(impls, args.repeats):
                        call, inputs, grad, variant = impls[name]
                        with variant_context(variant, D):
                            times[name].append(bench_ms(step_fn(call, inputs, grad, mode), device))
                    flop = attention_flops(1, args.heads, S, D, causal, mode)
                    row = {
                        "D": D,
                        "S": S,
                        "causal": causal,
                        "mode": mode,
                        "ms": times,
                        "tflops": {n: flop / statistics.median(t) / 1e9 for n, t in times.items()},
                        "after_over_before": [b / a for a, b in zip(times["after"], times["before"])],
                    }
                    rows.append(row)
                    print(row, flush=True)
    write_json(
        args.json,
        {
            "meta": {
                "device": device_name(device),
                "torch": torch.__version__,
                "heads": args.heads,
                "kv_heads": kv_heads,
                "repeats": args.repeats,
            },
            "rows": rows,
        },
    )
    extra = [f"after:{n}" for n in args.variants]
    print(
        f"\n{'D':>4} {'S':>6} {'causal':>6} {'mode':>8} | {'before':>7} {'after':>7} {'cudnn':>7} | "
        f"{'after/before':>12} {'spread':>7} | " + " ".join(f"{n:>22}" for n in extra)
    )
    for r in rows:
        t, ratio = r["tflops"], r["after_over_before"]
        print(
            f"{r['D']:>4} {r['S']:>6} {str(r['causal']):>6} {r['mode']:>8} | {t['before']:7.1f} {t['after']:7.1f} "
            f"{t['cudnn']:7.1f} | {statistics.median(ratio):12.3f} {max(ratio) - min(ratio):7.3f} | "
            + " ".join(f"{t[n]:10.1f} ({t[n] / t['after']:.3f}x)" for n in extra)
        )


if __name__ == "__main__":
    main()
