"""Which (query rows, key rows) blocks a rank computes at each ring step. Pure Python.

Layouts are described by segments: each rank's local sequence is a list of contiguous runs
of global positions. At ring step s, rank r holds the keys of rank (r - s) mod P; the block
tasks are every (query segment, key segment) pair some query can see (a Window of positions,
k_pos), with fully visible neighbours coalesced into one kernel call. One ring loop serves
every layout: layouts differ only in their segments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .masks import Visibility, Window, block_visibility

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    local_start: int  # first row in the rank's local tensor
    global_start: int  # its global token position
    length: int
    doc: int = -1  # the packed document it belongs to (balance.BalancedLayout), -1: one sequence


@dataclass(frozen=True)
class BlockTask:
    """Query rows q_rows of the local shard against key rows kv_rows of the held K/V block.

    masked=False: every query sees every key (no mask). masked=True: the call's window
    applies with q_pos = q_start + i, k_pos = k_start + j.
    """

    q_rows: slice
    kv_rows: slice
    q_start: int
    k_start: int
    masked: bool


def is_balanced(layout) -> bool:
    """A balance.BalancedLayout (packed documents), not a layout name."""
    return hasattr(layout, "pieces")


def layout_code(layout) -> int:
    """A layout as one int ranks compare to agree on it: a name's index, or past the names a
    balanced layout's fingerprint."""
    return len(LAYOUTS) + layout.fingerprint() if is_balanced(layout) else LAYOUTS.index(layout)


def show_layout_code(code: int) -> str:
    """layout_code's int, readable (in the message of ranks that disagree)."""
    return LAYOUTS[code] if code < len(LAYOUTS) else f"a balanced layout (fingerprint {code - len(LAYOUTS)})"


def check_layout(layout, api: str) -> None:
    if not is_balanced(layout) and layout not in LAYOUTS:
        raise ValueError(f"{api}: layout must be one of {LAYOUTS} or a balanced_layout(), got {layout!r}")


def check_named_layout(layout, api: str) -> None:
    """A layout of one sequence in equal chunks, one of LAYOUTS: a balanced layout lays out packed
    documents, for ring_flash_attn_varlen_func."""
    check_layout(layout, api)
    if is_balanced(layout):
        raise ValueError(f"{api}: a balanced layout (packed documents) goes with ring_flash_attn_varlen_func")


def chunks_per_rank(layout) -> int:
    return 2 if layout == "zigzag" else 1


def check_divisible(seq_len: int, world: int, layout: str, api: str, what: str = "sequence length") -> None:
    parts = world * chunks_per_rank(layout)
    if seq_len % parts:
        lo = seq_len // parts * parts
        hint = f"{lo} or {lo + parts}" if lo else f"{parts}"
        raise ValueError(
            f"{api}: {what} {seq_len} does not divide into {parts} equal chunks for layout "
            f"{layout!r} on {world} ranks; use a multiple of {parts} (e.g. {hint}), or pad"
        )


def segments(layout, rank: int, world: int, local_len: int) -> list[Segment]:
    """The runs of global positions held by `rank`, in local order (a balanced layout knows
    its own; local_len is then unused)."""
    if is_balanced(layout):
        return layout.segments(rank)
    if layout == "contiguous":
        return [Segment(0, rank * local_len, local_len)]
    chunk = local_len // 2
    return [Segment(0, rank * chunk, chunk), Segment(chunk, (2 * world - 1 - rank) * chunk, chunk)]


def global_positions(layout: str, rank: int, world: int, local_len: int) -> list[int]:
    return [s.global_start + i for s in segments(layout, rank, world, local_len) for i in range(s.length)]


def _coalesce(tasks: list[BlockTask]) -> list[BlockTask]:
    """Merge fully visible tasks that share query rows and have adjacent key rows, or share
    key rows and have adjacent query rows: fewer, larger kernel calls."""
    tasks = list(tasks)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(tasks):
            for j, b in enumerate(tasks):
                if i == j or a.masked or b.masked:
                    continue
                if a.q_rows == b.q_rows and a.kv_rows.stop == b.kv_rows.start:
                    new = BlockTask(a.q_rows, slice(a.kv_rows.start, b.kv_rows.stop), 0, 0, False)
                elif a.kv_rows == b.kv_rows and a.q_rows.stop == b.q_rows.start:
                    new = BlockTask(slice(a.q_rows.start, b.q_rows.stop), a.kv_rows, 0, 0, False)
                else:
                    continue
                tasks = [t for k, t in enumerate(tasks) if k not in (i, j)] + [new]
                merged = True
                break
            if merged:
                break
    return sorted(tasks, key=lambda t: (t.q_rows.start, t.kv_rows.start))


def step_tasks(
    layout, rank: int, world: int, step: int, q_len: int, kv_len: int, window: Window, coalesce: bool = True
) -> list[BlockTask]:
    """Block tasks for `rank` at ring `step`, when it holds the keys of rank (rank - step) % world.
    q_len / kv_len: local lengths of the query and key shards. coalesce=False keeps one task
    per (query segment, key segment), each with its true start positions (dropout needs them)."""
    src = rank if step == 0 else (rank - step) % world
    tasks = []
    for qs in segments(layout, rank, world, q_len):
        for ks in segments(layout, src, world, kv_len):
            if qs.doc != ks.doc:  # packed documents attend within themselves only
                continue
            vis = block_visibility(qs.global_start, qs.length, ks.global_start, ks.length, window)
            if vis is Visibility.NONE:
                continue
            tasks.append(
                BlockTask(
                    slice(qs.local_start, qs.local_start + qs.length),
                    slice(ks.local_start, ks.local_start + ks.length),
                    qs.global_start,
                    ks.global_start,
                    vis is Visibility.PARTIAL,
                )
            )
    return _coalesce(tasks) if coalesce else tasks


@functools.lru_cache(maxsize=256)
def ring_steps(layout, world: int, q_len: int, kv_len: int, window: Window) -> tuple[int, ...]:
    """The ring steps some rank has a block task in, ascending, step 0 always: the only steps
    the ring runs. A K/V block goes from one such step straight to the next (a hop of several
    places when the steps between have no work for anyone: e.g. a sliding window on the zigzag
    layout needs steps 0, 1 and world - 1 only), and after the last none is sent. Pure and the
    same on every rank; cached (layouts, windows and lengths are hashable)."""
    steps = [0]
    for step in range(1, world):
        if any(step_tasks(layout, r, world, step, q_len, kv_len, window) for r in range(world)):
            steps.append(step)
    return tuple(steps)


def steps_needed(layout, world: int, q_len: int, kv_len: int, window: Window) -> int:
    """How many steps the ring runs (len(ring_steps)): 1 means no K/V block ever travels."""
    return len(ring_steps(layout, world, q_len, kv_len, window))
