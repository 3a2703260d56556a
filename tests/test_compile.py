"""torch.compile(fullgraph=True) of the attention functions and modules: no graph break, and
the compiled forward and backward give exactly the eager results (the attention runs as one
opaque operator either way, so the same arithmetic runs; aot_eager keeps the surrounding ops
eager too). CPU: the torch backend and the Triton kernels under the interpreter; the ring over
gloo with 2 processes; a head_group on a 2 x 2 grid of 4."""

import copy
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

import ringflash
from ringflash import ops
from ringflash.local import use_backend
from ringflash.nn import RingMultiheadAttention

from oracle import assert_within
from ring_cases import TORCH

BACKENDS = pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)


def _compile(fn, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _no_graph_break():
    assert not counters["graph_break"], dict(counters["graph_break"])


def _leaves(*shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _run(fn, inputs, seed=1):
    """fn(*inputs) -> tuple of tensors; returns the outputs and the gradients of the inputs for
    random cotangents of every output (lse's gradient included)."""
    outs = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, inputs, cot)
    return [o.detach() for o in outs], list(grads)


def _assert_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def _operator_nodes(outs) -> list[str]:
    """The autograd nodes of the package's operators in the graph behind outs."""
    stack, seen, names = [o.grad_fn for o in outs if o.grad_fn is not None], set(), []
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            names += [node.name()] if f"GeneratedBackwardFor_{ops.NAMESPACE}_" in node.name() else []
            stack += [n for n, _ in node.next_functions if n is not None]
    return names


def _eager_run(fn, inputs):
    """_run of an eager call that must make none of the package's operators' autograd nodes
    (eager calls run the operators' forward and backward through autograd Functions; a torch
    dispatch mode would route them to the operators), so that comparing it with the compiled
    call compares those two routes."""

    def checked(*args):
        outs = fn(*args)
        assert not _operator_nodes(outs), _operator_nodes(outs)
        return outs

    return _run(checked, inputs)


@BACKENDS
def test_flash_attn_func_fullgraph(backend):
    """Causal with a window, GQA, a padding mask, lse returned: compiled == eager, forward and
    backward; a new sequence length recompiles (dynamic shapes) and is still exact."""
    pad = torch.zeros(2, 20, dtype=torch.bool)
    pad[1, 3:6] = True

    def f(q, k, v, pad):
        return ringflash.flash_attn_func(
            q, k, v, causal=True, window_size=(5, -1), key_padding_mask=pad, return_lse=True
        )

    cf = _compile(f)
    for S in (20, 28):
        q, k, v = _leaves((2, S, 4, 16), (2, S, 2, 16), (2, S, 2, 16), seed=S)
        mask = torch.nn.functional.pad(pad, (0, S - 20))
        got_out, got_grads = _run(lambda *t: cf(*t, mask), (q, k, v))
        want_out, want_grads = _eager_run(lambda *t: f(*t, mask), (q, k, v))
        _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    assert counters["stats"]["unique_graphs"] >= 1


def test_flash_attn_func_inductor():
    """The inductor backend (a C++ compiler on CPU): the attention operator is opaque, so its
    outputs and gradients are exactly the eager ones."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    f = lambda q, k, v: ringflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    q, k, v = _leaves(*[(1, 24, 2, 16)] * 3)
    got_out, got_grads = _run(_compile(f, "inductor"), (q, k, v))
    want_out, want_grads = _eager_run(f, (q, k, v))
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()


@BACKENDS
def test_flash_attn_varlen_func_fullgraph(backend):
    """Packed documents: compiled == eager; cu_seqlens' values are checked when the compiled
    graph runs (they are data), with the eager error."""
    cu = torch.tensor([0, 7, 7, 19, 30], dtype=torch.int32)

    def f(q, k, v, cu):
        return ringflash.flash_attn_varlen_func(q, k, v, cu, cu, 12, causal=True, return_lse=True)

    q, k, v = _leaves((30, 4, 16), (30, 2, 16), (30, 2, 16))
    cf = _compile(f)
    got_out, got_grads = _run(lambda *t: cf(*t, cu), (q, k, v))
    want_out, want_grads = _eager_run(lambda *t: f(*t, cu), (q, k, v))
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the total length 30, got 31"):
        cf(q, k, v, torch.tensor([0, 7, 31], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q = 12 is smaller than the longest document"):
        cf(q, k, v, torch.tensor([0, 17, 30], dtype=torch.int32))


def test_ring_without_group_fullgraph():
    """ring_flash_attn_func with no process group (local attention through the ring engine)."""
    f = lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True, return_lse=True)
    q, k, v = _leaves((2, 16, 4, 16), (2, 16, 2, 16), (2, 16, 2, 16))
    got_out, got_grads = _run(_compile(f), (q, k, v))
    want_out, want_grads = _eager_run(f, (q, k, v))
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()


def test_named_packed_layout_raises_under_fullgraph():
    """A named layout of packed documents needs its layout object built, which a compiled graph
    cannot: fullgraph compilation fails with the reason (eager works: test_ring_varlen)."""
    q = torch.randn(16, 2, 16)
    f = lambda q: ringflash.ring_flash_attn_varlen_func(q, q, q, [0, 5, 12, 16], layout="zigzag", causal=True)
    with pytest.raises(Exception, match="with packed documents is not supported under torch.compile"):
        torch.compile(f, fullgraph=True)(q)


@pytest.mark.parametrize("fn", ["flash", "ring"])
def test_dropout_fullgraph_draws_as_eager(fn):
    """dropout_p under torch.compile: no graph break, the seed drawn from torch's generator in
    the graph, so the same torch.manual_seed gives eager's output and gradients exactly."""
    call = ringflash.flash_attn_func if fn == "flash" else ringflash.ring_flash_attn_func
    f = lambda q, k, v: call(q, k, v, causal=True, dropout_p=0.3, return_lse=True)
    q, k, v = _leaves((2, 16, 4, 16), (2, 16, 2, 16), (2, 16, 2, 16))
    cf = _compile(f)
    torch.manual_seed(3)
    got_out, got_grads = _run(cf, (q, k, v))
    torch.manual_seed(3)
    want_out, want_grads = _eager_run(f, (q, k, v))
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    assert not torch.equal(cf(q, k, v)[0], got_out[0])  # the next call drops other pairs


def _encoder(E=64, H=4, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    ring = copy.deepcopy(layer)
    attn = RingMultiheadAttention(E, H, batch_first=True)
    attn.load_state_dict(layer.self_attn.state_dict())
    ring.self_attn = attn
    return ring


def _layer_step(layer, x, mask):
    layer.zero_grad(set_to_none=True)
    y = layer(x, src_mask=mask, is_causal=True)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach()] + [p.grad.clone() for p in layer.parameters()]


def test_encoder_layer_fullgraph():
    """RingMultiheadAttention inside a compiled nn.TransformerEncoderLayer (causal, training):
    the output and every parameter gradient equal the eager layer's; eval mode too."""
    layer = _encoder()
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    mask = nn.Transformer.generate_square_subsequent_mask(24)
    compiled = _compile(layer)
    _assert_equal(_layer_step(compiled, x, mask), _layer_step(layer, x, mask))
    layer.eval()
    with torch.no_grad():
        assert torch.equal(compiled(x, src_mask=mask, is_causal=True), layer(x, src_mask=mask, is_causal=True))
    _no_graph_break()


def test_nested_module_fullgraph():
    """RingMultiheadAttention on jagged nested tensors, compiled with fullgraph: self-attention
    (key and value the query) and a value that shares key's offsets need no look at the offsets'
    values, so no graph break; output and parameter gradients equal eager's."""
    torch.manual_seed(0)
    m = RingMultiheadAttention(16, 4, batch_first=True)
    offsets = torch.tensor([0, 3, 8])
    x, y = (torch.nested.nested_tensor_from_jagged(t, offsets) for t in _leaves((8, 16), (8, 16), seed=1))

    def step(fn, v):
        m.zero_grad(set_to_none=True)
        out = fn(x, v)
        (out.values() * torch.linspace(-1, 1, out.values().numel()).view_as(out.values())).sum().backward()
        return [out.values().detach()] + [p.grad.clone() for p in m.parameters()]

    for v in (x, y):
        f = lambda q, v: m(q, q, v, need_weights=False)[0]  # noqa: E731
        _assert_equal(step(_compile(f), v), step(f, v))
        _no_graph_break()
    z = torch.nested.nested_tensor_from_jagged(y.values(), torch.tensor([0, 4, 8]))  # other offsets: compared
    with pytest.raises(ValueError, match="key and value must hold sequences of the same lengths"):
        m(x, x, z, need_weights=False)


# ----------------------------------------------------------------------------- the ring, 2 ranks


def _ring_compiled(rank, world):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, h, 16, generator=g) for h in (4, 2, 2))
    pad = torch.rand(2, 32, generator=g) < 0.2
    pad[:, 0] = False
    leaves = [ringflash.shard(t).requires_grad_() for t in (q, k, v)]
    pad_l = ringflash.shard(pad)

    def f(q, k, v):
        return ringflash.ring_flash_attn_func(q, k, v, causal=True, key_padding_mask=pad_l, return_lse=True)

    cf = _compile(f)
    got_out, got_grads = _run(cf, leaves)
    want_out, want_grads = _eager_run(f, leaves)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    # a sliding window: its bounds are operator arguments, in the compiled graph as constants
    fw = lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, window_size=(5, 3), return_lse=True)
    got_out, got_grads = _run(_compile(fw), leaves)
    want_out, want_grads = _eager_run(fw, leaves)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    # the ranks disagree (rank 0 passes a shorter shard): every rank raises, compiled too
    bad = [t[:, :8] if rank == 0 else t for t in leaves]
    with pytest.raises(ValueError, match="ranks of the group disagree .*q local length: rank 0=8, rank 1=16"):
        ringflash.ring_flash_attn_func(*bad, causal=True)  # eager, for the message
    cf2 = _compile(lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True))
    with pytest.raises(ValueError, match="ranks of the group disagree .*q local length: rank 0=8, rank 1=16"):
        cf2(*bad)
    # packed documents on a balanced layout, cu_seqlens a tensor (its values are checked inside
    # the operator) and a list
    cu = torch.tensor([0, 5, 6, 26, 26, 32], dtype=torch.int32)
    layout = ringflash.balanced_layout(cu, world, causal=True)
    packed = [ringflash.shard(t, layout=layout, dim=0).requires_grad_() for t in (q[0], k[0], v[0])]
    for cu_arg in (cu, cu.tolist()):
        fv = lambda q, k, v: ringflash.ring_flash_attn_varlen_func(
            q, k, v, cu_arg, layout=layout, causal=True, window_size=(7, 0), return_lse=True
        )
        got_out, got_grads = _run(_compile(fv), packed)
        want_out, want_grads = _eager_run(fv, packed)
        _assert_equal(got_out + got_grads, want_out + want_grads)
        _no_graph_break()
    # one rank's cu_seqlens differ from the layout's: every rank raises, compiled too
    wrong = cu.clone()
    wrong[1] += rank == 1
    fw = _compile(lambda q, k, v: ringflash.ring_flash_attn_varlen_func(q, k, v, wrong, layout=layout, causal=True))
    quoted = r"rank\(s\) \[1\] .*" if rank == 0 else ""  # rank 1 raises its own error, rank 0 quotes it
    with pytest.raises(ValueError, match=quoted + "is not the one the layout was built from"):
        fw(*packed)
    # the module inside a compiled encoder layer, on its shard of the sequence
    layer = _encoder()
    x = ringflash.shard(torch.randn(2, 32, 64, generator=g))
    mask = nn.Transformer.generate_square_subsequent_mask(16)
    _assert_equal(_layer_step(_compile(layer), x, mask), _layer_step(layer, x, mask))
    _no_graph_break()
    dist.barrier()


