"""The benchmarks, examples and launch scripts keep working (toy sizes, CPU, gloo)."""

import json
import os
import re
import subprocess
import sys

import pytest

from commands import ROOT, TWO_RANKS, run


def test_bench_local_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.bench_local", "--smoke", "--steady", "2"]
    cmd += ["--json", str(tmp_path / "l.json")]
    out = run(cmd, tmp_path)
    data = json.loads((tmp_path / "l.json").read_text())
    assert len(data["rows"]) == 4 and all(r["ringflash"]["tflops"] > 0 for r in data["rows"])
    assert all(r["ringflash"]["steady_tflops"] > 0 and r["sdpa_math"]["steady_ms"] > 0 for r in data["rows"])
    assert "vs flash" in out and "(calls in a row)" in out


def test_packed_ring_tiles_counts(tmp_path):
    """benchmarks.packed_ring_tiles on a small mix: one line per rank; a ring rank covers at
    least the pairs it sees, and the one-GPU call's covered / visible is at least 1; the time
    model adds the fixed cost once per program that runs."""
    import re

    import torch

    out = run([sys.executable, "-m", "benchmarks.packed_ring_tiles", "--totals", "16384", "--worlds", "2",
               "--fixed-steps", "0"], tmp_path)  # fmt: skip
    single = float(re.search(r"one GPU: covered / visible ([\d.]+)", out).group(1))
    ranks = [float(x) for x in re.findall(r"rank \d: covered / visible ([\d.]+)", out)]
    assert single >= 1.0 and len(ranks) == 2 and all(r >= 1.0 for r in ranks), out
    # with no fixed cost a program the time model is the covered pairs alone
    ratio = r"\(one GPU's / P\) ([\d.]+)"
    pairs = re.findall(rf"covered / {ratio}, (\d+) programs, model \(F=0\) / {ratio}", out)
    assert len(pairs) == 2 and all(c == m and int(n) > 0 for c, n, m in pairs), out
    # one program per key block some query sees, each charged the fixed cost once
    from benchmarks.packed_ring_tiles import covered_pairs, model_steps

    q_lo = torch.tensor([0] * 128 + [5] * 128)  # keys 0..127 seen by rows [0, 70); 128..255 by none
    q_hi = torch.tensor([70] * 128 + [5] * 128)
    covered, visible, programs = covered_pairs(q_lo, q_hi, 256, 256, 0, 64, 128)
    assert (covered, visible, programs) == (2 * 64 * 128, 70 * 128, 1)
    assert model_steps(covered, programs, 64, 128, 3.0) == 2 + 3.0


def test_packed_ring_tiles_by_step(tmp_path):
    """packed_ring_tiles' step-by-step counts: one document over both ranks puts pairs in both
    ring steps of both ranks, documents that stay whole on their ranks none in step 1; the
    forward's query tiles count the same visible pairs; the per-step line prints a --measured
    replay's per-step max/mean beside the model's."""
    import json

    import torch

    import ringflash
    from benchmarks.packed_ring_tiles import rank_pairs

    total = 2048
    q = torch.zeros(total, 1, 16)
    for cu, step1 in (([0, total], True), ([0, 1024, total], False)):
        layout = ringflash.balanced_layout(cu, 2, causal=True)
        for rank in range(2):
            (covered, visible, programs), by_step, forward = rank_pairs(
                q, q, q, q, torch.tensor(cu, dtype=torch.int32), layout, rank, 2, 64, 128
            )
            assert len(by_step) == 2 and by_step[0][0] > 0 and (by_step[1][0] > 0) == step1, (cu, rank, by_step)
            assert tuple(sum(step[i] for step in by_step) for i in range(3)) == (covered, visible, programs)
            # the forward sees the same pairs, counted by query tiles
            assert [step[1] for step in forward] == [step[1] for step in by_step], (forward, by_step)
            assert all(c >= v for c, v, _ in forward) and (forward[1][2] > 0) == step1, forward
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps({"rows": [{"total": 16384, "world": 2, "device_step_max_over_mean": [1.25, None]}]}))
    out = run([sys.executable, "-m", "benchmarks.packed_ring_tiles", "--totals", "16384", "--worlds", "2",
               "--measured", str(measured)], tmp_path)  # fmt: skip
    assert "P=2 each step's busiest rank over its mean: model (F=7.6) " in out and "(m.json) 1.250 -" in out, out


def test_cuts_aligned_experiment_keeps_every_token_once():
    """benchmarks.common.cuts_aligned (the aligned-cuts experiment of packed_ring_tiles /
    packed_ring_replay / layout_balance --align): inside, a document cut over the ranks is cut
    at multiples of the alignment from its start, every token is still held by exactly one
    rank, and balance's own cuts are back afterwards."""
    import ringflash
    from benchmarks.common import cuts_aligned
    from ringflash import balance

    cu, world, align = [0, 300, 20000, 20100, 65536], 4, 128
    plain = ringflash.balanced_layout(cu, world)
    before = balance._cuts
    with cuts_aligned(align):
        aligned = ringflash.balanced_layout(cu, world)
    assert balance._cuts is before and ringflash.balanced_layout(cu, world) == plain
    held = sorted(int(p) for r in range(world) for p in aligned.positions(r))
    assert held == list(range(cu[-1]))
    starts = dict(zip(range(len(cu) - 1), cu))
    cut_docs = {s.doc for r in range(world) for s in aligned.segments(r) if s.length < cu[s.doc + 1] - cu[s.doc]}
    assert cut_docs, aligned
    for r in range(world):
        for s in aligned.segments(r):
            if s.doc in cut_docs:
                end = s.global_start + s.length
                assert (s.global_start - starts[s.doc]) % align == 0 or s.global_start == starts[s.doc]
                assert (end - starts[s.doc]) % align == 0 or end == cu[s.doc + 1], (s, aligned)
    assert aligned != plain


def test_cuts_aligned_min_piece_keeps_short_documents_exact():
    """cuts_aligned(align, min_piece): a document whose even pieces (causal: its 2P zigzag
    chunks) are shorter than min_piece keeps balance's own cuts, a longer one is rounded."""
    import ringflash
    from benchmarks.common import cuts_aligned

    cu, world, align = [0, 300, 20000, 20100, 65536], 4, 128  # chunks: doc 1 ~2462, doc 3 ~5679
    plain = ringflash.balanced_layout(cu, world, causal=True)
    with cuts_aligned(align, min_piece=4096):
        mixed = ringflash.balanced_layout(cu, world, causal=True)
    with cuts_aligned(align, min_piece=8192):  # no piece that long: nothing rounded
        assert ringflash.balanced_layout(cu, world, causal=True) == plain

    def runs(layout, doc):
        return sorted((s.global_start, s.length) for r in range(world) for s in layout.segments(r) if s.doc == doc)

    assert runs(mixed, 1) == runs(plain, 1)
    assert runs(mixed, 3) != runs(plain, 3)
    assert all((start - cu[3]) % align == 0 for start, _ in runs(mixed, 3))


