"""Balanced layouts of packed documents over the ranks of a ring (pure: no communication).

A packing user has one long row of documents (cu_seqlens) to shard over P ranks. The layout is
computed identically on every rank from the global cu_seqlens. Documents are dealt most work
(visible pairs) first; one that fits on the least loaded rank within BALANCE_SLACK of an equal
share stays whole there: its pairs are all computed at ring step 0 and none of its keys ever
needs to travel. Once some document is cut over every rank (every shard then travels around
the whole ring anyway), whole documents are kept only as far as step 0 stays within
BALANCE_SLACK of its own mean (balanced_layout deals again, up to STEP0_DEALS times): step 0 is
about 1/P of the work, so the slack of a share could otherwise leave it up to P x 2% uneven.
Any other document is cut, so that the ring steps stay even:

- a window with an unbounded side (causal; (-1, w) or (w, -1) without causality): the zigzag
  of the document over all P ranks (2P chunks, rank r holding chunks r and 2P-1-r, the ring
  turned for each cut document: causal, to the offset that evens the kernels' programs over
  the ranks; otherwise one rank further per document): every ring step carries an equal part
  of it, up to the one-token chunk granularity, and for a bounded side w > 0 one
  T(w) = w(w+1)/2 neighbour pair that one rank lacks at steps 1 and P - 1 (turned one rank
  per document, these differ by at most one pair) (_place_cut);
- full attention: P contiguous pieces (every pair visible: every step even), turned alike;
- a window bounded on both sides: pieces of at least m = max(left, right, 1) tokens, so each
  query's keys are in its own piece or a neighbour's and the ring needs steps 0, 1 and (with
  right > 0) P - 1 only, as few as the window allows. Each pair of neighbouring pieces adds
  exactly T(left) pairs at step 1 and T(right) at step P - 1 whatever their lengths, so the
  lengths are free to even out step 0. A document of n >= (P + 1) m tokens goes around the
  whole ring (P + 1 pieces, its head and its tail on one rank): every rank gets one neighbour
  pair at each of those steps, and the document alone is even at every step. A shorter one
  goes to k < P consecutive ranks (or stays whole: below 2m tokens it cannot be cut), and k - 1
  of them get a neighbour pair: no single rotation can make that even, since the first piece
  has no left neighbour; the offsets chosen per document spread these pairs over several
  documents, so steps 1 and P - 1 differ between ranks by whole neighbour pairs, at most one
  per such document. Then the deal is polished move by move (_polished): boundaries moved,
  whole documents moved or cut in two, a document's first and last pieces free to be shorter
  than m (nothing lies beyond them), each move taken only where it shortens the ring's compute
  time and gives no work to a step that had none. Where a rank's share is only a few windows
  long, window-long pieces are too coarse (a document under 2m tokens stays whole, about a
  rank's share of work): with MAX_REACH > 1 (off by default: the extra steps' calls cost more
  on a GPU than the evener steps save) pieces of m / 2 or m / 3 tokens are dealt and polished
  too, a query then reaching 2 or 3 pieces away (steps 0 to 3 and P - 3 to P - 1), and the
  layout whose compute time, each step with work priced at its fixed cost
  (STEP_KEYS_PER_ROW), is least is kept (_bounded_deal).

No length needs to divide by anything: shard sizes may differ between ranks. Each rank's
local tensor holds its pieces in global order.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ._checks import check_bool
from .masks import RowBounds, Window, held_bounds, window_from, window_of_args
from .schedule import BlockTask, Segment, check_divisible, check_layout, segments, step_tasks, steps_needed

BALANCE_SLACK = 0.02  # how far above an equal share of the work a whole document may leave a rank
STEP0_DEALS = 8  # at most this many deals again for an even step 0 (balanced_layout)
# A bounded window's pieces may be shorter than the window (a query's keys then up to `reach`
# pieces away, one more ring step each way a reach) where window-long pieces are too coarse to
# even the steps: balanced_layout tries reaches 1 to MAX_REACH (_bounded_deal). 1 by default:
# one H200 (benchmarks.packed_ring_replay --totals 32768 --worlds 8 --window 4096 --kv-heads 8
# --kernels --max-reach 1 3), reach 3 took the busiest rank's ring steps from 3.01 to 2.95 ms of
# device time but the mean rank's from 1.68 to 2.55 (two more steps' calls a rank), the ranks in
# lockstep 3.03 -> 3.32 ms and the busiest rank's host-clock time 4.87 -> 5.93 ms; 64K unchanged
MAX_REACH = 1
SHORT_SHARE_WINDOWS = 4  # ... where a rank's share is under this many windows (m tokens)
# What a ring step with work costs besides its pairs, in a rank's own pairs per query row it
# holds: its kernel calls' fixed part (launches, and programs over every row, most of which
# see nothing of a neighbour's block). Fit on one H200 (benchmarks.packed_ring_replay --kernels,
# 128K tokens, P = 8, 4K window, H = 32 / 8 kv heads, D = 128, forward + backward): 0.38 ms a
# neighbour's step besides its pairs, 16K rows a rank, 0.11-0.12 ms per million own pairs
STEP_KEYS_PER_ROW = 200
POLISH_MOVES = 24  # at most this many moves improve a bounded window's deal (_polished)
POLISH_WHOLE = 8  # a polishing round tries to move this many whole documents of the busiest ranks (_polished)
# _polished prices a pair of a neighbour's block at this many of a rank's own: a neighbour's block
# is a call of its own, mostly of rows that see few of its keys (1.0: pairs alike)
NEIGHBOUR_PAIR_COST = 1.0
# A ring step's block tasks over packed documents run as they are (kernel calls of their own)
# when they average this much work, visible pairs x q heads x head dim, else as one call over
# per-row bounds (BalancedLayout.step_plan). Never, since the per-row-bounds call has the Gluon
# forward and the fused backward: on one H200 (benchmarks.packed_ring_replay
# --own-call-work-log2 36 inf, long-tailed documents, H=32, D=128), one call per step was faster
# than own calls from 2^36 at every size measured: 512K, P = 2 / 4 / 8, mean rank -2.3 / -2.3 /
# -2.1%; a causal window of 4096 with 8 kv heads -10 / -9 / -12%; 128K within +-3%. Own calls
# had won at 33M-58M pairs per task with the two Triton passes and the Triton forward there.
OWN_CALL_WORK = float("inf")
# A ring step's per-row-bounds call (BalancedLayout.step_plan) over only the rows and keys that
# see each other, their box widened to CROP_ALIGN rows (whole blocks of the fused backward's
# blocked dQ, whole key tiles), at steps other than 0: a neighbour's block under a bounded window
# is seen by a window's rows at each of a rank's piece starts, and the kernels launch programs
# over every row and key given them. Off until timed on a GPU (benchmarks.packed_ring_replay
# --crop-step-calls 0 1): it also moves the kernels' tile choice, which counts keys per row of
# the call (RowBounds.keys_per_row).
CROP_STEP_CALLS = False
CROP_ALIGN = 128
# A ring over packed documents whose steps (schedule.ring_steps, step 0 counted) number from 2
# to this many computes each rank's attention in one call once every block it needs has come
# (BalancedLayout.gather_plan, ring._gathered_kv): no call per step, no float32 state, no merge.
# It gives up the overlap of the blocks' transfers with the steps' compute and holds every block
# it reaches at once (with their float32 dK / dV in the backward): 2 fits a bounded window at
# reach 1 (two shards). 0: never. Off until timed on a ring: on one H100 the compute alone of
# such a call (benchmarks/merged_keys.py: 128K tokens, P = 8, 32 / 8 heads, D = 128) was
# 0.83-0.88x a rank's ring steps under a 4K window, 0.75-0.77x for causal documents.
GATHER_MAX_STEPS = 0
# A packed ring's forward takes the blocks of its steps after step 0 in calls over this many at
# once (gathered in global order, BalancedLayout.gather_plan), folding into the float32 state
# once a call instead of once a step: a step's query tiles each walk few key blocks, so the
# fixed cost a tile (its Q and state loads, its state stores) weighs there
# (benchmarks/packed_ring_tiles.py's forward model). Step 0's own block goes alone, so that
# the first hops arrive while it computes; a call waits for the last block of its run, and
# holds that many blocks at once. 1: a call a step. The backward keeps a call a step. Off: on one
# H100 (replayed P = 8, 128K causal documents) runs of four cut a rank's forward 17% by device
# time, but ring._ring_kv starts each hop only when the next block is asked for, so a run's call
# would wait for its hops about as long as it saves (benchmarks/NOTES.md, item 43).
FORWARD_GROUP_STEPS = 1
CODE_PREFIX = "balanced:"  # BalancedLayout.code: the layout as the ring operators' layout string


def gather_runs(steps) -> list[tuple[int, ...]]:
    """The one rule for which of a packed ring's steps (schedule.ring_steps, ascending from 0)
    compute in one call over their blocks gathered in global order: consecutive runs covering
    them in ring order. From 2 to GATHER_MAX_STEPS steps: one run of all of them (the whole ring
    in one call each way, the backward gathered too: no float32 state, no merge); else, with
    FORWARD_GROUP_STEPS from 2, step 0 alone and then runs of that many (the forward's calls,
    each folded into the state once; the backward keeps a call a step); else a run a step.
    Pure: every rank, the forward and the backward decide alike."""
    steps = tuple(steps)
    if 1 < len(steps) <= GATHER_MAX_STEPS:
        return [steps]
    if not steps:
        return []
    size = max(FORWARD_GROUP_STEPS, 1)
    return [steps[:1]] + [steps[i : i + size] for i in range(1, len(steps), size)]


def _document_work(n: int, window: Window) -> int:
    """Visible (query, key) pairs of one self-attention document of n tokens."""
    return _pairs(0, n, 0, n, window)


def pad_rows(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """x with zero rows appended along dim (>= 0) up to n rows; x itself when it has n."""
    extra = n - x.shape[dim]
    if extra < 0:
        raise ValueError(f"pad_rows: x has {x.shape[dim]} rows on dim {dim}, more than the {n} to pad to")
    return x if extra == 0 else torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, extra])


class StepPlan(NamedTuple):
    """A rank's ring step over packed documents (BalancedLayout.step_plan): block tasks with
    position masks, or (bounds not None) one call over the query rows and key rows of `box`
    (a BlockTask) with `bounds`, its per-row intervals in the box's own indices."""

    tasks: tuple[BlockTask, ...]
    bounds: RowBounds | None
    box: BlockTask | None


