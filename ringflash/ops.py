"""The attention operations as torch.library custom operators, so torch.compile traces them.

torch.compile (dynamo) cannot trace a Triton launch nor the ring's Python control flow
(schedules, point-to-point exchanges, the rank-agreement collective), so each call of
flash_attn_func / flash_attn_varlen_func / ring_flash_attn_func becomes one opaque operator
for its forward and one for its backward, each with a fake (shape-only) implementation and
the autograd formula registered:

    ringflash::flash_fwd / ringflash::flash_bwd   one device (packed documents included)
    ringflash::ring_fwd  / ringflash::ring_bwd    the ring, the process group named by its
                                                  group_name, as torch's functional collectives
                                                  name theirs
    ringflash::ring_agree                         the ring's check alone, for a caller that runs
                                                  another path (RingMultiheadAttention's dense one)
    ringflash::hybrid_fwd / ringflash::hybrid_bwd a call with a head_group: the ring group and
                                                  the head group named so; the head all-to-alls
                                                  and the ring inside (hybrid._HybridAttn)

Inside, the operators run the same engine as everywhere else: the autograd Functions'
forward and backward (local._FlashAttn, ring._RingAttn, hybrid._HybridAttn), called as plain
functions with a _Saved object in place of autograd's context, so there is one engine and no
copy of it. Eager calls skip the operators' dispatch (flash(), ring(), hybrid()) and run the
same engine through its autograd Functions, except under a torch dispatch mode, which should see
the operators (through_operator; their FLOP counts: ringflash.flops).

Which backend runs (Triton or torch) is decided when the operator runs, by the device and
use_backend / RINGFLASH_BACKEND, as in eager calls; the eager wrappers pass the name they
resolved so a backward always runs on its forward's backend; under torch.compile (which cannot
read use_backend's context variable) the forward and the backward operators each resolve it
when they run.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import is_fake

from . import flops, local
from ._checks import check_cu_seqlens, check_max_seqlen, cu_values
from .balance import CODE_PREFIX, layout_from_code
from .dropout import Dropout, first_ranks_seed, keep_mask
from .masks import BlockMask, Window, packed_bounds, window_of_args
from .merge import state_dtype

# The operators' namespace is the package's import name: a copy of the package imported under
# another name (a benchmark's baseline beside this checkout) registers operators of its own
# instead of re-defining these, which leaves both copies' calls broken.
NAMESPACE = __name__.split(".")[0]


class _Saved(SimpleNamespace):
    """Stands in for autograd's ctx when an autograd Function's forward or backward is run as a
    plain function inside an operator."""

    saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass


def window_args(window: Window) -> tuple[int, int]:
    """A Window as the operators' two ints (-1: unbounded)."""
    return (-1 if window.left is None else window.left, -1 if window.right is None else window.right)


def _backend(name: str, device) -> str:
    return name or local.backend_name(device)


def shapes_only(t: torch.Tensor) -> bool:
    """Whether a call with tensor t computes shapes only: traced by torch.compile (fake tensors),
    a fake tensor under torch's FakeTensorMode, or on the meta device (no values, as torch's own
    attention and nn.MultiheadAttention allow: deferred initialization, shape inference). Such a
    call runs the operator, whose fake implementation gives the outputs' shapes and dtypes, and
    checks no values; nothing runs and no rank is contacted."""
    return _valueless(t) or (_dispatch_mode_on() and is_fake(t))


def _valueless(t: torch.Tensor) -> bool:
    # traced by torch.compile or on the meta device: shapes only, with or without a mode
    return torch.compiler.is_compiling() or t.is_meta


def _dispatch_mode_on() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0  # a C call: the eager path's cost stays ~0.2 us


def through_operator(t: torch.Tensor) -> bool:
    """Whether an eager call runs its operator rather than the engine alone: shapes only
    (shapes_only), or a torch dispatch mode on, which should see the call as one operator:
    FlopCounterMode counts its FLOPs (ringflash.flops), selective activation checkpointing
    chooses whether to save it, FakeTensorMode gets its fake implementation."""
    return _valueless(t) or _dispatch_mode_on()  # (a fake tensor, shapes_only's other case, comes under a mode)