def test_bench_ring_smoke_on_gloo(tmp_path):
    out = run(TWO_RANKS + ["-m", "benchmarks.bench_ring", "--smoke", "--json", str(tmp_path / "r.json")], tmp_path)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["world"] == 2 and data["meta"]["backend"] == "gloo"
    assert len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["tflops_per_gpu"]["ring"] > 0 and row["tflops_per_gpu"]["local"] > 0
    assert "per-GPU TFLOP/s" in out


def test_bench_packed_ring_smoke_on_gloo(tmp_path):
    """Packed documents on the ring over the process group, a row per layout: the ring's time
    beside the one-GPU call over P, and the layout's shards."""
    out = run(TWO_RANKS + ["-m", "benchmarks.bench_packed_ring", "--smoke", "--layouts", "balanced", "two-ranks",
                           "--json", str(tmp_path / "p.json")], tmp_path)  # fmt: skip
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["meta"]["world"] == 2 and data["meta"]["backend"] == "gloo"
    assert [r["layout"] for r in data["rows"]] == ["balanced", "two-ranks"]
    for r in data["rows"]:
        assert r["ring_ms"] > 0 and r["efficiency"] == pytest.approx(r["one_gpu_ms"] / 2 / r["ring_ms"])
        assert sum(r["local_lens"]) == r["total"]
    assert "packed ring over the process group" in out


def test_bench_ring_maxlen_smoke_on_gloo(tmp_path):
    out = run(
        TWO_RANKS + ["-m", "benchmarks.bench_ring_maxlen", "--smoke", "--json", str(tmp_path / "m.json")], tmp_path
    )
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["meta"]["world"] == 2 and [r["S"] for r in data["rows"]] == [64, 128]
    assert all(r["seconds"] > 0 for r in data["rows"]) and "peak allocated per GPU" in out


def test_bench_blockops_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.bench_blockops", "--smoke", "--json", str(tmp_path / "b.json")], tmp_path)
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["block_ops"]) == 2 and data["replay"][0]["efficiency"] > 0


def test_bench_packed_smoke(tmp_path):
    out = run([sys.executable, "-m", "benchmarks.packed", "--smoke", "--json", str(tmp_path / "p.json")], tmp_path)
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["dense causal", "docs:longtail", "docs:short", "window:32"]
    assert all(r["ms"] > 0 for r in rows) and "visible-pair TFLOP/s" in out
    # v's head dim apart (MLA-style): FLOPs count PV at Dv, so the rate is (D + Dv) / 2D of the time's
    out = run([sys.executable, "-m", "benchmarks.packed", "--smoke", "--v-head-dim", "8", "--json",
               str(tmp_path / "v.json")], tmp_path)  # fmt: skip
    got = json.loads((tmp_path / "v.json").read_text())
    assert got["meta"]["v_head_dim"] == 8 and "Dv=8" in out
    for r in got["rows"]:
        assert r["tflops"] == pytest.approx(2 * 2 * (16 + 8) * r["pairs"] / r["ms"] / 1e9), r


def test_bench_dropout_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.dropout", "--smoke", "--json", str(tmp_path / "d.json")], tmp_path)
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert len(rows) == 4 and all(min(r["ms"].values()) > 0 for r in rows)


def test_bench_packed_counts_visible_pairs():
    import torch

    from benchmarks.packed import causal_pairs, document_lengths, window_pairs

    for mix in ("longtail", "short"):
        lengths = document_lengths(mix, 5000, seed=3)
        assert sum(lengths) == 5000 and min(lengths) > 0
    i = torch.arange(300)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 17)
    assert window_pairs(300, 17) == int(band.sum())
    assert causal_pairs([3, 1]) == 6 + 1


def _launch_script(name, step, out_dir):
    """bash launch/<name> <step> with $OUT = out_dir: the finished process (output captured)."""
    return subprocess.run(
        ["bash", f"launch/{name}", step],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(out_dir)},
    )


def test_gpu_ring_script_refuses_without_two_gpus(tmp_path):
    import pytest
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("on a multi-GPU machine the script is the real thing, run on purpose")
    res = _launch_script("gpu_ring.sh", "tests", tmp_path)
    assert res.returncode == 2 and "needs 2 or more GPUs" in res.stderr, res.stderr


