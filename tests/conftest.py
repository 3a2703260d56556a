import os

import pytest
import torch

# The Triton kernels run under the interpreter on CPU-only machines; this must be set before
# triton.jit decorates the kernels, i.e. before ringflash.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backend(request, monkeypatch):
    """Parametrize with indirect=True over 'torch' / 'triton'."""
    monkeypatch.setenv("RINGFLASH_BACKEND", request.param)
    return request.param
