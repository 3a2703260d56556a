"""The ring engine: K/V blocks travel around the ranks of a process group while each rank
folds every visible block into its queries' float32 state; backward rotates K/V again and
sends the dK/dV accumulators (float32 unless the caller chose the inputs' 16-bit dtype to save
memory) back to their owners in kv-head chunks (_GradRelay).
"""
from __future__ import annotations

import contextlib
import math
import struct

import torch

from ._checks import (SUPPORTED_DTYPES, check_bool, check_qkv, key_bias_from_mask, resolve_grad_accum,
                      resolve_scale)
from .comm import ReplayComm, RingComm, agree_across_ranks, check_backend_device, group_rank_world
from .layout import _place, _split
from .local import backward_inputs, block_backward, block_forward, without_autocast
from .merge import SoftmaxState, state_dtype
from .schedule import LAYOUTS, check_layout, chunks_per_rank, step_tasks

_FIELD_NAMES = ("batch", "q local length", "k/v local length", "q heads", "k/v heads", "head_dim", "dtype",
                "causal", "layout", "softmax_scale", "device type", "key_padding_mask given",
                "grad_accum_dtype")


def _signature(q, k, causal, scale, layout, has_mask, grad_accum) -> dict:
    """What every rank of a ring must agree on, as integers."""
    B, Sq, Hq, D = q.shape
    values = (B, Sq, k.shape[1], Hq, k.shape[2], D, SUPPORTED_DTYPES.index(q.dtype), int(causal),
              LAYOUTS.index(layout), struct.unpack("<q", struct.pack("<d", scale))[0], int(q.is_cuda),
              int(has_mask), SUPPORTED_DTYPES.index(grad_accum))
    return dict(zip(_FIELD_NAMES, values))


def _show_field(name, value):
    if name in ("dtype", "grad_accum_dtype"):
        return str(SUPPORTED_DTYPES[value])
    if name == "layout":
        return LAYOUTS[value]
    if name == "softmax_scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    return str(value)


def _ring_kv(comm, k, v, key_bias):
    """The one ring loop: yield (step, k, v, key_bias) blocks, this rank's own first, then each
    previous rank's (key_bias travels with its keys, or stays None); the next blocks are
    already in flight while the caller computes on the current. Two sets of receive buffers,
    allocated once, reused."""
    world = comm.world if comm else 1
    blocks = (k, v) if key_bias is None else (k, v, key_bias)
    bufs = [None, None]
    cur = blocks
    for step in range(world):
        last = step + 1 == world
        if not last:
            slot = step % 2
            if bufs[slot] is None:
                bufs[slot] = tuple(torch.empty_like(t) for t in blocks)
            handles = comm.start(list(cur), list(bufs[slot]), "kv", step=step)
        yield step, cur[0], cur[1], (cur[2] if key_bias is not None else None)
        if not last:
            comm.wait(handles)
            cur = bufs[slot]


def _rows(key_bias, rows):
    return None if key_bias is None else key_bias[:, rows]


GRAD_CHUNKS = 4
"""Default number of kv-head chunks the dK/dV accumulators travel the ring in (at most
Hkv): the backward's receive memory is one chunk, 1/GRAD_CHUNKS of the accumulators. Tests
patch it (mock.patch.object); _RingAttn.apply takes an explicit count as its last argument."""

GRAD_CHUNK_MIN_BYTES = 64 << 20
"""By default no chunk is smaller than this: small accumulators cost little memory, and
chunked dK/dV kernels over a short sequence would leave most of the GPU idle (on an H200,
S_local = 4K with 8 kv heads: 0.61 -> 0.44 ring efficiency with 4 chunks)."""


