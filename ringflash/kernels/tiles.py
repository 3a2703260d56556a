"""Pieces shared by the forward and backward kernels: program ids, tile loads, key bias and
visibility, the key range of a query tile, and the softmax arithmetic the backward must repeat
exactly as the forward did it."""
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e): natural-log units -> base 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def base2_scores(dot, qk_scale, bias2, PRESCALE: tl.constexpr):
    """Raw scores q.k -> (s, scale) with fma(s, scale, -m) the base-2 scores minus a row offset
    m (exp2_shifted). Without PRESCALE the scale enters inside exp2's argument, one FMA per
    score, and the row max of the scaled scores is row_max(s, scale, NEGATIVE). With PRESCALE
    (a key bias follows, or the scale is 0) the scores are fma(q.k, scale, bias2) now, bias2
    the bias in base-2 units (0.0 without one). Every product of a scale here is an explicit
    FMA, in the forward and in both backward passes alike: the compiler's own contraction of
    a multiply and an add may differ between kernels, and the backward must rebuild the
    forward's probabilities to the last bit."""
    if PRESCALE:
        return tl.fma(dot, qk_scale, bias2), 1.0
    else:
        return dot, qk_scale


@triton.jit
def row_max(s, scale, NEGATIVE: tl.constexpr):
    """The row max of the scaled scores s * scale: max(s) * scale, or min(s) * scale for a
    negative scale (without PRESCALE)."""
    if NEGATIVE:
        return tl.min(s, 1) * scale
    else:
        return tl.max(s, 1) * scale


@triton.jit
def exp2_shifted(s, scale, m):
    """exp2(s * scale - m) for scores s (rows, keys) and row offsets m (rows,), one FMA each."""
    return tl.math.exp2(tl.fma(s, scale, -m[:, None]))


@triton.jit
def exp2_probs(s, scale, m, inv_l):
    """The probabilities exp2(s * scale - m) / l of scores s (rows, keys), as the forward's
    exp2_shifted computed their numerators."""
    return exp2_shifted(s, scale, m) * inv_l[:, None]


@triton.jit
def row_stats(M_ptrs, L_ptrs, rows, n_rows, MASKED: tl.constexpr):
    """(m, 1 / l) of query rows for the backward; a row that saw no key (l = 0), or past
    n_rows, gets m = +inf and 1 / l = 0, so that its probabilities are 0, not NaN."""
    if MASKED:
        m = tl.load(M_ptrs, mask=rows < n_rows, other=0.0)
        l = tl.load(L_ptrs, mask=rows < n_rows, other=0.0)
    else:
        m = tl.load(M_ptrs)
        l = tl.load(L_ptrs)
    seen = l > 0.0
    return tl.where(seen, m, float("inf")), tl.where(seen, 1.0 / tl.where(seen, l, 1.0), 0.0)


@triton.jit
def load_tile(ptrs, desc, b, row, h, rows, n_rows, d_ok, MASKED: tl.constexpr, PAD_D: tl.constexpr,
              TMA: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (ROWS, BLOCK_D) tile of a (B, S, H, D) tensor: rows row.. of batch b, head h.

    TMA: through the tensor-memory engine from a descriptor with block [1, ROWS, 1, BLOCK_D]
    (rows past the end and columns past D read as 0). Otherwise by pointers (`ptrs`), masking
    rows >= n_rows when MASKED and columns past D when PAD_D.
    """
    if TMA:
        return tl.reshape(desc.load([b, row, h, 0]), (ROWS, BLOCK_D))
    elif MASKED:
        mask = rows[:, None] < n_rows
        if PAD_D:
            mask = mask & d_ok
        return tl.load(ptrs, mask=mask, other=0.0)
    elif PAD_D:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def key_range(pid_m, q_start, k_start, Sq, Sk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """For query tile pid_m: (hi, full_end). Keys [0, hi) are visible to some row of the tile;
    [0, full_end) are whole BLOCK_N blocks visible to every row (no mask needed); the rest of
    [full_end, hi) needs the causal and bounds mask."""
    if CAUSAL:
        first_q = q_start + pid_m * BLOCK_M
        last_q = q_start + tl.minimum((pid_m + 1) * BLOCK_M, Sq) - 1
        hi = tl.minimum(tl.maximum(last_q - k_start + 1, 0), Sk)
        full_end = tl.minimum(tl.maximum(first_q - k_start + 1, 0), hi)
    else:
        hi = Sk
        full_end = Sk
    return hi, (full_end // BLOCK_N) * BLOCK_N


@triton.jit
def query_range(pid_n, q_start, k_start, Sq, Sk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """For key tile pid_n, the mirror of key_range: (lo, full_lo, Sq_full). Query rows [lo, Sq)
    see some key of the tile (lo a multiple of BLOCK_M); whole BLOCK_M blocks in
    [full_lo, Sq_full) see all of them (no mask); Sq_full ends the whole blocks, and
    [lo, full_lo) and [Sq_full, Sq) need the causal and bounds mask."""
    Sq_full = (Sq // BLOCK_M) * BLOCK_M
    if CAUSAL:
        first_k = k_start + pid_n * BLOCK_N
        last_k = k_start + tl.minimum((pid_n + 1) * BLOCK_N, Sk) - 1
        lo = tl.minimum(tl.maximum(first_k - q_start, 0), Sq)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.minimum(tl.maximum(last_k - q_start, 0), Sq)
        full_lo = tl.minimum(((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, Sq_full)
    else:
        lo = Sq * 0  # a runtime zero of Sq's type, like the causal branch's (Triton unifies the two)
        full_lo = lo
    return lo, full_lo, Sq_full


@triton.jit
def query_program(Hq, GROUP: tl.constexpr, CAUSAL: tl.constexpr):
    """(pid_m, b, h, hk) of a program over (query tiles, batch x q heads): its query tile, batch,
    q head and kv head (int64). Causal: later query tiles see more keys, so they start first
    and the tail is short."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    return pid_m, b, h, h // GROUP


@triton.jit
def key_bias2(BIAS_ptrs, cols, Sk, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The per-key bias of a key tile in base-2 units, (1, keys): natural-log units times
    log2(e), -inf for keys past Sk when MASKED; 0.0 without HAS_BIAS."""
    if HAS_BIAS:
        if MASKED:
            bias = tl.load(BIAS_ptrs, mask=cols < Sk, other=float("-inf"))
        else:
            bias = tl.load(BIAS_ptrs)
        return bias[None, :] * LOG2E
    else:
        return 0.0


@triton.jit
def visible_keys(q_pos, cols, Sk, k_start, CAUSAL: tl.constexpr):
    """(rows, keys) mask of a key tile at local columns `cols`: inside the keys and, when
    CAUSAL, at or before each query's global position q_pos."""
    visible = cols[None, :] < Sk
    if CAUSAL:
        visible = visible & (q_pos[:, None] >= (k_start + cols)[None, :])
    return visible