def test_gpu_local_script_names_its_steps(tmp_path):
    """launch/gpu_local.sh refuses a step it does not know (status 2), listing the ones it has,
    and runs nothing for it."""
    res = _launch_script("gpu_local.sh", "nosuchstep", tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "unknown step nosuchstep (steps: tests tune bench packed replay host)" in res.stdout
    assert not list(tmp_path.iterdir())


def test_plot_scaling_picks_weak_and_strong_rows(tmp_path):
    """Synthetic bench_ring.py files for P = 2, 4, 8: the table lists each weak (S = P x 32K) and
    strong (S = 256K) point once, ignores the others, and the SVG has one ring and one CP line
    per series and panel layout."""
    import xml.dom.minidom

    files = []
    for P in (2, 4, 8):
        rows = []
        for S in sorted({P * 32768, 262144, 1000}):
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    t = {"ring": 400.0 + P, "local": 420.0, "cp_cudnn": 500.0}
                    rows.append({"S": S, "causal": causal, "mode": mode, "tflops_per_gpu": t})
        path = tmp_path / f"p{P}.json"
        path.write_text(json.dumps({"meta": {"world": P, "heads": 32, "kv_heads": 8}, "rows": rows}))
        files.append(str(path))
    out = run([sys.executable, "-m", "benchmarks.plot_scaling", *files, "--out", str(tmp_path / "s.svg")], tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("| weak") or line.startswith("| strong")]
    # 2 kinds x 2 causal x 3 P; at P = 8, 8 x 32K = 256K is both weak and strong
    assert len(lines) == 12, out
    assert "| weak, H 32/8, causal | 4 | 404 | 0.96 | 500 | 0.81 |" in lines
    doc = xml.dom.minidom.parse(str(tmp_path / "s.svg"))
    # 4 series: ring + CP in the throughput panel, ring in the efficiency panel
    assert len(doc.getElementsByTagName("polyline")) == 4 * 3


def test_gluon_forward_compiles_for_hopper(tmp_path):
    """The Gluon forward variants the package uses (configs.GLUON_FWD, GLUON_FWD_DOCUMENTS)
    compile for sm_90a on this CPU machine: local causal (bf16), a sliding window, a ring step
    (fold, float32 state, fp16), head dims 96 and 192 (each in two pieces: 64 + 32, 128 + 64)
    and packed documents (per-row bounds, local and folded), within the shared memory, a wgmma
    left in flight (wait_group 1, or 2 behind v's two pieces), no spills except the few bytes
    the 128-key tiles spill where a GPU measured them faster than the spill-free 64-key ones:
    with per-row bounds (configs.GLUON_FWD_DOCUMENTS) at most ROWS_SPILL_BYTES, and MLA's
    192 / 128 (one register kept across the key loop, dense and causal: MLA_SPILL_BYTES; with a
    window, untimed, MLA_WINDOW_SPILL_BYTES), as when measured; and the persistent programs of
    short key ranges (configs.GLUON_FWD_SHORT, dense and causal, local and folded), which spill
    at most PERSISTENT_SPILL_BYTES per tile (a few tile scalars kept across the key loop,
    stored before it and loaded after it: SASS), as when measured; and the long key ranges'
    variants (configs.GLUON_FWD_LONG, dense and causal, local and folded) without spills; and
    the dense blocks' wide key blocks (configs.GLUON_FWD_DENSE, local and folded, in two pieces:
    a second wgmma group of scores), at most DENSE_SPILL_BYTES, as when measured."""
    from ringflash.kernels.configs import (
        GLUON_FWD,
        GLUON_FWD_DENSE,
        GLUON_FWD_DOCUMENTS,
        GLUON_FWD_LONG,
        GLUON_FWD_SHORT,
    )

    ROWS_SPILL_BYTES = 40
    MLA_SPILL_BYTES, MLA_WINDOW_SPILL_BYTES = 8, 48
    PERSISTENT_SPILL_BYTES = 32
    DENSE_SPILL_BYTES = 20

    cases = [f"{v}:{D}:1:bf16:1:0" for D, v in GLUON_FWD.items()]  # every head dim, causal
    v = GLUON_FWD[128]
    cases += [f"{v}:128:0:fp16:0:1", f"{v}:128:1:bf16:1:0:window"]
    # head dims under their padding (zero columns, O stored to its true width): local, ring step
    cases += [f"{v}:96:1:bf16:1:0", f"{GLUON_FWD[256]}:192:0:fp16:0:1"]
    # v's head dim apart from q/k's (MLA's 192 / 128; V and O tiles of their own width): local, ring step
    cases += [
        f"{GLUON_FWD[256]}:192/128:1:bf16:1:0",
        f"{GLUON_FWD[256]}:192/128:0:fp16:0:1:window",
        f"{GLUON_FWD_DOCUMENTS[256]}:192/128:1:bf16:0:1:rows",
        f"{v}:128/64:0:fp16:0:1",
    ]
    cases += [c for D, v in GLUON_FWD_DOCUMENTS.items() for c in (f"{v}:{D}:1:bf16:1:0:rows",
                                                                  f"{v}:{D}:0:fp16:0:1:rows")]  # fmt: skip
    cases += [c for D, v in GLUON_FWD_SHORT.items() for c in (f"{v}:{D}:1:bf16:1:0", f"{v}:{D}:0:fp16:0:1")]
    cases += [c for D, v in GLUON_FWD_LONG.items() for c in (f"{v}:{D}:1:bf16:1:0", f"{v}:{D}:0:fp16:0:1")]
    cases += [c for D, v in GLUON_FWD_DENSE.items() for c in (f"{v}:{D}:0:bf16:1:0", f"{v}:{D}:0:fp16:0:1")]
    run([sys.executable, "benchmarks/gluon_report.py", "--jobs", "2", "--json", str(tmp_path / "g.json")]
        + [a for c in cases for a in ("--case", c)], tmp_path, expect_ok=False)  # fmt: skip
    rows = json.loads((tmp_path / "g.json").read_text())  # (the report exits 1 on any spill)
    assert len(rows) == len(cases)
    for r in rows:
        assert "error" not in r, r
        if r["mask"] == "rows":
            allowed = ROWS_SPILL_BYTES
        elif r["config"]["persistent"]:
            allowed = PERSISTENT_SPILL_BYTES
        elif r["config"]["block_nt"]:
            allowed = DENSE_SPILL_BYTES
            assert r["sass_waits"].get("2"), r  # the scores land with PV's two groups in flight
        elif (r["D"], r.get("Dv")) == (192, 128):
            allowed = MLA_WINDOW_SPILL_BYTES if r["mask"] == "window" else MLA_SPILL_BYTES
        else:
            allowed = 0
        assert r["spill_bytes"] <= allowed and any(int(n) > 0 for n in r["sass_waits"]), r
        assert all(p.startswith("spills") for p in r["problems"]), r


def test_gluon_forward_early_p_frees_registers(tmp_path):
    """P made the 16-bit PV operand early (GluonConfig.p_early) keeps half as many registers of
    it live across the key loop: three consumer warpgroups on 192 x 128 tiles (ws3, 160
    registers a thread) compile without spills at D=64 (with float32 P live they spilled 4 KB),
    and ws2_s3's tiles with it (ws2_pe) use fewer registers than without, at D=64 and 128."""
    cases = ["ws3:64:1:bf16:1:0", "ws3:64:0:fp16:0:1"]
    cases += [f"{v}:{D}:1:bf16:1:0" for v in ("ws2_s3", "ws2_pe") for D in (64, 128)]
    run([sys.executable, "benchmarks/gluon_report.py", "--jobs", "2", "--json", str(tmp_path / "g.json")]
        + [a for c in cases for a in ("--case", c)], tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "g.json").read_text())
    assert len(rows) == len(cases) and not any("error" in r for r in rows), rows
    by = {(r["name"], r["D"], r["fold"]): r for r in rows}
    for fold in (0, 1):
        r = by["ws3", 64, fold]
        assert r["spill_bytes"] == 0 and r["problems"] == [] and any(int(n) > 0 for n in r["sass_waits"]), r
    for D in (64, 128):
        early, late = by["ws2_pe", D, 0], by["ws2_s3", D, 0]
        assert early["spill_bytes"] == late["spill_bytes"] == 0
        assert early["sass_regs"] < late["sass_regs"], (early["sass_regs"], late["sass_regs"])