def _mask(q_start, k_start, left, right, cu_values=None, device=None) -> BlockMask:
    """cu_values: packed documents' (cu_q, cu_k) as tuples of ints (check_cu_seqlens), or None."""
    window = window_of_args(left, right)
    bounds = None if cu_values is None else packed_bounds(*cu_values, window, device)
    return BlockMask(q_start, k_start, window, bounds)


def _dropout(dropout_p: float, seed) -> Dropout | None:
    """The operators' (dropout_p, seed tensor or None) as a Dropout from index 0, or None."""
    return None if seed is None or dropout_p == 0.0 else Dropout(int(seed), dropout_p)


def _forward_like(q, v):
    """What a forward operator returns, as fakes: out (B, Sq, Hq, Dv) (q's with v's head dim),
    lse, m, l (B, Hq, Sq)."""
    B, S, H, _ = q.shape
    stats = [q.new_empty((B, H, S), dtype=state_dtype(q.dtype)) for _ in range(3)]
    return (q.new_empty((B, S, H, v.shape[-1])), *stats)


def _grads_like(q, k, v):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


# ----------------------------------------------------------------------------- one device


@torch.library.custom_op(f"{NAMESPACE}::flash_fwd", mutates_args=())
def flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    q_start: int,
    k_start: int,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    backend: str,
    deterministic: bool,
    max_q: int,
    max_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, Hq, D) over k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), shapes already validated.
    Packed documents: B = 1 and cu_q / cu_k give the documents; their values and the
    max_q / max_k hints (-1: none) are checked here, where they are known even under
    torch.compile. dropout_p, seed (an int64 scalar tensor, or None: no dropout): attention
    dropout (ringflash.dropout). deterministic: the backward's mode (local.block_backward), kept
    for flash_bwd. Returns out (B, Sq, Hq, Dv), lse, m, l (B, Hq, Sq) in the state dtype."""
    name = _backend(backend, q.device)
    call = _planned_call(q, k, v, key_bias, cu_q, seed, q_start, k_start, left, right, scale, name, deterministic)
    if call is None:
        mask = _flash_mask(q, k, cu_q, cu_k, q_start, k_start, left, right, max_q, max_k)
        spec = local.LocalSpec(mask, scale, _dropout(dropout_p, seed))
    else:
        spec = call.spec
    ctx = _Saved()
    with local.use_backend(name):
        out, lse = local._FlashAttn.forward(ctx, q, k, v, key_bias, spec)
    m, l = ctx.saved_tensors[4:6]
    return out, lse, m.clone(), l  # m and l share one buffer: an operator's outputs may not alias


def _planned_call(q, k, v, key_bias, cu_q, seed, q_start, k_start, left, right, scale, name, deterministic):
    """The remembered call (local._ValidatedCall, its LocalSpec with a call plan) of an operator
    call that can replay one: no key bias, packed documents or dropout, CUDA tensors on the
    triton backend (name: resolved). Kept beside flash_attn_func's (local._CALLS) under the
    operators' own signature, found alike by flash_fwd and flash_bwd; None for any other call."""
    if key_bias is not None or cu_q is not None or seed is not None or name != "triton" or not q.is_cuda:
        return None
    signature = ("operator", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                 q_start, k_start, left, right, scale, deterministic)  # fmt: skip
    call = local._CALLS.get(signature)
    if call is None:
        mask = _mask(q_start, k_start, left, right)
        call = local._ValidatedCall(local.LocalSpec(mask, scale, None, deterministic, True, local._CallPlan()), name)
        local._remember_call(signature, call)
    return call


def _flash_mask(q, k, cu_q, cu_k, q_start, k_start, left, right, max_q, max_k) -> BlockMask:
    """flash_fwd's BlockMask, packed documents' cu_seqlens and max_seqlen hints checked first."""
    cu_values = None
    if cu_q is not None:
        api = "flash_attn_varlen_func"
        cu_values = check_cu_seqlens(cu_q, cu_k, q.shape[1], k.shape[1], q.device, api)
        check_max_seqlen(None if max_q < 0 else max_q, cu_values[0], "max_seqlen_q", api)
        check_max_seqlen(None if max_k < 0 else max_k, cu_values[1], "max_seqlen_k", api)
    return _mask(q_start, k_start, left, right, cu_values, q.device)


