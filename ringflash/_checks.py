"""Input validation shared by every public entry point.

Errors name the argument and the shapes involved and are raised before any kernel launches
or any collective starts.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Any head dim in this range, for q/k and for v independently: the Triton kernels pad each inside
# to a power of two of at least 16 (kernels._block_d: zero columns, masked loads and stores), which
# changes no score and no output column; the softmax scale stays that of q/k's true head dim
# (resolve_scale).
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


class AttnDims(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int  # q and k's (the softmax scale's)
    head_dim_v: int  # v's, and the output's

    @property
    def empty(self) -> bool:
        """No query row or no key: the result is known without a kernel (ringflash.empty)."""
        return self.batch == 0 or self.seqlen_q == 0 or self.seqlen_k == 0 or self.heads_q == 0


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_tensor(name: str, t, api: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_dense(name: str, t: torch.Tensor, api: str) -> None:
    """A tensor whose elements the kernels address by strides: not sparse, not nested."""
    if t.is_nested or t.layout != torch.strided:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(
            f"{api}: {name} must be a dense (strided) tensor, got {got}; documents of several lengths go "
            "packed to flash_attn_varlen_func"
        )


def check_qkv(q, k, v, api: str) -> AttnDims:
    """Validate q (B, Sq, Hq, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv); return the dimensions.
    D and Dv may differ (e.g. 192 and 128), each from MIN_HEAD_DIM to MAX_HEAD_DIM."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, api)
        check_dense(name, t, api)
        if t.dim() != 4:
            raise ValueError(f"{api}: {name} must be 4-D (batch, seqlen, heads, head_dim), got shape {_shape(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{api}: {name} has dtype {t.dtype}; supported: float16, bfloat16, float32 "
                "(float64 on the torch backend)"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{api}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{api}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dtype == torch.float64:
        from .local import backend_name  # local imports this module

        if backend_name(q.device) == "triton":  # before any collective: the kernels would refuse it later
            raise TypeError(
                f"{api}: q, k, v have dtype torch.float64, which the Triton backend ({q.device.type} tensors) does "
                'not take; float16, bfloat16 and float32 do (float64 runs on ringflash.local.use_backend("torch"))'
            )
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{api}: v must match k in batch, seqlen and heads (its head_dim may differ), got k {_shape(k)} "
            f"and v {_shape(v)}"
        )
    Dv = v.shape[3]
    if Bk != B:
        raise ValueError(f"{api}: batch differs: q {_shape(q)} vs k {_shape(k)}")
    if Dk != D:
        raise ValueError(f"{api}: head_dim differs: q {_shape(q)} vs k {_shape(k)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{api}: q heads ({Hq}) must be a multiple of k/v heads ({Hkv}); q {_shape(q)}, k {_shape(k)}")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{api}: head_dim {D} unsupported (q {_shape(q)}); need {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    if not MIN_HEAD_DIM <= Dv <= MAX_HEAD_DIM:
        raise ValueError(f"{api}: v head_dim {Dv} unsupported (v {_shape(v)}); need {MIN_HEAD_DIM} to {MAX_HEAD_DIM}")
    return AttnDims(B, Sq, Sk, Hq, Hkv, D, Dv)


def resolve_scale(softmax_scale, head_dim: int, api: str) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{api}: softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{api}: softmax_scale must be finite, got {softmax_scale}")
    if abs(softmax_scale) > MAX_SCALE:  # the Triton kernels take scale * log2(e) as a float32
        raise ValueError(
            f"{api}: softmax_scale {softmax_scale:g} overflows float32, in which the kernels apply it "
            f"(|softmax_scale| <= {MAX_SCALE:.3g})"
        )
    return float(softmax_scale)


def resolve_grad_accum(grad_accum_dtype, input_dtype: torch.dtype, exact: torch.dtype, api: str) -> torch.dtype:
    """The dtype the ring's gradient accumulators are kept in: `exact` (the state dtype) when
    None, else one of `exact` and the inputs' dtype."""
    if grad_accum_dtype is None:
        return exact
    if not isinstance(grad_accum_dtype, torch.dtype) or grad_accum_dtype not in (exact, input_dtype):
        raise ValueError(
            f"{api}: grad_accum_dtype must be None, {exact} or the inputs' dtype {input_dtype}, "
            f"got {grad_accum_dtype!r}"
        )
    return grad_accum_dtype


def check_bool(name: str, value, api: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool, got {type(value).__name__}")


def resolve_deterministic(deterministic, api: str) -> bool:
    """The backward's mode: bitwise reproducible when asked (deterministic=True) or when torch
    is told to use deterministic algorithms (torch.use_deterministic_algorithms(True))."""
    check_bool("deterministic", deterministic, api)
    return deterministic or torch.are_deterministic_algorithms_enabled()


def check_not_capturing(api: str, why: str) -> None:
    """A RuntimeError naming `api` when the current CUDA stream is capturing a graph
    (torch.cuda.graph, torch.cuda.make_graphed_callables, torch.compile's "reduce-overhead")
    and the call cannot be captured: `why` says what it does on the host that a graph's
    replays would not redo (read boundaries, draw a seed, agree across ranks). Skipped while
    torch.compile traces (the operators check when they run)."""
    if torch.compiler.is_compiling() or not torch.cuda.is_available():
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{api}: {why}, which a CUDA graph's replays would not redo: call it outside graph capture "
            "(flash_attn_func without dropout can be captured)"
        )


def check_mask_not_differentiated(name: str, mask, api: str) -> None:
    """A float mask is not differentiated: one that requires grad (with grad mode on) raises
    a ValueError naming the argument, rather than getting no gradient silently."""
    if mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{api}: {name} requires grad, but masks are not differentiated here: pass {name}.detach() "
            "(or compute it under torch.no_grad())"
        )


