"""Compile the Triton kernels for Hopper (sm_90a) on any machine, no GPU needed, and report
what ptxas says about each: registers per thread, spilled bytes, shared memory, how many
`wgmma.wait_group N` the PTX has for each N (N > 0: a matmul left in flight while other work
runs), and ptxas's performance warnings (C7514 / C7512: every wgmma of the kernel serialized).

    python -m benchmarks.kernel_report                       # built-in shapes, D=64 and 128
    python -m benchmarks.kernel_report --kind fwd --head-dims 128 --shape 128 64 8 4 --dump DIR
    python -m benchmarks.kernel_report --head-dims 128 --dropout   # the attention-dropout variants
    python -m benchmarks.kernel_report --head-dims 192 --head-dim-v 128   # v's head dim apart (MLA)
    python -m benchmarks.kernel_report --head-dims 128 256 --dtype fp32   # float32 inputs' shapes

Pointers and strides are compiled as 16-divisible, as the launcher's arguments are at these
shapes, so the figures match a compile on the GPU machine (checked on an H200: forward 196
registers, dQ 183, dK/dV 255 at D=128; benchmarks/results/kernel_report_h200.log).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ringflash.kernels import _block_d, _config_d, configs
from ringflash.kernels.backward import _dkdv_kernel, _dq_kernel
from ringflash.kernels.forward import _fwd_kernel

KERNELS = {"fwd": (_fwd_kernel, configs._FWD), "dkdv": (_dkdv_kernel, configs._DKDV), "dq": (_dq_kernel, configs._DQ)}
HOPPER_SHARED_BYTES = 232448  # per block on H100/H200 (227 KiB)


def compile_for_hopper(
    kind: str,
    D: int,
    causal: bool,
    cfg: configs.KernelConfig,
    dtype: str = "bf16",
    dropout: bool = False,
    Dv: int | None = None,
):
    """The kernel `kind` for `dtype` (bf16 or fp32) inputs of head dim D for q/k and Dv for v
    (default D), each padded as the launcher pads it; one kv head per q head; dropout: with
    attention dropout (the DROPOUT variant)."""
    fn = KERNELS[kind][0]
    Dv = D if Dv is None else Dv
    block_d, block_dv = _block_d(D), _block_d(Dv)
    rows = cfg.block_m if kind == "dkdv" else cfg.block_n
    descriptors = ({"Q", "DO"} if kind == "dkdv" else {"K", "V"}) if cfg.tma else set()
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in descriptors:
            block = block_dv if name in ("V", "DO") else block_d
            signature[name] = f"tensordesc<{dtype}[1,{rows},1,{block}]>"
        elif name in ("M", "L", "DELTA"):
            signature[name] = "*fp32"
        elif name in ("KLO", "KHI", "QLO", "QHI", "SPANS"):
            signature[name] = "*i32"
        elif name.isupper():  # the other tensors
            signature[name] = f"*{dtype}"
        elif (
            name.startswith("stride")
            or name in ("Hq", "Hkv", "Sq", "Sk", "q_start", "k_start", "win_left", "win_right")
            or (name.startswith("drop_") and name != "drop_scale")
        ):
            signature[name] = "i32"
        elif name in ("qk_scale", "sm_scale", "drop_scale"):
            signature[name] = "fp32"
        else:
            continue
        if signature[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    constants = dict(
        GROUP=1,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        HEAD_DIM_V=Dv,
        BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MASK=1 if causal else 0,  # tiles.MASK_WINDOW (causal: left unbounded, right 0) or MASK_NONE
        LEFT=False if kind != "dkdv" else causal,
        HAS_BIAS=False,
        PRECISION="tf32" if dtype == "bf16" else "ieee",
        TMA=cfg.tma,
        DROPOUT=dropout,
    )
    if kind == "fwd":
        constants.update(HAS_STATE=False, NORMALIZE=True, WARP_SPECIALIZE=cfg.warp_specialize, SCALE_SIGN=1)
    else:
        constants.update(ACCUMULATE=False, SCALE_SIGN=1)
    if kind == "dkdv":
        constants.update(QK_ORDER=cfg.qk_order, COMBINED_STATS=cfg.combined_stats)
    signature.update({name: "constexpr" for name in constants})
    return triton.compile(
        ASTSource(fn, signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def ptxas_report(ptx: str, workdir: Path) -> dict:
    """Run the ptxas that ships with Triton on one kernel's PTX."""
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    path = workdir / "kernel.ptx"
    path.write_text(ptx)
    res = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", os.devnull], capture_output=True, text=True, check=True
    )
    log = res.stderr
    return {
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
        "warnings": sorted(set(re.findall(r"\((C7\d+)\)", log))),
    }


