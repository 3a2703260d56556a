"""Process groups: who is in the ring, ranks agreeing on a call, and the point-to-point
exchange with the ring neighbours (RingComm; LocalComm for a single rank)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ._checks import check_not_capturing


def resolve_group(group):
    """None means the default group."""
    return dist.group.WORLD if group is None else group


def ring_group_name(group, world: int) -> str:
    """The name the ring operators (ops) resolve `group` by: "" for a ring of one rank, which
    may have no process group at all."""
    return resolve_group(group).group_name if world > 1 else ""


def group_rank_world(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when no process group is initialized.

    Under a launcher that says there are several processes (WORLD_SIZE > 1) but with no
    process group, this raises instead of quietly treating each process as the whole ring
    (which would shard nothing and compute every rank's part as if it were all).
    """
    if dist.is_available() and dist.is_initialized():
        group = resolve_group(group)
        return dist.get_rank(group), dist.get_world_size(group)
    world_env = os.environ.get("WORLD_SIZE", "1")
    if group is None and world_env.isdigit() and int(world_env) > 1:
        raise RuntimeError(
            f"ringflash: WORLD_SIZE={world_env} but no torch.distributed process group is initialized; "
            "call ringflash.dist_env.init_from_env() (or torch.distributed.init_process_group) first, "
            "or use ringflash.flash_attn_func for attention on one device"
        )
    return 0, 1


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
    """The device the small agreement all_gathers run on: the CPU whenever the group carries
    CPU tensors (gloo, alone or beside NCCL as "cpu:gloo,cuda:nccl"), so that reading the
    result back never waits for the GPU's queue; else `preferred` if the group carries it,
    else the current GPU (NCCL alone: a GPU all_gather and a host sync per check)."""
    if _CARRIES.get(_backend_for(group, "cpu")) == "cpu":
        return torch.device("cpu")
    if isinstance(preferred, torch.device) and _CARRIES.get(_backend_for(group, preferred.type)) == preferred.type:
        return preferred
    return torch.device("cuda", torch.cuda.current_device())


def _collective_failure(group, api: str, error: Exception) -> RuntimeError:
    rank = dist.get_rank()
    return RuntimeError(
        f"ringflash {api}: the check that every rank of the group passed the same call failed on rank {rank}; "
        f"a rank may have died or stopped calling, or the process group timed out: {error}"
    )


# what a rank's own bad input raises (an unsupported combination included): agreed, so that
# every rank raises it, where any other exception is a failure of its own
INPUT_ERRORS = (TypeError, ValueError, NotImplementedError)


# what every agreement over a ring says of the call's head group, after the caller's fields:
# its size (0: none, the plain ring) and this rank's place in it. A plain call sends zeros over
# `group` (agree_across_ranks) in the all_gather where a call with a head group sends its own
# values over the same group (agree_across_grid's first), so ranks given a head_group and ranks
# not given one meet in one all_gather and raise together
HEAD_FIELDS = ("head_group size", "rank in head_group")


def head_fields(head_group) -> dict:
    """HEAD_FIELDS' values for a call given `head_group` (None: zeros)."""
    if head_group is None:
        return dict.fromkeys(HEAD_FIELDS, 0)
    u, U = group_rank_world(head_group)
    return dict(zip(HEAD_FIELDS, (U, u)))


def _show_head_field(name, value) -> str:
    return "none" if name == "head_group size" and value == 0 else str(value)


class RejectedByRanks(ValueError):
    """Other ranks rejected their inputs: origins, [(global rank, its error's message)], the
    ranks whose own checks failed (a rank that relays this error sends these on, so a grid's
    stages quote each origin once, not a quote of a quote)."""

    def __init__(self, api: str, origins: list[tuple[int, str]]):
        self.origins = origins
        quoted = "; ".join(f"rank {g}: {message}" for g, message in origins)
        ranks = sorted({g for g, _ in origins})
        super().__init__(f"{api}: global rank(s) {ranks} of the group rejected their inputs ({quoted})")


