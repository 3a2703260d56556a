"""RingMultiheadAttention against torch.nn.MultiheadAttention, inside torch's own layers."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringflash import shard, unshard
from ringflash.nn import RingMultiheadAttention

from oracle import assert_float64_agree, assert_within
from ring_cases import TORCH, sent_field_names

E, H = 64, 4


def _ring_like(mha: nn.MultiheadAttention, **kw) -> RingMultiheadAttention:
    ring = RingMultiheadAttention(
        mha.embed_dim,
        mha.num_heads,
        dropout=mha.dropout,
        bias=mha.in_proj_bias is not None,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=mha.batch_first,
        **kw,
    )
    ring.load_state_dict(mha.state_dict())
    return ring


def _swap_attention(layer, **kw):
    """A copy of a torch Transformer layer with every MultiheadAttention replaced by the ring one."""
    layer = copy.deepcopy(layer)
    for name in ("self_attn", "multihead_attn"):
        if hasattr(layer, name):
            setattr(layer, name, _ring_like(getattr(layer, name), **kw))
    return layer


def _layers(batch_first, seed=0):
    torch.manual_seed(seed)
    enc = nn.TransformerEncoderLayer(E, H, dim_feedforward=128, dropout=0.0, batch_first=batch_first)
    dec = nn.TransformerDecoderLayer(E, H, dim_feedforward=128, dropout=0.0, batch_first=batch_first)
    return enc, dec


def _data(batch_first, B=2, S=24, S_mem=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = lambda L: (B, L, E) if batch_first else (L, B, E)
    x, mem, w = (
        torch.randn(shape(S), generator=g),
        torch.randn(shape(S_mem), generator=g),
        torch.randn(shape(S), generator=g),
    )
    pad = torch.rand(B, S, generator=g) < 0.25
    mem_pad = torch.rand(B, S_mem, generator=g) < 0.25
    pad[:, 0] = False  # with a causal mask, row 0 sees only key 0: keep it (torch gives NaN otherwise)
    return x, mem, w, pad, mem_pad


def _run(layer, kind, x, mem, pad, mem_pad, causal):
    S = x.shape[1] if layer.self_attn.batch_first else x.shape[0]
    mask = nn.Transformer.generate_square_subsequent_mask(S, dtype=x.dtype) if causal else None
    if kind == "enc":
        return layer(x, src_mask=mask, src_key_padding_mask=pad, is_causal=causal)
    return layer(x, mem, tgt_mask=mask, tgt_key_padding_mask=pad, memory_key_padding_mask=mem_pad, tgt_is_causal=causal)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["enc", "dec"])
@pytest.mark.parametrize("causal", [False, True])
def test_world1_matches_torch_layers(batch_first, kind, causal):
    enc, dec = _layers(batch_first)
    ref_layer = enc if kind == "enc" else dec
    ring_layer = _swap_attention(ref_layer)
    x, mem, w, pad, mem_pad = _data(batch_first)
    outs, grads = [], []
    # torch's float32 layer is the plain computation; the bounds derive from its error
    same = lambda t: t  # noqa: E731
    for layer, t in ((ref_layer, same), (ring_layer, same), (copy.deepcopy(ref_layer).double(), _f64)):
        out = _run(layer, kind, t(x), t(mem), pad, mem_pad, causal)
        (out * t(w)).sum().backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    assert_within("out", outs[1], outs[2], outs[0])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert_within(n, grads[1][n], grads[2][n], grads[0][n])


def _f64(t):
    """The float64 reference layer's inputs (boolean padding masks stay as they are)."""
    return t.double() if t.is_floating_point() else t


