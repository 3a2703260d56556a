"""flash_attn_func against a float64 oracle on both backends (Triton under the interpreter on CPU)."""

import pytest
import torch

from ringflash import flash_attn_func
from ringflash.masks import Window

from oracle import assert_within, case_dtypes, naive_attention, plain_errors, reference

BOTH = pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)


def _dtypes(backend):
    # bfloat16 tl.dot is wrong under the interpreter: bf16 is covered by the GPU tests
    return [torch.float32, torch.float16] if backend == "triton" else [torch.float32, torch.float64, torch.bfloat16]


def _inputs(B, Sq, Sk, Hq, Hkv, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda S, H: torch.randn(B, S, H, D, generator=g).to(dtype).requires_grad_()
    return mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv)


def _check(q, k, v, causal, scale=None, check_grad=True, key_padding_mask=None, seed=0, orders=1,
           window_size=(-1, -1)):  # fmt: skip
    """flash_attn_func's out, lse (and gradients) within tolerance of float64; returns (out, lse).
    orders: summation orders of the plain baseline (oracle.plain_errors)."""
    out, lse = flash_attn_func(
        q, k, v, causal=causal, softmax_scale=scale, return_lse=True, key_padding_mask=key_padding_mask,
        window_size=window_size,
    )  # fmt: skip
    assert out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])  # v's head dim
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(q.dtype)
    kw = dict(scale=scale, causal=causal, key_padding_mask=key_padding_mask, window_size=window_size)
    ref = reference(q, k, v, do, **kw)
    plain = plain_errors(q, k, v, do, ref, orders=orders, seed=seed, **kw)
    assert_within("out", out, ref[0], plain["out"])
    assert_within("lse", lse, ref[1], plain["lse"])
    if not check_grad:
        return out, lse
    grads = torch.autograd.grad(out, (q, k, v), do)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert g.dtype == q.dtype
        # With a single key every softmax is 1: dk is exactly 0 (plain autograd gets 0 exactly)
        # and ours is the rounding noise of dp - delta summed over all queries of the group, so
        # the floor covers that sum rather than one dot product. (Seen at 5.6e-6 against a 5.4e-6
        # dot-product floor in one CI run, depending on memory layout.)
        one_key_dk = name == "dk" and k.shape[1] == 1
        sum_len = q.shape[-1] * q.shape[1] * (q.shape[2] // k.shape[2]) if one_key_dk else None
        assert_within(name, g, r, plain[name], sum_len=sum_len)
    return out, lse


@BOTH
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (17, 17), (129, 129), (33, 100), (100, 33), (1, 57), (64, 1)])
def test_shapes(backend, causal, Sq, Sk):
    # the interpreter's larger blocks run one batch entry (batches are covered below)
    B = 1 if backend == "triton" and Sq * Sk > 2000 else 2
    for dtype in case_dtypes(backend, _dtypes(backend), Sq + Sk + causal):
        _check(*_inputs(B, Sq, Sk, 4, 2, 32, dtype, seed=Sq * 1000 + Sk), causal)


@BOTH
@pytest.mark.parametrize("D", [16, 24, 40, 64, 80, 128, 256])
def test_head_dims(backend, D):
    for causal in (False, True):
        _check(*_inputs(1, 37, 45, 2, 1, D, torch.float32, seed=D), causal)


@BOTH
@pytest.mark.parametrize("Hq,Hkv", [(1, 1), (4, 4), (6, 2), (8, 1)])
def test_gqa(backend, Hq, Hkv):
    _check(*_inputs(2, 40, 48, Hq, Hkv, 32, torch.float16 if backend == "triton" else torch.float32, seed=Hq), True)


@BOTH
def test_custom_scale(backend):
    q, k, v = _inputs(1, 50, 50, 2, 2, 32, torch.float32, seed=7)
    _check(q, k, v, causal=True, scale=0.7)
    # zero and negative scales: the row max of the scaled scores is not max(s) * scale
    _check(q, k, v, causal=True, scale=0.0)
    _check(q, k, v, causal=True, scale=-0.4)


def _large_score_case(seed):
    """Case `seed` of the large-score test: |scores| ~ 1e2 to 5e4, causal or not, GQA or not,
    positive, default and negative scales."""
    mag = (3.0, 10.0, 30.0, 70.0)[seed % 4]
    causal = bool(seed % 2)
    scale = (1.0, 0.3, None, -0.5)[(seed // 2) % 4]
    Hq, Hkv = ((2, 2), (4, 1), (4, 2))[seed % 3]
    q, k, v = _inputs(1, 40, 40, Hq, Hkv, 32, torch.float32, seed=100 + seed)
    with torch.no_grad():
        q.mul_(mag), k.mul_(mag)
    return q, k, v, causal, scale


@BOTH
@pytest.mark.parametrize("seed", range(24))
def test_large_scores(backend, seed):
    """Scores up to ~5e4: out, lse and dV at the level of plain float32 (autograd through a
    softmax), dQ and dK at the level of the flash algorithm done plainly in float32 (its delta
    cancels); both baselines over 4 summation orders. The kernels keep the row max and the
    normalizer (not only lse = m + log l, whose float32 rounding at 1e4 is ~1e-3 of every
    weight) and rebuild the forward's probabilities in the backward."""
    q, k, v, causal, scale = _large_score_case(seed)
    _check(q, k, v, causal, scale=scale, seed=seed, orders=4)


@BOTH
def test_rows_without_keys(backend):
    # Sq > Sk, causal bottom-right: the first Sq - Sk queries see nothing
    q, k, v = _inputs(1, 40, 10, 2, 2, 32, torch.float32, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :30] == 0) and torch.all(lse[:, :, :30] == float("-inf"))
    assert torch.isfinite(lse[:, :, 30:]).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :30] == 0)


@BOTH
def test_strided_inputs_match_contiguous(backend):
    g = torch.Generator().manual_seed(11)
    base = torch.randn(2, 3, 48, 40, 32, generator=g)  # (B, 3, S, H?, D) packed qkv-like
    q = base[:, 0, :, :4]  # (2, 48, 4, 32) non-contiguous
    k = base[:, 1, :, 4:6]
    v = base[:, 2, ::1, 6:8]
    vt = torch.randn(2, 32, 2, 48, generator=g).permute(0, 3, 2, 1)  # head_dim not unit-stride
    for causal in (False, True):
        for vv in (v, vt):
            a = flash_attn_func(q, k, vv, causal=causal)
            b = flash_attn_func(q.contiguous(), k.contiguous(), vv.contiguous(), causal=causal)
            assert torch.equal(a, b)


