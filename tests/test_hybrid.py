"""Hybrid sequence parallelism over gloo: R x U grids of processes (heads by all-to-all inside
each head group of U ranks, the ring over R), against the float64 oracle. The 8-process grids
(2x4, 4x2) run in test_ring.py, beside its other 8-process tests (one set of processes)."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist

from ringflash import balanced_layout, local_positions, ring_flash_attn_func, shard, unshard
from ringflash.hybrid import head_plan

from hybrid_cases import grid, hybrid_precision, hybrid_varlen_vs_oracle, hybrid_vs_oracle
from oracle import assert_float64_agree, assert_within, dropout_factors, plain_errors, reference
from ring_cases import TORCH, full_inputs, sent_field_names

# (R, U) grids on 4 processes; heads chosen so both GQA cases occur: Hkv >= U (Hkv / U per
# rank) and Hkv < U (the needed kv head replicated, gradients summed back)
CASES4 = [
    (2, 2, "zigzag", True, 1, 3, 4, 2, None, 1),  # Hkv == U
    (2, 2, "zigzag", False, 2, 2, 4, 1, None, 2),  # MQA: Hkv < U
    (2, 2, "contiguous", True, 1, 3, 4, 4, "bool", 3),  # key padding travels with the keys
    (2, 2, "zigzag", True, 1, 2, 8, 2, "float", 4),
    (1, 4, "zigzag", True, 1, 2, 4, 2, None, 5),  # Hkv < U, no ring
    (1, 4, "contiguous", False, 1, 2, 8, 4, "bool", 6),
    (4, 1, "zigzag", True, 1, 2, 4, 2, None, 7),  # the plain ring through the hybrid path
    (4, 1, "contiguous", False, 2, 2, 2, 1, "float", 8),
]


def test_hybrid_packed_documents_all_whole(worlds):
    """Every document whole on its ring position (the layout needs one ring step), the shards
    of unequal lengths (20 and 26 tokens): K/V are not padded to the longer one and each
    position's ring call runs as the local one, under the head all-to-all."""
    lengths = [12, 9, 8, 6, 5, 2, 2, 2]
    L = balanced_layout([0, *itertools.accumulate(lengths)], 2)
    assert L.hops == 1 and sorted(L.local_len(r) for r in range(2)) == [20, 26]
    got = worlds(4, **TORCH).run(hybrid_varlen_vs_oracle, 2, 2, lengths, True, (-1, -1), 4, 2, torch.float64, 5)
    assert sum(n for n, _ in got) == sum(lengths)


@pytest.mark.parametrize(
    "case", CASES4, ids=lambda c: f"R{c[0]}xU{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}-{c[6]}x{c[7]}-{c[8]}"
)
def test_hybrid_4_ranks(worlds, case):
    worlds(4, **TORCH).run(hybrid_vs_oracle, *case)


@pytest.mark.parametrize("grid", [(2, 2, 4, 1), (1, 4, 4, 2)], ids=lambda g: f"R{g[0]}xU{g[1]}-{g[2]}x{g[3]}")
def test_hybrid_precision_with_replicated_kv_heads(worlds, grid):
    """bfloat16, Hkv < U: the replicated kv heads' gradients as accurate as one device's."""
    worlds(4, **TORCH).run(hybrid_precision, *grid)


def test_hybrid_without_lse(worlds):
    worlds(4, **TORCH).run(hybrid_vs_oracle, 2, 2, "zigzag", True, 1, 2, 4, 2, None, 9, False)


@pytest.mark.parametrize(
    "layout,causal,window_size", [("zigzag", True, (2, 0)), ("contiguous", False, (3, 5))], ids=["zigzag", "contiguous"]
)
def test_hybrid_window(worlds, layout, causal, window_size):
    """A sliding window with a head_group: the ring over the ring positions' whole shards
    (chunk 3 x U 2 = 6 rows per ring position and chunk), windows narrower than that."""
    worlds(4, **TORCH).run(hybrid_vs_oracle, 2, 2, layout, causal, 1, 3, 4, 2, "bool", 10, True, window_size)


