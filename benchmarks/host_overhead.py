"""Host time per call of the local attention, layer by layer, on one device.

    python -m benchmarks.host_overhead --json benchmarks/results/host_overhead_h200.json
    python -m benchmarks.host_overhead --smoke          # tiny CPU run (CI keeps it working)
    python -m benchmarks.host_overhead --hybrid         # also the rows of a call with a head_group

At short sequences a call's time is the host's: checks, dispatch, launches. For each S (B=1,
H=32, D=128, causal, bf16 on a GPU) this times --calls calls in a row on the host clock (one
synchronize at the end), forward without gradients and forward+backward, of
  public     ringflash.flash_attn_func (eager: the autograd Function, no operator dispatch)
  operator   torch.ops.ringflash.flash_fwd with its registered autograd (what torch.compile
             traces; eager calls went through it before)
  ring       ringflash.ring_flash_attn_func on one rank (no process group; eager: ring._RingAttn,
             no operator dispatch)
  ring_op    the same call through torch.ops.ringflash.ring_fwd and its registered autograd
             (what torch.compile traces; eager ring calls went through it before)
  hybrid     (--hybrid) ringflash.ring_flash_attn_func with a head_group on a 1 x 1 grid of a
             one-rank process group started here (eager: hybrid._HybridAttn, no operator
             dispatch); its head all-to-alls run, over the one rank. The ring rows then run on
             that default group of one rank
  hybrid_op  the same call through torch.ops.ringflash.hybrid_fwd and its registered autograd
             (what torch.compile traces; eager calls with a head_group went through it before)
  backend    the backend's forward alone (ringflash.local.block_forward; forward only)
  kernels    the same kernels through ringflash.kernels.forward / .backward in a bare autograd
             Function (GPU): what the layers above the backend cost is public's time less this
  gluon      the same Gluon launches through gluon_forward.forward / gluon_backward.backward
             directly (GPU): what the backend's routing costs is kernels' time less this
  bare       a bare autograd Function that allocates what the call allocates (output, row
             statistics, three gradients) and launches nothing: the floor of an eager call
  sdpa       torch's scaled_dot_product_attention, FLASH_ATTENTION backend, on (B, H, S, D)
  sdpa_cudnn the same, CUDNN_ATTENTION backend
  compiled   (--compiled) torch.compile of the public call (inductor on a GPU, aot_eager on
             the CPU): what a compiled model pays a call, the operators inside its graph
and prints microseconds per call. --baseline DIR adds an older package's public call, operator
(and with --compiled its compiled call) to the rotation (a copy of its package directory, as
benchmarks.compare_versions takes it; its operators register under its own namespace). --host-only
stops each timing's clock when the host has issued its calls, before the device has run them:
the host's own time even where the device's is longer (at most a few hundred launches are
queued, far below the driver's queue).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import ringflash
from benchmarks.common import bench_device, device_name, host_seconds, result_meta, write_json
from benchmarks.compare_versions import load_baseline
from ringflash import ops
from ringflash.local import block_forward
from ringflash.masks import CAUSAL, BlockMask
from ringflash.merge import DeltaOf, SoftmaxState


def per_call_us(fn, calls, device, host_only=False):
    """Microseconds per call of `calls` calls of fn() in a row, after two warm-up calls
    (common.host_seconds: the device drained before and after, or with host_only the host's
    time alone)."""
    return host_seconds(fn, device, calls=calls, warmup=2, host_only=host_only) * 1e6


class _Kernels(torch.autograd.Function):
    """Causal attention through ringflash.kernels.forward / .backward alone."""

    @staticmethod
    def forward(ctx, q, k, v):
        from ringflash import kernels

        state = SoftmaxState.empty(torch.empty_like(q))
        kernels.forward(q, k, v, state, q_start=0, k_start=0, window=CAUSAL, bounds=None,
                        scale=q.shape[-1] ** -0.5, fold=False, normalize=True)  # fmt: skip
        ctx.save_for_backward(q, k, v, *state)
        return state.o

    @staticmethod
    def backward(ctx, do):
        from ringflash import kernels

        q, k, v, out, m, l = ctx.saved_tensors
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        kernels.backward(q, k, v, m, l, do, DeltaOf(out, None), dq, dk, dv, q_start=0, k_start=0, window=CAUSAL,
                         bounds=None, scale=q.shape[-1] ** -0.5, accumulate=False)  # fmt: skip
        return dq, dk, dv


class _Gluon(torch.autograd.Function):
    """Causal attention through gluon_forward.forward / gluon_backward.backward alone, with the
    variants the package chooses for these shapes."""

    @staticmethod
    def forward(ctx, q, k, v):
        from ringflash.kernels import _block_d, configs, gluon_forward

        out, m, l = SoftmaxState.empty(torch.empty_like(q))
        variant = configs.gluon_forward_variant(_block_d(q.shape[-1]), keys=k.shape[1], causal=True)
        gluon_forward.forward(q, k, v, q_start=0, k_start=0, scale=q.shape[-1] ** -0.5, out_o=out, out_m=m, out_l=l,
                              normalize=True, fold=False, window=CAUSAL, config=variant)  # fmt: skip
        ctx.save_for_backward(q, k, v, out, m, l)
        return out

    @staticmethod
    def backward(ctx, do):
        from ringflash.kernels import _block_d, configs, gluon_backward

        q, k, v, out, m, l = ctx.saved_tensors
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        gluon_backward.backward(q, k, v, m, l, do, DeltaOf(out, None), dq, dk, dv, q_start=0, k_start=0,
                                causal=False, window=(None, 0), scale=q.shape[-1] ** -0.5, accumulate=False,
                                config=configs.gluon_backward_variant(_block_d(q.shape[-1])))  # fmt: skip
        return dq, dk, dv


class _Bare(torch.autograd.Function):
    """What an eager call allocates and saves, and no launch."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, m, l = SoftmaxState.empty(torch.empty_like(q))
        ctx.save_for_backward(q, k, v, out, m, l)
        return out

    @staticmethod
    def backward(ctx, do):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])