def _world2(rank, world, batch_first, kind, causal, train):
    enc, dec = _layers(batch_first)
    ref_layer = enc if kind == "enc" else dec
    ring_layer = _swap_attention(ref_layer)
    for layer in (ref_layer, ring_layer):
        layer.train(train)
    layer64 = copy.deepcopy(ref_layer).double()  # torch's float32 layer is the plain computation
    x, mem, w, pad, mem_pad = _data(batch_first, S=8 * world, S_mem=4 * world)
    seq_dim = 1 if batch_first else 0
    sh = lambda t, d=seq_dim: shard(t, dim=d)
    with torch.set_grad_enabled(train):
        ref = _run(ref_layer, kind, x, mem, pad, mem_pad, causal)
        ref64 = _run(layer64, kind, x.double(), mem.double(), pad, mem_pad, causal)
        out = _run(ring_layer, kind, sh(x), sh(mem), sh(pad, 1), sh(mem_pad, 1), causal)
    whole = unshard(out, dim=seq_dim)
    if train:
        (ref * w).sum().backward()
        (ref64 * w.double()).sum().backward()
        (out * sh(w)).sum().backward()
        grads = [p.grad.clone() for p in ring_layer.parameters()]
        for g in grads:
            dist.all_reduce(g)  # each rank's gradient covers its own tokens (all before any check)
    assert_within("out", whole, ref64, ref)
    if train:
        params = zip(ref_layer.named_parameters(), layer64.parameters(), grads)
        for (n, p_ref), p64, g in params:
            assert_within(n, g, p64.grad, p_ref.grad)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])  # eval + no_grad: torch's fast path stays off
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("kind", ["enc", "dec"])
def test_world2_matches_torch_layers(worlds, batch_first, kind, causal, train):
    worlds(2, **TORCH).run(_world2, batch_first, kind, causal, train)


def test_state_dict_round_trip():
    for kw in (dict(), dict(bias=False), dict(kdim=24, vdim=40), dict(batch_first=True)):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(E, H, **kw)
        ring = RingMultiheadAttention(E, H, **kw)
        ring.load_state_dict(mha.state_dict())
        assert {k: v.shape for k, v in ring.state_dict().items()} == {k: v.shape for k, v in mha.state_dict().items()}
        torch.manual_seed(1)
        ring2 = RingMultiheadAttention(E, H, **kw)
        mha.load_state_dict(ring2.state_dict())
        for (k1, v1), (k2, v2) in zip(mha.state_dict().items(), ring2.state_dict().items()):
            assert k1 == k2 and torch.equal(v1, v2)


def test_kdim_vdim_cross_attention_and_unbatched():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, kdim=24, vdim=40)
    ring = _ring_like(mha)
    mha64 = copy.deepcopy(mha).double()  # torch's float32 module is the plain computation
    q, k, v = torch.randn(10, 3, E), torch.randn(14, 3, 24), torch.randn(14, 3, 40)
    ref, _ = mha(q, k, v, need_weights=False)
    out, weights = ring(q, k, v, need_weights=False)
    assert weights is None
    assert_within("out", out, mha64(q.double(), k.double(), v.double(), need_weights=False)[0], ref)
    ref, _ = mha(q[:, 0], k[:, 0], v[:, 0], need_weights=False)
    out, _ = ring(q[:, 0], k[:, 0], v[:, 0], need_weights=False)
    assert out.shape == ref.shape
    ref64 = mha64(q[:, 0].double(), k[:, 0].double(), v[:, 0].double(), need_weights=False)[0]
    assert_within("unbatched out", out, ref64, ref)


