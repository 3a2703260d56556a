"""Host cost per call on one GPU (diagnostic): flash_attn_func forward and forward+backward at
--seq-lens (B=1, H=32, D=128, causal, bf16), flash_attn_varlen_func forward+backward over many
short documents in 16K (benchmarks.packed's "short" mix), and one packed ring rank replayed
(benchmarks.packed_ring_replay: longtail documents in --ring-total over --ring-world ranks), each
as wall time per call, the device's busy time per call and a cProfile by self and by cumulative
time; the ring rank also under
torch.profiler: its kernels and how long each kind ran on the device.

    python -m benchmarks.profile_host > profile_host.log
    python -m benchmarks.profile_host --sections ring --ring-world 8 --ring-rank 3 --documents-backward fused
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import numpy as np
import torch

import ringflash
from benchmarks.common import DOCUMENTS_BACKWARDS, documents_backward, host_seconds, kernel_times
from benchmarks.packed import document_lengths
from benchmarks.packed_ring_replay import replay_rank


def per_call_us(fn, calls):
    return host_seconds(fn, "cuda", calls=calls, warmup=3) * 1e6


def device_us(fn, calls):
    """Microseconds per call the device spent in kernels and copies (torch.profiler)."""
    return sum(ms for _, _, ms in kernel_times(fn, "cuda", calls)) * 1e3 / calls


def report(name, fn, calls, lines):
    print(
        f"{name}: {per_call_us(fn, calls):.1f} us per call, {device_us(fn, calls):.1f} us of it on the device",
        flush=True,
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
        print(text.getvalue(), flush=True)


def local_calls(seq_lens):
    for S in seq_lens:
        q, k, v = (torch.randn(1, S, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd(q=q, k=k, v=v):
            with torch.no_grad():
                ringflash.flash_attn_func(q, k, v, causal=True)

        def train(qg=qg, kg=kg, vg=vg):
            ringflash.flash_attn_func(qg, kg, vg, causal=True).sum().backward()

        yield f"flash_attn_func S={S} no_grad", fwd
        yield f"flash_attn_func S={S} fwd+bwd", train


def packed_call():
    T = 16384
    lengths = document_lengths("short", T, 0)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def train():
        ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True).sum().backward()

    yield f"flash_attn_varlen_func {len(lengths)} short docs in 16K fwd+bwd", train


def ring_rank(total, world, rank):
    lengths = document_lengths("longtail", total, 0)
    cu_list = [0, *np.cumsum(lengths).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    Q, K, V, DO = (torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    layout = ringflash.balanced_layout(cu_list, world, causal=True)
    run = replay_rank(Q, K, V, DO, cu, layout, rank, world, (-1, -1), overlap=True)
    run()
    kernels = kernel_times(run, "cuda")
    print(
        f"ring rank {rank} of {world} ({total} tokens): {sum(ms for _, _, ms in kernels):.2f} ms on the device: "
        + ", ".join(f"{name[:40]} x{n} {ms:.2f}ms" for name, n, ms in kernels[:10]),
        flush=True,
    )
    yield f"ring rank {rank} of {world} replayed fwd+bwd", run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["local", "packed", "ring"], choices=["local", "packed", "ring"])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--ring-total", type=int, default=131072)
    ap.add_argument("--ring-world", type=int, default=4)
    ap.add_argument("--ring-rank", type=int, default=0)
    ap.add_argument(
        "--documents-backward",
        default="default",
        choices=DOCUMENTS_BACKWARDS,
        help="packed documents' backward: as configured, the fused Gluon kernel where it runs, or the two passes",
    )
    ap.add_argument("--calls", type=int, default=100, help="calls per timing and per profile (the ring: a tenth)")
    ap.add_argument("--lines", type=int, default=30, help="cProfile lines per ordering")
    args = ap.parse_args()
    with documents_backward(args.documents_backward):
        for section in args.sections:
            if section == "local":
                calls = [(c, args.calls) for c in local_calls(args.seq_lens)]
            elif section == "packed":
                calls = [(c, args.calls) for c in packed_call()]
            else:
                calls = [
                    (c, max(args.calls // 10, 1)) for c in ring_rank(args.ring_total, args.ring_world, args.ring_rank)
                ]
            for (name, fn), n in calls:
                report(name, fn, n, args.lines)


if __name__ == "__main__":
    main()
