"""The pure layers: layouts (shard / unshard / local_positions on one process) and the ring
schedule (which blocks each rank computes at each step). No processes, no kernels."""

import pytest
import torch

from ringflash import local_positions, shard
from ringflash.layout import _place, _split
from ringflash.masks import CAUSAL
from ringflash.schedule import global_positions, segments, step_tasks


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_zigzag_schedule_is_balanced_and_complete(world):
    """Every (query, key) pair a causal mask allows is computed exactly once, and every rank
    does the same causal work at every step."""
    c = 4
    L = 2 * c
    seen = torch.zeros(2 * world * c, 2 * world * c, dtype=torch.int64)
    for step in range(world):
        work = []
        for rank in range(world):
            q_glob = global_positions("zigzag", rank, world, L)
            k_glob = global_positions("zigzag", (rank - step) % world, world, L)
            w = 0
            for t in step_tasks("zigzag", rank, world, step, L, L, CAUSAL):
                for i in range(t.q_rows.start, t.q_rows.stop):
                    for j in range(t.kv_rows.start, t.kv_rows.stop):
                        qp, kp = q_glob[i], k_glob[j]
                        if not t.masked:
                            assert qp >= kp  # unmasked blocks must be fully visible
                        if not t.masked or qp >= kp:
                            seen[qp, kp] += 1
                            w += 1
            work.append(w)
        assert len(set(work)) == 1, (step, work)
    assert torch.equal(seen, torch.ones_like(seen).tril())


def test_contiguous_schedule_skips_invisible_steps():
    world, L = 4, 8
    for rank in range(world):
        for step in range(world):
            src = (rank - step) % world
            tasks = step_tasks("contiguous", rank, world, step, L, L, CAUSAL)
            assert len(tasks) == (0 if src > rank else 1)
            if tasks:
                assert tasks[0].masked == (src == rank)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_layouts_partition_the_sequence(layout, world):
    """Every position is held by exactly one rank, segments agree with global_positions, and
    _place inverts _split."""
    S = 2 * world * 3
    x = torch.arange(S)[None, :, None]
    held = []
    for rank in range(world):
        pos = global_positions(layout, rank, world, S // world)
        assert [s.global_start for s in segments(layout, rank, world, S // world)] == [
            pos[s.local_start] for s in segments(layout, rank, world, S // world)
        ]
        held += pos
    assert sorted(held) == list(range(S))
    assert torch.equal(_place(_split(x, world, layout), layout), x)


def test_empty_sequence_has_no_positions():
    # shard() gives an empty sequence empty shards, and shard(x) == x[:, local_positions(...)]
    x = torch.zeros(2, 0)
    for layout in ("zigzag", "contiguous"):
        pos = local_positions(0, layout=layout)
        assert pos.dtype == torch.int64 and pos.shape == (0,)
        assert torch.equal(shard(x, layout=layout), x[:, pos])
    with pytest.raises(ValueError, match="seq_len must be a non-negative int, got -1"):
        local_positions(-1)


def test_layout_errors_say_what_divides():
    with pytest.raises(ValueError, match=r"multiple of 2 \(e.g. 10 or 12\)"):
        local_positions(11)  # zigzag on one rank: 2 chunks
    with pytest.raises(ValueError, match="layout must be one of"):
        shard(torch.zeros(1, 8), layout="striped")
    with pytest.raises(ValueError, match="dim 3 out of range"):
        shard(torch.zeros(1, 8), dim=3)