def _gather_rows(group, fields: dict, local_error, api: str, device):
    """One agreement's exchange over `group`: every rank's row (1 when its own check passed,
    then its fields) and, when some rank's check failed, every rank's origins (a second
    collective, on that path only: RejectedByRanks.origins, or this rank's global rank and
    message). A collective that fails raises ringflash's RuntimeError."""
    group = resolve_group(group)
    row = [1 if local_error is None else 0] + [int(v) for v in fields.values()]
    mine = torch.tensor(row, dtype=torch.int64, device=_exchange_device(group, device))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(every, mine, group=group)
        rows = [t.tolist() for t in every]
        messages = [None] * len(rows)
        if any(other[0] == 0 for other in rows):
            origins = None
            if local_error is not None:
                origins = getattr(local_error, "origins", None) or [(dist.get_rank(), str(local_error))]
            dist.all_gather_object(messages, origins, group=group)
    except RuntimeError as e:
        raise _collective_failure(group, api, e) from e
    return rows, messages


def _outcome(rows, messages, names, local_error, api: str, show):
    """What a rank raises after an agreement's exchange (None: every rank passed, with equal
    fields): its own error, else a ValueError quoting the ranks that failed, else one listing
    the fields that differ, each rank's value."""
    if local_error is not None:
        return local_error
    failed = [r for r, other in enumerate(rows) if other[0] == 0]
    if failed:
        origins = [origin for r in failed for origin in messages[r]]
        return RejectedByRanks(api, list(dict.fromkeys(origins)))
    show = show or (lambda name, v: str(v))
    diffs = [i for i in range(len(names)) if len({other[i + 1] for other in rows}) > 1]
    if not diffs:
        return None
    detail = "; ".join(
        f"{names[i]}: "
        + ", ".join(
            f"rank {r}={(_show_head_field if names[i] in HEAD_FIELDS else show)(names[i], other[i + 1])}"
            for r, other in enumerate(rows)
        )
        for i in diffs
    )
    hint = ""
    if "head_group size" in names:
        sizes = [other[names.index("head_group size") + 1] for other in rows]
        if 0 in sizes and any(sizes):
            hint = (
                f"; head_group given on rank(s) {[r for r, n in enumerate(sizes) if n]} of the group only: give "
                "every rank its head_group (or every rank a 2-D DeviceMesh as group), or none"
            )
    return ValueError(f"{api}: ranks of the group disagree ({detail}){hint}")


def agree_across_ranks(group, fields: dict, local_error, api: str, device=None, show=None) -> None:
    """Make every rank of `group` fail together instead of hanging or computing garbage.

    Each rank contributes whether its own validation passed (local_error is None) and its
    integer `fields` (same keys on every rank), then HEAD_FIELDS' zeros (no head group), in one
    small all_gather. Then: a rank whose own check failed raises its error; the others raise a
    ValueError that quotes it (a second collective, on that path only); if all passed but some
    field differs, every rank raises the same ValueError listing each rank's value: a rank
    whose call was given a head group sends the same row over the same group first
    (agree_across_grid), so ranks that disagree on being given one raise here too, naming
    head_group. show(name, value) formats a value for the message. A collective that fails
    (a dead rank, a timeout) raises a RuntimeError naming ringflash and the call. Under CUDA
    graph capture: a RuntimeError naming the call, before any collective (a replay would not
    agree again).
    """
    check_not_capturing(api, "the ring's ranks agree on every call, reading the result on the host")
    fields = {**fields, **head_fields(None)}
    rows, messages = _gather_rows(group, fields, local_error, api, device)
    error = _outcome(rows, messages, list(fields), local_error, api, show)
    if error is not None:
        raise error


