"""Host time per call of the local attention, layer by layer, on one device.

    python -m benchmarks.host_overhead --json benchmarks/results/host_overhead_h200.json
    python -m benchmarks.host_overhead --smoke          # tiny CPU run (CI keeps it working)

At short sequences a call's time is the host's: checks, dispatch, launches. For each S (B=1,
H=32, D=128, causal, bf16 on a GPU) this times --calls calls in a row on the host clock (one
synchronize at the end), forward without gradients and forward+backward, of
  public     ringflash.flash_attn_func (eager: the autograd Function, no operator dispatch)
  operator   torch.ops.ringflash.flash_fwd with its registered autograd (what torch.compile
             traces; eager calls went through it before)
  backend    the backend's forward alone (ringflash.local.block_forward; forward only)
  sdpa       torch's scaled_dot_product_attention, FLASH_ATTENTION backend, on (B, H, S, D)
and prints microseconds per call.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import ringflash
from benchmarks.common import bench_device, device_name, host_seconds, result_meta, write_json
from ringflash import ops
from ringflash.local import block_forward
from ringflash.masks import CAUSAL, BlockMask
from ringflash.merge import SoftmaxState


def per_call_us(fn, calls, device):
    return host_seconds(fn, device, calls=calls, warmup=5) * 1e6


def callables(S, args, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, S, args.heads, args.head_dim)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = args.head_dim**-0.5
    backend = ringflash.local.backend_name(device)

    def public():
        return ringflash.flash_attn_func(q, k, v, causal=True)

    def operator():
        return ops.flash_fwd(q, k, v, None, None, None, 0, 0, -1, 0, scale, 0.0, None, backend, False, -1, -1)[0]

    fns = {"public": public, "operator": operator}
    if device.type == "cuda":
        bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        do_bhsd = do.transpose(1, 2).contiguous()

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*bhsd, is_causal=True)

        fns["sdpa"] = sdpa
    rows = {}
    for name, fn in fns.items():
        grad_do = do_bhsd if name == "sdpa" else do

        def fwd(fn=fn):
            with torch.no_grad():
                fn()

        def fwd_bwd(fn=fn, grad_do=grad_do):
            fn().backward(grad_do)

        rows[name] = {"fwd": per_call_us(fwd, args.calls, device), "fwd+bwd": per_call_us(fwd_bwd, args.calls, device)}
    qd, kd, vd = (t.detach() for t in (q, k, v))

    def backend_only():
        state = SoftmaxState.empty(torch.empty_like(qd))
        block_forward(qd, kd, vd, state, BlockMask(0, 0, CAUSAL), scale=scale, fold=False, normalize=True)

    rows["backend"] = {"fwd": per_call_us(backend_only, args.calls, device)}
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.calls = [16], 2, 16, 3
    out = []
    print(f"host time per call (us) on {device_name(device)}: B=1, H={args.heads}, D={args.head_dim}, causal, {dtype}")
    for S in args.seqlens:
        for name, times in callables(S, args, device, dtype).items():
            out.append({"seq_len": S, "impl": name, **{f"{m}_us": t for m, t in times.items()}})
            cells = "  ".join(f"{m} {t:8.1f}" for m, t in times.items())
            print(f"S={S:>6} {name:>9}: {cells}", flush=True)
    if args.json:
        write_json(args.json, {"meta": result_meta(device), "rows": out})


if __name__ == "__main__":
    main()