def _mesh(rank, world):
    """A 2-D DeviceMesh as group: dim 0 the ring, dim 1 the heads; the same numbers as groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    group, head_group = grid(2, 2)
    q, k, v, _ = full_inputs(1, 16, 16, 4, 2, 16, torch.float32, 3)
    a = [shard(t, group=mesh) for t in (q, k, v)]
    b = [shard(t, group=group, head_group=head_group) for t in (q, k, v)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(
        ring_flash_attn_func(*a, causal=True, group=mesh),
        ring_flash_attn_func(*b, causal=True, group=group, head_group=head_group),
    )
    assert torch.equal(unshard(a[0], group=mesh), q)
    assert torch.equal(local_positions(16, group=mesh), local_positions(16, group=group, head_group=head_group))


def test_device_mesh(worlds):
    worlds(4, **TORCH).run(_mesh)


def test_token_mapping_documented():
    """R = 2, U = 2, S = 16, zigzag: ring position r holds chunks r and 3 - r of 4; each head
    group cuts that shard in two, in group-rank order (the README's example)."""
    from ringflash.schedule import global_positions

    ring = [global_positions("zigzag", r, 2, 8) for r in range(2)]
    assert ring == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    # (r, u) -> ring[r][u * 4:(u + 1) * 4], which shard/local_positions give (test_hybrid_4_ranks)


def test_head_plan():
    p = head_plan(8, 4, 2, "t")
    assert [p.q_of(u) for u in range(2)] == [slice(0, 4), slice(4, 8)]
    assert [p.kv_of(u) for u in range(2)] == [slice(0, 2), slice(2, 4)]
    p = head_plan(8, 2, 4, "t")  # two ranks per kv head
    assert [p.kv_of(u) for u in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    for u in range(4):  # every rank's q heads are in its kv head's group
        qh = p.q_of(u)
        assert {h // 4 for h in range(qh.start, qh.stop)} == {p.kv_of(u).start}
    with pytest.raises(ValueError, match=r"q heads 6 .* not divisible by 4.*sizes that work: \[1, 2, 3, 6\]"):
        head_plan(6, 6, 4, "t")
    with pytest.raises(ValueError, match=r"k/v heads 6.*divide neither way.*\[1, 2, 3, 6, 12\]"):
        head_plan(12, 6, 4, "t")


def test_head_group_without_group():
    q = torch.randn(1, 8, 2, 16)
    # a stand-in of a group's type without a process group: what new_group gives outside its ranks
    head_group = dist.GroupMember.NON_GROUP_MEMBER
    with pytest.raises(ValueError, match="head_group given without group"):
        ring_flash_attn_func(q, q, q, head_group=head_group)
    for fn in (shard, unshard):
        with pytest.raises(ValueError, match="head_group given without group"):
            fn(q, head_group=head_group)
    with pytest.raises(ValueError, match="head_group given without group"):
        local_positions(8, head_group=head_group)
    with pytest.raises(TypeError, match="head_group must be None, a torch.distributed ProcessGroup"):
        local_positions(8, head_group=object())


def _expect_raise(fn, pattern):
    import re

    try:
        fn()
    except ValueError as e:
        assert re.search(pattern, str(e)), str(e)
        return str(e)
    raise AssertionError(f"no ValueError (wanted {pattern!r})")


def _errors(rank, world):
    """Bad input on one rank, or groups that do not form a grid: every rank raises (no hang)."""
    group, head_group = grid(2, 2)
    q = torch.randn(1, 4, 4, 16)
    k = torch.randn(1, 4, 2, 16)
    call = lambda q, k, **kw: lambda: ring_flash_attn_func(q, k, k, group=group, **{"head_group": head_group, **kw})
    # Hkv = 3 fits no U = 2 split, on rank 3 only: its message reaches every rank of the grid
    bad = rank == 3
    qq, k3 = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 3, 16)
    _expect_raise(call(qq if bad else q, k3 if bad else k), r"head_group sizes that work: \[1, 3, 6\]")
    # a local length that differs on one rank
    q6, k6 = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16)
    _expect_raise(call(q6 if rank == 0 else q, k6 if rank == 0 else k), r"q local length: rank 0=6")
    # the causal flag on one rank: found on its ring (rank 2 its second rank), quoted on the others
    _expect_raise(call(q, k, causal=rank == 2), r"causal / window_size right: rank 0=-1 \(not causal\), rank 1=0 \(c")
    # the same group given as ring and heads: its ranks sit at different ring positions
    _expect_raise(call(q, k, head_group=group), r"rank in head_group: rank 0=0, rank 1=1")
    # U differing between ring positions: ranks 0, 1 in one head group, ranks 2, 3 alone
    solo = [dist.new_group([i]) for i in range(world)][rank]
    _expect_raise(call(q, k, head_group=head_group if rank < 2 else solo), r"head_group size: rank 0=2, rank 1=1")
    # lengths that do not divide into 2RU chunks
    _expect_raise(
        lambda: shard(torch.randn(1, 12, 2, 16), group=group, head_group=head_group), r"multiple of 8 \(e.g. 8 or 16\)"
    )
    # unshard of a balanced layout's pieces with a wrong length on rank 3 alone: the whole grid
    # raises (before, its head group raised while the other head group waited in the ring's gather)
    L = balanced_layout([0, 7, 20], 2)
    n = L.head_piece_lens(rank // 2, 2)[rank % 2]
    piece = torch.zeros(n + (rank == 3), 2)
    _expect_raise(lambda: unshard(piece, group=group, head_group=head_group, layout=L, dim=0), r"rejected|gives ring")
    _expect_raise(  # and a dtype differing on rank 0 alone
        lambda: unshard(torch.zeros(n, 2, dtype=torch.float64 if rank == 0 else torch.float32), group=group,
                        head_group=head_group, layout=L, dim=0),
        r"disagree \(dtype",
    )  # fmt: skip
    # still usable afterwards: the grid is in step
    assert unshard(torch.zeros(n, 2), group=group, head_group=head_group, layout=L, dim=0).shape == (20, 2)
    out = ring_flash_attn_func(q, k, k, group=group, head_group=head_group, causal=True)
    assert out.shape == q.shape


def test_errors_raise_on_every_rank(worlds):
    worlds(4, **TORCH).run(_errors)


def _head_group_on_one_head_group(rank, world):
    """On a 2 x 2 grid, the ranks of one head group (2 and 3) not given it, or given one they
    cannot use: every ring then holds a rank without it, and every rank raises at the ring's
    first all_gather (where a plain call agrees), naming head_group, instead of ranks 0 and 1
    waiting for ranks 2 and 3 over their head group or the ring."""
    from torch.distributed.device_mesh import init_device_mesh

    group, head_group = grid(2, 2)
    mesh = init_device_mesh("cpu", (2, 2))
    q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 2, 16)
    lost = rank >= 2
    given = r"disagree \(head_group size: rank 0=2, rank 1=none.*head_group given on rank\(s\) \[0\] of the group only"
    _expect_raise(lambda: ring_flash_attn_func(q, k, k, group=group, head_group=None if lost else head_group), given)
    _expect_raise(
        lambda: ring_flash_attn_func(q, k, k, group=group, head_group=mesh if lost else head_group),
        r"head_group as a DeviceMesh must be 1-D"
        if lost
        else rf"global rank\(s\) \[{rank + 2}\] .*\(rank {rank + 2}: .*head_group as a DeviceMesh must be 1-D",
    )
    _expect_raise(lambda: unshard(torch.zeros(1, 4), group=group, head_group=None if lost else head_group), given)
    # the grid still works afterwards
    assert ring_flash_attn_func(q, k, k, group=group, head_group=head_group, causal=True).shape == q.shape


def test_head_group_missing_on_a_head_group_raises_on_every_rank(worlds):
    worlds(4, timeout=120, **TORCH).run(_head_group_on_one_head_group)


def _placement(rank, world):
    """With torchrun's LOCAL_WORLD_SIZE saying 2 GPUs per node: the usual grid (head groups of
    consecutive ranks) warns of nothing; the transposed one (head groups {0, 2} and {1, 3}, each
    across both nodes) warns once per pair of groups, naming the head group."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # this worker runs later tests too: restored below
    try:
        _placement_cases(rank)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def _placement_cases(rank):
    import warnings

    good_ring, good_heads = grid(2, 2)
    rings = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the grid with the roles swapped
    heads = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    bad_ring, bad_heads = rings[rank // 2], heads[rank % 2]
    q = torch.randn(1, 4, 4, 16, generator=torch.Generator().manual_seed(rank))
    for ring, heads_, want in ((good_ring, good_heads, 0), (bad_ring, bad_heads, 1), (bad_ring, bad_heads, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ring_flash_attn_func(q, q, q, group=ring, head_group=heads_, causal=True)
        said = [str(w.message) for w in caught if "ringflash:" in str(w.message)]
        assert len(said) == want, said  # once per pair of groups, not per call
        assert all("span nodes" in m for m in said), said


def test_placement_warns_of_head_groups_across_nodes(worlds):
    worlds(4, **TORCH).run(_placement)


def test_placement_problems():
    """comm.placement_problems by hand: nodes of 4 GPUs."""
    from ringflash.comm import placement_problems

    assert placement_problems([0, 4, 8, 12], [0, 1, 2, 3], 4) == []  # one node per head group, one crossing per node
    assert placement_problems([0, 1, 2, 3], None, 4) == []  # a ring inside one node crosses nothing
    assert placement_problems([0, 1, 4, 5], None, 4) == []  # two nodes: two crossings per turn, the least
    (ring,) = placement_problems([0, 4, 1, 5], None, 4)  # alternating: four crossings where two do
    assert "crosses between nodes 4 times per turn where 2 would do" in ring
    (heads,) = placement_problems([0, 1], [2, 6], 4)
    assert "head_group ranks [2, 6] span nodes [0, 1]" in heads


def _module(rank, world):
    """RingMultiheadAttention with a head_group: the unsharded output is nn.MultiheadAttention's
    on the whole sequence (float64, causal, padded keys)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ringflash.nn import RingMultiheadAttention

    group, head_group = grid(2, 2)
    torch.manual_seed(0)
    E, H, S = 64, 4, 16
    ring = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.float64, group=group, head_group=head_group)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ref.load_state_dict(ring.state_dict())
    x = torch.randn(2, S, E, dtype=torch.float64)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, 3] = pad[0, 9] = True
    sh = lambda t: shard(t, group=group, head_group=head_group)
    out, _ = ring(sh(x), sh(x), sh(x), key_padding_mask=sh(pad), is_causal=True, need_weights=False)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    want, _ = ref(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=False)
    got = unshard(out, group=group, head_group=head_group)
    assert_float64_agree("out", got, want, E)  # float64 both: its ulps over the longest sum, a projection's
    # a rank whose input fails before the call sends the fields that the other ranks' calls send
    xs = sh(x)
    early = sent_field_names(lambda: ring(xs, xs, xs, need_weights=True), "agree_across_grid")
    assert early == sent_field_names(lambda: ring(xs, xs, xs, need_weights=False), "agree_across_grid")
    # need_weights=True (not supported with a head group) on rank 0 alone: rank 0 raises its
    # NotImplementedError, the others quote it, none waits in the grid's agreement
    error, text = (NotImplementedError, "need_weights=True") if rank == 0 else (ValueError, r"rank\(s\) \[0\]")
    with pytest.raises(error, match=text):
        ring(sh(x), sh(x), sh(x), is_causal=True, need_weights=rank == 0)
    out_again, _ = ring(sh(x), sh(x), sh(x), key_padding_mask=sh(pad), is_causal=True, need_weights=False)
    assert torch.equal(out_again, out)  # the grid still in step
    # the same grid as a 2-D DeviceMesh (ring dim, head dim): the same groups, the same output
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    by_mesh = RingMultiheadAttention(E, H, batch_first=True, dtype=torch.float64, group=mesh)
    by_mesh.load_state_dict(ring.state_dict())
    assert [dist.get_process_group_ranks(g) for g in (by_mesh.group, by_mesh.head_group)] == [
        dist.get_process_group_ranks(g) for g in (group, head_group)
    ]
    got_mesh, _ = by_mesh(sh(x), sh(x), sh(x), key_padding_mask=sh(pad), is_causal=True, need_weights=False)
    assert torch.equal(got_mesh, out)
    with pytest.raises(ValueError, match="RingMultiheadAttention: group as a DeviceMesh must be 1-D, or 2-D"):
        RingMultiheadAttention(E, H, group=mesh, head_group=head_group)


