"""Launchers for the Triton kernels, with the same signatures as ringflash.reference.

Tensors must have a unit stride in head_dim; any other strides are passed to the kernels.
Kernels never import distributed code.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ..dq_sum import DQPart
from ..merge import LOG2E, DeltaOf
from . import configs
from .backward import _delta_kernel, _dkdv_kernel, _dq_kernel
from .forward import _fwd_kernel
from .key_bias import key_spans
from .launcher import launch, on_device
from .rows import _scatter_rows_kernel
from .tiles import MASK_NONE, MASK_ROWS, MASK_WINDOW, UNBOUNDED

TAKES_DQ_PARTS = True  # backward() takes a dq_sum.DQPart as dq (the fused kernel adds to its blocked buffer)


def _block_d(head_dim: int) -> int:
    """A head dim padded for the kernels: a power of two of at least 16 (zero columns)."""
    return max(16, triton.next_power_of_2(head_dim))


def head_dim_pieces(head_dim: int) -> tuple[int, int]:
    """(main, tail): a head dim (q/k's or v's) as the Gluon forward's tiles hold it, a
    power-of-two piece and a smaller power-of-two tail (0: none), when the two cover fewer
    columns than _block_d's one tile: 192 -> (128, 64), 96 -> (64, 32), 80 -> (64, 16);
    128 -> (128, 0), 224 -> (256, 0). Tiles must be powers of two; the tail's columns past
    head_dim are read as zeros."""
    padded = _block_d(head_dim)
    main = padded // 2
    tail = _block_d(head_dim - main) if head_dim > main else 0
    return (main, tail) if 0 < tail < main else (padded, 0)


def _config_d(block_d: int, block_dv: int) -> int:
    """The padded head dim the block-shape tables are looked up by: the larger of q/k's and v's.
    A config tuned (and checked to fit) for equal dims of that size is then an upper bound on
    every tile, shared-memory stage and accumulator of the launch; a config for the smaller dim
    could overflow (D = 32 with Dv = 256: a 128 x 256 float32 accumulator in 4 warps). Equal dims
    look up exactly the entry they always did."""
    return max(block_d, block_dv)


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs get true float32 products (torch's own float32 matmul does not use tf32)
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_dtype(q: torch.Tensor, fn: str) -> None:
    """q (B, Sq, Hq, D) of the block that `fn` (this module's forward or backward) runs: its
    dtype, which k and v share (checked before), must be one the kernels take."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"ringflash.kernels.{fn}: q (and k, v) has dtype {q.dtype}; the Triton backend supports float16, "
            'bfloat16 and float32 (the torch backend takes float64: ringflash.local.use_backend("torch"))'
        )


