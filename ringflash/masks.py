"""The causal rule by global token positions: query at q_pos sees key at k_pos iff q_pos >= k_pos.

A block is query rows [q_start, q_start + n_q) against key rows [k_start, k_start + n_k).
The same rule covers a local diagonal block, a fully visible block and every offset a ring
step produces. Pure Python.
"""

from __future__ import annotations

import enum


class Visibility(enum.Enum):
    NONE = 0  # no query sees any key: nothing to compute
    FULL = 1  # every query sees every key: no mask
    PARTIAL = 2  # the causal mask applies


def block_visibility(q_start: int, n_q: int, k_start: int, n_k: int, causal: bool) -> Visibility:
    if n_q <= 0 or n_k <= 0:
        return Visibility.NONE
    if not causal:
        return Visibility.FULL
    q_last, k_last = q_start + n_q - 1, k_start + n_k - 1
    if q_last < k_start:
        return Visibility.NONE
    if q_start >= k_last:
        return Visibility.FULL
    return Visibility.PARTIAL


def local_causal_offsets(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(q_start, k_start) for one device's causal attention, aligned bottom-right as
    flash-attn does: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    return seqlen_k - seqlen_q, 0