def report(
    kind: str,
    D: int,
    causal: bool,
    cfg: configs.KernelConfig,
    workdir: Path,
    dump: Path | None = None,
    dtype="bf16",
    dropout=False,
    Dv=None,
) -> dict:
    kern = compile_for_hopper(kind, D, causal, cfg, dtype, dropout, Dv)
    ptx = kern.asm["ptx"]
    row = {
        "kind": kind,
        "D": D,
        "Dv": D if Dv is None else Dv,
        "causal": causal,
        "dropout": dropout,
        "config": asdict(cfg),
        "shared": kern.metadata.shared,
        "fits": kern.metadata.shared <= HOPPER_SHARED_BYTES,
        "waits": dict(
            sorted(
                collections.Counter(
                    int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
                ).items()
            )
        ),
        **ptxas_report(ptx, workdir),
    }
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        dv = "" if Dv in (None, D) else f"_dv{Dv}"
        stem = f"{kind}_d{D}{dv}_c{int(causal)}_{cfg.block_m}x{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
        (dump / f"{stem}.ptx").write_text(ptx)
        (dump / f"{stem}.ttgir").write_text(kern.asm["ttgir"])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument(
        "--head-dim-v", type=int, help="v's head dim (default: each of --head-dims); the config is the launcher's"
    )
    ap.add_argument(
        "--shape",
        type=int,
        nargs=4,
        metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
        help="this block shape (with tensor descriptors) instead of the built-in one",
    )
    ap.add_argument("--dropout", action="store_true", help="the kernels with attention dropout")
    ap.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp32"], help="input dtype (fp32: the float32 block shapes)"
    )
    ap.add_argument("--dump", type=Path, help="write each kernel's PTX and TTGIR here")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kind:
            for D in args.head_dims:
                Dv = D if args.head_dim_v is None else args.head_dim_v
                table_d = _config_d(_block_d(D), _block_d(Dv))  # as the launcher looks it up
                float32 = args.dtype == "fp32"
                cfg = (
                    configs.KernelConfig(*args.shape, tma=True)
                    if args.shape
                    else configs.pick(kind, table_d, float32=float32, interpreting=False, file_configs={})
                )
                dims = f"D={D:<3d}" if Dv == D else f"D={D}/Dv={Dv}"
                for causal in (False, True):
                    r = report(kind, D, causal, cfg, Path(tmp), args.dump, args.dtype, dropout=args.dropout, Dv=Dv)
                    rows.append(r)
                    fits = "" if r["fits"] else " (over the H200's shared memory)"
                    drop = " dropout" if args.dropout else ""
                    print(
                        f"{kind:4s}{drop} {args.dtype} {dims} causal={causal!s:5s} {cfg.block_m}x{cfg.block_n} "
                        f"w{cfg.num_warps} s{cfg.num_stages} tma={cfg.tma!s:5s} regs={r['regs']} "
                        f"spill_bytes={r['spill_bytes']} "
                        f"shared={r['shared']}{fits} waits={r['waits']} warnings={r['warnings'] or '-'}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