def test_ring_fullgraph_two_ranks(worlds):
    """The ring compiled with fullgraph on 2 gloo ranks: compiled == eager (out, lse, dq, dk,
    dv; causal with padding, and a sliding window; packed documents with cu_seqlens as a tensor
    and as a list), no graph break, disagreeing ranks raise on every rank (a cu_seqlens that is
    not the layout's on one rank too), the encoder layer on the ring."""
    worlds(2).run(_ring_compiled)


def _module_paths_compiled(rank, world, compiler):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = RingMultiheadAttention(16, 2, dropout=0.5)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    pad = torch.tensor([[False, True, False, False], [False] * 4])
    mask = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 + rank))
    call = lambda x, **kw: m(x, x, x, **kw)  # noqa: E731

    def run(fn, module=m, inp=x, **kw):
        torch.manual_seed(3)  # the dropout seed
        module.zero_grad(set_to_none=True)
        inp.grad = None
        out, w = fn(inp, **kw)
        (out.sum() + (0 if w is None else w.square().sum())).backward()
        weights = [] if w is None else [w.detach()]
        return [out.detach(), inp.grad.clone(), *weights] + [p.grad for p in module.parameters()]

    # the dense path (an attn_mask with padding; dropout whose weights are asked for): compiled
    # == eager, the seed agreed inside the operator that checks the call
    for training, kw in ((False, dict(attn_mask=mask, key_padding_mask=pad)), (True, dict(need_weights=True))):
        m.train(training)
        got, want = run(_compile(call, backend=compiler), **kw), run(call, **kw)
        if compiler == "aot_eager":
            _assert_equal(got, want)
        else:  # inductor fuses the ops around the operators: eager float64 is the reference
            m64, x64 = copy.deepcopy(m).double(), x.detach().double().requires_grad_()
            kw64 = {name: t.double() if t.is_floating_point() else t for name, t in kw.items() if torch.is_tensor(t)}
            want64 = run(lambda x, **kw: m64(x, x, x, **kw), m64, x64, **{**kw, **kw64})
            for i, (a, ref, plain) in enumerate(zip(got, want64, want, strict=True)):
                assert_within(f"output {i}", a, ref, plain)
        _no_graph_break()
    # ranks that would take different paths (the dense one or the ring), or only one of which
    # computes weights: every rank raises, as in eager, neither hangs nor aborts in a collective
    cases = (
        ("attn_mask given", False, dict(attn_mask=mask) if rank == 0 else {}),
        ("attn_mask given", False, dict(attn_mask=mask, need_weights=False) if rank == 1 else dict(need_weights=False)),
        ("need_weights", False, dict(need_weights=rank == 0)),
        ("dropout_p", rank == 0, dict(need_weights=True)),  # training on rank 0 only: dense there
    )
    for field, training, kw in cases:
        m.train(training)
        with pytest.raises(ValueError, match=rf"ranks of the group disagree \({field}: rank 0=\S+, rank 1="):
            _compile(call, backend=compiler)(x, **kw)
    m.eval()
    out, w = _compile(call, backend=compiler)(x, attn_mask=mask)  # the group still works
    assert out.shape == x.shape and w.shape == (2, 4, 8)
    dist.barrier()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_module_paths_fullgraph_two_ranks(worlds, compiler):
    """RingMultiheadAttention compiled with fullgraph on 2 gloo ranks: its dense path equals
    eager (forward, weights, gradients; under inductor, whose fused ops round otherwise, within
    the bound derived from eager float64), and ranks that differ in what picks the path (an
    attn_mask, need_weights, training-mode dropout) raise on every rank."""
    worlds(2, timeout=600, **TORCH).run(_module_paths_compiled, compiler)


