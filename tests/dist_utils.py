"""Several processes joined by a process group, for the ring tests.

run_world(fn, world, *args) spawns `world` processes once for one call; World keeps a group of
processes alive across many calls (tests/conftest.py's `worlds` fixture hands them out per
module), since spawning and importing torch is most of a small test's cost. In both,
fn(rank, world, *args) runs on every rank, and a failure on any rank fails the caller with
that rank's traceback. Functions must be importable by name (module level in a test module).
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, env, backend):
    """The one start of a test rank: environment (before ringflash is imported: its backend
    choice is read at import), then the process group."""
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120), **kwargs)


def _entry(rank, world, port, env, backend, fn, args):
    _init(rank, world, port, env, backend)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_world(fn, world: int, *args, env: dict | None = None, backend: str = "gloo") -> None:
    """fn(rank, world, *args) on `world` freshly spawned processes (gloo on CPU, or nccl with
    one GPU per rank); a failure on any rank fails the caller."""
    mp.spawn(_entry, args=(world, free_port(), dict(env or {}), backend, fn, args), nprocs=world, join=True)


def _serve(rank, world, port, env, tasks, results):
    _init(rank, world, port, env, "gloo")
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, world, *args)
            results.put((rank, None, value))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails
            results.put((rank, traceback.format_exc(), None))
    dist.destroy_process_group()


class World:
    """`size` gloo processes that run one function after another. A task that fails on some
    rank fails run(); a task that does not finish within `timeout` seconds on every rank (a
    rank left waiting in a collective) kills the processes, and the next run() starts new ones."""

    def __init__(self, size: int, env: dict | None = None, timeout: float = 600.0):
        self.size, self.env, self.timeout = size, dict(env or {}), timeout
        self.procs = []

    def _start(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.size, port, self.env, self.tasks[r], self.results), daemon=True)
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """fn(rank, world, *args) on every rank; returns the ranks' return values, in rank order."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        reports, values = {}, {}
        while len(reports) < self.size:
            try:
                rank, error, value = self.results.get(timeout=self.timeout)
            except queue.Empty:
                self.close()
                missing = sorted(set(range(self.size)) - set(reports))
                raise AssertionError(
                    f"{fn.__name__}: rank(s) {missing} did not finish within {self.timeout} s; reports: {reports}"
                ) from None
            reports[rank], values[rank] = error, value
        failed = {r: e for r, e in reports.items() if e is not None}
        if failed:
            self.close()  # a rank may have left the group mid-collective: start afresh next time
            raise AssertionError(
                f"{fn.__name__} failed on rank(s) {sorted(failed)}:\n"
                + "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(failed.items()))
            )
        return [values[r] for r in range(self.size)]

    def close(self) -> None:
        for q, p in zip(getattr(self, "tasks", []), self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.procs = []
