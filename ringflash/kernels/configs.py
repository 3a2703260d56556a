"""Block shapes for the Triton kernels, named in one place.

Which config a kernel launch uses, in order: one set by override() around the call (the tuning
sweep and tests), the interpreter's small one when TRITON_INTERPRET=1, an entry of the file
named by RINGFLASH_KERNEL_CONFIGS (read once, at import), the built-in table below.

RINGFLASH_KERNEL_CONFIGS=path.json replaces entries for other GPUs, as written by
`python -m benchmarks.bench_local --tune --write-configs path.json`:
{"fwd": {"128": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "tma": true}}, ...}
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    tma: bool = False  # streamed tiles through tensor descriptors (the tensor-memory engine)
    warp_specialize: bool = False  # tl.range(..., warp_specialize=True) on the unmasked loop
    # dK/dV pass only: recompute the scores as Q K^T, the forward's operand order, and transpose
    # them, so the rebuilt probabilities are bitwise the forward's where a matmul's rounding
    # depends on its operand order (numpy's BLAS under the interpreter)
    qk_order: bool = False
    # dK/dV pass only, 16-bit inputs: rebuild the probabilities from m + log2(l), one offset per
    # row, instead of exp2(s2 - m) / l (exact at any |scores|, one more multiply per score). On
    # by default, so that a config from a file or a sweep cannot drop it unasked: without it a
    # 16-bit dK/dV loses accuracy at large scores; False only to measure what it costs
    combined_stats: bool = True


# Triton reads TRITON_INTERPRET once, when it is imported; so do we.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
KINDS = ("fwd", "dkdv", "dq")


# Interpreter: tl.dot runs in numpy; warps and stages are ignored. The three kernels use the same
# (32 query rows, 16 key rows) tiles and the dK/dV pass the forward's operand order: numpy's
# matmul rounds differently for other shapes or operand orders, and the backward must rebuild
# the forward's probabilities exactly (at |scores| ~ 1e4 a rounding of s is 1e-3 of a weight).
_INTERP_FWD = KernelConfig(32, 16, 4, 1)
_INTERP_DKDV = KernelConfig(32, 16, 4, 1, qk_order=True)
_INTERP_DQ = KernelConfig(32, 16, 4, 1)

# Hopper (H200), keyed by padded head dim (the larger of q/k's and v's when they differ:
# kernels._config_d; no shape is tuned for unequal dims). D=64 and D=128, and D=256's backward:
# the choice of the sweep `bench_local --tune --write-configs` on one H200 (B=1, H=32, S=16K,
# bf16), committed as benchmarks/results/configs_h200.json (a test keeps the two equal). D=32
# and D=256's Triton forward (the Gluon one runs there): not tuned, checked for correctness on an
# H200.
_FWD = {
    32: KernelConfig(128, 64, 4, 4),
    64: KernelConfig(128, 64, 4, 4, tma=True),
    128: KernelConfig(128, 128, 8, 3, tma=True),
    256: KernelConfig(64, 64, 8, 2),
}
_DKDV = {
    32: KernelConfig(32, 128, 4, 3),
    64: KernelConfig(64, 64, 4, 3, tma=True),
    128: KernelConfig(64, 128, 8, 3, tma=True),
    # spills 152-348 bytes (kernel_report); the spill-free shapes measured slower (benchmarks/NOTES.md)
    256: KernelConfig(32, 64, 8, 2, tma=True),
}
_DQ = {
    32: KernelConfig(128, 32, 4, 3),
    64: KernelConfig(128, 64, 4, 3, tma=True),
    128: KernelConfig(128, 64, 8, 3, tma=True),
    256: KernelConfig(64, 64, 8, 2, tma=True),
}

# Packed documents (MASK_ROWS): most key tiles are a document's edge or diagonal, and smaller
# query tiles waste fewer pairs there (one H200, bf16, H=32, D=128: forward 11-26% faster than
# the 128x128 tiles on documents of 64-2K tokens, equal on long-tailed 128-32K at 64K tokens;
# benchmarks/results/packed_variants_h200.json). Other head dims: the dense table.
_FWD_DOCUMENTS = {128: KernelConfig(64, 64, 4, 3, tma=True)}
# The two backward passes on packed documents, the same reason: 32 query rows x 64 keys (dK/dV)
# and 64 x 32 (dQ). One H200, bf16, H=32, D=128, causal documents of 64-2K tokens, forward +
# backward 11% faster than the dense tables' shapes at 16K tokens, 3% at 64K (python -m
# benchmarks.packed --mixes short --variants ...; benchmarks/results/packed_bwd_sweep_h200.log).
_DKDV_DOCUMENTS = {128: KernelConfig(32, 64, 4, 3, tma=True)}
_DQ_DOCUMENTS = {128: KernelConfig(64, 32, 4, 3, tma=True)}
_DOCUMENTS = {"fwd": _FWD_DOCUMENTS, "dkdv": _DKDV_DOCUMENTS, "dq": _DQ_DOCUMENTS}

# The Gluon (warp-specialized) forward's variant per padded head dim on Hopper, where it beats
# the Triton kernel (ringflash.kernels.gluon_forward; one H200, bf16, S=16K, forward: D=64
# 1.11-1.13x, D=128 1.19-1.23x, D=256 2.7-3.0x; benchmarks/RESULTS.md). Used for blocks
# without a key bias or dropout, dense, causal or windowed; packed documents (per-row bounds)
# take GLUON_FWD_DOCUMENTS. Any other block, head dim or GPU takes the Triton kernel.
# ws2_s3 has entries by tile widths for head dims run in two pieces (kernels.head_dim_pieces),
# forward (python -m benchmarks.bench_local --head-dims 192 96 [--v-head-dim 128]): MLA's 192 /
# 128 on 128-key blocks 1.05-1.11x cuDNN (64-key blocks 0.95-1.03x, padded to 256 0.86-0.90x);
# 192 in pieces 0.95-0.98x (padded to 256 0.82-0.85x), 96 1.12-1.21x (padded 1.02-1.05x);
# benchmarks/results/gluon_fwd_pieces_h200.log, gluon_fwd_qk_pieces_h200.log.
GLUON_FWD = {64: "ws2_s3", 128: "ws2_s3", 256: "ws2_s3"}
# Up to GLUON_PERSISTENT_MAX_KEYS keys (dense or causal blocks, not packed documents): persistent
# programs (ws2_p: the next tile's loads overlap the last one's output). One H200, bf16, B=1,
# H=32, forward, ws2_p over ws2_s3 (python3 benchmarks/gluon_check.py --head-dims 64 128
# --seqlens 4096 16384 --variants ws2_s3 ws2_p --skip-correctness; results/gluon_persistent_timing_h200.*):
# 4K keys D=64 1.05 / 1.08, D=128 1.03 / 1.03 (non-causal / causal); 16K keys 0.92 / 0.88 at
# D=128 (D=64 1.01 / 0.94), so not there. Unexplained: under Nsight Compute (one call, D=128,
# 16K, non-causal) the two took the same time with L2 hit rates alike (97.7 / 98.7%;
# python -m benchmarks.kernel_counters --seqlen 16384 --head-dims 128 --causal no --modes fwd
# --impls gluon=ws2_s3 gluon=ws2_p; results/kernel_counters_persistent_16k_h200.txt).
GLUON_FWD_SHORT = {64: "ws2_p", 128: "ws2_p"}
GLUON_PERSISTENT_MAX_KEYS = 4096
# Causal blocks (a window with no left bound) up to GLUON_PERSISTENT_MAX_KEYS keys: at D=128 the
# one-tile programs, dispatched a few heads together heaviest first, now beat the persistent
# ones' static order: ws2_s3 over ws2_p at 4K causal 1.035-1.046 in four runs on two machine
# starts (python3 benchmarks/gluon_check.py --head-dims 64 128 --seqlens 4096 8192 --variants
# ws2_k192e ws2_s3 ws2_p --skip-correctness, and the order reversed; results/gluon_short_causal_h200_*,
# gluon_wide_keys_h200_run1/2.txt); at D=64 ws2_p stays ahead (1.005 / 1.011).
GLUON_FWD_SHORT_CAUSAL = {64: "ws2_p"}
# From GLUON_LONG_MIN_KEYS keys (dense or causal blocks, not sliding windows or packed documents):
# three consumer warpgroups on 192-row tiles with P made 16-bit early (ws3, FA3's D=64 shape):
# more matmuls in flight per softmax, where D=64's matmuls are half D=128's and the softmax is
# not. One H200, bf16, B=1, H=32, forward, ws3 over ws2_s3, non-causal / causal (python3
# benchmarks/gluon_check.py --head-dims 64 --seqlens 8192 16384 32768 65536 --variants ws2_s3
# ws3 --skip-correctness; two machine starts, results/gluon_early_p_h200.*,
# gluon_ws3_keys_h200.*): 4K 0.98 / 0.95 (so not there), 8K 1.07 / 1.03, 16K 0.98-1.00 /
# 1.02-1.05, 32K 1.13 / 1.05, 64K 1.10-1.11 / 1.06-1.09.
GLUON_FWD_LONG = {64: "ws3"}
GLUON_LONG_MIN_KEYS = 8192
# Causal blocks take GLUON_FWD_LONG from fewer keys: since the causal tiles' launch order (heaviest
# first, a few heads together) ws3 leads at 4K too. bf16, B=1, H=32, D=64, S=4096, causal, ws3
# over ws2_p (this size's default before): one H100 1.041 and 1.042, the order swapped (python3
# benchmarks/gluon_check.py --head-dims 64 --seqlens 4096 --variants ws2_p ws3 --skip-correctness,
# then ws3 ws2_p; results/gluon_check_ws3_4k_h100{,_swapped}.log); one H200 ~1.04 in two earlier runs
# (results/gluon_rescale_early{,_swapped}_h200.txt). Non-causal 4K stays with ws2_p (ws3 0.93-0.95x).
GLUON_LONG_MIN_KEYS_CAUSAL = 4096
# Dense blocks (no mask, head dims of one piece each) from GLUON_DENSE_MIN_KEYS keys: 192-key
# blocks in two pieces (ws2_k192e: 128 + 64 keys, two stages, P made 16-bit early; 20 bytes
# spilled), the loop's fixed work (barriers, row reductions, waits) spread over 1.5x the keys.
# One H200, bf16, B=1, H=32, forward, non-causal, ws2_k192e over ws2_s3 in three runs on one
# machine start (python3 benchmarks/gluon_check.py --head-dims 128 --seqlens 4096 16384 32768
# 65536 --variants ws2_k192e ws2_s3 ws2_p --skip-correctness; results/gluon_wide_keys_h200_*):
# 4K 0.96-0.98 (so not there), 16K 1.00-1.05, 32K 1.03, 64K 1.04-1.06. Causal blocks, mixed
# (4K 0.93-0.94, 16K 0.96-1.00, 32K 0.90-0.92, 64K 1.00-1.04), keep GLUON_FWD.
GLUON_FWD_DENSE = {128: "ws2_k192e"}
GLUON_DENSE_MIN_KEYS = 16384
# Packed documents (per-row bounds). The 128-key variants spill with per-row bounds (40 bytes
# at D=128, 8 at D=256: python benchmarks/gluon_report.py --masks rows) and are still faster
# than the spill-free 128x64 ws2_n64: one H200, bf16, H=32, long-tailed documents of 16K / 64K
# tokens, forward (python -m benchmarks.packed --no-peers --mixes longtail --modes fwd
# --variants gluon=ws2_s3 gluon=ws2_n64 ...): D=128 1.12x / 1.11x; D=64 (no spills) 1.13x / 1.11x.
GLUON_FWD_DOCUMENTS = {64: "ws2_s3", 128: "ws2_s3", 256: "ws2"}
# Below this many keys per query row on average (RowBounds.keys_per_row; per head dim), packed
# documents take the Triton forward: its 64-row tiles with few key blocks each beat the Gluon
# kernel's 128-row tiles there, whose set-up per tile is paid for few blocks. One H200, bf16,
# 64K tokens of causal documents of N tokens each (N / 2 keys per row; python -m
# benchmarks.packed --no-peers --mixes fixed:N ...), Gluon over Triton forward speed for
# N = 1024 / 2048 / 4096: D=128 0.96 / 0.90 / 1.13; D=64 0.75 / 0.84 / 0.94 (long-tailed
# documents, 4381 and 6539 keys per row: 1.05 / 1.05); D=256 2.2x already at N = 1024 (its
# Triton forward is slow).
GLUON_DOCUMENTS_MIN_KEYS_PER_ROW = {64: 4096, 128: 1536, 256: 0}
# ...counted over the rows that see a key (RowBounds.keys_per_seeing_row) instead: the tiles of
# rows that see nothing end at once in either kernel, and a windowed ring's neighbour block is
# mostly such rows, whose mean over every row sends it to the Triton forward. The same where
# every row sees keys (where the threshold was tuned). Off until timed on a GPU, with the Gluon
# forward's correctness on such blocks (benchmarks/NOTES.md, "Next GPU run").
GLUON_DOCUMENTS_SEEING_ROWS = False

# The fused Gluon backward's variant per padded head dim on Hopper (one kernel per key block:
# dK, dV in registers, dQ added in float32 by atomics, so not bitwise reproducible; callers
# asking for determinism keep the two Triton passes). One H200, bf16, B=1, H=32, D=128, S=16K,
# whole backward: 532-562 TFLOP/s against the two Triton passes' 400-417 and cuDNN's 517-546
# (python benchmarks/gluon_bwd_check.py --quick); forward+backward through the package, D=64 and
# 128, S=16K-64K: 1.00-1.08x cuDNN (python -m benchmarks.bench_local; benchmarks/RESULTS.md).
# Blocks with a key bias, dropout or per-row bounds take the Triton passes.
# D=256 (and 192, run 256 wide): the head-dim split schedule (64-key blocks, each consumer
# warpgroup owning half of dK, dV and dQ's columns), blocked dQ: one H200, bf16, H=32, S=16K,
# whole backward 375-396 TFLOP/s against the two Triton passes' 159-180 and cuDNN's 360-385
# (python benchmarks/gluon_bwd_check.py --quick --head-dim 256 --variants split_d split_d_blk;
# row-major dQ atomics 298-303); forward+backward through the package D=256 1.02-1.07x cuDNN,
# D=192 0.91-0.92x (python -m benchmarks.bench_local --seqlens 16384 --head-dims 192 256).
# q/k = 192 runs in pieces (128 + 64, split_d_pieces; other head dims padded to 256 run as
# split_d_blk): one H200, bf16, H=32, v = 128, S=16K, whole backward 345-352 TFLOP/s against
# split_d_blk's 288-291 and cuDNN's 306 (non-causal) / 462 (causal) (python
# benchmarks/gluon_bwd_check.py --quick --seqlens 16384 --head-dim 192 --v-head-dim 128
# --variants split_d_blk split_d_pieces).
# Causal blocks at D = 64 and 128 take key block j of a few kv heads before any key block j + 1
# (ws2_lag_grouped: the launch does not end on one head's heaviest key blocks; packed documents
# keep the grid's order). One H200, bf16, B=1, H=32, whole backward, causal, over ws2_lag (python3
# benchmarks/gluon_bwd_check.py --variants ws2_lag ws2_lag_grouped --seqlens 4096 8192 16384
# --head-dim 64 / 128; results/gluon_bwd_grouped_d{64,128}_h200.*): 4K 1.09 / 1.10, 8K 1.04 /
# 1.02, 16K 0.99 / 0.99 (D=64 / 128; non-causal blocks launch the same kernel as before).
# And each key block walks its query blocks from the last one down (ws2_lag_grouped_down): causal
# key blocks side by side, whose first query blocks differ, then stream the same Q, dO and dQ
# rows at once (as non-causal ones do walking up), which D=64's half-size matmuls feel. Same
# machine, whole backward over ws2_lag_grouped, two runs, the order swapped (python3
# benchmarks/gluon_bwd_check.py --variants ws2_lag_grouped ws2_lag_grouped_down --seqlens 4096
# 8192 16384 --head-dim 64 / 128; results/gluon_bwd_walk_down_*): D=64 causal 4K
# 1.02-1.03, 8K 1.05, 16K 1.05-1.10, GQA 32/8 16K 1.02-1.04, non-causal 0.99-1.02; D=128
# 0.99-1.01 (one run), kept for one variant at both.
# At D=64 causal launches run persistent programs that take their key blocks from a counter
# (ws2_lag_grouped_down_pcc: the same blocks in the same order, the next one's first loads under
# the last one's final steps). Same machine, whole backward over ws2_lag_grouped_down, causal
# (python3 benchmarks/gluon_bwd_check.py --variants ws2_lag_grouped_down_pc ws2_lag_grouped_down
# --seqlens 4096 8192 16384 --head-dim 64; results/gluon_bwd_persistent_counter_*; two runs):
# 4K 1.09-1.10, 8K 1.10, 16K 1.08-1.10, GQA 32/8 1.13-1.17; non-causal 0.88-0.95 and D=128 causal
# 0.88-1.00, so neither takes it (benchmarks/NOTES.md "Persistent backward programs"). With dK / dV
# stored in vectors again (two runs, the order swapped; results/gluon_bwd_persistent_stores_*):
# D=64 causal 1.13-1.16, non-causal 0.98-0.99; D=128 0.98-1.03, on average 1.01 (within a run's
# noise, so D=128 keeps one block a program).
GLUON_BWD = {64: "ws2_lag_grouped_down_pcc", 128: "ws2_lag_grouped_down", 256: "split_d_pieces"}
# A fused launch has one program per (key block of 128, kv head): below this many per SM the
# two passes (more, smaller programs) win. One H200, a ring rank's calls at 2K-key tasks and 8 kv
# heads (128 programs on 132 SMs): fused 11.2 ms against 10.3 ms; at 8K-key tasks, 8 kv heads
# per chunk (512 programs): fused 120 ms against 141 ms (python -m benchmarks.bench_blockops
# --sections replay --backward default deterministic). The threshold sits between.
GLUON_BWD_MIN_PROGRAMS_PER_SM = 2
# ...except in a one-device call this small (batch x query heads x queries x keys), where the
# fused kernel's one launch saves more host time than its idle SMs cost. One H200, bf16, D=64
# and 128, causal and not, forward+backward with the threshold at 0 against as above
# (python -m benchmarks.compare_versions --baseline .baseline --seqlens 1024 2048 4096
# --kv-heads 8 --variants bwd_min_programs=0; and --kv-heads 32 --seqlens 1024): 1.11-2.34x
# with 8 kv heads (64-256 programs), 1.73-3.31x at 1K with 32; the largest row, 4K keys and 32
# query heads, is this bound. Above it the threshold holds, as where it was set (a ring rank's
# device-bound 2K-key tasks at 128 programs: fused 11.2 ms against 10.3); larger local calls of
# few programs (one or two kv heads) are not timed.
GLUON_BWD_SHORT_CALL_PAIRS = 32 * 4096 * 4096
# A key bias (key padding masks) in the Gluon forward and the fused backward: each K block's
# bias loaded by TMA beside it (forward), each key block's once (backward), added by the
# Triton kernels' own FMA (compiled without spills: python benchmarks/gluon_report.py --masks
# "" bias; python benchmarks/gluon_bwd_report.py --key-bias). Correct against float64 on one
# H100 and one H200 in one-device calls (tests/test_gpu_local.py -k gluon_key_bias) and on the
# replayed ring, folded and accumulating steps (tests/test_gpu_ring.py -k key_padding, one
# H200). False: the Triton kernels take a key bias.
GLUON_KEY_BIAS = True
# ...and the key blocks past a batch row's last key its bias does not hide (a key padding
# mask's trailing padding) skipped by both kernels (key_bias.key_spans; a tile the producer
# and the consumers cut differently would stop the kernel, so both cut by one rule). False:
# the kernels get every row's Sk and cut nothing.
GLUON_CUT_KEY_PADDING = True
# ...and the keys of a batch row's zero-bias span (key_bias.key_spans: its first run of keys
# whose bias is 0.0, in multiples of 384) computed as if there were no bias, in every kernel
# alike: the Gluon forward's blocks there take one FMA a score instead of the bias's two, and
# no bias read. Both checked on one H200 (the tests above with both on, and -k hides_nothing:
# a mask that hides no key gives bit for bit what no mask gives). One H200, bf16, B=4
# right-padded, H=32, S=4K, D=64 / 128, causal and not (python -m benchmarks.key_padding):
# the spans 1.00-1.30x forward, 1.00-1.07x forward+backward over the bias everywhere; with the
# cut 1.07-1.67x / 1.07-1.28x. False: every span empty, the bias on every key.
PLAIN_ZERO_BIAS_KEYS = True
# Packed documents (per-row bounds) in the fused backward: checked against float64 on one H200
# (tests/test_gpu_local.py -k documents). One H200, bf16, H=32, D=128, causal documents,
# forward+backward over the two Triton passes (python -m benchmarks.packed --variants
# gluon_bwd=ws2_lag gluon_bwd=none): long-tailed mix 1.20x (16K) / 1.11x (64K), short documents
# 0.96x / 1.04x. (The head-by-head grid order and the upward walk: what was measured here.)
# At D=128 in persistent programs (ws2_lag_pc, the producer planning each key block's query
# blocks): same machine, forward+backward over ws2_lag (python -m benchmarks.packed --totals
# 65536 131072 --mixes longtail short --variants gluon_bwd=ws2_lag gluon_bwd=ws2_lag_pc):
# long-tailed 1.02-1.03x, short documents 1.04-1.05x; a P=8 ring rank's backward at 128K 0.93x
# (python -m benchmarks.packed_ring_replay --totals 131072 --worlds 8 --kernels
# --documents-backward one-block persistent). At D=64 the same replay (--head-dim 64, two runs,
# the order swapped; benchmarks/results/packed_ring_replay_d64_persistent_documents_*): each
# rank's backward 0.91-0.93x at P=8, 0.92-0.95x at P=4, by device time; one GPU, two runs:
# long-tailed 0.98-1.08x, short 1.01-1.08x (results/packed_persistent_documents_d64*_h200.txt).
# Their key blocks handed out most query blocks first where the bounds have a key order (a ring
# step's: masks.RowBounds.key_order; ws2_lag_pch), so that a launch does not end on the last
# head's heaviest blocks. One H200, bf16, H=32 / 8 kv heads, D=128, 128K tokens, P=8, the
# busiest rank by device time over ws2_lag_pc's key-block order (python -m
# benchmarks.packed_ring_replay --totals 131072 --worlds 8 --kv-heads 8 --kernels --kernel-calls 3
# --no-inline --documents-backward default heavy-first, with and without --window 4096): a 4K
# window 8.23 -> 7.19 and 8.78 -> 7.82 ms (two runs, the order swapped), causal documents 20.20
# -> 16.87 ms. A whole packed batch on one device keeps the grid's order: the same order there
# made the one-device call 9-12% (window) and 30% (causal) slower, its 8 kv heads' blocks side by
# side streaming 8x the query rows through L2 (benchmarks/NOTES.md "key order"). D=64, the same
# replay with --head-dim 64 on one H100: busiest rank 5.49 -> 4.73 ms (window), 12.61 -> 11.57
# (causal documents).
GLUON_BWD_DOCUMENTS = {64: "ws2_lag_pch", 128: "ws2_lag_pch", 256: GLUON_BWD[256]}
# ... for calls of at least this many visible (query, key) pairs x query heads (B x Sq x Hq x
# RowBounds.keys_per_row): below, the fused launch's host time (row statistics, dQ scratch, five
# TMA descriptors) outweighs its faster kernel. One H200, bf16, H=32, D=128, causal documents,
# fused against the two passes (python -m benchmarks.packed --variants gluon_bwd=none
# gluon_bwd=ws2_lag; benchmarks/results/packed_h200_docs_bwd.log): 27 short documents in 16K
# (2.8e8) forward+backward 1.09x, long-tailed 16K (2.3e9) 1.30x; a packed ring rank replayed,
# S=128K, long-tailed documents (python -m benchmarks.packed_ring_replay --documents-backward
# default fused two-pass): P=8 (1.1e8 per call) 28.2 ms against 33.8, P=4 (4.4e8) 37.3 against
# 47.3. Not measured below 1.1e8, so the threshold stays just under it.
GLUON_BWD_DOCUMENTS_MIN_PAIRS = 100_000_000

# float32 inputs take twice the shared memory per tile: the 16-bit shapes above overflow an H200's
# 227 KiB at head dim 128 and 256 (forward 448 KiB, dK/dV 353 KiB at D=128, compiled for sm_90a:
# `python -m benchmarks.kernel_report --dtype fp32 --head-dims 128 --shape ...` with the 16-bit
# shape; without --shape it compiles these). These halve the tiles and stages. Not tuned.
_FLOAT32 = {
    "fwd": {128: KernelConfig(64, 64, 4, 2, tma=True), 256: KernelConfig(32, 32, 4, 2)},
    "dkdv": {128: KernelConfig(32, 64, 4, 2, tma=True), 256: KernelConfig(32, 32, 4, 1)},
    "dq": {128: KernelConfig(64, 32, 4, 2, tma=True), 256: KernelConfig(32, 32, 4, 1)},
}

# Process-wide, not per thread or context: autograd runs a CUDA backward on its own thread, and an
# override around forward and backward must reach the backward's kernels too.
_OVERRIDES: dict = {}


@contextlib.contextmanager
def override(**configs: KernelConfig):
    """Inside the block, the given kernels (fwd=, dkdv=, dq=) use these configs for every head
    dim, e.g. `with override(fwd=KernelConfig(128, 64, 8, 3)):` (the tuning sweep, tests). It
    holds for the whole process while the block runs (autograd's backward thread included), so
    it is for one thread's use at a time;
    gluon= names the Gluon forward variant to run where it takes the inputs (a key of
    gluon_forward.VARIANTS; None: never; a Triton fwd= override alone also turns it off);
    gluon_bwd= the fused Gluon backward's (gluon_backward.VARIANTS; None: never; a dkdv= or
    dq= override alone also turns it off)."""
    unknown = set(configs) - set(KINDS) - {"gluon", "gluon_bwd"}
    if unknown:
        raise ValueError(f"override: unknown kernel(s) {sorted(unknown)}; expected some of {KINDS}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(configs)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def read_configs(path: str) -> dict:
    """A RINGFLASH_KERNEL_CONFIGS file -> {kind: {block_d: KernelConfig}}."""
    with open(path) as f:
        raw = json.load(f)
    return {kind: {int(d): KernelConfig(**cfg) for d, cfg in by_d.items()} for kind, by_d in raw.items()}


_FILE = os.environ.get("RINGFLASH_KERNEL_CONFIGS")
_FILE_CONFIGS = read_configs(_FILE) if _FILE else {}


def write_configs(path: str, chosen: dict) -> None:
    """chosen: {kind: {block_d: KernelConfig}} -> the RINGFLASH_KERNEL_CONFIGS format."""
    with open(path, "w") as f:
        json.dump({kind: {str(d): asdict(c) for d, c in by_d.items()} for kind, by_d in chosen.items()}, f, indent=1)


_TABLES = {"fwd": (_FWD, _INTERP_FWD), "dkdv": (_DKDV, _INTERP_DKDV), "dq": (_DQ, _INTERP_DQ)}


def pick(
    kind: str,
    block_d: int,
    *,
    float32: bool = False,
    interpreting: bool | None = None,
    file_configs: dict | None = None,
) -> KernelConfig:
    """The config kernel `kind` uses for padded head dim block_d (the order in the module
    docstring; float32 inputs: the _FLOAT32 shapes where the 16-bit ones would not fit);
    interpreting and file_configs default to what the environment said at import."""
    chosen = _OVERRIDES.get(kind)
    if chosen is not None:
        return chosen
    interpreting = INTERPRETING if interpreting is None else interpreting
    file_configs = _FILE_CONFIGS if file_configs is None else file_configs
    table, interp = _TABLES[kind]
    if interpreting:
        return interp
    chosen = file_configs.get(kind, {}).get(block_d)
    if chosen is not None:
        return chosen
    if float32 and block_d in _FLOAT32[kind]:
        return _FLOAT32[kind][block_d]
    return table[max(block_d, 32)]


def kind_config(kind: str, block_d: int, documents: bool = False, float32: bool = False) -> KernelConfig:
    """pick(kind, ...), or for a block masked by per-row intervals (packed documents, 16-bit)
    the documents table's shape where it has one and neither override() nor the
    RINGFLASH_KERNEL_CONFIGS file decides."""
    if (
        documents
        and not float32
        and not INTERPRETING
        and kind not in _OVERRIDES
        and block_d not in _FILE_CONFIGS.get(kind, {})
        and block_d in _DOCUMENTS[kind]
    ):
        return _DOCUMENTS[kind][block_d]
    return pick(kind, block_d, float32=float32)


def forward_config(block_d: int, documents: bool = False, float32: bool = False) -> KernelConfig:
    """The forward's config; documents: a block masked by per-row intervals (packed documents)."""
    return kind_config("fwd", block_d, documents, float32)


