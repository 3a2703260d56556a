"""Helper for test_robustness: rank `die_rank` exits abruptly, in its second block of the first
ring step ("mid") or before its first ring call ("before"); the others must fail with a clear
ringflash error within the process-group timeout, not hang.

    python tests/die_mid_ring.py RANK WORLD PORT DIE_RANK TIMEOUT_S [mid|before]
"""

import os
import sys
from datetime import timedelta

rank, world, port, die_rank, timeout_s = (int(a) for a in sys.argv[1:6])
when = sys.argv[6] if len(sys.argv) > 6 else "mid"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RINGFLASH_BACKEND="torch")

import torch  # noqa: E402 - after the environment, which ringflash reads at import
import torch.distributed as dist  # noqa: E402

import ringflash  # noqa: E402
import ringflash.ring  # noqa: E402

dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))

if rank == die_rank and when == "before":
    os._exit(17)
if rank == die_rank:
    real, calls = ringflash.ring.block_forward, []

    def dying_block_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # zigzag causal: 3 blocks at step 0, so this is still step 0's work
            os._exit(17)
        return real(*args, **kwargs)

    ringflash.ring.block_forward = dying_block_forward

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 64 * world, 2, 16, generator=g) for _ in range(3))
ql, kl, vl = (ringflash.shard(t).requires_grad_() for t in (q, k, v))
for _ in range(3):
    out = ringflash.ring_flash_attn_func(ql, kl, vl, causal=True)
    out.sum().backward()
print("finished without error", flush=True)
dist.destroy_process_group()
