"""What the benchmarks share: timing on one device and across ranks, FLOP counts, the ring
benchmarks' shape options, process-group start, inputs and result metadata."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from ringflash.dist_env import init_from_env


def parse_clock_samples(text: str) -> dict:
    """nvidia-smi's lines "SM MHz, power W" (--format=csv,noheader,nounits) as their medians and
    count: {"sm_mhz", "power_w", "samples"}; lines that are not two numbers ("[N/A]") are left
    out, and with none left the medians are NaN."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except (ValueError, IndexError):
            continue
    if not samples:
        return {"sm_mhz": math.nan, "power_w": math.nan, "samples": 0}
    clocks, watts = zip(*samples)
    return {"sm_mhz": statistics.median(clocks), "power_w": statistics.median(watts), "samples": len(samples)}


@functools.cache
def power_field(index: int = 0) -> str:
    """nvidia-smi's instantaneous power reading, "power.draw.instant", where this driver has
    it; else "power.draw", a one-second average (a timing of a second or two then reads
    mostly the idle before it). Asked once per GPU."""
    import subprocess

    command = ["nvidia-smi", "-i", str(index), "--query-gpu=power.draw.instant", "--format=csv,noheader,nounits"]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=30)
        float(probe.stdout.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return "power.draw"
    return "power.draw.instant" if probe.returncode == 0 else "power.draw"


class ClockSampler:
    """The SM clock and power draw (power_field) of GPU `index`, sampled by nvidia-smi every
    `period_ms` while the block runs (the block starts once nvidia-smi has sampled once); .result
    is parse_clock_samples' dict of the samples after that first one, once the block ends, and
    .between(t0, t1) the same of those that arrived between two time.perf_counter() readings. A
    timing's clock: what sustained power or heat leaves a kernel, which a kernel's own counters
    do not show."""

    def __init__(self, index: int = 0, period_ms: int = 50):
        self.command = ["nvidia-smi", "-i", str(index), f"--query-gpu=clocks.sm,{power_field(index)}",
                        "--format=csv,noheader,nounits", "-lms", str(period_ms)]  # fmt: skip
        self.result = None
        self.samples = []  # (time.perf_counter() at arrival, nvidia-smi's line)

    def __enter__(self):
        import subprocess
        import threading

        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        # wait for nvidia-smi's first sample (its start takes longer than a short timing: a
        # fixed 0.1 s wait left most samples after the work, at idle) and drop it: taken before
        # the timed work starts
        self.process.stdout.readline()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        for line in self.process.stdout:
            self.samples.append((time.perf_counter(), line))

    def __exit__(self, *exc):
        self.process.terminate()
        self.process.wait()
        self.reader.join()
        self.result = self.between(-math.inf, math.inf)
        return False

    def between(self, t0: float, t1: float) -> dict:
        return parse_clock_samples("".join(line for t, line in self.samples if t0 <= t <= t1))


def attention_flops(B, H, S, D, causal, mode, Sk=None):
    """FLOPs of attention over S queries and Sk (default S) keys: forward 4*B*H*S*Sk*D, half for
    causal; forward+backward 3.5x, the backward alone ("bwd") 2.5x."""
    f = 4 * B * H * S * (S if Sk is None else Sk) * D * (0.5 if causal else 1.0)
    return f * {"fwd+bwd": 3.5, "bwd": 2.5}.get(mode, 1.0)


def in_rounds(items, rounds: int) -> list:
    """(round, item) in timing order: each item once a round, the order reversed every other
    round, so that a clock drifting during a shape's timings falls on each alike."""
    items = list(items)
    return [(r, i) for r in range(rounds) for i in (items if r % 2 == 0 else items[::-1])]


def bench_ms(fn, device) -> float:
    """Milliseconds of fn(): the median of triton.testing.do_bench on a GPU, the median of 3
    runs after one warm-up on CPU."""
    if torch.device(device).type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def host_seconds(fn, device, *, calls=1, repeats=1, warmup=1, host_only=False) -> float:
    """Host-clock seconds per call of fn(): `warmup` calls, then `repeats` times `calls` calls
    in a row with one synchronize at the end (a GPU's queue drained before and after), the
    median over the repeats divided by `calls`. Unlike bench_ms it counts the host's own time,
    which decides at short sequences. host_only: the clock stops once the calls are issued,
    before the synchronize: the host's time alone even where the device's is longer."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if not host_only:
            sync()
        times.append((time.perf_counter() - t0) / calls)
        if host_only:  # drained after the clock stopped, before the next repeat
            sync()
    return statistics.median(times)


def kernel_times(fn, device, calls=1) -> list[tuple[str, int, float]]:
    """`calls` calls of fn() under torch.profiler after a synchronize: [(name, count, ms)] of the
    kernels and copies by device time, most first (on the CPU: the operators by CPU time)."""
    return profiled_kernels(fn, device, calls)[0]


def profiled_kernels(fn, device, calls=1, blocks=None) -> tuple[list[tuple[str, int, float]], dict[str, float]]:
    """kernel_times' rows, and with `blocks` (a test on a torch.profiler.record_function
    block's name) how their total splits over such blocks: {name: ms} of the work inside each,
    counted to the innermost one (a block inside another is not counted in it), and {None: ms}
    the rest, so that the split sums to one profile's total. On CUDA the device ms of the
    kernels and copies launched inside (from as many calls profiled again with the host's
    events: the rows' total can differ from the split's, as copies beside kernels on another
    stream last longer or shorter from one run to the next, so figures that subtract a block
    take every part from the split), on the CPU the torch operators' own CPU ms there."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spent = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731

    def profiled(activities):
        sync()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            sync()
        return prof

    prof = profiled([ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=lambda e: -spent(e))
    rows = [(e.key, e.count, spent(e) / 1e3) for e in events]
    split = {}
    if blocks is not None:
        if cuda:
            split = _device_ms_by_block(profiled([ProfilerActivity.CPU, ProfilerActivity.CUDA]), blocks)
        else:
            for e in prof.events():
                if e.name.startswith("aten::"):
                    name = _innermost_block(e, blocks)
                    split[name] = split.get(name, 0.0) + e.self_cpu_time_total / 1e3
    return rows, split


def _device_ms_by_block(prof, blocks) -> dict[str, float]:
    """{block name: device ms} of a CUDA profile's kernels, copies and fills, each counted to the
    innermost record_function block (whose name passes `blocks`) open on the host when its
    launch was made: every launch, the package's own Triton and Gluon ones too, which no torch
    operator encloses; None: the ones outside every block (or whose launch was not seen). Time
    alone places a launch (the replay runs one host thread at a time: the backward's thread
    while the caller waits)."""
    return split_device_events(prof.profiler.kineto_results.events(), blocks)


def split_device_events(events, blocks) -> dict[str, float]:
    """_device_ms_by_block over kineto events (name(), device_type(), start_ns(), end_ns(),
    duration_ns(), correlation_id()). A record_function block also shows on the device's
    timeline as an event of its own name spanning the work launched inside it (a GPU user
    annotation, in some torch versions): such events are no work and are not counted, or every
    block's time would be counted twice, once more outside every block."""
    on_device = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    on_host = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    spans = sorted(
        ((e.start_ns(), e.end_ns(), e.name()) for e in on_host if blocks(e.name())),
        key=lambda span: span[1] - span[0],  # the innermost (shortest) first
    )
    annotations = {name for _, _, name in spans}
    # the CUDA runtime's and driver's launch calls (cudaLaunchKernel, cuLaunchKernelEx,
    # cudaMemcpyAsync, ...), by the correlation id their device work carries too
    launch_calls = ("Launch", "Memcpy", "Memset")
    launched_at = {
        e.correlation_id(): e.start_ns()
        for e in on_host
        if e.name().startswith("cu") and any(word in e.name() for word in launch_calls)
    }
    split = {}
    for e in on_device:
        t = launched_at.get(e.correlation_id())
        if t is None and e.name() in annotations:
            continue
        name = None if t is None else next((n for start, end, n in spans if start <= t <= end), None)
        split[name] = split.get(name, 0.0) + e.duration_ns() / 1e6
    return split


def _innermost_block(event, blocks):
    """The name of the innermost event, `event` itself or one enclosing it (the CPU profile's
    tree of operators), whose name passes `blocks`; None if none does."""
    while event is not None:
        if blocks(event.name):
            return event.name
        event = event.cpu_parent
    return None


DOCUMENTS_BACKWARDS = ("default", "fused", "persistent", "heavy-first", "one-block", "two-pass")


@contextlib.contextmanager
def documents_backward(name: str):
    """Inside the block packed documents' backward (configs.GLUON_BWD_DOCUMENTS) is as configured
    ("default"), the fused Gluon kernel wherever it runs ("fused"), at D = 64 and 128 the fused
    kernel in persistent programs ("persistent": ws2_lag_pc; "heavy-first": ws2_lag_pch, the key
    blocks handed out most query blocks first) or one key block a program ("one-block": ws2_lag),
    or the two Triton passes ("two-pass")."""
    from ringflash.kernels import configs

    at = lambda variant: {**configs.GLUON_BWD_DOCUMENTS, 64: variant, 128: variant}  # noqa: E731
    tables = {
        "default": configs.GLUON_BWD_DOCUMENTS,
        "fused": configs.GLUON_BWD,
        "persistent": at("ws2_lag_pc"),
        "heavy-first": at("ws2_lag_pch"),
        "one-block": at("ws2_lag"),
        "two-pass": {},
    }
    with mock.patch.object(configs, "GLUON_BWD_DOCUMENTS", dict(tables[name])):
        yield


DOCUMENTS_FORWARDS = ("default", "gluon", "triton", "seeing-rows")


@contextlib.contextmanager
def documents_forward(name: str):
    """Inside the block packed documents' forward (configs.GLUON_FWD_DOCUMENTS and its
    GLUON_DOCUMENTS_MIN_KEYS_PER_ROW) is as configured ("default"), the Gluon kernel wherever
    it runs, whatever the keys per row ("gluon"), the Triton kernel ("triton"), or as configured
    with the keys per row counted over the rows that see a key ("seeing-rows":
    configs.GLUON_DOCUMENTS_SEEING_ROWS on)."""
    from ringflash.kernels import configs

    variants = {} if name == "triton" else configs.GLUON_FWD_DOCUMENTS
    least = {} if name == "gluon" else configs.GLUON_DOCUMENTS_MIN_KEYS_PER_ROW
    seeing = name == "seeing-rows" or configs.GLUON_DOCUMENTS_SEEING_ROWS
    with (
        mock.patch.object(configs, "GLUON_FWD_DOCUMENTS", dict(variants)),
        mock.patch.object(configs, "GLUON_DOCUMENTS_MIN_KEYS_PER_ROW", dict(least)),
        mock.patch.object(configs, "GLUON_DOCUMENTS_SEEING_ROWS", seeing),
    ):
        yield


def step_fn(call, inputs, do, mode):
    """fn() running call() without gradients (mode "fwd"), forward + backward with dO = do
    ("fwd+bwd"), or the backward alone ("bwd"): call() runs once here and fn() takes the
    gradients of inputs from its output, the graph kept for the next fn()."""

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        call().backward(do)

    if mode == "bwd":
        out = call()
        return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)
    return fwd if mode == "fwd" else fwd_bwd


def timed_on_ranks(fn, *, iters, warmup, device):
    """Median milliseconds of fn() on this rank (CUDA events on GPUs), then the maximum over
    the default group's ranks."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    times = []
    dist.barrier()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


@contextlib.contextmanager
def cuts_aligned(align: int, min_piece: int = 0):
    """An experiment, not the package's behaviour: inside, balanced_layout cuts a document over
    the ranks at multiples of `align` tokens from its start (balance._cuts' inner bounds
    rounded; each piece then off an even split by up to align tokens), so that fewer kernel
    tiles straddle two pieces. min_piece: only where the even pieces (n / parts: a causal
    document's zigzag chunk, n / 2P) are at least this many tokens long; shorter ones keep
    their exact cuts. align=1: unchanged."""
    if align <= 1:
        yield
        return
    from ringflash import balance

    plain = balance._cuts

    def aligned(start, n, parts):
        runs = plain(start, n, parts)
        if n < min_piece * parts:  # short pieces: rounding by up to align would unbalance them
            return runs
        bounds = [start] + [start + min(n, align * round((b - start) / align)) for _, b in runs[:-1]] + [start + n]
        return list(zip(bounds, bounds[1:]))

    with mock.patch.object(balance, "_cuts", aligned):
        yield


FIXED_STEPS = 7.6  # a kernel program's fixed cost in block steps (D=128; benchmarks.packed_ring_tiles derives it)


def _piece_cost(qa: int, qb: int, ka: int, kb: int, cost: str) -> float:
    """Causal queries [qa, qb) against keys [ka, kb) of one document: "pairs", the visible
    pairs; "programs", those in 64 x 128 block steps plus FIXED_STEPS for each 128-key block
    the backward walks and each 128-row query tile the forward walks (packed_ring_tiles' model)."""
    from ringflash import balance
    from ringflash.masks import CAUSAL

    pairs = balance._pairs(qa, qb - qa, ka, kb - ka, CAUSAL)
    if cost == "pairs" or pairs == 0:
        return pairs
    blocks = math.ceil((min(kb, qb) - ka) / 128) + math.ceil((qb - max(qa, ka)) / 128)
    return pairs / (64 * 128) + FIXED_STEPS * blocks


def few_rank_layout(
    cu_seqlens, world: int, *, causal: bool = True, window_size=(-1, -1), per_shard: int = 2, ranks=None,
    cost: str = "pairs",
):  # fmt: skip
    """An experiment, not the package's behaviour: balanced_layout's whole documents where it
    keeps them, and each document it cuts zigzagged over k consecutive ranks (2k chunks, rank
    o + i holding chunks i and 2k-1-i) instead of all P: k = `ranks`, or min(P, max(2,
    ceil(per_shard x n / (total / P)))); largest first, each at the ring offset o that leaves
    the sum over ring steps of the busiest rank's cost least (_piece_cost: visible pairs, or
    with the kernel programs' fixed costs). Longer pieces mean fewer kernel programs a step, and
    with k = 2 the ring runs steps 0, 1 and P - 1 only, at the price of uneven steps. Causal
    attention only."""
    from ringflash import balance
    from ringflash.masks import CAUSAL
    from ringflash.schedule import Segment

    if not causal or tuple(window_size) != (-1, -1):
        raise ValueError("few_rank_layout: causal attention without a window only")
    base = balance.balanced_layout(cu_seqlens, world, causal=True)
    cu = list(base.cu_seqlens)
    holders = {}  # document -> the ranks holding it
    for r in range(world):
        for seg in base.segments(r):
            holders.setdefault(seg.doc, set()).add(r)
    per_rank = [[seg for seg in base.segments(r) if len(holders[seg.doc]) == 1] for r in range(world)]

    def step_costs(pieces):  # [step][rank] of one document's pieces, (start, end) per rank
        return [
            [sum(_piece_cost(qa, qb, ka, kb, cost) for qa, qb in pieces[r] for ka, kb in pieces[(r - s) % world])
             for r in range(world)]
            for s in range(world)
        ]  # fmt: skip

    load = [[0] * world for _ in range(world)]  # [step][rank]; whole documents: step 0
    load[0] = [sum(_piece_cost(g.global_start, g.global_start + g.length, g.global_start,
                               g.global_start + g.length, cost) for g in segs) for segs in per_rank]  # fmt: skip
    shard = cu[-1] / world
    for d in sorted((d for d, rs in holders.items() if len(rs) > 1), key=lambda d: -(cu[d + 1] - cu[d])):
        start, n = cu[d], cu[d + 1] - cu[d]
        k = min(world, ranks or max(2, math.ceil(per_shard * n / shard)))
        chunks = balance._cuts(start, n, 2 * k)
        best = None
        for offset in range(world):
            pieces = [[] for _ in range(world)]
            for i in range(k):
                pieces[(i + offset) % world] += [c for c in (chunks[i], chunks[2 * k - 1 - i]) if c[1] > c[0]]
            new = [[a + b for a, b in zip(row, add)] for row, add in zip(load, step_costs(pieces))]
            total = sum(max(row) for row in new)
            if best is None or total < best[0]:
                best = (total, pieces, new)
        _, pieces, load = best
        for r in range(world):
            per_rank[r] += [Segment(0, a, b - a, d) for a, b in pieces[r]]
    return balance._assembled(cu, world, CAUSAL, per_rank)


def ring_time(
    forward, backward, ready, steps, kv_hop_ms: float = 0.0, grad_hop_ms: float = 0.0, grad_chunks: int = 1
) -> float:
    """A ring call's time from each rank's time inside each ring step, forward[r][s] and
    backward[r][s] (ms), and the time each rank spends before its forward's first step
    (ready[r]), with the ring's own dependencies: a step starts after the rank's previous run
    step and once the block it computes on has arrived: in the forward the K/V its sender
    (the rank that held it at the previous run step) started that step with, kv_hop_ms after
    that start (ring._ring_kv starts a hop as it hands the caller the block before it); in the
    backward the dK/dV accumulators its sender finished that step with, in grad_chunks kv-head
    chunks sent one after another from that end (relay.GradRelay), each grad_hop_ms /
    grad_chunks, the step's time split evenly over them, each chunk computed once it has come.
    Hops take no time by default; steps: the ring steps that run, ascending from 0. Returns
    each rank's end of its backward."""
    world = len(forward)

    def phase(cost, begin, after_end, hop_ms, chunks):
        start = {(r, steps[0]): begin[r] for r in range(world)}
        end = {(r, steps[0]): begin[r] + cost[r][steps[0]] for r in range(world)}
        for prev, s in zip(steps, steps[1:]):
            for r in range(world):
                src = (r - (s - prev)) % world
                sent = (end if after_end else start)[(src, prev)]
                t = end[(r, prev)]
                for c in range(chunks):  # chunk c arrives (c + 1) chunk hops after the send began
                    t = max(t, sent + (c + 1) * hop_ms / chunks) + cost[r][s] / chunks
                start[(r, s)], end[(r, s)] = max(end[(r, prev)], sent + hop_ms / chunks), t
        return [end[(r, steps[-1])] for r in range(world)]

    return phase(backward, phase(forward, ready, False, kv_hop_ms, 1), True, grad_hop_ms, max(1, grad_chunks))


def dependent_ring_ms(
    forward, backward, compute, kv_hop_ms: float = 0.0, grad_hop_ms: float = 0.0, grad_chunks: int = 1
) -> float:
    """The busiest rank's time by the ring's own dependencies (ring_time, its hop arguments as
    there) from each rank's measured time in each ring step, forward[r][s] and backward[r][s]
    (ms), and its whole time compute[r] (ms): the steps that run (step 0 and any step some rank
    has time in), each rank's time outside its steps added after them."""
    world = len(forward)
    both = [[f + b for f, b in zip(fr, br)] for fr, br in zip(forward, backward)]
    outside = [c - sum(steps) for c, steps in zip(compute, both)]
    run = running_steps(forward, backward)
    ends = ring_time(forward, backward, [0.0] * world, run, kv_hop_ms, grad_hop_ms, grad_chunks)
    return max(e + o for e, o in zip(ends, outside))


def running_steps(forward, backward) -> list[int]:
    """The ring steps that run, from each rank's measured time in each step, forward[r][s] and
    backward[r][s]: step 0 and any step some rank has time in."""
    world = len(forward)
    return [s for s in range(world) if s == 0 or any(forward[r][s] + backward[r][s] for r in range(world))]


def kv_bytes_sent(layout, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K/V bytes each rank of a packed ring sends in one forward: one block a hop (layout.hops -
    1 hops), padded to the longest shard as the ring sends it."""
    return (layout.hops - 1) * layout.max_local_len * kv_heads * head_dim * 2 * itemsize


def add_align_args(ap):
    """The aligned-cuts experiment's options (cuts_aligned): --align and --align-min-piece."""
    ap.add_argument("--align", type=int, default=1, help="an experiment: cuts at multiples of it (common.cuts_aligned)")
    ap.add_argument(
        "--align-min-piece",
        type=int,
        default=0,
        help="with --align: round only cuts of documents whose even pieces are at least this many tokens",
    )


def add_local_args(ap, seqlens) -> None:
    """The options of the one-GPU kernel benchmarks beside a peer (benchmarks.dropout,
    benchmarks.key_padding): sequence lengths, head dims, heads, the JSON file, a CPU smoke run."""
    ap.add_argument("--seqlens", type=int, nargs="+", default=seqlens)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")


def add_shape_args(ap):
    """The attention-shape options of the ring benchmarks."""
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=None, help="GQA: K/V heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)


def start_ring(args, script, *, timeout_s):
    """Join torchrun's process group (2 or more ranks, else exit naming `script`); returns
    (rank, world, device, dtype): bf16, or float32 for --smoke on CPU."""
    rank, world, device = init_from_env(timeout_s=timeout_s)
    if world < 2:
        sys.exit(f"{script}: start it on 2 or more processes (ringflash-run -m benchmarks.{script})")
    dtype = torch.float32 if args.smoke and device.type == "cpu" else torch.bfloat16
    return rank, world, device, dtype


def rank_inputs(args, S_local, rank, device, dtype):
    """This rank's q, k, v (requiring grad) and dO, (B, S_local, heads, D) in dtype, seeded by rank."""
    g = torch.Generator(device=device).manual_seed(rank)
    mk = lambda H: torch.randn(args.batch, S_local, H, args.head_dim, device=device, dtype=dtype, generator=g)
    q, k, v = (t.requires_grad_() for t in (mk(args.heads), mk(args.kv_heads), mk(args.kv_heads)))
    return q, k, v, torch.randn_like(q)


def bench_device(smoke: bool) -> tuple[torch.device, torch.dtype]:
    """Where a benchmark runs and in what dtype: the GPU in bfloat16, or the CPU in float32 when
    there is none or for a smoke run (--smoke: tiny sizes, CI keeps the script working)."""
    if torch.cuda.is_available() and not smoke:
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def device_name(device) -> str:
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def result_meta(device, **extra) -> dict:
    """What a result file says about the run: the device, torch's version, the date, extra."""
    return {"device": device_name(device), "torch": torch.__version__, **extra, "date": time.strftime("%Y-%m-%d")}


def run_meta(args, world, device, dtype, **extra):
    """What a ring benchmark's result file says about the run."""
    return {
        "world": world,
        "device": device_name(device),
        "torch": torch.__version__,
        "dtype": str(dtype),
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        **extra,
        "backend": dist.get_backend(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(path: Path | None, data) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
