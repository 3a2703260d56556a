"""GPU correctness of the Triton kernels in bf16 and fp16 against float64, S up to 16K.

Run on a CUDA machine with `pytest -m gpu` (CPU CI skips these).
"""
import pytest
import torch

from ringflash import flash_attn_func
from oracle import assert_within, naive_attention

pytestmark = pytest.mark.gpu

CASES = [  # (B, Sq, Sk, Hq, Hkv, D)
    (2, 1031, 1031, 4, 2, 128),
    (1, 777, 2048, 4, 1, 64),
    (1, 4096, 4096, 2, 2, 96),
    (1, 16384, 16384, 2, 1, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_forward_backward_vs_float64(dtype, causal, case):
    B, Sq, Sk, Hq, Hkv, D = case
    g = torch.Generator(device="cuda").manual_seed(Sq + D)
    mk = lambda S, H: torch.randn(B, S, H, D, device="cuda", generator=g, dtype=dtype).requires_grad_()
    q, k, v = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)

    ref, ref_lse = naive_attention(q, k, v, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    del ref_lse
    plain, _ = naive_attention(q, k, v, causal=causal, dtype=dtype)
    plain_grads = torch.autograd.grad(plain, (q, k, v), do)
    assert_within("out", out, ref, plain)
    for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
        assert_within(name, got, r, p)
    assert torch.isfinite(lse).all()


def test_deterministic_on_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    results = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=True)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