class GatherPlan(NamedTuple):
    """A rank's ring over packed documents computed in one call (BalancedLayout.gather_plan):
    the blocks of the ring's steps gathered into `keys` rows in global order, rows[i] (int64 on
    the device) where step i's block's real rows go, and `bounds` the RowBounds of the rank's
    query rows against them (the key blocks in the grid's order)."""

    rows: tuple[torch.Tensor, ...]
    bounds: RowBounds
    keys: int


def _cropped(b: RowBounds, box: BlockTask) -> tuple[RowBounds, BlockTask]:
    """Bounds b of every query row against every key row of `box` (block starts 0), cut to the
    query rows that see a key and the key rows some query sees, the box widened to CROP_ALIGN
    rows on each side (within its rows): the bounds rebased to the new box, each row's interval
    within it (a row that sees nothing keeps lo == hi). Unchanged where nothing is seen."""
    rows, keys = (b.k_hi > b.k_lo).nonzero().flatten(), (b.q_hi > b.q_lo).nonzero().flatten()
    if not len(rows):
        return b, box

    def widened(first: int, last: int, n: int) -> tuple[int, int]:
        return first // CROP_ALIGN * CROP_ALIGN, min(n, -(-(last + 1) // CROP_ALIGN) * CROP_ALIGN)

    r0, r1 = widened(int(rows[0]), int(rows[-1]), box.q_rows.stop)
    k0, k1 = widened(int(keys[0]), int(keys[-1]), box.kv_rows.stop)
    k_lo, k_hi = ((t[r0:r1] - k0).clamp(0, k1 - k0) for t in (b.k_lo, b.k_hi))
    q_lo, q_hi = ((t[k0:k1] - r0).clamp(0, r1 - r0) for t in (b.q_lo, b.q_hi))
    return RowBounds(k_lo, k_hi, q_lo, q_hi), BlockTask(slice(r0, r1), slice(k0, k1), 0, 0, True)


