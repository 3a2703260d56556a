"""Ring attention speed per GPU, beside PyTorch's context parallel, in the same run.

    launch/run.sh benchmarks/bench_ring.py --json benchmarks/results/ring_2xh200.json
    RINGFLASH_NPROC=2 launch/run.sh benchmarks/bench_ring.py --smoke     # CPU, gloo, toy sizes

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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ringflash import ring_flash_attn_func  # noqa: E402
from ringflash.comm import ReplayComm  # noqa: E402
from ringflash.dist_env import close, init_from_env  # noqa: E402
from ringflash.ring import _RingAttn  # noqa: E402


def timed(fn, *, iters, warmup, device):
    """Median milliseconds of fn() on this rank, then the maximum over ranks."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    times = []
    dist.barrier()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def step_fn(call, inputs, do, mode):
    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        call().backward(do)

    return fwd if mode == "fwd" else fwd_bwd


def cp_case(args, backend_name, S, causal, mode, device, mesh, dtype):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    g = torch.Generator(device=device).manual_seed(1)
    # CP shards (B, H, S, D) buffers in place. K/V get all `heads` heads even for a GQA run:
    # SDPA's CP path has no GQA; the FLOPs (counted on query heads) are the same.
    q, k, v = (torch.randn(args.batch, args.heads, S, args.head_dim, device=device, dtype=dtype, generator=g)
               for _ in range(3))
    _cp_options.enable_load_balance = causal  # head-tail balancing needs is_causal=True
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(ql)

        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)

        return timed(step_fn(call, (ql, kl, vl), do, mode), iters=args.iters, warmup=args.warmup, device=device)


def add_shape_args(ap):
    """The attention-shape options of the ring benchmarks (this one and bench_ring_maxlen.py)."""
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="GQA: K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)


def start(args, script, *, timeout_s):
    """Join torchrun's process group (2 or more ranks, else exit naming `script`); returns
    (rank, world, device, dtype): bf16, or float32 for --smoke on CPU."""
    rank, world, device = init_from_env(timeout_s=timeout_s)
    if world < 2:
        sys.exit(f"{script}: start it on 2 or more processes (launch/run.sh)")
    dtype = torch.float32 if args.smoke and device.type == "cpu" else torch.bfloat16
    return rank, world, device, dtype


def rank_inputs(args, S_local, rank, device, dtype):
    """This rank's q, k, v (requiring grad) and dO, (B, S_local, heads, D) in dtype, seeded by rank."""
    g = torch.Generator(device=device).manual_seed(rank)
    mk = lambda H: torch.randn(args.batch, S_local, H, args.head_dim, device=device, dtype=dtype, generator=g)
    q, k, v = (t.requires_grad_() for t in (mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)))
    return q, k, v, torch.randn_like(q)


def run_meta(args, world, device, dtype, **extra):
    """What a result file says about the run."""
    return {"world": world, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype), "batch": args.batch, "heads": args.heads,
            "kv_heads": args.kv_heads, "head_dim": args.head_dim, **extra,
            "backend": dist.get_backend(), "date": time.strftime("%Y-%m-%d")}


def ring_cases(args, S, causal, mode, device, dtype, rank, world):
    q, k, v, do = rank_inputs(args, S // world, rank, device, dtype)
    out = {}
    call = lambda: ring_flash_attn_func(q, k, v, causal=causal, layout=args.layout)
    out["ring"] = timed(step_fn(call, (q, k, v), do, mode), iters=args.iters, warmup=args.warmup, device=device)
    scale = args.head_dim ** -0.5
    blocks = [(k.detach(), v.detach())] * world  # contents do not change the work

    def replay():
        comm = ReplayComm(rank, world, blocks, record=False)
        return _RingAttn.apply(q, k, v, None, causal, scale, args.layout, comm)[0]

    out["local"] = timed(step_fn(replay, (q, k, v), do, mode), iters=args.iters, warmup=args.warmup, device=device)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    add_shape_args(ap)
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peers", nargs="*", default=["cudnn", "flash"], choices=["cudnn", "flash"],
                    help="context_parallel's SDPA backends to time beside the ring (none: --peers)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="toy sizes (CPU with gloo)")
    args = ap.parse_args()
    rank, world, device, dtype = start(args, "bench_ring.py", timeout_s=600)
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
                flop = 4 * args.batch * args.heads * S * S * args.head_dim * (0.5 if causal else 1.0)
                flop *= 3.5 if mode == "fwd+bwd" else 1.0
                row = {"S": S, "causal": causal, "mode": mode, "ms": res,
                       "tflops_per_gpu": {k: flop / world / ms / 1e9 for k, ms in res.items()
                                          if isinstance(ms, float)}}
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0:
        meta = run_meta(args, world, device, dtype, layout=args.layout)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"\nper-GPU TFLOP/s, P={world}, H={args.heads}/{args.kv_heads}, D={args.head_dim}, {dtype}")
        names = [f"cp_{p}" for p in peers]
        print(f"{'S':>7} {'causal':>6} {'mode':>8} | {'ring':>7} {'local':>7} {'eff':>5} | "
              + " ".join(f"{n:>8}" for n in names) + " | " + " ".join(f"{'/' + n[3:]:>7}" for n in names))
        for r in rows:
            t = r["tflops_per_gpu"]
            peer = [t.get(n, float("nan")) for n in names]
            print(f"{r['S']:>7} {str(r['causal']):>6} {r['mode']:>8} | {t['ring']:7.1f} {t['local']:7.1f} "
                  f"{t['ring'] / t['local']:5.2f} | " + " ".join(f"{x:8.1f}" for x in peer) + " | "
                  + " ".join(f"{t['ring'] / x:7.2f}" for x in peer))
    close()


if __name__ == "__main__":
    main()