def test_gluon_forward_short_group_last_compiles(tmp_path):
    """The launch order with the short group of heads last (GluonConfig.tile_order "short_last",
    the kernel's SHORT_GROUP_FIRST constexpr off; the defaults have it on and compile in the
    tests above) compiles for sm_90a without spills and with a wgmma left in flight, causal,
    local and folded."""
    cases = ["ws3_short_last:64:1:bf16:1:0", "ws2_s3_short_last:128:1:fp16:0:1"]
    run([sys.executable, "benchmarks/gluon_report.py", "--jobs", "2", "--json", str(tmp_path / "g.json")]
        + [a for c in cases for a in ("--case", c)], tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "g.json").read_text())
    assert len(rows) == len(cases)
    for r in rows:
        assert "error" not in r and r["spill_bytes"] == 0 and r["problems"] == [], r
        assert r["config"]["tile_order"] == "short_last" and any(int(n) > 0 for n in r["sass_waits"]), r


def test_gluon_check_catches_a_wrong_forward_at_head_dims_in_pieces(tmp_path):
    """benchmarks/gluon_check.py's correctness harness on the CPU (a float64 stand-in for the
    kernel, --cpu-dry-run) at head dims the forward runs in two pieces: every case passes with
    the right stand-in, and a stand-in that ignores the causal mask fails the causal ones."""
    for mode, want_all in (("ok", True), ("bug", False)):
        out = tmp_path / f"{mode}.json"
        run([sys.executable, "benchmarks/gluon_check.py", "--cpu-dry-run", mode, "--quick", "--head-dims", "96", "192",
             "--variants", "ws2_s3", "--skip-timing", "--jobs", "0", "--json", str(out)], tmp_path)  # fmt: skip
        rows = json.loads(out.read_text())["correctness"]
        assert {r["D"] for r in rows} == {96, 192} and len(rows) >= 10, rows
        if want_all:
            assert all(r["status"] == "PASS" for r in rows), [r for r in rows if r["status"] != "PASS"]
        else:
            assert all(r["status"] == "FAIL" for r in rows if r["causal"]), rows


def test_gluon_bwd_check_catches_a_wrong_backward_with_v_head_dim_apart(tmp_path):
    """benchmarks/gluon_bwd_check.py's harness on the CPU (--cpu-dry-run: a float32 emulation of
    the kernel's blocking, the blocked dQ's finish interpreted) at MLA's head dims (192 / 128)
    for the pieces variant and the padded one: every case passes with the right emulation, and
    one without the causal diagonal mask fails every causal case."""
    for mode, variants in (("emulate", ["split_d_pieces", "split_d_blk"]), ("bug", ["split_d_pieces"])):
        out = tmp_path / f"{mode}.json"
        run([sys.executable, "benchmarks/gluon_bwd_check.py", "--cpu-dry-run", mode, "--quick", "--head-dim", "192",
             "--v-head-dim", "128", "--variants", *variants, "--skip-timing", "--jobs", "0", "--json", str(out)],
            tmp_path)  # fmt: skip
        rows = json.loads(out.read_text())["correctness"]
        assert {r["variant"] for r in rows} == set(variants) and len(rows) >= 7 * len(variants), rows
        if mode == "emulate":
            assert all(r["status"] == "PASS" for r in rows), [r for r in rows if r["status"] != "PASS"]
        else:
            assert all(r["status"] == "FAIL" for r in rows if r["causal"]), rows


