"""Gluon forward kernels for Hopper (sm_90a): FlashAttention-3-style schedules.

Imported only through ringflash.kernels.gluon_forward, which guards the import: this module
needs `triton.experimental.gluon` (triton >= 3.6).

The schedule (FlashAttention-3's forward on sm_90): a one-warp TMA producer partition (few
registers) feeds STAGES-deep K and V rings through ready/empty mbarriers; two consumer
warpgroups, each its own partition with 64 query rows of the tile, issue QK^T of block j with
PV of block j-1 still in flight (warpgroup_mma_wait(1), _overlap_loop). Earlier
single-partition and one-consumer schedules measured slower on one H200 (450-495 TFLOP/s
against 594-602 at D=128, 16K; benchmarks/NOTES.md) and were removed. One query tile a
program, or (PERSISTENT) at most one program per multiprocessor taking every programs-th tile,
the rings running on across its tiles, so that the next tile's loads overlap the last one's
output (faster on short key ranges only: configs.GLUON_FWD_SHORT); with DYNAMIC, such programs
taking their tiles from a counter in global memory in the one-tile launch's order (_gluon_counter:
FlashAttention-3's dynamic scheduler; not a default).

Tensors: q (B, Sq, Hq, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv), bf16 or fp16, as 4-D TMA
descriptors with blocks [1, BLOCK_M or BLOCK_N, 1, BLOCK_D or BLOCK_DV], BLOCK_D the head dim D
(HEAD_DIM) padded to a power of two, BLOCK_DV v's Dv (HEAD_DIM_V) likewise (rows past the end
and columns past D or Dv read as zeros, never the next batch or head). A D or Dv between two
powers of two may run as two pieces instead (kernels.head_dim_pieces: 192 as BLOCK_D = 128 plus
BLOCK_DT = 64 columns, Dv likewise as BLOCK_DV plus BLOCK_DVT, by descriptors of their own):
QK^T one wgmma per q/k piece into the same scores, PV one per v piece into its own O
accumulator; fewer zero columns multiplied, and less shared memory per stage. A key block may run
in two pieces likewise (BLOCK_NT: 192 keys as 128 + 64, two score accumulators, two PV wgmmas;
with head dims of one piece only). O (B, Sq, Hq, Dv) any
dtype (float32 when HAS_STATE), M and L (B, Hq, Sq) float32, by pointers.

State per query row, softmax in base 2 (qk_scale = scale * log2(e)):
m = max_j s2_ij, l = sum_j exp2(s2_ij - m), acc = sum_j exp2(s2_ij - m) v_j; an empty row has
m = -inf, l = 0, acc = 0. NORMALIZE writes O = acc / l (0 for empty rows), else acc.
HAS_STATE folds this call's keys into the incoming state (acc, m, l) = (O, M, L).

Which keys a query row sees is the Triton kernels' description, computed by the same helpers
(tiles.row_key_bounds, tiles.in_bounds): MASK_NONE, MASK_WINDOW (win_left / win_right around
the row's global position; causal is a window with right = 0) or MASK_ROWS (per-row global
bounds KLO / KHI, packed documents), each row an interval [lo, hi) of the local keys.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon_counter import TILE_WORDS, _fetch_tile, _max_combine, _publish_tile, _receive_tile, _reset_counter
from .key_bias import PLAIN_ALIGN as _PLAIN_ALIGN
from .tiles import LOG2E, MASK_NONE, MASK_ROWS, MASK_WINDOW, in_bounds, row_key_bounds

PLAIN_ALIGN: gl.constexpr = gl.constexpr(_PLAIN_ALIGN)

# ----------------------------------------------------------------------------------------------
# Which keys a query tile visits: the one place that reads the mask; everything else asks it.


@gluon.jit
def _hull_and_core(lo, hi, valid, n):
    """Over the `valid` entries of interval vectors [lo, hi) within [0, n): (min lo, max hi) of
    the nonempty ones (hi <= lo when none is), and (max lo, min hi), the indices every valid
    interval holds. The key range of a query tile, and the query range of a key tile."""
    seen = valid & (lo < hi)  # an empty interval widens nothing...
    return (
        gl.reduce(gl.where(seen, lo, n), 0, _min_combine),
        gl.reduce(gl.where(seen, hi, 0), 0, _max_combine),
        # ...but leaves no index held by every interval (its lo >= hi empties the intersection)
        gl.reduce(gl.where(valid, lo, 0), 0, _max_combine),
        gl.reduce(gl.where(valid, hi, n), 0, _min_combine),
    )


@gluon.jit
def _rows_range(
    first, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
    MASK: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Over the valid rows of [first, first + ROWS), each seeing its local keys [lo, hi)
    (tiles.row_key_bounds): (min lo, max hi), the keys some row sees (hi <= lo when none
    does), and (max lo, min hi), the keys every row sees."""
    if MASK == MASK_ROWS:
        rows = first + gl.arange(0, ROWS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        lo, hi = row_key_bounds(rows, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
        return _hull_and_core(lo, hi, rows < Sq, Sk)
    else:  # a window's bounds grow with the row: the first and last rows decide
        last = gl.minimum(first + ROWS, Sq) - 1
        lo_first, hi_first = row_key_bounds(first, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
        lo_last, hi_last = row_key_bounds(last, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
        return lo_first, hi_last, lo_last, hi_first


@gluon.jit
def _tile_key_range(
    off_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
    MASK: gl.constexpr, LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """The key blocks of the query tile at off_m, computed once per program by all warps before
    the partitions split, so that the producer and both consumers visit the same blocks:
    (lo, n, full_lo0, full_hi0, full_lo1, full_hi1). The tile visits the n blocks
    [lo + i * BLOCK_N, lo + (i + 1) * BLOCK_N) that some valid row sees (n == 0: none;
    tiles.block_ranges' start and end); every valid row of consumer warpgroup w (rows
    off_m + w * BLOCK_M / 2 ..) sees the keys [full_lo_w, full_hi_w): a block inside needs no
    mask."""
    lo, hi, _, _ = _rows_range(off_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, BLOCK_M,
                               num_warps)  # fmt: skip
    if LEFT:
        lo = lo // BLOCK_N * BLOCK_N
    else:
        lo = 0
    half: gl.constexpr = BLOCK_M // 2
    _, _, full_lo0, full_hi0 = _rows_range(off_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK,
                                           half, num_warps)  # fmt: skip
    _, _, full_lo1, full_hi1 = _rows_range(off_m + half, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
                                           MASK, half, num_warps)  # fmt: skip
    n = (gl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    return lo, n, full_lo0, full_hi0, full_lo1, full_hi1


@gluon.jit
def _tile_plan(
    t, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK: gl.constexpr,
    LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A persistent program's t-th tile (query tile t % num_m of batch-and-head t // num_m):
    (b, h, hk, off_m) as _tile's, then _tile_key_range's (lo, n, full_lo0, full_hi0,
    full_lo1, full_hi1). Each partition computes it for itself (windows only: a few scalar
    operations, no loads)."""
    return _tile_plan_at(
        t % num_m, t // num_m, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT,
        BLOCK_M, BLOCK_N, num_warps,
    )  # fmt: skip


@gluon.jit
def _tile_plan_at(
    pid_m, pid_bh, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK: gl.constexpr,
    LEFT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """_tile_plan's tuple for query tile pid_m of batch-and-head pid_bh."""
    b, h, hk, off_m = _tile(pid_m, pid_bh, num_m, Hq, group, MASK != MASK_NONE, BLOCK_M)
    lo, n, full_lo0, full_hi0, full_lo1, full_hi1 = _tile_key_range(
        off_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT, BLOCK_M, BLOCK_N, num_warps
    )
    return b, h, hk, off_m, lo, n, full_lo0, full_hi0, full_lo1, full_hi1


@gluon.jit
def _handed_tile_plan(
    t, num_m, num_tiles, heads_per_group, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
    MASK: gl.constexpr, LEFT: gl.constexpr, SHORT_GROUP_FIRST: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """_tile_plan's tuple for the t-th tile handed out from the counter (DYNAMIC): the t-th
    program of the one-tile launch, in its order (_launch_order: masked blocks heads_per_group
    heads together, heaviest tiles first; dense blocks as the grid lists them), so that the
    tiles taken side by side share their heads' K/V in L2 as the one-tile programs do."""
    if MASK == MASK_WINDOW:
        pid_m, pid_bh = _order_of(t, num_m, num_tiles // num_m, heads_per_group, SHORT_GROUP_FIRST)
    else:
        pid_m = t % num_m
        pid_bh = t // num_m
    return _tile_plan_at(
        pid_m, pid_bh, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT,
        BLOCK_M, BLOCK_N, num_warps,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Shared pieces. Reductions and cdiv are written here rather than taken from gl.max / gl.sum /
# gl.cdiv: those wrap triton.language.standard, whose helpers become interpreter objects when
# TRITON_INTERPRET=1 is set (as the CPU test suite does), and then fail to compile.


@gluon.jit
def _min_combine(a, b):
    return gl.minimum(a, b)


@gluon.jit
def _add_combine(a, b):
    return a + b


@gluon.jit
def _row_max(x):
    return gl.reduce(x, 1, _max_combine)


@gluon.jit
def _row_sum(x):
    return gl.reduce(x, 1, _add_combine)


@gluon.constexpr_function
def _mma_layout(num_warps, n):
    # 16 rows per warp; 8 warps split a 128-row tile into two warpgroups of 64 rows each
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.jit
def _launch_order(heads_per_group, SHORT_GROUP_FIRST: gl.constexpr):
    """(pid_m, pid_bh) of this program of the (num_m, B * Hq) grid, taken in launch order
    (program_id(0) fastest) group by group of heads_per_group heads, within a group query tile
    by query tile, each over the group's heads. With _tile's REVERSE the heaviest causal tiles
    of every head in the group start first, and the launch ends on light tiles rather than on
    the last head's heaviest (heads_per_group = 1: head by head, the plain grid order). The
    group of the B * Hq % heads_per_group heads left over comes last, or with
    SHORT_GROUP_FIRST first (a short last group's heaviest tiles start late)."""
    num_m = gl.num_programs(0)
    num_bh = gl.num_programs(1)
    linear = gl.program_id(1) * num_m + gl.program_id(0)
    return _order_of(linear, num_m, num_bh, heads_per_group, SHORT_GROUP_FIRST)


@gluon.jit
def _order_of(linear, num_m, num_bh, heads_per_group, SHORT_GROUP_FIRST: gl.constexpr):
    """_launch_order's (pid_m, pid_bh) for the linear-th program of a (num_m, num_bh) launch."""
    per_group = heads_per_group * num_m
    if SHORT_GROUP_FIRST:
        short = num_bh % heads_per_group  # (0: every group full)
        in_short = linear < short * num_m
        after = linear - short * num_m
        full_groups = after // per_group
        first_bh = gl.where(in_short, 0, short + full_groups * heads_per_group)
        rest = gl.where(in_short, linear, after - full_groups * per_group)
        heads = gl.where(in_short, short, heads_per_group)
    else:
        first_bh = linear // per_group * heads_per_group
        rest = linear - first_bh * num_m
        heads = gl.minimum(heads_per_group, num_bh - first_bh)  # the last group may hold fewer
    pid_m = rest // heads
    return pid_m, first_bh + rest - pid_m * heads


@gluon.jit
def _tile(pid_m, pid_bh, num_m, Hq, group, REVERSE: gl.constexpr, BLOCK_M: gl.constexpr):
    """(b, h, hk, off_m) of query tile pid_m (of num_m) of batch-and-head pid_bh: batch, q head,
    kv head, first row of the tile. REVERSE (masked attention, causal above all): later query
    tiles see more keys, so they are taken first and the tail is short."""
    if REVERSE:
        pid_m = num_m - 1 - pid_m
    b = pid_bh // Hq
    h = pid_bh % Hq
    return b, h, h // group, pid_m * BLOCK_M


@gluon.jit
def _masked(
    s, first_row, start_n, full_lo, full_hi, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
    MASK: gl.constexpr, LEFT: gl.constexpr, WIDTH: gl.constexpr,
):  # fmt: skip
    """s, scores of query rows first_row.. and the WIDTH keys from start_n, with the keys a row
    does not see at -inf (tiles.row_key_bounds). Only a block outside [full_lo, full_hi) is
    looked at, its bounds computed here, in the few masked blocks, rather than held in
    registers through the loop."""
    if (start_n < full_lo) | (start_n + WIDTH > full_hi):
        rows = first_row + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        lo_r, hi_r = row_key_bounds(rows, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK)
        cols = start_n + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(in_bounds(cols[None, :], lo_r[:, None], hi_r[:, None], LEFT), s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(
    s,
    s_t,
    scale2,
    m_i,
    l_i,
    first_row,
    start_n,
    full_lo,
    full_hi,
    qk_scale,
    Sq,
    Sk,
    q_start,
    k_start,
    win_left,
    win_right,
    KLO,
    KHI,
    MASK: gl.constexpr,
    LEFT: gl.constexpr,
    POSITIVE_SCALE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_NT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    """One key block of the online softmax.

    s: raw scores q.k (BLOCK_M, BLOCK_N) float32 in the wgmma accumulator layout, of query rows
    first_row.. and keys start_n..; with BLOCK_NT > 0 s_t holds the block's BLOCK_NT keys after
    those (its key tail piece, in its own accumulator layout; else s_t is ignored); m_i, l_i:
    (BLOCK_M,) in s's row slice. With HAS_BIAS (key blocks of one piece) s and scale2 come from
    _biased_scores: the scores times scale2 are the block's base-2 scores (else scale2 is not
    read). Returns (p, p_t, m_new, l_new, alpha) with p (and
    p_t, the tail's; p again without one) float32 and alpha the factor the accumulator must be
    multiplied by before p @ v is added.
    """
    if HAS_BIAS:
        gl.static_assert(BLOCK_NT == 0, "a key bias takes key blocks of one piece")
    elif not POSITIVE_SCALE:
        # max(s) * scale is the scaled max only for scale > 0: scale first (and mask after)
        s = s * qk_scale
        if BLOCK_NT > 0:
            s_t = s_t * qk_scale
    s = _masked(s, first_row, start_n, full_lo, full_hi, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI,
                MASK, LEFT, BLOCK_N)  # fmt: skip
    block_max = _row_max(s)
    if BLOCK_NT > 0:
        s_t = _masked(s_t, first_row, start_n + BLOCK_N, full_lo, full_hi, Sq, Sk, q_start, k_start, win_left,
                      win_right, KLO, KHI, MASK, LEFT, BLOCK_NT)  # fmt: skip
        block_max = gl.maximum(block_max, gl.convert_layout(_row_max(s_t), m_i.type.layout, assert_trivial=True))
    if HAS_BIAS:  # (scale2 > 0 or 1: the max of the scaled scores)
        m_new = gl.maximum(m_i, block_max * scale2)
    elif POSITIVE_SCALE:
        m_new = gl.maximum(m_i, block_max * qk_scale)
    else:
        m_new = gl.maximum(m_i, block_max)
    # a row that has seen no key keeps m = -inf; pivot on 0 so exp2 gives 0, not NaN
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    if HAS_BIAS:
        p = _probabilities(s, m_use, scale2, True)
    else:
        p = _probabilities(s, m_use, qk_scale, POSITIVE_SCALE)
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + _row_sum(p)
    p_t = p
    if BLOCK_NT > 0:
        m_use_t = gl.convert_layout(m_use, gl.SliceLayout(1, s_t.type.layout), assert_trivial=True)
        p_t = _probabilities(s_t, m_use_t, qk_scale, POSITIVE_SCALE)
        l_new = l_new + gl.convert_layout(_row_sum(p_t), m_i.type.layout, assert_trivial=True)
    return p, p_t, m_new, l_new, alpha


@gluon.jit
def _probabilities(s, m_use, qk_scale, POSITIVE_SCALE: gl.constexpr):
    if POSITIVE_SCALE:
        # an explicit FMA, as the Triton kernels' (tiles.exp2_shifted): the backward rebuilds
        # these probabilities with the same arithmetic, to the last bit
        return gl.exp2(gl.fma(s, qk_scale, -m_use[:, None]))
    else:
        return gl.exp2(s - m_use[:, None])


@gluon.jit
def _key_spans(KEY_SPANS, b, HAS_BIAS: gl.constexpr):
    """(pad_end, plain_lo, plain_hi): batch row b's row of key_bias.key_spans, its last key the
    bias does not hide + 1 (_unpadded_blocks) and its keys of zero bias [plain_lo, plain_hi),
    multiples of key_bias.PLAIN_ALIGN, which take the unbiased arithmetic (_biased_scores);
    zeros (an empty span) without HAS_BIAS. The one reader of that table in the Gluon kernels,
    each entry loaded once a tile (the entries a caller does not use are never loaded)."""
    pad_end = b * 0
    plain_lo = pad_end
    plain_hi = pad_end
    if HAS_BIAS:
        row = KEY_SPANS + 3 * b
        pad_end = gl.load(row)
        plain_lo = gl.load(row + 1)
        plain_hi = gl.load(row + 2)
    return pad_end, plain_lo, plain_hi


@gluon.jit
def _unpadded_blocks(n, lo, pad_end, KEYS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """n, or with HAS_BIAS the first of a tile's n key blocks from lo up to its batch row's last
    key the bias does not hide (pad_end, _key_spans: that key + 1): the blocks after it hold
    only hidden keys, which add exactly nothing. The producer and the consumers each cut a tile
    here alike: a block one of them skips and another waits for would stop the rings."""
    if HAS_BIAS:
        n = gl.minimum(n, gl.maximum(pad_end - lo + KEYS - 1, 0) // KEYS)
    return n


@gluon.jit
def _span_holds(start, width, plain_lo, plain_hi):
    """Whether the key block [start, start + width) lies in the zero-bias span [plain_lo,
    plain_hi) (_key_spans; its ends are multiples of PLAIN_ALIGN, which the block divides, so
    a block is wholly inside or outside it)."""
    return (start >= plain_lo) & (start + width <= plain_hi)


@gluon.constexpr_function
def _versioned(has_bias, block_dt, block_dvt):
    # whether a tile's leading blocks of zero bias run the key loop compiled without a bias
    # (as a kernel without one, POSITIVE_SCALE's arithmetic: the span is empty for a scale
    # <= 0) and the rest the biased loop, the producer loading no bias for the former: a branch
    # per block in the scores -> exp2 stream cost D=64 up to ~9% on a mask that hides nothing.
    # Head dims in pieces (MLA's) keep one loop: two spill there, and their larger matmuls hide
    # the branch
    return bool(has_bias) and block_dt + block_dvt == 0


@gluon.jit
def _plain_lead(lo, n, plain_lo, plain_hi, BLOCK_N: gl.constexpr, VERSIONED: gl.constexpr):
    """With VERSIONED, how many of a tile's n key blocks of one piece from key lo, counted from
    its first, lie in its batch row's zero-bias span [plain_lo, plain_hi) (_key_spans): 0 unless
    the span holds key lo, and 0 without VERSIONED. The consumers run them through the key loop
    compiled without the bias and the producer loads no bias for them, so both count them here
    alike."""
    held = n * 0
    if VERSIONED:
        held = gl.where(lo >= plain_lo, gl.minimum(gl.maximum(plain_hi - lo, 0) // BLOCK_N, n), 0)
    return held


@gluon.jit
def _biased_scores(
    s, bias_bufs, i, start, plain_lo, plain_hi, qk_scale, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
    s_layout: gl.constexpr,
):  # fmt: skip
    """(s, scale2) for key block i's raw scores s (its keys from start): with HAS_BIAS, a block
    inside its row's zero-bias span [plain_lo, plain_hi) (_key_spans; PLAIN_ALIGN is a multiple
    of the block) keeps s with scale2 = qk_scale, the unbiased arithmetic (one FMA a score, in
    exp2's argument); any other takes fma(s, qk_scale, bias) with scale2 = 1, as the Triton
    kernels' base2_scores: either way key by key what the backward rebuilds. The bias (base 2,
    (BLOCK_N,) in the key slice of s_layout) is read from the stage of the key-bias ring that
    the producer filled with K's stage (on K's barrier), before that stage is released (-inf
    hides a key; keys past Sk read 0 and are masked). Without HAS_BIAS: (s, qk_scale)."""
    scale2 = qk_scale
    if HAS_BIAS:
        width: gl.constexpr = bias_bufs.shape[2]
        plain = _span_holds(start, width, plain_lo, plain_hi)
        scale2 = gl.where(plain, qk_scale, 1.0)
        if not plain:
            bias2 = bias_bufs.index(i % STAGES).reshape([width]).load(gl.SliceLayout(0, s_layout)) * LOG2E
            s = gl.fma(s, qk_scale, bias2[None, :])
    return s, scale2


@gluon.jit
def _opaque(x):
    """x (32-bit elements), through a non-pure move the compiler can neither hoist out of a loop
    nor run ahead of a branch: loop-invariant index vectors are cheap to recompute but expensive
    to keep (LLVM hoists them, ptxas then spills); a branch whose body is plain arithmetic on
    values at hand becomes selects, both sides computed (_probs_t)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], x.dtype, is_pure=False, pack=1)


@gluon.jit
def _rows(x, layout: gl.constexpr):
    # row statistics move between the S and O accumulator layouts; both give a row to the
    # same threads, so this is free
    return gl.convert_layout(x, gl.SliceLayout(1, layout), assert_trivial=True)


@gluon.jit
def _empty_state(BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """(acc, m_i, l_i) of rows that have seen no key."""
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    return acc, m_i, l_i


@gluon.jit
def _write_out(
    acc,
    acc_t,
    m_i,
    l_i,
    O,
    M,
    L,
    b,
    h,
    off_m,
    Sq,
    seen,
    stride_ob,
    stride_os,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ls,
    NORMALIZE: gl.constexpr,
    HAS_STATE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_DT: gl.constexpr,
    s_layout: gl.constexpr,
    o_layout: gl.constexpr,
    ot_layout: gl.constexpr,
    OPAQUE: gl.constexpr = False,
):
    """Store O (acc / l, or acc), M and L for the tile's valid rows and O's HEAD_DIM columns:
    acc holds the first BLOCK_D of them, acc_t (when BLOCK_DT > 0) the BLOCK_DT after those
    (columns past HEAD_DIM are zero padding).

    HAS_STATE: (acc, m_i, l_i) covers this call's keys only; the incoming state in (O, M, L)
    is merged in here, which is the online softmax continued from it (up to rounding).
    Merging at the end rather than starting the loop from the state keeps nothing of it live
    across the key loop, where the consumer warps have no registers to spare. OPAQUE: the row
    and column index vectors made per call (_opaque), so that a persistent program does not keep
    them from one tile to the next across its key loops. seen: whether the
    tile saw any key; one that did not folds nothing in, so with HAS_STATE and not NORMALIZE it
    reads and writes nothing (a ring step's idle rows; masked rather than branched around,
    which cost registers).
    """
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    if OPAQUE:
        rows = _opaque(rows)
    rows = off_m + rows
    ok = rows < Sq
    m_ptrs = M + b.to(gl.int64) * stride_mb + h * stride_mh + rows * stride_ms
    l_ptrs = L + b.to(gl.int64) * stride_lb + h * stride_lh + rows * stride_ls
    if HAS_STATE and not NORMALIZE:
        ok = ok & seen
    a_in = None
    a_new = None
    if HAS_STATE:
        m_in = gl.load(m_ptrs, mask=ok, other=float("-inf"))
        l_in = gl.load(l_ptrs, mask=ok, other=0.0)
        m_new = gl.maximum(m_i, m_in)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        a_in = gl.exp2(m_in - m_use)  # 0 for a row empty on that side
        a_new = gl.exp2(m_i - m_use)
        l_i = l_in * a_in + l_i * a_new
        m_i = m_new
    _store_o(
        acc, O, b, h, off_m, Sq, seen, a_in, a_new, l_i, stride_ob, stride_os, stride_oh, 0, NORMALIZE, HAS_STATE,
        BLOCK_M, HEAD_DIM, BLOCK_D, o_layout, OPAQUE,
    )  # fmt: skip
    if BLOCK_DT > 0:
        _store_o(
            acc_t, O, b, h, off_m, Sq, seen, a_in, a_new, l_i, stride_ob, stride_os, stride_oh, BLOCK_D, NORMALIZE,
            HAS_STATE, BLOCK_M, HEAD_DIM, BLOCK_DT, ot_layout, OPAQUE,
        )  # fmt: skip
    gl.store(m_ptrs, m_i, mask=ok)
    gl.store(l_ptrs, l_i, mask=ok)


@gluon.jit
def _store_o(
    acc, O, b, h, off_m, Sq, seen, a_in, a_new, l_i, stride_ob, stride_os, stride_oh, COL0: gl.constexpr,
    NORMALIZE: gl.constexpr, HAS_STATE: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
    WIDTH: gl.constexpr, o_layout: gl.constexpr, OPAQUE: gl.constexpr = False,
):  # fmt: skip
    """_write_out's store of O's columns [COL0, COL0 + WIDTH) from acc (those past HEAD_DIM
    not stored), merged with the incoming state's (a_in, a_new: its row factors) and
    normalized by l_i as the flags say."""
    rows_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, o_layout))
    if OPAQUE:  # (recomputed per tile, not kept across a persistent program's key loops)
        rows_o = _opaque(rows_o)
        cols = _opaque(cols)
    rows_o = off_m + rows_o
    cols = COL0 + cols
    o_ptrs = (
        O
        + b.to(gl.int64) * stride_ob
        + h.to(gl.int64) * stride_oh
        + rows_o.to(gl.int64)[:, None] * stride_os
        + cols[None, :]
    )
    o_mask = (rows_o < Sq)[:, None]
    if COL0 + WIDTH > HEAD_DIM:
        o_mask = o_mask & (cols < HEAD_DIM)[None, :]
    if HAS_STATE and not NORMALIZE:
        o_mask = o_mask & seen
    if HAS_STATE:
        b_in = _rows(a_in, o_layout)[:, None]
        acc = acc * _rows(a_new, o_layout)[:, None]
        # an empty incoming row adds nothing, whatever its O holds
        acc = acc + gl.where(b_in == 0.0, 0.0, b_in * gl.load(o_ptrs, mask=o_mask, other=0.0))
    if NORMALIZE:
        l_o = _rows(l_i, o_layout)
        acc = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]  # empty rows: acc is 0
    gl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)


@gluon.jit
def _load_kv(
    desc, bufs, bars, i, b, hk, lo, STAGES: gl.constexpr, KEYS: gl.constexpr, tail_desc=None, tail_bufs=None,
    TAIL_ROW: gl.constexpr = 0, TAIL_COL: gl.constexpr = 0, bias_desc=None, bias_bufs=None,
    HAS_BIAS: gl.constexpr = False,
):  # fmt: skip
    """TMA of key block i (rows lo + i * KEYS ..) into stage i % STAGES of a ring; with
    TAIL_COL > 0 also the head dim's tail piece (columns TAIL_COL ..), or with TAIL_ROW > 0 the
    block's key tail piece (its rows from TAIL_ROW on), into tail_bufs; with HAS_BIAS the block's
    key bias (bias_desc: (B, Sk) float32) into bias_bufs; all on the same barrier."""
    st = i % STAGES
    bar = bars.index(st)
    TAIL_BYTES: gl.constexpr = tail_desc.block_type.nbytes if TAIL_ROW + TAIL_COL > 0 else 0
    BIAS_BYTES: gl.constexpr = bias_desc.block_type.nbytes if HAS_BIAS else 0
    mbarrier.expect(bar, desc.block_type.nbytes + TAIL_BYTES + BIAS_BYTES)
    if TAIL_ROW + TAIL_COL > 0:
        tma.async_copy_global_to_shared(
            tail_desc, [b, lo + i * KEYS + TAIL_ROW, hk, TAIL_COL], bar, tail_bufs.index(st)
        )
    if HAS_BIAS:
        tma.async_copy_global_to_shared(bias_desc, [b, lo + i * KEYS], bar, bias_bufs.index(st))
    tma.async_copy_global_to_shared(desc, [b, lo + i * KEYS, hk, 0], bar, bufs.index(st))


@gluon.jit
def _wait_stage(bars, i, STAGES: gl.constexpr):
    # the i-th use of a ring: stage i % STAGES, parity of its (i // STAGES)-th completion
    mbarrier.wait(bars.index(i % STAGES), (i // STAGES) & 1)


@gluon.jit
def _alloc_ring(desc, STAGES: gl.constexpr):
    return gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)


@gluon.jit
def _alloc_bars(N: gl.constexpr, COUNT: gl.constexpr = 1):
    # COUNT arrivals complete a phase (a TMA's expect counts as one)
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=COUNT)
    return bars


@gluon.jit
def _kv_tile(bufs, i, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    # the 4-D TMA block [1, BLOCK_N, 1, D] of stage i % STAGES seen as the 2-D matrix wgmma reads
    return bufs.index(i % STAGES).reshape([BLOCK_N, BLOCK_D])


@gluon.jit
def _scores(
    q2, k_bufs, q2_tail, kt_bufs, j, s_zero, st_zero, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr, BLOCK_NT: gl.constexpr,
):  # fmt: skip
    """QK^T of key block j, issued (async, one wgmma group per piece): over the head dim's
    BLOCK_D-wide main piece and, when BLOCK_DT > 0, its tail piece added into the same scores
    (a D=192 runs as 128 + 64 columns instead of padded to 256); with BLOCK_NT > 0 the block's
    key tail (kt_bufs: its BLOCK_NT keys after the BLOCK_N) into scores of its own. Returns the
    tokens (s, s_t); s_t is s without a key tail."""
    s_tok = warpgroup_mma(
        q2, _kv_tile(k_bufs, j, STAGES, BLOCK_N, BLOCK_D).permute((1, 0)), s_zero, use_acc=False, is_async=True
    )
    st_tok = s_tok
    if BLOCK_DT > 0:
        s_tok = warpgroup_mma(
            q2_tail, _kv_tile(kt_bufs, j, STAGES, BLOCK_N, BLOCK_DT).permute((1, 0)), s_tok, is_async=True
        )
    if BLOCK_NT > 0:
        st_tok = warpgroup_mma(
            q2, _kv_tile(kt_bufs, j, STAGES, BLOCK_NT, BLOCK_D).permute((1, 0)), st_zero, use_acc=False,
            is_async=True,
        )  # fmt: skip
    return s_tok, st_tok


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr):
    # P stays in registers as wgmma's A operand (the accumulator's layout already matches)
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _pv_operand(p, dtype: gl.constexpr, o_layout: gl.constexpr, P_EARLY: gl.constexpr):
    # the PV matmul's A operand: p itself when it was made one early (P_EARLY), else p converted
    if P_EARLY:
        return p
    else:
        return _p_operand(p, dtype, o_layout)


# ----------------------------------------------------------------------------------------------
# Overlapped: QK^T(j) and PV(j-1) in flight together.


@gluon.jit
def _overlap_loop(
    q2,
    k_bufs,
    q2_tail,
    kt_bufs,
    v_bufs,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    vt_bufs,
    acc,
    acc_t,
    m_i,
    l_i,
    first_row,
    lo,
    n,
    it,
    full_lo,
    full_hi,
    qk_scale,
    Sq,
    Sk,
    q_start,
    k_start,
    win_left,
    win_right,
    KLO,
    KHI,
    bias_bufs,
    plain_lo,
    plain_hi,
    STAGES: gl.constexpr,
    MASK: gl.constexpr,
    LEFT: gl.constexpr,
    POSITIVE_SCALE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_NT: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_DT: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    BLOCK_DVT: gl.constexpr,
    s_layout: gl.constexpr,
    st_layout: gl.constexpr,
    o_layout: gl.constexpr,
    ot_layout: gl.constexpr,
    P_EARLY: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    """The overlapped key loop over the n >= 1 blocks from key lo that the producer partition
    streams into the rings, after the `it` blocks this program took before (a persistent
    program's earlier tiles: the rings' stages and phases run on); releases each stage through
    its empty barrier. With BLOCK_DVT > 0
    v's head dim runs in two pieces too (acc: its first BLOCK_DV columns, acc_t the BLOCK_DVT
    after them, vt_bufs their V ring; else acc_t is None in and acc out). P_EARLY: each block's
    probabilities become the 16-bit PV operand as soon as the previous PV has landed, so that
    half as many registers (P in 16 bits, not float32) stay live across the loop's back edge
    beside the next block's scores. With BLOCK_NT > 0 each key block is BLOCK_N + BLOCK_NT keys
    in two pieces (k_bufs / v_bufs the first BLOCK_N, kt_bufs / vt_bufs the BLOCK_NT after
    them; st_layout the tail's scores), scored into two accumulators and added into acc by two
    PV wgmmas: a block wider than a power of two. HAS_BIAS: bias_bufs holds each K stage's key
    bias, [plain_lo, plain_hi) the keys whose bias is 0 (_biased_scores). Returns (acc, acc_t, m_i, l_i)."""
    dtype: gl.constexpr = q2.dtype
    KEYS: gl.constexpr = BLOCK_N + BLOCK_NT  # a key block's rows, both pieces
    # a key block's PV is two wgmma groups when v or the keys run in two pieces
    PV_GROUPS: gl.constexpr = 2 if BLOCK_DVT + BLOCK_NT > 0 else 1
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    st_zero = s_zero
    if BLOCK_NT > 0:
        st_zero = gl.zeros([BLOCK_M, BLOCK_NT], gl.float32, st_layout)

    # block 0: scores only
    _wait_stage(k_ready, it, STAGES)
    s_tok, st_tok = _scores(q2, k_bufs, q2_tail, kt_bufs, it, s_zero, st_zero, STAGES, BLOCK_N, BLOCK_D, BLOCK_DT,
                            BLOCK_NT)  # fmt: skip
    s, s_t = _landed_scores(s_tok, st_tok, 0, BLOCK_NT)
    s, scale2 = _biased_scores(s, bias_bufs, it, lo, plain_lo, plain_hi, qk_scale, HAS_BIAS, STAGES, s_layout)
    mbarrier.arrive(k_empty.index(it % STAGES))
    p, p_t, m_i, l_i, alpha = _softmax_step(
        s, s_t, scale2, m_i, l_i, first_row, lo, full_lo, full_hi, qk_scale, Sq, Sk, q_start, k_start,
        win_left, win_right, KLO, KHI, MASK, LEFT, POSITIVE_SCALE, BLOCK_N, BLOCK_NT, HAS_BIAS,
    )  # fmt: skip
    acc = acc * _rows(alpha, o_layout)[:, None]
    if BLOCK_DVT > 0:
        acc_t = acc_t * _rows(alpha, ot_layout)[:, None]
    if P_EARLY:
        p = _p_operand(p, dtype, o_layout)
        if BLOCK_NT > 0:
            p_t = _p_operand(p_t, dtype, o_layout)
    for j in range(1, n):
        _wait_stage(k_ready, it + j, STAGES)
        s_tok, st_tok = _scores(q2, k_bufs, q2_tail, kt_bufs, it + j, s_zero, st_zero, STAGES, BLOCK_N, BLOCK_D,
                                BLOCK_DT, BLOCK_NT)  # fmt: skip
        prev = it + j - 1  # the block whose PV is issued now
        _wait_stage(v_ready, prev, STAGES)
        p_op = _pv_operand(p, dtype, o_layout, P_EARLY)
        pt_op = p_op
        acc_tok = warpgroup_mma(p_op, _kv_tile(v_bufs, prev, STAGES, BLOCK_N, BLOCK_DV), acc, is_async=True)
        acc_t_tok = acc_tok
        if BLOCK_DVT > 0:
            acc_t_tok = warpgroup_mma(p_op, _kv_tile(vt_bufs, prev, STAGES, BLOCK_N, BLOCK_DVT), acc_t, is_async=True)
        if BLOCK_NT > 0:
            pt_op = _pv_operand(p_t, dtype, o_layout, P_EARLY)
            acc_tok = warpgroup_mma(pt_op, _kv_tile(vt_bufs, prev, STAGES, BLOCK_NT, BLOCK_DV), acc_tok, is_async=True)
        # groups complete in order: with PV(j-1)'s one or two groups left in flight, QK^T(j)
        # is done (every piece's group), PV(j-1) may not be
        s, s_t = _landed_scores(s_tok, st_tok, PV_GROUPS, BLOCK_NT)
        s, scale2 = _biased_scores(s, bias_bufs, it + j, lo + j * KEYS, plain_lo, plain_hi, qk_scale, HAS_BIAS,
                                   STAGES, s_layout)  # fmt: skip
        mbarrier.arrive(k_empty.index((it + j) % STAGES))
        p, p_t, m_i, l_i, alpha = _softmax_step(
            s, s_t, scale2, m_i, l_i, first_row, lo + j * KEYS, full_lo, full_hi, qk_scale, Sq, Sk,
            q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT, POSITIVE_SCALE, BLOCK_N, BLOCK_NT, HAS_BIAS,
        )  # fmt: skip
        if BLOCK_DVT > 0:
            acc, acc_t, p_op = warpgroup_mma_wait(0, deps=(acc_tok, acc_t_tok, p_op))
        elif BLOCK_NT > 0:
            acc, p_op, pt_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op, pt_op))
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        if P_EARLY:  # (only now: the landed PV read the previous operand's registers)
            p = _p_operand(p, dtype, o_layout)
            if BLOCK_NT > 0:
                p_t = _p_operand(p_t, dtype, o_layout)
        mbarrier.arrive(v_empty.index(prev % STAGES))
        # rescale only once PV(j-1) has landed in acc
        acc = acc * _rows(alpha, o_layout)[:, None]
        if BLOCK_DVT > 0:
            acc_t = acc_t * _rows(alpha, ot_layout)[:, None]
    last = it + n - 1
    _wait_stage(v_ready, last, STAGES)
    p_op = _pv_operand(p, dtype, o_layout, P_EARLY)
    if BLOCK_NT > 0:
        acc = warpgroup_mma(p_op, _kv_tile(v_bufs, last, STAGES, BLOCK_N, BLOCK_DV), acc, is_async=True)
        pt_op = _pv_operand(p_t, dtype, o_layout, P_EARLY)
        acc = warpgroup_mma(pt_op, _kv_tile(vt_bufs, last, STAGES, BLOCK_NT, BLOCK_DV), acc)
    else:
        acc = warpgroup_mma(p_op, _kv_tile(v_bufs, last, STAGES, BLOCK_N, BLOCK_DV), acc)
    if BLOCK_DVT > 0:
        acc_t = warpgroup_mma(p_op, _kv_tile(vt_bufs, last, STAGES, BLOCK_N, BLOCK_DVT), acc_t)
    else:  # a jit function returns tensors only: acc stands in
        acc_t = acc
    # the last V stage too: a persistent program's next tile loads into it
    mbarrier.arrive(v_empty.index(last % STAGES))
    return acc, acc_t, m_i, l_i


@gluon.jit
def _landed_scores(s_tok, st_tok, IN_FLIGHT: gl.constexpr, BLOCK_NT: gl.constexpr):
    """(s, s_t): the block's scores once its QK^T groups have landed, with IN_FLIGHT later
    groups still running; s_t is s without a key tail (BLOCK_NT == 0)."""
    if BLOCK_NT > 0:
        s, s_t = warpgroup_mma_wait(IN_FLIGHT, deps=(s_tok, st_tok))
    else:
        s = warpgroup_mma_wait(IN_FLIGHT, deps=(s_tok,))
        s_t = s
    return s, s_t


# ----------------------------------------------------------------------------------------------
# Warp-specialized: a TMA producer warp and the consumer warpgroups.


@gluon.jit
def _produce_tile(
    q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_bufs, k_bufs, v_bufs, qt_bufs, kt_bufs, vt_bufs, q_bar,
    k_ready, v_ready, k_empty, v_empty, q_empty, b, h, hk, off_m, lo, n, it, uses, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_NT: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr,
    BLOCK_DV: gl.constexpr, BLOCK_DVT: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    CONSUMERS: gl.constexpr, bias_desc, bias_bufs, KEY_SPANS, HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """One query tile's loads: its Q (the program's `uses`-th, when n > 0) and its n K/V blocks
    (with HAS_BIAS up to the batch row's trailing padding, _unpadded_blocks, and each K block's
    key bias but the leading zero-bias blocks', _plain_lead) into the rings after the `it` this
    program loaded before. Returns the blocks loaded."""
    # the column offsets of q/k's and v's tail pieces (0: no tail)
    TAIL_COL: gl.constexpr = BLOCK_D if BLOCK_DT > 0 else 0
    TAIL_COL_V: gl.constexpr = BLOCK_DV if BLOCK_DVT > 0 else 0
    # the key tail's first row in its block (0: none); K's and V's alike
    TAIL_ROW: gl.constexpr = BLOCK_N if BLOCK_NT > 0 else 0
    KEYS: gl.constexpr = BLOCK_N + BLOCK_NT
    pad_end, plain_lo, plain_hi = _key_spans(KEY_SPANS, b, HAS_BIAS)
    n = _unpadded_blocks(n, lo, pad_end, KEYS, HAS_BIAS)
    if n > 0:  # one Q buffer per consumer warpgroup (and one per tail piece), all on one barrier
        if PERSISTENT:  # every consumer warpgroup done with the previous tile's Q
            mbarrier.wait(q_empty.index(0), (uses & 1) ^ 1)
        q_rows: gl.constexpr = BLOCK_M // CONSUMERS
        if TAIL_COL > 0:
            mbarrier.expect(q_bar.index(0), CONSUMERS * (q_desc.block_type.nbytes + qt_desc.block_type.nbytes))
        else:
            mbarrier.expect(q_bar.index(0), CONSUMERS * q_desc.block_type.nbytes)
        for part in gl.static_range(CONSUMERS):
            row = off_m + part * q_rows
            tma.async_copy_global_to_shared(q_desc, [b, row, h, 0], q_bar.index(0), q_bufs.index(part))
            if TAIL_COL > 0:
                tma.async_copy_global_to_shared(qt_desc, [b, row, h, TAIL_COL], q_bar.index(0), qt_bufs.index(part))
    # the leading blocks the consumers take through the loop without a bias get no bias load:
    # a second TMA a block, on K's barrier, that nobody reads
    VERSIONED: gl.constexpr = _versioned(HAS_BIAS, BLOCK_DT, BLOCK_DVT)
    n_plain = _plain_lead(lo, n, plain_lo, plain_hi, BLOCK_N, VERSIONED)
    if VERSIONED:
        _produce_blocks(k_desc, v_desc, kt_desc, vt_desc, k_bufs, v_bufs, kt_bufs, vt_bufs, k_ready, v_ready,
                        k_empty, v_empty, b, hk, lo - it * KEYS, it, it + n_plain, STAGES, KEYS, TAIL_ROW, TAIL_COL,
                        TAIL_COL_V, bias_desc, bias_bufs, False)  # fmt: skip
    _produce_blocks(k_desc, v_desc, kt_desc, vt_desc, k_bufs, v_bufs, kt_bufs, vt_bufs, k_ready, v_ready, k_empty,
                    v_empty, b, hk, lo - it * KEYS, it + n_plain, it + n, STAGES, KEYS, TAIL_ROW, TAIL_COL,
                    TAIL_COL_V, bias_desc, bias_bufs, HAS_BIAS)  # fmt: skip
    return n


@gluon.jit
def _produce_blocks(
    k_desc, v_desc, kt_desc, vt_desc, k_bufs, v_bufs, kt_bufs, vt_bufs, k_ready, v_ready, k_empty, v_empty, b, hk,
    base, first, last, STAGES: gl.constexpr, KEYS: gl.constexpr, TAIL_ROW: gl.constexpr, TAIL_COL: gl.constexpr,
    TAIL_COL_V: gl.constexpr, bias_desc, bias_bufs, HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """The K/V loads (_load_kv) of the program's key blocks first .. last - 1 (block i's keys
    from base + i * KEYS), each once both consumer warpgroups released its stage; with HAS_BIAS
    each K block's key bias too."""
    for i in range(first, last):
        # a fresh barrier counts as having completed the phase before 0, so the first
        # STAGES waits (parity 1) pass at once
        mbarrier.wait(k_empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
        _load_kv(k_desc, k_bufs, k_ready, i, b, hk, base, STAGES, KEYS, kt_desc, kt_bufs, TAIL_ROW, TAIL_COL,
                 bias_desc, bias_bufs, HAS_BIAS)  # fmt: skip
        mbarrier.wait(v_empty.index(i % STAGES), ((i // STAGES) & 1) ^ 1)
        _load_kv(v_desc, v_bufs, v_ready, i, b, hk, base, STAGES, KEYS, vt_desc, vt_bufs, TAIL_ROW, TAIL_COL_V)


@gluon.jit
def _ws_producer(
    q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_bufs, k_bufs, v_bufs, qt_bufs, kt_bufs, vt_bufs, q_bar,
    k_ready, v_ready, k_empty, v_empty, q_empty, b, h, hk, off_m, lo, n, num_tiles, Hq, group, Sq, Sk, q_start,
    k_start, win_left, win_right, KLO, KHI, MASK: gl.constexpr, LEFT: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_NT: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr,
    BLOCK_DV: gl.constexpr, BLOCK_DVT: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    CONSUMERS: gl.constexpr, DYNAMIC: gl.constexpr, tile_counter, tile_ids, tile_full, tile_empty, heads_per_group,
    SHORT_GROUP_FIRST: gl.constexpr, bias_desc, bias_bufs, KEY_SPANS, HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """The TMA producer warp: this program's tile (b, h, hk, off_m, lo, n), or with PERSISTENT
    every num_programs-th of the num_tiles tiles from program_id on, each planned here as
    the consumers plan it (_tile_plan); or with DYNAMIC too each tile it takes from
    tile_counter, passed on to the consumers (_gluon_counter; the tile_ and heads_per_group
    arguments: stand-ins without DYNAMIC)."""
    if DYNAMIC:
        num_m = (Sq + BLOCK_M - 1) // BLOCK_M
        it = 0
        uses = 0
        k = 0  # tiles taken
        t = _fetch_tile(tile_counter)
        while t < num_tiles:
            b, h, hk, off_m, lo, n, _, _, _, _ = _handed_tile_plan(
                t, num_m, num_tiles, heads_per_group, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO,
                KHI, MASK, LEFT, SHORT_GROUP_FIRST, BLOCK_M, BLOCK_N + BLOCK_NT, 1,
            )  # fmt: skip
            # the consumers take the plan as it is: planned by each of them, 32-128 bytes spilled
            # at D=128 (its values kept across the key loop)
            _publish_tile(tile_ids, tile_full, tile_empty, k, t, (b, h, off_m, lo, n, 0), True)
            n = _produce_tile(
                q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_bufs, k_bufs, v_bufs, qt_bufs, kt_bufs, vt_bufs,
                q_bar, k_ready, v_ready, k_empty, v_empty, q_empty, b, h, hk, off_m, lo, n, it, uses, BLOCK_M,
                BLOCK_N, BLOCK_NT, BLOCK_D, BLOCK_DT, BLOCK_DV, BLOCK_DVT, STAGES, PERSISTENT, CONSUMERS, bias_desc,
                bias_bufs, KEY_SPANS, HAS_BIAS,
            )  # fmt: skip
            # the next tile taken only once this one's loads are issued (the consumers have
            # about STAGES key blocks of it left): one taken earlier would be held back from a
            # program that is free
            t = _fetch_tile(tile_counter)
            it += n
            uses += gl.minimum(n, 1)
            k += 1
        # past the last tile: the consumers stop; the launch's last fetch puts the counter back
        _publish_tile(tile_ids, tile_full, tile_empty, k, t, (0, 0, 0, 0, 0, 0), False)
        _reset_counter(tile_counter, t == num_tiles + gl.num_programs(0) - 1)
    elif PERSISTENT:
        num_m = (Sq + BLOCK_M - 1) // BLOCK_M
        it = 0
        uses = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, hk, off_m, lo, n, _, _, _, _ = _tile_plan(
                t, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT, BLOCK_M,
                BLOCK_N + BLOCK_NT, 1,
            )  # fmt: skip
            n = _produce_tile(
                q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_bufs, k_bufs, v_bufs, qt_bufs, kt_bufs, vt_bufs,
                q_bar, k_ready, v_ready, k_empty, v_empty, q_empty, b, h, hk, off_m, lo, n, it, uses, BLOCK_M,
                BLOCK_N, BLOCK_NT, BLOCK_D, BLOCK_DT, BLOCK_DV, BLOCK_DVT, STAGES, PERSISTENT, CONSUMERS, bias_desc,
                bias_bufs, KEY_SPANS, HAS_BIAS,
            )  # fmt: skip
            it += n
            uses += gl.minimum(n, 1)
    else:
        _produce_tile(
            q_desc, k_desc, v_desc, qt_desc, kt_desc, vt_desc, q_bufs, k_bufs, v_bufs, qt_bufs, kt_bufs, vt_bufs,
            q_bar, k_ready, v_ready, k_empty, v_empty, q_empty, b, h, hk, off_m, lo, n, 0, 0, BLOCK_M, BLOCK_N,
            BLOCK_NT, BLOCK_D, BLOCK_DT, BLOCK_DV, BLOCK_DVT, STAGES, PERSISTENT, CONSUMERS, bias_desc, bias_bufs,
            KEY_SPANS, HAS_BIAS,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Warp-specialized, FA3's layout: each of two consumer warpgroups is its own partition with its
# own 64 query rows of the tile, so they are never held in lockstep by a barrier of all their
# warps; they share the K/V stages (the empty barriers wait for both).


@gluon.jit
def _consume_tile(
    WG: gl.constexpr, q_bufs, k_bufs, qt_bufs, kt_bufs, v_bufs, vt_bufs, q_bar, k_ready, v_ready, k_empty, v_empty,
    q_empty, O, M, L, KLO, KHI, bias_bufs, KEY_SPANS, stride_ob, stride_os, stride_oh, stride_mb, stride_mh,
    stride_ms, stride_lb, stride_lh, stride_ls, b, h, off_m, lo, n, it, uses, full_lo, full_hi, Sq, Sk, q_start,
    k_start, win_left, win_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, BLOCK_DV: gl.constexpr, BLOCK_DVT: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_NT: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr, LEFT: gl.constexpr,
    NORMALIZE: gl.constexpr, HAS_STATE: gl.constexpr, POSITIVE_SCALE: gl.constexpr, PERSISTENT: gl.constexpr,
    CONSUMERS: gl.constexpr, P_EARLY: gl.constexpr, HAS_BIAS: gl.constexpr, OPAQUE: gl.constexpr = False,
):  # fmt: skip
    """Warpgroup WG's rows of one query tile: its key loop over the tile's n blocks (after the
    `it` this program took before; its Q the program's `uses`-th), then its output (OPAQUE: its
    index vectors recomputed per tile, _write_out). HAS_BIAS: bias_bufs the key bias ring
    (_biased_scores), the tile cut at its batch row's trailing padding (_unpadded_blocks, as the
    producer cuts it). Returns the key blocks consumed."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    pad_end, plain_lo, plain_hi = _key_spans(KEY_SPANS, b, HAS_BIAS)
    n = _unpadded_blocks(n, lo, pad_end, BLOCK_N + BLOCK_NT, HAS_BIAS)
    s_layout: gl.constexpr = _mma_layout(4, BLOCK_N)
    st_layout: gl.constexpr = _mma_layout(4, BLOCK_NT if BLOCK_NT > 0 else BLOCK_N)  # (unused without a key tail)
    o_layout: gl.constexpr = _mma_layout(4, BLOCK_DV)
    ot_layout: gl.constexpr = _mma_layout(4, BLOCK_DVT if BLOCK_DVT > 0 else BLOCK_DV)  # (unused without a tail)
    # the key blocks [lo, lo + n * (BLOCK_N + BLOCK_NT)) are the whole tile's, as the producer's: both
    # warpgroups consume every block; the mask is this warpgroup's rows'
    my_m = off_m + WG * ROWS
    acc, m_i, l_i = _empty_state(ROWS, BLOCK_DV, s_layout, o_layout)
    acc_t = None
    if BLOCK_DVT > 0:
        acc_t = gl.zeros([ROWS, BLOCK_DVT], gl.float32, ot_layout)
    if n > 0:
        mbarrier.wait(q_bar.index(0), uses & 1)
        q_tail = None
        if BLOCK_DT > 0:
            q_tail = qt_bufs.index(WG).reshape([ROWS, BLOCK_DT])
        q2 = q_bufs.index(WG).reshape([ROWS, BLOCK_D])
        rings = (kt_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, vt_bufs)  # (a tuple holds no None: q_tail)
        bounds = (full_lo, full_hi, qk_scale, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, bias_bufs,
                  plain_lo, plain_hi)  # fmt: skip
        acc_loop_t = acc  # (a stand-in: a None acc_t cannot cross a runtime branch)
        if BLOCK_DVT > 0:
            acc_loop_t = acc_t
        VERSIONED: gl.constexpr = _versioned(HAS_BIAS, BLOCK_DT, BLOCK_DVT)
        n_plain = _plain_lead(lo, n, plain_lo, plain_hi, BLOCK_N, VERSIONED)
        if VERSIONED:
            if n_plain > 0:
                acc, acc_loop_t, m_i, l_i = _overlap_loop(
                    q2, k_bufs, q_tail, *rings, acc, acc_loop_t, m_i, l_i, my_m, lo, n_plain, it, *bounds, STAGES,
                    MASK, LEFT, True, ROWS, BLOCK_N, BLOCK_NT, BLOCK_D, BLOCK_DT, BLOCK_DV, BLOCK_DVT, s_layout,
                    st_layout, o_layout, ot_layout, P_EARLY, False,
                )  # fmt: skip
        if n_plain < n:  # (every block without the versioning above)
            acc, acc_loop_t, m_i, l_i = _overlap_loop(
                q2, k_bufs, q_tail, *rings, acc, acc_loop_t, m_i, l_i, my_m, lo + n_plain * (BLOCK_N + BLOCK_NT),
                n - n_plain, it + n_plain, *bounds, STAGES, MASK, LEFT, POSITIVE_SCALE, ROWS, BLOCK_N, BLOCK_NT,
                BLOCK_D, BLOCK_DT, BLOCK_DV, BLOCK_DVT, s_layout, st_layout, o_layout, ot_layout, P_EARLY, HAS_BIAS,
            )  # fmt: skip
        if PERSISTENT:  # this warpgroup is done with Q: the producer may load the next tile's
            mbarrier.arrive(q_empty.index(0))
        if BLOCK_DVT > 0:  # (a None acc_t cannot leave this runtime branch)
            acc_t = acc_loop_t
    _write_out(
        acc, acc_t, m_i, l_i, O, M, L, b, h, my_m, Sq, n > 0, stride_ob, stride_os, stride_oh, stride_mb, stride_mh,
        stride_ms, stride_lb, stride_lh, stride_ls, NORMALIZE, HAS_STATE, ROWS, HEAD_DIM_V, BLOCK_DV, BLOCK_DVT,
        s_layout, o_layout, ot_layout, OPAQUE,
    )  # fmt: skip
    return n


@gluon.jit
def _wg_key_core(
    WG: gl.constexpr, off_m, full_lo0, full_hi0, full_lo1, full_hi1, Sq, Sk, q_start, k_start, win_left, win_right,
    KLO, KHI, MASK: gl.constexpr, ROWS: gl.constexpr, CONSUMERS: gl.constexpr,
):  # fmt: skip
    """(full_lo, full_hi): the keys every valid row of consumer warpgroup WG sees. Two consumers
    take their half from the tile's plan (_tile_key_range); each of three finds its own."""
    if CONSUMERS == 3:
        _, _, full_lo, full_hi = _rows_range(off_m + WG * ROWS, Sq, Sk, q_start, k_start, win_left, win_right, KLO,
                                             KHI, MASK, ROWS, 4)  # fmt: skip
    elif WG == 0:
        full_lo, full_hi = full_lo0, full_hi0
    else:
        full_lo, full_hi = full_lo1, full_hi1
    return full_lo, full_hi


@gluon.jit
def _ws2_consumer(
    WG: gl.constexpr, q_bufs, k_bufs, qt_bufs, kt_bufs, v_bufs, vt_bufs, q_bar, k_ready, v_ready, k_empty, v_empty,
    q_empty, O, M, L, KLO, KHI, bias_bufs, KEY_SPANS, stride_ob, stride_os, stride_oh, stride_mb, stride_mh,
    stride_ms, stride_lb, stride_lh, stride_ls, b, h, off_m, lo, n, full_lo0, full_hi0, full_lo1, full_hi1,
    num_tiles, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, qk_scale, HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_DV: gl.constexpr,
    BLOCK_DVT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_NT: gl.constexpr,
    STAGES: gl.constexpr, MASK: gl.constexpr, LEFT: gl.constexpr, NORMALIZE: gl.constexpr, HAS_STATE: gl.constexpr,
    POSITIVE_SCALE: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr, P_EARLY: gl.constexpr,
    HAS_BIAS: gl.constexpr, DYNAMIC: gl.constexpr, tile_ids, tile_full, tile_empty,
):  # fmt: skip
    """Consumer warpgroup WG: this program's tile, or with PERSISTENT the producer's sequence of
    tiles, each planned here as the producer plans it (_tile_plan); with DYNAMIC too the tiles
    the producer passes through tile_ids with their plan (b, h, off_m, lo, n: _ws_producer; the
    tile_ arguments are stand-ins without DYNAMIC)."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    if DYNAMIC:
        it = 0
        uses = 0
        k = 0
        t, plan = _receive_tile(tile_ids, tile_full, tile_empty, k, True)
        while t < num_tiles:
            b, h, off_m, lo, n, _ = plan
            # the keys every row of this warpgroup sees (as _wg_key_core's three consumers find theirs)
            _, _, full_lo, full_hi = _rows_range(off_m + WG * ROWS, Sq, Sk, q_start, k_start, win_left, win_right,
                                                 KLO, KHI, MASK, ROWS, 4)  # fmt: skip
            n = _consume_tile(
                WG, q_bufs, k_bufs, qt_bufs, kt_bufs, v_bufs, vt_bufs, q_bar, k_ready, v_ready, k_empty, v_empty,
                q_empty, O, M, L, KLO, KHI, bias_bufs, KEY_SPANS, stride_ob, stride_os, stride_oh, stride_mb, stride_mh,
                stride_ms, stride_lb, stride_lh, stride_ls, b, h, off_m, lo, n, it, uses, full_lo, full_hi, Sq, Sk,
                q_start, k_start, win_left, win_right, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_DT, HEAD_DIM_V, BLOCK_DV,
                BLOCK_DVT, BLOCK_M, BLOCK_N, BLOCK_NT, STAGES, MASK, LEFT, NORMALIZE, HAS_STATE, POSITIVE_SCALE,
                PERSISTENT, CONSUMERS, P_EARLY, HAS_BIAS, True,
            )  # fmt: skip
            it += n
            uses += gl.minimum(n, 1)
            k += 1
            t, plan = _receive_tile(tile_ids, tile_full, tile_empty, k, True)
    elif PERSISTENT:
        num_m = (Sq + BLOCK_M - 1) // BLOCK_M
        it = 0
        uses = 0
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, _, off_m, lo, n, full_lo0, full_hi0, full_lo1, full_hi1 = _tile_plan(
                t, num_m, Hq, group, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT, BLOCK_M,
                BLOCK_N + BLOCK_NT, 4,
            )  # fmt: skip
            full_lo, full_hi = _wg_key_core(WG, off_m, full_lo0, full_hi0, full_lo1, full_hi1, Sq, Sk, q_start,
                                            k_start, win_left, win_right, KLO, KHI, MASK, ROWS, CONSUMERS)  # fmt: skip
            n = _consume_tile(
                WG, q_bufs, k_bufs, qt_bufs, kt_bufs, v_bufs, vt_bufs, q_bar, k_ready, v_ready, k_empty, v_empty,
                q_empty, O, M, L, KLO, KHI, bias_bufs, KEY_SPANS, stride_ob, stride_os, stride_oh, stride_mb, stride_mh,
                stride_ms, stride_lb, stride_lh, stride_ls, b, h, off_m, lo, n, it, uses, full_lo, full_hi, Sq, Sk,
                q_start, k_start, win_left, win_right, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_DT, HEAD_DIM_V, BLOCK_DV,
                BLOCK_DVT, BLOCK_M, BLOCK_N, BLOCK_NT, STAGES, MASK, LEFT, NORMALIZE, HAS_STATE, POSITIVE_SCALE,
                PERSISTENT, CONSUMERS, P_EARLY, HAS_BIAS,
            )  # fmt: skip
            it += n
            uses += gl.minimum(n, 1)
    else:
        full_lo, full_hi = _wg_key_core(WG, off_m, full_lo0, full_hi0, full_lo1, full_hi1, Sq, Sk, q_start, k_start,
                                        win_left, win_right, KLO, KHI, MASK, ROWS, CONSUMERS)  # fmt: skip
        _consume_tile(
            WG, q_bufs, k_bufs, qt_bufs, kt_bufs, v_bufs, vt_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, q_empty,
            O, M, L, KLO, KHI, bias_bufs, KEY_SPANS, stride_ob, stride_os, stride_oh, stride_mb, stride_mh, stride_ms,
            stride_lb, stride_lh, stride_ls, b, h, off_m, lo, n, 0, 0, full_lo, full_hi, Sq, Sk, q_start, k_start,
            win_left, win_right, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_DT, HEAD_DIM_V, BLOCK_DV, BLOCK_DVT, BLOCK_M,
            BLOCK_N, BLOCK_NT, STAGES, MASK, LEFT, NORMALIZE, HAS_STATE, POSITIVE_SCALE, PERSISTENT, CONSUMERS, P_EARLY,
            HAS_BIAS,
        )  # fmt: skip


@gluon.jit(do_not_specialize=["num_tiles", "heads_per_group", "group", "Sq", "Sk", "q_start", "k_start", "win_left",
                               "win_right"])  # fmt: skip
def _fwd_ws2(
    q_desc,
    k_desc,
    v_desc,
    qt_desc,
    kt_desc,
    vt_desc,
    bias_desc,
    KEY_SPANS,
    O,
    M,
    L,
    KLO,
    KHI,
    stride_ob,
    stride_os,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ls,
    num_tiles,
    heads_per_group,
    Hq,
    group,
    Sq,
    Sk,
    q_start,
    k_start,
    win_left,
    win_right,
    qk_scale,
    TILE_COUNTER,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_DT: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    BLOCK_DVT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_NT: gl.constexpr,
    STAGES: gl.constexpr,
    MASK: gl.constexpr,
    LEFT: gl.constexpr,
    NORMALIZE: gl.constexpr,
    HAS_STATE: gl.constexpr,
    POSITIVE_SCALE: gl.constexpr,
    PERSISTENT: gl.constexpr,
    DYNAMIC: gl.constexpr,
    CONSUMERS: gl.constexpr,
    P_EARLY: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    SHORT_GROUP_FIRST: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """q_desc blocks are [1, BLOCK_M // CONSUMERS, 1, BLOCK_D] (one per consumer warpgroup: two
    or three of 64 rows each), k_desc
    [1, BLOCK_N, 1, BLOCK_D], v_desc [1, BLOCK_N, 1, BLOCK_DV]; BLOCK_D is q/k's head dim
    HEAD_DIM padded to a power of two, BLOCK_DV v's (and O's) head dim HEAD_DIM_V padded (the
    descriptors read the padding columns as zeros); num_warps = 4. With BLOCK_DT > 0, q/k's
    head dim runs in two pieces: BLOCK_D columns by q_desc / k_desc and the BLOCK_DT columns
    from column BLOCK_D on by qt_desc / kt_desc (blocks [.., BLOCK_DT]; None when
    BLOCK_DT = 0), e.g. 192 as 128 + 64 (tiles must be powers of two); v's likewise with
    BLOCK_DVT and vt_desc (from column BLOCK_DV on). With BLOCK_NT > 0 instead (no head-dim
    pieces), each key block is BLOCK_N + BLOCK_NT keys in two pieces: kt_desc / vt_desc blocks
    [1, BLOCK_NT, 1, BLOCK_D or BLOCK_DV] read each block's rows from BLOCK_N on (e.g. 192 keys
    as 128 + 64, wider than the power of two below it and with no padded keys).
    MASK, LEFT, win_left, win_right, KLO, KHI: as the Triton forward's (tiles.MASK_*; KLO / KHI
    (Sq,) int32 global key bounds for MASK_ROWS, any pointer otherwise). HAS_BIAS (key blocks of
    one piece, POSITIVE_SCALE off): bias_desc a 2-D TMA descriptor over a (B, Sk) float32 bias
    added to every query's scores of each key (natural-log units; -inf hides the key: a key
    padding mask), blocks [1, BLOCK_N], loaded with each K block, and KEY_SPANS (B, 3) int32,
    key_bias.key_spans: each batch row's last key the bias does not hide, plus one (its trailing
    padding: the key blocks past it are skipped, _unpadded_blocks), and its keys of zero bias
    (computed without it, _biased_scores); else both None.
    Grid (cdiv(Sq, BLOCK_M), B * Hq), one query tile a program (MASK_WINDOW: taken in
    _launch_order, heads_per_group heads together); or with PERSISTENT (windows,
    not MASK_ROWS, whose per-row reductions stay before the split; the launcher takes it for
    dense and causal blocks) a 1-D grid of at most one
    program per multiprocessor, program p taking tiles p, p + programs, .. of the num_tiles =
    cdiv(Sq, BLOCK_M) * B * Hq: the producer loads the next tile's Q and first K/V blocks while
    the consumers write the last tile's output. With DYNAMIC too (PERSISTENT only) the programs
    take the tiles from TILE_COUNTER instead (int32 (1,), zero at the launch and put back to
    zero by the launch's last fetch: _gluon_counter), in the one-tile launch's order
    (_handed_tile_plan), each as soon as its producer is free for it; without DYNAMIC
    TILE_COUNTER is None."""
    gl.static_assert(num_warps == 4, "ws2: the default partition is one consumer warpgroup")
    gl.static_assert(q_desc.block_type.shape[1] * CONSUMERS == BLOCK_M)
    gl.static_assert(v_desc.block_type.shape[3] == BLOCK_DV)
    gl.static_assert(not (PERSISTENT and MASK == MASK_ROWS), "persistent programs plan windows only")
    gl.static_assert(PERSISTENT or not DYNAMIC, "tiles from a counter: persistent programs only")
    gl.static_assert(BLOCK_NT == 0 or BLOCK_DT + BLOCK_DVT == 0, "a key tail or head-dim tails, not both")
    dtype: gl.constexpr = q_desc.dtype
    if PERSISTENT:  # each partition plans its tiles (_tile_plan); stand-ins here
        b = 0
        h = 0
        hk = 0
        off_m = 0
        lo = 0
        n = 0
        full_lo0 = 0
        full_hi0 = 0
        full_lo1 = 0
        full_hi1 = 0
    else:
        if MASK == MASK_WINDOW:  # causal and windows: heads_per_group heads together
            pid_m, pid_bh = _launch_order(heads_per_group, SHORT_GROUP_FIRST)
        else:  # (as the grid lists them; no registers spent on the order)
            pid_m = gl.program_id(0)
            pid_bh = gl.program_id(1)
        b, h, hk, off_m = _tile(pid_m, pid_bh, gl.num_programs(0), Hq, group, MASK != MASK_NONE, BLOCK_M)
        lo, n, full_lo0, full_hi0, full_lo1, full_hi1 = _tile_key_range(
            off_m, Sq, Sk, q_start, k_start, win_left, win_right, KLO, KHI, MASK, LEFT, BLOCK_M, BLOCK_N + BLOCK_NT,
            num_warps,
        )  # fmt: skip
    q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = _alloc_ring(k_desc, STAGES)
    v_bufs = _alloc_ring(v_desc, STAGES)
    if BLOCK_DT > 0:  # the head dim's tail piece of Q and of each K stage
        qt_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + qt_desc.block_type.shape, qt_desc.layout)
        kt_bufs = _alloc_ring(kt_desc, STAGES)
    elif BLOCK_NT > 0:  # each K stage's key tail (no Q tail)
        qt_bufs = q_bufs
        kt_bufs = _alloc_ring(kt_desc, STAGES)
    else:  # stand-ins, never read (warp_specialize's arguments cannot be None)
        qt_bufs = q_bufs
        kt_bufs = k_bufs
    if BLOCK_DVT + BLOCK_NT > 0:  # v's tail piece of each V stage, or its key tail
        vt_bufs = _alloc_ring(vt_desc, STAGES)
    else:
        vt_bufs = v_bufs
    if HAS_BIAS:  # each K stage's key bias
        gl.static_assert(BLOCK_NT == 0, "a key bias takes key blocks of one piece")
        gl.static_assert(PLAIN_ALIGN % BLOCK_N == 0, "a zero-bias span holds whole key blocks")
        bias_bufs = _alloc_ring(bias_desc, STAGES)
    else:  # a stand-in, never read
        bias_bufs = k_bufs
    q_bar = _alloc_bars(1)
    if PERSISTENT:
        q_empty = _alloc_bars(1, CONSUMERS)  # every consumer warpgroup done with Q
    else:
        q_empty = q_bar  # a stand-in, never used
    k_ready = _alloc_bars(STAGES)
    v_ready = _alloc_bars(STAGES)
    k_empty = _alloc_bars(STAGES, CONSUMERS)  # released when every consumer warpgroup is done
    v_empty = _alloc_bars(STAGES, CONSUMERS)
    if DYNAMIC:  # the producer's tiles passed to the consumers (_gluon_counter)
        tile_ids = gl.allocate_shared_memory(gl.int32, [2 * TILE_WORDS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tile_full = _alloc_bars(2)
        tile_empty = _alloc_bars(2, CONSUMERS)
        tile_counter = TILE_COUNTER
        tile_heads = heads_per_group
    else:  # stand-ins, never used (constants: no argument passed to the partitions)
        tile_ids = 0
        tile_full = 0
        tile_empty = 0
        tile_counter = 0
        tile_heads = 0
    fence_async_shared()
    # The consumer warpgroups take the same arguments after their index WG. Annotated
    # constexpr only so that the assignment keeps the tuple as built: a plain one turns its
    # constexpr members into tensors. Used only unpacked into the tuples below.
    consumer_args: gl.constexpr = (
        q_bufs,
        k_bufs,
        qt_bufs,
        kt_bufs,
        v_bufs,
        vt_bufs,
        q_bar,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        q_empty,
        O,
        M,
        L,
        KLO,
        KHI,
        bias_bufs,
        KEY_SPANS,
        stride_ob,
        stride_os,
        stride_oh,
        stride_mb,
        stride_mh,
        stride_ms,
        stride_lb,
        stride_lh,
        stride_ls,
        b,
        h,
        off_m,
        lo,
        n,
        full_lo0,
        full_hi0,
        full_lo1,
        full_hi1,
        num_tiles,
        Hq,
        group,
        Sq,
        Sk,
        q_start,
        k_start,
        win_left,
        win_right,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_DT,
        HEAD_DIM_V,
        BLOCK_DV,
        BLOCK_DVT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_NT,
        STAGES,
        MASK,
        LEFT,
        NORMALIZE,
        HAS_STATE,
        POSITIVE_SCALE,
        PERSISTENT,
        CONSUMERS,
        P_EARLY,
        HAS_BIAS,
        DYNAMIC,
        tile_ids,
        tile_full,
        tile_empty,
    )
    # The producer's arguments, likewise (a constexpr tuple; Gluon takes no comprehensions, so
    # each consumer count spells its partition list out).
    producer_args: gl.constexpr = (
        q_desc,
        k_desc,
        v_desc,
        qt_desc,
        kt_desc,
        vt_desc,
        q_bufs,
        k_bufs,
        v_bufs,
        qt_bufs,
        kt_bufs,
        vt_bufs,
        q_bar,
        k_ready,
        v_ready,
        k_empty,
        v_empty,
        q_empty,
        b,
        h,
        hk,
        off_m,
        lo,
        n,
        num_tiles,
        Hq,
        group,
        Sq,
        Sk,
        q_start,
        k_start,
        win_left,
        win_right,
        KLO,
        KHI,
        MASK,
        LEFT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_NT,
        BLOCK_D,
        BLOCK_DT,
        BLOCK_DV,
        BLOCK_DVT,
        STAGES,
        PERSISTENT,
        CONSUMERS,
        DYNAMIC,
        tile_counter,
        tile_ids,
        tile_full,
        tile_empty,
        tile_heads,
        SHORT_GROUP_FIRST,
        bias_desc,
        bias_bufs,
        KEY_SPANS,
        HAS_BIAS,
    )
    if CONSUMERS == 3:
        gl.warp_specialize(
            [
                (_ws2_consumer, (0,) + consumer_args),
                (_ws2_consumer, (1,) + consumer_args),
                (_ws2_consumer, (2,) + consumer_args),
                (_ws_producer, () + producer_args),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_ws2_consumer, (0,) + consumer_args),
                (_ws2_consumer, (1,) + consumer_args),
                (_ws_producer, () + producer_args),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


KERNELS = {"ws2": _fwd_ws2}
