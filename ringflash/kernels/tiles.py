"""Pieces shared by the forward and backward kernels: program ids, tile loads, key bias and
visibility, the key range of a query tile, and the softmax arithmetic the backward must repeat
exactly as the forward did it."""
import triton
import triton.language as tl
from triton.language.random import philox_impl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e): natural-log units -> base 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def base2_scores(dot, qk_scale, bias2, PRESCALE: tl.constexpr, plain):
    """Raw scores q.k -> (s, scale) with fma(s, scale, -m) the base-2 scores minus a row offset
    m (exp2_shifted). Without PRESCALE the scale enters inside exp2's argument, one FMA per
    score, and the row max of the scaled scores is row_max(s, scale, NEGATIVE, False). With
    PRESCALE (a key bias follows, or the scale is 0) the scores are fma(q.k, scale, bias2) now,
    bias2 the bias in base-2 units (0.0 without one), and scale 1; except the keys where
    `plain` (bool, broadcastable to the scores: a zero-bias span's keys, plain_keys) keep q.k
    and the scale, as without a bias. Every product of a scale here is an explicit FMA, in the
    forward and in both backward passes alike: the compiler's own contraction of a multiply and
    an add may differ between kernels, and the backward must rebuild the forward's
    probabilities to the last bit."""
    if PRESCALE:
        return (tl.fma(dot, tl.where(plain, 1.0, qk_scale), tl.where(plain, 0.0, bias2)),
                tl.where(plain, qk_scale, 1.0))  # fmt: skip
    else:
        return dot, qk_scale


@triton.jit
def row_max(s, scale, NEGATIVE: tl.constexpr, PRESCALE: tl.constexpr):
    """The row max of the scaled scores s * scale: max(s) * scale, or min(s) * scale for a
    negative scale (without PRESCALE); with PRESCALE, max(s * scale) of a scale per key
    (base2_scores: 1 or, on plain keys, the positive scale; the same bits as the max times it)."""
    if PRESCALE:
        return tl.max(s * scale, 1)
    elif NEGATIVE:
        return tl.min(s, 1) * scale
    else:
        return tl.max(s, 1) * scale


@triton.jit
def plain_span(SPANS, b, Sk, HAS_BIAS: tl.constexpr):
    """(lo, hi): batch row b's keys of zero bias below Sk (SPANS (B, 3) int32,
    key_bias.key_spans), which every kernel computes without the bias; (0, 0) without one."""
    if HAS_BIAS:
        return tl.load(SPANS + 3 * b + 1), tl.minimum(tl.load(SPANS + 3 * b + 2), Sk)
    else:
        return 0, 0


@triton.jit
def plain_keys(keys, span):
    """Which of the key indices `keys` (any shape) lie in span = plain_span(..)."""
    lo, hi = span
    return (keys >= lo) & (keys < hi)


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


# How a block's visible pairs are described (the MASK constexpr of the kernels; ringflash.masks):
MASK_NONE: tl.constexpr = tl.constexpr(0)  # every query sees every key of the block
MASK_WINDOW: tl.constexpr = tl.constexpr(1)  # q_pos - left <= k_pos <= q_pos + right (causal: right = 0)
MASK_ROWS: tl.constexpr = tl.constexpr(2)  # per-row intervals from arrays (packed documents)
UNBOUNDED: tl.constexpr = tl.constexpr(1 << 30)  # a window side without a bound (positions stay < 2^30)


@triton.jit
def row_key_bounds(rows, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK: tl.constexpr):
    """(lo, hi): the local key indices [lo, hi) that query rows `rows` (local indices, a vector)
    see, within [0, Sk); rows >= Sq see none (lo = hi = 0). MASK_WINDOW takes the query's
    global position q_start + row; MASK_ROWS loads global bounds KLO/KHI[row]."""
    valid = rows < Sq
    if MASK == MASK_ROWS:
        lo = tl.load(KLO + rows, mask=valid, other=0) - k_start
        hi = tl.load(KHI + rows, mask=valid, other=0) - k_start
    elif MASK == MASK_WINDOW:
        q_pos = q_start + rows
        lo = q_pos - win_left - k_start
        hi = q_pos + win_right + 1 - k_start
    else:
        lo = rows * 0  # runtime zeros of the rows' type (the branches must agree in type)
        hi = lo + Sk
    lo = tl.minimum(tl.maximum(lo, 0), Sk)
    hi = tl.maximum(tl.minimum(hi, Sk), lo)
    return tl.where(valid, lo, 0), tl.where(valid, hi, 0)


