"""The launch path's specialization key against Triton's own (no GPU needed): two arguments that
share a key must be specialized alike by Triton, or launch() would run a kernel compiled for
other arguments."""

import itertools

import pytest
import torch

from ringflash.kernels.key_bias import key_spans
from ringflash.masks import Window

triton = pytest.importorskip("triton")

from ringflash.kernels import launcher  # noqa: E402


def _corpus():
    ints = [0, 1, 2, 3, 15, 16, 17, 32, 48, 64, -1, -15, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
            -(2**31), -(2**31) - 1, -(2**31) - 16, 2**32, 2**63 - 1, 2**63, 2**64 - 16]  # fmt: skip
    buf = {dt: torch.empty(256, dtype=dt) for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int32)}
    tensors = [buf[dt][i:] for dt in buf for i in (0, 1, 2, 4, 8, 16)]
    descriptors = []
    from triton.tools.tensor_descriptor import TensorDescriptor

    for dt in (torch.bfloat16, torch.float16):
        x = torch.empty(1, 256, 4, 128, dtype=dt)
        for rows in (64, 128):
            descriptors.append(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, 128]))
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:
        GluonDescriptor = None
    if GluonDescriptor is not None:
        for dt, gdt in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
            x = torch.empty(1, 256, 4, 128, dtype=dt)
            for rows in (64, 128):
                layout = gl.NVMMASharedLayout.get_default_for([1, rows, 1, 128], gdt)
                descriptors.append(GluonDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, 128], layout))
    return ints + [True, False, None, 0.5, 1.0, -2.0] + tensors + descriptors


def test_launch_key_never_joins_what_triton_specializes_apart():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", 90, 32))
    corpus = _corpus()
    keys = [launcher._arg_class(x) for x in corpus]
    assert None not in keys  # every kind of argument the package launches with has a key
    specs = [native_specialize_impl(backend, x, False, True, True) for x in corpus]
    for (ka, sa, a), (kb, sb, b) in itertools.combinations(zip(keys, specs, corpus), 2):
        if ka == kb:
            assert sa == sb, (a, b, ka, sa, sb)
    # and the key does separate what Triton separates most often: alignment, 1, % 16, width
    assert len(set(keys)) >= len({repr(s) for s in specs})

    # the exact types' shortcut and the general path agree (subclasses take the general one)
    class Int(int):
        pass

    class Float(float):
        pass

    for x in corpus:
        if type(x) is int:
            assert launcher._arg_class(Int(x)) == launcher._arg_class(x), x
        elif type(x) is float:
            assert launcher._arg_class(Float(x)) == launcher._arg_class(x), x
        elif type(x) is torch.Tensor:
            assert launcher._arg_class(torch.nn.Parameter(x, requires_grad=False)) == launcher._arg_class(x)


def test_launch_falls_back_to_triton_where_it_cannot_key():
    """Under the interpreter (CPU CI), or with an argument of unknown kind, launch() is
    kernel[grid](...) itself."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw)) or "launched"

    assert launcher.launch(Kernel(), (2, 1), 1, object(), X=3) == "launched"
    assert calls and calls[0][0] == (2, 1) and calls[0][2] == {"X": 3}
    assert launcher._arg_class(object()) is None


def _same_argument(a, b) -> bool:
    """a and b the same launch argument: the same tensor, a descriptor of the same fields over
    the same tensor, or an equal value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if hasattr(a, "block_shape"):
        return type(a) is type(b) and a.base is b.base and {**vars(a), "base": 0} == {**vars(b), "base": 0}
    return type(a) is type(b) and a == b


