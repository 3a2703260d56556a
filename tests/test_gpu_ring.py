"""The ring's CUDA path on GPUs.

With one GPU: every rank's block schedule is replayed in one process (ReplayComm) and must
match single-GPU attention. With two or more GPUs: the real ring over NCCL, one process per
GPU. Run with `pytest -m gpu` on a CUDA machine.
"""

import pytest
import torch

from ringflash import balanced_layout, flash_attn_func, flash_attn_varlen_func, ring_flash_attn_func, shard, unshard
from ringflash.balance import document_zigzag_layout
from ringflash.testing import replay_ring, varlen_reference

from dist_utils import run_world
from oracle import (
    force_fused_backward,
    key_bias_on_gluon,
    naive_attention,
    rel_rms,
    spy_dq_unblocks,
    spy_fused_backward,
)

pytestmark = pytest.mark.gpu
_rel_rms = rel_rms


def _packed_reference_and_single_gpu(q, k, v, do, cu, **kw):
    """Packed documents (total, H, D) with cu_seqlens cu: out, dq, dk, dv in float64
    (varlen_reference), and one GPU's flash_attn_varlen_func with the same keywords."""
    ref = varlen_reference(q, k, v, do, cu, cu, **{n: x for n, x in kw.items() if n != "deterministic"})
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_varlen_func(qs, ks, vs, cu, cu, **kw)
    return [ref[0], *ref[2:]], [out.detach(), *torch.autograd.grad(out, (qs, ks, vs), do)]


def _within_single_gpu(ref, single, ring):
    """Each of the ring's out, dq, dk, dv finite and within 1.2x of one GPU's error against the
    float64 reference (rel_rms)."""
    for name, r, sgl, g in zip(("out", "dq", "dk", "dv"), ref, single, ring):
        assert torch.isfinite(g).all(), name
        e_single, e_ring = _rel_rms(sgl, r), _rel_rms(g, r)
        assert e_ring <= 1.2 * e_single + 1e-6, f"{name}: ring {e_ring:.3e} vs single GPU {e_single:.3e}"


def _inputs(B, S, Hq, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda H: torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def _reference(q, k, v, do, causal, window_size=(-1, -1)):
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qr, kr, vr, causal=causal, window_size=window_size)
    return [ref.detach(), *torch.autograd.grad(ref, (qr, kr, vr), do.double())]


def _single_gpu(q, k, v, do, causal, window_size=(-1, -1)):
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(qs, ks, vs, causal=causal, window_size=window_size)
    return [out.detach(), *torch.autograd.grad(out, (qs, ks, vs), do)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_replayed_ring_key_padding(layout, causal, world, monkeypatch):
    """A key padding mask on the ring (each rank's keys' slice of it travelling with them) on
    the Gluon kernels (configs.GLUON_KEY_BIAS: folded forward steps, accumulating fused backward
    steps; each block's trailing padding skipped, configs.GLUON_CUT_KEY_PADDING, its zero-bias
    span unbiased, PLAIN_ZERO_BIAS_KEYS): out and gradients within 1.2x of one GPU's error
    against float64, and both Gluon kernels ran."""
    fwd_calls, bwd_calls = key_bias_on_gluon(monkeypatch)
    q, k, v, do = _inputs(2, 4096, 4, 2, 128, torch.bfloat16, seed=world + 10 * causal)
    g = torch.Generator(device="cuda").manual_seed(world)
    pad = torch.rand(2, 4096, device="cuda", generator=g) < 0.2
    pad[0] = False  # left padding only: each step's keys of row 0 mostly a zero-bias span
    pad[0, :100] = True
    pad[1, -700:] = True
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qr, kr, vr, causal=causal, key_padding_mask=pad)
    ref = [ref.detach(), *torch.autograd.grad(ref, (qr, kr, vr), do.double())]
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(qs, ks, vs, causal=causal, key_padding_mask=pad)
    single = [out.detach(), *torch.autograd.grad(out, (qs, ks, vs), do)]
    fwd_calls.clear()
    bwd_calls.clear()
    ring = replay_ring(q, k, v, do, world=world, causal=causal, layout=layout, key_padding_mask=pad)
    assert fwd_calls and bwd_calls
    _within_single_gpu(ref, single, ring)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_replayed_ring_matches_single_gpu(dtype, layout, causal, world):
    q, k, v, do = _inputs(1, 4096, 4, 2, 128, dtype, seed=world)
    ref = _reference(q, k, v, do, causal)
    single = _single_gpu(q, k, v, do, causal)
    ring = replay_ring(q, k, v, do, world=world, causal=causal, layout=layout)
    assert all(g.dtype == dtype for g in ring)
    _within_single_gpu(ref, single, ring)