def _weights_case(seed, kdim=None, vdim=None, E=6, H=3, B=2, L=8, S=8, dtype=torch.float64):
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(E, H, kdim=kdim, vdim=vdim, dtype=dtype)
    ring = _ring_like(mha, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, B, E, generator=g, dtype=dtype)
    k = torch.randn(S, B, kdim or E, generator=g, dtype=dtype)
    v = torch.randn(S, B, vdim or E, generator=g, dtype=dtype)
    pad = torch.rand(B, S, generator=g) < 0.3
    pad[:, 0] = False  # torch gives NaN for a query that sees no key, ringflash 0
    return mha, ring, q, k, v, pad


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
@pytest.mark.parametrize(
    "cross,causal", [(False, False), (False, True), (True, False)], ids=["self", "causal", "cross"]
)
def test_need_weights_match_torch(average, causal, cross):
    """need_weights=True (forward's default): the weights and their gradients are torch's, in
    float64 (both sides are exact to a few ulps of float64 over the longest sum, the keys')."""
    mha, ring, q, k, v, pad = _weights_case(3, *((3, 5) if cross else (None, None)), S=11 if cross else 8)
    q.requires_grad_()
    mask = nn.Transformer.generate_square_subsequent_mask(8, dtype=torch.float64) if causal else None
    results = []
    for m in (mha, ring):
        out, w = m(q, k, v, key_padding_mask=pad, attn_mask=mask, is_causal=causal, average_attn_weights=average)
        (gq,) = torch.autograd.grad((w * torch.linspace(-1, 1, w.shape[-1], dtype=w.dtype)).square().sum(), q)
        results.append((out, w, gq))
    for name, a, b in zip(("out", "weights", "d weights / dq"), *results):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_float64_agree(name, a, b, len(k))
    _, w = ring(q[:, 0], k[:, 0], v[:, 0], key_padding_mask=pad[0], average_attn_weights=average)
    _, w_ref = mha(q[:, 0], k[:, 0], v[:, 0], key_padding_mask=pad[0], average_attn_weights=average)
    assert w.shape == w_ref.shape
    assert_float64_agree("unbatched weights", w, w_ref, len(k))
    assert ring(q, k, v, need_weights=False)[1] is None


def _weights_world2(rank, world, layout, causal, average):
    mha, ring, q, k, v, pad = _weights_case(5, L=4 * world, S=4 * world)
    ring.layout = layout
    mask = nn.Transformer.generate_square_subsequent_mask(4 * world, dtype=torch.float64) if causal else None
    _, w_ref = mha(q, k, v, key_padding_mask=pad, attn_mask=mask, is_causal=causal, average_attn_weights=average)
    sh = lambda t, d: shard(t, dim=d, layout=layout)
    out, w = ring(sh(q, 0), sh(k, 0), sh(v, 0), key_padding_mask=sh(pad, 1), is_causal=causal,
                  average_attn_weights=average)  # fmt: skip
    q_dim = 1 if average else 2  # (B, L_local, S) or (B, H, L_local, S): local query rows, every key
    assert w.shape == sh(w_ref, q_dim).shape
    assert_float64_agree("weights", w, sh(w_ref, q_dim), len(k))  # float64 both: its ulps over the keys
    assert_float64_agree("unshard(weights)", unshard(w.contiguous(), dim=q_dim, layout=layout), w_ref, len(k))


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_need_weights_world2_reassembled(worlds, layout, causal, average):
    """On the ring: each rank's weights are its own query rows over all keys in global order;
    reassembled along the query rows they are torch's."""
    worlds(2, **TORCH).run(_weights_world2, layout, causal, average)


