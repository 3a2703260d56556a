"""Process-group set-up for scripts started by torchrun (examples, benchmarks, GPU tests)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_from_env(*, timeout_s: float = 300.0, backend: str | None = None) -> tuple[int, int, torch.device]:
    """Initialize the default process group from torchrun's environment.

    Backend: `backend`, else $RINGFLASH_DIST_BACKEND, else "nccl" when CUDA is available and
    "gloo" otherwise. "nccl" is set up as "cpu:gloo,cuda:nccl": NCCL carries the ring's CUDA
    tensors and gloo the small per-call agreement check, which then never waits for the GPU's
    queue. With NCCL each process takes the GPU of its LOCAL_RANK. Collectives fail
    after `timeout_s` seconds instead of hanging (a rank that died, a mismatched call).
    Without torchrun's variables (RANK unset) nothing is initialized: one process, world 1.
    Returns (rank, world_size, device).
    """
    api = "init_from_env"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{api}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    source = "backend" if backend else "RINGFLASH_DIST_BACKEND"
    backend = backend or os.environ.get("RINGFLASH_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{api}: {source} must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError(f"{api}: {source} 'nccl' needs CUDA, which is not available here (use 'gloo')")
        backend = "cpu:gloo,cuda:nccl"
    use_cuda = "nccl" in backend
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if not local_rank.isdigit():
        raise ValueError(f"{api}: LOCAL_RANK must be a non-negative int, got {local_rank!r}")
    local_rank = int(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return 0, 1, device
    if not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def close() -> None:
    """Destroy the default group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()