@pytest.mark.parametrize("D,Dv", [(96, 96), (192, 192), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_replayed_ring_at_padded_head_dims(D, Dv, causal, monkeypatch):
    """Head dims under their padding (96 -> 128, 192 -> 256; MLA's v at 128 beside q/k at 192)
    fold each step's keys into the float32 state on the Gluon forward (zero columns read, O's
    true width stored), and the steps' gradients come from the fused backward (forced at this
    size; 256 wide: the head-dim split schedule, v's width apart) into the ring's one blocked
    dQ, replayed at world 4: within the error of one GPU's flash_attn_func."""
    from ringflash.kernels import gluon_forward

    calls = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: calls.append(kw["fold"]) or real(*a, **kw))
    q, k, v, do = _inputs(1, 4096, 4, 2, D, torch.bfloat16, seed=D + Dv + causal)
    if Dv != D:
        v, do = (t[..., :Dv].contiguous() for t in (v, do))
    ref = _reference(q, k, v, do, causal)
    single = _single_gpu(q, k, v, do, causal)
    calls.clear()
    force_fused_backward(monkeypatch)
    fused = spy_fused_backward(monkeypatch)
    ring = replay_ring(q, k, v, do, world=4, causal=causal, layout="zigzag")
    assert any(calls), "no ring step folded on the Gluon forward"
    assert set(fused) == {"blocked"}, fused
    _within_single_gpu(ref, single, ring)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window_size", [(True, (255, 0)), (False, (100, 300))])
def test_replayed_ring_with_window(layout, causal, window_size):
    """Sliding windows narrower than a chunk (zigzag: 4096 / 8 = 512 rows) through the Triton
    kernels at ring offsets, replayed at world 4 (whole steps without work): the error of one
    GPU's flash_attn_func with the window."""
    q, k, v, do = _inputs(1, 4096, 4, 2, 128, torch.bfloat16, seed=6)
    ref = _reference(q, k, v, do, causal, window_size)
    single = _single_gpu(q, k, v, do, causal, window_size)
    ring = replay_ring(q, k, v, do, world=4, causal=causal, window_size=window_size, layout=layout)
    _within_single_gpu(ref, single, ring)


@pytest.mark.parametrize("heads_q,heads_kv,chunks", [(6, 3, 2), (8, 4, 4), (8, 4, 1), (3, 1, 4)])
def test_replayed_ring_with_chunked_grads(heads_q, heads_kv, chunks):
    """The dK/dV accumulators in 1 to 4 kv-head chunks (2+1 heads for Hkv=3, C=2), exchanged on
    the side stream, replayed on one GPU."""
    q, k, v, do = _inputs(1, 3072, heads_q, heads_kv, 128, torch.bfloat16, seed=chunks)
    ref = _reference(q, k, v, do, True)
    single = _single_gpu(q, k, v, do, True)
    ring = replay_ring(q, k, v, do, world=3, causal=True, grad_chunks=chunks)
    for name, r, s, g in zip(("out", "dq", "dk", "dv"), ref, single, ring):
        assert _rel_rms(g, r) <= 1.2 * _rel_rms(s, r) + 1e-6, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replayed_ring_with_16bit_grad_accumulators(dtype):
    """grad_accum_dtype = the inputs' dtype through the Triton kernels (16-bit read-add-write of
    dQ/dK/dV): forward unchanged, gradients within 1.3 sqrt(P) of one GPU's error (the replay sums
    the ranks' dK/dV contributions in float32, so only dQ and each rank's share take the 16-bit
    roundings here; the NCCL test below has the whole chain)."""
    q, k, v, do = _inputs(1, 4096, 8, 4, 128, dtype, seed=5)
    ref = _reference(q, k, v, do, True)
    single = _single_gpu(q, k, v, do, True)
    exact = replay_ring(q, k, v, do, world=4, causal=True)
    ring = replay_ring(q, k, v, do, world=4, causal=True, grad_accum_dtype=dtype)
    assert torch.equal(ring[0], exact[0])
    for name, r, s, g in zip(("dq", "dk", "dv"), ref[1:], single[1:], ring[1:]):
        assert _rel_rms(g, r) <= 1.3 * 4**0.5 * _rel_rms(s, r) + 1e-6, name


def _nccl_worker(rank, world, layout, causal, dtype, heads=(8, 2), chunks=None, grad_accum=None, window_size=(-1, -1)):
    q, k, v, do = _inputs(2, 8192, *heads, 128, dtype, seed=0)  # same full tensors on every rank
    ref = _reference(q, k, v, do, causal, window_size)
    single = _single_gpu(q, k, v, do, causal, window_size)
    ql, kl, vl = (shard(t, layout=layout).clone().requires_grad_() for t in (q, k, v))
    out = ring_flash_attn_func(
        ql, kl, vl, causal=causal, window_size=window_size, layout=layout, grad_accum_dtype=grad_accum,
        grad_chunks=chunks,
    )  # fmt: skip
    grads = torch.autograd.grad(out, (ql, kl, vl), shard(do, layout=layout))
    ring = [unshard(t, layout=layout) for t in (out, *grads)]
    for name, r, s, g in zip(("out", "dq", "dk", "dv"), ref, single, ring):
        bound = 1.2 if grad_accum is None or name == "out" else 1.3 * world**0.5
        assert _rel_rms(g, r) <= bound * _rel_rms(s, r) + 1e-6, name


def _nccl_run(worker, *args, world=None):
    """worker(rank, world, *args) in one process per GPU, over NCCL: on `world` GPUs, default
    the largest power of two up to 8 that the machine has (the workers' 8192 and 16384 tokens
    divide into 2 x world zigzag chunks then, on 3, 5, 6 or 7 GPUs too)."""
    count = torch.cuda.device_count()
    world = world or min(8, 1 << (count.bit_length() - 1))
    if world > count:
        pytest.skip(f"needs {world} GPUs, {count} visible")
    run_world(worker, world, *args, backend="nccl")


NEEDS_2_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL ring needs 2 or more GPUs")


@NEEDS_2_GPUS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_nccl_ring_matches_single_gpu(dtype, layout, causal):
    _nccl_run(_nccl_worker, layout, causal, dtype)


@NEEDS_2_GPUS
@pytest.mark.parametrize("heads,chunks", [((6, 3), 2), ((8, 4), 4), ((8, 4), 1)])
def test_nccl_ring_with_chunked_grads(heads, chunks):
    _nccl_run(_nccl_worker, "zigzag", True, torch.bfloat16, heads, chunks)


@NEEDS_2_GPUS
def test_nccl_ring_with_16bit_grad_accumulators():
    _nccl_run(_nccl_worker, "zigzag", True, torch.bfloat16, (8, 2), None, torch.bfloat16)


@NEEDS_2_GPUS
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_nccl_ring_with_window(layout):
    """A causal window of 1024 over 8192 tokens on 2 GPUs (narrower than a chunk: 2048 zigzag,
    4096 contiguous), over NCCL."""
    _nccl_run(_nccl_worker, layout, True, torch.bfloat16, (8, 2), None, None, (1023, 0), world=2)


def _nccl_deterministic_worker(rank, world, chunks):
    q, k, v, do = _inputs(1, 16384, 8, 2, 128, torch.bfloat16, seed=3)
    ql, kl, vl = (shard(t).clone().requires_grad_() for t in (q, k, v))
    runs = []
    for _ in range(2):
        out = ring_flash_attn_func(ql, kl, vl, causal=True, grad_chunks=chunks, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, (ql, kl, vl), shard(do))))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), (name, rank)


