"""GPU correctness of the Triton kernels in bf16 and fp16 against float64, S up to 16K.

Run on a CUDA machine with `pytest -m gpu` (CPU CI skips these).
"""

import pytest
import torch

from ringflash import flash_attn_func
from ringflash.kernels import _block_d

from oracle import (
    assert_within,
    dropout_factors,
    force_fused_backward,
    key_bias_on_gluon,
    naive_attention,
    plain_errors,
    reference,
    spy_fused_backward,
)

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
def test_forward_backward_vs_float64(dtype, causal, case, window_size=(-1, -1), Dv=None):
    B, Sq, Sk, Hq, Hkv, D = case
    g = torch.Generator(device="cuda").manual_seed(Sq + D)
    mk = lambda S, H, d=D: torch.randn(B, S, H, d, device="cuda", generator=g, dtype=dtype).requires_grad_()
    q, k, v = mk(Sq, Hq), mk(Sk, Hkv), mk(Sk, Hkv, Dv or D)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_lse=True)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)

    ref, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window_size)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    plain, _ = naive_attention(q, k, v, causal=causal, window_size=window_size, dtype=dtype)
    plain_grads = torch.autograd.grad(plain, (q, k, v), do)
    assert_within("out", out, ref, plain)
    for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
        assert_within(name, got, r, p)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))  # rows that see no key


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_fits_and_is_exact(D, causal):
    """float32 inputs (true float32 products) take the _FLOAT32 block shapes where the 16-bit
    ones would not fit in shared memory."""
    test_forward_backward_vs_float64(torch.float32, causal, (1, 1031, 1031, 4, 2, D))


# (causal, window_size, (B, Sq, Sk, Hq, Hkv, D)) of the window tests
WINDOW_CASES = [
    (True, (511, 0), (1, 4096, 4096, 4, 2, 128)),
    (True, (0, 0), (1, 1031, 1031, 2, 1, 64)),
    (False, (300, 77), (2, 2049, 2049, 4, 4, 128)),
    (False, (-1, 128), (1, 777, 2048, 4, 1, 64)),
    (False, (40, 0), (1, 2048, 777, 2, 2, 128)),  # queries before every key's window see nothing
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window_size,case", WINDOW_CASES)
def test_windows_vs_float64(dtype, causal, window_size, case):
    test_forward_backward_vs_float64(dtype, causal, case, window_size)


@pytest.mark.parametrize("how", ["argument", "torch_flag"])
def test_deterministic_on_gpu(how, monkeypatch):
    """deterministic=True, or torch.use_deterministic_algorithms(True): the two-pass backward
    (the fused kernel is never called), bitwise equal run to run, on the shape the fused kernel
    would otherwise take."""
    calls = spy_fused_backward(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 4096, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    results = []
    before = torch.are_deterministic_algorithms_enabled()
    try:
        if how == "torch_flag":
            torch.use_deterministic_algorithms(True, warn_only=True)
        for _ in range(2):
            out = flash_attn_func(q, k, v, causal=True, deterministic=how == "argument")
            results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    finally:
        torch.use_deterministic_algorithms(before)
    assert not calls
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "case",
    [(2, 1031, 1031, 4, 2, 128), (1, 777, 2048, 4, 1, 128), (1, 2048, 777, 8, 8, 128), (2, 1031, 1031, 4, 2, 64)],
    ids=lambda c: "x".join(map(str, c)),
)
def test_fused_backward_vs_float64(dtype, causal, case, monkeypatch):
    """The fused Gluon backward (configs.GLUON_BWD, forced at these small sizes), D=64 / 128,
    dense and causal, Sq != Sk aligned bottom-right: gradients against float64 within the plain
    bound, as the two-pass backward's."""
    calls = spy_fused_backward(monkeypatch)
    force_fused_backward(monkeypatch)
    test_forward_backward_vs_float64(dtype, causal, case)
    assert calls, "the fused backward was not used"


@pytest.mark.parametrize("variant", ["ws2_lag", "ws2"])  # blocked dQ, row-major dQ atomics
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", [(2, 1031, 1031, 4, 2, 96), (1, 777, 2048, 4, 1, 48), (1, 2048, 777, 8, 8, 80)],
                         ids=lambda c: "x".join(map(str, c)))  # fmt: skip
def test_fused_backward_at_padded_head_dims(variant, causal, case, monkeypatch):
    """Head dims under their tile width (48 -> 64, 80 and 96 -> 128) in the fused backward:
    zero columns read, dK / dV stored to their true width, dQ's (zero) padding columns kept out
    of dq, through the blocked dQ and the row-major atomics; bf16 gradients against float64
    within the plain bound."""
    from ringflash.kernels import configs

    calls = spy_fused_backward(monkeypatch)
    force_fused_backward(monkeypatch)
    monkeypatch.setattr(configs, "GLUON_BWD", dict.fromkeys(configs.GLUON_BWD, variant))
    test_forward_backward_vs_float64(torch.bfloat16, causal, case)
    assert calls, "the fused backward was not used"


@pytest.mark.parametrize("variant", ["split_d_blk", "split_d"])  # blocked dQ, row-major dQ atomics
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "dtype,case,Dv",
    [
        (torch.bfloat16, (2, 1031, 1031, 4, 2, 256), None),
        (torch.float16, (1, 777, 2048, 4, 1, 256), None),
        (torch.bfloat16, (1, 2048, 777, 8, 8, 192), None),  # 192 and 136 run 256 wide
        (torch.bfloat16, (1, 1031, 1031, 4, 1, 136), None),
        (torch.bfloat16, (1, 1031, 1031, 4, 2, 192), 128),  # MLA's q/k and v head dims
        (torch.float16, (1, 777, 2048, 4, 1, 192), 128),
        (torch.bfloat16, (1, 1031, 777, 4, 4, 128), 256),  # v wider than q/k
        (torch.bfloat16, (1, 1031, 1031, 2, 1, 256), 72),
    ],
    ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c).split(".")[-1],
)
def test_fused_backward_split_head_dim(variant, causal, dtype, case, Dv, monkeypatch):
    """Wide head dims in the fused backward that splits the head-dim columns over its two
    consumer warpgroups (64-key blocks, P^T and dS^T exchanged through shared memory): dense and
    causal, Sq != Sk bottom-right, GQA, padded widths, v's head dim apart from q/k's (the tiles
    of the larger one's config); gradients against float64 within the plain bound."""
    from ringflash.kernels import configs

    calls = spy_fused_backward(monkeypatch)
    force_fused_backward(monkeypatch)
    monkeypatch.setattr(configs, "GLUON_BWD", {**configs.GLUON_BWD, 256: variant})
    test_forward_backward_vs_float64(dtype, causal, case, Dv=Dv)
    assert calls, "the fused backward was not used"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "causal,window_size,case",
    [
        *WINDOW_CASES,
        (False, (130, -1), (1, 1031, 1031, 2, 2, 128)),  # and a left reach alone
        (True, (511, 0), (1, 2048, 2048, 4, 2, 256)),  # the head-dim split schedule
        (False, (40, 0), (1, 2048, 777, 2, 2, 192)),
    ],
)
def test_fused_backward_windows_vs_float64(dtype, causal, window_size, case, monkeypatch):
    """Sliding windows in the fused backward (both edges masked, key blocks visiting only the
    query blocks their window reaches): gradients against float64 within the plain bound."""
    calls = spy_fused_backward(monkeypatch)
    force_fused_backward(monkeypatch)
    test_forward_backward_vs_float64(dtype, causal, case, window_size)
    assert calls, "the fused backward was not used"


