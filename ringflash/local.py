"""Single-device attention: flash_attn_func, and the block operations the ring is built from.

Backend choice: CUDA tensors run the Triton kernels, CPU tensors the plain-torch blockwise
implementation (ringflash.reference). The environment variable RINGFLASH_BACKEND=triton or
=torch, read once when ringflash is imported, forces one for the whole process; use_backend()
forces one inside a `with` block. Triton on CPU tensors runs Triton's interpreter, which needs
TRITON_INTERPRET=1 set before ringflash (and triton) are imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import NamedTuple

import torch

from . import reference
from ._checks import (
    check_bool,
    check_cu_seqlens,
    check_cu_tensor,
    check_max_seqlen,
    check_qkv,
    check_tensor,
    key_bias_from_mask,
    resolve_deterministic,
    resolve_scale,
)
from .dq_sum import DQPart
from .dropout import Dropout, all_dropped, check_dropout, operator_dropout
from .empty import empty_attention
from .masks import BlockMask, Visibility, local_offsets, window_from
from .merge import DeltaOf, SoftmaxState, state_dtype

BACKENDS = ("triton", "torch")

# read once: RINGFLASH_BACKEND (checked at first use, so a bad value cannot break the import)
# and whether Triton runs its CPU interpreter (triton reads it once, at import, too)
_ENV_BACKEND = os.environ.get("RINGFLASH_BACKEND", "").strip().lower() or None
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_FORCED = contextvars.ContextVar("ringflash_backend", default=None)


def _check_backend(name, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}={name!r}; expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Inside the block, block operations run on backend `name` ("triton" or "torch")
    whatever the device, as RINGFLASH_BACKEND does for the whole process."""
    token = _FORCED.set(_check_backend(name, "use_backend"))
    try:
        yield
    finally:
        _FORCED.reset(token)


def backend_name(device: torch.device) -> str:
    """The backend tensors on `device` run on: use_backend's, else RINGFLASH_BACKEND's, else
    "triton" for CUDA and "torch" for anything else."""
    forced = _FORCED.get()
    if forced is None and _ENV_BACKEND is not None:
        forced = _check_backend(_ENV_BACKEND, "RINGFLASH_BACKEND")
    if forced is None:
        return "triton" if device.type == "cuda" else "torch"
    if forced == "triton" and device.type != "cuda" and not _INTERPRETER:
        raise RuntimeError(
            "the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before ringflash "
            "is imported (Triton's interpreter)"
        )
    return forced


def backend_for(device: torch.device):
    """The module (ringflash.kernels or ringflash.reference) whose block operations tensors on
    `device` run on now. An autograd function resolves it once, in its forward, and keeps it
    for its backward: a backward on the other backend would rebuild the probabilities with
    other arithmetic than the forward's."""
    if backend_name(device) == "triton":
        from . import kernels  # imported lazily: the torch path needs no Triton

        return kernels
    return reference


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels need head_dim contiguous; other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_window(mask: BlockMask, q, k):
    """(visible, window) of a block of q's rows over k's: visible False when no query sees any
    key (nothing to launch); window None when every pair is visible (the unmasked loop), else
    the mask's window."""
    vis = mask.visibility(q.shape[1], k.shape[1])
    return vis is not Visibility.NONE, None if vis is Visibility.FULL else mask.window


def block_forward(
    q, k, v, state, mask: BlockMask, *, scale, fold, normalize=False, key_bias=None, backend=None, dropout=None
):
    """Attention of q (B, Sq, Hq, D) over k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), the pairs `mask` lets attend
    (positions, window, document bounds: ringflash.masks.BlockMask), into `state`, a
    SoftmaxState of the Sq rows, o (B, Sq, Hq, Dv) (ringflash.merge). fold=True: state holds an incoming
    unnormalized state for the same rows and receives the merged one; otherwise it is
    overwritten. normalize=True: state.o receives the normalized output (in its own dtype)
    instead of the unnormalized sum. key_bias: optional (B, Sk) float32 added to the scores of
    each key (-inf: a padded key). A block no query can see launches nothing. backend:
    backend_for's module (None: the one for q's device now). dropout: optional
    ringflash.dropout.Dropout of the block (its q0 / k0: the indices of q's and k's first rows).
    Returns whether anything was computed.
    """
    visible, window = _launch_window(mask, q, k)
    if not visible:
        if not fold:
            state.o.zero_()
            state.m.fill_(float("-inf"))
            state.l.zero_()
        return False
    (backend or backend_for(q.device)).forward(
        _unit_stride(q), _unit_stride(k), _unit_stride(v), state, q_start=mask.q_start, k_start=mask.k_start,
        window=window, bounds=mask.bounds, scale=scale, fold=fold, normalize=normalize, key_bias=key_bias,
        dropout=dropout,
    )  # fmt: skip
    return True


