"""The Gluon backward's check harness keeps working on the CPU, in its dry run (a float32
emulation of the kernel): it passes the right emulation and fails a wrong one. A file of its own
beside test_gluon_harness.py (the forward's) so that the two CI workers (pytest --dist loadfile)
can run the two long tests side by side."""

import json
import sys

from commands import CASE_TIMEOUT, DEADLINE, run


def test_gluon_bwd_check_catches_a_wrong_backward_with_v_head_dim_apart(tmp_path):
    """benchmarks/gluon_bwd_check.py's harness on the CPU (--cpu-dry-run: a float32 emulation of
    the kernel's blocking, the blocked dQ's finish interpreted) at MLA's head dims (192 / 128),
    the pieces variant: every case passes with the right emulation, and one without the causal
    diagonal mask fails every causal case. (The padded split_d_blk would run the same emulation
    again: it emulates blocks, masks and the dQ layout, which the two variants share, not the
    head-dim pieces; each case costs CI seconds.)"""
    variants = ["split_d_pieces"]
    for mode in ("emulate", "bug"):
        out = tmp_path / f"{mode}.json"
        run([sys.executable, "benchmarks/gluon_bwd_check.py", "--cpu-dry-run", mode, "--quick", "--head-dim", "192",
             "--v-head-dim", "128", "--variants", *variants, "--skip-timing", "--jobs", "0", "--case-timeout",
             CASE_TIMEOUT, "--deadline", DEADLINE, "--json", str(out)], tmp_path)  # fmt: skip
        rows = json.loads(out.read_text())["correctness"]
        assert {r["variant"] for r in rows} == set(variants) and len(rows) >= 7 * len(variants), rows
        if mode == "emulate":
            assert all(r["status"] == "PASS" for r in rows), [(r["status"], r) for r in rows if r["status"] != "PASS"]
        else:
            assert all(r["status"] == "FAIL" for r in rows if r["causal"]), rows
