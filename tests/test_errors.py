"""Bad input: errors name the argument and the shapes, before any kernel launches; on a ring,
every rank raises (never a hang, never a mixed-up ring)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ringflash import flash_attn_func, ring_flash_attn_func, ring_flash_attn_varlen_func, unshard

from ring_cases import TORCH, Case, full_inputs, ring_vs_oracle

ROOT = Path(__file__).resolve().parents[1]


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "args,exc,pattern",
    [
        ((_t(2, 8, 4), _t(2, 8, 4, 32), _t(2, 8, 4, 32)), ValueError, r"q must be 4-D.*\(2, 8, 4\)"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 32, 1), _t(2, 8, 4, 32)), ValueError, r"k must be 4-D"),
        (
            (_t(2, 8, 4, 32), _t(3, 8, 4, 32), _t(3, 8, 4, 32)),
            ValueError,
            r"batch differs.*\(2, 8, 4, 32\).*\(3, 8, 4, 32\)",
        ),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 64), _t(2, 8, 4, 64)), ValueError, r"head_dim differs"),
        ((_t(2, 8, 4, 32), _t(2, 8, 3, 32), _t(2, 8, 3, 32)), ValueError, r"multiple of k/v heads \(3\)"),
        ((_t(2, 8, 4, 32), _t(2, 8, 4, 32), _t(2, 9, 4, 32)), ValueError, r"v must match k in batch, seqlen and heads"),
        ((_t(2, 8, 4, 0), _t(2, 8, 4, 0), _t(2, 8, 4, 0)), ValueError, r"head_dim 0 unsupported"),
        ((_t(2, 8, 4, 264), _t(2, 8, 4, 264), _t(2, 8, 4, 264)), ValueError, r"head_dim 264 unsupported"),
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
    from ringflash import flash_attn_varlen_func, ring_flash_attn_func
    from ringflash.nn import RingMultiheadAttention

    cu = torch.tensor([0, 4], dtype=torch.int32)
    for f in (flash_attn_func, ring_flash_attn_func):  # a float mask is not differentiated
        with pytest.raises(ValueError, match="key_padding_mask requires grad"):
            f(q, q, q, key_padding_mask=torch.zeros(1, 4, requires_grad=True))
    for call in (
        lambda: flash_attn_func(q, q, q, deterministic=1),
        lambda: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, deterministic="yes"),
        lambda: ring_flash_attn_func(q, q, q, deterministic=None),
        lambda: RingMultiheadAttention(32, 2, deterministic=0),
    ):
        with pytest.raises(TypeError, match="deterministic must be a bool"):
            call()

    h = q.to(torch.bfloat16)
    for bad in (torch.float16, torch.float64, "bfloat16"):  # neither float32 nor the inputs' dtype
        with pytest.raises(
            ValueError,
            match=r"grad_accum_dtype must be None, torch.float32 or the inputs' dtype "
            r"torch.bfloat16, got",
        ):
            ring_flash_attn_func(h, h, h, grad_accum_dtype=bad)


def test_remembered_calls_are_still_checked():
    """flash_attn_func remembers a checked call by its signature (shapes, dtypes, devices,
    flags and the settings in force); a call that equals a remembered one in value but not in
    type, or differs in what the checks read, is checked in full."""
    from ringflash import local

    q = _t(1, 4, 2, 16)
    for _ in range(2):  # remembered, then a hit
        flash_attn_func(q, q, q, causal=True, window_size=(1, 0), softmax_scale=0.5)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_func(q, q, q, causal=1, window_size=(1, 0), softmax_scale=0.5)
    with pytest.raises(ValueError, match="window_size must be a pair of ints"):
        flash_attn_func(q, q, q, causal=True, window_size=(True, 0), softmax_scale=0.5)
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        flash_attn_func(q, q, q, causal=True, window_size=(1, 0), softmax_scale=True)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attn_func(q, q, q, causal=True, window_size=(1, 0), softmax_scale=0.5, return_lse=0)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_func(q, q.double(), q, causal=True, window_size=(1, 0), softmax_scale=0.5)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, q, q, causal=True, window_size=(1, 0), softmax_scale=0.5, dropout_p=1.5)
    # the settings in force are part of the signature
    signature = lambda: local._call_signature(q, q, q, True, 0.5, (1, 0), None, False, 0.0, None, False)  # noqa: E731
    plain = signature()
    with local.use_backend("triton"):
        assert signature() != plain
    torch.use_deterministic_algorithms(True)
    try:
        assert signature() != plain
    finally:
        torch.use_deterministic_algorithms(False)
    assert signature() == plain
    # a backend that cannot run raises after a hit of the same shapes: Triton on CPU tensors
    # without its interpreter, in a fresh process (this one runs the interpreter)
    code = (
        "import torch, ringflash\nfrom ringflash import local\nq = torch.randn(1, 8, 2, 16)\n"
        "kw = dict(causal=True, window_size=(1, 0), softmax_scale=0.5)\nringflash.flash_attn_func(q, q, q, **kw)\n"
        "try:\n    with local.use_backend('triton'):\n        ringflash.flash_attn_func(q, q, q, **kw)\n"
        "except RuntimeError as e:\n    print('raised:', e)\n"
    )
    result = _python(code)
    assert "raised:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout + result.stderr


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the repository importable and `env` set."""
    full = {k: v for k, v in os.environ.items() if k not in ("RINGFLASH_BACKEND", "TRITON_INTERPRET", "WORLD_SIZE")}
    full.update(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


ATTEND = "import torch, ringflash; q = torch.randn(1, 4, 2, 16); ringflash.flash_attn_func(q, q, q)"


def test_bad_backend_env():
    """RINGFLASH_BACKEND is read once, at import, and a bad value is named at the first call."""
    res = _python(ATTEND, RINGFLASH_BACKEND="cuda")
    assert res.returncode != 0 and "RINGFLASH_BACKEND='cuda'" in res.stderr, res.stderr[-2000:]
    res = _python(ATTEND, RINGFLASH_BACKEND="triton", TRITON_INTERPRET="0")
    assert res.returncode != 0 and "TRITON_INTERPRET=1" in res.stderr, res.stderr[-2000:]
    assert _python(ATTEND, RINGFLASH_BACKEND="torch").returncode == 0


def test_use_backend_rejects_unknown_names():
    from ringflash.local import use_backend

    with pytest.raises(ValueError, match="use_backend='cuda'"):
        with use_backend("cuda"):
            pass


def test_several_ranks_without_a_process_group_raise():
    """Under torchrun (WORLD_SIZE=2) but without init_process_group, the ring functions and
    shard would silently treat each process as the whole ring: they raise instead."""
    # one interpreter: one-device attention needs no group; each ring call must raise
    script = ATTEND + textwrap.dedent(
        """
        for call in ("ringflash.shard(q)", "ringflash.ring_flash_attn_func(q, q, q)", "ringflash.local_positions(4)"):
            try:
                eval(call)
            except RuntimeError as e:
                assert "WORLD_SIZE=2 but no torch.distributed process group" in str(e), (call, str(e))
            else:
                raise AssertionError(call + " did not raise")
        print("all raised")
        """
    )
    res = _python(script, WORLD_SIZE="2")
    assert res.returncode == 0 and "all raised" in res.stdout, res.stderr[-2000:]


def test_bad_grad_chunks():
    q = _t(1, 4, 2, 16)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="grad_chunks must be None or a positive int"):
            ring_flash_attn_func(q, q, q, grad_chunks=bad)