@BOTH
def test_lse_is_differentiable(backend):
    q, k, v = _inputs(1, 20, 24, 2, 1, 32, torch.float64 if backend == "torch" else torch.float32, seed=5)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    w = torch.randn(lse.shape, dtype=lse.dtype, generator=torch.Generator().manual_seed(6)).to(lse.device)
    loss = (lse * w).sum() + out.sum()
    grads = torch.autograd.grad(loss, (q, k, v))

    def naive_grads(dtype):  # the same loss through naive attention in dtype
        ref, ref_lse = naive_attention(q, k, v, causal=True, dtype=dtype)
        return torch.autograd.grad((ref_lse * w.to(dtype)).sum() + ref.sum(), (q, k, v))

    # float64 the reference, the plain computation in q's dtype the baseline of the bound
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, naive_grads(torch.float64), naive_grads(q.dtype)):
        assert_within(name, g, r, p)


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
@pytest.mark.parametrize("seed_loss", ["sum", "square"])
def test_second_order_gradients_raise(backend, seed_loss):
    """Gradients of the gradients (create_graph=True, e.g. a gradient penalty) are not supported:
    differentiating the first-order gradients raises, whether or not the gradient reaching the
    backward requires grad (out.sum() gives one that does not; torch's once_differentiable let
    those gradients through as constants and a penalty's term was silently lost), and the
    first-order gradients are the same as without create_graph."""
    from ringflash import flash_attn_varlen_func, ring_flash_attn_func

    q, k, v = _inputs(1, 7, 6, 2, 1, 8, torch.float64, seed=1)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    calls = {
        "causal": lambda q: flash_attn_func(q, k, v, causal=True),
        "key_padding_mask": lambda q: flash_attn_func(q, k, v, key_padding_mask=torch.tensor([[True] * 5 + [False]])),
        "varlen": lambda q: flash_attn_varlen_func(q[0, :6], k[0], v[0], cu, cu, 3, 3, causal=True),
        "ring": lambda q: ring_flash_attn_func(q[:, :6], k, v, causal=True),
    }
    loss = (lambda o: o.sum()) if seed_loss == "sum" else (lambda o: o.square().sum())
    for name, call in calls.items():
        out = call(q)
        (dq,) = torch.autograd.grad(loss(out), q, create_graph=True)
        (plain,) = torch.autograd.grad(loss(call(q)), q)
        assert torch.equal(dq.detach(), plain), name
        with pytest.raises(RuntimeError, match="first order only"):
            (dq.square().sum() + out.sum()).backward()


@pytest.mark.parametrize("backend", ["torch"], indirect=True)
def test_gradcheck_float64(backend):
    q, k, v = _inputs(1, 7, 6, 2, 1, 8, torch.float64, seed=1)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c: flash_attn_func(a, b, c, causal=causal), (q, k, v))


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_triton_rejects_float64(backend):
    q, k, v = _inputs(1, 8, 8, 1, 1, 16, torch.float64, seed=1)
    from ringflash import ring_flash_attn_func

    # named by the call's own check, before any kernel or (on a ring) collective
    for api, call in (("flash_attn_func", flash_attn_func), ("ring_flash_attn_func", ring_flash_attn_func)):
        with pytest.raises(TypeError, match=rf"^{api}: q, k, v have dtype torch.float64, which the Triton"):
            call(q, k, v)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_poisoned_output_is_fully_written(backend, monkeypatch):
    """The kernels write every element: every buffer flash_attn_func allocates uninitialized
    (torch.empty, torch.empty_like, Tensor.new_empty) starts as NaN, and each result must be
    one of those buffers (or made from one), so that a store left out shows as NaN."""
    real_empty_like, real_empty, real_new_empty = torch.empty_like, torch.empty, torch.Tensor.new_empty
    poisoned = []

    def poison(t):
        poisoned.append(t.untyped_storage().data_ptr())
        return t.fill_(float("nan"))

    q, k, v = _inputs(1, 33, 70, 2, 1, 24, torch.float32, seed=9)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poison(real_empty_like(t, **kw)))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **kw: poison(real_new_empty(t, *a, **kw)))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    monkeypatch.undo()
    # out is the kernel's output buffer itself; the gradients are kernel buffers too
    assert out.untyped_storage().data_ptr() in poisoned
    for t in (out, lse, dq, dk, dv):
        assert not torch.isnan(t).any()


@BOTH
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_padding_mask(backend, kind):
    g = torch.Generator().manual_seed(21)
    q, k, v = _inputs(2, 33, 70, 4, 2, 32, torch.float32, seed=21)
    if kind == "bool":
        mask = torch.rand(2, 70, generator=g) < 0.3
        mask[1] = True  # batch 1: every key padded -> output 0, lse -inf, no NaN
    else:
        mask = torch.randn(2, 70, generator=g) * 2
    # the interpreter (seconds per launch) runs one causal setting per kind, the two ways round
    for causal in (False, True) if backend == "torch" else (kind == "float",):
        out, lse = _check(q, k, v, causal, key_padding_mask=mask)
        if kind == "bool":
            assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_zero_bias_spans(backend, causal, monkeypatch):
    """configs.PLAIN_ZERO_BIAS_KEYS: each batch row's keys of zero bias (key_bias.key_spans) scored
    without the bias, the others with it, in the forward and both backward passes (the Gluon
    kernels choose by the same spans): out, lse and gradients within tolerance of float64, for a
    right-padded row, a left-padded one and one whose first run of zeros is too short for a
    span; the spans are checked nonempty, so the unbiased scores did run."""
    from ringflash import kernels
    from ringflash.kernels import configs

    monkeypatch.setattr(configs, "PLAIN_ZERO_BIAS_KEYS", True)
    spans = []

    def spy(key_bias, scale):
        spans.append(key_spans(key_bias, scale))
        return spans[-1]

    key_spans = kernels.key_spans
    monkeypatch.setattr(kernels, "key_spans", spy)
    # (the fewest keys past one PLAIN_ALIGN of 384 that hold the three rows: the interpreter's
    # time goes as the keys)
    q, k, v = _inputs(3, 24, 400, 2, 1, 16, torch.float32, seed=8)
    mask = torch.zeros(3, 400, dtype=torch.bool)  # True: a padded key
    mask[0, 390:] = True  # span [0, 384), then biased keys 384..389
    mask[1, :30] = True  # span [384, 768): past Sk, to the end
    mask[2, 100:110] = True  # zeros [0, 100): no span
    _check(q, k, v, causal, key_padding_mask=mask)
    assert len(spans) == 2  # the forward; the backward, whose two passes share one
    for s in spans:
        assert s[:, 1:].tolist() == [[0, 384], [384, 768], [0, 0]]


