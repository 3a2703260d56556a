"""Triton backward kernels: delta = rowsum(dO * O), then dK/dV and dQ in separate passes.

Every block uses the final row statistics (m, l) of its query rows, so a ring step's gradients
need no re-merge, and rebuilds each probability as exp2(s2 - m) / l with the forward's own
arithmetic (base2_scores, exp2_probs). dK/dV programs own a key tile and loop over the GQA group's query heads, dQ
programs own a query tile: no atomics, so results are bitwise reproducible. With ACCUMULATE
the gradients are added to the caller's (float32) buffers, otherwise written.
"""
import triton
import triton.language as tl

from .tiles import (
    base2_scores,
    exp2_probs,
    exp2_shifted,
    key_bias2,
    key_range,
    load_tile,
    query_program,
    query_range,
    row_stats,
    visible_keys,
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
    dk, dv, k, v, k_pos, bias2, bias2_t, Q_ptrs, DO_ptrs, M_ptrs, L_ptrs, DELTA_ptrs, stride_qs, stride_dos,
    offs_m, d_ok, lo, hi, q_start, Sq, qk_scale, Q_desc, DO_desc, b32, h32,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    PRESCALE: tl.constexpr, QK_ORDER: tl.constexpr, COMBINED_STATS: tl.constexpr,
):
    # Q_ptrs / DO_ptrs (pointer path) / M_ptrs / L_ptrs / DELTA_ptrs point at query row `lo` on entry
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = load_tile(Q_ptrs, Q_desc, b32, start_m, h32, rows, Sq, d_ok, MASKED, PAD_D, TMA, BLOCK_M, BLOCK_D)
        do = load_tile(DO_ptrs, DO_desc, b32, start_m, h32, rows, Sq, d_ok, MASKED, PAD_D, TMA, BLOCK_M, BLOCK_D)
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
            s, scale = base2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, bias2, PRESCALE)
            if COMBINED_STATS:
                p_t = tl.trans(exp2_shifted(s, scale, m))
            else:
                p_t = tl.trans(exp2_probs(s, scale, m, inv_l))
        else:
            s_t, scale = base2_scores(tl.dot(k, tl.trans(q), input_precision=PRECISION), qk_scale, bias2_t, PRESCALE)
            e_t = tl.math.exp2(tl.fma(s_t, scale, -m[None, :]))
            if COMBINED_STATS:
                p_t = e_t
            else:
                p_t = e_t * inv_l[None, :]
        if MASKED:
            visible = rows[None, :] < Sq
            if CAUSAL:
                visible = visible & ((q_start + rows)[None, :] >= k_pos[:, None])
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
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