@NEEDS_2_GPUS
@pytest.mark.parametrize("chunks", [1, 2])
def test_nccl_ring_is_bitwise_deterministic(chunks):
    """The same inputs twice over NCCL with deterministic=True: bitwise equal forward and
    backward on every rank."""
    _nccl_run(_nccl_deterministic_worker, chunks)


def test_replayed_ring_is_bitwise_deterministic():
    q, k, v, do = _inputs(1, 8192, 8, 2, 128, torch.bfloat16, seed=3)
    a = replay_ring(q, k, v, do, world=4, causal=True, deterministic=True)
    b = replay_ring(q, k, v, do, world=4, causal=True, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (False, "contiguous")])
@pytest.mark.parametrize("chunks,accum", [(None, None), (2, None), (1, torch.bfloat16)])
def test_replayed_ring_fused_backward(causal, layout, chunks, accum, monkeypatch):
    """With the fused kernel (forced at this size) each step's dense / causal D=128 blocks
    compute dQ with dK/dV in one call, per kv-head chunk as the accumulators arrive: gradients within 1.2x of one GPU's
    error against float64 (1.3 sqrt(P) with 16-bit accumulators, as the two-pass ring's), and
    within the same bound of the deterministic ring's. With float32 accumulators every call adds
    to its ring call's one blocked dQ, un-permuted once per rank's call (not once per launch)."""

    calls = spy_fused_backward(monkeypatch)
    unblocks = spy_dq_unblocks(monkeypatch)
    q, k, v, do = _inputs(1, 4096, 8, 4, 128, torch.bfloat16, seed=7)
    ref = _reference(q, k, v, do, causal)
    single = _single_gpu(q, k, v, do, causal)
    kw = dict(world=4, causal=causal, layout=layout, grad_chunks=chunks, grad_accum_dtype=accum)
    force_fused_backward(monkeypatch)  # at this small size
    calls.clear()
    unblocks.clear()
    ring = replay_ring(q, k, v, do, **kw)
    assert calls, "the fused backward was not used"
    if accum is None:
        assert set(calls) == {"blocked"} and len(unblocks) == 4, (calls, len(unblocks))
    else:  # a 16-bit accumulator: a float32 scratch per launch, finished per launch
        assert set(calls) == {"tensor"} and len(unblocks) == len(calls), (calls, len(unblocks))
    calls.clear()
    unblocks.clear()
    two_pass = replay_ring(q, k, v, do, deterministic=True, **kw)
    assert not calls and not unblocks
    factor = 1.2 if accum is None else 1.3 * 4**0.5
    for name, r, s, g, t in zip(("out", "dq", "dk", "dv"), ref, single, ring, two_pass):
        e_single = _rel_rms(s, r)
        assert _rel_rms(g, r) <= factor * e_single + 1e-6, name
        assert _rel_rms(t, r) <= factor * e_single + 1e-6, name