def test_bad_window_size():
    """ring_flash_attn_func's window_size: flash-attn's pair, right -1 or 0 with causal, and
    self-attention only (equal local lengths, as causal); named before anything runs."""
    q, kv = _t(1, 4, 2, 16), _t(1, 6, 2, 16)
    for bad in ((3,), (1, 2, 3), "(1, 1)", (-2, 0), (1.0, 0), (True, 0), None):
        with pytest.raises(ValueError, match=r"window_size must be a pair of ints >= -1 \(left, right\), got"):
            ring_flash_attn_func(q, q, q, window_size=bad)
    with pytest.raises(ValueError, match=r"causal=True means window_size's right is 0; got window_size=\(4, 2\)"):
        ring_flash_attn_func(q, q, q, causal=True, window_size=(4, 2))
    with pytest.raises(
        ValueError, match=r"windowed \(window_size=\(2, 2\)\) ring attention needs equal q and k/v local lengths"
    ):
        ring_flash_attn_func(q, kv, kv, window_size=(2, 2))
    with pytest.raises(ValueError, match=r"causal windowed \(window_size=\(3, -1\)\) ring attention needs equal"):
        ring_flash_attn_func(q, kv, kv, causal=True, window_size=(3, -1))
    assert ring_flash_attn_func(q, kv, kv, window_size=(-1, -1)).shape == q.shape  # no window: cross-attention


