import os

import pytest
import torch

# The Triton kernels run under the interpreter on CPU-only machines; this must be set before
# triton is imported (by ringflash.kernels, which ringflash imports lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def _share_cores_among_workers() -> None:
    """Under pytest -n N, each worker process (and what it starts: the ranks of the distributed
    tests, the scripts the smoke tests run, which inherit OMP_NUM_THREADS) takes its 1/N of the
    cores instead of torch's default of all of them: N x cores threads on the cores ran the two
    Gluon harness tests side by side 1.8x slower on two cores (200 s against 111). A thread
    count set by the caller is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_cores_among_workers()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_remembered_calls():
    """Every test starts with no remembered flash_attn_func calls (ringflash.local._CALLS): what
    a call of another test learned (its checks, its call plan, under that test's monkeypatched
    tunables) must not decide this test's launches, whatever order the tests run in."""
    from ringflash import local

    local._CALLS.clear()


@pytest.fixture(autouse=True)
def _gpu_memory_handed_back(request):
    """After a GPU test, the memory its process's allocator keeps cached goes back to the driver:
    the GPU tests run in several processes at once (pytest -n 8), each caching what its largest
    test took, and together those caches can exceed an 80 GB GPU's memory, so that another
    process's allocation fails mid-test."""
    yield
    if HAS_CUDA and "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def backend(request):
    """Parametrize with indirect=True over 'torch' / 'triton': the block operations run there."""
    from ringflash.local import use_backend

    with use_backend(request.param):
        yield request.param


@pytest.fixture(scope="module")
def worlds():
    """worlds(size, timeout=600.0, **env) -> a dist_utils.World of `size` gloo processes with that
    environment (e.g. RINGFLASH_BACKEND="torch"), started at first use and kept for the module.
    A short timeout makes a task that leaves a rank waiting in a collective fail quickly."""
    from dist_utils import World

    pool = {}

    def get(size, timeout=600.0, **env):
        key = (size, timeout, tuple(sorted(env.items())))
        if key not in pool:
            pool[key] = World(size, env, timeout=timeout)
        return pool[key]

    yield get
    for world in pool.values():
        world.close()
