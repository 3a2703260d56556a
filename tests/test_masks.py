"""The one description of which keys a query sees (ringflash.masks), against brute force."""

import pickle
import random

import pytest
import torch

from ringflash import balance, balanced_layout
from ringflash.masks import (
    CAUSAL,
    FULL,
    KEY_ORDER_BLOCK,
    KEY_ORDER_ROWS,
    Visibility,
    Window,
    block_visibility,
    document_bounds,
    key_block_order,
    packed_bounds,
    window_from,
)


def _sees(window: Window, qp: int, kp: int) -> bool:
    return (window.left is None or kp >= qp - window.left) and (window.right is None or kp <= qp + window.right)


WINDOWS = [FULL, CAUSAL, Window(0, 0), Window(3, 0), Window(2, 5), Window(None, 4), Window(7, None), Window(0, 2)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_block_visibility_is_exact(window):
    rng = random.Random(str(window))
    for _ in range(300):
        qs, ks, nq, nk = rng.randint(-5, 30), rng.randint(-5, 30), rng.randint(0, 9), rng.randint(0, 9)
        pairs = [_sees(window, qs + i, ks + j) for i in range(nq) for j in range(nk)]
        want = Visibility.NONE if not any(pairs) else Visibility.FULL if all(pairs) else Visibility.PARTIAL
        assert block_visibility(qs, nq, ks, nk, window) is want, (qs, nq, ks, nk)


def _random_cu(rng, n_docs, longest):
    lengths = [rng.choice([0, 1, rng.randint(0, longest)]) for _ in range(n_docs)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_document_bounds_match_brute_force(window):
    """Every query row's [k_lo, k_hi) is exactly the keys of its document it sees (bottom-right
    aligned per document), every key row's [q_lo, q_hi) exactly the queries that see it."""
    rng = random.Random(str(window) + "docs")
    for _ in range(20):
        n = rng.randint(1, 6)
        cu_q = _random_cu(rng, n, 9)
        cu_k = cu_q if rng.random() < 0.5 else _random_cu(rng, n, 9)
        b = document_bounds(torch.tensor(cu_q), torch.tensor(cu_k), window)
        sees = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
        for d in range(n):
            offset = cu_k[d + 1] - cu_q[d + 1]
            for i in range(cu_q[d], cu_q[d + 1]):
                for j in range(cu_k[d], cu_k[d + 1]):
                    sees[i, j] = _sees(window, i + offset, j)
        for i in range(cu_q[-1]):
            row = sees[i].nonzero().flatten().tolist()
            lo, hi = int(b.k_lo[i]), int(b.k_hi[i])
            assert row == list(range(lo, hi)), (cu_q, cu_k, i, row, lo, hi)
        for j in range(cu_k[-1]):
            col = sees[:, j].nonzero().flatten().tolist()
            assert col == list(range(int(b.q_lo[j]), int(b.q_hi[j]))), (cu_q, cu_k, j)
        assert all(t.dtype == torch.int32 for t in b[:4])
        # built on the host for a device: the same bounds, and the mean keys per query row
        on_dev = packed_bounds(tuple(cu_q), tuple(cu_k), window, torch.device("cpu"))
        assert all(torch.equal(x, y) for x, y in zip(on_dev[:4], b[:4]))
        assert on_dev.keys_per_row == pytest.approx(sees.sum().item() / max(cu_q[-1], 1))


def test_key_block_order_puts_the_blocks_spanning_most_query_blocks_first():
    """key_block_order against brute force: for random per-key [q_lo, q_hi) (empty ones among
    them, key counts not a multiple of the block), a permutation of the key blocks whose query
    block spans (the hull of the block's seen rows, in KEY_ORDER_ROWS blocks) never increase,
    equal spans in key order; on_device keeps it with the bounds where asked, int32."""
    rng = random.Random("order")
    for n in [0, 1, KEY_ORDER_BLOCK, 3 * KEY_ORDER_BLOCK + 5, 700]:
        for _ in range(5):
            lo = torch.tensor([rng.randint(0, 2000) for _ in range(n)], dtype=torch.int32)
            hi = lo + torch.tensor([rng.choice([0, 0, 1, rng.randint(0, 900)]) for _ in range(n)], dtype=torch.int32)
            spans = []
            for b in range(-(-n // KEY_ORDER_BLOCK)):
                rows = [r for j in range(b * KEY_ORDER_BLOCK, min(n, (b + 1) * KEY_ORDER_BLOCK))
                        for r in range(int(lo[j]), int(hi[j]))]  # fmt: skip
                blocks = {r // KEY_ORDER_ROWS for r in rows}
                spans.append(max(blocks) - min(blocks) + 1 if blocks else 0)
            want = sorted(range(len(spans)), key=lambda b: (-spans[b], b))
            got = key_block_order(lo, hi)
            assert got.dtype == torch.int32 and got.tolist() == want, (n, spans)
            bounds = document_bounds(torch.tensor([0, 0]), torch.tensor([0, n]), FULL)._replace(q_lo=lo, q_hi=hi)
            assert bounds.on_device("cpu", key_order=True).key_order.tolist() == want
            assert bounds.on_device("cpu").key_order is None


@pytest.mark.parametrize("crop", [False, True], ids=["every_row", "cropped"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_ring_step_plan_covers_every_visible_pair_once(window, crop, monkeypatch):
    """A balanced layout's step_plan at every rank and step: its own tasks (position masks) and
    its per-row intervals of the held block (padded by one row) over its box together cover
    exactly the pairs of one document that the window lets attend, each once, whichever
    documents are large enough for tasks of their own (a finite OWN_CALL_WORK, so that both
    kinds of call occur); padding rows are seen by none. Cropped (balance.CROP_STEP_CALLS, a
    CROP_ALIGN of 4 rows so that these short shards crop): the box at steps other than 0 holds
    every row that sees a key and every key some row sees, widened to whole 4-row blocks (step
    0's box: every row). Each call's bounds carry their key blocks' order (RowBounds.key_order)."""
    OWN_WORK = 2**36
    monkeypatch.setattr(balance, "OWN_CALL_WORK", OWN_WORK)
    monkeypatch.setattr(balance, "CROP_STEP_CALLS", crop)
    monkeypatch.setattr(balance, "CROP_ALIGN", 4)
    rng = random.Random(str(window) + "ring")
    for trial in range(12):
        cu = _random_cu(rng, rng.randint(1, 7), 30)
        world = rng.randint(1, 4)
        w = [-1 if x is None else x for x in (window.left, window.right)]
        L = balanced_layout(cu, world, causal=w[1] == 0, window_size=tuple(w))
        doc = lambda p: max(d for d in range(len(cu) - 1) if cu[d] <= p < cu[d + 1])  # noqa: E731
        pair_work = [1, OWN_WORK // 40, OWN_WORK][trial % 3]  # none, some, every document
        for rank in range(world):
            for step in range(world):
                q_pos = L.positions(rank).tolist()
                k_pos = L.positions((rank - step) % world).tolist()
                n_k = L.max_local_len + 1
                sees = torch.zeros(len(q_pos), n_k, dtype=torch.int64)
                for i, qp in enumerate(q_pos):
                    for j, kp in enumerate(k_pos):
                        sees[i, j] = doc(qp) == doc(kp) and _sees(window, qp, kp)
                tasks, b, box = L.step_plan(rank, step, window, n_k, "cpu", pair_work)
                covered = torch.zeros_like(sees)
                for t in tasks:
                    for i in range(t.q_rows.start, t.q_rows.stop):
                        for j in range(t.kv_rows.start, t.kv_rows.stop):
                            qp, kp = t.q_start + i - t.q_rows.start, t.k_start + j - t.kv_rows.start
                            covered[i, j] += not t.masked or _sees(window, qp, kp)
                if b is not None:
                    (r0, r1), (k0, k1) = (box.q_rows.start, box.q_rows.stop), (box.kv_rows.start, box.kv_rows.stop)
                    assert len(b.k_lo) == r1 - r0 and len(b.q_lo) == k1 - k0
                    for i in range(r1 - r0):
                        covered[r0 + i, k0 + int(b.k_lo[i]) : k0 + int(b.k_hi[i])] += 1
                    for j in range(k1 - k0):
                        col = torch.arange(len(q_pos))
                        seen_by = ((col >= r0 + int(b.q_lo[j])) & (col < r0 + int(b.q_hi[j]))).long()
                        others = sum(_task_column(t, k0 + j, len(q_pos), window) for t in tasks)
                        assert torch.equal(seen_by, covered[:, k0 + j] - others)
                    assert all(int(b.q_lo[j - k0]) == int(b.q_hi[j - k0]) for j in range(len(k_pos), k1))  # padding
                    assert b.keys_per_row == pytest.approx(sees.sum().item() / (r1 - r0))
                    assert torch.equal(b.key_order, key_block_order(b.q_lo, b.q_hi))  # (heaviest first)
                    if crop and step:  # the box: the rows and keys that see each other, in whole blocks
                        seeing, seen = sees.any(1).nonzero().flatten(), sees.any(0).nonzero().flatten()
                        assert r0 == int(seeing[0]) // 4 * 4 and r1 == min(
                            len(q_pos), -(-(int(seeing[-1]) + 1) // 4) * 4
                        )
                        assert k0 == int(seen[0]) // 4 * 4 and k1 == min(n_k, -(-(int(seen[-1]) + 1) // 4) * 4)
                    else:
                        assert (r0, r1, k0, k1) == (0, len(q_pos), 0, n_k)
                assert torch.equal(covered, sees), (cu, world, rank, step, pair_work)
                assert L.step_plan(rank, step, window, n_k, "cpu", pair_work)[1] is b  # built once
        copied = pickle.loads(pickle.dumps(L))  # without the plans, equal
        assert copied == L and not copied._held and copied.code == L.code


def _task_column(t, j, n_q, window):
    """Which query rows task t lets see key row j (0/1 per row)."""
    col = torch.zeros(n_q, dtype=torch.int64)
    if t.kv_rows.start <= j < t.kv_rows.stop:
        kp = t.k_start + j - t.kv_rows.start
        for i in range(t.q_rows.start, t.q_rows.stop):
            col[i] = not t.masked or _sees(window, t.q_start + i - t.q_rows.start, kp)
    return col


@pytest.mark.parametrize(
    "causal,window_size,want",
    [(False, (-1, -1), FULL), (True, (-1, -1), CAUSAL), (True, (5, 0), Window(5, 0)), (True, (5, -1), Window(5, 0)),
     (False, (0, 3), Window(0, 3)), (False, (-1, 2), Window(None, 2))],
)  # fmt: skip
def test_window_from_flash_attn_semantics(causal, window_size, want):
    assert window_from(causal, window_size, "f") == want


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), (-2, 0), (0.5, 1), "ab", (True, 1), None, 3])
def test_window_size_must_be_a_pair_of_ints(bad):
    with pytest.raises(ValueError, match="window_size must be a pair of ints >= -1"):
        window_from(False, bad, "f")


def test_causal_with_a_future_window_is_an_error():
    with pytest.raises(ValueError, match="causal=True means window_size's right is 0"):
        window_from(True, (4, 2), "f")