def _mismatch(rank, world):
    q, k, v, _ = full_inputs(1, 8, 8, 2, 1, 16, torch.float32, 0)
    bad = dict(
        length=(q[:, : 6 if rank else 4], k[:, : 6 if rank else 4], v[:, : 6 if rank else 4], {}),
        causal=(q[:, :4], k[:, :4], v[:, :4], {"causal": rank == 1}),
        dtype=(
            q[:, :4].to(torch.float64 if rank else torch.float32),
            k[:, :4].to(torch.float64 if rank else torch.float32),
            v[:, :4].to(torch.float64 if rank else torch.float32),
            {},
        ),
        heads=(q[:, :4, : 1 + rank], k[:, :4], v[:, :4], {}),
        layout=(q[:, :4], k[:, :4], v[:, :4], {"layout": "zigzag" if rank else "contiguous"}),
        scale=(q[:, :4], k[:, :4], v[:, :4], {"softmax_scale": 0.5 + rank}),
        grad_accum=(
            q[:, :4].bfloat16(),
            k[:, :4].bfloat16(),
            v[:, :4].bfloat16(),
            {"grad_accum_dtype": torch.bfloat16 if rank else None},
        ),
        grad_chunks=(q[:, :4], k[:, :4], v[:, :4], {"grad_chunks": 1 + rank}),
        window=(q[:, :4], k[:, :4], v[:, :4], {"window_size": (2, 1 + rank)}),
        v_head_dim=(q[:, :4], k[:, :4], v[:, :4, :, : 16 - 8 * rank], {}),
    )
    named = {  # the message names what was passed (causal is a window whose right side is 0)
        "v_head_dim": r"disagree \(v head_dim: rank 0=16, rank 1=8",
        "causal": r"disagree \(causal / window_size right: rank 0=-1 \(not causal\), rank 1=0 \(causal\)\)",
        "window": r"disagree \(causal / window_size right: rank 0=1, rank 1=2\)",
    }
    for name, (a, b, c, kw) in bad.items():
        with pytest.raises(ValueError, match=named.get(name, "disagree")):
            ring_flash_attn_func(a, b, c, **kw)
    # one rank's own input is invalid: it raises its error, the other quotes it
    pattern = "head_dim 264" if rank == 1 else r"rank\(s\) \[1\] .*rejected their inputs \(rank 1: .*head_dim 264"
    with pytest.raises(ValueError, match=pattern):
        bad_q = torch.randn(1, 4, 2, 264 if rank == 1 else 16)
        ring_flash_attn_func(bad_q, bad_q[:, :, :1], bad_q[:, :, :1])
    # odd local length under zigzag on one rank only
    pattern = "multiple of 2" if rank == 0 else "rejected"
    with pytest.raises(ValueError, match=pattern):
        ring_flash_attn_func(
            q[:, : 5 if rank == 0 else 4], k[:, : 5 if rank == 0 else 4], v[:, : 5 if rank == 0 else 4]
        )
    # unshard with different shapes, also past the eighth dimension, or numbers of dimensions
    with pytest.raises(ValueError, match="disagree"):
        unshard(torch.zeros(1, 4 + 2 * rank))
    with pytest.raises(ValueError, match=r"disagree \(size\[9\]: rank 0=1, rank 1=2\)"):
        unshard(torch.zeros([1, 4] + [1] * 7 + [1 + rank]))
    with pytest.raises(ValueError, match="disagree.*ndim"):
        unshard(torch.zeros([1, 4] + [1] * rank))
    with pytest.raises(ValueError, match="disagree.*layout"):
        unshard(torch.zeros(1, 4), layout="zigzag" if rank else "contiguous")
    with pytest.raises(ValueError, match=r"disagree \(dtype: rank 0=torch.float32, rank 1=torch.float64\)"):
        unshard(torch.zeros(1, 4, dtype=torch.float64 if rank else torch.float32))
    # packed documents on a named layout that one rank cannot build (its cu_seqlens holds a
    # float): that rank raises its error, the other quotes it, neither waits in the ring
    packed = torch.zeros(4, 2, 16)
    pattern = "cu_seqlens must hold ints" if rank == 1 else r"rank\(s\) \[1\] .*rejected"
    with pytest.raises((TypeError, ValueError), match=pattern):
        ring_flash_attn_varlen_func(packed, packed, packed, [0, 3.0 if rank else 3, 8], layout="contiguous")
    # gloo cannot carry these tensors (meta stands in for a GPU tensor here)
    with pytest.raises(ValueError, match="cannot carry meta"):
        m = q[:, :4].to("meta")
        ring_flash_attn_func(m, m[:, :, :1], m[:, :, :1])
    # the group still works afterwards
    ring_vs_oracle(rank, world, Case("zigzag", True, 1, 2, 2, 1, 16, torch.float32, seed=0))


