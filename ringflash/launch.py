"""ringflash-run: start a script on several processes of this machine with torchrun.

    ringflash-run [options] SCRIPT.py [ARGS...]
    ringflash-run [options] -m PACKAGE.MODULE [ARGS...]

Options (each also read from the environment variable named in brackets):
  --nproc N           processes [RINGFLASH_NPROC]; default: the number of GPUs, or 2 without GPUs
  --backend B         nccl or gloo [RINGFLASH_DIST_BACKEND]; default: nccl with GPUs, else gloo
  --log-ranks R       ranks whose output is shown, e.g. 0 or 0,1 [RINGFLASH_LOG_RANKS]; default 0
  --log-dir DIR       every rank's log [RINGFLASH_LOG_DIR]; default .logs/
It runs from the current directory with the current Python, changes no paths, and sets
OMP_NUM_THREADS (unless set) so that the processes share the cores instead of each taking all.
Scripts call ringflash.dist_env.init_from_env(), which reads the backend chosen here.
"""

from __future__ import annotations

import argparse
import os
import sys


def omp_threads(cores: int, nproc: int) -> int:
    """CPU threads per process: the cores shared out, at least one (more threads than cores
    run slower than fewer, especially under load)."""
    return max(1, cores // max(1, nproc))


def torchrun_command(argv: list[str], environ: dict, gpus: int, cores: int) -> tuple[list[str], dict]:
    """(command line, environment) that ringflash-run executes for `argv`."""
    ap = argparse.ArgumentParser(
        prog="ringflash-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nproc", type=int, default=None)
    ap.add_argument("--backend", choices=["nccl", "gloo"], default=None)
    ap.add_argument("--log-ranks", default=None)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m does")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    opts = ap.parse_args(argv)
    backend = opts.backend or environ.get("RINGFLASH_DIST_BACKEND") or ("nccl" if gpus else "gloo")
    if backend not in ("nccl", "gloo"):
        ap.error(f"backend must be nccl or gloo, got {backend!r}")
    usable_gpus = gpus if backend == "nccl" else 0
    if opts.nproc is not None:
        nproc = opts.nproc
    elif environ.get("RINGFLASH_NPROC"):
        nproc = environ["RINGFLASH_NPROC"]
        if not nproc.strip().isdigit():
            ap.error(f"RINGFLASH_NPROC must be a positive int, got {nproc!r}")
        nproc = int(nproc)
    else:
        nproc = usable_gpus or 2
    if nproc < 1:
        ap.error(f"--nproc / RINGFLASH_NPROC must be a positive int, got {nproc}")
    if backend == "nccl" and nproc > gpus:
        ap.error(f"NCCL needs one GPU per process: {nproc} processes, {gpus} GPUs (use --backend gloo for CPUs)")
    env = dict(environ)
    env["RINGFLASH_DIST_BACKEND"] = backend
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(cores, nproc)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_dir = opts.log_dir or environ.get("RINGFLASH_LOG_DIR") or ".logs"
    os.makedirs(log_dir, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--log-dir",
        log_dir,
        "--tee",
        "3",
        "--local-ranks-filter",
        opts.log_ranks or environ.get("RINGFLASH_LOG_RANKS") or "0",
    ]
    cmd += (["-m"] if opts.module else []) + [opts.script, *opts.args]
    return cmd, env


def main(argv=None) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cmd, env = torchrun_command(sys.argv[1:] if argv is None else argv, dict(os.environ), gpus, os.cpu_count() or 1)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