def test_gluon_backward_blocked_dq_layout():
    """The blocked float32 dQ of the Gluon backward (cfg.dq_blocked): the launcher's view inverts
    the kernel's offsets (_gluon_bwd._red_add_blocked), and its finish (one Triton launch, here
    interpreted) scales, un-permutes and casts (or adds) into dq of any strides, ragged last
    block included, at both head dims and at one under its padding (96 in a 128-wide buffer)."""
    import torch

    from ringflash.kernels import gluon_backward as gb

    cfg = gb.VARIANTS["ws2_blk"][128]
    B, Sq, Hq = 2, 130, 3
    for D in (128, 64, 96):  # 96: a buffer 128 wide, whose padding columns are not dQ's
        W = gb.padded_head_dim(D)
        acc = torch.arange(B * Hq * gb.padded_rows(Sq, cfg) * W, dtype=torch.float32).view(B, Hq, -1, W)
        nat = gb.dq_natural_view(acc)
        corners = [(0, 0, 0, 0, 0, 0, 0, 0, 0, 0), (1, 2, 3, 1, 5, 2, 1, W // 16 - 1, 2, 1)]
        for b, n, w, h, g, hq, wg, j, t, e in corners:
            # the kernel: tile (b, hq, 64-row block n, warpgroup wg) at ((b Hq + hq) Sq_pad + 64 n) W + 32 W wg,
            # element (r = 16 w + 8 h + g, c = 8 j + 2 t + e) at (w * 8 W + g * 16 + h * 2) + (j * 128 + t * 4 + e)
            flat = ((b * Hq + hq) * acc.shape[2] + 64 * n) * W + 32 * W * wg + w * 8 * W + g * 16 + h * 2
            assert nat[b, n, w, h, g, hq, wg, j, t, e].item() == flat + j * 128 + t * 4 + e
        natural = nat.reshape(B, -1, Hq, W)[:, :Sq, :, :D]  # (B, Sq, Hq, D) in row order
        for dtype, accumulate, layout in [(torch.bfloat16, False, "contiguous"), (torch.float32, True, "contiguous"),
                                          (torch.float16, True, "heads first")]:  # fmt: skip
            if layout == "contiguous":
                dq = torch.ones(B, Sq, Hq, D, dtype=dtype)
            else:  # (B, Hq, Sq, D) memory seen as (B, Sq, Hq, D)
                dq = torch.ones(B, Hq, Sq, D, dtype=dtype).transpose(1, 2)
            # 16-bit: values a 16-bit float holds exactly (the interpreter rounds to bfloat16
            # toward zero, the GPU to nearest)
            wrap = 64 if dtype != torch.float32 else acc.numel()
            acc32, finish = gb.dq_buffer(dq, scale=0.5, accumulate=accumulate, cfg=cfg)
            acc32.copy_(acc % wrap)
            finish()
            want = (natural % wrap) * 0.5 + (1.0 if accumulate else 0.0)
            assert torch.equal(dq, want.to(dtype)), (D, dtype, layout)


def test_gluon_backward_blocked_dq_narrow_tile():
    """A dQ piece narrower than the blocked buffer's tiles (split_d_pieces' tail: 64 columns into
    the second 128-wide tile of a 256-wide buffer, _red_add_blocked with TILE_COLS = 128) lands,
    through the launcher's view, at dQ columns 128 .. 191 and nowhere else."""
    import torch

    from ringflash.kernels import gluon_backward as gb

    W, tile_cols, cols = 256, 128, 64
    acc = torch.zeros(1, 1, 64, W)
    r = torch.arange(64)[:, None]
    c = torch.arange(cols)[None, :]
    # the kernel's offsets (_red_add_blocked, WIDTH = TILE_COLS) within tile 1 of the 64-row block
    offs = 1 * 64 * tile_cols + (r // 16) * (tile_cols * 16) + (r % 8) * 16 + ((r // 8) % 2) * 2
    offs = offs + (c // 8) * 128 + ((c // 2) % 4) * 4 + (c % 2)
    vals = (r * 1000 + c).float()  # row r, piece column c
    acc.view(-1)[offs.reshape(-1)] = vals.reshape(-1)
    dq = gb.dq_natural_view(acc).reshape(1, 64, 1, W)[0, :, 0]  # (rows, W) in dQ's order
    assert torch.equal(dq[:, 128:192], vals)
    assert not dq[:, :128].any() and not dq[:, 192:].any()


def test_gluon_backward_compiles_for_hopper(tmp_path):
    """The Gluon backward's variants keep compiling for
    sm_90a on this CPU machine, causal bf16 accumulating into float32 (a ring step), at D=128
    and at 96 (run 128 wide): no spills, within the shared memory, S^T and dP^T left in flight
    (wait_group 1), vectorized dQ adds, dK / dV stored in vectors (not 16 bits at a time: the
    persistent programs' per-block strides once lost their alignment). The default among them
    (its grouped heads and downward walk), the same in persistent programs taking key blocks from
    a counter (D=64's default for causal launches), and packed documents' per-row bounds in
    persistent programs (ws2_lag_pc, its producer planning each block's query blocks)."""
    from ringflash.kernels import configs

    variants = ["ws2", "ws2_blk", "ws2_lag", "ws2_lagq", "ws2_lag_grouped_down", "ws2_lag_grouped_down_pc"]
    variants += [v for v in (configs.GLUON_BWD[128],) if v not in variants]
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", *variants, "--head-dims", "128", "--causal",
         "1", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(tmp_path / "b.json")],
        tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "b.json").read_text())
    assert len(rows) == len(variants)
    # a head dim under its tile width (96 in 128: masked stores, clamped dQ columns), blocked dQ
    # and row-major
    padded = ["ws2_lag", "ws2"]
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", *padded, "--head-dims", "96", "--causal",
         "1", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(tmp_path / "p.json")],
        tmp_path)  # fmt: skip
    rows += json.loads((tmp_path / "p.json").read_text())
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", "ws2_lag_pc", "--head-dims", "128", "--rows",
         "--causal", "0", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(tmp_path / "r.json")],
        tmp_path)  # fmt: skip
    rows += json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == len(variants) + len(padded) + 1 and rows[-1]["rows"] and rows[-1]["config"]["persistent"]
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r
        assert r["stg_16"] == 0, r


def test_gluon_backward_split_head_dim_compiles_for_hopper(tmp_path):
    """The head-dim split schedule (D=256, and 192 run 256 wide), blocked and row-major dQ,
    causal bf16 accumulating (a ring step), with a window, with per-row bounds and with v's head
    dim apart (192 / 128): no spills
    (its producer warp needs 40 registers: at 24 it spilled), within the shared memory (K, V,
    two Q / dO stages and four P^T / dS^T tiles: 230,816 of 232,448 bytes), S^T left in flight
    (wait_group 1)."""
    rows = []
    for i, extra in enumerate(
        [
            ["--head-dims", "256", "192"],
            ["--head-dims", "256", "--window-left", "300"],
            ["--head-dims", "256", "--rows"],
            ["--head-dims", "192", "--v-head-dim", "128"],  # MLA's: V and dO tiles 128 wide
        ]
    ):
        variants = ["split_d_blk", "split_d"] if i == 0 else ["split_d_blk"]
        out = tmp_path / f"s{i}.json"
        run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", *variants, "--causal", "1", "--dtypes",
             "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(out), *extra], tmp_path)  # fmt: skip
        got = json.loads(out.read_text())
        assert len(got) == (4 if i == 0 else 1), got
        rows += got
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r
        assert r["shared"] <= 232448, r


def test_gluon_backward_head_dim_in_pieces_compiles_for_hopper(tmp_path):
    """split_d_pieces (q/k's 192 as 128 + 64, dK's and dQ's pieces crossed between the
    warpgroups) compiles for sm_90a with v's 128 (MLA) and 192, causal accumulating, with per-row
    bounds: no spills, S^T left in flight, within the shared memory, and fewer matmul
    instructions than the same shapes run 256 wide (split_d_blk)."""
    rows = {}
    for i, extra in enumerate([["--v-head-dim", "128"], ["--v-head-dim", "192"], ["--v-head-dim", "128", "--rows"]]):
        out = tmp_path / f"p{i}.json"
        run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", "split_d_pieces", "split_d_blk",
             "--head-dims", "192", "--causal", "1", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json",
             str(out), *extra], tmp_path)  # fmt: skip
        got = json.loads(out.read_text())
        assert sorted(r["name"] for r in got) == ["split_d_blk", "split_d_pieces"], got
        rows[i] = {r["name"]: r for r in got}
    for by_name in rows.values():
        r, padded = by_name["split_d_pieces"], by_name["split_d_blk"]
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r
        assert r["shared"] <= 232448 and r["hgmma"] < padded["hgmma"], (r, padded)


def test_gluon_backward_window_compiles_for_hopper(tmp_path):
    """The default fused backward with a sliding window (both edges masked), causal and not, D=64
    and 128: no spills, within the shared memory, wait_group 1 kept."""
    from ringflash.kernels import configs

    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", configs.GLUON_BWD[128], "--causal", "0", "1",
         "--dtypes", "bf16", "--accumulate", "1", "--window-left", "300", "--jobs", "1", "--json",
         str(tmp_path / "w.json")], tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "w.json").read_text())
    assert len(rows) == 4 and all(r["window_left"] == 300 for r in rows)
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r


