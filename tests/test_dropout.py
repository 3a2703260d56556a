"""Attention dropout: the keep mask is a pure function of (seed, batch, head, global query index,
global key index) (ringflash.dropout), bit for bit Triton's Philox; the kernels (and the torch
backend) drop exactly the reference's pairs and their backward uses the forward's mask;
flash_attn_func, flash_attn_varlen_func, the ring functions and RingMultiheadAttention in
training drop the same pairs on one device and on 2 or 3 ranks in both layouts."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflash
from ringflash import shard, unshard
from ringflash.dropout import draw_seed, keep_mask, philox4x32, threshold
from ringflash.nn import RingMultiheadAttention

from oracle import assert_float64_agree, assert_within, dropout_factors, plain_errors, reference
from ring_cases import TORCH

E, H, B = 8, 2, 2


def test_philox_is_tritons():
    """The plain-torch Philox equals tl.philox (run by Triton's interpreter on CPU), so a kernel
    that draws with tl.philox(seed, key index, query index, head, batch) keeps the same pairs."""
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out_ptr, seed, c1, c2, c3, N: tl.constexpr):
        offs = tl.arange(0, N)
        z = offs * 0
        c0 = offs.to(tl.uint32) * 977 + 12345
        r0, r1, r2, r3 = tl.philox(seed, c0, (z + c1).to(tl.uint32), (z + c2).to(tl.uint32), (z + c3).to(tl.uint32))
        tl.store(out_ptr + offs, r0.to(tl.int64))
        tl.store(out_ptr + N + offs, r3.to(tl.int64))

    for seed in (0, 123456789012345, 2**63 - 5):
        for c in ((0, 0, 0), (7, 3, 2), (2**31 + 5, 65535, 4000000000)):
            out = torch.empty(2 * 64, dtype=torch.int64)
            draw[(1,)](out, seed, *c, N=64)
            r = philox4x32(torch.arange(64, dtype=torch.int64) * 977 + 12345, *c, seed)
            assert torch.equal(out[:64] & 0xFFFFFFFF, r[0]) and torch.equal(out[64:] & 0xFFFFFFFF, r[3])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_independence(p):
    idx = torch.arange
    keep = keep_mask(2024, p, idx(2), idx(3), idx(200), idx(300))
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * sigma
    # heads, batches, rows and neighbouring keys are not copies of one another
    for a, b in ((keep[0, 0], keep[0, 1]), (keep[0, 0], keep[1, 0]), (keep[0, 0, :-1], keep[0, 0, 1:])):
        agree = (a == b).float().mean().item()
        assert abs(agree - (p * p + (1 - p) ** 2)) < 5 * math.sqrt(0.25 / a.numel())
    assert threshold(0.0) == 0 and bool(keep_mask(1, 0.0, idx(1), idx(1), idx(5), idx(5)).all())
    assert not keep_mask(1, 1.0, idx(1), idx(1), idx(5), idx(5)).any()


def _reference(ring, x, seed, p, q_idx=None, causal=False):
    """torch ops on the full sequence (float64): softmax, then the same keep mask / (1 - p)."""
    Bx, L, _ = x.shape
    w_q, w_k, w_v = ring.in_proj_weight.split(E)
    b_q, b_k, b_v = ring.in_proj_bias.split(E)
    heads = lambda t: t.view(Bx, L, H, E // H).transpose(1, 2)  # noqa: E731
    q, k, v = heads(F.linear(x, w_q, b_q)), heads(F.linear(x, w_k, b_k)), heads(F.linear(x, w_v, b_v))
    s = q @ k.transpose(-1, -2) / math.sqrt(E // H)
    if causal:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    idx = torch.arange
    keep = keep_mask(seed, p, idx(Bx), idx(H), idx(L), idx(L))
    w = torch.softmax(s, -1) * keep / (1 - p)
    o = (w @ v).transpose(1, 2).reshape(Bx, L, E)
    return F.linear(o, ring.out_proj.weight, ring.out_proj.bias), w


def _module(p, seed=0):
    torch.manual_seed(seed)
    return RingMultiheadAttention(E, H, dropout=p, batch_first=True, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_module_dropout_matches_reference_with_the_same_mask(causal):
    """Outputs, weights (dropped, as torch returns them) and every gradient are those of plain
    torch with the same keep mask: the backward uses the forward's mask."""
    p = 0.3
    ring = _module(p)
    x = torch.randn(B, 12, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(42)
    seed = draw_seed()
    torch.manual_seed(42)
    out, w = ring(x, x, x, is_causal=causal, average_attn_weights=False)
    ref, w_ref = _reference(ring, x, seed, p, causal=causal)
    n = x.shape[0] * x.shape[1]  # the longest sum: a parameter gradient's, over the B x L rows
    assert_float64_agree("out", out, ref, n)
    assert_float64_agree("weights", w, w_ref, n)
    params = [x, *ring.parameters()]
    got = torch.autograd.grad((out.square().sum() + w.square().sum()), params)
    want = torch.autograd.grad((ref.square().sum() + w_ref.square().sum()), params)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_float64_agree(f"grad {i}", a, b, n)
    # torch.manual_seed reproduces; another draw drops other pairs; eval mode drops nothing
    torch.manual_seed(42)
    assert torch.equal(ring(x, x, x, is_causal=causal)[0], out)
    assert not torch.equal(ring(x, x, x, is_causal=causal)[0], out)
    # need_weights=False: dropout in the kernels, the same pairs as the dense path's
    torch.manual_seed(42)
    fast, none = ring(x, x, x, is_causal=causal, need_weights=False)
    ref, _ = _reference(ring, x, seed, p, causal=causal)
    assert none is None
    assert_float64_agree("need_weights=False out", fast, ref, n)
    fast_grads = torch.autograd.grad(fast.square().sum(), params)
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    for i, (a, b) in enumerate(zip(fast_grads, ref_grads)):
        assert_float64_agree(f"need_weights=False grad {i}", a, b, n)
    ring.eval()
    full, w_eval = ring(x, x, x, is_causal=causal, average_attn_weights=False)
    assert bool((w_eval > 0).any())
    assert_float64_agree("eval weights' row sums", w_eval.sum(-1), torch.ones_like(w_eval[..., 0]), w_eval.shape[-1])


def _world(rank, world, layout, causal):
    p = 0.4
    ring, ref_module = _module(p), _module(p)  # the same parameters
    ring.layout = layout
    L = 4 * world
    g = torch.Generator().manual_seed(3)
    x, w_out = (torch.randn(B, L, E, dtype=torch.float64, generator=g) for _ in range(2))
    torch.manual_seed(11)  # the same on every rank; rank 0's draw is used by all
    seed = draw_seed()
    xr = x.clone().requires_grad_()
    ref, w_ref = _reference(ref_module, xr, seed, p, causal=causal)
    torch.manual_seed(11)
    sh = lambda t, d=1: shard(t, dim=d, layout=layout)  # noqa: E731
    xl = sh(x).clone().requires_grad_()
    out, w = ring(xl, xl, xl, is_causal=causal, average_attn_weights=False)
    assert torch.equal(w != 0, sh(w_ref, 2) != 0)  # the kept set is identical
    n = B * L  # the longest sum: a parameter gradient's, over the B x L rows
    assert_float64_agree("out", out, sh(ref), n)
    assert_float64_agree("weights", w, sh(w_ref, 2), n)
    assert_float64_agree("unshard(out)", unshard(out, layout=layout), ref, n)
    torch.manual_seed(11)  # need_weights=False: the kernels drop the same pairs
    fast = ring(xl, xl, xl, is_causal=causal, need_weights=False)[0]
    assert_float64_agree("need_weights=False out", fast, sh(ref), n)
    ((ref * w_out).sum() + w_ref.square().sum()).backward()
    ((out * sh(w_out)).sum() + w.square().sum()).backward()  # each rank: the loss of its rows
    assert_float64_agree("x.grad", xl.grad, sh(xr.grad), n)
    for (name, a), b in zip(ring.named_parameters(), ref_module.parameters()):
        grad = a.grad.clone()
        dist.all_reduce(grad)
        assert_float64_agree(name, grad, b.grad, n)


@pytest.mark.parametrize(
    "world,layout,causal",
    [(2, "zigzag", True), (2, "contiguous", False), (3, "zigzag", False), (3, "contiguous", True)],
)
def test_dropout_same_at_any_world_and_layout(worlds, world, layout, causal):
    """The same seed drops the same pairs at world 2 and 3, zigzag or contiguous, as the
    one-device reference: outputs, weights and gradients agree to float64 rounding."""
    worlds(world, **TORCH).run(_world, layout, causal)


# ----------------------------------------------------------------------------- in the kernels


def _inputs(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _drawn_next(seed):
    """The seed the next call draws after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    drawn = draw_seed()
    torch.manual_seed(seed)
    return drawn


def _check_against_reference(got, q, k, v, do, **kw):
    """got = (out, dq, dk, dv) within 2x the plain same-dtype error of the float64 reference."""
    ref = reference(q, k, v, do, **kw)
    plain = plain_errors(q, k, v, do, ref, **kw)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref[:1] + ref[2:]):
        assert_within(name, x, r, plain[name])


CASES = [  # (causal, window_size, dtype); no bfloat16: Triton's interpreter gets its tl.dot wrong
    (False, (-1, -1), torch.float32),
    (True, (-1, -1), torch.float32),
    (False, (9, 4), torch.float16),
]


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("causal,window,dtype", CASES, ids=["full-f32", "causal-f32", "window-f16"])
def test_flash_attn_dropout_matches_reference_with_the_same_mask(backend, causal, window, dtype):
    """flash_attn_func(dropout_p=) in the kernels: output and gradients are those of the
    float64 reference with the keep mask of (seed, batch, head, query row, key column),
    the seed being the next draw of torch's CPU generator (Sq != Sk: indices, not aligned
    positions; GQA; a head dim that is padded inside)."""
    B, Sq, Sk, Hq, Hkv, D, p = 2, 24, 40, 4, 2, 24, 0.3
    q, k, v, do = _inputs([(B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, Hq, D)], dtype)
    seed = _drawn_next(5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ringflash.flash_attn_func(*leaves, causal=causal, window_size=window, dropout_p=p, return_lse=True)
    grads = torch.autograd.grad(out, leaves, do)
    drop = dropout_factors(seed, p, B, Hq, Sq, Sk)
    _check_against_reference((out, *grads), q, k, v, do, causal=causal, window_size=window, drop=drop)
    # lse is that of the undropped weights; the same generator state drops the same pairs (the
    # seeds are drawn outside the kernels: once is enough)
    assert torch.equal(lse, ringflash.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)[1])
    if backend == "torch":
        torch.manual_seed(5)
        again = ringflash.flash_attn_func(q, k, v, causal=causal, window_size=window, dropout_p=p)
        assert torch.equal(again, out)
        assert not torch.equal(ringflash.flash_attn_func(q, k, v, causal=causal, window_size=window, dropout_p=p), out)


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_varlen_dropout_indices_are_packed_rows(backend):
    """flash_attn_varlen_func(dropout_p=): the mask of (seed, 0, head, packed query row, packed
    key row), documents of several lengths, each against its float64 reference."""
    cu, Hq, Hkv, D, p = [0, 7, 30, 31, 50], 2, 1, 16, 0.25
    total = cu[-1]
    q, k, v, do = _inputs([(total, Hq, D), (total, Hkv, D), (total, Hkv, D), (total, Hq, D)], torch.float32, 3)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    seed = _drawn_next(9)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ringflash.flash_attn_varlen_func(*leaves, cu_t, cu_t, causal=True, dropout_p=p)
    grads = torch.autograd.grad(out, leaves, do)
    drop = dropout_factors(seed, p, 1, Hq, total, total)
    for a, b in zip(cu, cu[1:]):
        got = (out[None, a:b], grads[0][None, a:b], grads[1][None, a:b], grads[2][None, a:b])
        docs = [t[None, a:b] for t in (q, k, v, do)]
        _check_against_reference(got, *docs, causal=True, drop=drop[:, :, a:b, a:b])


def test_dropout_p_errors_and_extremes():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    for bad in (-0.1, 1.5, "0.1", True, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            ringflash.flash_attn_func(q, q, q, dropout_p=bad)
    # p = 0 is no dropout; p = 1 drops every weight (output and its gradients 0, lse kept)
    assert torch.equal(ringflash.flash_attn_func(q, q, q, dropout_p=0.0), ringflash.flash_attn_func(q, q, q))
    out, lse = ringflash.flash_attn_func(q, q, q, dropout_p=1.0, return_lse=True)
    assert not out.any() and torch.equal(lse, ringflash.flash_attn_func(q, q, q, return_lse=True)[1])
    out.sum().backward()
    assert not q.grad.any()
    # a CPU generator of the caller's: its state alone decides the pairs
    g = torch.Generator().manual_seed(4)
    first = ringflash.flash_attn_func(q, q, q, dropout_p=0.5, generator=g)
    torch.manual_seed(123)  # the default generator plays no part
    assert torch.equal(ringflash.flash_attn_func(q, q, q, dropout_p=0.5, generator=g.manual_seed(4)), first)
    for bad in ("seed", 4):
        with pytest.raises(ValueError, match="generator must be None or a CPU torch.Generator"):
            ringflash.flash_attn_func(q, q, q, dropout_p=0.5, generator=bad)


def _ring_world(rank, world, layout, causal, grad_chunks):
    """ring_flash_attn_func(dropout_p=) on this world drops exactly the pairs one device drops
    (every rank takes the first rank's seed: the others' generators differ here)."""
    B, S, Hq, Hkv, D, p = 1, 12 * world, 4, 2, 8, 0.4
    q, k, v, do = _inputs([(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)], torch.float64, 1)
    seed = draw_seed(torch.Generator().manual_seed(21))
    mine = torch.Generator().manual_seed(21 + rank)  # only the first rank's draw counts
    sh = lambda t: shard(t, dim=1, layout=layout)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    out = ringflash.ring_flash_attn_func(
        *leaves, causal=causal, layout=layout, dropout_p=p, grad_chunks=grad_chunks, generator=mine
    )
    grads = torch.autograd.grad(out, leaves, sh(do))
    full = [unshard(t, dim=1, layout=layout) for t in (out, *grads)]
    _check_against_reference(full, q, k, v, do, causal=causal, drop=dropout_factors(seed, p, B, Hq, S, S))


@pytest.mark.parametrize("world,layout,causal,grad_chunks", [(2, "zigzag", True, 2), (3, "contiguous", False, None)])
def test_ring_dropout_same_pairs_at_any_world(worlds, world, layout, causal, grad_chunks):
    """The ring functions' dropout: outputs and gradients equal the one-device float64
    reference with the same keep mask, at world 2 and 3, either layout, dK/dV in head chunks."""
    worlds(world, **TORCH).run(_ring_world, layout, causal, grad_chunks)


def _ring_varlen_world(rank, world):
    cu, Hq, D, p = [0, 5, 29, 40, 52], 2, 8, 0.3
    total = cu[-1]
    q, k, v, do = _inputs([(total, Hq, D)] * 4, torch.float64, 2)
    seed = _drawn_next(33)
    layout = ringflash.balanced_layout(cu, world, causal=True)
    sh = lambda t: shard(t, dim=0, layout=layout)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    out = ringflash.ring_flash_attn_varlen_func(*leaves, cu, layout=layout, causal=True, dropout_p=p)
    grads = torch.autograd.grad(out, leaves, sh(do))
    drop = dropout_factors(seed, p, 1, Hq, total, total)
    full = [unshard(t, dim=0, layout=layout) for t in (out, *grads)]
    for a, b in zip(cu, cu[1:]):
        doc = [t[None, a:b] for t in (q, k, v, do)]
        _check_against_reference([g[None, a:b] for g in full], *doc, causal=True, drop=drop[:, :, a:b, a:b])


def test_ring_varlen_dropout_same_pairs_as_one_device(worlds):
    """ring_flash_attn_varlen_func(dropout_p=) on 2 ranks of a balanced layout: the pairs of
    packed rows one device drops, against the float64 reference document by document."""
    worlds(2, **TORCH).run(_ring_varlen_world)
