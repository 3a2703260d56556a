"""The Gluon kernels' check harnesses keep working on the CPU, in their dry runs (float64 and
float32 stand-ins for the kernels): each passes the right stand-in and fails a wrong one. Apart
from test_gluon_scripts.py so that the two CI workers (pytest --dist loadfile) share these long
tests."""

import json
import sys

from commands import run

# a dry-run case takes seconds; the harnesses' own 90 s before a case counts as hung (meant for
# a GPU kernel that never returns) can pass on a loaded CPU, after which every case of its
# family is skipped, and so can their deadline for starting a case (gluon_bwd_check's 330 s),
# after which the rest are skipped: pytest's own timeout guards these runs instead
CASE_TIMEOUT = "600"
DEADLINE = "3600"


def test_gluon_check_catches_a_wrong_forward_at_head_dims_in_pieces(tmp_path):
    """benchmarks/gluon_check.py's correctness harness on the CPU (a float64 stand-in for the
    kernel, --cpu-dry-run) at head dims the forward runs in two pieces: every case passes with
    the right stand-in, and a stand-in that ignores the causal mask fails the causal ones (at
    192 alone: the catch does not depend on the head dim, and each case costs CI seconds)."""
    for mode, want_all, dims in (("ok", True, ["96", "192"]), ("bug", False, ["192"])):
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


def test_gluon_bwd_check_catches_a_wrong_backward_with_v_head_dim_apart(tmp_path):
    """benchmarks/gluon_bwd_check.py's harness on the CPU (--cpu-dry-run: a float32 emulation of
    the kernel's blocking, the blocked dQ's finish interpreted) at MLA's head dims (192 / 128)
    for the pieces variant and the padded one: every case passes with the right emulation, and
    one without the causal diagonal mask fails every causal case."""
    for mode, variants in (("emulate", ["split_d_pieces", "split_d_blk"]), ("bug", ["split_d_pieces"])):
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
