"""Check and time the Gluon backward (ringflash/kernels/gluon_backward.py) on one Hopper GPU.

    PYTHONPATH=. python3 benchmarks/gluon_bwd_check.py --json gluon_bwd.json
    PYTHONPATH=. python3 benchmarks/gluon_bwd_check.py --quick --json q.json     # S=16K, fewer cases
    PYTHONPATH=. python3 benchmarks/gluon_bwd_check.py --cpu-dry-run             # this script, no GPU

1. Correctness on fresh random inputs: the forward state (o, m, l) from the package's forward
   (ringflash.kernels.forward), delta = rowsum(dO * o) from its delta kernel, then the Gluon
   backward with dq, dk, dv poisoned with NaN (or, accumulating, float32 buffers holding random
   values). Reference: the same math in float64 (gluon_backward.reference: the probabilities
   from the same m, l; ds = p (dp - delta)). PASS iff for each of dq, dk, dv the relative error
   ||got - ref|| / ||ref|| is at most 2x that of the same math done plainly in the input dtype
   (matmul outputs, probabilities and ds rounded to it; statistics in float32) with a floor of a
   few float32 ulps, there is no NaN, and rows that see no key get exactly 0. The Triton
   backward (ringflash.kernels.backward) runs on the same inputs: its errors are reported beside.
   Cases: ragged shapes (1031, 777 x 2048, 2048 x 777 causal bottom-right), GQA 4/1 and 8/2,
   causal and not, bf16 and fp16, float32 and 16-bit dq, accumulation into float32 buffers,
   ring-like blocks (positions ~1e6 with every pair visible, partly visible, none visible).
2. Timing, only for variants that passed: B=1, H=32 (and GQA 32/8 once), D=--head-dim (128), bf16, causal and
   not: the whole backward (delta + row statistics + kernel + the float32 dQ's cast to bf16)
   beside the package's Triton two-pass backward (delta + dK/dV pass + dQ pass) and SDPA's
   cuDNN backward (autograd.grad with retain_graph), triton.testing.do_bench medians;
   TFLOP/s = 2.5 x 4*B*H*S*S*D (half for causal). The Gluon gradients at each timed shape are
   compared with the Triton ones. --rounds N times each shape N times, the order reversed every
   other round: the tables then give medians, and a last one each variant's TFLOP/s over the
   first variant's in the same round (median, min-max), instead of two runs with the order
   swapped.

Every case runs in a child process under a timeout (benchmarks.gluon_check.Runner): a hung
kernel is killed and recorded as HANG (the other variants of its schedule are then skipped;
--no-family-skip keeps them), a crash as CRASH, and the run goes on. --deadline: no new case
after that many seconds. Results go to --json after every case; the summary table prints last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import gluon_check as gc  # noqa: E402

F32_EPS = 2.0**-23
LOG2E = 1.4426950408889634
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --cpu-dry-run: inputs on the CPU, the package's torch backend for the forward and the Triton
# comparison, and in place of the Gluon kernel a float32 emulation of its blocking (the plan,
# the masks, the padded statistics); FAKE=bug: the emulation without the causal diagonal mask
FAKE = os.environ.get("GLUON_BWD_CHECK_FAKE", "")
DEV = "cpu" if FAKE else "cuda"
# what one plain run checks and times: the first version and the second round's variants
# (benchmarks/NOTES.md, 2026-12-02); ws2_s3 and ws2_rot were measured equal or slower than ws2
DEFAULT_VARIANTS = ["ws2", "ws2_blk", "ws2_lag", "ws2_lagq"]

# ----------------------------------------------------------------------------------------------
# Cases


def correctness_cases(variant: str, lite: bool, D: int = 128, Dv: int | None = None) -> list[dict]:
    from ringflash.kernels import gluon_backward as gb

    far = 10**6
    cols = ("B", "Sq", "Sk", "Hq", "Hkv", "causal", "dtype", "q_start", "k_start")
    table = [
        # (B, Sq, Sk, Hq, Hkv, causal, dtype, q_start, k_start), extras; bottom-right causal: Sk - Sq
        ((1, 1031, 1031, 4, 1, False, "bf16", 0, 0), {}),
        ((1, 1031, 1031, 4, 1, True, "bf16", 0, 0), {}),
        ((1, 777, 2048, 8, 2, True, "bf16", 2048 - 777, 0), {}),
        # Sq > Sk, bottom-right: query rows 0..1270 see no key, whole query blocks are skipped
        ((1, 2048, 777, 4, 4, True, "bf16", 777 - 2048, 0), {}),
        # accumulating into float32 buffers that hold random values (the ring's mode)
        ((1, 1031, 1031, 8, 2, True, "bf16", 0, 0), dict(accumulate=True)),
        # ring-like block, partly visible, positions far from 0
        ((1, 1031, 777, 4, 2, True, "bf16", far + 300, far), dict(accumulate=True)),
        ((1, 1031, 1031, 4, 1, False, "fp16", 0, 0), dict(dq="input")),
    ]
    if not lite:
        table += [
            ((1, 1031, 1031, 4, 1, True, "fp16", 0, 0), dict(dq="input")),
            ((1, 777, 2048, 8, 2, False, "fp16", 0, 0), {}),
            ((1, 777, 2048, 8, 2, False, "bf16", 0, 0), {}),
            # exact tiles, two batches, 16-bit dq (float32 scratch + cast)
            ((2, 1024, 1024, 4, 4, True, "bf16", 0, 0), dict(dq="input")),
            # ring-like: every pair visible (all keys before all queries), then none visible
            ((1, 1031, 1031, 4, 2, True, "bf16", far + 2000, far), dict(accumulate=True)),
            ((1, 1031, 1031, 4, 2, True, "bf16", 0, 5000), {}),
            # one query row; keys fewer than one warpgroup's half of a block
            ((1, 1, 300, 2, 1, True, "bf16", 299, 0), {}),
            ((1, 200, 60, 2, 1, False, "fp16", 0, 0), {}),
            ((1, 1031, 1031, 8, 2, False, "fp16", 0, 0), dict(accumulate=True, dq="input")),
        ]
    cases = []
    for row, extras in table:
        c = {**dict(zip(cols, row)), "D": D, "Dv": Dv or D, "scale": D**-0.5, "accumulate": False, "dq": "fp32"}
        c.update(extras)
        cfg = gb.config_for(max(D, Dv or D), variant)
        # the family a hang takes down: variants sharing a barrier protocol (lag has its own)
        c.update(kind="correct", variant=variant, schedule=cfg.schedule + ("_lag" if cfg.lag else ""))
        c["id"] = f"{variant}:{len(cases)}"
        cases.append(c)
    return cases


def timing_tasks(
    variants, seqlens, heads, gqa_heads, D: int = 128, Dv: int | None = None, rounds: int = 1
) -> list[dict]:
    """One timing per implementation and shape, `rounds` times each shape (gluon_check.in_rounds)."""
    tasks = []
    # 16K first, then the shorter ones, the GQA case, the longer ones: a deadline cuts the last
    order = sorted(seqlens, key=lambda S: (S != 16384, S > 16384, S))
    shapes = [(S, causal, heads) for S in order if S <= 16384 for causal in (False, True)]
    if gqa_heads:
        shapes.append((16384 if 16384 in seqlens else order[0], True, gqa_heads))
    shapes += [(S, causal, heads) for S in order if S > 16384 for causal in (False, True)]
    impls = ["sdpa_cudnn", "triton"] + [f"gluon:{v}" for v in variants]
    for S, causal, hkv in shapes:
        for r, impl in gc.in_rounds(impls, rounds):
            tasks.append(
                dict(
                    kind="time",
                    impl=impl,
                    D=D,
                    Dv=Dv or D,
                    S=S,
                    causal=causal,
                    B=1,
                    H=heads,
                    Hkv=hkv,
                    dtype="bf16",
                    id=f"time:{impl}:{S}:{int(causal)}:{hkv}" + (f":r{r}" if rounds > 1 else ""),
                    round=r,
                )
            )
    return tasks


# ----------------------------------------------------------------------------------------------
# Worker side


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _forward_state(q, k, v, *, q_start, k_start, causal, scale):
    """(o, m, l) of the package's forward (the Gluon forward on Hopper)."""
    from ringflash.masks import CAUSAL
    from ringflash.merge import SoftmaxState

    if FAKE:
        from ringflash import reference as backend
    else:
        from ringflash import kernels as backend
    state = SoftmaxState.empty(q.new_empty(*q.shape[:-1], v.shape[-1]))  # the output: v's head dim
    backend.forward(
        q,
        k,
        v,
        state,
        q_start=q_start,
        k_start=k_start,
        window=CAUSAL if causal else None,
        bounds=None,
        scale=scale,
        fold=False,
        normalize=True,
    )
    return state.o, state.m, state.l, backend.delta