def test_plans_rebind_exactly_what_a_fresh_plan_would_build():
    """A launch plan kept by signature (kernels.plans) gives another call of the same signature
    the arguments its own launch_plan would build: its tensors, descriptors over its tensors,
    the same values; a signature differs where the alignment, the strides or which arguments
    are the same tensor differ. Gluon forward and backward, dense, windowed and packed rows, and
    with a key bias (the forward's through a TMA descriptor, the backward's a pointer)."""
    from ringflash.kernels import gluon_backward as gb
    from ringflash.kernels import gluon_forward as gf
    from ringflash.kernels.plans import Plan, alias_pattern, tensor_key
    from ringflash.masks import RowBounds, Window

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    B, S, H, D = 1, 256, 4, 128

    def call_tensors():
        mk = lambda *shape, dt=torch.bfloat16: torch.randn(*shape).to(dt)  # noqa: E731
        f32 = torch.float32
        t = dict(q=mk(B, S, H, D), k=mk(B, S, 2, D), v=mk(B, S, 2, D), do=mk(B, S, H, D), dk=mk(B, S, 2, D))
        t.update(dv=mk(B, S, 2, D), stats=mk(B * H * 2 * S, dt=f32), dq32=mk(B, H, S, D, dt=f32))
        t.update(o=mk(B, S, H, D, dt=f32), m=mk(B, H, S, dt=f32), l=mk(B, H, S, dt=f32))
        lo = torch.zeros(S, dtype=torch.int32)
        order = torch.arange(S // 128 - 1, -1, -1, dtype=torch.int32)
        t["bounds"] = RowBounds(lo, lo + 7, lo.clone(), lo + 9, key_order=order)
        t["counter"] = torch.zeros(1, dtype=torch.int32)
        t["bias"] = mk(B, S, dt=f32)
        t["spans"] = key_spans(t["bias"], 0.1)
        return t

    first, second = call_tensors(), call_tensors()
    fwd_cfg = gf.config_for(D, gf.DEFAULT_VARIANT)
    for masks in (dict(causal=True), dict(causal=False, window=(100, 3)), dict(causal=False, bounds="rows"),
                  dict(causal=False, bounds="rows", variant="ws2_lag_pch"),
                  dict(causal=True, key_bias=True)):  # fmt: skip

        def backward_plan(t, masks=masks):
            cfg = gb.config_for(D, masks.get("variant", "ws2_lag"))
            kw = {k: v for k, v in masks.items() if k not in ("variant", "key_bias")}
            kw["bounds"] = b = t["bounds"] if "bounds" in masks else None
            bias = t["bias"] if "key_bias" in masks else None
            spans = t["spans"] if "key_bias" in masks else None
            rows = (None, None, None) if b is None else (b.q_lo, b.q_hi, b.key_order)
            tensors = (t["q"], t["k"], t["v"], t["stats"], t["do"], t["dq32"], t["dk"], t["dv"], *rows, t["counter"],
                       bias, spans)  # fmt: skip
            built = gb.launch_plan(*tensors[:8], q_start=5, k_start=0, scale=0.1, accumulate=True, cfg=cfg, **kw,
                                   tile_counter=t["counter"] if cfg.persistent else None, key_bias=bias,
                                   spans=spans)  # fmt: skip
            assert built[3]["ORDERED"] == ("variant" in masks)
            assert built[3]["HAS_BIAS"] == (bias is not None)
            return tensors, built

        def forward_plan(t, masks=masks):
            b = t["bounds"] if "bounds" in masks else None
            window = Window(*masks["window"]) if "window" in masks else None
            rows = (None, None) if b is None else (b.k_lo, b.k_hi)
            bias = t["bias"] if "key_bias" in masks else None
            spans = t["spans"] if "key_bias" in masks else None
            tensors = (t["q"], t["k"], t["v"], t["o"], t["m"], t["l"], *rows, bias, spans)
            built = gf.launch_plan(*tensors[:3], q_start=5, k_start=0, scale=0.1, out_o=t["o"], out_m=t["m"],
                                   out_l=t["l"], normalize=False, fold=True, cfg=fwd_cfg, causal=masks["causal"],
                                   window=window, bounds=b, key_bias=bias, spans=spans)  # fmt: skip
            # a key bias is added to the scaled scores: the scale is applied first, as the Triton kernels'
            assert built[3]["HAS_BIAS"] == (bias is not None) and built[3]["POSITIVE_SCALE"] == (bias is None)
            assert sum(hasattr(a, "block_shape") and a.base is bias for a in built[2]) == (bias is not None)
            return tensors, built

        for make in (backward_plan, forward_plan):
            tensors, (kernel, grid, args, kwargs) = make(first)
            plan = Plan(kernel, grid, args, kwargs, tensors)
            tensors2, (kernel2, grid2, args2, kwargs2) = make(second)
            rebound = plan.args_for(tensors2)
            assert (plan.kernel, plan.grid, plan.kwargs) == (kernel2, grid2, kwargs2)
            assert len(rebound) == len(args2)
            for i, (a, b) in enumerate(zip(rebound, args2)):
                assert _same_argument(a, b), (make.__name__, masks, i, a, b)
            assert any(hasattr(a, "block_shape") for a in rebound)
            # the plan holds none of the tensors it was built from: a kept plan must not keep a
            # long call's inputs and outputs alive
            held = [a.base if hasattr(a, "block_shape") else a for a in plan.args]
            assert not any(isinstance(a, torch.Tensor) for a in held), (make.__name__, masks)
            rebound_again = plan.args_for(tensors2)
            assert all(_same_argument(a, b) for a, b in zip(rebound_again, args2))

    x, y = first["q"], second["q"]
    assert alias_pattern((x, x, x)) != alias_pattern((x, y, x))
    assert alias_pattern((x, None, None)) == alias_pattern((y, None, None))
    assert tensor_key(x) == tensor_key(y)
    flat = torch.empty(2 * x.numel() + 8, dtype=x.dtype)
    assert tensor_key(flat[: x.numel()].view(x.shape)) != tensor_key(flat[1 : x.numel() + 1].view(x.shape))
    assert tensor_key(x) != tensor_key(x.transpose(1, 2).contiguous().transpose(1, 2))


def test_head_dim_pieces_cover_each_head_dim_in_fewer_columns():
    """q/k's head dim as the Gluon forward's QK^T runs it: a power-of-two main piece and a
    smaller power-of-two tail (or none) that together hold every column, in fewer columns than
    one padded tile whenever there is a tail."""
    from ringflash.kernels import _block_d, head_dim_pieces

    def pow2(x):
        return x & (x - 1) == 0

    for D in range(1, 257):
        main, tail = head_dim_pieces(D)
        assert pow2(main) and main >= 16 and main + tail >= D, (D, main, tail)
        if tail:
            assert pow2(tail) and 16 <= tail < main and main + tail < _block_d(D), (D, main, tail)
        else:
            assert main == _block_d(D), (D, main)
    assert [head_dim_pieces(D) for D in (64, 96, 128, 192, 256)] == [(64, 0), (64, 32), (128, 0), (128, 64), (256, 0)]


def test_gluon_forward_pads_head_dims_to_its_tiles():
    """Head dims under a tile width run in head_dim_pieces, q/k's and v's alike (96 -> 64 + 32,
    192 -> 128 + 64; 128 whole): main descriptors and BLOCK_D / BLOCK_DV, tail descriptors
    (None without a tail) and BLOCK_DT / BLOCK_DVT, HEAD_DIM the true width that O is stored to;
    the config is the tile widths' (192: a third K/V stage, which a padded 256 would not fit);
    widths that do not pad to a tuned tile, or rows whose strides TMA cannot take, are
    Unsupported, naming why (the caller then runs the Triton forward)."""
    from ringflash.kernels import configs
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")

    def tensors(D, H=4):
        q = torch.zeros(1, 130, H, D, dtype=torch.bfloat16)
        k = torch.zeros(1, 200, 2, D, dtype=torch.bfloat16)
        m = torch.zeros(1, H, 130)
        return q, k, k.clone(), torch.zeros(q.shape), m, m.clone()

    for D, (main, tail), stages in ((96, (64, 32), 3), (192, (128, 64), 3), (128, (128, 0), 3)):
        q, k, v, o, m, l = tensors(D)
        cfg = gf.config_for(D, configs.GLUON_FWD[gf.padded_head_dim(D)])
        assert cfg.stages == stages
        assert gf.shared_bytes(cfg, main + tail) <= gf.HOPPER_SHARED_BYTES - 1024
        gf.check_shapes(q, k, v, o, m, l, normalize=False, fold=True, cfg=cfg)
        _, _, args, kwargs = gf.launch_plan(q, k, v, q_start=0, k_start=0, scale=0.1, out_o=o, out_m=m, out_l=l,
                                            normalize=False, fold=True, cfg=cfg)  # fmt: skip
        widths = [kwargs[x] for x in ("HEAD_DIM", "BLOCK_D", "BLOCK_DT", "HEAD_DIM_V", "BLOCK_DV", "BLOCK_DVT")]
        assert widths == [D, main, tail, D, main, tail]
        blocks = [[1, cfg.q_rows, 1, main], [1, cfg.block_n, 1, main], [1, cfg.block_n, 1, main]]
        if tail:
            blocks += [[1, cfg.q_rows, 1, tail], [1, cfg.block_n, 1, tail], [1, cfg.block_n, 1, tail]]
        else:
            assert args[3:6] == (None, None, None)
        descriptors = args[: len(blocks)]
        assert [list(a.block_shape) for a in descriptors] == blocks
        assert all(list(a.shape) == list(t.shape) for a, t in zip(descriptors, (q, k, v) * 2))  # true widths
    with pytest.raises(gf.Unsupported, match="head_dim 320 not supported"):
        gf.check_shapes(*tensors(320), normalize=False, fold=True)
    with pytest.raises(gf.Unsupported, match="head_dim 12 not supported"):
        gf.config_for(12)
    with pytest.raises(gf.Unsupported, match="16-byte aligned strides"):  # 100 x 2 bytes per head
        gf.check_shapes(*tensors(100), normalize=False, fold=True)


def _forward_plan_inputs(B, S, H, Hkv, D):
    """q, k (zeros, bf16) and launch_plan's other arguments for a forward of these shapes, and
    per-row bounds of one causal document over the S rows."""
    from ringflash.masks import RowBounds

    q = torch.zeros(B, S, H, D, dtype=torch.bfloat16)
    k = torch.zeros(B, S, Hkv, D, dtype=torch.bfloat16)
    o, m = torch.zeros(q.shape, dtype=torch.bfloat16), torch.zeros(B, H, S)
    common = dict(q_start=0, k_start=0, scale=0.1, out_o=o, out_m=m, out_l=m.clone(), normalize=True, fold=False)
    lo = torch.zeros(S, dtype=torch.int32)
    bounds = RowBounds(lo, torch.arange(1, S + 1, dtype=torch.int32), torch.arange(S, dtype=torch.int32), lo + S)
    return q, k, common, bounds


def test_gluon_forward_persistent_plan():
    """A persistent config launches a 1-D grid of min(tiles, max_programs or one per
    multiprocessor) programs with PERSISTENT set and the tile count as an argument; packed
    documents (per-row bounds, reduced before the partitions split) keep one tile a program."""
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    B, S, H = 2, 1031, 4
    q, k, common, bounds = _forward_plan_inputs(B, S, H, 1, 128)
    tiles = gf.triton_cdiv(S, 128) * B * H  # 72
    for variant, programs in (("ws2_s3", None), ("ws2_p", min(tiles, gf.multiprocessors(q.device))), ("ws2_p7", 7)):
        cfg = gf.config_for(128, variant)
        _, grid, args, kwargs = gf.launch_plan(q, k, k.clone(), causal=True, cfg=cfg, **common)
        assert kwargs["PERSISTENT"] == (programs is not None)
        assert grid == ((programs,) if programs else (gf.triton_cdiv(S, 128), B * H))
        assert tiles in [a for a in args if type(a) is int]
    o, m = common["out_o"], common["out_m"]
    one = {**common, "out_o": o[:1], "out_m": m[:1], "out_l": m[:1].clone()}
    _, grid, _, kwargs = gf.launch_plan(q[:1], k[:1], k[:1].clone(), cfg=gf.config_for(128, "ws2_p"), bounds=bounds,
                                        **one)  # fmt: skip
    assert not kwargs["PERSISTENT"] and grid == (gf.triton_cdiv(S, 128), H)


def test_gluon_forward_dynamic_plan():
    """Persistent programs taking their tiles from a counter (GluonConfig.dynamic, ws2_pd) launch
    ws2_p's grid with DYNAMIC set and the device's one zeroed int32 counter as TILE_COUNTER (no
    counter otherwise), causal tiles in the one-tile launch's head groups (heads_per_group as a
    one-tile launch's, where ws2_p takes 1); a kept plan puts the counter back in (launch_planned
    gets the forward's eight tensors); sliding windows and documents keep one tile a program
    (DYNAMIC off); dynamic without persistent is refused."""
    from dataclasses import replace

    from ringflash.kernels import gluon_forward as gf
    from ringflash.kernels.plans import Plan

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    B, S, H = 2, 1031, 4
    q, k, common, bounds = _forward_plan_inputs(B, S, H, 1, 128)
    counter = gf.tile_counter(q.device)
    assert counter is gf.tile_counter(q.device) and counter.dtype == torch.int32 and counter.tolist() == [0]
    for variant, dynamic in (("ws2_p", False), ("ws2_pd", True), ("ws2_pd7", True)):
        cfg = gf.config_for(128, variant)
        _, grid, args, kwargs = gf.launch_plan(q, k, k.clone(), causal=True, cfg=cfg, **common)
        _, p_grid, p_args, _ = gf.launch_plan(q, k, k.clone(), causal=True, cfg=gf.config_for(128, "ws2_p"), **common)
        assert kwargs["PERSISTENT"] and kwargs["DYNAMIC"] == dynamic
        assert grid == ((7,) if variant == "ws2_pd7" else p_grid)
        assert any(a is counter for a in args) == dynamic and args[-1] is (counter if dynamic else None)
        # the one-tile launch's head groups (L2's share: every head here), ws2_p head by head
        assert args[-11] == (H * B if dynamic else 1) and p_args[-11] == 1, (args[-11], p_args[-11])
    # a kept plan: the counter is no tensor of the call's signature; launch_planned puts it back
    v = k.clone()
    kernel, grid, args, kwargs = gf.launch_plan(q, k, v, cfg=gf.config_for(128, "ws2_pd"), **common)
    tensors = (q, k, v, common["out_o"], common["out_m"], common["out_l"], None, None)
    plan = Plan(kernel, grid, args, kwargs, (*tensors, counter))
    assert plan.args_for((*tensors, counter))[-1] is counter
    launched = []
    plan.launch = lambda kernel, grid, args, kwargs: launched.append(args)
    gf.launch_planned(plan, tensors)
    assert launched[0][-1] is counter and launched[0][0].base is q
    # sliding windows and per-row bounds: one tile a program, no counter
    from ringflash.masks import Window

    cfg = gf.config_for(128, "ws2_pd")
    for extra in (dict(window=Window(300, 0)), dict(bounds=bounds)):
        _, grid, args, kwargs = gf.launch_plan(q, k, k.clone(), cfg=cfg, **extra, **common)
        assert not kwargs["PERSISTENT"] and not kwargs["DYNAMIC"] and args[-1] is None and len(grid) == 2
    with pytest.raises(ValueError, match="persistent"):
        replace(gf.config_for(128, "ws2_s3"), dynamic=True)


def test_gluon_forward_three_consumers_plan():
    """ws3 runs three 64-row consumer warpgroups on 192-row tiles: grid cdiv(S, 192) tiles, Q's
    descriptor 64 rows, CONSUMERS=3 and 160 registers a consumer thread (the entry cap 128 over
    16 warps, less the producer's warpgroup, down to a multiple of 8); per-row bounds (whose
    reductions take 128-row tiles) raise Unsupported; configs whose rows do not match their
    consumers are refused. Its 128-key blocks make P 16-bit early (P_EARLY)."""
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    B, S, H = 1, 1031, 4
    q, k, common, bounds = _forward_plan_inputs(B, S, H, 2, 64)
    cfg = gf.config_for(64, "ws3")
    assert (cfg.consumers, cfg.block_m, cfg.q_rows, cfg.consumer_regs) == (3, 192, 64, 160)
    assert gf.config_for(64, "ws2_s3").consumer_regs == 240  # (two consumers: unchanged)
    _, grid, args, kwargs = gf.launch_plan(q, k, k.clone(), causal=True, cfg=cfg, **common)
    assert grid == (gf.triton_cdiv(S, 192), B * H) and kwargs["CONSUMERS"] == 3 and kwargs["CONSUMER_REGS"] == 160
    assert kwargs["P_EARLY"] and cfg.block_n == 128
    assert args[0].block_shape == [1, 64, 1, 64]
    with pytest.raises(gf.Unsupported, match="per-row bounds need 128-row tiles"):
        gf.launch_plan(q, k, k.clone(), cfg=cfg, bounds=bounds, **common)
    for bad in (dict(consumers=4, block_m=256), dict(consumers=3, block_m=128)):
        with pytest.raises(ValueError, match="two or three 4-warp consumer partitions"):
            gf.GluonConfig("ws2", block_n=64, **bad)


def test_gluon_forward_key_blocks_in_two_pieces():
    """A key block of block_n + block_nt keys (configs.GLUON_FWD_DENSE's): K and V descriptors
    of block_n rows and their tails' of block_nt rows, full head dim; BLOCK_NT set; shared
    memory counted for the whole block and within the H200's; head dims in pieces (96) are
    Unsupported with it, and block_nt must be a power of two from 16 below block_n."""
    from ringflash.kernels import configs
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    for name in (configs.GLUON_FWD_DENSE[128], "ws2_k160"):
        cfg = gf.config_for(128, name)
        assert cfg.block_nt and cfg.keys == cfg.block_n + cfg.block_nt
        assert gf.shared_bytes(cfg, 128) == 2 * 128 * (cfg.block_m + 2 * cfg.stages * cfg.keys)
        assert gf.shared_bytes(cfg, 128) <= gf.HOPPER_SHARED_BYTES - 1024
        q, k, common, _ = _forward_plan_inputs(1, 1031, 4, 2, 128)
        _, _, args, kwargs = gf.launch_plan(q, k, k.clone(), cfg=cfg, **common)
        blocks = (kwargs["BLOCK_N"], kwargs["BLOCK_NT"], kwargs["BLOCK_DT"], kwargs["BLOCK_DVT"])
        assert blocks == (cfg.block_n, cfg.block_nt, 0, 0)
        assert args[3] is None
        assert [list(a.block_shape) for a in args[1:3] + args[4:6]] == (
            [[1, cfg.block_n, 1, 128]] * 2 + [[1, cfg.block_nt, 1, 128]] * 2
        )
        q, k, common, _ = _forward_plan_inputs(1, 1031, 4, 2, 96)
        with pytest.raises(gf.Unsupported, match="head dims of one piece"):
            gf.launch_plan(q, k, k.clone(), cfg=cfg, **common)
    for bad in (24, 48, 128, -16, 8):
        with pytest.raises(ValueError, match="a power of two from 16 below block_n"):
            gf.GluonConfig("ws2", 128, 128, 4, 2, block_nt=bad)


def test_gluon_forward_tile_order_plan(monkeypatch):
    """A one-tile causal or windowed launch takes as many heads together (heads_per_group, the
    kernel's launch order) as keep their K and V within TILE_ORDER_L2_BYTES, at most all B x Hq
    and at least one; dense blocks, packed documents (per-row bounds), persistent programs and a
    config with tile_order "by_head" go head by head (1)."""
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    B, S, H, D = 2, 1031, 4, 64
    q, k, common, bounds = _forward_plan_inputs(B, S, H, 2, D)
    per_head = S * 2 * (D + D)  # keys x (q/k's + v's head dim) x 2 bytes
    ws3, flat = gf.config_for(D, "ws3"), gf.config_for(D, "ws3_by_head")

    def grouped(cfg, **kw):
        kernel, _, args, _ = gf.launch_plan(q, k, k.clone(), cfg=cfg, **{**common, **kw})
        return dict(zip(kernel.arg_names, args))["heads_per_group"]

    for l2, heads in ((3 * per_head + 1, 3), (per_head - 1, 1), (1 << 40, B * H)):
        monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", l2)
        assert grouped(ws3, causal=True) == heads
        assert grouped(ws3, window=Window(300, 77)) == heads
        assert grouped(ws3) == grouped(flat, causal=True) == 1
        assert grouped(gf.config_for(D, "ws2_p"), causal=True) == 1
    o, m = common["out_o"], common["out_m"]
    one = {**common, "out_o": o[:1], "out_m": m[:1], "out_l": m[:1].clone()}
    kernel, _, args, _ = gf.launch_plan(q[:1], k[:1], k[:1].clone(), cfg=gf.config_for(D, "ws2_s3"), bounds=bounds,
                                        **one)  # fmt: skip
    assert dict(zip(kernel.arg_names, args))["heads_per_group"] == 1
    # the short group first: a constexpr, on in the package's variants, off in the short_last ones
    for variant, first in (("ws3", True), ("ws3_short_last", False)):
        _, _, _, kwargs = gf.launch_plan(q, k, k.clone(), cfg=gf.config_for(D, variant), causal=True, **common)
        assert kwargs["SHORT_GROUP_FIRST"] is first


_BWD_PLAN_SHAPE = (2, 1031, 8, 4, 64)  # B, S, Hq, Hkv, D of _backward_plan's inputs


def _backward_plan(variant, **kw):
    """gluon_backward.launch_plan's (kernel, grid, args, kwargs) for zero CPU inputs of
    _BWD_PLAN_SHAPE (bf16 q, k, v, do; float32 statistics and gradients) under variant's config;
    kw replaces the call's keywords (causal=False, no window, no bounds)."""
    from ringflash.kernels import gluon_backward as gb

    B, S, H, Hkv, D = _BWD_PLAN_SHAPE
    q, k = torch.zeros(B, S, H, D, dtype=torch.bfloat16), torch.zeros(B, S, Hkv, D, dtype=torch.bfloat16)
    grads = (torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(k.shape))
    args = dict(q_start=0, k_start=0, scale=0.1, accumulate=False, cfg=gb.config_for(D, variant), causal=False)
    return gb.launch_plan(q, k, k.clone(), torch.zeros(B, H, 2, S), q.clone(), *grads, **{**args, **kw})


def test_gluon_backward_grouped_heads_plan(monkeypatch):
    """ws2_lag_grouped launches causal blocks on a 3-D grid (heads a group, key blocks, groups)
    with GROUPED_HEADS set, the group the largest divisor of B x Hkv whose streamed Q, dO and dQ
    fit TILE_ORDER_L2_BYTES; non-causal blocks, packed documents and the default keep the 2-D
    grid."""
    from ringflash.kernels import gluon_backward as gb
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    for heads, streamed, budget, expected in ((32, 1, 6, 4), (32, 1, 12, 8), (32, 1, 99, 32), (6, 1, 4, 3),
                                              (7, 1, 6, 1), (32, 10, 9, 1)):  # fmt: skip
        monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", budget)
        assert gb.heads_per_group(heads, streamed) == expected, (heads, streamed, budget)
    monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", 1 << 40)
    B, S, H, Hkv, D = _BWD_PLAN_SHAPE
    blocks = gf.triton_cdiv(S, 128)

    def plan(variant, **kw):
        _, grid, _, kwargs = _backward_plan(variant, **kw)
        return grid, kwargs["GROUPED_HEADS"]

    assert plan("ws2_lag_grouped", causal=True) == ((B * Hkv, blocks, 1), True)
    assert plan("ws2_lag_grouped") == ((blocks, B * Hkv), False)
    assert plan("ws2_lag", causal=True) == ((blocks, B * Hkv), False)
    monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", 2 * S * (H // Hkv) * (2 * D * 2 + D * 4))
    assert plan("ws2_lag_grouped", causal=True) == ((2, blocks, B * Hkv // 2), True)
    # the query blocks' walk: a constexpr of its own, up unless a config says otherwise
    walks = {v: _backward_plan(v, causal=True)[3]["WALK"]
             for v in ("ws2_lag", "ws2_lag_grouped", "ws2_rot", "ws2_lag_grouped_down")}  # fmt: skip
    assert walks == {"ws2_lag": 0, "ws2_lag_grouped": 0, "ws2_rot": 1, "ws2_lag_grouped_down": 2}
    assert gb.WALKS == ("up", "rotated", "down")  # the kernel's WALK is the index
    with pytest.raises(ValueError, match="unknown walk 'sideways'"):
        gb.GluonBwdConfig(walk="sideways")


def test_gluon_backward_persistent_plan(monkeypatch):
    """A persistent launch runs at most one program per multiprocessor on a 1-D grid, with
    PERSISTENT set, the grid it stands for (blocks in all, its first two dimensions: the same
    order, the causal head groups kept) and a zeroed int32 counter among the arguments; "causal"
    configs run only causal launches (a bounded right reach, no per-row bounds) so, "all" configs
    every launch, packed documents' per-row bounds included (their grid order: key blocks, then
    heads); the head-dim split schedule has no persistent form."""
    from ringflash.kernels import gluon_backward as gb
    from ringflash.kernels import gluon_forward as gf
    from ringflash.masks import RowBounds

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", 1 << 40)
    B, S, H, Hkv, D = _BWD_PLAN_SHAPE
    blocks = gf.triton_cdiv(S, 128)
    tiles = blocks * B * Hkv

    def plan(variant, sms=132, **kw):
        monkeypatch.setattr(gb, "multiprocessors", lambda device: sms)
        kernel, grid, args, kwargs = _backward_plan(variant, **kw)
        named = dict(zip(kernel.arg_names, args))
        counter = named["TILE_COUNTER"]
        if kwargs["PERSISTENT"]:
            assert counter.dtype == torch.int32 and counter.shape == (1,) and int(counter) == 0
        else:
            assert counter is named["DQ"]  # (a stand-in, never read)
        return grid, kwargs["PERSISTENT"], kwargs["GROUPED_HEADS"], (named["num_tiles"], named["grid0"], named["grid1"])

    assert plan("ws2_lag_grouped_down") == ((blocks, B * Hkv), False, False, (tiles, blocks, B * Hkv))
    assert plan("ws2_lag_grouped_down_pc") == ((tiles,), True, False, (tiles, blocks, B * Hkv))
    assert plan("ws2_lag_grouped_down_pc", sms=5) == ((5,), True, False, (tiles, blocks, B * Hkv))
    # causal: the grouped grid (heads a group, key blocks, groups), here all heads, then two
    assert plan("ws2_lag_grouped_down_pc", sms=5, causal=True) == ((5,), True, True, (tiles, B * Hkv, blocks))
    monkeypatch.setattr(gf, "TILE_ORDER_L2_BYTES", 2 * S * (H // Hkv) * (2 * D * 2 + D * 4))
    assert plan("ws2_lag_grouped_down", causal=True)[0] == (2, blocks, B * Hkv // 2)
    assert plan("ws2_lag_grouped_down_pc", sms=5, causal=True) == ((5,), True, True, (tiles, 2, blocks))
    # persistent for causal launches only: a non-causal one keeps one block a program
    assert plan("ws2_lag_grouped_down_pcc", causal=True)[:2] == ((tiles,), True)
    assert plan("ws2_lag_grouped_down_pcc", window=(None, 5))[:2] == ((tiles,), True)
    assert plan("ws2_lag_grouped_down_pcc")[:2] == ((blocks, B * Hkv), False)
    whole = torch.zeros(S, dtype=torch.int32), torch.full((S,), S, dtype=torch.int32)
    bounds = RowBounds(*whole, *whole)
    assert plan("ws2_lag_grouped_down_pc", sms=5, bounds=bounds) == ((5,), True, False, (tiles, blocks, B * Hkv))
    assert plan("ws2_lag_pc", bounds=bounds) == ((tiles,), True, False, (tiles, blocks, B * Hkv))
    assert plan("ws2_lag_grouped_down_pcc", bounds=bounds)[:2] == ((blocks, B * Hkv), False)
    assert plan("ws2_lag")[:2] == ((blocks, B * Hkv), False)

    # key blocks handed out in the bounds' key order (ws2_lag_pch): the same grid, ORDERED and the
    # order among the arguments; the grid's order without a key order, one of another length,
    # or under another config
    def order_of(variant, bounds):
        kernel, grid, args, kwargs = _backward_plan(variant, bounds=bounds)
        named = dict(zip(kernel.arg_names, args))
        return grid, kwargs["ORDERED"], named["KEY_ORDER"] if kwargs["ORDERED"] else named["KEY_ORDER"] is named["DQ"]

    order = torch.arange(blocks - 1, -1, -1, dtype=torch.int32)
    ordered = bounds._replace(key_order=order)
    assert order_of("ws2_lag_pch", ordered) == ((tiles,), True, order)
    assert order_of("ws2_lag_pch", bounds) == ((tiles,), False, True)
    assert order_of("ws2_lag_pch", ordered._replace(key_order=order[1:])) == ((tiles,), False, True)
    assert order_of("ws2_lag_pc", ordered) == ((tiles,), False, True)
    with pytest.raises(ValueError, match="order='heavy' hands out packed documents' key blocks"):
        gb.GluonBwdConfig(persistent="causal", order="heavy")
    with pytest.raises(ValueError, match="order must be 'grid' or 'heavy', got 'light'"):
        gb.GluonBwdConfig(order="light")
    with pytest.raises(ValueError, match="persistent programs run the ws2 schedule"):
        gb.GluonBwdConfig(schedule="ws2_split_d", block_n=64, persistent="all")
    with pytest.raises(ValueError, match="persistent must be None, 'all' or 'causal', got 'sometimes'"):
        gb.GluonBwdConfig(persistent="sometimes")


def test_gluon_backward_counter_per_call(monkeypatch):
    """prepare() gives every persistent call a counter of its own, zeroed before each launch, also
    on a kept launch plan (the plan's counter argument replaced by the call's); a non-persistent
    launch of the same config (non-causal, "causal" persistence) gets none. With the statistics
    in one launch, that launch zeroes the counter and the kernel's first launch has no memset. The CPU stands in for
    the GPU: the device check and the statistics launch are replaced, nothing is launched."""
    from ringflash.kernels import gluon_backward as gb
    from ringflash.kernels import gluon_forward as gf

    if not gf.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gf.GLUON_ERROR}")
    monkeypatch.setattr(gb, "_PLANS", gb.Plans())
    monkeypatch.setattr(gb, "check_supported", lambda *a, **kw: None)
    monkeypatch.setattr(gb, "_one_launch_stats", lambda m, l, delta: False)
    stats = lambda m, l, delta, cfg: torch.zeros(m.shape[0] * m.shape[1], 2, gb.padded_rows(m.shape[2], cfg))  # noqa: E731
    monkeypatch.setattr(gb, "row_stats", stats)
    built = []
    real = gb.launch_plan
    monkeypatch.setattr(gb, "launch_plan", lambda *a, **kw: built.append(1) or real(*a, **kw))
    B, S, H, Hkv, D = _BWD_PLAN_SHAPE
    q, k = torch.zeros(B, S, H, D, dtype=torch.bfloat16), torch.zeros(B, S, Hkv, D, dtype=torch.bfloat16)
    m, l = torch.zeros(B, H, S), torch.ones(B, H, S)
    dk = torch.zeros(k.shape, dtype=torch.bfloat16)
    for causal in (True, False):
        counters, built[:] = [], []
        for _ in range(3):  # the plan is built on the second call and kept for the third
            prep = gb.prepare(q, k, k.clone(), m, l, q.clone(), torch.zeros(B, H, S), torch.zeros(q.shape), dk,
                              dk.clone(), q_start=0, k_start=0, causal=causal, scale=0.1, accumulate=False,
                              config="ws2_lag_grouped_down_pcc")  # fmt: skip
            named = dict(zip(prep.kernel.arg_names, prep.args))
            assert prep.kwargs["PERSISTENT"] is causal
            if causal:
                assert prep.tile_counter is not None and named["TILE_COUNTER"] is prep.tile_counter
                counters.append(prep.tile_counter)
            else:
                assert prep.tile_counter is None and named["TILE_COUNTER"] is prep.dq32
        assert len(built) == 2  # the third call ran on the kept plan
        assert len({id(c) for c in counters}) == len(counters)
    # with the statistics in one launch, that launch zeroes the counter: the kernel's first
    # launch needs no memset, a second launch of the same Prepared (benchmarks) gets one
    monkeypatch.setattr(gb, "_one_launch_stats", lambda m, l, delta: True)
    zeroed_by_stats = []

    def one_launch(m, l, delta, cfg, dq32=None, do=None, counter=None, kept=None):
        side_launches.append(kept)  # the kept plan's own statistics launch (plans.Plan.side)
        if counter is not None:
            counter.zero_()
            zeroed_by_stats.append(counter)
        return stats(m, l, delta, cfg)

    monkeypatch.setattr(gb, "launch_row_stats", one_launch)
    monkeypatch.setattr(launcher, "launch", lambda kernel, grid, *args, **kw: launched.append(int(kw_counter(args))))
    # a kept plan's launches (plans.Plan.launch) alike
    monkeypatch.setattr(
        launcher.KeptLaunch, "__call__", lambda self, kernel, grid, args, kw: launched.append(int(kw_counter(args)))
    )
    launched, side_launches = [], []
    for causal in (True, False):
        zeroed_by_stats.clear()
        prep = gb.prepare(q, k, k.clone(), m, l, q.clone(), torch.zeros(B, H, S), torch.zeros(q.shape), dk,
                          dk.clone(), q_start=0, k_start=0, causal=causal, scale=0.1, accumulate=False,
                          config="ws2_lag_grouped_down_pcc")  # fmt: skip
        assert prep.counter_zeroed is causal
        assert [id(c) for c in zeroed_by_stats] == ([id(prep.tile_counter)] if causal else [])
        # both signatures were met three times above: their plans are kept, with a statistics launch each
        assert isinstance(side_launches[-1], launcher.KeptLaunch) and prep.kept is not None
        if causal:
            kw_counter = lambda args: args[prep.kernel.arg_names.index("TILE_COUNTER")]  # noqa: E731
            prep.tile_counter.fill_(5)  # stands for what a launch leaves there
            launched.clear()
            prep.launch()  # the statistics launch's zero stands: no memset before it
            prep.launch()  # a second launch: zeroed first
            assert launched == [5, 0] and not prep.counter_zeroed


def test_gluon_backward_takes_v_head_dim_apart_only_split():
    """The fused backward's launcher with v's head dim apart from q/k's (MLA: 192 and 128; and
    the mirror): the head-dim split variant for the larger padded width takes it, with the
    output-derived delta (merge.DeltaOf: out and do are v's width) and the ring's blocked dQ (q's
    width); V and dO descriptors take v's padded width, dV's store its true one. A variant that
    does not split the head dim raises Unsupported naming why."""
    from ringflash.kernels import configs
    from ringflash.kernels import gluon_backward as gb
    from ringflash.merge import DeltaOf

    if not gb.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gb.GLUON_ERROR}")
    B, S, H = 1, 200, 4
    for D, Dv in ((192, 128), (128, 256), (256, 72)):
        bf = dict(dtype=torch.bfloat16)
        q, k, v = torch.zeros(B, S, H, D, **bf), torch.zeros(B, S, 2, D, **bf), torch.zeros(B, S, 2, Dv, **bf)
        do, out, m = torch.zeros(B, S, H, Dv, **bf), torch.zeros(B, S, H, Dv, **bf), torch.zeros(B, H, S)
        dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
        cfg = gb._resolve(q, v, configs.GLUON_BWD[256])
        assert cfg.split_d
        blocked = gb.BlockedDQ(torch.zeros(B, H, gb.blocked_rows(S), gb.padded_head_dim(D)))
        gb.check_shapes(q, k, v, m, m, do, DeltaOf(out, None), blocked, dk, dv, scale=0.1, cfg=cfg)
        stats = torch.zeros(B * H * 2 * gb.padded_rows(S, cfg))
        _, _, args, kwargs = gb.launch_plan(q, k, v, stats, do, blocked.acc, dk, dv, q_start=0, k_start=0, causal=True,
                                            scale=0.1, accumulate=True, cfg=cfg)  # fmt: skip
        assert (kwargs["HEAD_DIM"], kwargs["HEAD_DIM_V"]) == (D, Dv) and kwargs["SPLIT_D"]
        qk_width = 128 if D == 192 else gb.padded_head_dim(D)  # the default runs 192 in pieces: 128 + 64
        assert [a.block_shape[-1] for a in args[:4]] == [qk_width, qk_width] + [gb.padded_head_dim(Dv)] * 2
        assert kwargs["BLOCK_DT"] == (64 if D == 192 else 0)
        with pytest.raises(gb.Unsupported, match="only the head-dim split schedule"):
            dq = torch.zeros(q.shape)
            gb.check_shapes(q, k, v, m, m, do, m, dq, dk, dv, scale=0.1, cfg=gb.config_for(128, "ws2_lag"))


def _causal_launch_plan(gb, cfg, D, Dv, B=1, S=200, H=4):
    """(args, kwargs) of the Gluon backward's causal, accumulating launch of cfg for bf16 q (B,
    S, H, D), k (B, S, 2, D), v (B, S, 2, Dv), checked (gluon_backward.check_shapes, as a call
    is) and built on the CPU (no kernel runs)."""
    from ringflash.merge import DeltaOf

    bf = dict(dtype=torch.bfloat16)
    q, k, v = torch.zeros(B, S, H, D, **bf), torch.zeros(B, S, 2, D, **bf), torch.zeros(B, S, 2, Dv, **bf)
    do, out, m = torch.zeros(B, S, H, Dv, **bf), torch.zeros(B, S, H, Dv, **bf), torch.zeros(B, H, S)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    acc = torch.zeros(B, H, gb.blocked_rows(S), gb.padded_head_dim(D))
    gb.check_shapes(q, k, v, m, m, do, DeltaOf(out, None), gb.BlockedDQ(acc), dk, dv, scale=0.1, cfg=cfg)
    stats = torch.zeros(B * H * 2 * gb.padded_rows(S, cfg))
    _, _, args, kwargs = gb.launch_plan(q, k, v, stats, do, acc, dk, dv, q_start=0, k_start=0, causal=True, scale=0.1,
                                        accumulate=True, cfg=cfg)  # fmt: skip
    return args, kwargs


def test_gluon_backward_head_dim_in_pieces_plan():
    """split_d_pieces runs q/k's head dim as a main piece twice its tail (192 = 128 + 64: BLOCK_D
    128, BLOCK_DT 64, tail descriptors from column 128 on) beside v's own padded width; other
    head dims (256 whole, 160 = 128 + 32 unbalanced) run padded as split_d_blk, without tail
    descriptors. Any other schedule refuses pieces."""
    from ringflash.kernels import gluon_backward as gb

    if not gb.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gb.GLUON_ERROR}")
    cfg = gb.config_for(192, "split_d_pieces")
    assert cfg.pieces and cfg.split_d and cfg.dq_blocked
    for D, Dv, want in ((192, 128, (128, 64)), (192, 192, (128, 64)), (256, 256, (256, 0)), (160, 160, (256, 0))):
        args, kwargs = _causal_launch_plan(gb, cfg, D, Dv)
        assert (kwargs["BLOCK_D"], kwargs["BLOCK_DT"]) == want and kwargs["SPLIT_D"]
        pv = gb.padded_head_dim(Dv)
        assert [a.block_shape[-1] for a in args[:4]] == [want[0], want[0], pv, pv]  # q, k, v, do
        tails = args[5:7]
        if want[1]:
            assert [list(t.block_shape) for t in tails] == [[1, cfg.block_m, 1, 64], [1, cfg.block_n, 1, 64]]
        else:
            assert tails == (None, None)
    with pytest.raises(ValueError, match="head-dim split schedule"):
        gb.GluonBwdConfig(pieces=True)


def test_gluon_backward_shared_bytes_by_tile_widths():
    """The split schedule's shared memory is counted at q/k's and v's own tile widths (MLA's 192
    as 128 + 64 beside v's 128), not every tile at the larger padded width: three stages fit at
    192 / 128 and not at 256, where the check refuses them."""
    from dataclasses import replace

    from ringflash.kernels import gluon_backward as gb

    if not gb.HAS_GLUON:
        pytest.skip(f"Gluon not importable: {gb.GLUON_ERROR}")
    s3 = replace(gb.config_for(192, "split_d_pieces"), stages=3)
    # K, V: 64 keys x (192 + 128) columns; three stages of Q + dO and the statistics; P^T, dS^T x 2
    kv_stages = 2 * 64 * 320 + 3 * (2 * 64 * 320 + 512)
    assert gb.shared_bytes(s3, 192, head_dim_v=128) == kv_stages + 4 * 64 * 64 * 2
    limit = gb.HOPPER_SHARED_BYTES - 1024
    assert gb.shared_bytes(s3, 192, head_dim_v=128) <= limit < gb.shared_bytes(s3, 256)
    _causal_launch_plan(gb, s3, 192, 128)
    with pytest.raises(gb.Unsupported, match="too much shared memory"):
        _causal_launch_plan(gb, s3, 256, 256)


def test_plans_are_kept_from_the_second_call_on():
    """kernels.plans.Plans: a signature met once only marks it (no plan built), the second
    call builds and keeps the plan, later calls get it; the least recently used go first."""
    from ringflash.kernels.plans import Plan, Plans

    plans = Plans(kept=2)
    plan = Plan(None, (1,), (), {}, ())
    assert plans.get("a") is None and not plans.wants("a")
    assert plans.get("a") is None and plans.wants("a")
    plans.put("a", plan)
    assert plans.get("a") is plan
    assert not plans.wants("b") and not plans.wants("c")  # "a" is the least recently used: dropped
    assert plans.get("a") is None and len(plans) == 2
    with pytest.raises(ValueError, match="no tensor"):
        Plan(None, (1,), (torch.zeros(1),), {}, (torch.zeros(1),))


def test_kept_launch_calls_the_compiled_kernel_without_the_key(monkeypatch):
    """A plan's KeptLaunch: the first launch goes through Triton (which compiles), the second
    through launch()'s keyed fast path, and from then on the compiled kernel runs directly with
    the same values (the keyword arguments and defaults after the positional ones) without
    classifying any argument; with launch hooks installed, or on another device, it goes
    through launch() again."""
    runs, through_triton = [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *values):
            runs.append(values)

    compiled = Compiled()

    class Param:
        def __init__(self, constexpr):
            self.is_constexpr = constexpr

    class Kernel:
        params = [Param(False), Param(False), Param(True), Param(False)]

        class signature:  # noqa: N801  (inspect.Signature's attribute)
            parameters = {n: type("P", (), {"default": d})() for n, d in (("a", 0), ("b", 0), ("C", 0), ("d", 5))}

        def __getitem__(self, grid):
            return lambda *a, **kw: through_triton.append((grid, a, kw)) or compiled

    fast, device = [True], [0]
    monkeypatch.setattr(launcher, "fast_path_applies", lambda kernel: fast[0])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 100 + d, raising=False)
    kernel, kept = Kernel(), launcher.KeptLaunch()
    args, kwargs = (3, 16), {"C": 8}
    assert kept(kernel, (2,), args, kwargs) is compiled and len(through_triton) == 1 and not runs
    assert kept(kernel, (2,), args, kwargs) is compiled and len(runs) == 1  # keyed fast path
    expected = (2, 1, 1, 100, "fn", "meta", None, None, None, 3, 16, 8, 5)
    assert runs[-1] == expected

    def no_key(x):
        raise AssertionError("classified again")

    monkeypatch.setattr(launcher, "_arg_class", no_key)
    assert kept(kernel, (2,), args, kwargs) is compiled and runs[-1] == expected and len(runs) == 2
    fast[0] = False  # launch hooks (a profiler): Triton's own path, every launch
    assert kept(kernel, (2,), args, kwargs) is compiled and len(through_triton) == 2 and len(runs) == 2
    fast[0], device[0] = True, 1  # another device: launch()'s keyed path, which classifies
    with pytest.raises(AssertionError, match="classified again"):
        kept(kernel, (2,), args, kwargs)


def _fake_cuda_launcher(nvidia, launch, signature, metas, *, scratch=0):
    """A triton CudaLauncher as its __init__ builds it, with `launch` (a callable object, as
    the compiled C function is) in place of the C module, which needs a CUDA toolkit."""
    run = object.__new__(nvidia.CudaLauncher)
    run.num_ctas = 1
    run.launch = nvidia.wrap_handle_tensordesc(launch, signature, metas)
    run.global_scratch_size, run.global_scratch_align = scratch, 16
    run.profile_scratch_size, run.profile_scratch_align = 0, 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    return run


def test_direct_launch_passes_what_tritons_launcher_passes(monkeypatch):
    """DirectLaunch against triton's own CUDA launcher (the installed triton's CudaLauncher.__call__
    and wrap_handle_tensordesc, the C function and the TMA encoder stood in): the same values in
    the same order for kernels with TMA descriptors anywhere among their arguments (first, last,
    side by side, fp4-padded, NaN-padded), descriptors without TMA metadata, and none at all; and
    triton's launcher itself where DirectLaunch cannot stand in (scratch memory, another type)."""
    import types

    from triton.backends.nvidia import driver as nvidia
    from triton.tools.tensor_descriptor import TensorDescriptor

    def encode(*a):  # the TMA map's inputs, lists as tuples so that two maps compare by value
        return ("map", *(tuple(x) if isinstance(x, list) else x for x in a))

    utils = types.SimpleNamespace(fill_tma_descriptor=encode)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))
    monkeypatch.setattr(launcher, "_tma_encoder", lambda: encode)

    class Launch:
        def __init__(self):
            self.calls = []

        def __call__(self, *args):
            self.calls.append(args)

    def desc(rows, cols, padding="zero", dtype=torch.bfloat16):
        t = torch.zeros(rows, cols, dtype=dtype)
        return TensorDescriptor(t, [rows, cols], [cols, 1], [16, 16], padding=padding)

    def meta(elem_type, fp4_padded=False):
        return {"swizzle": 3, "elem_size": 2, "elem_type": elem_type, "block_size": [16, 16], "fp4_padded": fp4_padded}

    x, y = torch.zeros(4), torch.zeros(8)
    kinds = {"d": "tensordesc<bf16[16, 16]>", "p": "*fp32", "i": "i32", "f": "fp32", "c": "constexpr"}
    cases = [  # (the kernel's arguments by kind, their values, the descriptors' metadata)
        ("dpidc", [desc(32, 64), x, 7, desc(48, 32, "nan"), 64], [meta(10), meta(10)]),
        ("ddpf", [desc(16, 16), desc(64, 128), y, 0.5], [meta(10), meta(7, fp4_padded=True)]),
        ("pidd", [x, 3, desc(16, 32), desc(32, 16)], [meta(10), meta(9)]),
        ("pdi", [y, desc(16, 16, "nan"), 1], None),  # no TMA metadata: descriptors passed apart
        ("pifc", [x, 5, 0.25, 16], None),  # no descriptor: the C function itself
    ]
    for kinds_of, values, metas in cases:
        signature = {n: kinds[k] for n, k in enumerate(kinds_of)}
        theirs, ours = Launch(), Launch()
        nvidia.CudaLauncher.__call__(
            _fake_cuda_launcher(nvidia, theirs, signature, metas), 4, 2, 1, 77, "fn", "meta", None, None, None, *values
        )
        direct = launcher.DirectLaunch.of(_fake_cuda_launcher(nvidia, ours, signature, metas))
        assert direct is not None, kinds_of
        direct(4, 2, 1, 77, "fn", "meta", tuple(values))
        assert ours.calls == theirs.calls and len(theirs.calls) == 1, kinds_of

    # scratch memory (triton allocates it per launch) or another launcher: triton's own
    signature, values = {0: kinds["d"], 1: kinds["p"]}, (desc(16, 16), x)
    assert launcher.DirectLaunch.of(_fake_cuda_launcher(nvidia, Launch(), signature, [meta(10)], scratch=64)) is None
    assert launcher.DirectLaunch.of(Launch()) is None

    # _run: the kernel's DirectLaunch, built once, where it can; its launcher where not
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 100 + d, raising=False)
    ours = Launch()
    compiled = types.SimpleNamespace(
        run=_fake_cuda_launcher(nvidia, ours, signature, [meta(10)]), function="fn", packed_metadata="meta"
    )
    launcher._run(compiled, 0, (3,), values)
    launcher._run(compiled, 1, (3,), values)
    assert [c[:4] for c in ours.calls] == [(3, 1, 1, 100), (3, 1, 1, 101)] and len(ours.calls[0]) == 13 + 5 + 1
    assert launcher._DIRECT[id(compiled)][1] is not None