def flash(
    q, k, v, key_bias, cu_q, cu_k, q_start, k_start, left, right, scale, dropout_p, seed, backend, deterministic, max_q,
    max_k, *, want_lse=True,
):  # fmt: skip
    """(out, lse) of flash_fwd (same arguments), for the public functions. Traced by
    torch.compile: the operator. Eager: the same forward and backward (local._FlashAttn)
    without the operator's dispatch, whose host time per call matters at short sequences
    (benchmarks.host_overhead); there lse is None unless want_lse."""
    if through_operator(q):
        out, lse, _, _ = flash_fwd(
            q, k, v, key_bias, cu_q, cu_k, q_start, k_start, left, right, scale, dropout_p, seed, backend,
            deterministic, max_q, max_k,
        )  # fmt: skip
        return out, lse
    mask = _flash_mask(q, k, cu_q, cu_k, q_start, k_start, left, right, max_q, max_k)
    spec = local.LocalSpec(mask, scale, _dropout(dropout_p, seed), deterministic, want_lse)
    return flash_eager(q, k, v, key_bias, spec, _backend(backend, q.device))


def flash_eager(q, k, v, key_bias, spec, backend: str):
    """flash()'s eager call from its local.LocalSpec and resolved backend name: (out, lse), lse
    None unless spec.want_lse."""
    with local.use_backend(backend):
        return local._FlashAttn.apply(q, k, v, key_bias, spec)


@flash_fwd.register_fake
def _(q, k, v, *args):
    return _forward_like(q, v)


