"""Launch plans kept by call signature, so that a repeated call skips its checks and the
building of its launch arguments.

A Gluon launch's host time is mostly Python: checking dtypes, shapes, strides and alignment,
then building four or five TMA descriptors (each validated by Triton on construction) and the
argument tuple. Everything those steps read is in the call's signature: each tensor's device,
dtype, shape, strides and 16-byte alignment, which of them are the same tensor, and the call's
other arguments. A call whose
signature was seen before reuses that call's plan: its kernel, grid and keyword arguments as
they were, its positional arguments with the tensors (and the descriptors' base tensors) of
this call put in their places. Descriptors are copied, not rebuilt: shape, strides, block and
layout are the signature's, only the base differs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import OrderedDict
from typing import NamedTuple

import torch

from .launcher import KeptLaunch

_KEPT = 256  # plans kept (least recently used dropped): the ring's steps and chunks each have their own


def tensor_key(t: torch.Tensor | None):
    """What a plan may depend on of tensor t (None: None)."""
    if t is None:
        return None
    return (t.device, t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16)


def alias_pattern(tensors) -> tuple:
    """Which of `tensors` are the same object (for each, the position of its first
    occurrence): part of a signature, since a plan puts each argument's tensor back by the
    position it first found it at, and flash_attn_func(x, x, x) must not share a plan with
    distinct q, k, v."""
    ids = [id(t) for t in tensors]
    return tuple(map(ids.index, ids))


def _position(tensors, x) -> int | None:
    for j, t in enumerate(tensors):
        if t is x:
            return j
    return None


def _rebased(descriptor, base):
    """A shallow copy of a TMA descriptor over `base` (or None) without the dataclass's
    validation: shape, strides and block are the signature's."""
    d = object.__new__(type(descriptor))
    d.__dict__.update(descriptor.__dict__)
    d.base = base
    return d


class Plan:
    """(kernel, grid, args, kwargs) of one launch built from `tensors`, with every positional
    argument that is one of them, or a TMA descriptor over one of them, marked. extra: what
    else the caller keeps with the plan (its config). A plan holds none of the tensors it was
    built from (their places are empty until args_for fills them): a kept plan must not keep a
    call's inputs and outputs alive, which can be gigabytes at long sequences."""

    __slots__ = ("kernel", "grid", "args", "kwargs", "extra", "_slots", "launch", "_side")

    def __init__(self, kernel, grid, args, kwargs, tensors, extra=None):
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            raise ValueError("a keyword argument is a tensor: it cannot be replanned")
        self.kernel, self.grid, self.kwargs, self.extra = kernel, grid, kwargs, extra
        self.launch = KeptLaunch()  # launch(kernel, grid, args, kwargs): its specialization kept
        self._side = {}
        args, slots = list(args), []
        for i, a in enumerate(args):
            descriptor = not isinstance(a, torch.Tensor) and isinstance(getattr(a, "base", None), torch.Tensor)
            if isinstance(a, torch.Tensor) or descriptor:
                j = _position(tensors, a.base if descriptor else a)
                if j is None:
                    raise ValueError(f"argument {i} comes from no tensor of the signature: it cannot be replanned")
                slots.append((i, j, descriptor))
                args[i] = _rebased(a, None) if descriptor else None
        self.args, self._slots = tuple(args), tuple(slots)

    def side(self, name: str) -> KeptLaunch:
        """The KeptLaunch of a launch made beside the plan's own by every call of its signature
        (a backward's statistics, its dQ finish), whose arguments follow from that signature
        too."""
        kept = self._side.get(name)
        if kept is None:
            kept = self._side[name] = KeptLaunch()
        return kept

    def args_for(self, tensors) -> list:
        """The positional arguments for `tensors` (the same signature, in the same order)."""
        args = list(self.args)
        for i, j, descriptor in self._slots:
            args[i] = _rebased(args[i], tensors[j]) if descriptor else tensors[j]
        return args


class PlanUse(NamedTuple):
    """One kept plan's use by a wrapper (plans.recording): kind ("forward" / "backward"), the
    Plan, and the wrapper's arguments whose tensors it was used with (a tuple the wrapper
    names)."""

    kind: str
    plan: Plan
    args: tuple


_RECORDING = contextvars.ContextVar("ringflash_plan_uses", default=None)


@contextlib.contextmanager
def recording():
    """Inside the block, every kept plan a wrapper launches from (or keeps) is appended, as a
    PlanUse, to the list the block gets: what a caller's layers chose, for a caller that wants
    to replay them (ringflash.local's call plans)."""
    uses = []
    token = _RECORDING.set(uses)
    try:
        yield uses
    finally:
        _RECORDING.reset(token)


def record(kind: str, plan: Plan, args: tuple) -> None:
    uses = _RECORDING.get()
    if uses is not None:
        uses.append(PlanUse(kind, plan, args))


_SEEN = object()  # a signature met once: its plan is built when it comes again


class Plans:
    """Plans by signature (hashable), the _KEPT most recently used. A plan is kept from a
    signature's second call on: calls whose signatures never repeat (packed batches of ever new
    totals) pay for the signature only, not for building plans never used."""

    def __init__(self, kept: int = _KEPT):
        self._plans: OrderedDict = OrderedDict()
        self._kept = kept

    def get(self, key) -> Plan | None:
        """The plan for `key`, or None (then wants(key) says whether to build one)."""
        plan = self._plans.get(key)
        if plan is None:
            return None
        try:
            self._plans.move_to_end(key)
        except KeyError:  # dropped meanwhile by another thread (autograd runs one per device)
            pass
        return None if plan is _SEEN else plan

    def wants(self, key) -> bool:
        """After get(key) gave None: whether key was met before (build and put its plan);
        otherwise it is remembered as met."""
        if self._plans.get(key) is _SEEN:
            return True
        self.put(key, _SEEN)
        return False

    def put(self, key, plan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        if len(self._plans) > self._kept:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
