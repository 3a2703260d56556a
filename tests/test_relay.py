"""The gradient relay: kv-head chunks, their exchange around the ring, and the memory they take."""

import contextlib
from unittest import mock

import pytest
import torch

from ringflash import ring_flash_attn_func, shard
from ringflash.comm import RingComm
from ringflash.relay import DEFAULT_GRAD_CHUNKS, GRAD_CHUNK_MIN_BYTES, default_grad_chunks, head_chunks
from ringflash.testing import ReplayComm, replay_ring

from allocations import ring_allocations, ring_copies
from oracle import assert_within, plain_errors, reference
from ring_cases import TORCH, Case, full_inputs, ring_vs_oracle


@pytest.mark.parametrize("heads,chunks", [(1, 1), (4, 1), (4, 2), (4, 3), (5, 3), (8, 4), (3, 8), (7, 7)])
def test_head_chunks_cover_the_heads_near_equally_larger_first(heads, chunks):
    parts = head_chunks(heads, chunks)
    assert len(parts) == min(heads, chunks)
    assert [p.start for p in parts] == [0] + [p.stop for p in parts[:-1]] and parts[-1].stop == heads
    sizes = [p.stop - p.start for p in parts]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


def test_default_grad_chunks_follow_the_accumulator_size():
    """Small dK/dV accumulators stay in one chunk (chunked kernels over short sequences leave
    the GPU idle); from GRAD_CHUNK_MIN_BYTES per chunk up, DEFAULT_GRAD_CHUNKS of them."""
    count = lambda S, Hkv: default_grad_chunks(torch.empty(1, S, Hkv, 128, device="meta"), torch.float32)
    assert GRAD_CHUNK_MIN_BYTES == 64 << 20
    assert count(4096, 8) == 1  # 32 MiB of float32 dK + dV
    assert count(16384, 8) == 2  # 128 MiB
    assert count(32768, 8) == DEFAULT_GRAD_CHUNKS  # 256 MiB
    assert count(32768, 32) == DEFAULT_GRAD_CHUNKS


@contextlib.contextmanager
def _recording_grad_exchanges(heads_sent):
    """Record the kv heads slice of every gradient exchange this rank starts."""
    real = RingComm.start

    def start(self, send, recv, kind, **kw):
        if kind == "grad":
            heads_sent.append(kw["heads"])
        return real(self, send, recv, kind, **kw)

    with mock.patch.object(RingComm, "start", start):
        yield


def _chunked(rank, world, case: Case):
    """The ring against float64 with the accumulators in case.grad_chunks chunks; each step
    exchanges every kv head exactly once, in min(chunks, Hkv) near-equal chunks."""
    heads_sent = []
    with _recording_grad_exchanges(heads_sent):
        ring_vs_oracle(rank, world, case)
    n = min(case.grad_chunks, case.Hkv)
    assert len(heads_sent) == world * n, (len(heads_sent), world, n)
    for i in range(0, len(heads_sent), n):
        step = sorted(heads_sent[i : i + n], key=lambda h: h.start)
        assert [h.start for h in step] == [0] + [h.stop for h in step[:-1]] and step[-1].stop == case.Hkv, step
        assert max(h.stop - h.start for h in step) - min(h.stop - h.start for h in step) <= 1, step


