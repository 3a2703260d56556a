"""Host Python per launch of the Gluon kernels: triton's CUDA launcher against the package's
DirectLaunch (kernels/launcher.py), on any machine.

Compiles the Gluon forward and backward of one call for sm_90a on the CPU (as the compile
reports do), builds triton's CudaLauncher for each compiled kernel with its own signature and
TMA metadata, the C launch function and the TMA encoder stood in by no-op Python functions
(both paths call each equally often), and times a launch of each path in alternating rounds.
What it measures is the Python each path runs around the C function, on this host; the whole
call's host time on a GPU is benchmarks/host_overhead.py's.

    python -m benchmarks.launch_python [--seqlen 4096] [--head-dim 64] [--launches 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types

import torch

from ringflash.kernels import gluon_backward as gb
from ringflash.kernels import gluon_forward as gf
from ringflash.kernels import launcher


def _values(kernel, args, kwargs) -> tuple:
    """Every parameter's value in order, as launch() passes them to the compiled kernel."""
    params = kernel.signature.parameters
    rest = list(params)[len(args) :]
    return (*args, *(kwargs[n] if n in kwargs else params[n].default for n in rest))


def _plans(seqlen: int, head_dim: int, causal: bool):
    """(name, kernel, grid, args, kwargs) of the forward and the fused backward of one call
    (B=1, 32 heads, bf16) on zero CPU tensors."""
    B, H = 1, 32
    q = torch.zeros(B, seqlen, H, head_dim, dtype=torch.bfloat16)
    m = torch.zeros(B, H, seqlen)
    fwd = gf.launch_plan(
        q, q.clone(), q.clone(), q_start=0, k_start=0, scale=0.1, out_o=torch.zeros_like(q), out_m=m,
        out_l=m.clone(), normalize=True, fold=False, cfg=gf.config_for(head_dim), causal=causal,
    )  # fmt: skip
    grads = (torch.zeros(q.shape), torch.zeros(q.shape), torch.zeros(q.shape))
    bwd = gb.launch_plan(
        q, q.clone(), q.clone(), torch.zeros(B, H, 2, seqlen), q.clone(), *grads, q_start=0, k_start=0, scale=0.1,
        accumulate=False, cfg=gb.config_for(head_dim), causal=causal,
    )  # fmt: skip
    return [("forward", *fwd), ("backward", *bwd)]


def _cuda_launcher(nvidia, compiled, launch):
    """triton's CudaLauncher for `compiled` as its __init__ builds it, `launch` in place of the
    C module (which needs a CUDA toolkit and a driver)."""
    run = object.__new__(nvidia.CudaLauncher)
    run.num_ctas = getattr(compiled.metadata, "num_ctas", 1)
    signature = dict(compiled.src.signature.items())
    run.launch = nvidia.wrap_handle_tensordesc(launch, signature, getattr(compiled.metadata, "tensordesc_meta", None))
    for name in ("global_scratch_size", "global_scratch_align", "profile_scratch_size", "profile_scratch_align"):
        setattr(run, name, getattr(compiled.metadata, name))
    run.launch_cooperative_grid = compiled.metadata.launch_cooperative_grid
    run.launch_pdl = compiled.metadata.launch_pdl
    return run


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--launches", type=int, default=20000, help="launches a timed round")
    p.add_argument("--rounds", type=int, default=7, help="rounds a path, alternating")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import triton
    from triton.backends.nvidia import driver as nvidia

    def c_launch(*args):  # the C function's stand-in
        return None

    def encode(*args):  # the TMA encoder's stand-in
        return None

    rows = []
    for name, kernel, grid, args, kwargs in _plans(a.seqlen, a.head_dim, causal=True):
        compiled = gf.compile_plan(kernel, args, kwargs)
        values = _values(kernel, args, kwargs)
        utils = types.SimpleNamespace(fill_tma_descriptor=encode)
        saved = triton.runtime.driver._active
        triton.runtime.driver.set_active(types.SimpleNamespace(utils=utils))
        saved_encoder = launcher._tma_encoder
        launcher._tma_encoder = lambda: encode
        try:
            run = _cuda_launcher(nvidia, compiled, c_launch)
            direct = launcher.DirectLaunch.of(run)
            if direct is None:
                raise SystemExit(f"{name}: DirectLaunch does not stand in for this triton's launcher")
            g0, g1, g2 = (*grid, 1, 1)[:3]

            def theirs():
                for _ in range(a.launches):
                    run(g0, g1, g2, 0, "fn", "meta", None, None, None, *values)

            def ours():
                for _ in range(a.launches):
                    direct(g0, g1, g2, 0, "fn", "meta", values)

            times = {"triton": [], "direct": []}
            for _ in range(a.rounds):
                for path, fn in (("triton", theirs), ("direct", ours)):
                    t = time.perf_counter()
                    fn()
                    times[path].append((time.perf_counter() - t) / a.launches * 1e6)
        finally:
            triton.runtime.driver._active = saved
            launcher._tma_encoder = saved_encoder
        descriptors = sum(str(s).startswith("tensordesc") for s in compiled.src.signature.values())
        tri, dirl = statistics.median(times["triton"]), statistics.median(times["direct"])
        rows.append(
            dict(kernel=name, values=len(values), descriptors=descriptors, triton_us=tri, direct_us=dirl,
                 saved_us=tri - dirl, rounds=times)
        )  # fmt: skip
    print(f"Python around the C launch, per launch (median of {a.rounds} rounds of {a.launches}; this host)")
    print(f"{'kernel':<10} {'values':>6} {'descs':>5} {'triton us':>10} {'direct us':>10} {'saved us':>9}")
    for r in rows:
        print(
            f"{r['kernel']:<10} {r['values']:>6} {r['descriptors']:>5} {r['triton_us']:>10.2f} {r['direct_us']:>10.2f}"
            f" {r['saved_us']:>9.2f}"
        )
    result = dict(seqlen=a.seqlen, head_dim=a.head_dim, triton=triton.__version__, rows=rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
