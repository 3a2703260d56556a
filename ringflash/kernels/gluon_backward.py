"""Gluon (fused, warp-specialized, FlashAttention-3-style) backward for Hopper, its launcher, a
float64 reference of its semantics, and a compile report that needs no GPU.

    from ringflash.kernels import gluon_backward as gb
    gb.backward(q, k, v, m, l, do, delta, dq, dk, dv, q_start=0, k_start=0, causal=True,
                scale=D ** -0.5, accumulate=False)

Semantics (those of ringflash.kernels.backward for a dense or causal block; a window or packed
documents' per-row bounds restrict the visible pairs as there), per batch b, q head
h and kv head hk = h // (Hq // Hkv), with qk_scale = scale * log2(e) and s = q_i . k_j:
  p_ij = exp2(fma(s, qk_scale, -(m_i + log2 l_i))) for visible pairs (causal: q_start + i >=
  k_start + j), 0 otherwise and 0 for rows with l = 0; dp_ij = do_i . v_j;
  ds_ij = p_ij (dp_ij - delta_i); dv_j = sum_i p_ij do_i; dk_j = scale sum_i ds_ij q_i;
  dq_i = scale sum_j ds_ij k_j; dk, dv of a kv head sum over its q heads.
accumulate=True adds the gradients to dq, dk, dv; otherwise they are written.

dq: the kernel adds dQ in float32 with atomics (so dQ is not bitwise reproducible run to run).
A float32 dq is accumulated into in place (zeroed first when not accumulating); a 16-bit dq goes
through a float32 scratch buffer and one cast (or add) at the end. A caller that sums dQ over
many launches (the ring) passes a BlockedDQ instead and finishes it once (unblock_dq). dk, dv: any of float32,
bfloat16, float16 (stored once per key block, added to when accumulating).

The module imports on any machine; without Gluon (triton < 3.6), without a Hopper GPU, or for
inputs the kernel does not take (float32, head dims padding to other than 64, 128 and 256, scale <= 0,
strides a TMA descriptor cannot express), `backward` raises `Unsupported` before writing anything and the
caller uses the Triton kernels instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..masks import KEY_ORDER_BLOCK
from ..merge import DeltaOf
from ..reference import delta as torch_delta
from . import head_dim_pieces
from .gluon_forward import (
    HOPPER_SHARED_BYTES,
    LOG2E,
    _descriptor,
    _tma_ok,
    check_key_bias,
    compile_plan,
    compiled_report,
    device_capability,
    heads_within_l2,
    multiprocessors,
    padded_head_dim,
    timed_compile,
)
from .gluon_forward import report_problems as forward_report_problems
from .key_bias import key_spans, spans_stand_in
from .launcher import launch_kept, on_device
from .plans import Plan, Plans, alias_pattern, record, tensor_key

try:  # Gluon exists from triton 3.6 on; the rest of the package must not depend on it
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TensorDescriptor

    from . import _gluon_bwd as _k

    GLUON_ERROR = None
except Exception as e:  # ImportError, or an API change in another triton version
    _k = _gl = _TensorDescriptor = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

HAS_GLUON = GLUON_ERROR is None


class Unsupported(ValueError):
    """The Gluon backward cannot run these inputs; use the Triton kernels."""


@dataclass
class BlockedDQ:
    """A caller's blocked float32 dQ accumulator, given as dq: acc (B, Hq, >= Sq padded to 64
    rows, D) float32, each 64-row block of a (batch, head) contiguous in dq_natural_view's
    layout (a view into a larger buffer of such blocks: heads and rows from a multiple of 64
    sliced), zeroed by the caller. The kernel adds unscaled dQ to it (padded rows: zeros) and
    finishes nothing; the caller scales and un-permutes it once after its last launch
    (unblock_dq). Needs a config with dq_blocked."""

    acc: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Configurations


# the orders in which a key block's program may visit its query blocks; the kernel's WALK
# constexpr is the index (_gluon_bwd._query_block)
WALKS = ("up", "rotated", "down")


@dataclass(frozen=True)
class GluonBwdConfig:
    # producer warp + two consumer warpgroups that split the block's keys ("ws2": 64 each) or its
    # head-dim columns ("ws2_split_d", for wide head dims: all 64 keys, half the columns each)
    schedule: str = "ws2"
    block_m: int = 64  # query rows per step (each warpgroup's dK / dV matmuls see all of them)
    block_n: int = 128  # keys per program (ws2: 64 per consumer warpgroup)
    stages: int = 2  # depth of the Q / dO / statistics ring
    producer_regs: int = 24  # registers of the producer warp (setmaxnreg)
    maxnreg: int = 168  # register cap at entry: 168 x 12 warps x 32 = 64512 of the SM's 65536
    # the order of each key block's query blocks: "up" from the first; "rotated" from its own
    # one, wrapping (spreads the dQ atomics); "down" from the last (causal blocks side by side
    # then stream the same query rows at once, as non-causal ones do walking up)
    walk: str = "up"
    # dQ added unscaled into a float32 scratch in a blocked order (each warp's atomic covers 512
    # contiguous bytes, red.v4 at immediate offsets), scaled and un-permuted into dq at the end
    dq_blocked: bool = False
    lag: bool = False  # dQ one step late, 3 dS buffers: the warpgroups meet one step apart, not every step
    dq_first: bool = False  # with lag: dQ issued before dK, its atomics overlap the dK matmul (FA3's order)
    # ws2_split_d: q/k's head dim in kernels.head_dim_pieces where it has a tail (192 = 128 + 64)
    # rather than padded; dK's and dQ's pieces cross between the warpgroups (_consumer_split_d)
    pieces: bool = False
    # causal blocks: a 3-D grid takes key block j of a few kv heads (as many as keep their
    # streamed Q, dO and dQ within gluon_forward.TILE_ORDER_L2_BYTES) before any key block j + 1,
    # so that the launch does not end on one head's heaviest key blocks (heads_per_group)
    group_heads: bool = False
    # ws2: the launches ("all", or only the "causal" ones; None: none) that run at most one
    # program per multiprocessor, each taking key blocks from a counter in the launch's order
    # (_gluon_bwd._fetch_tile), the next block's first Q / dO stages and its K / V loaded while
    # the last one's final steps and dK / dV stores run; "all" includes packed documents' per-row
    # bounds (the producer warp then plans each block's query blocks and passes them on with it)
    persistent: str | None = None
    # persistent programs over packed documents' per-row bounds: the key blocks handed out most
    # query blocks first (masks.RowBounds.key_order; "heavy"), each block's heads side by side,
    # rather than in the grid's order ("grid": key blocks, then heads), so that the launch does
    # not end on one long program
    order: str = "grid"

    def __post_init__(self):
        if self.schedule not in ("ws2", "ws2_split_d"):
            raise ValueError(f"unknown schedule {self.schedule!r}")
        if self.block_n != (64 if self.split_d else 128) or self.block_m != 64:
            raise ValueError(
                "ws2 takes 128-key blocks (64 per consumer warpgroup), ws2_split_d 64-key blocks; "
                "both take 64-row query blocks"
            )
        if self.split_d and self.lag:
            raise ValueError("ws2_split_d has no lagged dQ (its P^T and dS^T buffers fill the shared memory)")
        if self.dq_first and not self.lag:
            raise ValueError("dq_first needs lag (without it dQ waits for both halves of dS every step)")
        if self.pieces and not self.split_d:
            raise ValueError("head dims in pieces run the head-dim split schedule (ws2_split_d)")
        if self.persistent not in (None, "all", "causal"):
            raise ValueError(f"persistent must be None, 'all' or 'causal', got {self.persistent!r}")
        if self.persistent and self.split_d:
            raise ValueError("persistent programs run the ws2 schedule (ws2_split_d keeps one key block a program)")
        if self.order not in ("grid", "heavy"):
            raise ValueError(f"order must be 'grid' or 'heavy', got {self.order!r}")
        if self.order == "heavy" and self.persistent != "all":
            raise ValueError("order='heavy' hands out packed documents' key blocks: it needs persistent='all'")
        if self.walk not in WALKS:
            raise ValueError(f"unknown walk {self.walk!r} (one of {WALKS})")

    @property
    def split_d(self) -> bool:
        return self.schedule == "ws2_split_d"

    @property
    def num_warps(self) -> int:
        return 4  # the default partition: consumer warpgroup 0

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread after reallocation: 3 warpgroups at the entry cap, less
        the producer's warpgroup at producer_regs, over the two consumer warpgroups."""
        return (self.maxnreg * 12 - self.producer_regs * 4) // 8


