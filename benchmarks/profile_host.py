"""Host cost per call on one GPU (diagnostic): flash_attn_func forward and forward+backward at
--seq-lens (B=1, H=32, D=128 or --head-dim, causal, bf16), flash_attn_varlen_func forward+backward over many
short documents in 16K (benchmarks.packed's "short" mix), and one packed ring rank replayed
(benchmarks.packed_ring_replay: longtail documents in --ring-total over --ring-world ranks), each
as wall time per call, the device's busy time per call and a cProfile by self and by cumulative
time; the ring rank also under
torch.profiler: its kernels and how long each kind ran on the device.

    python -m benchmarks.profile_host > profile_host.log
    python -m benchmarks.profile_host --sections ring --ring-world 8 --ring-rank 3 --documents-backward fused
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import io
import pstats
import time
from unittest import mock

import numpy as np
import torch

import ringflash
from benchmarks.common import DOCUMENTS_BACKWARDS, documents_backward, host_seconds, in_rounds, kernel_times, step_fn
from benchmarks.packed import document_lengths
from benchmarks.packed_ring_replay import replay_rank


def per_call_us(fn, calls):
    return host_seconds(fn, "cuda", calls=calls, warmup=3) * 1e6


def device_us(fn, calls):
    """Microseconds per call the device spent in kernels and copies (torch.profiler)."""
    return sum(ms for _, _, ms in kernel_times(fn, "cuda", calls)) * 1e3 / calls


# (module or class path, attribute): the layers of a local call, outermost first
SPLIT_TARGETS = (
    ("ringflash.local", "_call_signature"),
    ("ringflash.ops", "flash"),
    ("ringflash.ops", "flash_eager"),
    ("ringflash.ops", "_flash_mask"),
    ("ringflash._checks", "cu_values"),
    ("ringflash.ops", "packed_bounds"),
    ("torch.autograd", "backward"),
    ("ringflash.local._FlashAttn", "forward"),
    ("ringflash.local._FlashAttn", "backward"),
    ("ringflash.local._CallPlan", "replay_forward"),
    ("ringflash.local._CallPlan", "backward"),
    ("ringflash.local", "_output_state"),
    ("ringflash.local", "_gradients"),
    ("ringflash.local", "backward_inputs"),
    ("ringflash.local", "output_grad"),
    ("ringflash.local", "block_forward"),
    ("ringflash.local", "block_backward"),
    ("ringflash.kernels", "forward"),
    ("ringflash.kernels", "backward"),
    ("ringflash.kernels", "delta"),
    ("ringflash.kernels", "fuses_backward"),
    ("ringflash.kernels.gluon_forward", "forward"),
    ("ringflash.kernels.gluon_forward", "check_supported"),
    ("ringflash.kernels.gluon_forward", "launch_plan"),
    ("ringflash.kernels.gluon_forward", "launch_planned"),
    ("ringflash.kernels.gluon_backward", "prepared_from"),
    ("ringflash.kernels.gluon_backward.Prepared", "launch"),
    ("ringflash.kernels.gluon_backward", "unblock_dq"),
    ("ringflash.kernels.plans.Plan", "args_for"),
    ("ringflash.kernels.launcher.KeptLaunch", "__call__"),
    ("ringflash.kernels.gluon_backward", "backward"),
    ("ringflash.kernels.gluon_backward", "check_supported"),
    ("ringflash.kernels.gluon_backward", "row_stats"),
    ("ringflash.kernels.gluon_backward", "launch_row_stats"),
    ("ringflash.kernels.gluon_backward", "dq_buffer"),
    ("ringflash.kernels.gluon_backward", "launch_plan"),
    ("triton.runtime.jit.JITFunction", "run"),
    ("triton.backends.nvidia.driver.CudaLauncher", "__call__"),
)


def _owner(path):
    """The module or class a dotted path names."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