@triton.jit(do_not_specialize=["Sq", "Sk", "q_start", "k_start"])
def _dkdv_kernel(
    Q, K, V, DO, M, L, DELTA, DK, DV, BIAS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_bias_b,
    Hkv, Sq, Sk, q_start, k_start, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, SCALE_SIGN: tl.constexpr = 1, QK_ORDER: tl.constexpr = False,
    COMBINED_STATS: tl.constexpr = False,
):
    """Q and DO are tensors, or (B, Sq, Hq, D) descriptors with blocks [1, BLOCK_M, 1, BLOCK_D]
    when TMA. M, L, DELTA: (B, Hq, Sq) float32 with equal strides. QK_ORDER: recompute the
    scores as Q K^T (the forward's operand order) and transpose them, instead of K Q^T.
    COMBINED_STATS: M holds m + log2(l) per row (L unused) and the probabilities are
    exp2(s2 - (m + log2 l)), one offset per row and no multiply by 1/l per score; the rounding of
    m + log2 l (2^-24 |m| relative) then enters every probability: below a 16-bit rounding of
    them unless |m| > 2^13. SCALE_SIGN: the sign of qk_scale (1, 0 or -1)."""
    PRESCALE: tl.constexpr = HAS_BIAS or SCALE_SIGN == 0
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    tile_mask = (offs_n[:, None] < Sk) & d_ok
    cols64 = offs_n.to(tl.int64)
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols64[:, None] * stride_ks + offs_d[None, :],
                mask=tile_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + cols64[:, None] * stride_vs + offs_d[None, :],
                mask=tile_mask, other=0.0)
    k_pos = k_start + offs_n
    # the key tile's bias in base-2 units, as a row (Q K^T order) and as a column (K Q^T); 0.0
    # without one
    bias2 = key_bias2(BIAS + b * stride_bias_b + offs_n, offs_n, Sk, True, HAS_BIAS)
    if HAS_BIAS:
        bias2_t = tl.trans(bias2)
    else:
        bias2_t = 0.0

    # Query rows that see some key of this tile, and the subrange that sees all of them.
    lo, full_lo, Sq_full = query_range(pid_n, q_start, k_start, Sq, Sk, CAUSAL, BLOCK_M, BLOCK_N)
    lo64 = lo.to(tl.int64)
    full64 = full_lo.to(tl.int64)
    end64 = Sq_full.to(tl.int64)
    tail_lo = tl.maximum(full_lo, Sq_full)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    tail64 = tl.maximum(full64, end64)
    b32 = b.to(tl.int32)
    for g in range(GROUP):
        h = hk * GROUP + g
        h32 = h.to(tl.int32)
        stat_offs = b * stride_lb + h * stride_lh + offs_m
        M_ptrs, L_ptrs, DELTA_ptrs = M + stat_offs, L + stat_offs, DELTA + stat_offs
        if TMA:  # rows come from the descriptors; the pointer arguments are unused
            Q_ptrs, DO_ptrs = DELTA_ptrs, DELTA_ptrs
            Q_lo, DO_lo, Q_full, DO_full, Q_tail, DO_tail = (DELTA_ptrs, DELTA_ptrs, DELTA_ptrs, DELTA_ptrs,
                                                            DELTA_ptrs, DELTA_ptrs)
        else:
            Q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
            DO_ptrs = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dos + offs_d[None, :]
            Q_lo, DO_lo = Q_ptrs + lo64 * stride_qs, DO_ptrs + lo64 * stride_dos
            Q_full, DO_full = Q_ptrs + full64 * stride_qs, DO_ptrs + full64 * stride_dos
            Q_tail, DO_tail = Q_ptrs + tail64 * stride_qs, DO_ptrs + tail64 * stride_dos
        # diagonal blocks (causal mask)
        dk, dv = _dkdv_q_range(
            dk, dv, k, v, k_pos, bias2, bias2_t, Q_lo, DO_lo, M_ptrs + lo64, L_ptrs + lo64, DELTA_ptrs + lo64,
            stride_qs, stride_dos,
            offs_m, d_ok, lo, full_lo, q_start, Sq, qk_scale, Q, DO, b32, h32,
            MASKED=True, CAUSAL=CAUSAL, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
            PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER,
            COMBINED_STATS=COMBINED_STATS)
        # fully visible blocks
        dk, dv = _dkdv_q_range(
            dk, dv, k, v, k_pos, bias2, bias2_t, Q_full, DO_full, M_ptrs + full64, L_ptrs + full64, DELTA_ptrs + full64,
            stride_qs, stride_dos, offs_m, d_ok, full_lo, Sq_full, q_start, Sq, qk_scale, Q, DO, b32, h32,
            MASKED=False, CAUSAL=CAUSAL, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
            PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER,
            COMBINED_STATS=COMBINED_STATS)
        # ragged tail of the query rows
        dk, dv = _dkdv_q_range(
            dk, dv, k, v, k_pos, bias2, bias2_t, Q_tail, DO_tail, M_ptrs + tail64, L_ptrs + tail64, DELTA_ptrs + tail64,
            stride_qs, stride_dos, offs_m, d_ok, tail_lo, Sq, q_start, Sq, qk_scale, Q, DO, b32, h32,
            MASKED=True, CAUSAL=CAUSAL, PAD_D=PAD_D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
            PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE, QK_ORDER=QK_ORDER,
            COMBINED_STATS=COMBINED_STATS)

    _store_grad(DK + b * stride_dkb + hk * stride_dkh + cols64[:, None] * stride_dks + offs_d[None, :],
                dk * sm_scale, tile_mask, ACCUMULATE)
    _store_grad(DV + b * stride_dvb + hk * stride_dvh + cols64[:, None] * stride_dvs + offs_d[None, :],
                dv, tile_mask, ACCUMULATE)