def _rejection_quoted_once(rank, world):
    """A 2 x 2 grid where global rank 1 rejects its input: every other rank raises a
    ValueError naming global rank 1 and quoting its message once (the stages that relay it
    send its origin on, not a quote of a quote); the grid still works after."""
    group, head_group = grid(2, 2)
    q = torch.randn(1, 8, 4, 264 if rank == 1 else 16)
    call = lambda q: ring_flash_attn_func(q, q, q, causal=True, group=group, head_group=head_group)  # noqa: E731
    with pytest.raises(ValueError) as caught:
        call(q)
    message = str(caught.value)
    if rank == 1:
        assert "head_dim 264" in message and "rejected" not in message, message
    else:
        assert re.search(r"global rank\(s\) \[1\] of the group rejected their inputs \(rank 1: .*head_dim 264", message)
        assert message.count("rejected their inputs") == 1 and message.count("head_dim 264") == 1, message
    assert call(q[..., :16]).shape == (1, 8, 4, 16)


def test_rejection_quoted_once_across_the_grid(worlds):
    worlds(4, **TORCH).run(_rejection_quoted_once)


def test_module_with_head_group(worlds):
    worlds(4, **TORCH).run(_module)


def _second_order(rank, world):
    """A gradient penalty through the ring and through heads by all-to-all: the first-order
    gradients come back, differentiating them raises on every rank."""
    q, k, v, _ = full_inputs(1, 4 * world, 4 * world, 4, 2, 8, torch.float64, 3)
    for group, head_group in ((dist.group.WORLD, None), grid(1, world)):
        leaf = shard(q, group=group, head_group=head_group).clone().requires_grad_()
        kv = [shard(t, group=group, head_group=head_group) for t in (k, v)]
        out = ring_flash_attn_func(leaf, *kv, causal=True, group=group, head_group=head_group)
        (dq,) = torch.autograd.grad(out.sum(), leaf, create_graph=True)
        with pytest.raises(RuntimeError, match="first order only"):
            (dq.square().sum() + out.sum()).backward()


