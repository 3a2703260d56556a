"""The ring engine: K/V blocks travel around the ranks of a process group while each rank
folds every visible block into its queries' float32 softmax state; the backward rotates K/V
again while the dK/dV accumulators follow their blocks back to the owners (ringflash.relay).

Read top-down: ring_flash_attn_func validates and agrees across ranks, then runs _RingAttn
(forward and backward over the one ring loop, _ring_kv) under a RingSpec. A ring of one step
whose one block covers every row and key (one rank; packed documents all whole on their ranks)
is the local call, and runs as it (_whole_block).
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import torch

from . import balance, ops
from ._checks import (
    SUPPORTED_DTYPES,
    check_bool,
    check_not_capturing,
    check_qkv,
    cu_values,
    key_bias_from_mask,
    resolve_deterministic,
    resolve_grad_accum,
    resolve_scale,
)
from .balance import checked_cu_seqlens, named_layout
from .comm import (
    INPUT_ERRORS,
    check_backend_device,
    check_group_types,
    group_rank_world,
    is_mesh,
    resolve_groups_or_error,
    ring_group_name,
    validated_across_ranks,
    warn_placement,
)
from .dq_sum import DQSum
from .dropout import Dropout, all_dropped, check_dropout, operator_dropout
from .empty import empty_attention
from .local import (
    backend_for,
    backend_name,
    backward_inputs,
    block_backward,
    block_forward,
    first_order_only,
    fuses_backward,
    local_backward,
    local_forward,
    packed_outputs,
    without_autocast,
)
from .masks import FULL, BlockMask, Window, window_from
from .merge import SoftmaxState, state_dtype
from .relay import GradRelay, default_grad_chunks
from .schedule import (
    LAYOUTS,
    check_layout,
    check_named_layout,
    chunks_per_rank,
    is_balanced,
    layout_code,
    ring_steps,
    show_layout_code,
    step_tasks,
)


@dataclass(frozen=True)
class RingSpec:
    """What a ring call computes, beside its tensors: the same on every rank.

    window: which keys a query sees, by global positions (masks.Window; causal is
    Window(None, 0)). scale: softmax scale. layout: how the sequence is sharded
    (ringflash.schedule.LAYOUTS). grad_chunks: kv-head chunks the dK/dV accumulators travel in
    (None: relay.default_grad_chunks). grad_accum: dtype of dQ and the travelling dK/dV
    accumulators (None: the state dtype). dropout: None, or the call's attention dropout
    (ringflash.dropout.Dropout from index 0; each block task takes it at its global positions).
    deterministic: the backward keeps dQ apart from dK/dV in bitwise reproducible passes;
    otherwise blocks local.fuses_backward accepts compute all three in one fused call.
    """

    window: Window
    scale: float
    layout: str
    grad_chunks: int | None = None
    grad_accum: torch.dtype | None = None
    dropout: Dropout | None = None
    deterministic: bool = False

    def __post_init__(self):
        if not isinstance(self.window, Window):  # e.g. the causal flag where the window goes
            raise TypeError(f"RingSpec.window must be a masks.Window, got {self.window!r}")


def _ring_kv(comm, k, v, key_bias, steps):
    """The one ring loop: yield (step, k, v, key_bias) blocks for the ring steps `steps`
    (schedule.ring_steps: ascending from 0; blocks no query sees are never sent), this rank's
    own first, then at step s the block of rank (rank - s), each sent straight from one step
    of `steps` to the next (to the rank that many places on; key_bias travels with its keys, or
    stays None); the next blocks are already in flight while the caller computes on the
    current. Two sets of receive buffers, allocated once, reused."""
    blocks = (k, v) if key_bias is None else (k, v, key_bias)
    bufs = [None, None]
    cur = blocks
    for i, step in enumerate(steps):
        last = i + 1 == len(steps)
        if not last:
            slot = i % 2
            if bufs[slot] is None:
                bufs[slot] = tuple(torch.empty_like(t) for t in blocks)
            handles = comm.start(list(cur), list(bufs[slot]), "kv", step=step, hop=steps[i + 1] - step)
        yield step, cur[0], cur[1], (cur[2] if key_bias is not None else None)
        if not last:
            comm.wait(handles)
            cur = bufs[slot]


def _rows(key_bias, rows):
    return None if key_bias is None else key_bias[:, rows]


def _tasks(spec: RingSpec, comm, step, q, kv_len):
    """This rank's block tasks at `step` for queries q (B, Sq, Hq, D), each with its BlockMask
    and its Dropout (or None): with dropout every task keeps its global start positions (no
    coalescing). Packed documents without dropout: the step's tasks when they are large, else
    one task over every row (or, balance.CROP_STEP_CALLS, the rows and keys that see each
    other), its mask each row's interval of the held keys (BalancedLayout.step_plan)."""
    drop = spec.dropout
    if is_balanced(spec.layout) and drop is None:
        tasks, bounds, box = spec.layout.step_plan(
            comm.rank, step, spec.window, kv_len, q.device, q.shape[2] * q.shape[3]
        )
        if bounds is not None:
            yield box, BlockMask(bounds=bounds), None
            return
    else:
        tasks = step_tasks(spec.layout, comm.rank, comm.world, step, q.shape[1], kv_len, spec.window, drop is None)
    for t in tasks:
        mask = BlockMask(t.q_start, t.k_start, spec.window if t.masked else FULL)
        yield t, mask, drop and drop.at(t.q_start, t.k_start)


