"""The block operations the ring uses: global positions, state folding in any order,
accumulating backward."""

import random

import pytest
import torch

from ringflash.local import attention_delta, block_backward, block_forward
from ringflash.masks import CAUSAL, FULL, BlockMask
from ringflash.merge import SoftmaxState

from oracle import assert_within, naive_attention

BOTH = pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)


def _qkv(S, Hq=4, Hkv=2, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, S, H, D, generator=g).to(dtype) for H in (Hq, Hkv, Hkv)]


def _ref_and_plain(q, k, v, **kw):
    """(out, lse) of plain attention in float64 (the reference) and in q's dtype (the plain
    same-precision computation whose error bounds ours)."""
    return naive_attention(q, k, v, **kw), naive_attention(q, k, v, dtype=q.dtype, **kw)


def _split(S, n_blocks, seed):
    cuts = sorted(random.Random(seed).sample(range(1, S), n_blocks - 1))
    return list(zip([0] + cuts, cuts + [S]))


def _fold(q, k, v, blocks, order, causal, q_start=0):
    """Fold the key blocks in `order` into one state; returns (normalized o, lse, state)."""
    state = SoftmaxState.empty(torch.empty(q.shape, dtype=torch.float32))
    first = True
    for i in order:
        a, b = blocks[i]
        block_forward(
            q,
            k[:, a:b],
            v[:, a:b],
            state,
            BlockMask(q_start, a, CAUSAL if causal else FULL),
            scale=q.shape[-1] ** -0.5,
            fold=not first,
        )
        first = False
    lse = state.lse()
    return state.normalized(torch.float32), lse, state


def _tree_fold(q, k, v, blocks, causal):
    from ringflash import merge_attn_states

    states = [_fold(q, k, v, [blk], [0], causal)[:2] for blk in blocks]
    while len(states) > 1:
        nxt = [merge_attn_states(*states[i], *states[i + 1]) for i in range(0, len(states) - 1, 2)]
        states = nxt + ([states[-1]] if len(states) % 2 else [])
    return states[0]


@BOTH
@pytest.mark.parametrize("causal", [False, True])
def test_any_fold_order_equals_one_pass(backend, causal):
    S = 50
    q, k, v = _qkv(S, seed=1)
    (ref, ref_lse), (plain, plain_lse) = _ref_and_plain(q, k, v, causal=causal)
    blocks = _split(S, 5, seed=2)
    orders = {"sequential": list(range(5)), "shuffled": random.Random(3).sample(range(5), 5)}
    if backend == "torch":  # the interpreter's launches take seconds: its folds are checked in two orders and a tree
        orders["reversed"] = list(range(5))[::-1]
    results = {name: _fold(q, k, v, blocks, order, causal) for name, order in orders.items()}
    results["tree"] = _tree_fold(q, k, v, blocks, causal)
    results["one pass"] = _fold(q, k, v, [(0, S)], [0], causal)
    for name, (o, lse, *_) in results.items():
        assert_within(f"out {name}", o, ref, plain)
        assert_within(f"lse {name}", lse, ref_lse, plain_lse, sum_len=S)


@BOTH
def test_global_positions_and_invisible_blocks(backend):
    q, k, v = _qkv(48, seed=4)
    qs, ks = 1000, 1000  # any global offset
    state = SoftmaxState.empty(torch.full(q.shape, float("nan")))
    # keys entirely after every query: nothing launched, state stays empty
    assert not block_forward(q, k, v, state, BlockMask(qs, ks + 48, CAUSAL), scale=0.2, fold=False, normalize=True)
    assert torch.all(state.o == 0) and torch.all(state.lse() == float("-inf")) and torch.all(state.l == 0)
    # keys entirely before every query: no mask; equals non-causal attention
    block_forward(q, k, v, state, BlockMask(qs + 48, ks, CAUSAL), scale=0.2, fold=False, normalize=True)
    (ref, _), (plain, _) = _ref_and_plain(q, k, v, scale=0.2)
    assert_within("keys before every query", state.o, ref, plain)
    # a diagonal block at an offset equals the local causal block
    block_forward(q, k, v, state, BlockMask(qs + 5, ks, CAUSAL), scale=0.2, fold=False, normalize=True)
    pos = dict(q_pos=torch.arange(48) + 5, k_pos=torch.arange(48))
    (ref, ref_lse), (plain, plain_lse) = _ref_and_plain(q, k, v, scale=0.2, causal=True, **pos)
    assert_within("diagonal block at an offset", state.o, ref, plain)
    assert_within("its lse", state.lse(), ref_lse, plain_lse, sum_len=48)