def validated_across_ranks(group, api: str, validate, field_names, *, device=None, show=None):
    """Run validate() -> (fields, result) on every rank and agree across `group`: returns
    result when every rank's validation passed with equal fields, else raises on every rank
    (agree_across_ranks). With one rank, validate()'s errors propagate as they are.

    validate raises INPUT_ERRORS for bad input; fields is a dict of ints with the
    keys `field_names` (a rank whose validation failed contributes zeros)."""
    _, world = group_rank_world(group)
    if world == 1:
        return validate()[1]
    try:
        fields, result = validate()
        error = None
    except INPUT_ERRORS as e:
        fields, result, error = dict.fromkeys(field_names, 0), None, e
    agree_across_ranks(group, fields, error, api, device=device, show=show)
    return result


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

    def start(
        self,
        send: list[torch.Tensor],
        recv: list[torch.Tensor],
        kind: str,
        *,
        step: int,
        heads: slice | None = None,
        hop: int = 1,
    ):
        """Send `send` to the next rank and receive `recv` from the previous one, asynchronously
        (hop > 1: to the rank hop places on, from the one hop places back: the dK/dV
        accumulators' way home when the ring stops early). kind: "kv" (key/value blocks) or
        "grad" (dK/dV accumulators); the two may be in flight at once and are kept apart by
        tag; messages of one kind match in the order they are started. step (the ring step)
        and heads (the kv heads a "grad" exchange carries) are what ringflash.testing.ReplayComm
        needs to play one; the ring passes them to either. Returns handles for wait()."""
        tag = _TAGS[kind]
        to, frm = self.next, self.prev
        if hop != 1:
            to = dist.get_global_rank(self.group, (self.rank + hop) % self.world)
            frm = dist.get_global_rank(self.group, (self.rank - hop) % self.world)
        ops = [dist.P2POp(dist.isend, t, to, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, frm, self.group, tag) for t in recv]
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
            f"stopped calling the ring, or the process group timed out: {error}"
        )


class LocalComm:
    """The ring of one rank: nothing is ever exchanged (the ring loop makes no exchange when
    world == 1), so the same engine serves a single device."""

    world = 1

    def __init__(self, rank: int = 0):
        self.rank = rank  # a rank whose blocks all stay home keeps its own place in the schedule

    def start(self, send, recv, kind: str, *, step: int, heads: slice | None = None, hop: int = 1):
        raise AssertionError("a one-rank ring exchanges nothing")

    @staticmethod
    def wait(handles) -> None:
        pass


def is_mesh(x) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device meshes
        return False
    return isinstance(x, DeviceMesh)


def check_group_types(group, head_group, api: str) -> None:
    """group and head_group must each be None, a process group or a DeviceMesh: anything else
    (a typo, another library's group) would otherwise run as a ring of one rank when no process
    group is initialized."""
    for name, value in (("group", group), ("head_group", head_group)):
        if value is None or is_mesh(value):
            continue
        # new_group's answer on the ranks outside the group (an int): refused by _check_member, in
        # the agreement, so that the ranks inside raise too
        if dist.is_available() and (isinstance(value, dist.ProcessGroup) or value is dist.GroupMember.NON_GROUP_MEMBER):
            continue
        raise TypeError(
            f"{api}: {name} must be None, a torch.distributed ProcessGroup or a DeviceMesh, got {type(value).__name__}"
        )


