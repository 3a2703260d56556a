"""A replayed packed ring's time with hops that take time, on the host (no GPU): what the replay on
one GPU cannot show, where its transfers are copies beside the kernels.

    python -m benchmarks.ring_time_model results/packed_ring_replay_forward_groups_h100.json \
        --link-gb-s 100 200 400

For each row of a `packed_ring_replay --kernels --json` file: each rank's measured device time in
each ring step, forward and backward (rank_step_forward_ms / rank_step_backward_ms), run through
common.ring_time (by common.dependent_ring_ms) with every hop taking its bytes over --link-gb-s
(a K/V block: the row's bytes sent over its hops; the dK/dV accumulators: the same rows in the
accumulator dtype, float32 unless the row says "input", in the ring's kv-head chunks, one after
another), plus each rank's device time outside the steps, less the replay's own transfers.
Printed: the busiest rank's time and the efficiency (the one-device call over P, over it) with
hops free (the replay's "by the ring's dependencies") and at each bandwidth.

A ring step starts its hop as it is handed the block before (ring._ring_kv), and a forward run of
several steps (balance.FORWARD_GROUP_STEPS) computes in its last step once its blocks have come:
the model charges that run the hops it waits for. Rows whose whole ring is gathered into one
call (gather_max_steps at least the steps that run) compute outside the steps: not modelled,
skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import dependent_ring_ms, running_steps

ITEMSIZE = {"torch.bfloat16": 2, "torch.float16": 2, "torch.float32": 4}


def modelled(row: dict, meta: dict, link_gb_s: list[float]) -> dict | None:
    """{bandwidth (0: hops free): (busiest rank's ms, efficiency)} for one replay row (meta: its
    file's), or None where the row has no per-step figures or gathers its whole ring."""
    fwd, bwd = row.get("rank_step_forward_ms"), row.get("rank_step_backward_ms")
    if not fwd or not bwd:
        return None
    world = row["world"]
    if 1 < len(running_steps(fwd, bwd)) <= (row.get("gather_max_steps") or 0):
        return None
    compute = [d - t for d, t in zip(row["rank_device_ms"], row["rank_transfer_ms"])]
    single_ms = row["device_efficiency"] * world * max(row["rank_device_ms"])
    itemsize = ITEMSIZE[meta.get("dtype", "torch.bfloat16")]
    kv_bytes = row["bytes_sent_per_rank"] / max(row["hops"], 1)
    grad_itemsize = itemsize if row.get("grad_accum_dtype") == "input" else 4
    grad_bytes = kv_bytes * grad_itemsize / itemsize
    # the ring's own kv-head chunk count for these blocks where the row took the default
    chunks = row.get("grad_chunks") or grad_chunks_of(row, meta, grad_itemsize)
    out = {}
    for gb_s in [0.0, *link_gb_s]:
        hop = (lambda b: 0.0) if gb_s == 0 else (lambda b: b / (gb_s * 1e9) * 1e3)  # noqa: E731
        busiest = dependent_ring_ms(fwd, bwd, compute, hop(kv_bytes), hop(grad_bytes), chunks)
        out[gb_s] = (busiest, single_ms / world / busiest)
    return out


def grad_chunks_of(row: dict, meta: dict, grad_itemsize: int) -> int:
    """relay.default_grad_chunks for the row's K/V blocks (the longest shard's rows, as they
    travel), from their shapes alone (tensors on the meta device)."""
    import torch

    from ringflash.relay import default_grad_chunks

    acc = {2: torch.bfloat16, 4: torch.float32}[grad_itemsize]
    k = torch.empty(1, max(row["local_lens"]), meta["kv_heads"], meta["head_dim"], device="meta")
    return min(default_grad_chunks(k, acc), meta["kv_heads"])


KNOBS = ("forward_group_steps", "gather_max_steps", "documents_forward", "documents_backward", "grad_accum_dtype")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("replays", nargs="+", type=Path, help="packed_ring_replay --kernels --json files")
    ap.add_argument("--link-gb-s", type=float, nargs="+", default=[100.0, 200.0, 400.0],
                    help="the bandwidths a hop is modelled at, GB/s each way")  # fmt: skip
    args = ap.parse_args()
    if any(b <= 0 for b in args.link_gb_s):
        ap.error(f"--link-gb-s must be positive, got {args.link_gb_s}")
    for path in args.replays:
        data = json.loads(path.read_text())
        print(f"== {path.name} ({data['meta'].get('device')}): busiest rank ms (efficiency), hops free, then at "
              + ", ".join(f"{b:g}" for b in args.link_gb_s) + " GB/s")  # fmt: skip
        for row in data["rows"]:
            label = f"S={row['total']} P={row['world']} window={row['window']} " + " ".join(
                f"{k}={row.get(k)}" for k in KNOBS if k in row
            )
            got = modelled(row, data["meta"], args.link_gb_s)
            if got is None:
                print(f"  {label}: not modelled (no per-step figures, or its whole ring in one call)")
                continue
            print(f"  {label}: " + " | ".join(f"{ms:.2f} ({eff:.3f})" for ms, eff in got.values()))


if __name__ == "__main__":
    main()