def attention_delta(o, do, backend=None):
    """rowsum(dO * O) in float32 (float64 for float64): (B, S, H, Dv) -> (B, H, S)."""
    return (backend or backend_for(o.device)).delta(_unit_stride(o), _unit_stride(do))


def block_backward(
    q,
    k,
    v,
    m,
    l,
    do,
    delta,
    dq,
    dk,
    dv,
    mask: BlockMask,
    *,
    scale,
    accumulate,
    key_bias=None,
    backend=None,
    dropout=None,
    deterministic=False,
    whole_call=False,
):
    """Gradients of the block (`mask` and `dropout` as in block_forward) given the final row statistics m, l
    (SoftmaxState.m / .l) and delta, (B, Hq, Sq) each, of the query rows (delta a tensor, or a
    merge.DeltaOf the backend computes it from): added into
    (accumulate=True) or written to dq (B, Sq, Hq, D) (or a dq_sum.DQPart, only added to),
    dk (B, Sk, Hkv, D) and dv (B, Sk, Hkv, Dv); do is (B, Sq, Hq, Dv). dq=None skips
    the dQ pass, dk=dv=None the dK/dV pass. With all three given, a block fuses_backward accepts
    runs as one fused kernel whose dQ is not bitwise reproducible; deterministic=True keeps the
    separate passes, which are. whole_call: the block is a one-device call's whole attention
    (a short one takes the fused kernel however few its programs). Returns whether anything
    was computed."""
    backend = backend or backend_for(q.device)
    if isinstance(dq, DQPart):
        if not accumulate:
            raise ValueError("a DQPart is only added to: pass accumulate=True")
        if not getattr(backend, "TAKES_DQ_PARTS", False):
            dq = dq.tensor()
    visible, window = _launch_window(mask, q, k)
    if not visible:
        if not accumulate:
            for t in (dq, dk, dv):
                if t is not None:
                    t.zero_()
        return False
    backend.backward(
        _unit_stride(q), _unit_stride(k), _unit_stride(v), m, l, _unit_stride(do), delta, dq, dk, dv,
        q_start=mask.q_start, k_start=mask.k_start, window=window, bounds=mask.bounds, scale=scale,
        accumulate=accumulate, key_bias=key_bias, dropout=dropout, deterministic=deterministic, whole_call=whole_call,
    )  # fmt: skip
    return True


def fuses_backward(q, k, v, mask: BlockMask, *, key_bias=None, backend=None, dropout=None, deterministic=False):
    """Whether block_backward runs this block (arguments as its) as one fused kernel when given
    dq, dk and dv together: a caller that computes dQ apart from dK/dV (the ring's backward)
    should then pass them together."""
    visible, window = _launch_window(mask, q, k)
    return visible and (backend or backend_for(q.device)).fuses_backward(
        q, k, v, window=window, bounds=mask.bounds, key_bias=key_bias, dropout=dropout, deterministic=deterministic
    )


def without_autocast(method):
    """For autograd Function forward/backward: an enclosing torch.autocast must not downcast
    the float32 state or the torch backend's einsums; the inputs' own dtypes decide."""

    @functools.wraps(method)
    def wrapper(ctx, *args):
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None  # (q, or the output's gradient)
        if tensor is None:
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if tensor is None:  # a backward that received no gradient tensor
            tensor = ctx.saved_tensors[0]
        device_type = "cuda" if tensor.is_cuda else tensor.device.type
        if not torch.is_autocast_enabled(device_type):  # entering the context costs host time
            return method(ctx, *args)
        with torch.autocast(device_type, enabled=False):
            return method(ctx, *args)

    return wrapper


_SECOND_ORDER = (
    b"ringflash: attention gradients are first order only; differentiating them again (create_graph=True, "
    b"e.g. a gradient penalty) is not supported"
)