def _whole_block(spec: RingSpec, comm, q, kv_len):
    """(mask, dropout) of the ring's one block when the ring runs one step (one rank, or a
    layout that keeps every document whole) and that step is one block task over every query
    row and every held key: the ring call is then the local call (local_forward /
    local_backward: the output normalized by the kernel, no float32 state to zero, merge or
    normalize, dK/dV written once instead of accumulated, relayed and cast). Else None. The
    forward and the backward decide alike (the schedule is pure)."""
    if len(ring_steps(spec.layout, comm.world, q.shape[1], kv_len, spec.window)) != 1:
        return None
    tasks = list(_tasks(spec, comm, 0, q, kv_len))
    if len(tasks) != 1:
        return None
    t, mask, drop = tasks[0]
    every = range(q.shape[1])[t.q_rows] == range(q.shape[1]) and range(kv_len)[t.kv_rows] == range(kv_len)
    return (mask, drop) if every else None


def _gatherable(spec: RingSpec, key_bias) -> bool:
    """Whether this ring's blocks may be gathered into calls over several blocks at once:
    packed documents (BalancedLayout.gather_plan) without dropout or key bias, whose masks and
    biases follow each block's own positions."""
    return is_balanced(spec.layout) and spec.dropout is None and key_bias is None


def _runs(spec: RingSpec, steps, key_bias) -> list[tuple[int, ...]]:
    """The ring's steps in the runs computed in one call each (balance.gather_runs) where the
    blocks may be gathered (_gatherable), else a run a step."""
    return balance.gather_runs(steps) if _gatherable(spec, key_bias) else [(s,) for s in steps]


def _gathered(spec: RingSpec, comm, q, kv_len, key_bias):
    """(steps, balance.GatherPlan) when this ring call computes in one call over every block its
    steps hold (balance.gather_runs: one run of two steps or more), else None; a ring whose blocks
    may not be gathered (_gatherable) asks no further."""
    if not _gatherable(spec, key_bias):
        return None
    steps = ring_steps(spec.layout, comm.world, q.shape[1], kv_len, spec.window)
    if len(steps) < 2 or len(balance.gather_runs(steps)) != 1:
        return None
    return steps, spec.layout.gather_plan(comm.rank, steps, spec.window, q.device)


def _gather_block(backend, k_all, v_all, rows, k_blk, v_blk) -> None:
    """A block's real rows (the first len(rows); blocks travel padded) into the gathered K / V
    at `rows` (a GatherPlan's rows[i]), by the backend's scatter_rows."""
    backend.scatter_rows(k_all, rows, k_blk)
    backend.scatter_rows(v_all, rows, v_blk)


def _gather_buffers(k, v, plan):
    """Empty K (B, plan.keys, Hkv, D) and V (B, plan.keys, Hkv, Dv) for a GatherPlan's keys."""
    return k.new_empty(k.shape[0], plan.keys, *k.shape[2:]), v.new_empty(v.shape[0], plan.keys, *v.shape[2:])


def _gathered_kv(comm, k, v, steps, plan, backend):
    """Every block of `steps` gathered in global order through the one ring loop: K (B,
    plan.keys, Hkv, D), V (B, plan.keys, Hkv, Dv)."""
    k_all, v_all = _gather_buffers(k, v, plan)
    for i, (_, k_blk, v_blk, _) in enumerate(_ring_kv(comm, k, v, None, steps)):
        _gather_block(backend, k_all, v_all, plan.rows[i], k_blk, v_blk)
    return k_all, v_all