@BOTH
@pytest.mark.parametrize("causal", [False, True])
def test_block_backward_accumulates_to_full_gradient(backend, causal):
    S, D = 60, 32
    q, k, v = _qkv(S, D=D, seed=5)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(qr, kr, vr, causal=causal)
    do = torch.randn_like(q)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (qr, kr, vr), do.double())
    qp, kp, vp = (t.clone().requires_grad_() for t in (q, k, v))  # the plain float32 computation
    plain = torch.autograd.grad(naive_attention(qp, kp, vp, causal=causal, dtype=q.dtype)[0], (qp, kp, vp), do)

    o, _, state = _fold(q, k, v, [(0, S)], [0], causal)
    delta = attention_delta(o, do)
    dq = torch.zeros(q.shape)
    dk = torch.zeros(k.shape)
    dv = torch.zeros(v.shape)
    scale = D**-0.5
    # query blocks x key blocks, in a shuffled order, accumulating in float32
    q_blocks, k_blocks = _split(S, 3, 6), _split(S, 4, 7)
    pairs = [(qb, kb) for qb in q_blocks for kb in k_blocks]
    random.Random(8).shuffle(pairs)
    for (qa, qb), (ka, kb) in pairs:
        block_backward(
            q[:, qa:qb],
            k[:, ka:kb],
            v[:, ka:kb],
            state.m[:, :, qa:qb],
            state.l[:, :, qa:qb],
            do[:, qa:qb],
            delta[:, :, qa:qb],
            dq[:, qa:qb],
            dk[:, ka:kb],
            dv[:, ka:kb],
            BlockMask(qa, ka, CAUSAL if causal else FULL),
            scale=scale,
            accumulate=True,
        )
    for name, got, ref_g, plain_g in zip(("dq", "dk", "dv"), (dq, dk, dv), (ref_dq, ref_dk, ref_dv), plain):
        assert_within(name, got, ref_g, plain_g)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_block_backward_16bit_on_row_views(backend):
    """A ring block's statistics are views of the rows of the whole local state; the 16-bit
    dK/dV pass (one combined offset per row) must read them as it reads contiguous copies."""
    S, D = 40, 32
    q, k, v = _qkv(S, D=D, dtype=torch.float16, seed=11)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(torch.float16)
    o, _, state = _fold(q, k, v, [(0, S)], [0], True)
    delta = attention_delta(o.to(torch.float16), do)
    qa, qb = 13, 37
    grads = []
    for copy in (False, True):
        stats = [state.m[:, :, qa:qb], state.l[:, :, qa:qb], delta[:, :, qa:qb]]
        if copy:
            stats = [t.contiguous() for t in stats]
        dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
        dq = torch.zeros(q[:, qa:qb].shape)
        block_backward(q[:, qa:qb], k, v, stats[0], stats[1], do[:, qa:qb], stats[2], dq, dk, dv,
                       BlockMask(qa, 0, CAUSAL), scale=D**-0.5, accumulate=True)  # fmt: skip
        grads.append((dq, dk, dv))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_dq_sum_adds_blocked_and_row_major_parts():
    """A ring call's dQ sum (ringflash.dq_sum.DQSum): the fused kernel's parts view the one
    blocked float32 buffer (rows from a multiple of 64, any heads; none for a 16-bit
    accumulator or rows off the blocks), the others the row-major one; result() scales and
    un-permutes the blocked sum (one Triton launch, here interpreted) and adds the row-major
    one, or writes the output dtype directly when nothing else was added."""
    from ringflash.dq_sum import DQSum
    from ringflash.kernels import gluon_backward as gb

    B, S, Hq, D = 2, 130, 4, 64
    g = torch.Generator().manual_seed(0)
    # integers: exact in every dtype and sum below (the interpreter rounds to 16 bits toward zero)
    x = torch.randint(-64, 64, (B, 192, Hq, D), generator=g).float()
    y = torch.randint(-64, 64, (B, S, Hq, D), generator=g).float()

    def fill(dq_sum):
        part = dq_sum.part(slice(64, S), slice(1, 3)).blocked()
        assert part.acc.shape == (B, 2, 128, D) and part.acc.data_ptr() == dq_sum.blocked()[:, 1, 64].data_ptr()
        assert dq_sum.part(slice(0, S)).blocked().acc.shape == (B, Hq, 192, D)
        gb.dq_natural_view(dq_sum.blocked()).copy_(x.view(B, 3, 4, 2, 8, Hq, 2, D // 16, 4, 2))

    both = DQSum((B, S, Hq, D), torch.float32, torch.device("cpu"), scale=0.5)
    fill(both)
    assert both.part(slice(10, 20)).blocked() is None  # off the 64-row blocks
    both.part(slice(0, S)).tensor().add_(y)
    assert torch.equal(both.result(torch.float32), 0.5 * x[:, :S] + y)
    assert both._blocked is None  # released
    alone = DQSum((B, S, Hq, D), torch.float32, torch.device("cpu"), scale=0.5)
    fill(alone)
    out = alone.result(torch.bfloat16)
    assert alone._natural is None and out.dtype == torch.bfloat16
    assert torch.equal(out, (0.5 * x[:, :S]).bfloat16())
    narrow = DQSum((B, S, Hq, D), torch.bfloat16, torch.device("cpu"), scale=0.5)
    assert narrow.part(slice(0, S)).blocked() is None  # a 16-bit accumulator: row-major only
    narrow.part(slice(0, S), slice(2, 4)).tensor().add_(y[:, :, 2:].bfloat16())
    assert torch.equal(narrow.result(torch.bfloat16)[:, :, 2:], y[:, :, 2:].bfloat16())


def test_block_backward_adds_to_a_dq_part_on_the_torch_backend():
    """block_backward given a DQPart on a backend that does not take parts (the torch one) adds
    to the part's row-major view, as it would to that view given directly; a part is only added
    to (accumulate=False: ValueError)."""
    from ringflash import reference
    from ringflash.dq_sum import DQSum

    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 40, 2, 16, generator=g, dtype=torch.float64) for _ in range(4))
    state = SoftmaxState.zeros((1, 40, 2, 16), torch.float64, q.device)
    block_forward(q, k, v, state, BlockMask(0, 0, CAUSAL), scale=0.25, fold=True, backend=reference)
    out = state.normalized(torch.float64)
    delta = attention_delta(out, do, backend=reference)
    rows_mask = BlockMask(8, 0, CAUSAL)  # query rows 8.. over every key
    args = (q[:, 8:], k, v, state.m[:, :, 8:], state.l[:, :, 8:], do[:, 8:], delta[:, :, 8:])
    want = torch.zeros(1, 40, 2, 16, dtype=torch.float64)
    block_backward(*args, want[:, 8:], None, None, rows_mask, scale=0.25, accumulate=True, backend=reference)
    dq = DQSum((1, 40, 2, 16), torch.float64, q.device, scale=0.25)
    block_backward(*args, dq.part(slice(8, 40)), None, None, rows_mask, scale=0.25, accumulate=True,
                   backend=reference)  # fmt: skip
    assert torch.equal(dq.result(torch.float64), want)
    with pytest.raises(ValueError, match="only added to"):
        block_backward(*args, dq.part(slice(8, 40)), None, None, rows_mask, scale=0.25, accumulate=False,
                       backend=reference)  # fmt: skip