def test_second_order_gradients_raise_on_every_rank(worlds):
    worlds(2, **TORCH).run(_second_order)


def _hybrid_dropout(rank, world, R, U, layout):
    """Dropout with a head_group: the pairs one device drops (global query heads), every rank of
    the grid on the first rank's seed although their generators differ."""
    from ringflash.dropout import draw_seed

    group, head_group = grid(R, U)
    B, S, Hq, Hkv, D, p = 1, 8 * world, 4, 2, 8, 0.3
    q, k, v, do = full_inputs(B, S, S, Hq, Hkv, D, torch.float64, 5)
    seed = draw_seed(torch.Generator().manual_seed(50))
    mine = torch.Generator().manual_seed(50 + rank)
    sh = lambda t: shard(t, group=group, head_group=head_group, layout=layout)  # noqa: E731
    leaves = [sh(t).clone().requires_grad_() for t in (q, k, v)]
    out = ring_flash_attn_func(
        *leaves, causal=True, group=group, head_group=head_group, layout=layout, dropout_p=p, generator=mine
    )
    grads = torch.autograd.grad(out, leaves, sh(do))
    kw = dict(causal=True, drop=dropout_factors(seed, p, B, Hq, S, S))
    ref = reference(q, k, v, do, **kw)
    plain = plain_errors(q, k, v, do, ref, **kw)
    for name, got, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
        assert_within(name, got, sh(r), plain[name])