@triton.jit
def _dq_k_range(
    dq, q, do, m, delta, q_pos, K_ptrs, V_ptrs, BIAS_ptrs, stride_ks, stride_vs, offs_n, d_ok,
    lo, hi, k_start, Sk, qk_scale, K_desc, V_desc, b32, hk32,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    PRESCALE: tl.constexpr,
):
    # K_ptrs / V_ptrs (pointer path) / BIAS_ptrs point at key row `lo` on entry
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(K_ptrs, K_desc, b32, start_n, hk32, cols, Sk, d_ok, MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        v = load_tile(V_ptrs, V_desc, b32, start_n, hk32, cols, Sk, d_ok, MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        bias2 = key_bias2(BIAS_ptrs, cols, Sk, MASKED, HAS_BIAS)
        s, scale = base2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, bias2, PRESCALE)
        # exp2(s2 - m): the probabilities times l; dq's 1/l is applied once per row at the end
        p = exp2_shifted(s, scale, m)
        if MASKED:
            p = tl.where(visible_keys(q_pos, cols, Sk, k_start, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if not TMA:
            K_ptrs += BLOCK_N * stride_ks
            V_ptrs += BLOCK_N * stride_vs
        BIAS_ptrs += BLOCK_N
    return dq


@triton.jit(do_not_specialize=["Sq", "Sk", "q_start", "k_start"])
def _dq_kernel(
    Q, K, V, DO, M, L, DELTA, DQ, BIAS,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_bias_b,
    Hq, Sq, Sk, q_start, k_start, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, SCALE_SIGN: tl.constexpr = 1,
):
    """K and V are tensors, or (B, Sk, Hkv, D) descriptors with blocks [1, BLOCK_N, 1, BLOCK_D]
    when TMA. M, L, DELTA: (B, Hq, Sq) float32 with equal strides. SCALE_SIGN: the sign of
    qk_scale (1, 0 or -1)."""
    PRESCALE: tl.constexpr = HAS_BIAS or SCALE_SIGN == 0
    pid_m, b, h, hk = query_program(Hq, GROUP, CAUSAL)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    row_ok = offs_m < Sq
    tile_mask = row_ok[:, None] & d_ok
    rows64 = offs_m.to(tl.int64)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :],
                mask=tile_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows64[:, None] * stride_dos + offs_d[None, :],
                 mask=tile_mask, other=0.0)
    stat_offs = b * stride_lb + h * stride_lh + offs_m
    m, inv_l = row_stats(M + stat_offs, L + stat_offs, offs_m, Sq, True)
    delta = tl.load(DELTA + stat_offs, mask=row_ok, other=0.0)
    q_pos = q_start + offs_m

    hi, full_end = key_range(pid_m, q_start, k_start, Sq, Sk, CAUSAL, BLOCK_M, BLOCK_N)

    skip = full_end.to(tl.int64)
    BIAS_ptrs = BIAS + b * stride_bias_b + offs_n
    if TMA:  # rows come from the descriptors; the pointer arguments are unused
        K_ptrs, V_ptrs, K_rest, V_rest = BIAS_ptrs, BIAS_ptrs, BIAS_ptrs, BIAS_ptrs
    else:
        K_ptrs = K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        V_ptrs = V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :]
        K_rest, V_rest = K_ptrs + skip * stride_ks, V_ptrs + skip * stride_vs
    b32, hk32 = b.to(tl.int32), hk.to(tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_k_range(dq, q, do, m, delta, q_pos, K_ptrs, V_ptrs, BIAS_ptrs, stride_ks, stride_vs, offs_n,
                     d_ok, 0, full_end, k_start, Sk, qk_scale, K, V, b32, hk32,
                     MASKED=False, CAUSAL=CAUSAL, PAD_D=PAD_D, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
                     PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE)
    dq = _dq_k_range(dq, q, do, m, delta, q_pos, K_rest, V_rest, BIAS_ptrs + skip, stride_ks, stride_vs,
                     offs_n, d_ok, full_end, hi, k_start, Sk, qk_scale, K, V, b32, hk32,
                     MASKED=True, CAUSAL=CAUSAL, PAD_D=PAD_D, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
                     PRECISION=PRECISION, TMA=TMA, PRESCALE=PRESCALE)
    _store_grad(DQ + b * stride_dqb + h * stride_dqh + rows64[:, None] * stride_dqs + offs_d[None, :],
                dq * (inv_l * sm_scale)[:, None], tile_mask, ACCUMULATE)
