"""The examples run and check themselves (toy sizes, CPU, gloo on 2 processes)."""

import re
import sys

import pytest

from commands import TWO_RANKS, run

TRAIN = "examples/train_long_context.py"


def _losses(out):
    """The per-step losses the training example printed, in order."""
    return [float(x) for x in re.findall(r"step +\d+/\d+ +loss ([0-9.]+)", out)]


def test_quickstart_two_ranks(tmp_path):
    out = run(TWO_RANKS + ["examples/quickstart.py"], tmp_path)
    assert "world 2" in out
    # the script exits 1 past its tolerance, derived from one-device attention's error against float64
    err, tol = map(float, re.search(r"max abs error ([0-9.e+-]+) .* \(tolerance ([0-9.e+-]+)\)", out).groups())
    assert err <= tol


def test_quickstart_one_process(tmp_path):
    out = run([sys.executable, "examples/quickstart.py"], tmp_path)
    assert "world 1" in out and "max abs error" in out


@pytest.mark.parametrize(
    "flags,reference,shown",
    [([], "flash_attn_func", []), (["--packed"], "flash_attn_varlen_func", ["layout balanced", "packed documents"])],
    ids=["sequence", "packed"],
)
def test_train_check_matches_one_process(tmp_path, flags, reference, shown):
    out = run(TWO_RANKS + [TRAIN, *flags, "--check", "--steps", "3", "--seq-len", "256"], tmp_path)
    assert all(text in out for text in shown), out
    assert f"check: 2-rank ring vs 1-process {reference}, first 3 steps" in out
    for step in (1, 2, 3):
        assert re.search(rf"step {step}: ring [0-9.]+ +single [0-9.]+", out), out
    assert "check passed" in out


def test_train_check_with_16bit_grad_accumulators(tmp_path):
    out = run(
        TWO_RANKS
        + [TRAIN, "--check", "--steps", "3", "--seq-len", "256", "--dtype", "bfloat16", "--grad-accum", "input"],
        tmp_path,
    )
    assert "bfloat16, bfloat16 gradient accumulators" in out and "check passed" in out, out


def test_train_loss_falls(tmp_path):
    # the other layout, and enough steps (>= 50) that the script itself checks the loss fell
    out = run(TWO_RANKS + [TRAIN, "--steps", "50", "--seq-len", "256", "--layout", "contiguous"], tmp_path)
    losses = _losses(out)
    assert len(losses) >= 5 and "tok/s" in out
    assert losses[-1] < losses[0] - 2.0, losses  # from ln(256) ~ 5.55 to well under 3.5
    first, last = map(float, re.search(r"first loss ([0-9.]+) +last loss ([0-9.]+)", out).groups())
    assert (first, last) == (losses[0], losses[-1])


@pytest.mark.parametrize("packed", [[], ["--packed"]], ids=["sequence", "packed"])
def test_train_one_process_check(tmp_path, packed):
    """The example without torchrun: one process, where the ring call is the local call, so
    --check compares a computation with itself and must find no difference at all (bitwise);
    the two-process tests above are the ones that check the ring's arithmetic."""
    out = run(
        [sys.executable, TRAIN, "--check", "--steps", "2", "--check-steps", "2", "--seq-len", "128", *packed], tmp_path
    )
    assert "world 1" in out and "check passed: max rel diff 0.0e+00" in out, out


def test_train_packed_window_check_matches_one_process(tmp_path):
    out = run(
        TWO_RANKS + [TRAIN, "--packed", "--window", "32", "--check", "--steps", "3", "--seq-len", "256"], tmp_path
    )
    assert "causal window of 32 keys" in out and "check passed" in out, out


# A user's classic mistake, made in a wrapper around the unchanged example: RoPE positions of
# the LOCAL tensor (0 .. S/P-1 on every rank) instead of ringflash.local_positions. Every rank's
# attention is still exact, but the model differs from the one-process model: --check must fail.
LOCAL_POSITIONS_BUG = """
import os, runpy, sys
import torch
import ringflash
world = int(os.environ["WORLD_SIZE"])
ringflash.local_positions = lambda seq_len, *, group=None, layout="zigzag", device=None: (
    torch.arange(seq_len // world, device=device))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _check_fails_under(bug: str, tmp_path, *flags):
    """The training example run with --check inside a wrapper that plants `bug`: the check fails."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(bug)
    out = run(
        TWO_RANKS + [str(wrapper), TRAIN, *flags, "--check", "--steps", "3", "--seq-len", "256"],
        tmp_path,
        expect_ok=False,
    )
    assert "check FAILED" in out


def test_train_check_catches_wrong_positions(tmp_path):
    _check_fails_under(LOCAL_POSITIONS_BUG, tmp_path)


# The packed user's mistake, in a wrapper around the unchanged example: the ring given the
# packed row as ONE document (layout and attention), so tokens attend across documents while
# the one-process reference keeps them apart: --check must fail. (Positions that do not restart
# at each document would not do: RoPE scores depend only on offsets within a document.)
ONE_DOCUMENT_BUG = """
import runpy, sys
import torch
import ringflash
build, attend = ringflash.balanced_layout, ringflash.ring_flash_attn_varlen_func
whole = lambda cu: torch.tensor([0, int(cu[-1])], dtype=cu.dtype, device=cu.device)
ringflash.balanced_layout = lambda cu_seqlens, world, **kw: build(whole(cu_seqlens), world, **kw)
ringflash.ring_flash_attn_varlen_func = lambda q, k, v, cu_seqlens, **kw: attend(q, k, v, whole(cu_seqlens), **kw)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_train_packed_check_catches_attention_across_documents(tmp_path):
    _check_fails_under(ONE_DOCUMENT_BUG, tmp_path, "--packed")