class _RingAttn(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, key_bias, spec: RingSpec, comm):
        """comm: RingComm, LocalComm or ringflash.testing.ReplayComm. key_bias: None or (B, Sk)
        in the state dtype. Returns (out, lse)."""
        k, v = k.contiguous(), v.contiguous()  # they travel whole
        backend = backend_for(q.device)  # kept for the backward: the same arithmetic in both
        ctx.spec, ctx.comm, ctx.backend = spec, comm, backend
        ctx.set_materialize_grads(False)
        whole = _whole_block(spec, comm, q, k.shape[1])
        if whole is not None:
            mask, drop = whole
            state = local_forward(q, k, v, key_bias, mask, scale=spec.scale, backend=backend, dropout=drop)
            ctx.save_for_backward(q, k, v, state.o, state.m, state.l, key_bias)
            return state.o, state.lse()
        gathered = _gathered(spec, comm, q, k.shape[1], key_bias)
        if gathered is not None:
            steps, plan = gathered
            k_all, v_all = _gathered_kv(comm, k, v, steps, plan, backend)
            mask = BlockMask(bounds=plan.bounds)
            state = local_forward(q, k_all, v_all, None, mask, scale=spec.scale, backend=backend)
            ctx.save_for_backward(q, k, v, state.o, state.m, state.l, key_bias)
            return state.o, state.lse()
        state = SoftmaxState.zeros((*q.shape[:3], v.shape[3]), state_dtype(q.dtype), q.device)  # o: (.., Dv)
        steps = ring_steps(spec.layout, comm.world, q.shape[1], k.shape[1], spec.window)
        # {step: its run} for the runs of several steps (_runs); the others a call a step
        groups = {step: run for run in _runs(spec, steps, key_bias) if len(run) > 1 for step in run}
        for step, k_blk, v_blk, bias_blk in _ring_kv(comm, k, v, key_bias, steps):
            run = groups.get(step)
            if run is not None:  # gathered until its run's last block has come, then one call
                i = run.index(step)
                if i == 0:
                    plan = spec.layout.gather_plan(comm.rank, run, spec.window, q.device)
                    k_run, v_run = _gather_buffers(k, v, plan)
                _gather_block(backend, k_run, v_run, plan.rows[i], k_blk, v_blk)
                if i + 1 == len(run):
                    mask = BlockMask(bounds=plan.bounds)
                    block_forward(q, k_run, v_run, state, mask, scale=spec.scale, fold=True, backend=backend)
                    k_run = v_run = None
                continue
            for t, mask, drop in _tasks(spec, comm, step, q, k.shape[1]):
                block_forward(
                    q[:, t.q_rows],
                    k_blk[:, t.kv_rows],
                    v_blk[:, t.kv_rows],
                    state.rows(t.q_rows),
                    mask,
                    scale=spec.scale,
                    fold=True,
                    key_bias=_rows(bias_blk, t.kv_rows),
                    backend=backend,
                    dropout=drop,
                )
        lse = state.lse()
        out = state.normalized(q.dtype)
        ctx.save_for_backward(q, k, v, out, state.m, state.l, key_bias)
        return out, lse

    @staticmethod
    @first_order_only
    @without_autocast
    def backward(ctx, do, dlse):
        q, k, v, out, m, l, key_bias = ctx.saved_tensors
        spec, comm, backend = ctx.spec, ctx.comm, ctx.backend
        # kv_grad_dtype: a caller that sums dK/dV further (hybrid's replicated heads) takes them
        # unrounded, in the accumulator dtype
        kv_grad_dtype = getattr(ctx, "kv_grad_dtype", None)
        whole = _whole_block(spec, comm, q, k.shape[1])
        if whole is not None:
            mask, drop = whole
            dq, dk, dv = local_backward(q, k, v, out, m, l, key_bias, do, dlse, mask, scale=spec.scale,
                                        backend=backend, dropout=drop, deterministic=spec.deterministic,
                                        kv_grad_dtype=kv_grad_dtype)  # fmt: skip
            return dq, dk, dv, None, None, None
        acc = spec.grad_accum or state_dtype(q.dtype)
        chunks = default_grad_chunks(k, acc, v) if spec.grad_chunks is None else spec.grad_chunks
        gathered = _gathered(spec, comm, q, k.shape[1], key_bias)
        if gathered is not None:
            steps, plan = gathered
            relay = GradRelay(comm, k, v, acc, chunks, steps)
            k_all, v_all = _gathered_kv(comm, k, v, steps, plan, backend)
            mask = BlockMask(bounds=plan.bounds)
            dq, dk_all, dv_all = local_backward(q, k_all, v_all, out, m, l, None, do, dlse, mask, scale=spec.scale,
                                                backend=backend, deterministic=spec.deterministic,
                                                kv_grad_dtype=acc)  # fmt: skip
            k_all = v_all = None
            # each block's rows of dK / dV into its accumulators, which travel as the ring's do
            for step, rows in zip(steps, plan.rows):
                for h, dk, dv in relay.arriving(step):
                    dk[:, : len(rows)].add_(dk_all[:, :, h].index_select(1, rows))
                    dv[:, : len(rows)].add_(dv_all[:, :, h].index_select(1, rows))
                relay.send(step)
            dk_all = dv_all = None
            dk, dv = relay.finish(kv_grad_dtype or k.dtype)
            return dq, dk, dv, None, None, None
        do, delta = backward_inputs(out, do, dlse, backend)
        # one dQ sum per call: the fused kernel adds to one blocked buffer, finished once at the end
        dq = DQSum(q.shape, acc, q.device, spec.scale)
        steps = ring_steps(spec.layout, comm.world, q.shape[1], k.shape[1], spec.window)
        relay = GradRelay(comm, k, v, acc, chunks, steps)
        G = q.shape[2] // k.shape[2]
        chunk_heads = min(h.stop - h.start for h in relay.heads)
        for step, k_blk, v_blk, bias_blk in _ring_kv(comm, k, v, key_bias, steps):
            tasks = list(_tasks(spec, comm, step, q, k.shape[1]))
            # a task the fused kernel takes (asked with the smallest kv-head chunk, the calls'
            # size) computes its dQ with dK/dV below; the others compute dQ first: it does not
            # need the incoming dK/dV accumulators, which arrive meanwhile
            fused = [
                fuses_backward(
                    q[:, t.q_rows, : chunk_heads * G],
                    k_blk[:, t.kv_rows, :chunk_heads],
                    v_blk[:, t.kv_rows, :chunk_heads],
                    mask,
                    key_bias=_rows(bias_blk, t.kv_rows),
                    backend=backend,
                    dropout=drop,
                    deterministic=spec.deterministic,
                )  # fmt: skip
                for t, mask, drop in tasks
            ]
            for (t, mask, drop), fuse in zip(tasks, fused):
                if fuse:
                    continue
                r = t.q_rows
                block_backward(
                    q[:, r],
                    k_blk[:, t.kv_rows],
                    v_blk[:, t.kv_rows],
                    m[:, :, r],
                    l[:, :, r],
                    do[:, r],
                    delta[:, :, r],
                    dq.part(r),
                    None,
                    None,
                    mask,
                    scale=spec.scale,
                    accumulate=True,
                    key_bias=_rows(bias_blk, t.kv_rows),
                    backend=backend,
                    dropout=drop,
                    deterministic=spec.deterministic,
                )
            # dK/dV per kv-head chunk h, with the q heads of its group, as the chunks arrive
            for h, dk, dv in relay.arriving(step):
                qh = slice(h.start * G, h.stop * G)
                for (t, mask, drop), fuse in zip(tasks, fused):
                    r = t.q_rows
                    block_backward(
                        q[:, r, qh],
                        k_blk[:, t.kv_rows, h],
                        v_blk[:, t.kv_rows, h],
                        m[:, qh, r],
                        l[:, qh, r],
                        do[:, r, qh],
                        delta[:, qh, r],
                        dq.part(r, qh) if fuse else None,
                        dk[:, t.kv_rows],
                        dv[:, t.kv_rows],
                        mask,
                        scale=spec.scale,
                        accumulate=True,
                        key_bias=_rows(bias_blk, t.kv_rows),
                        backend=backend,
                        dropout=drop and drop.heads_from(qh.start),
                        deterministic=spec.deterministic,
                    )
            relay.send(step)
        k_blk = v_blk = bias_blk = None  # the K/V receive buffers go before the outputs are made
        dk, dv = relay.finish(kv_grad_dtype or k.dtype)
        return dq.result(q.dtype), dk, dv, None, None, None