def test_cross_rank_mismatch_raises_on_every_rank(worlds):
    worlds(2, **TORCH).run(_mismatch)


def test_meta_tensors_give_shapes():
    """On the meta device (no values: deferred initialization, shape inference) the functions give
    the outputs' shapes and dtypes as torch's attention does, also under autocast (the inputs'
    dtypes decide, as in any call), and the backward gives gradients of the inputs' shapes."""
    from ringflash import flash_attn_varlen_func

    q = torch.randn(2, 40, 4, 16, device="meta", requires_grad=True)
    k = torch.randn(2, 24, 2, 16, device="meta", requires_grad=True)
    v = torch.randn(2, 24, 2, 8, device="meta", requires_grad=True)
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert (out.shape, out.dtype, out.device.type) == ((2, 40, 4, 8), torch.float32, "meta")
        assert (lse.shape, lse.dtype, lse.device.type) == ((2, 4, 40), torch.float32, "meta")
    out.sum().backward()
    assert [(t.grad.shape, t.grad.device.type) for t in (q, k, v)] == [(t.shape, "meta") for t in (q, k, v)]
    packed = torch.randn(40, 4, 16, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device="meta")
    out = flash_attn_varlen_func(packed, packed, packed, cu, cu, 25, 25, window_size=(8, 0))
    assert (out.shape, out.dtype, out.device.type) == ((40, 4, 16), torch.bfloat16, "meta")


def _meta_ring(rank, world):
    """A ring of one rank and RingMultiheadAttention on it give meta shapes, as
    nn.MultiheadAttention does (a ring over several ranks refuses meta tensors: _mismatch)."""
    import torch.distributed as dist

    from ringflash.nn import RingMultiheadAttention

    alone = [dist.new_group([r]) for r in range(world)][rank]
    q = torch.randn(1, 32, 2, 16, device="meta", requires_grad=True)
    out, lse = ring_flash_attn_func(q, q, q, causal=True, return_lse=True, group=alone)
    out.sum().backward()
    assert [t.shape for t in (out, lse, q.grad)] == [(1, 32, 2, 16), (1, 2, 32), (1, 32, 2, 16)]
    x = torch.randn(3, 32, 32, device="meta")
    ours = RingMultiheadAttention(32, 2, batch_first=True, device="meta", group=alone)
    theirs = torch.nn.MultiheadAttention(32, 2, batch_first=True, device="meta")
    causal = torch.nn.Transformer.generate_square_subsequent_mask(32, device="meta")
    for kw in (
        dict(need_weights=False),
        dict(),
        dict(average_attn_weights=False),
        dict(attn_mask=causal, is_causal=True),
    ):
        got, want = ours(x, x, x, **kw), theirs(x, x, x, **kw)
        assert [None if t is None else (t.shape, t.device.type) for t in got] == [
            None if t is None else (t.shape, t.device.type) for t in want
        ], kw


def test_meta_tensors_on_a_ring_of_one(worlds):
    worlds(2, **TORCH).run(_meta_ring)


def test_device_mismatch_named():
    q = _t(1, 4, 2, 16)
    with pytest.raises(ValueError, match="one device.*meta"):
        flash_attn_func(q, q.to("meta"), q)


def test_agreement_exchange_prefers_the_cpu(monkeypatch):
    """The rank-agreement all_gather runs on the CPU whenever the group carries CPU tensors
    (gloo beside NCCL), so reading it back never waits for the GPU; NCCL alone: the GPU."""
    from ringflash import comm

    cases = {"cpu:gloo,cuda:nccl": "cpu", "gloo": "cpu", "nccl": "cuda"}
    for backend, want in cases.items():
        monkeypatch.setattr(comm.dist, "get_backend", lambda group=None, b=backend: b)
        monkeypatch.setattr(comm, "resolve_group", lambda group: group)
        monkeypatch.setattr(comm.torch.cuda, "current_device", lambda: 0)
        assert comm._exchange_device(None, torch.device("cuda", 0)).type == want, backend


