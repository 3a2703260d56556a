"""Check and time the Gluon forward (ringflash/kernels/gluon_forward.py) on one Hopper GPU.

    PYTHONPATH=. python3 benchmarks/gluon_check.py --json gluon_check.json
    PYTHONPATH=. python3 benchmarks/gluon_check.py --quick --json q.json          # S=16K, fewer cases
    PYTHONPATH=. python3 benchmarks/gluon_check.py --variants ws ws_s3 --seqlens 16384 --head-dims 128

1. Compile report per variant (CPU side: registers, spills, shared memory, wgmma waits).
2. Correctness against float64 on fresh random inputs, outputs poisoned with NaN first: ragged
   shapes (1031, 777x2048, ...), causal and not, GQA 4/1 and 8/2, bf16 and fp16, D=64/128 (any
   head dim a variant runs with --head-dims, e.g. 96 and 192 in two pieces),
   positions far from 0, rows and tiles that see no key, strided views, and the ring-step
   (fold) mode against an unsplit run. PASS needs every error <= 2x the error of the plain
   same-dtype torch attention against float64 (with a floor of a few float32 ulps), no NaN,
   and exact (0, -inf, 0) for rows that see no key.
3. Timing beside SDPA (cuDNN and flash backends) and the package's Triton kernel, B=1, H=32,
   triton.testing.do_bench medians, TFLOP/s = 4*B*H*S*S*D (half for causal). Only variants
   that passed correctness are timed; each timed output is also compared with the Triton
   kernel's at that shape. --rounds N times each shape N times, the order reversed every other
   round: the table then gives medians, and a last one each variant's TFLOP/s over the first
   variant's in the same round (median, min-max).

Every case runs in a child process watched with a timeout (--case-timeout): a hung kernel
is killed and recorded as HANG (the rest of that variant is skipped), a crash as CRASH, and
the run moves on. --deadline stops starting new work after that many seconds. Results are
written to --json after every case; the summary table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import in_rounds  # noqa: E402  (gluon_bwd_check's rounds too)

START, RESULT = "@@START ", "@@RESULT "
F32_EPS = 2.0**-23

# ----------------------------------------------------------------------------------------------
# Cases


def has_config(variant: str, D: int) -> bool:
    """Whether the variant runs head dim D (its own entry, its tile widths' or its padding's)."""
    from ringflash.kernels import gluon_forward as gf

    try:
        gf.config_for(D, variant)
    except gf.Unsupported:
        return False
    return True


def correctness_cases(variant: str, lite: bool, head_dims) -> list[dict]:
    """Correctness cases for one variant; `lite` keeps a smaller set (bf16 only)."""
    shapes = [  # (B, Sq, Sk, Hq, Hkv, D)
        (2, 1031, 1031, 4, 1, 128),
        (1, 777, 2048, 8, 2, 128),
        (1, 2048, 777, 4, 4, 128),  # Sq > Sk: bottom-right causal leaves whole tiles empty
        (2, 1031, 1031, 4, 1, 64),
        (1, 777, 2048, 8, 2, 64),
        (1, 128, 256, 2, 2, 64),  # exact tiles
        (1, 1, 300, 2, 1, 128),  # one query row
        (1, 1031, 1031, 4, 2, 256),  # D=256: only with --head-dims ... 256
        (1, 777, 2048, 4, 1, 256),
        (2, 1031, 1031, 4, 1, 96),  # head dims in two pieces (64 + 32, 128 + 64): with --head-dims 96 192
        (1, 777, 2048, 8, 2, 192),
    ]
    dtypes = ["bf16"] if lite else ["bf16", "fp16"]
    cases = []

    from ringflash.kernels import gluon_forward as gf

    def add(**kw):
        if kw["D"] in head_dims and has_config(variant, kw["D"]):
            kw.setdefault("mode", "local")
            kw.setdefault("scale", kw["D"] ** -0.5)
            kw.setdefault("layout", "bshd")
            kw["variant"] = variant
            kw["schedule"] = gf.config_for(kw["D"], variant).schedule
            kw["id"] = f"{variant}:{len(cases)}"
            cases.append(kw)

    for B, Sq, Sk, Hq, Hkv, D in shapes if not lite else shapes[:2] + shapes[3:5] + shapes[7:8] + shapes[9:]:
        for causal in (False, True):
            for dt in dtypes:
                add(
                    B=B,
                    Sq=Sq,
                    Sk=Sk,
                    Hq=Hq,
                    Hkv=Hkv,
                    D=D,
                    causal=causal,
                    dtype=dt,
                    q_start=Sk - Sq if causal else 0,
                    k_start=0,
                )
    # per head dim, one case per property: (B, Sq, Sk, Hq, Hkv, D, causal, dtype, q_start, k_start), extras
    cols = ("B", "Sq", "Sk", "Hq", "Hkv", "D", "causal", "dtype", "q_start", "k_start")
    far = 10**6
    for D in sorted(set(head_dims)):
        table = [
            # positions far from 0 (bottom-right alignment shifted by 10^6)
            ((1, 777, 2048, 4, 2, D, True, "bf16", far + 2048 - 777, far), {}),
            # rows 0..299 see no key; the first query tiles are skipped entirely
            ((1, 1031, 777, 4, 1, D, True, "bf16", 0, 300), {}),
            # ring-step fold: two key blocks (ragged cut), and the later block first (incoming empty rows)
            ((2, 1031, 1031, 4, 2, D, True, "bf16", 0, 0), dict(mode="fold2", cut=517)),
            ((2, 1031, 1031, 4, 2, D, True, "bf16", 0, 0), dict(mode="fold2_reversed", cut=517)),
            # three blocks, the last call folds and normalizes; non-causal
            ((1, 777, 2048, 8, 2, D, False, "bf16", 0, 0), dict(mode="fold3", cut=600, cut2=1300)),
        ]
        if not lite:
            table += [
                # q, k, v as (B, H, S, D)-contiguous tensors seen as (B, S, H, D); M, L transposed views
                ((2, 1031, 1031, 4, 2, D, True, "fp16", 0, 0), dict(layout="bhsd")),
                # a non-positive scale takes the pre-scaled path
                ((1, 777, 1031, 2, 1, D, False, "bf16", 0, 0), dict(scale=-(D**-0.5))),
            ]
        for row, extras in table:
            add(**dict(zip(cols, row)), **extras)
    return cases


def timing_medians(rows, shape) -> dict:
    """{(impl, *shape(row)): row}: a shape's one timing, or over several rounds a row with the
    median TFLOP/s (and ms, kernel TFLOP/s, ms outside the kernel where given), the rounds'
    count, and the agreement with the Triton result of every round."""
    groups = {}
    for r in rows:
        groups.setdefault((r["impl"], *shape(r)), []).append(r)
    by = {}
    for key, rs in groups.items():
        ok = [r for r in rs if "tflops" in r]
        if len(rs) == 1 or not ok:
            by[key] = rs[0]
            continue
        row = dict(ok[0], rounds=len(ok))
        for f in ("tflops", "ms", "kernel_tflops", "kernel_ms", "rest_ms"):
            if all(f in r for r in ok):
                row[f] = statistics.median(r[f] for r in ok)
        row["agrees_with_triton"] = all(r.get("agrees_with_triton", True) for r in ok)
        by[key] = row
    return by


def print_round_ratios(rows, gl_impls, shape, shapes, head: str) -> None:
    """For shapes timed in two rounds or more: each Gluon variant's TFLOP/s over the first
    variant's in the same round, median (min-max) over the rounds, a line per shape (its
    columns: head, a formatted line start; shapes: the shape tuples in print order)."""
    if len(gl_impls) < 2:
        return
    tf = {(r["impl"], *shape(r), r.get("round", 0)): r["tflops"] for r in rows if "tflops" in r}
    ratios = {}
    for (impl, *sh, rnd), t in tf.items():
        base = tf.get((gl_impls[0], *sh, rnd))
        if impl in gl_impls[1:] and base:
            ratios.setdefault((impl, *sh), []).append(t / base)
    if not any(len(v) > 1 for v in ratios.values()):
        return
    print(f"\n=== each variant over {gl_impls[0][6:]}, TFLOP/s of the same round: median (min-max) over the rounds ===")
    print(head + " | " + " ".join(f"{i[6:][:18]:>18}" for i in gl_impls[1:]))
    for sh in shapes:
        cells = []
        for impl in gl_impls[1:]:
            q = ratios.get((impl, *sh), [])
            cells.append(f"{statistics.median(q):.3f} ({min(q):.3f}-{max(q):.3f})" if len(q) > 1 else "-")
        print(" ".join(f"{x!s:>{w}}" for x, w in zip(sh, (6, 6, 6))) + " | " + " ".join(f"{c:>18}" for c in cells))


def add_rounds_arg(ap) -> None:
    """--rounds, the timings' rounds (in_rounds), of this script and the backward's."""
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each shape this many times, the order reversed every other round (medians and per-round "
        "ratios to the first variant in the summary)",
    )


def timing_tasks(variants, head_dims, seqlens, heads, dtype, rounds: int = 1) -> list[dict]:
    """One timing per implementation and shape, `rounds` times each shape (in_rounds)."""
    tasks = []
    for D in head_dims:
        for S in seqlens:
            for causal in (False, True):
                gluon = [f"gluon:{v}" for v in variants if has_config(v, D)]
                for r, impl in in_rounds(["sdpa_cudnn", "sdpa_flash", "triton"] + gluon, rounds):
                    tasks.append(
                        dict(
                            kind="time",
                            impl=impl,
                            D=D,
                            S=S,
                            causal=causal,
                            B=1,
                            H=heads,
                            dtype=dtype,
                            id=f"time:{impl}:{D}:{S}:{int(causal)}" + (f":r{r}" if rounds > 1 else ""),
                            round=r,
                        )
                    )
    return tasks


# ----------------------------------------------------------------------------------------------
# Worker side (runs in the child process)

_DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
# CPU dry run of the checking code itself (--cpu-dry-run): inputs on the CPU and, in place of
# the kernel, a float32 stand-in with the kernel's semantics (FAKE=bug: a deliberately wrong one)
FAKE = os.environ.get("GLUON_CHECK_FAKE", "")
DEV = "cpu" if FAKE else "cuda"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _fake_forward(q, k, v, *, q_start, k_start, causal, scale, out_o, out_m, out_l, normalize, fold, config=None):
    """The kernel's contract computed by the float64 reference, stored like the kernel would."""
    from ringflash.kernels import gluon_forward as gf

    state = (out_o, out_m, out_l) if fold else None
    if FAKE == "bug":  # ignores the causal mask: the checks must catch it
        causal = False
    acc, m, l = gf.reference(q, k, v, q_start=q_start, k_start=k_start, causal=causal, scale=scale, state=state)
    out_o.copy_(gf.normalized(acc, l) if normalize else acc)
    out_m.copy_(m)
    out_l.copy_(l)


