"""Bad input to the local API: errors name the argument and the shapes, before any kernel."""
import pytest
import torch

from ringflash import flash_attn_func


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "args,exc,pattern",
    [
        ((_t(2, 8, 4), _t(2, 8, 4, 32), _t(2, 8, 4, 32)), ValueError, r"q must be 4-D.*\(2, 8, 4\)"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 32, 1), _t(2, 8, 4, 32)), ValueError, r"k must be 4-D"),
        ((_t(2, 8, 4, 32), _t(3, 8, 4, 32), _t(3, 8, 4, 32)), ValueError, r"batch differs.*\(2, 8, 4, 32\).*\(3, 8, 4, 32\)"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 64), _t(2, 8, 4, 64)), ValueError, r"head_dim differs"),
        ((_t(2, 8, 4, 32), _t(2, 8, 3, 32), _t(2, 8, 3, 32)), ValueError, r"multiple of k/v heads \(3\)"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 32), _t(2, 9, 4, 32)), ValueError, r"k and v must have the same shape"),
        ((_t(2, 8, 4, 12), _t(2, 8, 4, 12), _t(2, 8, 4, 12)), ValueError, r"head_dim 12 unsupported"),
        ((_t(2, 8, 4, 264), _t(2, 8, 4, 264), _t(2, 8, 4, 264)), ValueError, r"head_dim 264 unsupported"),
        ((_t(2, 8, 4, 36), _t(2, 8, 4, 36), _t(2, 8, 4, 36)), ValueError, r"head_dim 36 unsupported"),
        ((_t(2, 0, 4, 32), _t(2, 8, 4, 32), _t(2, 8, 4, 32)), ValueError, r"empty input"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 32, dtype=torch.float16), _t(2, 8, 4, 32)), TypeError, r"share a dtype"),
        ((torch.ones(2, 8, 4, 32, dtype=torch.int32),) * 3, TypeError, r"q has dtype torch.int32"),
        (([1.0], _t(2, 8, 4, 32), _t(2, 8, 4, 32)), TypeError, r"q must be a torch.Tensor"),
    ],
)
def test_bad_tensors(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        flash_attn_func(*args)


def test_bad_options():
    q = _t(1, 4, 2, 16)
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, q, q, softmax_scale="0.1")
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_func(q, q, q, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="causal"):
        flash_attn_func(q, q, q, causal=1)
    with pytest.raises(TypeError):
        flash_attn_func(q, q, q, True)  # options are keyword-only
    from ringflash import ring_flash_attn_func

    h = q.to(torch.bfloat16)
    for bad in (torch.float16, torch.float64, "bfloat16"):  # neither float32 nor the inputs' dtype
        with pytest.raises(ValueError, match=r"grad_accum_dtype must be None, torch.float32 or the inputs' dtype "
                                             r"torch.bfloat16, got"):
            ring_flash_attn_func(h, h, h, grad_accum_dtype=bad)


def test_bad_backend_env(monkeypatch):
    q = _t(1, 4, 2, 16)
    monkeypatch.setenv("RINGFLASH_BACKEND", "cuda")
    with pytest.raises(ValueError, match="RINGFLASH_BACKEND"):
        flash_attn_func(q, q, q)
    monkeypatch.setenv("RINGFLASH_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        flash_attn_func(q, q, q)


def test_device_mismatch_named():
    q = _t(1, 4, 2, 16)
    with pytest.raises(ValueError, match="one device.*meta"):
        flash_attn_func(q, q.to("meta"), q)