def test_init_from_env_sets_nccl_up_beside_gloo(monkeypatch):
    """init_from_env's "nccl" is "cpu:gloo,cuda:nccl" (the agreement check on the CPU side)."""
    from ringflash import dist_env

    seen = {}
    monkeypatch.setattr(dist_env.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist_env.dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend))
    monkeypatch.setattr(dist_env.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist_env.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist_env.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist_env.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dist_env.init_from_env(backend="nccl")
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    dist_env.init_from_env(backend="gloo")
    assert seen["backend"] == "gloo"


def _packed_cpu(api):
    import ringflash

    q, k, v = (_t(12, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    if api == "flash_attn_varlen_func":
        return lambda: ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    layout = ringflash.balanced_layout([0, 5, 12], 1)
    return lambda: ringflash.ring_flash_attn_varlen_func(q, k, v, cu, layout=layout, causal=True)


def _dense_cpu(call, **kw):
    q, k, v = (_t(1, 12, 2, 16) for _ in range(3))
    return lambda: call(q, k, v, causal=True, **kw)


@pytest.mark.parametrize(
    "api, make, raises",
    [
        ("flash_attn_varlen_func", lambda: _packed_cpu("flash_attn_varlen_func"), True),
        ("ring_flash_attn_varlen_func", lambda: _packed_cpu("ring_flash_attn_varlen_func"), True),
        ("flash_attn_func", lambda: _dense_cpu(flash_attn_func, dropout_p=0.1), True),
        ("ring_flash_attn_func", lambda: _dense_cpu(ring_flash_attn_func, dropout_p=0.1), True),
        ("flash_attn_func", lambda: _dense_cpu(flash_attn_func), False),
        ("flash_attn_func", lambda: _dense_cpu(flash_attn_func, dropout_p=1.0), False),
        ("ring_flash_attn_func", lambda: _dense_cpu(ring_flash_attn_func), False),
    ],
)
def test_host_reads_raise_under_graph_capture(monkeypatch, api, make, raises):
    """While a CUDA stream captures a graph (mocked here; tests/test_gpu_graphs.py captures
    for real), calls that read values on the host (packed documents' boundaries) or draw them
    there (a dropout seed) raise a RuntimeError naming the API before any work; dense calls
    without dropout run (one rank's ring call is the local call)."""
    fn = make()
    fn()  # not capturing: runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    if raises:
        with pytest.raises(RuntimeError, match=f"^{api}: .*CUDA graph"):
            fn()
    else:
        fn()


def test_ring_over_ranks_raises_under_graph_capture(monkeypatch):
    """A ring over several ranks agrees across them on every call (a read to the host): under
    capture (mocked, as the world of two ranks) it raises naming the API where the ranks would
    agree (comm.agree_across_ranks), before any collective."""
    import ringflash.comm
    import ringflash.ring

    fn = _dense_cpu(ring_flash_attn_func)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for module in (ringflash.ring, ringflash.comm):
        monkeypatch.setattr(module, "group_rank_world", lambda group: (0, 2))
    with pytest.raises(RuntimeError, match="^ring_flash_attn_func: the ring's ranks agree.*CUDA graph"):
        fn()


def _grad_on_one_rank(rank, world):
    """Only rank 0's inputs require grad (rank 1 under no_grad, or frozen): the backward is a
    ring too, which rank 1 would never join; every rank raises at the forward instead."""
    import ringflash

    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"disagree \(requires grad \(q, k, v\): rank 0=q, rank 1=none\)"):
        ring_flash_attn_func(q.requires_grad_(rank == 0), q.detach(), q.detach(), causal=True)
    with torch.set_grad_enabled(rank == 1), pytest.raises(ValueError, match=r"rank 0=none, rank 1=q\+k\+v"):
        x = torch.randn(1, 4, 2, 16, requires_grad=True)
        ring_flash_attn_func(x, x, x)
    layout = ringflash.balanced_layout([0, 3, 8], world)
    packed = torch.randn(layout.local_len(rank), 2, 16)
    with pytest.raises(ValueError, match=r"disagree \(requires grad \(q, k, v\): rank 0=none, rank 1=k"):
        k = packed.clone().requires_grad_(rank == 1)
        ring_flash_attn_varlen_func(packed, k, packed, [0, 3, 8], layout=layout)
    x = torch.randn(1, 4, 2, 16, requires_grad=True)  # the group still works, backward included
    ring_flash_attn_func(x, x, x, causal=True).sum().backward()
    assert x.grad.shape == x.shape


def test_requires_grad_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **TORCH).run(_grad_on_one_rank)


def _unshard_device_on_one_rank(rank, world):
    """One rank's x_local on another device (meta stands in for a GPU tensor the group's
    backend carries differently): every rank raises before the all_gather."""
    x = torch.zeros(1, 4, 2)
    pattern = r"unshard: ranks of the group disagree \(device type: rank 0=cpu, rank 1=meta"
    with pytest.raises(ValueError, match=pattern):
        unshard(x.to("meta") if rank else x)
    assert unshard(x).shape == (1, 8, 2)  # the group still works


def test_unshard_device_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **TORCH).run(_unshard_device_on_one_rank)