def _max_abs(a, b, where=None):
    d = (a.double() - b.double()).abs()
    if where is not None:
        d = d[where]
    return d.max().item() if d.numel() else 0.0


def plain_einsum(eq, *operands):
    """torch.einsum in the operands' dtype, as a plain 16-bit implementation computes it
    (float32 accumulation, the result rounded once). On a CPU (the dry runs), whose 16-bit
    matmuls run ~30x slower than float32 ones, the same: in float32, then rounded."""
    if operands[0].device.type == "cpu":
        return torch.einsum(eq, *(x.float() for x in operands)).to(operands[0].dtype)
    return torch.einsum(eq, *operands)


def _plain(q, k, v, *, q_start, k_start, causal, scale):
    """Attention the obvious way in the inputs' dtype (scores, softmax and p @ v rounded to it,
    the log-sum-exp in float32), as a test's error yardstick. Returns (o, m, l) with m, l in
    base 2 from the rounded scores."""
    dt = q.dtype
    G = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(G, dim=2)
    vv = v.repeat_interleave(G, dim=2)
    s = plain_einsum("bihd,bjhd->bhij", q, kk) * scale  # in dtype
    if causal:
        qp = q_start + torch.arange(q.shape[1], device=q.device)
        kp = k_start + torch.arange(k.shape[1], device=q.device)
        s = s.masked_fill(qp[:, None] < kp[None, :], float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.exp(s - lse[..., None].to(dt)).masked_fill(empty, 0.0)
    o = plain_einsum("bhij,bjhd->bihd", p, vv)
    s2 = s.float() * 1.4426950408889634
    m = s2.amax(-1)
    l = torch.exp2(s2 - m[..., None]).sum(-1)
    e = empty.squeeze(-1)
    return o, m.masked_fill(e, float("-inf")), l.masked_fill(e, 0.0)


def _rand(shape, dtype, g, layout, dev):
    """(B, S, H, D) random tensor; layout 'bhsd' makes it a view of a (B, H, S, D) tensor."""
    if layout == "bhsd":
        B, S, H, D = shape
        return torch.randn(B, H, S, D, device=dev, generator=g, dtype=dtype).transpose(1, 2)
    return torch.randn(*shape, device=dev, generator=g, dtype=dtype)


def _stats_out(B, H, S, layout, dev):
    if layout == "bhsd":  # (B, S, H) storage seen as (B, H, S)
        return (
            torch.full((B, S, H), float("nan"), device=dev).transpose(1, 2),
            torch.full((B, S, H), float("nan"), device=dev).transpose(1, 2),
        )
    return (torch.full((B, H, S), float("nan"), device=dev), torch.full((B, H, S), float("nan"), device=dev))


def run_correctness(c: dict, plan: list | None = None) -> dict:
    """One correctness case. plan: instead, append a launch_spec of every kernel call the case
    makes (on CPU stand-in tensors) and return without checking: what to precompile."""
    from ringflash.kernels import gluon_forward as gf

    dev = "cpu" if plan is not None else DEV
    dt = _DT[c["dtype"]]
    B, Sq, Sk, Hq, Hkv, D = (c[x] for x in ("B", "Sq", "Sk", "Hq", "Hkv", "D"))
    seed = (time.time_ns() ^ hash(c["id"])) % 2**31  # fresh inputs every run; recorded to reproduce
    g = torch.Generator(device=dev).manual_seed(seed)
    q = _rand((B, Sq, Hq, D), dt, g, c["layout"], dev)
    k = _rand((B, Sk, Hkv, D), dt, g, c["layout"], dev)
    v = _rand((B, Sk, Hkv, D), dt, g, c["layout"], dev)
    pos = dict(q_start=c["q_start"], causal=c["causal"], scale=c["scale"])
    cfg = gf.config_for(D, c["variant"])
    mode = c["mode"]

    if plan is not None:
        forward = lambda *a, **kw: plan.append(gf.launch_spec(*a, **kw))
    else:
        forward = _fake_forward if FAKE else gf.forward

    def call(kk, vv, k_start, o, m, l, normalize, fold):
        forward(
            q, kk, vv, k_start=k_start, out_o=o, out_m=m, out_l=l, normalize=normalize, fold=fold, config=cfg, **pos
        )

    t0 = time.perf_counter()
    m_out, l_out = _stats_out(B, Hq, Sq, c["layout"], dev)
    res = {"seed": seed}
    if mode == "local":
        if c["layout"] == "bhsd":  # the output a strided view as well
            o = torch.full((B, Hq, Sq, D), float("nan"), device=dev, dtype=dt).transpose(1, 2)
        else:
            o = torch.full((B, Sq, Hq, D), float("nan"), device=dev, dtype=dt)
        call(k, v, c["k_start"], o, m_out, l_out, True, False)
    else:
        k0 = c["k_start"]
        cuts = [0, c["cut"]] + ([c["cut2"]] if mode == "fold3" else []) + [Sk]
        parts = list(zip(cuts[:-1], cuts[1:]))
        if mode == "fold2_reversed":
            parts = parts[::-1]
        o = torch.full((B, Sq, Hq, D), float("nan"), device=dev, dtype=torch.float32)
        for i, (a, b) in enumerate(parts):
            last = i == len(parts) - 1
            normalize = last and mode == "fold3"
            call(k[:, a:b], v[:, a:b], k0 + a, o, m_out, l_out, normalize, i > 0)
        if mode != "fold3":
            o = gf.normalized(o, l_out)
        # the unsplit run, for comparison
        o_un = torch.full((B, Sq, Hq, D), float("nan"), device=dev, dtype=dt)
        m_un, l_un = _stats_out(B, Hq, Sq, c["layout"], dev)
        call(k, v, k0, o_un, m_un, l_un, True, False)
        if plan is not None:
            return {}
        _sync()
        res["vs_unsplit_o"] = _max_abs(o, o_un)
        res["vs_unsplit_m"] = _max_abs(m_out, m_un, torch.isfinite(m_un))
    if plan is not None:
        return {}
    _sync()
    res["kernel_s"] = time.perf_counter() - t0

    acc64, m64, l64 = gf.reference(q, k, v, k_start=c["k_start"], **pos)
    o64 = gf.normalized(acc64, l64)
    po, pm, pl = _plain(q, k, v, k_start=c["k_start"], **pos)
    empty = l64 == 0  # (B, H, S)
    full = ~empty
    scale_o = max(o64.abs().max().item(), 1e-30)
    floor_o = 4 * F32_EPS * max(scale_o, 1.0) * D**0.5
    err_o, plain_o = _max_abs(o, o64), _max_abs(po, o64)
    bound_o = 2 * max(plain_o, floor_o)
    fin = torch.isfinite(m64)
    mscale = m64[fin].abs().max().item() if fin.any() else 1.0
    err_m = _max_abs(m_out, m64, fin)
    plain_m = _max_abs(pm, m64, fin)
    bound_m = 2 * max(plain_m, 4 * F32_EPS * max(mscale, 1.0) * D**0.5)
    rel = lambda a: ((a.double() - l64).abs() / l64.clamp_min(1e-300))[full]
    err_l = rel(l_out).max().item() if full.any() else 0.0
    plain_l = rel(pl).max().item() if full.any() else 0.0
    bound_l = 2 * max(plain_l, 4 * F32_EPS * Sk**0.5)
    nan = bool(torch.isnan(o).any() or torch.isnan(m_out).any() or torch.isnan(l_out).any())
    empty_ok = True
    if empty.any():
        e_rows = empty.transpose(1, 2)  # (B, S, H)
        empty_ok = bool((o[e_rows] == 0).all() and torch.isneginf(m_out[empty]).all() and (l_out[empty] == 0).all())
    checks = {
        "o": err_o <= bound_o,
        "m": err_m <= bound_m,
        "l": err_l <= bound_l,
        "no_nan": not nan,
        "empty_rows": empty_ok,
        "m_inf_pattern": bool((torch.isneginf(m_out) == ~fin).all()),
    }
    if "vs_unsplit_o" in res:
        checks["vs_unsplit"] = res["vs_unsplit_o"] <= bound_o
    res.update(
        status="PASS" if all(checks.values()) else "FAIL",
        failed=[k_ for k_, ok in checks.items() if not ok],
        rel_err_o=err_o / scale_o,
        rel_plain_o=plain_o / scale_o,
        rel_bound_o=bound_o / scale_o,
        rel_err_m=err_m / max(mscale, 1.0),
        rel_bound_m=bound_m / max(mscale, 1.0),
        rel_err_l=err_l,
        rel_bound_l=bound_l,
        empty_rows=int(empty.sum().item()),
    )
    return res


_CACHE: dict = {}


def _inputs(t):
    key = (t["D"], t["S"], t["dtype"], t["B"], t["H"])
    if _CACHE.get("key") != key:
        _CACHE.clear()
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        dt = _DT[t["dtype"]]
        _CACHE["key"] = key
        _CACHE["qkv"] = [
            torch.randn(t["B"], t["S"], t["H"], t["D"], device="cuda", dtype=dt, generator=g) for _ in range(3)
        ]
    return _CACHE


def run_timing(t: dict) -> dict:
    import triton

    cache = _inputs(t)
    q, k, v = cache["qkv"]
    B, S, H, D, causal = t["B"], t["S"], t["H"], t["D"], t["causal"]
    scale = D**-0.5
    impl = t["impl"]
    o = torch.empty_like(q)
    if impl.startswith("sdpa"):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if "sdpa" not in cache:
            cache["sdpa"] = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        qs, ks, vs = cache["sdpa"]
        backend = SDPBackend.CUDNN_ATTENTION if impl == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

        def fn():
            with sdpa_kernel(backend), torch.no_grad():
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    elif impl == "triton":
        from ringflash import kernels as rk
        from ringflash.merge import SoftmaxState

        state = SoftmaxState.empty(o)
        from ringflash.masks import CAUSAL

        fn = lambda: rk.forward(
            q,
            k,
            v,
            state,
            q_start=0,
            k_start=0,
            window=CAUSAL if causal else None,
            bounds=None,
            scale=scale,
            fold=False,
            normalize=True,
        )
    else:
        from ringflash.kernels import gluon_forward as gf

        m = torch.empty(B, H, S, device="cuda")
        l = torch.empty_like(m)
        variant = impl.split(":", 1)[1]
        fn = lambda: gf.forward(
            q,
            k,
            v,
            q_start=0,
            k_start=0,
            causal=causal,
            scale=scale,
            out_o=o,
            out_m=m,
            out_l=l,
            normalize=True,
            fold=False,
            config=variant,
        )
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    res = {"status": "OK", "ms": ms, "tflops": flops / ms / 1e9}
    if impl == "triton" or impl.startswith("gluon"):
        ref = cache.get(("triton_out", causal))
        if impl == "triton":
            cache[("triton_out", causal)] = o.clone()
        elif ref is not None:
            res["rel_diff_vs_triton"] = _max_abs(o, ref) / max(ref.abs().max().item(), 1e-30)
            res["agrees_with_triton"] = res["rel_diff_vs_triton"] <= 2.0**-6  # a few bf16 ulps of the largest value
    return res


def _selftest_task(t):
    """Stand-ins for a kernel that passes, hangs, kills its process, raises, or floods stderr."""
    b = t["behave"]
    if b == "hang":
        time.sleep(3600)
    elif b == "crash":
        os._exit(7)
    elif b == "error":
        raise ValueError("selftest error")
    elif b == "chatty":
        sys.stderr.write("x" * (1 << 20))
        sys.stderr.flush()
    return {"status": "PASS"}


def worker(task_file: str) -> None:
    for i, t in json.loads(Path(task_file).read_text()):
        print(START + str(i), flush=True)
        try:
            if t.get("kind") == "selftest":
                res = _selftest_task(t)
            else:
                res = run_timing(t) if t.get("kind") == "time" else run_correctness(t)
        except Exception as e:  # reported, then the next task
            res = {
                "status": "ERROR",
                "error": f"{type(e).__name__}: {str(e)[:400]}",
                "trace": traceback.format_exc()[-1500:],
            }
            if "CUDA" in str(e) or "illegal" in str(e).lower():
                print(RESULT + json.dumps({"i": i, **res}), flush=True)
                sys.exit(3)  # the context is gone; the parent restarts a fresh process
        print(RESULT + json.dumps({"i": i, **res}), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent side


class Runner:
    """Runs a task list in child processes, one task at a time, each under a timeout.

    Each child gets the tasks still to do as (index, task) pairs and prints START i before
    task i and RESULT {...} after it. No RESULT within `timeout` seconds of START: the child
    is killed, the task recorded as HANG and the rest of its group skipped; the child dying
    inside a task: CRASH. Either way a fresh child continues with the tasks left."""

    STARTUP_S = 180.0  # imports and CUDA initialisation before the first START
    script = Path(__file__).resolve()  # the script whose --worker mode runs the tasks

    def __init__(self, timeout: float, deadline: float, sink, family: bool = False):
        self.timeout, self.deadline, self.sink, self.family = timeout, deadline, sink, family

    def group(self, task) -> str:
        """What a hang takes down: the variant (or timed implementation); with `family`, every
        variant of the same schedule (they differ only in block shapes, the protocol is one)."""
        if self.family and task.get("schedule"):
            return task["schedule"]
        return task.get("variant") or task.get("impl")

    def run(self, tasks: list[dict]) -> None:
        self.tasks, self.done, self.dead = tasks, [False] * len(tasks), {}
        with tempfile.TemporaryDirectory() as tmp:
            for attempt in range(len(tasks) + 1):
                todo = []
                for i, t in enumerate(tasks):
                    if self.done[i]:
                        continue
                    if self.group(t) in self.dead:
                        self._record(i, {"status": "SKIPPED", "why": self.dead[self.group(t)]})
                    elif time.monotonic() > self.deadline:
                        self._record(i, {"status": "SKIPPED", "why": "deadline"})
                    else:
                        todo.append(i)
                if not todo:
                    return
                path = Path(tmp) / f"tasks_{attempt}.json"
                path.write_text(json.dumps([[i, tasks[i]] for i in todo]))
                self._child(path, todo, Path(tmp) / f"stderr_{attempt}.txt")

    def _record(self, i, res):
        self.done[i] = True
        self.sink({**self.tasks[i], **res})

    def _child(self, path: Path, todo: list[int], err_path: Path) -> None:
        """Run the tasks `todo` (indices, in order) in one child until it ends, hangs or dies."""
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if env.get("GLUON_CHECK_FAKE") or env.get("GLUON_BWD_CHECK_FAKE"):
            # a CPU dry run compiles no Gluon kernel; its Triton ones (the blocked dQ's finish) interpret
            env["TRITON_INTERPRET"] = "1"
        else:  # interpreted kernels patch triton.language in-process, which breaks Gluon compilation
            env.pop("TRITON_INTERPRET", None)
        with open(err_path, "w") as err:  # a file, not a pipe: a chatty child must never block
            proc = subprocess.Popen(
                [sys.executable, str(self.script), "--worker", str(path)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        fd = proc.stdout.fileno()
        current, t_mark, buf = None, time.monotonic(), b""
        try:
            while True:
                limit = self.timeout if current is not None else self.STARTUP_S
                remaining = t_mark + limit - time.monotonic()
                if remaining <= 0:
                    idx = current if current is not None else next(i for i in todo if not self.done[i])
                    self._record(idx, {"status": "HANG", "why": f"no result within {limit:.0f} s; killed"})
                    g = self.group(self.tasks[idx])
                    self.dead[g] = f"{g} hung on {self.tasks[idx]['id']}"
                    return
                ready, _, _ = select.select([fd], [], [], min(remaining, 5.0))
                if not ready:
                    continue
                data = os.read(fd, 1 << 16)
                if not data:  # the child exited
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.decode(errors="replace")
                    if line.startswith(START):
                        current, t_mark = int(line[len(START) :]), time.monotonic()
                    elif line.startswith(RESULT):
                        res = json.loads(line[len(RESULT) :])
                        self._record(res.pop("i"), res)
                        current, t_mark = None, time.monotonic()
                        if time.monotonic() > self.deadline:
                            return
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        tail = lambda: err_path.read_text(errors="replace")[-2000:] if err_path.exists() else ""
        if current is not None:  # died inside a task
            self._record(current, {"status": "CRASH", "returncode": proc.returncode, "stderr_tail": tail()})
        elif not any(self.done[i] for i in todo):  # died before its first task
            self._record(
                todo[0],
                {
                    "status": "CRASH",
                    "returncode": proc.returncode,
                    "why": "child failed to start",
                    "stderr_tail": tail(),
                },
            )


def precompile(cases, variants, head_dims, seqlens, heads, dtype, jobs) -> dict:
    """Compile, on the CPU cores in parallel, every kernel the cases and timings will launch,
    before any GPU work: the launches then find them in triton's cache instead of compiling
    one by one while the GPU waits. Specializations are derived exactly as the launch does."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ringflash.kernels import gluon_forward as gf

    t0 = time.monotonic()
    specs = []
    for c in cases:
        run_correctness(c, plan=specs)
    contig = lambda shape, dt: (shape, tuple(torch.empty(shape, device="meta").stride()), dt)
    for v in variants:
        for D in [d for d in head_dims if has_config(v, d)]:
            for S in sorted(set(seqlens)):
                for causal in (False, True):
                    qkv = contig((1, S, heads, D), dtype)
                    ml = contig((1, heads, S), "float32")
                    specs.append(
                        {
                            "tensors": [qkv, qkv, qkv, qkv, ml, ml],
                            "q_start": 0,
                            "k_start": 0,
                            "causal": causal,
                            "scale": D**-0.5,
                            "normalize": True,
                            "fold": False,
                            "config": v,
                        }
                    )
    unique = {}
    for sp in specs:
        unique.setdefault(gf.compile_spec(sp, key_only=True), sp)
    errors = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for sp, (err, _) in zip(unique.values(), ex.map(gf.try_compile_spec, unique.values())):
            if err:
                errors.append({"config": str(sp["config"]), "causal": sp["causal"], "error": err})
    return {"launches": len(specs), "kernels": len(unique), "seconds": time.monotonic() - t0, "errors": errors}


def compile_reports(variants, head_dims) -> list[dict]:
    from ringflash.kernels import gluon_forward as gf

    rows = []
    for v in variants:
        for D in [d for d in head_dims if has_config(v, d)]:
            try:
                r = gf.hopper_report(gf.config_for(D, v), D, causal=True)
                r["name"] = v
                r["problems"] = gf.report_problems(r)
            except Exception as e:
                r = {"name": v, "D": D, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            if "error" in r:
                print(f"report {v:10s} D={D:<3d} ERROR {r['error']}", flush=True)
            else:
                print(
                    f"report {v:10s} D={D:<3d} regs={r['regs']} setmaxnreg={r['setmaxnreg']} spills={r['spill_bytes']} "
                    f"shared={r['shared']} waits={r['sass_waits']} {'OK' if not r['problems'] else r['problems']}",
                    flush=True,
                )
    return rows


def print_summary(out: dict, variants, head_dims, seqlens):
    print("\n=== correctness (per variant: pass / total; worst error / bound ratios) ===")
    for v in variants:
        rows = [r for r in out["correctness"] if r.get("variant") == v]
        if not rows:
            continue
        npass = sum(r["status"] == "PASS" for r in rows)
        bad = [r for r in rows if r["status"] != "PASS"]
        ratio = max((r["rel_err_o"] / r["rel_bound_o"] for r in rows if "rel_err_o" in r), default=float("nan"))
        worst_o = max((r["rel_err_o"] for r in rows if "rel_err_o" in r), default=float("nan"))
        print(
            f"{v:10s} {npass:3d}/{len(rows):<3d} max rel err O {worst_o:.2e} (worst err/bound {ratio:.2f})"
            + (
                ""
                if not bad
                else "  NOT PASSING: "
                + ", ".join(
                    f"{r['id']}={r['status']}{'(' + ','.join(r.get('failed', [])) + ')' if r.get('failed') else ''}"
                    for r in bad[:6]
                )
                + (" ..." if len(bad) > 6 else "")
            )
        )
    if not out["timing"]:
        return
    impls = ["sdpa_cudnn", "sdpa_flash", "triton"] + [f"gluon:{v}" for v in variants]
    shape = lambda r: (r["D"], r["S"], r["causal"])  # noqa: E731
    by = timing_medians(out["timing"], shape)
    names = [i.replace("gluon:", "") for i in impls]
    print(f"\n=== forward TFLOP/s (B=1, H={out['meta']['heads']}, bf16 unless --dtype) ===")
    print(f"{'D':>4} {'S':>6} {'causal':>6} | " + " ".join(f"{n[:10]:>10}" for n in names) + " | best gluon / cudnn")
    for D in head_dims:
        for S in seqlens:
            for causal in (False, True):
                vals, best = [], None
                for i in impls:
                    r = by.get((i, D, S, causal))
                    t = r.get("tflops") if r else None
                    mark = "" if not r or r.get("agrees_with_triton", True) else "!"
                    vals.append(f"{t:9.1f}{mark or ' '}" if t else f"{(r or {}).get('status', '-')[:9]:>10}")
                    if t and i.startswith("gluon") and mark == "" and (best is None or t > best[1]):
                        best = (i, t)
                cu = (by.get(("sdpa_cudnn", D, S, causal)) or {}).get("tflops")
                tail = f"{best[0][6:]} {best[1] / cu:.2f}x" if best and cu else "-"
                print(f"{D:>4} {S:>6} {str(causal):>6} | " + " ".join(vals) + f" | {tail}")
    print("('!' = output differs from the Triton kernel's by more than 2^-6 of its largest value)")
    shapes = [(D, S, causal) for D in head_dims for S in seqlens for causal in (False, True)]
    gl_impls = [i for i in impls if i.startswith("gluon:")]
    print_round_ratios(out["timing"], gl_impls, shape, shapes, f"{'D':>6} {'S':>6} {'causal':>6}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("gluon_check.json"))
    ap.add_argument("--variants", nargs="+", default=None, help="default: every variant in gluon_forward.VARIANTS")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="timing dtype")
    ap.add_argument("--quick", action="store_true", help="S=16K only and the smaller correctness set")
    add_rounds_arg(ap)
    ap.add_argument(
        "--full-correctness-for",
        nargs="*",
        default=["ws2", "ws2_s3"],
        help="variants that get the full correctness set (others get the smaller one)",
    )
    ap.add_argument("--report", action="store_true", help="also print the compile report per variant (CPU side)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="processes that compile every kernel before the GPU work (0: compile on first launch)",
    )
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--time-failing", action="store_true", help="also time variants that did not pass")
    ap.add_argument("--case-timeout", type=float, default=90.0, help="seconds per case before it counts as hung")
    ap.add_argument(
        "--no-family-skip",
        action="store_true",
        help="after a hang skip only that variant (default: every variant of its schedule)",
    )
    ap.add_argument("--deadline", type=float, default=1500.0, help="start no new case after this many seconds")
    ap.add_argument(
        "--cpu-dry-run",
        nargs="?",
        const="ok",
        choices=["ok", "bug"],
        help="check this script on a CPU: a float64 stand-in replaces the kernel ('bug': a wrong one)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)

    if args.cpu_dry_run:
        os.environ["GLUON_CHECK_FAKE"] = args.cpu_dry_run
        args.skip_timing, args.report = True, False
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    from ringflash.kernels import gluon_forward as gf

    variants = args.variants or list(gf.VARIANTS)
    unknown = [v for v in variants if v not in gf.VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(gf.VARIANTS)}")
    seqlens = [16384] if args.quick else args.seqlens
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "gluon": gf.HAS_GLUON,
        "gluon_error": gf.GLUON_ERROR,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "heads": args.heads,
        "variants": {v: {str(D): vars(c) for D, c in gf.VARIANTS[v].items()} for v in variants},
        "argv": sys.argv[1:],
    }
    out = {"meta": meta, "report": [], "correctness": [], "timing": []}
    print(json.dumps({k: meta[k] for k in ("gpu", "capability", "torch", "triton", "python", "gluon")}), flush=True)

    def save():
        args.json.write_text(json.dumps(out, indent=1, default=str))

    if not gf.HAS_GLUON:
        print(f"Gluon not importable: {gf.GLUON_ERROR}", flush=True)
    if args.report and gf.HAS_GLUON:
        out["report"] = compile_reports(variants, args.head_dims)
        save()

    def sink(section):
        def f(row):
            out[section].append(row)
            save()
            if section == "correctness":
                errs = (
                    f"O {row['rel_err_o']:.2e}/{row['rel_bound_o']:.2e} m {row['rel_err_m']:.1e} "
                    f"l {row['rel_err_l']:.1e}"
                    if "rel_err_o" in row
                    else row.get("error") or row.get("why") or ""
                )
                print(
                    f"{row['status']:7s} {row['id']:12s} {row['mode']:15s} B{row['B']} {row['Sq']}x{row['Sk']} "
                    f"H{row['Hq']}/{row['Hkv']} D{row['D']} {row['dtype']} causal={int(row['causal'])} "
                    f"{row['layout']} q0={row['q_start']} k0={row['k_start']} {errs} "
                    f"{'failed=' + ','.join(row['failed']) if row.get('failed') else ''}",
                    flush=True,
                )
            else:
                extra = f" vs triton {row['rel_diff_vs_triton']:.1e}" if "rel_diff_vs_triton" in row else ""
                print(
                    f"{row['status']:7s} {row['impl']:16s} D={row['D']} S={row['S']} causal={int(row['causal'])} "
                    + (
                        f"{row['ms']:.3f} ms {row['tflops']:.1f} TFLOP/s{extra}"
                        if "tflops" in row
                        else str(row.get("error") or row.get("why") or row.get("stderr_tail", ""))[-300:]
                    ),
                    flush=True,
                )

        return f

    passing = set(variants)
    per_variant = (
        []
        if args.skip_correctness
        else [
            correctness_cases(v, lite=args.quick or v not in args.full_correctness_for, head_dims=args.head_dims)
            for v in variants
        ]
    )
    # round robin over the variants: every variant's first (smallest-risk) case runs early, so
    # a broken schedule shows within minutes whatever its place in the list
    cases = [
        c
        for i in range(max(map(len, per_variant), default=0))
        for cs in per_variant
        if i < len(cs)
        for c in cs[i : i + 1]
    ]
    if args.jobs > 0 and gf.HAS_GLUON and not args.cpu_dry_run:
        try:
            pre = precompile(
                cases,
                [] if args.skip_timing else variants,
                args.head_dims,
                seqlens,
                args.heads,
                {"bf16": "bfloat16", "fp16": "float16"}[args.dtype],
                args.jobs,
            )
        except Exception as e:  # only a speed-up: the launches compile on their own
            pre = {"launches": 0, "kernels": 0, "seconds": 0.0, "errors": [], "failed": f"{type(e).__name__}: {e}"}
            print(f"precompile failed ({pre['failed'][:300]}); kernels compile at first launch", flush=True)
        out["meta"]["precompile"] = pre
        save()
        print(
            f"precompiled {pre['kernels']} kernels for {pre['launches']} launches in {pre['seconds']:.0f} s"
            f" on {args.jobs} processes; {len(pre['errors'])} failed to compile",
            flush=True,
        )
        for e in pre["errors"]:
            print(f"COMPILE ERROR {e['config']} causal={e['causal']}: {e['error'][-300:]}", flush=True)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        save()
        print("no CUDA GPU here: stopping after the CPU-side steps", flush=True)
        return
    if not args.skip_correctness:
        Runner(args.case_timeout, deadline, sink("correctness"), family=not args.no_family_skip).run(cases)
        passing = {v for v in variants if all(r["status"] == "PASS" for r in out["correctness"] if r["variant"] == v)}
    timed = [] if args.skip_timing else variants if args.time_failing else [v for v in variants if v in passing]
    if not args.skip_timing:
        tasks = timing_tasks(timed, args.head_dims, seqlens, args.heads, args.dtype, args.rounds)
        Runner(max(args.case_timeout, 300.0), deadline, sink("timing")).run(tasks)
    meta["elapsed_s"] = time.monotonic() - t0
    save()
    print(
        f"\nwrote {args.json} ({meta['elapsed_s']:.0f} s); variants passing correctness: {sorted(passing)}; "
        f"timed: {timed}"
    )
    print_summary(out, variants, args.head_dims, seqlens)


if __name__ == "__main__":
    main()
