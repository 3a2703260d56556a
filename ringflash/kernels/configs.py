"""Block shapes for the Triton kernels, named in one place.

On the GPU the values come from the sweep in benchmarks/bench_local.py --tune (see
benchmarks/NOTES.md for the runs that chose them). Under the Triton interpreter (CPU tests)
small blocks keep the tests quick while still giving several blocks per row, and
BLOCK_M != BLOCK_N so tile-boundary logic is exercised.

RINGFLASH_KERNEL_CONFIGS=path.json replaces entries for other GPUs, as written by
`bench_local.py --tune --write-configs path.json`:
{"fwd": {"128": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tma": true}}, ...}
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # streamed tiles through tensor descriptors (the tensor-memory engine)
    warp_specialize: bool = False  # tl.range(..., warp_specialize=True) on the unmasked loop
    # dK/dV pass only: recompute the scores as Q K^T, the forward's operand order, and transpose
    # them, so the rebuilt probabilities are bitwise the forward's where a matmul's rounding
    # depends on its operand order (numpy's BLAS under the interpreter)
    qk_order: bool = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Interpreter: tl.dot runs in numpy; warps and stages are ignored. The three kernels use the same
# (32 query rows, 16 key rows) tiles and the dK/dV pass the forward's operand order: numpy's
# matmul rounds differently for other shapes or operand orders, and the backward must rebuild
# the forward's probabilities exactly (at |scores| ~ 1e4 a rounding of s is 1e-3 of a weight).
_INTERP_FWD = KernelConfig(32, 16, 4, 1)
_INTERP_DKDV = KernelConfig(32, 16, 4, 1, qk_order=True)
_INTERP_DQ = KernelConfig(32, 16, 4, 1)

# Hopper (H200), keyed by padded head dim. D=64 and D=128 entries: the sweep of 2026-11-29
# (benchmarks/results/tune_h200_call1.json, B=1, H=32, S=16K, bf16); others are scaled guesses.
# D=64 and D=128: the third sweep's choice, benchmarks/results/configs_h200.json (written by
# `bench_local.py --tune --write-configs`; sweeps in benchmarks/results/tune_h200_call*.json).
# D=32 and D=256 were checked for correctness on the H200, not tuned.
_FWD = {
    32: KernelConfig(128, 64, 4, 4),
    64: KernelConfig(128, 64, 4, 4, tma=True),
    128: KernelConfig(128, 128, 8, 3, tma=True),
    256: KernelConfig(64, 64, 8, 2),
}
_DKDV = {
    32: KernelConfig(32, 128, 4, 3),
    64: KernelConfig(32, 128, 4, 3, tma=True),
    128: KernelConfig(64, 128, 8, 3, tma=True),
    256: KernelConfig(32, 64, 8, 2),
}
_DQ = {
    32: KernelConfig(128, 32, 4, 3),
    64: KernelConfig(128, 64, 4, 3, tma=True),
    128: KernelConfig(128, 64, 8, 3, tma=True),
    256: KernelConfig(64, 32, 8, 2),
}

# Overrides for the tuning sweep: {"fwd": KernelConfig, ...}; empty in normal use.
OVERRIDES: dict[str, KernelConfig] = {}


@functools.lru_cache(maxsize=4)
def _file_configs(path: str) -> dict:
    with open(path) as f:
        raw = json.load(f)
    return {kind: {int(d): KernelConfig(**cfg) for d, cfg in by_d.items()} for kind, by_d in raw.items()}


def write_configs(path: str, chosen: dict) -> None:
    """chosen: {kind: {block_d: KernelConfig}} -> the RINGFLASH_KERNEL_CONFIGS format."""
    with open(path, "w") as f:
        json.dump({kind: {str(d): asdict(c) for d, c in by_d.items()} for kind, by_d in chosen.items()}, f, indent=1)


def _pick(kind: str, table: dict, interp: KernelConfig, block_d: int) -> KernelConfig:
    if kind in OVERRIDES:
        return OVERRIDES[kind]
    if interpreting():
        return interp
    path = os.environ.get("RINGFLASH_KERNEL_CONFIGS")
    if path:
        chosen = _file_configs(path).get(kind, {}).get(block_d)
        if chosen is not None:
            return chosen
    return table[max(block_d, 32)]


def forward_config(block_d: int) -> KernelConfig:
    return _pick("fwd", _FWD, _INTERP_FWD, block_d)


def dkdv_config(block_d: int) -> KernelConfig:
    return _pick("dkdv", _DKDV, _INTERP_DKDV, block_d)


def dq_config(block_d: int) -> KernelConfig:
    return _pick("dq", _DQ, _INTERP_DQ, block_d)
