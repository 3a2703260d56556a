"""One launch path for every Triton and Gluon kernel of the package: `launch(kernel, grid, *args,
**kwargs)` does what `kernel[grid](*args, **kwargs)` does, with less host time per call.

Triton's own dispatch (JITFunction.run) binds and specializes every argument, builds a cache
key, checks the kernel's globals, builds launch metadata and calls the (empty) launch hooks on
every call: 39-56 us of host time per launch of the Gluon forward on one H200's host (two runs),
where the compiled kernel's own launcher takes ~14 us (`python -m benchmarks.profile_host
--sections launch`). A short call launches two to four kernels, and its host time, not the GPU,
decides its speed.

Here the first launch of a kernel for a given specialization goes through Triton (which
compiles or finds the kernel); later launches with arguments of the same specialization call
the compiled kernel's launcher directly. The specialization key mirrors Triton's rules
(triton.runtime.jit.create_function_from_signature with native_specialize_impl), kept
conservative: two calls share a key only if Triton specializes them alike
(tests/test_launcher.py checks the rules against Triton's on many values):
  tensor -> dtype and whether data_ptr is 16-byte aligned;
  int    -> == 1 (a constexpr to Triton), % 16 == 0, and its integer width (i32 / i64 / u64);
  bool, float, None, str -> the type (and the value for bool and None);
  tensor descriptor -> its type, dtype, block shape, layout and padding.
Anything else, launch hooks installed (a profiler), or the interpreter: Triton's own path.
A kept launch plan (plans.Plan, whose signature fixes every argument's specialization) launches
through its KeptLaunch, which after its first fast launch skips even the key.
"""

from __future__ import annotations

import contextlib

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from . import configs

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)

# (kernel, device, argument classes, keyword items) -> (compiled kernel, parameter names, defaults)
_COMPILED: dict = {}
_KEPT = 256


def _arg_class(x):
    """What of x decides Triton's specialization (see the module docstring); None: unknown."""
    kind = type(x)  # the common exact types first: this runs for every argument of every launch
    if kind is int:
        return (x == 1, x % 16 == 0, 0 if _I32[0] <= x < _I32[1] else 1 if _I64[0] <= x < _I64[1] else 2)
    if kind is float:
        return float
    if kind is torch.Tensor or isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, bool) or x is None:  # bool before int: a bool is an int
        return ("v", x)
    if isinstance(x, int):  # a subclass: as the int it is
        return _arg_class(int(x))
    if isinstance(x, float):
        return float
    if isinstance(x, str):
        return ("s", x)
    block_shape = getattr(x, "block_shape", None)
    base = getattr(x, "base", None)
    if block_shape is not None and isinstance(base, torch.Tensor):  # a host tensor descriptor
        return (type(x), base.dtype, tuple(block_shape), getattr(x, "layout", None), getattr(x, "padding", None))
    return None


def _hooks_installed() -> bool:
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def fast_path_applies(kernel) -> bool:
    """Whether launch() may bypass Triton's dispatch for this kernel: a JIT-compiled (not
    interpreted) kernel on a GPU, no launch hooks."""
    return not configs.INTERPRETING and isinstance(kernel, JITFunction) and not _hooks_installed()


_CONSTEXPR_POSITIONS: dict = {}


def _constexpr_positions(kernel) -> tuple[bool, ...]:
    """Per parameter of the kernel, in order: whether it is a constexpr (keyed by its value)."""
    flags = _CONSTEXPR_POSITIONS.get(kernel)
    if flags is None:
        flags = _CONSTEXPR_POSITIONS[kernel] = tuple(bool(p.is_constexpr) for p in kernel.params)
    return flags


_SAME_DEVICE = contextlib.nullcontext()