@pytest.mark.parametrize("R,U,layout", [(2, 2, "zigzag"), (1, 4, "contiguous")])
def test_hybrid_dropout_same_pairs_as_one_device(worlds, R, U, layout):
    worlds(4, **TORCH).run(_hybrid_dropout, R, U, layout)


@pytest.mark.parametrize(
    "R,U,causal,window_size,Hq,Hkv,dtype",
    [
        (2, 2, True, (-1, -1), 4, 2, torch.float64),  # kv heads split over the head group
        (2, 2, True, (6, 0), 4, 1, torch.float64),  # a window; the kv head replicated
        (1, 4, False, (-1, -1), 4, 2, torch.float16),  # replicated kv heads in 16-bit (one rounding)
        (4, 1, True, (-1, -1), 2, 1, torch.float64),  # the plain varlen ring through the hybrid path
    ],
)
def test_hybrid_packed_documents(worlds, R, U, causal, window_size, Hq, Hkv, dtype):
    """ring_flash_attn_varlen_func with a head_group equals one device's packed attention
    (float64 oracle, 2x the plain same-dtype error); ring shards that do not divide by U are cut
    into pieces one token apart."""
    lengths = [3, 0, 90, 1, 7, 20, 6]  # 127 tokens: the 90-token document crosses ring positions
    got = worlds(4, **TORCH).run(hybrid_varlen_vs_oracle, R, U, lengths, causal, window_size, Hq, Hkv, dtype, 3)
    assert sum(n for n, _ in got) == sum(lengths)
    assert any(unequal for _, unequal in got) == (U > 1)  # the unequal-pieces path is exercised


