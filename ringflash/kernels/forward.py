"""Triton forward kernel: one query tile against the keys its rows see, by global positions.

Each query row sees an interval of the block's keys (tiles.row_key_bounds: a window
q_pos - left <= k_pos <= q_pos + right with q_pos = q_start + row, k_pos = k_start + col, causal
being right = 0; or per-row intervals of packed documents), so a local diagonal block, a
fully visible ring block, a sliding window and packed documents are one kernel: key blocks no
row of the tile sees are skipped, those every row sees take the unmasked loop.

The softmax state of a row is (acc, m, l) (ringflash.merge): m the row max of the base-2
scores, l the sum of exp2(s2 - m), acc the unnormalized weighted sum of values. With
HAS_STATE the tile starts from an incoming float32 state instead of empty, which folds a ring
step into the running result without a merge pass; NORMALIZE writes acc / l in the output's
dtype (local attention), otherwise acc itself (a ring step). Softmax runs in base 2 with
log2(e) folded into the scale.
"""
import triton
import triton.language as tl

from .tiles import (
    MASK_NONE,
    base2_scores,
    block_ranges,
    dropout_keep,
    exp2_shifted,
    in_bounds,
    key_bias2,
    load_tile,
    plain_keys,
    plain_span,
    query_program,
    row_key_bounds,
    row_max,
)


@triton.jit
def _fwd_block_range(
    acc, l_i, m_i, q, lo_i, hi_i, K_ptrs, V_ptrs, BIAS_ptrs, stride_ks, stride_vs, offs_n, offs_d, offs_dv,
    start, end, Sk, qk_scale, K_desc, V_desc, b32, hk32, h32, drop, span,
    MASKED: tl.constexpr, LEFT: tl.constexpr, PAD_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, PRESCALE: tl.constexpr, NEGATIVE: tl.constexpr, DROPOUT: tl.constexpr,
    PAD_DV: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Fold key blocks [start, end) into the tile's state (acc, l_i, m_i) of query rows offs_m;
    MASKED: each row sees only its keys [lo_i, hi_i) (tiles.in_bounds; LEFT: some lo_i is above
    0). K_ptrs / V_ptrs / BIAS_ptrs point at key row `start` on entry (pointer path).
    DROPOUT: drop = (seed low, seed high, threshold, the rows' query indices, the key index of
    key row 0, 1 / (1 - p)) (tiles.dropout_keep) and h32 the query head's dropout index; l
    sums every probability, the values are weighed by the kept ones scaled. K tiles are
    (BLOCK_N, BLOCK_D) over q/k's head dim, V tiles (BLOCK_N, BLOCK_DV) over v's (offs_dv).
    span: the batch row's zero-bias keys (tiles.plain_span), scored as without a bias."""
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < HEAD_DIM_V
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        cols = start_n + offs_n
        k = load_tile(K_ptrs, K_desc, b32, start_n, hk32, cols, Sk, d_ok, MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        bias2 = key_bias2(BIAS_ptrs, cols, Sk, MASKED, HAS_BIAS)
        s, scale = base2_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, bias2, PRESCALE,
                                plain_keys(cols[None, :], span))  # fmt: skip
        if MASKED:  # invisible scores become what the row max ignores (+inf for min(s) * scale)
            seen = in_bounds(cols[None, :], lo_i[:, None], hi_i[:, None], LEFT)
            if NEGATIVE:
                s = tl.where(seen, s, float("inf"))
            else:
                s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, scale, NEGATIVE, PRESCALE))
        # A row that has seen no key yet keeps m = -inf; pivot on 0 so exp2 gives 0, not NaN.
        m_pivot = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = exp2_shifted(s, scale, m_pivot)
        alpha = tl.math.exp2(m_i - m_pivot)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(V_ptrs, V_desc, b32, start_n, hk32, cols, Sk, dv_ok, MASKED, PAD_DV, TMA, BLOCK_N, BLOCK_DV)
        if DROPOUT:
            seed_lo, seed_hi, thr, q_idx, k0, keep_scale = drop
            keep = dropout_keep(seed_lo, seed_hi, thr, b32, h32, q_idx[:, None], (k0 + cols)[None, :])
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
        if not TMA:
            K_ptrs += BLOCK_N * stride_ks
            V_ptrs += BLOCK_N * stride_vs
        BIAS_ptrs += BLOCK_N
    return acc, l_i, m_i


# Sequence lengths and positions are never specialized: a length of 1 must not turn them into
# compile-time constants (and a new compile per value).
@triton.jit(do_not_specialize=["Sq", "Sk", "q_start", "k_start", "win_left", "win_right", "drop_seed_lo",
                               "drop_seed_hi", "drop_thr", "drop_q0", "drop_k0", "drop_h0"])