def test_small_head_dims_in_torch_layers():
    """torch's own layer tests use d_model 4 with 2 heads: head_dim 2 (padded inside)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0)
    swapped = _swap_attention(layer)
    layer64 = copy.deepcopy(layer).double()  # torch's float32 layer is the plain computation
    x = torch.randn(5, 3, 4)
    models = (layer, swapped, layer64)
    outs = [m(t) for m, t in zip(models, (x, x, x.double()))]
    assert_within("out", outs[1], outs[2], outs[0])
    grads = [torch.autograd.grad(o.square().sum(), list(m.parameters())) for o, m in zip(outs, models)]
    for (n, _), plain, got, want in zip(layer.named_parameters(), *grads):
        assert_within(n, got, want, plain)


def test_bias_of_another_dtype_promotes():
    """A float16 in_proj_bias on a float64 module: the result is promoted, as torch's."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 4, batch_first=True, dtype=torch.float64).eval()
    ring = _ring_like(mha, dtype=torch.float64).eval()
    for m in (mha, ring):
        m.in_proj_bias = nn.Parameter(m.in_proj_bias.detach().to(torch.float16))
    ring.in_proj_bias.data.copy_(mha.in_proj_bias)
    x = torch.randn(4, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        a, b = mha(x, x, x)[0], ring(x, x, x)[0]
    assert_float64_agree("out", a, b, 4)  # float64 both: its ulps over the 4 keys / features


@pytest.mark.parametrize("need_weights", [True, False])
def test_autocast_output_dtype_is_torchs(need_weights):
    """Under CPU bfloat16 autocast, with biases: torch's dtypes, and exactly the module's result
    on bfloat16 inputs and parameters without autocast (autocast casts each projection's x, w
    and b to bfloat16, and the attention runs on the bfloat16 projections either way)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    ring = _ring_like(mha)
    with torch.no_grad():
        for p in ring.parameters():  # nonzero biases
            p.normal_()
    low = copy.deepcopy(ring).to(torch.bfloat16)
    x = torch.randn(2, 5, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (a, wa), (b, wb) = (m(x, x, x, need_weights=need_weights) for m in (mha, ring))
    c = low(*(x.bfloat16(),) * 3, need_weights=need_weights)[0]
    assert b.dtype == a.dtype == torch.bfloat16 and torch.equal(b, c)
    assert need_weights or wa is wb is None
    assert not need_weights or wb.dtype == wa.dtype


@pytest.mark.parametrize("shape", [(5, 0, E), (0, 3, E)], ids=["empty_batch", "no_queries"])
def test_empty_inputs_give_empty_outputs(shape):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H)
    ring = _ring_like(mha)
    x = torch.randn(shape, requires_grad=True)
    for average in (True, False):
        (a, wa), (b, wb) = (m(x, x, x, average_attn_weights=average) for m in (mha, ring))
        assert a.shape == b.shape and wa.shape == wb.shape
    b.sum().backward()
    assert x.grad.shape == x.shape


def _empty_shard_world2(rank, world):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H)
    ring = _ring_like(mha)
    x = torch.randn(0, 3, E)  # no queries or keys on any rank
    masks = (None, torch.zeros(0, 0), torch.zeros(0, 0, dtype=torch.bool))
    for mask, need_weights in [(m, nw) for m in masks for nw in (True, False)]:
        xr = x.clone().requires_grad_()
        (a, wa), (b, wb) = (m(t, t, t, attn_mask=mask, need_weights=need_weights) for m, t in ((mha, x), (ring, xr)))
        assert a.shape == b.shape and (wb is None) == (not need_weights)
        assert wb is None or wa.shape == wb.shape
        b.sum().backward()
        assert xr.grad.shape == x.shape


def _mesh_world2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    by_group = RingMultiheadAttention(E, H, batch_first=True)
    by_mesh = RingMultiheadAttention(E, H, batch_first=True, group=init_device_mesh("cpu", (world,)))
    by_mesh.load_state_dict(by_group.state_dict())
    assert dist.get_process_group_ranks(by_mesh.group) == [0, 1] and by_mesh.head_group is None
    x = shard(torch.randn(2, 8 * world, E, generator=torch.Generator().manual_seed(1)), dim=1)
    (a, _), (b, _) = (m(x, x, x, need_weights=False) for m in (by_group, by_mesh))
    assert torch.equal(a, b)


def test_one_dim_mesh_as_group_world2(worlds):
    """A 1-D DeviceMesh as group is its process group: the same output as the default group."""
    worlds(2, **TORCH).run(_mesh_world2)


def test_empty_shards_world2(worlds):
    """Empty shards on every rank give empty outputs, with weights and with an attn_mask too."""
    worlds(2, **TORCH).run(_empty_shard_world2)


def _disagreeing_world2(rank, world):
    ring = RingMultiheadAttention(E, H, dropout=0.5).eval()
    x = torch.randn(4, 2, E)
    # a rank whose input fails before the ring call sends the fields that the other ranks' ring
    # calls send (else their rows differ in length: checked first, before any rank waits on it)
    early = sent_field_names(lambda: ring(x, x, x, attn_mask=torch.zeros(4, 9)))
    assert early == sent_field_names(lambda: ring(x, x, x)) and "need_weights" in early
    cases = (  # one rank takes the dense path, the other the ring; or only one computes weights
        ("attn_mask given", dict(attn_mask=torch.zeros(4, 8)) if rank == 0 else {}),
        ("need_weights", dict(need_weights=rank == 0)),
        ("dropout_p", dict(need_weights=True)),  # in training mode on rank 0 only
        ("causal / window_size right", dict(need_weights=False, is_causal=rank == 0)),
    )
    for field, kw in cases:
        ring.train(field == "dropout_p" and rank == 0)
        # the error names the module the caller called, and what differs
        pattern = rf"^RingMultiheadAttention: ranks of the group disagree \({field}: rank 0=\S+"
        with pytest.raises(ValueError, match=pattern):
            ring(x, x, x, **kw)
    ring.eval()
    # one rank's own input is invalid before the ranks agree (a mask of the wrong shape, a
    # query of the wrong embedding size, a mask that is not the causal one given as the hint):
    # it raises its error, the other rank quotes it
    causal = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    bad_inputs = (
        ("attn_mask must have shape", dict(attn_mask=torch.zeros(4, 8 + rank))),
        ("embed", dict(query=torch.randn(4, 2, E + 2 * rank))),
        ("not the causal mask", dict(attn_mask=torch.zeros(4, 4) if rank else causal, is_causal=True)),
    )
    for text, kw in bad_inputs:
        args = {"query": x, "key": x, "value": x, **kw}
        with pytest.raises((ValueError, AssertionError), match=text if rank == 1 else r"rank\(s\) \[1\] .*rejected"):
            ring(**args)
    out, w = ring(x, x, x, attn_mask=torch.zeros(4, 8))  # the group still works
    assert out.shape == x.shape and w.shape == (2, 4, 8)


def test_disagreeing_ranks_raise_on_every_rank(worlds):
    """Ranks that choose different paths (an attn_mask, need_weights, training dropout on one
    rank only) raise the same ValueError on every rank, neither hang nor abort."""
    worlds(2, **TORCH).run(_disagreeing_world2)


def test_misuse_found_at_construction():
    for kw, pattern in (
        (dict(embed_dim=10, num_heads=3), "embed_dim 10 must be divisible by num_heads 3"),
        (dict(embed_dim=1024, num_heads=2), "512 per head; at most 256"),
        (dict(embed_dim=0, num_heads=1), "embed_dim must be a positive int"),
        (dict(embed_dim=8, num_heads=0), "num_heads must be a positive int"),
        (dict(embed_dim=8, num_heads=2, dropout=1.5), "dropout must be a probability"),
        (dict(embed_dim=8, num_heads=2, kdim=-1), "kdim must be a positive int"),
        (dict(embed_dim=8, num_heads=2, grad_accum_dtype=torch.int8), "grad_accum_dtype"),
    ):
        with pytest.raises(ValueError, match=pattern):
            RingMultiheadAttention(**kw)


def test_unsupported_arguments_raise():
    ring = RingMultiheadAttention(E, H, dropout=0.1, batch_first=True).eval()
    x = torch.randn(2, 6, E)
    nt = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(5, E)], layout=torch.jagged)
    with pytest.raises(ValueError, match="nested tensors take no key_padding_mask"):
        ring(nt, nt, nt, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch_first=True"):
        RingMultiheadAttention(E, H)(nt, nt, nt)
    with pytest.raises(NotImplementedError, match="must be all of query, key and value"):
        ring(nt, x, x)
    with pytest.raises(NotImplementedError, match=r"TorchScript \(torch.jit.script\) is not supported; torch.compile"):
        torch.jit.script(nn.TransformerEncoder(_swapped_layer(E, H), 1))
    with pytest.raises(AssertionError, match="received 1-D query tensor"):
        empty = torch.nested.nested_tensor([])
        ring(empty, empty, empty)
    with pytest.raises(ValueError, match="not the causal mask"):
        ring(x, x, x, attn_mask=torch.zeros(6, 6, dtype=torch.bool), is_causal=True, need_weights=False)
    with pytest.raises(ValueError, match="layout"):
        RingMultiheadAttention(E, H, layout="striped")
    with pytest.raises(ValueError, match="causal ring attention needs equal"):
        ring(x, torch.randn(2, 4, E), torch.randn(2, 4, E), is_causal=True, need_weights=False)


def test_causal_hint_with_the_lowest_float():
    """A causal float mask that hides with finfo(dtype).min (as transformers builds them), not
    -inf, is taken as the is_causal hint, as torch takes it; masks that are not causal, or hide
    with a value that need not zero a weight, are still refused."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64).eval()
    ring = _ring_like(mha, dtype=torch.float64).eval()
    L = 6
    x = torch.randn(2, L, E, dtype=torch.float64)
    lowest = torch.finfo(torch.float64).min
    mask = torch.full((L, L), lowest, dtype=torch.float64).triu(1)
    for need_weights in (True, False):
        a, b = (m(x, x, x, attn_mask=mask, is_causal=True, need_weights=need_weights)[0] for m in (mha, ring))
        assert_float64_agree(f"need_weights={need_weights}", a, b, E)  # float64 both: E, the longest sum
    for bad in (mask.T, torch.full((L, L), -1e9, dtype=torch.float64).triu(1)):
        with pytest.raises(ValueError, match="not the causal mask"):
            ring(x, x, x, attn_mask=bad, is_causal=True, need_weights=False)


def test_grad_accum_dtype_reaches_the_ring():
    """The module passes grad_accum_dtype on: an invalid one is refused by name, the inputs'
    own dtype is taken (the module's gradients, with either, within the bound derived from torch's
    own bfloat16 layer against float64). In one process the two give the same bits (one ring
    step, nothing accumulated across steps): test_grad_accum_dtype_reaches_the_ring_accumulation
    shows the setting reaching the accumulation, on 2 ranks."""
    x = torch.randn(1, 8, E, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_accum_dtype must be None"):
        RingMultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16, grad_accum_dtype=torch.float16)(
            x, x, x, need_weights=False
        )
    torch.manual_seed(0)
    exact = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16)
    low = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16, grad_accum_dtype=torch.bfloat16)
    low.load_state_dict(exact.state_dict())
    # torch's layer in bfloat16 is the plain computation, a float64 copy the reference
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16)
    mha.load_state_dict(exact.state_dict())
    mha64 = copy.deepcopy(mha).double()
    for m in (exact, low, mha, mha64):
        dtype, xd = m.out_proj.weight.dtype, x.to(m.out_proj.weight.dtype)
        # torch's layer wants the causal mask beside is_causal; the ring's takes the hint alone
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=dtype) if m in (mha, mha64) else None
        out = m(xd, xd, xd, need_weights=False, is_causal=True, attn_mask=mask)[0]
        (out.float() if dtype == torch.bfloat16 else out).square().sum().backward()
    for (n, p64), a, b, plain in zip(mha64.named_parameters(), exact.parameters(), low.parameters(), mha.parameters()):
        assert_within(f"{n} (float32 accumulation)", a.grad, p64.grad, plain.grad)
        assert_within(f"{n} (bfloat16 accumulation)", b.grad, p64.grad, plain.grad)