def resolve_groups(group, head_group, api: str):
    """(ring group, head group or None) from what a call was given.

    group may be a process group, None (the default group), or a DeviceMesh: a 1-D mesh is its
    group; a 2-D mesh (with head_group None) is (ring dim 0, head dim 1), so the head groups
    are the mesh's rows: consecutive ranks, one node's GPUs under the usual placement.
    head_group may be a process group, a 1-D DeviceMesh, or None (the plain ring). A head
    group without a ring group is a ValueError (the ring over the rest would be a guess), and
    so is, with a head group, a group or head_group that is no process group this rank is in
    (new_group gives the ranks outside a group GroupMember.NON_GROUP_MEMBER); any other type is
    a TypeError."""
    check_group_types(group, head_group, api)
    if is_mesh(head_group):
        if head_group.ndim != 1:
            raise ValueError(f"{api}: head_group as a DeviceMesh must be 1-D, got {head_group.ndim}-D")
        head_group = head_group.get_group()
    if is_mesh(group):
        if group.ndim == 2 and head_group is None:
            return group.get_group(0), group.get_group(1)
        if group.ndim != 1:
            raise ValueError(
                f"{api}: group as a DeviceMesh must be 1-D, or 2-D (ring dim, head dim) without head_group; "
                f"got a {group.ndim}-D mesh" + (" and a head_group" if head_group is not None else "")
            )
        group = group.get_group()
    if head_group is not None and group is None:
        raise ValueError(
            f"{api}: head_group given without group; pass the ring's process group too (group=, R ranks "
            "whose head groups are disjoint), or a 2-D DeviceMesh as group"
        )
    if head_group is not None:
        _check_member("group", group, api)
        _check_member("head_group", head_group, api)
    return group, head_group