def first_order_only(backward):
    """For autograd Function backward: its gradients computed without a graph and, under
    create_graph=True, returned through a node that raises when differentiated. torch's
    once_differentiable adds that node only when the incoming gradients require grad; with a
    loss such as out.sum() they do not, and the gradients would come back as constants that
    silently drop a gradient penalty's term."""

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        with torch.no_grad():
            grads = backward(ctx, *args)
        if not torch.is_grad_enabled():
            return grads
        raises = torch._C._functions.DelayedError(_SECOND_ORDER, len(grads))
        return raises(*[None if g is None else g.detach().requires_grad_() for g in grads])

    return wrapper


def output_grad(out, do):
    """dO for the backward of (out, lse), contiguous: zeros when only lse was used (do None)."""
    return torch.zeros_like(out) if do is None else do.contiguous()


def backward_inputs(out, do, dlse, backend=None):
    """(dO, delta) for the backward of (out, lse): dO may be None (only lse was used);
    delta = rowsum(dO * out), minus dlse when lse was used (d lse_i / d s_ij = p_ij folds into
    ds = p * (dp - delta))."""
    do = output_grad(out, do)
    return do, DeltaOf(out, dlse).value(do, lambda o, d: attention_delta(o, d, backend))


def local_forward(q, k, v, key_bias, mask: BlockMask, *, scale, backend, dropout=None) -> SoftmaxState:
    """Attention of q (B, Sq, Hq, D) over all of k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) in one
    block (mask, key_bias, dropout as block_forward's): a SoftmaxState whose o is the normalized
    output (B, Sq, Hq, Dv) in q's dtype, with m, l (B, Hq, Sq) in the state dtype for
    local_backward. No float32 output state is kept or merged."""
    state = _output_state(q, v)
    block_forward(q, k, v, state, mask, scale=scale, fold=False, normalize=True, key_bias=key_bias,
                  backend=backend, dropout=dropout)  # fmt: skip
    return state


def _output_state(q, v) -> SoftmaxState:
    """local_forward's state for q's rows, allocated, contents undefined."""
    return SoftmaxState.empty(q.new_empty(*q.shape[:3], v.shape[3]))


def _gradients(q, k, v, kv_grad_dtype=None):
    """local_backward's (dq, dk, dv), contiguous, allocated, contents undefined."""
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk, dv = (torch.empty_like(t, dtype=kv_grad_dtype, memory_format=torch.contiguous_format) for t in (k, v))
    return dq, dk, dv


def local_backward(
    q, k, v, out, m, l, key_bias, do, dlse, mask: BlockMask, *, scale, backend, dropout=None, deterministic=False,
    kv_grad_dtype=None,
):  # fmt: skip
    """(dq, dk, dv) of local_forward's (out, lse) given their gradients do (B, Sq, Hq, Dv) and
    dlse (B, Hq, Sq), either None; dq in q's dtype, dk and dv in kv_grad_dtype (None: k's and
    v's), each written once (no accumulator to zero, add to or cast)."""
    do = output_grad(out, do)
    # delta left to the backend: the fused backward computes it in its statistics launch
    delta = DeltaOf(out, dlse)
    dq, dk, dv = _gradients(q, k, v, kv_grad_dtype)
    block_backward(q, k, v, m, l, do, delta, dq, dk, dv, mask, scale=scale, accumulate=False, key_bias=key_bias,
                   backend=backend, dropout=dropout, deterministic=deterministic, whole_call=True)  # fmt: skip
    return dq, dk, dv


class LocalSpec(NamedTuple):
    """A one-device call's options, as _FlashAttn takes them: one argument (an autograd
    Function's host time per call grows with its argument count). mask: the BlockMask; scale;
    dropout: a Dropout or None; deterministic: the backward's mode (block_backward);
    want_lse: whether the forward returns lse (its three small ops are host time a short call
    feels), else None in its place; plan: the call's _CallPlan (flash_attn_func's repeated
    calls), or None."""

    mask: BlockMask
    scale: float
    dropout: Dropout | None = None
    deterministic: bool = False
    want_lse: bool = True
    plan: _CallPlan | None = None


