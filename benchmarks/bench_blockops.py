"""What the ring's block operations cost on one GPU, beside the plain kernel on the same work.

    python -m benchmarks.bench_blockops --json benchmarks/results/blockops_h200.json

1. Block operations: the forward folding a block into a float32 (o, lse) state at global
   position offsets, against flash_attn_func's forward (fresh state, 16-bit output); the
   backward accumulating into float32 dQ/dK/dV buffers, against writing 16-bit gradients.
2. The ring's schedule without communication: rank 0 of a P-rank zigzag ring replayed on this
   GPU (ReplayComm: each K/V block is copied in, not received), against the whole sequence in
   one flash_attn_func call divided by P. Zigzag gives every rank the same work, so the ratio
   is the ring efficiency this GPU allows before any communication cost.
3. Memory: the peak of rank 0's replayed ring forward+backward (P=4, zigzag, causal) beyond
   its inputs, against flash_attn_func forward+backward on the same local q, k, v plus the
   two K/V receive buffers.
--grad-chunks 1 4 repeats sections 2 and 3 with the dK/dV accumulators exchanged in 1 and 4
kv-head chunks (default: the library's choice); --grad-accum float32 input repeats them with
the gradient accumulators in float32 (default) and in the inputs' dtype (grad_accum_dtype);
--backward default deterministic repeats section 2 with the fused backward (the default) and
the two-pass one (deterministic=True), ring and one-GPU call alike.
Medians of triton.testing.do_bench; bf16, B=1, H=32, D=128.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import bench_ms as bench
from benchmarks.common import write_json
from ringflash import flash_attn_func
from ringflash.local import attention_delta, block_backward, block_forward
from ringflash.masks import CAUSAL, FULL, BlockMask
from ringflash.merge import SoftmaxState
from ringflash.ring import RingSpec, _RingAttn
from ringflash.testing import ReplayComm


def block_op_rows(S, H, D, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, S, H, D, device=device, dtype=dtype, generator=g) for _ in range(4))
    scale, offset = D**-0.5, 3 * S  # any global offset; the diagonal stays the diagonal
    rows = []
    for causal in (False, True):
        state = SoftmaxState.zeros(q.shape, torch.float32, device)
        plain_fwd = bench(lambda: flash_attn_func(q, k, v, causal=causal), device)
        block_fwd = bench(
            lambda: block_forward(
                q, k, v, state, BlockMask(offset, offset, CAUSAL if causal else FULL), scale=scale, fold=True
            ),
            device,
        )
        local = SoftmaxState.empty(torch.empty_like(q))
        block_forward(
            q, k, v, local, BlockMask(0, 0, CAUSAL if causal else FULL), scale=scale, fold=False, normalize=True
        )
        out = local.o
        grads16 = [torch.empty_like(t) for t in (q, k, v)]
        grads32 = [torch.zeros(t.shape, device=device) for t in (q, k, v)]

        def backward(bufs, accumulate, q_start):
            delta = attention_delta(out, do)
            block_backward(
                q,
                k,
                v,
                local.m,
                local.l,
                do,
                delta,
                *bufs,
                BlockMask(q_start, q_start, CAUSAL if causal else FULL),
                scale=scale,
                accumulate=accumulate,
            )

        plain_bwd = bench(lambda: backward(grads16, False, 0), device)
        block_bwd = bench(lambda: backward(grads32, True, offset), device)
        rows.append(
            {
                "S": S,
                "causal": causal,
                "plain_fwd_ms": plain_fwd,
                "block_fwd_ms": block_fwd,
                "fwd_loss": block_fwd / plain_fwd - 1,
                "plain_bwd_ms": plain_bwd,
                "block_bwd_ms": block_bwd,
                "bwd_loss": block_bwd / plain_bwd - 1,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def replay_rows(S, world, H, Hkv, D, dtype, device, grad_chunks, grad_accum, backward="default"):
    g = torch.Generator(device=device).manual_seed(1)
    S_local = S // world
    mk = lambda S, heads: torch.randn(1, S, heads, D, device=device, dtype=dtype, generator=g).requires_grad_()
    q, k, v, do = mk(S_local, H), mk(S_local, Hkv), mk(S_local, Hkv), mk(S_local, H)
    qf, kf, vf = mk(S, H), mk(S, Hkv), mk(S, Hkv)
    dof = torch.randn_like(qf)
    blocks = [(k.detach(), v.detach())] * world
    det = backward == "deterministic"
    spec = RingSpec(CAUSAL, D**-0.5, "zigzag", grad_chunks, ACCUM[grad_accum](dtype), deterministic=det)

    def replay():
        comm = ReplayComm(0, world, blocks, record=False)
        _RingAttn.apply(q, k, v, None, spec, comm)[0].backward(do.detach())

    def full():
        flash_attn_func(qf, kf, vf, causal=True, deterministic=det).backward(dof)

    r, f = bench(replay, device), bench(full, device)
    row = {
        "S": S,
        "world": world,
        "kv_heads": Hkv,
        "grad_chunks": grad_chunks,
        "grad_accum": grad_accum,
        "backward": backward,
        "replay_rank0_ms": r,
        "full_over_world_ms": f / world,
        "efficiency": f / world / r,
    }
    print(json.dumps(row), flush=True)
    return row


def memory_rows(S_local, world, H, Hkv, D, dtype, device, grad_chunks, grad_accum):
    g = torch.Generator(device=device).manual_seed(2)
    mk = lambda heads: torch.randn(1, S_local, heads, D, device=device, dtype=dtype, generator=g).requires_grad_()
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    do = torch.randn_like(q)
    blocks = [(k.detach(), v.detach())] * world

    def peak(fn):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    spec = RingSpec(CAUSAL, D**-0.5, "zigzag", grad_chunks, ACCUM[grad_accum](dtype))

    def ring():
        comm = ReplayComm(0, world, blocks, record=False)
        _RingAttn.apply(q, k, v, None, spec, comm)[0].backward(do)

    def local():
        flash_attn_func(q, k, v, causal=True).backward(do)

    ring(), local()  # warm-up: compiled kernels, allocator
    kv_buffers = 2 * (k.numel() + v.numel()) * k.element_size()
    r, l = peak(ring), peak(local)
    row = {
        "S_local": S_local,
        "world": world,
        "heads": H,
        "kv_heads": Hkv,
        "grad_chunks": grad_chunks,
        "grad_accum": grad_accum,
        "ring_peak_gib": r / 2**30,
        "local_peak_gib": l / 2**30,
        "kv_buffers_gib": kv_buffers / 2**30,
        "ratio": r / (l + kv_buffers),
    }
    print(json.dumps(row), flush=True)
    return row


# --grad-accum names -> the accumulator dtype for inputs of a dtype (None: the library's float32)
ACCUM = {"float32": lambda dtype: None, "input": lambda dtype: dtype}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    ap.add_argument(
        "--sections", nargs="+", default=["block_ops", "replay", "memory"], choices=["block_ops", "replay", "memory"]
    )
    ap.add_argument(
        "--grad-chunks",
        type=int,
        nargs="+",
        default=[None],
        help="kv-head chunks of the backward's dK/dV exchange (default: the library's)",
    )
    ap.add_argument(
        "--grad-accum",
        nargs="+",
        default=["float32"],
        choices=sorted(ACCUM),
        help="gradient accumulators in float32 or in the inputs' dtype",
    )
    ap.add_argument(
        "--backward",
        nargs="+",
        default=["default"],
        choices=["default", "deterministic"],
        help="the replay's backward: the default (fused where it applies) or deterministic=True",
    )
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype, H, D = (torch.bfloat16, 32, 128) if device.type == "cuda" else (torch.float32, 2, 32)
    sizes = [16384] if device.type == "cuda" else [128]
    # (S, P, Hkv): the last one is small per rank (S_local = 4K) with GQA, where chunked dK/dV
    # kernels have the fewest programs
    replays = (
        [(32768, 2, H), (131072, 2, H), (131072, 4, H), (131072, 8, H), (16384, 4, H // 4)]
        if device.type == "cuda"
        else [(128, 2, H)]
    )
    out = {
        "meta": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(dtype),
            "heads": H,
            "head_dim": D,
            "date": time.strftime("%Y-%m-%d"),
        },
        "block_ops": [],
        "replay": [],
        "memory": [],
    }
    if "block_ops" in args.sections:
        out["block_ops"] = [r for S in sizes for r in block_op_rows(S, H, D, dtype, device)]
    if "replay" in args.sections:
        out["replay"] = [
            replay_rows(S, w, H, Hkv, D, dtype, device, c, a, b)
            for S, w, Hkv in replays
            for c in args.grad_chunks
            for a in args.grad_accum
            for b in args.backward
        ]
    if "memory" in args.sections and device.type == "cuda":
        out["memory"] = [
            memory_rows(S, 4, H, Hkv, D, dtype, device, c, a)
            for S in (32768, 65536)
            for Hkv in (H, H // 4)
            for c in args.grad_chunks
            for a in args.grad_accum
        ]
    write_json(args.json, out)
    print("\nblock operations vs the plain kernel (same work):")
    for r in out["block_ops"]:
        print(
            f"  S={r['S']} causal={r['causal']}: forward {r['fwd_loss'] * 100:+.1f}%, "
            f"backward {r['bwd_loss'] * 100:+.1f}%"
        )
    print("ring schedule replayed without communication (rank 0) vs one-GPU attention / P:")
    for r in out["replay"]:
        print(
            f"  S={r['S']} P={r['world']} Hkv={r['kv_heads']} grad chunks={r['grad_chunks']} "
            f"accumulators {r['grad_accum']} backward {r['backward']}: "
            f"{r['replay_rank0_ms']:.2f} ms, efficiency {r['efficiency']:.3f}"
        )
    print("peak memory beyond the inputs, ring (P=4) vs local + 2 K/V buffers:")
    for r in out["memory"]:
        print(
            f"  S_local={r['S_local']} H={r['heads']}/{r['kv_heads']} grad chunks={r['grad_chunks']} "
            f"accumulators {r['grad_accum']}: "
            f"ring {r['ring_peak_gib']:.2f} GiB, "
            f"local {r['local_peak_gib']:.2f} + buffers {r['kv_buffers_gib']:.2f} GiB: ratio {r['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
