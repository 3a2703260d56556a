"""Tiles handed out at run time to persistent Gluon programs (Hopper, sm_90a): shared by the
backward (_gluon_bwd: key blocks) and the forward (_gluon_fwd with DYNAMIC: query tiles).

A program's producer warp takes its next tile from an int32 counter in global memory (one
atomic a warp: _fetch_tile) and passes it to the program's consumer warpgroups through one of
two shared slots (_publish_tile / _receive_tile): `tile_ids` (2 * TILE_WORDS int32 words),
`tile_full` (two mbarriers of count 1) and `tile_empty` (two of count CONSUMERS, one arrival
per consumer warpgroup that has read the slot). A tile index past the last stops every
partition. Every launch takes each index below the tile count exactly once and, in each
program, exactly one index at or past it: num_tiles + num_programs fetches in all, so the
counter ends the launch at that sum unless it is put back (_reset_counter; the backward's
launcher zeroes its counter instead).

Imported only by the guarded Gluon kernel modules: this one needs `triton.experimental.gluon`
(triton >= 3.6).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _fetch_tile(counter):
    """The next tile of the launch: the counter's value before adding 1, read by lane 0 of the
    producer warp and passed to every lane (one atomic a warp, not 32)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 r, l; mov.b32 r, 0; mov.u32 l, %laneid; setp.eq.u32 p, l, 0;"
        " @p atom.global.relaxed.gpu.add.u32 r, [$1], 1; shfl.sync.idx.b32 $0, r, 0, 0x1f, 0xffffffff; }",
        "=r,l",
        [counter.to(gl.int64, bitcast=True)],
        gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _reset_counter(counter, last):
    """Where `last` (the program's final fetch returned the launch's last index, num_tiles +
    num_programs - 1): lane 0 of the producer warp, the thread whose atomic that was, stores 0
    into the counter. Every other fetch of the launch came before that atomic in the counter's
    order (each returned a smaller value), and a program fetches nothing after its index past
    the last, so the store is the counter's final value: the next launch starts from 0 with no
    memset. Assumes one launch at a time on the counter (stream order)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p, q; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; setp.ne.b32 q, $2, 0;"
        " and.pred p, p, q; @p st.relaxed.gpu.global.b32 [$1], 0; mov.b32 $0, 0; }",
        "=r,l,r",
        [counter.to(gl.int64, bitcast=True), last.to(gl.int32)],
        gl.int32,
        is_pure=False,
        pack=1,
    )


TILE_WORDS = gl.constexpr(8)  # a shared slot's int32 words: the tile and up to seven words the producer planned


@gluon.jit
def _publish_tile(tile_ids, tile_full, tile_empty, k, t, rows, ROWS: gl.constexpr):
    """The producer: tile t as the program's k-th into slot k % 2 (ROWS: with the six words
    of `rows` after it), once every consumer has read what the slot held (tile_empty; a fresh
    barrier passes parity 1); tile_full (count 1) completes its (k // 2)-th phase."""
    slot = k % 2
    mbarrier.wait(tile_empty.index(slot), ((k // 2) & 1) ^ 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    tile_ids.index(slot * TILE_WORDS).store(gl.full([1], t, gl.int32, one))
    if ROWS:
        for j in gl.static_range(6):
            tile_ids.index(slot * TILE_WORDS + 1 + j).store(gl.full([1], rows[j], gl.int32, one))
    mbarrier.arrive(tile_full.index(slot))


@gluon.jit
def _max_combine(a, b):  # (also the forward's row maxima: _gluon_fwd imports it)
    return gl.maximum(a, b)


@gluon.jit
def _read_word(tile_ids, i):
    """Word i of the shared slots, read by a consumer warpgroup (every thread gets it)."""
    four: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.reduce(tile_ids.index(i).load(four), 0, _max_combine)


@gluon.jit
def _receive_tile(tile_ids, tile_full, tile_empty, k, ROWS: gl.constexpr):
    """A consumer warpgroup: the program's k-th tile from slot k % 2 (_publish_tile) and
    (ROWS) the six words after it (else zeros), then the slot released."""
    slot = k % 2
    mbarrier.wait(tile_full.index(slot), (k // 2) & 1)
    at = slot * TILE_WORDS
    t = _read_word(tile_ids, at)
    if ROWS:
        rows = (
            _read_word(tile_ids, at + 1), _read_word(tile_ids, at + 2), _read_word(tile_ids, at + 3),
            _read_word(tile_ids, at + 4), _read_word(tile_ids, at + 5), _read_word(tile_ids, at + 6),
        )  # fmt: skip
    else:
        rows = (0, 0, 0, 0, 0, 0)
    mbarrier.arrive(tile_empty.index(slot))
    return t, rows