@torch.library.custom_op(f"{NAMESPACE}::flash_bwd", mutates_args=())
def flash_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    key_bias: torch.Tensor | None,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    q_start: int,
    k_start: int,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of flash_fwd, given its out, m, l and the gradients of out and lse."""
    name = _backend(backend, q.device)
    call = _planned_call(q, k, v, key_bias, cu_q, seed, q_start, k_start, left, right, scale, name, deterministic)
    with local.use_backend(name):
        if call is None:
            cu = None if cu_q is None else cu_values(cu_q, cu_k, "flash_attn_varlen_func")
            spec = local.LocalSpec(_mask(q_start, k_start, left, right, cu, q.device), scale,
                                   _dropout(dropout_p, seed), deterministic)  # fmt: skip
        else:
            spec = call.spec
        ctx = _Saved(
            saved_tensors=(q, k, v, out, m, l, key_bias),
            spec=spec,
            backend=local.backend_for(q.device),
            input_key=None if call is None else spec.plan.input_key(q, k, v),
        )
        dq, dk, dv = local._FlashAttn.backward(ctx, do, dlse)[:3]
    return dq, dk, dv


@flash_bwd.register_fake
def _(q, k, v, *args):
    return _grads_like(q, k, v)


def _flash_setup(ctx, inputs, output):
    q, k, v, key_bias, cu_q, cu_k, q_start, k_start, left, right, scale, dropout_p, seed, backend, det, _, _ = inputs
    ctx.args = (q_start, k_start, left, right, scale, dropout_p)  # the hints were checked by the forward
    ctx.backend, ctx.deterministic = backend, det
    out, _, m, l = output
    ctx.save_for_backward(q, k, v, out, m, l, key_bias, cu_q, cu_k, seed)


def _flash_backward(ctx, dout, dlse, dm, dl):
    q, k, v, out, m, l, key_bias, cu_q, cu_k, seed = ctx.saved_tensors
    dq, dk, dv = flash_bwd(
        q, k, v, out, m, l, dout, dlse, key_bias, cu_q, cu_k, *ctx.args, seed, ctx.backend, ctx.deterministic
    )
    return (dq, dk, dv) + (None,) * 14


flash_fwd.register_autograd(_flash_backward, setup_context=_flash_setup)


# ----------------------------------------------------------------------------- the ring


def _ring_run(group_name: str):
    """(comm, group) for a ring operator: RingComm over the named group, or LocalComm ("")."""
    from .comm import LocalComm, RingComm

    if not group_name:
        return LocalComm(), None
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return RingComm(group), group


def _layout(layout: str):
    """The operators' layout string: a layout name, or a balanced layout's .code."""
    return layout_from_code(layout) if layout.startswith(CODE_PREFIX) else layout


def _ring_spec(left, right, scale, dropout, layout, grad_chunks, grad_accum, deterministic):
    from .ring import RingSpec

    grad_chunks = None if grad_chunks < 0 else grad_chunks
    window = window_of_args(left, right)
    return RingSpec(window, scale, _layout(layout), grad_chunks, grad_accum, dropout, deterministic)


def _cu_seqlens_error(cu_seqlens, layout: str, api: str):
    """The ValueError for packed documents whose cu_seqlens are not the ones the balanced layout
    was built from (checked here, where a tensor's values are known even under torch.compile),
    or None."""
    if cu_seqlens is None:
        return None
    cu = cu_values(cu_seqlens, cu_seqlens, api)[0]  # once per tensor and version, as the eager check
    if cu == _layout(layout).cu_seqlens:
        return None
    return ValueError(f"{api}: cu_seqlens {list(cu[:6])}... is not the one the layout was built from")


def _agreed(agree, cu_seqlens, layout: str, device, seed, group, head_group=None):
    """What a ring operator checks before its first exchange: cu_seqlens against the layout,
    and (agree non-empty: the compiled path) this rank's signature against every rank's of the
    ring, or of the grid with a head group, so that one rank's error raises on every rank.
    Returns the seed every rank uses, the first rank's over the ring then the head group (None
    without dropout; the seed as given without a process group)."""
    from . import ring
    from .comm import agree_across_grid

    api = _api_name(layout)
    error = _cu_seqlens_error(cu_seqlens, layout, api)
    if agree:  # the call's own fields, then a caller's (ring.CALLER_FIELDS) when it sent them
        names = ring._agreed_names(ring.CALLER_FIELDS if len(agree) > len(ring._FIELD_NAMES) else ())
        fields = dict(zip(names, agree, strict=True))
        agree_across_grid(group, head_group, fields, error, api, device=device, show=ring._show_field)
    elif error is not None:
        raise error
    if seed is None or group is None:
        return seed
    groups = (group,) if head_group is None else (group, head_group)
    return torch.tensor(first_ranks_seed(int(seed), device, *groups), dtype=torch.int64)


def _ring_call(
    q, cu_seqlens, group_name, left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum, deterministic,
    agree,
):  # fmt: skip
    """What a ring forward runs before its first exchange, eager or as ring_fwd: (comm, RingSpec,
    the seed every rank uses), the call checked (_agreed)."""
    comm, group = _ring_run(group_name)
    seed = _agreed(agree, cu_seqlens, layout, q.device, seed, group)
    spec = _ring_spec(left, right, scale, _dropout(dropout_p, seed), layout, grad_chunks, grad_accum, deterministic)
    return comm, spec, seed


@torch.library.custom_op(f"{NAMESPACE}::ring_fwd", mutates_args=())
def ring_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    group_name: str,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    layout: str,
    grad_chunks: int,
    grad_accum: torch.dtype | None,
    backend: str,
    deterministic: bool,
    agree: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring forward over the process group named `group_name` ("" : one rank), inputs
    already validated on this rank. layout: a layout name, or a balanced layout's .code
    (packed documents: B = 1; cu_seqlens, when given, are checked against the layout's).
    agree: empty, or this rank's call signature (ring._signature's values, then a caller's
    ring.CALLER_FIELDS when it sends them), checked against
    every rank's with one all_gather before the ring starts (the compiled path's rank-agreement
    check; a rank whose cu_seqlens check failed makes every rank raise). dropout_p, seed: as
    flash_fwd's; every rank uses the first rank's seed. Returns out, lse, m, l as flash_fwd, and
    the seed used (an int64 scalar on the CPU, 0 without dropout) for the backward."""
    from . import ring

    comm, spec, seed = _ring_call(
        q, cu_seqlens, group_name, left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum,
        deterministic, agree,
    )  # fmt: skip
    ctx = _Saved()
    with local.use_backend(_backend(backend, q.device)):
        out, lse = ring._RingAttn.forward(ctx, q, k, v, key_bias, spec, comm)
    m, l = ctx.saved_tensors[4:6]
    return out, lse, m.clone(), l, torch.zeros((), dtype=torch.int64) if seed is None else seed.clone()


