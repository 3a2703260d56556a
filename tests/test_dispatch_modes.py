"""Under a torch dispatch mode every call runs as its operators, which the mode sees:
FlopCounterMode's counts (ringflash.flops: the closed forms against pairs counted one by one
from a boolean mask, and each public call's operators), selective activation checkpointing's
choice. The ring and hybrid calls over processes are counted in test_hybrid.py (its gloo
world)."""

import itertools
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ringflash import balanced_layout, flash_attn_func, flash_attn_varlen_func
from ringflash.balance import _pairs
from ringflash.flops import ring_pairs
from ringflash.masks import Window
from ringflash.nn import RingMultiheadAttention

OPS = torch.ops.ringflash


def mask_pairs(q_pos, k_pos, left=-1, right=-1, q_doc=None, k_doc=None) -> int:
    """(query, key) pairs with k in [q - left, q + right] (-1: unbounded) and, when given, the
    same document: counted from the full boolean matrix."""
    q_pos, k_pos = torch.as_tensor(q_pos)[:, None], torch.as_tensor(k_pos)[None, :]
    seen = torch.ones(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool)
    if left >= 0:
        seen &= k_pos >= q_pos - left
    if right >= 0:
        seen &= k_pos <= q_pos + right
    if q_doc is not None:
        seen &= torch.as_tensor(q_doc)[:, None] == torch.as_tensor(k_doc)[None, :]
    return int(seen.sum())