def _bsh(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _tma_ok(t: torch.Tensor) -> bool:
    """Tensor descriptors need a 16-byte aligned base and 16-byte aligned outer strides."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((st * size) % 16 == 0 for st in t.stride()[:-1])


def _maybe_descriptors(cfg, tensors, rows, block_ds):
    """(True, descriptors with blocks [1, rows, 1, block_d], block_d the tensor's entry of
    block_ds: its padded head dim) when the config asks for TMA and every tensor allows it,
    else (False, the tensors)."""
    if not (cfg.tma and all(_tma_ok(t) for t in tensors)):
        return False, tensors
    from triton.tools.tensor_descriptor import TensorDescriptor

    return True, tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, block_d])
                       for t, block_d in zip(tensors, block_ds, strict=True))


def _bias_args(key_bias, q, scale):
    """(key bias pointer, its key_spans, its batch stride, HAS_BIAS); q stands in for the
    pointers when there is no bias."""
    if key_bias is None:
        return q, q, 0, False
    return key_bias, key_spans(key_bias, scale), key_bias.stride(0), True


def _stat_strides(*stats):
    """(batch, head) strides shared by the (B, H, S) row statistics."""
    assert len({t.stride() for t in stats}) == 1, "row statistics must share strides"
    return stats[0].stride(0), stats[0].stride(1)


def _scale_sign(scale: float) -> int:
    return (scale > 0) - (scale < 0)


def _mask_args(window, bounds, q):
    """(MASK, win_left, win_right, LEFT for the key side, LEFT for the query side, (KLO, KHI),
    (QLO, QHI)) for a block: per-row bounds (packed documents) when given, else a window (None:
    every key); q stands in for unused pointers."""
    unbounded = UNBOUNDED.value
    if bounds is not None:
        return (MASK_ROWS.value, unbounded, unbounded, True, True, (bounds.k_lo, bounds.k_hi),
                (bounds.q_lo, bounds.q_hi))
    if window is None or window.is_full:
        return MASK_NONE.value, unbounded, unbounded, False, False, (q, q), (q, q)
    left = unbounded if window.left is None else window.left
    right = unbounded if window.right is None else window.right
    return MASK_WINDOW.value, left, right, window.left is not None, window.right is not None, (q, q), (q, q)


_NO_DROPOUT = (0, 0, 0, 0, 0, 0, 1.0)


def _dropout_args(dropout):
    """(the kernels' drop_* arguments, DROPOUT) for a ringflash.dropout.Dropout or None."""
    return (_NO_DROPOUT, False) if dropout is None else (dropout.kernel_args(), True)


def forward(q, k, v, state, *, q_start, k_start, window, bounds, scale, fold, normalize, key_bias=None,
            dropout=None):
    """See ringflash.reference.forward."""
    _check_dtype(q, "forward")
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    block_d, block_dv = _block_d(D), _block_d(Dv)
    drop_args, has_dropout = _dropout_args(dropout)
    gluon_ok = not has_dropout and (key_bias is None or configs.GLUON_KEY_BIAS)
    config_d = _config_d(block_d, block_dv)
    if gluon_ok and _gluon_forward(
        q, k, v, state, q_start, k_start, window, bounds, scale, fold, normalize, config_d, key_bias
    ):
        return
    cfg = configs.forward_config(config_d, documents=bounds is not None,
                                 float32=q.dtype == torch.float32)
    grid = (triton.cdiv(Sq, cfg.block_m), B * Hq)
    bias, spans, stride_bias_b, has_bias = _bias_args(key_bias, q, scale)
    mask, left, right, left_k, _, (k_lo, k_hi), _ = _mask_args(window, bounds, q)
    use_tma, (k_arg, v_arg) = _maybe_descriptors(cfg, (k, v), cfg.block_n, (block_d, block_dv))
    with on_device(q):
        launch(
            _fwd_kernel, grid,
            q, k_arg, v_arg, state.o, state.m, state.l, bias, spans, k_lo, k_hi,
            *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(state.o), *_stat_strides(state.m, state.l), stride_bias_b,
            Hq, Sq, Sk, q_start, k_start, left, right, scale * LOG2E, *drop_args,
            GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, HEAD_DIM_V=Dv, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, MASK=mask, LEFT=left_k, HAS_STATE=fold, NORMALIZE=normalize, HAS_BIAS=has_bias,
            PRECISION=_precision(q.dtype), TMA=use_tma, WARP_SPECIALIZE=cfg.warp_specialize,
            SCALE_SIGN=_scale_sign(scale), DROPOUT=has_dropout, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def _documents_keys_per_row(bounds) -> float | None:
    """The keys per row a packed-documents block's forward tile choice goes by: over every row,
    or over the rows that see a key (configs.GLUON_DOCUMENTS_SEEING_ROWS); None without bounds."""
    if bounds is None:
        return None
    return bounds.keys_per_seeing_row if configs.GLUON_DOCUMENTS_SEEING_ROWS else bounds.keys_per_row


def _gluon_forward(
    q, k, v, state, q_start, k_start, window, bounds, scale, fold, normalize, config_d, key_bias=None
) -> bool:
    """Run the block on the Gluon forward where it is faster and takes these inputs (Hopper,
    16-bit, any mask, a key bias; v's head dim may differ from q/k's: configs.gluon_forward_variant
    by the larger padded head dim config_d; a head dim under its padding reads zero columns);
    False: the caller runs the Triton one."""
    variant = configs.gluon_forward_variant(
        config_d,
        documents=bounds is not None,
        keys_per_row=_documents_keys_per_row(bounds),
        # sliding windows (a left bound) take the one-tile default whatever the key count: the
        # persistent and three-consumer variants were measured on dense and causal blocks only
        # (and spill with a left bound: benchmarks/gluon_report.py --masks window)
        keys=None if window is not None and window.left is not None else k.shape[1],
        # (the wide key blocks take no head-dim pieces: a head dim under its padding has them;
        # nor a key bias, loaded a key block of one piece at a time)
        dense=window is None and bounds is None and key_bias is None and q.shape[-1] == v.shape[-1] == config_d,
        causal=window is not None and window.left is None,
    )
    if variant is None or not q.is_cuda:
        return False
    from . import gluon_forward

    try:  # it launches on q's device itself
        gluon_forward.forward(q, k, v, q_start=q_start, k_start=k_start, window=window, bounds=bounds,
                              scale=scale, out_o=state.o, out_m=state.m, out_l=state.l, normalize=normalize,
                              fold=fold, config=variant, key_bias=key_bias)  # fmt: skip
    except gluon_forward.Unsupported:  # raised before anything is written
        return False
    return True


def delta(o, do):
    """rowsum(dO * O): (B, S, H, Dv) x2 -> (B, H, S) float32."""
    B, S, H, D = o.shape
    out = torch.empty(B, H, S, dtype=torch.float32, device=o.device)
    block_m = 32 if configs.INTERPRETING else 128
    with on_device(o):
        launch(
            _delta_kernel, (triton.cdiv(S, block_m), B * H),
            o, do, out, *_bsh(o), *_bsh(do), out.stride(0), out.stride(1), H, S,
            HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=block_m,
        )
    return out


_rowsum = delta  # for the backward, whose argument of that name shadows it


def scatter_rows(dst, rows, src):
    """dst[:, rows[i]] = src[:, i] for i < len(rows): dst (B, N, ...), src (B, >= len(rows),
    ...) of dst's dtype, rows int64 (distinct). Each row's trailing dims must be one contiguous
    run in both (else torch's index_copy_)."""
    n = len(rows)
    width = math.prod(dst.shape[2:])
    if not (_rows_contiguous(dst) and _rows_contiguous(src)) or src.dtype != dst.dtype:
        dst.index_copy_(1, rows, src[:, :n])
        return
    if n == 0 or width == 0:
        return
    block_w = min(1024, triton.next_power_of_2(width))
    block_r = max(1, 4096 // block_w)
    with on_device(dst):
        launch(
            _scatter_rows_kernel, (triton.cdiv(n, block_r), triton.cdiv(width, block_w), dst.shape[0]),
            src, dst, rows, n, width, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            BLOCK_R=block_r, BLOCK_W=block_w,
        )  # fmt: skip


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row t[b, i] (its trailing dims) is one contiguous run."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def combined_stats(m, l):
    """m + log2(l) per row, +inf for rows that saw no key: the dK/dV pass's one offset per row
    for 16-bit inputs (configs.KernelConfig.combined_stats). Laid out with m's strides (m is
    often a view of a ring block's rows), as the kernel reads M, L and DELTA at one offset."""
    out = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=m.device)
    return out.copy_(torch.where(l > 0, m + torch.log2(l), float("inf")))


def fuses_backward(
    q, k, v, *, window, bounds, key_bias=None, dropout=None, deterministic=False, whole_call=False
) -> bool:
    """Whether backward() given dq, dk and dv together runs this block as one fused kernel
    (the Gluon backward on Hopper: 16-bit, the larger head dim padded to a tuned width
    (configs.GLUON_BWD; v's differing from q/k's only where that variant splits the head dim,
    i.e. 256), dense,
    causal, a sliding window or per-row bounds (configs.GLUON_BWD_DOCUMENTS), a key bias only
    with configs.GLUON_KEY_BIAS, no dropout, enough key blocks x kv heads to fill the GPU:
    configs.GLUON_BWD_MIN_PROGRAMS_PER_SM,
    or whole_call (the block is a one-device call's whole attention) and at most
    configs.GLUON_BWD_SHORT_CALL_PAIRS, unless override(gluon_bwd=) forces it). Its dQ is added
    in float32 by atomics, whose order varies: not bitwise reproducible, so deterministic=True
    says no. A caller that can compute dQ and dK/dV in one call should then do so (the ring's
    backward). Per-row bounds also need configs.GLUON_BWD_DOCUMENTS_MIN_PAIRS visible pairs x
    query heads."""
    if deterministic or dropout is not None or not q.is_cuda:
        return False
    if key_bias is not None and not configs.GLUON_KEY_BIAS:
        return False
    return fused_backward_fits(q, k, v, bounds, _fused_backward_sms(q.device), whole_call)


def fused_backward_fits(q, k, v, bounds, sm_count: int, whole_call: bool = False) -> bool:
    """fuses_backward's choice for a block without key bias or dropout on a GPU of sm_count SMs
    (0: not one the fused kernel runs on), from shapes, dtypes and the bounds alone (any device);
    whole_call: the block is a one-device call's whole attention."""
    D = max(q.shape[-1], v.shape[-1])
    if not sm_count or q.dtype == torch.float32:
        return False
    variant = configs.gluon_backward_variant(_block_d(D), documents=bounds is not None)
    if variant is None:
        return False
    from . import gluon_backward

    # (a forced variant may not have this head dim)
    cfg = gluon_backward.VARIANTS.get(variant, {}).get(_block_d(D))
    if cfg is None or (v.shape[-1] != q.shape[-1] and not cfg.split_d):
        return False
    if configs.overridden("gluon_bwd"):  # forced: any size
        return True
    if bounds is not None and bounds.keys_per_row is not None:
        # a call this small is faster as two passes: the fused launch's host time shows
        pairs = q.shape[0] * q.shape[1] * q.shape[2] * bounds.keys_per_row
        if pairs < configs.GLUON_BWD_DOCUMENTS_MIN_PAIRS:
            return False
    # a short one-device call: one launch instead of the passes' several saves more host time
    # than the SMs left idle cost
    if whole_call and q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] <= configs.GLUON_BWD_SHORT_CALL_PAIRS:
        return True
    # one program per key block and kv head: too few to fill the GPU lose to the two passes
    key_blocks = -(-k.shape[1] // cfg.block_n)
    return k.shape[0] * k.shape[2] * key_blocks >= configs.GLUON_BWD_MIN_PROGRAMS_PER_SM * sm_count


@functools.lru_cache(maxsize=16)
def _fused_backward_sms(device: torch.device) -> int:
    """The SM count of a device the fused backward runs on (Gluon importable, Hopper), else 0;
    once per device: the ring asks for every task of every step."""
    from . import gluon_backward

    if not gluon_backward.HAS_GLUON or torch.cuda.get_device_capability(device) != (9, 0):
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gluon_backward(
    q, k, v, m, l, do, delta, dq, dk, dv, q_start, k_start, window, bounds, scale, accumulate, key_bias=None
) -> bool:
    """Run the block on the fused Gluon backward (the caller checked fuses_backward); False:
    it does not take these tensors (strides, alignment, sizes), nothing written, the caller runs
    the Triton passes. dq: a tensor, or a DQPart, whose call's blocked buffer the kernel adds to
    where the variant's dQ is blocked (no scratch, zeroing or finish per launch)."""
    from . import gluon_backward

    reaches = None if window is None or bounds is not None else (window.left, window.right)  # bounds decide alone
    D = max(q.shape[-1], v.shape[-1])
    variant = configs.gluon_backward_variant(_block_d(D), documents=bounds is not None)
    try:  # it launches on q's device itself
        if isinstance(dq, DQPart):
            blocked = dq.blocked() if gluon_backward.config_for(D, variant).dq_blocked else None
            dq = dq.tensor() if blocked is None else blocked
        gluon_backward.backward(q, k, v, m, l, do, delta, dq, dk, dv, q_start=q_start, k_start=k_start,
                                causal=False, scale=scale, accumulate=accumulate, config=variant,
                                window=reaches, bounds=bounds, key_bias=key_bias)  # fmt: skip
    except gluon_backward.Unsupported:
        return False
    return True


def backward(q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, window, bounds, scale, accumulate,
             key_bias=None, dropout=None, deterministic=False, whole_call=False):
    """See ringflash.reference.backward. m, l and delta: (B, Hq, Sq) views with equal strides
    (delta may be a merge.DeltaOf: the fused kernel's statistics launch computes it, else it is
    computed here first; dq may be a dq_sum.DQPart: the fused kernel adds to its blocked buffer,
    the passes to its row-major view).
    Given dq, dk and dv together, a block fuses_backward accepts runs as one fused kernel
    (dQ not bitwise reproducible); otherwise, or with deterministic=True, the dK/dV and dQ
    passes run (bitwise reproducible). whole_call: as fuses_backward's."""
    _check_dtype(q, "backward")
    if (
        dq is not None
        and dk is not None
        and fuses_backward(q, k, v, window=window, bounds=bounds, key_bias=key_bias, dropout=dropout,
                           deterministic=deterministic, whole_call=whole_call)  # fmt: skip
        and _gluon_backward(
            q, k, v, m, l, do, delta, dq, dk, dv, q_start, k_start, window, bounds, scale, accumulate, key_bias
        )
    ):
        return
    if isinstance(dq, DQPart):
        dq = dq.tensor()
    if isinstance(delta, DeltaOf):
        delta = delta.value(do, _rowsum)
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    block_d, block_dv = _block_d(D), _block_d(Dv)
    config_d = _config_d(block_d, block_dv)
    bias, spans, stride_bias_b, has_bias = _bias_args(key_bias, q, scale)
    mask, left, right, left_k, left_q, (k_lo, k_hi), (q_lo, q_hi) = _mask_args(window, bounds, q)
    drop_args, has_dropout = _dropout_args(dropout)
    common = dict(GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, HEAD_DIM_V=Dv, BLOCK_DV=block_dv, MASK=mask,
                  ACCUMULATE=accumulate, HAS_BIAS=has_bias, PRECISION=_precision(q.dtype),
                  SCALE_SIGN=_scale_sign(scale), DROPOUT=has_dropout)
    positions = (Sq, Sk, q_start, k_start, left, right, scale * LOG2E, scale, *drop_args)
    stat_strides = _stat_strides(m, l, delta)
    with on_device(q):
        if dk is not None:
            cfg = configs.dkdv_config(config_d, documents=bounds is not None, float32=q.dtype == torch.float32)
            combined = cfg.combined_stats and q.dtype != torch.float32
            m_arg, l_arg = (combined_stats(m, l),) * 2 if combined else (m, l)
            assert _stat_strides(m_arg) == stat_strides
            tma, (q_arg, do_arg) = _maybe_descriptors(cfg, (q, do), cfg.block_m, (block_d, block_dv))
            launch(
                _dkdv_kernel, (triton.cdiv(Sk, cfg.block_n), B * Hkv),
                q_arg, k, v, do_arg, m_arg, l_arg, delta, dk, dv, bias, spans, q_lo, q_hi,
                *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(do), *_bsh(dk), *_bsh(dv),
                *stat_strides, stride_bias_b, Hkv, *positions,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LEFT=left_q, TMA=tma, QK_ORDER=cfg.qk_order,
                COMBINED_STATS=combined, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
            )
        if dq is not None:
            cfg = configs.dq_config(config_d, documents=bounds is not None, float32=q.dtype == torch.float32)
            tma, (k_arg, v_arg) = _maybe_descriptors(cfg, (k, v), cfg.block_n, (block_d, block_dv))
            launch(
                _dq_kernel, (triton.cdiv(Sq, cfg.block_m), B * Hq),
                q, k_arg, v_arg, do, m, l, delta, dq, bias, spans, k_lo, k_hi,
                *_bsh(q), *_bsh(k), *_bsh(v), *_bsh(do), *_bsh(dq),
                *stat_strides, stride_bias_b, Hq, *positions,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LEFT=left_k, TMA=tma,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
            )
