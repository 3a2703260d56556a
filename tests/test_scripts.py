"""The benchmarks, examples and launch scripts keep working (toy sizes, CPU, gloo)."""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from commands import ROOT, TWO_RANKS, run


def test_bench_local_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.bench_local", "--smoke", "--steady", "2", "--rounds", "2"]
    cmd += ["--json", str(tmp_path / "l.json")]
    out = run(cmd, tmp_path)
    data = json.loads((tmp_path / "l.json").read_text())
    assert len(data["rows"]) == 4 and all(r["ringflash"]["tflops"] > 0 for r in data["rows"])
    assert all(r["ringflash"]["steady_tflops"] > 0 and r["sdpa_math"]["steady_ms"] > 0 for r in data["rows"])
    for r in (r[impl] for r in data["rows"] for impl in ("ringflash", "sdpa_math")):  # two rounds, their median
        assert len(r["rounds_ms"]) == 2 and r["ms"] == sum(r["rounds_ms"]) / 2, r
        assert r["spread"] == max(r["rounds_ms"]) / min(r["rounds_ms"]), r
    assert "vs flash" in out and "(calls in a row)" in out and "(spread)" in out


def test_bench_local_rounds_keep_medians_and_errors():
    """bench_local --rounds: each time and its TFLOP/s from the median round; a failed round is
    reported, not averaged away."""
    from benchmarks.bench_local import over_rounds

    runs = [{"impl": "x", "ms": ms, "tflops": 12.0 / ms, "steady_ms": 2 * ms, "steady_tflops": 6.0 / ms}
            for ms in (4.0, 1.0, 2.0)]  # fmt: skip
    out = over_rounds(runs)
    assert out["ms"] == 2.0 and out["tflops"] == 6.0 and out["steady_ms"] == 4.0 and out["steady_tflops"] == 3.0
    assert out["rounds_ms"] == [4.0, 1.0, 2.0] and out["spread"] == 4.0
    assert over_rounds(runs[:1]) == runs[0]
    failed = {"impl": "x", "error": "RuntimeError: no"}
    assert over_rounds([runs[0], failed]) is failed


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
    # ...and the forward's query tiles alike
    forward = re.findall(rf"forward: covered / {ratio}, model / {ratio}", out)
    assert len(forward) == 2 and all(c == m and float(c) > 0 for c, m in forward), out
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
    """Packed documents on the ring over the process group, a row per layout and variant of a
    balance constant (--gather-max-steps 0 2): the ring's time beside the one-GPU call over P,
    and the layout's shards."""
    out = run(TWO_RANKS + ["-m", "benchmarks.bench_packed_ring", "--smoke", "--layouts", "balanced", "two-ranks",
                           "--gather-max-steps", "0", "2", "--json", str(tmp_path / "p.json")], tmp_path)  # fmt: skip
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["meta"]["world"] == 2 and data["meta"]["backend"] == "gloo"
    assert [(r["layout"], r["gather_max_steps"]) for r in data["rows"]] == [
        ("balanced", 0), ("balanced", 2), ("two-ranks", 0), ("two-ranks", 2)
    ]  # fmt: skip
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


def test_bench_key_padding_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.key_padding", "--smoke", "--rounds", "1", "--json"]
    run(cmd + [str(tmp_path / "k.json")], tmp_path)
    rows = json.loads((tmp_path / "k.json").read_text())["rows"]
    impls = {"gluon", "gluon_plain", "gluon_cut", "gluon_cut_plain", "triton", "no_mask", "sdpa"}
    assert len(rows) == 4 and all(r["ms"].keys() == impls for r in rows)
    assert all(r["plain_over_gluon"] == r["ms"]["gluon"] / r["ms"]["gluon_plain"] for r in rows)
    # the backward alone, under a mask that hides nothing; each impl timed in two rounds, the
    # median (of two: their mean) reported
    cmd = [sys.executable, "-m", "benchmarks.key_padding", "--smoke", "--modes", "bwd", "--hides-nothing"]
    run(cmd + ["--rounds", "2", "--json", str(tmp_path / "b.json")], tmp_path)
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["causal"], r["mode"], r["hides_nothing"]) for r in rows] == [(False, "bwd", True), (True, "bwd", True)]
    for r in rows:
        assert all(len(t) == 2 and r["ms"][i] == sum(t) / 2 for i, t in r["rounds"].items()), r
        assert r["spread"] == max(max(t) / min(t) for t in r["rounds"].values()) >= 1, r


