import math
import random

import pytest
import torch

from ringflash import merge_attn_states

from oracle import assert_within


def _state(scores, values):
    """(o, lse) of softmax over `scores` (list) with scalar `values`, as (1,1,1,1) / (1,1,1)."""
    s = torch.tensor(scores, dtype=torch.float64)
    lse = torch.logsumexp(s, 0)
    o = (torch.softmax(s, 0) * torch.tensor(values, dtype=torch.float64)).sum()
    return o.reshape(1, 1, 1, 1), lse.reshape(1, 1, 1)


def test_worked_numbers():
    # blocks [3, 1] then [5, 2]: max 5, l = sum exp(s - 5) = 1.2034
    a, b = _state([3.0, 1.0], [1.0, 2.0]), _state([5.0, 2.0], [3.0, 4.0])
    o, lse = merge_attn_states(*a, *b)
    want_o, want_lse = _state([3.0, 1.0, 5.0, 2.0], [1.0, 2.0, 3.0, 4.0])
    # the float64 softmax over all four scores is the reference: float64's ulp floor bounds it
    assert_within("o", o, want_o, 0.0, sum_len=4)
    assert_within("lse", lse, want_lse, 0.0, sum_len=4)


def _random_states(n, B=2, S=5, H=3, D=4, seed=0, empty_rows=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        o = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
        lse = torch.randn(B, H, S, generator=g, dtype=torch.float64) * 5
        if empty_rows:
            lse[:, :, i % S] = float("-inf")  # this side saw no key for one row
            o[:, i % S] = 0
        out.append((o, lse))
    return out


def _fold(states, order):
    acc = states[order[0]]
    for i in order[1:]:
        acc = merge_attn_states(*acc, *states[i])
    return acc


def _tree(states):
    while len(states) > 1:
        nxt = [merge_attn_states(*states[i], *states[i + 1]) for i in range(0, len(states) - 1, 2)]
        if len(states) % 2:
            nxt.append(states[-1])
        states = nxt
    return states[0]


def test_associative_commutative_any_order():
    states = _random_states(6)
    # reference: the six states merged at once in float64 (no higher precision to compare
    # against, so float64's ulp floor over a 6-term sum is the bound for every order)
    o_all, lse_all = (torch.stack(t) for t in zip(*states))
    ref_lse = torch.logsumexp(lse_all, 0)
    ref_o = (torch.exp(lse_all - ref_lse).nan_to_num().transpose(2, 3).unsqueeze(-1) * o_all).sum(0)
    orders = [list(range(6)), list(range(6))[::-1], random.Random(1).sample(range(6), 6)]
    results = [_fold(states, order) for order in orders] + [_tree(states)]
    for o, lse in results:
        assert_within("o", o, ref_o, 0.0, sum_len=6)
        assert_within("lse", lse, ref_lse, 0.0, sum_len=6)


def test_both_sides_empty_gives_zero_and_minus_inf():
    o = torch.randn(1, 3, 2, 8)
    lse = torch.full((1, 2, 3), float("-inf"))
    mo, ml = merge_attn_states(o * 0, lse, o * 0, lse.clone())
    assert torch.all(mo == 0) and torch.all(ml == float("-inf"))
    # one side empty: the other side unchanged
    lse_b = torch.randn(1, 2, 3)
    mo, ml = merge_attn_states(o * 0, lse, o, lse_b)
    assert torch.equal(mo, o) and torch.equal(ml, lse_b)  # weights exactly 0 and 1


def test_dtypes():
    o = torch.randn(1, 4, 2, 8)
    lse = torch.randn(1, 2, 4)
    mo, ml = merge_attn_states(o.half(), lse, o.bfloat16(), lse)
    assert mo.dtype == torch.float32 and ml.dtype == torch.float32
    mo, ml = merge_attn_states(o.double(), lse.double(), o.double(), lse.double())
    assert mo.dtype == torch.float64 and ml.dtype == torch.float64
    # 16-bit statistics are widened before the merge, not merged in 16 bits
    mo, ml = merge_attn_states(o, lse.half(), o, lse.half())
    assert ml.dtype == torch.float32


def test_large_lse_no_overflow():
    o = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    lse_a = torch.tensor([[[1e4, -1e4]]], dtype=torch.float64)
    lse_b = torch.tensor([[[1e4 + 1, -1e4 - 3]]], dtype=torch.float64)
    mo, ml = merge_attn_states(o, lse_a, o, lse_b)
    assert torch.isfinite(mo).all() and torch.isfinite(ml).all()
    want = torch.tensor(1e4 + 1 + math.log1p(math.exp(-1)), dtype=torch.float64)
    assert_within("lse", ml[0, 0, 0], want, 0.0, sum_len=2)  # float64's ulps at 1e4


def test_bad_input():
    o = torch.randn(1, 4, 2, 8)
    lse = torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attn_states(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(ValueError, match="o_a"):
        merge_attn_states(o[0], lse, o, lse)
    with pytest.raises(TypeError, match="o_b"):
        merge_attn_states(o, lse, o.long(), lse)
    with pytest.raises(TypeError, match="lse_a"):
        merge_attn_states(o, [1.0], o, lse)
