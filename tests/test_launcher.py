"""The launch path's specialization key against Triton's own (no GPU needed): two arguments that
share a key must be specialized alike by Triton, or launch() would run a kernel compiled for
other arguments."""

import itertools

import pytest
import torch

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
