"""The Gluon kernels' compile checks keep working on the CPU (sm_90a compiled with the bundled
ptxas). Apart from test_scripts.py, and from the check harnesses' dry runs
(test_gluon_harness.py), so that the two CI workers (pytest --dist loadfile) share these long
tests."""

import json
import sys

from commands import run


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
    a second wgmma group of scores), at most DENSE_SPILL_BYTES, as when measured. Whatever
    spills, none inside a key loop (those run once a key block), but one reload a block with
    per-row bounds at D=128 and in MLA's dense and causal cases (ROWS_LOOP_SPILLS,
    MLA_LOOP_SPILLS, as when measured)."""
    from ringflash.kernels.configs import (
        GLUON_FWD,
        GLUON_FWD_DENSE,
        GLUON_FWD_DOCUMENTS,
        GLUON_FWD_LONG,
        GLUON_FWD_SHORT,
    )

    ROWS_SPILL_BYTES = 40
    MLA_SPILL_BYTES, MLA_WINDOW_SPILL_BYTES = 8, 48
    # spills inside a key loop, run once a key block: a reload of one register (SASS: one LDL)
    ROWS_LOOP_SPILLS = MLA_LOOP_SPILLS = 1
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
        loop_allowed = 0
        if r["mask"] == "rows":
            allowed, loop_allowed = ROWS_SPILL_BYTES, ROWS_LOOP_SPILLS
        elif r["config"]["persistent"]:
            allowed = PERSISTENT_SPILL_BYTES
        elif r["config"]["block_nt"]:
            allowed = DENSE_SPILL_BYTES
            assert r["sass_waits"].get("2"), r  # the scores land with PV's two groups in flight
        elif (r["D"], r.get("Dv")) == (192, 128):
            allowed = MLA_WINDOW_SPILL_BYTES if r["mask"] == "window" else MLA_SPILL_BYTES
            loop_allowed = 0 if r["mask"] == "window" else MLA_LOOP_SPILLS
        else:
            allowed = 0
        assert r["spill_bytes"] <= allowed and r["loop_spills"] <= loop_allowed, r
        assert any(int(n) > 0 for n in r["sass_waits"]) and all(p.startswith("spills") for p in r["problems"]), r


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


def test_gluon_forward_dynamic_tiles_compile_for_hopper(tmp_path):
    """Persistent programs taking their tiles from a counter (ws2_pd) compile for sm_90a at D=64
    and 128, dense and causal, local (bf16) and folded (fp16): within the shared memory, a wgmma
    left in flight, the producer's counter in the SASS (two ATOMG.E.ADD: the fetch before its
    loop and the one in it; one STG.E.STRONG.GPU: the counter put back to zero), which ws2_p
    (tiles in a fixed order) has not; no spills except at D=128 causal, within
    PERSISTENT_SPILL_BYTES as ws2_p's (16-32 bytes, a few tile scalars across the key loop)."""
    from ringflash.kernels.gluon_forward import HOPPER_SHARED_BYTES

    PERSISTENT_SPILL_BYTES = 32
    cases = [f"ws2_pd:{D}:{c}:{mode}" for D in (64, 128) for c in (0, 1) for mode in ("bf16:1:0", "fp16:0:1")]
    cases += ["ws2_p:128:1:bf16:1:0"]
    run([sys.executable, "benchmarks/gluon_report.py", "--jobs", "2", "--json", str(tmp_path / "g.json")]
        + [a for c in cases for a in ("--case", c)], tmp_path, expect_ok=False)  # fmt: skip
    rows = json.loads((tmp_path / "g.json").read_text())  # (the report exits 1 on any spill)
    assert len(rows) == len(cases) and not any("error" in r for r in rows), rows
    for r in rows:
        assert r["shared"] <= HOPPER_SHARED_BYTES and any(int(n) > 0 for n in r["sass_waits"]), r
        assert all(p.startswith("spills") for p in r["problems"]), r
        if r["name"] == "ws2_p":
            assert r["tile_atomics"] == 0 and r["strong_stores"] == 0, r
            continue
        assert r["config"]["dynamic"] and r["tile_atomics"] == 2 and r["strong_stores"] == 1, r
        allowed = PERSISTENT_SPILL_BYTES if (r["D"], r["causal"]) == (128, True) else 0
        assert r["spill_bytes"] <= allowed, r


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
    persistent programs (ws2_lag_pc, its producer planning each block's query blocks; ws2_lag_pch,
    the blocks handed out in the bounds' key order)."""
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
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", "ws2_lag_pc", "ws2_lag_pch", "--head-dims",
         "128", "--rows", "--causal", "0", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json",
         str(tmp_path / "r.json")], tmp_path)  # fmt: skip
    rows += json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == len(variants) + len(padded) + 2
    assert all(r["rows"] and r["config"]["persistent"] for r in rows[-2:]) and rows[-1]["config"]["order"] == "heavy"
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
    names = ["split_d_blk", "split_d_pieces"]
    cases = [(["--v-head-dim", "128"], names), (["--v-head-dim", "192"], names),
             (["--v-head-dim", "128", "--rows"], names)]  # fmt: skip
    for i, (extra, names) in enumerate(cases):
        out = tmp_path / f"p{i}.json"
        run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", *names, "--head-dims", "192",
             "--causal", "1", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(out), *extra],
            tmp_path)  # fmt: skip
        by_name = {r["name"]: r for r in json.loads(out.read_text())}
        assert sorted(by_name) == sorted(names), by_name
        padded = by_name["split_d_blk"]
        for name in names[1:]:
            r = by_name[name]
            assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r
            assert r["shared"] <= 232448 and r["hgmma"] < 2 * padded["hgmma"], (r, padded)
        assert by_name["split_d_pieces"]["hgmma"] < padded["hgmma"]


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