def _triton_backward(q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate):
    from ringflash.masks import CAUSAL

    if FAKE:
        from ringflash import reference as backend
    else:
        from ringflash import kernels as backend
    backend.backward(
        q,
        k,
        v,
        m,
        l,
        do,
        delta,
        dq,
        dk,
        dv,
        q_start=q_start,
        k_start=k_start,
        window=CAUSAL if causal else None,
        bounds=None,
        scale=scale,
        accumulate=accumulate,
        deterministic=True,  # the two Triton passes, not the fused kernel the default now runs
    )


def plain_backward(q, k, v, m, l, do, delta, *, q_start, k_start, causal, scale):
    """The same math done plainly in q's dtype: the matmuls' outputs, the probabilities and ds
    rounded to it, the statistics in float32 (as a plain 16-bit implementation keeps them).
    The error yardstick. Returns (dq, dk, dv) in q's dtype."""
    dt = q.dtype
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = gc.plain_einsum("bihd,bjhd->bhij", q, kk)
    off = torch.where(l > 0, m + torch.log2(torch.where(l > 0, l, 1.0)), float("inf"))
    p = torch.exp2(s.float() * (scale * LOG2E) - off[..., None])
    if causal:
        q_pos = q_start + torch.arange(Sq, device=q.device)
        k_pos = k_start + torch.arange(Sk, device=q.device)
        p = p.masked_fill(q_pos[:, None] < k_pos[None, :], 0.0)
    p = p.to(dt)
    dp = gc.plain_einsum("bihd,bjhd->bhij", do, vv)
    ds = (p.float() * (dp.float() - delta[..., None])).to(dt)
    dq = gc.plain_einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = (gc.plain_einsum("bhij,bihd->bjhd", ds, q).float() * scale).view(B, Sk, Hkv, G, D).sum(3).to(dt)
    dv = gc.plain_einsum("bhij,bihd->bjhd", p, do).float().view(B, Sk, Hkv, G, Dv).sum(3).to(dt)
    return dq, dk, dv


