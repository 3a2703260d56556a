"""Triton backward kernels: delta = rowsum(dO * O), then dK/dV and dQ in separate passes.

Every block uses the final row statistics (m, l) of its query rows, so a ring step's gradients
need no re-merge, and rebuilds each probability as exp2(s2 - m) / l with the forward's own
arithmetic (base2_scores, exp2_shifted). dK/dV programs own a key tile and loop over the
query blocks that see it (tiles.key_query_bounds, the mirror of the forward's key ranges) for
each q head of the GQA group; dQ programs own a query tile and loop over its visible key
blocks as the forward does. No atomics, so results are bitwise reproducible. With ACCUMULATE
the gradients are added to the caller's (float32) buffers, otherwise written.
"""

import triton
import triton.language as tl

from .tiles import (
    MASK_NONE,
    base2_scores,
    block_ranges,
    dropout_keep,
    exp2_probs,
    exp2_shifted,
    in_bounds,
    key_bias2,
    key_query_bounds,
    load_tile,
    plain_keys,
    plain_span,
    query_program,
    row_key_bounds,
    row_stats,
)


@triton.jit
def _delta_kernel(
    O, DO, DELTA,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh,
    H, S,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """DELTA (B, H, S) = rowsum(DO * O) of O, DO (B, S, H, HEAD_DIM): v's head dim Dv."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows64 = offs_m.to(tl.int64)
    mask = (offs_m[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows64[:, None] * stride_ds + offs_d[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + b * stride_lb + h * stride_lh + offs_m, tl.sum(o * do, 1), mask=offs_m < S)


@triton.jit
def _store_grad(ptrs, grad, mask, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        grad += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, grad.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_q_range(
    dk, dv, k, v, q_lo, q_hi, bias2, bias2_t, plain, plain_t, Q_ptrs, DO_ptrs, M_ptrs, L_ptrs, DELTA_ptrs, stride_qs,
    stride_dos, offs_m, d_ok, dv_ok, start, end, Sq, qk_scale, Q_desc, DO_desc, b32, h32, drop,
    MASKED: tl.constexpr, LEFT: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, PRESCALE: tl.constexpr,
    QK_ORDER: tl.constexpr, COMBINED_STATS: tl.constexpr, DROPOUT: tl.constexpr,
    PAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Add the query blocks [start, end) to the key tile's dK, dV; MASKED: each key is seen only
    by the query rows [q_lo, q_hi) (tiles.in_bounds; LEFT: some q_lo is above 0).
    Q_ptrs / DO_ptrs (pointer path) and M_ptrs / L_ptrs / DELTA_ptrs point at query row `start`
    on entry. DROPOUT: drop = (seed low, seed high, threshold, the query index of query row 0,
    the tile's key indices, the head offset, 1 / (1 - p)): dV takes the kept probabilities scaled, dS the kept
    dP scaled (the forward's mask, rebuilt). Q tiles and dK are (.., BLOCK_D) over q/k's head dim,
    dO tiles, v and dV (.., BLOCK_DV) over v's (dv_ok, PAD_DV). bias2 / plain (a row of the
    tile's keys) and bias2_t / plain_t (a column): the keys' bias and which of them lie in the
    zero-bias span (base2_scores)."""
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        q = load_tile(Q_ptrs, Q_desc, b32, start_m, h32, rows, Sq, d_ok, MASKED, PAD_D, TMA, BLOCK_M, BLOCK_D)
        do = load_tile(DO_ptrs, DO_desc, b32, start_m, h32, rows, Sq, dv_ok, MASKED, PAD_DV, TMA, BLOCK_M, BLOCK_DV)
        if COMBINED_STATS:  # M holds m + log2(l) per row (+inf for a row that saw no key)
            if MASKED:
                m = tl.load(M_ptrs, mask=rows < Sq, other=float("inf"))
            else:
                m = tl.load(M_ptrs)
        else:
            m, inv_l = row_stats(M_ptrs, L_ptrs, rows, Sq, MASKED)
        if MASKED:
            delta = tl.load(DELTA_ptrs, mask=rows < Sq, other=0.0)
        else:
            delta = tl.load(DELTA_ptrs)
        if QK_ORDER:
            # the scores as the forward computed them, Q K^T, then transposed: the rebuilt
            # probabilities are the forward's to the last bit wherever the matmul is
            # deterministic for a tile shape (the CPU interpreter's BLAS is not symmetric in
            # its operands)
            s, scale = base2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, bias2, PRESCALE,
                                    plain)  # fmt: skip
            if COMBINED_STATS:
                p_t = tl.trans(exp2_shifted(s, scale, m))
            else:
                p_t = tl.trans(exp2_probs(s, scale, m, inv_l))
        else:
            s_t, scale = base2_scores(tl.dot(k, tl.trans(q), input_precision=PRECISION), qk_scale, bias2_t, PRESCALE,
                                      plain_t)  # fmt: skip
            e_t = tl.math.exp2(tl.fma(s_t, scale, -m[None, :]))
            if COMBINED_STATS:
                p_t = e_t
            else:
                p_t = e_t * inv_l[None, :]
        if MASKED:  # the same pairs as the forward's row bounds, seen from the keys
            p_t = tl.where(in_bounds(rows[None, :], q_lo[:, None], q_hi[:, None], LEFT), p_t, 0.0)
        if DROPOUT:
            seed_lo, seed_hi, thr, q0, k_idx, h0, keep_scale = drop
            keep_t = dropout_keep(seed_lo, seed_hi, thr, b32, h32 + h0, (q0 + rows)[None, :], k_idx[:, None])
            dv = tl.dot(tl.where(keep_t, p_t * keep_scale, 0.0).to(do.dtype), do, dv, input_precision=PRECISION)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            dp_t = tl.where(keep_t, dp_t * keep_scale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
        if not TMA:
            Q_ptrs += BLOCK_M * stride_qs
            DO_ptrs += BLOCK_M * stride_dos
        M_ptrs += BLOCK_M
        if not COMBINED_STATS:
            L_ptrs += BLOCK_M
        DELTA_ptrs += BLOCK_M
    return dk, dv


_NOT_SPECIALIZED = ["Sq", "Sk", "q_start", "k_start", "win_left", "win_right", "drop_seed_lo", "drop_seed_hi",
                    "drop_thr", "drop_q0", "drop_k0", "drop_h0"]


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _dkdv_kernel(
    Q, K, V, DO, M, L, DELTA, DK, DV, BIAS, SPANS, QLO, QHI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_bias_b,
    Hkv, Sq, Sk, q_start, k_start, win_left, win_right, qk_scale, sm_scale,
    drop_seed_lo, drop_seed_hi, drop_thr, drop_q0, drop_k0, drop_h0, drop_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, LEFT: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, SCALE_SIGN: tl.constexpr = 1, QK_ORDER: tl.constexpr = False,
    COMBINED_STATS: tl.constexpr = False, DROPOUT: tl.constexpr = False,
):
    """Q, K, DK (.., D) and V, DO, DV (.., Dv): HEAD_DIM = D and HEAD_DIM_V = Dv, padded to BLOCK_D
    and BLOCK_DV (equal when D = Dv). Q and DO are tensors, or descriptors with blocks
    [1, BLOCK_M, 1, BLOCK_D] and [1, BLOCK_M, 1, BLOCK_DV] when TMA. M, L, DELTA: (B, Hq, Sq)
    float32 with equal strides. MASK, win_left, win_right: as
    the forward's; QLO / QHI (Sk,) int32: the global query bounds [lo, hi) of each key for
    MASK_ROWS. LEFT here: some key is seen only from a query row after 0
    (causal, a window's right side, documents). QK_ORDER:
    recompute the scores as Q K^T (the forward's operand order) and transpose them, instead of
    K Q^T. COMBINED_STATS: M holds m + log2(l) per row
    (L unused) and the probabilities are exp2(s2 - (m + log2 l)), one offset per row and no
    multiply by 1/l per score; the rounding of m + log2 l (2^-24 |m| relative) then enters every
    probability: below a 16-bit rounding of them unless |m| > 2^13. SCALE_SIGN: the sign of
    qk_scale (1, 0 or -1). DROPOUT, drop_*: as the forward's. BIAS, SPANS: as the forward's."""
    PRESCALE: tl.constexpr = HAS_BIAS or SCALE_SIGN == 0
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    col_ok = offs_n < Sk
    tile_mask = col_ok[:, None] & d_ok
    tile_mask_v = col_ok[:, None] & dv_ok
    cols64 = offs_n.to(tl.int64)
    # the query rows that see each key, and the query blocks: masked [start, full_start),
    # unmasked [full_start, full_end), masked [full_end, end)
    q_lo, q_hi = key_query_bounds(offs_n, Sq, Sk, q_start, k_start, win_left, win_right, QLO, QHI, MASK)
    start, full_start, full_end, end = block_ranges(q_lo, q_hi, col_ok, Sq, BLOCK_M, LEFT)
    if ACCUMULATE:
        if start >= end:  # no query sees the tile: nothing to add (a ring step's idle keys)
            return
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols64[:, None] * stride_ks + offs_d[None, :],
                mask=tile_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + cols64[:, None] * stride_vs + offs_dv[None, :],
                mask=tile_mask_v, other=0.0)
    # the key tile's bias in base-2 units, as a row (Q K^T order) and as a column (K Q^T); 0.0
    # without one
    bias2 = key_bias2(BIAS + b * stride_bias_b + offs_n, offs_n, Sk, True, HAS_BIAS)
    if HAS_BIAS:
        bias2_t = tl.trans(bias2)
    else:
        bias2_t = 0.0
    span = plain_span(SPANS, b, Sk, HAS_BIAS)
    plain, plain_t = plain_keys(offs_n[None, :], span), plain_keys(offs_n[:, None], span)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    b32 = b.to(tl.int32)
    drop = (drop_seed_lo, drop_seed_hi, drop_thr, drop_q0, drop_k0 + offs_n, drop_h0, drop_scale)
    for g in range(GROUP):
        h = hk * GROUP + g
        h32 = h.to(tl.int32)
        stat_offs = b * stride_lb + h * stride_lh + offs_m
        M_ptrs, L_ptrs, DELTA_ptrs = M + stat_offs, L + stat_offs, DELTA + stat_offs
        if TMA:  # rows come from the descriptors; the pointer arguments are unused
            Q_ptrs, DO_ptrs = DELTA_ptrs, DELTA_ptrs
        else:
            Q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
            DO_ptrs = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_dv[None, :]
        if LEFT:  # masked: the diagonal of a causal block, a window's edge
            at = start.to(tl.int64)
            dk, dv = _dkdv_q_range(
                dk, dv, k, v, q_lo, q_hi, bias2, bias2_t, plain, plain_t, Q_ptrs + at * stride_qs,
                DO_ptrs + at * stride_dos,
                M_ptrs + at, L_ptrs + at, DELTA_ptrs + at, stride_qs, stride_dos,
                offs_m, d_ok, dv_ok, start, full_start, Sq, qk_scale, Q, DO, b32, h32, drop,
                MASKED=True, LEFT=LEFT, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
                PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER, COMBINED_STATS=COMBINED_STATS,
                DROPOUT=DROPOUT, PAD_DV=PAD_DV, BLOCK_DV=BLOCK_DV)
        at = full_start.to(tl.int64)  # query blocks that see every key of the tile: no mask
        dk, dv = _dkdv_q_range(
            dk, dv, k, v, q_lo, q_hi, bias2, bias2_t, plain, plain_t, Q_ptrs + at * stride_qs,
            DO_ptrs + at * stride_dos,
            M_ptrs + at, L_ptrs + at, DELTA_ptrs + at, stride_qs, stride_dos,
            offs_m, d_ok, dv_ok, full_start, full_end, Sq, qk_scale, Q, DO, b32, h32, drop,
            MASKED=False, LEFT=LEFT, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
            PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER, COMBINED_STATS=COMBINED_STATS,
                DROPOUT=DROPOUT, PAD_DV=PAD_DV, BLOCK_DV=BLOCK_DV)
        at = full_end.to(tl.int64)  # masked: a window's other edge, the ragged end of the queries
        dk, dv = _dkdv_q_range(
            dk, dv, k, v, q_lo, q_hi, bias2, bias2_t, plain, plain_t, Q_ptrs + at * stride_qs,
            DO_ptrs + at * stride_dos,
            M_ptrs + at, L_ptrs + at, DELTA_ptrs + at, stride_qs, stride_dos,
            offs_m, d_ok, dv_ok, full_end, end, Sq, qk_scale, Q, DO, b32, h32, drop,
            MASKED=True, LEFT=LEFT, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
            PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER, COMBINED_STATS=COMBINED_STATS,
                DROPOUT=DROPOUT, PAD_DV=PAD_DV, BLOCK_DV=BLOCK_DV)

    _store_grad(DK + b * stride_dkb + hk * stride_dkh + cols64[:, None] * stride_dks + offs_d[None, :],
                dk * sm_scale, tile_mask, ACCUMULATE)
    _store_grad(DV + b * stride_dvb + hk * stride_dvh + cols64[:, None] * stride_dvs + offs_dv[None, :],
                dv, tile_mask_v, ACCUMULATE)