def test_gluon_bwd_check_rounds_alternate_and_summarize(capsys):
    """benchmarks/gluon_bwd_check.py --rounds: each shape's implementations timed in rounds whose
    order reverses every other round, and the summary's medians and per-round ratios to the
    first variant (here: b 1.1x a in two rounds, 1.3x in one) computed from the rows."""
    from benchmarks import gluon_bwd_check as gbc

    base = ["sdpa_cudnn", "triton", "gluon:a", "gluon:b"]
    tasks = gbc.timing_tasks(["a", "b"], [16384], 32, 0, rounds=3)
    assert [t["impl"] for t in tasks if not t["causal"]] == base + base[::-1] + base
    assert [t["round"] for t in tasks if not t["causal"]] == [0] * 4 + [1] * 4 + [2] * 4
    assert len({t["id"] for t in tasks}) == len(tasks) == 24
    assert [t["impl"] for t in gbc.timing_tasks(["a"], [16384], 32, 0)][:3] == base[:3]
    speed = {"sdpa_cudnn": [300, 310, 320], "triton": [100, 100, 100], "gluon:a": [200, 210, 190],
             "gluon:b": [220, 273, 209]}  # fmt: skip
    rows = [
        dict(impl=i, S=16384, causal=False, Hkv=32, round=r, status="OK", tflops=t, ms=1.0)
        for i, ts in speed.items()
        for r, t in enumerate(ts)
    ]
    out = {"meta": {"heads": 32, "head_dim": 192}, "correctness": [], "timing": rows}
    gbc.print_summary(out, ["a", "b"], [16384])
    text = capsys.readouterr().out
    table = text.split("=== backward TFLOP/s")[1]
    assert "310.0" in table and "200.0" in table and "220.0" in table  # medians of the rounds
    assert "1.100 (1.100-1.300)" in text.split("over a, TFLOP/s of the same round")[1]
    # the forward's check, through the same helpers (benchmarks.gluon_check)
    from benchmarks import gluon_check as gc

    variants = ["ws2", "ws2_s3"]
    assert all(gc.has_config(v, 128) for v in variants)
    fwd = gc.timing_tasks(variants, [128], [4096], 32, "bf16", rounds=2)
    impls = ["sdpa_cudnn", "sdpa_flash", "triton"] + [f"gluon:{v}" for v in variants]
    assert [t["impl"] for t in fwd if not t["causal"]] == impls + impls[::-1]
    faster = {0: 1.1, 1: 1.2}  # the second variant over the first, by round
    rows = [
        dict(
            impl=i,
            D=128,
            S=4096,
            causal=False,
            round=r,
            status="OK",
            tflops=100.0 * (faster[r] if i == impls[-1] else 1),
        )
        for r in range(2)
        for i in impls
    ]
    gc.print_summary({"meta": {"heads": 32}, "correctness": [], "timing": rows}, variants, [128], [4096])
    assert "1.150 (1.100-1.200)" in capsys.readouterr().out


