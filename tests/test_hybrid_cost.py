"""The hybrid split's cost model (ringflash.cost) and its scripts, on CPU."""

import json
import sys

import pytest

from ringflash.cost import Links, head_group_candidates, hybrid_step_time, recommend_head_group

from commands import run


def test_terms_by_hand():
    """S = 8192, Hq = Hkv = 8, D = 64, R = 2, U = 2 on one node of 4: each term from its formula."""
    links = Links(intra_gbps=100.0, inter_gbps=10.0, latency_s=0.0)
    t = hybrid_step_time(8192, 8, 8, 64, 2, 2, gpus_per_node=4, links=links, kernel_tflops=100.0)
    flops = 4 * 8 * 8192**2 * 64 * 0.5 * 3.5
    assert t.compute == pytest.approx(flops / 4 / 100e12)
    tok = 2048 * 64 * 2  # one head of a rank's 2048 tokens, bf16
    a2a = 2 * (2 * tok * 8 / 2 + 2 * tok * 4 * 1)  # q and out: half of 8 heads; k, v: 4 heads to the 1 other
    assert t.all_to_all == pytest.approx(a2a / 100e9)
    assert t.ring_link_gbps == 100.0  # the ring stays in the node
    hop_f = 2 * 4096 * 4 * 64 * 2 / 100e9
    c_f = t.compute / 3.5 / 2
    assert t.ring_exposed == pytest.approx(max(0.0, hop_f - c_f) + max(0.0, hop_f * 3 - t.compute * 2.5 / 3.5 / 2))
    # across nodes (8 GPUs on nodes of 4) the ring's hops take the network
    assert hybrid_step_time(8192, 8, 8, 64, 4, 2, gpus_per_node=4, links=links).ring_link_gbps == 10.0


def test_recommendation_follows_the_network():
    """Many nodes, short shards: a slow network makes larger head groups win; a network as fast
    as NVLink leaves the plain ring (nothing exchanged by all-to-all) best."""
    kw = dict(S=1 << 20, Hq=32, Hkv=8, D=128, gpus=512)
    slow, _ = recommend_head_group(**kw, links=Links(inter_gbps=50.0))
    fast, times = recommend_head_group(**kw, links=Links(inter_gbps=400.0, intra_gbps=400.0))
    assert slow > 1 and fast == 1
    assert [t.U for t in times] == [1, 2, 4, 8] and all(t.R * t.U == 512 for t in times)


def test_candidates_and_errors():
    assert head_group_candidates(32, 8) == [1, 2, 4, 8]
    # 3 does not divide 8; 4 neither divides 6 nor is divided by it; 8 does not divide 12
    assert head_group_candidates(12, 6) == [1, 2]
    with pytest.raises(ValueError, match="cannot split 6 q heads"):
        hybrid_step_time(1024, 6, 6, 64, 2, 4)
    with pytest.raises(ValueError, match="inside a node"):
        hybrid_step_time(1024, 32, 8, 64, 1, 16)


def test_cost_script(tmp_path):
    out = run([sys.executable, "-m", "benchmarks.hybrid_cost", "--json", str(tmp_path / "c.json")], tmp_path)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["model_only"] and sorted({r["nodes"] for r in data["rows"]}) == [1, 2, 4, 8, 16, 32, 64]
    assert sum(r["best"] for r in data["rows"]) == 7 and "MODEL (not measured)" in out


def test_compute_script_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.hybrid_compute", "--smoke", "--json", str(tmp_path / "h.json")], tmp_path)
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert [(r["U"], r["q_heads"], r["kv_heads"]) for r in rows] == [(1, 4, 2), (2, 2, 1), (4, 1, 1)]
    assert all(r["ms"] > 0 for r in rows)


def test_all_to_all_latency_counts_each_exchange():
    """The all-to-all term carries one latency per exchange the hybrid issues (A2A_PER_STEP), and
    none when U = 1 (no exchange)."""
    from ringflash.cost import A2A_PER_STEP

    slow, free = Links(latency_s=1e-3), Links(latency_s=0.0)
    a, b = (hybrid_step_time(8192, 8, 4, 64, 2, 2, links=lk) for lk in (slow, free))
    assert a.all_to_all - b.all_to_all == pytest.approx(A2A_PER_STEP * 1e-3)
    assert hybrid_step_time(8192, 8, 4, 64, 4, 1, links=slow).all_to_all == 0.0