def emulate_backward(q, k, v, m, l, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate, config=None):
    """The Gluon kernel's blocking in float32 torch (the CPU dry run's stand-in): one program
    per (key block, batch, kv head) with the kernel's plan (_gluon_bwd._plan), masks, padded row
    statistics (gluon_backward.row_stats), 16-bit P and dS operands, float32 dQ added per block
    and the launcher's dq handling. FAKE=bug leaves the causal diagonal unmasked."""
    from ringflash.kernels import gluon_backward as gb

    cfg = gb._resolve(q, v, config)
    gb.check_shapes(q, k, v, m, l, do, delta, dq, dk, dv, scale=scale, cfg=cfg)
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    BM, BN = cfg.block_m, cfg.block_n
    dt = q.dtype
    sq_pad = gb.padded_rows(Sq, cfg)
    n_kblocks = -(-Sk // BN)
    stats = gb.row_stats(m, l, delta, cfg).view(B, Hq, 2, sq_pad)
    pad = lambda t, rows: torch.cat([t.float(), t.new_zeros(B, rows - t.shape[1], *t.shape[2:]).float()], 1)
    qp, dop = pad(q, sq_pad), pad(do, sq_pad)
    kp, vp = pad(k, n_kblocks * BN), pad(v, n_kblocks * BN)
    # the launcher's float32 dQ buffer and its finish (cast, or un-permuting the blocked layout)
    dq32, finish = gb.dq_buffer(dq, scale=scale, accumulate=accumulate, cfg=cfg)
    # blocked (cfg.dq_blocked): the kernel adds unscaled dQ tiles through this (B, n, 4, 2, 8, Hq,
    # 2, 8, 4, 2) view, the inverse of the kernel's offsets; the finish scales it
    nat = gb.dq_natural_view(dq32) if cfg.dq_blocked else None
    qk_scale = scale * LOG2E
    n_mblocks = -(-Sq // BM)
    for kb in range(n_kblocks):
        n0 = kb * BN
        n_last = min(n0 + BN, Sk) - 1
        if causal:
            m_first = min(max(k_start + n0 - q_start, 0) // BM, n_mblocks)
            m_full = -(-max(k_start + n_last - q_start, 0) // BM)
        else:
            m_first = m_full = 0
        key_ragged = n0 + BN > Sk
        keys = n0 + torch.arange(BN)
        for b in range(B):
            for hk in range(Hkv):
                kt, vt = kp[b, n0 : n0 + BN, hk], vp[b, n0 : n0 + BN, hk]
                dk_acc = torch.zeros(BN, D)
                dv_acc = torch.zeros(BN, Dv)
                n_m = n_mblocks - m_first

                def query_block(i):  # _gluon_bwd._query_block: (q head, query block) of step i
                    g = i // n_m
                    j = i - g * n_m
                    if cfg.walk == "rotated":
                        j = (j + kb) % n_m
                    elif cfg.walk == "down":
                        j = n_m - 1 - j
                    return hk * G + g, m_first + j

                def add_dq(i, ds):  # step i's dQ from its dS (kernel: _dq_add)
                    h, mb = query_block(i)
                    off_m = mb * BM
                    dq_part = ds.T @ kt
                    n_ok = max(0, min(BM, Sq - off_m))
                    # the kernel adds the padding rows' dQ (exactly 0) to row Sq - 1 (or, blocked,
                    # to the padding rows of the scratch)
                    assert bool((dq_part[n_ok:] == 0).all()), "padding rows must give dQ = 0"
                    if nat is not None:  # (the buffer's width: D padded)
                        W = dq32.shape[-1]
                        dq_part = torch.nn.functional.pad(dq_part, (0, W - D))
                        nat[b, mb, :, :, :, h] += dq_part.view(4, 2, 8, 2, W // 16, 4, 2)
                    else:
                        dq32[b, off_m : off_m + n_ok, h] += dq_part[:n_ok] * scale

                # the kernel's flat loop over G * n_m steps; cfg.lag: step i adds dQ(i - 1) from the
                # kept dS(i - 1), the last one after the loop (as _consumer, its indices recomputed)
                ds_prev = None
                for i in range(G * n_m):
                    h, mb = query_block(i)
                    off_m = mb * BM
                    qt, dot = qp[b, off_m : off_m + BM, h], dop[b, off_m : off_m + BM, h]
                    st = kt @ qt.T  # (BN keys, BM queries)
                    if key_ragged or (causal and mb < m_full and FAKE != "bug"):
                        vis = (keys < Sk)[:, None].expand(BN, BM)
                        if causal:
                            rows = q_start + off_m + torch.arange(BM)
                            vis = vis & (rows[None, :] >= (k_start + keys)[:, None])
                        st = st.masked_fill(~vis, float("-inf"))
                    offset, dl = stats[b, h, 0, off_m : off_m + BM], stats[b, h, 1, off_m : off_m + BM]
                    pt = torch.exp2(st * qk_scale - offset[None, :])
                    dv_acc += pt.to(dt).float() @ dot
                    dpt = vt @ dot.T
                    ds = (pt * (dpt - dl[None, :])).to(dt).float()
                    dk_acc += ds @ qt
                    if cfg.lag:
                        if i > 0:
                            add_dq(i - 1, ds_prev)
                        ds_prev = ds
                    else:
                        add_dq(i, ds)
                if cfg.lag and ds_prev is not None:
                    add_dq(G * n_m - 1, ds_prev)
                n_ok = max(0, min(BN, Sk - n0))
                for buf, acc in ((dk, dk_acc * scale), (dv, dv_acc)):
                    acc = acc[:n_ok]
                    if accumulate:
                        acc = acc + buf[b, n0 : n0 + n_ok, hk].float()
                    buf[b, n0 : n0 + n_ok, hk] = acc.to(buf.dtype)
    if finish is not None:
        finish()


def _rel(got, ref) -> float:
    den = ref.double().norm().item()
    num = (got.double() - ref.double()).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def run_correctness(c: dict, plan: list | None = None) -> dict:
    """One correctness case. plan: instead, append a launch_spec of the Gluon launch the case
    makes (CPU stand-in tensors) and return: what to precompile."""
    from ringflash.kernels import gluon_backward as gb

    dev = "cpu" if plan is not None else DEV
    dt = _DT[c["dtype"]]
    B, Sq, Sk, Hq, Hkv, D = (c[x] for x in ("B", "Sq", "Sk", "Hq", "Hkv", "D"))
    Dv = c.get("Dv", D)
    seed = (time.time_ns() ^ hash(c["id"])) % 2**31  # fresh inputs every run; recorded to reproduce
    g = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, device=dev, generator=g, dtype=torch.float32)
    # scores q.k * scale ~ N(0, 1.5^2): |s| up to ~5-7 at these sizes
    q = (rnd(B, Sq, Hq, D) * 1.5).to(dt)
    k, v = rnd(B, Sk, Hkv, D).to(dt), rnd(B, Sk, Hkv, Dv).to(dt)
    do = rnd(B, Sq, Hq, Dv).to(dt)
    pos = dict(q_start=c["q_start"], k_start=c["k_start"], causal=c["causal"], scale=c["scale"])
    acc = c["accumulate"]
    dq_dt = torch.float32 if c["dq"] == "fp32" else dt
    g_dt = torch.float32 if acc else dt

    def outputs():
        if acc:  # float32 buffers holding random values, added to
            return rnd(B, Sq, Hq, D).to(dq_dt), rnd(B, Sk, Hkv, D).to(g_dt), rnd(B, Sk, Hkv, Dv).to(g_dt)
        nan = lambda shape, t: torch.full(shape, float("nan"), device=dev, dtype=t)
        return nan((B, Sq, Hq, D), dq_dt), nan((B, Sk, Hkv, D), g_dt), nan((B, Sk, Hkv, Dv), g_dt)

    if plan is not None:
        m = torch.empty(B, Hq, Sq)
        plan.append(gb.launch_spec(q, k, v, m, m, do, m, *outputs(), accumulate=acc, config=c["variant"], **pos))
        return {}
    res = {"seed": seed}
    t0 = time.perf_counter()
    o, m, l, delta_fn = _forward_state(q, k, v, **pos)
    delta = delta_fn(o, do)
    dq, dk, dv = outputs()
    init = [t.clone() for t in (dq, dk, dv)] if acc else None
    run = emulate_backward if FAKE else gb.backward
    run(q, k, v, m, l, do, delta, dq, dk, dv, accumulate=acc, config=c["variant"], **pos)
    _sync()
    res["kernel_s"] = time.perf_counter() - t0
    got = [t.double() - i.double() for t, i in zip((dq, dk, dv), init)] if acc else [t.double() for t in (dq, dk, dv)]
    nan = any(bool(torch.isnan(t).any()) for t in (dq, dk, dv))

    ref = gb.reference(q, k, v, m, l, do, delta, **pos)
    plain = plain_backward(q, k, v, m, l, do, delta, **pos)
    # the Triton backward on the same inputs, its outputs in the same dtypes (poisoned / random)
    tq, tk, tv = outputs()
    t_init = [t.clone() for t in (tq, tk, tv)] if acc else None
    _triton_backward(q, k, v, m, l, do, delta, tq, tk, tv, accumulate=acc, **pos)
    _sync()
    tri = [t.double() - i.double() for t, i in zip((tq, tk, tv), t_init)] if acc else [t.double() for t in (tq, tk, tv)]
    checks = {"no_nan": not nan}
    for name, x, r, p, t, out in zip(("dq", "dk", "dv"), got, ref, plain, tri, (dq, dk, dv)):
        # floor: a few float32 ulps of a D-long (dq) or Sq-long (dk, dv) sum, relative
        n_sum = D if name == "dq" else Sq * (Hq // Hkv)
        floor = 4 * F32_EPS * math.sqrt(n_sum)
        if out.dtype != torch.float32:  # rounding the stored values (init + gradient when accumulating)
            floor = max(floor, torch.finfo(out.dtype).eps * out.double().norm().item() / max(r.norm().item(), 1e-300))
        err, err_plain, err_tri = _rel(x, r), _rel(p, r), _rel(t, r)
        bound = 2 * max(err_plain, floor)
        res[f"rel_{name}"], res[f"rel_plain_{name}"], res[f"rel_triton_{name}"] = err, err_plain, err_tri
        res[f"bound_{name}"] = bound
        res[f"rel_vs_triton_{name}"] = _rel(x, t)
        checks[name] = err <= bound
        res[f"triton_within_{name}"] = err_tri <= bound
    empty = (l == 0).transpose(1, 2)  # (B, Sq, Hq): rows that see no key
    res["empty_rows"] = int(empty.sum().item())
    if res["empty_rows"]:
        checks["empty_rows_zero"] = bool((got[0][empty] == 0).all())
    res.update(status="PASS" if all(checks.values()) else "FAIL", failed=[n for n, ok in checks.items() if not ok])
    return res


_CACHE: dict = {}


def _timing_inputs(t):
    """Inputs and the forward state for a timed shape, shared by the implementations."""
    key = (t["S"], t["H"], t["Hkv"], t["causal"], t.get("Dv", t["D"]))
    if _CACHE.get("key") != key:
        _CACHE.clear()
        torch.cuda.empty_cache()
        g = torch.Generator(device="cuda").manual_seed(0)
        B, S, H, Hkv, D = t["B"], t["S"], t["H"], t["Hkv"], t["D"]
        Dv = t.get("Dv", D)
        dt = _DT[t["dtype"]]
        q = torch.randn(B, S, H, D, device="cuda", dtype=dt, generator=g)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dt, generator=g)
        v = torch.randn(B, S, Hkv, Dv, device="cuda", dtype=dt, generator=g)
        do = torch.randn(B, S, H, Dv, device="cuda", dtype=dt, generator=g)
        o, m, l, _ = _forward_state(q, k, v, q_start=0, k_start=0, causal=t["causal"], scale=D**-0.5)
        _CACHE.update(key=key, q=q, k=k, v=v, do=do, o=o, m=m, l=l)
    return _CACHE


def run_timing(t: dict) -> dict:
    import triton

    from ringflash import kernels as rk

    c = _timing_inputs(t)
    q, k, v, do, o, m, l = (c[x] for x in ("q", "k", "v", "do", "o", "m", "l"))
    B, S, H, D, causal = t["B"], t["S"], t["H"], t["D"], t["causal"]
    scale = D**-0.5
    impl = t["impl"]
    grads = None
    if impl == "sdpa_cudnn":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        G = H // t["Hkv"]
        qs = q.transpose(1, 2).contiguous().requires_grad_()
        ks = k.repeat_interleave(G, dim=2).transpose(1, 2).contiguous().requires_grad_()
        vs = v.repeat_interleave(G, dim=2).transpose(1, 2).contiguous().requires_grad_()
        dos = do.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        fn = lambda: torch.autograd.grad(out, (qs, ks, vs), dos, retain_graph=True)
    else:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grads = (dq, dk, dv)
        if impl == "triton":
            fn = lambda: _triton_backward(
                q, k, v, m, l, do, rk.delta(o, do), dq, dk, dv, q_start=0, k_start=0, causal=causal, scale=scale,
                accumulate=False,
            )  # fmt: skip
        else:
            from ringflash.kernels import gluon_backward as gb

            variant = impl.split(":", 1)[1]
            fn = lambda: gb.backward(
                q, k, v, m, l, do, rk.delta(o, do), dq, dk, dv, q_start=0, k_start=0, causal=causal, scale=scale,
                accumulate=False, config=variant,
            )  # fmt: skip
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    # QK^T and dQ, dK at D; PV, dP and dV at Dv (the two equal: 2.5 x 4 B H S^2 D)
    flops = 2.5 * 4 * B * H * S * S * (D + t.get("Dv", D)) / 2 * (0.5 if causal else 1.0)
    res = {"status": "OK", "ms": ms, "tflops": flops / ms / 1e9}
    if impl.startswith("gluon:"):
        # the parts of the same call: the kernel launch alone (its inputs prepared outside the
        # timed region: delta, the row statistics, the zeroed float32 dQ; it keeps adding into
        # that buffer, which changes nothing in its cost) and the finish (dQ cast / un-permute)
        prep = gb.prepare(
            q, k, v, m, l, do, rk.delta(o, do), dq, dk, dv, q_start=0, k_start=0, causal=causal, scale=scale,
            accumulate=False, config=variant,
        )  # fmt: skip
        prep.launch()
        torch.cuda.synchronize()
        res["kernel_ms"] = triton.testing.do_bench(prep.launch, warmup=25, rep=100, return_mode="median")
        res["kernel_tflops"] = flops / res["kernel_ms"] / 1e9
        res["finish_ms"] = (
            triton.testing.do_bench(prep.finish, warmup=5, rep=25, return_mode="median") if prep.finish else 0.0
        )
        res["rest_ms"] = ms - res["kernel_ms"]  # delta, statistics, zeroing, finish, launch overheads
    if grads is not None:
        if impl.startswith("gluon:"):
            fn()  # the timed launches kept adding into the prepared buffer: compare a fresh call
            torch.cuda.synchronize()
        if impl == "triton":
            c["triton_grads"] = [x.clone() for x in grads]
        elif "triton_grads" in c:
            diffs = [_rel(x, r) for x, r in zip(grads, c["triton_grads"])]
            res["rel_vs_triton"] = max(diffs)
            res["agrees_with_triton"] = res["rel_vs_triton"] <= 2e-2
    return res


def worker(task_file: str) -> None:
    for i, t in json.loads(Path(task_file).read_text()):
        print(gc.START + str(i), flush=True)
        try:
            res = run_timing(t) if t.get("kind") == "time" else run_correctness(t)
        except Exception as e:  # reported, then the next task
            res = {
                "status": "ERROR",
                "error": f"{type(e).__name__}: {str(e)[:400]}",
                "trace": traceback.format_exc()[-1500:],
            }
            if "CUDA" in str(e) or "illegal" in str(e).lower():
                print(gc.RESULT + json.dumps({"i": i, **res}, default=str), flush=True)
                sys.exit(3)  # the context is gone; the parent restarts a fresh process
        print(gc.RESULT + json.dumps({"i": i, **res}, default=str), flush=True)


class Runner(gc.Runner):
    """benchmarks.gluon_check's runner, its children running this script's tasks."""

    script = Path(__file__).resolve()


# ----------------------------------------------------------------------------------------------
# Parent side


def precompile(cases, variants, seqlens, heads, gqa_heads, jobs, D: int = 128, Dv: int | None = None) -> dict:
    """Compile every Gluon backward the cases and timings launch, on the CPU cores in parallel,
    before the GPU work (the launches then find them in triton's cache)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from ringflash.kernels import gluon_backward as gb

    t0 = time.monotonic()
    specs = []
    for c in cases:
        run_correctness(c, plan=specs)
    for v in variants:
        for hkv in sorted({heads, gqa_heads} - {0}):
            for causal in (False, True):
                S = seqlens[0]
                q = torch.empty(1, S, heads, D, dtype=torch.bfloat16)
                k = torch.empty(1, S, hkv, D, dtype=torch.bfloat16)
                v_ = torch.empty(1, S, hkv, Dv or D, dtype=torch.bfloat16)
                do = torch.empty(1, S, heads, Dv or D, dtype=torch.bfloat16)
                m = torch.empty(1, heads, S)
                specs.append(
                    gb.launch_spec(
                        q, k, v_, m, m, do, m, q, k, v_, q_start=0, k_start=0, causal=causal, scale=D**-0.5,
                        accumulate=False, config=v,
                    )
                )  # fmt: skip
    unique = {}
    for sp in specs:
        unique.setdefault(gb.compile_spec(sp, key_only=True), sp)
    errors = []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for sp, (err, _) in zip(unique.values(), ex.map(gb.try_compile_spec, unique.values())):
            if err:
                errors.append({"config": str(sp["config"]), "causal": sp["causal"], "error": err})
    return {"launches": len(specs), "kernels": len(unique), "seconds": time.monotonic() - t0, "errors": errors}


def print_summary(out: dict, variants, seqlens):
    print("\n=== correctness (pass / total; worst err / bound; Triton's worst err / same bound) ===")
    for v in variants:
        rows = [r for r in out["correctness"] if r.get("variant") == v]
        if not rows:
            continue
        npass = sum(r["status"] == "PASS" for r in rows)
        ratio = lambda pre: max(
            (r[f"{pre}{n}"] / r[f"bound_{n}"] for r in rows for n in ("dq", "dk", "dv") if f"{pre}{n}" in r),
            default=float("nan"),
        )
        bad = [r for r in rows if r["status"] != "PASS"]
        print(
            f"{v:8s} {npass:3d}/{len(rows):<3d} worst err/bound {ratio('rel_'):.2f}, triton {ratio('rel_triton_'):.2f}"
            + (
                ""
                if not bad
                else "  NOT PASSING: "
                + ", ".join(
                    f"{r['id']}={r['status']}{'(' + ','.join(r.get('failed', [])) + ')' if r.get('failed') else ''}"
                    for r in bad[:8]
                )
            )
        )
    if not out["timing"]:
        return
    impls = ["sdpa_cudnn", "triton"] + [f"gluon:{v}" for v in variants]
    shape = lambda r: (r["S"], r["causal"], r["Hkv"])  # noqa: E731
    by = gc.timing_medians(out["timing"], shape)
    shapes = sorted({(r["S"], r["causal"], r["Hkv"]) for r in out["timing"]}, key=lambda x: (x[2] != 32, x))
    names = [i.replace("gluon:", "") for i in impls]
    print(
        f"\n=== backward TFLOP/s (B=1, H={out['meta']['heads']}, D={out['meta']['head_dim']}, bf16; "
        "2.5 x forward FLOPs) ==="
    )
    print(
        f"{'S':>6} {'causal':>6} {'Hkv':>4} | "
        + " ".join(f"{n[:10]:>10}" for n in names)
        + " | best gluon / triton, cudnn"
    )
    for S, causal, hkv in shapes:
        vals, best = [], None
        for i in impls:
            r = by.get((i, S, causal, hkv))
            t = r.get("tflops") if r else None
            mark = "" if not r or r.get("agrees_with_triton", True) else "!"
            vals.append(f"{t:9.1f}{mark or ' '}" if t else f"{(r or {}).get('status', '-')[:9]:>10}")
            if t and i.startswith("gluon") and not mark and (best is None or t > best[1]):
                best = (i, t)
        tri = (by.get(("triton", S, causal, hkv)) or {}).get("tflops")
        cu = (by.get(("sdpa_cudnn", S, causal, hkv)) or {}).get("tflops")
        tail = "-"
        if best:
            tail = f"{best[0][6:]} {best[1] / tri:.2f}x" if tri else best[0][6:]
            tail += f", {best[1] / cu:.2f}x" if cu else ""
        print(f"{S:>6} {str(causal):>6} {hkv:>4} | " + " ".join(vals) + f" | {tail}")
    print("('!' = gradients differ from the Triton backward's by more than 2e-2 relative)")
    gl_impls = [i for i in impls if i.startswith("gluon:")]
    if any("kernel_ms" in r for r in out["timing"]):
        print("\n=== Gluon kernel alone: TFLOP/s (ms outside the kernel: delta, statistics, zeroing, finish) ===")
        print(f"{'S':>6} {'causal':>6} {'Hkv':>4} | " + " ".join(f"{i[6:][:16]:>16}" for i in gl_impls))
        for S, causal, hkv in shapes:
            cells = []
            for i in gl_impls:
                r = by.get((i, S, causal, hkv)) or {}
                cells.append(f"{r['kernel_tflops']:7.1f} ({r['rest_ms']:5.2f})" if "kernel_ms" in r else f"{'-':>16}")
            print(f"{S:>6} {str(causal):>6} {hkv:>4} | " + " ".join(f"{c:>16}" for c in cells))
    gc.print_round_ratios(out["timing"], gl_impls, shape, shapes, f"{'S':>6} {'causal':>6} {'Hkv':>6}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=Path("gluon_bwd.json"))
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"default: {' '.join(DEFAULT_VARIANTS)} (ws2_s3, ws2_rot: measured, no gain; 'all': every variant)",
    )
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128, help="of every case and timing (the variants must take it)")
    ap.add_argument("--v-head-dim", type=int, default=None, help="v's head dim apart (default: --head-dim), e.g. 128")
    ap.add_argument("--gqa-heads", type=int, default=8, help="kv heads of the one GQA timing (0: none)")
    ap.add_argument("--quick", action="store_true", help="S=16K only and the smaller correctness set")
    gc.add_rounds_arg(ap)
    ap.add_argument("--full-correctness-for", nargs="*", default=["ws2"], help="variants that get the full set")
    ap.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="processes compiling the Gluon kernels before the GPU work (0: compile at first launch)",
    )
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--time-failing", action="store_true", help="also time variants that did not pass")
    ap.add_argument("--case-timeout", type=float, default=90.0, help="seconds per case before it counts as hung")
    ap.add_argument("--timing-timeout", type=float, default=120.0, help="seconds per timing before it counts as hung")
    ap.add_argument("--no-family-skip", action="store_true", help="after a hang skip only that variant")
    ap.add_argument(
        "--deadline",
        type=float,
        default=330.0,
        help="start no new case after this many seconds (the run ends at most a timeout later)",
    )
    ap.add_argument(
        "--cpu-dry-run",
        nargs="?",
        const="emulate",
        choices=["emulate", "bug"],
        help="check this script on a CPU: a float32 emulation replaces the kernel ('bug': a wrong one)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)

    if args.cpu_dry_run:
        os.environ["GLUON_BWD_CHECK_FAKE"] = args.cpu_dry_run
        args.skip_timing = True
    t0 = time.monotonic()
    deadline = t0 + args.deadline
    from ringflash.kernels import gluon_backward as gb

    variants = args.variants or DEFAULT_VARIANTS
    if variants == ["all"]:
        variants = list(gb.VARIANTS)
    unknown = [v for v in variants if v not in gb.VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(gb.VARIANTS)}")
    seqlens = [16384] if args.quick else args.seqlens
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "gluon": gb.HAS_GLUON,
        "gluon_error": gb.GLUON_ERROR,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "v_head_dim": args.v_head_dim or args.head_dim,
        "variants": {v: {D: vars(c) for D, c in gb.VARIANTS[v].items()} for v in variants},
        "argv": sys.argv[1:],
        "dry_run": args.cpu_dry_run,
    }
    out = {"meta": meta, "correctness": [], "timing": []}
    print(json.dumps({k: meta[k] for k in ("gpu", "capability", "torch", "triton", "python", "gluon")}), flush=True)

    def save():
        args.json.write_text(json.dumps(out, indent=1, default=str))

    def sink(section):
        def f(row):
            out[section].append(row)
            save()
            if section == "correctness":
                if "rel_dq" in row:
                    errs = " ".join(
                        f"{n} {row[f'rel_{n}']:.1e}/{row[f'bound_{n}']:.1e} (tri {row[f'rel_triton_{n}']:.1e})"
                        for n in ("dq", "dk", "dv")
                    )
                else:
                    errs = str(row.get("error") or row.get("why") or row.get("stderr_tail", ""))[-400:]
                print(
                    f"{row['status']:7s} {row['id']:10s} B{row['B']} {row['Sq']}x{row['Sk']} H{row['Hq']}/{row['Hkv']} "
                    f"{row['dtype']} causal={int(row['causal'])} q0={row['q_start']} k0={row['k_start']} "
                    f"acc={int(row['accumulate'])} dq={row['dq']} {errs} "
                    f"{'failed=' + ','.join(row['failed']) if row.get('failed') else ''}",
                    flush=True,
                )
            else:
                extra = f" vs triton {row['rel_vs_triton']:.1e}" if "rel_vs_triton" in row else ""
                if "kernel_ms" in row:
                    extra += (
                        f"; kernel alone {row['kernel_ms']:.3f} ms {row['kernel_tflops']:.1f} TFLOP/s, "
                        f"rest {row['rest_ms']:.3f} ms (finish {row['finish_ms']:.3f})"
                    )
                print(
                    f"{row['status']:7s} {row['impl']:14s} S={row['S']} causal={int(row['causal'])} Hkv={row['Hkv']} "
                    + (
                        f"{row['ms']:.3f} ms {row['tflops']:.1f} TFLOP/s{extra}"
                        if "tflops" in row
                        else str(row.get("error") or row.get("why") or row.get("stderr_tail", ""))[-400:]
                    ),
                    flush=True,
                )

        return f

    per_variant = (
        []
        if args.skip_correctness
        else [
            correctness_cases(
                v, lite=args.quick or v not in args.full_correctness_for, D=args.head_dim, Dv=args.v_head_dim
            )  # fmt: skip
            for v in variants
        ]
    )
    # round robin over the variants: each variant's first cases run early
    cases = [
        c
        for i in range(max(map(len, per_variant), default=0))
        for cs in per_variant
        if i < len(cs)
        for c in cs[i : i + 1]
    ]
    if args.jobs > 0 and gb.HAS_GLUON and not args.cpu_dry_run:
        try:
            pre = precompile(
                cases, [] if args.skip_timing else variants, seqlens, args.heads, args.gqa_heads, args.jobs,
                args.head_dim, args.v_head_dim,
            )  # fmt: skip
        except Exception as e:  # only a speed-up: the launches compile on their own
            pre = {"launches": 0, "kernels": 0, "seconds": 0.0, "errors": [], "failed": f"{type(e).__name__}: {e}"}
            print(f"precompile failed ({pre['failed'][:300]}); kernels compile at first launch", flush=True)
        meta["precompile"] = pre
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
    passing = set(variants)
    if cases:
        Runner(args.case_timeout, deadline, sink("correctness"), family=not args.no_family_skip).run(cases)
        passing = {v for v in variants if all(r["status"] == "PASS" for r in out["correctness"] if r["variant"] == v)}
    timed = [] if args.skip_timing else variants if args.time_failing else [v for v in variants if v in passing]
    if not args.skip_timing:
        gqa = args.gqa_heads if args.gqa_heads != args.heads else 0
        tasks = timing_tasks(timed, seqlens, args.heads, gqa, args.head_dim, args.v_head_dim, args.rounds)
        Runner(args.timing_timeout, deadline, sink("timing")).run(tasks)
    meta["elapsed_s"] = time.monotonic() - t0
    save()
    print(
        f"\nwrote {args.json} ({meta['elapsed_s']:.0f} s); variants passing correctness: {sorted(passing)}; "
        f"timed: {timed}"
    )
    print_summary(out, variants, seqlens)


if __name__ == "__main__":
    main()
