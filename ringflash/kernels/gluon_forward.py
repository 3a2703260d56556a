"""Gluon (warp-specialized, FlashAttention-3-style) forward for Hopper, its launcher, a float64
reference of its semantics, and a compile report that needs no GPU.

    from ringflash.kernels import gluon_forward as gf
    gf.forward(q, k, v, q_start=0, k_start=0, causal=True, scale=D ** -0.5,
               out_o=o, out_m=m, out_l=l, normalize=True, fold=False)

Semantics (per query row, softmax in base 2, qk_scale = scale * log2(e)):
  m = max_j s2_ij (float32, -inf for a row that sees no key), l = sum_j exp2(s2_ij - m),
  acc = sum_j exp2(s2_ij - m) v_j, with s2 = (q . k) * qk_scale over the visible keys (keys
  past Sk never): every key, or causal (q_start + i >= k_start + j), or a `window`
  (ringflash.masks.Window by global positions), or per-row `bounds` (ringflash.masks.RowBounds
  of packed documents), exactly as the Triton forward reads them. fold=True starts from
  (acc, m, l) = (out_o, out_m, out_l) (out_o float32) instead of the empty state;
  normalize=True writes out_o = acc / l (0 for empty rows) in out_o's dtype, else acc (out_o
  float32).

The module imports on any machine; without Gluon (triton < 3.6) or without a Hopper GPU,
`forward` raises `Unsupported` and the caller uses the Triton kernel instead.
"""

from __future__ import annotations

import collections
import functools
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..masks import CAUSAL
from . import _block_d as padded_head_dim  # the tile width a head dim runs at (a power of two)
from . import _tma_ok as _descriptor_aligned
from . import head_dim_pieces
from .key_bias import key_spans, spans_stand_in
from .launcher import launch, on_device
from .plans import Plan, Plans, alias_pattern, record, tensor_key
from .sass import matmul_loop_spills
from .sass import parse as parse_sass
from .tiles import MASK_ROWS, MASK_WINDOW

try:  # Gluon exists from triton 3.6 on; the rest of the package must not depend on it
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TensorDescriptor

    from . import _gluon_fwd as _k

    GLUON_ERROR = None
except Exception as e:  # ImportError, or an API change in another triton version
    _k = _gl = _TensorDescriptor = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

HAS_GLUON = GLUON_ERROR is None
LOG2E = 1.4426950408889634
HOPPER_SHARED_BYTES = 232448  # per block on H100/H200 (227 KiB)


class Unsupported(ValueError):
    """The Gluon forward cannot run these inputs; use the Triton kernel."""


# ----------------------------------------------------------------------------------------------
# Configurations