def gluon_forward_variant(
    block_d: int,
    documents: bool = False,
    keys_per_row: float | None = None,
    keys: int | None = None,
    dense: bool = False,
    causal: bool = False,
) -> str | None:
    """The Gluon forward variant for this head dim (documents: a block masked by per-row
    bounds whose rows see keys_per_row keys on average, where known; keys: the block's key
    count, where known (None for sliding windows): GLUON_FWD_SHORT up to
    GLUON_PERSISTENT_MAX_KEYS, GLUON_FWD_LONG from GLUON_LONG_MIN_KEYS (causal blocks from
    GLUON_LONG_MIN_KEYS_CAUSAL, before the short ones); dense: a block with no
    mask whose head dims are block_d, one piece each: GLUON_FWD_DENSE from
    GLUON_DENSE_MIN_KEYS, before GLUON_FWD_LONG; causal: a window with no left bound, whose
    short key ranges take GLUON_FWD_SHORT_CAUSAL instead of GLUON_FWD_SHORT), or None: none is
    tuned for it, the documents are short (GLUON_DOCUMENTS_MIN_KEYS_PER_ROW), a Triton config
    is forced by override() or the RINGFLASH_KERNEL_CONFIGS file, or the kernels are
    interpreted. override(gluon=name) forces a variant (None: the Triton forward)."""
    overrides = _OVERRIDES
    if "gluon" in overrides:
        return overrides["gluon"]
    if INTERPRETING or "fwd" in overrides or block_d in _FILE_CONFIGS.get("fwd", {}):
        return None
    if not documents:
        if causal and keys is not None and keys >= GLUON_LONG_MIN_KEYS_CAUSAL and block_d in GLUON_FWD_LONG:
            return GLUON_FWD_LONG[block_d]
        short = GLUON_FWD_SHORT_CAUSAL if causal else GLUON_FWD_SHORT
        if keys is not None and keys <= GLUON_PERSISTENT_MAX_KEYS and block_d in short:
            return short[block_d]
        if dense and keys is not None and keys >= GLUON_DENSE_MIN_KEYS and block_d in GLUON_FWD_DENSE:
            return GLUON_FWD_DENSE[block_d]
        if keys is not None and keys >= GLUON_LONG_MIN_KEYS and block_d in GLUON_FWD_LONG:
            return GLUON_FWD_LONG[block_d]
        return GLUON_FWD.get(block_d)
    if keys_per_row is not None and keys_per_row < GLUON_DOCUMENTS_MIN_KEYS_PER_ROW.get(block_d, 0):
        return None
    return GLUON_FWD_DOCUMENTS.get(block_d)