def ring(
    q, k, v, key_bias, cu_seqlens, group_name, left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum,
    backend, deterministic, agree,
):  # fmt: skip
    """(out, lse) of ring_fwd (same arguments), for the ring functions. Traced by torch.compile:
    the operator. Eager: the same check, forward and backward (ring._RingAttn) without the
    operator's dispatch, whose handling of the arguments costs host time on every call (torch
    rebuilds the schema's argument list for each argument it fills in)."""
    if through_operator(q):
        out, lse, _, _, _ = ring_fwd(
            q, k, v, key_bias, cu_seqlens, group_name, left, right, scale, dropout_p, seed, layout, grad_chunks,
            grad_accum, backend, deterministic, agree,
        )  # fmt: skip
        return out, lse
    from . import ring as ring_module

    comm, spec, _ = _ring_call(
        q, cu_seqlens, group_name, left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum,
        deterministic, agree,
    )  # fmt: skip
    with local.use_backend(_backend(backend, q.device)):
        return ring_module._RingAttn.apply(q, k, v, key_bias, spec, comm)


@ring_fwd.register_fake
def _(q, k, v, *args):
    return (*_forward_like(q, v), torch.empty((), dtype=torch.int64))


@torch.library.custom_op(f"{NAMESPACE}::ring_bwd", mutates_args=())
def ring_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    key_bias: torch.Tensor | None,
    group_name: str,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor,
    layout: str,
    grad_chunks: int,
    grad_accum: torch.dtype | None,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of ring_fwd (this rank's shards), K/V rotating the ring again; seed: the one
    ring_fwd used."""
    from . import ring

    comm, _ = _ring_run(group_name)
    with local.use_backend(_backend(backend, q.device)):
        ctx = _Saved(
            saved_tensors=(q, k.contiguous(), v.contiguous(), out, m, l, key_bias),
            spec=_ring_spec(
                left, right, scale, _dropout(dropout_p, seed), layout, grad_chunks, grad_accum, deterministic
            ),
            comm=comm,
            backend=local.backend_for(q.device),
        )
        dq, dk, dv = ring._RingAttn.backward(ctx, do, dlse)[:3]
    return dq, dk, dv


@ring_bwd.register_fake
def _(q, k, v, *args):
    return _grads_like(q, k, v)


def _ring_setup(ctx, inputs, output):
    q, k, v, key_bias, _, group_name, left, right, scale, dropout_p, _, *rest = inputs
    ctx.args = (group_name, left, right, scale, dropout_p)
    ctx.rest = rest[:-1]  # the agreement signature is the forward's alone
    out, _, m, l, seed = output
    ctx.save_for_backward(q, k, v, out, m, l, key_bias, seed)


def _ring_backward(ctx, dout, dlse, dm, dl, dseed):
    q, k, v, out, m, l, key_bias, seed = ctx.saved_tensors
    dq, dk, dv = ring_bwd(q, k, v, out, m, l, dout, dlse, key_bias, *ctx.args, seed, *ctx.rest)
    return (dq, dk, dv) + (None,) * 14


ring_fwd.register_autograd(_ring_backward, setup_context=_ring_setup)


@torch.library.custom_op(f"{NAMESPACE}::ring_agree", mutates_args=())
def ring_agree(
    tensors: list[torch.Tensor], seed: torch.Tensor | None, group_name: str, layout: str, agree: list[int]
) -> list[torch.Tensor]:
    """ring_fwd's check (_agreed) alone, for a caller whose ranks took another path than the
    ring (RingMultiheadAttention's dense one): returns copies of `tensors` (an operator's
    outputs may not alias its inputs), then the seed every rank uses (zeros without one).
    The caller's collectives take these outputs, so none of them runs before the check."""
    _, group = _ring_run(group_name)
    device = tensors[0].device if tensors else None
    seed = _agreed(agree, None, layout, device, seed, group)
    return [t.clone() for t in tensors] + [torch.zeros((), dtype=torch.int64) if seed is None else seed.clone()]


@ring_agree.register_fake
def _(tensors, *args):
    return [torch.empty_like(t) for t in tensors] + [torch.empty((), dtype=torch.int64)]


def _agree_setup(ctx, inputs, output):
    ctx.agree_given = bool(inputs[-1])


def _agree_backward(ctx, grads):
    # the copies' gradients are their inputs'; none for the rest (torch takes an empty agree
    # list for a list of tensors, whose "no gradient" is an empty list)
    return list(grads[:-1]), None, None, None, None if ctx.agree_given else []


ring_agree.register_autograd(_agree_backward, setup_context=_agree_setup)


def agree(tensors, seed, group_name: str, layout: str, agree: list[int]):
    """ring_agree of `tensors` (None entries stay None): (*tensors, the seed every rank uses, or
    None when seed is None)."""
    given = [t for t in tensors if t is not None]
    *copies, agreed = ring_agree(given, seed, group_name, layout, agree)
    copies = iter(copies)
    return (*(None if t is None else next(copies) for t in tensors), None if seed is None else agreed)


@torch.library.custom_op(f"{NAMESPACE}::dropout_keep", mutates_args=())
def dropout_keep(seed: torch.Tensor, p: float, batch: int, heads: int, q_idx: torch.Tensor, keys: int) -> torch.Tensor:
    """ringflash.dropout.keep_mask(seed, p, 0..batch-1, 0..heads-1, q_idx, 0..keys-1) as one
    operator, for the dense path's torch ops around it: a compiler keeps its 64-bit integer
    arithmetic whole (inductor's CPU code generator rejects it), so the mask is the same bits
    eager or compiled. seed: an int64 scalar tensor; q_idx: int64 (L,) global query indices.
    Returns bool (batch, heads, L, keys) on q_idx's device."""
    idx = lambda n: torch.arange(n, device=q_idx.device)  # noqa: E731
    return keep_mask(int(seed), p, idx(batch), idx(heads), q_idx, idx(keys))


@dropout_keep.register_fake
def _(seed, p, batch, heads, q_idx, keys):
    return q_idx.new_empty((batch, heads, q_idx.shape[0], keys), dtype=torch.bool)


# ----------------------------------------------------------------------------- hybrid


def _grid_run(group_name: str, head_group_name: str):
    """(ring group, head group, comm) for a hybrid operator: the groups by name, and RingComm
    over the ring (LocalComm for a ring of one rank)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from .comm import LocalComm, RingComm, group_rank_world

    group, head_group = _resolve_process_group(group_name), _resolve_process_group(head_group_name)
    return group, head_group, RingComm(group) if group_rank_world(group)[1] > 1 else LocalComm()


def _api_name(layout: str) -> str:
    """The public function a ring or hybrid operator runs for (its errors name it)."""
    return "ring_flash_attn_varlen_func" if layout.startswith(CODE_PREFIX) else "ring_flash_attn_func"


def _hybrid_spec(
    left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum, deterministic, q_heads, kv_heads, head_group
):  # fmt: skip
    """(RingSpec, HeadPlan) of a hybrid operator: dropout of this rank's query heads, which start
    at u * Hq / U among the global ones."""
    from .comm import group_rank_world
    from .hybrid import head_plan

    u, U = group_rank_world(head_group)
    plan = head_plan(q_heads, kv_heads, U, _api_name(layout))
    drop = _dropout(dropout_p, seed)
    drop = drop and drop.heads_from(u * plan.q_per)
    return _ring_spec(left, right, scale, drop, layout, grad_chunks, grad_accum, deterministic), plan


def _hybrid_call(
    q, k, cu_seqlens, group_name, head_group_name, left, right, scale, dropout_p, seed, layout, grad_chunks,
    grad_accum, deterministic, agree,
):  # fmt: skip
    """What a hybrid forward runs before its first exchange, eager or as hybrid_fwd: (head
    group, comm, RingSpec, HeadPlan, the seed every rank uses), the call checked (_agreed)."""
    group, head_group, comm = _grid_run(group_name, head_group_name)
    seed = _agreed(agree, cu_seqlens, layout, q.device, seed, group, head_group)
    spec, plan = _hybrid_spec(
        left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum, deterministic, q.shape[2], k.shape[2],
        head_group,
    )  # fmt: skip
    return head_group, comm, spec, plan, seed


@torch.library.custom_op(f"{NAMESPACE}::hybrid_fwd", mutates_args=())
def hybrid_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    group_name: str,
    head_group_name: str,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    layout: str,
    grad_chunks: int,
    grad_accum: torch.dtype | None,
    backend: str,
    deterministic: bool,
    lens_q: list[int],
    lens_k: list[int],
    ring_len: int,
    return_lse: bool,
    agree: list[int],
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """Hybrid attention (ringflash.hybrid) over the ring named `group_name` and the head group
    named `head_group_name`, inputs already validated on this rank: q (B, lens_q[u], Hq, D),
    k, v (B, lens_k[u], Hkv, D / Dv) this rank's tokens (u: its rank in the head group),
    key_padding_mask (B, lens_k[u]) or None; K/V travel the ring at ring_len rows. layout, as
    ring_fwd's (a balanced layout's .code: packed documents, B = 1, cu_seqlens checked when
    given). agree: empty, or this rank's ring._signature values (then a caller's, as ring_fwd's),
    agreed over the grid (comm.agree_across_grid) before any exchange. dropout_p, seed: as ring_fwd's; every rank
    uses the grid's first rank's seed (over the ring, then the head group).
    Returns out (B, lens_q[u], Hq, Dv), lse (B, Hq, lens_q[u]; (B, Hq, 0) without return_lse)
    and for hybrid_bwd the ring's q_r, k_r, v_r, out_r, m, l, key bias ((0,) without a mask)
    and the seed used (an int64 scalar on the CPU, 0 without dropout)."""
    from .hybrid import _HybridAttn

    head_group, comm, spec, plan, seed = _hybrid_call(
        q, k, cu_seqlens, group_name, head_group_name, left, right, scale, dropout_p, seed, layout, grad_chunks,
        grad_accum, deterministic, agree,
    )  # fmt: skip
    ctx = _Saved()
    with local.use_backend(_backend(backend, q.device)):
        out, lse = _HybridAttn.forward(
            ctx, q, k, v, key_padding_mask, spec, comm, plan, head_group, lens_q, lens_k, ring_len, return_lse
        )
    q_r, k_r, v_r, out_r, m, l, key_bias = ctx.saved_tensors
    if lse is None:
        lse = m.new_empty(q.shape[0], q.shape[2], 0)
    if key_bias is None:
        key_bias = m.new_empty(0)
    seed = torch.zeros((), dtype=torch.int64) if seed is None else seed
    return out, lse, q_r, k_r, v_r, out_r, m.clone(), l, key_bias, seed  # m, l share one buffer


def hybrid(
    q, k, v, key_padding_mask, cu_seqlens, group_name, head_group_name, left, right, scale, dropout_p, seed, layout,
    grad_chunks, grad_accum, backend, deterministic, lens_q, lens_k, ring_len, return_lse, agree,
):  # fmt: skip
    """(out, lse or None without return_lse) of hybrid_fwd (same arguments), for the calls with
    a head group. Traced by torch.compile: the operator. Eager: the same check, forward and
    backward (hybrid._HybridAttn) without the operator's dispatch, whose handling of its 22
    arguments costs host time on every call, as ring()'s."""
    if through_operator(q):
        out, lse, *_ = hybrid_fwd(
            q, k, v, key_padding_mask, cu_seqlens, group_name, head_group_name, left, right, scale, dropout_p, seed,
            layout, grad_chunks, grad_accum, backend, deterministic, lens_q, lens_k, ring_len, return_lse, agree,
        )  # fmt: skip
        return out, (lse if return_lse else None)
    from .hybrid import _HybridAttn

    head_group, comm, spec, plan, _ = _hybrid_call(
        q, k, cu_seqlens, group_name, head_group_name, left, right, scale, dropout_p, seed, layout, grad_chunks,
        grad_accum, deterministic, agree,
    )  # fmt: skip
    with local.use_backend(_backend(backend, q.device)):
        return _HybridAttn.apply(
            q, k, v, key_padding_mask, spec, comm, plan, head_group, lens_q, lens_k, ring_len, return_lse
        )