class _FlashAttn(torch.autograd.Function):
    @staticmethod
    @without_autocast
    def forward(ctx, q, k, v, key_bias, spec: LocalSpec):
        """(out, lse) of local_forward under `spec`; lse None when not spec.want_lse."""
        plan = spec.plan
        key = None if plan is None else plan.input_key(q, k, v)
        state = None if key is None else plan.replay_forward(key, q, k, v)
        if state is None:
            backend = backend_for(q.device)

            def run():
                return local_forward(q, k, v, key_bias, spec.mask, scale=spec.scale, backend=backend,
                                     dropout=spec.dropout)  # fmt: skip

            state = run() if key is None else plan.learn_forward(key, q, k, v, run)
        else:
            backend = plan.backend
        ctx.save_for_backward(q, k, v, state.o, state.m, state.l, key_bias)
        ctx.spec, ctx.backend, ctx.input_key = spec, backend, key
        ctx.set_materialize_grads(False)
        return state.o, state.lse() if spec.want_lse else None

    @staticmethod
    @first_order_only
    @without_autocast
    def backward(ctx, do, dlse):
        q, k, v, out, m, l, key_bias = ctx.saved_tensors
        spec = ctx.spec

        def run():
            return local_backward(
                q, k, v, out, m, l, key_bias, do, dlse, spec.mask, scale=spec.scale, backend=ctx.backend,
                dropout=spec.dropout, deterministic=spec.deterministic,
            )  # fmt: skip

        key = ctx.input_key
        dq, dk, dv = run() if key is None else spec.plan.backward(key, q, k, v, out, m, l, do, dlse, spec.scale, run)
        return dq, dk, dv, None, None


# the Gluon forward's mask tensors of a call without masks (gluon_forward.forward's tensors
# after q, k, v and the state: row bounds, key bias and its key limits)
_NO_MASKS = (None, None, None, None)


def _same_tensors(recorded, tensors) -> bool:
    return len(recorded) == len(tensors) and all(a is b for a, b in zip(recorded, tensors, strict=True))


class _CallPlan:
    """What the layers below flash_attn_func chose for the calls of one signature, to replay
    without them: the Gluon forward's kept launch plan, and the fused backward's (ringflash.
    kernels.plans). A repeated call then costs its allocations, its launches and one autograd
    node, host time a short call feels (benchmarks.host_overhead).

    Learned from a call whose layers used exactly one kept plan on tensors that are the call's
    own (checked by identity: inputs, outputs, gradients), under plans.recording(); until then,
    or where nothing was learned (the Triton kernels, the two-pass backward), the layers run.
    A plan holds for calls of its signature whose inputs have the strides, alignment and
    aliasing it was learned with (input_key); the backward's also needs its dO, dlse, out, m
    and l alike (plans.tensor_key: an operator's are handed in, not allocated here); under a
    kernel config override (kernels.configs.override) the layers always run. Each half gives
    up learning after _TRIES calls that taught it nothing. Module constants of kernels.configs
    changed at run time (tests, benchmarks) are not seen by a plan learned before: forget the
    remembered calls (local._CALLS.clear()) then."""

    _TRIES = 3

    __slots__ = ("backend", "_configs", "_gluon_forward", "_gluon_backward", "_plans", "_forward", "_backward",
                 "_tries")  # fmt: skip

    def __init__(self):
        from . import kernels
        from .kernels import configs, gluon_backward, gluon_forward, plans

        self.backend = kernels
        self._configs, self._plans = configs, plans
        self._gluon_forward, self._gluon_backward = gluon_forward, gluon_backward
        self._forward = None  # (input key, Plan)
        self._backward = None  # (input key, the keys of (dO, dlse, out, m, l), Plan)
        self._tries = [0, 0]  # runs of the forward / backward that taught nothing

    def _backward_keys(self, do, dlse, out, m, l) -> tuple:
        """What a backward replay needs alike of the tensors it is handed besides q, k, v."""
        tensor_key = self._plans.tensor_key
        return tensor_key(do), tensor_key(dlse), tensor_key(out), tensor_key(m), tensor_key(l)

    def input_key(self, q, k, v):
        """What a replay needs alike of the inputs beyond the call's signature; None: the layers
        must run (a kernel config override is in force)."""
        if self._configs.overridden_any():
            return None
        return (q.stride(), k.stride(), v.stride(), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
                q is k, q is v, k is v)  # fmt: skip

    def replay_forward(self, key, q, k, v) -> SoftmaxState | None:
        """local_forward's state from the learned forward plan, or None: none learned for key."""
        learned = self._forward
        if learned is None or learned[0] != key:
            return None
        state = _output_state(q, v)
        self._gluon_forward.launch_planned(learned[1], (q, k, v, state.o, state.m, state.l, *_NO_MASKS))
        return state

    def learn_forward(self, key, q, k, v, run) -> SoftmaxState:
        """run() (local_forward), learning its plan when it used one on this call's tensors."""
        if self._forward is not None or self._tries[0] >= self._TRIES:
            return run()
        with self._plans.recording() as uses:
            state = run()
        if len(uses) == 1 and uses[0].kind == "forward":
            if _same_tensors(uses[0].args, (q, k, v, state.o, state.m, state.l, *_NO_MASKS)):
                self._forward = (key, uses[0].plan)
                return state
        self._tries[0] += 1
        return state

    def backward(self, key, q, k, v, out, m, l, do, dlse, scale, run):
        """(dq, dk, dv) of local_backward: replayed from the learned backward plan where it holds
        for key, dO, dlse, out, m and l, else run(), learning its plan when there is none yet."""
        learned = self._backward
        if learned is not None:
            if learned[0] == key:
                do = output_grad(out, do)
                if self._backward_keys(do, dlse, out, m, l) == learned[1] and all(do is not t for t in (q, k, v)):
                    dq, dk, dv = _gradients(q, k, v)
                    self._gluon_backward.prepared_from(learned[2], q, k, v, m, l, do, DeltaOf(out, dlse), dq, dk, dv,
                                                   scale=scale, accumulate=False)()  # fmt: skip
                    return dq, dk, dv
            return run()
        if self._tries[1] >= self._TRIES:
            return run()
        with self._plans.recording() as uses:
            dq, dk, dv = run()
        if len(uses) == 1 and uses[0].kind == "backward":
            uq, uk, uv, um, ul, udo, udelta, udq, udk, udv, uscale, uaccumulate, ubounds, ukey_bias = uses[0].args
            if (
                _same_tensors((uq, uk, uv, um, ul, udq, udk, udv), (q, k, v, m, l, dq, dk, dv))
                and isinstance(udelta, DeltaOf)
                and udelta.out is out
                and udelta.dlse is dlse
                and uscale == scale
                and not uaccumulate
                and ubounds is None
                and ukey_bias is None
            ):
                self._backward = (key, self._backward_keys(udo, dlse, out, m, l), uses[0].plan)
                return dq, dk, dv
        self._tries[1] += 1
        return dq, dk, dv


