"""The gradient relay: the dK/dV accumulators of the K/V block a rank holds at a ring step
travel on with the block, in kv-head chunks, and reach the block's owner after the last step.

Memory: the accumulators (float32, or the inputs' 16-bit dtype when the caller asks) are split
by kv heads into C chunks, each in its own slot, plus ONE spare slot of the largest chunk's
size. Chunk c is sent from its slot while the incoming chunk c is received into the spare; once
that exchange has completed, the sent slot becomes the spare (references swap, nothing is
copied). Receiving thus costs 1/C of the accumulators instead of a second full pair.

Order: the exchanges of a step form a chain (each reuses the slot the previous one freed),
started by send(step) and driven on as the next step asks for its chunks (arriving(step)), after
its dQ pass, so the transfers overlap compute. Chunks are ordered largest first and the chain
runs in ascending order on every other step that runs (the first, the third, ...), descending
on the others: each slot then always holds a
chunk no larger than the one it was made for, although chunk sizes may differ by a head
(Hkv % C != 0). arriving(step) yields the chunks in the order they arrive; callers never see
the parity rule.

Streams (CUDA): the chain runs on a side stream, one per device for the process, because
work.wait() blocks the stream it is called on and the compute stream must not wait for a whole
chain. The side stream waits for the compute stream before a chain (the accumulators are
complete); the compute stream waits for the side stream right after chunk c has arrived and
before the next exchange is issued, so it waits for chunk c only. Every slot is referenced until
finish(), where the compute stream waits for the side stream before any is released; tensors a
comm allocates on the side stream (ReplayComm's records) are read on the compute stream only
after that wait, and the side stream waits for the compute stream before its next use.
"""

from __future__ import annotations

import contextlib
import math

import torch

DEFAULT_GRAD_CHUNKS = 4
"""Default number of kv-head chunks (at most Hkv): the backward's receive memory is one chunk,
1/4 of the accumulators."""

GRAD_CHUNK_MIN_BYTES = 64 << 20
"""By default no chunk is smaller than this: small accumulators cost little memory, and
chunked dK/dV kernels over a short sequence would leave most of the GPU idle (on an H200,
S_local = 4K with 8 kv heads: 0.61 -> 0.44 ring efficiency with 4 chunks)."""