@pytest.mark.parametrize("R,U,named", [(2, 2, "zigzag"), (4, 1, "contiguous")])
def test_hybrid_packed_documents_on_a_named_layout(worlds, R, U, named):
    """Packed documents on a named layout with a head_group: 128 tokens, divisible by 2 x R x U."""
    lengths = [3, 0, 90, 1, 7, 20, 7]
    got = worlds(4, **TORCH).run(hybrid_varlen_vs_oracle, R, U, lengths, True, (-1, -1), 4, 2, torch.float64, 3, named)
    assert [n for n, _ in got] == [128 // (R * U)] * 4


def counted_calls(rank, world, cases):
    """{case: {operator: FLOPs}} of this rank's ring and hybrid calls under FlopCounterMode, forward
    and backward: (name, R, U, layout, causal, window_size, packed document lengths or None)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ringflash import ring_flash_attn_varlen_func

    results = {}
    for name, R, U, layout, causal, window_size, lengths in cases:
        group, head_group = grid(R, U)
        H, D, Dv = 4, 8, 16
        kw = dict(causal=causal, window_size=window_size, group=group, head_group=head_group if U > 1 else None)
        if lengths is None:
            S = 32
            q, k, _, _ = full_inputs(2, S, S, H, 2, D, torch.float32, 0)
            v = torch.randn(2, S, 2, Dv)
            sh = lambda t: shard(t, layout=layout, **{a: kw[a] for a in ("group", "head_group")})  # noqa: E731
            ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
            call = lambda: ring_flash_attn_func(ql, kl, vl, layout=layout, **kw)  # noqa: E731
        else:
            cu = [0, *itertools.accumulate(lengths)]
            layout = balanced_layout(cu, R, causal=causal, window_size=window_size)
            sh = lambda t: shard(t, dim=0, layout=layout, **{a: kw[a] for a in ("group", "head_group")})  # noqa: E731
            ql, kl = (sh(torch.randn(cu[-1], H, D)).requires_grad_() for _ in range(2))
            vl = sh(torch.randn(cu[-1], H, Dv)).requires_grad_()
            cu_t = torch.tensor(cu, dtype=torch.int32)
            call = lambda: ring_flash_attn_varlen_func(ql, kl, vl, cu_t, layout=layout, **kw)  # noqa: E731
        with FlopCounterMode(display=False) as counter:
            call().sum().backward()
        results[name] = {str(op).split(".")[1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    return results


def test_ring_and_hybrid_flops_add_up_to_the_sequence(worlds):
    """Each rank counts its queries against every key; the ranks' counts add up to the whole
    sequence's (the pairs counted one by one from a boolean mask), heads split by the head group."""
    from test_dispatch_modes import mask_pairs

    lengths = [11, 3, 0, 9, 13]
    cases = [
        ("ring-zigzag-causal", 4, 1, "zigzag", True, (-1, -1), None),
        ("ring-contiguous-window", 4, 1, "contiguous", False, (5, 2), None),
        ("hybrid-zigzag-causal", 2, 2, "zigzag", True, (-1, -1), None),
        ("ring-packed-window", 4, 1, None, True, (6, -1), lengths),
        ("hybrid-packed", 2, 2, None, True, (-1, -1), lengths),
    ]
    by_rank = worlds(4, **TORCH).run(counted_calls, cases)
    H, D, Dv = 4, 8, 16
    for name, _, U, _, causal, (left, right), lengths in cases:
        right = 0 if causal else right
        if lengths is None:
            pairs = 2 * mask_pairs(range(32), range(32), left, right)
        else:
            docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            pairs = mask_pairs(range(sum(lengths)), range(sum(lengths)), left, right, docs, docs)
        op = "ring" if U == 1 else "hybrid"
        got = {key: sum(counts[name][key] for counts in by_rank) for key in by_rank[0][name]}
        want = {f"{op}_fwd": 2 * pairs * H * (D + Dv), f"{op}_bwd": 2 * pairs * H * (3 * D + 2 * Dv)}
        assert got == want, (name, [counts[name] for counts in by_rank])