def flash_attn_func(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), key_padding_mask=None, return_lse=False,
    dropout_p=0.0, generator=None, deterministic=False,
):  # fmt: skip
    """Exact attention on one device.

    q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv) with Hq % Hkv == 0 (GQA / MQA
    without copies). dtype float16, bfloat16 or float32 (float64 on the torch backend); any D
    and any Dv from 1 to 256, independently (v's head dim may differ, e.g. D = 192, Dv = 128;
    padded inside; the default scale is 1/sqrt(D) of q/k's true D). Empty inputs (B, Sq or Hq
    0) give empty outputs; Sk = 0 gives out 0 and lse -inf. Masks align bottom-right when
    Sq != Sk, as flash-attn's: query i sits at key position i + Sk - Sq. causal: query i
    sees key j iff j <= i + Sk - Sq. window_size = (left, right): query i sees key j iff
    i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 meaning unbounded on that side (causal
    means right = 0; another right with causal=True is an error). A query that sees no key
    gets output 0 and lse -inf. key_padding_mask: optional (B, Sk), bool (True = padding: the
    key is ignored) or float (added to every query's scores of that key; not differentiated:
    one that requires grad raises).
    Returns out (B, Sq, Hq, Dv) in q's dtype, and with return_lse=True also lse (B, Hq, Sq),
    float32 (float64 for float64 inputs), natural log. Differentiable in q, k, v (and
    through lse). Key blocks no query of a tile sees are skipped: a window costs in proportion
    to S x window, not S^2. dropout_p: attention dropout (apply it in training only, as
    flash-attn's): the pair (query i, key j) of batch b and query head h is dropped by a keep
    mask that is a pure function of (a fresh seed from torch's CPU generator, b, h, i, j)
    (ringflash.dropout), kept weights are scaled by 1 / (1 - p); the backward rebuilds the
    mask. lse is that of the weights before dropout. generator: a CPU torch.Generator to draw
    the seed from instead.
    deterministic: the backward's mode. False (default): on Hopper, 16-bit inputs with D = Dv
    padded to 64 or 128 (a multiple of 8 up to 128) or to 256 (where Dv may differ), dense, causal, windowed or packed
    documents, no key padding mask or dropout, run one fused backward kernel whose dQ is summed
    in float32 by atomics in a varying order (gradients equal within rounding, not bitwise, run
    to run); True, or
    torch.use_deterministic_algorithms(True): the two-pass backward, bitwise reproducible. Every
    other case is bitwise reproducible either way.
    """
    signature = _call_signature(q, k, v, causal, softmax_scale, window_size, key_padding_mask, return_lse, dropout_p,
                                generator, deterministic)  # fmt: skip
    call = None if signature is None else _CALLS.get(signature)
    if call is None:
        api = "flash_attn_func"
        dims = check_qkv(q, k, v, api)
        check_bool("causal", causal, api)
        check_bool("return_lse", return_lse, api)
        deterministic = resolve_deterministic(deterministic, api)
        dropout_p = check_dropout(dropout_p, generator, api)
        window = window_from(causal, window_size, api)
        scale = resolve_scale(softmax_scale, dims.head_dim, api)
        key_bias = key_bias_from_mask(key_padding_mask, dims, q.device, api, state_dtype(q.dtype))
        if dims.empty:
            out, lse = empty_attention(q, k, v)
            return (out, lse) if return_lse else out
        q_start, k_start = local_offsets(dims.seqlen_q, dims.seqlen_k)
        if signature is None:  # the general path: key padding, dropout, torch.compile, ...
            out, lse = ops.flash(
                q, k, v, key_bias, None, None, q_start, k_start, *ops.window_args(window), scale,
                *operator_dropout(dropout_p, generator), _op_backend(q), deterministic, -1, -1, want_lse=return_lse,
            )  # fmt: skip
            out = all_dropped(out, dropout_p)
            return (out, lse) if return_lse else out
        backend = _op_backend(q)
        plan = _CallPlan() if backend == "triton" and q.is_cuda else None
        spec = LocalSpec(BlockMask(q_start, k_start, window), scale, None, deterministic, return_lse, plan)
        call = _ValidatedCall(spec, backend)
        _remember_call(signature, call)
    out, lse = ops.flash_eager(q, k, v, None, call.spec, call.backend)
    return (out, lse) if return_lse else out