def test_bench_mask_cost_smoke(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.mask_cost", "--smoke", "--pairs", "2", "--modes", "bwd", "fwd+bwd"]
    run(cmd + ["--json", str(tmp_path / "m.json")], tmp_path)
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [(r["causal"], r["mode"]) for r in rows] == [(c, m) for c in (False, True) for m in ("bwd", "fwd+bwd")]
    for r in rows:  # each pair timed both ways; the ratio their median
        assert len(r["ms"]) == 2 and all(t.keys() == {"none", "mask"} and min(t.values()) > 0 for t in r["ms"])
        assert r["ratios"] == [t["mask"] / t["none"] for t in r["ms"]] and r["ratio"] == sum(r["ratios"]) / 2, r


def test_bench_placement_smoke(tmp_path):
    run([sys.executable, "-m", "benchmarks.placement", "--smoke", "--json", str(tmp_path / "p.json")], tmp_path)
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["fwd:out", "fwd:in", "bwd:in", "bwd:grads"]
    for r in rows:  # two addresses, one round each; the spread is of their medians
        assert len(r["ms"]) == 2 and all(len(t) == 1 and t[0] > 0 for t in r["ms"])
        assert r["between"] == max(t[0] for t in r["ms"]) / min(t[0] for t in r["ms"]), r
        assert r["in_order"] == [dict(round=0, candidate=i, ms=r["ms"][i][0]) for i in range(2)], r  # as listed


def test_placement_clock_correlation():
    """placement --clocks: r between ms and 1 / MHz; NaN where a timing has no sample (nvidia-smi's
    "[N/A]") or a column is constant, rather than a figure from part of the timings."""
    from benchmarks.placement import clock_correlation

    def timings(ms, mhz):
        return [dict(ms=a, sm_mhz=b) for a, b in zip(ms, mhz)]

    assert clock_correlation(timings([7.0, 7.5, 7.0, 8.0], [1980, 1850, 1980, 1730])) > 0.99
    assert clock_correlation(timings([7.0, 7.5, 7.0, 8.0], [1730, 1980, 1850, 1980])) < 0
    assert math.isnan(clock_correlation(timings([7.0, 7.5, 8.0], [1980, math.nan, 1730])))
    assert math.isnan(clock_correlation(timings([7.0, 7.5, 8.0], [1980, 1980, 1980])))


def test_placement_candidates_hold_the_same_data_elsewhere():
    import torch

    from benchmarks.placement import placed

    x = torch.randn(3, 5, 7)
    cands = placed(x, 5)
    assert all(torch.equal(c, x) for c in cands)
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in cands)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:])), spans  # none overlaps another
    odd = [c.data_ptr() for c in cands[1::2]]
    assert len(odd) == 2 and (odd[1] - odd[0]) % 4096 != 0  # views not a page multiple apart


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
    """Two copies of the package side by side (here: this one twice) in one run, with variants
    (a changed config, a changed module constant) and grouped kv heads."""
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
            "bwd_min_programs=0",
            "--kv-heads",
            "1",
            "--json",
            str(tmp_path / "c.json"),
        ],
        tmp_path,
    )
    result = json.loads((tmp_path / "c.json").read_text())
    rows = result["rows"]
    want = {"before", "after", "cudnn", "after:qk_order", "after:combined+32x128", "after:bwd_min_programs=0"}
    assert len(rows) == 4 and all(set(r["tflops"]) == want for r in rows)
    assert result["meta"]["kv_heads"] == 1


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
    import shutil

    shutil.copytree(ROOT / "ringflash", tmp_path / "base" / "ringflash_before")
    command = ["-m", "benchmarks.host_overhead", "--smoke", "--host-only", "--compiled", "--hybrid"]
    command += ["--json", str(tmp_path / "h.json")]
    run([sys.executable, *command, "--baseline", str(tmp_path / "base")], tmp_path)
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    impls = {"public", "operator", "ring", "ring_op", "hybrid", "hybrid_op", "compiled", "bare", "backend"}
    impls |= {f"{name} (ringflash_before)" for name in ("public", "operator", "compiled")}
    assert {r["impl"] for r in rows} == impls and all(r["fwd_us"] > 0 for r in rows)


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