@pytest.mark.parametrize("make_layout", [balanced_layout, document_zigzag_layout], ids=["balanced", "document_zigzag"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (511, 0))])
def test_replayed_packed_ring_matches_single_gpu(world, causal, window_size, make_layout):
    """Packed documents over a balanced layout, or every document cut over every rank (one
    kernel call per step over per-row key intervals): within 1.2x of one GPU's
    flash_attn_varlen_func error against float64; the K/V copies on a side stream (as a
    network transfer runs) change nothing, bit for bit."""
    lengths = [3000, 1, 700, 64, 2200, 130, 1, 900, 1197]  # 8193 tokens: shards of unequal length
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, int(cu[-1]), 4, 2, 128, torch.bfloat16, seed=world))
    kw = dict(causal=causal, window_size=window_size)
    ref, single = _packed_reference_and_single_gpu(q, k, v, do, cu, **kw)
    L = make_layout(cu, world, **kw)
    assert L.hops > 1 or window_size != (-1, -1)  # documents cross ranks: blocks travel
    kw = dict(world=world, layout=L, deterministic=True, **kw)  # bitwise comparison below
    ring = replay_ring(q[None], k[None], v[None], do[None], **kw)
    overlapped = replay_ring(q[None], k[None], v[None], do[None], overlap=True, **kw)
    assert all(torch.equal(g, o) for g, o in zip(ring, overlapped))
    _within_single_gpu(ref, single, [g[0] for g in ring])