def one_rank_grid():
    """(ring group, head group) of a 1 x 1 grid for the hybrid rows: the default group, started
    here with one rank (torch's default backend per device) when none is, and a group of rank 0."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD, dist.new_group([0])


def callables(S, args, device, dtype, grid=None):
    """{row: {mode: fn}}; grid: one_rank_grid()'s groups for the hybrid rows, or None."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (1, S, args.heads, args.head_dim)
    q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    scale = args.head_dim**-0.5
    backend = ringflash.local.backend_name(device)

    def public():
        return ringflash.flash_attn_func(q, k, v, causal=True)

    def operator():
        return ops.flash_fwd(q, k, v, None, None, None, 0, 0, -1, 0, scale, 0.0, None, backend, False, -1, -1)[0]

    def ring():
        return ringflash.ring_flash_attn_func(q, k, v, causal=True)

    def through_operator(call, entry: str, operator):
        """call() with ops.<entry> (the eager path's entry) replaced by its operator's forward
        (out, lse): the same call through the operator's dispatch (and so its backward)."""
        eager = getattr(ops, entry)

        def run():
            setattr(ops, entry, lambda *a: operator(*a)[:2])
            try:
                return call()
            finally:
                setattr(ops, entry, eager)

        return run

    ring_op = through_operator(ring, "ring", ops.ring_fwd)
    fns = {"public": public, "operator": operator, "ring": ring, "ring_op": ring_op}
    if grid is not None:
        group, head_group = grid

        def hybrid():
            return ringflash.ring_flash_attn_func(q, k, v, causal=True, group=group, head_group=head_group)

        fns |= {"hybrid": hybrid, "hybrid_op": through_operator(hybrid, "hybrid", ops.hybrid_fwd)}
    compiler = "inductor" if device.type == "cuda" else "aot_eager"
    if args.compiled:
        fns["compiled"] = torch.compile(public, fullgraph=True, backend=compiler)
    if args.baseline:  # an older package's calls, in the same rotation
        before = load_baseline(args.baseline, args.baseline_name)

        def public_before():
            return before.flash_attn_func(q, k, v, causal=True)

        fns[f"public ({args.baseline_name})"] = public_before
        fns[f"operator ({args.baseline_name})"] = lambda: before.ops.flash_fwd(
            q, k, v, None, None, None, 0, 0, -1, 0, scale, 0.0, None, backend, False, -1, -1
        )[0]
        if args.compiled:
            fns[f"compiled ({args.baseline_name})"] = torch.compile(public_before, fullgraph=True, backend=compiler)
    if device.type == "cuda":
        fns["kernels"] = lambda: _Kernels.apply(q, k, v)
        fns["gluon"] = lambda: _Gluon.apply(q, k, v)
        with torch.no_grad():  # the rows time the same kernels: their outputs are the public call's
            expected = public()
            for name in ("kernels", "gluon"):
                if not torch.equal(fns[name](), expected):
                    raise RuntimeError(f"the {name} row's output differs from flash_attn_func's")
    fns["bare"] = lambda: _Bare.apply(q, k, v)
    if device.type == "cuda":
        bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        do_bhsd = do.transpose(1, 2).contiguous()

        def sdpa(backend):
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*bhsd, is_causal=True)

        fns["sdpa"] = lambda: sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        fns["sdpa_cudnn"] = lambda: sdpa(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)
    rows = {}
    for name, fn in fns.items():
        inputs, grad_do = (bhsd, do_bhsd) if name.startswith("sdpa") else ((q, k, v), do)

        def fwd(fn=fn):
            with torch.no_grad():
                fn()

        def fwd_bwd(fn=fn, inputs=inputs, grad_do=grad_do):
            for t in inputs:  # as benchmarks.common.step_fn: gradients taken, not added to
                t.grad = None
            fn().backward(grad_do)

        rows[name] = {"fwd": fwd, "fwd+bwd": fwd_bwd}
    qd, kd, vd = (t.detach() for t in (q, k, v))

    def backend_only():
        state = SoftmaxState.empty(torch.empty_like(qd))
        block_forward(qd, kd, vd, state, BlockMask(0, 0, CAUSAL), scale=scale, fold=False, normalize=True)

    rows["backend"] = {"fwd": backend_only}
    return rows