def counted(fn) -> dict:
    """{operator name: FLOPs} of fn() under FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op).removeprefix("ringflash."): n for op, n in counter.get_flop_counts()["Global"].items()}


def window_ints(window: Window) -> tuple[int, int]:
    return tuple(-1 if w is None else w for w in (window.left, window.right))


def test_pair_count_over_any_positions():
    """balance._pairs, the closed form the counts use, at negative positions and wide windows too."""
    rng = random.Random(0)
    for _ in range(400):
        q_lo, k_lo = rng.randint(-20, 20), rng.randint(-20, 20)
        q_hi, k_hi = q_lo + rng.randint(0, 25), k_lo + rng.randint(0, 25)
        window = Window(rng.choice([None, 0, 1, 3, 17]), rng.choice([None, 0, 2, 9]))
        want = mask_pairs(range(q_lo, q_hi), range(k_lo, k_hi), *window_ints(window))
        assert _pairs(q_lo, q_hi - q_lo, k_lo, k_hi - k_lo, window) == want, (q_lo, q_hi, k_lo, k_hi, window)


@pytest.mark.parametrize("window", [Window(), Window(None, 0), Window(5, 0), Window(3, 4)], ids=str)
def test_ring_pairs_over_the_ranks_are_the_sequence(window):
    """Every query sits on one rank: the ranks' counts add up to the whole sequence's."""
    S = 48
    for layout, world in itertools.product(["zigzag", "contiguous"], [1, 2, 3, 4]):
        want = mask_pairs(range(S), range(S), *window_ints(window))
        got = [ring_pairs(layout, r, world, S // world, S, window) for r in range(world)]
        assert sum(got) == want, (layout, world, got)
    cu = [0, 13, 14, 30, 30, 48]
    docs = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    want = mask_pairs(range(S), range(S), *window_ints(window), docs, docs)
    for world in (1, 2, 3):
        layout = balanced_layout(cu, world, causal=window.right == 0, window_size=window_ints(window))
        got = [ring_pairs(layout, r, world, layout.local_len(r), S, window) for r in range(world)]
        assert sum(got) == want, (world, got)


def forward_flops(pairs, Hq, D, Dv):
    return 2 * pairs * Hq * (D + Dv)


def backward_flops(pairs, Hq, D, Dv):
    return 2 * pairs * Hq * (3 * D + 2 * Dv)


CASES = [  # B, Sq, Sk, Hq, Hkv, D, Dv, causal, window_size
    (2, 24, 24, 4, 2, 16, 16, False, (-1, -1)),
    (1, 24, 24, 2, 2, 16, 8, True, (-1, -1)),
    (1, 16, 40, 3, 1, 8, 8, True, (-1, -1)),  # bottom-right: query i at key position i + 24
    (2, 40, 16, 2, 1, 8, 16, True, (-1, -1)),  # the first 24 queries see nothing
    (1, 32, 32, 2, 2, 16, 16, False, (5, 2)),
    (1, 32, 32, 2, 2, 16, 16, True, (7, 0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_flash_counts_the_pairs_its_mask_keeps(case):
    B, Sq, Sk, Hq, Hkv, D, Dv, causal, window_size = case
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=g, requires_grad=True)
    k = torch.randn(B, Sk, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, Sk, Hkv, Dv, generator=g, requires_grad=True)
    left, right = window_size[0], 0 if causal else window_size[1]
    pairs = B * mask_pairs(torch.arange(Sq) + Sk - Sq, range(Sk), left, right)

    def call():
        flash_attn_func(q, k, v, causal=causal, window_size=window_size).sum().backward()

    want = {"flash_fwd": forward_flops(pairs, Hq, D, Dv), "flash_bwd": backward_flops(pairs, Hq, D, Dv)}
    assert counted(call) == want  # nothing else: the operators' own aten calls are not counted again


def test_dropout_and_key_padding_count_as_the_plain_call():
    q = torch.randn(2, 24, 2, 16, requires_grad=True)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[:, 20:] = True
    plain = counted(lambda: flash_attn_func(q, q, q, causal=True).sum().backward())
    assert counted(lambda: flash_attn_func(q, q, q, causal=True, dropout_p=0.3).sum().backward()) == plain
    assert counted(lambda: flash_attn_func(q, q, q, causal=True, key_padding_mask=mask).sum().backward()) == plain


@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 3))])
def test_varlen_counts_each_document(causal, window_size):
    cu_q, cu_k = [0, 5, 5, 17, 20], [0, 9, 12, 20, 20]  # an empty document on each side
    H, D = 2, 8
    q = torch.randn(cu_q[-1], H, D, requires_grad=True)
    k, v = (torch.randn(cu_k[-1], H, D, requires_grad=True) for _ in range(2))
    right = 0 if causal else window_size[1]
    pairs = 0
    for d in range(len(cu_q) - 1):  # bottom-right per document
        shift = cu_k[d + 1] - cu_q[d + 1]
        pairs += mask_pairs(torch.arange(cu_q[d], cu_q[d + 1]) + shift, range(cu_k[d], cu_k[d + 1]),
                            window_size[0], right)  # fmt: skip
    cq, ck = torch.tensor(cu_q), torch.tensor(cu_k)

    def call():
        flash_attn_varlen_func(q, k, v, cq, ck, causal=causal, window_size=window_size).sum().backward()

    assert counted(call) == {"flash_fwd": forward_flops(pairs, H, D, D), "flash_bwd": backward_flops(pairs, H, D, D)}


def test_meta_and_fake_tensors_count_as_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = (2, 32, 4, 16)
    real = counted(lambda: flash_attn_func(*(torch.randn(shape) for _ in range(3)), causal=True))
    assert real == {"flash_fwd": forward_flops(2 * 32 * 33 // 2, 4, 16, 16)}
    assert counted(lambda: flash_attn_func(*(torch.empty(shape, device="meta") for _ in range(3)), causal=True)) == real
    with FakeTensorMode():
        fake = [torch.empty(shape) for _ in range(3)]
        assert counted(lambda: flash_attn_func(*fake, causal=True)) == real


def test_meta_documents_count_as_one_sequence():
    """cu_seqlens of no values: the documents are unknown, the call counts as one sequence."""
    q = torch.empty(20, 2, 8, device="meta")
    cu = torch.tensor([0, 8, 20], device="meta")
    got = counted(lambda: flash_attn_varlen_func(q, q, q, cu, cu, max_seqlen_q=12, max_seqlen_k=12, causal=True))
    assert got == {"flash_fwd": forward_flops(20 * 21 // 2, 2, 8, 8)}


def test_module_counts_its_attention_beside_its_projections():
    E, H, L, B = 32, 4, 24, 2
    mha = RingMultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, L, E)
    got = counted(lambda: mha(x, x, x, need_weights=False, is_causal=True, attn_mask=torch.ones(L, L).triu(1).bool()))
    pairs = B * L * (L + 1) // 2
    assert got.pop("ring_fwd") == forward_flops(pairs, H, E // H, E // H)  # one rank: a ring of one
    assert sum(got.values()) == 2 * B * L * E * 4 * E, got  # the in (3E x E) and out (E x E) projections


@pytest.mark.parametrize("save", [True, False])
def test_selective_checkpointing_saves_or_recomputes_the_attention(save, monkeypatch):
    """A checkpoint policy sees ringflash.flash_fwd and is obeyed: saved, the attention's
    forward runs once; recomputed, again in the backward. The gradients are the plain call's."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from ringflash import local

    runs, forward = [], local._FlashAttn.forward
    monkeypatch.setattr(local._FlashAttn, "forward", staticmethod(lambda *a: runs.append(1) or forward(*a)))

    def policy(ctx, op, *args, **kwargs):
        keep = save and op == OPS.flash_fwd.default
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    q = torch.randn(1, 40, 2, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    f = lambda q: flash_attn_func(q @ w, q @ w, q, causal=True)  # noqa: E731
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    got = torch.autograd.grad(checkpoint(f, q, use_reentrant=False, context_fn=context).square().sum(), (q, w))
    assert len(runs) == (1 if save else 2)
    want = torch.autograd.grad(f(q).square().sum(), (q, w))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