@triton.jit
def key_query_bounds(cols, Sq, Sk, q_start, k_start, win_left, win_right, QLO, QHI, MASK: tl.constexpr):
    """The mirror of row_key_bounds for key rows `cols`: the local query indices [lo, hi) that
    see each key, within [0, Sq); keys >= Sk are seen by none."""
    valid = cols < Sk
    if MASK == MASK_ROWS:
        lo = tl.load(QLO + cols, mask=valid, other=0) - q_start
        hi = tl.load(QHI + cols, mask=valid, other=0) - q_start
    elif MASK == MASK_WINDOW:
        k_pos = k_start + cols
        lo = k_pos - win_right - q_start
        hi = k_pos + win_left + 1 - q_start
    else:
        lo = cols * 0
        hi = lo + Sq
    lo = tl.minimum(tl.maximum(lo, 0), Sq)
    hi = tl.maximum(tl.minimum(hi, Sq), lo)
    return tl.where(valid, lo, 0), tl.where(valid, hi, 0)


@triton.jit
def block_ranges(lo, hi, valid, n, BLOCK: tl.constexpr, LEFT: tl.constexpr):
    """The loop over the other side's blocks of BLOCK rows for a tile whose rows see
    [lo, hi) of them (vectors; `valid` rows only): (start, full_start, full_end, end). Blocks in
    [full_start, full_end) are seen whole by every valid row (no mask); [start, full_start) and
    [full_end, end) need the mask; nothing outside [start, end) is seen, and start >= end iff no
    valid row sees anything (rows with lo >= hi widen nothing). Without LEFT (no row has a lower
    bound above 0) start = full_start = 0 and the first masked range is empty."""
    seen = valid & (lo < hi)
    end = tl.max(tl.where(seen, hi, 0), 0)
    # an empty row leaves no block seen by every row (its lo >= hi empties the intersection)
    full_lo = tl.max(tl.where(valid, lo, 0), 0)
    full_hi = tl.min(tl.where(valid, hi, n), 0)
    if LEFT:
        start = (tl.min(tl.where(seen, lo, n), 0) // BLOCK) * BLOCK
    else:
        start = end * 0
    full_start = tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, start)
    full_end = tl.maximum(full_hi // BLOCK * BLOCK, full_start)
    return start, full_start, full_end, end


@triton.jit
def in_bounds(idx, lo, hi, LEFT: tl.constexpr):
    """The mask of a masked block: which indices idx fall in their row's [lo, hi) (broadcastable
    index tensors; the bounds of row_key_bounds / key_query_bounds, so indices past the other
    side's length and rows past their own are never in). Without LEFT every lo is 0."""
    if LEFT:
        return (idx >= lo) & (idx < hi)
    else:
        return idx < hi


@triton.jit
def query_program(Hq, GROUP: tl.constexpr, REVERSE: tl.constexpr):
    """(pid_m, b, h, hk) of a program over (query tiles, batch x q heads): its query tile, batch,
    q head and kv head (int64). REVERSE (causal and the like): later query tiles see more keys,
    so they start first and the tail is short."""
    pid_m = tl.program_id(0)
    if REVERSE:
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
def dropout_keep(seed_lo, seed_hi, thr, b, h, q_idx, k_idx):
    """Which pairs attention dropout keeps (ringflash.dropout.keep_mask, bit for bit): q_idx and
    k_idx broadcastable int32 tensors of whole-sequence query and key indices, b and h the
    batch and query head. The first word r of Philox-4x32-10 of the counter (key, query, head,
    batch) under the key (seed_lo, seed_hi) (int32 bit patterns) keeps the pair iff r >= the
    threshold; both sides are shifted by 2^31 (thr arrives shifted) and compared as int32."""
    z = (q_idx + k_idx) * 0
    r, _, _, _ = philox_impl(
        (k_idx + z).to(tl.uint32, bitcast=True), (q_idx + z).to(tl.uint32, bitcast=True),
        (z + h.to(tl.int32)).to(tl.uint32, bitcast=True), (z + b.to(tl.int32)).to(tl.uint32, bitcast=True),
        seed_lo.to(tl.uint32, bitcast=True), seed_hi.to(tl.uint32, bitcast=True),
    )
    return (r ^ 0x80000000).to(tl.int32, bitcast=True) >= thr
