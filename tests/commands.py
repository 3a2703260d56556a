"""Run the project's scripts as a user would, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ringflash-run from a checkout (launch/run.sh), on 2 gloo processes, with this interpreter
TWO_RANKS = ["bash", "launch/run.sh", "--nproc", "2", "--backend", "gloo"]


def run(cmd, tmp_path, timeout=600, env=None, expect_ok=True) -> str:
    """Run cmd (a list) in the repository root with a clean ringflash environment (each
    process's logs under tmp_path); assert it succeeded (or failed, with expect_ok=False);
    return its stdout."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in ("RINGFLASH_BACKEND", "TRITON_INTERPRET", "WORLD_SIZE", "RANK")
    }
    full_env.update(RINGFLASH_LOG_DIR=str(tmp_path / "logs"), PYTHON=sys.executable, **(env or {}))
    res = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    else:
        assert res.returncode != 0, f"{cmd} passed, expected a failure:\n{res.stdout[-3000:]}"
    return res.stdout