@dataclass(frozen=True)
class BalancedLayout:
    """Which global token positions each rank of a `world`-rank ring holds, for documents
    `cu_seqlens` (the global boundaries, a tuple). Made by balanced_layout(); accepted by
    shard, unshard, local_positions and ring_flash_attn_varlen_func wherever "zigzag" is."""

    cu_seqlens: tuple[int, ...]
    world: int
    window: Window
    pieces: tuple[tuple[Segment, ...], ...]  # per rank, in local order; Segment.doc: the document
    # made once by __post_init__, so that code traced by torch.compile reads them as constants
    code: str = field(init=False, repr=False, compare=False)
    _digest: int = field(init=False, repr=False, compare=False)
    _local_lens: tuple = field(init=False, repr=False, compare=False)  # each rank's rows: every call asks
    _held: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # step_plan's

    def __post_init__(self):
        self._check_pieces()
        object.__setattr__(self, "_local_lens", tuple(sum(s.length for s in segs) for segs in self.pieces))
        window = [-1 if w is None else w for w in (self.window.left, self.window.right)]
        runs = [[[s.global_start, s.length, s.doc] for s in segs] for segs in self.pieces]
        code = CODE_PREFIX + json.dumps([list(self.cu_seqlens), self.world, window, runs], separators=(",", ":"))
        object.__setattr__(self, "code", code)
        text = repr((self.cu_seqlens, self.world, self.pieces)).encode()
        object.__setattr__(self, "_digest", int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2)

    def _check_pieces(self) -> None:
        """A layout built by hand must be one: documents from 0, one tuple of pieces per rank,
        each piece non-empty, inside its document and after the rank's previous piece in its
        local rows, and every token held by exactly one rank (else a ring call would compute on
        rows nobody holds, and unshard return memory nobody wrote)."""
        api, cu = "BalancedLayout", self.cu_seqlens
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{api}: cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}")
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"{api}: world must be a positive int, got {self.world!r}")
        if len(self.pieces) != self.world:
            raise ValueError(f"{api}: pieces must hold one tuple per rank ({self.world}), got {len(self.pieces)}")
        held = []
        for rank, segs in enumerate(self.pieces):
            local = 0
            for seg in segs:
                a, b = seg.global_start, seg.global_start + seg.length
                if seg.length <= 0 or seg.local_start != local:
                    raise ValueError(
                        f"{api}: rank {rank}'s piece [{a}:{b}] must be non-empty and start at local row {local}, "
                        f"got length {seg.length} at local row {seg.local_start}"
                    )
                if not (0 <= seg.doc < len(cu) - 1 and cu[seg.doc] <= a and b <= cu[seg.doc + 1]):
                    raise ValueError(f"{api}: rank {rank}'s piece [{a}:{b}] is not inside its document {seg.doc}")
                held.append((a, b))
                local += seg.length
        at = 0
        for a, b in [*sorted(held), (cu[-1], cu[-1])]:  # the end: tokens after the last piece
            if a != at:
                what = f"token {a} by two ranks" if a < at else f"tokens [{at}:{a}] by no rank"
                raise ValueError(f"{api}: every token must be held by exactly one rank, got {what}")
            at = b

    def __getstate__(self):  # pickled and copied without step_plan's device tensors
        return {**self.__dict__, "_held": {}}

    @property
    def total(self) -> int:
        return self.cu_seqlens[-1]

    def _in_range(self, value, name: str, api: str) -> int:
        """value (a rank or a ring step), checked: an int in [0, world) (not Python's negative
        indices)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.world:
            raise ValueError(f"BalancedLayout.{api}: {name} must be in [0, {self.world}), got {value!r}")
        return value

    def segments(self, rank: int) -> list[Segment]:
        return list(self.pieces[self._in_range(rank, "rank", "segments")])

    def local_len(self, rank: int) -> int:
        return self._local_lens[self._in_range(rank, "rank", "local_len")]

    @property
    def max_local_len(self) -> int:
        return max(self._local_lens)

    def block_len(self, rank: int, window: Window | None = None) -> int:
        """Rows of `rank`'s K/V block in a ring call under `window` (the call's mask; default the
        layout's own): the longest shard's when blocks travel (they go padded to it, so that
        every receive buffer fits every block), else its own; the longest shard's under
        torch.compile too, whose graph cannot read the cached hops (the padding rows' gradients
        are dropped by the pad's backward). A call may take a wider mask than the layout was
        balanced for, and then its blocks may travel where the layout's own would not."""
        if torch.compiler.is_compiling() or self.hops_under(window) > 1:
            return self.max_local_len
        return self.local_len(rank)

    def pad_block(self, t: torch.Tensor, rank: int, dim: int = 0, window: Window | None = None) -> torch.Tensor:
        """`rank`'s K or V shard t (its local_len(rank) rows along dim) padded to
        block_len(rank, window) (pad_rows: no copy where nothing is added, as with every
        document whole)."""
        return pad_rows(t, self.block_len(rank, window), dim)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """int64 (local_len(rank),): the global positions `rank` holds, in local order."""
        segs = self.pieces[self._in_range(rank, "rank", "positions")]
        if not segs:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat([torch.arange(s.global_start, s.global_start + s.length, device=device) for s in segs])

    def document_positions(self, global_positions: torch.Tensor) -> torch.Tensor:
        """Each token's position within its own document (0 at the document's first token), for
        int global positions such as positions(rank) or local_positions(..., layout=self):
        what RoPE and position embeddings take when packing restarts them at every document.
        Same shape and device; no communication."""
        if not isinstance(global_positions, torch.Tensor) or global_positions.is_floating_point():
            raise TypeError(f"BalancedLayout.document_positions: global_positions must be an int tensor, "
                            f"got {getattr(global_positions, 'dtype', type(global_positions).__name__)}")  # fmt: skip
        pos = global_positions.long()
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= self.total):
            raise ValueError(f"BalancedLayout.document_positions: positions must lie in [0, {self.total})")
        cu = torch.tensor(self.cu_seqlens, dtype=torch.long, device=pos.device)
        return pos - cu[torch.searchsorted(cu, pos, right=True) - 1]

    def fingerprint(self) -> int:
        """A 62-bit digest of (cu_seqlens, world, pieces): ranks compare it to agree on the layout."""
        return self._digest

    def work(self, rank: int, step: int) -> int:
        """Visible pairs `rank` computes at ring step `step` (it then holds the keys of rank
        (rank - step) mod world): the balance this layout is built for."""
        self._in_range(rank, "rank", "work")
        self._in_range(step, "step", "work")
        return self._pairs_at(rank, (rank - step) % self.world, self.window)

    def _pairs_at(self, rank: int, src: int, window: Window) -> int:
        pairs = 0
        for qs in self.pieces[rank]:
            for ks in self.pieces[src]:
                if ks.doc == qs.doc:
                    pairs += _pairs(qs.global_start, qs.length, ks.global_start, ks.length, window)
        return pairs

    def step_plan(self, rank: int, step: int, window: Window, n_k: int, device, pair_work: int) -> StepPlan:
        """How `rank` computes ring step `step`, when it holds rank (rank - step) mod world's
        shard padded to n_k rows, with the call's `window` per document: a StepPlan.

        When the step's block tasks (schedule.step_tasks: a pair of pieces of one document
        each, window masks by position) average at least OWN_CALL_WORK (visible pairs x
        pair_work, pair_work being q heads x head dim): those tasks, bounds and box None, the
        fastest kernels on large pieces. Otherwise no tasks and one call over the rows and keys
        of `box` (every row and key, or with CROP_STEP_CALLS at steps other than 0 those that
        see each other, _cropped), `bounds` its masks.RowBounds in the box's own row indices
        (block start 0): many small pieces would each pay a launch. No tasks and bounds None:
        no row sees a key. Kept on the layout per (rank, step, window, n_k, device, pair_work):
        a model's layers and the backward build it once (16 bytes per row)."""
        src = (rank - step) % self.world
        key = (rank, src, window, n_k, str(device), pair_work, OWN_CALL_WORK, CROP_STEP_CALLS)
        if key not in self._held:
            tasks = step_tasks(self, rank, self.world, step, 0, 0, window)
            if not tasks or self._pairs_at(rank, src, window) * pair_work >= OWN_CALL_WORK * len(tasks):
                self._held[key] = StepPlan(tuple(tasks), None, None)
            else:
                cu = torch.tensor(self.cu_seqlens, dtype=torch.int64)
                b = held_bounds(self.positions(rank), self.positions(src), n_k, cu, window)
                box = BlockTask(slice(0, self.local_len(rank)), slice(0, n_k), 0, 0, True)
                if CROP_STEP_CALLS and src != rank:
                    b, box = _cropped(b, box)
                # its key blocks most query blocks first (RowBounds.key_order): a neighbour's
                # block under a window is seen by few of its key blocks, each by a window of rows
                self._held[key] = StepPlan((), b.on_device(device, key_order=True), box)
        return self._held[key]

    def gather_plan(self, rank: int, steps: tuple[int, ...], window: Window, device) -> GatherPlan:
        """How `rank` computes a ring of `steps` (schedule.ring_steps) in one call with the
        call's `window`: a GatherPlan over the real rows of the blocks its steps hold (rank
        (rank - step) mod world's at each step). Every key a query row sees is in one of those
        blocks, so in global order a row's visible keys are one interval (masks.held_bounds).
        The key blocks keep the grid's order: in a call of a whole rank's keys that order was
        the faster one (benchmarks/NOTES.md, "One call over every key a rank needs"). Kept on
        the layout like step_plan's."""
        key = ("gather", rank, tuple(steps), window, str(device))
        if key not in self._held:
            held = [self.positions((rank - step) % self.world) for step in steps]
            keys = torch.sort(torch.cat(held)).values
            cu = torch.tensor(self.cu_seqlens, dtype=torch.int64)
            bounds = held_bounds(self.positions(rank), keys, len(keys), cu, window)
            rows = tuple(torch.searchsorted(keys, p).to(device) for p in held)
            self._held[key] = GatherPlan(rows, bounds.on_device(device), len(keys))
        return self._held[key]

    def head_pieces(self, rank: int, U: int) -> BalancedLayout:
        """With a head group of U ranks (hybrid parallelism): how rank `rank`'s shard (its
        local_len(rank) rows, as one document) is cut over the head group, as a layout of U
        ranks: U contiguous pieces in head-group rank order, lengths differing by at most one."""
        return _head_pieces(self.local_len(rank), U)

    def head_piece_lens(self, rank: int, U: int) -> tuple[int, ...]:
        """The lengths of head_pieces(rank, U)'s U pieces, by plain arithmetic (torch.compile
        traces it; building a layout it cannot)."""
        return tuple(b - a for a, b in _cuts(0, self.local_len(rank), U))

    @functools.cached_property
    def hops(self) -> int:
        """How many ring steps any rank has work in (1: no K/V ever travels) under the layout's
        own mask, from the schedule; computed once per layout (the layout is frozen)."""
        return steps_needed(self, self.world, 0, 0, self.window)

    def hops_under(self, window: Window | None) -> int:
        """hops for a call under `window` (None: the layout's own mask; schedule.ring_steps
        caches the others)."""
        if window is None or window == self.window:
            return self.hops
        return steps_needed(self, self.world, 0, 0, window)

    def __repr__(self) -> str:
        lines = [f"BalancedLayout({len(self.cu_seqlens) - 1} documents, {self.total} tokens, {self.world} ranks)"]
        for r, segs in enumerate(self.pieces):
            runs = ", ".join(f"[{s.global_start}:{s.global_start + s.length}]" for s in segs[:6])
            more = f", ... ({len(segs)} pieces)" if len(segs) > 6 else ""
            lines.append(f"  rank {r}: {self.local_len(r)} tokens {runs}{more}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def _head_pieces(n: int, U: int) -> BalancedLayout:
    pieces = tuple((Segment(0, a, b - a, 0),) if b > a else () for a, b in _cuts(0, n, U))
    return BalancedLayout((0, n), U, Window(), pieces)


@functools.lru_cache(maxsize=16)
def layout_from_code(code: str) -> BalancedLayout:
    """The BalancedLayout whose .code is `code` (the ring operators carry a layout as this
    string: a torch.library operator takes no Python objects)."""
    cu, world, (left, right), runs = json.loads(code[len(CODE_PREFIX) :])
    pieces = []
    for rank_runs in runs:
        local, segs = 0, []
        for start, n, doc in rank_runs:
            segs.append(Segment(local, start, n, doc))
            local += n
        pieces.append(tuple(segs))
    return BalancedLayout(tuple(cu), world, window_of_args(left, right), tuple(pieces))


def _pairs(q0: int, nq: int, k0: int, nk: int, window: Window) -> int:
    """Visible pairs between query positions [q0, q0 + nq) and key positions [k0, k0 + nk)."""
    if nq <= 0 or nk <= 0:
        return 0
    # (q, k) is visible iff -right <= q - k <= left: the pairs with q - k <= left less those with
    # q - k < -right (an unbounded side: every pair, no pair); 0 for a window with no offset in it
    within_left = nq * nk if window.left is None else _pairs_below(q0, nq, k0, nk, window.left)
    past_right = 0 if window.right is None else _pairs_below(q0, nq, k0, nk, -window.right - 1)
    return max(0, within_left - past_right)


def _pairs_below(q0: int, nq: int, k0: int, nk: int, t: int) -> int:
    """Pairs (q, k) in [q0, q0 + nq) x [k0, k0 + nk) with q - k <= t, in closed form: query q
    counts clamp(k0 + nk + t - q, 0, nk) keys, a difference of two runs of positive parts."""

    # tri(x) = sum of max(0, x - j) over j >= 0 = x (x + 1) / 2 for x > 0, written out: the
    # layouts call this hundreds of thousands of times
    k1, q1 = k0 + nk, q0 + nq
    a, b, c, d = k1 + t - q0, k1 + t - q1, k0 + t - q0, k0 + t - q1
    twice = (a * (a + 1) if a > 0 else 0) - (b * (b + 1) if b > 0 else 0)
    return (twice - (c * (c + 1) if c > 0 else 0) + (d * (d + 1) if d > 0 else 0)) // 2


def _cuts(start: int, n: int, parts: int) -> list[tuple[int, int]]:
    """n tokens from `start` in `parts` contiguous runs whose lengths differ by at most one."""
    bounds = [start + (n * i) // parts for i in range(parts + 1)]
    return list(zip(bounds, bounds[1:]))


def _cut(start: int, n: int, world: int, window: Window, offset: int):
    """A document [start, start + n) cut over all P ranks (a window with an unbounded side), as
    runs (a, b, rank). One side unbounded (causal, or (-1, w) / (w, -1) without causality): the
    zigzag of the document, 2P chunks, rank (r + offset) mod P holding chunks r and 2P-1-r;
    full attention: P contiguous pieces, piece i on rank (i + offset) mod P. Chunk lengths
    differ by at most one token: every ring step is even up to that, at any offset (a rotation
    of the ring)."""
    if (window.left is None) != (window.right is None):
        chunks = _cuts(start, n, 2 * world)
        owned = [(r, c) for r in range(world) for c in (chunks[r], chunks[2 * world - 1 - r])]
    else:
        owned = list(enumerate(_cuts(start, n, world)))
    return [(a, b, (r + offset) % world) for r, (a, b) in owned if b > a]


def _runs_work(runs, world: int, window: Window) -> dict[int, list[int]]:
    """Ring step -> visible pairs of each rank at that step, for one document's runs (a, b,
    rank): the queries of a run on rank r see the keys of a run on rank q at step (r - q) mod P.
    With a bounded window only runs within reach see each other (walking away from a run, the
    first one out of reach ends the walk); with an unbounded side only step 0 is counted (the
    steps of a zigzag or full-attention cut are even already, and only step 0 gets whole
    documents)."""
    runs = sorted(runs)
    out: dict[int, list[int]] = {0: [0] * world}
    bounded = window.left is not None and window.right is not None
    if bounded and all(b - a >= max(window.left, window.right) for a, b, _ in runs):
        # every run at least as long as the window: in closed form, the same counts. A run of
        # x tokens sees itself x (left + right + 1) - T(left) - T(right) times (T(w) = w(w+1)/2:
        # what its edges lack); next to each other, the right run's queries see T(left) of
        # the left one's keys, the left run's queries T(right) of the right one's; no further
        left, right = window.left, window.right
        tl, tr = left * (left + 1) // 2, right * (right + 1) // 2
        for a, b, r in runs:
            out[0][r] += (b - a) * (left + right + 1) - tl - tr
        for (_, _, r), (_, _, q) in zip(runs, runs[1:]):
            for step, rank, pairs in (((q - r) % world, q, tl), ((r - q) % world, r, tr)):
                if pairs:
                    out.setdefault(step, [0] * world)[rank] += pairs
        return out
    if not bounded:  # a run's queries see the runs on its own rank only: O(runs), not O(runs^2)
        own: dict[int, list] = {}
        for run in runs:
            own.setdefault(run[2], []).append(run)
        for qa, qb, qr in runs:
            out[0][qr] += sum(_pairs(qa, qb - qa, ka, kb - ka, window) for ka, kb, _ in own[qr])
        return out
    for j, (qa, qb, qr) in enumerate(runs):
        for order in (range(j, -1, -1), range(j + 1, len(runs))):  # itself and back, then ahead
            for i in order:
                ka, kb, kr = runs[i]
                pairs = _pairs(qa, qb - qa, ka, kb - ka, window)
                if pairs == 0:
                    break
                out.setdefault((qr - kr) % world, [0] * world)[qr] += pairs
    return out


def _fill(level: list[int], fixed: list[int], least: list[int], n: int, c: int) -> list[int]:
    """Token counts x_r >= least[r] summing to n that leave level[r] - fixed[r] + c * x_r (a
    rank's step-0 pairs: c pairs per token, less `fixed` at its pieces' edges) as even as
    possible: water filling, in integers (the remainder, one token each, to the lowest)."""
    k = len(level)
    base = [level[r] - fixed[r] + c * least[r] for r in range(k)]  # each rank at its minimum
    extra = n - sum(least)
    order = sorted(range(k), key=lambda r: (base[r], r))
    acc = 0
    for j, r in enumerate(order):
        acc += base[r]
        top = (c * extra + acc) // (j + 1)  # the level when the j + 1 lowest share `extra`
        if j + 1 == k or top <= base[order[j + 1]]:
            break
    x = list(least)
    for r in order[: j + 1]:
        x[r] += (top - base[r]) // c
    for r in sorted(range(k), key=lambda r: (base[r] + c * (x[r] - least[r]), r))[: n - sum(x)]:
        x[r] += 1
    return x


def _window_cut(start: int, n: int, world: int, window: Window, load, parts: int, offset: int, piece: int):
    """A window bounded on both sides: the document in `parts` pieces on consecutive ranks from
    `offset`, each at least `piece` tokens (m = max(left, right, 1), or m / reach:
    _bounded_deal), lengths evening out step 0 (_fill: its pair counts are exact for pieces of
    at least m, a guide for shorter ones). With parts == P and n >= (P + 1) piece the ring
    closes: P + 1 pieces, the first and the last on one rank, so that every rank holds a piece
    with a left and one with a right neighbour."""
    left, right = window.left, window.right
    ring = parts == world and n >= (world + 1) * piece
    ranks = [(offset + i) % world for i in range(parts)]
    count = [2 if ring and i == parts - 1 else 1 for i in range(parts)]
    edge = left * (left + 1) // 2 + right * (right + 1) // 2  # pairs a piece's edges lack at step 0
    x = _fill([load[0][r] for r in ranks], [c * edge for c in count], [c * piece for c in count], n,
              left + right + 1)  # fmt: skip
    if ring:  # the last rank's share: the document's head, and its tail
        head = x[-1] // 2
        x, ranks = [head, *x[:-1], x[-1] - head], [ranks[-1], *ranks]
    runs, a = [], start
    for length, r in zip(x, ranks):
        runs.append((a, a + length, r))
        a += length
    return runs


def _peak_extras(extra: list[int], n: int) -> list[int]:
    """For each offset o, max over ranks q of extra[q] + n * (P - 1 - (q - o) mod P): the largest
    extra once a document of n tokens is cut at offset o (_place_cut), for every o in O(P), not
    O(P^2). With a[q] = extra[q] - n q, the ranks q >= o give a[q] + n (P - 1 + o) and the ranks
    q < o give a[q] + n (o - 1): suffix and prefix maxima of a."""
    world = len(extra)
    a = [e - n * q for q, e in enumerate(extra)]
    suffix = a[:]
    for q in range(world - 2, -1, -1):
        suffix[q] = max(suffix[q], suffix[q + 1])
    peaks, prefix = [], None  # prefix: max of a over the ranks before o
    for o in range(world):
        peak = suffix[o] + n * (world - 1 + o)
        if prefix is not None:
            peak = max(peak, prefix + n * (o - 1))
        peaks.append(peak)
        prefix = a[o] if prefix is None else max(prefix, a[o])
    return peaks


def _place_cut(
    start: int, n: int, world: int, window: Window, load, least: int, turn: int, extra: list[int], piece: int
):
    """Where a document that does not fit whole goes, as runs (a, b, rank), given the ring
    step loads so far (`load`: step -> visible pairs per rank).

    Zigzag and full attention: cut over every rank (_cut), the ring turned to some offset. The
    pairs of every step are even at any offset, but not the kernels' programs: in a zigzag
    (causal), at a step s > b the rank holding chunks b and 2P-1-b has its queries (the last
    chunks) see two key chunks, twice the backward's programs of the steps s <= b, where two
    query chunks see one key chunk (the forward's programs the other way round). At offset 0
    for every document rank 0 took that at every step and rank P - 1 at none (at 128K over 8
    ranks 1016 against 657 backward programs a kv head, benchmarks.packed_ring_tiles). So a
    causal zigzag takes the offset that leaves the largest `extra` least: each rank's
    (P - 1 - b) x n so far, b its chunk index in each document cut, n the document's tokens
    (ties: the next offset from `turn`, the count of documents cut before); updated in place.
    Any other unbounded side (e.g. window (-1, w) without causality) takes offset `turn`: with
    a bounded side w > 0 the turns spread the zigzag's shortfalls, one rank's last chunk lacking
    a right neighbour (its step-1 share of T(w) = w(w+1)/2 pairs) and one's first chunk the next
    chunk on its own rank (step P - 1), one per rank in turn; full attention (every step even in
    pairs and programs) turns too.

    A window bounded on both sides: its pieces are at least m = max(left, right, 1) tokens, so
    a query's keys are in its own piece or a neighbour's: a piece sees its left neighbour's
    keys one ring step later and its right one's P - 1 steps later, no more steps than the
    window needs. Each pair of neighbouring pieces adds exactly T(left) pairs at step 1 and
    T(right) at step P - 1 (T(w) = w(w+1)/2), whatever the lengths, which are then free to even
    out step 0 (_window_cut). With pieces of `piece` < m tokens (_bounded_deal) a query reaches
    up to ceil(m / piece) pieces away, as many steps each way, and pairs are counted exactly.
    The candidates: whole on rank `least` (a document kept whole never adds a step), and k
    pieces on consecutive ranks from any offset, for k = min(P, n // piece) and k = 2 (fewer
    ranks to carry the minimum); taken: the least ring time after it (sum
    over steps of max_r of the loads), then the least idle at steps >= 1 (sum of P * max_r -
    sum_r: whole documents can only fill step 0), then the candidate's order (pure and
    deterministic)."""
    if window.left is None or window.right is None or world == 1:
        offset = turn % world
        if window.left is None and window.right == 0:  # causal
            peaks = _peak_extras(extra, n)
            offset = min(range(world), key=lambda o: (peaks[o], (o - turn) % world))
            extra[:] = [extra[q] + n * (world - 1 - (q - offset) % world) for q in range(world)]
        return _cut(start, n, world, window, offset)
    top = min(world, n // piece)
    candidates = [[(start, start + n, least)]]
    for parts in sorted({top, 2}, reverse=True):
        if 2 <= parts <= top:
            candidates += [_window_cut(start, n, world, window, load, parts, o, piece) for o in range(world)]
    best = None
    for order, runs in enumerate(candidates):
        time = idle = 0
        work = _runs_work(runs, world, window)
        for step in set(load) | set(work):
            row, add = load.get(step, [0] * world), work.get(step, [0] * world)
            new = [row[r] + add[r] for r in range(world)]
            time += max(new)
            idle += (world * max(new) - sum(new)) if step else 0
        if best is None or (time, idle, order) < best[0]:
            best = ((time, idle, order), runs)
    return best[1]


def _polished(per_rank, world: int, window: Window, piece: int, reach: int, tokens: int):
    """A bounded window's dealt pieces (per rank its Segments), improved move by move; returns (the
    polished Segments per rank, their priced compute time, how many ring steps have work). The deal
    places one document at a time and cuts only into pieces of at least `piece` tokens (m =
    max(left, right, 1), or m / reach: _bounded_deal), which leaves steps uneven by whole
    neighbour pairs (T(left), as much work as m tokens' own) where the window is a fair part of
    a rank's share (a 4K window over 16K-token shares, P = 8: 1.23x an even split). Each round
    tries, for the documents on a rank that is the busiest at some step, every boundary moved by
    +-4^k tokens (a document's first and last pieces may then be shorter than `piece`: nothing
    lies beyond them, so a query still reaches at most `reach` pieces away), the POLISH_WHOLE
    most-work whole documents on such ranks moved to the rank least busy at step 0, or cut in
    two (at 1/2, 1/3, 2/3) onto two neighbouring ranks; it takes the move that lowers the ring's
    compute time (the sum over steps of the busiest rank's pairs) most, ties broken by the sum
    of squares of the loads (evener), up to POLISH_MOVES moves. Each ring step with work is
    priced at _step_price besides its pairs, so a move that gives work to a step that had none
    (a hop of K/V where none travelled) is taken only where it saves more than that, and a
    neighbour's pairs at NEIGHBOUR_PAIR_COST of a rank's own (pure and deterministic)."""
    docs: dict[int, list[tuple[int, int, int]]] = {}
    for r, segs in enumerate(per_rank):
        for s in segs:
            docs.setdefault(s.doc, []).append((s.global_start, s.global_start + s.length, r))
    for runs in docs.values():
        runs.sort()

    def priced(work):  # step -> per-rank pairs, a neighbour's priced at NEIGHBOUR_PAIR_COST
        return {step: row if step == 0 else [x * NEIGHBOUR_PAIR_COST for x in row] for step, row in work.items()}

    work = [priced(_runs_work(runs, world, window)) for runs in docs.values()]
    steps = sorted({s % world for s in range(-reach, reach + 1)})  # where pieces within reach put work
    load = [[sum(w.get(s, [0] * world)[r] for w in work) for r in range(world)] for s in steps]
    even = sum(map(sum, load)) / world  # the ring's compute time split evenly
    # a ring step costs a hop of K/V (mostly hidden behind the step before it) and kernel
    # calls per rank whose fixed part pairs do not count
    price = _step_price(even, tokens, world)

    def time(rows):
        return sum(max(row) for row in rows)

    def score(rows):
        return time(rows) + price * sum(map(any, rows)), sum(x * x for row in rows for x in row)

    def scored(change):
        """score(rows) after the change (step -> (rank, its change) where nonzero), from the
        current one: only the changed ranks are read unless one of them was a step's busiest."""
        spent, squares = best_score
        for i, s in enumerate(steps):
            if s in change:
                row, top, ys = load[i], tops[i], change[s]
                new = [row[r] + y for r, y in ys]
                if any(row[r] == top for r, _ in ys):
                    full = row.copy()
                    for (r, _), x in zip(ys, new):
                        full[r] = x
                    new_top = max(full)
                else:
                    new_top = max(top, *new)
                now_busy = busy[i] - sum(1 for r, _ in ys if row[r]) + sum(1 for x in new if x)
                spent += new_top - top + price * ((now_busy > 0) - (busy[i] > 0))
                squares += sum(y * (2 * row[r] + y) for r, y in ys)
        return spent, squares

    # a move's priced change by (the runs it replaces, their replacement), kept across rounds:
    # a round moves one document, so most of the next round's candidates are the same
    changes: dict[tuple, dict[int, tuple[tuple[int, float], ...]]] = {}

    def change_of(old, new):
        key = (tuple(old), tuple(new))
        if key not in changes:
            dense = priced(_work_change(old, new, world, window))
            sparse = {step: tuple((r, y) for r, y in enumerate(row) if y) for step, row in dense.items()}
            changes[key] = {step: ys for step, ys in sparse.items() if ys}
        return changes[key]

    def moves(runs, busiest):
        """(lo, hi, near, change): runs[lo:hi] replaced by `near` changes the document's
        work by `change` (step -> (rank, its change) where nonzero: change_of)."""
        if len(runs) == 1:
            a, b, r = runs[0]
            spare = min(range(world), key=lambda q: (load[0][q], q))
            cands = [[(a, b, spare)]] if spare != r else []
            for c in sorted({a + (b - a) // 2, a + (b - a) // 3, b - (b - a) // 3} - {a, b}):
                # one part stays on its rank or goes to the least busy one, the other next to it
                for q in sorted({(r - 1) % world, r, (spare - 1) % world, spare}):
                    cands.append([(a, c, q), (c, b, (q + 1) % world)])
            for new in cands:
                yield 0, 1, new, change_of(runs, new)
            return
        for i in range(len(runs) - 1):
            (a, c, r), (_, b, q) = runs[i], runs[i + 1]
            if r not in busiest and q not in busiest:
                continue
            # the runs whose pairs can change: these two and `reach` on each side (a query
            # reaches no further, before the move and after)
            lo, hi = max(0, i - reach), i + 2 + reach
            for k in range(0, (b - a).bit_length(), 2):
                for c2 in (c - (1 << k), c + (1 << k)):
                    if not a <= c2 <= b:
                        continue
                    near = [run for run in (*runs[lo:i], (a, c2, r), (c2, b, q), *runs[i + 2 : hi]) if run[1] > run[0]]
                    last = len(runs) - (hi - lo) + len(near) - 1  # the document's last run after it
                    if all(y - x >= piece for j, (x, y, _) in enumerate(near, lo) if 0 < j < last):
                        yield lo, hi, near, change_of(runs[lo:hi], near)

    def summary():  # each step's busiest rank's load, and how many ranks have work at it
        return [max(row) for row in load], [sum(1 for x in row if x) for row in load]

    best_score = score(load)
    tops, busy = summary()
    for _ in range(POLISH_MOVES):
        if time(load) <= even * (1 + BALANCE_SLACK):
            break
        busiest = {r for row in load if any(row) for r in range(world) if row[r] == max(row)}
        whole = sorted((d for d, runs in docs.items() if len(runs) == 1 and runs[0][2] in busiest),
                       key=lambda d: (-(docs[d][0][1] - docs[d][0][0]), d))[:POLISH_WHOLE]  # fmt: skip
        best = None
        cut = {d for d, runs in docs.items() if len(runs) > 1 and busiest & {r for *_, r in runs}}
        for d in sorted(cut | set(whole)):
            for lo, hi, near, change in moves(docs[d], busiest):
                if any(s not in steps for s in change):
                    continue  # a query would reach past `reach` pieces
                sc = scored(change)
                if sc < best_score and (best is None or sc < best[0]):
                    best = (sc, d, lo, hi, near, change)
        if best is None:
            break
        best_score, d, lo, hi, near, change = best
        docs[d] = [*docs[d][:lo], *near, *docs[d][hi:]]
        for i, s in enumerate(steps):
            for r, y in change.get(s, ()):
                load[i][r] += y
        tops, busy = summary()
    polished: list[list[Segment]] = [[] for _ in range(world)]
    for d, runs in docs.items():
        for a, b, r in runs:
            polished[r].append(Segment(0, a, b - a, d))
    return polished, best_score[0], sum(map(any, load))


def _work_change(old, new, world: int, window: Window) -> dict[int, list[int]]:
    """Ring step -> each rank's change in visible pairs when a document's runs `old` become
    `new` (both runs (a, b, rank) of one document, or the same stretch of it)."""
    change = _runs_work(new, world, window)
    for step, row in _runs_work(old, world, window).items():
        change[step] = [x - y for x, y in zip(change.get(step, [0] * world), row)]
    return change


def checked_cu_seqlens(cu_seqlens, api: str, read=None) -> list[int]:
    """Global document boundaries (a 1-D int tensor or a sequence of ints) as a list of ints,
    checked: starting at 0, non-decreasing. read: how a tensor's values reach the host (a
    function of the tensor giving a sequence of ints; default tolist)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(f"{api}: cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")  # fmt: skip
        if cu_seqlens.is_meta:
            raise ValueError(f"{api}: cu_seqlens is on the meta device, which holds no values")
        cu = [int(x) for x in (cu_seqlens.tolist() if read is None else read(cu_seqlens))]
    else:
        if isinstance(cu_seqlens, (str, bytes)) or not hasattr(cu_seqlens, "__iter__"):
            raise TypeError(
                f"{api}: cu_seqlens must be a 1-D int tensor or a sequence of ints, got {type(cu_seqlens).__name__}"
            )
        cu = list(cu_seqlens)
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
            raise TypeError(f"{api}: cu_seqlens must hold ints, got {cu_seqlens!r}")
    if not cu or cu[0] != 0:
        raise ValueError(f"{api}: cu_seqlens must start at 0, got {cu[:4]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{api}: cu_seqlens must be non-decreasing, got {cu[:8]}...")
    return cu


def _deal(docs, work, world: int, window: Window, step0_cap: float | None = None, piece: int = 1):
    """Documents (doc, start, n) dealt to the ranks, most work first: (per rank its Segments,
    load: ring step -> each rank's visible pairs, how many documents were cut). A document
    stays whole on the rank with the least work if it fits there within BALANCE_SLACK of an
    equal share of all the work (and, given step0_cap, leaves that rank's step-0 pairs at most
    step0_cap), else it is cut (_place_cut; a bounded window's pieces at least `piece`
    tokens)."""
    share = sum(work.values()) / world
    per_rank: list[list[Segment]] = [[] for _ in range(world)]
    load: dict[int, list[int]] = {0: [0] * world}  # ring step -> each rank's visible pairs at it
    total = [0] * world  # each rank's visible pairs over all steps
    tokens = [0] * world
    turn = 0  # documents cut so far
    extra = [0] * world  # the zigzags' extra kernel programs per rank, in tokens x steps (_place_cut)
    # a whole document's pairs are all at step 0: with a bounded window, where steps 1 and P - 1
    # may be uneven by whole neighbour pairs, it goes to the rank with the least step-0 work;
    # otherwise (every later step even) to the one with the least work in total
    bounded = window.left is not None and window.right is not None
    for d, start, n in sorted(docs, key=lambda t: (-work[t[0]], t[1])):
        r = min(range(world), key=lambda i: (load[0][i] if bounded else total[i], total[i], tokens[i], i))
        fits = total[r] + work[d] <= share * (1 + BALANCE_SLACK)
        if world == 1 or (fits and (step0_cap is None or load[0][r] + work[d] <= step0_cap)):
            per_rank[r].append(Segment(0, start, n, d))
            tokens[r] += n
            total[r] += work[d]
            load[0][r] += work[d]
            continue
        runs = _place_cut(start, n, world, window, load, r, turn, extra, piece)
        turn += 1
        for a, b, i in runs:
            per_rank[i].append(Segment(0, a, b - a, d))
            tokens[i] += b - a
            total[i] += _pairs(a, b - a, start, n, window)
        for step, pairs in _runs_work(runs, world, window).items():
            row = load.setdefault(step, [0] * world)
            for i, p in enumerate(pairs):
                row[i] += p
    return per_rank, load, turn


def balanced_layout(cu_seqlens, world: int, *, causal: bool = True, window_size=(-1, -1)) -> BalancedLayout:
    """The balanced layout of packed documents over `world` ranks (module docstring).

    cu_seqlens: the global document boundaries, a 1-D int tensor or a sequence of ints,
    starting at 0, non-decreasing (empty documents allowed). causal / window_size: the masking
    the attention will use (flash-attn semantics per document), which decides the balance.
    Pure and deterministic: every rank computes the same layout from the same arguments.
    """
    cu, window, docs = _layout_args(cu_seqlens, world, causal, window_size, "balanced_layout")
    mask = window  # the layout keeps the call's window; the documents are placed by `placed`
    # A window side at least the longest document bounds nothing in any document: they are
    # placed as the mask they see (a 4K window over documents of at most 4K tokens: causal),
    # since a document shorter than twice a window's side is never cut into window-long pieces
    longest = max((n for _, _, n in docs), default=0)
    window = Window(*(None if w is not None and w >= longest - 1 else w for w in (window.left, window.right)))
    work = {d: _document_work(n, window) for d, _, n in docs}
    if window.left is not None and window.right is not None and world > 1:
        return _assembled(cu, world, mask, _bounded_deal(docs, work, world, window, cu[-1]))
    per_rank, load, cut = _deal(docs, work, world, window)
    if cut:
        # A document cut over every rank sends every shard around the whole ring, so cutting
        # more of them sends nothing more; whole documents put all their work at step 0, where
        # a few large ones leave some ranks busier than the rest (only BALANCE_SLACK of a share
        # of all the work, but up to P times that of step 0's). Deal again, a document staying
        # whole only within BALANCE_SLACK of step 0's mean, a few times; keep the deal whose
        # step 0 exceeds its mean least (later steps are even: that excess is the ring's
        # compute time above an even split).
        def excess(dealt):
            step0 = dealt[1][0]
            return max(step0) - sum(step0) / world

        best = dealt = (per_rank, load, cut)
        for _ in range(STEP0_DEALS):
            mean0 = sum(dealt[1][0]) / world
            if max(dealt[1][0]) <= mean0 * (1 + BALANCE_SLACK):
                break
            dealt = _deal(docs, work, world, window, step0_cap=mean0 * (1 + BALANCE_SLACK))
            if excess(dealt) < excess(best):
                best = dealt
        per_rank, load, cut = best
    return _assembled(cu, world, mask, per_rank)


def _bounded_deal(docs, work, world: int, window: Window, tokens: int) -> list[list[Segment]]:
    """A window bounded on both sides, P > 1: each rank's Segments. Pieces of at least
    ceil(m / reach) tokens (m = max(left, right, 1)), dealt (_deal) and polished (_polished),
    for reach = 1 (window-long pieces: steps 0, 1 and P - 1 only) and, where a rank's share is
    under SHORT_SHARE_WINDOWS windows (m tokens), up to MAX_REACH; kept: the least priced
    compute time (_polished's: each step with work at _step_price), the smaller reach on a tie.
    A larger reach is tried only while the best so far's compute time exceeds an even split by
    more than the price of the steps it would add (one a reach for each bounded side that is
    not 0), and while it shortens the pieces (pure and deterministic)."""
    m = max(window.left, window.right, 1)
    even = sum(work.values()) / world
    price = _step_price(even, tokens, world)
    sides = (window.left > 0) + (window.right > 0)
    top = MAX_REACH if tokens < SHORT_SHARE_WINDOWS * m * world else 1
    best, last_piece = None, None  # best: (priced time, steps with work, reach, segments)
    for reach in range(1, top + 1):
        piece = -(-m // reach)
        if best is not None:
            spent, busy, at, _ = best
            if piece == last_piece or spent - price * busy - even <= price * sides * (reach - at):
                break
        dealt, _, _ = _deal(docs, work, world, window, piece=piece)
        segments, spent, busy = _polished(dealt, world, window, piece, reach, tokens)
        if best is None or spent < best[0]:
            best = (spent, busy, reach, segments)
        last_piece = piece
    return best[3]


def _step_price(even: float, tokens: int, world: int) -> float:
    """What _polished and _bounded_deal add to the ring's compute time (visible pairs) for each
    ring step with work, given the work split evenly (`even` pairs a rank) and `tokens` over
    `world` ranks: STEP_KEYS_PER_ROW pairs a query row of an even share, and at least the slack a
    whole document may leave (BALANCE_SLACK of `even`)."""
    return max(BALANCE_SLACK * even, STEP_KEYS_PER_ROW * tokens / world)


def document_zigzag_layout(cu_seqlens, world: int, *, causal: bool = True, window_size=(-1, -1)) -> BalancedLayout:
    """Every document cut over all `world` ranks, however short, the way context-parallel
    peers shard packed documents (for comparing with balanced_layout: `python -m
    benchmarks.packed_ring_replay --layouts balanced document-zigzag`): with a window that has
    an unbounded side (causal) the zigzag of each document, 2P chunks, rank r holding chunks r
    and 2P-1-r; otherwise P contiguous pieces, piece i on rank i (_cut, the ring never turned).
    Every ring step is even up to one token a chunk, and every shard travels around the whole
    ring. Accepted wherever a balanced_layout is; arguments as balanced_layout's."""
    cu, window, docs = _layout_args(cu_seqlens, world, causal, window_size, "document_zigzag_layout")
    per_rank: list[list[Segment]] = [[] for _ in range(world)]
    for d, start, n in docs:
        for a, b, r in _cut(start, n, world, window, 0):
            per_rank[r].append(Segment(0, a, b - a, d))
    return _assembled(cu, world, window, per_rank)


def _layout_args(cu_seqlens, world, causal, window_size, api: str):
    """A layout function's checked arguments: (cu_seqlens as a list, the masks.Window, the
    non-empty documents as (doc, start, length))."""
    cu = checked_cu_seqlens(cu_seqlens, api)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{api}: world must be a positive int, got {world!r}")
    check_bool("causal", causal, api)
    window = window_from(causal, window_size, api)
    return cu, window, [(d, a, b - a) for d, (a, b) in enumerate(zip(cu, cu[1:])) if b > a]


def _assembled(cu: list[int], world: int, window: Window, per_rank) -> BalancedLayout:
    """The layout of each rank's Segments (any order, local starts ignored): each rank's pieces
    in global order, local starts consecutive."""
    pieces = []
    for segs in per_rank:
        local, placed = 0, []
        for s in sorted(segs, key=lambda s: s.global_start):
            placed.append(Segment(local, s.global_start, s.length, s.doc))
            local += s.length
        pieces.append(tuple(placed))
    return BalancedLayout(tuple(cu), world, window, tuple(pieces))


@functools.lru_cache(maxsize=16)
def named_layout(cu_seqlens: tuple, world: int, name: str, window: Window, parts: int = 1) -> BalancedLayout:
    """A named layout ("zigzag", "contiguous") of packed documents as a BalancedLayout: the
    shards shard(x, layout=name, dim=0) makes of the packed row, cut at the document
    boundaries, for comparing with balanced_layout (documents are cut wherever the shards fall;
    nothing is balanced). The total must split into world x parts shards as `name` requires
    (parts: a head group's U). window: the attention's (masks.Window), for work() and hops."""
    api = "ring_flash_attn_varlen_func"
    check_layout(name, api)
    total = cu_seqlens[-1]
    check_divisible(total, world * parts, name, api, what="packed length (cu_seqlens[-1])")
    docs = [(d, a, b) for d, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:])) if b > a]
    pieces = []
    for rank in range(world):
        placed, at = [], 0
        for seg in segments(name, rank, world, total // world):
            for d, a, b in docs:
                lo, hi = max(a, seg.global_start), min(b, seg.global_start + seg.length)
                if hi > lo:
                    placed.append(Segment(at, lo, hi - lo, d))
                    at += hi - lo
        pieces.append(tuple(placed))
    return BalancedLayout(tuple(cu_seqlens), world, window, tuple(pieces))
