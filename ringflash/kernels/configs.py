"""Block shapes for the Triton kernels, named in one place.

On the GPU the values come from the sweep in benchmarks/bench_local.py --tune (see
benchmarks/NOTES.md for the run that chose them). Under the Triton interpreter (CPU tests)
small blocks keep the tests quick while still giving several blocks per row, and
BLOCK_M != BLOCK_N so tile-boundary logic is exercised.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # K/V tiles through tensor descriptors (forward only)
    warp_specialize: bool = False  # tl.range(..., warp_specialize=True) on the unmasked loop


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Interpreter: tl.dot runs in numpy; warps and stages are ignored.
_INTERP_FWD = KernelConfig(32, 16, 4, 1)
_INTERP_DKDV = KernelConfig(16, 32, 4, 1)
_INTERP_DQ = KernelConfig(32, 16, 4, 1)

# Hopper (H200), keyed by padded head dim. D=64 and D=128 entries: the sweep of 2026-11-29
# (benchmarks/results/tune_h200_call1.json, B=1, H=32, S=16K, bf16); others are scaled guesses.
_FWD = {
    32: KernelConfig(128, 64, 4, 4),
    64: KernelConfig(128, 64, 4, 4),
    128: KernelConfig(128, 64, 8, 3),
    256: KernelConfig(64, 64, 8, 2),
}
_DKDV = {
    32: KernelConfig(64, 128, 4, 3),
    64: KernelConfig(64, 128, 8, 3),
    128: KernelConfig(64, 128, 8, 3),
    256: KernelConfig(32, 64, 8, 2),
}
_DQ = {
    32: KernelConfig(128, 64, 4, 3),
    64: KernelConfig(128, 64, 8, 3),
    128: KernelConfig(128, 64, 8, 3),
    256: KernelConfig(64, 32, 8, 2),
}

# Overrides for the tuning sweep: {"fwd": KernelConfig, ...}; empty in normal use.
OVERRIDES: dict[str, KernelConfig] = {}


def _pick(kind: str, table: dict, interp: KernelConfig, block_d: int) -> KernelConfig:
    if kind in OVERRIDES:
        return OVERRIDES[kind]
    if interpreting():
        return interp
    return table[max(block_d, 32)]


def forward_config(block_d: int) -> KernelConfig:
    return _pick("fwd", _FWD, _INTERP_FWD, block_d)


def dkdv_config(block_d: int) -> KernelConfig:
    return _pick("dkdv", _DKDV, _INTERP_DKDV, block_d)


def dq_config(block_d: int) -> KernelConfig:
    return _pick("dq", _DQ, _INTERP_DQ, block_d)
