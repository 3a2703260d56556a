"""Ring attention over gloo with several processes against a single-process float64 oracle."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ringflash import flash_attn_func, local_positions, ring_flash_attn_func, shard, unshard
from ringflash.comm import RingComm
from ringflash.masks import window_from
from ringflash.schedule import ring_steps, step_tasks, steps_needed

from hybrid_cases import hybrid_precision, hybrid_vs_oracle
from oracle import assert_within, max_err, plain_errors, reference, rel_rms
from ring_cases import TORCH, TRITON, Case, full_inputs, ring_vs_oracle


def _cases():
    """(world, Case) pairs: both layouts, causal or not, GQA/MQA, float32/float64, padding
    masks, cross-attention; odd chunk lengths give several kernel blocks per rank."""
    out = []
    for world in (1, 2, 3, 4):
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                out.append((world, Case(layout, causal, 2, 5, 4, 2, 16, torch.float32, seed=world)))
        out.append((world, Case("zigzag", True, 1, 24, 3, 1, 32, torch.float64, seed=7)))  # MQA, float64
        out.append(
            (world, Case("zigzag", False, 2, 3, 2, 2, 16, torch.float32, seed=8, mask="bool", kv_chunk=7))
        )  # cross-attention, padded keys
        out.append((world, Case("contiguous", True, 2, 5, 2, 1, 16, torch.float32, seed=9, mask="float")))
    return out


@pytest.mark.parametrize("world,case", _cases(), ids=lambda x: str(x) if isinstance(x, Case) else f"w{x}")
def test_ring_torch_backend(worlds, world, case):
    worlds(world, **TORCH).run(ring_vs_oracle, case)


def _triton_cases():
    out = []
    for world in (2, 3):
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                for mask in (None, "bool") if causal else (None,):
                    out.append((world, Case(layout, causal, 1, 20, 2, 1, 16, torch.float32, seed=3, mask=mask)))
        # GQA in two kv-head chunks: the kernels on head-sliced views of q, k, v, the statistics and the slots
        out.append((world, Case("zigzag", True, 1, 8, 4, 2, 16, torch.float32, seed=4, grad_chunks=2)))
    return out


@pytest.mark.parametrize("world,case", _triton_cases(), ids=lambda x: str(x) if isinstance(x, Case) else f"w{x}")
def test_ring_triton_interpreter(worlds, world, case):
    worlds(world, **TRITON).run(ring_vs_oracle, case)


def _windowed(rank, world, layout, causal, window_size, chunk, seed):
    """A sliding window on the dense ring: this rank's out, lse and gradients, and the
    reassembled out and dK, against one device's float64 attention with the same window over
    the whole sequence; bounds from the plain float32 computation (GQA 4/2, float32)."""
    S = 2 * world * chunk
    q, k, v, do = full_inputs(1, S, S, 4, 2, 16, torch.float32, seed)
    kw = dict(causal=causal, window_size=window_size)
    ref = reference(q, k, v, do, **kw)
    plain = plain_errors(q, k, v, do, ref, **kw)
    sh = lambda t, dim=1: shard(t, layout=layout, dim=dim)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    kinds = []  # the exchanges this rank starts: the ring stops after the steps the window needs
    start = RingComm.start

    def counted(self, send, recv, kind, **kw):
        kinds.append(kind)
        return start(self, send, recv, kind, **kw)

    with mock.patch.object(RingComm, "start", counted):
        out, lse = ring_flash_attn_func(ql, kl, vl, layout=layout, return_lse=True, **kw)
        grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    steps = steps_needed(layout, world, 2 * chunk, 2 * chunk, window_from(causal, window_size, "t"))
    assert kinds.count("kv") == 2 * (steps - 1), (kinds, steps)  # forward and backward
    tag = f"{layout} causal={causal} window_size={window_size} world {world}"
    assert_within(f"out {tag}", out, sh(ref[0]), plain["out"])
    assert_within(f"lse {tag}", lse, sh(ref[1], dim=2), plain["lse"], sum_len=1)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert_within(f"{name} {tag}", g, sh(r), plain[name])
    assert_within(f"unshard(out) {tag}", unshard(out, layout=layout), ref[0], plain["out"])
    assert_within(f"unshard(dk) {tag}", unshard(grads[1], layout=layout), ref[3], plain["dk"])


# (layout, causal, window_size) with chunk 6 (S = 12 world): (3, 0) and (2, 4) are narrower than
# a chunk, so at world 3 ring step 2 has no work on any rank (contiguous, causal) or single
# ranks have none at a step (two-sided, and zigzag); zigzag empties a whole step from world 4
# (test_narrow_windows_leave_ring_steps_without_work)
WINDOWS = [
    ("zigzag", True, (3, 0)),
    ("contiguous", True, (3, 0)),
    ("zigzag", False, (2, 4)),
    ("contiguous", False, (2, 4)),
    ("zigzag", True, (10, -1)),  # causal with right -1: right 0, a window wider than a chunk
    ("contiguous", False, (-1, 7)),  # unbounded on the left, into the future on the right
]
WINDOW_CASES = [(w, c) for w in (2, 3) for c in WINDOWS] + [(4, ("zigzag", True, (3, 0)))]


@pytest.mark.parametrize(
    "world,case",
    WINDOW_CASES,
    ids=lambda x: f"{x[0]}-{'causal' if x[1] else 'full'}-{x[2][0]}_{x[2][1]}" if isinstance(x, tuple) else f"w{x}",
)
def test_ring_window_torch_backend(worlds, world, case):
    worlds(world, **TORCH).run(_windowed, *case, 6, 20 + world)


@pytest.mark.parametrize(
    "case", [("zigzag", True, (3, 0)), ("contiguous", False, (2, 4))], ids=["zigzag-causal", "contiguous-full"]
)
def test_ring_window_triton_interpreter(worlds, case):
    worlds(2, **TRITON).run(_windowed, *case, 6, 30)


def test_narrow_windows_leave_ring_steps_without_work():
    """What the cases above exercise in the schedule: ranks (or all ranks) that hold K/V no
    query of theirs sees at a step compute nothing there."""

    def work(layout, world, causal, window_size):
        """[step][rank]: has block tasks."""
        w = window_from(causal, window_size, "t")
        local = 12  # chunk 6: 12 rows per rank in either layout
        return [[bool(step_tasks(layout, r, world, s, local, local, w)) for r in range(world)] for s in range(world)]

    assert work("contiguous", 3, True, (3, 0))[2] == [False] * 3
    assert steps_needed("contiguous", 3, 12, 12, window_from(True, (3, 0), "t")) == 2  # one hop: K/V stop there
    assert work("zigzag", 4, True, (3, 0))[2] == [False] * 4
    # the ring skips that step: K/V go from step 1 straight to step 3, two places on
    assert ring_steps("zigzag", 4, 12, 12, window_from(True, (3, 0), "t")) == (0, 1, 3)
    assert ring_steps("zigzag", 8, 12, 12, window_from(True, (3, 0), "t")) == (0, 1, 7)  # 2 hops, not 7
    assert not work("zigzag", 3, True, (3, 0))[1][0]
    for layout in ("contiguous", "zigzag"):
        assert not all(all(step) for step in work(layout, 3, False, (2, 4)))
        assert all(all(step) for step in work(layout, 3, False, (-1, -1)))  # no window: every rank works every step


def test_no_process_group_is_local_attention():
    """A ring of one rank runs as the local call (ring._whole_block): output and gradients
    bitwise flash_attn_func's."""
    q, k, v, do = full_inputs(2, 24, 24, 4, 2, 16, torch.float32, 0)
    assert not dist.is_initialized()

    def with_grads(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        return [out.detach(), *torch.autograd.grad(out, leaves, do)]

    from ringflash import reference

    calls = []  # the backward's calls: one with dQ, dK and dV together, as the local call makes
    backward = reference.backward

    def counted(q, k, v, m, l, do, delta, dq, dk, dv, **kw):
        calls.append((dq is not None, dk is not None))
        return backward(q, k, v, m, l, do, delta, dq, dk, dv, **kw)

    for kw in (dict(causal=False), dict(causal=True), dict(causal=True, window_size=(5, 0))):
        calls.clear()
        with mock.patch.object(reference, "backward", counted):
            ring = with_grads(ring_flash_attn_func, **kw)
        assert calls == [(True, True)], (kw, calls)
        for a, b in zip(ring, with_grads(flash_attn_func, **kw)):
            assert torch.equal(a, b), kw
    a = ring_flash_attn_func(q, k, v, causal=False, window_size=(3, 6))
    assert torch.equal(a, flash_attn_func(q, k, v, causal=False, window_size=(3, 6)))
    assert max_err(a, flash_attn_func(q, k, v, causal=False)) > 1e-2  # the window changed the result
    assert torch.equal(shard(q), q) and torch.equal(unshard(q), q)
    assert torch.equal(local_positions(24), torch.arange(24))


def _subgroups(rank, world):
    # two rings at once on disjoint subgroups: ranks [1, 3] and [0, 2]
    ga, gb = dist.new_group([1, 3]), dist.new_group([0, 2])
    if rank in (1, 3):
        ring_vs_oracle(rank, world, Case("zigzag", True, 1, 6, 2, 1, 16, torch.float32, seed=1), group=ga)
        assert local_positions(24, group=ga).tolist() == (
            list(range(0, 6)) + list(range(18, 24)) if rank == 1 else list(range(6, 18))
        )
    else:
        ring_vs_oracle(rank, world, Case("contiguous", False, 2, 4, 4, 4, 16, torch.float32, seed=2), group=gb)


def test_ring_on_subgroups(worlds):
    worlds(4, **TORCH).run(_subgroups)


def _precision(rank, world, grad_accum):
    """relative RMS error against float64, bf16 inputs: the ring's within 1.2x of one device's
    with float32 gradient accumulators. With bf16 ones (grad_accum_dtype) the gradients take one
    rounding per step, and their error grows like sqrt(world): within 1.3 sqrt(world) of one
    device's (measured 1.2-1.7 at world 2, 1.6-3.1 at world 8); their forward is bitwise the
    default's."""
    q, k, v, do = full_inputs(1, 64 * world, 64 * world, 2, 2, 32, torch.bfloat16, 11)
    ref = reference(q, k, v, do, causal=True)
    plain = plain_errors(q, k, v, do, ref, causal=True)
    ref = [ref[0], *ref[2:]]
    names = ("out", "dq", "dk", "dv")
    # one device, itself within 2x the plain bf16 computation's error (the anchor of the ratios)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out1 = flash_attn_func(qs, ks, vs, causal=True)
    one = (out1, *torch.autograd.grad(out1, (qs, ks, vs), do))
    for name, x, r in zip(names, one, ref):
        assert_within(f"one device {name}", x, r, plain[name])
    err1 = [rel_rms(x, r) for x, r in zip(one, ref)]
    # the ring, reassembled
    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    out = ring_flash_attn_func(ql, kl, vl, causal=True, grad_accum_dtype=grad_accum)
    g = torch.autograd.grad(out, (ql, kl, vl), shard(do))
    ring = [unshard(x) for x in (out, *g)]
    if grad_accum is None:
        for name, x, r in zip(names, ring, ref):
            assert_within(f"world {world} {name}", x, r, plain[name])
    errw = [rel_rms(x, r) for x, r in zip(ring, ref)]
    for name, e1, ew in zip(names, err1, errw):
        bound = 1.2 if grad_accum is None or name == "out" else 1.3 * world**0.5
        assert ew <= bound * e1, f"{name}: world {world} error {ew:.3e} vs one device {e1:.3e}"
    if grad_accum is not None:
        assert torch.equal(out, ring_flash_attn_func(ql, kl, vl, causal=True))


@pytest.mark.parametrize("world", [4, 8])
def test_precision_does_not_fall_with_ranks(worlds, world):
    worlds(world, **TORCH).run(_precision, None)


# hybrid grids of 8 ranks (ringflash.hybrid; tests/test_hybrid.py has the 4-rank ones) here,
# on this module's 8 processes: starting 8 more on a small machine costs minutes
HYBRID8 = [
    (2, 4, "zigzag", True, 1, 1, 8, 2, None, 11),  # Hkv < U: kv heads replicated
    (4, 2, "zigzag", True, 1, 1, 4, 4, "bool", 12),  # Hkv > U
    (4, 2, "contiguous", False, 1, 1, 4, 2, None, 13),  # Hkv == U
]


@pytest.mark.parametrize("case", HYBRID8, ids=lambda c: f"R{c[0]}xU{c[1]}-{c[2]}-{c[6]}x{c[7]}")
def test_hybrid_8_ranks(worlds, case):
    worlds(8, **TORCH).run(hybrid_vs_oracle, *case)


@pytest.mark.parametrize("grid", [(2, 4, 4, 4), (4, 2, 4, 2)], ids=lambda g: f"R{g[0]}xU{g[1]}-{g[2]}x{g[3]}")
def test_hybrid_precision_at_8_ranks(worlds, grid):
    worlds(8, **TORCH).run(hybrid_precision, *grid)


@pytest.mark.parametrize("world", [2, 8])
def test_precision_with_16bit_grad_accumulators(worlds, world):
    worlds(world, **TORCH).run(_precision, torch.bfloat16)


def _large_scores(rank, world, layout, causal, Hq, Hkv, mag, seed):
    """Scores ~1e4-5e4 on the ring: the state (m, l) folds across ranks and the backward
    rebuilds each block's probabilities from the final m, l, so the reassembled out, dV and
    dQ, dK stand against the same baselines as one device (test_local.test_large_scores)."""
    S, D = 24 * world, 32  # enough keys per row for near-ties, where an lse-only state fails
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, S, H, D, generator=g) for H in (Hq, Hkv, Hkv, Hq))
    q, k = q * mag, k * mag
    sh = lambda t: shard(t, layout=layout)
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    out, lse = ring_flash_attn_func(ql, kl, vl, causal=causal, softmax_scale=1.0, layout=layout, return_lse=True)
    grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    got = [unshard(out, layout=layout), unshard(lse, layout=layout, dim=2)]
    got += [unshard(t, layout=layout) for t in grads]
    ref = reference(q, k, v, do, causal=causal, scale=1.0)
    plain = plain_errors(q, k, v, do, ref, orders=4, seed=seed, causal=causal, scale=1.0)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert_within(f"{name} ({layout}, causal={causal}, {Hq}/{Hkv}, seed {seed})", x, r, plain[name])


