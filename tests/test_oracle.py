"""The shared tolerance rule (oracle.assert_within) can fail where it must."""

import pytest
import torch

from oracle import assert_within, naive_attention, plain_errors, reference


def test_float64_bound_rejects_a_result_rounded_through_float32():
    """A float64 result is held to float64's ulps: the same attention rounded through float32
    once (as a float32 merge, scale or statistic would round it) fails, and so does the whole
    computation done in float32; the float64 computation itself passes. Under a float32 floor
    (the rule before) the rounded result was within the bound."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 24, 2, 32, generator=g, dtype=torch.float64) for _ in range(4))
    ref = reference(q, k, v, do, causal=True)
    plain = plain_errors(q, k, v, do, ref, orders=2, causal=True)
    # a float64 computation other than the reference's: a permuted head dim sums in another order
    perm = torch.randperm(32, generator=g)
    out64 = naive_attention(q[..., perm], k[..., perm], v, causal=True)[0]
    assert_within("float64", out64, ref[0], plain["out"])
    rounded = out64.float().double()
    in_float32 = naive_attention(q, k, v, causal=True, dtype=torch.float32)[0].double()
    for name, got in (("rounded through float32", rounded), ("computed in float32", in_float32)):
        with pytest.raises(AssertionError, match="error .* > bound"):
            assert_within(name, got, ref[0], plain["out"])
    # what the float32 floor allowed: 2 x 4 ulps of float32 x max |out| x sqrt(head_dim)
    old_bound = 2 * 4 * torch.finfo(torch.float32).eps * max(ref[0].abs().max().item(), 1.0) * 32**0.5
    assert (rounded - ref[0]).abs().max().item() < old_bound
