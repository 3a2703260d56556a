"""Run the project's scripts as a user would, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ringflash-run from a checkout (launch/run.sh), on 2 gloo processes, with this interpreter
TWO_RANKS = ["bash", "launch/run.sh", "--nproc", "2", "--backend", "gloo"]


# What torch's gloo teardown prints when it aborts a process at exit (a C++ thread destroyed
# unjoined): seen in ~1 of 20 two-rank runs of examples/quickstart.py on a loaded 2-core machine,
# after the script's work and checks had passed, with or without a barrier before
# destroy_process_group; ringflash has no C++ code or threads of its own. Under more load it
# struck two runs in a row (benchmarks.bench_ring --smoke beside a compile on 2 cores), so a run
# it aborts is retried up to TEARDOWN_ATTEMPTS times in all.
TEARDOWN_ABORT = "terminate called without an active exception"
TEARDOWN_ATTEMPTS = 4

# a dry-run case takes seconds; the harnesses' own 90 s before a case counts as hung (meant for
# a GPU kernel that never returns) can pass on a loaded CPU, after which every case of its
# family is skipped, and so can their deadline for starting a case (gluon_bwd_check's 330 s),
# after which the rest are skipped: pytest's own timeout guards these runs instead
CASE_TIMEOUT = "600"
DEADLINE = "3600"


def _teardown_abort(log_dir: Path) -> bool:
    return log_dir.is_dir() and any(
        TEARDOWN_ABORT in f.read_text(errors="replace") for f in log_dir.rglob("stderr.log")
    )


def run(cmd, tmp_path, timeout=600, env=None, expect_ok=True) -> str:
    """Run cmd (a list) in the repository root with a clean ringflash environment (each
    process's logs under tmp_path); assert it succeeded (or failed, with expect_ok=False);
    return its stdout. A run that a process's gloo teardown aborted (TEARDOWN_ABORT in its log)
    runs again, up to TEARDOWN_ATTEMPTS runs in all."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("RINGFLASH_BACKEND", "TRITON_INTERPRET", "WORLD_SIZE", "RANK")
    }
    full_env.update(PYTHON=sys.executable, **(env or {}))
    for attempt in range(TEARDOWN_ATTEMPTS):
        log_dir = tmp_path / f"logs{attempt or ''}"
        full_env["RINGFLASH_LOG_DIR"] = str(log_dir)
        res = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        if res.returncode == 0 or not _teardown_abort(log_dir):
            break
    if expect_ok:
        assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    else:
        assert res.returncode != 0, f"{cmd} passed, expected a failure:\n{res.stdout[-3000:]}"
    return res.stdout