def _grad_accum_world2(rank, world):
    """RingMultiheadAttention(grad_accum_dtype=bfloat16) on 2 ranks against the default (float32
    accumulation): the input's and the parameters' gradients of both within the bound derived
    from torch's own bfloat16 layer against a float64 copy (both on the whole sequence), and
    the two not equal."""
    torch.manual_seed(0)
    exact = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16)
    low = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16, grad_accum_dtype=torch.bfloat16)
    low.load_state_dict(exact.state_dict())
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.bfloat16)  # the plain computation
    mha.load_state_dict(exact.state_dict())
    mha64 = copy.deepcopy(mha).double()  # the reference
    L = 16 * world  # zigzag: 2 chunks of 8 tokens a rank
    x = torch.randn(2, L, E, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    grads = {}
    for m in (mha, mha64):  # torch's layer wants the causal mask beside is_causal
        xd = x.to(m.out_proj.weight.dtype).clone().requires_grad_()
        mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=xd.dtype)
        m(xd, xd, xd, need_weights=False, is_causal=True, attn_mask=mask)[0].double().square().sum().backward()
        grads[m] = [xd.grad, *(p.grad for p in m.parameters())]
    for m in (exact, low):
        xl = shard(x, dim=1).clone().requires_grad_()
        m(xl, xl, xl, need_weights=False, is_causal=True)[0].double().square().sum().backward()
        params = [p.grad.clone() for p in m.parameters()]
        for g in params:
            dist.all_reduce(g)  # each rank's gradient covers its own tokens (all before any check)
        grads[m] = [unshard(xl.grad, dim=1), *params]
    names = ["input", *(n for n, _ in mha.named_parameters())]
    for n, a, b, want, plain in zip(names, grads[exact], grads[low], grads[mha64], grads[mha]):
        assert_within(f"{n} (float32 accumulation)", a, want, plain)
        assert_within(f"{n} (bfloat16 accumulation)", b, want, plain)
    # The setting reached the ring's accumulation: on 2 ranks dQ sums over 2 ring steps and each
    # rank's dK/dV accumulator travels to the other rank and back, gathering a part at each step
    # (and a part per task within one). In bfloat16 every partial sum is rounded to 8 bits before
    # the next part is added, in float32 only the total, so bf16(bf16(a) + b) against bf16(a + b)
    # on each of thousands of elements: many differ (1808 of the input's 4096 and 5407 of
    # in_proj_weight's 12288 when written); all equal would take every partial sum's rounding to
    # vanish in the final one, on any machine. (In one process there is one step: nothing is
    # accumulated across steps and the two give the same bits.)
    assert not torch.equal(grads[exact][0], grads[low][0]), "input gradient"
    assert not torch.equal(grads[exact][1], grads[low][1]), "in_proj_weight gradient"


