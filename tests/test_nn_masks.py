"""RingMultiheadAttention with torch's attn_mask (bool or float, (L, S) or (N * num_heads, L, S),
with key_padding_mask), and its attention weights, against torch.nn.MultiheadAttention: on one
device, and at world 2 and 3 (gloo) with each rank passing its query rows over all keys."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringflash import shard, unshard
from ringflash.nn import RingMultiheadAttention

from oracle import assert_float64_agree
from ring_cases import TORCH

E, H, B = 6, 3, 2
# ring and torch's module in float64 against each other (no higher precision to measure either
# against): float64's ulps over the longest sum, a parameter gradient's over the B x S key rows


def _modules(seed, kdim=None, vdim=None, **kw):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, dtype=torch.float64, **kw)
    ring = RingMultiheadAttention(E, H, kdim=kdim, vdim=vdim, dtype=torch.float64, **kw)
    ring.load_state_dict(mha.state_dict())
    return mha, ring


def _inputs(L, S, kind, seed, kdim=None, vdim=None):
    """query (L, B, E), key, value (S, B, *), key padding (B, S) and an attn_mask of `kind`:
    "bool2d", "float2d", "bool3d", "float3d". No query row is fully masked (torch gives NaN
    there, ringflash 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, B, E, generator=g, dtype=torch.float64)
    k = torch.randn(S, B, kdim or E, generator=g, dtype=torch.float64)
    v = torch.randn(S, B, vdim or E, generator=g, dtype=torch.float64)
    pad = torch.rand(B, S, generator=g) < 0.25
    pad[:, 0] = False
    shape = (L, S) if kind.endswith("2d") else (B * H, L, S)
    if kind.startswith("bool"):
        mask = torch.rand(shape, generator=g) < 0.4
        mask[..., 0] = False
    else:
        mask = torch.randn(shape, generator=g, dtype=torch.float64)
        mask[torch.rand(shape, generator=g) < 0.3] = float("-inf")
        mask[..., 0] = 0.0
    return q, k, v, pad, mask


KINDS = ["bool2d", "float2d", "bool3d", "float3d"]


def _run(m, q, k, v, pad, mask, average):
    out, w = m(q, k, v, key_padding_mask=pad, attn_mask=mask, average_attn_weights=average)
    return out, w


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_attn_mask_matches_torch(kind, cross):
    kv = (3, 5) if cross else (None, None)
    mha, ring = _modules(0, *kv)
    q, k, v, pad, mask = _inputs(7, 9 if cross else 7, kind, seed=1, kdim=kv[0], vdim=kv[1])
    if not cross:
        k = v = q
    results = []
    for m in (mha, ring):
        x = q.clone().requires_grad_()
        xk = x if not cross else k
        xv = x if not cross else v
        out, w = _run(m, x, xk, xv, pad, mask, average=False)
        loss = (out * torch.linspace(-1, 1, E, dtype=out.dtype)).sum() + w.square().sum()
        grads = torch.autograd.grad(loss, [x, *m.parameters()])
        results.append((out, w, *grads))
    for i, (a, b) in enumerate(zip(*results)):
        assert a.shape == b.shape
        assert_float64_agree(f"result {i}", a, b, B * len(k))


def test_attn_mask_fully_masked_row_is_zero():
    mha, ring = _modules(0)
    q, _, _, _, _ = _inputs(5, 5, "bool2d", seed=2)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[2] = True  # query 2 may attend to nothing
    out, w = ring(q, q, q, attn_mask=mask)
    ref, w_ref = mha(q, q, q, attn_mask=mask)
    assert torch.isnan(ref[2]).all() and torch.isnan(w_ref[:, 2]).all()  # torch's
    assert not w[:, 2].any() and torch.equal(out[2], ring.out_proj.bias.expand(B, E))  # out_proj(0)
    rows = [0, 1, 3, 4]
    assert_float64_agree("out", out[rows], ref[rows], B * len(q))
    assert_float64_agree("weights", w[:, rows], w_ref[:, rows], B * len(q))