def test_key_padding_mask_errors():
    q = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, k seqlen\) = \(2, 8\)"):
        flash_attn_func(q, q, q, key_padding_mask=torch.zeros(8, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool or floating point"):
        flash_attn_func(q, q, q, key_padding_mask=torch.zeros(2, 8, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("tma", [False, True])
def test_forward_kernel_variants(backend, tma):
    """The forward kernel's tensor-descriptor path computes the same function (interpreter):
    unmasked key ranges of 0 to 6 blocks of 16, a negative scale, a key padding bias."""
    from ringflash.kernels import configs

    with configs.override(fwd=configs.KernelConfig(32, 16, 4, 1, tma=tma)):
        for causal in (False, True):
            for Sq, Sk, D in ((37, 45, 24), (1, 70, 16), (64, 64, 32), (20, 100, 16), (5, 50, 16)):
                q, k, v = _inputs(1, Sq, Sk, 4, 2, D, torch.float16, seed=Sq + D)
                _check(q, k, v, causal, check_grad=False)
                if causal:  # scores scaled before the max (the interpreter takes seconds per launch: once)
                    _check(q, k, v, causal, scale=-0.3, check_grad=False)
            q, k, v = _inputs(2, 33, 70, 4, 2, 32, torch.float32, seed=21)
            mask = torch.rand(2, 70, generator=torch.Generator().manual_seed(3)) < 0.3
            _check(q, k, v, causal, check_grad=False, key_padding_mask=mask)


@BOTH
def test_autocast_does_not_lower_precision(backend):
    """An enclosing autocast must not downcast the float32 state or the torch backend's math."""
    q, k, v = _inputs(1, 40, 40, 2, 2, 32, torch.float32, seed=2)
    ref = flash_attn_func(q, k, v, causal=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flash_attn_func(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # the same kernels on the same float32 inputs: the same bits
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
@pytest.mark.parametrize("variant", ["tma", "pointers", "combined"])
def test_backward_kernel_variants(backend, variant):
    """The backward kernels with the GPU's dK/dV shape (fewer query rows than key rows per
    tile), through tensor descriptors or pointers, the dK/dV pass's K Q^T operand order, and
    its probabilities from m + log2 l for 16-bit inputs ("combined"), compute the same
    gradients (interpreter): unmasked ranges of 2 to 7 blocks, causal offsets
    either way, a negative scale, a key padding bias."""
    from ringflash.kernels import configs

    tma = variant == "tma"
    with configs.override(
        dkdv=configs.KernelConfig(16, 32, 4, 1, tma=tma), dq=configs.KernelConfig(32, 16, 4, 1, tma=tma)
    ):
        for causal in (False, True):
            _check(*_inputs(2, 37, 45, 4, 2, 24, torch.float16, seed=4), causal)
        # one causal setting each, the two ways round (the interpreter takes seconds per launch)
        _check(*_inputs(1, 100, 70, 2, 1, 16, torch.float16, seed=5), True)
        _check(*_inputs(1, 50, 120, 2, 2, 16, torch.float32, seed=6), False, scale=-0.3)
        mask = torch.rand(2, 70, generator=torch.Generator().manual_seed(4)) < 0.3
        _check(*_inputs(2, 40, 70, 2, 1, 16, torch.float32, seed=8), True, key_padding_mask=mask)


def test_kernel_configs_file(tmp_path):
    """A RINGFLASH_KERNEL_CONFIGS file replaces the entries it has; override() wins over it."""
    from ringflash.kernels import configs

    path = tmp_path / "cfg.json"
    mine = configs.KernelConfig(64, 32, 4, 2, tma=True)
    configs.write_configs(str(path), {"fwd": {128: mine}})
    on_gpu = dict(interpreting=False, file_configs=configs.read_configs(str(path)))
    assert configs.pick("fwd", 128, **on_gpu) == mine
    assert configs.pick("fwd", 64, **on_gpu) == configs._FWD[64]  # not in the file: the built-in table
    assert configs.pick("dq", 128, **on_gpu) == configs._DQ[128]
    other = configs.KernelConfig(32, 32, 4, 1)
    with configs.override(fwd=other):
        assert configs.pick("fwd", 128, **on_gpu) == other
    assert configs.pick("fwd", 128, **on_gpu) == mine
    with pytest.raises(ValueError, match="unknown kernel"):
        with configs.override(bwd=other):
            pass
    # a dK/dV config that does not mention the combined row statistics keeps them (exact 16-bit
    # dK/dV at large scores), as every built-in one does
    path.write_text('{"dkdv": {"128": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3}}}')
    assert configs.pick("dkdv", 128, interpreting=False, file_configs=configs.read_configs(str(path))).combined_stats
    assert all(c.combined_stats for table in (configs._DKDV, configs._DKDV_DOCUMENTS) for c in table.values())


def test_documents_configs(monkeypatch):
    """Blocks of packed documents (per-row bounds) take each kernel's documents table where it
    has the head dim, the dense table elsewhere and for float32; override() and the
    RINGFLASH_KERNEL_CONFIGS file still decide first."""
    from ringflash.kernels import configs

    monkeypatch.setattr(configs, "INTERPRETING", False)
    chosen = {"fwd": configs.forward_config, "dkdv": configs.dkdv_config, "dq": configs.dq_config}
    for kind, config in chosen.items():
        table = configs._DOCUMENTS[kind]
        assert config(128, documents=True) == table[128] != config(128), kind
        assert config(64, documents=True) == config(64) == configs._TABLES[kind][0][64], kind
        assert config(128, documents=True, float32=True) == configs._FLOAT32[kind][128], kind
        other = configs.KernelConfig(32, 32, 4, 1)
        with configs.override(**{kind: other}):
            assert config(128, documents=True) == other, kind
        monkeypatch.setattr(configs, "_FILE_CONFIGS", {kind: {128: other}})
        assert config(128, documents=True) == other, kind
        monkeypatch.setattr(configs, "_FILE_CONFIGS", {})


@pytest.mark.parametrize("seeing_rows", [False, True])
def test_documents_forward_by_the_rows_that_see_keys(seeing_rows, monkeypatch):
    """A neighbour's block in a windowed packed ring: most query rows see none of its keys.
    RowBounds counts the keys per row over every row (times the rows: the block's pairs, the
    fused backward's size rule) and over the rows that see a key; the forward's tile choice goes
    by the first, or by the second with configs.GLUON_DOCUMENTS_SEEING_ROWS (the tiles of rows
    that see nothing end at once), which the empty rows' mean no longer pulls under the Gluon
    threshold. Where every row sees keys (a rank's own causal documents, where the threshold was
    tuned) the two are one."""
    from ringflash import kernels
    from ringflash.kernels import configs
    from ringflash.masks import held_bounds

    window, n = 4096, 8192
    cu = torch.tensor([0, 2 * n], dtype=torch.int64)  # one document over both shards
    mine, theirs = torch.arange(n, 2 * n), torch.arange(n)
    bounds = held_bounds(mine, theirs, n, cu, Window(window, 0)).on_device("cpu")
    seen = (bounds.k_hi - bounds.k_lo).long()
    assert int((seen > 0).sum()) == window  # the first `window` rows see the neighbour's keys
    assert bounds.keys_per_row == pytest.approx(seen.sum().item() / n)
    assert bounds.keys_per_seeing_row == pytest.approx((window + 1) / 2)
    monkeypatch.setattr(configs, "INTERPRETING", False)
    monkeypatch.setattr(configs, "GLUON_DOCUMENTS_SEEING_ROWS", seeing_rows)
    least = configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW[128]
    assert bounds.keys_per_row < least <= bounds.keys_per_seeing_row  # the case the rule changes
    asked = []
    spy = lambda *a, **kw: asked.append(kw["keys_per_row"])  # noqa: E731 - None: the Triton forward runs
    monkeypatch.setattr(configs, "gluon_forward_variant", spy)
    q = torch.zeros(1, n, 2, 128, dtype=torch.bfloat16)
    assert not kernels._gluon_forward(q, q, q, None, 0, 0, None, bounds, 1.0, False, True, 128)
    assert asked == [bounds.keys_per_seeing_row if seeing_rows else bounds.keys_per_row]
    own = held_bounds(mine, mine, n, cu, Window(None, 0)).on_device("cpu")
    assert own.keys_per_row == own.keys_per_seeing_row
    # no row seeing a key: both 0, no division by zero
    none = held_bounds(mine, theirs, n, torch.tensor([0, n, 2 * n]), Window(None, 0)).on_device("cpu")
    assert none.keys_per_row == none.keys_per_seeing_row == 0.0


def test_gluon_forward_choice(monkeypatch):
    """Which Gluon forward variant a block asks for on a GPU: GLUON_FWD by head dim (up to
    GLUON_PERSISTENT_MAX_KEYS keys GLUON_FWD_SHORT's persistent programs), packed documents
    GLUON_FWD_DOCUMENTS, none for an untuned head dim; override(gluon=) forces one (or
    none), a Triton forward override turns it off. Every variant named exists for its head dim."""
    from ringflash.kernels import configs, gluon_forward

    monkeypatch.setattr(configs, "INTERPRETING", False)
    assert configs.gluon_forward_variant(128) == configs.GLUON_FWD[128]
    assert configs.gluon_forward_variant(128, documents=True) == configs.GLUON_FWD_DOCUMENTS[128]
    assert configs.gluon_forward_variant(32) is None
    for d, least in configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW.items():  # short documents: the Triton forward
        docs = configs.GLUON_FWD_DOCUMENTS[d]
        assert configs.gluon_forward_variant(d, documents=True, keys_per_row=least) == docs
        fewer = configs.gluon_forward_variant(d, documents=True, keys_per_row=max(least - 0.5, 0.0))
        assert fewer is (None if least else docs), d
    assert set(configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW) == set(configs.GLUON_FWD_DOCUMENTS)
    with configs.override(gluon="ws2_n64"):
        assert configs.gluon_forward_variant(128) == "ws2_n64"
    with configs.override(gluon=None):
        assert configs.gluon_forward_variant(128, documents=True) is None
    with configs.override(fwd=configs.KernelConfig(64, 64, 4, 2)):
        assert configs.gluon_forward_variant(128) is None
    with configs.override(dq=configs.KernelConfig(64, 64, 4, 2), gluon_bwd=None):  # the backward's alone
        assert configs.gluon_forward_variant(128) == configs.GLUON_FWD[128]
    for table in (configs.GLUON_FWD, configs.GLUON_FWD_DOCUMENTS, configs.GLUON_FWD_SHORT,
                  configs.GLUON_FWD_SHORT_CAUSAL, configs.GLUON_FWD_LONG, configs.GLUON_FWD_DENSE):  # fmt: skip
        for d, name in table.items():
            assert d in gluon_forward.VARIANTS[name]
    # short key ranges take persistent programs; longer ones and packed documents do not
    most = configs.GLUON_PERSISTENT_MAX_KEYS
    for d, name in configs.GLUON_FWD_SHORT.items():
        assert configs.gluon_forward_variant(d, keys=most) == name and gluon_forward.config_for(d, name).persistent
        assert configs.gluon_forward_variant(d, keys=most + 1) == configs.GLUON_FWD[d]
        # causal blocks: GLUON_FWD_LONG from GLUON_LONG_MIN_KEYS_CAUSAL keys where it has the head
        # dim; below, GLUON_FWD_SHORT_CAUSAL where it has the head dim, else the one-tile GLUON_FWD
        for keys in (most - 1, most, most + 1):
            if d in configs.GLUON_FWD_LONG and keys >= configs.GLUON_LONG_MIN_KEYS_CAUSAL:
                causal = configs.GLUON_FWD_LONG[d]
            elif keys <= most:
                causal = configs.GLUON_FWD_SHORT_CAUSAL.get(d, configs.GLUON_FWD[d])
            else:
                causal = configs.GLUON_FWD[d]
            assert configs.gluon_forward_variant(d, keys=keys, causal=True) == causal, (d, keys)
        assert (
            configs.gluon_forward_variant(d, documents=True, keys_per_row=1e9, keys=1) == configs.GLUON_FWD_DOCUMENTS[d]
        )
    # D=64: causal blocks of 4K keys take ws3, shorter ones ws2_p, dense blocks of 4K ws2_p
    assert [configs.gluon_forward_variant(64, keys=n, causal=True) for n in (4095, 4096)] == ["ws2_p", "ws3"]
    assert configs.gluon_forward_variant(64, keys=4096) == "ws2_p"
    assert set(configs.GLUON_FWD_SHORT_CAUSAL) <= set(configs.GLUON_FWD_SHORT)
    assert configs.GLUON_FWD_SHORT_CAUSAL != configs.GLUON_FWD_SHORT  # (else the table is not needed)
    assert configs.gluon_forward_variant(256, keys=1) == configs.GLUON_FWD[256]
    # long key ranges take GLUON_FWD_LONG where it has the head dim; packed documents and an
    # unknown key count (sliding windows) do not
    least = configs.GLUON_LONG_MIN_KEYS
    assert least > most and configs.GLUON_FWD_LONG
    for d in (64, 128, 256):
        long = configs.GLUON_FWD_LONG.get(d, configs.GLUON_FWD[d])
        assert configs.gluon_forward_variant(d, keys=least) == long
        assert configs.gluon_forward_variant(d, keys=least - 1) == configs.GLUON_FWD[d]
        assert configs.gluon_forward_variant(d) == configs.GLUON_FWD[d]
        docs = configs.gluon_forward_variant(d, documents=True, keys_per_row=1e9, keys=least)
        assert docs == configs.GLUON_FWD_DOCUMENTS[d]
    # dense blocks of many keys take GLUON_FWD_DENSE where it has the head dim, before
    # GLUON_FWD_LONG; masked ones (dense=False), packed documents and short ones do not
    dense_least = configs.GLUON_DENSE_MIN_KEYS
    assert dense_least > most and configs.GLUON_FWD_DENSE
    for d in (64, 128, 256):
        wide = configs.GLUON_FWD_DENSE.get(d)
        assert configs.gluon_forward_variant(d, keys=dense_least, dense=True) == (
            wide or configs.GLUON_FWD_LONG.get(d, configs.GLUON_FWD[d])
        )
        assert configs.gluon_forward_variant(d, keys=dense_least, dense=False) == configs.GLUON_FWD_LONG.get(
            d, configs.GLUON_FWD[d]
        )
        below = configs.gluon_forward_variant(d, keys=dense_least - 1, dense=True)
        assert below == configs.GLUON_FWD_LONG.get(d, configs.GLUON_FWD[d])
        docs = configs.gluon_forward_variant(d, documents=True, keys_per_row=1e9, keys=dense_least, dense=True)
        assert docs == configs.GLUON_FWD_DOCUMENTS[d]
        if wide:
            assert gluon_forward.config_for(d, wide).block_nt > 0


@pytest.mark.parametrize(
    "window,counted", [(None, True), (Window(None, 0), True), (Window(None, 5), True), (Window(7, 0), False),
                       (Window(3, 4), False)]
)  # fmt: skip
def test_gluon_forward_choice_sees_the_key_count(window, counted, monkeypatch):
    """A block's forward asks for its Gluon variant with its key count (GLUON_FWD_SHORT /
    GLUON_FWD_LONG go by it), except under a sliding window (a left bound), which asks with
    none: the persistent and three-consumer variants were measured on dense and causal blocks.
    It asks as a dense block (GLUON_FWD_DENSE) only with no mask and head dims of one piece
    each: the wide key blocks take no head-dim pieces; as a causal one (GLUON_FWD_SHORT_CAUSAL)
    with a window that has no left bound."""
    from ringflash import kernels
    from ringflash.kernels import configs

    asked = []
    monkeypatch.setattr(
        configs, "gluon_forward_variant", lambda *a, **kw: asked.append((kw["keys"], kw["dense"], kw["causal"]))
    )
    causal = window is not None and window.left is None
    q, k, v = (torch.randn(1, n, 2, 16) for n in (5, 11, 11))
    ran = kernels._gluon_forward(q, k, v, None, 0, 0, window, None, 0.25, False, True, 16)
    assert ran is False and asked == [(11 if counted else None, window is None, causal)]
    asked.clear()
    q12, k12, v12 = (t[..., :12] for t in (q, k, v))  # 12 under its padding to 16: two pieces
    kernels._gluon_forward(q12, k12, v12, None, 0, 0, window, None, 0.25, False, True, 16)
    assert asked == [(11 if counted else None, False, causal)]


def test_lse_computed_only_when_returned(monkeypatch):
    """An eager call computes lse (three small ops of host time) only with return_lse=True; the
    output and its gradients do not depend on it."""
    from ringflash import local
    from ringflash.merge import SoftmaxState

    calls = []
    real = SoftmaxState.lse
    monkeypatch.setattr(SoftmaxState, "lse", lambda self: calls.append(1) or real(self))
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    assert calls == []
    out2, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert calls == [1] and torch.equal(out, out2)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    grads2 = torch.autograd.grad(out2.sum() + 0 * lse.sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    packed = local.flash_attn_varlen_func(q[0], k[0], v[0], *(torch.tensor([0, 9, 16]),) * 2, causal=True)
    assert calls == [1] and packed.shape == (16, 2, 8)


@pytest.mark.parametrize("Sq", [64, 100, 1])
def test_gluon_backward_row_stats(Sq):
    """The fused backward's packed row statistics (built by torch ops, on any device): per
    (batch, head) the offsets m + log2(l) (+inf where l = 0) then delta, each padded to whole
    query blocks with (+inf, 0); in one launch also the blocked dQ scratch and a persistent
    launch's counter zeroed."""
    from ringflash.kernels import gluon_backward as gb

    cfg = gb.GluonBwdConfig()
    g = torch.Generator().manual_seed(Sq)
    m, delta = (torch.randn(2, 3, Sq, generator=g) for _ in range(2))
    l = torch.rand(2, 3, Sq, generator=g) + 0.5
    l[0, 1, 0] = 0.0  # a row that saw no key
    Sp = gb.padded_rows(Sq, cfg)
    st = gb.row_stats(m, l, delta, cfg).view(2, 3, 2, Sp)
    want = torch.where(l > 0, m + torch.log2(l), float("inf"))
    assert torch.equal(st[:, :, 0, :Sq], want) and torch.equal(st[:, :, 1, :Sq], delta)
    assert bool((st[:, :, 0, Sq:] == float("inf")).all()) and bool((st[:, :, 1, Sq:] == 0).all())
    assert st[0, 1, 0, 0] == float("inf") and Sp % cfg.block_m == 0 and Sp >= Sq
    # the same in one Triton launch (the interpreter here), over views with other strides, the
    # blocked float32 dQ buffer zeroed in passing; offsets within the rounding of two float32
    # log2 (<= 1 ulp each, numpy's against torch's)
    big = torch.randn(2, 2, 3, Sq + 5, generator=g)
    m2, l2, d2 = big[0, ..., 2:-3], big[1, ..., 1:-4].abs() + 0.5, torch.randn(2, 3, Sq, generator=g)
    l2[1, 2, -1] = 0.0
    dq32 = torch.full((2, 3, Sp, 64), float("nan"))
    counter = torch.full((1,), 7, dtype=torch.int32)  # persistent programs' counter, zeroed in passing too
    one = gb.launch_row_stats(m2, l2, d2, cfg, dq32, counter=counter).view(2, 3, 2, Sp)
    assert int(counter) == 0
    ref = gb.row_stats(m2, l2, d2, cfg).view(2, 3, 2, Sp)
    ulp = torch.finfo(torch.float32).eps * ref[:, :, 0, :Sq].abs().clamp_min(1.0)
    got, want = one[:, :, 0, :Sq], ref[:, :, 0, :Sq]
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite], want[~finite])
    assert bool(((got - want).abs()[finite] <= 2 * ulp[finite]).all())
    assert torch.equal(one[:, :, 1], ref[:, :, 1]) and torch.equal(one[:, :, 0, Sq:], ref[:, :, 0, Sq:])
    assert bool((dq32 == 0).all())
    # delta computed in the same launch from the output (merge.DeltaOf), with and without dlse:
    # rowsum(out * do) of Dv float32 products, within Dv roundings of the sum of |products|;
    # Dv = 96 is read 128 wide, the columns past it masked
    from ringflash.merge import DeltaOf

    dlse = torch.randn(2, 3, Sq, generator=g)
    for Dv in (64, 96):
        out, do = (torch.randn(2, Sq + 3, 3, Dv, generator=g).to(torch.bfloat16)[:, 3:] for _ in range(2))
        products = out.float() * do.float()
        bound = Dv * torch.finfo(torch.float32).eps * products.abs().sum(-1).transpose(1, 2)
        for pending_dlse in (None, dlse):
            want_delta = products.sum(-1).transpose(1, 2) - (0 if pending_dlse is None else pending_dlse)
            got = gb.launch_row_stats(m2, l2, DeltaOf(out, pending_dlse), cfg, do=do).view(2, 3, 2, Sp)
            assert bool(((got[:, :, 1, :Sq] - want_delta).abs() <= bound).all()), Dv
            assert bool((got[:, :, 1, Sq:] == 0).all()) and torch.equal(got[:, :, 0], one[:, :, 0])


def test_gluon_backward_choice(monkeypatch):
    """Which fused backward a block asks for on a GPU: GLUON_BWD by head dim, none for an
    untuned one; override(gluon_bwd=) forces one (or none), a Triton backward override (or the
    interpreter) turns it off. Every variant named exists for its head dim."""
    from ringflash.kernels import configs, gluon_backward

    monkeypatch.setattr(configs, "INTERPRETING", False)
    assert configs.gluon_backward_variant(128) == configs.GLUON_BWD[128]
    assert configs.gluon_backward_variant(32) is None
    with configs.override(gluon_bwd="ws2"):
        assert configs.gluon_backward_variant(128) == "ws2"
    with configs.override(gluon_bwd=None):
        assert configs.gluon_backward_variant(128) is None
    for kind in ("dkdv", "dq"):
        with configs.override(**{kind: configs.KernelConfig(64, 64, 4, 2)}):
            assert configs.gluon_backward_variant(128) is None
    assert configs.gluon_backward_variant(128, documents=True) == configs.GLUON_BWD_DOCUMENTS.get(128)
    monkeypatch.setattr(configs, "GLUON_BWD_DOCUMENTS", {128: "ws2_lag"})
    assert configs.gluon_backward_variant(128, documents=True) == "ws2_lag"
    monkeypatch.setattr(configs, "INTERPRETING", True)
    assert configs.gluon_backward_variant(128) is None
    for table in (configs.GLUON_BWD, configs.GLUON_BWD_DOCUMENTS):
        for d, name in table.items():
            assert d in gluon_backward.VARIANTS[name]


def test_override_holds_across_threads():
    """override() holds for the whole process while its block runs: autograd runs a CUDA
    backward on its own thread, and an override around forward and backward must reach it
    (a context variable did not: the GPU backward silently kept its built-in configs)."""
    import threading

    from ringflash.kernels import configs

    seen = []
    probe = lambda: seen.append((configs.pick("dq", 64), configs.overridden("gluon_bwd")))  # noqa: E731
    shape = configs.KernelConfig(16, 16, 4, 1)
    with configs.override(dq=shape, gluon_bwd=None):
        worker = threading.Thread(target=probe)
        worker.start()
        worker.join()
    probe()
    assert seen[0] == (shape, True)
    assert seen[1][0] != shape and not seen[1][1]


@pytest.mark.parametrize("compiled", [False, True])
def test_deterministic_reaches_the_backward(compiled, monkeypatch):
    """block_backward gets the call's mode (deterministic=True, torch.use_deterministic_algorithms,
    or neither), from flash_attn_func and flash_attn_varlen_func, eager and compiled (the
    operators carry it from the forward to the backward)."""
    from ringflash import flash_attn_varlen_func, local

    seen = []
    real = local.block_backward
    monkeypatch.setattr(local, "block_backward", lambda *a, **kw: seen.append(kw["deterministic"]) or real(*a, **kw))
    q, k, v = (torch.randn(1, 12, 2, 16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    dense = lambda **kw: flash_attn_func(q, k, v, causal=True, **kw)  # noqa: E731
    packed = lambda **kw: flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, causal=True, **kw)  # noqa: E731
    for fn in (dense, packed):
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")

        def modes(**kw):
            seen.clear()
            torch.autograd.grad(fn(**kw).sum(), (q, k, v))
            return set(seen)

        assert modes() == {False} and modes(deterministic=True) == {True}
        torch.use_deterministic_algorithms(True)
        try:
            assert modes() == {True}
        finally:
            torch.use_deterministic_algorithms(False)


def test_fused_backward_only_where_it_runs(monkeypatch):
    """kernels.fuses_backward: never on a CPU tensor, with a key bias, dropout or
    deterministic=True; its device-independent part (fused_backward_fits, any device): never for
    float32, head dims not padded to a tuned width, unequal ones unless the larger's variant splits
    the head dim (256), or a GPU it does not run on (0 SMs); dense blocks need
    GLUON_BWD_MIN_PROGRAMS_PER_SM programs per SM unless the block is a one-device call's whole
    attention of at most GLUON_BWD_SHORT_CALL_PAIRS (batch x query heads x queries x keys), per-row
    bounds also GLUON_BWD_DOCUMENTS_MIN_PAIRS pairs x heads; a gluon_bwd override forces it at any
    size."""
    from ringflash import kernels
    from ringflash.dropout import Dropout
    from ringflash.kernels import configs
    from ringflash.masks import RowBounds, Window

    monkeypatch.setattr(configs, "INTERPRETING", False)
    big = torch.empty(1, 16384, 32, 128, dtype=torch.bfloat16)  # 128 key blocks x 32 heads
    small = torch.empty(1, 1024, 8, 128, dtype=torch.bfloat16)  # 8 x 8
    fits = kernels.fused_backward_fits
    assert fits(big, big, big, None, 132) and not fits(small, small, small, None, 132)
    # a short one-device call: few programs, fused all the same; up to the bound, not past it
    assert fits(small, small, small, None, 132, whole_call=True)
    assert configs.GLUON_BWD_SHORT_CALL_PAIRS == 32 * 4096 * 4096
    short_q, one_kv = (
        torch.empty(1, 4096, 32, 128, dtype=torch.bfloat16),
        torch.empty(1, 4096, 1, 128, dtype=torch.bfloat16),
    )
    assert fits(short_q, one_kv, one_kv, None, 132, whole_call=True) and not fits(short_q, one_kv, one_kv, None, 132)
    long_q, long_kv = (
        torch.empty(1, 4097, 32, 128, dtype=torch.bfloat16),
        torch.empty(1, 4097, 1, 128, dtype=torch.bfloat16),
    )
    assert not fits(long_q, long_kv, long_kv, None, 132, whole_call=True)  # 33 programs, device-bound
    assert not fits(small.float(), small.float(), small.float(), None, 132, whole_call=True)
    assert not fits(small, small, small, None, 0, whole_call=True)
    assert not fits(big, big, big, None, 0)
    assert not fits(big.float(), big.float(), big.float(), None, 132)
    assert not fits(big, big, big[..., :64], None, 132)
    assert fits(big[..., :96], big[..., :96], big[..., :96], None, 132)  # padded to a tuned 128
    assert not fits(big[..., :32], big[..., :32], big[..., :32], None, 132)  # 32: none tuned
    wide = torch.empty(1, 16384, 32, 192, dtype=torch.bfloat16)  # padded to 256: the head-dim split
    assert fits(wide, wide, wide, None, 132)
    assert fits(wide, wide, big, None, 132) and fits(big, big, wide, None, 132)  # MLA's 192 / 128 and the mirror
    with configs.override(gluon_bwd=configs.GLUON_BWD[128]):  # a variant that does not split: equal dims only
        assert fits(big, big, big, None, 132) and not fits(wide, wide, big, None, 132)
    monkeypatch.setattr(configs, "GLUON_BWD", {k: v for k, v in configs.GLUON_BWD.items() if k != 256})
    assert not fits(wide, wide, wide, None, 132)  # no variant for 256
    monkeypatch.undo()
    monkeypatch.setattr(configs, "INTERPRETING", False)
    with configs.override(gluon_bwd=configs.GLUON_BWD[128]):
        assert fits(small, small, small, None, 132)
    with configs.override(gluon_bwd=None):
        assert not fits(big, big, big, None, 132)
    rows = torch.zeros(16384, dtype=torch.int32)
    threshold = configs.GLUON_BWD_DOCUMENTS_MIN_PAIRS / (16384 * 32)  # keys per row at the threshold
    for keys_per_row, want in ((threshold * 0.9, False), (threshold * 1.1, True), (None, True)):
        bounds = RowBounds(rows, rows, rows, rows, keys_per_row)
        assert fits(big, big, big, bounds, 132) == (want and bool(configs.GLUON_BWD_DOCUMENTS)), keys_per_row

    kw = dict(window=None, bounds=None)
    assert not kernels.fuses_backward(big, big, big, **kw)  # on the CPU
    assert not kernels.fuses_backward(big, big, big, deterministic=True, **kw)
    assert not kernels.fuses_backward(big, big, big, key_bias=torch.zeros(1, 16384), **kw)
    assert not kernels.fuses_backward(big, big, big, dropout=Dropout(1, 0.1), **kw)
    assert not kernels.fuses_backward(big, big, big, window=Window(16, 0), bounds=None)


def test_builtin_configs_match_the_h200_sweep():
    """The table the kernels use on Hopper is the one the committed sweep chose."""
    import json
    from pathlib import Path

    from ringflash.kernels import configs

    chosen = json.loads((Path(__file__).parents[1] / "benchmarks/results/configs_h200.json").read_text())
    tables = {"fwd": configs._FWD, "dkdv": configs._DKDV, "dq": configs._DQ}
    for kind, by_d in chosen.items():
        for d, cfg in by_d.items():  # the fields the sweep chose (not the numerics switches)
            assert {k: getattr(tables[kind][int(d)], k) for k in cfg} == cfg, (kind, d)


@pytest.mark.parametrize("backend", ["triton"], indirect=True)
def test_backward_with_very_negative_scores(backend):
    """Every score near -140 and a ragged last key tile: the zero rows past the end of the keys
    get p = exp(140) = inf in float32 inside the dK/dV program; they must stay out of every
    gradient."""
    q, k, v = _inputs(1, 40, 45, 4, 2, 32, torch.float32, seed=11)
    with torch.no_grad():
        q.sub_(5.0), k.add_(5.0)  # scores ~ -140
    out = flash_attn_func(q, k, v)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(12))
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = reference(q, k, v, do)
    plain = plain_errors(q, k, v, do, ref)
    for name, g, r in zip("dq dk dv".split(), grads, ref[2:]):
        assert torch.isfinite(g).all(), name
        assert_within(name, g, r, plain[name])


def test_backward_runs_on_the_forwards_backend():
    """A backward outside the use_backend block of its forward still runs on the forward's
    backend (the other would rebuild the probabilities with other arithmetic), for the local
    function and the ring's engine."""
    from ringflash import ring_flash_attn_func
    from ringflash.local import use_backend

    q, k, v, causal, scale = _large_score_case(3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    for fn in (flash_attn_func, ring_flash_attn_func):
        with use_backend("triton"):
            inside = torch.autograd.grad(fn(q, k, v, causal=causal, softmax_scale=scale), (q, k, v), do)
            out = fn(q, k, v, causal=causal, softmax_scale=scale)
        outside = torch.autograd.grad(out, (q, k, v), do)
        for a, b in zip(inside, outside):
            assert torch.equal(a, b), fn.__name__


@BOTH
@pytest.mark.parametrize(
    "Sq,Sk,causal,window_size",
    [(70, 70, True, (5, 0)), (70, 70, False, (9, 4)), (70, 70, False, (0, 0)), (70, 70, True, (1, -1)),
     (50, 90, True, (17, 0)), (90, 50, False, (3, 11)), (64, 64, False, (-1, 7)), (64, 64, False, (20, -1)),
     (40, 40, True, (200, 0)), (33, 100, False, (2, 2))],
)  # fmt: skip
def test_sliding_windows(backend, Sq, Sk, causal, window_size):
    """Windows of 0, 1, odd and larger than the sequence, one side open, Sq != Sk (bottom-right
    aligned), causal and not, GQA; rows that see no key get 0 and -inf."""
    for dtype in case_dtypes(backend, _dtypes(backend)[:2], Sq + window_size[0] + window_size[1] + causal):
        q, k, v = _inputs(1, Sq, Sk, 4, 2, 32, dtype, seed=Sq + Sk + window_size[0])
        out, lse = _check(q, k, v, causal, window_size=window_size)
        ref, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window_size)
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty)
        assert torch.all(out.transpose(1, 2)[empty] == 0)


def test_window_size_errors():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="window_size must be a pair of ints >= -1"):
        flash_attn_func(q, q, q, window_size=(-2, 3))
    with pytest.raises(ValueError, match="causal=True means window_size's right is 0"):
        flash_attn_func(q, q, q, causal=True, window_size=(3, 1))


@BOTH
def test_remembered_call_matches_a_checked_one(backend, monkeypatch):
    """flash_attn_func remembers a checked call by its signature; a repeated call skips the
    checks and gives what the first, fully checked call gave: output, lse and gradients, bitwise.
    At most _CALLS_KEPT signatures are kept."""
    from ringflash import local

    monkeypatch.setattr(local, "_CALLS", {})
    q, k, v = _inputs(1, 8, 8, 4, 2, 16, torch.float32, 0)
    do = torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for _ in range(2):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        results.append((out, lse, *torch.autograd.grad((out, lse), (q, k, v), (do, torch.ones_like(lse)))))
        assert len(local._CALLS) == 1
    for a, b in zip(*results):
        assert torch.equal(a, b)
    monkeypatch.setattr(local, "_CALLS_KEPT", 3)
    for S in range(1, 6):
        x = torch.randn(1, S, 2, 16)
        flash_attn_func(x, x, x)
        assert len(local._CALLS) <= 3


def test_call_plan_learns_and_replays_only_alike_calls(monkeypatch):
    """local._CallPlan's rules, with the Gluon wrappers stood in (the plan is otherwise made for
    CUDA calls only): a half is learned only from a run whose layers used exactly one kept plan
    of its kind on the call's own tensors (plans.recording), and gives up after _TRIES runs
    that taught it nothing; a replay launches the learned plan on the new call's tensors, and
    only for inputs of the learned strides, alignment and aliasing, with no config override, and
    in the backward for dO, dlse, out, m and l of the learned keys and the learned scale."""
    from ringflash import local
    from ringflash.kernels import configs, gluon_backward, gluon_forward, plans
    from ringflash.merge import DeltaOf

    launched, prepared = [], []
    monkeypatch.setattr(gluon_forward, "launch_planned", lambda plan, tensors: launched.append((plan, tensors)))

    def prepared_from(plan, *tensors, scale, accumulate):
        prepared.append((plan, tensors, scale, accumulate))
        return lambda: None

    monkeypatch.setattr(gluon_backward, "prepared_from", prepared_from)
    mk = lambda: torch.randn(1, 8, 2, 16)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    plan = local._CallPlan()
    key = plan.input_key(q, k, v)
    forward_plan, backward_plan = object(), object()

    def forward_run(*uses):  # uses: (kind, the tensors' indices into the call's, or None: a copy)
        def run():
            state = local._output_state(q, v)
            own = (q, k, v, state.o, state.m, state.l, *local._NO_MASKS)
            for kind, copy_at in uses:
                tensors = tuple(t.clone() if i == copy_at else t for i, t in enumerate(own))
                plans.record(kind, forward_plan, tensors)
            return state

        return run

    for uses in ([], [("forward", None)] * 2, [("backward", None)], [("forward", 0)], [("forward", 4)]):
        plan._tries[0] = 0
        plan.learn_forward(key, q, k, v, forward_run(*uses))
        assert plan.replay_forward(key, q, k, v) is None and not launched, uses
    plan.learn_forward(key, q, k, v, forward_run(("forward", None)))
    q2, k2, v2 = mk(), mk(), mk()
    state = plan.replay_forward(plan.input_key(q2, k2, v2), q2, k2, v2)
    ((used, tensors),) = launched
    assert used is forward_plan and tensors[:3] == (q2, k2, v2) and tensors[3:] == (*state, *local._NO_MASKS)
    assert state.o.shape == q2.shape and state.m.shape == (1, 2, 8)
    transposed = torch.randn(1, 2, 8, 16).transpose(1, 2)
    assert plan.input_key(transposed, k, v) != key and plan.input_key(q, q, v) != key
    assert plan.replay_forward(plan.input_key(transposed, k, v), transposed, k, v) is None
    with configs.override(gluon=None):
        assert plan.input_key(q, k, v) is None
    fresh = local._CallPlan()  # a half that learned nothing _TRIES times stops recording
    for _ in range(local._CallPlan._TRIES + 1):
        fresh.learn_forward(key, q, k, v, forward_run())
    with plans.recording() as outer:
        fresh.learn_forward(key, q, k, v, forward_run(("forward", None)))
    assert fresh._forward is None and len(outer) == 1  # recorded to the outer block, not learned

    out, m, l = state.o, state.m, state.l
    do, dlse, scale = torch.randn_like(out), None, 0.25
    layers_ran = []

    def backward_run(scale_used=scale, accumulate=False, delta_out=None):
        def run():
            layers_ran.append(1)
            grads = local._gradients(q2, k2, v2)
            delta = DeltaOf(out if delta_out is None else delta_out, dlse)
            plans.record("backward", backward_plan,
                         (q2, k2, v2, m, l, do, delta, *grads, scale_used, accumulate, None, None))  # fmt: skip
            return grads

        return run

    key2 = plan.input_key(q2, k2, v2)
    for run in (backward_run(scale_used=0.5), backward_run(accumulate=True), backward_run(delta_out=out.clone())):
        plan._tries[1] = 0
        plan.backward(key2, q2, k2, v2, out, m, l, do, dlse, scale, run)
        assert plan._backward is None
    plan._tries[1] = 0
    plan.backward(key2, q2, k2, v2, out, m, l, do, dlse, scale, backward_run())
    layers_ran.clear()
    dq, dk, dv = plan.backward(key2, q2, k2, v2, out, m, l, torch.randn_like(out), dlse, scale, backward_run())
    ((used, tensors, used_scale, accumulate),) = prepared
    assert used is backward_plan and used_scale == scale and not accumulate and not layers_ran
    assert tensors[:5] == (q2, k2, v2, m, l) and tensors[7:] == (dq, dk, dv) and tensors[6].out is out
    shifted = torch.empty(do.numel() + 1)[1:].view(do.shape)  # 4 bytes off a 16-byte boundary
    for args in ((shifted, dlse), (do, torch.zeros(1, 2, 8))):  # a dO or dlse unlike the learned
        plan.backward(key2, q2, k2, v2, out, m, l, *args, scale, backward_run())
        assert layers_ran and len(prepared) == 1
        layers_ran.clear()
    other = plan.input_key(transposed, k2, v2)
    plan.backward(other, q2, k2, v2, out, m, l, do, dlse, scale, backward_run())  # another input key
    assert layers_ran and len(prepared) == 1
