"""dQ of a ring call's query rows, summed over every block backward of the call.

A rank's queries meet a new K/V block at every ring step, and each block backward adds its part
of dQ. The Triton passes and the torch backend add into a row-major buffer (B, S, Hq, D) in the
accumulator dtype. The fused Gluon backward adds unscaled dQ into a blocked float32 layout
(gluon_backward.BlockedDQ) that must be scaled and un-permuted afterwards; given one blocked
buffer for the whole call it skips the per-launch scratch, its zeroing and its finishing pass
(a read and a read-modify-write of the call's whole dQ per step and kv-head chunk), and
result() un-permutes once, straight into the output dtype where nothing else was added.
"""

from __future__ import annotations

import torch


class DQSum:
    """dQ (B, S, Hq, D) of one call, in `acc` dtype (float32, float64 or a 16-bit accumulator
    the caller asked for), scale: the softmax scale of every block. Its buffers are made when
    first needed: row-major for part().tensor(), blocked (float32 accumulators only) for
    part().blocked()."""

    def __init__(self, shape, acc: torch.dtype, device: torch.device, scale: float):
        self.shape, self.acc, self.device, self.scale = tuple(shape), acc, device, float(scale)
        self._natural = self._blocked = None

    def part(self, rows: slice = slice(None), heads: slice = slice(None)) -> DQPart:
        """The rows and q heads one block backward adds to."""
        return DQPart(self, rows, heads)

    def natural(self) -> torch.Tensor:
        """The row-major buffer (B, S, Hq, D) in the accumulator dtype."""
        if self._natural is None:
            self._natural = torch.zeros(self.shape, dtype=self.acc, device=self.device)
        return self._natural

    def blocked(self) -> torch.Tensor:
        """The blocked float32 buffer (B, Hq, S padded to whole blocks, D padded to the kernel's
        tile width) of unscaled dQ."""
        if self._blocked is None:
            from .kernels.gluon_backward import blocked_rows, padded_head_dim

            B, S, Hq, D = self.shape
            self._blocked = torch.zeros(
                B, Hq, blocked_rows(S), padded_head_dim(D), dtype=torch.float32, device=self.device
            )
        return self._blocked

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """The summed dQ (B, S, Hq, D) in `dtype`; the blocked buffer is released."""
        if self._blocked is None:
            return self.natural().to(dtype)
        from .kernels.gluon_backward import unblock_dq

        blocked, self._blocked = self._blocked, None
        if self._natural is None:
            out = torch.empty(self.shape, dtype=dtype, device=self.device)
            unblock_dq(blocked, out, scale=self.scale, accumulate=False)
            return out
        unblock_dq(blocked, self._natural, scale=self.scale, accumulate=True)
        return self._natural.to(dtype)


class DQPart:
    """Rows `rows` and q heads `heads` of a DQSum: what block_backward takes as dq."""

    def __init__(self, dq_sum: DQSum, rows: slice, heads: slice):
        self.sum, self.rows, self.heads = dq_sum, rows, heads

    def tensor(self) -> torch.Tensor:
        """A view (B, rows, heads, D) of the row-major buffer."""
        rows = self.sum.natural()[:, self.rows]
        return rows if self.heads == slice(None) else rows[:, :, self.heads]

    def blocked(self):
        """A gluon_backward.BlockedDQ over these rows and heads of the blocked buffer, or None
        where it cannot serve: an accumulator other than float32, or a first row off the
        blocks."""
        from .kernels.gluon_backward import DQ_BLOCK_ROWS, BlockedDQ

        start = self.rows.start or 0
        if self.sum.acc != torch.float32 or start % DQ_BLOCK_ROWS or self.rows.step not in (None, 1):
            return None

        return BlockedDQ(self.sum.blocked()[:, self.heads, start:])
