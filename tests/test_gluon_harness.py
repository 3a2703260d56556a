"""The Gluon forward's check harness keeps working on the CPU, in its dry run (a float64
stand-in for the kernel): it passes the right stand-in and fails a wrong one. The backward's is
in test_gluon_bwd_harness.py: a file each (pytest --dist loadfile) so that the two CI workers can
run these two long tests side by side."""

import json
import sys

from commands import CASE_TIMEOUT, DEADLINE, run


def test_gluon_check_catches_a_wrong_forward_at_head_dims_in_pieces(tmp_path):
    """benchmarks/gluon_check.py's correctness harness on the CPU (a float64 stand-in for the
    kernel, --cpu-dry-run) at head dims the forward runs in two pieces: every case passes with
    the right stand-in at 192 (128 + 64), and a stand-in that ignores the causal mask fails the
    causal ones at 96 (64 + 32): each piece split runs once, as each case costs CI seconds."""
    for mode, want_all, dims in (("ok", True, ["192"]), ("bug", False, ["96"])):
        out = tmp_path / f"{mode}.json"
        run([sys.executable, "benchmarks/gluon_check.py", "--cpu-dry-run", mode, "--quick", "--head-dims", *dims,
             "--variants", "ws2_s3", "--skip-timing", "--jobs", "0", "--case-timeout", CASE_TIMEOUT, "--deadline",
             DEADLINE, "--json", str(out)], tmp_path)  # fmt: skip
        rows = json.loads(out.read_text())["correctness"]
        assert {r["D"] for r in rows} == set(map(int, dims)) and len(rows) >= 5 * len(dims), rows
        if want_all:
            assert all(r["status"] == "PASS" for r in rows), [(r["status"], r) for r in rows if r["status"] != "PASS"]
        else:
            assert all(r["status"] == "FAIL" for r in rows if r["causal"]), rows