def test_direct_launch_encodes_a_tma_map_once_per_address_shape_and_strides(monkeypatch):
    """A descriptor met again at the same address, shape, strides and padding launches with the
    TMA map encoded the first time (the driver's encoder not called again); any of them changed,
    a map of its own is encoded; at most TMA_MAPS_KEPT are kept per descriptor slot."""
    import types

    from triton.backends.nvidia import driver as nvidia
    from triton.tools.tensor_descriptor import TensorDescriptor

    encoded = []

    def encode(*a):
        encoded.append(a)
        return ("map", len(encoded))

    utils = types.SimpleNamespace(fill_tma_descriptor=encode)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(utils=utils))
    monkeypatch.setattr(launcher, "_tma_encoder", lambda: encode)
    monkeypatch.setattr(launcher, "TMA_MAPS_KEPT", 3)
    calls = []
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [16, 16], "fp4_padded": False}
    signature = {0: "tensordesc<bf16[16, 16]>", 1: "i32"}
    direct = launcher.DirectLaunch.of(_fake_cuda_launcher(nvidia, lambda *a: calls.append(a), signature, [meta]))
    t = torch.zeros(64, 32, dtype=torch.bfloat16)

    def launch(base, shape, strides, padding="zero"):
        direct(1, 1, 1, 0, "fn", "meta", (TensorDescriptor(base, shape, strides, [16, 16], padding=padding), 5))
        return calls[-1][13]  # the TMA map, first value after the launcher's fixed head

    first = launch(t, [64, 32], [32, 1])
    assert launch(t, [64, 32], [32, 1]) is first and len(encoded) == 1  # a new descriptor, same tensor
    assert launch(t.clone(), [64, 32], [32, 1]) != first  # another address
    assert launch(t, [32, 32], [32, 1]) != first  # another shape
    assert launch(t, [32, 32], [64, 1]) != first and len(encoded) == 4  # other strides: a map each
    assert launch(t, [32, 32], [64, 1], "nan") != first and len(encoded) == 5  # padding too
    assert launch(t, [64, 32], [32, 1]) != first and len(encoded) == 6  # the slot was full: cleared
    assert encoded[-1] == encoded[0] and calls[-1][14:] == (64, 32, 32, 1, 5)


