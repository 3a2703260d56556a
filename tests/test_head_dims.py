"""Any head dim from 1 to 256, and empty inputs, in flash_attn_func, flash_attn_varlen_func and
the ring, against the float64 oracle (both backends; the Triton kernels under the interpreter)."""

import math

import pytest
import torch
from test_local import _check, _inputs
from test_varlen import _check_varlen

from ringflash import flash_attn_func, flash_attn_varlen_func, ring_flash_attn_func

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
        worlds(world, **TORCH).run(ring_vs_oracle, Case(layout, True, 2, 3, 4, 2, D, torch.float32, 2e-5, seed=D))


@pytest.mark.parametrize("D", [3, 12])
def test_ring_any_head_dim_triton(worlds, D):
    case = Case("zigzag", True, 1, 6, 2, 1, D, torch.float32, 5e-5, seed=D, mask="bool")
    worlds(2, **TRITON).run(ring_vs_oracle, case)


@BOTH
@pytest.mark.parametrize(
    "B,Sq,Sk,Hq,Hkv", [(0, 5, 5, 2, 1), (2, 0, 5, 2, 1), (2, 5, 0, 2, 1), (2, 0, 0, 2, 2), (2, 5, 5, 0, 1)]
)
def test_empty_inputs(backend, B, Sq, Sk, Hq, Hkv):
    """No batch, no query or no heads: empty outputs; no key: out 0, lse -inf; gradients flow
    (zeros, of the inputs' shapes), as torch's own attention on empty tensors."""
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