def _chunked_cases():
    """Equal chunks, unequal ones (Hkv % C != 0), C > Hkv (MQA), GQA, both layouts, causal or
    not, masks, cross-attention."""
    out = []
    for world in (2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                for chunks in (1, 2, 3):  # Hkv=4: chunks of 4; 2+2; 2+1+1 heads
                    if world == 4 and (layout, causal, chunks) != ("zigzag", True, 3):
                        continue
                    out.append(
                        (
                            world,
                            Case(
                                layout,
                                causal,
                                2,
                                3,
                                8,
                                4,
                                16,
                                torch.float32,
                                seed=10 * world + chunks,
                                grad_chunks=chunks,
                            ),
                        )
                    )
        if world == 4:
            continue
        out.append((world, Case("zigzag", True, 1, 8, 3, 1, 16, torch.float64, seed=5, grad_chunks=3)))
        out.append(
            (
                world,
                Case("zigzag", False, 1, 2, 5, 5, 16, torch.float32, seed=6, mask="bool", kv_chunk=5, grad_chunks=3),
            )
        )  # 2+2+1 heads, cross-attention
        out.append(
            (world, Case("contiguous", True, 2, 3, 6, 3, 16, torch.float64, seed=7, mask="float", grad_chunks=2))
        )  # 2+1 heads
    return out


@pytest.mark.parametrize("world,case", _chunked_cases(), ids=lambda x: str(x) if isinstance(x, Case) else f"w{x}")
def test_chunked_grad_exchange(worlds, world, case):
    worlds(world, **TORCH).run(_chunked, case)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
@pytest.mark.parametrize(
    "world,layout,causal,Hq,Hkv,chunks",
    [
        (2, "zigzag", True, 8, 4, 3),
        (3, "contiguous", False, 8, 4, 2),
        (3, "zigzag", True, 6, 3, 2),
        (2, "contiguous", True, 2, 1, 3),
        (4, "zigzag", False, 5, 5, 3),
        (3, "zigzag", True, 4, 4, 1),
    ],
)
def test_replay_with_chunked_grad_exchange(backend, world, layout, causal, Hq, Hkv, chunks):
    """replay_ring (ReplayComm records each head chunk it sends) against the float64 oracle."""
    records = []
    real_init = ReplayComm.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        records.append(self.sent_grads)

    q, k, v, do = full_inputs(2, 2 * world * 4, 2 * world * 4, Hq, Hkv, 16, torch.float64, world + chunks)
    with mock.patch.object(ReplayComm, "__init__", init):
        out, dq, dk, dv = replay_ring(q, k, v, do, world=world, causal=causal, layout=layout, grad_chunks=chunks)
    ref = reference(q, k, v, do, causal=causal)
    plain = plain_errors(q, k, v, do, ref, causal=causal)
    assert_within("out", out, ref[0], plain["out"])
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
        assert_within(name, g, r, plain[name])
    n = min(chunks, Hkv)
    assert len(records) == world and all(len(sent) == world * n for sent in records)
    assert all(dkc.shape[2] == h.stop - h.start <= -(-Hkv // n) for sent in records for _, h, (dkc, _) in sent)


def _allocations(rank, world, chunks, dtype=torch.float32, Hq=2, Hkv=2, grad_accum=None):
    """[(factory, dtype, bytes)] of the ring engine's own allocations in one causal forward +
    backward with 8 tokens per rank, B=1, D=16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        shard(torch.randn(1, 8 * world, H, 16, generator=g, dtype=dtype)).requires_grad_() for H in (Hq, Hkv, Hkv)
    )
    with ring_allocations() as made:
        out = ring_flash_attn_func(q, k, v, causal=True, grad_chunks=chunks, grad_accum_dtype=grad_accum)
        out.sum().backward()
    return made


@pytest.mark.parametrize("world", [3, 6])
def test_no_allocation_per_ring_step(worlds, world):
    """The engine allocates the same tensors for 3 steps or 6: forward: the state (o; m and l in
    one buffer), the normalization's zeros and 2 receive buffers x (k, v) = 7; backward: dq,
    one slot per dK/dV head chunk (2 heads: 2 chunks), one spare slot, 2 receive buffers x
    (k, v), the dk and dv outputs = 10."""
    made = worlds(world, **TORCH).run(_allocations, 2)[0]
    assert len(made) == 17, [name for name, _, _ in made]


def _copies(rank, world):
    """The Tensor-method copies (allocations.ring_copies) the engine makes in one causal forward +
    backward, 8 tokens per rank."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard(torch.randn(1, 8 * world, 2, 16, generator=g)).requires_grad_() for _ in range(3))
    with ring_copies() as made:
        out = ring_flash_attn_func(q, k, v, causal=True, grad_chunks=2)
        out.sum().backward()
    return sorted(made)


def test_no_copy_per_ring_step(worlds):
    """Nor does it copy through Tensor methods (clone, new_empty, .to, ...) once per step: the
    same copies for 3 steps or 6."""
    at3, at6 = worlds(3, **TORCH).run(_copies)[0], worlds(6, **TORCH).run(_copies)[0]
    assert at3 == at6, (at3, at6)


def _float32_bytes(rank, world):
    """bf16 inputs: the engine's float32 allocations are the state, dq and the dK/dV
    accumulators with their receive space, which must shrink to one head chunk."""
    B, S_local, Hq, Hkv, D = 1, 8, 8, 4, 16  # as _allocations makes them
    state = B * S_local * Hq * D * 4 * 2 + 2 * B * Hq * S_local * 4  # o and dq; m and l
    head = B * S_local * D * 4 * 2  # one kv head of dK and dV
    normalization = B * Hq * S_local * 4  # its zeros
    totals = {}
    for chunks in (1, 2, 3, 4, 8):
        made = _allocations(rank, world, chunks, torch.bfloat16, Hq, Hkv)
        totals[chunks] = sum(n for _, dtype, n in made if dtype == torch.float32)
        largest = -(-Hkv // min(chunks, Hkv))
        # the accumulators (Hkv heads) and one spare slot of the largest chunk: no second full pair
        want = state + normalization + head * (Hkv + largest)
        assert totals[chunks] == want, (chunks, totals[chunks], want)
    assert totals[1] > totals[2] == totals[3] > totals[4] == totals[8], totals
    assert totals[1] - totals[4] == head * 3


def test_float32_gradient_buffers_shrink_with_chunks(worlds):
    worlds(2, **TORCH).run(_float32_bytes)


def _accumulator_bytes(rank, world):
    """grad_accum_dtype=bf16: the backward allocates nothing in float32 (only the forward's
    state is), and dQ plus the dK/dV slots and spare take half the default's bytes."""
    B, S_local, Hq, Hkv, D = 1, 8, 8, 4, 16  # as _allocations makes them
    forward_state = B * S_local * Hq * D * 4 + 3 * B * Hq * S_local * 4  # o; m, l and the normalization's zeros
    made = {accum: _allocations(rank, world, 2, torch.bfloat16, Hq, Hkv, accum) for accum in (None, torch.bfloat16)}
    f32 = {a: sum(n for _, dtype, n in m if dtype == torch.float32) for a, m in made.items()}
    assert f32[torch.bfloat16] == forward_state, (f32, forward_state)
    # the gradient state: dq (Hq heads), dK/dV slots (Hkv heads) and a spare of 2 heads
    grad_state = B * S_local * D * 4 * (Hq + 2 * Hkv + 2 * 2)
    total = {a: sum(n for _, _, n in m) for a, m in made.items()}
    assert total[None] - total[torch.bfloat16] == grad_state // 2, (total, grad_state)


def test_16bit_gradient_accumulators_halve_the_gradient_state(worlds):
    worlds(2, **TORCH).run(_accumulator_bytes)