def test_gluon_key_bias_compiles_for_hopper(tmp_path):
    """A key bias (key padding masks) in the Gluon kernels compiles for sm_90a without spills:
    the forward's default one-tile variant (local causal, and a folded ring step), its short
    (persistent) and long (three consumers) variants, and MLA's head dims in pieces; the fused
    backward's defaults at D=128 (accumulating) and MLA's 192 / 128. The forward's bias rides
    in a TMA ring beside K: its shared memory is the same case's without a bias plus STAGES x
    128 keys x 4 bytes, within the H200's limit. The backward's zero-bias blocks branch around
    the bias instead of selecting. A forward with head dims of one piece holds two copies of
    its key loop (a tile's zero-bias blocks run the one compiled without the bias), so twice
    the case's tensor-core instructions, and its producer loads no bias for those blocks (a
    second copy of its K/V loads); MLA's, in pieces, one; likewise the non-causal
    backward at D=64 (two copies of the consumer) and the causal one at D=128 (one). No spills,
    but in the persistent programs at D=128 (the default for short non-causal key ranges),
    which spill at most PERSISTENT_BIAS_SPILL_BYTES, as when measured, none of it inside a key
    loop: tile scalars stored before a tile's key loops and loaded after them (SASS), as the
    same kernel without a bias spills 16 bytes."""
    from ringflash.kernels.configs import GLUON_BWD, GLUON_FWD, GLUON_FWD_LONG, GLUON_FWD_SHORT
    from ringflash.kernels.gluon_forward import HOPPER_SHARED_BYTES, config_for

    PERSISTENT_BIAS_SPILL_BYTES = 120
    v = GLUON_FWD[128]
    plain = [f"{v}:128:1:bf16:1:0", f"{v}:128:0:fp16:0:1", f"{GLUON_FWD_SHORT[64]}:64:1:bf16:1:0",
             f"{GLUON_FWD_LONG[64]}:64:0:bf16:1:0", f"{GLUON_FWD[256]}:192/128:1:bf16:1:0",
             f"{GLUON_FWD_SHORT[128]}:128:0:bf16:1:0"]  # fmt: skip
    cases = plain + [f"{c}:bias" for c in plain]
    # (exits 1: MLA's plain case and the persistent D=128 ones spill their known bytes,
    # test_gluon_forward_compiles_for_hopper)
    run([sys.executable, "benchmarks/gluon_report.py", "--jobs", "2", "--json", str(tmp_path / "f.json")]
        + [a for c in cases for a in ("--case", c)], tmp_path, expect_ok=False)  # fmt: skip
    rows = json.loads((tmp_path / "f.json").read_text())
    assert len(rows) == len(cases) and not any("error" in r for r in rows), rows
    for without, with_bias in zip(rows[: len(plain)], rows[len(plain) :]):
        assert with_bias.get("key_bias") and not without.get("key_bias"), (without, with_bias)
        persistent_128 = with_bias["config"]["persistent"] and with_bias["D"] == 128
        allowed = PERSISTENT_BIAS_SPILL_BYTES if persistent_128 else 0
        assert with_bias["spill_bytes"] <= allowed and with_bias["loop_spills"] == 0, with_bias
        assert all(p.startswith("spills") for p in with_bias["problems"]), with_bias
        cfg = config_for(with_bias["D"], with_bias["name"], head_dim_v=with_bias.get("Dv"))
        ring = cfg.stages * cfg.block_n * 4  # (allocations are aligned: a few bytes more)
        assert ring <= with_bias["shared"] - without["shared"] <= ring + 128, (without, with_bias)
        assert with_bias["shared"] <= HOPPER_SHARED_BYTES, with_bias
        copies = 1 if with_bias.get("Dv") else 2
        assert with_bias["hgmma"] == copies * without["hgmma"], (without, with_bias)
        # the producer: one more TMA load a K block for the bias; where versioned, a second
        # copy of its K/V loads (the zero-bias blocks', without the bias's) beside that (ptxas
        # may peel either loop, so at least that many)
        if copies == 1:
            assert with_bias["tma_loads"] == without["tma_loads"] + 1, (without, with_bias)
        else:
            assert with_bias["tma_loads"] >= without["tma_loads"] + 3, (without, with_bias)
    bwd = tmp_path / "b.json"
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", GLUON_BWD[128], "--head-dims", "128",
         "--causal", "1", "--dtypes", "bf16", "--accumulate", "1", "--key-bias", "--jobs", "1", "--json", str(bwd)],
        tmp_path)  # fmt: skip
    mla = tmp_path / "m.json"
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", GLUON_BWD[256], "--head-dims", "192",
         "--v-head-dim", "128", "--causal", "1", "--dtypes", "bf16", "--accumulate", "0", "--key-bias", "--jobs", "1",
         "--json", str(mla)], tmp_path)  # fmt: skip
    rows = json.loads(bwd.read_text()) + json.loads(mla.read_text())
    assert len(rows) == 2 and all(r["key_bias"] for r in rows)
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["sass_waits"].get("1", 0) > 0, r
    # a block in its row's zero-bias span skips the bias's FMA by a branch: made into selects
    # (both sides computed), it costs one FSEL a score (32 a thread a step at D=128) over the
    # same case without a bias; the branch itself, a select or two
    plain = tmp_path / "p.json"
    run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", GLUON_BWD[128], "--head-dims", "128",
         "--causal", "1", "--dtypes", "bf16", "--accumulate", "1", "--jobs", "1", "--json", str(plain)],
        tmp_path)  # fmt: skip
    (without,) = json.loads(plain.read_text())
    assert rows[0]["fsel"] - without["fsel"] <= 8, (without["fsel"], rows[0]["fsel"])
    assert rows[0]["hgmma"] == without["hgmma"], (without, rows[0])
    d64 = []
    for i, flag in enumerate(([], ["--key-bias"])):
        run([sys.executable, "benchmarks/gluon_bwd_report.py", "--variants", GLUON_BWD[64], "--head-dims", "64",
             "--causal", "0", "--dtypes", "bf16", "--accumulate", "0", *flag, "--jobs", "1", "--json",
             str(tmp_path / f"d64_{i}.json")], tmp_path)  # fmt: skip
        d64 += json.loads((tmp_path / f"d64_{i}.json").read_text())
    assert d64[1]["key_bias"] and d64[1]["spill_bytes"] == 0 and not d64[1]["problems"], d64[1]
    assert d64[1]["hgmma"] == 2 * d64[0]["hgmma"], d64
