"""Registers, spills and wgmma waits of the Triton kernels one fwd+bwd call compiles (GPU).

    python benchmarks/kernel_report.py --seqlen 16384 --head-dim 128 [--causal] [--fwd-shape 128 64 8 4]

For each compiled kernel: registers per thread, spilled bytes, and how many
`wgmma.wait_group N` instructions its PTX has for each N (N > 0 means a dot left in flight
while other work runs). The PTX and TTGIR go to --dump DIR when given.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ringflash import flash_attn_func  # noqa: E402
from ringflash.kernels import configs  # noqa: E402
from ringflash.kernels.backward import _dkdv_kernel, _dq_kernel  # noqa: E402
from ringflash.kernels.forward import _fwd_kernel  # noqa: E402


def compiled(jit_fn):
    """The CompiledKernel objects in a JITFunction's caches (the cache layout differs by version)."""
    for entry in getattr(jit_fn, "device_caches", {}).values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                yield from (k for k in part.values() if hasattr(k, "asm"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--fwd-shape", type=int, nargs=4, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                    help="the forward's block shape instead of the built-in one")
    ap.add_argument("--dump", type=Path)
    args = ap.parse_args()
    D = args.head_dim
    if args.fwd_shape:
        configs.OVERRIDES["fwd"] = configs.KernelConfig(*args.fwd_shape, tma=True)
    q, k, v = (torch.randn(1, args.seqlen, args.heads, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flash_attn_func(q, k, v, causal=args.causal).sum().backward()
    torch.cuda.synchronize()
    for fn in (_fwd_kernel, _dkdv_kernel, _dq_kernel):
        for kern in compiled(fn):
            ptx = kern.asm.get("ptx", "")
            waits = collections.Counter(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))
            n_wgmma = len(re.findall(r"wgmma\.mma_async", ptx))
            print(f"{kern.name:14s} causal={args.causal} D={D} regs={kern.n_regs} "
                  f"spills={kern.n_spills} wgmma={n_wgmma} waits={dict(sorted(waits.items()))}")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                stem = f"{kern.name}_c{int(args.causal)}_d{D}"
                (args.dump / f"{stem}.ptx").write_text(ptx)
                (args.dump / f"{stem}.ttgir").write_text(kern.asm.get("ttgir", ""))


if __name__ == "__main__":
    main()