def test_key_spans_cut_trailing_padding_and_zero_bias_runs(monkeypatch):
    """key_bias.key_spans per batch row: [0] the last key the bias does not hide (-inf), plus one
    (hidden keys before it and finite biases of any sign do not cut it; 0 when every key is
    hidden; Sk with configs.GLUON_CUT_KEY_PADDING off); [1:] the first run of keys whose bias is
    exactly 0, shrunk to multiples of 384 (its end rounded up past Sk when it runs to the end),
    empty for a scale <= 0 or with configs.PLAIN_ZERO_BIAS_KEYS off."""
    from ringflash.kernels import configs

    inf = float("-inf")
    Sk = 1000
    bias = torch.zeros(7, Sk)
    bias[0, 900:] = inf  # right padding: zeros [0, 900) -> [0, 768)
    bias[1, :50] = inf  # left padding: zeros [50, 1000) run to the end -> [384, 1152)
    bias[2, 400:] = inf  # zeros [0, 400) -> [0, 384)
    bias[3] = torch.linspace(0.5, 2.0, Sk)  # no zero: empty
    bias[4, :] = inf  # every key hidden: empty
    bias[5, 100] = -0.5  # zeros [0, 100): shorter than 384, empty
    bias[6, 3] = 2.0  # inner padding and a finite bias cut neither [0]; the first run [0, 3): empty
    bias[6, 10:20] = inf
    monkeypatch.setattr(configs, "GLUON_CUT_KEY_PADDING", True)
    monkeypatch.setattr(configs, "PLAIN_ZERO_BIAS_KEYS", True)
    spans = key_spans(bias, 0.125)
    assert spans.dtype == torch.int32 and spans.shape == (7, 3)
    assert spans[:, 0].tolist() == [900, 1000, 400, 1000, 0, 1000, 1000]
    plain = [tuple(r) for r in spans[:, 1:].tolist()]
    assert plain[0] == (0, 768) and plain[1] == (384, 1152) and plain[2] == (0, 384)
    for row in (3, 4, 5, 6):
        assert plain[row][0] >= plain[row][1], row
    # every key of a span has bias exactly 0 (the kernels leave it out there)
    for row, (lo, hi) in enumerate(plain):
        assert bool((bias[row, lo : min(hi, Sk)] == 0).all()), row
    assert (key_spans(bias, -0.125)[:, 1:] == 0).all() and (key_spans(bias, 0.0)[:, 1:] == 0).all()
    assert key_spans(bias[:, :0], 0.125).tolist() == [[0, 0, 0]] * 7
    monkeypatch.setattr(configs, "GLUON_CUT_KEY_PADDING", False)
    monkeypatch.setattr(configs, "PLAIN_ZERO_BIAS_KEYS", False)
    assert key_spans(bias, 0.125).tolist() == [[Sk, 0, 0]] * 7