def _empty_shard_compiled(rank, world):
    """An empty shard beside a full one, compiled: the empty rank returns no ring operator's
    result, so its check runs in the agreement operator: both ranks raise the disagreement,
    neither waits in the other's all_gather. Both empty: empty results, gradients 0-sized."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    fn = _compile(lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True))
    full = [torch.randn(1, 8, 2, 16, generator=g) for _ in range(3)]
    mine = [t[:, :0] for t in full] if rank == 0 else full
    with pytest.raises(ValueError, match="ranks of the group disagree .*q local length: rank 0=0, rank 1=8"):
        fn(*mine)
    empty = [t[:, :0].clone().requires_grad_() for t in full]
    out = fn(*empty)
    out.sum().backward()
    assert out.shape == (1, 0, 2, 16) and empty[0].grad.shape == (1, 0, 2, 16)
    dist.barrier()


def test_empty_shard_fullgraph_two_ranks(worlds):
    worlds(2, timeout=120, **TORCH).run(_empty_shard_compiled)


# ----------------------------------------------------------------------------- hybrid, 2 x 2 grid


def _hybrid_compiled(rank, world):
    from hybrid_cases import grid

    torch.set_num_threads(1)
    group, head_group = grid(2, 2)
    kw = dict(group=group, head_group=head_group)
    g = torch.Generator().manual_seed(0)
    sh = lambda t, **a: ringflash.shard(t, **kw, **a)
    # GQA with Hkv = U: the kv heads split over the head group; causal zigzag, lse returned
    q, k, v = (torch.randn(2, 32, h, 16, generator=g) for h in (4, 2, 2))
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)
    got_out, got_grads = _run(_compile(f), leaves)
    want_out, want_grads = _eager_run(f, leaves)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    # Hkv < U in 16-bit (the kv head replicated, its gradients summed in float32 and rounded
    # once), a key padding mask, dropout on the grid's first rank's seed
    q, k, v = (torch.randn(1, 32, h, 16, generator=g, dtype=torch.float16) for h in (4, 1, 1))
    pad = torch.rand(1, 32, generator=g) < 0.2
    pad[:, 0] = False
    pad_l = sh(pad)
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    fd = lambda q, k, v: ringflash.ring_flash_attn_func(
        q, k, v, layout="contiguous", key_padding_mask=pad_l, dropout_p=0.25, return_lse=True, **kw
    )
    cf = _compile(fd)
    torch.manual_seed(7 + rank)  # the ranks draw different seeds: they agree on the first rank's
    got_out, got_grads = _run(cf, leaves)
    torch.manual_seed(7 + rank)
    want_out, want_grads = _eager_run(fd, leaves)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    # one rank's shard is shorter: the grid agreement inside the operator raises on every rank
    q, k = torch.randn(1, 8, 4, 16, generator=g), torch.randn(1, 8, 2, 16, generator=g)
    bad = (q[:, :4], k[:, :4]) if rank == 0 else (q, k)
    pattern = "q local length: rank 0=4, rank 1=8"
    with pytest.raises(ValueError, match=pattern):
        ringflash.ring_flash_attn_func(bad[0], bad[1], bad[1], causal=True, **kw)  # eager, for the message
    cf = _compile(lambda q, k: ringflash.ring_flash_attn_func(q, k, k, causal=True, **kw))
    with pytest.raises(ValueError, match=pattern):
        cf(*bad)
    # packed documents (cu_seqlens a tensor: its values checked inside the operator), pieces of
    # unequal length; one rank's cu_seqlens wrong: every rank raises
    cu = torch.tensor([0, 5, 6, 26, 26, 31], dtype=torch.int32)
    layout = ringflash.balanced_layout(cu, 2, causal=True)
    q, k, v = (torch.randn(31, h, 16, generator=g) for h in (4, 2, 2))
    packed = [sh(t, layout=layout, dim=0).requires_grad_() for t in (q, k, v)]
    wrong = cu.clone()
    wrong[1] += rank == 3
    fv = lambda q, k, v, cu: ringflash.ring_flash_attn_varlen_func(
        q, k, v, cu, layout=layout, causal=True, return_lse=True, **kw
    )
    cf = _compile(fv)
    got_out, got_grads = _run(lambda *t: cf(*t, cu), packed)
    want_out, want_grads = _eager_run(lambda *t: fv(*t, cu), packed)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    with pytest.raises(ValueError, match="is not the one the layout was built from"):
        cf(*packed, wrong)
    # RingMultiheadAttention with the head group, compiled: output and the gradients of the
    # input and of every parameter as eager's
    torch.manual_seed(0)  # the same parameters on every rank
    mha = RingMultiheadAttention(64, 4, batch_first=True, group=group, head_group=head_group)
    x = sh(torch.randn(2, 32, 64, generator=g)).requires_grad_()
    fm = lambda x, *params: (mha(x, x, x, need_weights=False, is_causal=True)[0],)
    got_out, got_grads = _run(_compile(fm), [x, *mha.parameters()])
    want_out, want_grads = _eager_run(fm, [x, *mha.parameters()])
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    dist.barrier()
    return packed[0].shape[0]


def _hybrid_inductor(rank, world):
    from hybrid_cases import grid

    torch.set_num_threads(1)
    group, head_group = grid(2, 2)
    kw = dict(group=group, head_group=head_group)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, h, 16, generator=g) for h in (4, 2, 2))
    leaves = [ringflash.shard(t, **kw).requires_grad_() for t in (q, k, v)]
    f = lambda q, k, v: ringflash.ring_flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)
    got_out, got_grads = _run(_compile(f, backend="inductor"), leaves)
    want_out, want_grads = _run(f, leaves)
    _assert_equal(got_out + got_grads, want_out + want_grads)
    _no_graph_break()
    dist.barrier()


def test_hybrid_fullgraph_2x2(worlds):
    """ring_flash_attn_func / ring_flash_attn_varlen_func with a head_group compiled with
    fullgraph on a 2 x 2 grid of gloo ranks: compiled (the hybrid operators) == eager (their
    forward and backward through hybrid._HybridAttn, no operator dispatched) bitwise (out, lse,
    dq, dk, dv), no graph break; kv heads split (Hkv = U) and replicated (Hkv < U, float16) with
    a padding mask and dropout; packed documents; a disagreement or a wrong cu_seqlens on one
    rank raises on every rank; RingMultiheadAttention with the head group (parameter gradients
    too)."""
    lens = worlds(4, **TORCH).run(_hybrid_compiled)
    layout = ringflash.balanced_layout([0, 5, 6, 26, 26, 31], 2, causal=True)
    pieces = [[layout.head_pieces(r, 2).local_len(u) for u in range(2)] for r in range(2)]
    assert lens == [n for row in pieces for n in row] and any(a != b for a, b in pieces)  # unequal pieces
    assert [list(layout.head_piece_lens(r, 2)) for r in range(2)] == pieces  # what the traced call uses


def _hybrid_deterministic(rank, world):
    from unittest import mock

    from ringflash import ring

    from hybrid_cases import grid

    group, head_group = grid(2, 2)
    kw = dict(group=group, head_group=head_group, causal=True)
    g = torch.Generator().manual_seed(0)
    leaves = [ringflash.shard(torch.randn(1, 32, h, 16, generator=g), group=group, head_group=head_group)
              .requires_grad_() for h in (4, 2, 2)]  # fmt: skip
    seen = []
    real = ring.block_backward
    spy = lambda *a, **k: seen.append(k["deterministic"]) or real(*a, **k)  # noqa: E731
    compiled = _compile(ringflash.ring_flash_attn_func)
    with mock.patch.object(ring, "block_backward", spy):
        for fn in (ringflash.ring_flash_attn_func, compiled):
            for det in (False, True):
                seen.clear()
                out = fn(*leaves, deterministic=det, **kw)
                torch.autograd.grad(out.sum(), leaves)
                assert set(seen) == {det}
    dist.barrier()


def test_hybrid_deterministic_reaches_the_backward(worlds):
    """deterministic= reaches every block backward of a call with a head_group, eager and
    compiled (the hybrid operators carry it from the forward to the backward)."""
    worlds(4, **TORCH).run(_hybrid_deterministic)


def test_hybrid_inductor_2x2(worlds):
    """The inductor backend around the hybrid operators on the 2 x 2 grid: the operators are
    opaque, so outputs and gradients are exactly the eager ones, no graph break."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler")
    worlds(4, **TORCH).run(_hybrid_inductor)


