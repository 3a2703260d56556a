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


@pytest.mark.parametrize("D", [256, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_other_head_dims(D, causal):
    test_forward_backward_vs_float64(torch.bfloat16, causal, (1, 2049, 2049, 4, 2, D))


@pytest.mark.parametrize("variant", ["pointers", "tma", "tma+ws"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_variants_and_key_padding(variant, causal, monkeypatch):
    """Every forward variant the sweep may pick, with and without a key padding mask."""
    from ringflash.kernels import configs

    base = configs.forward_config(128)
    monkeypatch.setitem(configs.OVERRIDES, "fwd", configs.KernelConfig(
        base.block_m, base.block_n, base.num_warps, base.num_stages, tma=variant != "pointers",
        warp_specialize=variant == "tma+ws"))
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 3001, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(2, 3001, device="cuda", generator=g) < 0.2
    for kpm in (None, mask):
        out = flash_attn_func(q, k, v, causal=causal, key_padding_mask=kpm)
        ref, _ = naive_attention(q, k, v, causal=causal, key_padding_mask=kpm)
        plain, _ = naive_attention(q, k, v, causal=causal, key_padding_mask=kpm, dtype=torch.bfloat16)
        assert_within(f"out {variant}", out, ref, plain)