_FIELD_NAMES = (
    "batch",
    "q local length",
    "k/v local length",
    "q heads",
    "k/v heads",
    "head_dim",
    "v head_dim",
    "dtype",
    "window_size left",
    "causal / window_size right",  # causal=True is a window whose right side is 0
    "layout",
    "softmax_scale",
    "device type",
    "key_padding_mask given",
    "grad_accum_dtype",
    "grad_chunks",
    "dropout_p",
    # which of q, k, v the backward will reach (bits 1, 2, 4; 0 under no_grad): the backward is a
    # ring too, and a rank that never runs it leaves the others waiting in it
    "requires grad (q, k, v)",
)


# what a caller that picks between paths before any collective also agrees on, in the ring's
# one check (RingMultiheadAttention: its dense or ring path and the collectives after the
# ring); named here because the compiled operators' check (ops._agreed) gets the values alone
CALLER_FIELDS = ("attn_mask given", "need_weights", "add_bias_kv / add_zero_attn keys")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _grad_bits(q, k, v) -> int:
    if not torch.is_grad_enabled():
        return 0
    return sum(1 << i for i, t in enumerate((q, k, v)) if t.requires_grad)


def _signature(q, k, v, spec: RingSpec, has_mask: bool, dropout_p: float = 0.0, grads=None) -> dict:
    """What every rank of a ring must agree on, as integers. grads: the tensors whose
    requires_grad counts (default q, k, v; a caller passing stand-ins for the shapes gives
    the real ones)."""
    B, Sq, Hq, D = q.shape
    values = (
        B,
        Sq,
        k.shape[1],
        Hq,
        k.shape[2],
        D,
        v.shape[-1],
        SUPPORTED_DTYPES.index(q.dtype),
        -1 if spec.window.left is None else spec.window.left,
        -1 if spec.window.right is None else spec.window.right,
        layout_code(spec.layout),
        _float_bits(spec.scale),
        int(q.is_cuda),
        int(has_mask),
        SUPPORTED_DTYPES.index(spec.grad_accum),
        -1 if spec.grad_chunks is None else spec.grad_chunks,
        _float_bits(dropout_p),
        _grad_bits(*(grads or (q, k, v))),
    )
    return dict(zip(_FIELD_NAMES, values))


def _agreed_names(caller_fields=()) -> tuple:
    """The names of the ints that the ranks of a ring call agree on (eager), in the order sent:
    the call's own, then caller_fields' (_ring_flash_attn's), with a head group or without
    (comm.HEAD_FIELDS follow them, added where the ranks agree). A rank that fails before its
    call sends zeros under these names (RingMultiheadAttention._raise_together): a different
    set would not match the others' rows."""
    return _FIELD_NAMES + tuple(caller_fields)


def _show_field(name, value):
    if name in ("dtype", "grad_accum_dtype"):
        return str(SUPPORTED_DTYPES[value])
    if name == "layout":
        return show_layout_code(value)
    if name in ("softmax_scale", "dropout_p"):
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if name == "grad_chunks" and value == -1:
        return "None"
    if name == "requires grad (q, k, v)":
        return "+".join(n for i, n in enumerate("qkv") if value >> i & 1) or "none"
    if name == "causal / window_size right" and value in (-1, 0):
        return f"{value} ({'causal' if value == 0 else 'not causal'})"
    return str(value)


