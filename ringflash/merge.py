"""The softmax state of a set of query rows, and the one associative merge of two states.

A row's softmax over a set of keys is summarized by (o, m, l): m the largest score, l the sum
of exp(s - m) and o the sum of exp(s - m) * v (or, once normalized, o / l). The kernels and
the torch backend keep m in base-2 units of the scaled scores (s2 = q.k * scale * log2 e) and
fold every block of keys into (o, m, l) exactly as the online softmax does. Keeping the max
beside the normalizer, instead of only lse = m + log l, is what lets the backward rebuild each
probability with the forward's own arithmetic: at |scores| ~ 1e4 a float32 lse carries ~1e-3 of
rounding, which exp turns into a 1e-3 relative error on the dominant weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import _shape, check_tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of `dtype`: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class SoftmaxState(NamedTuple):
    """The softmax state of B x S query rows with H heads.

    o: (B, S, H, Dv) (Dv: v's head dim), the unnormalized sum_j exp2(s2_ij - m_i) v_j (state dtype), or the
    normalized output in any dtype. m, l: (B, H, S) views with equal strides, in the state
    dtype: m the row max of the scaled base-2 scores (-inf for a row that saw no key), l the
    sum of exp2(s2_ij - m_i) (0 for such a row).
    """

    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor

    @staticmethod
    def empty(o: torch.Tensor) -> SoftmaxState:
        """A state for the rows of `o` (B, S, H, Dv) with m and l allocated as one (2, B, H, S)
        buffer of the state dtype, contents undefined."""
        B, S, H, _ = o.shape
        m, l = torch.empty(2, B, H, S, dtype=state_dtype(o.dtype), device=o.device).unbind(0)
        return SoftmaxState(o, m, l)

    @staticmethod
    def zeros(shape, dtype: torch.dtype, device) -> SoftmaxState:
        """The state of rows that have seen no key yet: o = 0 of `shape` (B, S, H, Dv), m = -inf, l = 0."""
        B, S, H, _ = shape
        stats = torch.empty(2, B, H, S, dtype=dtype, device=device)
        stats[0].fill_(float("-inf"))
        stats[1].zero_()
        return SoftmaxState(torch.zeros(shape, dtype=dtype, device=device), stats[0], stats[1])

    def rows(self, rows: slice) -> SoftmaxState:
        return SoftmaxState(self.o[:, rows], self.m[:, :, rows], self.l[:, :, rows])

    def lse(self) -> torch.Tensor:
        """Natural-log sum of exp(scores), (B, H, S): -inf for a row that saw no key."""
        return (self.m + torch.log2(self.l)) * LN2

    def normalized(self, dtype: torch.dtype) -> torch.Tensor:
        """o / l in `dtype` (0 for rows that saw no key); overwrites o."""
        inv = torch.where(self.l > 0, 1.0 / self.l, torch.zeros_like(self.l))
        return self.o.mul_(inv.transpose(1, 2).unsqueeze(-1)).to(dtype)


class DeltaOf(NamedTuple):
    """A backward's delta = rowsum(dO * out) - dlse of the query rows, (B, H, S) in the state
    dtype, not yet computed: a backend may compute it inside a launch of its own (the fused
    backward's row statistics) or first, by value(). out: (B, S, H, Dv), the forward's output;
    dlse: (B, H, S), the gradient of lse, or None."""

    out: torch.Tensor
    dlse: torch.Tensor | None

    def value(self, do: torch.Tensor, rowsum) -> torch.Tensor:
        """delta from do (B, S, H, Dv) and rowsum(out, do) -> (B, H, S) (a backend's delta)."""
        delta = rowsum(self.out, do)
        return delta if self.dlse is None else delta - self.dlse.to(delta.dtype)


def fold(o_a, m_a, l_a, o_b, m_b, l_b, exp=torch.exp2):
    """Merge two states over disjoint key sets: (o, m, l) with o unnormalized, m in the units
    of `exp` (torch.exp2: base-2 scores; torch.exp: natural). A side that saw no key has
    m = -inf and l = 0; both sides empty give o = 0, m = -inf, l = 0, never NaN."""
    m = torch.maximum(m_a, m_b)
    # both sides empty: -inf - -inf would be NaN; any finite pivot gives weights 0
    pivot = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = exp(m_a - pivot), exp(m_b - pivot)
    # weights (B, H, S) -> (B, S, H, 1) to scale o
    o = o_a * w_a.transpose(1, 2).unsqueeze(-1) + o_b * w_b.transpose(1, 2).unsqueeze(-1)
    return o, m, l_a * w_a + l_b * w_b


def merge_attn_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets.

    o_a, o_b: (B, S, H, Dv), normalized outputs of each key set (any float dtype).
    lse_a, lse_b: (B, H, S), natural-log sum of exp(scores); -inf for a row that saw no key.
    Returns (o, lse) in float32, or float64 when an input is float64. Associative and
    commutative; a row empty on both sides gives o = 0 and lse = -inf, never NaN.
    """
    api = "merge_attn_states"
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        check_tensor(name, t, api)
        if not t.is_floating_point():
            raise TypeError(f"{api}: {name} must be floating point, got {t.dtype}")
    if o_a.dim() != 4 or o_a.shape != o_b.shape:
        raise ValueError(f"{api}: o_a and o_b must be equal 4-D (B, S, H, D), got {_shape(o_a)} and {_shape(o_b)}")
    B, S, H, _ = o_a.shape
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != (B, H, S):
            raise ValueError(
                f"{api}: {name} must have shape (B, H, S) = {(B, H, S)} for o {_shape(o_a)}, got {_shape(t)}"
            )
    devices = {t.device for t in (o_a, lse_a, o_b, lse_b)}
    if len(devices) != 1:
        raise ValueError(f"{api}: all inputs must be on one device, got {sorted(map(str, devices))}")
    dtype = state_dtype(torch.promote_types(o_a.dtype, lse_a.dtype))
    dtype = torch.promote_types(dtype, state_dtype(torch.promote_types(o_b.dtype, lse_b.dtype)))
    # a normalized state is (o, m = lse, l = 1) in natural units; l = 0 where lse = -inf
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    l_a, l_b = ((~torch.isneginf(t)).to(dtype) for t in (lse_a, lse_b))
    o, m, l = fold(o_a.to(dtype), lse_a, l_a, o_b.to(dtype), lse_b, l_b, exp=torch.exp)
    inv = torch.where(l > 0, 1.0 / l, torch.zeros_like(l))
    return o * inv.transpose(1, 2).unsqueeze(-1), m + torch.log(l)
