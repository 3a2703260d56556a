"""Reading a kernel's SASS (cuobjdump -sass text, sm_90a) for the compile reports: the
instructions with their control words, and the loops as backward branches delimit them."""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]{16}) \*/")
_UPPER = re.compile(r"^\s+/\* (0x[0-9a-f]{16}) \*/\s*$")
_BRANCH = re.compile(r"\bBRA\b(?:.*?,)?\s*(0x[0-9a-f]+)")


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


def matmul_loop_spills(instructions) -> int:
    """Local-memory instructions (LDL / STL: spills) inside the innermost loops that hold a
    tensor-core instruction (HGMMA), i.e. the key loops, run once a key block. Spills outside
    them (a tile's or program's scalars stored before its key loop and loaded after it) run
    once a tile."""
    ops = [(a, opcode(t)) for a, t, _ in instructions]
    mma = [a for a, op in ops if op == "HGMMA"]
    with_mma = [(f, l) for f, l in loops(instructions) if any(f <= a <= l for a in mma)]
    # a loop holding another matmul loop (a persistent program's tile loop) is not innermost
    inner = [(f, l) for f, l in with_mma if not any((f2, l2) != (f, l) and f <= f2 and l2 <= l for f2, l2 in with_mma)]
    return sum(1 for a, op in ops if op in ("LDL", "STL") and any(f <= a <= l for f, l in inner))