def _check_member(name: str, group, api: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not isinstance(group, dist.ProcessGroup) or dist.get_rank(group) < 0:
        got = "GroupMember.NON_GROUP_MEMBER" if group is dist.GroupMember.NON_GROUP_MEMBER else type(group).__name__
        raise ValueError(
            f"{api}: {name} must be a process group that this rank is in (or a DeviceMesh), got {got}; "
            "torch.distributed.new_group gives the ranks outside the group GroupMember.NON_GROUP_MEMBER"
        )


def resolve_groups_or_error(group, head_group, api: str):
    """resolve_groups for a call whose ranks agree before any other collective: (ring group,
    head group or None, None); or, where this rank's group or head_group is refused, (the
    group this rank agrees over, None, the error), for the caller to carry the error into its
    agreement over that group (as an error of its own input), so that the ranks sharing it
    raise too instead of waiting there: `group` as given (None: the default group), a
    DeviceMesh's first dimension (the ring's, by the 2-D mesh's convention). Where `group`
    names no process group this rank is in, the error is raised here: there is no group to
    agree over."""
    try:
        return (*resolve_groups(group, head_group, api), None)
    except (TypeError, ValueError) as error:
        if is_mesh(group):
            return group.get_group(0), None, error
        if group is not None:
            try:
                _check_member("group", group, api)
            except ValueError:
                raise error from None
        return group, None, error


def _agree_stage(group, fields: dict, error, api: str, device, show):
    """One agreement over `group` that returns the error to raise later (or None)."""
    if group_rank_world(group)[1] == 1:
        return error
    rows, messages = _gather_rows(group, fields, error, api, device)
    return _outcome(rows, messages, list(fields), error, api, show)


def validated_across_grid(group, head_group, api: str, validate, field_names, *, device=None, show=None):
    """validated_across_ranks for the ranks of a grid: `group` (the ring, R ranks) and
    `head_group` (U ranks) through every rank, the ring groups meeting each head group once:
    validate() -> (fields, result) as in validated_across_ranks, then agree_across_grid."""
    try:
        fields, result = validate()
        error = None
    except INPUT_ERRORS as e:
        fields, result, error = dict.fromkeys(field_names, 0), None, e
    agree_across_grid(group, head_group, fields, error, api, device=device, show=show)
    return result


def agree_across_grid(group, head_group, fields: dict, local_error, api: str, *, device=None, show=None) -> None:
    """agree_across_ranks for the ranks of a grid, once this rank's validation has run
    (fields, and local_error: its error or None; the compiled hybrid operator runs this when
    it executes): returns when every rank of the grid passed with equal fields, else raises
    on every rank.

    Three small all_gathers, so that a rank's error or a disagreement anywhere in the grid
    raises on every rank of it, with no rank left waiting: over `group` (every field, then
    HEAD_FIELDS: the head group's size and this rank's place in it: the row a call without a
    head group sends over `group` in its one agreement), over head_group (every field, the
    ring's size and the rank in `group` that a head group shares) and over `group` again (the
    second one's outcome). Pairs of groups that do not form a grid (a head group whose ranks
    sit at different ring positions, the same group passed twice) disagree on those ranks and
    raise. A ring where some rank was given no head group (or could not use the one it was
    given) raises after the first, on every rank of it: that rank takes part in no other.
    A rank of a head group that was not given it can tell no one else: its head group's other
    ranks, on other rings, wait for it in the second all_gather. head_group None: the plain
    ring's one agreement (agree_across_ranks)."""
    if head_group is None:
        agree_across_ranks(group, fields, local_error, api, device=device, show=show)
        return
    r, R = group_rank_world(group)
    u, U = group_rank_world(head_group)
    if R > 1 or U > 1:
        check_not_capturing(api, "the ring's ranks agree on every call, reading the result on the host")
    error = local_error
    if R > 1:
        row = {**fields, **head_fields(head_group)}
        rows, messages = _gather_rows(group, row, local_error, api, device)
        error = _outcome(rows, messages, list(row), local_error, api, show)
        size = list(row).index("head_group size") + 1
        if error is not None and any(other[size] == 0 for other in rows):  # a plain call's one agreement
            raise error
    error = _agree_stage(head_group, {**fields, "ring size (group)": R, "rank in group": r}, error, api, device, show)
    error = _agree_stage(group, {}, error, api, device, show)
    if error is not None:
        raise error


def placement_problems(ring_ranks, head_ranks, gpus_per_node: int) -> list[str]:
    """What a grid's placement costs that another order of the same ranks would not, with node
    = global rank // gpus_per_node (torchrun numbers ranks node by node): a head group spread
    over nodes (its all-to-alls leave NVLink), and a ring whose order crosses between nodes more
    often per turn than its nodes require (each extra crossing puts a hop on the network).
    ring_ranks: the ring group's global ranks in ring order; head_ranks: the head group's, or
    None. Pure: returns the problems as sentences, [] when the placement is as good as it gets."""
    ring_nodes = [r // gpus_per_node for r in ring_ranks]
    problems = []
    if head_ranks is not None and len({r // gpus_per_node for r in head_ranks}) > 1:
        problems.append(
            f"head_group ranks {list(head_ranks)} span nodes {sorted({r // gpus_per_node for r in head_ranks})} "
            f"({gpus_per_node} GPUs per node), so its all-to-alls leave the node; build head groups of one "
            f"node's ranks (a DeviceMesh of shape (R, U) with U <= {gpus_per_node} does)"
        )
    n = len(ring_nodes)
    crossings = sum(ring_nodes[i] != ring_nodes[(i + 1) % n] for i in range(n)) if n > 1 else 0
    needed = len(set(ring_nodes)) if len(set(ring_nodes)) > 1 else 0
    if crossings > needed:
        problems.append(
            f"the ring's rank order {list(ring_ranks)} crosses between nodes {crossings} times per turn "
            f"where {needed} would do; give group its ranks node by node"
        )
    return problems


_PLACEMENT_CHECKED: set = set()


def warn_placement(group, head_group=None) -> None:
    """Warn once per pair of groups about placement_problems, nodes taken from torchrun's
    LOCAL_WORLD_SIZE (nothing without it, or without an initialized process group)."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not per_node.isdigit() or int(per_node) < 1 or not dist.is_initialized():
        return
    key = (resolve_group(group).group_name, None if head_group is None else resolve_group(head_group).group_name)
    if key in _PLACEMENT_CHECKED:
        return
    _PLACEMENT_CHECKED.add(key)
    ring = dist.get_process_group_ranks(resolve_group(group))
    heads = None if head_group is None else dist.get_process_group_ranks(resolve_group(head_group))
    for problem in placement_problems(ring, heads, int(per_node)):
        warnings.warn(f"ringflash: {problem}", stacklevel=3)