@hybrid_fwd.register_fake
def _(q, k, v, key_padding_mask, cu_seqlens, group_name, head_group_name, *args):
    from .hybrid import head_plan

    layout, lens_q, ring_len, return_lse = args[5], args[-5], args[-3], args[-2]
    B, L, Hq, D = q.shape
    plan = head_plan(Hq, k.shape[2], len(lens_q), _api_name(layout))
    n = sum(lens_q)
    state = state_dtype(q.dtype)
    q_r = q.new_empty(B, n, plan.q_per, D)
    k_r, v_r = (t.new_empty(B, ring_len, plan.kv_per, t.shape[3]) for t in (k, v))
    m, l = (q.new_empty(B, plan.q_per, n, dtype=state) for _ in range(2))
    lse = q.new_empty(B, Hq, L if return_lse else 0, dtype=state)
    key_bias = q.new_empty((B, ring_len) if key_padding_mask is not None else (0,), dtype=state)
    out, out_r = q.new_empty(B, L, Hq, v.shape[3]), q.new_empty(B, n, plan.q_per, v.shape[3])
    return out, lse, q_r, k_r, v_r, out_r, m, l, key_bias, torch.empty((), dtype=torch.int64)


@torch.library.custom_op(f"{NAMESPACE}::hybrid_bwd", mutates_args=())
def hybrid_bwd(
    q_r: torch.Tensor,
    k_r: torch.Tensor,
    v_r: torch.Tensor,
    out_r: torch.Tensor,
    m: torch.Tensor,
    l: torch.Tensor,
    key_bias: torch.Tensor | None,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
    group_name: str,
    head_group_name: str,
    left: int,
    right: int,
    scale: float,
    dropout_p: float,
    seed: torch.Tensor,
    layout: str,
    grad_chunks: int,
    grad_accum: torch.dtype | None,
    backend: str,
    deterministic: bool,
    lens_q: list[int],
    lens_k: list[int],
    return_lse: bool,
    q_len: int,
    kv_len: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (B, q_len, Hq, D), dk, dv (B, kv_len, kv_heads, D) of hybrid_fwd (this rank's tokens),
    given its ring tensors and the gradients of out and lse (None: zeros); seed: the one
    hybrid_fwd used."""
    from .hybrid import _HybridAttn

    _, head_group, comm = _grid_run(group_name, head_group_name)
    spec, plan = _hybrid_spec(
        left, right, scale, dropout_p, seed, layout, grad_chunks, grad_accum, deterministic, len(lens_q) * q_r.shape[2],
        kv_heads, head_group,
    )  # fmt: skip
    with local.use_backend(_backend(backend, q_r.device)):
        ctx = _Saved(
            saved_tensors=(q_r, k_r, v_r, out_r, m, l, key_bias),
            spec=spec,
            comm=comm,
            plan=plan,
            head_group=head_group,
            lens_q=lens_q,
            lens_k=lens_k,
            return_lse=return_lse,
            q_len=q_len,
            kv_len=kv_len,
            backend=local.backend_for(q_r.device),
        )
        dq, dk, dv = _HybridAttn.backward(ctx, dout, dlse)[:3]
    return dq, dk, dv


@hybrid_bwd.register_fake
def _(q_r, k_r, v_r, *args):
    lens_q, q_len, kv_len, kv_heads = args[-6], *args[-3:]
    B, _, h, D = q_r.shape
    dk, dv = (t.new_empty(B, kv_len, kv_heads, t.shape[3]) for t in (k_r, v_r))
    return q_r.new_empty(B, q_len, len(lens_q) * h, D), dk, dv


def _hybrid_setup(ctx, inputs, output):
    q, k, _, key_padding_mask, _, *names_and_args = inputs
    group_name, head_group_name, left, right, scale, dropout_p, _, layout, grad_chunks, grad_accum = names_and_args[:10]
    backend, deterministic, lens_q, lens_k, _, return_lse, _ = names_and_args[10:]
    ctx.names_and_args = (group_name, head_group_name, left, right, scale, dropout_p)
    ctx.rest = (
        layout, grad_chunks, grad_accum, backend, deterministic, lens_q, lens_k, return_lse, q.shape[1], *k.shape[1:3]
    )  # fmt: skip
    ctx.has_mask = key_padding_mask is not None
    ctx.set_materialize_grads(False)  # the ring tensors' gradients are never used
    _, _, q_r, k_r, v_r, out_r, m, l, key_bias, seed = output
    ctx.save_for_backward(q_r, k_r, v_r, out_r, m, l, key_bias, seed)


def _hybrid_backward(ctx, dout, dlse, *unused):
    q_r, k_r, v_r, out_r, m, l, key_bias, seed = ctx.saved_tensors
    key_bias = key_bias if ctx.has_mask else None
    dq, dk, dv = hybrid_bwd(q_r, k_r, v_r, out_r, m, l, key_bias, dout, dlse, *ctx.names_and_args, seed, *ctx.rest)
    return (dq, dk, dv) + (None,) * 19


hybrid_fwd.register_autograd(_hybrid_backward, setup_context=_hybrid_setup)

flops.register(NAMESPACE)