def key_bias_from_mask(mask, dims: AttnDims, device, api: str, dtype=torch.float32):
    """key_padding_mask (B, Sk), bool (True = ignore the key) or float (added to the scores,
    not differentiated: one that requires grad raises), as a (B, Sk) bias in `dtype` (the
    state dtype: float32, float64 for float64), or None."""
    if mask is None:
        return None
    check_tensor("key_padding_mask", mask, api)
    check_dense("key_padding_mask", mask, api)
    want = (dims.batch, dims.seqlen_k)
    if tuple(mask.shape) != want:
        raise ValueError(f"{api}: key_padding_mask must have shape (batch, k seqlen) = {want}, got {_shape(mask)}")
    if mask.device != device:
        raise ValueError(f"{api}: key_padding_mask is on {mask.device}, q on {device}")
    if mask.dtype == torch.bool:
        return torch.zeros(want, dtype=dtype, device=device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"{api}: key_padding_mask must be bool or floating point, got {mask.dtype}")
    check_mask_not_differentiated("key_padding_mask", mask, api)
    return mask.detach().to(dtype).contiguous()


def check_cu_tensor(name: str, cu, device, api: str) -> None:
    """What can be checked of a cu_seqlens tensor without reading its values."""
    check_tensor(name, cu, api)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{api}: {name} must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{api}: {name} must be 1-D (n_docs + 1,), got shape {_shape(cu)}")
    if cu.device != device:
        raise ValueError(f"{api}: {name} is on {cu.device}, q on {device}")


# (id(cu_q), id(cu_k)) -> (weakref to cu_q, to cu_k, their versions, their values): the last
# few pairs of GPU boundary tensors read, so that the layers of a model over one packed batch
# (and their backwards) wait for the device once, not once per call
_READ_VALUES: dict = {}
_READ_VALUES_KEPT = 8


def _versions(*tensors):
    """The tensors' version counters (bumped by every in-place write through torch), or None
    for tensors that keep none (inference mode)."""
    try:
        return tuple(t._version for t in tensors)
    except RuntimeError:
        return None


def _remembers_values(cu) -> bool:
    """Whether cu_values keeps what it read of this tensor: only on a GPU, where a read waits
    for the device's queue (a CPU tensor can also change behind torch's back, through numpy)."""
    return cu.is_cuda


def _read_values(cu_q, cu_k) -> tuple[tuple, tuple]:
    if cu_q is cu_k:
        values = tuple(cu_q.tolist())
        return values, values
    both = torch.cat([cu_q.long(), cu_k.long()]).tolist()
    return tuple(both[: cu_q.numel()]), tuple(both[cu_q.numel() :])


def cu_values(cu_q, cu_k, api: str = "ringflash") -> tuple[tuple, tuple]:
    """Packed documents' boundaries (two int tensors) as two tuples of ints, read to the host
    in one copy (for tensors on a GPU: one wait for its queue). GPU tensors read before, of
    the same version (unchanged by torch since), give what was read then, without a wait.
    Under CUDA graph capture a RuntimeError naming `api` (a replay would keep the values read
    at capture)."""
    check_not_capturing(api, "packed documents' boundaries (cu_seqlens) are read on the host")
    key, versions = (id(cu_q), id(cu_k)), _versions(cu_q, cu_k)
    hit = _READ_VALUES.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k and versions is not None and hit[2] == versions:
        return hit[3]
    values = _read_values(cu_q, cu_k)
    if versions is not None and _remembers_values(cu_q) and _remembers_values(cu_k):
        _READ_VALUES.pop(key, None)
        while len(_READ_VALUES) >= _READ_VALUES_KEPT:
            _READ_VALUES.pop(next(iter(_READ_VALUES)))
        _READ_VALUES[key] = (weakref.ref(cu_q), weakref.ref(cu_k), versions, values)
    return values


def check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int, device, api: str):
    """Validate packed documents' boundaries, each starting at 0, non-decreasing, ending at its
    total, with as many documents on both sides. Returns their values (cu_values)."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_cu_tensor(name, cu, device, api)
    values_q, values_k = cu_values(cu_q, cu_k, api)
    for name, values, total in (("cu_seqlens_q", values_q, total_q), ("cu_seqlens_k", values_k, total_k)):
        if values[0] != 0:
            raise ValueError(f"{api}: {name} must start at 0, got {list(values[:4])}...")
        steps = [b - a for a, b in zip(values, values[1:])]
        if any(d < 0 for d in steps):
            i = next(i for i, d in enumerate(steps) if d < 0)
            raise ValueError(f"{api}: {name} must be non-decreasing, got {values[i]} then {values[i + 1]} at {i}")
        if values[-1] != total:
            raise ValueError(f"{api}: {name} must end at the total length {total}, got {values[-1]}")
    if len(values_q) != len(values_k):
        raise ValueError(
            f"{api}: cu_seqlens_q and cu_seqlens_k must describe as many documents, got "
            f"{len(values_q) - 1} and {len(values_k) - 1}"
        )
    return values_q, values_k


def check_max_seqlen(max_seqlen, cu: tuple, name: str, api: str) -> None:
    """A max_seqlen hint must be an int at least the longest document (it is never trusted);
    cu: the documents' boundaries as check_cu_seqlens returns them."""
    if max_seqlen is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{api}: {name} must be an int or None, got {type(max_seqlen).__name__}")
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if max_seqlen < longest:
        raise ValueError(f"{api}: {name} = {max_seqlen} is smaller than the longest document ({longest})")