HEAD_DIMS = (64, 128, 256)
_CONFIGS = {
    "ws2": GluonBwdConfig(stages=2),
    "ws2_s3": GluonBwdConfig(stages=3),
    "ws2_rot": GluonBwdConfig(stages=2, walk="rotated"),
    # 2026-12-02, second round (benchmarks/NOTES.md): one limit each
    "ws2_blk": GluonBwdConfig(stages=2, dq_blocked=True),
    "ws2_lag": GluonBwdConfig(stages=2, dq_blocked=True, lag=True),
    # ... in persistent programs (packed documents' launches: their key blocks keep the grid's order)
    "ws2_lag_pc": GluonBwdConfig(stages=2, dq_blocked=True, lag=True, persistent="all"),
    # ... their key blocks handed out most query blocks first
    "ws2_lag_pch": GluonBwdConfig(stages=2, dq_blocked=True, lag=True, persistent="all", order="heavy"),
    "ws2_lagq": GluonBwdConfig(stages=2, dq_blocked=True, lag=True, dq_first=True),
    # ws2_lag's tiles, causal launches a few heads' key block j at a time
    "ws2_lag_grouped": GluonBwdConfig(stages=2, dq_blocked=True, lag=True, group_heads=True),
    # the same, each key block walking its query blocks from the last one down (configs.GLUON_BWD)
    "ws2_lag_grouped_down": GluonBwdConfig(stages=2, dq_blocked=True, lag=True, group_heads=True, walk="down"),
    # ... in persistent programs that take key blocks from a counter (the same blocks in the same
    # order), every launch; and the causal launches only (configs.GLUON_BWD)
    "ws2_lag_grouped_down_pc": GluonBwdConfig(
        stages=2, dq_blocked=True, lag=True, group_heads=True, walk="down", persistent="all"
    ),
    "ws2_lag_grouped_down_pcc": GluonBwdConfig(
        stages=2, dq_blocked=True, lag=True, group_heads=True, walk="down", persistent="causal"
    ),
}
# the same tiles at D = 64 and 128 (D = 64: half the shared memory; compiles without spills,
# `python benchmarks/gluon_bwd_report.py`); D = 256 splits the head dim instead (dK and dV of
# 128 keys would not fit in registers, nor K, V and two Q / dO stages in shared memory)
_SPLIT_D = {
    "split_d": GluonBwdConfig(schedule="ws2_split_d", block_n=64, stages=2, producer_regs=40),
    "split_d_blk": GluonBwdConfig(schedule="ws2_split_d", block_n=64, stages=2, producer_regs=40, dq_blocked=True),
    # q/k = 192 as 128 + 64 (MLA's 192 / 128); other head dims padded to 256 run as split_d_blk
    "split_d_pieces": GluonBwdConfig(
        schedule="ws2_split_d", block_n=64, stages=2, producer_regs=40, dq_blocked=True, pieces=True
    ),
}
VARIANTS: dict[str, dict[int, GluonBwdConfig]] = {
    **{name: dict.fromkeys((64, 128), c) for name, c in _CONFIGS.items()},
    **{name: {256: c} for name, c in _SPLIT_D.items()},
}
DEFAULT_VARIANT = "ws2"


def config_for(head_dim: int, variant: str | None = None) -> GluonBwdConfig:
    """The variant's config for a head dim (looked up by its padding: padded_head_dim)."""
    by_d = VARIANTS[variant or DEFAULT_VARIANT]
    block_d = padded_head_dim(head_dim)
    if block_d not in by_d:
        raise Unsupported(
            f"head_dim {head_dim} not supported by the Gluon backward (head dims padded to one of {sorted(by_d)})"
        )
    return by_d[block_d]


