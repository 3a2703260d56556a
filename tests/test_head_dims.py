"""Any head dim from 1 to 256, and empty inputs, in flash_attn_func, flash_attn_varlen_func and
the ring, against the float64 oracle (both backends; the Triton kernels under the interpreter)."""

import math

import pytest
import torch
from test_local import _check, _inputs
from test_ring_varlen import _ring_varlen_vs_oracle
from test_varlen import _check_varlen

from ringflash import flash_attn_func, flash_attn_varlen_func, ring_flash_attn_func, shard

from hybrid_cases import hybrid_vs_oracle
from oracle import assert_within, plain_errors, reference
from ring_cases import TORCH, TRITON, Case, ring_vs_oracle

BOTH = pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)


@pytest.mark.parametrize(
    "backend,D",
    [("torch", D) for D in (1, 2, 3, 5, 8, 12, 17, 36, 100, 255)] + [("triton", D) for D in (1, 3, 12, 36, 255)],
    indirect=["backend"],
)
def test_any_head_dim(backend, D):
    """Padded inside to a power of two >= 16 (zero columns): scores, the default scale
    1/sqrt(D) and the output columns are those of the true D; gradients too."""
    dtypes = [torch.float32, torch.float16] if backend == "triton" else [torch.float32, torch.float64]
    for dtype in dtypes:
        for causal in (False, True):
            _check(*_inputs(2, 19, 23, 4, 2, D, dtype, seed=D), causal)


@BOTH
@pytest.mark.parametrize("D", [1, 6, 20])
def test_any_head_dim_key_padding_and_scale(backend, D):
    q, k, v = _inputs(1, 21, 21, 2, 1, D, torch.float32, seed=D + 1)
    mask = torch.rand(1, 21, generator=torch.Generator().manual_seed(D)) < 0.3
    _check(q, k, v, True, scale=0.3, key_padding_mask=mask)


@BOTH
@pytest.mark.parametrize("D", [1, 7, 44])
def test_varlen_any_head_dim(backend, D):
    _check_varlen([7, 20, 0, 11], [9, 20, 3, 11], True, (-1, -1), D=D, seed=D)


def test_default_scale_is_the_true_head_dim():
    """The padding must not change the scale: softmax_scale=None equals 1/sqrt(D) explicitly."""
    q, k, v = _inputs(1, 9, 9, 2, 2, 3, torch.float64, seed=0)
    a = flash_attn_func(q, k, v)
    b = flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("D", [1, 5, 12])
def test_ring_any_head_dim_torch(worlds, world, D):
    for layout in ("zigzag", "contiguous"):
        worlds(world, **TORCH).run(ring_vs_oracle, Case(layout, True, 2, 3, 4, 2, D, torch.float32, seed=D))


@pytest.mark.parametrize("D", [3, 12])
def test_ring_any_head_dim_triton(worlds, D):
    case = Case("zigzag", True, 1, 6, 2, 1, D, torch.float32, seed=D, mask="bool")
    worlds(2, **TRITON).run(ring_vs_oracle, case)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