def test_replayed_windowed_packed_ring_gluon_on_neighbour_blocks(monkeypatch):
    """configs.GLUON_DOCUMENTS_SEEING_ROWS: a windowed ring's neighbour blocks, whose rows mostly
    see none of its keys, take the Gluon forward by the keys of the rows that see some (here
    1.7K-2K, over the threshold; 0.7K-1K over every row, under it), its tiles of empty rows folding
    nothing into the state: within 1.2x of one GPU's flash_attn_varlen_func error against
    float64, and such a block did run on the Gluon kernel."""
    from ringflash.kernels import configs, gluon_forward

    monkeypatch.setattr(configs, "GLUON_DOCUMENTS_SEEING_ROWS", True)
    ran = []
    real = gluon_forward.forward

    def spy(*a, bounds=None, **kw):
        if bounds is not None:
            ran.append((bounds.keys_per_row, bounds.keys_per_seeing_row))
        return real(*a, bounds=bounds, **kw)

    monkeypatch.setattr(gluon_forward, "forward", spy)
    lengths = [9000, 300, 3000, 4084]  # 16384 tokens: the long document crosses the shards
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, int(cu[-1]), 4, 2, 128, torch.bfloat16, seed=31))
    kw = dict(causal=True, window_size=(4095, 0))
    ref, single = _packed_reference_and_single_gpu(q, k, v, do, cu, **kw)
    ran.clear()
    L = balanced_layout(cu, 2, **kw)
    ring = replay_ring(q[None], k[None], v[None], do[None], world=2, layout=L, **kw)
    least = configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW[128]
    assert any(mean < least <= seeing for mean, seeing in ran), ran  # a neighbour block on Gluon
    _within_single_gpu(ref, single, [g[0] for g in ring])


@pytest.mark.parametrize(
    "lengths,world,window_size",
    [([9000, 300, 3000, 4084], 2, (4095, 0)), ([3000, 1, 700, 64, 2200, 130, 1, 900, 1197], 4, (511, 0))],
)
def test_replayed_windowed_packed_ring_cropped_steps(lengths, world, window_size, monkeypatch):
    """balance.CROP_STEP_CALLS: a windowed ring's steps after the first run their per-row-bounds
    calls over the rows and keys that see each other only (whole 128-row blocks: the fused
    backward's blocked dQ, rebased bounds), with the kernels the package picks for them: within
    1.2x of one GPU's flash_attn_varlen_func error against float64, and some step's call was
    cropped."""
    from ringflash import balance

    monkeypatch.setattr(balance, "CROP_STEP_CALLS", True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, int(cu[-1]), 8, 4, 128, torch.bfloat16, seed=world + 40))
    kw = dict(causal=True, window_size=window_size)
    ref, single = _packed_reference_and_single_gpu(q, k, v, do, cu, **kw)
    L = balanced_layout(cu, world, **kw)
    ring = replay_ring(q[None], k[None], v[None], do[None], world=world, layout=L, **kw)
    boxes = [(r, p.box) for r, p, in ((r, L.step_plan(r, s, L.window, L.max_local_len, "cuda", 8 * 128))
             for r in range(world) for s in range(1, world)) if p.box is not None]  # fmt: skip
    assert any(b.q_rows != slice(0, L.local_len(r)) for r, b in boxes), boxes
    _within_single_gpu(ref, single, [g[0] for g in ring])


def _replayed_packed_ring_vs_single_gpu(world, chunks, causal, window_size, seed):
    """The packed ring over a balanced layout of a mix with documents longer than a shard,
    replayed (bf16, 8 / 4 heads, D=128): within 1.2x of one GPU's flash_attn_varlen_func error
    against float64, forward and gradients. Returns the layout."""
    lengths = [3000, 1, 700, 64, 2200, 130, 1, 900, 1197]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, int(cu[-1]), 8, 4, 128, torch.bfloat16, seed=seed))
    kw = dict(causal=causal, window_size=window_size)
    ref, single = _packed_reference_and_single_gpu(q, k, v, do, cu, **kw)
    L = balanced_layout(cu, world, **kw)
    ring = replay_ring(q[None], k[None], v[None], do[None], world=world, layout=L, grad_chunks=chunks, **kw)
    _within_single_gpu(ref, single, [g[0] for g in ring])
    return L