LARGE = [
    ("zigzag", True, 2, 2, 30.0, 1),
    ("zigzag", True, 4, 1, 70.0, 2),
    ("contiguous", False, 4, 2, 30.0, 3),
    ("zigzag", False, 2, 2, 70.0, 4),
    ("contiguous", True, 2, 2, 10.0, 5),
    ("zigzag", True, 4, 2, 30.0, 6),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", LARGE, ids=lambda c: f"{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}x{c[3]}-s{c[5]}")
def test_large_scores_on_the_ring(worlds, world, case):
    worlds(world, **TORCH).run(_large_scores, *case)


@pytest.mark.parametrize(
    "case",
    [("zigzag", True, 2, 1, 30.0, 5), ("contiguous", False, 2, 2, 70.0, 6)],
    ids=["zigzag-causal", "contiguous-full"],
)
def test_large_scores_on_the_ring_triton_interpreter(worlds, case):
    worlds(2, **TRITON).run(_large_scores, *case)


@pytest.mark.parametrize("chunks,masked", [(None, False), (2, True)])
def test_ring_backward_fused_grouping(chunks, masked, monkeypatch):
    """A backend that fuses a block's dQ with its dK/dV (the fused Hopper kernel; here the torch
    backend told to) gets each task's dQ inside the kv-head chunk loop, beside dK/dV, instead
    of in the dQ pass first: bitwise the same gradients as the separate passes (the same
    operations in the same order), with kv-head chunks and a key padding mask;
    deterministic=True keeps the separate passes."""
    from ringflash import reference as torch_backend
    from ringflash.testing import replay_ring

    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 96, 8, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 96, 4, 16, dtype=torch.float64, generator=g) for _ in range(2))
    pad = (torch.rand(1, 96, generator=g) < 0.2) if masked else None
    kw = dict(world=3, causal=True, key_padding_mask=pad, grad_chunks=chunks)
    with torch_backend_calls(monkeypatch, torch_backend) as calls:
        separate = replay_ring(q, k, v, do, **kw)
        assert calls and not any(dq and dk for dq, dk in calls)
    monkeypatch.setattr(torch_backend, "fuses_backward", lambda *a, **kw: not kw["deterministic"])
    with torch_backend_calls(monkeypatch, torch_backend) as calls:
        fused = replay_ring(q, k, v, do, **kw)
        assert calls and all(dq and dk for dq, dk in calls)
    with torch_backend_calls(monkeypatch, torch_backend) as calls:
        replay_ring(q, k, v, do, deterministic=True, **kw)
        assert not any(dq and dk for dq, dk in calls)
    for name, a, b in zip(("out", "dq", "dk", "dv"), separate, fused):
        assert torch.equal(a, b), (name, (a - b).abs().max())


