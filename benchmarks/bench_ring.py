"""Ring attention speed per GPU, beside PyTorch's context parallel, in the same run.

    ringflash-run -m benchmarks.bench_ring --json benchmarks/results/ring_2xh200.json
    ringflash-run --nproc 2 --backend gloo -m benchmarks.bench_ring --smoke     # CPU, toy sizes

For each total sequence length S (sharded over the P ranks), causal and not, forward and
forward+backward, it times:
  ring        ringflash.ring_flash_attn_func over the process group (zigzag layout)
  local       the same rank's block schedule replayed on its own device with no communication
              (ReplayComm copies each K/V block in place of receiving it): the single-GPU
              kernel on the local share of the work
  cp_cudnn    torch.distributed.tensor.experimental.context_parallel, SDPA CUDNN_ATTENTION
  cp_flash    the same with SDPA FLASH_ATTENTION
(CP's head-tail load balancing is on for causal runs and off otherwise, as it requires; the
peers run on GPUs only.)
Per-GPU TFLOP/s = total FLOPs / P / time, with FLOPs 4*B*H*S*S*D (half for causal), 3.5x for
forward+backward; time = the median iteration on each rank, the slowest rank. Ring
efficiency = ring / local.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    add_shape_args,
    attention_flops,
    rank_inputs,
    run_meta,
    start_ring,
    step_fn,
    timed_on_ranks,
    write_json,
)
from ringflash import ring_flash_attn_func
from ringflash.dist_env import close
from ringflash.masks import CAUSAL, FULL
from ringflash.ring import RingSpec, _RingAttn
from ringflash.testing import ReplayComm


def cp_case(args, backend_name, S, causal, mode, device, mesh, dtype):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    g = torch.Generator(device=device).manual_seed(1)
    # CP shards (B, H, S, D) buffers in place. K/V get all `heads` heads even for a GQA run:
    # SDPA's CP path has no GQA; the FLOPs (counted on query heads) are the same.
    q, k, v = (
        torch.randn(args.batch, args.heads, S, args.head_dim, device=device, dtype=dtype, generator=g) for _ in range(3)
    )
    _cp_options.enable_load_balance = causal  # head-tail balancing needs is_causal=True
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(ql)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)

        return timed_on_ranks(
            step_fn(call, (ql, kl, vl), do, mode), iters=args.iters, warmup=args.warmup, device=device
        )


def ring_cases(args, S, causal, mode, device, dtype, rank, world):
    q, k, v, do = rank_inputs(args, S // world, rank, device, dtype)
    out = {}
    call = lambda: ring_flash_attn_func(q, k, v, causal=causal, layout=args.layout)
    out["ring"] = timed_on_ranks(
        step_fn(call, (q, k, v), do, mode), iters=args.iters, warmup=args.warmup, device=device
    )
    spec = RingSpec(CAUSAL if causal else FULL, args.head_dim**-0.5, args.layout)
    blocks = [(k.detach(), v.detach())] * world  # contents do not change the work

    def replay():
        comm = ReplayComm(rank, world, blocks, record=False)
        return _RingAttn.apply(q, k, v, None, spec, comm)[0]

    out["local"] = timed_on_ranks(
        step_fn(replay, (q, k, v), do, mode), iters=args.iters, warmup=args.warmup, device=device
    )
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    add_shape_args(ap)
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--peers",
        nargs="*",
        default=["cudnn", "flash"],
        choices=["cudnn", "flash"],
        help="context_parallel's SDPA backends to time beside the ring (none: --peers)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="toy sizes (CPU with gloo)")
    args = ap.parse_args()
    rank, world, device, dtype = start_ring(args, "bench_ring", timeout_s=600)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.iters, args.warmup = [64 * world], 2, 16, 2, 1
    args.kv_heads = args.kv_heads or args.heads
    # context_parallel runs on GPUs only: on CPU its math path is no meaningful peer, fails on
    # causal inputs part-way through its collectives, and with gloo (torch 2.13) made one of the
    # processes abort at exit in about 1 run of 10 even when it had only run forward.
    peers = args.peers if device.type == "cuda" else []
    mesh = None
    if peers:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    rows = []
    for S in args.seqlens:
        for causal in (False, True):
            for mode in ("fwd", "fwd+bwd"):
                res = ring_cases(args, S, causal, mode, device, dtype, rank, world)
                for p in peers:
                    res[f"cp_{p}"] = cp_case(args, p, S, causal, mode, device, mesh, dtype)
                flop = attention_flops(args.batch, args.heads, S, args.head_dim, causal, mode)
                row = {
                    "S": S,
                    "causal": causal,
                    "mode": mode,
                    "ms": res,
                    "tflops_per_gpu": {k: flop / world / ms / 1e9 for k, ms in res.items() if isinstance(ms, float)},
                }
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        meta = run_meta(args, world, device, dtype, layout=args.layout)
        write_json(args.json, {"meta": meta, "rows": rows})
        print(f"\nper-GPU TFLOP/s, P={world}, H={args.heads}/{args.kv_heads}, D={args.head_dim}, {dtype}")
        names = [f"cp_{p}" for p in peers]
        print(
            f"{'S':>7} {'causal':>6} {'mode':>8} | {'ring':>7} {'local':>7} {'eff':>5} | "
            + " ".join(f"{n:>8}" for n in names)
            + " | "
            + " ".join(f"{'/' + n[3:]:>7}" for n in names)
        )
        for r in rows:
            t = r["tflops_per_gpu"]
            peer = [t.get(n, float("nan")) for n in names]
            print(
                f"{r['S']:>7} {str(r['causal']):>6} {r['mode']:>8} | {t['ring']:7.1f} {t['local']:7.1f} "
                f"{t['ring'] / t['local']:5.2f} | "
                + " ".join(f"{x:8.1f}" for x in peer)
                + " | "
                + " ".join(f"{t['ring'] / x:7.2f}" for x in peer)
            )
    close()


if __name__ == "__main__":
    main()
