"""flash_attn_varlen_func: packed documents (THD) against a float64 oracle run one document at
a time, on both backends (Triton under the interpreter on CPU)."""

import random

import pytest
import torch

from ringflash import flash_attn_func
from ringflash.local import flash_attn_varlen_func
from ringflash.testing import naive_attention, varlen_plain_errors, varlen_reference

from oracle import assert_within, case_dtypes

BOTH = pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)


def _dtypes(backend):
    # bfloat16 tl.dot is wrong under the interpreter: bf16 is covered by the GPU tests
    return [torch.float32, torch.float16] if backend == "triton" else [torch.float32, torch.float64]


def _cu(lengths, device="cpu"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _packed(len_q, len_k, Hq, Hkv, D, dtype, seed, device="cpu", Dv=None):
    """q, k, v, do of packed documents; v and do have head dim Dv (default D)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(len_q), sum(len_k)
    mk = lambda n, H, d=D: torch.randn(n, H, d, generator=g).to(device, dtype)
    q = mk(tq, Hq).requires_grad_()
    k = mk(tk, Hkv).requires_grad_()
    v = mk(tk, Hkv, Dv or D).requires_grad_()
    return q, k, v, mk(tq, Hq, Dv or D)


def _check_varlen(
    len_q, len_k, causal, window_size, Hq=4, Hkv=2, D=32, dtype=torch.float32, seed=0, device="cpu", Dv=None
):
    q, k, v, do = _packed(len_q, len_k, Hq, Hkv, D, dtype, seed, device, Dv)
    cu_q, cu_k = _cu(len_q, device), _cu(len_k, device)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size, return_lse=True)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == dtype and lse.shape == (Hq, q.shape[0])
    grads = torch.autograd.grad(out, (q, k, v), do)
    kw = dict(causal=causal, window_size=window_size)
    ref = varlen_reference(q, k, v, do, cu_q, cu_k, **kw)
    plain = varlen_plain_errors(q, k, v, do, cu_q, cu_k, ref, **kw)
    for name, got, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref):
        assert not torch.isnan(got).any(), name
        if name != "lse":
            assert_within(name, got, r, plain[name])
        else:
            assert_within(name, got, r, plain[name], sum_len=1)
    # rows that see no key: 0 and -inf (and, from the oracle, zero gradients)
    empty = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.all(out.transpose(0, 1)[empty] == 0)
    return out, lse, grads


MIXES = {
    # (query lengths, key lengths): documents of 0 and 1 tokens, longer than a tile (interpreter
    # tiles are 32 x 16), several documents in one tile, Sq != Sk per document
    "mixed": ([5, 0, 1, 40, 3, 17, 0, 33], None),
    "short": ([2, 3, 1, 4, 1, 2, 5, 1, 3, 2], None),
    "long": ([70, 45], None),
    "q_ne_k": ([9, 30, 1, 12], [14, 22, 5, 12]),
}


@BOTH
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (4, 0)), (False, (2, 7))])
def test_varlen_against_float64(backend, mix, causal, window_size):
    len_q, len_k = MIXES[mix]
    # the parity gives each dtype every mix, causal and not, under the interpreter
    for dtype in case_dtypes(backend, _dtypes(backend), list(MIXES).index(mix) + causal + window_size[0]):
        _check_varlen(len_q, len_k or len_q, causal, window_size, dtype=dtype, seed=len(len_q))


@BOTH
@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (6, 2), (4, 1)])
def test_varlen_gqa(backend, Hq, Hkv):
    _check_varlen([7, 20, 0, 11], [7, 20, 0, 11], True, (-1, -1), Hq=Hq, Hkv=Hkv, seed=Hq)


@BOTH
@pytest.mark.parametrize("causal", [False, True])
def test_one_document_equals_flash_attn_func(backend, causal):
    q, k, v, do = _packed([37], [50], 4, 2, 32, torch.float32, 3)
    a = flash_attn_varlen_func(q, k, v, _cu([37]), _cu([50]), causal=causal)
    b = flash_attn_func(q[None], k[None], v[None], causal=causal)[0]
    assert torch.equal(a, b)  # the same kernels over the same tiles: the same bits


def test_outputs_are_views_whose_backward_copies_nothing():
    """out and lse come back as squeezed views of the batch-of-one call: their backward is a view
    too (indexing's, SelectBackward, would allocate a zeroed batch and copy the gradient into it
    on every call)."""
    q, k, v, _ = _packed([7, 20], [7, 20], 2, 2, 16, torch.float32, 1)
    q.requires_grad_()
    out, lse = flash_attn_varlen_func(q, k, v, _cu([7, 20]), _cu([7, 20]), causal=True, return_lse=True)
    assert type(out.grad_fn).__name__.startswith("SqueezeBackward"), out.grad_fn
    assert type(lse.grad_fn).__name__.startswith("SqueezeBackward"), lse.grad_fn
    assert out.shape == (27, 2, 16) and lse.shape == (2, 27)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_random_document_mixes(backend):
    """Random lengths (including 0 and 1), random windows, float64 on the torch backend."""
    rng = random.Random(0)
    for trial in range(12):
        lengths = [rng.choice([0, 1, 2, rng.randint(1, 60)]) for _ in range(rng.randint(1, 7))]
        if sum(lengths) == 0:
            lengths.append(3)
        causal = rng.random() < 0.5
        left = rng.choice([-1, 0, 1, 5, 100])
        right = 0 if causal else rng.choice([-1, 0, 3])
        _check_varlen(lengths, lengths, causal, (left, right), dtype=torch.float64, seed=trial)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_invisible_chunks_are_skipped(backend, monkeypatch):
    """Cost follows the visible pairs: on the torch backend (1024 x 1024 chunks) 4 documents of
    1024 tokens in one 4096-token row compute the 4 diagonal chunks, causal or not, not 16."""
    from ringflash import reference

    calls = []
    real = reference._scores2
    monkeypatch.setattr(reference, "_scores2", lambda *a: calls.append(1) or real(*a))
    q, k, v, _ = _packed([1024] * 4, [1024] * 4, 1, 1, 16, torch.float32, 0)
    for causal in (False, True):
        calls.clear()
        flash_attn_varlen_func(q, k, v, _cu([1024] * 4), _cu([1024] * 4), causal=causal)
        assert len(calls) == 4, (causal, len(calls))
    # a causal window of 100 over one 4096-token document: the diagonal chunks and the three
    # just below it that the window reaches into, 7 of the 10 a causal mask would compute
    calls.clear()
    flash_attn_varlen_func(q, k, v, _cu([4096]), _cu([4096]), causal=True, window_size=(100, 0))
    assert len(calls) == 7, len(calls)
    calls.clear()
    flash_attn_func(q[None], k[None], v[None], causal=True, window_size=(100, 0))
    assert len(calls) == 7, len(calls)


def test_bad_varlen_input():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    cases = [
        (dict(cu_seqlens_q=cu.float()), TypeError, "cu_seqlens_q must be int32 or int64, got torch.float32"),
        (dict(cu_seqlens_k=cu[None]), ValueError, r"cu_seqlens_k must be 1-D"),
        (dict(cu_seqlens_q=torch.tensor([1, 4, 10])), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10])), ValueError, "non-decreasing, got 6 then 4"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 9])), ValueError, "cu_seqlens_k must end at the total length 10"),
        (dict(cu_seqlens_q=cu.to("meta")), ValueError, "cu_seqlens_q is on meta"),
        (dict(cu_seqlens_k=torch.tensor([0, 10])), ValueError, "as many documents, got 2 and 1"),
        (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q = 5 is smaller than the longest document \(6\)"),
        (dict(window_size=(2,)), ValueError, "window_size must be a pair"),
    ]
    for kw, exc, pattern in cases:
        args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, **kw}
        with pytest.raises(exc, match=pattern):
            flash_attn_varlen_func(q, q, q, **args)
    with pytest.raises(ValueError, match=r"q must be 3-D \(total, heads, head_dim\)"):
        flash_attn_varlen_func(q[None], q, q, cu, cu)


def test_boundaries_read_once_per_tensor_version(monkeypatch):
    """cu_seqlens on a GPU are read to the host (a wait for the device) once per tensor and
    version: the layers of a model over one batch reuse the read; a tensor changed in place,
    or a new one, is read again; a dead tensor's entry never answers for another."""
    from ringflash import _checks

    reads = []
    real_read = _checks._read_values
    monkeypatch.setattr(_checks, "_remembers_values", lambda cu: True)  # as for GPU tensors
    monkeypatch.setattr(_checks, "_READ_VALUES", {})
    monkeypatch.setattr(_checks, "_read_values", lambda *a: reads.append(1) or real_read(*a))
    q, k, v, _ = _packed([5, 3], [5, 3], 2, 1, 16, torch.float32, 0)
    cu = _cu([5, 3])
    want = flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    for _ in range(3):
        assert torch.equal(flash_attn_varlen_func(q, k, v, cu, cu, causal=True), want)
    assert len(reads) == 1
    cu[1] = 4  # in place: a new version, read again (and checked again)
    other = flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    assert len(reads) == 2 and not torch.equal(other, want)
    cu[2] = 9
    with pytest.raises(ValueError, match="must end at the total length 8"):
        flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    fresh = _cu([5, 3])  # equal values, another tensor: read
    assert torch.equal(flash_attn_varlen_func(q, k, v, fresh, fresh, causal=True), want)
    assert len(reads) == 4
    with torch.inference_mode():  # tensors without a version counter are read every call
        cu_inf = _cu([5, 3])
        for _ in range(2):
            flash_attn_varlen_func(q, k, v, cu_inf, cu_inf, causal=True)
    assert len(reads) == 6
    assert len(_checks._READ_VALUES) <= _checks._READ_VALUES_KEPT
    # the documented limit: a write through .data bumps no version, so the old read answers
    stale = _cu([5, 3])
    flash_attn_varlen_func(q, k, v, stale, stale, causal=True)
    stale.data[1] = 4
    assert torch.equal(flash_attn_varlen_func(q, k, v, stale, stale, causal=True), want)


def test_empty_rows_have_zero_gradients():
    """Causal documents with more queries than keys: the first queries see nothing; their
    outputs and gradients are 0 (never NaN)."""
    q, k, v, do = _packed([6, 4], [2, 4], 2, 1, 16, torch.float32, 5)
    out = flash_attn_varlen_func(q, k, v, _cu([6, 4]), _cu([2, 4]), causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    assert torch.all(out[:4] == 0) and torch.all(dq[:4] == 0)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    # float64 the reference, naive attention in float32 the plain baseline of the bound
    ref, plain = (
        naive_attention(q[None, :6], k[None, :2], v[None, :2], causal=True, dtype=d)[0]
        for d in (torch.float64, torch.float32)
    )
    assert_within("out", out[None, :6], ref, plain)


GPU_LENGTHS = [1, 0, 700, 3000, 129, 64, 1500, 2, 257]  # tiles of 64 / 128 rows: many straddle documents


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "causal,window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (255, 0)), (False, (100, 300))]
)
def test_varlen_on_gpu(dtype, causal, window_size):
    _check_varlen(GPU_LENGTHS, GPU_LENGTHS, causal, window_size, Hq=4, Hkv=2, D=128, dtype=dtype, device="cuda")


@pytest.mark.gpu
def test_varlen_on_gpu_q_ne_k_gqa():
    len_k = [n + 37 for n in GPU_LENGTHS]
    _check_varlen(GPU_LENGTHS, len_k, True, (-1, -1), Hq=8, Hkv=1, D=64, dtype=torch.bfloat16, device="cuda")