def check_grad_chunks(grad_chunks, api: str):
    if grad_chunks is not None and (
        isinstance(grad_chunks, bool) or not isinstance(grad_chunks, int) or grad_chunks < 1
    ):
        raise ValueError(f"{api}: grad_chunks must be None or a positive int, got {grad_chunks!r}")


def ring_call_spec(
    q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, api, window_size=(-1, -1),
    deterministic=False,
):  # fmt: skip
    """Validate a ring call's own arguments (not against other ranks); returns the dims, its
    RingSpec and the key bias (B, Sk_local) in the state dtype, or None. causal and
    window_size (flash-attn's) become the RingSpec's Window, by global positions."""
    dims = check_qkv(q, k, v, api)
    deterministic = resolve_deterministic(deterministic, api)
    check_bool("causal", causal, api)
    window = window_from(causal, window_size, api)
    check_layout(layout, api)
    check_grad_chunks(grad_chunks, api)
    scale = resolve_scale(softmax_scale, dims.head_dim, api)
    key_bias = key_bias_from_mask(key_padding_mask, dims, q.device, api, state_dtype(q.dtype))
    grad_accum = resolve_grad_accum(grad_accum_dtype, q.dtype, state_dtype(q.dtype), api)
    if not window.is_full and dims.seqlen_q != dims.seqlen_k:
        # both masks compare global positions of one sequence: self-attention only
        windowed = tuple(window_size) != (-1, -1)
        what = " ".join(
            (["causal"] if causal else []) + ([f"windowed (window_size={tuple(window_size)})"] if windowed else [])
        )
        raise ValueError(
            f"{api}: {what} ring attention needs equal q and k/v local lengths (self-attention), "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    return dims, RingSpec(window, scale, layout, grad_chunks, grad_accum, deterministic=deterministic), key_bias


def ring_flash_attn_func(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    group=None,
    layout="zigzag",
    key_padding_mask=None,
    return_lse=False,
    grad_accum_dtype=None,
    grad_chunks=None,
    head_group=None,
    dropout_p=0.0,
    generator=None,
    deterministic=False,
):
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (B, Sq_local, Hq, D), k: (B, Sk_local, Hkv, D), v: (B, Sk_local, Hkv, Dv): this rank's
    shards (see shard() and local_positions(), with the same layout), Hq % Hkv == 0; float16,
    bfloat16 or float32 (float64 on CPU); any head dims D (q, k) and Dv (v) from 1 to 256,
    independently (padded inside, not on the wire; the default scale is 1/sqrt(D)). An empty
    shard (B, Sq_local or Hq 0, on every rank) gives an empty output, Sk_local = 0 out 0.
    group: a process group (None: the default group). With world size 1, or no process group
    initialized, this is local attention. layout: "zigzag" (balanced causal
    work) or "contiguous"; causal needs Sq_local == Sk_local (the same sequence).
    window_size=(left, right): flash-attn's sliding window over the whole sequence, by global
    positions: the query at position i sees the key at j iff i - left <= j <= i + right (-1:
    unbounded on that side), as flash_attn_func(window_size=) on the unsharded tensors; with
    causal=True right must be -1 or 0. A window needs Sq_local == Sk_local, as causal does.
    Blocks no query sees are skipped (a rank computes about Sq_local x window), and the ring
    runs only the steps some rank has work in (schedule.ring_steps): a block skips steps
    nobody needs and is not sent after the last one.
    key_padding_mask: optional (B, Sk_local) for this rank's keys, bool (True = padding, the
    key is ignored) or float (added to the scores; not differentiated: one that requires grad
    raises); it travels around the ring with its keys.
    Returns this rank's shard of the output, (B, Sq_local, Hq, Dv) in q's dtype, exactly as
    attention over the whole sequence on one device would give it; with return_lse=True also
    lse (B, Hq, Sq_local), float32 (float64 for float64 inputs). Differentiable in q, k, v.
    grad_accum_dtype: the dtype the backward accumulates dQ and the travelling dK/dV in across
    the ring's steps. None (default): float32 (float64 for float64), and the gradients' error
    does not grow with the number of ranks. q's own dtype (float16 / bfloat16) saves memory
    (measured on an H200, P=4, H=32, D=128: a rank's peak beyond its inputs 12X -> 8.5X, X =
    one 16-bit shard of q) at the price of one 16-bit rounding per step, so the gradients'
    error grows like sqrt(P) (README: Memory). The forward is the same either way.
    grad_chunks: the number of kv-head chunks the dK/dV accumulators travel in (at most Hkv;
    None: 4, fewer for accumulators under 4 x 64 MiB); receiving costs one chunk of memory.
    Every call checks with one small all_gather that all ranks passed the same shapes (head dims too), dtype,
    causal flag and window, layout, scale, mask presence, grad_accum_dtype and grad_chunks,
    and whether a head_group is given (its size, this rank's place in it), and raises on every
    rank if not; so does a group or head_group that one rank cannot use (the ranks sharing its
    `group` raise its error).
    head_group: a process group of U ranks sharing this rank's ring position (or pass a 2-D
    DeviceMesh as group: dim 0 the ring, dim 1 the heads): the sequence is then sharded over
    R x U ranks (shard(..., head_group=)), heads travel by all-to-all inside the head group
    and the ring runs over `group` on Hq / U heads (ringflash.hybrid; README: Hybrid). Shapes
    in and out are as above, for this rank's S / (R U) tokens.
    dropout_p: attention dropout (apply it in training only), with flash_attn_func's keep mask
    of global query and key indices: the same seed drops the same pairs at any world size and
    layout; every rank uses the first rank's seed (one more small all_gather per call).
    generator: a CPU torch.Generator to draw the seed from (default: torch's CPU generator).
    deterministic: the backward's mode, as flash_attn_func's: False (default) lets each ring
    step's blocks that the fused Hopper backward takes (16-bit, D = Dv padded to 64 or 128, or
    the larger padded to 256 with any Dv, dense, causal, windowed or packed documents, no key
    padding mask or dropout) compute dQ, dK and dV
    in one kernel, dQ summed by float32 atomics in a varying order; True (or
    torch.use_deterministic_algorithms(True)) keeps the bitwise reproducible two-pass backward.
    """
    return _ring_flash_attn(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, group=group, layout=layout,
        key_padding_mask=key_padding_mask, return_lse=return_lse, grad_accum_dtype=grad_accum_dtype,
        grad_chunks=grad_chunks, head_group=head_group, dropout_p=dropout_p, generator=generator,
        deterministic=deterministic,
    )  # fmt: skip


def _ring_flash_attn(
    q, k, v, *, causal, softmax_scale, window_size, group, layout, key_padding_mask, return_lse, grad_accum_dtype,
    grad_chunks, head_group, dropout_p, generator, deterministic, caller_fields=None, agree_only=None,
    api="ring_flash_attn_func",
):  # fmt: skip
    """ring_flash_attn_func. caller_fields: CALLER_FIELDS' ints (name -> value) that every rank
    must agree on in the same check, for a caller whose ranks choose between paths before any
    collective (RingMultiheadAttention), with a head_group too. agree_only: a tuple of tensors
    (or Nones) that the caller's other path takes (its collectives' inputs): runs the check
    and returns them, with the dropout seed every rank uses (an int64 scalar tensor; None
    without dropout) after them; both come out of the operator that runs the check (compiled,
    it runs there), so no collective of that path can run before it.
    api: the name its errors start with (the caller's: a module's)."""
    # a group or head_group this rank cannot use is an error of its input, carried into the
    # agreement over `group` (comm.resolve_groups_or_error): the ranks waiting there raise it too
    check_group_types(group, head_group, api)  # not a group at all: no group to carry the error over
    resolve_error = None
    if head_group is not None or is_mesh(group):
        group, head_group, resolve_error = resolve_groups_or_error(group, head_group, api)
        if head_group is not None:
            from .hybrid import hybrid_attn

            return hybrid_attn(
                q,
                k,
                v,
                causal=causal,
                softmax_scale=softmax_scale,
                window_size=window_size,
                group=group,
                head_group=head_group,
                layout=layout,
                key_padding_mask=key_padding_mask,
                return_lse=return_lse,
                grad_accum_dtype=grad_accum_dtype,
                grad_chunks=grad_chunks,
                dropout_p=dropout_p,
                generator=generator,
                deterministic=deterministic,
                caller_fields=caller_fields,
            )
    rank, world = group_rank_world(group)

    def validate():
        if resolve_error is not None:
            raise resolve_error
        check_bool("return_lse", return_lse, api)
        p = check_dropout(dropout_p, generator, api)
        check_named_layout(layout, api)
        dims, spec, key_bias = ring_call_spec(
            q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, api, window_size,
            deterministic,
        )  # fmt: skip
        if world > 1:
            check_backend_device(group, q.device, api)
            parts = chunks_per_rank(layout)
            for name, n in (("q", dims.seqlen_q), ("k/v", dims.seqlen_k)):
                if n % parts:
                    raise ValueError(
                        f"{api}: {name} local length {n} must be a multiple of {parts} for layout {layout!r}"
                    )
        else:  # one rank: every layout is the identity
            spec = dataclasses.replace(spec, layout="contiguous")
        fields = _signature(q, k, v, spec, key_bias is not None, p)
        return {**fields, **(caller_fields or {})}, (spec, key_bias, p)

    if torch.compiler.is_compiling():
        # traced: this rank's checks run now; the agreement all_gather runs inside the ring
        # operator when it executes (dynamo cannot trace a collective whose result decides)
        fields, (spec, key_bias, p) = validate()
        agree = [fields[name] for name in _agreed_names(caller_fields or ())] if world > 1 else []
    else:
        # every rank fails together, or all agree: never a hang, never a mixed-up ring
        names = _agreed_names(caller_fields or ())
        spec, key_bias, p = validated_across_ranks(
            group, api, validate, names, device=getattr(q, "device", None), show=_show_field
        )
        warn_placement(group)
        agree = []
    if agree_only is not None:
        return ops.agree(
            agree_only, operator_dropout(p, generator)[1], ring_group_name(group, world), spec.layout, agree
        )
    if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0 or k.shape[1] == 0:  # agreed by every rank
        out, lse = empty_attention(q, k, v)
        if agree:
            # compiled: no ring operator runs the check, so the agreement operator does; the
            # results are its copies, or the graph would drop it as unused
            seed = operator_dropout(p, generator)[1]
            out, lse, _ = ops.agree([out, lse], seed, ring_group_name(group, world), spec.layout, agree)
        return (out, lse) if return_lse else out
    out, lse = ops.ring(
        q, k, v, key_bias, None, ring_group_name(group, world), *ops.window_args(spec.window),
        spec.scale, *operator_dropout(p, generator), spec.layout,
        -1 if spec.grad_chunks is None else spec.grad_chunks, spec.grad_accum,
        "" if torch.compiler.is_compiling() else backend_name(q.device), spec.deterministic, agree,
    )  # fmt: skip
    out = all_dropped(out, p)
    return (out, lse) if return_lse else out


# why a CUDA graph cannot capture a packed ring call (check_not_capturing; rings over several
# ranks raise where the ranks agree, comm.agree_across_ranks)
_PACKED_ON_HOST = "packed documents' boundaries are read and their row bounds built on the host"


def check_packed_call(
    q, k, v, cu_seqlens, layout, causal, softmax_scale, window_size, return_lse, grad_accum_dtype, grad_chunks,
    dropout_p, generator, api, world, rank, head_pieces=(0, 1), deterministic=False,
):  # fmt: skip
    """Validate a packed-document ring call on this rank (not against other ranks): returns
    (dropout_p as a float, its RingSpec over the balanced layout). world, rank: the ring's;
    head_pieces (u, U): this rank's place in a head group, whose piece of the ring position's
    shard it holds (BalancedLayout.head_pieces). Under torch.compile a cu_seqlens tensor's
    values are checked by the ring operator when it runs."""
    if isinstance(layout, _LayoutError):  # a named layout that could not be built on this rank
        raise layout.error
    check_bool("return_lse", return_lse, api)
    p = check_dropout(dropout_p, generator, api)
    if not is_balanced(layout):
        raise ValueError(f"{api}: layout must be a ringflash.balanced_layout(...) or one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{api}: {name} must be a 3-D tensor (n_local, heads, head_dim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")  # fmt: skip
    if layout.world != world:
        raise ValueError(f"{api}: the layout was built for {layout.world} ranks, the group has {world}")
    if not (torch.compiler.is_compiling() and isinstance(cu_seqlens, torch.Tensor)):
        # a tensor: read once per tensor and version (the layers over one batch wait once)
        cu = checked_cu_seqlens(cu_seqlens, api, read=lambda t: cu_values(t, t, api)[0])
        if tuple(cu) != layout.cu_seqlens:
            raise ValueError(f"{api}: cu_seqlens {cu[:6]}... is not the one the layout was built from")
    u, U = head_pieces
    n = layout.local_len(rank) if U == 1 else layout.head_piece_lens(rank, U)[u]
    if q.shape[0] != n or k.shape[0] != n:
        where = f"rank {rank}" if U == 1 else f"ring position {rank}, head-group rank {u}"
        raise ValueError(f"{api}: the layout gives {where} {n} tokens, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    _, spec, _ = ring_call_spec(
        q[None], k[None], v[None], causal, softmax_scale, "contiguous", None, grad_accum_dtype, grad_chunks, api,
        window_size, deterministic,
    )  # fmt: skip
    return p, dataclasses.replace(spec, layout=layout)


@dataclasses.dataclass(frozen=True)
class _LayoutError:
    """A named layout whose building failed on this rank (bad cu_seqlens or window_size), or
    any layout of a call whose group or head_group this rank could not use: it stands in for
    the layout until check_packed_call raises its error inside the ranks' agreement, so that
    every rank raises rather than the others waiting in a collective."""

    error: Exception


def _packed_layout(layout, cu_seqlens, causal, window_size, group, head_group, api):
    """(layout, cu_seqlens): a named layout ("zigzag", "contiguous") of packed documents as the
    BalancedLayout it amounts to (balance.named_layout: the name's shards cut at the document
    boundaries, over the ring's R ranks, each divisible by a head group's U), with cu_seqlens
    as the checked list of ints it was built from (read to the host once); anything else as
    it is."""
    if not isinstance(layout, str):
        return layout, cu_seqlens
    if torch.compiler.is_compiling():  # the layout object cannot be built inside a compiled graph
        raise ValueError(
            f"{api}: layout={layout!r} with packed documents is not supported under torch.compile: "
            "build a ringflash.balanced_layout(...) outside the compiled code and pass it"
        )
    cu = checked_cu_seqlens(cu_seqlens, api)
    window = window_from(causal, window_size, api)
    U = 1 if head_group is None else group_rank_world(head_group)[1]
    return named_layout(tuple(cu), group_rank_world(group)[1], layout, window, U), cu


def ring_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens,
    *,
    layout,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    group=None,
    return_lse=False,
    grad_accum_dtype=None,
    grad_chunks=None,
    dropout_p=0.0,
    generator=None,
    head_group=None,
    deterministic=False,
):
    """Exact attention over packed documents sharded across the ranks of `group`.

    q: (n_local, Hq, D), k: (n_local, Hkv, D), v: (n_local, Hkv, Dv): this rank's tokens of the packed row, in the
    order of `layout` (a ringflash.balanced_layout(cu_seqlens, world, ...) built from the same
    global cu_seqlens on every rank; shard(x, layout=layout, dim=0) makes them), Hq % Hkv == 0.
    layout may also be "zigzag" or "contiguous", for comparison: the packed row sharded as
    those cut it (its length divisible by 2P or P), documents cut wherever the shards fall
    (eager only: a compiled graph cannot build its layout object).
    cu_seqlens: the global document boundaries (as balanced_layout's). Each query attends to
    the keys of its own document only, with causal and window_size (flash-attn semantics)
    applied within it: self-attention, the same documents for queries and keys. Returns this
    rank's output (n_local, Hq, Dv) in q's dtype and, with return_lse, lse (Hq, n_local).
    Differentiable in q, k, v. A document the layout keeps whole on one rank is computed
    there; when no document spans two ranks no K/V travels at all, and each rank's call is the
    one-device call on its documents (no float32 state, no gradient relay). grad_accum_dtype,
    grad_chunks: as ring_flash_attn_func's. dropout_p, generator: as flash_attn_varlen_func's
    (query and key indices: positions in the packed row), the same pairs at any world size.
    head_group: as ring_flash_attn_func's (or a 2-D DeviceMesh as group), with the layout built
    for the R ranks of the ring: each ring position's shard is cut into U contiguous pieces
    (lengths differing by at most one; shard(..., layout=layout, head_group=head_group, dim=0)),
    heads travel by all-to-all inside the head group and the ring runs the documents over the
    ring positions' whole shards at Hq / U heads. deterministic: as ring_flash_attn_func's.
    """
    api = "ring_flash_attn_varlen_func"
    check_not_capturing(api, _PACKED_ON_HOST)
    check_group_types(group, head_group, api)
    resolve_error = None
    if head_group is not None or is_mesh(group):  # an error carried as ring_flash_attn_func's
        group, head_group, resolve_error = resolve_groups_or_error(group, head_group, api)
    try:
        if resolve_error is not None:
            raise resolve_error
        layout, cu_seqlens = _packed_layout(layout, cu_seqlens, causal, window_size, group, head_group, api)
    except INPUT_ERRORS as error:
        if torch.compiler.is_compiling():
            raise
        layout = _LayoutError(error)
    if head_group is not None:
        from .hybrid import hybrid_varlen_attn

        return hybrid_varlen_attn(
            q, k, v, cu_seqlens, layout=layout, causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, group=group, head_group=head_group, return_lse=return_lse,
            grad_accum_dtype=grad_accum_dtype, grad_chunks=grad_chunks, dropout_p=dropout_p, generator=generator,
            deterministic=deterministic,
        )  # fmt: skip
    rank, world = group_rank_world(group)
    compiling = torch.compiler.is_compiling()

    def validate():
        p, spec = check_packed_call(
            q, k, v, cu_seqlens, layout, causal, softmax_scale, window_size, return_lse, grad_accum_dtype,
            grad_chunks, dropout_p, generator, api, world, rank, deterministic=deterministic,
        )  # fmt: skip
        if world > 1:
            check_backend_device(group, q.device, api)
        shapes = (
            q.new_empty(1, layout.max_local_len, *q.shape[1:]),
            k.new_empty(1, layout.max_local_len, *k.shape[1:]),
            v.new_empty(1, layout.max_local_len, *v.shape[1:]),
        )
        return _signature(*shapes, spec, False, p, grads=(q, k, v)), (spec, p)

    if compiling:  # as ring_flash_attn_func: the agreement runs inside the ring operator
        fields, (spec, p) = validate()
        agree = list(fields.values()) if world > 1 else []
        cu_check = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
    else:
        spec, p = validated_across_ranks(
            group, api, validate, _agreed_names(), device=getattr(q, "device", None), show=_show_field
        )
        warn_placement(group)
        agree, cu_check = [], None
    # K/V travel padded to the longest shard; the schedule never reads the padding rows. The
    # ring runs the call's hops (schedule.ring_steps): with every document whole, one, where
    # nothing is exchanged, so nothing is padded (layout.block_len), and the ring call is the
    # local one
    k_p, v_p = layout.pad_block(k, rank, window=spec.window), layout.pad_block(v, rank, window=spec.window)
    out, lse = ops.ring(
        q[None], k_p[None], v_p[None], None, cu_check, ring_group_name(group, world),
        *ops.window_args(spec.window), spec.scale, *operator_dropout(p, generator), layout.code,
        -1 if spec.grad_chunks is None else spec.grad_chunks, spec.grad_accum,
        "" if compiling else backend_name(q.device), spec.deterministic, agree,
    )  # fmt: skip
    return packed_outputs(all_dropped(out, p), lse, return_lse)