@contextlib.contextmanager
def inclusive_timers(targets=SPLIT_TARGETS):
    """Wrap each (owner path, attribute) in a wall-clock timer; yields {label: [calls, seconds]}
    (inclusive: a layer's time holds the layers it calls). The originals are restored after."""
    totals, restore = {}, []
    for path, attr in targets:
        owner = _owner(path)
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        if raw is None:
            continue
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        label = f"{path.rsplit('.', 1)[-1]}.{attr}"
        slot = totals.setdefault(label, [0, 0.0])

        def timed(*args, _fn=fn, _slot=slot, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _slot[0] += 1
                _slot[1] += time.perf_counter() - t0

        functools.update_wrapper(timed, fn)
        setattr(owner, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        restore.append((owner, attr, raw))
    try:
        yield totals
    finally:
        for owner, attr, raw in reversed(restore):
            setattr(owner, attr, raw)


def split(name, fn, calls):
    """Inclusive microseconds per call of each layer SPLIT_TARGETS names, beside the call's
    wall time (measured without the timers)."""
    wall = per_call_us(fn, calls)
    with inclusive_timers() as totals:
        fn()  # warm the wrapped path
        for slot in totals.values():
            slot[:] = [0, 0.0]
        timed_wall = per_call_us(fn, calls)  # its warmup calls count too: divide by what ran
        runs = calls + 3
    print(f"{name}: {wall:.1f} us per call ({timed_wall:.1f} with the timers)", flush=True)
    for label, (n, seconds) in totals.items():
        if n:
            print(f"    {label:40s} {n / runs:5.2f} calls {seconds / runs * 1e6:8.1f} us", flush=True)


def report(name, fn, calls, lines, split_only=False):
    if split_only:
        return split(name, fn, calls)
    print(
        f"{name}: {per_call_us(fn, calls):.1f} us per call, {device_us(fn, calls):.1f} us of it on the device",
        flush=True,
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
        print(text.getvalue(), flush=True)


def local_calls(seq_lens, head_dim=128):
    for S in seq_lens:
        q, k, v, do = (torch.randn(1, S, 32, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd(q=q, k=k, v=v):
            with torch.no_grad():
                ringflash.flash_attn_func(q, k, v, causal=True)

        # as bench_local times it (benchmarks.common.step_fn): out.backward(do), gradients taken
        # rather than added to, no reduction of the output and its backward in the profile
        train = step_fn(lambda qg=qg, kg=kg, vg=vg: ringflash.flash_attn_func(qg, kg, vg, causal=True),
                        (qg, kg, vg), do, "fwd+bwd")  # fmt: skip

        yield f"flash_attn_func S={S} D={head_dim} no_grad", fwd
        yield f"flash_attn_func S={S} D={head_dim} fwd+bwd", train


def packed_call():
    T = 16384
    lengths = document_lengths("short", T, 0)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    train = step_fn(lambda: ringflash.flash_attn_varlen_func(q, k, v, cu, cu, causal=True), (q, k, v),
                    torch.randn_like(q), "fwd+bwd")  # fmt: skip

    yield f"flash_attn_varlen_func {len(lengths)} short docs in 16K fwd+bwd", train


def ring_rank(total, world, rank):
    lengths = document_lengths("longtail", total, 0)
    cu_list = [0, *np.cumsum(lengths).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    Q, K, V, DO = (torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    layout = ringflash.balanced_layout(cu_list, world, causal=True)
    run = replay_rank(Q, K, V, DO, cu, layout, rank, world, (-1, -1), overlap=True)
    run()
    kernels = kernel_times(run, "cuda")
    print(
        f"ring rank {rank} of {world} ({total} tokens): {sum(ms for _, _, ms in kernels):.2f} ms on the device: "
        + ", ".join(f"{name[:40]} x{n} {ms:.2f}ms" for name, n, ms in kernels[:10]),
        flush=True,
    )
    yield f"ring rank {rank} of {world} replayed fwd+bwd", run


def launch_layers(S=128):
    """The Gluon forward's launch taken apart at S tokens (B=1, H=32, D=128, causal, bf16): the
    public call, the launcher with its checks, Triton's JIT dispatch of a precomputed launch,
    its argument binder alone, the compiled kernel's own launcher (TMA descriptors encoded
    there), and floors: one torch op, an empty Triton kernel, SDPA's flash forward."""
    import triton
    from triton.runtime.driver import driver

    from ringflash.kernels import gluon_forward
    from ringflash.merge import SoftmaxState

    @triton.jit
    def _noop(x):
        pass

    q, k, v = (torch.randn(1, S, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    state = SoftmaxState.empty(torch.empty_like(q))
    plan = dict(q_start=0, k_start=0, scale=128**-0.5, out_o=state.o, out_m=state.m, out_l=state.l,
                normalize=True, fold=False, causal=True)  # fmt: skip
    cfg = gluon_forward.config_for(128)
    kernel, grid, args, kwargs = gluon_forward.launch_plan(q, k, v, cfg=cfg, **plan)
    compiled = kernel[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    binder = kernel.device_caches[device][-1]
    bound = tuple(binder(*args, **kwargs)[0].values())
    stream = driver.active.get_current_stream(device)
    g = (*grid, 1)[:3]

    def direct():
        compiled.run(*g, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound)

    with torch.no_grad():
        yield "flash_attn_func fwd", lambda: ringflash.flash_attn_func(q, k, v, causal=True)
        yield "gluon_forward.forward", lambda: gluon_forward.forward(q, k, v, config=cfg, **plan)
        yield "launch_plan alone", lambda: gluon_forward.launch_plan(q, k, v, cfg=cfg, **plan)
        yield "kernel[grid] (JIT dispatch)", lambda: kernel[grid](*args, **kwargs)
        yield "binder alone", lambda: binder(*args, **kwargs)
        yield "compiled.run (launcher)", direct
        yield "one torch op (q.add(1))", lambda: q.add(1)
        yield "empty Triton kernel[grid]", lambda: _noop[(1,)](q)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def sdpa():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        yield "sdpa flash fwd", sdpa


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sections", nargs="+", default=["local", "packed", "ring"], choices=["local", "packed", "ring", "launch"]
    )
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--head-dim", type=int, default=128, help="the local calls' head dim")
    ap.add_argument("--ring-total", type=int, default=131072)
    ap.add_argument("--ring-world", type=int, default=4)
    ap.add_argument("--ring-rank", type=int, default=0)
    ap.add_argument(
        "--documents-backward",
        default="default",
        choices=DOCUMENTS_BACKWARDS,
        help="packed documents' backward: as configured, the fused Gluon kernel where it runs, or the two passes",
    )
    ap.add_argument("--calls", type=int, default=100, help="calls per timing and per profile (the ring: a tenth)")
    ap.add_argument("--lines", type=int, default=30, help="cProfile lines per ordering")
    ap.add_argument("--split", action="store_true", help="inclusive timers per layer instead of cProfile")
    ap.add_argument(
        "--plain-launch",
        action="store_true",
        help="kept launch plans launch through launcher.launch (keyed per call) instead of their KeptLaunch",
    )
    ap.add_argument(
        "--compare-plain-launch",
        type=int,
        metavar="ROUNDS",
        help="instead of the report: each call's host time per call with kept launches and with --plain-launch, "
        "alternating over ROUNDS rounds of --calls calls (the order swapped every round), medians",
    )
    args = ap.parse_args()
    plain = plain_launch() if args.plain_launch else contextlib.nullcontext()
    with documents_backward(args.documents_backward), plain:
        for section in args.sections:
            if section == "launch":
                for name, fn in launch_layers():
                    print(f"{name:32s} {per_call_us(fn, args.calls):8.1f} us per call", flush=True)
                continue
            if section == "local":
                calls = [(c, args.calls) for c in local_calls(args.seq_lens, args.head_dim)]
            elif section == "packed":
                calls = [(c, args.calls) for c in packed_call()]
            else:
                calls = [
                    (c, max(args.calls // 10, 1)) for c in ring_rank(args.ring_total, args.ring_world, args.ring_rank)
                ]
            for (name, fn), n in calls:
                if args.compare_plain_launch:
                    compare_plain_launch(name, fn, n, args.compare_plain_launch)
                else:
                    report(name, fn, n, args.lines, args.split)


def plain_launch():
    """A context in which kept launch plans launch through launcher.launch, as before KeptLaunch."""
    from ringflash.kernels import launcher

    return mock.patch.object(
        launcher.KeptLaunch, "__call__", lambda self, kernel, grid, a, kw: launcher.launch(kernel, grid, *a, **kw)
    )


def compare_plain_launch(name, fn, calls, rounds):
    """Host time per call of fn with kept launches and with plain ones, alternating in one
    process (the host's speed drifts between processes and machine starts by more than the
    difference): medians over the rounds, and their ratio."""
    times = {"kept": [], "plain": []}
    arms = {"kept": contextlib.nullcontext, "plain": plain_launch}
    for _, arm in in_rounds(("kept", "plain"), rounds):
        with arms[arm]():
            times[arm].append(per_call_us(fn, calls))
    kept, plain = (float(np.median(times[a])) for a in ("kept", "plain"))
    print(
        f"{name}: kept {kept:.1f} us, plain {plain:.1f} us per call (medians of {rounds}); "
        f"kept / plain {kept / plain:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