def _default_grad_chunks(k, acc) -> int:
    accumulator_bytes = 2 * k.numel() * acc.itemsize
    return max(1, min(GRAD_CHUNKS, accumulator_bytes // max(GRAD_CHUNK_MIN_BYTES, 1)))


def _head_chunks(heads: int, chunks: int) -> list[slice]:
    """min(chunks, heads) contiguous, near-equal ranges of `heads` heads, the larger ones first."""
    n = max(1, min(chunks, heads))
    size, extra = divmod(heads, n)
    bounds = [0]
    for c in range(n):
        bounds.append(bounds[-1] + size + (c < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class _GradRelay:
    """The dK/dV accumulators (float32, or the 16-bit grad_accum_dtype) of the K/V block a rank
    holds at a ring step, split by kv heads into chunks, each in its own slot; after each
    step's dK/dV pass they move on to
    the next rank (after the last step they reach the block's owner) one chunk at a time,
    through ONE spare slot of the largest chunk's size: chunk c is sent from its slot while the
    incoming chunk c is received into the spare; once that exchange has completed, the sent slot
    becomes the spare (references swap, nothing is copied). So receiving costs 1/C of the
    accumulators instead of a second full pair.

    The exchanges of a step form a chain (each reuses the slot the previous one freed), started
    by send() and driven on by ready(c), which the next step calls before writing chunk c (after
    its dQ pass, so the transfer overlaps compute). Chunks are ordered largest first and the
    chain runs in ascending order on even steps, descending on odd ones: each slot then always
    holds a chunk no larger than the one it was made for, although chunk sizes may differ by a
    head (Hkv % C != 0). The next step writes the chunks in the order they arrive.

    On CUDA the chain runs on a side stream: work.wait() blocks the stream it is called on, and
    the compute stream must not wait for a whole chain. The side stream waits for the compute
    stream before a chain (the accumulators are complete); the compute stream waits for the
    side stream right after chunk c has arrived and before the next exchange is issued, so it
    waits for chunk c only. Every slot is referenced until finish(), where the compute stream
    waits for the side stream before any is released; tensors a comm allocates on the side
    stream (ReplayComm's records) are read on the compute stream only after that wait, and the
    side stream waits for the compute stream before its next use.
    """

    def __init__(self, comm, k, acc, chunks: int):
        B, S, H, D = k.shape
        self.comm = comm
        self.heads = _head_chunks(H, chunks if comm is not None else 1)
        self.shapes = [(B, S, h.stop - h.start, D) for h in self.heads]
        numel = [math.prod(shape) for shape in self.shapes]
        # one flat tensor of the accumulator dtype per slot holds the chunk's dK then its dV
        self.slots = [torch.zeros(2 * n, dtype=acc, device=k.device) for n in numel]
        self.spare = torch.empty(2 * max(numel), dtype=acc, device=k.device) if comm is not None else None
        self.side = torch.cuda.Stream(k.device) if comm is not None and k.is_cuda else None
        self.chain = []  # chunks still to exchange in the current chain, in order
        self.in_flight = None  # (chunk, handles) of the running exchange
        self.chain_step = None

    def _views(self, slot, c):
        shape = self.shapes[c]
        n = math.prod(shape)
        return slot[:n].view(shape), slot[n:2 * n].view(shape)

    def order(self, step: int) -> list[int]:
        """The chain order of `step`'s exchange."""
        up = list(range(len(self.heads)))
        return up if step % 2 == 0 else up[::-1]

    def compute_order(self, step: int) -> list[int]:
        """The order to write the chunks in at `step`: the order in which step-1's chain
        delivers them (the reverse of this step's chain)."""
        return self.order(step)[::-1]

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _start_next(self):
        c = self.chain.pop(0)
        with self._on_side():
            handles = self.comm.start(list(self._views(self.slots[c], c)), list(self._views(self.spare, c)),
                                      "grad", step=self.chain_step, heads=self.heads[c])
        self.in_flight = (c, handles)

    def _complete(self):
        c, handles = self.in_flight
        with self._on_side():
            self.comm.wait(handles)
        self.slots[c], self.spare = self.spare, self.slots[c]
        self.in_flight = None
        return c

    def send(self, step: int) -> None:
        """Start moving every chunk of `step` on to the next rank (no-op without a comm)."""
        if self.comm is None:
            return
        assert self.in_flight is None and not self.chain, "the previous chain must have completed"
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        self.chain, self.chain_step = self.order(step), step
        self._start_next()

    def ready(self, c: int):
        """(dK, dV) of chunk c, (B, Sk, heads of chunk c, D) in the accumulator dtype, once the
        incoming chunk has arrived; exchanges queued behind it start now."""
        while self.in_flight is not None and (self.in_flight[0] == c or c in self.chain):
            done = self._complete()
            if done == c and self.side is not None:
                torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            if self.chain:
                self._start_next()
        return self._views(self.slots[c], c)

    def finish(self, dtype):
        """Complete the last chain; return dK, dV contiguous (B, Sk, Hkv, D) in `dtype`,
        releasing each slot as soon as it is copied out."""
        while self.in_flight is not None:
            self._complete()
            if self.chain:
                self._start_next()
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        self.spare = None
        B, S, _, D = self.shapes[0]
        H = self.heads[-1].stop
        dk, dv = (torch.empty(B, S, H, D, dtype=dtype, device=self.slots[0].device) for _ in range(2))
        for c, h in enumerate(self.heads):
            gk, gv = self._views(self.slots[c], c)
            dk[:, :, h].copy_(gk)
            dv[:, :, h].copy_(gv)
            self.slots[c] = gk = gv = None
        return dk, dv


class _RingAttn(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, key_bias, causal, scale, layout, comm, grad_chunks=None, grad_accum=None):
        """comm: RingComm, ReplayComm, or None for a single rank. key_bias: None or (B, Sk) float32.
        grad_chunks: kv-head chunks for the backward's dK/dV exchange (None: GRAD_CHUNKS, fewer
        for accumulators under GRAD_CHUNKS * GRAD_CHUNK_MIN_BYTES). grad_accum: the dtype of
        the backward's dQ and dK/dV accumulators (None: the state dtype, float32)."""
        rank, world = (comm.rank, comm.world) if comm else (0, 1)
        k, v = k.contiguous(), v.contiguous()  # they travel whole
        B, Sq, Hq, D = q.shape
        acc = state_dtype(q.dtype)
        state = SoftmaxState.zeros(q.shape, acc, q.device)
        for step, kb, vb, bias in _ring_kv(comm, k, v, key_bias):
            for t in step_tasks(layout, rank, world, step, Sq, k.shape[1], causal):
                block_forward(q[:, t.q_rows], kb[:, t.kv_rows], vb[:, t.kv_rows], state.rows(t.q_rows),
                              q_start=t.q_start, k_start=t.k_start, causal=t.causal, scale=scale, fold=True,
                              key_bias=_rows(bias, t.kv_rows))
        m, l, lse = state.m, state.l, state.lse()
        out = state.normalized(q.dtype)
        ctx.save_for_backward(q, k, v, out, m, l, key_bias)
        grad_accum = grad_accum or acc
        chunks = _default_grad_chunks(k, grad_accum) if grad_chunks is None else int(grad_chunks)
        ctx.args = (causal, scale, layout, comm, chunks, grad_accum)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @without_autocast
    def backward(ctx, do, dlse):
        q, k, v, out, m, l, key_bias = ctx.saved_tensors
        causal, scale, layout, comm, grad_chunks, acc = ctx.args
        rank, world = (comm.rank, comm.world) if comm else (0, 1)
        do, delta = backward_inputs(out, do, dlse)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # dK/dV accumulators travel with their K/V block and reach the owner after the last step
        relay = _GradRelay(comm, k, acc, grad_chunks)
        Sq, Sk, G = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
        for step, kb, vb, bias in _ring_kv(comm, k, v, key_bias):
            tasks = step_tasks(layout, rank, world, step, Sq, Sk, causal)
            common = lambda t: dict(q_start=t.q_start, k_start=t.k_start, causal=t.causal, scale=scale,
                                    accumulate=True, key_bias=_rows(bias, t.kv_rows))
            # dQ first: it does not need the incoming dK/dV accumulators, which arrive meanwhile
            for t in tasks:
                block_backward(q[:, t.q_rows], kb[:, t.kv_rows], vb[:, t.kv_rows], m[:, :, t.q_rows],
                               l[:, :, t.q_rows], do[:, t.q_rows], delta[:, :, t.q_rows], dq[:, t.q_rows], None, None,
                               **common(t))
            # dK/dV per kv-head chunk h, with the q heads of its group
            for c in relay.compute_order(step):
                dk, dv = relay.ready(c)
                h = relay.heads[c]
                qh = slice(h.start * G, h.stop * G)
                for t in tasks:
                    block_backward(q[:, t.q_rows, qh], kb[:, t.kv_rows, h], vb[:, t.kv_rows, h],
                                   m[:, qh, t.q_rows], l[:, qh, t.q_rows], do[:, t.q_rows, qh],
                                   delta[:, qh, t.q_rows], None, dk[:, t.kv_rows], dv[:, t.kv_rows], **common(t))
            relay.send(step)
        kb = vb = bias = None  # the K/V receive buffers go before the outputs are made
        dk, dv = relay.finish(k.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, *, causal=False, softmax_scale=None, group=None, layout="zigzag",
                         key_padding_mask=None, return_lse=False, grad_accum_dtype=None):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (B, Sq_local, Hq, D), k, v: (B, Sk_local, Hkv, D): this rank's shards (see shard() and
    local_positions()), Hq % Hkv == 0; float16, bfloat16 or float32 (float64 on CPU).
    group: a process group (None: the default group). With world size 1, or no process group
    initialized, this is local attention. layout: "zigzag" (balanced causal work) or
    "contiguous"; causal needs Sq_local == Sk_local (the same sequence).
    key_padding_mask: optional (B, Sk_local) for this rank's keys, bool (True = padding, the
    key is ignored) or float (added to the scores; not differentiated); it travels around the
    ring with its keys.
    Returns this rank's shard of the output, (B, Sq_local, Hq, D) in q's dtype, exactly as
    attention over the whole sequence on one device would give it; with return_lse=True also
    lse (B, Hq, Sq_local), float32. Differentiable in q, k, v.
    grad_accum_dtype: the dtype the backward accumulates dQ and the travelling dK/dV in across
    the ring's steps. None (default): float32 (float64 for float64), and the gradients' error
    does not grow with the number of ranks. q's own dtype (float16 / bfloat16) saves memory
    (measured on an H200, P=4, H=32, D=128: a rank's peak beyond its inputs 12X -> 8.5X, X =
    one 16-bit shard of q) at the price of one 16-bit rounding per step, so the gradients'
    error grows like sqrt(P) (README: Memory). The forward is the same either way.
    Every call checks with one small all_gather that all ranks passed the same shapes,
    dtype, causal flag, layout, scale, mask presence and grad_accum_dtype, and raises on every
    rank if not.
    """
    api = "ring_flash_attn_func"
    rank, world = group_rank_world(group)
    error, fields, scale, key_bias = None, {}, None, None
    try:
        dims = check_qkv(q, k, v, api)
        check_bool("causal", causal, api)
        check_bool("return_lse", return_lse, api)
        check_layout(layout, api)
        scale = resolve_scale(softmax_scale, dims.head_dim, api)
        key_bias = key_bias_from_mask(key_padding_mask, dims, q.device, api, state_dtype(q.dtype))
        grad_accum = resolve_grad_accum(grad_accum_dtype, q.dtype, state_dtype(q.dtype), api)
        if causal and dims.seqlen_q != dims.seqlen_k:
            raise ValueError(f"{api}: causal ring attention needs equal q and k/v local lengths, "
                             f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
        if world > 1:
            check_backend_device(group, q.device, api)
            parts = chunks_per_rank(layout)
            for name, n in (("q", dims.seqlen_q), ("k/v", dims.seqlen_k)):
                if n % parts:
                    raise ValueError(f"{api}: {name} local length {n} must be a multiple of {parts} "
                                     f"for layout {layout!r}")
            fields = _signature(q, k, causal, scale, layout, key_bias is not None, grad_accum)
    except (TypeError, ValueError) as e:
        if world == 1:
            raise
        error = e
    if world > 1:
        # every rank fails together, or all agree: never a hang, never a mixed-up ring
        fields = fields or dict.fromkeys(_FIELD_NAMES, 0)
        agree_across_ranks(group, fields, error, api, device=getattr(q, "device", None), show=_show_field)
    else:
        layout = "contiguous"  # one rank: every layout is the identity
    comm = RingComm(group) if world > 1 else None
    out, lse = _RingAttn.apply(q, k, v, key_bias, causal, scale, layout, comm, None, grad_accum)
    return (out, lse) if return_lse else out


def replay_ring(q, k, v, do, *, world, causal=False, softmax_scale=None, layout="zigzag", key_padding_mask=None,
                ranks=None, grad_accum_dtype=None):
    """Run the ring's schedule for `world` ranks inside one process on full tensors, without
    a process group: each rank in `ranks` (default all) is replayed in turn with ReplayComm.

    q, k, v, do: full (B, S, H, D) tensors. Returns out, dq, dk, dv as full tensors
    (positions of ranks not replayed are zero; dk/dv then hold only the replayed ranks'
    contributions). For checking the ring's device path on one GPU against flash_attn_func,
    and for timing one rank's share of the work without communication. grad_accum_dtype: as
    in ring_flash_attn_func (the summing of dK/dV over the replayed ranks is float32).
    """
    dims = check_qkv(q, k, v, "replay_ring")
    scale = resolve_scale(softmax_scale, dims.head_dim, "replay_ring")
    grad_accum = resolve_grad_accum(grad_accum_dtype, q.dtype, state_dtype(q.dtype), "replay_ring")
    key_bias = key_bias_from_mask(key_padding_mask, dims, q.device, "replay_ring", state_dtype(q.dtype))
    k_shards, v_shards = _split(k, world, layout), _split(v, world, layout)
    bias_shards = [None] * world if key_bias is None else _split(key_bias, world, layout)
    blocks = [(ks, vs) if bs is None else (ks, vs, bs) for ks, vs, bs in zip(k_shards, v_shards, bias_shards)]
    q_shards, do_shards = _split(q, world, layout), _split(do, world, layout)
    outs, dqs = [torch.zeros_like(t) for t in q_shards], [torch.zeros_like(t) for t in q_shards]
    dks = [torch.zeros_like(t, dtype=state_dtype(k.dtype)) for t in k_shards]
    dvs = [torch.zeros_like(t, dtype=state_dtype(v.dtype)) for t in v_shards]
    for rank in range(world) if ranks is None else ranks:
        comm = ReplayComm(rank, world, blocks) if world > 1 else None
        ql = q_shards[rank].detach().requires_grad_()
        kl, vl = k_shards[rank].detach().requires_grad_(), v_shards[rank].detach().requires_grad_()
        out, _ = _RingAttn.apply(ql, kl, vl, bias_shards[rank], causal, scale, layout, comm, None, grad_accum)
        dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), do_shards[rank])
        outs[rank], dqs[rank] = out.detach(), dq
        for owner, heads, (dk, dv) in comm.sent_grads if comm else [(rank, slice(None), (dk, dv))]:
            dks[owner][:, :, heads] += dk
            dvs[owner][:, :, heads] += dv
    return (_place(outs, layout), _place(dqs, layout),
            _place([t.to(k.dtype) for t in dks], layout), _place([t.to(v.dtype) for t in dvs], layout))