def test_key_spans_agree_with_their_definition_across_blocks(monkeypatch):
    """key_spans' one-pass kernel (1024 keys a block, the first zero and the nonzero after it
    carried across blocks) against the definition written out row by row, on random padding
    masks and biases of 2500 keys: zeros that start, stop and restart in any block."""
    from ringflash.kernels import configs

    monkeypatch.setattr(configs, "GLUON_CUT_KEY_PADDING", True)
    monkeypatch.setattr(configs, "PLAIN_ZERO_BIAS_KEYS", True)
    g = torch.Generator().manual_seed(3)
    Sk, a = 2500, 384
    rows = []
    for r in range(16):
        row = torch.zeros(Sk)
        if r % 2:  # a leading run: the first zero in a later block, or none
            row[: int(torch.randint(1, Sk + 1, (1,), generator=g))] = float("-inf") if r % 4 == 1 else -1.5
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):  # a few runs of hidden or biased keys
            lo = int(torch.randint(0, Sk, (1,), generator=g))
            hi = min(Sk, lo + int(torch.randint(1, 1500, (1,), generator=g)))
            row[lo:hi] = float("-inf") if torch.rand(1, generator=g) < 0.7 else 0.25
        rows.append(row)
    bias = torch.stack(rows)
    got = key_spans(bias, 0.5).tolist()
    for r, row in enumerate(bias.tolist()):
        visible = [i for i, x in enumerate(row) if x > float("-inf")]
        zeros = [i for i, x in enumerate(row) if x == 0.0]
        first_zero = zeros[0] if zeros else Sk
        first_after = next((i for i in range(first_zero, Sk) if row[i] != 0.0), Sk)
        lo = -(-first_zero // a) * a
        hi = -(-Sk // a) * a if first_after == Sk else first_after // a * a
        assert got[r] == [visible[-1] + 1 if visible else 0, lo, max(hi, lo)], (r, got[r])
