"""Which keys a query sees: one description for causal attention, sliding windows and packed
documents, used by the kernels, the torch backend and the ring's schedule alike.

A query at global position qp sees the key at position kp iff kp lies in the query's visible
interval: qp - left <= kp <= qp + right (a Window; None = unbounded on that side; causal is
right = 0), intersected, with packed documents, with the keys of the query's own document
(RowBounds: one half-open interval [k_lo, k_hi) of key positions per query row, and its
mirror, [q_lo, q_hi) of query positions per key row). A block of query rows against key rows
is then NONE (no pair visible: nothing computed), FULL (every pair: no mask) or PARTIAL (the
mask applies). Pure Python and torch; no kernels, no distributed code.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch


class Visibility(enum.Enum):
    NONE = 0  # no query sees any key: nothing to compute
    FULL = 1  # every query sees every key: no mask
    PARTIAL = 2  # the mask applies


@dataclass(frozen=True)
class Window:
    """Query position qp sees key position kp iff qp - left <= kp <= qp + right; None is
    unbounded on that side. Window() is full attention, Window(None, 0) causal."""

    left: int | None = None
    right: int | None = None

    @property
    def is_full(self) -> bool:
        return self.left is None and self.right is None


FULL = Window()
CAUSAL = Window(None, 0)


def window_of_args(left: int, right: int) -> Window:
    """The operators' two ints (-1: unbounded on that side) as a Window (ops.window_args' inverse)."""
    return Window(None if left < 0 else left, None if right < 0 else right)


def window_from(causal: bool, window_size, api: str) -> Window:
    """flash-attn's (causal, window_size=(left, right)) as a Window: -1 is unbounded; causal
    means right = 0, so with causal=True right must be -1 or 0."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    ):
        raise ValueError(f"{api}: window_size must be a pair of ints >= -1 (left, right), got {window_size!r}")
    left, right = (None if w == -1 else w for w in window_size)
    if causal:
        if right not in (None, 0):
            raise ValueError(
                f"{api}: causal=True means window_size's right is 0; got window_size={tuple(window_size)} "
                "(use causal=False for a window that reaches into the future)"
            )
        right = 0
    return Window(left, right)


def block_visibility(q_start: int, n_q: int, k_start: int, n_k: int, window: Window) -> Visibility:
    """Query positions [q_start, q_start + n_q) against key positions [k_start, k_start + n_k)."""
    if n_q <= 0 or n_k <= 0:
        return Visibility.NONE
    if window.is_full:
        return Visibility.FULL
    q_last, k_last = q_start + n_q - 1, k_start + n_k - 1
    left = float("inf") if window.left is None else window.left
    right = float("inf") if window.right is None else window.right
    if k_start > q_last + right or k_last < q_start - left:
        return Visibility.NONE
    if k_last <= q_start + right and k_start >= q_last - left:
        return Visibility.FULL
    return Visibility.PARTIAL


KEY_ORDER_BLOCK = 128  # RowBounds.key_order's key blocks: the fused backward's (ws2: 128 keys a program)
KEY_ORDER_ROWS = 64  # ... priced by the query blocks of this many rows their hull spans


class RowBounds(NamedTuple):
    """Per-row visible intervals, int32, in global positions of the other side, half-open:
    query row i sees key positions [k_lo[i], k_hi[i]); key row j is seen by query positions
    [q_lo[j], q_hi[j]). An empty row has lo == hi (at its document's start). The kernels
    subtract a block's start position and clip to the block. Counted on the host when the bounds
    were built (on_device), else None: keys_per_row, the mean number of keys a query row sees
    (times the rows: the block's visible pairs); keys_per_seeing_row, the same mean over the rows
    that see a key. The kernels choose a tile shape by one of them (configs.GLUON_DOCUMENTS_SEEING_ROWS).
    key_order (None, or where on_device was asked for it): the key blocks of KEY_ORDER_BLOCK
    keys, most query blocks first (int32 on the bounds' device, a permutation of
    range(ceil(len(q_lo) / KEY_ORDER_BLOCK)): key_block_order), for persistent programs that
    take the heaviest blocks first."""

    k_lo: torch.Tensor
    k_hi: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    keys_per_row: float | None = None
    keys_per_seeing_row: float | None = None
    key_order: torch.Tensor | None = None

    def on_device(self, device, key_order: bool = False) -> RowBounds:
        """These bounds (host tensors) on `device`, with keys_per_row and keys_per_seeing_row
        (and with key_order, the key_order) counted here; on a GPU the copies come from pinned
        memory and do not wait for the device's queue."""
        seen = (self.k_hi - self.k_lo).double()
        pairs, seeing = float(seen.sum()), int((seen > 0).sum())
        device = torch.device(device)
        if device.type == "cuda":
            move = lambda t: t.pin_memory().to(device, non_blocking=True)  # noqa: E731
        else:
            move = lambda t: t.to(device)  # noqa: E731
        return RowBounds(
            *(move(t) for t in self[:4]),
            keys_per_row=pairs / len(seen) if len(seen) else 0.0,
            keys_per_seeing_row=pairs / seeing if seeing else 0.0,
            key_order=move(key_block_order(self.q_lo, self.q_hi)) if key_order else None,
        )