def test_gluon_backward_documents_compile_for_hopper(tmp_path):
    """The fused backward with packed documents' per-row bounds (configs.GLUON_BWD_DOCUMENTS),
    D=64 and 128 (each its own entry), accumulating: no spills, within the shared memory,
    wait_group 1 kept."""
    from ringflash.kernels import configs

    rows = []
    for D in (64, 128):
        out = tmp_path / f"r{D}.json"
        run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", configs.GLUON_BWD_DOCUMENTS[D],
             "--head-dims", str(D), "--causal", "0", "--dtypes", "bf16", "--accumulate", "1", "--rows", "--jobs", "1",
             "--json", str(out)], tmp_path)  # fmt: skip
        rows += json.loads(out.read_text())
    assert len(rows) == 2 and all(r["rows"] for r in rows)
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r


def test_builtin_shapes_compile_for_hopper(tmp_path):
    """Every built-in kernel shape compiles for sm_90a (on this CPU machine, with the ptxas that
    ships with Triton) within the H200's shared memory and without ptxas serializing the
    kernel's wgmma instructions; a shape known not to fit is reported as not fitting."""
    run([sys.executable, "-m", "benchmarks.kernel_report", "--json", str(tmp_path / "k.json")], tmp_path)
    rows = json.loads((tmp_path / "k.json").read_text())
    assert len(rows) == 12  # 3 kernels x D 64, 128 x causal or not
    for r in rows:
        assert r["fits"] and not r["warnings"] and r["waits"] and r["regs"] <= 255, r  # C7514/C7512: serialized
    run(
        [
            sys.executable,
            "-m",
            "benchmarks.kernel_report",
            "--kind",
            "fwd",
            "--head-dims",
            "128",
            "--shape",
            "128",
            "128",
            "8",
            "4",
            "--json",
            str(tmp_path / "big.json"),
        ],
        tmp_path,
    )
    # 295936 bytes: the sixth sweep's OutOfResources on the H200
    assert not any(r["fits"] for r in json.loads((tmp_path / "big.json").read_text()))


def test_run_retries_only_a_gloo_teardown_abort(tmp_path):
    """commands.run reruns a command once when a process's log shows gloo's teardown abort, and
    reports any other failure at once."""
    import commands

    script = tmp_path / "flaky.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "logs = pathlib.Path(os.environ['RINGFLASH_LOG_DIR']) / 'r' / '1'\n"
        "logs.mkdir(parents=True)\n"
        "first = not pathlib.Path(sys.argv[1]).exists()\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "(logs / 'stderr.log').write_text(sys.argv[2] if first else '')\n"
        "print('attempt', 1 if first else 2)\n"
        "sys.exit(134 if first else 0)\n"
    )
    cmd = [sys.executable, str(script), str(tmp_path / "ran")]
    assert "attempt 2" in commands.run(cmd + [commands.TEARDOWN_ABORT], tmp_path)
    (tmp_path / "ran").unlink()
    assert "attempt 1" in commands.run(cmd + ["some other error"], tmp_path / "other", expect_ok=False)


def test_ringflash_run_builds_the_torchrun_command(tmp_path):
    """ringflash-run: defaults from the machine, options over environment variables, the CPU
    cores shared out, no change of directory or paths, -m for modules, clear refusals."""
    import pytest

    from ringflash.launch import torchrun_command

    log = str(tmp_path / "logs")
    cmd, env = torchrun_command(["--log-dir", log, "train.py", "--steps", "3"], {}, gpus=0, cores=2)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in cmd
    assert cmd[-3:] == ["train.py", "--steps", "3"] and env["RINGFLASH_DIST_BACKEND"] == "gloo"
    assert env["OMP_NUM_THREADS"] == "1" and "PYTHONPATH" not in env
    cmd, env = torchrun_command(["--log-dir", log, "-m", "benchmarks.bench_ring", "--smoke"], {}, gpus=4, cores=64)
    assert "--nproc-per-node=4" in cmd and cmd[-3:] == ["-m", "benchmarks.bench_ring", "--smoke"]
    assert env["RINGFLASH_DIST_BACKEND"] == "nccl" and env["OMP_NUM_THREADS"] == "16"
    cmd, env = torchrun_command(
        ["--log-dir", log, "x.py"], {"RINGFLASH_NPROC": "3", "OMP_NUM_THREADS": "7"}, gpus=0, cores=2
    )
    assert "--nproc-per-node=3" in cmd and env["OMP_NUM_THREADS"] == "7"
    with pytest.raises(SystemExit):
        torchrun_command(["--log-dir", log, "--nproc", "3", "--backend", "nccl", "x.py"], {}, gpus=2, cores=8)


def test_compare_versions_smoke(tmp_path):
    """Two copies of the package side by side (here: this one twice) in one run."""
    import shutil

    shutil.copytree(ROOT / "ringflash", tmp_path / "base" / "ringflash_before")
    run(
        [
            sys.executable,
            "-m",
            "benchmarks.compare_versions",
            "--smoke",
            "--baseline",
            str(tmp_path / "base"),
            "--variants",
            "qk_order",
            "combined+32x128",
            "--json",
            str(tmp_path / "c.json"),
        ],
        tmp_path,
    )
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert len(rows) == 4 and all(
        set(r["tflops"]) == {"before", "after", "cudnn", "after:qk_order", "after:combined+32x128"} for r in rows
    )


def test_precision_large_scores_smoke(tmp_path):
    out = run(
        [sys.executable, "-m", "benchmarks.precision_large_scores", "--backends", "torch", "--seeds", "2"], tmp_path
    )
    assert "flash_plain" in out and "torch |" in out


def test_compile_train_smoke(tmp_path):
    """benchmarks.compile_train --smoke: both models compiled (fullgraph) match eager on CPU."""
    pytest.importorskip("transformers")
    out = run([sys.executable, "-m", "benchmarks.compile_train", "--smoke"], tmp_path)
    assert "graph breaks 0" in out and out.strip().splitlines()[-1].startswith("verdict: OK"), out


def test_check_overhead_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.check_overhead", "--smoke", "--json", str(tmp_path / "c.json")], tmp_path)
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["rows"][0]["gloo_alone_us"] > 0


def test_host_overhead_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.host_overhead", "--smoke", "--json", str(tmp_path / "h.json")], tmp_path)
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"public", "operator", "backend"} and all(r["fwd_us"] > 0 for r in rows)


