"""Test oracles (ringflash.testing) and the tolerance rule the tests share."""

from __future__ import annotations

import torch

from ringflash.testing import dropout_factors, flash_plain, max_err, naive_attention, plain_errors, reference, rel_rms

__all__ = [
    "assert_float64_agree",
    "assert_within",
    "case_dtypes",
    "dropout_factors",
    "flash_plain",
    "max_err",
    "naive_attention",
    "plain_errors",
    "reference",
    "rel_rms",
]


def assert_within(name, got, ref64, plain, factor=2.0, sum_len=None):
    """got's error against the float64 reference is at most `factor` x that of the plain
    same-dtype computation (`plain`: its result, or its error as a float), with a floor of a
    few ulps of got's own dtype over a sum of `sum_len` terms (default: a head_dim-long dot
    product); the plain result can be exact by luck, e.g. dq = 0 when each query sees a single
    key, and in float64 plain out, lse and dv are the reference's own arithmetic (error 0), so
    there the floor is the bound: float64's ulps, which a result that went through float32
    anywhere exceeds by far."""
    assert not torch.isnan(got).any(), f"{name}: NaN in result"
    err = max_err(got, ref64)
    plain_err = plain if isinstance(plain, float) else max_err(plain, ref64)
    finite = ref64[torch.isfinite(ref64)]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    eps = torch.finfo(got.dtype).eps
    sum_len = sum_len or (got.shape[-1] if got.dim() == 4 else 1)
    # 16-bit results: the floor is one rounding at the largest value (at least 1): the plain
    # error is a rounding error of the dtype and exact only where the result is (a query that
    # sees one key: dq = 0)
    floor = eps * max(scale, 1.0) if eps > 1e-4 else 4 * eps * max(scale, 1.0) * sum_len**0.5
    bound = factor * max(plain_err, floor)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (plain {plain_err:.3e})"


def assert_float64_agree(name, got, want, sum_len):
    """got against `want`, two float64 computations of one result that round differently (torch's
    own float64 modules and ops, for instance): with no higher precision to measure either
    against, the plain error is taken as 0 and the bound is assert_within's floor, float64's
    ulps over a sum of `sum_len` terms (the computation's longest)."""
    assert got.dtype == want.dtype == torch.float64, (name, got.dtype, want.dtype)
    assert_within(name, got, want, 0.0, sum_len=sum_len)


def case_dtypes(backend: str, dtypes, case: int) -> list:
    """The dtypes a parametrized case runs: under the Triton interpreter (seconds per launch)
    one of its two by the case's parity (choose `case` so that across the cases each dtype
    meets causal and not), on other backends all of `dtypes`."""
    return [dtypes[case % 2]] if backend == "triton" else list(dtypes)


def spy_fused_backward(monkeypatch) -> list:
    """Record every call of the fused Gluon backward that ran (one that raised Unsupported, after
    which the caller takes the two passes, is not one): the list grows by one per call, "blocked"
    where its dq was a BlockedDQ (a ring call's one blocked buffer), else "tensor"."""
    from ringflash.kernels import gluon_backward

    calls = []
    real = gluon_backward.backward

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append("blocked" if isinstance(a[7], gluon_backward.BlockedDQ) else "tensor")
        return out

    monkeypatch.setattr(gluon_backward, "backward", spy)
    return calls


def spy_dq_unblocks(monkeypatch) -> list:
    """Record every un-permuting of a blocked float32 dQ (gluon_backward.unblock_dq), one entry
    per launch."""
    from ringflash.kernels import gluon_backward

    calls = []
    real = gluon_backward.unblock_dq
    monkeypatch.setattr(gluon_backward, "unblock_dq", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def key_bias_on_gluon(monkeypatch) -> tuple[list, list]:
    """Key padding masks on the Gluon kernels with their trailing padding cut and their zero-bias
    spans unbiased (configs.GLUON_KEY_BIAS, GLUON_CUT_KEY_PADDING, PLAIN_ZERO_BIAS_KEYS: the Triton
    kernels take the spans too) and the fused backward at any size; returns
    (the Gluon forward's calls, each its config, the fused backward's calls: spy_fused_backward)."""
    from ringflash.kernels import configs, gluon_forward

    monkeypatch.setattr(configs, "GLUON_KEY_BIAS", True)
    monkeypatch.setattr(configs, "GLUON_CUT_KEY_PADDING", True)
    monkeypatch.setattr(configs, "PLAIN_ZERO_BIAS_KEYS", True)
    force_fused_backward(monkeypatch)
    fwd_calls = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: fwd_calls.append(kw["config"]) or real(*a, **kw))
    return fwd_calls, spy_fused_backward(monkeypatch)


def force_fused_backward(monkeypatch) -> None:
    """The fused backward at any size: no occupancy threshold (configs.GLUON_BWD_MIN_PROGRAMS_PER_SM)
    and no least work for per-row bounds (configs.GLUON_BWD_DOCUMENTS_MIN_PAIRS)."""
    from ringflash.kernels import configs

    monkeypatch.setattr(configs, "GLUON_BWD_MIN_PROGRAMS_PER_SM", 0)
    monkeypatch.setattr(configs, "GLUON_BWD_DOCUMENTS_MIN_PAIRS", 0)