@pytest.mark.parametrize(
    "world,chunks,causal,window_size",
    # the window: over 2 ranks this mix keeps every document whole (one step), so 4 and 8
    [(2, None, True, (-1, -1)), (4, 2, True, (-1, -1)), (4, None, True, (511, 0)), (8, 2, True, (511, 0))],
)
def test_replayed_packed_ring_gathered(world, chunks, causal, window_size, monkeypatch):
    """balance.GATHER_MAX_STEPS at the world size: each rank's attention in one call over every
    block its steps hold, gathered in global order (the kernels the package picks for a one-
    device call of those bounds, the fused backward among them), dK / dV rows sent home on the
    relay: within 1.2x of one GPU's flash_attn_varlen_func error against float64, and the
    blocks did travel."""
    from ringflash import balance

    monkeypatch.setattr(balance, "GATHER_MAX_STEPS", world)
    L = _replayed_packed_ring_vs_single_gpu(world, chunks, causal, window_size, world + 50)
    assert 1 < L.hops <= world, L


@pytest.mark.parametrize("world,size", [(4, 3), (8, 4)])
def test_replayed_packed_ring_forward_groups(world, size, monkeypatch):
    """balance.FORWARD_GROUP_STEPS: the forward's steps after the first in calls over runs of
    `size` blocks gathered in global order, folding into the float32 state (the per-row-bounds
    kernels the package picks for those bounds): within 1.2x of one GPU's error against
    float64, and blocks were gathered."""
    from ringflash import balance
    from ringflash import ring as ring_module

    gathered = []
    gather_block = ring_module._gather_block
    monkeypatch.setattr(balance, "FORWARD_GROUP_STEPS", size)
    monkeypatch.setattr(ring_module, "_gather_block", lambda *a: gathered.append(1) or gather_block(*a))
    L = _replayed_packed_ring_vs_single_gpu(world, None, True, (-1, -1), world + 60)
    assert L.hops > size and gathered, L


@pytest.mark.parametrize("world,chunks", [(2, None), (4, 2)])
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (True, (511, 0))])
def test_replayed_packed_ring_fused_backward(world, chunks, causal, window_size, monkeypatch):
    """Packed documents over a balanced layout with the fused kernel (forced at this size): each
    step's per-row-bounds blocks compute dQ with dK/dV per kv-head chunk (a layout of one step,
    every document whole: one local call, dQ written once); gradients within 1.2x of one GPU's
    two-pass error against float64, and the kernel was used."""
    calls = spy_fused_backward(monkeypatch)
    lengths = [3000, 1, 700, 64, 2200, 130, 1, 900, 1197]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, do = (t[0] for t in _inputs(1, int(cu[-1]), 8, 4, 128, torch.bfloat16, seed=world + 20))
    kw = dict(causal=causal, window_size=window_size)
    ref, single = _packed_reference_and_single_gpu(q, k, v, do, cu, deterministic=True, **kw)
    force_fused_backward(monkeypatch)
    L = balanced_layout(cu, world, **kw)
    ring = replay_ring(q[None], k[None], v[None], do[None], world=world, layout=L, grad_chunks=chunks, **kw)
    assert calls, "the fused backward was not used"
    # the per-step call over every row adds to the ring call's blocked dQ; the local call's
    # one launch per rank writes its own
    assert calls == ["tensor"] * world if L.hops == 1 else "blocked" in calls, (L.hops, calls)
    _within_single_gpu(ref, single, [g[0] for g in ring])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_replayed_ring_at_large_scores(dtype, layout):
    """|scores| ~ 1e3-1e4: the ring's folded (m, l) state and its backward from the final
    statistics stay within 1.2x of one GPU's error against float64."""
    q, k, v, do = _inputs(1, 4096, 4, 2, 128, dtype, seed=9)
    q, k = q * 8, k * 8
    ref = _reference(q, k, v, do, True)
    single = _single_gpu(q, k, v, do, True)
    ring = replay_ring(q, k, v, do, world=4, causal=True, layout=layout)
    for name, r, s, g in zip(("out", "dq", "dk", "dv"), ref, single, ring):
        assert torch.isfinite(g).all(), name
        assert rel_rms(g, r) <= 1.2 * rel_rms(s, r) + 1e-6, f"{name}: ring {rel_rms(g, r):.3e} vs {rel_rms(s, r):.3e}"
