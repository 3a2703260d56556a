"""Tools for checking and timing the ring on one device, without a process group.

replay_ring plays every rank of a `world`-rank ring in turn inside one process (ReplayComm
stands in for the exchange), so the ring's device path can be compared with single-device
attention on one GPU, and one rank's share of the work timed without communication. Not for
training: the replay computes each rank's part sequentially.
"""

from __future__ import annotations

import torch

from .comm import LocalComm
from .layout import _place, _split
from .merge import state_dtype
from .ring import _RingAttn, ring_call_spec


class ReplayComm:
    """Plays rank `rank` of a `world`-rank ring inside one process.

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


def replay_ring(
    q,
    k,
    v,
    do,
    *,
    world,
    causal=False,
    softmax_scale=None,
    layout="zigzag",
    key_padding_mask=None,
    ranks=None,
    grad_accum_dtype=None,
    grad_chunks=None,
):
    """Run the ring's schedule for `world` ranks inside one process on full tensors, without
    a process group: each rank in `ranks` (default all) is replayed in turn with ReplayComm.

    q, k, v, do: full (B, S, H, D) tensors. Returns out, dq, dk, dv as full tensors
    (positions of ranks not replayed are zero; dk/dv then hold only the replayed ranks'
    contributions). grad_accum_dtype, grad_chunks: as in ring_flash_attn_func (the summing of
    dK/dV over the replayed ranks is float32).
    """
    _, spec, key_bias = ring_call_spec(
        q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, "replay_ring"
    )
    k_shards, v_shards = _split(k, world, layout), _split(v, world, layout)
    bias_shards = [None] * world if key_bias is None else _split(key_bias, world, layout)
    blocks = [(ks, vs) if bs is None else (ks, vs, bs) for ks, vs, bs in zip(k_shards, v_shards, bias_shards)]
    q_shards, do_shards = _split(q, world, layout), _split(do, world, layout)
    outs, dqs = [torch.zeros_like(t) for t in q_shards], [torch.zeros_like(t) for t in q_shards]
    dks = [torch.zeros_like(t, dtype=state_dtype(k.dtype)) for t in k_shards]
    dvs = [torch.zeros_like(t, dtype=state_dtype(v.dtype)) for t in v_shards]
    for rank in range(world) if ranks is None else ranks:
        comm = ReplayComm(rank, world, blocks) if world > 1 else LocalComm()
        ql = q_shards[rank].detach().requires_grad_()
        kl, vl = k_shards[rank].detach().requires_grad_(), v_shards[rank].detach().requires_grad_()
        out, _ = _RingAttn.apply(ql, kl, vl, bias_shards[rank], spec, comm)
        dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), do_shards[rank])
        outs[rank], dqs[rank] = out.detach(), dq
        for owner, heads, (dk_part, dv_part) in comm.sent_grads if world > 1 else [(rank, slice(None), (dk, dv))]:
            dks[owner][:, :, heads] += dk_part
            dvs[owner][:, :, heads] += dv_part
    return (
        _place(outs, layout),
        _place(dqs, layout),
        _place([t.to(k.dtype) for t in dks], layout),
        _place([t.to(v.dtype) for t in dvs], layout),
    )