def test_fused_backward_is_the_default_where_it_fills_the_gpu(monkeypatch):
    """By default: B=1, S=4096, 32 kv heads (1024 programs) take the fused kernel, dense and with
    a window, and so does a call as short as configs.GLUON_BWD_SHORT_CALL_PAIRS with 2 kv heads
    (64 programs), and so does a key padding mask (configs.GLUON_KEY_BIAS); past it, 32 query
    heads on one kv head at 8K (64 programs, under configs.GLUON_BWD_MIN_PROGRAMS_PER_SM) take
    the two passes, and so does a key padding mask with GLUON_KEY_BIAS off."""
    from ringflash.kernels import configs

    calls = spy_fused_backward(monkeypatch)

    def run(H, Hkv=None, S=4096, **kw):
        calls.clear()
        q = torch.randn(1, S, H, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, S, Hkv or H, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))  # fmt: skip
        flash_attn_func(q, k, v, **kw).sum().backward()
        return bool(calls)

    assert run(32, causal=True) and run(32, window_size=(255, 0))
    assert run(32, 2, causal=True) and run(2, causal=True)
    assert not run(32, 1, S=8192, causal=True)
    padding = torch.zeros(1, 4096, dtype=torch.bool, device="cuda")
    assert run(32, key_padding_mask=padding) == configs.GLUON_KEY_BIAS
    monkeypatch.setattr(configs, "GLUON_KEY_BIAS", False)
    assert not run(32, key_padding_mask=padding)


@pytest.mark.parametrize("D", [256, 32, 1, 4, 12, 72, 200])  # below 16 or not a multiple of 8: padded inside
@pytest.mark.parametrize("causal", [False, True])
def test_other_head_dims(D, causal):
    test_forward_backward_vs_float64(torch.bfloat16, causal, (1, 2049, 2049, 4, 2, D))