def test_packed_ring_replay_varies_the_layouts_constants(tmp_path):
    """--max-reach, --crop-step-calls and --gather-max-steps (as --balance-slack, --polish-moves
    and --neighbour-pair-cost) replay a variant per value of their ringflash.balance constants:
    a row each, the values recorded, a value other than the package's named in its printed line."""
    from ringflash import balance

    out = tmp_path / "r.json"
    printed = run([sys.executable, "-m", "benchmarks.packed_ring_replay", "--smoke", "--no-inline", "--json", str(out),
                   "--window", "200", "--max-reach", str(balance.MAX_REACH), "3", "--crop-step-calls", "1",
                   "--gather-max-steps", "2"], tmp_path)  # fmt: skip
    assert balance.MAX_REACH != 3 and balance.GATHER_MAX_STEPS != 2
    rows = json.loads(out.read_text())["rows"]
    assert [r["max_reach"] for r in rows] == [balance.MAX_REACH, 3]
    assert [r["polish_moves"] for r in rows] == [balance.POLISH_MOVES] * 2
    assert [r["crop_step_calls"] for r in rows] == [1, 1]
    assert [r["gather_max_steps"] for r in rows] == [2, 2]
    assert printed.count("max reach") == 1 and "max reach 3, crop step calls 1, gather max steps 2;" in printed, printed


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
    # hops that take time: a forward step waits for its block's hop from the sender's start of
    # the step before, the backward's for the dK/dV hop from the sender's end
    ends = ring_time([[1, 1], [1, 1]], [[1, 1], [1, 1]], [0, 0], [0, 1], kv_hop_ms=3, grad_hop_ms=2)
    assert ends == [8, 8]  # forward step 1 at 3, ends 4; backward step 0 4-5, step 1 at 5 + 2
    # ...the dK/dV in two chunks, one after the other: the first at 5 + 1, computed till 6.5, the
    # second at 5 + 2, computed till 7.5
    ends = ring_time([[1, 1], [1, 1]], [[1, 1], [1, 1]], [0, 0], [0, 1], 3, 2, grad_chunks=2)
    assert ends == [7.5, 7.5]


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
    for label in ("ops.flash_eager", "_FlashAttn.forward", "local.block_forward", "local.block_backward"):
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


def test_nothing_hidden_impl_is_the_plain_call():
    """bench_local.call_of's ringflash_nothing_hidden (kernel_counters' mask-cost impl): an
    all-False key padding mask, which changes no output."""
    from benchmarks.bench_local import call_of

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2, 24, 2, 16, generator=g) for _ in range(3)]
    for causal in (False, True):
        plain = call_of("ringflash", tensors, causal)()
        assert torch.equal(call_of("ringflash_nothing_hidden", tensors, causal)(), plain)