@triton.jit
def _dq_k_range(
    dq, q, do, m, delta, lo_i, hi_i, K_ptrs, V_ptrs, BIAS_ptrs, stride_ks, stride_vs, offs_n, d_ok, dv_ok,
    start, end, Sk, qk_scale, K_desc, V_desc, b32, hk32, h32, drop, span,
    MASKED: tl.constexpr, LEFT: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, PRESCALE: tl.constexpr,
    DROPOUT: tl.constexpr, PAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Add the key blocks [start, end) to the query tile's dQ (times l: 1/l is applied at the
    end); MASKED: each row sees only its keys [lo_i, hi_i) (tiles.in_bounds). K_ptrs / V_ptrs (pointer path) and
    BIAS_ptrs point at key row `start` on entry. DROPOUT: drop as the forward's (dS takes the
    kept dP scaled). span: the batch row's zero-bias keys (tiles.plain_span)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(K_ptrs, K_desc, b32, start_n, hk32, cols, Sk, d_ok, MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        v = load_tile(V_ptrs, V_desc, b32, start_n, hk32, cols, Sk, dv_ok, MASKED, PAD_DV, TMA, BLOCK_N, BLOCK_DV)
        bias2 = key_bias2(BIAS_ptrs, cols, Sk, MASKED, HAS_BIAS)
        s, scale = base2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, bias2, PRESCALE,
                                plain_keys(cols[None, :], span))  # fmt: skip
        # exp2(s2 - m): the probabilities times l; dq's 1/l is applied once per row at the end
        p = exp2_shifted(s, scale, m)
        if MASKED:
            p = tl.where(in_bounds(cols[None, :], lo_i[:, None], hi_i[:, None], LEFT), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            seed_lo, seed_hi, thr, q_idx, k0, keep_scale = drop
            keep = dropout_keep(seed_lo, seed_hi, thr, b32, h32, q_idx[:, None], (k0 + cols)[None, :])
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if not TMA:
            K_ptrs += BLOCK_N * stride_ks
            V_ptrs += BLOCK_N * stride_vs
        BIAS_ptrs += BLOCK_N
    return dq


@triton.jit(do_not_specialize=_NOT_SPECIALIZED)
def _dq_kernel(
    Q, K, V, DO, M, L, DELTA, DQ, BIAS, SPANS, KLO, KHI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_bias_b,
    Hq, Sq, Sk, q_start, k_start, win_left, win_right, qk_scale, sm_scale,
    drop_seed_lo, drop_seed_hi, drop_thr, drop_q0, drop_k0, drop_h0, drop_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, LEFT: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, SCALE_SIGN: tl.constexpr = 1, DROPOUT: tl.constexpr = False,
):
    """Q, K, DQ (.., D) and V, DO (.., Dv): HEAD_DIM = D and HEAD_DIM_V = Dv, padded to BLOCK_D and
    BLOCK_DV (equal when D = Dv). K and V are tensors, or descriptors with blocks
    [1, BLOCK_N, 1, BLOCK_D] and [1, BLOCK_N, 1, BLOCK_DV] when TMA. M, L, DELTA: (B, Hq, Sq)
    float32 with equal strides. MASK, LEFT, win_left,
    win_right, KLO, KHI: as the forward's. SCALE_SIGN: the sign of qk_scale (1, 0 or -1).
    DROPOUT, drop_*: as the forward's. BIAS, SPANS: as the forward's."""
    PRESCALE: tl.constexpr = HAS_BIAS or SCALE_SIGN == 0
    pid_m, b, h, hk = query_program(Hq, GROUP, MASK != MASK_NONE)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    row_ok = offs_m < Sq
    tile_mask = row_ok[:, None] & d_ok
    rows64 = offs_m.to(tl.int64)
    lo_i, hi_i = row_key_bounds(offs_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
    start, full_start, full_end, end = block_ranges(lo_i, hi_i, row_ok, Sk, BLOCK_N, LEFT)
    if ACCUMULATE:
        if start >= end:  # no row sees a key: nothing to add (a ring step's idle rows)
            return
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :],
                mask=tile_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_dos + offs_dv[None, :],
                 mask=row_ok[:, None] & dv_ok, other=0.0)
    stat_offs = b * stride_lb + h * stride_lh + offs_m
    m, inv_l = row_stats(M + stat_offs, L + stat_offs, offs_m, Sq, True)
    delta = tl.load(DELTA + stat_offs, mask=row_ok, other=0.0)

    BIAS_ptrs = BIAS + b * stride_bias_b + offs_n
    if TMA:  # rows come from the descriptors; the pointer arguments are unused
        K_ptrs, V_ptrs = BIAS_ptrs, BIAS_ptrs
    else:
        K_ptrs = K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        V_ptrs = V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :]
    b32, hk32, h32 = b.to(tl.int32), hk.to(tl.int32), h.to(tl.int32) + drop_h0  # h32: dropout's head
    drop = (drop_seed_lo, drop_seed_hi, drop_thr, drop_q0 + offs_m, drop_k0, drop_scale)
    span = plain_span(SPANS, b, Sk, HAS_BIAS)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for part in tl.static_range(3):  # masked, unmasked, masked
        if part == 0:
            lo, hi = start, full_start
        elif part == 1:
            lo, hi = full_start, full_end
        else:
            lo, hi = full_end, end
        if part != 0 or LEFT:
            at = lo.to(tl.int64)
            dq = _dq_k_range(
                dq, q, do, m, delta, lo_i, hi_i, K_ptrs + at * stride_ks, V_ptrs + at * stride_vs, BIAS_ptrs + at,
                stride_ks, stride_vs, offs_n, d_ok, dv_ok, lo, hi, Sk, qk_scale, K, V, b32, hk32, h32, drop, span,
                MASKED=part != 1, LEFT=LEFT, PAD_D=PAD_D, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                HAS_BIAS=HAS_BIAS, PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, DROPOUT=DROPOUT,
                PAD_DV=PAD_DV, BLOCK_DV=BLOCK_DV)
    _store_grad(DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqs + offs_d[None, :],
                dq * (inv_l * sm_scale)[:, None], tile_mask, ACCUMULATE)