def shared_bytes(cfg: GluonBwdConfig, head_dim: int, elem: int = 2, head_dim_v: int | None = None) -> int:
    """Shared memory of the tiles at these widths (q/k's: qk_tile_columns; v's default: q/k's): K +
    V, STAGES x (Q + dO + statistics), 2 dS buffers (3 with lag; split_d: 2 dS and 2 P^T)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kv = cfg.block_n * (head_dim + head_dim_v) * elem
    ring = cfg.stages * (cfg.block_m * (head_dim + head_dim_v) * elem + 2 * cfg.block_m * 4)
    if cfg.split_d:  # P^T and dS^T, a pair a step in flight
        ds_tiles = 4
    else:
        ds_tiles = 3 if cfg.lag else 2
    return kv + ring + ds_tiles * cfg.block_n * cfg.block_m * elem


def qk_tile_columns(cfg: GluonBwdConfig, head_dim: int) -> tuple[int, int]:
    """(main, tail) tile widths of q/k's head dim: in kernels.head_dim_pieces where cfg takes
    pieces and they balance (main = 2 x tail, as 192 = 128 + 64), else (padded, 0)."""
    if cfg.pieces:
        main, tail = head_dim_pieces(head_dim)
        if tail and main == 2 * tail:
            return main, tail
    return padded_head_dim(head_dim), 0


def _resolve(q, v, config) -> GluonBwdConfig:
    """The config of a call: given, or the variant's (default DEFAULT_VARIANT) for the larger of
    q/k's and v's head dims (an upper bound on every tile, as gluon_forward.config_for)."""
    if config is None or isinstance(config, str):
        return config_for(max(q.shape[-1], v.shape[-1]), config)
    return config


# ----------------------------------------------------------------------------------------------
# Checks

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_shapes(q, k, v, m, l, do, delta, dq, dk, dv, *, scale, cfg=None, key_bias=None) -> None:
    """Everything check_supported checks that does not need the device: dtypes, shapes,
    strides, alignment, the scale."""
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k, v, do)):
        raise Unsupported(
            f"q, k, v, do must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}"
        )
    if (
        q.dim() != 4
        or k.dim() != 4
        or v.dim() != 4
        or do.dim() != 4
        or k.shape[:3] != v.shape[:3]
        or do.shape[:3] != q.shape[:3]
        or do.shape[3] != v.shape[3]
    ):
        raise Unsupported(
            "expected q (B, Sq, Hq, D), do (B, Sq, Hq, Dv), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), "
            f"got {tuple(q.shape)}, {tuple(do.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Sq, Hq, D = q.shape
    Dv = v.shape[3]
    if Dv != D and (cfg is None or not cfg.split_d):
        raise Unsupported(f"v's head dim {Dv} differs from q's {D}: only the head-dim split schedule takes that")
    Bk, Sk, Hkv, Dk = k.shape
    if Bk != B or Dk != D or Hq % Hkv:
        raise Unsupported(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)} (Hq % Hkv must be 0)")
    block_d = padded_head_dim(D)
    if block_d not in HEAD_DIMS or padded_head_dim(Dv) not in HEAD_DIMS:
        raise Unsupported(
            f"head dims {D}, {Dv} not supported by the Gluon backward (head dims padded to one of {HEAD_DIMS})"
        )
    if D % 2:  # (TMA's 16-byte strides already ask for a multiple of 8)
        raise Unsupported(f"the Gluon backward adds dQ in column pairs: head_dim {D} must be even")
    if not scale > 0:
        raise Unsupported(f"the Gluon backward takes a positive scale, got {scale}")
    if cfg is not None and shared_bytes(cfg, sum(qk_tile_columns(cfg, D)), head_dim_v=padded_head_dim(Dv)) > (
        HOPPER_SHARED_BYTES - 1024
    ):
        raise Unsupported(f"config {cfg} needs too much shared memory at D={D}")
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if not _tma_ok(t):
            raise Unsupported(
                f"{name} needs a unit head_dim stride, a 16-byte aligned base and 16-byte aligned strides"
            )
    stats = (("m", m), ("l", l), ("delta", delta))
    if isinstance(delta, DeltaOf):  # computed by the statistics launch from the output
        stats = (("m", m), ("l", l)) + ((("dlse", delta.dlse),) if delta.dlse is not None else ())
        out = delta.out
        if out.shape != do.shape or out.dtype != q.dtype or out.stride(-1) != 1:
            raise Unsupported(f"out needs do's shape, q's dtype, unit last stride: {out.dtype} {tuple(out.shape)}")
    for name, t in stats:
        if tuple(t.shape) != (B, Hq, Sq) or t.dtype != torch.float32:
            raise Unsupported(f"{name} must be float32 (B, Hq, Sq) = {(B, Hq, Sq)}, got {t.dtype} {tuple(t.shape)}")
    if dq is None or dk is None or dv is None:
        raise Unsupported("the fused backward computes dq, dk and dv together")
    if isinstance(dq, BlockedDQ):
        _check_blocked(dq.acc, B, Sq, Hq, block_d, cfg)
        dq = None
    named = (("dq", dq, (B, Sq, Hq, D)),) if dq is not None else ()
    for name, t, shape in (*named, ("dk", dk, (B, Sk, Hkv, D)), ("dv", dv, (B, Sk, Hkv, Dv))):
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise Unsupported(f"{name} must be {shape} with a unit last stride, got {tuple(t.shape)} {t.stride()}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise Unsupported(f"{name} dtype {t.dtype} not supported")
    if dq is not None and dq.dtype == torch.float32 and (dq.data_ptr() % 8 or any(s % 2 for s in dq.stride()[:-1])):
        # the atomics add two adjacent float32 per instruction (8-byte aligned pairs)
        raise Unsupported("a float32 dq needs an 8-byte aligned base and even strides")
    if max(Sq, Sk) >= 2**30:
        raise Unsupported("sizes beyond 32-bit row indices")
    check_key_bias(key_bias, B, Sk, tma=False)


def _check_blocked(acc: torch.Tensor, B: int, Sq: int, Hq: int, D: int, cfg) -> None:
    if cfg is not None and not cfg.dq_blocked:
        raise Unsupported(f"a blocked dq needs a config with dq_blocked, got {cfg}")
    rows = blocked_rows(Sq)
    if (
        acc.dtype != torch.float32
        or acc.dim() != 4
        or acc.shape[0] != B
        or acc.shape[1] != Hq
        or acc.shape[2] < rows
        or acc.shape[3] != D
        or acc.stride(3) != 1
        or acc.stride(2) != D
        or acc.data_ptr() % 16
        or any(s % (DQ_BLOCK_ROWS * D) for s in (acc.stride(0), acc.stride(1)))
    ):
        raise Unsupported(
            f"a blocked dq must be float32 ({B}, {Hq}, >= {rows}, {D}) of contiguous 64-row blocks, "
            f"got {acc.dtype} {tuple(acc.shape)} strides {acc.stride()}"
        )


def check_supported(q, k, v, m, l, do, delta, dq, dk, dv, *, scale, cfg=None, key_bias=None) -> None:
    """Raise Unsupported unless the Gluon backward can run these tensors here."""
    if not HAS_GLUON:
        raise Unsupported(f"Gluon is not available: {GLUON_ERROR}")
    dq_tensor = dq.acc if isinstance(dq, BlockedDQ) else dq
    tensors = (q, k, v, m, l, do, dq_tensor, dk, dv, key_bias) + (
        tuple(delta) if isinstance(delta, DeltaOf) else (delta,)
    )
    if any(t is not None and (not t.is_cuda or t.device != q.device) for t in tensors):
        raise Unsupported("the Gluon backward needs all tensors on one CUDA device")
    cap = device_capability(q.device)
    if cap != (9, 0):
        raise Unsupported(f"the Gluon backward is built for sm_90a (Hopper), this GPU is sm_{cap[0]}{cap[1]}")
    check_shapes(q, k, v, m, l, do, delta, dq, dk, dv, scale=scale, cfg=cfg, key_bias=key_bias)


# ----------------------------------------------------------------------------------------------
# Launcher


def padded_rows(Sq: int, cfg: GluonBwdConfig) -> int:
    return -(-Sq // cfg.block_m) * cfg.block_m


@triton.jit
def _row_stats_kernel(
    M, L, DELTA, O, DO, STATS, DQ32, COUNTER,
    stride_mb, stride_mh, stride_lb, stride_lh, stride_db, stride_dh,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
    H, S, SP,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
    ZERO_DQ: tl.constexpr, FROM_OUTPUT: tl.constexpr, HAS_DLSE: tl.constexpr, ZERO_COUNTER: tl.constexpr,
):  # fmt: skip
    """row_stats in one launch: STATS (B, H, 2, SP) float32 seen flat, [b, h, 0, r] =
    M + log2(L) (+inf where L = 0 or r >= S) and [b, h, 1, r] = DELTA (0 for r >= S), of
    M, L, DELTA (B, H, S) float32 with unit row strides; one program per BLOCK rows of a
    (batch, head). FROM_OUTPUT: delta computed here as rowsum(O * DO) of O, DO (B, S, H,
    HEAD_DIM_V) (read BLOCK_DV wide, its power of two), minus DELTA (then dlse, (B, H, S)) with
    HAS_DLSE. ZERO_DQ: also zero those rows of DQ32 (B, H, SP, HEAD_DIM) float32 (HEAD_DIM: the
    blocked buffer's padded width). ZERO_COUNTER: program (0, 0) also zeroes COUNTER, int32 (1,)
    (persistent programs' key blocks)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < S
    m = tl.load(M + b * stride_mb + h * stride_mh + rows, mask=inside, other=0.0)
    l = tl.load(L + b * stride_lb + h * stride_lh + rows, mask=inside, other=0.0)
    if FROM_OUTPUT:  # as the delta kernel (kernels.backward._delta_kernel) computes it
        cols = tl.arange(0, BLOCK_DV)
        rows64 = rows.to(tl.int64)[:, None]
        ok = inside[:, None] & (cols < HEAD_DIM_V)[None, :]
        o = tl.load(O + b * stride_ob + h * stride_oh + rows64 * stride_os + cols[None, :],
                    mask=ok, other=0.0).to(tl.float32)  # fmt: skip
        do = tl.load(DO + b * stride_dob + h * stride_doh + rows64 * stride_dos + cols[None, :],
                     mask=ok, other=0.0).to(tl.float32)  # fmt: skip
        delta = tl.sum(o * do, 1)
        if HAS_DLSE:
            delta -= tl.load(DELTA + b * stride_db + h * stride_dh + rows, mask=inside, other=0.0)
    else:
        delta = tl.load(DELTA + b * stride_db + h * stride_dh + rows, mask=inside, other=0.0)
    seen = l > 0.0
    offset = tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("inf"))
    out = STATS + bh.to(tl.int64) * 2 * SP + rows
    tl.store(out, offset)
    tl.store(out + SP, delta)
    if ZERO_DQ:
        cols = tl.arange(0, HEAD_DIM)
        dq_rows = bh.to(tl.int64) * SP + rows
        tl.store(DQ32 + dq_rows[:, None] * HEAD_DIM + cols[None, :], tl.zeros((BLOCK, HEAD_DIM), tl.float32))
    if ZERO_COUNTER:
        first = (tl.program_id(0) + tl.program_id(1)) == 0
        tl.store(COUNTER + tl.arange(0, 1), tl.zeros((1,), tl.int32), mask=tl.full((1,), 1, tl.int1) & first)


def launch_row_stats(
    m, l, delta, cfg: GluonBwdConfig, dq32: torch.Tensor | None = None, do=None, counter: torch.Tensor | None = None,
    kept=None,
) -> torch.Tensor:  # fmt: skip
    """row_stats as one Triton launch (on a GPU, or under the interpreter) instead of five small
    torch ops, whose host time a short call feels. delta: a tensor, or a merge.DeltaOf computed
    in the same launch (then do (B, Sq, Hq, Dv), unit last stride, is needed: no separate delta
    launch); dq32: a blocked float32 dQ buffer (B, Hq, Sq_pad, D), contiguous, to zero in the same
    launch (None: none); counter: an int32 (1,) to zero in it too (persistent programs' key
    blocks: no memset launch of its own; None: none). kept: a kept plan's KeptLaunch for it
    (plans.Plan.side), or None."""
    B, Hq, Sq = m.shape
    Sp = padded_rows(Sq, cfg)
    stats = torch.empty(B * Hq * 2 * Sp, dtype=torch.float32, device=m.device)
    D = 16 if dq32 is None else dq32.shape[-1]
    pending = isinstance(delta, DeltaOf)
    # DELTA: the delta itself, or a pending delta's dlse; m stands in for pointers never read
    given = (m if delta.dlse is None else delta.dlse) if pending else delta
    out = delta.out if pending else m
    dv = out.shape[-1] if pending else 16  # the output's head dim (16: unread)
    o_strides = (*out.stride()[:3], *do.stride()[:3]) if pending else (0,) * 6
    with on_device(m):
        launch_kept(
            kept, _row_stats_kernel, (Sp // cfg.block_m, B * Hq),
            (m, l, given, out, do if pending else m, stats, stats if dq32 is None else dq32,
             stats if counter is None else counter,
             m.stride(0), m.stride(1), l.stride(0), l.stride(1), given.stride(0), given.stride(1), *o_strides,
             Hq, Sq, Sp),
            dict(HEAD_DIM=D, HEAD_DIM_V=dv, BLOCK_DV=padded_head_dim(dv), BLOCK=cfg.block_m,
                 ZERO_DQ=dq32 is not None, FROM_OUTPUT=pending, HAS_DLSE=pending and delta.dlse is not None,
                 ZERO_COUNTER=counter is not None),
        )  # fmt: skip
    return stats


def _one_launch_stats(m, l, delta) -> bool:
    """Whether prepare builds the row statistics with launch_row_stats: on a GPU, rows of unit
    stride (and a pending delta's output and dlse too)."""
    rows = (m, l, *(t for t in delta if t is not None)) if isinstance(delta, DeltaOf) else (m, l, delta)
    return m.is_cuda and all(t.stride(-1) == 1 for t in rows)


def row_stats(m, l, delta, cfg: GluonBwdConfig) -> torch.Tensor:
    """The kernel's per-row statistics: (B, Hq, 2, Sq_pad) float32 seen flat, rows (offset, delta) per
    (batch, head), offset = m + log2(l) (+inf where l = 0: those rows' probabilities are 0),
    padded past Sq with (+inf, 0), the padding rows' exact values (torch ops, any device;
    launch_row_stats is the same in one launch)."""
    B, Hq, Sq = m.shape
    Sp = padded_rows(Sq, cfg)
    st = torch.empty(B, Hq, 2, Sp, dtype=torch.float32, device=m.device)
    offset, deltas = st.unbind(2)
    pad = _padding_stats(m.device)
    torch.where(l > 0, m + torch.log2(l), pad[0, 0], out=offset[..., :Sq])
    deltas[..., :Sq] = delta
    if Sp > Sq:  # both padding values in one fill
        st[..., Sq:] = pad
    return st.view(-1)


@functools.lru_cache(maxsize=16)
def _padding_stats(device: torch.device) -> torch.Tensor:
    """(2, 1) float32: a padding row's (offset, delta) = (+inf, 0), broadcast over the rows."""
    return torch.tensor([[float("inf")], [0.0]], dtype=torch.float32, device=device)


def _stats_descriptor(stats: torch.Tensor, cfg: GluonBwdConfig):
    layout = _gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    return _TensorDescriptor(stats, [stats.numel()], [1], [cfg.block_m], layout)


DQ_BLOCK_ROWS = 64  # rows per block of the blocked float32 dQ (two warpgroup tiles of 64 x D / 2)


def blocked_rows(Sq: int) -> int:
    """Sq rounded up to whole blocks of the blocked dQ layout."""
    return -(-Sq // DQ_BLOCK_ROWS) * DQ_BLOCK_ROWS


def dq_natural_view(acc: torch.Tensor) -> torch.Tensor:
    """The blocked float32 dQ accumulator (B, Hq, Sq_pad, D) (cfg.dq_blocked) as a view
    (B, Sq_pad / 64, 4, 2, 8, Hq, 2, D / 16, 4, 2) whose element [b, n, w, h, g, hq, wg, j, t, e]
    is dQ[b, 64 n + 16 w + 8 h + g, hq, 64 wg + 8 j + 2 t + e]: each (b, hq, 64-row block) is two
    warpgroup tiles of 64 x 64 in the order (w, j, g, t, h, e) of _gluon_bwd._red_add_blocked."""
    B, Hq, Sp, D = acc.shape
    return acc.view(B, Hq, Sp // 64, 2, 4, D // 16, 8, 4, 2, 2).permute(0, 2, 4, 8, 6, 1, 3, 5, 7, 9)


@triton.jit
def _dq_unblock_kernel(
    ACC, DQ, stride_b, stride_s, stride_h, stride_d, H, S, SP, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """DQ[b, r, h, :HEAD_DIM] = scale * dQ (or += with ACCUMULATE) for the 64 rows r of block
    program_id(0) of (b, h) = divmod(program_id(1), H), rows r < S, read from the blocked float32
    buffer ACC (B, H, SP, BLOCK_D) (_gluon_bwd._red_add_blocked's layout: each 64-row block is
    two warpgroup tiles of 64 x BLOCK_D / 2, element (r = 16 w + 8 h + g, c = 8 j + 2 t + e) of
    a tile at w * 8 BLOCK_D + 16 g + 2 h + 128 j + 4 t + e; columns from HEAD_DIM on: padding)."""
    n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    r = tl.arange(0, 64)
    c = tl.arange(0, BLOCK_D)
    half: tl.constexpr = BLOCK_D // 2
    r_off = (r // 16) * (8 * BLOCK_D) + (r % 8) * 16 + ((r // 8) % 2) * 2
    c_off = (c // half) * (32 * BLOCK_D) + ((c % half) // 8) * 128 + ((c // 2) % 4) * 4 + (c % 2)
    block = ACC + (bh.to(tl.int64) * SP + n * 64) * BLOCK_D
    vals = tl.load(block + r_off[:, None] + c_off[None, :]) * scale
    rows = n * 64 + r
    out = DQ + b * stride_b + h * stride_h + rows.to(tl.int64)[:, None] * stride_s + c[None, :] * stride_d
    inside = (rows < S)[:, None] & (c < HEAD_DIM)[None, :]
    if ACCUMULATE:
        vals += tl.load(out, mask=inside, other=0.0).to(tl.float32)
    tl.store(out, vals.to(DQ.dtype.element_ty), mask=inside)


def unblock_dq(acc: torch.Tensor, dq: torch.Tensor, *, scale: float, accumulate: bool, kept=None) -> None:
    """dq (B, Sq, Hq, D), any strides and float dtype, = scale * the blocked float32 dQ acc
    (B, Hq, Sq padded to 64 rows, D padded: padded_head_dim), contiguous (dq_natural_view's
    layout), or += with accumulate: one Triton launch (through `kept`, a kept plan's KeptLaunch,
    where given)."""
    B, Sq, Hq, D = dq.shape
    Sp, block_d = acc.shape[2], acc.shape[3]
    with on_device(dq):
        launch_kept(
            kept, _dq_unblock_kernel, (Sp // DQ_BLOCK_ROWS, B * Hq),
            (acc, dq, *dq.stride(), Hq, Sq, Sp, float(scale)),
            dict(HEAD_DIM=D, BLOCK_D=block_d, ACCUMULATE=bool(accumulate)),
        )  # fmt: skip


def dq_buffer(
    dq: torch.Tensor, *, scale: float, accumulate: bool, cfg: GluonBwdConfig, zero_blocked: bool = True, kept=None
):  # fmt: skip
    """(dq32, finish) of a launch: dq32 the float32 buffer the kernel adds dQ to (zeroed as needed;
    the blocked scratch left unzeroed with zero_blocked=False: launch_row_stats zeroes it),
    finish() None or what turns it into dq afterwards:
    - row-major (B, Sq, Hq, D), the kernel's dQ scaled: a float32 dq itself (zeroed unless
      accumulating, then no finish), else a zeroed scratch, cast into dq (or added);
    - cfg.dq_blocked: a zeroed blocked scratch (dq_natural_view) of unscaled dQ, scaled and
      un-permuted into dq (or added) by one Triton launch (a strided torch op over the
      10-dimensional view ran at a quarter of the memory's speed: 1.6 ms at 64K rows, 32 heads)."""
    B, Sq, Hq, D = dq.shape
    if cfg.dq_blocked:
        Sp = padded_rows(Sq, cfg)
        acc = (torch.zeros if zero_blocked else torch.empty)(
            B, Hq, Sp, padded_head_dim(D), dtype=torch.float32, device=dq.device
        )
        return acc, lambda: unblock_dq(acc, dq, scale=scale, accumulate=accumulate, kept=kept)
    if dq.dtype == torch.float32:
        if not accumulate:
            dq.zero_()
        return dq, None
    dq32 = torch.zeros(B, Sq, Hq, D, dtype=torch.float32, device=dq.device)
    return dq32, (lambda: dq.add_(dq32)) if accumulate else (lambda: dq.copy_(dq32))


def _dq_strides(dq32: torch.Tensor, cfg: GluonBwdConfig):
    """(batch, row, head) strides of the kernel's float32 dQ: (B, Sq, Hq, D), or blocked (B, Hq, Sq_pad, D)."""
    if cfg.dq_blocked:
        return dq32.stride(0), dq32.stride(2), dq32.stride(1)
    return dq32.stride()[:3]


def window_bounds(causal: bool, window) -> tuple[int | None, int | None]:
    """(left, right) reaches of the mask (None: unbounded): window = (left, right) as
    masks.Window's, or None; causal=True is (None, 0)."""
    if window is None:
        return (None, 0) if causal else (None, None)
    if causal:
        raise ValueError("pass causal=True or a window, not both")
    left, right = window
    for name, x in (("left", left), ("right", right)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
            raise ValueError(f"window {name} must be None or an int >= 0, got {x!r}")
    return left, right


def persistent_launch(cfg: GluonBwdConfig, causal: bool, bounds) -> bool:
    """Whether a launch of cfg runs persistent programs: "all" every launch, "causal" those with a
    bounded right reach and no per-row bounds."""
    return cfg.persistent == "all" or (cfg.persistent == "causal" and causal and bounds is None)


def ordered_key_blocks(cfg: GluonBwdConfig, persistent: bool, bounds, key_blocks: int):
    """The order a launch hands out its key blocks in where cfg orders them (order="heavy":
    the bounds' key_order, persistent programs over per-row bounds whose key_order has one
    entry per key block of cfg's), else None (the grid's order)."""
    if cfg.order != "heavy" or not persistent or bounds is None or bounds.key_order is None:
        return None
    order = bounds.key_order
    if cfg.block_n != KEY_ORDER_BLOCK or order.shape != (key_blocks,) or order.device != bounds.q_lo.device:
        return None
    return order


def launch_plan(
    q, k, v, stats, do, dq32, dk, dv, *, q_start, k_start, causal, scale, accumulate, cfg, window=None, bounds=None,
    tile_counter=None, key_bias=None, spans=None,
):  # fmt: skip
    """(kernel, grid, args, kwargs) of one launch for checked inputs; dq32: the float32 buffer
    the kernel adds dQ to; stats: row_stats(). Any device (the CPU compile binds CPU tensors).
    The kernel takes a right reach as q_start moved by it (key kp <= query qp + right iff
    kp <= qp' = qp + right) and the left one relative to that (qp <= kp + left iff
    qp' <= kp + left + right). bounds: packed documents' masks.RowBounds (its key rows' q_lo /
    q_hi decide alone), without causal or a window. tile_counter: a zeroed int32 (1,) tensor that
    a persistent launch takes its key blocks from (None: a new one). key_bias: None or the
    forward's (B, Sk) float32 key bias; spans: key_spans(key_bias, scale) (computed here when
    not given)."""
    B, Sq, Hq, D = q.shape
    Dv = v.shape[3]
    block_dv = padded_head_dim(Dv)
    block_d, block_dt = qk_tile_columns(cfg, D)
    Sk, Hkv = k.shape[1], k.shape[2]
    if bounds is not None:
        if causal or window is not None:
            raise ValueError("per-row bounds decide alone: no causal flag or window with them")
        for name, t in (("q_lo", bounds.q_lo), ("q_hi", bounds.q_hi)):
            if t.dtype != torch.int32 or tuple(t.shape) != (Sk,) or t.stride(0) != 1 or t.device != q.device:
                raise Unsupported(f"bounds.{name} must be int32 ({Sk},) with unit stride on q's device")
    left, right = window_bounds(causal, window)
    has_left = left is not None
    q_start, k_start = int(q_start) + (right or 0), int(k_start)
    left = left + (right or 0) if has_left else 0
    if max(abs(q_start), abs(k_start), abs(k_start - q_start)) + Sq + Sk + left >= 2**31 - 1:
        raise Unsupported("positions beyond 32 bits")
    if stats.numel() >= 2**31:
        raise Unsupported("row statistics beyond 32-bit indices")
    kwargs = dict(
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_DT=block_dt,
        HEAD_DIM_V=Dv,
        BLOCK_DV=block_dv,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        CAUSAL=right is not None,
        HAS_LEFT=has_left,
        ROWS=bounds is not None,
        ACCUMULATE=bool(accumulate),
        WALK=WALKS.index(cfg.walk),
        DQ_BLOCKED=cfg.dq_blocked,
        LAG=cfg.lag,
        DQ_FIRST=cfg.dq_first,
        SPLIT_D=cfg.split_d,
        GROUPED_HEADS=False,
        PERSISTENT=False,
        HAS_BIAS=key_bias is not None,
        PRODUCER_REGS=cfg.producer_regs,
        CONSUMER_REGS=cfg.consumer_regs,
        num_warps=cfg.num_warps,
        maxnreg=cfg.maxnreg,
    )
    args = (
        _descriptor(q, cfg.block_m, block_d),
        _descriptor(k, cfg.block_n, block_d),
        _descriptor(v, cfg.block_n, block_dv),
        _descriptor(do, cfg.block_m, block_dv),
        _stats_descriptor(stats, cfg),
        _descriptor(q, cfg.block_m, block_dt) if block_dt else None,
        _descriptor(k, cfg.block_n, block_dt) if block_dt else None,
        dq32,
        dk,
        dv,
        *_dq_strides(dq32, cfg),
        *dk.stride()[:3],
        *dv.stride()[:3],
        Hq,
        Hkv,
        Hq // Hkv,
        Sq,
        Sk,
        padded_rows(Sq, cfg),
        q_start,
        k_start,
        left,
        dq32 if bounds is None else bounds.q_lo,  # (unused without bounds)
        dq32 if bounds is None else bounds.q_hi,
        dq32 if key_bias is None else key_bias,  # (unused without a key bias)
        0 if key_bias is None else key_bias.stride(0),
        dq32 if key_bias is None else (key_spans(key_bias, scale) if spans is None else spans),
        float(scale) * LOG2E,
        float(scale),
    )
    grid = (-(-Sk // cfg.block_n), B * Hkv)
    if cfg.group_heads and kwargs["CAUSAL"] and bounds is None:
        # per kv head: its q heads' Q and dO read, dQ added in float32, by every key block
        streamed = Sq * (Hq // Hkv) * ((D + Dv) * q.element_size() + D * 4)
        heads = heads_per_group(B * Hkv, streamed)
        if heads > 1:
            grid = (heads, grid[0], B * Hkv // heads)
            kwargs["GROUPED_HEADS"] = True
    num_tiles = math.prod(grid)
    persistent = persistent_launch(cfg, kwargs["CAUSAL"], bounds)
    if persistent and tile_counter is None:
        tile_counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    key_order = ordered_key_blocks(cfg, persistent, bounds, grid[0])
    # (read only by persistent programs; the order only by ordered ones)
    args += (num_tiles, grid[0], grid[1], tile_counter if persistent else dq32)
    args += (dq32 if key_order is None else key_order,)
    kwargs["ORDERED"] = key_order is not None
    if persistent:
        kwargs["PERSISTENT"] = True
        grid = (min(num_tiles, multiprocessors(q.device)),)
    return _k.KERNELS[cfg.schedule], grid, args, kwargs


def heads_per_group(heads: int, streamed_bytes: int) -> int:
    """The largest divisor of heads (B x Hkv) whose heads' streamed bytes (each streamed_bytes)
    fit the forward's L2 budget (gluon_forward.heads_within_l2): a divisor, so that every group
    is whole."""
    most = heads_within_l2(heads, streamed_bytes)
    return max(g for g in range(1, most + 1) if heads % g == 0)


def backward(
    q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate, config=None, window=None,
    bounds=None, key_bias=None,
):  # fmt: skip
    """Gradients of attention over one block (semantics: module docstring) into dq, dk, dv.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), do (B, Sq, Hq, Dv): all bfloat16 or
    all float16, D and Dv padded to 64, 128 or 256 (multiples of 8; 256 runs the head-dim split
    schedule, the only one that takes Dv != D), TMA-able strides. m, l, delta (B, Hq, Sq)
    float32: the forward's row max of the base-2 scaled scores, its normalizer sum exp2(s2 - m) (0 for a row that saw no
    key) and rowsum(dO * O) (or a merge.DeltaOf: computed in the statistics launch, minus its
    dlse).
    dq: float32 (accumulated into with atomics; an 8-byte aligned base and even strides) or
    16-bit (through a float32 scratch and a cast at the end), or a BlockedDQ the caller finishes
    (always added to). config: a GluonBwdConfig or a
    variant name (default DEFAULT_VARIANT). window: None, or (left, right) reaches (None:
    unbounded; masks.Window's meaning) instead of causal: query position qp sees key position kp
    iff qp - left <= kp <= qp + right. bounds: packed documents' masks.RowBounds instead of
    both (q_start / k_start: the block's first positions, as the Triton kernels take them).
    key_bias: None or (B, Sk) float32, the forward's bias of each key (natural-log units; -inf
    hides the key). Raises Unsupported (nothing written) for inputs the kernel does not take.
    """
    prep = prepare(
        q,
        k,
        v,
        m,
        l,
        do,
        delta,
        dq,
        dk,
        dv,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        scale=scale,
        accumulate=accumulate,
        config=config,
        window=window,
        bounds=bounds,
        key_bias=key_bias,
    )
    if prep is not None:
        prep()


@dataclass
class Prepared:
    """One backward() call split in its parts: launch() the kernel (adds into dq32), finish()
    (None, or dq32 into dq: cast / un-permute), prepared before them: the float32 dQ buffer
    zeroed, the row statistics. Calling it runs launch then finish. tile_counter: the counter
    that persistent programs take key blocks from, zeroed before every launch(): by the
    statistics launch for the first (counter_zeroed), by a memset for any other."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    dq32: torch.Tensor
    finish: object = None
    tile_counter: torch.Tensor | None = None
    counter_zeroed: bool = False
    kept: object = None  # a kept plan's launcher (plans.Plan.launch), else None: launcher.launch

    def launch(self):
        with on_device(self.dq32):
            if self.tile_counter is not None:
                if self.counter_zeroed:  # (by the statistics launch, for this first launch only)
                    self.counter_zeroed = False
                else:
                    self.tile_counter.zero_()
            launch_kept(self.kept, self.kernel, self.grid, self.args, self.kwargs)

    def __call__(self):
        self.launch()
        if self.finish is not None:
            self.finish()


def prepare(
    q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate, config=None, window=None,
    bounds=None, key_bias=None,
):  # fmt: skip
    """backward() up to the launch (its arguments, checks and Unsupported alike): a Prepared, or
    None when there is nothing to launch (Sq or Sk = 0: the gradients are then already handled).
    A call of a signature seen before skips the checks and reuses that call's plan (plans.py)."""
    signature = _signature(q, k, v, m, l, do, delta, dq, dk, dv, q_start, k_start, causal, scale, accumulate, config,
                           window, bounds, key_bias)  # fmt: skip
    plan = _PLANS.get(signature)
    if plan is not None:
        record("backward", plan, (q, k, v, m, l, do, delta, dq, dk, dv, scale, accumulate, bounds, key_bias))
        return prepared_from(plan, q, k, v, m, l, do, delta, dq, dk, dv, scale=scale, accumulate=accumulate,
                             bounds=bounds, key_bias=key_bias)  # fmt: skip
    cfg = _resolve(q, v, config)
    check_supported(q, k, v, m, l, do, delta, dq, dk, dv, scale=scale, cfg=cfg, key_bias=key_bias)
    return _prepared(None, cfg, q, k, v, m, l, do, delta, dq, dk, dv, q_start=q_start, k_start=k_start,
                     causal=causal, scale=scale, accumulate=accumulate, window=window, bounds=bounds,
                     key_bias=key_bias, signature=signature)  # fmt: skip


def prepared_from(
    plan: Plan, q, k, v, m, l, do, delta, dq, dk, dv, *, scale, accumulate, bounds=None, key_bias=None
):  # fmt: skip
    """prepare() for arguments of the signature `plan` was kept for (prepare checked that one; a
    caller replaying a recorded plans.PlanUse checks that its arguments are alike)."""
    return _prepared(plan, plan.extra, q, k, v, m, l, do, delta, dq, dk, dv, q_start=None, k_start=None,
                     causal=None, scale=scale, accumulate=accumulate, window=None, bounds=bounds,
                     key_bias=key_bias)  # fmt: skip


def _prepared(
    plan, cfg, q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate, window, bounds,
    key_bias=None, signature=None,
):  # fmt: skip
    """prepare()'s work after its checks: from a kept plan (q_start, k_start, causal and window
    then unread: the plan has them), or building one (kept under `signature` when it repeats)."""
    Sq, Sk = q.shape[1], k.shape[1]
    if Sq == 0 or Sk == 0:  # nothing to add (a TMA descriptor cannot be empty)
        if not accumulate:
            for t in (dq, dk, dv):
                if not isinstance(t, BlockedDQ):  # (only ever added to)
                    t.zero_()
        return None
    # allocations name their device; Prepared.launch runs on q's
    one_launch = _one_launch_stats(m, l, delta)
    if isinstance(dq, BlockedDQ):  # the caller's accumulator: zeroed and finished by the caller
        dq32, finish, zero_in_stats = dq.acc, None, False
    else:  # a blocked scratch is zeroed by the statistics launch where there is one
        zero_in_stats = one_launch and cfg.dq_blocked
        dq32, finish = dq_buffer(dq, scale=scale, accumulate=accumulate, cfg=cfg, zero_blocked=not zero_in_stats,
                                 kept=None if plan is None else plan.side("dq_finish"))  # fmt: skip
    # blocks handed out at run time: a counter of this call's (a kept plan takes it), zeroed by
    # the statistics launch where there is one, else before the kernel's (Prepared.launch); a kept
    # plan says whether it launches persistent programs
    if plan is not None:
        persistent = plan.kwargs["PERSISTENT"]
    else:
        persistent = persistent_launch(cfg, window_bounds(causal, window)[1] is not None, bounds)
    counter = torch.empty(1, dtype=torch.int32, device=q.device) if persistent else None
    if one_launch:
        stats = launch_row_stats(m, l, delta, cfg, dq32 if zero_in_stats else None, do=do, counter=counter,
                                 kept=None if plan is None else plan.side("row_stats"))  # fmt: skip
    else:
        if isinstance(delta, DeltaOf):
            delta = delta.value(do, torch_delta)  # torch ops, any strides
        stats = row_stats(m, l, delta, cfg)
    zeroed = one_launch and counter is not None
    spans = None if key_bias is None else key_spans(key_bias, scale)
    tensors = (q, k, v, stats, do, dq32, dk, dv,
               *((None, None, None) if bounds is None else (bounds.q_lo, bounds.q_hi, bounds.key_order)),
               counter, key_bias, spans)  # fmt: skip
    if plan is not None:
        return Prepared(
            plan.kernel, plan.grid, plan.args_for(tensors), plan.kwargs, dq32, finish, counter, zeroed, plan.launch
        )
    kernel, grid, args, kwargs = launch_plan(
        q,
        k,
        v,
        stats,
        do,
        dq32,
        dk,
        dv,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        scale=scale,
        accumulate=accumulate,
        cfg=cfg,
        window=window,
        bounds=bounds,
        tile_counter=counter,
        key_bias=key_bias,
        spans=spans,
    )
    if _PLANS.wants(signature):
        plan = Plan(kernel, grid, args, kwargs, tensors, extra=cfg)
        _PLANS.put(signature, plan)
        record("backward", plan, (q, k, v, m, l, do, delta, dq, dk, dv, scale, accumulate, bounds, key_bias))
    return Prepared(kernel, grid, args, kwargs, dq32, finish, counter, zeroed)


_PLANS = Plans()


def _signature(q, k, v, m, l, do, delta, dq, dk, dv, q_start, k_start, causal, scale, accumulate, config, window,
               bounds, key_bias):  # fmt: skip
    """Everything prepare's checks and launch_plan read of a call (plans.py)."""
    pending = isinstance(delta, DeltaOf)
    dq_tensor = dq.acc if isinstance(dq, BlockedDQ) else dq
    q_lo, q_hi = (None, None) if bounds is None else (bounds.q_lo, bounds.q_hi)
    return (
        alias_pattern((q, k, v, do, dq_tensor, dk, dv, q_lo, q_hi, key_bias)),
        *(tensor_key(t) for t in (q, k, v, m, l, do, dk, dv, key_bias)),
        ("pending", tensor_key(delta.out), tensor_key(delta.dlse)) if pending else tensor_key(delta),
        ("blocked", tensor_key(dq.acc)) if isinstance(dq, BlockedDQ) else tensor_key(dq),
        None if bounds is None else (tensor_key(bounds.q_lo), tensor_key(bounds.q_hi), tensor_key(bounds.key_order)),
        int(q_start),
        int(k_start),
        bool(causal),
        float(scale),
        bool(accumulate),
        config,
        window,
    )


# ----------------------------------------------------------------------------------------------
# float64 reference of exactly these semantics


def reference(q, k, v, m, l, do, delta, *, q_start, k_start, causal, scale, chunk=512):
    """(dq, dk, dv) in float64 of the module's semantics, from the given statistics (any float
    dtype; the probabilities use m + log2 l as given). Chunked over query rows."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    f64 = torch.float64
    kd = k.to(f64).repeat_interleave(G, dim=2)
    vd = v.to(f64).repeat_interleave(G, dim=2)
    qk_scale = scale * LOG2E
    dq = torch.zeros(B, Sq, Hq, D, dtype=f64, device=q.device)
    dkr = torch.zeros(B, Sk, Hq, D, dtype=f64, device=q.device)
    Dv = v.shape[3]
    dvr = torch.zeros(B, Sk, Hq, Dv, dtype=f64, device=q.device)
    k_pos = k_start + torch.arange(Sk, device=q.device)
    m, l, delta = m.to(f64), l.to(f64), delta.to(f64)
    for i0 in range(0, Sq, chunk):
        i1 = min(i0 + chunk, Sq)
        qc, doc = q[:, i0:i1].to(f64), do[:, i0:i1].to(f64)
        s2 = torch.einsum("bihd,bjhd->bhij", qc, kd) * qk_scale
        lc = l[:, :, i0:i1]
        off = torch.where(lc > 0, m[:, :, i0:i1] + torch.log2(torch.where(lc > 0, lc, 1.0)), float("inf"))
        p = torch.exp2(s2 - off[..., None])
        if causal:
            q_pos = q_start + torch.arange(i0, i1, device=q.device)
            p = p.masked_fill(q_pos[:, None] < k_pos[None, :], 0.0)
        dp = torch.einsum("bihd,bjhd->bhij", doc, vd)
        ds = p * (dp - delta[:, :, i0:i1, None])
        dq[:, i0:i1] = scale * torch.einsum("bhij,bjhd->bihd", ds, kd)
        dkr += scale * torch.einsum("bhij,bihd->bjhd", ds, qc)
        dvr += torch.einsum("bhij,bihd->bjhd", p, doc)
    dk = dkr.view(B, Sk, Hkv, G, D).sum(3)
    dv = dvr.view(B, Sk, Hkv, G, Dv).sum(3)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Compile report (no GPU needed)


def compile_launch(
    q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate, config=None, key_only=False,
    window=None, bounds=None, key_bias=None,
):  # fmt: skip
    """Compile for sm_90a, on any machine, exactly what backward() with these arguments would
    launch (CPU tensors of the same shapes and strides will do: the specialization depends only
    on dtypes, strides and 16-byte alignment). Returns triton's CompiledKernel, or with key_only
    a string that is equal for launches sharing a kernel."""
    if not HAS_GLUON:
        raise Unsupported(f"Gluon is not available: {GLUON_ERROR}")
    cfg = _resolve(q, v, config)
    check_shapes(q, k, v, m, l, do, delta, dq, dk, dv, scale=scale, cfg=cfg, key_bias=key_bias)
    B, Sq, Hq, D = q.shape
    if cfg.dq_blocked:
        dq32 = torch.empty(B, Hq, padded_rows(Sq, cfg), D, dtype=torch.float32, device=q.device)
    elif dq.dtype == torch.float32:
        dq32 = dq
    else:
        dq32 = torch.empty(B, Sq, Hq, D, dtype=torch.float32, device=q.device)
    stats = torch.empty(B * Hq * 2 * padded_rows(Sq, cfg), dtype=torch.float32, device=q.device)
    kernel, _, args, kwargs = launch_plan(
        q,
        k,
        v,
        stats,
        do,
        dq32,
        dk,
        dv,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        scale=scale,
        accumulate=accumulate,
        cfg=cfg,
        window=window,
        bounds=bounds,
        key_bias=key_bias,
        spans=None if key_bias is None else spans_stand_in(key_bias),  # (no kernel runs here)
    )
    return compile_plan(kernel, args, kwargs, key_only)


_NAMES = ("q", "k", "v", "m", "l", "do", "delta", "dq", "dk", "dv")


def launch_spec(q, k, v, m, l, do, delta, dq, dk, dv, **kw) -> dict:
    """A picklable description of a backward() call: tensor shapes, strides and dtypes, the
    other arguments as given. compile_spec compiles what that call launches."""
    meta = lambda t: (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))
    return {"tensors": [meta(t) for t in (q, k, v, m, l, do, delta, dq, dk, dv)], **kw}


def compile_spec(spec: dict, key_only: bool = False):
    """compile_launch for a launch_spec, on CPU tensors with its shapes and strides."""
    ts = [torch.empty_strided(shape, stride, dtype=getattr(torch, dt)) for shape, stride, dt in spec["tensors"]]
    kw = {k: v for k, v in spec.items() if k != "tensors"}
    return compile_launch(*ts, key_only=key_only, **kw)


def try_compile_spec(spec: dict):
    """timed_compile of compile_spec: for a process pool."""
    return timed_compile(compile_spec, spec)


def compile_for_hopper(
    cfg: GluonBwdConfig,
    head_dim: int,
    *,
    causal: bool,
    dtype: str = "bf16",
    accumulate: bool = False,
    grad_dtype: str | None = None,
    group: int = 1,
    Sq: int = 1031,
    Sk: int = 777,
    window_left: int | None = None,
    rows: bool = False,
    head_dim_v: int | None = None,
    key_bias: bool = False,
):
    """compile_launch for contiguous CPU tensors of these sizes (2 kv heads; v and do head_dim_v
    wide, default head_dim). grad_dtype: that
    of dk and dv (default: float32 when accumulating, else the input dtype); dq is float32.
    window_left: a sliding window of that left reach (right: 0 when causal, else unbounded).
    rows: packed documents' per-row bounds instead (causal and window_left unused). key_bias:
    with a (1, Sk) float32 key bias."""
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    gdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[grad_dtype]
    gdt = gdt or (torch.float32 if accumulate else tdt)
    hkv = 2
    q = torch.empty(1, Sq, hkv * group, head_dim, dtype=tdt)
    k = torch.empty(1, Sk, hkv, head_dim, dtype=tdt)
    v = torch.empty(1, Sk, hkv, head_dim_v or head_dim, dtype=tdt)
    do = torch.empty(1, Sq, hkv * group, head_dim_v or head_dim, dtype=tdt)
    m = torch.empty(1, q.shape[2], Sq)
    return compile_launch(
        q,
        k,
        v,
        m,
        m,
        do,
        m,
        torch.empty(q.shape, dtype=torch.float32),
        torch.empty(k.shape, dtype=gdt),
        torch.empty(v.shape, dtype=gdt),
        q_start=Sk - Sq,
        k_start=0,
        causal=causal and window_left is None and not rows,
        scale=head_dim**-0.5,
        accumulate=accumulate,
        config=cfg,
        window=None if window_left is None or rows else (window_left, 0 if causal else None),
        bounds=_compile_bounds(Sq, Sk) if rows else None,
        key_bias=torch.empty(1, Sk) if key_bias else None,
    )


def _compile_bounds(Sq: int, Sk: int):
    """Per-row bounds of the right sizes and dtype for a CPU compile (values unused)."""
    from ..masks import RowBounds

    return RowBounds(*(torch.zeros(n, dtype=torch.int32) for n in (Sq, Sq, Sk, Sk)),
                     key_order=torch.arange(-(-Sk // KEY_ORDER_BLOCK), dtype=torch.int32))  # fmt: skip


def hopper_report(
    cfg: GluonBwdConfig,
    head_dim: int,
    *,
    causal: bool,
    dtype: str = "bf16",
    accumulate: bool = False,
    group: int = 1,
    dump: Path | None = None,
    window_left: int | None = None,
    rows: bool = False,
    head_dim_v: int | None = None,
    key_bias: bool = False,
) -> dict:
    """gluon_forward.compiled_report of one case compiled by compile_for_hopper, with the dQ
    atomics counted in the SASS: red_v2 / red_v4 (vectorized float32 adds), red_scalar; and
    stg_16, global stores of 16 bits (dK / dV element by element: their pointers' alignment was
    not known); fsel, the selects (a key bias's branch made into selects has one a score more
    than the same case without a bias: _probs_t)."""
    kern = compile_for_hopper(
        cfg, head_dim, causal=causal, dtype=dtype, accumulate=accumulate, group=group, window_left=window_left,
        rows=rows, head_dim_v=head_dim_v, key_bias=key_bias,
    )  # fmt: skip
    case = {"D": head_dim, "Dv": head_dim_v or head_dim, "causal": causal, "dtype": dtype, "accumulate": accumulate,
            "group": group, "window_left": window_left, "rows": rows, "key_bias": key_bias}  # fmt: skip
    return compiled_report(
        kern,
        cfg,
        case,
        dump=dump,
        stem=f"bwd_{cfg.schedule}_d{head_dim}_v{head_dim_v or head_dim}_c{int(causal)}_w{window_left}_r{int(rows)}"
        f"{'_bias' if key_bias else ''}_{dtype}_a{int(accumulate)}_s{cfg.stages}",
        sass_counts={
            "red_v2": r"\bREDG?\.E\.ADD\.F32x2\b",
            "red_v4": r"\bREDG?\.E\.ADD\.F32x4\b",
            "red_scalar": r"\b(?:REDG?|ATOMG?)\.E\.ADD\.F32\.",
            "stg_16": r"\bSTG\.E\.(?:U16|S16)\b",
            "fsel": r"\bFSEL\b",
        },
    )


def report_problems(row: dict) -> list[str]:
    """gluon_forward.report_problems, dQ atomics that are not all vectorized, and dK / dV stored
    16 bits at a time."""
    bad = forward_report_problems(row)
    if row["red_v2"] + row["red_v4"] == 0 or row["red_scalar"]:
        bad.append(f"dQ atomics not vectorized (v2: {row['red_v2']}, v4: {row['red_v4']}, scalar: {row['red_scalar']})")
    if row["stg_16"]:
        bad.append(f"dK / dV stored 16 bits at a time ({row['stg_16']} stores)")
    return bad