def timed_in_rotation(fns, repeats, calls, device, host_only):
    """{name: {mode: [microseconds per call, one per repeat]}} of fns {name: {mode: fn}}, every
    fn timed once per repeat, the order rotated from repeat to repeat: a drift of the host's speed
    (which moves by tens of percent between timings) falls on every row alike."""
    order = [(name, mode) for name, modes in fns.items() for mode in modes]
    times = {name: {mode: [] for mode in modes} for name, modes in fns.items()}
    for r in range(repeats):
        for name, mode in order[r % len(order) :] + order[: r % len(order)]:
            times[name][mode].append(per_call_us(fns[name][mode], calls, device, host_only))
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5, help="timings of each row, in rotation (median and range)")
    ap.add_argument("--host-only", action="store_true", help="the host's time alone (see the module docstring)")
    ap.add_argument("--baseline", type=Path, help="a folder holding an older package directory (compare_versions)")
    ap.add_argument("--baseline-name", default="ringflash_before")
    ap.add_argument("--compiled", action="store_true", help="also the public call under torch.compile")
    ap.add_argument("--hybrid", action="store_true", help="also the rows hybrid and hybrid_op (a one-rank grid)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes")
    args = ap.parse_args()
    device, dtype = bench_device(args.smoke)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.calls, args.repeats = [16], 2, 16, 3, 2
    grid = one_rank_grid() if args.hybrid else None
    out = []
    clock = "the host's own" if args.host_only else "wall, device drained"
    print(f"host time per call (us, {clock}) on {device_name(device)}: B=1, H={args.heads}, D={args.head_dim}, "
          f"causal, {dtype}")  # fmt: skip
    print(f"median (min-max) of {args.repeats} timings in rotation, {args.calls} calls each")
    for S in args.seqlens:
        fns = callables(S, args, device, dtype, grid)
        times = timed_in_rotation(fns, args.repeats, args.calls, device, args.host_only)
        for name, modes in times.items():
            row = {"seq_len": S, "impl": name}
            for m, ts in modes.items():
                row[f"{m}_us"], row[f"{m}_us_all"] = statistics.median(ts), ts
            out.append(row)
            cells = "  ".join(
                f"{m} {statistics.median(ts):7.1f} ({min(ts):.0f}-{max(ts):.0f})" for m, ts in modes.items()
            )
            print(f"S={S:>6} {name:>10}: {cells}", flush=True)
    if args.json:
        write_json(args.json, {"meta": result_meta(device), "rows": out})


if __name__ == "__main__":
    main()