def on_device(t: torch.Tensor):
    """A context that makes t's GPU the current device for a launch (nothing to do, and no host
    time spent switching, when it already is, or for a CPU tensor)."""
    if not t.is_cuda or t.device.index in (None, torch.cuda.current_device()):
        return _SAME_DEVICE
    return torch.cuda.device(t.device)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), on the current CUDA device and stream (on_device(t) makes
    a tensor's device the current one)."""
    return _launch(kernel, grid, args, kwargs)[0]


def _launch(kernel, grid, args, kwargs):
    """launch()'s work: (what the launch returns, and where it took the fast path (compiled,
    the trailing values the keyword arguments and defaults give, device), else None)."""
    if not fast_path_applies(kernel):
        return kernel[grid](*args, **kwargs), None
    constexpr = _constexpr_positions(kernel)
    classes = tuple([("c", a) if c else _arg_class(a) for a, c in zip(args, constexpr)])
    if len(args) > len(constexpr) or None in classes or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return kernel[grid](*args, **kwargs), None
    device = torch.cuda.current_device()
    key = (kernel, device, classes, tuple(kwargs.items()))
    try:
        hit = _COMPILED.get(key)
    except TypeError:  # an unhashable keyword value
        return kernel[grid](*args, **kwargs), None
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "function") and getattr(compiled, "run", None) is not None:
            names = list(kernel.signature.parameters)
            defaults = {n: p.default for n, p in kernel.signature.parameters.items()}
            if len(_COMPILED) >= _KEPT:
                _COMPILED.pop(next(iter(_COMPILED)))
            _COMPILED[key] = (compiled, names[len(args) :], defaults)
        return compiled, None
    compiled, rest, defaults = hit
    tail = tuple(kwargs[n] if n in kwargs else defaults[n] for n in rest)
    _run(compiled, device, grid, (*args, *tail))
    return compiled, (compiled, tail, device)


def _run(compiled, device: int, grid, values) -> None:
    """The compiled kernel's own launcher on `device`'s current stream (its C function directly
    where DirectLaunch can stand in for triton's Python around it)."""
    g0, g1, g2 = (*grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream(device)
    direct = _direct_launch(compiled)
    if direct is None:
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)
    else:
        direct(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, values)


class DirectLaunch:
    """What triton 3.6's CUDA launcher (backends/nvidia/driver.py: CudaLauncher.__call__ and
    the wrap_handle_tensordesc around its C function) does per launch without hooks or scratch
    memory, with its per-argument Python done once: the tensor descriptors' positions and TMA
    metadata are read from the launcher when it is first met, so a launch slices the values
    between descriptors and encodes each descriptor's TMA map with the same driver call, where
    triton loops over every value and looks each descriptor's metadata up again (the host
    time: benchmarks/launch_python.py). `of(launcher)` is None for anything else (another
    triton, another backend, a kernel with scratch memory): the launcher itself runs those."""

    __slots__ = ("_launch", "_coop", "_pdl", "_descriptors")

    def __init__(self, launch, coop, pdl, descriptors):
        self._launch, self._coop, self._pdl = launch, coop, pdl
        self._descriptors = descriptors  # ((position among the values, expand), ...) in order

    @classmethod
    def of(cls, run) -> DirectLaunch | None:
        try:
            from triton.backends.nvidia import driver as nvidia
        except ImportError:
            return None
        if type(run) is not getattr(nvidia, "CudaLauncher", None) or getattr(nvidia, "_BASE_ARGS_FORMAT_LEN", 0) != 13:
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None  # triton allocates those per launch
        launch, positions, metas = run.launch, (), ()
        code = getattr(launch, "__code__", None)
        if code is not None:  # wrap_handle_tensordesc's closure around the C function
            if getattr(launch, "__qualname__", "") != "wrap_handle_tensordesc.<locals>.inner":
                return None
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
            if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
                return None
            launch, positions, metas = cells["launcher"], sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
            if len(metas) != len(positions):
                return None
        fill = _tma_encoder() if any(m is not None for m in metas) else None
        expanders = [_descriptor_expander(m, fill, nvidia.TMA_DTYPE_DEVICE_TO_HOST) for m in metas]
        return cls(launch, run.launch_cooperative_grid, run.launch_pdl, tuple(zip(positions, expanders)))

    def __call__(self, g0, g1, g2, stream, function, packed_metadata, values) -> None:
        # the launcher's fixed head: grid, stream, function, cooperative, PDL, the two scratch
        # buffers, packed metadata, launch metadata and the two hooks
        args = [g0, g1, g2, stream, function, self._coop, self._pdl, None, None, packed_metadata, None, None, None]
        start = 0
        for position, expand in self._descriptors:
            args += values[start:position]
            args += expand(values[position])
            start = position + 1
        args += values[start:]
        self._launch(*args)