def test_clock_sampler_medians(capsys, tmp_path):
    """benchmarks.common.ClockSampler (bench_local --clocks): the block starts after nvidia-smi's
    first sample, which is left out; the medians of the lines sampled after it, "[N/A]" lines
    left out; bench_local prints them per impl."""
    from benchmarks.bench_local import print_clocks
    from benchmarks.common import ClockSampler, parse_clock_samples

    assert parse_clock_samples("1755, 600.5\n[N/A], 3\n1800, 700\n1500, 650.0\n") == {
        "sm_mhz": 1755.0, "power_w": 650.0, "samples": 3
    }  # fmt: skip
    assert parse_clock_samples("[N/A], [N/A]\n")["samples"] == 0
    sampler, printed = ClockSampler(), tmp_path / "printed"
    # a stand-in for nvidia-smi, which samples until stopped: its first sample, taken before the
    # block, waits for the block to start, so it is never counted
    started = tmp_path / "started"
    sampler.command = [sys.executable, "-c", "import os, time; print('900, 80', flush=True); "
                       f"[time.sleep(0.05) for _ in range(1200) if not os.path.exists({str(started)!r})]; "
                       "print('1650, 690'); print('1700, 700', flush=True); "
                       f"open({str(printed)!r}, 'w').close(); time.sleep(60)"]  # fmt: skip
    with sampler:  # stopped once it has printed
        t_started = time.perf_counter()
        started.touch()
        deadline = time.monotonic() + 60
        while not printed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sampler.result == {"sm_mhz": 1675.0, "power_w": 695.0, "samples": 2}
    # each sample stamped as it arrived: both after the block started (placement --clocks)
    assert sampler.between(t_started, time.perf_counter()) == sampler.result
    assert sampler.between(-math.inf, t_started)["samples"] == 0
    row = {"D": 128, "S": 65536, "causal": True, "mode": "fwd", "ringflash": {"sm_mhz": 1650.0, "power_w": 690.0},
           "sdpa_cudnn": {"sm_mhz": 1700.0, "power_w": 700.0}}  # fmt: skip
    print_clocks([row])
    out = capsys.readouterr().out
    assert "ringflash MHz, W" in out and "1650       690" in out and "1700       700" in out, out


def test_bench_local_samples_clocks_after_the_first_call(monkeypatch):
    """bench_local --clocks: each impl's first call (a kernel's compile, a cuDNN plan: seconds of
    an idle GPU) runs before the sampler starts, so the medians are of the timed calls; without
    --clocks or --idle-gap nothing runs ahead of the timing."""
    from benchmarks import bench_local

    calls, log = [], []

    class Sampler:
        result = {"sm_mhz": 1700.0, "power_w": 690.0}

        def __init__(self, index):
            pass

        def __enter__(self):
            log.append(("sampler", len(calls)))
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench_local, "runner", lambda *a: lambda: calls.append(1))
    monkeypatch.setattr(bench_local, "ClockSampler", Sampler)
    monkeypatch.setattr(bench_local, "bench_ms", lambda fn, device: log.append(("timed", len(calls))) or 2.0)
    monkeypatch.setattr(bench_local.torch.cuda, "current_device", lambda: 0)
    res = bench_local.measure("ringflash", None, 1, 2, 64, 32, True, "fwd", "cpu", clocks=True)
    assert "error" not in res and res["sm_mhz"] == 1700.0, res
    assert log == [("sampler", 1), ("timed", 1)], log
    log.clear(), calls.clear()
    bench_local.measure("ringflash", None, 1, 2, 64, 32, True, "fwd", "cpu")
    assert log == [("timed", 0)], log