@pytest.mark.parametrize(
    "shape,n,dtype",
    [
        ((2, 50, 3, 16), 37, torch.float32),
        ((1, 70, 8, 130), 70, torch.bfloat16),
        ((1, 9, 1, 5), 0, torch.float16),
        ((1, 0, 2, 4), 0, torch.float32),  # a rank that holds no token: no rows to gather into
    ],
)
def test_scatter_rows_matches_index_copy(shape, n, dtype):
    """kernels.scatter_rows (the Triton kernel, interpreted: a gathered ring's blocks into their
    global order) equals torch's index_copy_ (the torch backend's): batches, a row width that is
    no power of two, 16-bit rows, no rows at all (and none to gather into); a source with rows
    not contiguous (falls back to index_copy_); only the first len(rows) source rows move
    (blocks travel padded)."""
    from ringflash import kernels, reference

    g = torch.Generator().manual_seed(n)
    src = torch.randn(shape[0], n + 3, *shape[2:], generator=g).to(dtype)
    rows = torch.randperm(shape[1], generator=g)[:n]
    got, want = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    kernels.scatter_rows(got, rows, src)
    reference.scatter_rows(want, rows, src)
    assert torch.equal(got, want) and torch.equal(got[:, rows], src[:, :n])
    untouched = torch.ones(shape[1], dtype=torch.bool)
    untouched[rows] = False
    assert not got[:, untouched].any()
    strided = src.transpose(2, 3).contiguous().transpose(2, 3)  # rows' trailing dims not one run
    if shape[2] > 1 and n:
        again = torch.zeros(shape, dtype=dtype)
        kernels.scatter_rows(again, rows, strided)
        assert torch.equal(again, want)
