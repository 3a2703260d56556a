"""Quickstart: exact causal attention over a sequence sharded across processes.

    ringflash-run --nproc 2 examples/quickstart.py   # 2 processes (CPU: gloo)
    ringflash-run examples/quickstart.py             # one process per GPU (NCCL)
    python examples/quickstart.py                    # one process

Every rank holds 1/P of the sequence; ring_flash_attn_func gives each rank its part of the
output of attention over the WHOLE sequence, which rank 0 checks against one-device attention:
against float64, the ring may err at most twice as much as one device in the same dtype.
"""

import sys

import torch

import ringflash
from ringflash.dist_env import close, init_from_env
from ringflash.local import use_backend

rank, world, device = init_from_env(timeout_s=120)  # world 1 when not started by torchrun
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
B, H, D = 1, 4, 64
S = 2 * world * (2048 if device.type == "cuda" else 256)  # zigzag: S divisible by 2 * world

# The same full q, k, v on every rank (same seed, drawn on the CPU), then each rank keeps its shard.
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, generator=gen).to(device, dtype) for _ in range(3))
q_local, k_local, v_local = (ringflash.shard(t, layout="zigzag") for t in (q, k, v))  # (B, S/P, H, D)

out_local = ringflash.ring_flash_attn_func(q_local, k_local, v_local, causal=True, layout="zigzag")
out = ringflash.unshard(out_local, layout="zigzag")  # every rank's part, back in sequence order

failed = False
if rank == 0:
    one = ringflash.flash_attn_func(q, k, v, causal=True)  # the whole sequence on one device
    with use_backend("torch"):  # float64 (the Triton kernels have none): the reference
        ref = ringflash.flash_attn_func(q.double(), k.double(), v.double(), causal=True)
    err, one_err = ((t.double() - ref).abs().max().item() for t in (out, one))
    # twice the one-device error, taken as at least an ulp of the largest output (one device
    # can be exact by luck)
    tol = 2 * max(one_err, torch.finfo(dtype).eps * ref.abs().max().item())
    print(
        f"world {world}, {device.type}, {dtype}: q {tuple(q.shape)} -> local {tuple(q_local.shape)}; "
        f"ring's max abs error {err:.2e} against float64, one device's {one_err:.2e} (tolerance {tol:.2e})",
        flush=True,
    )
    failed = not err <= tol
close()
sys.exit(1 if failed else 0)