def test_clock_sampler_reads_instant_power_where_the_driver_has_it(monkeypatch):
    """ClockSampler samples nvidia-smi's power.draw.instant where the probe reads a number from
    it, else the one-second power.draw: an unknown field, "[N/A]", or no nvidia-smi at all."""
    import subprocess
    import types

    from benchmarks import common

    answers = {}

    def fake_run(cmd, **kwargs):
        answer = answers["probe"]
        if isinstance(answer, Exception):
            raise answer
        return types.SimpleNamespace(returncode=answer[0], stdout=answer[1], stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    cases = [
        ((0, "412.37\n"), "power.draw.instant"),
        ((2, 'Field "power.draw.instant" is not a valid field'), "power.draw"),
        ((0, "[N/A]\n"), "power.draw"),
        (FileNotFoundError("nvidia-smi"), "power.draw"),
    ]
    for probe, field in cases:
        answers["probe"] = probe
        common.power_field.cache_clear()
        assert common.power_field(0) == field, probe
        assert f"--query-gpu=clocks.sm,{field}" in common.ClockSampler().command
    common.power_field.cache_clear()


def test_kernel_counters_profiles_the_batch_asked(tmp_path, monkeypatch):
    """--batch reaches the profiled call (ncu's command line), so a profile can match
    benchmarks.mask_cost's B=4; a failed ncu is reported per case, not raised."""
    import argparse
    import types

    from benchmarks import kernel_counters

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return types.SimpleNamespace(returncode=1, stdout="", stderr="no GPU")

    monkeypatch.setattr(kernel_counters.subprocess, "run", fake_run)
    args = argparse.Namespace(out=tmp_path, head_dims=[64], causal="no", modes=["bwd"], v_head_dim=None,
                              impls=["ringflash", "ringflash_nothing_hidden"], seqlen=8192, source=False, heads=32,
                              batch=4)  # fmt: skip
    kernel_counters.run_all(args)
    assert len(commands) == 2
    for cmd, impl in zip(commands, args.impls):
        call = cmd[cmd.index("--call") + 1 :]
        assert cmd[cmd.index("--batch") + 1] == "4" and call == [impl, "64", "8192", "full", "bwd"], cmd
    assert "ncu failed (rc 1)" in (tmp_path / "table.txt").read_text()


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


def test_key_order_model(capsys):
    """benchmarks.key_order_model: a key block's steps are its keys' query-block hull times the
    group (unseen keys widen nothing, a block no query sees has none), and on a small windowed
    packed ring the most-first order never ends later than the grid's and never before the even
    share."""
    import numpy as np
    import torch

    from benchmarks.key_order_model import block_steps, finish_times, main
    from ringflash.masks import RowBounds

    lo = np.array([0] * 128 + [70] * 60 + [5] * 10, dtype=np.int32)
    hi = np.array([0] * 128 + [200] * 60 + [5] * 10, dtype=np.int32)
    assert block_steps(lo, hi, 4) == [0, (4 - 1) * 4]
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    grid, first, even = finish_times(RowBounds(t(lo), t(lo), t(lo), t(hi)), 2, 4, 3, 1.0)
    assert even <= first <= grid and even == (1 + 13) * 2 / 3
    main(["--totals", "8192", "--worlds", "4", "--window", "1024", "--seeds", "0", "--processors", "16"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  step ")]
    assert lines
    for line in lines:
        for cell in line.split(": ", 1)[1].split("|")[0].split():
            g, h, e = map(float, cell.split("/"))
            assert e - 1 <= h <= g + 1e-9, line


def test_launch_python_smoke(tmp_path):
    """benchmarks.launch_python compiles the Gluon forward and backward for sm_90a on the CPU
    and times triton's launcher beside DirectLaunch on each compiled kernel's own signature and
    TMA metadata: a row a kernel, each with its descriptors (it exits if DirectLaunch cannot
    stand in for this triton's launcher)."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "l.json"
    cmd = [sys.executable, "-m", "benchmarks.launch_python", "--seqlen", "1024", "--launches", "20", "--rounds", "1"]
    printed = run([*cmd, "--json", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["forward", "backward"], printed
    assert all(r["descriptors"] > 0 and r["triton_us"] > 0 and r["direct_us"] > 0 for r in rows)


def test_layout_balance_long_rows_smoke(tmp_path):
    """benchmarks.layout_balance --families long: the packed benchmarks' 128K-token rows, one
    line per mask and ring size, worst over the mixes asked for."""
    out = run([sys.executable, "-m", "benchmarks.layout_balance", "--families", "long", "--masks", "win(100,0)",
               "--worlds", "4", "--mixes", "2"], tmp_path)  # fmt: skip
    assert "worst over 2 mixes per row (long, 2 seeds each)" in out, out
    row = next(line.split() for line in out.splitlines() if line.startswith("win(100,0)"))
    assert row[1] == "4" and 1.0 <= float(row[5]) < 1.1, row  # compute time over an even split


def test_device_split_skips_the_blocks_own_device_spans():
    """The device time split over record_function blocks: each kernel counted to the innermost
    block open when its launch was made, kernels launched outside every block to None; a
    block's own span on the device's timeline (a GPU user annotation, same name, no launch) is
    no work: counted, it doubled every block's time into None."""
    import torch

    from benchmarks.common import split_device_events

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    class Event:
        def __init__(self, name, device, start, end, correlation=0):
            self._name, self._device, self._start, self._end, self._correlation = name, device, start, end, correlation

        def name(self):
            return self._name

        def device_type(self):
            return self._device

        def start_ns(self):
            return self._start

        def end_ns(self):
            return self._end

        def duration_ns(self):
            return self._end - self._start

        def correlation_id(self):
            return self._correlation

    events = [
        Event("step 0", cpu, 0, 1000),  # a block, and a transfer block inside it
        Event("transfer", cpu, 100, 200),
        Event("cudaLaunchKernel", cpu, 50, 60, correlation=1),
        Event("cudaMemcpyAsync", cpu, 150, 160, correlation=2),
        Event("cuLaunchKernelEx", cpu, 2000, 2010, correlation=3),  # outside every block
        Event("fwd_kernel", cuda, 0, 3_000_000, correlation=1),
        Event("Memcpy DtoD", cuda, 0, 500_000, correlation=2),
        Event("bwd_kernel", cuda, 0, 250_000, correlation=3),
        Event("step 0", cuda, 0, 4_000_000, correlation=7),  # the blocks' device spans
        Event("transfer", cuda, 0, 600_000, correlation=8),
        Event("unseen_kernel", cuda, 0, 1_000_000, correlation=9),  # its launch not in the profile
    ]
    split = split_device_events(events, lambda name: name in ("step 0", "transfer"))
    assert split == {"step 0": 3.0, "transfer": 0.5, None: 1.25}, split


def test_merged_keys_smoke(tmp_path):
    """benchmarks.merged_keys --smoke: each rank's one call over every key its ring steps reach
    gives the one-device call's rows (the script asserts it on the CPU), a row per rank."""
    out = tmp_path / "m.json"
    run([sys.executable, "-m", "benchmarks.merged_keys", "--smoke", "--json", str(out)], tmp_path)
    (row,) = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in row["ranks"]] == list(range(row["world"]))
    assert all(r["merged_ms"] > 0 and r["ring_ms"] > 0 for r in row["ranks"])


def test_ring_time_model_on_a_replay(tmp_path):
    """benchmarks.ring_time_model on a committed replay file: with hops free it gives the
    replay's own "by the ring's dependencies" efficiency; slower links only lengthen the ring;
    a row whose whole ring is one gathered call is skipped, not modelled."""
    import re
    from pathlib import Path

    from benchmarks.ring_time_model import modelled

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    p4 = results / "packed_ring_replay_forward_groups_p4_h100.json"
    data = json.loads(p4.read_text())
    for row in data["rows"]:
        got = modelled(row, data["meta"], [50.0, 400.0])
        assert got[0.0][1] == pytest.approx(row["device_efficiency_ring_dependencies"], rel=1e-9)
        assert got[50.0][0] > got[400.0][0] > got[0.0][0], got
    gathered = json.loads((results / "packed_ring_replay_gathered_window_h100.json").read_text())
    meta = gathered["meta"]
    assert modelled(gathered["rows"][1], meta, [400.0]) is None and modelled(gathered["rows"][0], meta, [400.0])
    out = run([sys.executable, "-m", "benchmarks.ring_time_model", str(p4), "--link-gb-s", "200"], tmp_path)
    assert len(re.findall(r"forward_group_steps=\d.*: [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\)", out)) == 2, out


def _sass_line(address, text, stall=1, wait=0):
    """One instruction as cuobjdump -sass prints it: the text, then the control word's line."""
    upper = ((wait << 11) | stall) << 41
    return f"        /*{address:04x}*/  {text} ;  /* 0x{0:016x} */\n{' ' * 100}/* 0x{upper:016x} */"


def test_sass_loops_finds_a_loop_and_its_stalls(tmp_path):
    """benchmarks/sass_loops.py on a hand-written dump: one loop (a backward branch) with its
    stall sum from the control words, a retry stub's branch back over an EXIT left out."""
    from benchmarks import sass_loops

    line = _sass_line
    dump = "\n".join([
        line(0x00, "MOV R1, c[0x0][0x28]", 1),
        line(0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT", 2),
        line(0x20, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 5, wait=1),
        line(0x30, "MUFU.EX2 R2, R2", 8),
        line(0x40, "@P0 BRA 0x10", 3),
        line(0x50, "EXIT", 1),
        line(0x60, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R7", 1),
        line(0x70, "@!P1 BRA 0x20", 1),
    ])  # fmt: skip
    instructions = sass_loops.parse(dump)
    assert len(instructions) == 8 and instructions[2][2] & 0xF == 5
    assert sass_loops.loops(instructions) == [(0x10, 0x40)]
    s = sass_loops.summary(instructions, 0x10, 0x40)
    assert s["count"] == 4 and s["stall_sum"] == 18 and s["opcodes"]["HGMMA"] == 1
    assert [e.split()[1] for e in sass_loops.events(instructions, 0x10, 0x40)] == [
        "0x0010",
        "0x0020",
        "0x0030",
        "0x0040",
    ]
    path = tmp_path / "k.sass"
    path.write_text(dump)
    out = run([sys.executable, "benchmarks/sass_loops.py", str(path), "--min", "1"], tmp_path)
    assert "loop 0x0010-0x0040 instructions=4 stall_sum=18" in out


def test_matmul_loop_spills_counts_the_key_loops_only():
    """The compile reports' loop_spills on a hand-written dump of a persistent program: a tile
    loop around a key loop. Of its spills (LDL / STL) only the key loop's reload counts: not the
    stores before the loops, the tile loop's own load and store around its key loop, nor one
    in a loop without a matmul (a wait's spin)."""
    from ringflash.kernels.sass import matmul_loop_spills, parse

    dump = "\n".join(_sass_line(a, t) for a, t in [
        (0x00, "STL [R1], R2"),
        (0x10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"),  # the tile loop's own matmul
        (0x20, "LDL R3, [R1]"),
        (0x30, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"),  # the key loop
        (0x40, "LDL R4, [R1+0x4]"),
        (0x50, "FADD R4, R4, R3"),
        (0x60, "@P0 BRA 0x30"),
        (0x70, "STL [R1+0x8], R4"),
        (0x80, "@P1 BRA 0x10"),
        (0x90, "LDL R5, [R1+0x8]"),
        (0xA0, "@P2 BRA 0x90"),
        (0xB0, "EXIT"),
    ])  # fmt: skip
    assert matmul_loop_spills(parse(dump)) == 1


def test_sass_loops_reads_a_profiles_samples_per_loop(tmp_path):
    """sass_loops.py --samples on a hand-written ncu source page (kernel_counters --source's
    csv: a title row, then a header): each loop's warp samples and executed instructions, most
    samples first, addresses from the kernel's first instruction; a retry stub's loop over an
    EXIT left out; --min / --max bound a loop's size."""
    from benchmarks import sass_loops

    head = '"Kernel Name","_fwd_ws2",\n"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
    rows = [(0x7F00, "MOV R1, c[0x0][0x28]", 3, 10), (0x7F10, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ", 50, 400),
            (0x7F20, "@P0 BRA 0x7f10", 7, 400), (0x7F30, "MUFU.EX2 R2, R2", 20, 200),
            (0x7F40, "FADD R2, R2, R3", 5, 200), (0x7F50, "@P1 BRA 0x7f30", 9, 200), (0x7F60, "EXIT", 1, 10),
            (0x7F70, "@!P1 BRA 0x7f40", 4, 4)]  # fmt: skip
    page = head + "".join(f'"{a:#x}","{t}","{n}","{x}"\n' for a, t, n, x in rows)
    instructions, counts = sass_loops.parse_samples(page)
    assert len(instructions) == 8 and counts[0x7F30] == (20, 200)
    path = tmp_path / "k_sass.csv"
    path.write_text(page)
    out = run([sys.executable, "benchmarks/sass_loops.py", str(path), "--samples", "--min", "1"], tmp_path)
    lines = out.strip().splitlines()
    assert lines[0] == "99 warp samples, 8 instructions", out
    assert lines[1:] == ["loop +0x00010-+0x00020 instructions=2 samples=57 executed=800",
                         "loop +0x00030-+0x00050 instructions=3 samples=34 executed=600"], out  # fmt: skip
    loops_of = lambda *a: run([sys.executable, "benchmarks/sass_loops.py", str(path), "--samples", *a], tmp_path)  # noqa: E731
    out = loops_of("--min", "3")
    assert out.strip().splitlines()[1:] == ["loop +0x00030-+0x00050 instructions=3 samples=34 executed=600"], out
    out = loops_of("--min", "1", "--max", "2")
    assert out.strip().splitlines()[1:] == ["loop +0x00010-+0x00020 instructions=2 samples=57 executed=800"], out