def default_grad_chunks(k: torch.Tensor, acc: torch.dtype, v: torch.Tensor | None = None) -> int:
    """The chunk count for K/V blocks k (B, S, Hkv, D), v (B, S, Hkv, Dv) (None: like k) with
    accumulators of dtype acc."""
    accumulator_bytes = (k.numel() + (k if v is None else v).numel()) * acc.itemsize
    return max(1, min(DEFAULT_GRAD_CHUNKS, accumulator_bytes // GRAD_CHUNK_MIN_BYTES))


def head_chunks(heads: int, chunks: int) -> list[slice]:
    """min(chunks, heads) contiguous, near-equal ranges of `heads` heads, the larger ones first."""
    n = max(1, min(chunks, heads))
    size, extra = divmod(heads, n)
    bounds = [0]
    for c in range(n):
        bounds.append(bounds[-1] + size + (c < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The relay's side stream for `device`, created once per process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[index]


class GradRelay:
    """dK/dV accumulators for K/V blocks like k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv), in `acc`
    dtype, in `chunks` kv-head chunks, passed around the ring of `comm` (RingComm, LocalComm or
    ReplayComm).

    Per ring step: `for heads, dk, dv in relay.arriving(step)` gives each chunk's kv heads and
    its (B, Sk, heads, D) dK and (B, Sk, heads, Dv) dV views, in arrival order, to add the step's
    contributions into;
    then relay.send(step). After the last step, relay.finish(dtype) returns this rank's dK, dV.
    steps: the ring steps that run (schedule.ring_steps; None: every one): the accumulators go
    with their block from one to the next, and from the last straight home (world - step places
    on); one step sends nothing.
    """

    def __init__(self, comm, k, v, acc: torch.dtype, chunks: int, steps=None):
        B, S, H, D = k.shape
        Dv = v.shape[3]
        self.comm = comm
        self.steps = tuple(range(comm.world)) if steps is None else tuple(steps)
        self.index = {step: i for i, step in enumerate(self.steps)}
        self.exchanges = comm.world > 1 and len(self.steps) > 1  # else every block's accumulators stay home
        self.heads = head_chunks(H, chunks if self.exchanges else 1)
        # (dK, dV) shapes of each chunk
        self.shapes = [((B, S, h.stop - h.start, D), (B, S, h.stop - h.start, Dv)) for h in self.heads]
        numel = [math.prod(sk) + math.prod(sv) for sk, sv in self.shapes]
        # one flat tensor of the accumulator dtype per slot holds the chunk's dK then its dV
        self.slots = [torch.zeros(n, dtype=acc, device=k.device) for n in numel]
        self.spare = torch.empty(max(numel), dtype=acc, device=k.device) if self.exchanges else None
        self.side = _side_stream(k.device) if self.exchanges and k.is_cuda else None
        self.chain = []  # chunks still to exchange in the current chain, in order
        self.in_flight = None  # (chunk, handles) of the running exchange
        self.chain_step = None
        self.chain_hop = 1

    def _views(self, slot, c):
        shape_k, shape_v = self.shapes[c]
        n, n_v = math.prod(shape_k), math.prod(shape_v)
        return slot[:n].view(shape_k), slot[n : n + n_v].view(shape_v)

    def _chain_order(self, step: int) -> list[int]:
        up = list(range(len(self.heads)))  # alternating between the steps that run
        return up if self.index[step] % 2 == 0 else up[::-1]

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _start_next(self):
        c = self.chain.pop(0)
        with self._on_side():
            handles = self.comm.start(
                list(self._views(self.slots[c], c)),
                list(self._views(self.spare, c)),
                "grad",
                step=self.chain_step,
                heads=self.heads[c],
                hop=self.chain_hop,
            )
        self.in_flight = (c, handles)

    def _complete(self):
        c, handles = self.in_flight
        with self._on_side():
            self.comm.wait(handles)
        self.slots[c], self.spare = self.spare, self.slots[c]
        self.in_flight = None
        return c

    def _ready(self, c: int):
        """Chunk c's views, once the incoming chunk has arrived; exchanges queued behind it
        start now."""
        while self.in_flight is not None and (self.in_flight[0] == c or c in self.chain):
            done = self._complete()
            if done == c and self.side is not None:
                torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            if self.chain:
                self._start_next()
        return self._views(self.slots[c], c)

    def arriving(self, step: int):
        """Yield (kv heads, dK, dV) of every chunk for `step`'s dK/dV pass, in the order the
        previous step's chain delivers them (the reverse of this step's own chain)."""
        for c in self._chain_order(step)[::-1]:
            dk, dv = self._ready(c)
            yield self.heads[c], dk, dv

    def send(self, step: int) -> None:
        """Start moving every chunk of `step` on to the next rank."""
        if not self.exchanges:
            return
        assert self.in_flight is None and not self.chain, "the previous chain must have completed"
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        self.chain, self.chain_step = self._chain_order(step), step
        # to where the block is at the next step that runs, or from the last straight to the owner, rank - step
        i = self.index[step]
        world = self.comm.world
        self.chain_hop = self.steps[i + 1] - step if i + 1 < len(self.steps) else (world - step) % world
        self._start_next()

    def finish(self, dtype):
        """Complete the last chain; return dK (B, Sk, Hkv, D), dV (B, Sk, Hkv, Dv) contiguous in
        `dtype`, releasing each slot as soon as it is copied out."""
        while self.in_flight is not None:
            self._complete()
            if self.chain:
                self._start_next()
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        self.spare = None
        (B, S, _, D), (_, _, _, Dv) = self.shapes[0]
        H = self.heads[-1].stop
        dk, dv = (torch.empty(B, S, H, d, dtype=dtype, device=self.slots[0].device) for d in (D, Dv))
        for c, h in enumerate(self.heads):
            gk, gv = self._views(self.slots[c], c)
            dk[:, :, h].copy_(gk)
            dv[:, :, h].copy_(gv)
            self.slots[c] = gk = gv = None
        return dk, dv