def _tma_encoder():
    """The active driver's TMA map encoder, as triton's launcher calls it."""
    import triton

    return triton.runtime.driver.active.utils.fill_tma_descriptor


TMA_MAPS_KEPT = 64  # TMA maps kept per descriptor slot of a compiled kernel (_descriptor_expander)


def _descriptor_expander(meta, fill, tma_dtypes):
    """The values a host tensor descriptor becomes at a launch, as triton's
    make_tensordesc_arg builds them for this descriptor's metadata (None: no TMA map).

    The TMA maps are kept by what they encode besides the metadata (address, shape, strides,
    padding; at most TMA_MAPS_KEPT per descriptor slot): the map is a pure function of those,
    and the launch copies it into the kernel's parameters, so a tensor met again at the same
    address (a training loop's activations come back to the caching allocator's blocks) skips
    the driver's encoding."""
    if meta is None:
        return lambda d: (d.base, *d.shape, *d.strides, d.padding == "nan", *d.shape, *d.strides)
    swizzle, elem_size, block_size = meta["swizzle"], meta["elem_size"], meta["block_size"]
    elem_type, fp4_padded = tma_dtypes[meta["elem_type"]], meta["fp4_padded"]
    maps: dict = {}

    def expand(d):
        shape, strides = d.shape, d.strides
        if fp4_padded:
            shape = [*shape[:-1], shape[-1] * 2]
        padding = int(d.padding == "nan")
        key = (d.base.data_ptr(), padding, *shape, *strides)
        tma_map = maps.get(key)
        if tma_map is None:
            if len(maps) >= TMA_MAPS_KEPT:
                maps.clear()
            tma_map = fill(key[0], swizzle, elem_size, elem_type, block_size, shape, strides, padding)
            maps[key] = tma_map
        return (tma_map, *shape, *strides)

    return expand


_DIRECT: dict = {}  # id(compiled kernel) -> (the kernel, its DirectLaunch or None)


def _direct_launch(compiled) -> DirectLaunch | None:
    """The DirectLaunch of a compiled kernel, built once (None: its own launcher runs it)."""
    hit = _DIRECT.get(id(compiled))
    if hit is not None and hit[0] is compiled:
        return hit[1]
    direct = DirectLaunch.of(compiled.run)
    if len(_DIRECT) >= _KEPT:
        _DIRECT.pop(next(iter(_DIRECT)))
    _DIRECT[id(compiled)] = (compiled, direct)
    return direct


def launch_kept(kept, kernel, grid, args, kwargs):
    """kernel[grid](*args, **kwargs) through `kept` (a KeptLaunch, for a kept plan's launches)
    or, where it is None, launch()."""
    if kept is None:
        return launch(kernel, grid, *args, **kwargs)
    return kept(kernel, grid, args, kwargs)


class KeptLaunch:
    """The launches of one launch plan (plans.Plan), whose every argument follows from its
    signature, so that Triton specializes them all alike: once one took launch()'s fast path,
    the later ones call the compiled kernel directly, without classifying and hashing every
    argument again (~25 us of host time per launch of the Gluon forward's 33 arguments). Called
    as launch() is, with the plan's kernel, grid and keyword arguments each time."""

    __slots__ = ("_fast",)

    def __init__(self):
        self._fast = None  # (compiled, tail, device) of the first fast launch

    def __call__(self, kernel, grid, args, kwargs):
        fast = self._fast
        if fast is not None and fast_path_applies(kernel) and torch.cuda.current_device() == fast[2]:
            compiled, tail, device = fast
            _run(compiled, device, grid, (*args, *tail))
            return compiled
        result, self._fast = _launch(kernel, grid, args, kwargs)
        return result
