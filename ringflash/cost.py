"""A cost model for choosing the hybrid split: R ring positions x U head-group ranks.

Pure Python. hybrid_step_time() predicts one attention forward+backward of a sequence of S
tokens over R x U GPUs (ring_flash_attn_func with a head_group of U ranks), from the kernel
rate and two bandwidths; recommend_head_group() picks U.

What is measured and what is only a model: the default kernel rate (440 TFLOP/s forward +
backward, causal, bf16, H=32, D=128) is ringflash's measured rate on one H200 at 16K-64K
tokens per GPU, and the default NVLink figure is of the order our two H200s moved in a ring
send/recv (~345 GB/s each way for 1 GiB). Everything else is only a model, with nothing
measured on several nodes: the InfiniBand rate (a nominal 400 Gb/s per GPU), the all-to-all
time (bytes over the NVLink rate plus a fixed latency, with no contention and nothing
overlapped: the implementation runs the all-to-alls between the compute), the ring hop
(bytes over the slowest link the ring crosses, overlapped with the step's compute as the ring
does), a kernel rate that does not fall for small shards or few heads (it does: measure it
with benchmarks/hybrid_compute.py and pass kernel_tflops), and no other traffic on the links.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """intra_gbps: NVLink, GB/s per direction per GPU; inter_gbps: the network, GB/s per GPU
    (400 Gb/s InfiniBand = 50 GB/s); latency_s: fixed cost of one all-to-all or ring hop."""

    intra_gbps: float = 400.0
    inter_gbps: float = 50.0
    latency_s: float = 20e-6


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one forward+backward, by term, and the resulting efficiency
    (compute / total)."""

    R: int
    U: int
    compute: float  # kernels, per GPU
    all_to_all: float  # head exchanges (in, out; forward and backward), exposed
    ring_exposed: float  # ring hops not hidden behind the step's compute
    ring_link_gbps: float  # the slowest link a ring hop crosses

    @property
    def total(self) -> float:
        return self.compute + self.all_to_all + self.ring_exposed

    @property
    def efficiency(self) -> float:
        return self.compute / self.total


# all-to-alls per forward+backward (ringflash.hybrid: one per tensor exchanged)
A2A_PER_STEP = 8


def kv_heads_per_rank(Hq: int, Hkv: int, U: int) -> int:
    """K/V heads a rank holds after the head exchange (ringflash.hybrid.head_plan's rule);
    ValueError when U does not split the heads."""
    if Hq % U or not ((Hkv >= U and Hkv % U == 0) or (Hkv < U and U % Hkv == 0)):
        raise ValueError(f"a head group of {U} cannot split {Hq} q heads / {Hkv} k/v heads")
    return Hkv // U if Hkv >= U else 1


def hybrid_step_time(
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    R: int,
    U: int,
    *,
    batch: int = 1,
    causal: bool = True,
    dtype_bytes: int = 2,
    gpus_per_node: int = 8,
    links: Links = Links(),
    kernel_tflops: float = 440.0,
) -> StepTime:
    """Predict one forward+backward of attention over S tokens on R x U GPUs.

    S: the whole sequence; Hq, Hkv: query and key/value heads; D: head_dim; R: ring
    positions (the ring's ranks); U: head-group ranks (inside one node: U <= gpus_per_node,
    and head groups of consecutive ranks, as a mesh places them). kernel_tflops: the local
    kernels' forward+backward rate (FLOPs convention of benchmarks: forward 4 B H S^2 D, half
    for causal, forward+backward 3.5x). Returns a StepTime (seconds).

    Terms. compute = FLOPs / (R U) / rate. all_to_all: per rank, q, k, v in and out back
    (forward), dO in and dQ, dK, dV back (backward): (U - 1) / U of the q-sized tensors and,
    for K/V, what every other rank needs of this rank's tokens (its kv heads, replicated when
    Hkv < U), over NVLink, plus one latency per exchange the implementation issues: 8 (q, k,
    v in and out back; dO in and dQ, dK, dV back; one more each for lse and its gradient, or a
    key padding mask, not counted). ring: R steps forward and R backward; a
    forward hop carries K/V of S / R tokens and the rank's kv heads, a backward hop K/V again
    and the float32 dK/dV; a step costs max(its compute, its hop) after the first, and the
    hop's link is NVLink when the whole ring is in one node, else the network (ring
    neighbours kept on one node where possible, so each node's crossing uses its own GPU's
    network link).
    """
    if U > gpus_per_node or gpus_per_node % U:
        raise ValueError(f"U={U} must divide gpus_per_node={gpus_per_node} (a head group stays inside a node)")
    kv = kv_heads_per_rank(Hq, Hkv, U)
    P = R * U
    flops = 4 * batch * Hq * S * S * D * (0.5 if causal else 1.0) * 3.5
    compute = flops / P / (kernel_tflops * 1e12)

    L = S / P  # tokens per rank
    tok = batch * L * D * dtype_bytes  # one head of this rank's tokens
    q_bytes = tok * Hq * (U - 1) / U
    kv_bytes = tok * kv * (U - 1)  # to each of the U - 1 others: the kv heads it needs
    a2a_bytes = 2 * (2 * q_bytes + 2 * kv_bytes)  # forward (q, k, v, out) and backward (dO, dq, dk, dv)
    all_to_all = 0.0 if U == 1 else a2a_bytes / (links.intra_gbps * 1e9) + A2A_PER_STEP * links.latency_s

    ring_exposed, link = 0.0, links.intra_gbps
    if R > 1:
        nodes = -(-P // gpus_per_node)
        link = links.intra_gbps if nodes == 1 else links.inter_gbps
        blk = batch * (S / R) * kv * D  # elements of one K (or V) block
        hop_f = 2 * blk * dtype_bytes / (link * 1e9) + links.latency_s
        hop_b = (2 * blk * dtype_bytes + 2 * blk * 4) / (link * 1e9) + links.latency_s
        c_f, c_b = compute / 3.5 / R, compute * 2.5 / 3.5 / R
        ring_exposed = (R - 1) * (max(c_f, hop_f) - c_f + max(c_b, hop_b) - c_b)
    return StepTime(R, U, compute, all_to_all, ring_exposed, link)


def head_group_candidates(Hq: int, Hkv: int, gpus_per_node: int = 8) -> list[int]:
    """The U (dividing gpus_per_node) that split the heads."""
    out = []
    for U in range(1, gpus_per_node + 1):
        if gpus_per_node % U == 0:
            try:
                kv_heads_per_rank(Hq, Hkv, U)
            except ValueError:
                continue
            out.append(U)
    return out


def recommend_head_group(S, Hq, Hkv, D, gpus: int, **kw) -> tuple[int, list[StepTime]]:
    """(the U with the least predicted time, every candidate's StepTime) for `gpus` GPUs
    (R = gpus / U); kw as hybrid_step_time. Ties go to the smaller U (less exchanged)."""
    g = kw.get("gpus_per_node", 8)
    times = [
        hybrid_step_time(S, Hq, Hkv, D, gpus // U, U, **kw) for U in head_group_candidates(Hq, Hkv, g) if gpus % U == 0
    ]
    if not times:
        raise ValueError(f"no head group size splits {Hq}/{Hkv} heads over {gpus} GPUs")
    best = min(times, key=lambda t: (round(t.total, 12), t.U))
    return best.U, times