@contextlib.contextmanager
def torch_backend_calls(monkeypatch, module):
    """Record (dq given, dk given) of every backward call of the torch backend inside the block."""
    calls, real = [], module.backward

    def spy(*a, **kw):
        calls.append((a[7] is not None, a[8] is not None))
        return real(*a, **kw)

    monkeypatch.setattr(module, "backward", spy)
    try:
        yield calls
    finally:
        monkeypatch.setattr(module, "backward", real)


def _deterministic_reaches_the_backward(rank, world):
    """Every block_backward call of a ring backward gets the call's mode: deterministic=True,
    torch.use_deterministic_algorithms(True), or neither; eager and compiled (the operators
    carry it from the forward to the backward)."""
    from ringflash import ring

    q, k, v, do = full_inputs(1, 16, 16, 4, 2, 16, torch.float32, 5)
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    seen = []
    real = ring.block_backward

    def spy(*a, **kw):
        seen.append(kw["deterministic"])
        return real(*a, **kw)

    def modes(fn, **kw):
        seen.clear()
        torch.autograd.grad(fn(ql, kl, vl, causal=True, **kw), (ql, kl, vl), shard(do))
        return set(seen)

    compiled = torch.compile(ring_flash_attn_func, fullgraph=True, backend="aot_eager")
    with mock.patch.object(ring, "block_backward", spy):
        for fn in (ring_flash_attn_func, compiled):
            assert modes(fn) == {False}
            assert modes(fn, deterministic=True) == {True}
            torch.use_deterministic_algorithms(True)
            try:
                assert modes(fn) == {True}
            finally:
                torch.use_deterministic_algorithms(False)
    torch._dynamo.reset()


def test_deterministic_reaches_the_ring_backward(worlds):
    worlds(2, **TORCH).run(_deterministic_reaches_the_backward)