@pytest.mark.parametrize(
    "B,Sq,Sk,Hq,Hkv", [(0, 5, 5, 2, 1), (2, 0, 5, 2, 1), (2, 5, 0, 2, 1), (2, 0, 0, 2, 2), (2, 5, 5, 0, 1)]
)
def test_empty_inputs(backend, B, Sq, Sk, Hq, Hkv):
    """No batch, no query or no heads: empty outputs; no key: out 0, lse -inf; gradients flow
    (zeros, of the inputs' shapes), as torch's own attention on empty tensors. The result is
    known before any backend is chosen (ringflash.empty): one backend's run covers both."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, 8, generator=g).requires_grad_()
    k, v = (torch.randn(B, Sk, Hkv, 8, generator=g).requires_grad_() for _ in range(2))
    for fn in (flash_attn_func, ring_flash_attn_func):
        out, lse = fn(q, k, v, causal=Sq == Sk, return_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, Hq, Sq)
        assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
        grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        for g_, t in zip(grads, (q, k, v)):
            assert g_.shape == t.shape and not g_.any()
    if B == 1 or B == 0:
        return
    # varlen: documents whose rows or keys are all empty
    cu_q = torch.tensor([0, Sq], dtype=torch.int32)
    cu_k = torch.tensor([0, Sk], dtype=torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k)
    assert out.shape == q[0].shape and not out.any()


def _ring_empty(rank, world):
    q = torch.randn(0, 4, 2, 8)
    out = ring_flash_attn_func(q, q, q, causal=True)
    assert out.shape == q.shape


def test_ring_empty_batch(worlds):
    worlds(2, **TORCH).run(_ring_empty)


# ----------------------------------------------------------------------------- v's own head dim
# q, k (.., D) and v (.., Dv) with D != Dv (MLA: 192 and 128): out and dv are (.., Dv), the
# default scale stays 1/sqrt(D) (the oracle's naive_attention uses q's last dim).


def _qkv(B, Sq, Sk, Hq, Hkv, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda S, H, d: torch.randn(B, S, H, d, generator=g).to(dtype).requires_grad_()
    return mk(Sq, Hq, D), mk(Sk, Hkv, D), mk(Sk, Hkv, Dv)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
@pytest.mark.parametrize("D,Dv", [(24, 16), (16, 40), (192, 128)])
def test_v_head_dim_differs_torch(backend, D, Dv):
    """out, lse, dq, dk, dv within 2x the plain same-dtype error of float64; GQA, causal or not."""
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            _check(*_qkv(2, 19, 23, 4, 2, D, Dv, dtype, seed=D + Dv), causal)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize(
    "D,Dv,dtype,causal",
    [(24, 16, torch.float32, False), (24, 16, torch.float16, True), (16, 40, torch.float16, False),
     (16, 40, torch.float32, True)],
)  # fmt: skip
def test_v_head_dim_differs_triton(backend, D, Dv, dtype, causal):
    """The kernels with BLOCK_DV != BLOCK_D (interpreter; bf16 is the GPU test's)."""
    _check(*_qkv(1, 19, 37, 4, 2, D, Dv, dtype, seed=D * Dv), causal)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_v_head_dim_differs_triton_tensor_descriptors(backend):
    """The tensor-descriptor path (blocks [1, rows, 1, BLOCK_DV] for v and dO), the GPU's dK/dV
    tile shape, and a key padding bias, with Dv > D and Dv < D (interpreter)."""
    from ringflash.kernels import configs

    tma = configs.KernelConfig(32, 16, 4, 1, tma=True)
    with configs.override(fwd=tma, dkdv=configs.KernelConfig(16, 32, 4, 1, tma=True), dq=tma):
        mask = torch.rand(1, 40, generator=torch.Generator().manual_seed(1)) < 0.3
        _check(*_qkv(1, 33, 40, 2, 1, 16, 48, torch.float16, seed=2), True, key_padding_mask=mask)
        _check(*_qkv(1, 33, 40, 2, 2, 40, 8, torch.float32, seed=3), False)


@BOTH
def test_varlen_v_head_dim_differs(backend):
    _check_varlen([7, 20, 0, 11], [9, 20, 3, 11], True, (-1, -1), D=20, Dv=12, seed=5)


def test_default_scale_is_q_k_head_dim_when_v_differs():
    q, k, v = _qkv(1, 9, 9, 2, 2, 3, 5, torch.float64, seed=0)
    a = flash_attn_func(q, k, v)
    assert a.shape == (1, 9, 2, 5)
    assert torch.equal(a, flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(3)))
    assert not torch.equal(a, flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(5)))


