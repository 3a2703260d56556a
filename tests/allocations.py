"""Count the tensors the ring engine allocates itself (not its block operations' backends)."""

from __future__ import annotations

import contextlib
import sys

import torch

FACTORIES = ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like")
BACKENDS = ("ringflash.reference", "ringflash.kernels")


def _made_by_the_engine(frame) -> bool:
    """Whether the call stack from `frame` out runs through ringflash code but not through a
    block operation's backend (whose temporaries scale with the blocks, by design)."""
    in_ringflash = False
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(BACKENDS):
            return False
        in_ringflash = in_ringflash or name.startswith("ringflash.")
        frame = frame.f_back
    return in_ringflash


@contextlib.contextmanager
def _wrapped(owner, names, wrap):
    """Inside the block, owner.<name> is wrap(name, real) for each of names (real: the original),
    restored after."""
    real = {name: getattr(owner, name) for name in names}
    for name, fn in real.items():
        setattr(owner, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(owner, name, fn)


@contextlib.contextmanager
def ring_allocations():
    """Record (factory, dtype, bytes) of every floating-point tensor (the memory that matters;
    not the rank check's small integer rows) that ringflash code outside the block operations'
    backends allocates with torch's factory functions inside the block."""
    made = []

    def wrap(name, real):
        def alloc(*a, **kw):
            t = real(*a, **kw)
            if t.is_floating_point() and _made_by_the_engine(sys._getframe(1)):
                made.append((name, t.dtype, t.numel() * t.element_size()))
            return t

        return alloc

    with _wrapped(torch, FACTORIES, wrap):
        yield made


# Tensor methods that return new memory: the copies a per-step allocation most often hides in
METHODS = ("clone", "new_empty", "new_zeros", "new_full", "contiguous", "to")


@contextlib.contextmanager
def ring_copies():
    """Record the Tensor method name of every floating-point tensor that ringflash code outside
    the block operations' backends makes with a METHODS call that returns new memory (not
    `contiguous` or `to` returning their input)."""
    made = []

    def wrap(name, real):
        def method(self, *a, **kw):
            t = real(self, *a, **kw)
            new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.untyped_storage().data_ptr()
            if new and t.is_floating_point() and _made_by_the_engine(sys._getframe(1)):
                made.append(name)
            return t

        return method

    with _wrapped(torch.Tensor, METHODS, wrap):
        yield made