def test_grad_accum_dtype_reaches_the_ring_accumulation(worlds):
    worlds(2, timeout=120, **TORCH).run(_grad_accum_world2)


def test_bad_ranks_raise_as_torch_does():
    """Inputs of the wrong rank (and an unbatched 3-D attn_mask of the wrong shape) raise a
    ValueError that is also torch's AssertionError, with torch's own message for each."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(4, 4)
    ring = RingMultiheadAttention(4, 4)
    b, u = torch.randn(4, 4, 4), torch.randn(4, 4)
    mask1 = torch.tensor([False, False, True, True])
    cases = [
        ((b, u, b), {}),
        ((b, b, u), {}),
        ((b, b, b), dict(key_padding_mask=mask1)),
        ((b, b, b), dict(attn_mask=mask1)),
        ((u, b, u), {}),
        ((u, u, b), {}),
        ((u, u, u), dict(key_padding_mask=torch.zeros(1, 8, dtype=torch.bool))),
        ((u, u, u), dict(attn_mask=mask1)),
        ((u, u, u), dict(attn_mask=torch.zeros(5, 4, 4, dtype=torch.bool))),
        ((torch.randn(4), torch.randn(4), torch.randn(4)), {}),
    ]
    for args, kw in cases:
        with pytest.raises(AssertionError) as theirs:
            mha(*args, **kw)
        with pytest.raises(ValueError) as ours:
            ring(*args, **kw)
        assert isinstance(ours.value, AssertionError)
        assert str(theirs.value) in str(ours.value), (str(theirs.value), str(ours.value))


@pytest.mark.parametrize("causal", [False, True])
def test_nested_tensors_run_as_packed_documents(causal):
    """Jagged nested inputs: each sequence's output and the parameters' gradients are those of
    torch's module run on each sequence alone (float64), with add_bias_kv / add_zero_attn."""
    torch.manual_seed(0)
    kw = dict(batch_first=True, dtype=torch.float64, add_bias_kv=True, add_zero_attn=True)
    mha, ring = nn.MultiheadAttention(10, 5, **kw), RingMultiheadAttention(10, 5, **kw)
    ring.load_state_dict(mha.state_dict())
    seqs = [torch.randn(n, 10, dtype=torch.float64) for n in (4, 1, 6)]
    nt = torch.nested.nested_tensor(seqs, layout=torch.jagged)
    out, weights = ring(nt, nt, nt, is_causal=causal)
    assert weights is None and out.is_nested
    w_out = [torch.randn(s.shape, dtype=torch.float64) for s in seqs]
    loss = 0.0
    n = sum(map(len, seqs))  # float64 both: its ulps over the longest sum, a gradient's over every row
    for i, x in enumerate(seqs):
        mask = nn.Transformer.generate_square_subsequent_mask(len(x), dtype=torch.float64) if causal else None
        ref = mha(x[None], x[None], x[None], attn_mask=mask, is_causal=causal)[0][0]
        assert_float64_agree(f"sequence {i}", out[i], ref, n)
        loss = loss + (ref * w_out[i]).sum()
    loss.backward()
    (out.values() * torch.cat(w_out)).sum().backward()
    for (name, a), b in zip(ring.named_parameters(), mha.parameters()):
        assert_float64_agree(name, a.grad, b.grad, n)