def test_renamed_copy_registers_its_own_operators(tmp_path):
    """A copy of the package imported under another name (a benchmark's baseline) beside this
    one: each registers operators under its own name and both still run, in either order."""
    import subprocess
    import sys
    import textwrap

    from tests.commands import ROOT

    shutil.copytree(ROOT / "ringflash", tmp_path / "ringflash_before")
    script = textwrap.dedent(
        f"""
        import sys, torch
        import ringflash
        sys.path.insert(0, {str(tmp_path)!r})
        import ringflash_before
        q = torch.randn(1, 16, 2, 8)
        for lib in (ringflash, ringflash_before, ringflash):
            assert torch.equal(lib.flash_attn_func(q, q, q), ringflash.flash_attn_func(q, q, q))
        assert torch.ops.ringflash_before.flash_fwd is not None
        """
    )
    env = {"PYTHONPATH": str(ROOT), "RINGFLASH_BACKEND": "torch", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


# ----------------------------------------------------------------------------- one GPU, inductor


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_module_compiled_by_inductor_on_gpu(dtype):
    """RingMultiheadAttention on one GPU (no process group) compiled by inductor, fullgraph: the
    ring path (a causal self-attention) and the dense path (an attn_mask with padding; training
    dropout with weights asked for, the mask drawn by the dropout_keep operator on the GPU's
    generator) within the bound derived from the same module in eager float64 (on the torch
    backend), against the eager call at this dtype; no graph break."""
    torch.manual_seed(0)
    E, heads, L, N = 128, 2, 256, 2
    m = RingMultiheadAttention(E, heads, dropout=0.25, batch_first=True).to("cuda", dtype)
    m64 = copy.deepcopy(m).double()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(N, L, E, device="cuda", generator=g).to(dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    mask = torch.randn(L, L, device="cuda", generator=g)
    pad = torch.zeros(N, L, dtype=torch.bool, device="cuda")
    pad[0, 200:] = True
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").triu(1)

    def run(module, inp, fn=None, **kw):
        torch.manual_seed(3)  # the dropout seed
        module.zero_grad(set_to_none=True)
        inp.grad = None
        out, w = (fn or (lambda x, **kw: module(x, x, x, **kw)))(inp, **kw)
        (out.float().sum() + (0 if w is None else w.float().square().sum())).backward()
        weights = [] if w is None else [w.detach()]
        return [out.detach(), inp.grad.clone(), *weights] + [p.grad for p in module.parameters()]

    cases = (
        (False, dict(attn_mask=causal, is_causal=True, need_weights=False)),  # the ring path
        (False, dict(attn_mask=mask.to(dtype), key_padding_mask=pad)),
        (True, dict(need_weights=True)),
    )
    for training, kw in cases:
        m.train(training)
        m64.train(training)
        call = lambda x, **kw: m(x, x, x, **kw)  # noqa: E731
        got = run(m, x, _compile(call, backend="inductor"), **kw)
        _no_graph_break()
        plain = run(m, x, **kw)
        kw64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        with use_backend("torch"):  # float64 on the GPU: the kernels take 16- and 32-bit inputs
            want64 = run(m64, x64, **kw64)
        for i, (a, ref, p) in enumerate(zip(got, want64, plain, strict=True)):
            assert_within(f"{sorted(kw)} training={training} result {i}", a, ref, p, sum_len=L)
