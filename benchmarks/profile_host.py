"""Host cost per call on one GPU (diagnostic): flash_attn_func at S=1K forward and
forward+backward, and flash_attn_varlen_func forward+backward over many short documents in 16K
(benchmarks.packed's "short" mix), each as wall time per call and a cProfile by self and by
cumulative time; then the kernel launches of a P=4 packed ring rank replayed
(benchmarks.packed_ring_replay) under torch.profiler: how many launches, how long each kind ran.

    python -m benchmarks.profile_host > profile_host.log
"""

from __future__ import annotations

import cProfile
import io
import pstats

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import ringflash
from benchmarks.common import host_seconds
from benchmarks.packed import document_lengths
from benchmarks.packed_ring_replay import replay_rank


def per_call_us(fn, calls=200):
    return host_seconds(fn, "cuda", calls=calls, warmup=20) * 1e6


def main():
    dev = "cuda"
    q, k, v = (torch.randn(1, 1024, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))

    def local():
        with torch.no_grad():
            ringflash.flash_attn_func(q, k, v, causal=True)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def local_train():
        ringflash.flash_attn_func(qg, kg, vg, causal=True).sum().backward()

    T = 16384
    lengths = document_lengths("short", T, 0)
    cu_short = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device=dev)
    qp, kp, vp = (torch.randn(T, 32, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def packed_train():
        ringflash.flash_attn_varlen_func(qp, kp, vp, cu_short, cu_short, causal=True).sum().backward()

    for name, fn in (
        ("flash_attn_func S=1K no_grad", local),
        ("flash_attn_func S=1K fwd+bwd", local_train),
        (f"flash_attn_varlen_func {len(lengths)} short docs in 16K fwd+bwd", packed_train),
    ):
        print(f"{name}: {per_call_us(fn):.1f} us per call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(35)
            print(text.getvalue())
    total, world = 131072, 4
    lengths = document_lengths("longtail", total, 0)
    cu_list = [0, *np.cumsum(lengths).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    Q, K, V, DO = (torch.randn(total, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
    layout = ringflash.balanced_layout(cu_list, world, causal=True)
    print(layout)
    for r in range(world):
        run = replay_rank(Q, K, V, DO, cu, layout, r, world, (-1, -1), overlap=True)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run()
            torch.cuda.synchronize()
        kernels = [e for e in p.key_averages() if e.self_device_time_total > 0]
        kernels.sort(key=lambda e: -e.self_device_time_total)
        print(
            f"rank {r}: "
            + ", ".join(f"{e.key[:40]} x{e.count} {e.self_device_time_total / 1e3:.2f}ms" for e in kernels[:8])
        )


if __name__ == "__main__":
    main()