def test_packed_ring_replay_layouts_smoke(tmp_path):
    """--layouts replays the peers' cut of every document (document_zigzag_layout) beside the
    balanced layout: a row each, named, with that layout's shards."""
    import numpy as np

    from benchmarks.packed import document_lengths
    from ringflash.balance import document_zigzag_layout

    out = tmp_path / "r.json"
    printed = run([sys.executable, "-m", "benchmarks.packed_ring_replay", "--smoke", "--no-inline", "--json", str(out),
                   "--layouts", "balanced", "document-zigzag", "few-ranks"], tmp_path)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["balanced", "document-zigzag", "few-ranks"]
    cu = [0, *np.cumsum(document_lengths("longtail", rows[1]["total"], 0)).tolist()]
    L = document_zigzag_layout(cu, rows[1]["world"])
    assert rows[1]["local_lens"] == [L.local_len(r) for r in range(L.world)]
    assert printed.count("layout=document-zigzag") == 1


def test_ring_time_follows_the_blocks_dependencies():
    """common.ring_time: the forward's step waits for the K/V its sender started the step before
    with, the backward's for the dK/dV its sender finished it with (a skipped step: the rank
    that many places back)."""
    from benchmarks.common import ring_time

    # forward: rank 1's slow step 0 delays only itself (its step 1 needs rank 0's start)
    ends = ring_time([[1, 1], [3, 1]], [[1, 1], [1, 1]], [0, 0], [0, 1])
    assert ends == [6, 6]  # the backward's step 1 on rank 0 waits for rank 1's step 0 to end
    # steps 0 and 2 of 3 ranks: at step 2 rank r holds rank r + 1's block
    ends = ring_time([[0, 0, 0]] * 3, [[5, 0, 1], [1, 0, 1], [1, 0, 1]], [0, 0, 0], [0, 2])
    assert ends == [6, 2, 6]  # rank 2 waits for rank 0's step 0 (5), rank 1 for nobody slow


def test_few_rank_layout_cuts_over_a_few_consecutive_ranks():
    """The experiment's layout (benchmarks.common.few_rank_layout): every token once; the
    documents balanced_layout keeps whole stay where it keeps them; each one it cuts is the
    zigzag of 2k chunks over k consecutive ranks, k = min(P, max(2, ceil(2 n / (total / P))))."""
    import math

    import torch

    from benchmarks.common import few_rank_layout
    from ringflash import balance

    lengths = [700, 3, 90, 1, 2000, 40, 5, 300, 1200, 17, 600]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    for world in (2, 4, 8):
        L, base = few_rank_layout(cu, world), balance.balanced_layout(cu, world)
        held = torch.cat([L.positions(r) for r in range(world)])
        assert torch.equal(held.sort().values, torch.arange(cu[-1]))
        cut = 0
        for d, n in enumerate(lengths):
            where = lambda lay: sorted(r for r in range(world) for s in lay.segments(r) if s.doc == d)  # noqa: E731
            mine, theirs = where(L), where(base)
            if len(set(theirs)) == 1:
                assert mine == theirs, (world, d)
                continue
            k = min(world, max(2, math.ceil(2 * n * world / cu[-1])))
            chunks = balance._cuts(cu[d], n, 2 * k)
            first = next(r for r in range(world) for s in L.segments(r) if s.doc == d and s.global_start == cu[d])
            for i in range(k):
                segs = L.segments((first + i) % world)
                got = [(s.global_start, s.global_start + s.length) for s in segs if s.doc == d]
                assert got == sorted(c for c in (chunks[i], chunks[2 * k - 1 - i]) if c[1] > c[0]), (world, d, i)
            cut += 1
        assert cut, world  # (the mix has documents cut at every size)
        # every cut document over two neighbouring ranks (offsets by the programs' cost): the
        # ring runs steps 0, 1 and P - 1 only
        two = few_rank_layout(cu, world, ranks=2, cost="programs")
        held = torch.cat([two.positions(r) for r in range(world)])
        assert torch.equal(held.sort().values, torch.arange(cu[-1]))
        for d in range(len(lengths)):
            on = sorted({r for r in range(world) for s in two.segments(r) if s.doc == d})
            assert len(on) <= 2 and (len(on) < 2 or (on[1] - on[0]) % world in (1, world - 1)), (world, d, on)
        assert two.hops == len({0, 1, world - 1}), world