def _head_group_on_one_rank(rank, world):
    """A head_group given on rank 1 alone, or one that rank 1 cannot use: rank 1 would take the
    hybrid path (or raise) while rank 0 agrees on the plain ring's call. Every rank raises,
    naming head_group, at the one agreement over `group` that both enter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ringflash
    from ringflash.nn import RingMultiheadAttention

    solo = [dist.new_group([r]) for r in range(world)][rank]  # a head group of one: a 2 x 1 grid
    only0 = dist.new_group([0])  # rank 1 is not in it (it gets GroupMember.NON_GROUP_MEMBER)
    mesh = init_device_mesh("cpu", (world, 1))  # 2-D: (ring, heads)
    one = rank == 1
    q = torch.randn(1, 4, 2, 16)

    def raises(call, mine, theirs):
        with pytest.raises(ValueError, match=mine if one else theirs):
            call()

    given = r"disagree \(head_group size: rank 0=none, rank 1=1.*head_group given on rank\(s\) \[1\] of the group only"
    world_group = dist.group.WORLD
    raises(lambda: ring_flash_attn_func(q, q, q, group=world_group, head_group=solo if one else None), given, given)
    raises(  # group=None on every rank (the default group), a head_group on rank 1 alone
        lambda: ring_flash_attn_func(q, q, q, head_group=solo if one else None),
        "head_group given without group",
        r"rank\(s\) \[1\] .*rejected their inputs \(rank 1: .*head_group given without group",
    )
    raises(  # a 2-D DeviceMesh as head_group
        lambda: ring_flash_attn_func(q, q, q, group=world_group, head_group=mesh if one else None),
        "head_group as a DeviceMesh must be 1-D",
        r"rank\(s\) \[1\] .*head_group as a DeviceMesh must be 1-D",
    )
    raises(  # a group rank 1 is not in
        lambda: ring_flash_attn_func(q, q, q, group=world_group, head_group=only0 if one else None),
        "head_group must be a process group that this rank is in",
        r"rank\(s\) \[1\] .*head_group must be a process group that this rank is in",
    )
    raises(  # the 2-D mesh on both (a 2 x 1 grid), and a head_group besides on rank 1
        lambda: ring_flash_attn_func(q, q, q, group=mesh, head_group=solo if one else None),
        "2-D .* without head_group",
        r"rank\(s\) \[1\] .*2-D \(ring dim, head dim\) without head_group",
    )
    # packed documents, the module and unshard: the same agreement
    layout = ringflash.balanced_layout([0, 3, 8], world)
    packed = torch.randn(layout.local_len(rank), 2, 16)
    raises(
        lambda: ring_flash_attn_varlen_func(
            packed, packed, packed, [0, 3, 8], layout=layout, group=world_group, head_group=solo if one else None
        ),
        given,
        given,
    )
    raises(
        lambda: ring_flash_attn_varlen_func(
            packed, packed, packed, [0, 3, 8], layout=layout, head_group=solo if one else None
        ),
        "head_group given without group",
        r"rank\(s\) \[1\] .*head_group given without group",
    )
    module = RingMultiheadAttention(32, 2, batch_first=True, group=world_group, head_group=solo if one else None)
    x = torch.randn(1, 4, 32)
    raises(lambda: module(x, x, x, need_weights=False), given, given)
    # need_weights=True: rank 1's NotImplementedError (not with a head group), quoted on rank 0
    with pytest.raises(NotImplementedError if one else ValueError, match=r"(rank\(s\) \[1\] .*)?need_weights=True"):
        module(x, x, x)
    raises(lambda: unshard(torch.zeros(1, 4), group=world_group, head_group=solo if one else None), given, given)
    # the group still works afterwards
    assert ring_flash_attn_func(q, q, q, causal=True).shape == q.shape


def test_head_group_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **TORCH).run(_head_group_on_one_rank)


def _bad_calls():
    """(call, exception, message) of arguments that used to pass unchecked: each run silently
    wrong (a scale beyond float32, a group of the wrong type taken for no group, a replay that
    dropped rows, a module dropout above 1) or failed inside torch with an error naming neither
    ringflash nor the argument."""
    import ringflash
    from ringflash import balanced_layout, dist_env, shard
    from ringflash.launch import torchrun_command
    from ringflash.nn import RingMultiheadAttention
    from ringflash.testing import replay_ring

    q = _t(1, 8, 2, 16)
    x = _t(2, 8, 32)

    def module(**kw):
        m = RingMultiheadAttention(32, 4, batch_first=True, **kw)
        return m

    def dropout_set_later():
        m = module(dropout=0.1).train()
        m.dropout = 1.5
        m(x, x, x)

    def replay(world, layout, S):
        t = _t(1, S, 2, 16)
        replay_ring(t, t, t, t, world=world, layout=layout)

    int_causal_mask = torch.ones(8, 8, dtype=torch.long).triu(1)
    return {
        "scale beyond float32": (lambda: flash_attn_func(q, q, q, softmax_scale=1e39), ValueError, "overflows float32"),
        "sparse q": (lambda: flash_attn_func(q.to_sparse(), q, q), TypeError, "q must be a dense"),
        "sparse key padding mask": (
            lambda: flash_attn_func(q, q, q, key_padding_mask=torch.ones(1, 8, dtype=torch.bool).to_sparse()),
            TypeError,
            "key_padding_mask must be a dense",
        ),
        "group a string": (lambda: ring_flash_attn_func(q, q, q, group="g"), TypeError, "group must be None, a"),
        "head_group a string": (
            lambda: ring_flash_attn_func(q, q, q, head_group="h"),
            TypeError,
            "head_group must be None, a",
        ),
        "shard group an int": (lambda: shard(q, group=7), TypeError, "group must be None, a"),
        "shard dim a bool": (lambda: shard(q, dim=True), TypeError, "dim must be an int, got bool"),
        "module group a string": (lambda: module(group="g"), TypeError, "group must be None, a"),
        "module balanced layout": (
            lambda: module(layout=balanced_layout([0, 16], 1)),
            ValueError,
            "goes with ring_flash_attn_varlen_func",
        ),
        "module dropout set above 1": (dropout_set_later, ValueError, "dropout must be a probability"),
        "module is_causal an int": (lambda: module()(x, x, x, is_causal=1), TypeError, "is_causal must be a bool"),
        "module int causal mask": (
            lambda: module()(x, x, x, attn_mask=int_causal_mask, is_causal=True, need_weights=False),
            TypeError,
            "attn_mask must be bool or floating point",
        ),
        "module mask a list": (
            lambda: module()(x, x, x, key_padding_mask=[[False] * 8] * 2),
            TypeError,
            "key_padding_mask must be a torch.Tensor",
        ),
        "replay rows lost": (lambda: replay(2, "zigzag", 63), ValueError, "63 does not divide into 4"),
        "replay layout of another world": (
            lambda: replay(4, balanced_layout([0, 16], 2), 16),
            ValueError,
            "built for 2 ranks, world is 4",
        ),
        "init timeout": (lambda: dist_env.init_from_env(timeout_s=-5), ValueError, "timeout_s must be a positive"),
        "init backend": (lambda: dist_env.init_from_env(backend="bogus"), ValueError, "must be 'nccl' or 'gloo'"),
        "run nproc 0": (lambda: torchrun_command(["--nproc", "0", "x.py"], {}, gpus=0, cores=2), SystemExit, "2"),
        "run nproc env": (
            lambda: torchrun_command(["x.py"], {"RINGFLASH_NPROC": "abc"}, gpus=0, cores=2),
            SystemExit,
            "2",
        ),
        "shard dim a float": (lambda: ringflash.shard(q, layout="zigzag", dim=1.0), TypeError, "dim must be an int"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_named(case, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # ringflash-run makes its log folder in the current one
    call, exc, pattern = _bad_calls()[case]
    with pytest.raises(exc, match=pattern):
        call()