def _fwd_kernel(
    Q, K, V, O, M, L, BIAS, SPANS, KLO, KHI,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_mb, stride_mh, stride_bias_b,
    Hq, Sq, Sk, q_start, k_start, win_left, win_right, qk_scale,
    drop_seed_lo, drop_seed_hi, drop_thr, drop_q0, drop_k0, drop_h0, drop_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr, LEFT: tl.constexpr, HAS_STATE: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    TMA: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False, SCALE_SIGN: tl.constexpr = 1,
    DROPOUT: tl.constexpr = False,
):
    """Q (B, Sq, Hq, D), K (B, Sk, Hkv, D), V (B, Sk, Hkv, Dv), O (B, Sq, Hq, Dv): HEAD_DIM = D and
    HEAD_DIM_V = Dv, padded to BLOCK_D and BLOCK_DV (equal when D = Dv). K and V are tensors, or
    tensor descriptors with blocks [1, BLOCK_N, 1, BLOCK_D] and [1, BLOCK_N, 1, BLOCK_DV] when
    TMA. M and L: (B, Hq, Sq) float32 with equal strides.
    MASK (tiles.MASK_*): which keys each query row sees; win_left / win_right for MASK_WINDOW
    (tiles.UNBOUNDED for an open side), KLO / KHI (Sq,) int32 global key bounds for MASK_ROWS.
    LEFT: some row's keys start after key 0 (a window's left side, documents), which adds a
    masked range before the unmasked one. SCALE_SIGN: the sign of qk_scale (1, 0 or -1).
    DROPOUT: attention dropout, drop_*: ringflash.dropout.Dropout.kernel_args(). HAS_BIAS:
    BIAS (B, Sk) float32 rows stride_bias_b apart, added to each key's scores (natural-log
    units), and SPANS its key_bias.key_spans (B, 3) int32; else any pointers."""
    PRESCALE: tl.constexpr = HAS_BIAS or SCALE_SIGN == 0
    NEGATIVE: tl.constexpr = SCALE_SIGN < 0 and not PRESCALE
    pid_m, b, h, hk = query_program(Hq, GROUP, MASK != MASK_NONE)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Sq
    tile_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    rows64 = offs_m.to(tl.int64)

    # the keys each row sees, and the key blocks: masked [start, full_start), unmasked
    # [full_start, full_end), masked [full_end, end)
    lo_i, hi_i = row_key_bounds(offs_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
    start, full_start, full_end, end = block_ranges(lo_i, hi_i, row_ok, Sk, BLOCK_N, LEFT)
    if HAS_STATE and not NORMALIZE:
        if start >= end:  # no row sees a key: the state stays as it is (a ring step's idle rows)
            return

    q = tl.load(Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs + offs_d[None, :],
                mask=tile_mask, other=0.0)
    o_ptrs = O + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os + offs_dv[None, :]
    stat_offs = b * stride_mb + h * stride_mh + offs_m
    if HAS_STATE:  # an empty incoming row has m = -inf, l = 0, acc = 0
        m_i = tl.load(M + stat_offs, mask=row_ok, other=float("-inf"))
        l_i = tl.load(L + stat_offs, mask=row_ok, other=0.0)
        acc = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    BIAS_ptrs = BIAS + b * stride_bias_b + offs_n
    if TMA:  # rows come from the descriptors; the pointer arguments are unused
        K_ptrs, V_ptrs = BIAS_ptrs, BIAS_ptrs
    else:
        K_ptrs = K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :]
        V_ptrs = V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_dv[None, :]
    b32, hk32, h32 = b.to(tl.int32), hk.to(tl.int32), h.to(tl.int32) + drop_h0
    drop = (drop_seed_lo, drop_seed_hi, drop_thr, drop_q0 + offs_m, drop_k0, drop_scale)
    span = plain_span(SPANS, b, Sk, HAS_BIAS)
    if LEFT:
        at = start.to(tl.int64)
        acc, l_i, m_i = _fwd_block_range(
            acc, l_i, m_i, q, lo_i, hi_i, K_ptrs + at * stride_ks, V_ptrs + at * stride_vs, BIAS_ptrs + at,
            stride_ks, stride_vs, offs_n, offs_d, offs_dv, start, full_start, Sk, qk_scale, K, V, b32, hk32, h32, drop,
            span,
            MASKED=True, LEFT=LEFT, PAD_D=PAD_D, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            HAS_BIAS=HAS_BIAS, PRECISION=PRECISION, TMA=TMA, WARP_SPECIALIZE=False, PRESCALE=PRESCALE,
            NEGATIVE=NEGATIVE, DROPOUT=DROPOUT, PAD_DV=PAD_DV, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)
    # key blocks every row of the tile sees: no mask
    at = full_start.to(tl.int64)
    acc, l_i, m_i = _fwd_block_range(
        acc, l_i, m_i, q, lo_i, hi_i, K_ptrs + at * stride_ks, V_ptrs + at * stride_vs, BIAS_ptrs + at,
        stride_ks, stride_vs, offs_n, offs_d, offs_dv, full_start, full_end, Sk, qk_scale, K, V, b32, hk32, h32, drop,
            span,
        MASKED=False, LEFT=LEFT, PAD_D=PAD_D, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        HAS_BIAS=HAS_BIAS, PRECISION=PRECISION, TMA=TMA, WARP_SPECIALIZE=WARP_SPECIALIZE, PRESCALE=PRESCALE,
        NEGATIVE=NEGATIVE, DROPOUT=DROPOUT, PAD_DV=PAD_DV, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)
    # the rest: the causal diagonal, a window's leading edge, the ragged end of the keys
    at = full_end.to(tl.int64)
    acc, l_i, m_i = _fwd_block_range(
        acc, l_i, m_i, q, lo_i, hi_i, K_ptrs + at * stride_ks, V_ptrs + at * stride_vs, BIAS_ptrs + at,
        stride_ks, stride_vs, offs_n, offs_d, offs_dv, full_end, end, Sk, qk_scale, K, V, b32, hk32, h32, drop,
            span,
        MASKED=True, LEFT=LEFT, PAD_D=PAD_D, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        HAS_BIAS=HAS_BIAS, PRECISION=PRECISION, TMA=TMA, WARP_SPECIALIZE=False, PRESCALE=PRESCALE,
        NEGATIVE=NEGATIVE, DROPOUT=DROPOUT, PAD_DV=PAD_DV, HEAD_DIM_V=HEAD_DIM_V, BLOCK_DV=BLOCK_DV)

    if NORMALIZE:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)
    tl.store(M + stat_offs, m_i, mask=row_ok)
    tl.store(L + stat_offs, l_i, mask=row_ok)