class _ValidatedCall(NamedTuple):
    """What flash_attn_func's checks resolve for a call signature (_call_signature): the
    autograd Function's options and the backend's name."""

    spec: LocalSpec
    backend: str


# Validated calls by signature: a repeated call of the same shapes, dtypes, devices and flags
# skips its checks and the building of its mask, host time a short call feels
# (benchmarks.host_overhead). The _CALLS_KEPT most recently added are kept.
_CALLS: dict = {}
_CALLS_KEPT = 256


def _remember_call(signature, call: _ValidatedCall) -> None:
    if len(_CALLS) >= _CALLS_KEPT:
        try:
            _CALLS.pop(next(iter(_CALLS)))
        except (KeyError, RuntimeError, StopIteration):  # changed meanwhile by another thread
            pass
    _CALLS[signature] = call


def _call_signature(q, k, v, causal, softmax_scale, window_size, key_padding_mask, return_lse, dropout_p, generator,
                    deterministic):  # fmt: skip
    """Everything flash_attn_func's checks read of an eager call without key padding or dropout
    whose arguments are of the exact types the checks accept (so that equal signatures pass them
    alike: True == 1, but a 1 for causal must still raise), or None: the call is checked in
    full. The checks read shapes, dtypes and devices, not strides or values; the backend and
    determinism settings in force are part of it."""
    if (
        type(q) is not torch.Tensor
        or type(k) is not torch.Tensor
        or type(v) is not torch.Tensor
        or key_padding_mask is not None
        or generator is not None
        or type(dropout_p) is not float
        or dropout_p != 0.0
        or type(causal) is not bool
        or type(return_lse) is not bool
        or type(deterministic) is not bool
        or not (softmax_scale is None or type(softmax_scale) is float)
        or type(window_size) is not tuple
        or len(window_size) != 2
        or type(window_size[0]) is not int
        or type(window_size[1]) is not int
        or ops.through_operator(q)
    ):
        return None
    return (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal, softmax_scale,
        window_size, return_lse, deterministic or torch.are_deterministic_algorithms_enabled(), _FORCED.get(),
    )  # fmt: skip


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False, softmax_scale=None,
    window_size=(-1, -1), return_lse=False, dropout_p=0.0, generator=None, deterministic=False,
):  # fmt: skip
    """Exact attention over packed documents (the THD layout), on one device.

    q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv), Hq % Hkv == 0; dtypes and head dims as
    flash_attn_func. cu_seqlens_q, cu_seqlens_k: int32 or int64 (n_docs + 1,) on q's device,
    starting at 0, non-decreasing, ending at total_q / total_k: document d is rows
    cu[d]:cu[d+1] (empty documents allowed). Each query attends only to the keys of its own
    document, with causal and window_size (as flash_attn_func's) applied per document, aligned
    bottom-right within it. max_seqlen_q / max_seqlen_k: hints, checked when given (never
    trusted: the kernels do not use them). Returns out (total_q, Hq, Dv) in q's dtype and, with
    return_lse=True, lse (Hq, total_q), float32 (float64 for float64 inputs). Differentiable in
    q, k, v. Any head dim from 1 to 256; no documents or no rows give empty (or zero) outputs.
    Cost follows the visible pairs (about the sum of squared document lengths / 2 for
    causal documents), not total_q x total_k. dropout_p, generator: as flash_attn_func's, query
    and key indices being rows of the packed q and k. deterministic: as flash_attn_func's (packed
    documents take the fused backward too: D = Dv padded to 64 or 128, or padded to 256, 16-bit, no dropout, on Hopper,
    calls of enough work: kernels.fuses_backward). cu_seqlens on a GPU are read to the host
    once per tensor and version (_checks.cu_values): pass a new tensor for new boundaries
    written behind torch's back (through .data, DLPack, raw pointers), which the version
    counter cannot see.
    """
    api = "flash_attn_varlen_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, api)
        if t.dim() != 3:
            raise ValueError(f"{api}: {name} must be 3-D (total, heads, head_dim), got shape {tuple(t.shape)}")
    dims = check_qkv(q[None], k[None], v[None], api)
    check_bool("causal", causal, api)
    check_bool("return_lse", return_lse, api)
    dropout_p = check_dropout(dropout_p, generator, api)
    deterministic = resolve_deterministic(deterministic, api)
    window = window_from(causal, window_size, api)
    scale = resolve_scale(softmax_scale, dims.head_dim, api)
    check_cu_tensor("cu_seqlens_q", cu_seqlens_q, q.device, api)
    check_cu_tensor("cu_seqlens_k", cu_seqlens_k, q.device, api)
    hints = []
    for name, hint in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int)):
            raise TypeError(f"{api}: {name} must be an int or None, got {type(hint).__name__}")
        if hint is not None and hint < 0:
            raise ValueError(f"{api}: {name} = {hint} is negative")
        hints.append(-1 if hint is None else hint)
    if dims.empty:  # no kernel runs: the values are checked here
        cu_q, cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], q.device, api)
        check_max_seqlen(max_seqlen_q, cu_q, "max_seqlen_q", api)
        check_max_seqlen(max_seqlen_k, cu_k, "max_seqlen_k", api)
        return packed_outputs(*empty_attention(q[None], k[None], v[None]), return_lse)
    # cu_seqlens' values (and the hints against them) are checked by ops.flash before any
    # kernel: inside the operator when traced, where they are known under torch.compile too
    out, lse = ops.flash(
        q[None], k[None], v[None], None, cu_seqlens_q, cu_seqlens_k, 0, 0, *ops.window_args(window), scale,
        *operator_dropout(dropout_p, generator), _op_backend(q), deterministic, *hints, want_lse=return_lse,
    )  # fmt: skip
    return packed_outputs(all_dropped(out, dropout_p), lse, return_lse)


def packed_outputs(out, lse, return_lse: bool):
    """What the packed APIs return from a batch-of-one call's out (1, T, H, Dv) and lse
    (1, H, T): out (T, H, Dv), and (out, lse (H, T)) with return_lse. Views by squeeze, whose
    backward is a view too (indexing [0]'s allocates a zeroed batch and copies the gradient
    into it: a full-size fill and copy per call)."""
    out = out.squeeze(0)
    return (out, lse.squeeze(0)) if return_lse else out


def _op_backend(q) -> str:
    """The backend name for an operator call: resolved now in eager calls, so the backward runs
    on the forward's backend; "" under torch.compile, which cannot read use_backend's context
    (the operators then resolve it when they run)."""
    return "" if ops.shapes_only(q) else backend_name(q.device)


from . import ops  # noqa: E402  (ops runs this module's autograd Function: imported once it exists)
