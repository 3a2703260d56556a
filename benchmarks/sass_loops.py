"""The loops of a SASS dump (as gluon_report.py / gluon_bwd_report.py --dump write them): each
backward branch's body with its size, opcode histogram and the sum of its control words' stall
counts (the cycles the scheduler waits after each instruction before the next issues, as ptxas
set them: a static issue schedule, not a measurement). --events lists a loop's matmuls, waits,
barriers, shared loads and atomics in order, with each one's scoreboard wait mask and stall.

    python benchmarks/sass_loops.py DUMP.sass [--min 100]
    python benchmarks/sass_loops.py DUMP.sass --events 0x0f40 [--all]
    python benchmarks/sass_loops.py DIR/TAG_sass.csv --samples [--min 100] [--max 800]

--samples reads a measured profile instead: ncu's per-instruction source page as
`benchmarks.kernel_counters --source` keeps it, and lists each loop's warp samples and executed
instructions, most samples first (addresses from the kernel's first instruction): two builds'
copies of a loop side by side tell whether a loop itself got slower or ran more often.

Control word (the upper 64 bits' top 23, as Volta and later encode it): stall bits 0-3, yield
bit 4, write barrier 5-7, read barrier 8-10, wait mask 11-16, register reuse 17-20.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ringflash.kernels.sass import loops, opcode, parse  # noqa: E402

EVENTS = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "LDS", "LDG", "REDG", "STSM", "BRA", "FENCE", "MUFU")


def parse_samples(text: str) -> tuple[list[tuple[int, str, int]], dict[int, tuple[int, int]]]:
    """ncu's source page (csv, one row per SASS instruction): the instructions as parse gives
    them (control words 0: the page has none) and {address: (warp samples, executed)}."""
    rows = list(csv.reader(io.StringIO(text)))
    at = next((i for i, r in enumerate(rows) if "Address" in r and "Source" in r), None)
    if at is None:
        raise ValueError("no ncu source page: no header row with Address and Source")
    names = ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")
    cols = [rows[at].index(n) for n in names]
    instructions, counts = [], {}
    for r in rows[at + 1 :]:
        if len(r) > max(cols) and r[cols[0]].startswith("0x"):
            address = int(r[cols[0]], 16)
            instructions.append((address, r[cols[1]].strip(), 0))
            counts[address] = (int(r[cols[2]] or 0), int(r[cols[3]] or 0))
    return instructions, counts


def summary(instructions, first: int, last: int) -> dict:
    body = [(a, t, c) for a, t, c in instructions if first <= a <= last]
    return {
        "first": first,
        "last": last,
        "count": len(body),
        "stall_sum": sum(c & 0xF for *_, c in body),
        "opcodes": collections.Counter(opcode(t) for _, t, _ in body),
    }


def events(instructions, first: int, last: int, every: bool = False) -> list[str]:
    """The loop's instructions (index in the loop, address, wait mask, stall, text): its events
    (EVENTS' opcodes), or every one."""
    body = [(a, t, c) for a, t, c in instructions if first <= a <= last]
    return [
        f"{i:4d} {a:#06x} wait={(c >> 11) & 0x3F:02x} stall={c & 0xF:2d} {t}"
        for i, (a, t, c) in enumerate(body)
        if every or opcode(t) in EVENTS
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sass", type=Path, help="a SASS dump, or with --samples ncu's source page (csv)")
    ap.add_argument("--min", type=int, default=100, help="loops of fewer instructions are left out")
    ap.add_argument("--max", type=int, default=None, help="loops of more instructions are left out")
    ap.add_argument("--events", help="the loop starting at this address (hex): its events in order")
    ap.add_argument("--all", action="store_true", help="with --events: every instruction")
    ap.add_argument("--samples", action="store_true", help="the file is ncu's source page: loops by warp samples")
    args = ap.parse_args(argv)
    if args.samples:
        instructions, counts = parse_samples(args.sass.read_text())
        base = instructions[0][0] if instructions else 0
        rows = []
        for first, last in loops(instructions):
            body = [a for a, _, _ in instructions if first <= a <= last]
            if args.min <= len(body) <= (args.max or len(body)):
                rows.append((sum(counts[a][0] for a in body), len(body), sum(counts[a][1] for a in body), first, last))
        print(f"{sum(c[0] for c in counts.values())} warp samples, {len(instructions)} instructions")
        for samples, n, executed, first, last in sorted(rows, reverse=True):
            span = f"+{first - base:#07x}-+{last - base:#07x}"
            print(f"loop {span} instructions={n} samples={samples} executed={executed}")
        return
    instructions = parse(args.sass.read_text())
    if args.events:
        first = int(args.events, 16)
        last = min((b for a, b in loops(instructions) if a == first), default=None)
        if last is None:
            ap.error(f"no loop starts at {args.events}")
        print("\n".join(events(instructions, first, last, args.all)))
        return
    for first, last in loops(instructions):
        s = summary(instructions, first, last)
        if args.min <= s["count"] <= (args.max or s["count"]):
            top = " ".join(f"{k}:{v}" for k, v in s["opcodes"].most_common(16))
            print(f"loop {first:#06x}-{last:#06x} instructions={s['count']} stall_sum={s['stall_sum']} {top}")


if __name__ == "__main__":
    main()
