"""CUDA graphs: flash_attn_func, and a ring call of one rank (the local call), captured with
torch.cuda.graph and replayed on new values put into the same tensors give what eager calls
give; calls that read or draw values on the host raise under capture, naming the API.

Run on a CUDA machine with `pytest -m gpu` (the errors are also checked on the CPU, with the
capture state mocked: tests/test_errors.py).
"""

import pytest
import torch

import ringflash
from ringflash import flash_attn_func, ring_flash_attn_func
from ringflash.testing import capture_graph

from oracle import assert_within, naive_attention

pytestmark = pytest.mark.gpu


def _inputs(seed, B=2, S=1031, Hq=4, Hkv=2, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda H: torch.randn(B, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


@pytest.mark.parametrize("attention", ["flash_attn_func", "ring_flash_attn_func"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_forward_backward_replayed_on_new_values(attention, deterministic, causal, D):
    """One captured forward+backward, replayed twice on new q, k, v, dO copied into its
    tensors: the output and lse equal an eager call's bitwise (the forward is deterministic),
    and so do the gradients with deterministic=True; the fused backward's (dQ summed by atomics
    in a varying order) are within the float64 bound. The replays' outputs differ from the
    capture's (the graph reads the tensors, not what they held at capture)."""
    call = {"flash_attn_func": flash_attn_func, "ring_flash_attn_func": ring_flash_attn_func}[attention]
    kw = dict(causal=causal, deterministic=deterministic, return_lse=True)
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(0, D=D)))

    def step():
        q.grad = k.grad = v.grad = None
        out, lse = call(q, k, v, **kw)
        out.backward(do)
        return out, lse

    graph, (out, lse) = capture_graph(step)
    captured_out = out.clone()
    for seed in (1, 2):
        with torch.no_grad():
            for static, new in zip((q, k, v, do), _inputs(seed, D=D)):
                static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out_e, lse_e = call(qe, ke, ve, **kw)
        out_e.backward(do)
        assert torch.equal(out, out_e) and torch.equal(lse, lse_e)
        assert not torch.equal(out, captured_out)
        grads, eager = (q.grad, k.grad, v.grad), (qe.grad, ke.grad, ve.grad)
        if deterministic:
            for name, got, want in zip(("dq", "dk", "dv"), grads, eager):
                assert torch.equal(got, want), name
            continue
        ref = naive_attention(qe, ke, ve, causal=causal)[0]
        ref_grads = torch.autograd.grad(ref, (qe, ke, ve), do.double())
        plain = naive_attention(qe, ke, ve, causal=causal, dtype=torch.bfloat16)[0]
        plain_grads = torch.autograd.grad(plain, (qe, ke, ve), do)
        for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
            assert_within(name, got, r, p)


def test_forward_replayed_without_grad():
    """A captured forward under no_grad (inference), replayed on new values: bitwise the eager
    output."""
    q, k, v, _ = _inputs(0)

    def step():
        with torch.no_grad():
            return flash_attn_func(q, k, v, causal=True)

    graph, out = capture_graph(step)
    for seed in (1, 2):
        for static, new in zip((q, k, v), _inputs(seed)[:3]):
            static.copy_(new)
        graph.replay()
        assert torch.equal(out, flash_attn_func(q, k, v, causal=True))


def _packed(api):
    q, k, v, _ = (t[0] for t in _inputs(0, B=1, S=512))
    cu = torch.tensor([0, 100, 512], dtype=torch.int32, device="cuda")
    if api == "flash_attn_varlen_func":
        return lambda: ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True)
    layout = ringflash.balanced_layout([0, 100, 512], 1)
    return lambda: ringflash.ring_flash_attn_varlen_func(q, k, v, cu, layout=layout, causal=True)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
@pytest.mark.parametrize(
    "api, call",
    [
        ("flash_attn_varlen_func", lambda: _packed("flash_attn_varlen_func")),
        ("ring_flash_attn_varlen_func", lambda: _packed("ring_flash_attn_varlen_func")),
        ("flash_attn_func", lambda: (lambda q, k, v: lambda: flash_attn_func(q, k, v, dropout_p=0.1))(*_inputs(0)[:3])),
    ],
)
def test_host_reads_raise_under_capture(api, call):
    """Packed documents (boundaries read and row bounds built on the host) and dropout (a seed
    drawn on the host per call) raise a RuntimeError naming the API inside a capture, after
    warm-up calls that ran (and cached what they read) outside it: a replay would otherwise keep
    the capture's boundaries or seed."""
    fn = call()
    fn()  # outside a capture: runs, and caches the boundaries it read
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=f"^{api}: .*CUDA graph"):
        with torch.cuda.graph(graph):
            fn()
    fn()  # the stream is usable after the failed capture


def test_compiled_with_cuda_graphs():
    """torch.compile(mode="reduce-overhead") (CUDA graph trees over the compiled forward and
    backward): no graph is skipped, and each call on new inputs gives the eager output and
    gradients bitwise (deterministic=True)."""
    from torch._dynamo.utils import counters

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attention, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # the graphs are recorded on the first calls, then replayed
        q, k, v, do = _inputs(seed)
        qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
        out = compiled(qc, kc, vc)
        out.backward(do)
        qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
        out_e = attention(qe, ke, ve)
        out_e.backward(do)
        assert torch.equal(out, out_e)
        for name, got, want in zip(("dq", "dk", "dv"), (qc.grad, kc.grad, vc.grad), (qe.grad, ke.grad, ve.grad)):
            assert torch.equal(got, want), name
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