def test_packed_ring_replay_smoke(tmp_path):
    """The replay runs (with --kernels: each rank's split and the one-GPU call's over P, and
    each rank's replayed transfers and ring steps apart), once per --documents-forward and --grad-accum-dtypes
    variant."""
    out = tmp_path / "r.json"
    printed = run([sys.executable, "-m", "benchmarks.packed_ring_replay", "--smoke", "--kernels", "--json", str(out),
                   "--grad-accum-dtypes", "float32", "input", "--documents-forward", "default", "triton"],
                  tmp_path)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["documents_forward"], r["grad_accum_dtype"]) for r in rows] == [
        ("default", "float32"), ("default", "input"), ("triton", "float32"), ("triton", "input")
    ]  # fmt: skip
    row = rows[0]
    assert row["world"] == 2 and len(row["rank_ms"]) == 2 and sum(row["local_lens"]) == row["total"]
    for label in ("one GPU / 2: ", "rank 0: ", "rank 1: "):
        for kernels in ("[default fwd, default bwd] ", "[triton fwd, default bwd] "):
            assert kernels + label in printed, printed
    # --kernels: each rank's summed kernel time (the printed totals) and the balance from it
    totals = [float(re.search(rf"\[default fwd, default bwd\] rank {r}: ([0-9.]+) ms", printed).group(1))
              for r in range(2)]  # fmt: skip
    device = row["rank_device_ms"]
    assert device == pytest.approx(totals, abs=0.0051)  # (printed to 0.01 ms)
    assert row["device_max_over_mean"] == pytest.approx(max(device) / (sum(device) / 2))
    assert 0 < row["device_efficiency"] and "by device time max/mean" in printed
    # ...and less the replay's stand-ins for the network (on the CPU: their operators' CPU time)
    transfers = row["rank_transfer_ms"]
    assert all(0 < x < t for x, t in zip(transfers, device)), (transfers, device)
    for r in range(2):
        assert f"rank {r}: {device[r]:.2f} ms (the replay's transfers {transfers[r]:.2f})" in printed
    less = [t - x for t, x in zip(device, transfers)]
    assert row["device_efficiency_less_transfers"] == pytest.approx(row["device_efficiency"] * max(device) / max(less))
    # ...and in lockstep: each step of the forward and of the backward as long as its busiest
    # rank's part (the sum of the maxima), plus the most time a rank spends outside the steps;
    # by the ring's dependencies (common.ring_time) between the two
    steps = row["rank_step_device_ms"]
    outside = [t - sum(steps[r]) for r, t in enumerate(less)]
    phases = (row["rank_step_forward_ms"], row["rank_step_backward_ms"])
    lockstep = max(outside) + sum(max(p[r][s] for r in range(2)) for p in phases for s in range(2))
    efficiency = row["device_efficiency_less_transfers"] * max(less)  # the one-GPU share, ms
    assert row["device_efficiency_lockstep"] == pytest.approx(efficiency / lockstep)
    dependent = efficiency / row["device_efficiency_ring_dependencies"]
    assert max(less) - 1e-6 <= dependent <= lockstep + 1e-6, (less, dependent, lockstep)
    assert "in lockstep" in printed and "by the ring's dependencies" in printed
    assert "less the transfers: max/mean" in printed
    # ...and inside each ring step (less the transfers): every step of this layout runs on both
    # ranks, its parts within the rank's total, and each step's max/mean over the ranks
    by_step = row["rank_step_device_ms"]
    assert len(by_step) == 2 and all(len(s) == 2 and min(s) > 0 for s in by_step), by_step
    assert all(sum(s) <= t - x for s, t, x in zip(by_step, device, transfers)), (by_step, device, transfers)
    for step, uneven in enumerate(row["device_step_max_over_mean"]):
        parts = [by_step[r][step] for r in range(2)]
        assert uneven == pytest.approx(max(parts) / (sum(parts) / 2))
    # ...the forward's and the backward's apart, each step of each rank in both, adding up
    fwd, bwd = row["rank_step_forward_ms"], row["rank_step_backward_ms"]
    for r in range(2):
        assert min(fwd[r]) > 0 and min(bwd[r]) > 0, (fwd, bwd)
        assert [f + b for f, b in zip(fwd[r], bwd[r])] == pytest.approx(by_step[r])
    assert len(row["device_step_max_over_mean_backward"]) == 2
    assert re.search(r"per step max/mean both [\d.]+ [\d.]+; forward [\d.]+ [\d.]+; backward [\d.]+ [\d.]+\)", printed)


def test_profile_host_timers_count_layers_and_restore_them():
    """profile_host --split's timers: each layer of a call counted once per call (on the CPU
    backend here), the original functions back in place afterwards."""
    import torch

    import ringflash
    from benchmarks.profile_host import inclusive_timers
    from ringflash import local

    before = (local.block_forward, local._FlashAttn.__dict__["forward"])
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    with inclusive_timers() as totals:
        for _ in range(2):
            ringflash.flash_attn_func(q, k, v, causal=True).sum().backward()
    for label in ("ops.flash", "_FlashAttn.forward", "local.block_forward", "local.block_backward"):
        assert totals[label][0] == 2 and totals[label][1] > 0, label
    assert (local.block_forward, local._FlashAttn.__dict__["forward"]) == before


def test_profile_packed_callers_name_the_autograd_node():
    """profile_packed --callers: each operator's time with the operators and autograd nodes
    around it; indexing's backward shows as a zero fill inside SelectBackward0 (on the CPU, by
    CPU time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_packed import callers

    x = torch.randn(1, 64, 4, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (x[0] * 2).sum().backward()
    chains = [chain for chain, us in callers(prof, cuda=False)]
    assert any(c.startswith("aten::zero_ <") and "SelectBackward0" in c for c in chains), chains


def test_kernel_counters_reads_ncu_raw_csv(tmp_path):
    """kernel_counters' reading of ncu's raw page: units scaled, stall reasons largest first."""
    from benchmarks.kernel_counters import format_row, read_raw, summarize

    names = [
        "Kernel Name",
        "gpu__time_duration.sum",
        "gpc__cycles_elapsed.avg.per_second",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__t_sector_hit_rate.pct",
    ]
    units = ["", "ms", "Ghz", "%", "%", "%", "", "", "", "%", "%"]
    row = ["_fwd_ws2", "6.5", "1.7", "75", "74.5", "36", "3.2", "1.7", "0.8", "1.8", "97.5"]
    path = tmp_path / "raw.csv"
    path.write_text("\n".join(",".join(f'"{x}"' for x in r) for r in (names, units, row)) + "\n")
    ((name, d, u),) = read_raw(path)
    s = summarize(name, d, u)
    assert (s["us"], s["mhz"], s["tensor_pct"], s["issue_pct"]) == (6500.0, 1700.0, 74.5, 36.0)
    assert (s["dram_pct"], s["l2_hit_pct"]) == (1.8, 97.5)
    assert [k for k, _ in s["stalls"]] == ["barrier", "wait", "long_scoreboard"]
    assert "6500.0 us" in format_row("t", s)


def test_kernel_counters_names_an_unknown_implementation(tmp_path):
    """--impls takes ours, cuDNN or ours with a named Gluon forward variant; anything else is
    refused by name before ncu is started."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel_counters", "--out", str(tmp_path), "--impls",
                          "gluon=ws2_p", "sdpa_flash"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "unknown ['sdpa_flash']" in out.stderr, out.stderr


def test_tile_order_model():
    """benchmarks.tile_order_model: list scheduling in launch order (a long cost last waits
    for a free processor), tile costs heaviest first per group of heads, and the figures it
    prints for the causal forward: head by head leaves a tail that taking every head's tile i
    first removes."""
    from benchmarks.tile_order_model import finish_time, launch_costs, main, tail

    assert finish_time([1, 1, 3], 2) == 4 and finish_time([3, 1, 1], 2) == 3
    assert launch_costs(3, 2, 1, 0.5) == [3.5, 2.5, 1.5, 3.5, 2.5, 1.5]
    assert launch_costs(3, 3, 2, 0.0) == [3, 3, 2, 2, 1, 1, 3, 2, 1]
    assert launch_costs(3, 3, 2, 0.0, short_first=True) == [3, 2, 1, 3, 3, 2, 2, 1, 1]
    by_head, every = (tail(8192, 192, 32, g, 132, 0.3) for g in (1, 32))
    assert by_head > 1.05 and 1.0 <= every < 1.01
    assert tail(16384, 192, 32, 6, 132, 0.3, short_first=True) < tail(16384, 192, 32, 6, 132, 0.3) - 0.01
    main(["--seqlens", "8192", "--rows", "192", "--head-dim", "64"])
