"""Gluon backward kernel for Hopper (sm_90a): FlashAttention-3's fused, warp-specialized schedule.

Imported only through ringflash.kernels.gluon_backward, which guards the import: this module
needs `triton.experimental.gluon` (triton >= 3.6).

One program per (key block of BLOCK_N = 128 keys, batch x kv head). It loops over the q heads of
the GQA group and, for each, over the query blocks of BLOCK_M = 64 rows that see the key block;
dK and dV stay in registers (float32) and are stored once at the end. Partitions:

- producer (1 warp, few registers): K and V of the block once, then Q, dO and the two per-row
  statistics of every query block through a STAGES-deep ring (ready / empty mbarriers);
- two consumer warpgroups (4 warps each, WG = 0, 1), each owning 64 of the 128 keys:
    S^T  = K_wg Q^T            (SS wgmma, 64 keys x 64 queries)
    dP^T = V_wg dO^T           (SS)
    P^T  = exp2(fma(S^T, qk_scale, -offset)) (masked on diagonal / ragged blocks)
    dV  += P^T dO              (RS: P^T stays in registers as the A operand)
    dS^T = P^T (dP^T - delta)
    dK  += dS^T Q              (RS)
    dS^T -> shared memory (both halves form the 128-key dS of the block), then
    dQ_wg = dS K[:, 64 WG : 64 WG + 64]  (SS, 64 queries x 64 head-dim columns of this WG)
  and add dQ_wg * scale to a float32 dQ with vectorized atomics (red.global.add.v2.f32: Gluon
  3.6 has no TMA reduce-add).

SPLIT_D (head dims padded to 256, where dK and dV of 128 keys would need 256 registers a thread
and K, V and two Q / dO stages 256 KiB): one program per 64-key block; both consumer warpgroups
hold all 64 keys and split the head-dim columns instead (_consumer_split_d): each computes S^T
and dP^T for 32 of the 64 query rows, writes P^T and dS^T to shared memory, and after a barrier
accumulates dK, dV and computes dQ for its 128 columns over all 64 rows.

Options (constexprs; gluon_backward.VARIANTS names the combinations):
- DQ_BLOCKED: dQ is added unscaled into a float32 scratch in a blocked order (_red_add_blocked):
  eight red.global.add.v4.f32 per thread and step at immediate offsets from one base, each warp
  instruction covering 512 contiguous bytes; the launcher scales and un-permutes it into dq.
- LAG: dQ one step late. Step i computes dQ(i - 1) from dS(i - 1) (three dS buffers), so the
  dS barrier that held both warpgroups in lockstep every step is normally passed at once: they
  may drift up to a step apart (one's softmax beside the other's matmuls). The last step's dQ
  follows the loop.
- DQ_FIRST (with LAG): FlashAttention-3's order, dQ(i - 1) issued before dK(i); the dQ atomics
  then run while dK is in the tensor cores.
- PERSISTENT (ws2): at most one program per multiprocessor, each taking key blocks from a
  counter that the producer reads and passes to the consumers (_fetch_tile, _publish_tile,
  _receive_tile; with packed documents' per-row bounds also the block's query blocks, which the
  producer warp plans: _block_rows); the barriers' phases run on from block to block and
  kv_empty holds the next block's K / V load until both consumers are done with the last.
  ORDERED (with per-row bounds): the counter's n-th block is the n-th of the launcher's order
  (masks.RowBounds.key_order: most query blocks first), each block's heads side by side.

Statistics: `offset` = m + log2(l) per query row (+inf for rows that saw no key and for the
padding rows past Sq, so their probabilities are exactly 0), `delta` = rowsum(dO * O); both
float32, in one padded tensor (B * Hq, 2, Sq_pad) that the launcher builds, read flat by TMA.
Q, K, V, dO: (B, S, H, D) 16-bit tensors through 4-D TMA descriptors (rows past the end read as
zeros, never the next batch's; a head dim D under its tile width BLOCK_D reads zero columns).
Keys past Sk are masked (their zero rows would otherwise meet p = exp2(-offset), which can
overflow, times 0 in the dQ matmul).
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

from ._gluon_counter import TILE_WORDS, _fetch_tile, _max_combine, _publish_tile, _receive_tile
from ._gluon_fwd import PLAIN_ALIGN, _alloc_bars, _hull_and_core, _key_spans, _mma_layout, _opaque, _span_holds
from .tiles import LOG2E, MASK_ROWS, in_bounds, key_query_bounds

# ----------------------------------------------------------------------------------------------
# Which query blocks a key block visits. Every partition computes the same plan from the same
# arguments, so their loops have the same trip count (the barrier protocol depends on it).


@gluon.jit
def _block_coords(p0, p1, p2, dim0, Hkv, BLOCK_N: gl.constexpr, GROUPED_HEADS: gl.constexpr):
    """(b, hk, n0): batch, kv head and first key of the key block at grid coordinates (p0, p1,
    p2) (_plan)."""
    if GROUPED_HEADS:
        n0 = p1 * BLOCK_N
        pid_bh = p2 * dim0 + p0
    else:
        n0 = p0 * BLOCK_N
        pid_bh = p1
    return pid_bh // Hkv, pid_bh % Hkv, n0


@gluon.jit
def _plan(
    p0,
    p1,
    p2,
    dim0,
    Hkv,
    Sq,
    Sk,
    q_start,
    k_start,
    left,
    rows_first,
    rows_n,
    CAUSAL: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    ROWS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    GROUPED_HEADS: gl.constexpr,
):
    """(b, hk, n0, m_first, n_m, full_lo, full_hi, key_ragged) of the key block at grid
    coordinates (p0, p1, p2) of a grid dim0 wide (_grid_coords): batch, kv head,
    first key of the block; the query blocks m_first .. m_first + n_m - 1 see the block
    (n_m >= 0), the rows full_lo .. full_hi see every valid key of it (a query block reaching
    outside is masked); key_ragged: the block runs past Sk. Query row i sees local key j iff
    k_start + j <= q_start + i (CAUSAL: the launcher folds a window's right reach into q_start)
    and q_start + i <= k_start + j + left (HAS_LEFT). ROWS (packed documents): the query blocks
    rows_first .. rows_first + rows_n - 1 (_key_tile_query_range);
    full_lo / full_hi then unused (each consumer has its own keys' range). GROUPED_HEADS: the
    grid is (heads a group, key blocks, groups), so that every head of a group takes its key
    block j (heaviest first when causal) before any takes block j + 1; else (key blocks,
    B * Hkv), head by head."""
    b, hk, n0 = _block_coords(p0, p1, p2, dim0, Hkv, BLOCK_N, GROUPED_HEADS)
    n_last = gl.minimum(n0 + BLOCK_N, Sk) - 1  # last valid key of the block
    n_mblocks = (Sq + BLOCK_M - 1) // BLOCK_M
    m_first = 0
    m_end = n_mblocks
    full_lo = 0
    full_hi = n_mblocks * BLOCK_M
    if CAUSAL:
        first_row = gl.maximum(k_start + n0 - q_start, 0)  # the first row that sees key n0
        m_first = gl.minimum(first_row // BLOCK_M, n_mblocks)
        full_lo = k_start + n_last - q_start  # rows from here see every valid key's right edge
    if HAS_LEFT:
        last_row = gl.minimum(k_start + n_last + left - q_start, Sq - 1)  # the last row that sees key n_last
        m_end = (gl.maximum(last_row, -1) + BLOCK_M) // BLOCK_M  # (never a negative division)
        full_hi = k_start + n0 + left - q_start  # rows up to here see key n0
    if ROWS:
        m_first = rows_first
        m_end = rows_first + rows_n
    n_m = gl.maximum(m_end - m_first, 0)
    return b, hk, n0, m_first, n_m, full_lo, full_hi, n0 + BLOCK_N > Sk


@gluon.jit
def _unpadded(n_m, n0, b, KEY_SPANS, HAS_BIAS: gl.constexpr):
    """n_m, or with HAS_BIAS 0 where the key block from n0 starts past its batch row's last key
    the bias does not hide (KEY_SPANS[b, 0]: that key + 1, key_bias.key_spans): its keys add
    exactly nothing, its dK and dV are zeros. The producer and both consumers cut a block's
    steps here alike; the walk over its query blocks (_query_block) keeps _plan's n_m (a cut
    block takes no step): fed the cut count, a select of a loaded value, it made the causal
    loop slower (benchmarks/NOTES.md, "The cut's step count")."""
    if HAS_BIAS:
        pad_end, _, _ = _key_spans(KEY_SPANS, b, HAS_BIAS)
        n_m = gl.where(n0 < pad_end, n_m, 0)
    return n_m


@gluon.jit
def _plain_block(KEY_SPANS, b, n0, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Whether the key block [n0, n0 + BLOCK_N) lies in its batch row's zero-bias span
    (KEY_SPANS[b, 1:], key_bias.key_spans; multiples of PLAIN_ALIGN, which BLOCK_N divides): its
    probabilities are rebuilt without the bias, as every kernel computed them (_probs_t).
    False without HAS_BIAS."""
    plain = n0 < 0
    if HAS_BIAS:
        gl.static_assert(PLAIN_ALIGN % BLOCK_N == 0, "a zero-bias span holds whole key blocks")
        _, plain_lo, plain_hi = _key_spans(KEY_SPANS, b, HAS_BIAS)
        plain = _span_holds(n0, BLOCK_N, plain_lo, plain_hi)
    return plain


@gluon.jit
def _keys_range(first, Sq, Sk, q_start, k_start, QLO, QHI, KEYS: gl.constexpr, num_warps: gl.constexpr):
    """Over the keys of [first, first + KEYS) below Sk, each seen by the local query rows [lo, hi)
    (tiles.key_query_bounds of per-row bounds): (min lo, max hi), the rows that see some key,
    and (max lo, min hi), the rows that see every key. The mirror of _gluon_fwd._rows_range."""
    keys = first + gl.arange(0, KEYS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    lo, hi = key_query_bounds(keys, Sq, Sk, q_start, k_start, 0, 0, QLO, QHI, MASK_ROWS)
    return _hull_and_core(lo, hi, keys < Sk, Sq)


@gluon.jit
def _key_tile_query_range(
    n0, Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT_D: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Packed documents: the query blocks of the key block from key n0, by num_warps warps:
    (m_first, n_m, full_lo0, full_hi0, full_lo1, full_hi1). The block visits query blocks
    m_first .. m_first + n_m - 1 (those some key sees; n_m == 0: none); every valid key of
    consumer warpgroup w sees the rows [full_lo_w, full_hi_w): a query block inside needs no
    mask. SPLIT_D: both warpgroups hold all keys (the ranges of w = 0 and 1 are the same). The
    same integers whatever the warps: one launch block a program computes it once before the
    partitions split, a persistent program's producer warp for every block it takes (_block_rows:
    one warp's reductions need no shared memory, whose predicated loads the consumers kept live
    across their blocks, and spilled)."""
    if SPLIT_D:
        lo, hi, full_lo0, full_hi0 = _keys_range(n0, Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_N, num_warps)
        full_lo1 = full_lo0
        full_hi1 = full_hi0
    else:
        half: gl.constexpr = BLOCK_N // 2
        lo0, hi0, full_lo0, full_hi0 = _keys_range(n0, Sq, Sk, q_start, k_start, QLO, QHI, half, num_warps)
        lo1, hi1, full_lo1, full_hi1 = _keys_range(n0 + half, Sq, Sk, q_start, k_start, QLO, QHI, half, num_warps)
        lo = gl.minimum(lo0, lo1)
        hi = gl.maximum(hi0, hi1)
    m_first = lo // BLOCK_M
    n_m = gl.maximum((hi + BLOCK_M - 1) // BLOCK_M - m_first, 0)
    return m_first, n_m, full_lo0, full_hi0, full_lo1, full_hi1


@gluon.jit
def _query_block(i, hk, group, m_first, n_m, p0, BLOCK_M: gl.constexpr, WALK: gl.constexpr):
    """(q head, first row) of iteration i: heads of the group outer, query blocks inner.

    WALK (the index in gluon_backward.WALKS): 0, each key block walks its query blocks from the first up;
    1, from its own one (and wraps; p0: the key block's first grid coordinate): programs running
    side by side (neighbouring key blocks of one head) then add their dQ into different rows at
    any moment, instead of all into the same rows at once (with _plan's GROUPED_HEADS p0 is the
    head within its group: any offset is a whole walk); 2, from the last one down: causal key
    blocks side by side, whose first query blocks differ, then read and add the same rows at
    once, as non-causal ones do walking up."""
    g = i // n_m
    j = i - g * n_m
    if WALK == 1:
        j = (j + p0) % n_m
    elif WALK == 2:
        j = n_m - 1 - j
    return hk * group + g, (m_first + j) * BLOCK_M


@gluon.jit
def _grid_coords(t, grid0, grid1):
    """(p0, p1, p2): the coordinates of the t-th program of a grid0 x grid1 x .. launch (p0 fastest)."""
    rest = t // grid0
    return t % grid0, rest % grid1, rest // grid1


# Persistent programs: the producer takes the program's next key block from a counter in global
# memory and passes it to both consumers through one of two shared slots (_gluon_counter).


@gluon.jit
def _block_rows(t, grid0, Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Packed documents, a persistent program's producer warp: key block t's query blocks
    (_key_tile_query_range's six integers; the grid's first coordinate is the key block)."""
    return _key_tile_query_range((t % grid0) * BLOCK_N, Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_M, BLOCK_N, False, 1)


@gluon.jit
def _ordered_tile(t, KEY_ORDER, grid0, grid1):
    """The grid index (key block fastest, grid0 x grid1) of the t-th block handed out in
    KEY_ORDER's order (int32, grid0 key blocks): key block KEY_ORDER[t // grid1], head t % grid1
    (each block's heads side by side). Read by the producer warp."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    block = gl.reduce(gl.load(KEY_ORDER + t // grid1 + gl.arange(0, 1, layout=one)), 0, _max_combine)
    return (t % grid1) * grid0 + block


# ----------------------------------------------------------------------------------------------
# Producer: one warp issuing TMA copies.


@gluon.jit
def _produce_stage(
    g, i, b, hk, group, m_first, n_m, p0, q_desc, do_desc, st_desc, qt_desc, q_bufs, do_bufs, st_bufs, qt_bufs,
    ready, empty, Hq, Sq_pad, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr,
    STAGES: gl.constexpr, WALK: gl.constexpr,
):  # fmt: skip
    """Q, dO and the statistics of the key block's step i, the program's step g (its earlier key
    blocks' steps before it), into stage g % STAGES."""
    s = g % STAGES
    # empty[s]: count 2, one arrival per consumer warpgroup when it has finished reading
    # stage s. The g-th fill of stage s (g // STAGES = u) needs the (u-1)-th release, i.e.
    # phase u-1 completed: parity (u & 1) ^ 1. A fresh barrier counts as having completed
    # the phase before phase 0, so the first STAGES waits (u = 0, parity 1) pass at once.
    mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
    h, off_m = _query_block(i, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
    tail_bytes: gl.constexpr = qt_desc.block_type.nbytes if BLOCK_DT > 0 else 0
    stage_bytes: gl.constexpr = (
        q_desc.block_type.nbytes + tail_bytes + do_desc.block_type.nbytes + 2 * st_desc.block_type.nbytes
    )
    # ready[s]: count 1 (this expect), completes when all stage_bytes have landed
    bar = ready.index(s)
    mbarrier.expect(bar, stage_bytes)
    tma.async_copy_global_to_shared(q_desc, [b, off_m, h, 0], bar, q_bufs.index(s))
    if BLOCK_DT > 0:
        tma.async_copy_global_to_shared(qt_desc, [b, off_m, h, BLOCK_D], bar, qt_bufs.index(s))
    tma.async_copy_global_to_shared(do_desc, [b, off_m, h, 0], bar, do_bufs.index(s))
    # the (offset, delta) rows of (b, h) in the flat statistics: two 1-D copies
    st_at = (b * Hq + h) * 2 * Sq_pad + off_m
    tma.async_copy_global_to_shared(st_desc, [st_at], bar, st_bufs.index(2 * s))
    tma.async_copy_global_to_shared(st_desc, [st_at + Sq_pad], bar, st_bufs.index(2 * s + 1))


@gluon.jit
def _produce_kv(
    b, hk, n0, k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, kv_bar, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr
):  # fmt: skip
    """K and V of the key block (and K's tail piece) into their one buffer. kv_bar: count 1;
    this expect is the arrival that completes its phase once the tiles have landed."""
    if BLOCK_DT > 0:
        mbarrier.expect(
            kv_bar.index(0), k_desc.block_type.nbytes + kt_desc.block_type.nbytes + v_desc.block_type.nbytes
        )
        tma.async_copy_global_to_shared(kt_desc, [b, n0, hk, BLOCK_D], kv_bar.index(0), kt_smem.index(0))
    else:
        mbarrier.expect(kv_bar.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, n0, hk, 0], kv_bar.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [b, n0, hk, 0], kv_bar.index(0), v_smem.index(0))


@gluon.jit
def _producer(
    block_args, rows_args, TILE_COUNTER, KEY_ORDER, ORDERED: gl.constexpr, num_tiles, grid0, grid1, tile_ids,
    tile_full, tile_empty, ROWS: gl.constexpr, PERSISTENT: gl.constexpr,
):  # fmt: skip
    """The TMA producer warp: the program's key block (PERSISTENT: each key block it takes from
    the counter, passed on to the consumers; ROWS: with its query blocks, _block_rows of
    rows_args), each its K and V once, then Q, dO and the two per-row statistics of every query
    block through a STAGES-deep ring (ready / empty mbarriers) whose stages and phases run on
    from block to block (_produce_key_block). block_args: _produce_key_block's arguments between
    the block's rows and PERSISTENT (the kernel's producer_args). ORDERED: the counter's n-th
    block is _ordered_tile's (KEY_ORDER), not the grid's n-th."""
    if PERSISTENT:
        it = 0  # the steps of this program's earlier key blocks
        uses = 0  # ... its earlier key blocks with steps (K and V loaded)
        k = 0  # key blocks taken
        t = _fetch_tile(TILE_COUNTER)
        while t < num_tiles:
            tile = t
            if ORDERED:
                tile = _ordered_tile(t, KEY_ORDER, grid0, grid1)
            rows = (0, 0, 0, 0, 0, 0)
            if ROWS:
                rows = _block_rows(tile, grid0, *rows_args)
            _publish_tile(tile_ids, tile_full, tile_empty, k, tile, rows, ROWS)
            p0, p1, p2 = _grid_coords(tile, grid0, grid1)
            n_iter = _produce_key_block(p0, p1, p2, grid0, it, uses, rows, *block_args, PERSISTENT)
            # the next block taken only now: the consumers have about STAGES steps of this one
            # left, and a block taken earlier would be held back from a program that is free
            t = _fetch_tile(TILE_COUNTER)
            it += n_iter
            uses += gl.minimum(n_iter, 1)
            k += 1
        # past the last block: the consumers stop
        _publish_tile(tile_ids, tile_full, tile_empty, k, t, (0, 0, 0, 0, 0, 0), False)
    else:
        _produce_key_block(
            gl.program_id(0), gl.program_id(1), gl.program_id(2), gl.num_programs(0), 0, 0, (0, 0, 0, 0, 0, 0),
            *block_args, PERSISTENT,
        )  # fmt: skip


@gluon.jit
def _produce_key_block(
    p0, p1, p2, dim0, it, uses, block_rows, Hq, Hkv, group, Sq, Sk, Sq_pad, q_start, k_start,
    left, rows_first, rows_n, q_desc,
    do_desc, k_desc, v_desc, st_desc, qt_desc, kt_desc, q_bufs, do_bufs, st_bufs, qt_bufs, k_smem, v_smem, kt_smem,
    kv_bar, kv_empty, ready, empty, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, ROWS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DT: gl.constexpr,
    STAGES: gl.constexpr, WALK: gl.constexpr, GROUPED_HEADS: gl.constexpr, KEY_SPANS, HAS_BIAS: gl.constexpr,
    PERSISTENT: gl.constexpr,
):  # fmt: skip
    """The loads of the key block at grid coordinates (p0, p1, p2) (_plan), after the `it` steps
    and `uses` K / V loads of the program's earlier blocks; returns its steps. With BLOCK_DT > 0
    (q/k's head dim in two pieces) also the tail pieces of K (columns BLOCK_D ..) and of every Q
    block, on the same barriers. block_rows: as _consume_key_block's."""
    if PERSISTENT:  # packed documents: this block's query blocks (_block_rows; else the kernel's)
        rows_first, rows_n = block_rows[0], block_rows[1]
    b, hk, n0, m_first, n_m, _, _, _ = _plan(
        p0, p1, p2, dim0, Hkv, Sq, Sk, q_start, k_start, left, rows_first, rows_n, CAUSAL, HAS_LEFT, ROWS, BLOCK_M,
        BLOCK_N, GROUPED_HEADS,
    )  # fmt: skip
    n_iter = group * _unpadded(n_m, n0, b, KEY_SPANS, HAS_BIAS)
    # K and V are loaded only when the consumers will wait for them (n_iter > 0): no copy may
    # still be in flight when the program ends
    if PERSISTENT:
        # the first stages before K and V: their slots free up as the previous block's last
        # steps end, K's and V's buffer only once both consumers are done with it (kv_empty:
        # count 2, its use-th phase; a fresh barrier passes parity 1)
        first = gl.minimum(n_iter, STAGES)
        for i in range(first):
            _produce_stage(
                it + i, i, b, hk, group, m_first, n_m, p0, q_desc, do_desc, st_desc, qt_desc, q_bufs, do_bufs,
                st_bufs, qt_bufs, ready, empty, Hq, Sq_pad, BLOCK_M, BLOCK_D, BLOCK_DT, STAGES, WALK,
            )  # fmt: skip
        if n_iter > 0:
            mbarrier.wait(kv_empty.index(0), (uses & 1) ^ 1)
            _produce_kv(b, hk, n0, k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, kv_bar, BLOCK_D, BLOCK_DT)
    else:
        first = 0
        if n_iter > 0:
            _produce_kv(b, hk, n0, k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, kv_bar, BLOCK_D, BLOCK_DT)
    for i in range(first, n_iter):
        _produce_stage(
            it + i, i, b, hk, group, m_first, n_m, p0, q_desc, do_desc, st_desc, qt_desc, q_bufs, do_bufs, st_bufs,
            qt_bufs, ready, empty, Hq, Sq_pad, BLOCK_M, BLOCK_D, BLOCK_DT, STAGES, WALK,
        )  # fmt: skip
    return n_iter


# ----------------------------------------------------------------------------------------------
# Consumers: two warpgroups, 64 keys each.


@gluon.jit
def _red_add_pairs(ptrs, vals, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Atomically add vals (ROWS, COLS) float32 into ptrs, two adjacent columns per instruction
    (red.global.add.v2.f32, sm_90; Gluon's atomic_add emits one scalar atom per element).
    Requires every pair (2c, 2c+1) to be held by one thread, as in the wgmma accumulator layout:
    the reshape and split then stay in registers. Unpredicated: ptxas turns a predicated red into
    a branch around it."""
    v_lo, v_hi = vals.reshape([ROWS, COLS // 2, 2]).split()
    p_lo, p_hi = ptrs.reshape([ROWS, COLS // 2, 2]).split()
    gl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v2.f32 [$1], {$2, $3}; mov.b32 $0, 0;",
        "=r,l,r,r",
        [p_lo.to(gl.int64, bitcast=True), v_lo, v_hi],
        gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _red_add_blocked(
    base, vals, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr, TILE_COLS: gl.constexpr = 0
):  # fmt: skip
    """Atomically add vals (ROWS = 64, COLS) float32 into the blocked tile at base (ROWS * COLS
    float32, layout below), four values per instruction (red.global.add.v4.f32, sm_90). With
    TILE_COLS > COLS, into the first COLS columns of a blocked tile TILE_COLS wide (the same
    layout with COLS = TILE_COLS, columns j < COLS / 8).

    Blocked tile: element (r, c), with r = 16 w + 8 h + g (w < 4, h < 2, g < 8) and
    c = 8 j + 2 t + e (j < COLS / 8, t < 4, e < 2), sits at ((w * COLS / 8 + j) * 32 + 4 g + t) * 4
    + 2 h + e, i.e. dimensions (w, j, g, t, h, e) in memory order (gluon_backward.dq_natural_view
    is the inverse). In the wgmma accumulator layout warp w holds rows 16 w.. 16 w + 15 and lane
    4 g + t holds (g + 8 h, 8 j + 2 t + e) for all j, h, e: the four values of one (w, j, g, t) are
    one thread's and contiguous (16 bytes), and one instruction of a warp (fixed j) covers 512
    contiguous bytes, against 8 rows x 32 bytes for a row-major dQ. The addresses are then one base
    plus immediates. Correctness does not depend on that layout: the offsets come from the
    logical (r, c) and reshape / permute / split are logical operations (another layout would
    cost shuffles, not results)."""
    gl.static_assert(ROWS == 64, "one warpgroup's accumulator: 4 warps x 16 rows")
    WIDTH: gl.constexpr = TILE_COLS if TILE_COLS > 0 else COLS
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    r_off = (r // 16) * (WIDTH * 16) + (r % 8) * 16 + ((r // 8) % 2) * 2
    c_off = (c // 8) * 128 + ((c // 2) % 4) * 4 + (c % 2)
    # (r, c) -> (w, h, g, c2, e) -> (w, g, c2, h, e): the last two dimensions are the 16 bytes
    offs = r_off[:, None] + c_off[None, :]
    o = gl.permute(offs.reshape([4, 2, 8, COLS // 2, 2]), (0, 2, 3, 1, 4))
    v = gl.permute(vals.reshape([4, 2, 8, COLS // 2, 2]), (0, 2, 3, 1, 4))
    o0, _ = o.split()  # e = 0
    o00, _ = o0.split()  # h = 0, e = 0: the first of the four
    v0, v1 = v.split()  # e = 0, 1
    v00, v10 = v0.split()  # h = 0, 1 at e = 0
    v01, v11 = v1.split()  # h = 0, 1 at e = 1
    gl.inline_asm_elementwise(
        "red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0;",
        "=r,l,r,r,r,r",
        [(base + o00).to(gl.int64, bitcast=True), v00, v01, v10, v11],
        gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _key_bias2(BIAS, b, stride_bias_b, keys, Sk):
    """The key bias of `keys` (the block's key rows, in a slice of the scores' layout) in base-2
    units: BIAS (B, Sk) float32 in natural-log units times log2(e), as the forward's
    (tiles.key_bias2); keys past Sk read 0 (their scores are masked)."""
    return gl.load(BIAS + b.to(gl.int64) * stride_bias_b + keys, mask=keys < Sk, other=0.0) * LOG2E


@gluon.jit
def _probs_t(st, offset, bias2, plain, qk_scale, HAS_BIAS: gl.constexpr):
    """P^T = exp2(S^T qk_scale - offset) of scores S^T (keys x query rows) and the rows' offsets
    m + log2(l); with HAS_BIAS, unless the block is plain (_plain_block: its keys' bias is 0,
    and every kernel leaves it out), the keys' bias2 (base 2) added first by the forward's own
    FMA, fma(q.k, qk_scale, bias2) (the Triton kernels' base2_scores)."""
    scale2 = qk_scale
    if HAS_BIAS:
        scale2 = gl.where(plain, qk_scale, 1.0)
        if not plain:
            # bias2 through _opaque: a branch of arithmetic alone became selects, the FMA done
            # and thrown away on plain blocks (one FMA and one select a score)
            st = gl.fma(st, qk_scale, _opaque(bias2)[:, None])
    return gl.exp2(gl.fma(st, scale2, -offset[None, :]))


@gluon.jit
def _mask_scores(
    st, key_ragged, off_m, full_lo, full_hi, key_idx, q_idx, key_q_lo, key_q_hi, Sk, q_start, k_start, left,
    BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, ROWS: gl.constexpr,
):  # fmt: skip
    """S^T (keys key_idx x query rows q_idx of the block from off_m) with the pairs the mask hides
    at -inf, computed only where the block is not whole: keys past Sk (key_ragged), or query
    rows off [full_lo, full_hi) (ROWS: the rows every key of the block sees; a window's or
    causal mask's edges). -inf scores give p = 0 (also against an offset of +inf)."""
    if ROWS:
        masked = key_ragged | (off_m < full_lo) | (off_m + BLOCK_M > full_hi)  # [full_lo, full_hi)
    elif CAUSAL or HAS_LEFT:
        masked = key_ragged | (off_m < full_lo) | (off_m + BLOCK_M - 1 > full_hi)  # the window's edges
    else:
        masked = key_ragged
    if masked:
        keys = _opaque(key_idx)
        vis = (keys < Sk)[:, None] & (q_idx < BLOCK_M)[None, :]
        if ROWS:
            vis = vis & in_bounds((off_m + _opaque(q_idx))[None, :], key_q_lo[:, None], key_q_hi[:, None], True)
        elif CAUSAL or HAS_LEFT:
            q_pos = (q_start + off_m + _opaque(q_idx))[None, :]
            k_pos = (k_start + keys)[:, None]
            if CAUSAL:
                vis = vis & (q_pos >= k_pos)
            if HAS_LEFT:
                vis = vis & (q_pos <= k_pos + left)
        st = gl.where(vis, st, float("-inf"))
    return st


@gluon.jit
def _store_grad(
    acc, base, row0, n_rows, stride_s, ACCUMULATE: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr,
    layout: gl.constexpr,
):  # fmt: skip
    """Store (or add, ACCUMULATE) the first COLS columns of acc (ROWS, BLOCK_D) float32 at rows
    row0.. (< n_rows) of a (S, COLS) slice with row stride stride_s, in base's dtype."""
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    ptrs = base + rows.to(gl.int64)[:, None] * stride_s + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < COLS)[None, :]
    if ACCUMULATE:
        acc = acc + gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)
    gl.store(ptrs, acc.to(base.dtype.element_ty), mask=mask)


@gluon.jit
def _dq_add(
    dq,
    DQ,
    b,
    h,
    off_m,
    Sq,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    sm_scale,
    dq_rows,
    dq_cols,
    WG: gl.constexpr,
    BLOCK_M: gl.constexpr,
    DQ_COLS: gl.constexpr,
    DQ_BLOCKED: gl.constexpr,
    dq_layout: gl.constexpr,
    TILE: gl.constexpr = -1,
    TILE_COLS: gl.constexpr = 0,
):
    """Add this warpgroup's dQ (BLOCK_M rows from off_m, DQ_COLS columns dq_cols, from WG *
    DQ_COLS unless the caller says otherwise) of head h to the float32 dQ: row-major (B, Sq, Hq,
    D) with sm_scale applied, or (DQ_BLOCKED) unscaled into the blocked (B, Hq, Sq_pad, D)
    accumulator (_red_add_blocked's tiles of 64 x TILE_COLS (default DQ_COLS) at [b, h, off_m:
    off_m + 64] seen flat, tile TILE (default WG) after the tiles before it; a narrower dQ
    fills the tile's first DQ_COLS columns)."""
    if DQ_BLOCKED:
        tile: gl.constexpr = WG if TILE < 0 else TILE
        width: gl.constexpr = DQ_COLS if TILE_COLS == 0 else TILE_COLS
        base = DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh + off_m.to(gl.int64) * stride_dqs
        _red_add_blocked(base + tile * (BLOCK_M * width), dq, BLOCK_M, DQ_COLS, dq_layout, width)
    else:
        # Rows past Sq (the zero-filled end of the last query block) have p = 0, so ds = 0 and
        # their dQ rows are exactly 0: they add +0.0 to row Sq - 1 instead of being masked
        rows = gl.minimum(off_m + _opaque(dq_rows), Sq - 1)
        dq_base = DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh
        dq_ptrs = dq_base + rows.to(gl.int64)[:, None] * stride_dqs + _opaque(dq_cols)[None, :]
        _red_add_pairs(dq_ptrs, dq * sm_scale, BLOCK_M, DQ_COLS)


@gluon.jit
def _consume_key_block(
    WG: gl.constexpr,
    q_bufs,
    do_bufs,
    st_bufs,
    k_smem,
    v_smem,
    ds_bufs,
    kv_bar,
    ready,
    empty,
    ds_bar,
    DQ,
    DK,
    DV,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    Hq,
    Hkv,
    group,
    Sq,
    Sk,
    q_start,
    k_start,
    left,
    QLO,
    QHI,
    rows_first,
    rows_n,
    rows_full_lo0,
    rows_full_hi0,
    rows_full_lo1,
    rows_full_hi1,
    qk_scale,
    sm_scale,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    ROWS: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    WALK: gl.constexpr,
    DQ_BLOCKED: gl.constexpr,
    LAG: gl.constexpr,
    DQ_FIRST: gl.constexpr,
    qt_bufs,
    kt_smem,
    BLOCK_DT: gl.constexpr,
    GROUPED_HEADS: gl.constexpr,
    BIAS,
    stride_bias_b,
    KEY_SPANS,
    HAS_BIAS: gl.constexpr,
    p0,
    p1,
    p2,
    dim0,
    it,
    uses,
    block_rows,
    kv_empty,
    PERSISTENT: gl.constexpr,
):
    """Consumer warpgroup WG's part of the key block at grid coordinates (p0, p1, p2) (_plan),
    after the `it` steps and `uses` K / V loads of the program's earlier blocks (PERSISTENT;
    block_rows: packed documents' query blocks of this block, as _block_rows); returns its
    steps."""
    if PERSISTENT:  # per block: else values derived from them once for all blocks are kept (spilled)
        Sq = _opaque(Sq)
        q_start = _opaque(q_start)
        k_start = _opaque(k_start)
    KEYS: gl.constexpr = BLOCK_N // 2  # keys of this warpgroup
    gl.static_assert(BLOCK_DT == 0, "ws2 runs q/k's head dim whole")
    DQ_COLS: gl.constexpr = BLOCK_D // 2  # dQ columns of this warpgroup
    gl.static_assert(HEAD_DIM_V == HEAD_DIM, "ws2 takes one head dim for q, k and v")
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = _mma_layout(4, BLOCK_M)  # S^T, dP^T: (KEYS, BLOCK_M)
    dq_layout: gl.constexpr = _mma_layout(4, DQ_COLS)  # dQ_wg: (BLOCK_M, DQ_COLS)
    kv_layout: gl.constexpr = _mma_layout(4, BLOCK_D)  # dK, dV: (KEYS, BLOCK_D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    gl.static_assert(KEYS == 64, "one warpgroup's wgmma tile is 64 rows")

    if PERSISTENT:  # packed documents: this block's query blocks, as the producer planned them
        rows_first, rows_n, rows_full_lo0, rows_full_hi0, rows_full_lo1, rows_full_hi1 = block_rows
    b, hk, n0, m_first, n_m, full_lo, full_hi, key_ragged = _plan(
        p0, p1, p2, dim0, Hkv, Sq, Sk, q_start, k_start, left, rows_first, rows_n, CAUSAL, HAS_LEFT, ROWS, BLOCK_M,
        BLOCK_N, GROUPED_HEADS,
    )  # fmt: skip
    n_iter = group * _unpadded(n_m, n0, b, KEY_SPANS, HAS_BIAS)
    dk = gl.zeros([KEYS, BLOCK_D], gl.float32, kv_layout)
    dv = gl.zeros([KEYS, BLOCK_D], gl.float32, kv_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    key_idx = gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    if ROWS and PERSISTENT:  # made per block, not kept across the program's blocks (at D=128 spilled)
        key_idx = _opaque(key_idx)
    key_idx = n0 + WG * KEYS + key_idx
    bias2 = qk_scale  # (a stand-in without a key bias, never read)
    if HAS_BIAS:  # this warpgroup's keys' bias, for every step of the block
        bias2 = _key_bias2(BIAS, b, stride_bias_b, key_idx, Sk)
    plain = _plain_block(KEY_SPANS, b, n0, BLOCK_N, HAS_BIAS)
    q_idx = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = WG * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    if HEAD_DIM != BLOCK_D:
        # dQ's padding columns are exactly 0 (K's read as zeros): the row-major adds put them on
        # the last pair of real columns (+0.0) instead of past the row; pairs stay pairs (D even)
        dq_cols = gl.where(dq_cols < HEAD_DIM, dq_cols, HEAD_DIM - 2 + dq_cols % 2)
    key_q_lo = None  # (per-row bounds only)
    key_q_hi = None
    if ROWS:
        # this warpgroup's keys: the local query rows each is seen by, for the whole loop;
        # [full_lo, full_hi): the rows that see all of them
        key_q_lo, key_q_hi = key_query_bounds(key_idx, Sq, Sk, q_start, k_start, 0, 0, QLO, QHI, MASK_ROWS)
        if WG == 0:
            full_lo = rows_full_lo0
            full_hi = rows_full_hi0
        else:
            full_lo = rows_full_lo1
            full_hi = rows_full_hi1
    if n_iter > 0:
        # K and V landed: the uses-th phase (the producer's one expect per key block with steps)
        mbarrier.wait(kv_bar.index(0), uses & 1)
    for i in range(n_iter):
        g = it + i  # the program's step (its earlier key blocks' steps before it)
        s = g % STAGES
        if PERSISTENT:  # dQ's strides extended to 64 bits here, not once for all blocks and kept (spilled)
            one = _opaque(i * 0) + 1
            stride_dqb = stride_dqb * one
            stride_dqs = stride_dqs * one
            stride_dqh = stride_dqh * one
        h, off_m = _query_block(i, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
        # ready[s]: the (g // STAGES)-th completion of stage s's barrier
        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
        q_t = q_bufs.index(s).reshape([BLOCK_M, BLOCK_D])
        do_t = do_bufs.index(s).reshape([BLOCK_M, BLOCK_D])
        # K and V through an index the compiler cannot prove constant: their wgmma descriptors
        # are then rebuilt per step (a few uniform adds) instead of being kept across the loop,
        # which ran out of uniform registers and spilled
        zero = _opaque(i * 0)
        k_all = k_smem.index(zero).reshape([BLOCK_N, BLOCK_D])
        k_wg = k_all.slice(WG * KEYS, KEYS, dim=0)  # (KEYS, D): A of S^T
        k_cols = k_all.slice(WG * DQ_COLS, DQ_COLS, dim=1)  # (BLOCK_N, DQ_COLS): B of dQ_wg
        v_wg = v_smem.index(zero).reshape([BLOCK_N, BLOCK_D]).slice(WG * KEYS, KEYS, dim=0)
        st_tok = warpgroup_mma(k_wg, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt_tok = warpgroup_mma(v_wg, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        offset = st_bufs.index(2 * s).load(gl.SliceLayout(0, s_layout))
        # groups complete in order: one left in flight means S^T is done, dP^T may not be
        st = warpgroup_mma_wait(1, deps=(st_tok,))
        st = _mask_scores(
            st, key_ragged, off_m, full_lo, full_hi, key_idx, q_idx, key_q_lo, key_q_hi, Sk, q_start, k_start, left,
            BLOCK_M, CAUSAL, HAS_LEFT, ROWS,
        )  # fmt: skip
        pt = _probs_t(st, offset, bias2, plain, qk_scale, HAS_BIAS)
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dv_tok = warpgroup_mma(pt_op, do_t, dv, is_async=True)
        delta = st_bufs.index(2 * s + 1).load(gl.SliceLayout(0, s_layout))
        # in flight: dP^T, dV; one left means dP^T is done
        dpt = warpgroup_mma_wait(1, deps=(dpt_tok,))
        ds = (pt * (dpt - delta[None, :])).to(dtype)
        if LAG:
            ds_op = gl.convert_layout(ds, op_layout)
            # dQ one step late: dQ(i - 1) from dS(i - 1), which both warpgroups wrote during step
            # i - 1, so the barrier below is normally passed at once and the warpgroups may
            # drift up to one step apart instead of meeting every step (module docstring).
            # Three dS buffers, dS(i) in buffer g % 3 (g: the program's step); ds_bar[g % 3]:
            # count 2, one arrival per warpgroup at step g; its n-th use (n = g // 3) completes
            # phase n. Below, i stands for g: the program's key blocks run one after the other,
            # and a block's last dQ (after the loop) waits as step i + 1 would.
            #  - wait for dS(i - 1), parity ((i - 1) // 3) & 1: the barrier cannot be two phases
            #    ahead, its next arrivals (step i + 2) need this warpgroup's, which come later.
            #  - no phase skipped: a warpgroup arrives for step i (use n) after passing the wait
            #    for step i - 1 (below, before its arrival), so the other warpgroup had arrived
            #    for step i - 1, hence for step i - 3 (use n - 1): phase n - 1 was complete.
            #  - buffer reuse: dS(i) overwrites dS(i - 3), which this warpgroup read at step
            #    i - 2 (finished by that step's wait(0)) and the other one at its step i - 2;
            #    this warpgroup's store comes after its wait for dS(i - 1), so the other
            #    warpgroup had arrived at step i - 1, which follows its step i - 2's wait(0).
            # At i = 0 there is no dS(-1): the matmul reads buffer 2 (not written before step 2,
            # which neither warpgroup reaches before both arrived for step 1) and its result is
            # dropped; the barrier wait and the atomics are skipped.
            ip = g + 2  # g - 1 modulo 3 without a negative operand
            if DQ_FIRST:
                # FlashAttention-3's order: dQ before dK, then the dQ atomics run while dK is in
                # the tensor cores (wait(1) below leaves dK in flight)
                if i > 0:
                    mbarrier.wait(ds_bar.index(ip % 3), ((g - 1) // 3) & 1)
                dq_tok = warpgroup_mma(
                    ds_bufs.index(ip % 3).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
                )
                dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
                ds_bufs.index(_opaque(g % 3)).slice(WG * KEYS, KEYS, dim=0).store(ds)
                fence_async_shared()
                mbarrier.arrive(ds_bar.index(g % 3))
                # in flight: dV, dQ(i - 1), dK; one left: dV and dQ are done
                dv, dq, pt_op = warpgroup_mma_wait(1, deps=(dv_tok, dq_tok, pt_op))
                if i > 0:
                    hp, off_mp = _query_block(i - 1, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
                    _dq_add(dq, DQ, b, hp, off_mp, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows,
                            dq_cols, WG, BLOCK_M, DQ_COLS, DQ_BLOCKED, dq_layout)  # fmt: skip
                dk, ds_op = warpgroup_mma_wait(0, deps=(dk_tok, ds_op))
                mbarrier.arrive(empty.index(s))
            else:
                dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
                if i > 0:
                    mbarrier.wait(ds_bar.index(ip % 3), ((g - 1) // 3) & 1)
                dq_tok = warpgroup_mma(
                    ds_bufs.index(ip % 3).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
                )
                ds_bufs.index(_opaque(g % 3)).slice(WG * KEYS, KEYS, dim=0).store(ds)
                fence_async_shared()
                mbarrier.arrive(ds_bar.index(g % 3))
                dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
                mbarrier.arrive(empty.index(s))
                if i > 0:
                    hp, off_mp = _query_block(i - 1, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
                    _dq_add(dq, DQ, b, hp, off_mp, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows,
                            dq_cols, WG, BLOCK_M, DQ_COLS, DQ_BLOCKED, dq_layout)  # fmt: skip
        else:
            # dS^T of this warpgroup's keys into rows WG * KEYS.. of buffer g % 2
            ds_buf = ds_bufs.index(g % 2)
            ds_buf.slice(WG * KEYS, KEYS, dim=0).store(ds)
            ds_op = gl.convert_layout(ds, op_layout)
            dk_tok = warpgroup_mma(ds_op, q_t, dk, is_async=True)
            # Both halves of dS must be in shared memory before either warpgroup reads it.
            # ds_bar[g % 2]: count 2, one arrival per warpgroup (mbarrier.arrive syncs the
            # warpgroup's 128 threads, then one thread arrives); its n-th use (n = g // 2)
            # completes phase n, so wait for parity n & 1. A warpgroup arrives for use n + 1 only
            # after its own wait for use n has passed, so no phase is skipped. The fence makes
            # the generic stores above visible to the wgmma (async proxy) reads.
            fence_async_shared()
            mbarrier.arrive(ds_bar.index(g % 2))
            mbarrier.wait(ds_bar.index(g % 2), (g // 2) & 1)
            dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
            dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok, pt_op, ds_op))
            # Stage s fully read (S^T, dP^T, dV, dK are done): release it. empty[s] has count 2.
            # Buffer g % 2 of dS is rewritten at step g + 2, after both warpgroups have
            # passed ds_bar at i + 1, which each reaches only after this wait: its dQ read is done.
            mbarrier.arrive(empty.index(s))
            _dq_add(dq, DQ, b, h, off_m, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows, dq_cols, WG,
                    BLOCK_M, DQ_COLS, DQ_BLOCKED, dq_layout)  # fmt: skip
    if LAG:
        if n_iter > 0:
            # the last step's dQ: dS(n_iter - 1) from both warpgroups
            last = n_iter - 1
            g_last = it + last
            mbarrier.wait(ds_bar.index(g_last % 3), (g_last // 3) & 1)
            k_cols = k_smem.index(0).reshape([BLOCK_N, BLOCK_D]).slice(WG * DQ_COLS, DQ_COLS, dim=1)
            dq_tok = warpgroup_mma(
                ds_bufs.index(g_last % 3).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True
            )
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))
            hp, off_mp = _query_block(last, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
            _dq_add(dq, DQ, b, hp, off_mp, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows, dq_cols, WG,
                    BLOCK_M, DQ_COLS, DQ_BLOCKED, dq_layout)  # fmt: skip
    if PERSISTENT:
        if n_iter > 0:  # done with K and V (the last dQ matmul read K): the next block may load
            mbarrier.arrive(kv_empty.index(0))
    row0 = n0 + WG * KEYS
    if LAG:
        # through opaque moves: the pointers' 64-bit parts are then computed here, not before the
        # loop and kept across it (ptxas spilled them in the accumulating causal case)
        b = _opaque(b)
        hk = _opaque(hk)
    if PERSISTENT:
        # likewise the strides' 64-bit extensions (else computed once for all blocks and kept),
        # times an opaque 1 rather than through _opaque: a product keeps the stride's known
        # divisibility, so dK and dV are still stored in vectors (not 16 bits at a time)
        one = _opaque(row0 * 0) + 1
        stride_dkb = stride_dkb * one
        stride_dks = stride_dks * one
        stride_dkh = stride_dkh * one
        stride_dvb = stride_dvb * one
        stride_dvs = stride_dvs * one
        stride_dvh = stride_dvh * one
    # a key block no query sees adds nothing: accumulating, it is left as it is (a ring step's
    # idle keys); otherwise its zeros are written
    if n_iter > (0 if ACCUMULATE else -1):
        _store_grad(
            dk * sm_scale,
            DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh,
            row0,
            Sk,
            stride_dks,
            ACCUMULATE,
            KEYS,
            HEAD_DIM,
            kv_layout,
        )
        _store_grad(
            dv,
            DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh,
            row0,
            Sk,
            stride_dvs,
            ACCUMULATE,
            KEYS,
            HEAD_DIM,
            kv_layout,
        )
    return n_iter


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    block_args,
    plain_args,
    bias_test,
    BLOCK_N: gl.constexpr,
    GROUPED_HEADS: gl.constexpr,
    VERSIONED: gl.constexpr,
    kv_empty,
    num_tiles,
    grid0,
    grid1,
    tile_ids,
    tile_full,
    tile_empty,
    ROWS: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Consumer warpgroup WG: the program's key block (PERSISTENT: those the producer passes
    through tile_ids), planned here as the producer plans it. block_args: _consume_key_block's
    arguments up to the block's coordinates (the kernel's consumer_args); plain_args and
    bias_test: _consume_versioned's."""
    if PERSISTENT:
        it = 0  # (as _producer)
        uses = 0
        k = 0
        t, rows = _receive_tile(tile_ids, tile_full, tile_empty, k, ROWS)
        while t < num_tiles:
            p0, p1, p2 = _grid_coords(t, grid0, grid1)
            n_iter = _consume_versioned(WG, block_args, plain_args, bias_test, p0, p1, p2, grid0, it, uses, rows,
                                        kv_empty, PERSISTENT, BLOCK_N, GROUPED_HEADS, VERSIONED)  # fmt: skip
            it += n_iter
            uses += gl.minimum(n_iter, 1)
            k += 1
            t, rows = _receive_tile(tile_ids, tile_full, tile_empty, k, ROWS)
    else:
        _consume_versioned(
            WG, block_args, plain_args, bias_test, gl.program_id(0), gl.program_id(1), gl.program_id(2),
            gl.num_programs(0), 0, 0, (0, 0, 0, 0, 0, 0), kv_empty, PERSISTENT, BLOCK_N, GROUPED_HEADS, VERSIONED,
        )  # fmt: skip


@gluon.jit
def _consume_versioned(
    WG: gl.constexpr, block_args, plain_args, bias_test, p0, p1, p2, dim0, it, uses, rows, kv_empty,
    PERSISTENT: gl.constexpr, BLOCK_N: gl.constexpr, GROUPED_HEADS: gl.constexpr, VERSIONED: gl.constexpr,
):  # fmt: skip
    """_consume_key_block on the key block at (p0, p1, p2); with VERSIONED, a block of zero bias
    (_plain_block) through its copy compiled without a bias (plain_args: block_args with
    HAS_BIAS off; bias_test: (Hkv, KEY_SPANS)): its steps are then the unbiased kernel's, not
    behind a branch a step (a mask that hides nothing cost non-causal D=64 4-9%). The two rebuild
    the same probabilities (_probs_t), and such a block is never cut (_unpadded: its keys are
    visible)."""
    if VERSIONED:
        Hkv, KEY_SPANS = bias_test
        b, _, n0 = _block_coords(p0, p1, p2, dim0, Hkv, BLOCK_N, GROUPED_HEADS)
        if _plain_block(KEY_SPANS, b, n0, BLOCK_N, True):
            n_iter = _consume_key_block(WG, *plain_args, p0, p1, p2, dim0, it, uses, rows, kv_empty, PERSISTENT)
        else:
            n_iter = _consume_key_block(WG, *block_args, p0, p1, p2, dim0, it, uses, rows, kv_empty, PERSISTENT)
    else:
        n_iter = _consume_key_block(WG, *block_args, p0, p1, p2, dim0, it, uses, rows, kv_empty, PERSISTENT)
    return n_iter


@gluon.jit
def _split_d_scores(i, zero, bufs, s_zero, shape: gl.constexpr):
    """_consumer_split_d's step i scores, issued once its stage has landed: S^T = K Q_wg^T (one
    wgmma group per head-dim piece) and dP^T = V dO_wg^T, in flight. bufs: Q, dO, Q's tail
    stages, K, V, K's tail, the stages' ready barriers; zero: an opaque 0 indexing K and V (as
    _consumer: their wgmma descriptors are then rebuilt per step, not kept across the loop);
    shape: (WG, QROWS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_DT, STAGES, NBUF: the P^T / dS^T
    buffer pairs)."""
    WG, QROWS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_DT, STAGES, _, _ = shape
    q_bufs, do_bufs, qt_bufs, k_smem, v_smem, kt_smem, ready = bufs
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    q_wg = q_bufs.index(s).reshape([BLOCK_M, BLOCK_D]).slice(WG * QROWS, QROWS, dim=0)
    do_wg = do_bufs.index(s).reshape([BLOCK_M, BLOCK_DV]).slice(WG * QROWS, QROWS, dim=0)
    k_all = k_smem.index(zero).reshape([BLOCK_N, BLOCK_D])
    v_all = v_smem.index(zero).reshape([BLOCK_N, BLOCK_DV])
    st_tok = warpgroup_mma(k_all, q_wg.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if BLOCK_DT > 0:  # the tail piece's columns into the same scores
        qt_wg = qt_bufs.index(s).reshape([BLOCK_M, BLOCK_DT]).slice(WG * QROWS, QROWS, dim=0)
        kt_all = kt_smem.index(zero).reshape([BLOCK_N, BLOCK_DT])
        st_tok = warpgroup_mma(kt_all, qt_wg.permute((1, 0)), st_tok, is_async=True)
    dpt_tok = warpgroup_mma(v_all, do_wg.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return st_tok, dpt_tok


@gluon.jit
def _split_d_probs(
    st_tok, dpt_tok, i, off_m, st_bufs, ds_bufs, ds_bar, step_mask, qk_scale,
    s_layout: gl.constexpr, shape: gl.constexpr, CAUSAL: gl.constexpr, HAS_LEFT: gl.constexpr, ROWS: gl.constexpr,
):  # fmt: skip
    """Step i's P^T and dS^T (its query block from off_m) from its scores (st_tok, dpt_tok), this
    warpgroup's 32 columns of each written to shared
    memory; returns once both warpgroups' halves are there. step_mask: _mask_scores' other
    arguments, then the keys' bias and whether the block is plain (_probs_t)."""
    WG, QROWS, BLOCK_M, _, _, _, _, STAGES, NBUF, HAS_BIAS = shape
    key_ragged, full_lo, full_hi, key_idx, q_idx, key_q_lo, key_q_hi, Sk, q_start, k_start, left, bias2, plain = (
        step_mask
    )
    dtype: gl.constexpr = ds_bufs.dtype
    s = i % STAGES
    offset = st_bufs.index(2 * s).slice(WG * QROWS, QROWS).load(gl.SliceLayout(0, s_layout))
    st = warpgroup_mma_wait(1, deps=(st_tok,))  # (dP^T's group after S^T's)
    st = _mask_scores(
        st, key_ragged, off_m, full_lo, full_hi, key_idx, q_idx, key_q_lo, key_q_hi, Sk, q_start, k_start, left,
        BLOCK_M, CAUSAL, HAS_LEFT, ROWS,
    )  # fmt: skip
    pt = _probs_t(st, offset, bias2, plain, qk_scale, HAS_BIAS)
    delta = st_bufs.index(2 * s + 1).slice(WG * QROWS, QROWS).load(gl.SliceLayout(0, s_layout))
    dpt = warpgroup_mma_wait(0, deps=(dpt_tok,))
    ds = (pt * (dpt - delta[None, :])).to(dtype)
    # P^T(i) and dS^T(i) in buffers 2 (i % NBUF) and 2 (i % NBUF) + 1; ds_bar[i % NBUF]: count 2,
    # one arrival per warpgroup, its n-th use (n = i // NBUF) completes phase n. No phase is
    # skipped: a warpgroup arrives for step i only after passing step i - 1's wait, which needs
    # the other's arrival for step i - 1, hence for step i - NBUF. A buffer is rewritten at step
    # i + NBUF, after both warpgroups passed ds_bar at step i + NBUF - 1, which each reaches only
    # after its wait for step i's gradients, which read it (NBUF = 2: that wait comes before the
    # next step's _split_d_probs).
    ds_bufs.index(2 * (i % NBUF)).slice(WG * QROWS, QROWS, dim=1).store(pt.to(dtype))
    ds_bufs.index(2 * (i % NBUF) + 1).slice(WG * QROWS, QROWS, dim=1).store(ds)
    fence_async_shared()
    mbarrier.arrive(ds_bar.index(i % NBUF))
    mbarrier.wait(ds_bar.index(i % NBUF), (i // NBUF) & 1)


@gluon.jit
def _split_d_gradients(i, zero, dv, dk, dq_zero, bufs, ds_bufs, cols: gl.constexpr, shape: gl.constexpr):
    """Step i's dV += P^T dO, dK += dS^T Q over this warpgroup's columns and its dQ = dS K, issued
    in that order (one wgmma group each). Returns their tokens."""
    WG, _, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_DT, STAGES, NBUF, _ = shape
    COLS_V, DK_COL0, DK_COLS, DQ_COL0, DQ_COLS, _ = cols
    q_bufs, do_bufs, qt_bufs, k_smem, v_smem, kt_smem, ready = bufs
    s = i % STAGES
    q_t = q_bufs.index(s).reshape([BLOCK_M, BLOCK_D])
    k_all = k_smem.index(zero).reshape([BLOCK_N, BLOCK_D])
    pt_buf = ds_bufs.index(2 * (i % NBUF))
    ds_buf = ds_bufs.index(2 * (i % NBUF) + 1)
    do_cols = do_bufs.index(s).reshape([BLOCK_M, BLOCK_DV]).slice(WG * COLS_V, COLS_V, dim=1)
    dv_tok = warpgroup_mma(pt_buf, do_cols, dv, is_async=True)
    if BLOCK_DT > 0:  # warpgroup 0: dK's main piece and dQ's tail; 1: dK's tail and dQ's main piece
        if WG == 0:
            q_cols = q_t
            k_cols = kt_smem.index(zero).reshape([BLOCK_N, BLOCK_DT])
        else:
            q_cols = qt_bufs.index(s).reshape([BLOCK_M, BLOCK_DT])
            k_cols = k_all
    else:
        q_cols = q_t.slice(DK_COL0, DK_COLS, dim=1)
        k_cols = k_all.slice(DQ_COL0, DQ_COLS, dim=1)
    dk_tok = warpgroup_mma(ds_buf, q_cols, dk, is_async=True)
    dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
    return dv_tok, dk_tok, dq_tok


@gluon.jit
def _split_d_step_done(
    i, h, off_m, dq, empty, dq_add, cols: gl.constexpr, shape: gl.constexpr, DQ_BLOCKED: gl.constexpr
):  # fmt: skip
    """After step i's gradients have landed: its stage released and its dQ (head h, query block
    from off_m) added (dq_add: _dq_add's other arguments)."""
    WG, _, BLOCK_M, _, _, _, _, STAGES, _, _ = shape
    _, _, _, DQ_COL0, DQ_COLS, DQ_TILE = cols
    DQ, b, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows, dq_cols = dq_add
    dq_layout: gl.constexpr = dq.type.layout
    mbarrier.arrive(empty.index(i % STAGES))  # stage read by every matmul of the step
    # the blocked dQ's two tiles are half the padded width each (BLOCK_D with pieces): dQ's main
    # piece fills tile 0, its tail the first columns of tile 1
    _dq_add(dq, DQ, b, h, off_m, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows, dq_cols, WG, BLOCK_M,
            DQ_COLS, DQ_BLOCKED, dq_layout, DQ_COL0 // DQ_TILE, DQ_TILE)  # fmt: skip


@gluon.jit
def _consumer_split_d(
    WG: gl.constexpr,
    q_bufs,
    do_bufs,
    st_bufs,
    k_smem,
    v_smem,
    ds_bufs,
    kv_bar,
    ready,
    empty,
    ds_bar,
    DQ,
    DK,
    DV,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    Hq,
    Hkv,
    group,
    Sq,
    Sk,
    q_start,
    k_start,
    left,
    QLO,
    QHI,
    rows_first,
    rows_n,
    rows_full_lo0,
    rows_full_hi0,
    rows_full_lo1,
    rows_full_hi1,
    qk_scale,
    sm_scale,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    ROWS: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    WALK: gl.constexpr,
    DQ_BLOCKED: gl.constexpr,
    LAG: gl.constexpr,
    DQ_FIRST: gl.constexpr,
    qt_bufs,
    kt_smem,
    BLOCK_DT: gl.constexpr,
    GROUPED_HEADS: gl.constexpr,
    BIAS,
    stride_bias_b,
    KEY_SPANS,
    HAS_BIAS: gl.constexpr,
):
    """The wide head dims' consumer (SPLIT_D): both warpgroups share the 64 keys of the block and
    own half of the head-dim columns each (dK, dV of 64 keys x 256 would need 256 registers a
    thread in one warpgroup). Per step (64 query rows):
        S^T_wg, dP^T_wg = K Q_wg^T, V dO_wg^T   (64 keys x this warpgroup's 32 rows, full depth)
        P^T_wg, dS^T_wg -> shared memory (columns 32 WG.. of the step's 64 x 64 P^T and dS^T)
        both warpgroups meet (ds_bar), then over all 64 rows and this warpgroup's columns c:
        dV[:, c] += P^T dO[:, c];  dK[:, c] += dS^T Q[:, c];  dQ[:, c] = dS K[:, c]
    Five matmuls of equal size per warpgroup; the scores' exchange through shared memory is
    what the split costs. LAG and DQ_FIRST do not apply (unused).

    BLOCK_DT > 0: q/k's head dim in two pieces, BLOCK_D columns (Q's q_bufs, K's k_smem) and
    BLOCK_DT after them (qt_bufs, kt_smem; BLOCK_D = 2 BLOCK_DT, e.g. 192 = 128 + 64), which do
    not halve into powers of two: S^T takes one wgmma per piece, and the pieces cross between
    the gradients: warpgroup 0 holds dK's main piece and computes dQ's tail, warpgroup 1 dK's
    tail and dQ's main piece (each 3 x BLOCK_DT columns of dK and dQ); dV halves as before."""
    TAIL: gl.constexpr = BLOCK_DT > 0
    if TAIL:
        gl.static_assert(BLOCK_D == 2 * BLOCK_DT, "the crossed pieces balance at main = 2 x tail")
        DK_COLS: gl.constexpr = BLOCK_D if WG == 0 else BLOCK_DT  # dK columns this warpgroup owns
        DK_COL0: gl.constexpr = 0 if WG == 0 else BLOCK_D
        DQ_COLS: gl.constexpr = BLOCK_DT if WG == 0 else BLOCK_D  # dQ columns it computes
        DQ_COL0: gl.constexpr = BLOCK_D if WG == 0 else 0
    else:
        DK_COLS: gl.constexpr = BLOCK_D // 2  # head-dim columns of dK and dQ this warpgroup owns
        DK_COL0: gl.constexpr = WG * DK_COLS
        DQ_COLS: gl.constexpr = DK_COLS
        DQ_COL0: gl.constexpr = DK_COL0
    COLS_V: gl.constexpr = BLOCK_DV // 2  # ... of dV (v's head dim may differ: MLA)
    DQ_TILE: gl.constexpr = BLOCK_D if TAIL else BLOCK_D // 2  # the blocked dQ's tiles: half the padded width
    QROWS: gl.constexpr = BLOCK_M // 2  # query rows of this warpgroup's S^T, dP^T
    s_layout: gl.constexpr = _mma_layout(4, QROWS)  # S^T, dP^T: (BLOCK_N, QROWS)
    acc_layout: gl.constexpr = _mma_layout(4, DK_COLS)  # dK: (BLOCK_N, DK_COLS)
    dq_layout: gl.constexpr = _mma_layout(4, DQ_COLS)  # dQ: (BLOCK_M, DQ_COLS)
    v_layout: gl.constexpr = _mma_layout(4, COLS_V)  # dV: (BLOCK_N, COLS_V)
    gl.static_assert(BLOCK_N == 64, "one warpgroup's wgmma tile is 64 rows: the block's keys")
    gl.static_assert(BLOCK_M == 64, "64 query rows per step, 32 per warpgroup's scores")

    p0 = gl.program_id(0)  # (one key block a program: no persistent schedule here)
    b, hk, n0, m_first, n_m, full_lo, full_hi, key_ragged = _plan(
        p0, gl.program_id(1), gl.program_id(2), gl.num_programs(0), Hkv, Sq, Sk, q_start, k_start, left, rows_first,
        rows_n, CAUSAL, HAS_LEFT, ROWS, BLOCK_M, BLOCK_N, GROUPED_HEADS,
    )  # fmt: skip
    n_iter = group * _unpadded(n_m, n0, b, KEY_SPANS, HAS_BIAS)
    dk = gl.zeros([BLOCK_N, DK_COLS], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, COLS_V], gl.float32, v_layout)
    s_zero = gl.zeros([BLOCK_N, QROWS], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    key_idx = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    bias2 = qk_scale  # (a stand-in without a key bias, never read)
    if HAS_BIAS:  # the block's keys' bias, for every step
        bias2 = _key_bias2(BIAS, b, stride_bias_b, key_idx, Sk)
    plain = _plain_block(KEY_SPANS, b, n0, BLOCK_N, HAS_BIAS)
    q_idx = WG * QROWS + gl.arange(0, QROWS, layout=gl.SliceLayout(0, s_layout))
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_cols = DQ_COL0 + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    if HEAD_DIM != BLOCK_D + BLOCK_DT:
        # as _consumer: the exact-zero padding columns add onto the last real pair
        dq_cols = gl.where(dq_cols < HEAD_DIM, dq_cols, HEAD_DIM - 2 + dq_cols % 2)
    key_q_lo = key_idx  # (stand-ins, read with per-row bounds only; a tuple holds no None)
    key_q_hi = key_idx
    if ROWS:
        key_q_lo, key_q_hi = key_query_bounds(key_idx, Sq, Sk, q_start, k_start, 0, 0, QLO, QHI, MASK_ROWS)
        full_lo = rows_full_lo0  # (both halves hold all keys of the block)
        full_hi = rows_full_hi0
    bufs = (q_bufs, do_bufs, qt_bufs, k_smem, v_smem, kt_smem, ready)  # (the helpers' shared memory)
    step_mask = (key_ragged, full_lo, full_hi, key_idx, q_idx, key_q_lo, key_q_hi, Sk, q_start, k_start, left, bias2,
                 plain)  # fmt: skip
    dq_add = (DQ, b, Sq, stride_dqb, stride_dqs, stride_dqh, sm_scale, dq_rows, dq_cols)
    # the head-dim columns each gradient's matmul takes (_split_d_gradients)
    cols: gl.constexpr = (COLS_V, DK_COL0, DK_COLS, DQ_COL0, DQ_COLS, DQ_TILE)
    NBUF: gl.constexpr = 2
    shape: gl.constexpr = (WG, QROWS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_DT, STAGES, NBUF, HAS_BIAS)
    if n_iter > 0:
        mbarrier.wait(kv_bar.index(0), 0)
    for i in range(n_iter):
        h, off_m = _query_block(i, hk, group, m_first, n_m, p0, BLOCK_M, WALK)
        zero = _opaque(i * 0)
        st_tok, dpt_tok = _split_d_scores(i, zero, bufs, s_zero, shape)
        _split_d_probs(st_tok, dpt_tok, i, off_m, st_bufs, ds_bufs, ds_bar, step_mask, qk_scale, s_layout, shape,
                       CAUSAL, HAS_LEFT, ROWS)  # fmt: skip
        dv_tok, dk_tok, dq_tok = _split_d_gradients(i, zero, dv, dk, dq_zero, bufs, ds_bufs, cols, shape)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
        _split_d_step_done(i, h, off_m, dq, empty, dq_add, cols, shape, DQ_BLOCKED)
    b = _opaque(b)  # (as _consumer with LAG: the pointers' 64-bit parts computed here, not kept)
    hk = _opaque(hk)
    if n_iter > (0 if ACCUMULATE else -1):  # (as _consumer)
        col0: gl.constexpr = DK_COL0
        _store_grad(
            dk * sm_scale,
            DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh + col0,
            n0,
            Sk,
            stride_dks,
            ACCUMULATE,
            BLOCK_N,
            HEAD_DIM - col0,
            acc_layout,
        )
        col0_v: gl.constexpr = WG * COLS_V
        _store_grad(
            dv,
            DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh + col0_v,
            n0,
            Sk,
            stride_dvs,
            ACCUMULATE,
            BLOCK_N,
            HEAD_DIM_V - col0_v,
            v_layout,
        )


@gluon.jit(
    do_not_specialize=["group", "Sq", "Sk", "Sq_pad", "q_start", "k_start", "left", "num_tiles", "grid0", "grid1"]
)
def _bwd_ws2(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    st_desc,
    qt_desc,
    kt_desc,
    DQ,
    DK,
    DV,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    Hq,
    Hkv,
    group,
    Sq,
    Sk,
    Sq_pad,
    q_start,
    k_start,
    left,
    QLO,
    QHI,
    BIAS,
    stride_bias_b,
    KEY_SPANS,
    qk_scale,
    sm_scale,
    num_tiles,
    grid0,
    grid1,
    TILE_COUNTER,
    KEY_ORDER,
    HEAD_DIM: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_DT: gl.constexpr,
    HEAD_DIM_V: gl.constexpr,
    BLOCK_DV: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    HAS_LEFT: gl.constexpr,
    ROWS: gl.constexpr,
    ACCUMULATE: gl.constexpr,
    WALK: gl.constexpr,
    DQ_BLOCKED: gl.constexpr,
    LAG: gl.constexpr,
    DQ_FIRST: gl.constexpr,
    SPLIT_D: gl.constexpr,
    GROUPED_HEADS: gl.constexpr,
    PERSISTENT: gl.constexpr,
    ORDERED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """q_desc: blocks [1, BLOCK_M, 1, BLOCK_D], k_desc [1, BLOCK_N, 1, BLOCK_D], do_desc [1,
    BLOCK_M, 1, BLOCK_DV], v_desc [1, BLOCK_N, 1, BLOCK_DV]: BLOCK_D, BLOCK_DV the head dims
    HEAD_DIM (q, k), HEAD_DIM_V (v, do) padded to powers of two (the padding columns read as
    zeros; they differ only with SPLIT_D); st_desc: the flat (B * Hq * 2 * Sq_pad,) float32
    statistics with blocks [BLOCK_M]. BLOCK_DT > 0 (SPLIT_D only): q/k's head dim in two pieces,
    BLOCK_D columns by q_desc / k_desc and BLOCK_DT from column BLOCK_D on by qt_desc / kt_desc
    (blocks [.., BLOCK_DT]; None without a tail). num_warps = 4 (the default partition is consumer
    warpgroup 0). DQ: float32 (B, Sq, Hq, HEAD_DIM) added to atomically, or (DQ_BLOCKED) the
    blocked (B, Hq, Sq_pad, BLOCK_D); DK (B, Sk, Hkv, HEAD_DIM), DV (B, Sk, Hkv, HEAD_DIM_V).
    PERSISTENT (ws2): a 1-D grid of programs that each take several of the
    num_tiles key blocks of a grid0 x grid1 x .. launch, handed out at run time from
    TILE_COUNTER (int32, zero at the launch); without it num_tiles,
    grid0, grid1 and TILE_COUNTER are unused. ORDERED (persistent, packed documents): handed out
    in KEY_ORDER's order of the key blocks (int32 (grid0,)), each block's heads side by side
    (_ordered_tile); else KEY_ORDER is unused. HAS_BIAS: BIAS (B, Sk) float32, rows stride_bias_b
    apart, the forward's key bias (natural-log units; -inf hides a key), and KEY_SPANS (B, 3)
    int32, key_bias.key_spans: each batch row's last key it does not hide, plus one (key blocks
    past it do nothing but store zeros: _unpadded), and its keys of zero bias (rebuilt without
    it: _plain_block); else any pointers."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(q_desc.block_type.shape[1] == BLOCK_M)
    gl.static_assert(k_desc.block_type.shape[1] == BLOCK_N)
    gl.static_assert(not (ROWS and GROUPED_HEADS), "packed documents keep the grid's order")
    gl.static_assert(not (PERSISTENT and SPLIT_D), "persistent programs: the ws2 schedule")
    gl.static_assert(not ORDERED or (PERSISTENT and ROWS), "key blocks in an order: persistent, packed documents")
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    # (offset, delta) of stage s at rows 2 s, 2 s + 1; the 1-D layout of the descriptor's blocks
    st_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES] + st_desc.block_type.shape, st_desc.layout)
    # K and V: rings of depth 1, so that the consumers can index them with an opaque zero
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    if BLOCK_DT > 0:  # the tail pieces of every Q stage and of K
        gl.static_assert(SPLIT_D, "head dims in pieces run the head-dim split schedule")
        qt_bufs = gl.allocate_shared_memory(dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
        kt_smem = gl.allocate_shared_memory(dtype, [1] + kt_desc.block_type.shape, kt_desc.layout)
    else:  # stand-ins, never read (warp_specialize's arguments cannot be None)
        qt_bufs = q_bufs
        kt_smem = k_smem
    if SPLIT_D:
        # P^T and dS^T of two steps; each warpgroup writes 32 of
        # the 64 columns, which a 64-byte swizzle keeps in whole swizzle blocks (the default
        # 128-byte one would cut them)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        DS_BUFS: gl.constexpr = 4  # (_consumer_split_d's NBUF pairs)
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        DS_BUFS: gl.constexpr = 3 if LAG else 2  # LAG: dS(i) is read during step i + 1 (_consumer)
    ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
    kv_bar = _alloc_bars(1)
    if PERSISTENT:  # both consumer warpgroups done with a key block's K and V: the next may load
        kv_empty = _alloc_bars(1, 2)
    else:  # (a stand-in, never used)
        kv_empty = kv_bar
    if PERSISTENT:  # the producer's key blocks passed to the consumers (_publish_tile)
        tile_ids = gl.allocate_shared_memory(gl.int32, [2 * TILE_WORDS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tile_full = _alloc_bars(2)
        tile_empty = _alloc_bars(2, 2)
    else:  # (stand-ins, never used)
        tile_ids = kv_bar
        tile_full = kv_bar
        tile_empty = kv_bar
    ready = _alloc_bars(STAGES)
    empty = _alloc_bars(STAGES, 2)  # released when both consumer warpgroups are done with a stage
    ds_bar = _alloc_bars(DS_BUFS // 2 if SPLIT_D else DS_BUFS, 2)  # both halves of dS (SPLIT_D: and P^T) written
    fence_async_shared()
    # packed documents: every partition needs the same query blocks (QLO / QHI: per key), planned
    # here once for the program's one block (persistent: by the producer per block, _block_rows)
    if ROWS and not PERSISTENT:
        rows_first, rows_n, rows_full_lo0, rows_full_hi0, rows_full_lo1, rows_full_hi1 = _key_tile_query_range(
            gl.program_id(0) * BLOCK_N, Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_M, BLOCK_N, SPLIT_D, num_warps
        )
    else:
        rows_first = 0
        rows_n = 0
        rows_full_lo0 = 0
        rows_full_hi0 = 0
        rows_full_lo1 = 0
        rows_full_hi1 = 0
    # Annotated constexpr so the tuple keeps its constexpr members (as in _gluon_fwd)
    consumer_args: gl.constexpr = (
        q_bufs,
        do_bufs,
        st_bufs,
        k_smem,
        v_smem,
        ds_bufs,
        kv_bar,
        ready,
        empty,
        ds_bar,
        DQ,
        DK,
        DV,
        stride_dqb,
        stride_dqs,
        stride_dqh,
        stride_dkb,
        stride_dks,
        stride_dkh,
        stride_dvb,
        stride_dvs,
        stride_dvh,
        Hq,
        Hkv,
        group,
        Sq,
        Sk,
        q_start,
        k_start,
        left,
        QLO,
        QHI,
        rows_first,
        rows_n,
        rows_full_lo0,
        rows_full_hi0,
        rows_full_lo1,
        rows_full_hi1,
        qk_scale,
        sm_scale,
        HEAD_DIM,
        BLOCK_D,
        HEAD_DIM_V,
        BLOCK_DV,
        BLOCK_M,
        BLOCK_N,
        STAGES,
        CAUSAL,
        HAS_LEFT,
        ROWS,
        ACCUMULATE,
        WALK,
        DQ_BLOCKED,
        LAG,
        DQ_FIRST,
        qt_bufs,
        kt_smem,
        BLOCK_DT,
        GROUPED_HEADS,
        BIAS,
        stride_bias_b,
        KEY_SPANS,
        HAS_BIAS,
    )
    # _produce_key_block's arguments between the block's `uses` and PERSISTENT
    producer_args: gl.constexpr = (
        Hq, Hkv, group, Sq, Sk, Sq_pad, q_start, k_start, left, rows_first, rows_n, q_desc, do_desc, k_desc, v_desc,
        st_desc, qt_desc, kt_desc, q_bufs, do_bufs, st_bufs, qt_bufs, k_smem, v_smem, kt_smem, kv_bar, kv_empty, ready,
        empty, CAUSAL, HAS_LEFT, ROWS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DT, STAGES, WALK, GROUPED_HEADS, KEY_SPANS,
        HAS_BIAS,
    )  # fmt: skip
    rows_args: gl.constexpr = (Sq, Sk, q_start, k_start, QLO, QHI, BLOCK_M, BLOCK_N)  # (_block_rows)
    # both drivers' arguments after their own: the key blocks handed out and the slots passing them
    handout: gl.constexpr = (num_tiles, grid0, grid1, tile_ids, tile_full, tile_empty, ROWS, PERSISTENT)
    producer_rest: gl.constexpr = (gl.tuple(rows_args), TILE_COUNTER, KEY_ORDER, ORDERED) + handout
    persistent_args: gl.constexpr = (kv_empty,) + handout
    # a key block of zero bias runs a copy of the consumer compiled without the bias
    # (_consume_versioned) at D <= 64, whose half-size matmuls do not hide a branch a step;
    # at D=128 the two copies spill (the accumulating causal case: 232 bytes), and the causal
    # D=64 backward measured slower with them (mask/none 1.041-1.050 against 1.019-1.027)
    plain_args: gl.constexpr = consumer_args[:-1] + (False,)
    VERSIONED: gl.constexpr = HAS_BIAS and BLOCK_D <= 64 and not CAUSAL
    versions: gl.constexpr = (
        gl.tuple(consumer_args), gl.tuple(plain_args), gl.tuple((Hkv, KEY_SPANS)), BLOCK_N, GROUPED_HEADS, VERSIONED
    )  # fmt: skip
    if SPLIT_D:
        gl.warp_specialize(
            [
                (_consumer_split_d, (0,) + consumer_args),
                (_consumer_split_d, (1,) + consumer_args),
                (_producer, (gl.tuple(producer_args),) + producer_rest),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_consumer, (0,) + versions + persistent_args),
                (_consumer, (1,) + versions + persistent_args),
                (_producer, (gl.tuple(producer_args),) + producer_rest),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


KERNELS = {"ws2": _bwd_ws2, "ws2_split_d": _bwd_ws2}  # (the schedule is the SPLIT_D constexpr)