def gluon_backward_variant(block_d: int, documents: bool = False) -> str | None:
    """The fused Gluon backward's variant for this padded head dim (documents: a block masked by
    per-row bounds, GLUON_BWD_DOCUMENTS), or None: none is tuned for it, a Triton backward config
    is forced by override() or the RINGFLASH_KERNEL_CONFIGS file, or the kernels are
    interpreted. override(gluon_bwd=name) forces a variant (None: the two Triton passes)."""
    overrides = _OVERRIDES
    if "gluon_bwd" in overrides:
        return overrides["gluon_bwd"]
    if INTERPRETING or {"dkdv", "dq"} & set(overrides):
        return None
    if any(block_d in _FILE_CONFIGS.get(kind, {}) for kind in ("dkdv", "dq")):
        return None
    return (GLUON_BWD_DOCUMENTS if documents else GLUON_BWD).get(block_d)


def overridden(kind: str) -> bool:
    """Whether override() around the call sets `kind` (a forced choice skips the heuristics)."""
    return kind in _OVERRIDES


def overridden_any() -> bool:
    """Whether override() is in force for any kernel."""
    return bool(_OVERRIDES)


def dkdv_config(block_d: int, documents: bool = False, float32: bool = False) -> KernelConfig:
    return kind_config("dkdv", block_d, documents, float32)


def dq_config(block_d: int, documents: bool = False, float32: bool = False) -> KernelConfig:
    return kind_config("dq", block_d, documents, float32)
