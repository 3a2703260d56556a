"""Run a function on several CPU processes joined by a gloo process group."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, env, fn, args):
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args, env: dict | None = None) -> None:
    """fn(rank, world, *args) on `world` spawned processes; a failure on any rank fails the caller."""
    mp.spawn(_entry, args=(world, free_port(), dict(env or {}), fn, args), nprocs=world, join=True)


def grad_chunks(chunks: int):
    """Context manager: the ring backward exchanges dK/dV in min(chunks, Hkv) kv-head chunks,
    whatever the size (the library's default keeps small accumulators in one chunk)."""
    import contextlib
    from unittest import mock

    import ringflash.ring

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(ringflash.ring, "GRAD_CHUNKS", chunks))
    stack.enter_context(mock.patch.object(ringflash.ring, "GRAD_CHUNK_MIN_BYTES", 0))
    return stack
