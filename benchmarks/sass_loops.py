"""The loops of a SASS dump (as gluon_report.py / gluon_bwd_report.py --dump write them): each
backward branch's body with its size, opcode histogram and the sum of its control words' stall
counts (the cycles the scheduler waits after each instruction before the next issues, as ptxas
set them: a static issue schedule, not a measurement). --events lists a loop's matmuls, waits,
barriers, shared loads and atomics in order, with each one's scoreboard wait mask and stall.

    python benchmarks/sass_loops.py DUMP.sass [--min 100]
    python benchmarks/sass_loops.py DUMP.sass --events 0x0f40 [--all]

Control word (the upper 64 bits' top 23, as Volta and later encode it): stall bits 0-3, yield
bit 4, write barrier 5-7, read barrier 8-10, wait mask 11-16, register reuse 17-20.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_UPPER = re.compile(r"^\s+/\* (0x[0-9a-f]{16}) \*/\s*$")
_BRANCH = re.compile(r"\bBRA\b(?:.*?,)?\s*(0x[0-9a-f]+)")
EVENTS = ("HGMMA", "WARPGROUP", "SYNCS", "BAR", "LDS", "LDG", "REDG", "STSM", "BRA", "FENCE", "MUFU")


def parse(text: str) -> list[tuple[int, str, int]]:
    """(address, instruction text, control word) of every instruction in a cuobjdump -sass text."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _INSTRUCTION.search(line)
        if m:
            upper = _UPPER.match(lines[i + 1]) if i + 1 < len(lines) else None
            out.append((int(m.group(1), 16), m.group(2), int(upper.group(1), 16) >> 41 if upper else 0))
    return out


def opcode(text: str) -> str:
    """The opcode without its predicate and modifiers: "@!P0 HGMMA.64x64x16.F32" -> "HGMMA"."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]


def loops(instructions) -> list[tuple[int, int]]:
    """(first, last address) of each backward branch's body. A body holding an EXIT is left out:
    the branch back from an out-of-line retry stub (an mbarrier wait's), placed after the code."""
    exits = [a for a, t, _ in instructions if opcode(t) == "EXIT"]
    found = []
    for address, text, _ in instructions:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= address:
            first = int(m.group(1), 16)
            if not any(first <= e <= address for e in exits):
                found.append((first, address))
    return found


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
    ap.add_argument("sass", type=Path)
    ap.add_argument("--min", type=int, default=100, help="loops of fewer instructions are left out")
    ap.add_argument("--events", help="the loop starting at this address (hex): its events in order")
    ap.add_argument("--all", action="store_true", help="with --events: every instruction")
    args = ap.parse_args(argv)
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
        if s["count"] >= args.min:
            top = " ".join(f"{k}:{v}" for k, v in s["opcodes"].most_common(16))
            print(f"loop {first:#06x}-{last:#06x} instructions={s['count']} stall_sum={s['stall_sum']} {top}")


if __name__ == "__main__":
    main()