def key_block_order(q_lo: torch.Tensor, q_hi: torch.Tensor) -> torch.Tensor:
    """The key blocks of KEY_ORDER_BLOCK keys ordered by key_block_spans, most first, ties and
    blocks that no query sees in key order: int32 (ceil(len(q_lo) / KEY_ORDER_BLOCK),). A
    persistent launch handing its blocks out in this order starts the longest programs first,
    instead of ending on one (a window's blocks at a piece's end see the most rows)."""
    return torch.sort(key_block_spans(q_lo, q_hi), descending=True, stable=True).indices.to(torch.int32)


def key_block_spans(q_lo: torch.Tensor, q_hi: torch.Tensor) -> torch.Tensor:
    """Per key block of KEY_ORDER_BLOCK keys (the last may be shorter), how many query blocks of
    KEY_ORDER_ROWS rows the hull of its keys' [q_lo, q_hi) spans (0: no query sees it): int64."""
    n = len(q_lo)
    blocks = -(-n // KEY_ORDER_BLOCK)
    seen = q_hi > q_lo
    far = 2**62  # unseen keys and the padding of the last block widen no hull
    first = torch.where(seen, q_lo.to(torch.int64), far)
    last = torch.where(seen, q_hi.to(torch.int64), -far)
    pad = torch.full((blocks * KEY_ORDER_BLOCK - n,), far, dtype=torch.int64)
    first = torch.cat([first, pad]).view(blocks, KEY_ORDER_BLOCK).amin(1)
    last = torch.cat([last, -pad]).view(blocks, KEY_ORDER_BLOCK).amax(1)
    return torch.where(last > first, (last + KEY_ORDER_ROWS - 1) // KEY_ORDER_ROWS - first // KEY_ORDER_ROWS, 0)


@dataclass(frozen=True)
class BlockMask:
    """Where a block of query rows and key rows sits and which of its pairs are visible:
    q_start / k_start, the global positions of its first query and key rows; window; and for
    packed documents `bounds` (RowBounds, its query rows' k_lo / k_hi and key rows' q_lo / q_hi
    arrays, which then decide alone)."""

    q_start: int = 0
    k_start: int = 0
    window: Window = FULL
    bounds: RowBounds | None = None

    def visibility(self, n_q: int, n_k: int) -> Visibility:
        if n_q <= 0 or n_k <= 0:
            return Visibility.NONE
        if self.bounds is not None:
            return Visibility.PARTIAL
        return block_visibility(self.q_start, n_q, self.k_start, n_k, self.window)


def local_offsets(seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(q_start, k_start) for one device's attention, aligned bottom-right as flash-attn does:
    query i sits at position i + seqlen_k - seqlen_q of the keys."""
    return seqlen_k - seqlen_q, 0


def document_bounds(cu_q: torch.Tensor, cu_k: torch.Tensor, window: Window) -> RowBounds:
    """The RowBounds of packed documents: document d holds query rows cu_q[d]:cu_q[d+1] and key
    rows cu_k[d]:cu_k[d+1], each query sees only its document's keys, with the window aligned
    bottom-right per document (query row i of document d sits at key position
    i + cu_k[d+1] - cu_q[d+1]). cu_q, cu_k: int (n_docs + 1,) on the device of the result."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q_rows = torch.arange(total_q, device=cu_q.device)
    k_rows = torch.arange(total_k, device=cu_k.device)
    # the document of each row (empty documents hold no row, so any tie-break is right)
    doc_q = torch.searchsorted(cu_q, q_rows, right=True) - 1
    doc_k = torch.searchsorted(cu_k, k_rows, right=True) - 1
    offset = cu_k[1:] - cu_q[1:]  # key position of query row i = i + offset[doc]
    q_pos = q_rows + offset[doc_q]
    k_lo, k_hi = cu_k[doc_q], cu_k[doc_q + 1]
    if window.left is not None:
        k_lo = torch.maximum(k_lo, q_pos - window.left)
    if window.right is not None:
        k_hi = torch.minimum(k_hi, q_pos + window.right + 1)
    k_lo = torch.minimum(k_lo, k_hi.clamp(min=cu_k[doc_q]))  # an empty row: lo == hi
    k_hi = torch.maximum(k_hi, k_lo)
    # mirror: key row j (document d) is seen by query rows i with i + offset - left <= j <= i + offset + right
    q_lo, q_hi = cu_q[doc_k], cu_q[doc_k + 1]
    if window.right is not None:
        q_lo = torch.maximum(q_lo, k_rows - offset[doc_k] - window.right)
    if window.left is not None:
        q_hi = torch.minimum(q_hi, k_rows - offset[doc_k] + window.left + 1)
    q_lo = torch.minimum(q_lo, q_hi.clamp(min=cu_q[doc_k]))
    q_hi = torch.maximum(q_hi, q_lo)
    return RowBounds(*(t.to(torch.int32) for t in (k_lo, k_hi, q_lo, q_hi)))


@functools.lru_cache(maxsize=8)
def packed_bounds(values_q: tuple, values_k: tuple, window: Window, device: torch.device) -> RowBounds:
    """document_bounds of the documents whose boundaries are values_q / values_k (tuples of
    ints, as check_cu_seqlens returns them), built on the host and copied to `device`
    (RowBounds.on_device: with keys_per_row). Cached by those values: the layers of a model
    over one packed batch, and each forward's backward, build them once (a few int32 per row,
    16 bytes per token; the last 8 kept)."""
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return document_bounds(as_tensor(values_q), as_tensor(values_k), window).on_device(device)


def held_bounds(q_pos: torch.Tensor, k_pos: torch.Tensor, n_k: int, cu: torch.Tensor, window: Window) -> RowBounds:
    """The RowBounds, in local row indices, of query rows at global positions q_pos against
    key rows at k_pos of the same packed documents (self-attention: one cu, the document
    boundaries, int64). q_pos, k_pos: int64, ascending (a layout's local order), which makes
    each row's visible rows of the other side one interval: the ones whose positions lie in
    its document and window. n_k >= len(k_pos): key rows past k_pos (padding) are seen by none.
    A row that sees nothing gets lo == hi where its document's rows would be, and a padding
    row the last key row's hi: neither widens the range a tile of the kernels loops over."""

    def interval(pos, other, before, after):
        # the positions [pos - before, pos + after] of pos's document, as indices into other
        doc = torch.searchsorted(cu, pos, right=True) - 1
        lo_pos, hi_pos = cu[doc], cu[doc + 1]
        if before is not None:
            lo_pos = torch.maximum(lo_pos, pos - before)
        if after is not None:
            hi_pos = torch.minimum(hi_pos, pos + after + 1)
        lo = torch.searchsorted(other, lo_pos)
        hi = torch.maximum(torch.searchsorted(other, hi_pos), lo)
        return lo, hi

    k_lo, k_hi = interval(q_pos, k_pos, window.left, window.right)
    q_lo, q_hi = interval(k_pos, q_pos, window.right, window.left)
    pad = torch.full((n_k - len(k_pos),), int(q_hi[-1]) if len(k_pos) else 0, dtype=torch.int64)
    q_lo, q_hi = torch.cat([q_lo, pad]), torch.cat([q_hi, pad])
    return RowBounds(*(t.to(torch.int32) for t in (k_lo, k_hi, q_lo, q_hi)))