@pytest.mark.parametrize("D,Dv", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_v_head_dim_differs(D, Dv, causal, monkeypatch):
    """v's head dim apart from q/k's (MLA: 192 and 128), bf16 against float64, out and
    gradients within 2x plain bf16 attention: the Gluon forward with V tiles of their own width
    (BLOCK_DV != BLOCK_D), the backward's two passes with tensor descriptors of both widths."""
    from ringflash.kernels import gluon_forward

    calls = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    test_forward_backward_vs_float64(torch.bfloat16, causal, (1, 2049, 2049, 4, 2, D), Dv=Dv)
    assert calls, "the Gluon forward was not used"


@pytest.mark.parametrize("D,Dv", [(192, 128), (192, 192), (168, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_head_dim_in_pieces(D, Dv, causal, monkeypatch):
    """q/k's head dim in pieces (128 + 64; 168's tail columns past the head dim read as zeros)
    in the fused backward (split_d_pieces: dK's and dQ's pieces crossed between the two
    warpgroups), v's 128 (MLA) or 192: out and gradients against float64 within 2x plain bf16
    attention, and the fused kernel ran with the tail piece."""
    variant = "split_d_pieces"
    from ringflash.kernels import configs, gluon_backward

    plans = []
    real = gluon_backward.launch_plan
    monkeypatch.setattr(gluon_backward, "launch_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    with configs.override(gluon_bwd=variant):
        test_forward_backward_vs_float64(torch.bfloat16, causal, (1, 2049, 2049, 4, 2, D), Dv=Dv)
    assert plans and all(kw["BLOCK_DT"] == 64 for *_, kw in plans), [p[3] for p in plans]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (True, (300, 0)), (False, (-1, -1))])
def test_fused_backward_grouped_heads(D, causal, window_size, monkeypatch):
    """The fused backward with causal key blocks taken a few kv heads at a time (ws2_lag_grouped:
    a 3-D grid, 2 of 4 heads a group here): dK and dV bitwise equal to the plain grid order's
    (each key block's are one program's sums), dQ (float32 atomics in another order) and all
    against float64 within the plain bound; a non-causal block keeps the 2-D grid. The same
    with each key block walking its query blocks down (ws2_lag_grouped_down: dK, dV summed in
    another order, so within the bound only)."""
    from ringflash.kernels import configs, gluon_backward, gluon_forward

    force_fused_backward(monkeypatch)
    monkeypatch.setattr(gluon_backward, "_PLANS", gluon_backward.Plans())
    plans = []
    real = gluon_backward.launch_plan
    monkeypatch.setattr(gluon_backward, "launch_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    g = torch.Generator(device="cuda").manual_seed(D + 11)
    mk = lambda H: torch.randn(2, 1031, H, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(4), mk(2), mk(2)
    do = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    kw = dict(causal=causal, window_size=window_size)
    # per kv head: Sq x (q heads a kv head) x ((D + Dv) x 2 bytes + D x 4): room for 2 of the 4
    monkeypatch.setattr(gluon_forward, "TILE_ORDER_L2_BYTES", 2 * 1031 * 2 * (2 * D * 2 + D * 4))
    grads = {}
    for variant in ("ws2_lag", "ws2_lag_grouped", "ws2_lag_grouped_down"):
        with configs.override(gluon_bwd=variant):
            out = flash_attn_func(q, k, v, **kw)
            grads[variant] = torch.autograd.grad(out, (q, k, v), do)
    (_, grid, _, kwargs), (_, grid_g, _, kwargs_g), (_, grid_d, _, kwargs_d) = plans[-3:]
    assert not kwargs["GROUPED_HEADS"] and len(grid) == 2
    assert kwargs_g["GROUPED_HEADS"] == causal and grid_g == grid_d == ((2, grid[0], 2) if causal else grid)
    assert (kwargs["WALK"], kwargs_g["WALK"], kwargs_d["WALK"]) == (0, 0, 2)
    assert torch.equal(grads["ws2_lag"][1], grads["ws2_lag_grouped"][1])
    assert torch.equal(grads["ws2_lag"][2], grads["ws2_lag_grouped"][2])
    ref = naive_attention(q, k, v, **kw)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    plain = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)[0]
    plain_grads = torch.autograd.grad(plain, (q, k, v), do)
    for variant in ("ws2_lag_grouped", "ws2_lag_grouped_down"):
        for name, got, r, p in zip(("dq", "dk", "dv"), grads[variant], ref_grads, plain_grads):
            assert_within(f"{variant} {name}", got, r, p)


def _three_programs_recorded(monkeypatch) -> list:
    """The fused backward forced at any size, on three multiprocessors' worth of persistent
    programs, with no kept launch plans yet: the list each new launch plan (kernel, grid, args,
    kwargs) is appended to."""
    from ringflash.kernels import gluon_backward

    force_fused_backward(monkeypatch)
    monkeypatch.setattr(gluon_backward, "_PLANS", gluon_backward.Plans())
    monkeypatch.setattr(gluon_backward, "multiprocessors", lambda device: 3)
    plans = []
    real = gluon_backward.launch_plan
    monkeypatch.setattr(gluon_backward, "launch_plan", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    return plans


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "causal,window_size,Sq,Sk",
    [(True, (-1, -1), 1031, 1031), (False, (-1, -1), 1031, 1031), (True, (300, 0), 1031, 1031),
     (True, (300, 0), 257, 2049)],
)  # fmt: skip
def test_fused_backward_persistent(D, causal, window_size, Sq, Sk, monkeypatch):
    """The fused backward's key blocks in persistent programs that take them from a counter
    (ws2_lag_grouped_down_pc), here three programs for 36 or 68 key blocks, and (257 queries
    under a 300-key window at the end of 2049 keys) blocks that no query sees between blocks with
    steps. dK and dV bitwise equal to one block a program's (each block's sums are one program's,
    in the same order), dQ (float32 atomics in another order) and all against float64 within the
    plain bound; the launches were one-dimensional, three programs, and the last call ran on a
    kept plan (with its own counter)."""
    from ringflash.kernels import configs

    plans = _three_programs_recorded(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D + Sk)
    mk = lambda S, H: torch.randn(2, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(Sq, 4), mk(Sk, 2), mk(Sk, 2)
    do = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    kw = dict(causal=causal, window_size=window_size)
    grads = {}
    variants = ("ws2_lag_grouped_down", "ws2_lag_grouped_down_pc")
    # the persistent variant three times: its plan is built on the second call, kept for the third
    for variant in variants + variants[-1:] * 2:
        with configs.override(gluon_bwd=variant):
            out = flash_attn_func(q, k, v, **kw)
            grads[variant] = torch.autograd.grad(out, (q, k, v), do)
    assert [p[3]["PERSISTENT"] for p in plans] == [False, True, True], [p[3] for p in plans]
    assert [p[1] for p in plans[1:]] == [(3,)] * 2
    for variant in variants[1:]:
        for i in (1, 2):
            assert torch.equal(grads["ws2_lag_grouped_down"][i], grads[variant][i]), variant
    ref = naive_attention(q, k, v, **kw)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    plain = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)[0]
    plain_grads = torch.autograd.grad(plain, (q, k, v), do)
    for variant in variants[1:]:
        for name, got, r, p in zip(("dq", "dk", "dv"), grads[variant], ref_grads, plain_grads):
            assert_within(f"{variant} {name}", got, r, p)


@pytest.mark.parametrize("variant", ["pointers", "tma", "tma+ws"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_variants_and_key_padding(variant, causal):
    """Every forward variant the sweep may pick, with and without a key padding mask."""
    from ringflash.kernels import configs

    base = configs.forward_config(128)
    with configs.override(
        fwd=configs.KernelConfig(
            base.block_m,
            base.block_n,
            base.num_warps,
            base.num_stages,
            tma=variant != "pointers",
            warp_specialize=variant == "tma+ws",
        )
    ):
        g = torch.Generator(device="cuda").manual_seed(5)
        q, k, v = (torch.randn(2, 3001, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        mask = torch.rand(2, 3001, device="cuda", generator=g) < 0.2
        for kpm in (None, mask):
            out = flash_attn_func(q, k, v, causal=causal, key_padding_mask=kpm)
            ref, _ = naive_attention(q, k, v, causal=causal, key_padding_mask=kpm)
            plain, _ = naive_attention(q, k, v, causal=causal, key_padding_mask=kpm, dtype=torch.bfloat16)
            assert_within(f"out {variant}", out, ref, plain)


@pytest.mark.parametrize("qk_order", [False, True], ids=["kq_order", "qk_order"])
@pytest.mark.parametrize("seed", range(8))
def test_large_scores_float32(seed, qk_order):
    """test_local.test_large_scores on the GPU's compiled kernels and block shapes, float32
    (true float32 products): out, lse and dV at the level of plain float32, dQ/dK at the level
    of the flash algorithm done plainly, over 4 summation orders. With the dK/dV pass in either
    operand order: whether K Q^T rebuilds the forward's probabilities here decides qk_order."""
    from ringflash.kernels import configs

    mag = (3.0, 10.0, 30.0, 70.0)[seed % 4]
    causal, scale = bool(seed % 2), (1.0, 0.3, None, -0.5)[(seed // 2) % 4]
    g = torch.Generator(device="cuda").manual_seed(100 + seed)
    q, k, v = (torch.randn(1, 300, H, 32, device="cuda", generator=g) for H in (4, 2, 2))
    q, k = q * mag, k * mag
    do = torch.randn(q.shape, device="cuda", generator=g)
    base = configs.dkdv_config(32)
    with configs.override(dkdv=configs.KernelConfig(**{**base.__dict__, "qk_order": qk_order})):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = flash_attn_func(qs, ks, vs, causal=causal, softmax_scale=scale, return_lse=True)
        got = (out, lse, *torch.autograd.grad(out, (qs, ks, vs), do))
    kw = dict(causal=causal, scale=scale)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), do.cpu(), **kw)
    plain = plain_errors(q.cpu(), k.cpu(), v.cpu(), do.cpu(), ref, orders=4, seed=seed, **kw)
    for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert_within(name, x.cpu(), r, plain[name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_16bit(dtype, causal):
    """|scores| ~ 1e3-1e4 in 16-bit inputs with the built-in D=128 shapes: against float64,
    within 2x of plain 16-bit attention (autograd through a softmax)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(1, 1031, H, 128, device="cuda", generator=g) for H in (4, 2, 2, 4))
    q, k = (t * 8.0 for t in (q, k))
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(qs, ks, vs, causal=causal, softmax_scale=1.0)
    got = (out, *torch.autograd.grad(out, (qs, ks, vs), do))
    ref = reference(q, k, v, do, causal=causal, scale=1.0)
    plain = plain_errors(q, k, v, do, ref, causal=causal, scale=1.0)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, (ref[0], *ref[2:])):
        assert_within(name, x, r, plain[name])


@pytest.mark.parametrize(
    "causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (200, 0)), (False, (300, 77))]
)
@pytest.mark.parametrize("D,Dv", [(128, 128), (96, 96), (192, 192), (192, 128), (128, 64), (64, 128)])
def test_gluon_forward_is_used_and_agrees(causal, window_size, D, Dv, monkeypatch):
    """bf16 blocks without a key bias run on the Gluon forward (configs.GLUON_FWD), dense,
    causal or windowed, at D=128, at head dims under their padding (96 and 192 run the 128-
    and 256-wide tiles with zero columns) and with v's head dim apart from q/k's (V and O tiles
    of their own width): its output and lse against float64 within the plain bound, and beside
    the Triton kernel's (override(gluon=None)) within the same bound; a key padding mask takes
    the Triton kernel only with configs.GLUON_KEY_BIAS off."""
    from ringflash.kernels import configs, gluon_forward

    calls = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (torch.randn(2, 1031, H, d, device="cuda", generator=g, dtype=torch.bfloat16) for H, d in
               ((4, D), (2, D), (2, Dv)))  # fmt: skip
    kw = dict(causal=causal, window_size=window_size)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    assert calls, "the Gluon forward was not used"
    with configs.override(gluon=None):
        out_t, lse_t = flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, ref_lse = naive_attention(q, k, v, **kw)
    plain, plain_lse = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)
    assert_within("out", out, ref, plain)
    assert_within("out vs triton", out, out_t.double(), plain)
    assert_within("lse", lse, ref_lse, plain_lse, sum_len=1)
    assert_within("lse vs triton", lse, lse_t.double(), plain_lse, sum_len=1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))  # rows that see no key
    calls.clear()
    padding = torch.zeros(2, 1031, dtype=torch.bool, device="cuda")
    flash_attn_func(q, k, v, key_padding_mask=padding, **kw)
    assert bool(calls) == configs.GLUON_KEY_BIAS
    calls.clear()
    monkeypatch.setattr(configs, "GLUON_KEY_BIAS", False)
    flash_attn_func(q, k, v, key_padding_mask=padding, **kw)
    assert not calls


def _key_padding(kind, B, Sk, g):
    """A key padding mask of each kind: "bool" (about a fifth of the keys hidden, the last batch
    row's last 600 keys all hidden: right padding, whose key blocks the kernels skip), "float"
    (finite biases, natural-log units, and -inf on the same keys), "empty" (bool, the first
    batch row's keys all hidden: its rows see no key), "runs" (bool, padding only: the first
    row's first 50 keys hidden, the last row's last 600, so that each row's visible keys hold a
    zero-bias span of 384-key multiples, key_bias.key_spans, and keys outside it)."""
    hidden = torch.rand(B, Sk, device="cuda", generator=g) < 0.2
    if kind == "runs":
        hidden[:] = False
        hidden[0, :50] = True
    hidden[-1, -600:] = True
    if kind == "empty":
        hidden[0] = True
    if kind != "float":
        return hidden
    bias = torch.randn(B, Sk, device="cuda", generator=g, dtype=torch.float32) * 3
    return bias.masked_fill(hidden, float("-inf"))


@pytest.mark.parametrize("tier", ["short", "middle", "long"])
@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_key_bias(tier, D, Dv, causal, monkeypatch):
    """A key padding mask (bool, and finite float biases with -inf) on the Gluon kernels
    (configs.GLUON_KEY_BIAS): the forward in each tier of its choice (ws2_p, the one-tile
    default, ws3 at D=64) and the fused backward at the shapes' default variants. Out, lse and
    gradients against float64 within the plain bf16 computation's error, out beside the Triton
    kernels' (override(gluon=None), two passes) within the same bound, and both Gluon kernels
    ran. Keys 1031 a row (the bias copied to 16-byte rows for its TMA descriptor); the key blocks
    past a row's last visible key are skipped (configs.GLUON_CUT_KEY_PADDING), and those of a
    zero-bias span computed without the bias (configs.PLAIN_ZERO_BIAS_KEYS; "runs")."""
    from ringflash.kernels import configs

    fwd_calls, bwd_calls = key_bias_on_gluon(monkeypatch)
    most, least, dense_least = KEY_TIERS[tier]
    monkeypatch.setattr(configs, "GLUON_PERSISTENT_MAX_KEYS", most)
    monkeypatch.setattr(configs, "GLUON_LONG_MIN_KEYS", least)
    monkeypatch.setattr(configs, "GLUON_DENSE_MIN_KEYS", dense_least)
    g = torch.Generator(device="cuda").manual_seed(D + Dv + 3 * causal + len(tier))
    B, S = 2, 1031
    for kind in ("bool", "float", "empty", "runs"):
        mk = lambda H, d: torch.randn(B, S, H, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
        q, k, v = mk(4, D), mk(2, D), mk(2, Dv)
        kpm = _key_padding(kind, B, S, g)
        kw = dict(causal=causal, key_padding_mask=kpm)
        fwd_calls.clear()
        bwd_calls.clear()
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        assert fwd_calls and bwd_calls, (kind, fwd_calls, bwd_calls)
        with configs.override(gluon=None):
            out_t = flash_attn_func(q, k, v, deterministic=True, **kw)
        ref, ref_lse = naive_attention(q, k, v, **kw)
        ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
        plain, plain_lse = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)
        plain_grads = torch.autograd.grad(plain, (q, k, v), do)
        assert_within(f"out {kind}", out, ref, plain)
        assert_within(f"out vs triton {kind}", out, out_t.double(), plain)
        assert_within(f"lse {kind}", lse, ref_lse, plain_lse, sum_len=1)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
            assert_within(f"{name} {kind}", got, r, p)


@pytest.mark.parametrize("D", [64, 128])
def test_key_padding_that_hides_nothing_is_free_bitwise(D, monkeypatch):
    """configs.PLAIN_ZERO_BIAS_KEYS: a key padding mask that hides no key has one zero-bias span
    over every key (key_bias.key_spans), so every kernel computes exactly what it does without a
    mask: out and lse bit for bit on the Gluon forward, dK and dV on the fused backward (its dQ
    adds come in any order), and all five on the Triton kernels (deterministic two passes).
    Without the spans the bias's FMA rounds every score apart. Causal (a dense call's variant
    differs with a bias), 2 x 1031 keys (a ragged last block)."""
    from ringflash.kernels import configs

    fwd_calls, bwd_calls = key_bias_on_gluon(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D)
    mk = lambda H: torch.randn(2, 1031, H, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(4), mk(2), mk(2)
    do = torch.randn(2, 1031, 4, D, device="cuda", generator=g, dtype=torch.bfloat16)
    nothing = torch.zeros(2, 1031, dtype=torch.bool, device="cuda")

    def run(mask, **kw):
        out, lse = flash_attn_func(q, k, v, causal=True, key_padding_mask=mask, return_lse=True, **kw)
        return [out, lse, *torch.autograd.grad(out, (q, k, v), do)]

    masked = run(nothing)
    assert fwd_calls and bwd_calls
    plain = run(None)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), masked, plain):
        assert name == "dq" or torch.equal(a, b), name
    with configs.override(gluon=None):
        masked, plain = run(nothing, deterministic=True), run(None, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), masked, plain):
        assert torch.equal(a, b), f"triton {name}"


# the key-count thresholds that put a 1031-key block in each tier of the Gluon forward's choice:
# (GLUON_PERSISTENT_MAX_KEYS, GLUON_LONG_MIN_KEYS, GLUON_DENSE_MIN_KEYS)
KEY_TIERS = {
    "short": (10**9, 10**9 + 1, 10**9 + 1),
    "middle": (0, 10**9, 10**9),
    "long": (0, 1, 10**9),
    "dense": (0, 10**9, 1),
}


@pytest.mark.parametrize(
    "causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (-1, 77)), (True, (200, 0))]
)
@pytest.mark.parametrize("tier", list(KEY_TIERS))
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_forward_by_key_count(tier, D, causal, window_size, monkeypatch):
    """Dense, causal and one-sided windowed blocks take configs.GLUON_FWD_SHORT (causal ones
    GLUON_FWD_SHORT_CAUSAL) up to GLUON_PERSISTENT_MAX_KEYS keys, GLUON_FWD_LONG from
    GLUON_LONG_MIN_KEYS, dense blocks (no mask) GLUON_FWD_DENSE from GLUON_DENSE_MIN_KEYS, else
    GLUON_FWD (a head dim missing from a tier's table: GLUON_FWD); a sliding window (a left
    bound) takes GLUON_FWD at any key count.
    The thresholds moved so that a 1031-key block (GQA 4/2) falls in each tier: the variant
    launched is the tier's, and its output and lse agree with float64 within the plain bound."""
    from ringflash.kernels import configs, gluon_forward

    most, least, dense_least = KEY_TIERS[tier]
    monkeypatch.setattr(configs, "GLUON_PERSISTENT_MAX_KEYS", most)
    monkeypatch.setattr(configs, "GLUON_LONG_MIN_KEYS", least)
    monkeypatch.setattr(configs, "GLUON_DENSE_MIN_KEYS", dense_least)
    table = {"short": configs.GLUON_FWD_SHORT, "middle": configs.GLUON_FWD, "long": configs.GLUON_FWD_LONG,
             "dense": configs.GLUON_FWD_DENSE}[tier]  # fmt: skip
    masked = causal or window_size != (-1, -1)
    if tier == "dense" and masked:  # masked blocks fall through to the tier below
        table = configs.GLUON_FWD
    if tier == "short" and masked:  # causal blocks (no left bound) take their own short table
        table = configs.GLUON_FWD_SHORT_CAUSAL
    sliding = window_size[0] != -1
    expected = configs.GLUON_FWD[D] if sliding else table.get(D, configs.GLUON_FWD[D])
    launched = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: launched.append(kw["config"]) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(D + len(tier))
    q, k, v = (torch.randn(2, 1031, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for H in (4, 2, 2))
    kw = dict(causal=causal, window_size=window_size)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    assert launched == [expected]
    ref, ref_lse = naive_attention(q, k, v, **kw)
    plain, plain_lse = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)
    assert_within("out", out, ref, plain)
    assert_within("lse", lse, ref_lse, plain_lse, sum_len=1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


@pytest.mark.parametrize("variant", ["ws2_k192e", "ws2_k160"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sk", [100, 150, 200, 1031])
def test_gluon_forward_key_blocks_in_two_pieces(variant, causal, Sk):
    """Key blocks of 192 and 160 keys, each in two pieces (128 + 64 / 32): keys that end in the
    first piece, in the second, just past one block, and ragged over several; dense and causal,
    GQA 4/2: output and lse against float64 within the plain bound. Then a ring step: the keys
    in two calls, the second folding into the first's float32 state and normalizing, against
    float64 within the same bound."""
    import math

    from ringflash.kernels import configs, gluon_forward

    g = torch.Generator(device="cuda").manual_seed(Sk + causal)
    q, k, v = (torch.randn(2, n, H, 128, device="cuda", generator=g, dtype=torch.bfloat16) for n, H in
               ((300, 4), (Sk, 2), (Sk, 2)))  # fmt: skip
    launched = []
    real = gluon_forward.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gluon_forward, "forward", lambda *a, **kw: launched.append(kw["config"]) or real(*a, **kw))
        with configs.override(gluon=variant):
            out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert launched == [variant]
    ref, ref_lse = naive_attention(q, k, v, causal=causal)
    plain, plain_lse = naive_attention(q, k, v, causal=causal, dtype=torch.bfloat16)
    assert_within("out", out, ref, plain)
    assert_within("lse", lse, ref_lse, plain_lse, sum_len=1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # a ring step (non-causal): keys [0, cut) then [cut, Sk) folded in
    cut = Sk // 3
    o = torch.zeros(2, 300, 4, 128, device="cuda")
    m, l = (torch.zeros(2, 4, 300, device="cuda") for _ in range(2))
    for lo, hi, last in ((0, cut, False), (cut, Sk, True)):
        gluon_forward.forward(q, k[:, lo:hi], v[:, lo:hi], q_start=0, k_start=lo, scale=1 / math.sqrt(128),
                              out_o=o, out_m=m, out_l=l, normalize=last, fold=lo > 0, config=variant)  # fmt: skip
    ref, _ = naive_attention(q, k, v)
    plain, _ = naive_attention(q, k, v, dtype=torch.bfloat16)
    assert_within("folded out", o, ref, plain)


@pytest.mark.parametrize(
    "D,variant", [(64, "ws3"), (128, "ws2_s3"), (64, "ws3_short_last"), (128, "ws2_s3_short_last")]
)
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (False, (300, 77))])
def test_gluon_forward_tile_order(D, variant, causal, window_size, monkeypatch):
    """The one-tile Gluon forward's launch order (heads_per_group heads together, heaviest
    tiles first: _gluon_fwd._launch_order) visits every tile once: with 1, 3 (of 8: groups of
    2, 3 and 3 with the short group first, 3, 3 and 2 with it last) and all 8 heads a group the output
    and lse are bitwise identical, and within the plain bound of float64."""
    from ringflash.kernels import configs, gluon_forward
    from ringflash.kernels.plans import Plans

    g = torch.Generator(device="cuda").manual_seed(D + 3)
    q, k, v = (torch.randn(2, 1031, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for H in (4, 2, 2))
    kw = dict(causal=causal, window_size=window_size)
    per_head = 1031 * 2 * (D + D)  # keys x (q/k's + v's head dim) x 2 bytes
    real = gluon_forward.heads_per_group
    results = []
    for heads in (1, 3, 8):
        monkeypatch.setattr(gluon_forward, "TILE_ORDER_L2_BYTES", heads * per_head)
        monkeypatch.setattr(gluon_forward, "_PLANS", Plans())  # plans keep their launch's arguments
        grouped = []
        monkeypatch.setattr(gluon_forward, "heads_per_group", lambda *a: grouped.append(real(*a)) or grouped[-1])
        with configs.override(gluon=variant):
            results.append(flash_attn_func(q, k, v, return_lse=True, **kw))
        assert grouped == [heads]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    ref, ref_lse = naive_attention(q, k, v, **kw)
    plain, plain_lse = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)
    assert_within("out", results[0][0], ref, plain)
    assert_within("lse", results[0][1], ref_lse, plain_lse, sum_len=1)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gluon_forward_dynamic_tiles(D, causal, monkeypatch):
    """Persistent programs taking their tiles from a counter (ws2_pd; ws2_pd7, seven programs;
    three programs; dense and causal, GQA 4/2, queries and keys that end inside a tile and a
    block): output and lse against float64 within the plain bf16 bound, bitwise equal to ws2_p's
    (the same tiles, each computed alone by one program), the outputs poisoned before every
    call; three calls back to back per case (the plan kept from the second call on), after each
    the device's counter back at zero (the launch's last fetch resets it: a missing reset would
    leave the next call no tiles)."""
    import math
    from dataclasses import replace

    from ringflash.kernels import gluon_forward as gf
    from ringflash.kernels.plans import Plans

    monkeypatch.setattr(gf, "_PLANS", Plans())
    counter = gf.tile_counter(torch.device("cuda", torch.cuda.current_device()))
    g = torch.Generator(device="cuda").manual_seed(D + 10 * causal)
    variants = ["ws2_pd", "ws2_pd7", replace(gf.config_for(D, "ws2_pd"), max_programs=3)]
    for B, Sq, Sk in ((2, 1031, 1031), (1, 257, 2049), (1, 128, 128), (2, 2048, 4096)):
        q = torch.randn(B, Sq, 4, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, 2, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        ref, ref_lse = naive_attention(q, k, v, causal=causal)
        plain, plain_lse = naive_attention(q, k, v, causal=causal, dtype=torch.bfloat16)
        results = {}
        for variant in ["ws2_p", *variants]:
            for call in range(3):
                o = torch.full((B, Sq, 4, D), float("nan"), device="cuda", dtype=torch.bfloat16)
                m, l = (torch.full((B, 4, Sq), float("nan"), device="cuda") for _ in range(2))
                gf.forward(q, k, v, q_start=Sk - Sq, k_start=0, scale=1 / math.sqrt(D), out_o=o, out_m=m, out_l=l,
                           normalize=True, fold=False, causal=causal, config=variant)  # fmt: skip
                torch.cuda.synchronize()
                assert counter.item() == 0, (variant, call, counter.item())
                lse = (m + torch.log2(l)) * math.log(2)  # m and l in base 2
                name = f"{variant} {B}x{Sq}x{Sk} call {call}"
                assert_within(f"out {name}", o, ref, plain)
                assert_within(f"lse {name}", lse, ref_lse, plain_lse, sum_len=1)
                results.setdefault(variant if isinstance(variant, str) else "3 programs", []).append((o, m, l))
        for variant, got in results.items():
            for o, m, l in got:
                want = results["ws2_p"][0]
                assert torch.equal(o, want[0]) and torch.equal(m, want[1]) and torch.equal(l, want[2]), variant


# (causal, window_size, extra keys per document) of the packed-documents tests: 37 extra keys
# give documents whose keys no query sees (37 keys and no query); -40 queries that see no key
# (bottom-right alignment; documents of 1-40 queries and no key)
DOCUMENT_CASES = [
    (True, (-1, -1), 0),
    (False, (-1, -1), 0),
    (True, (255, 0), 0),
    (False, (100, 300), 0),
    (True, (-1, -1), 37),
    (True, (-1, -1), -40),
]
DOCUMENT_LENGTHS = [1, 0, 700, 3000, 129, 64, 1500, 2, 257, 5, 130]


def _documents(len_k_extra):
    """(query lengths, key lengths, cu_seqlens_q, cu_seqlens_k on the GPU) of DOCUMENT_LENGTHS
    with len_k_extra keys per document (at least 0)."""
    len_q = DOCUMENT_LENGTHS
    len_k = [max(n + len_k_extra, 0) for n in len_q]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], device="cuda") for x in (len_q, len_k))
    return len_q, len_k, cu_q, cu_k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window_size,len_k_extra", DOCUMENT_CASES)
@pytest.mark.parametrize("D", [128, 64, 96, 192])
@pytest.mark.parametrize("fused", [True, False])
def test_documents_backward_vs_float64(dtype, causal, window_size, len_k_extra, D, fused, monkeypatch):
    """Packed documents (per-row bounds) in the fused backward (configs.GLUON_BWD_DOCUMENTS,
    forced at every size) and in the two passes (deterministic=True, on the documents tables'
    shapes where they have the head dim; 96 runs 128 wide): documents of 0 to 3000 rows,
    key blocks straddling several, Sq != Sk per document; dq, dk, dv against float64 within
    the plain bound; keys no query sees get dK = dV = 0, queries that see no key dQ = 0."""
    from ringflash.kernels import configs
    from ringflash.local import flash_attn_varlen_func
    from ringflash.testing import varlen_plain_errors, varlen_reference

    W = _block_d(D)  # the tile width D runs at (96: 128, zero columns)
    calls = spy_fused_backward(monkeypatch)
    if fused:
        force_fused_backward(monkeypatch)
        monkeypatch.setattr(configs, "GLUON_BWD_DOCUMENTS", {W: configs.GLUON_BWD_DOCUMENTS[W]})
    chosen = []
    real_config = configs.kind_config
    monkeypatch.setattr(configs, "kind_config", lambda *a, **kw: chosen.append(real_config(*a, **kw)) or chosen[-1])
    len_q, len_k, cu_q, cu_k = _documents(len_k_extra)
    g = torch.Generator(device="cuda").manual_seed(len(len_q) + len_k_extra + D + 40)
    mk = lambda n, H: torch.randn(n, H, D, device="cuda", generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(sum(len_q), 8), mk(sum(len_k), 2), mk(sum(len_k), 2)
    do = torch.randn(q.shape, device="cuda", generator=g, dtype=dtype)
    kw = dict(causal=causal, window_size=window_size)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, deterministic=not fused, **kw)
    chosen.clear()
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert bool(calls) == fused, "the fused backward was used" if calls else "the fused backward was not used"
    if not fused:
        tables = [configs._DOCUMENTS[kind].get(W, configs.pick(kind, W)) for kind in ("dkdv", "dq")]
        assert chosen == tables
    ref = varlen_reference(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, **kw)
    plain = varlen_plain_errors(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, ref, **kw)
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert_within(name, got, r, plain[name])
        assert not torch.isnan(got).any()
    # rows in no visible pair (float64 reference: a query's output, a key's dV, exactly 0; not
    # dQ's own zeros, which a query seeing one key also has)
    lonely_q, lonely_k = ((t == 0).flatten(1).all(1) for t in (ref[0], ref[4]))
    assert (grads[0][lonely_q] == 0).all() and (grads[1][lonely_k] == 0).all() and (grads[2][lonely_k] == 0).all()
    assert bool(lonely_q.any() or lonely_k.any()) == (len_k_extra != 0)  # the cases built to have such rows do


@pytest.mark.parametrize("causal,window_size,len_k_extra", DOCUMENT_CASES)
@pytest.mark.parametrize("D", [128, 64])
def test_fused_backward_persistent_documents(causal, window_size, len_k_extra, D, monkeypatch):
    """Packed documents' per-row bounds in persistent programs (ws2_lag_pc: the producer plans
    each key block's query blocks and passes them on with the block; ws2_lag_pch: the blocks
    handed out most query blocks first, the bounds given their key order as a ring step's are),
    three programs for the documents' key blocks of two kv heads, blocks that no query sees among
    them: dK and dV bitwise equal to one block a program's (ws2_lag), everything against float64
    within the plain bound, keys no query sees get dK = dV = 0; the launches were
    one-dimensional, three programs, the last in the bounds' key order."""
    from ringflash import ops
    from ringflash.kernels import configs
    from ringflash.local import flash_attn_varlen_func
    from ringflash.masks import key_block_order
    from ringflash.testing import varlen_plain_errors, varlen_reference

    def ordered(*args):
        b = real(*args)
        return b._replace(key_order=key_block_order(b.q_lo.cpu(), b.q_hi.cpu()).to(b.q_lo.device))

    real = ops.packed_bounds
    monkeypatch.setattr(ops, "packed_bounds", ordered)
    plans = _three_programs_recorded(monkeypatch)
    len_q, len_k, cu_q, cu_k = _documents(len_k_extra)
    g = torch.Generator(device="cuda").manual_seed(len(len_q) + len_k_extra + D + 41)
    mk = lambda n, H: torch.randn(n, H, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(sum(len_q), 8), mk(sum(len_k), 2), mk(sum(len_k), 2)
    do = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    kw = dict(causal=causal, window_size=window_size)
    grads = {}
    variants = ("ws2_lag", "ws2_lag_pc", "ws2_lag_pch")
    for variant in variants:
        monkeypatch.setattr(configs, "GLUON_BWD_DOCUMENTS", {D: variant})
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kw)
        grads[variant] = torch.autograd.grad(out, (q, k, v), do)
    assert [p[3]["ROWS"] for p in plans] == [True, True, True], [p[3] for p in plans]
    assert [p[3]["PERSISTENT"] for p in plans] == [False, True, True]
    assert [p[3]["ORDERED"] for p in plans] == [False, False, True]
    assert plans[1][1] == plans[2][1] == (3,)
    order = dict(zip(plans[2][0].arg_names, plans[2][2]))["KEY_ORDER"]
    assert sorted(order.tolist()) == list(range(-(-k.shape[0] // 128))) != order.tolist()  # (not the grid's)
    ref = varlen_reference(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, **kw)
    plain = varlen_plain_errors(q.detach(), k.detach(), v.detach(), do, cu_q, cu_k, ref, **kw)
    lonely_k = (ref[4] == 0).flatten(1).all(1)
    for variant in variants[1:]:
        for i in (1, 2):
            assert torch.equal(grads["ws2_lag"][i], grads[variant][i]), variant
        for name, got, r in zip(("dq", "dk", "dv"), grads[variant], ref[2:]):
            assert_within(f"{variant} {name}", got, r, plain[name])
        assert (grads[variant][1][lonely_k] == 0).all() and (grads[variant][2][lonely_k] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window_size,len_k_extra", DOCUMENT_CASES)
@pytest.mark.parametrize("D", [128, 64, 256])
def test_gluon_forward_documents(dtype, causal, window_size, len_k_extra, D, monkeypatch):
    """Packed documents (per-row bounds) at each head dim on its Gluon forward
    (configs.GLUON_FWD_DOCUMENTS, forced: these documents are short enough that the built-in rule
    would take the Triton forward, configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW): documents of 0 to 3000 rows, most 128-row
    tiles straddling several; out and lse against float64 within the plain bound and beside the
    Triton kernel's; rows that see no key give out 0 and lse -inf."""
    from ringflash.kernels import configs, gluon_forward
    from ringflash.local import flash_attn_varlen_func
    from ringflash.testing import varlen_plain_errors, varlen_reference

    calls = []
    real = gluon_forward.forward
    monkeypatch.setattr(gluon_forward, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    len_q, len_k, cu_q, cu_k = _documents(len_k_extra)
    g = torch.Generator(device="cuda").manual_seed(len(len_q) + len_k_extra + 40)
    mk = lambda n, H: torch.randn(n, H, D, device="cuda", generator=g, dtype=dtype)  # noqa: E731
    q, k, v, do = mk(sum(len_q), 8), mk(sum(len_k), 2), mk(sum(len_k), 2), mk(sum(len_q), 8)
    kw = dict(causal=causal, window_size=window_size)
    with configs.override(gluon=configs.GLUON_FWD_DOCUMENTS[D]):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert calls, "the Gluon forward was not used"
    with configs.override(gluon=None):
        out_t, lse_t = flash_attn_varlen_func(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    ref = varlen_reference(q, k, v, do, cu_q, cu_k, **kw)
    plain = varlen_plain_errors(q, k, v, do, cu_q, cu_k, ref, **kw)
    assert_within("out", out, ref[0], plain["out"])
    assert_within("out vs triton", out, out_t.double(), plain["out"])
    assert_within("lse", lse, ref[1], plain["lse"], sum_len=1)
    assert_within("lse vs triton", lse, lse_t.double(), plain["lse"], sum_len=1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref[1]))
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_vs_float64_with_the_same_mask(dtype, causal):
    """dropout_p in the kernels on the GPU: output and gradients against float64 with the keep
    mask of ringflash.dropout (the CPU oracle of the pairs), D = 128 and a padded D = 96."""
    from ringflash.dropout import draw_seed

    for B, S, Hq, Hkv, D in ((1, 1031, 4, 2, 128), (2, 515, 2, 1, 96)):
        g = torch.Generator(device="cuda").manual_seed(S + D)
        mk = lambda H: torch.randn(B, S, H, D, device="cuda", generator=g, dtype=dtype).requires_grad_()  # noqa: E731
        q, k, v = mk(Hq), mk(Hkv), mk(Hkv)
        p = 0.15
        torch.manual_seed(7)
        seed = draw_seed()
        torch.manual_seed(7)
        out = flash_attn_func(q, k, v, causal=causal, dropout_p=p)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), do)
        drop = dropout_factors(seed, p, B, Hq, S, S, device="cuda")
        ref = naive_attention(q, k, v, causal=causal, drop=drop)[0]
        ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
        plain = naive_attention(q, k, v, causal=causal, drop=drop, dtype=dtype)[0]
        plain_grads = torch.autograd.grad(plain, (q, k, v), do)
        assert_within("out", out, ref, plain)
        for name, got, r, pl in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
            assert_within(name, got, r, pl)


@pytest.mark.parametrize("D", [64, 128, 96])  # Gluon forward + fused backward; Triton kernels (96)
def test_fast_launch_path_matches_triton_dispatch(D, monkeypatch):
    """launch() calls a compiled kernel directly once Triton's dispatch has found it: the
    launches it takes over give bitwise the outputs and (deterministic) gradients of Triton's
    own dispatch, also for arguments of another alignment (a view one row in)."""
    from ringflash.kernels import launcher

    g = torch.Generator(device="cuda").manual_seed(D)
    base = torch.randn(3, 1, 1025, 4, D, device="cuda", generator=g, dtype=torch.bfloat16)

    def run():
        results = []
        for rows in (slice(0, 1024), slice(1, 1025)):  # the second: another data_ptr alignment
            for deterministic in (True, False):  # False: the fused backward where it runs
                q, k, v = (t[:, rows].detach().requires_grad_() for t in base)
                out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
                # the fused dQ is summed by atomics in a varying order: not compared bitwise
                results += [out, dq, dk, dv] if deterministic else [out, dk, dv]
        return results

    force_fused_backward(monkeypatch)  # D = 64 / 128: the fused Gluon backward and its stats kernel
    real = launcher.fast_path_applies
    monkeypatch.setattr(launcher, "fast_path_applies", lambda kernel: False)
    want = run()
    monkeypatch.setattr(launcher, "fast_path_applies", real)
    monkeypatch.setattr(launcher, "_COMPILED", {})
    first, second = run(), run()  # the first fills the cache, the second launches from it
    assert launcher._COMPILED, "no launch went through the fast path"
    for a, b, c in zip(want, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backward_through_lse_vs_float64(D, causal, monkeypatch):
    """A loss of both out and lse on the fused backward, whose statistics launch computes
    delta = rowsum(dO * out) - dlse itself: gradients against float64 within the plain bound."""
    calls = spy_fused_backward(monkeypatch)
    force_fused_backward(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D + causal)
    mk = lambda S, H: torch.randn(1, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    q, k, v = mk(1031, 4), mk(1031, 2), mk(1031, 2)
    do = torch.randn(1, 1031, 4, D, device="cuda", generator=g, dtype=torch.bfloat16)
    dlse = torch.randn(1, 4, 1031, device="cuda", generator=g)

    def grads(out, lse):
        return torch.autograd.grad((out * do.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum(), (q, k, v))

    got = grads(*flash_attn_func(q, k, v, causal=causal, return_lse=True))
    want = grads(*naive_attention(q, k, v, causal=causal))
    plain = grads(*naive_attention(q, k, v, causal=causal, dtype=torch.bfloat16))
    for name, a, r, p in zip(("dq", "dk", "dv"), got, want, plain):
        assert_within(name, a, r, p)
    assert calls, "the fused backward was not used"


def _results(q, k, v, do):
    """out and the gradients of the distinct tensors among q, k, v."""
    out = flash_attn_func(q, k, v, causal=True)
    leaves = [t for i, t in enumerate((q, k, v)) if all(t is not s for s in (q, k, v)[:i])]
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def test_launch_plans_rebind_exactly(monkeypatch):
    """The Gluon forward and fused backward keep launch plans by call signature (kernels.plans,
    from a signature's second call on): a later call with other tensors of that signature gives
    the results a call with no plan gives (out, dK, dV bitwise; dQ, added by float32 atomics in a
    varying order, within one bfloat16 rounding), and a plan built for one tensor passed as q, k
    and v is not used for distinct q, k, v of the same shapes."""
    from ringflash import local
    from ringflash.kernels import gluon_backward, gluon_forward
    from ringflash.kernels.plans import Plan

    force_fused_backward(monkeypatch)
    rebinds = []
    real = Plan.args_for
    monkeypatch.setattr(Plan, "args_for", lambda self, t: rebinds.append(1) or real(self, t))
    g = torch.Generator(device="cuda").manual_seed(3)
    mk = lambda: torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, x, q2, k2, v2, do = (mk().requires_grad_() for _ in range(8))
    do = do.detach()

    dq64 = reference(q, k, v, do, causal=True)[2]
    dx64 = sum(reference(x, x, x, do, causal=True)[2:])  # x as q, k and v: the three gradients' sum

    def check(got, want):  # the gradient with dQ in it: within 2x the same computation's error
        assert len(got) == len(want)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            if name == "dq":
                assert_within("dq", a, dx64 if len(got) == 2 else dq64, b)
            else:
                assert torch.equal(a, b), name

    for plans in (gluon_forward._PLANS, gluon_backward._PLANS):
        plans.clear()
    fresh = _results(q, k, v, do)  # first call of the signature: no plan
    _results(q2, k2, v2, do)  # the second builds its plans
    rebinds.clear()
    check(_results(q, k, v, do), fresh)
    assert len(rebinds) == 2, "the forward and the backward took their plans"
    for plans in (gluon_forward._PLANS, gluon_backward._PLANS, local._CALLS):  # no plan anywhere
        plans.clear()
    aliased = _results(x, x, x, do)
    check(_results(x, x, x, do), aliased)
    rebinds.clear()
    check(_results(q, k, v, do), fresh)  # distinct tensors: not the aliased plans
    assert not rebinds


class _LayersRan(Exception):
    pass


def _layers_refuse(monkeypatch) -> None:
    """flash_attn_func's layers below its autograd Function raise _LayersRan when they run."""
    from ringflash import local

    def refuse(*args, **kwargs):
        raise _LayersRan

    monkeypatch.setattr(local, "local_forward", refuse)
    monkeypatch.setattr(local, "local_backward", refuse)


@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (192, 128)])
@pytest.mark.parametrize("causal,window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (300, 0))])
def test_call_plan_replays_the_layers(D, Dv, causal, window_size, monkeypatch):
    """A repeated flash_attn_func call replays the launches its layers chose (local._CallPlan):
    once two calls of a signature ran, a third with other tensors of it runs with the layers
    below the autograd Function refusing to run, and gives what the layers gave for the same
    tensors: out and lse bitwise, dK and dV bitwise (one program's sums per key block), dQ
    (float32 atomics in a varying order) within 2x plain bf16 attention's error against
    float64. Through lse too (its gradient's key learned with the plan)."""
    force_fused_backward(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D + Dv + window_size[0])
    mk = lambda H, d: torch.randn(2, 1031, H, d, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    kw = dict(causal=causal, window_size=window_size)

    def inputs():
        return (mk(4, D).requires_grad_(), mk(2, D).requires_grad_(), mk(2, Dv).requires_grad_(), mk(4, Dv),
                torch.randn(2, 4, 1031, device="cuda", generator=g))  # fmt: skip

    def results(q, k, v, do, dlse):
        out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v))
        return (out.detach(), lse.detach(), *grads)

    first, second = inputs(), inputs()
    by_layers = results(*first)  # the signature's first call: checked, through the layers
    results(*second)  # its second: the plan learned
    _layers_refuse(monkeypatch)
    replayed = results(*first)
    for name, i in (("out", 0), ("lse", 1), ("dk", 3), ("dv", 4)):
        assert torch.equal(replayed[i], by_layers[i]), name
    q, k, v, do, dlse = first

    def dq_of(dtype):  # leaves of `dtype`: float64's dq is not rounded to bfloat16
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = naive_attention(*leaves, dtype=dtype, **kw)
        return torch.autograd.grad((out * do.to(dtype)).sum() + (lse * dlse.to(lse.dtype)).sum(), leaves[0])[0]

    assert_within("dq", replayed[2], dq_of(torch.float64), dq_of(torch.bfloat16))


def test_call_plan_runs_the_layers_for_unlike_calls(monkeypatch):
    """A learned call plan is replayed only for calls alike in what it was learned with: a dO
    off the learned alignment, inputs of other strides, an aliased q / k / v, a kernel config
    override or deterministic=True run the layers (here refusing to, so that they are seen)."""
    from ringflash.kernels import configs

    force_fused_backward(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda: torch.randn(1, 1024, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    do = mk()
    for _ in range(2):  # learned
        q, k, v = (mk().requires_grad_() for _ in range(3))
        flash_attn_func(q, k, v, causal=True).backward(do)
    _layers_refuse(monkeypatch)
    q, k, v = (mk().requires_grad_() for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)  # replayed
    shifted = torch.empty(do.numel() + 1, device="cuda", dtype=do.dtype)[1:].view(do.shape).copy_(do)
    with pytest.raises(_LayersRan):  # dO 2 bytes off a 16-byte boundary
        out.backward(shifted, retain_graph=True)
    out.backward(do)  # the replay's backward with a dO like the learned one
    transposed = torch.randn(1, 4, 1024, 64, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(_LayersRan):  # other strides
        flash_attn_func(transposed, k, v, causal=True)
    with pytest.raises(_LayersRan):
        flash_attn_func(q, q, q, causal=True)
    with pytest.raises(_LayersRan), configs.override(gluon="ws2_s3"):
        flash_attn_func(q, k, v, causal=True)
    with pytest.raises(_LayersRan):
        flash_attn_func(q, k, v, causal=True, deterministic=True)


@pytest.mark.parametrize("D", [64, 128])
def test_call_plan_replays_under_compile(D, monkeypatch):
    """The operators torch.compile calls (ops.flash_fwd / flash_bwd) replay call plans too, kept
    beside flash_attn_func's under their own signature: once two compiled calls ran, a third
    runs with the layers refusing to, and gives what the eager call's layers gave for the same
    tensors (out, dK, dV bitwise; dQ within 2x plain bf16 attention's error against float64)."""
    force_fused_backward(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(D + 7)
    mk = lambda H: torch.randn(2, 1031, H, D, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731

    def inputs():
        return mk(4).requires_grad_(), mk(2).requires_grad_(), mk(2).requires_grad_(), mk(4)

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)

    def results(fn, q, k, v, do):
        out = fn(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))

    first, second = inputs(), inputs()
    by_layers = results(attention, *first)
    results(compiled, *first)
    results(compiled, *second)
    _layers_refuse(monkeypatch)
    replayed = results(compiled, *first)
    for name, i in (("out", 0), ("dk", 2), ("dv", 3)):
        assert torch.equal(replayed[i], by_layers[i]), name
    q, k, v, do = first
    ref = reference(q, k, v, do, causal=True)
    assert_within("dq", replayed[1], ref[2], plain_errors(q, k, v, do, ref, causal=True)["dq"])


@pytest.mark.parametrize("causal", [False, True])
def test_flop_counter_runs_the_same_kernels(causal):
    """Under FlopCounterMode a call runs as its operators (ringflash.flops): the same kernels as
    the eager call, so outputs and (deterministic) gradients bitwise equal, and counted."""
    from torch.utils.flop_counter import FlopCounterMode

    B, S, H, D = 1, 2048, 4, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal, deterministic=True)
        return (out, *torch.autograd.grad(out, leaves, do))

    eager = run()
    with FlopCounterMode(display=False) as counter:
        counted = run()
    assert all(torch.equal(a, b) for a, b in zip(counted, eager))
    pairs = B * (S * (S + 1) // 2 if causal else S * S)
    got = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert got == {"ringflash.flash_fwd": 2 * pairs * H * 2 * D, "ringflash.flash_bwd": 2 * pairs * H * 5 * D}
