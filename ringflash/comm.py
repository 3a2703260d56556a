"""RingComm: asynchronous send-to-next / receive-from-previous over any process group."""
from __future__ import annotations

import torch
import torch.distributed as dist


def resolve_group(group):
    """None means the default group."""
    return dist.group.WORLD if group is None else group


def group_rank_world(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when no process group is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    group = resolve_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


def _backend_for(group, device_type: str):
    """The backend name `group` uses for tensors of `device_type`, or None."""
    backend = str(dist.get_backend(resolve_group(group))).lower()
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return per_device.get(device_type, backend if not per_device else None)


_CARRIES = {"nccl": "cuda", "gloo": "cpu"}


def check_backend_device(group, device: torch.device, api: str) -> None:
    """NCCL carries CUDA tensors only and gloo CPU tensors only (for point-to-point)."""
    name = _backend_for(group, device.type)
    backend = str(dist.get_backend(resolve_group(group))).lower()
    if name is None or (name in _CARRIES and _CARRIES[name] != device.type):
        raise ValueError(
            f"{api}: the process group's backend {backend!r} cannot carry {device.type} tensors "
            f"(NCCL needs CUDA tensors, one GPU per rank; gloo needs CPU tensors)"
        )


def _exchange_device(group, preferred) -> torch.device:
    """A device the group's backend can all_gather on, `preferred` when possible."""
    if isinstance(preferred, torch.device) and _CARRIES.get(_backend_for(group, preferred.type)) == preferred.type:
        return preferred
    if _CARRIES.get(_backend_for(group, "cpu")) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree_across_ranks(group, fields: dict, local_error, api: str, device=None, show=None) -> None:
    """Make every rank of `group` fail together instead of hanging or computing garbage.

    Each rank contributes whether its own validation passed (local_error is None) and its
    integer `fields` (same keys on every rank), in one small all_gather. Then: a rank whose
    own check failed raises its error; the others raise a ValueError naming the failed ranks;
    if all passed but some field differs, every rank raises the same ValueError listing each
    rank's value. show(name, value) formats a value for the message.
    """
    group = resolve_group(group)
    row = [1 if local_error is None else 0] + [int(v) for v in fields.values()]
    mine = torch.tensor(row, dtype=torch.int64, device=_exchange_device(group, device))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if local_error is not None:
        raise local_error
    failed = [r for r, other in enumerate(rows) if other[0] == 0]
    if failed:
        raise ValueError(f"{api}: rank(s) {failed} of the group rejected their inputs (see their error)")
    show = show or (lambda name, v: str(v))
    names = list(fields)
    diffs = [i for i in range(len(names)) if len({other[i + 1] for other in rows}) > 1]
    if diffs:
        detail = "; ".join(
            f"{names[i]}: " + ", ".join(f"rank {r}={show(names[i], other[i + 1])}" for r, other in enumerate(rows))
            for i in diffs)
        raise ValueError(f"{api}: ranks of the group disagree ({detail})")


_TAGS = {"kv": 0, "grad": 1}


class RingComm:
    """Point-to-point exchange with the ring neighbours of this rank in `group`."""

    def __init__(self, group):
        self.group = resolve_group(group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # P2POp takes global ranks
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor], kind: str, *, step: int,
              heads: slice | None = None):
        """Send `send` to the next rank and receive `recv` from the previous one, asynchronously.
        kind: "kv" (key/value blocks) or "grad" (dK/dV accumulators); the two may be in flight
        at once and are kept apart by tag; messages of one kind match in the order they are
        started. step (the ring step) and heads (the kv heads a "grad" exchange carries) are
        what ReplayComm needs to play one; the ring passes them to either. Returns handles
        for wait()."""
        tag = _TAGS[kind]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in recv]
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self._failure(e) from e

    def wait(self, handles) -> None:
        try:
            for h in handles or ():
                h.wait()
        except RuntimeError as e:
            raise self._failure(e) from e

    def _failure(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"ringflash: the ring exchange of rank {dist.get_global_rank(self.group, self.rank)} with "
            f"rank {self.prev} (receiving) / rank {self.next} (sending) failed; a rank may have died or "
            f"stopped calling the ring, or the process group timed out: {error}")


class ReplayComm:
    """Plays rank `rank` of a `world`-rank ring inside one process (no process group), so the
    ring's CUDA path can be checked and timed on a single GPU.

    The K/V blocks "received" at step s are copied from `blocks[(rank - s - 1) % world]`, the
    tuple of tensors (k, v, and the key bias if any) that rank holds. Gradient accumulators
    sent on at step s belong to the block of rank (rank - s) % world; with `record` set each is
    recorded in `sent_grads` as (owner rank, kv heads slice, [dk, dv]), and zeros come back, so
    adding the records of every replayed rank into dk[:, :, heads] / dv[:, :, heads] gives each
    block's dK/dV.
    """

    def __init__(self, rank: int, world: int, blocks, record: bool = True):
        if world < 2:
            raise ValueError("ReplayComm needs world >= 2")
        self.rank, self.world = rank, world
        self.blocks = blocks
        self.record = record
        self.sent_grads = []

    def start(self, send, recv, kind: str, *, step: int, heads: slice | None = None):
        if kind == "kv":
            for buf, t in zip(recv, self.blocks[(self.rank - step - 1) % self.world], strict=True):
                buf.copy_(t)
        else:
            if self.record:
                owner = (self.rank - step) % self.world
                self.sent_grads.append((owner, slice(None) if heads is None else heads, [t.clone() for t in send]))
            for t in recv:
                t.zero_()
        return None

    @staticmethod
    def wait(handles) -> None:
        pass