def test_attn_mask_bad_shapes():
    _, ring = _modules(0)
    q = torch.randn(5, B, E, dtype=torch.float64)
    for mask, pattern in (
        (torch.zeros(5, 4, dtype=torch.bool), r"attn_mask must have shape \(L, S\) = \(5, 5\)"),
        (torch.zeros(B, 5, 5, dtype=torch.bool), r"\(batch \* num_heads, L, S\) = \(6, 5, 5\)"),
        (torch.zeros(5, dtype=torch.bool), "expected `attn_mask` to be `None`, 2-D or 3-D"),  # torch's words
        (torch.zeros(5, 5, dtype=torch.int64), "attn_mask must be bool or floating point"),
    ):
        with pytest.raises((ValueError, TypeError), match=pattern):
            ring(q, q, q, attn_mask=mask)


def test_masks_that_require_grad_raise():
    """torch's module differentiates a float attn_mask / key_padding_mask; these are not, so one
    that requires grad raises naming it (no silent missing .grad); without grad mode it runs."""
    mha, ring = _modules(0)
    q, _, _, _, mask = _inputs(5, 5, "float2d", seed=2)
    pad = torch.randn(B, 5, dtype=torch.float64)
    for name, value in (("attn_mask", mask), ("key_padding_mask", pad)):
        for need_weights in (True, False):
            with pytest.raises(ValueError, match=f"{name} requires grad"):
                ring(q, q, q, need_weights=need_weights, **{name: value.clone().requires_grad_()})
            with torch.no_grad():
                got = ring(q, q, q, need_weights=need_weights, **{name: value.clone().requires_grad_()})[0]
                want = mha(q, q, q, need_weights=need_weights, **{name: value})[0]
            assert_float64_agree(f"{name}, need_weights={need_weights}", got, want, B * len(q))


def _world(rank, world, layout, kind, average, cross):
    kv = (3, 5) if cross else (None, None)
    mha, ring = _modules(3, *kv)
    ring.layout = layout
    L, S = 4 * world, (6 if cross else 4) * world
    q, k, v, pad, mask = _inputs(L, S, kind, seed=4, kdim=kv[0], vdim=kv[1])
    w_out = torch.randn(L, B, E, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sh = lambda t, d: shard(t, dim=d, layout=layout)
    ref, w_ref = _run(mha, q, k, v, pad, mask, average)
    # each rank: its query rows, every key column in global order
    mask_local = sh(mask, 0 if mask.dim() == 2 else 1)
    out, w = _run(ring, sh(q, 0), sh(k, 0), sh(v, 0), sh(pad, 1), mask_local, average)
    q_dim = 1 if average else 2
    n = B * S
    assert_float64_agree("out", out, sh(ref, 0), n)
    assert_float64_agree("weights", w, sh(w_ref, q_dim), n)
    assert_float64_agree("unshard(out)", unshard(out, dim=0, layout=layout), ref, n)
    assert_float64_agree("unshard(weights)", unshard(w.contiguous(), dim=q_dim, layout=layout), w_ref, n)
    # gradients of a loss on this rank's outputs and weights, summed over ranks = torch's
    (ref * w_out).sum().backward(retain_graph=True)
    w_ref.square().sum().backward()
    ((out * sh(w_out, 0)).sum() + w.square().sum()).backward()
    for (name, p_ref), p in zip(mha.named_parameters(), ring.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        assert_float64_agree(name, g, p_ref.grad, n)


@pytest.mark.parametrize(
    "world,layout,kind,average,cross",
    [
        (2, "zigzag", "bool2d", True, False),
        (2, "contiguous", "float3d", False, False),
        (2, "zigzag", "float2d", False, True),
        (3, "zigzag", "bool3d", True, True),
        (3, "contiguous", "bool2d", False, False),
    ],
)
def test_attn_mask_on_the_ring(worlds, world, layout, kind, average, cross):
    """attn_mask rows follow the queries (each rank passes its own), columns are all keys in
    global order; outputs, weights and gradients reassembled equal torch's on the whole."""
    worlds(world, **TORCH).run(_world, layout, kind, average, cross)


def _weights_grad(rank, world, layout, causal):
    mha, ring = _modules(6)
    ring.layout = layout
    L = 4 * world
    q, _, _, pad, _ = _inputs(L, L, "bool2d", seed=7)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64) if causal else None
    _, w_ref = mha(q, q, q, key_padding_mask=pad, attn_mask=mask, is_causal=causal, average_attn_weights=False)
    x = shard(q, dim=0, layout=layout)
    _, w = ring(x, x, x, key_padding_mask=shard(pad, dim=1, layout=layout), is_causal=causal,
                average_attn_weights=False)  # fmt: skip
    assert_float64_agree("weights", w, shard(w_ref, dim=2, layout=layout), B * L)
    w_ref.square().sum().backward()
    w.square().sum().backward()
    for (name, p_ref), p in zip(mha.named_parameters(), ring.parameters()):
        if p_ref.grad is None:  # the weights do not depend on v's or the output's parameters
            assert p.grad is None or not p.grad.any(), name
            continue
        g = p.grad.clone()
        dist.all_reduce(g)
        assert_float64_agree(name, g, p_ref.grad, B * L)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_weights_gradients_on_the_ring(worlds, layout, causal):
    """need_weights on the fast path (no attn_mask) is differentiable on the ring: gradients of
    a loss on each rank's weights, summed over the ranks, are torch's."""
    worlds(2, **TORCH).run(_weights_grad, layout, causal)


EXTRAS = {"bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True),
          "both": dict(add_bias_kv=True, add_zero_attn=True)}  # fmt: skip


def _extra_case(m, q, k, v, pad, mask, causal):
    out, w = m(q, k, v, key_padding_mask=pad, attn_mask=mask, is_causal=causal, average_attn_weights=False)
    return out, w


@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool2d", "float3d"])
def test_extra_keys_match_torch(extra, mask_kind):
    """add_bias_kv / add_zero_attn: the extra keys come after the sequence and every query sees
    them (torch pads both masks for them); outputs, weights and every gradient are torch's."""
    mha, ring = _modules(8, **EXTRAS[extra])
    q, _, _, pad, mask = _inputs(7, 7, mask_kind or "bool2d", seed=9)
    causal = mask_kind == "causal"
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64) if causal else mask
    mask = None if mask_kind is None else mask
    results = []
    for m in (mha, ring):
        x = q.clone().requires_grad_()
        out, w = _extra_case(m, x, x, x, pad, mask, causal)
        loss = (out * torch.linspace(-1, 1, E, dtype=out.dtype)).sum() + w.square().sum()
        results.append((out, w, *torch.autograd.grad(loss, [x, *m.parameters()])))
    for i, (a, b) in enumerate(zip(*results)):
        assert a.shape == b.shape
        assert_float64_agree(f"result {i}", a, b, B * (len(q) + 2))  # with the extra keys