def test_v_head_dim_bad_input():
    """A bad v is named before anything runs, in the local, varlen and ring APIs."""
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    bad = [
        (torch.randn(1, 8, 2, 0), r"v head_dim 0 unsupported \(v \(1, 8, 2, 0\)\); need 1 to 256"),
        (torch.randn(1, 8, 2, 257), r"v head_dim 257 unsupported"),
        (torch.randn(1, 9, 2, 16), r"v must match k in batch, seqlen and heads.*\(1, 8, 2, 16\) and v \(1, 9, 2, 16\)"),
        (torch.randn(1, 8, 1, 32), r"v must match k in batch, seqlen and heads .*v \(1, 8, 1, 32\)"),
        (torch.randn(2, 8, 2, 32), r"v must match k in batch, seqlen and heads"),
    ]
    for v, pattern in bad:
        for fn in (flash_attn_func, ring_flash_attn_func):
            with pytest.raises(ValueError, match=f"{fn.__name__}: {pattern}"):
                fn(q, k, v)
        if v.shape[0] == 1:
            cu = torch.tensor([0, 8], dtype=torch.int32)
            with pytest.raises(ValueError, match=f"flash_attn_varlen_func: {pattern}"):
                flash_attn_varlen_func(q[0], k[0], v[0], cu, torch.tensor([0, v.shape[1]], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_empty_inputs_v_head_dim(backend):
    q = torch.randn(2, 0, 2, 8).requires_grad_()
    k, v = torch.randn(2, 5, 1, 8).requires_grad_(), torch.randn(2, 5, 1, 3).requires_grad_()
    for fn in (flash_attn_func, ring_flash_attn_func):
        out = fn(q, k, v)
        assert out.shape == (2, 0, 2, 3)
        grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]
    out, lse = flash_attn_func(torch.randn(2, 3, 2, 8), k[:, :0], v[:, :0], return_lse=True)  # no keys
    assert out.shape == (2, 3, 2, 3) and not out.any() and bool(torch.isneginf(lse).all())


def _ring_v_head_dim(rank, world, D, Dv, dtype, Hq, seed):
    """Zigzag causal ring (GQA when Hq > 2), the dK/dV accumulators of 2 kv heads in 2 chunks:
    out, lse and gradients on this rank's shard within 2x the plain same-dtype error of float64."""
    B, S, Hkv = 1, 8 * world, 2
    q, k, v = (t.detach() for t in _qkv(B, S, S, Hq, Hkv, D, Dv, dtype, seed))
    do = torch.randn(B, S, Hq, Dv, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ref = reference(q, k, v, do, causal=True)
    plain = plain_errors(q, k, v, do, ref, causal=True)
    sh = lambda t, dim=1: shard(t, layout="zigzag", dim=dim)
    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    out, lse = ring_flash_attn_func(ql, kl, vl, causal=True, layout="zigzag", return_lse=True, grad_chunks=2)
    assert out.shape == (B, S // world, Hq, Dv) and out.dtype == dtype
    grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    assert [g.shape for g in grads] == [t.shape for t in (ql, kl, vl)]
    for name, got, r in zip(plain, (out, lse, *grads), ref):
        assert_within(name, got, sh(r, 2 if name == "lse" else 1), plain[name], sum_len=1 if name == "lse" else None)


@pytest.mark.parametrize("D,Dv", [(24, 16), (16, 40)])
def test_ring_v_head_dim_differs_torch(worlds, D, Dv):
    worlds(2, **TORCH).run(_ring_v_head_dim, D, Dv, torch.float32, 4, D + Dv)


def test_ring_v_head_dim_differs_triton(worlds):
    worlds(2, **TRITON).run(_ring_v_head_dim, 12, 20, torch.float16, 2, 7)


def test_ring_varlen_v_head_dim_differs(worlds):
    """Packed documents on the ring (one cut over both ranks, K/V padded to the longest shard)
    with v's head dim 24 beside q/k's 16."""
    worlds(2, **TORCH).run(_ring_varlen_vs_oracle, [3, 0, 50, 1, 7], True, (-1, -1), 4, 2, torch.float32, 3, 24)


def test_hybrid_v_head_dim_differs(worlds):
    """A head group of 2 (R = 1, U = 2): the head all-to-alls carry v and out at Dv = 24."""
    worlds(2, **TORCH).run(hybrid_vs_oracle, 1, 2, "zigzag", True, 1, 2, 4, 2, None, 11, True, (-1, -1), 24)


def test_operator_fakes_give_v_head_dim():
    """torch.compile traces the operators' fake implementations: out (.., Dv), gradients like q, k, v."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ringflash import ops

    ns = getattr(torch.ops, ops.NAMESPACE)
    with FakeTensorMode():
        q, k, v = torch.empty(1, 5, 2, 8), torch.empty(1, 6, 1, 8), torch.empty(1, 6, 1, 3)
        out, lse, m, l = ns.flash_fwd(q, k, v, None, None, None, 0, 0, -1, -1, 0.3, 0.0, None, "", False, -1, -1)
        assert out.shape == (1, 5, 2, 3) and lse.shape == m.shape == l.shape == (1, 2, 5)
        out, *_ = ns.ring_fwd(q, k, v, None, None, "", -1, -1, 0.3, 0.0, None, "contiguous", -1, None, "", False, [])
        assert out.shape == (1, 5, 2, 3)
        grads = ns.flash_bwd(q, k, v, out, m, l, out, None, None, None, None, 0, 0, -1, -1, 0.3, 0.0, None, "", False)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