@dataclass(frozen=True)
class GluonConfig:
    schedule: str  # "ws2", the one schedule of _gluon_fwd
    block_m: int = 128  # query rows per program (64 per consumer warpgroup)
    block_n: int = 128  # key rows per block (its first piece when block_nt > 0)
    num_warps: int = 8  # warps of the default partition (ws2: one of its two consumer warpgroups)
    stages: int = 2  # depth of the K and V rings
    producer_regs: int = 24  # ws, ws2: registers of the producer warp (setmaxnreg)
    maxnreg: int | None = None  # ws, ws2: register cap at entry; the default partition gets what is left
    # one program per multiprocessor looping over the query tiles (dense and causal blocks;
    # sliding windows and packed documents keep one tile a program): the next tile's loads
    # overlap the last one's output
    persistent: bool = False
    max_programs: int | None = None  # persistent: at most this many programs (None: one per multiprocessor)
    # persistent: each program's producer takes its next tile from a counter in global memory
    # (one atomic a tile, in the one-tile launch's order) rather than every programs-th tile
    dynamic: bool = False
    consumers: int = 2  # consumer warpgroups of 64 query rows each (block_m = 64 x consumers)
    # each block's P made the 16-bit PV operand right after the previous PV lands rather than
    # before the next PV: 16-bit P (not float32) live across the key loop's back edge
    p_early: bool = False
    # the order of a one-tile causal or windowed launch's tiles (benchmarks.tile_order_model): a
    # few heads' tiles together, heaviest first (heads_per_group), the heads left over a short
    # group of their own: "short_first" that group first (its heaviest tiles then start early),
    # "short_last" last; "by_head", head by head as the grid lists them
    tile_order: str = "short_first"
    # a key block's second piece: blocks of block_n + block_nt keys, scored by two wgmmas each
    # (tiles are powers of two; 192 = 128 + 64 keys). Not with head dims in two pieces
    block_nt: int = 0

    def __post_init__(self):
        if self.schedule != "ws2":
            raise ValueError(f"unknown schedule {self.schedule!r}")
        if self.tile_order not in ("short_first", "short_last", "by_head"):
            raise ValueError(f"unknown tile_order {self.tile_order!r}")
        if self.consumers not in (2, 3) or self.num_warps != 4 or self.block_m != 64 * self.consumers:
            raise ValueError("ws2 runs two or three 4-warp consumer partitions of 64 rows each")
        if self.dynamic and not self.persistent:
            raise ValueError("dynamic: tiles from a counter need persistent programs")
        nt = self.block_nt
        if nt and (nt & (nt - 1) or not 16 <= nt < self.block_n):  # (a tile's shape: a power of two)
            raise ValueError(f"block_nt {nt}: a power of two from 16 below block_n {self.block_n}")

    @property
    def keys(self) -> int:
        """Keys per key block, both pieces."""
        return self.block_n + self.block_nt

    @property
    def warp_specialized(self) -> bool:
        return self.schedule == "ws2"

    @property
    def q_rows(self) -> int:
        """Rows of one Q TMA block (ws2: one per consumer warpgroup)."""
        return self.block_m // self.consumers

    @property
    def consumer_regs(self) -> int | None:
        """Registers per consumer thread after reallocation: the entry cap times all warps
        (rounded up to warpgroups) less the producer's warpgroup, spread over the consumer
        warps (each 4-warp consumer partition), down to setmaxnreg's multiple of 8."""
        if not self.warp_specialized or self.maxnreg is None:
            return None
        consumer_warps = 4 * self.consumers
        total = (consumer_warps // 4 + 1) * 4
        return (self.maxnreg * total - self.producer_regs * 4) // consumer_warps // 8 * 8


# Variants by name -> {head_dim: config}. "default" is what forward() uses without `config`.
# D=256 takes 64-key blocks: Q 64 KiB + 2 stages x (K + V) 128 KiB = 192 KiB, O alone 128
# registers a thread.
VARIANTS: dict[str, dict[int | tuple[int, int], GluonConfig]] = {
    "ws2": {
        64: GluonConfig("ws2", 128, 128, 4, 3, 24, 168),
        128: GluonConfig("ws2", 128, 128, 4, 2, 24, 168),
        256: GluonConfig("ws2", 128, 64, 4, 2, 24, 168),
    },
    # the deepest K/V rings that fit: 4 stages at D=64, 3 at 128, 2 at 256 (as ws2)...
    "ws2_s3": {
        64: GluonConfig("ws2", 128, 128, 4, 4, 24, 168),
        128: GluonConfig("ws2", 128, 128, 4, 3, 24, 168),
        256: GluonConfig("ws2", 128, 64, 4, 2, 24, 168),
        # ...and where a head dim runs in two pieces (head_dim_pieces), keyed by the tile widths
        # (q/k's, v's), what the saved shared memory allows: 192 a third 64-key stage (Q 48 KiB
        # + 3 x (24 + 24) KiB; with v still padded, no faster than two and no slower); MLA's 192
        # beside 128 128-key blocks, whose registers are D=128's (S 128 keys, O 128 wide), 2
        # stages (48 + 2 x (48 + 32) KiB). Other widths take their padded head dim's entry.
        (192, 192): GluonConfig("ws2", 128, 64, 4, 3, 24, 168),
        (192, 128): GluonConfig("ws2", 128, 128, 4, 2, 24, 168),
    },
    # 64-key blocks: half the score registers (room for per-row document bounds at D=128) and
    # less of a short document's edge computed and masked
    "ws2_n64": {64: GluonConfig("ws2", 128, 64, 4, 6, 24, 168), 128: GluonConfig("ws2", 128, 64, 4, 5, 24, 168)},
}
# ws2_s3's tiles in persistent programs; ws2_p7 only checks them: seven programs, so that each
# takes many tiles (their number rarely a multiple of seven)
VARIANTS["ws2_p"] = {d: replace(cfg, persistent=True) for d, cfg in VARIANTS["ws2_s3"].items()}
VARIANTS["ws2_p7"] = {d: replace(cfg, max_programs=7) for d, cfg in VARIANTS["ws2_p"].items()}
# the same persistent programs taking their tiles from a counter (GluonConfig.dynamic): tiles in
# the one-tile launch's order, each to the first program free for it, as FlashAttention-3's
# schedulers do; ws2_pd7 checks it on seven programs
VARIANTS["ws2_pd"] = {d: replace(cfg, dynamic=True) for d, cfg in VARIANTS["ws2_p"].items()}
VARIANTS["ws2_pd7"] = {d: replace(cfg, max_programs=7) for d, cfg in VARIANTS["ws2_pd"].items()}
# three consumer warpgroups (192-row tiles, FA3's D=64 shape): more matmuls in flight per
# softmax at D=64, where the softmax is as long as at 128 and the matmuls half; 160 registers
# a consumer thread (the entry cap 128 over 16 warps). 128-key blocks fit those only with P
# made 16-bit early (float32 P spilled 4 KB); on 64-key blocks (measured: 0.87-0.98x ws2_s3)
# the barriers a FLOP double. This one is D=64's from 8K keys on (configs.GLUON_FWD_LONG).
# ws2_pe: ws2_s3 with P made 16-bit early, which alone measured within noise of ws2_s3.
VARIANTS["ws3"] = {64: GluonConfig("ws2", 192, 128, 4, 4, 24, 128, consumers=3, p_early=True)}
VARIANTS["ws2_pe"] = {d: replace(cfg, p_early=True) for d, cfg in VARIANTS["ws2_s3"].items()}
# Key blocks wider than 128 at D=128 (FlashAttention-3's sm90 forward takes 176 keys there for
# non-causal attention, 128 for causal): 192
# (128 + 64) and 160 (128 + 32) keys, two stages (Q 32 KiB + 2 x (K + V) 192 / 160 KiB); the
# scores 96 / 80 registers a consumer thread against 128-key blocks' 64, the loop's fixed work
# (barriers, row reductions, waits) over more keys.
VARIANTS["ws2_k192"] = {128: GluonConfig("ws2", 128, 128, 4, 2, 24, 168, block_nt=64)}
VARIANTS["ws2_k160"] = {128: GluonConfig("ws2", 128, 128, 4, 2, 24, 168, block_nt=32)}
VARIANTS["ws2_k192e"] = {d: replace(cfg, p_early=True) for d, cfg in VARIANTS["ws2_k192"].items()}
VARIANTS["ws2_k160e"] = {d: replace(cfg, p_early=True) for d, cfg in VARIANTS["ws2_k160"].items()}
# the one-tile launches' tiles head by head (the grid's own order) or with the short group of
# heads last, to time either beside the default (short group first). One H200, bf16, B=1, H=32,
# causal, short first over short last, four runs on two machine starts (python3
# benchmarks/gluon_check.py --variants ws2_s3 ws2_s3_short_last ws3 ws3_short_last --head-dims 64
# 128 --seqlens 8192 16384 --skip-correctness, the order swapped every other run;
# results/gluon_short_first_h200.txt): D=128 8K 1.027-1.030, 16K 0.985-1.012; ws3 (D=64) 8K
# 0.992-1.010, 16K 0.979-1.083 (mean 1.033).
for _order in ("by_head", "short_last"):
    for _name in ("ws2_s3", "ws3"):
        VARIANTS[f"{_name}_{_order}"] = {d: replace(cfg, tile_order=_order) for d, cfg in VARIANTS[_name].items()}
DEFAULT_VARIANT = "ws2_s3"
HEAD_DIMS = (64, 128, 256)


def config_for(head_dim: int, variant: str | None = None, head_dim_v: int | None = None) -> GluonConfig:
    """The variant's config for a head dim: the entry for the widths the kernel's tiles hold
    (tile_widths) where the variant has one, else the padded larger head dim's (an upper bound
    on every tile, as the Triton kernels' tables are looked up)."""
    by_d = VARIANTS[variant or DEFAULT_VARIANT]
    widths = tile_widths(head_dim, head_dim_v)
    if widths in by_d:
        return by_d[widths]
    head_dim = max(head_dim, head_dim_v or 0)
    block_d = padded_head_dim(head_dim)
    if block_d not in by_d:
        raise Unsupported(
            f"head_dim {head_dim} not supported by the Gluon forward's {variant or DEFAULT_VARIANT!r} "
            f"(head dims padded to one of {sorted(d for d in by_d if isinstance(d, int))})"
        )
    return by_d[block_d]


def tile_widths(head_dim: int, head_dim_v: int | None = None) -> tuple[int, int]:
    """(q/k's columns, v's columns) as the kernel's tiles hold them: each head dim in its pieces
    (192: 128 + 64; v's default: q/k's head dim)."""
    return sum(head_dim_pieces(head_dim)), sum(head_dim_pieces(head_dim if head_dim_v is None else head_dim_v))


def shared_bytes(
    cfg: GluonConfig, head_dim: int, elem: int = 2, head_dim_v: int | None = None, key_bias: bool = False
) -> int:
    """Shared memory the tiles take (Q + STAGES x (K + V), and with key_bias STAGES x the key
    blocks' float32 bias) at these tile widths (tile_widths; v's default: q/k's), barriers
    excluded."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tiles = elem * (head_dim * (cfg.block_m + cfg.stages * cfg.keys) + head_dim_v * cfg.stages * cfg.keys)
    return tiles + (4 * cfg.stages * cfg.keys if key_bias else 0)


# ----------------------------------------------------------------------------------------------
# Launcher

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _tma_ok(t: torch.Tensor) -> bool:
    """A unit head-dim stride and the 16-byte alignment every tensor descriptor needs."""
    return t.stride(-1) == 1 and _descriptor_aligned(t)


@functools.lru_cache(maxsize=64)
def _smem_layout(rows: int, head_dim: int, bf16: bool):
    # cached: building the layout is a good part of the launch's host time
    return _gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], _gl.bfloat16 if bf16 else _gl.float16)


def _descriptor(t: torch.Tensor, rows: int, block_d: int):
    """4-D TMA descriptor over (B, S, H, D) with blocks of `rows` rows of one head, block_d
    columns wide (block_d > D reads the columns past D as zeros)."""
    block = [1, rows, 1, block_d]
    return _TensorDescriptor(
        t, list(t.shape), list(t.stride()), block, _smem_layout(rows, block_d, t.dtype == torch.bfloat16)
    )


@functools.lru_cache(maxsize=4)
def _bias_smem_layout(keys: int):
    return _gl.NVMMASharedLayout.get_default_for([1, keys], _gl.float32)


def _tma_rows(key_bias: torch.Tensor) -> torch.Tensor:
    """A copy of a (B, Sk) float32 key bias whose rows a TMA descriptor can read: 16-byte
    aligned (rows padded to a multiple of 4 keys; B x Sk floats copied)."""
    B, Sk = key_bias.shape
    rows = torch.empty(B, -(-Sk // 4) * 4, dtype=key_bias.dtype, device=key_bias.device)
    return rows[:, :Sk].copy_(key_bias)


def _bias_descriptor(key_bias: torch.Tensor, keys: int):
    """2-D TMA descriptor over a (B, Sk) float32 key bias, blocks of one batch row's `keys` keys
    (keys past Sk read as zeros)."""
    return _TensorDescriptor(
        key_bias, list(key_bias.shape), list(key_bias.stride()), [1, keys], _bias_smem_layout(keys)
    )


@functools.lru_cache(maxsize=16)
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (a CPU stand-in, as for the compile check: an H100 /
    H200's 132)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.lru_cache(maxsize=16)
def device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, once per device (asked on every launch)."""
    return torch.cuda.get_device_capability(device)


def check_supported(q, k, v, out_o, out_m, out_l, *, normalize, fold, cfg=None, key_bias=None) -> None:
    """Raise Unsupported unless the Gluon forward can run these tensors here."""
    if not HAS_GLUON:
        raise Unsupported(f"Gluon is not available: {GLUON_ERROR}")
    tensors = (k, v, out_o, out_m, out_l) + (() if key_bias is None else (key_bias,))
    if not all(t.is_cuda and t.device == q.device for t in tensors) or not q.is_cuda:
        raise Unsupported("the Gluon forward needs all tensors on one CUDA device")
    cap = device_capability(q.device)
    if cap != (9, 0):
        raise Unsupported(f"the Gluon forward is built for sm_90a (Hopper), this GPU is sm_{cap[0]}{cap[1]}")
    check_shapes(q, k, v, out_o, out_m, out_l, normalize=normalize, fold=fold, cfg=cfg, key_bias=key_bias)


def check_shapes(q, k, v, out_o, out_m, out_l, *, normalize, fold, cfg=None, key_bias=None) -> None:
    """The device-independent part of check_supported: dtypes, shapes, strides, alignment."""
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise Unsupported(f"q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise Unsupported(
            "expected q (B, Sq, Hq, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv), "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    Dv = v.shape[3]
    if Bk != B or Dk != D or Hq % Hkv:
        raise Unsupported(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)} (Hq % Hkv must be 0)")
    for name, dim in (("head_dim", D), ("v's head_dim", Dv)):
        if padded_head_dim(dim) not in HEAD_DIMS:
            raise Unsupported(
                f"{name} {dim} not supported by the Gluon forward (supported: up to {max(HEAD_DIMS)}, "
                f"padded to one of {HEAD_DIMS})"
            )
    width, width_v = tile_widths(D, Dv)
    if cfg is not None and shared_bytes(cfg, width, head_dim_v=width_v, key_bias=key_bias is not None) > (
        HOPPER_SHARED_BYTES - 1024
    ):
        raise Unsupported(f"config {cfg} needs too much shared memory at D={D}, Dv={Dv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _tma_ok(t):
            raise Unsupported(
                f"{name} needs a unit head_dim stride, a 16-byte aligned base and 16-byte aligned strides"
            )
    if tuple(out_o.shape) != (B, Sq, Hq, Dv) or out_o.stride(-1) != 1:
        raise Unsupported(f"out_o must be (B, Sq, Hq, Dv) = {(B, Sq, Hq, Dv)} with a unit last stride")
    if (fold or not normalize) and out_o.dtype != torch.float32:
        raise Unsupported("out_o holds the unnormalized float32 state when fold or not normalize")
    if out_o.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"out_o dtype {out_o.dtype} not supported")
    for name, t in (("out_m", out_m), ("out_l", out_l)):
        if tuple(t.shape) != (B, Hq, Sq) or t.dtype != torch.float32:
            raise Unsupported(f"{name} must be float32 (B, Hq, Sq) = {(B, Hq, Sq)}, got {t.dtype} {tuple(t.shape)}")
    if max(Sq, Sk) >= 2**30 or max(out_m.stride(1) * Hq, out_l.stride(1) * Hq) >= 2**31:
        raise Unsupported("sizes beyond 32-bit row indices")
    check_key_bias(key_bias, B, Sk, tma=True)


def check_key_bias(key_bias, B: int, Sk: int, *, tma: bool) -> None:
    """Raise Unsupported unless key_bias is None or a bias the Gluon kernels take: float32
    (B, Sk) with a unit key stride, and with tma (the forward's descriptor) 16-byte aligned rows."""
    if key_bias is None:
        return
    unit = Sk <= 1 or key_bias.stride(1) == 1
    if (
        tuple(key_bias.shape) != (B, Sk)
        or key_bias.dtype != torch.float32
        or not unit
        or (tma and not _tma_ok(key_bias))
    ):
        rows = " and 16-byte aligned rows" if tma else ""
        raise Unsupported(
            f"key_bias must be float32 (B, Sk) = {(B, Sk)} with a unit key stride{rows}, got {key_bias.dtype} "
            f"{tuple(key_bias.shape)} strides {key_bias.stride()}"
        )


def forward(
    q, k, v, *, q_start, k_start, scale, out_o, out_m, out_l, normalize, fold, causal=False, window=None, bounds=None,
    config=None, key_bias=None,
):  # fmt: skip
    """Attention of q (B, Sq, Hq, D) over k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) by global
    positions; writes out_o (B, Sq, Hq, Dv), out_m and out_l (B, Hq, Sq) float32 (semantics:
    module docstring).

    causal=True is window=masks.CAUSAL; bounds (RowBounds, its k_lo / k_hi for q's rows)
    decides alone when given. key_bias: None or (B, Sk) float32, added to every score of its
    key (natural-log units; -inf hides the key). config: a GluonConfig or a variant name (default:
    DEFAULT_VARIANT for this head dim). Raises Unsupported for inputs the kernel does not take
    (nothing is written then). A call of a signature seen before skips the checks and reuses
    that call's plan (plans.py).
    """
    k_lo, k_hi = (None, None) if bounds is None else (bounds.k_lo, bounds.k_hi)
    if key_bias is not None and key_bias.dtype == torch.float32 and not _tma_ok(key_bias):
        key_bias = _tma_rows(key_bias)
    spans = None if key_bias is None or key_bias.shape[1] == 0 else key_spans(key_bias, scale)
    tensors = (q, k, v, out_o, out_m, out_l, k_lo, k_hi, key_bias, spans)  # every tensor the launch reads
    signature = (
        alias_pattern(tensors),
        *map(tensor_key, tensors),
        int(q_start),
        int(k_start),
        float(scale),
        bool(normalize),
        bool(fold),
        bool(causal),
        None if window is None else (window.left, window.right),
        config,
    )
    plan = _PLANS.get(signature)
    if plan is not None:  # checked and planned before: only the tensors differ
        record("forward", plan, tensors)
        launch_planned(plan, tensors)
        return
    cfg = _resolve(q, v, config)
    check_supported(q, k, v, out_o, out_m, out_l, normalize=normalize, fold=fold, cfg=cfg, key_bias=key_bias)
    if q.numel() == 0:
        return
    if k.shape[1] == 0:  # no keys (a TMA descriptor cannot be empty): the state is unchanged
        if not fold:
            out_o.zero_()
            out_m.fill_(float("-inf"))
            out_l.zero_()
        elif normalize:
            out_o.copy_(normalized(out_o, out_l))
        return
    kernel, grid, args, kwargs = launch_plan(
        q,
        k,
        v,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        window=window,
        bounds=bounds,
        scale=scale,
        out_o=out_o,
        out_m=out_m,
        out_l=out_l,
        normalize=normalize,
        fold=fold,
        cfg=cfg,
        key_bias=key_bias,
        spans=spans,
    )
    if _PLANS.wants(signature):
        # (a dynamic launch's counter is the device's: launch_planned puts it in)
        plan = Plan(kernel, grid, args, kwargs, (*tensors, tile_counter(q.device)) if kwargs["DYNAMIC"] else tensors)
        _PLANS.put(signature, plan)
        record("forward", plan, tensors)
    with on_device(q):
        launch(kernel, grid, *args, **kwargs)


def launch_planned(plan: Plan, tensors) -> None:
    """forward()'s launch from a kept plan, for tensors (q, k, v, out_o, out_m, out_l, k_lo,
    k_hi, key_bias, key_spans(key_bias, scale)) of the signature the plan was kept for (forward()
    checked that one; a caller replaying a recorded plans.PlanUse checks that its tensors are
    alike)."""
    if plan.kwargs["DYNAMIC"]:  # tiles from the device's counter
        tensors = (*tensors, tile_counter(tensors[0].device))
    with on_device(tensors[0]):
        plan.launch(plan.kernel, plan.grid, plan.args_for(tensors), plan.kwargs)


_PLANS = Plans()


def _resolve(q, v, config) -> GluonConfig:
    """config as given (a GluonConfig), or config_for q's and v's head dims (a variant name or None)."""
    if config is None or isinstance(config, str):
        return config_for(q.shape[-1], config, head_dim_v=v.shape[-1])
    return config


def launch_plan(
    q, k, v, *, q_start, k_start, scale, out_o, out_m, out_l, normalize, fold, cfg, causal=False, window=None,
    bounds=None, key_bias=None, spans=None,
):  # fmt: skip
    """(kernel, grid, args, kwargs) of one launch, for checked inputs (any device: the CPU
    compile check binds CPU tensors through the same arguments). spans: key_spans(key_bias,
    scale) (computed here when not given)."""
    from . import _mask_args

    B, Sq, Hq, D = q.shape
    Dv = v.shape[3]
    (block_d, block_dt), (block_dv, block_dvt) = head_dim_pieces(D), head_dim_pieces(Dv)
    Sk, Hkv = k.shape[1], k.shape[2]
    q_start, k_start = int(q_start), int(k_start)
    # positions as the Triton kernels take them: below 2^30 (tiles.UNBOUNDED), so that a
    # window's bounds stay within 32 bits
    if max(abs(q_start), abs(k_start)) + Sq + Sk >= 2**30:
        raise Unsupported("positions beyond 2^30")
    if causal and window is not None:
        raise ValueError("give causal=True or a window, not both")
    mask, win_left, win_right, left, _, (k_lo, k_hi), _ = _mask_args(CAUSAL if causal else window, bounds, out_m)
    if cfg.block_nt and (block_dt or block_dvt):
        raise Unsupported("a key block in two pieces takes head dims of one piece")
    if cfg.block_nt and key_bias is not None:
        raise Unsupported("a key bias takes key blocks of one piece")
    if mask == MASK_ROWS and cfg.consumers != 2:  # (the tile's per-row reductions take powers of two)
        raise Unsupported("per-row bounds need 128-row tiles: two consumer warpgroups")
    # dense and causal only (no left bound): what was measured; sliding windows spill more
    persistent = cfg.persistent and mask != MASK_ROWS and not left
    dynamic = persistent and cfg.dynamic
    num_tiles = triton_cdiv(Sq, cfg.block_m) * B * Hq
    kwargs = dict(
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_DT=block_dt,
        HEAD_DIM_V=Dv,
        BLOCK_DV=block_dv,
        BLOCK_DVT=block_dvt,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_NT=cfg.block_nt,
        STAGES=cfg.stages,
        MASK=mask,
        LEFT=left,
        NORMALIZE=bool(normalize),
        HAS_STATE=bool(fold),
        # a key bias is added to the scaled scores: they are scaled first (the Triton kernels' PRESCALE)
        POSITIVE_SCALE=bool(scale > 0) and key_bias is None,
        PERSISTENT=persistent,
        DYNAMIC=dynamic,
        CONSUMERS=cfg.consumers,
        P_EARLY=cfg.p_early,
        HAS_BIAS=key_bias is not None,
        SHORT_GROUP_FIRST=cfg.tile_order == "short_first",
        num_warps=cfg.num_warps,
    )
    if cfg.warp_specialized:
        kwargs["PRODUCER_REGS"] = cfg.producer_regs
    if cfg.schedule == "ws2":
        kwargs["CONSUMER_REGS"] = cfg.consumer_regs
    if cfg.maxnreg is not None:
        kwargs["maxnreg"] = cfg.maxnreg
    args = (
        _descriptor(q, cfg.q_rows, block_d),
        _descriptor(k, cfg.block_n, block_d),
        _descriptor(v, cfg.block_n, block_dv),
        _descriptor(q, cfg.q_rows, block_dt) if block_dt else None,
        *_second_pieces(k, v, cfg, block_d, block_dt, block_dv, block_dvt),
        None if key_bias is None else _bias_descriptor(key_bias, cfg.block_n),
        None if key_bias is None else (key_spans(key_bias, scale) if spans is None else spans),
        out_o,
        out_m,
        out_l,
        k_lo,
        k_hi,
        out_o.stride(0),
        out_o.stride(1),
        out_o.stride(2),
        out_m.stride(0),
        out_m.stride(1),
        out_m.stride(2),
        out_l.stride(0),
        out_l.stride(1),
        out_l.stride(2),
        num_tiles,
        heads_per_group(cfg, mask, persistent, B * Hq, Sk, k.element_size() * (D + Dv)),
        Hq,
        Hq // Hkv,
        Sq,
        Sk,
        q_start,
        k_start,
        win_left,
        win_right,
        float(scale) * LOG2E,
        tile_counter(q.device) if dynamic else None,
    )
    if persistent:
        grid = (min(num_tiles, cfg.max_programs or multiprocessors(q.device)),)
    else:
        grid = (triton_cdiv(Sq, cfg.block_m), B * Hq)
    return _k.KERNELS[cfg.schedule], grid, args, kwargs


def _second_pieces(k, v, cfg: GluonConfig, block_d: int, block_dt: int, block_dv: int, block_dvt: int):
    """K's and V's descriptors of their blocks' second pieces: the key tail (each block's rows
    from block_n on) or the head dims' tail columns, each None where there is none."""
    if cfg.block_nt:
        return _descriptor(k, cfg.block_nt, block_d), _descriptor(v, cfg.block_nt, block_dv)
    return (
        _descriptor(k, cfg.block_n, block_dt) if block_dt else None,
        _descriptor(v, cfg.block_n, block_dvt) if block_dvt else None,
    )


# The L2 share that the K and V of the heads whose causal tiles run side by side may take
# (one H200 reports 60 MB of L2), so that each head's K/V is read from memory about once.
TILE_ORDER_L2_BYTES = 24 << 20


def heads_per_group(cfg: GluonConfig, mask: int, persistent: bool, heads: int, keys: int, kv_row_bytes: int) -> int:
    """How many of the B x Hq heads a one-tile launch takes tile by tile together
    (_gluon_fwd._launch_order), and persistent programs that take the tiles from a counter
    (cfg.dynamic) in the same order: causal and windowed blocks (whose later query tiles see
    more keys and so start first) as many as keep their K and V (keys x kv_row_bytes each)
    within TILE_ORDER_L2_BYTES, so that the launch ends on light tiles; 1 (head by head)
    otherwise."""
    if mask != MASK_WINDOW or (persistent and not cfg.dynamic) or cfg.tile_order == "by_head":
        return 1
    return heads_within_l2(heads, keys * kv_row_bytes)


def heads_within_l2(heads: int, bytes_per_head: int) -> int:
    """How many of `heads` (at least one) keep their bytes_per_head each within
    TILE_ORDER_L2_BYTES: the L2 budget of the forward's and the backward's tile orders."""
    return max(1, min(heads, TILE_ORDER_L2_BYTES // max(bytes_per_head, 1)))


@functools.lru_cache(maxsize=16)
def tile_counter(device: torch.device) -> torch.Tensor:
    """The int32 (1,) counter that persistent programs with cfg.dynamic take their tiles from,
    one per device, zeroed once here: each launch's last fetch puts it back to zero
    (_gluon_counter._reset_counter), so a call needs no memset. Assumes one such launch at a
    time per device (launches on one stream, or ordered between streams); two running at once
    would share its tiles. Made outside CUDA graph capture (a first call under capture would
    allocate it from the graph's pool)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# float64 reference of exactly these semantics


def reference(q, k, v, *, q_start, k_start, causal, scale, state=None, chunk=1024):
    """(acc (B, Sq, Hq, D), m (B, Hq, Sq), l (B, Hq, Sq)) in float64, on q's device.

    state: optional incoming (acc, m, l) to continue from (any float dtype). Work is chunked
    over query rows so the score matrix of one chunk is all that is built.
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    f64 = torch.float64
    kd = k.to(f64).repeat_interleave(G, dim=2)
    vd = v.to(f64).repeat_interleave(G, dim=2)
    qk_scale = scale * LOG2E
    acc = torch.zeros(B, Sq, Hq, D, dtype=f64, device=q.device)
    m = torch.full((B, Hq, Sq), float("-inf"), dtype=f64, device=q.device)
    l = torch.zeros(B, Hq, Sq, dtype=f64, device=q.device)
    k_pos = k_start + torch.arange(Sk, device=q.device)
    for i0 in range(0, Sq, chunk):
        i1 = min(i0 + chunk, Sq)
        s2 = torch.einsum("bihd,bjhd->bhij", q[:, i0:i1].to(f64), kd) * qk_scale
        if causal:
            q_pos = q_start + torch.arange(i0, i1, device=q.device)
            s2 = s2.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
        if state is not None:
            a0 = state[0][:, i0:i1].to(f64)
            m0 = state[1][:, :, i0:i1].to(f64)
            l0 = state[2][:, :, i0:i1].to(f64)
        else:
            a0 = torch.zeros(B, i1 - i0, Hq, D, dtype=f64, device=q.device)
            m0 = torch.full((B, Hq, i1 - i0), float("-inf"), dtype=f64, device=q.device)
            l0 = torch.zeros(B, Hq, i1 - i0, dtype=f64, device=q.device)
        mc = torch.maximum(m0, s2.amax(-1) if Sk else m0)
        pivot = torch.where(torch.isneginf(mc), torch.zeros_like(mc), mc)
        p = torch.exp2(s2 - pivot[..., None])
        alpha = torch.exp2(m0 - pivot)
        l[:, :, i0:i1] = l0 * alpha + p.sum(-1)
        m[:, :, i0:i1] = mc
        acc[:, i0:i1] = a0 * alpha.transpose(1, 2)[..., None] + torch.einsum("bhij,bjhd->bihd", p, vd)
    return acc, m, l


def normalized(acc, l):
    """acc / l with 0 for empty rows; acc (B, S, H, D), l (B, H, S)."""
    lt = l.transpose(1, 2)[..., None]
    return torch.where(lt == 0, torch.zeros_like(acc), acc / torch.where(lt == 0, torch.ones_like(lt), lt))


# ----------------------------------------------------------------------------------------------
# Compile report (no GPU needed)


def compile_plan(kernel, args, kwargs, key_only: bool = False):
    """Compile for sm_90a, on any machine, the Gluon kernel that `kernel[grid](*args,
    **kwargs)` would launch, from the specialization triton's launcher binder derives from
    those arguments. Returns triton's CompiledKernel (it lands in triton's cache, so a later GPU
    launch of the same kernel skips compiling), or with key_only a string that is equal for
    launches sharing a kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    if key_only:
        return repr(
            (
                kernel.fn.__name__,
                sorted(signature.items()),
                sorted(constexprs.items()),
                sorted(attrs.items()),
                sorted(options.__dict__.items()),
            )
        )
    return triton.compile(GluonASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def timed_compile(compile_spec, spec: dict):
    """(None or the error message, seconds) of compile_spec(spec): for a process pool."""
    import time

    t = time.perf_counter()
    try:
        compile_spec(spec)
        return None, time.perf_counter() - t
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[-600:]}", time.perf_counter() - t


def compile_launch(
    q, k, v, *, q_start, k_start, scale, out_o, out_m, out_l, normalize, fold, causal=False, window=None, bounds=None,
    config=None, key_only=False, key_bias=None,
):  # fmt: skip
    """Compile for sm_90a, on any machine, exactly what forward() with these arguments would
    launch (tensors may be CPU tensors of the same shapes and strides: the specialization
    depends only on dtypes, strides and 16-byte alignment). The result lands in triton's
    cache, so a later GPU launch of the same kernel skips compiling. Returns triton's
    CompiledKernel, or with key_only a string that is equal for launches sharing a kernel."""
    if not HAS_GLUON:
        raise Unsupported(f"Gluon is not available: {GLUON_ERROR}")
    cfg = _resolve(q, v, config)
    check_shapes(q, k, v, out_o, out_m, out_l, normalize=normalize, fold=fold, cfg=cfg, key_bias=key_bias)
    kernel, _, args, kwargs = launch_plan(
        q,
        k,
        v,
        q_start=q_start,
        k_start=k_start,
        causal=causal,
        window=window,
        bounds=bounds,
        scale=scale,
        out_o=out_o,
        out_m=out_m,
        out_l=out_l,
        normalize=normalize,
        fold=fold,
        cfg=cfg,
        key_bias=key_bias,
        spans=None if key_bias is None else spans_stand_in(key_bias),  # (no kernel runs here)
    )
    return compile_plan(kernel, args, kwargs, key_only)


def launch_spec(q, k, v, *, out_o, out_m, out_l, **kw) -> dict:
    """A picklable description of a forward() call: tensor shapes, strides and dtypes, the
    other arguments as given. compile_spec compiles what that call launches."""
    meta = lambda t: (tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""))
    return {"tensors": [meta(t) for t in (q, k, v, out_o, out_m, out_l)], **kw}


def compile_spec(spec: dict, key_only: bool = False):
    """compile_launch for a launch_spec, on CPU tensors with its shapes and strides."""
    ts = [torch.empty_strided(shape, stride, dtype=getattr(torch, dt)) for shape, stride, dt in spec["tensors"]]
    kw = {k: v for k, v in spec.items() if k != "tensors"}
    q, k, v, o, m, l = ts
    return compile_launch(q, k, v, out_o=o, out_m=m, out_l=l, key_only=key_only, **kw)


def try_compile_spec(spec: dict):
    """timed_compile of compile_spec: for a process pool."""
    return timed_compile(compile_spec, spec)


def compile_for_hopper(
    cfg: GluonConfig,
    head_dim: int,
    *,
    causal: bool,
    dtype: str = "bf16",
    normalize: bool = True,
    fold: bool = False,
    scale: float = 0.125,
    group: int = 1,
    Sq: int = 1031,
    Sk: int = 777,
    mask: str = "",
    head_dim_v: int | None = None,
    key_bias: bool = False,
):
    """compile_launch for contiguous CPU tensors of these sizes (2 kv heads; v's head dim
    head_dim_v, default head_dim). mask: "" (causal or not, by `causal`), "window" (a sliding
    window: (300, 0) with causal, else (300, 77)) or "rows" (per-row bounds of packed
    documents); key_bias: with a (1, Sk) float32 key bias."""
    from ..masks import RowBounds, Window

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    hkv = 2
    q = torch.empty(1, Sq, hkv * group, head_dim, dtype=tdt)
    k = torch.empty(1, Sk, hkv, head_dim, dtype=tdt)
    v = k if head_dim_v is None else torch.empty(1, Sk, hkv, head_dim_v, dtype=tdt)
    o = torch.empty(*q.shape[:3], v.shape[3], dtype=torch.float32 if (fold or not normalize) else tdt)
    m = torch.empty(1, q.shape[2], Sq)
    if mask not in ("", "window", "rows"):
        raise ValueError(f"mask must be '', 'window' or 'rows', got {mask!r}")
    window = Window(300, 0 if causal else 77) if mask == "window" else None
    bounds = RowBounds(*(torch.zeros(n, dtype=torch.int32) for n in (Sq, Sq, Sk, Sk))) if mask == "rows" else None
    return compile_launch(
        q,
        k,
        v,
        q_start=Sk - Sq,
        k_start=0,
        causal=causal and not mask,
        window=window,
        bounds=bounds,
        scale=scale,
        out_o=o,
        out_m=m,
        out_l=torch.empty_like(m),
        normalize=normalize,
        fold=fold,
        config=cfg,
        # rows 16-byte aligned (a TMA descriptor's), the keys still ragged
        key_bias=torch.empty(1, -(-Sk // 4) * 4)[:, :Sk] if key_bias else None,
    )


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compiled_report(kern, cfg, case: dict, *, dump: Path | None = None, stem: str = "k", sass_counts=None) -> dict:
    """What ptxas and the SASS say about `kern` (a Gluon kernel compiled for sm_90a) of config
    `cfg` (a dataclass with schedule and consumer_regs): `case` (the compiled case's own
    entries), then

    regs: registers per thread at entry (ptxas; with warp specialization the entry cap),
    setmaxnreg: the per-partition budgets the kernel switches to, sass_regs: registers the
    SASS names (with warp specialization: what the busiest partition uses of its budget),
    spill_bytes and stack_bytes (must be 0), loop_spills: local-memory instructions inside the
    key loops (sass.matmul_loop_spills: spills that run once a key block), shared (bytes; must
    be <= 232448), ptx_waits / sass_waits: {N: count} of wgmma waits that leave N groups in
    flight (N > 0: a matmul overlapping other work), hgmma: count of Hopper tensor-core
    instructions, tma_loads: of TMA loads (UTMALDG), sass_lines,
    warnings: ptxas's C7xxx codes (C7510-C7515: wgmma serialized, C7508: setmaxnreg ignored),
    and for each {name: regex} of sass_counts its count in the SASS. dump: a folder for the
    PTX, TTGIR, SASS and ptxas's log, named by `stem`."""
    ptx = kern.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = Path(tmp) / "k.ptx"
        cubin = Path(tmp) / "k.cubin"
        ptx_path.write_text(ptx)
        res = subprocess.run(
            [_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx_path), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    log = res.stderr
    count = lambda xs: dict(sorted(collections.Counter(int(x, 0) for x in xs).items()))
    row = {
        "variant": cfg.schedule,
        "config": asdict(cfg),
        **case,
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "setmaxnreg": sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "consumer_regs_expected": cfg.consumer_regs,
        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1))
        + int(re.search(r"(\d+) bytes spill loads", log).group(1)),
        "stack_bytes": int(re.search(r"(\d+) bytes stack frame", log).group(1)),
        "shared": kern.metadata.shared,
        "ptx_waits": count(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)),
        "sass_waits": count(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", sass)),
        "loop_spills": matmul_loop_spills(parse_sass(sass)),
        "hgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "tma_loads": len(re.findall(r"\bUTMALDG\b", sass)),
        # highest register any instruction names + 1: with warp specialization, what the
        # busiest partition really uses under its setmaxnreg budget
        "sass_regs": 1 + max((int(x) for x in re.findall(r"\bR(\d+)\b", sass)), default=-1),
        "sass_lines": sass.count("\n"),
        "warnings": sorted(set(re.findall(r"\((C7\d+)\)", log))),
        **{name: len(re.findall(pattern, sass)) for name, pattern in (sass_counts or {}).items()},
    }
    row["fits"] = row["shared"] <= HOPPER_SHARED_BYTES
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{stem}.ptx").write_text(ptx)
        (dump / f"{stem}.ttgir").write_text(kern.asm["ttgir"])
        (dump / f"{stem}.sass").write_text(sass)
        (dump / f"{stem}.ptxas.txt").write_text(log)
    return row


def hopper_report(
    cfg: GluonConfig,
    head_dim: int,
    *,
    causal: bool,
    dtype: str = "bf16",
    normalize: bool = True,
    fold: bool = False,
    dump: Path | None = None,
    mask: str = "",
    head_dim_v: int | None = None,
    key_bias: bool = False,
) -> dict:
    """compiled_report of one variant compiled by compile_for_hopper (mask, head_dim_v, key_bias: as its),
    with the SASS's tile_atomics (ATOMG.E.ADD: persistent programs' tile counter, one fetch
    before the producer's loop and one in it) and strong_stores (STG.E.STRONG.GPU: the
    counter put back to zero at the launch's end) counted."""
    kern = compile_for_hopper(
        cfg,
        head_dim,
        causal=causal,
        dtype=dtype,
        normalize=normalize,
        fold=fold,
        mask=mask,
        head_dim_v=head_dim_v,
        key_bias=key_bias,
    )
    case = {"D": head_dim, "causal": causal, "mask": mask, "dtype": dtype, "normalize": normalize, "fold": fold}
    if head_dim_v is not None:
        case["Dv"] = head_dim_v
    if key_bias:
        case["key_bias"] = True
    dv = "" if head_dim_v is None else f"_dv{head_dim_v}"
    stem = (
        f"{cfg.schedule}_d{head_dim}{dv}_c{int(causal)}{mask and '_' + mask}{'_bias' if key_bias else ''}"
        f"_{cfg.block_m}x{cfg.block_n}"
        f"{f'+{cfg.block_nt}' if cfg.block_nt else ''}"
        f"_w{cfg.num_warps}_s{cfg.stages}"
    )
    counts = {"tile_atomics": r"\bATOMG\.E\.ADD\b", "strong_stores": r"\bSTG\.E\.STRONG\.GPU\b"}
    return compiled_report(kern, cfg, case, dump=dump, stem=stem, sass_counts=counts)


def report_problems(row: dict) -> list[str]:
    """Why a compile report (compiled_report's row) is not acceptable (empty list: fine):
    spills, shared memory over the limit, no HGMMA, ptxas warnings, no wgmma wait that leaves a
    group in flight (1; 2 where v's head dim runs in two pieces), other setmaxnreg budgets than
    the config's."""
    bad = []
    if row["spill_bytes"] or row["stack_bytes"]:
        bad.append(f"spills {row['spill_bytes']} bytes, stack {row['stack_bytes']}, {row['loop_spills']} in key loops")
    if not row["fits"]:
        bad.append(f"shared memory {row['shared']} > {HOPPER_SHARED_BYTES}")
    if row["hgmma"] == 0:
        bad.append("no HGMMA in the SASS")
    if row["warnings"]:
        bad.append(f"ptxas warnings {row['warnings']}")
    if not any(n > 0 for n in row["sass_waits"]):
        bad.append("no wgmma wait of N > 0 (no matmul left in flight)")
    # warp-specialized kernels also show the budgets of the idle worker warps and of the
    # region before the split
    want = {row["config"]["producer_regs"], row["consumer_regs_expected"]}
    if not want <= set(row["setmaxnreg"]):
        bad.append(f"setmaxnreg {row['setmaxnreg']} lacks {sorted(want)}")
    return bad
