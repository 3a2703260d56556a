"""Attention dropout: the keep mask is a pure function of (seed, batch, head, global query index,
global key index) (ringflash.dropout), bit for bit Triton's Philox; RingMultiheadAttention in
training drops the same pairs on one device and on 2 or 3 ranks in both layouts, and its
gradients use the forward's mask."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringflash import shard, unshard
from ringflash.dropout import draw_seed, keep_mask, philox4x32, threshold
from ringflash.nn import RingMultiheadAttention

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
    seed = draw_seed("cpu")
    torch.manual_seed(42)
    out, w = ring(x, x, x, is_causal=causal, average_attn_weights=False)
    ref, w_ref = _reference(ring, x, seed, p, causal=causal)
    assert (out - ref).abs().max() < 1e-12 and (w - w_ref).abs().max() < 1e-12
    params = [x, *ring.parameters()]
    got = torch.autograd.grad((out.square().sum() + w.square().sum()), params)
    want = torch.autograd.grad((ref.square().sum() + w_ref.square().sum()), params)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-11
    # torch.manual_seed reproduces; another draw drops other pairs; eval mode drops nothing
    torch.manual_seed(42)
    assert torch.equal(ring(x, x, x, is_causal=causal)[0], out)
    assert not torch.equal(ring(x, x, x, is_causal=causal)[0], out)
    ring.eval()
    full, w_eval = ring(x, x, x, is_causal=causal, average_attn_weights=False)
    assert bool((w_eval > 0).any()) and (w_eval.sum(-1) - 1).abs().max() < 1e-12


def _world(rank, world, layout, causal):
    p = 0.4
    ring, ref_module = _module(p), _module(p)  # the same parameters
    ring.layout = layout
    L = 4 * world
    g = torch.Generator().manual_seed(3)
    x, w_out = (torch.randn(B, L, E, dtype=torch.float64, generator=g) for _ in range(2))
    torch.manual_seed(11)  # the same on every rank; rank 0's draw is used by all
    seed = draw_seed("cpu")
    xr = x.clone().requires_grad_()
    ref, w_ref = _reference(ref_module, xr, seed, p, causal=causal)
    torch.manual_seed(11)
    sh = lambda t, d=1: shard(t, dim=d, layout=layout)  # noqa: E731
    xl = sh(x).clone().requires_grad_()
    out, w = ring(xl, xl, xl, is_causal=causal, average_attn_weights=False)
    assert torch.equal(w != 0, sh(w_ref, 2) != 0)  # the kept set is identical
    assert (out - sh(ref)).abs().max() < 1e-12 and (w - sh(w_ref, 2)).abs().max() < 1e-12
    assert (unshard(out, layout=layout) - ref).abs().max() < 1e-12
    ((ref * w_out).sum() + w_ref.square().sum()).backward()
    ((out * sh(w_out)).sum() + w.square().sum()).backward()  # each rank: the loss of its rows
    assert (xl.grad - sh(xr.grad)).abs().max() < 1e-11
    for (name, a), b in zip(ring.named_parameters(), ref_module.parameters()):
        grad = a.grad.clone()
        dist.all_reduce(grad)
        assert (grad - b.grad).abs().max() < 1e-11, name


@pytest.mark.parametrize(
    "world,layout,causal",
    [(2, "zigzag", True), (2, "contiguous", False), (3, "zigzag", False), (3, "contiguous", True)],
)
def test_dropout_same_at_any_world_and_layout(worlds, world, layout, causal):
    """The same seed drops the same pairs at world 2 and 3, zigzag or contiguous, as the
    one-device reference: outputs, weights and gradients agree to float64 rounding."""
    worlds(world, **TORCH).run(_world, layout, causal)