def _extra_world(rank, world, layout, extra, mask_kind):
    mha, ring = _modules(10, **EXTRAS[extra])
    ring.layout = layout
    L = 4 * world
    q, _, _, pad, mask = _inputs(L, L, mask_kind or "bool2d", seed=11)
    causal = mask_kind == "causal"
    mask = None if mask_kind in (None, "causal") else mask
    sh = lambda t, d: shard(t, dim=d, layout=layout)
    causal_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    ref, w_ref = _extra_case(mha, q, q, q, pad, causal_mask if causal else mask, causal)
    x = sh(q, 0)
    m_local = None if mask is None else sh(mask, 0 if mask.dim() == 2 else 1)  # causal: is_causal alone
    out, w = _extra_case(ring, x, x, x, sh(pad, 1), m_local, causal)
    n = B * (L + 2)  # with the extra keys
    assert_float64_agree("out", out, sh(ref, 0), n)
    assert_float64_agree("weights", w, sh(w_ref, 2), n)  # (B, H, L_local, S + extra)
    ref.square().sum().backward(retain_graph=True)
    w_ref.square().sum().backward()
    (out.square().sum() + w.square().sum()).backward()
    for (name, p_ref), p in zip(mha.named_parameters(), ring.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # every rank holds the extra key; each one's gradient covers its queries
        assert_float64_agree(name, g, p_ref.grad, n)


@pytest.mark.parametrize(
    "world,layout,extra,mask_kind",
    [
        (2, "zigzag", "both", "causal"),
        (2, "contiguous", "bias_kv", None),
        (3, "zigzag", "zero_attn", "bool2d"),
        (3, "contiguous", "both", "float3d"),
    ],
)
def test_extra_keys_on_the_ring(worlds, world, layout, extra, mask_kind):
    """On the ring every rank holds the extra keys (they are parameters, or zero) and folds them
    into its own queries with the lse merge; nothing more travels."""
    worlds(world, **TORCH).run(_extra_world, layout, extra, mask_kind)