def _swapped_layer(E, H, dtype=torch.float32):
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=2 * E, batch_first=True, dtype=dtype)
    layer.self_attn = RingMultiheadAttention(E, H, batch_first=True, dtype=dtype)
    return layer


def test_encoder_nested_fast_path_input():
    """nn.TransformerEncoder in inference with a padding mask hands its layers strided nested
    tensors (enable_nested_tensor, the default): they run as packed documents, as torch's."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dtype=torch.float64), 2)
    ring = nn.TransformerEncoder(_swapped_layer(16, 4, torch.float64), 2)
    ring.load_state_dict(ref.state_dict())
    ref.eval(), ring.eval()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:], pad[2, 3:] = True, True
    with torch.no_grad():
        got, want = ring(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad)
    assert_float64_agree("out", got, want, 32)  # float64 both: its ulps over the longest sum, the feedforward's


def _projection_input_on_one_rank(rank, world):
    """One rank's key or value of another embedding size, or an input of another dtype than
    the weights: F.linear's RuntimeError on that rank alone left the others in the ring's
    check; now that rank raises its error and the others quote it."""
    ring = RingMultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    bad_inputs = (
        ("key has embedding dimension 10, expected 8", (x, torch.randn(1, 4, 10), x)),
        ("value has embedding dimension 6, expected 8", (x, x, torch.randn(1, 4, 6))),
        ("query has dtype torch.float64", (x.double(), x, x)),
    )
    for text, args in bad_inputs:
        with pytest.raises((ValueError, TypeError), match=text if rank == 1 else r"rank\(s\) \[1\] .*rejected") as e:
            ring(*(args if rank == 1 else (x, x, x)), need_weights=False)
        assert rank == 0 or "dtype" not in text or isinstance(e.value, RuntimeError)  # as torch's module raises it
    assert ring(x, x, x, need_weights=False)[0].shape == x.shape  # the group still works


def test_projection_input_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **TORCH).run(_projection_input_on_one_rank)
