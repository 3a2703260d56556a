"""Hugging Face transformers integration: a causal LM's attention on the ring.

    import ringflash.hf as rhf
    rhf.apply(model, group=None, layout="zigzag")       # in place; rhf.unapply(model) undoes it
    batch = rhf.shard_inputs(input_ids, labels=labels, attention_mask=attention_mask)
    out = model(**batch)                                 # out.loss: this rank's part of the loss
    out.loss.backward()
    rhf.allreduce_grads(model)                           # SUM over the group: one device's gradients

Hybrid sequence parallelism (README: Hybrid): pass the same group and head_group (or one 2-D
DeviceMesh as group) to apply, shard_inputs and allreduce_grads; the sequence is then sharded
over the R x U grid and the gradients are summed over all R x U ranks.

How it fits into transformers (5.x):
- An attention function and its mask function are registered under ATTN_IMPLEMENTATION in
  transformers' AttentionInterface / AttentionMaskInterface, and the model's config is
  switched to it. The name has no "flash" in it: transformers treats such names as flash
  kernels (hub loading, varlen handling). Without a registered mask function transformers
  drops the 2D attention mask for a custom name (padding would be silently ignored), and its
  flash mask function returns None for a shard without padding (ranks would disagree), so
  ours always hands the 2D padding mask through.
- A forward pre-hook on the base model decides, once per forward, whether this forward runs
  on the ring (a process group of more than one rank, no KV cache passed in, not inside the
  model's generate(), which apply() wraps) or locally (no group, a cache given, or
  generate(): each rank then holds its whole input).
  It passes that decision and the binding (group, layout, head_group) down to the attention
  function as a keyword argument, so gradient checkpointing's recomputation sees the same
  decision. On the ring it also fills in global position_ids when none are given (RoPE must
  see global positions), turns off the useless KV cache of sharded keys, and rejects packed
  sequences.
- shard_inputs shifts the labels on the whole sequence before sharding and passes them as
  `shift_labels` (transformers' ForCausalLMLoss then does not shift again inside a shard),
  with the global label-token count as `num_items_in_batch`, so the ranks' losses add up to
  the one-device loss.

Sliding-window layers (Mistral; Qwen2 with use_sliding_window) run through
flash_attn_func(window_size=(W - 1, 0)) on one process and ring_flash_attn_func(window_size=)
on the ring (transformers: query i sees key j iff i - W < j <= i); a window shorter than a
shard needs one neighbour's K/V only (the ring runs 2 steps with contiguous, at most 3 with zigzag). Attention
dropout in training runs in the kernels (ringflash.dropout: the ring drops the pairs one
process drops). Both, and padding, work with a head_group as without.

Packed documents (one row): shard_inputs sees the whole row, so it is where the documents are
found (cu_seqlens, or restarting position_ids read as transformers reads them) and laid out
(balanced_layout over the ring's R ranks); the batch carries them (a _Packed under
_PACKED_KWARG) to the pre-hook, which puts them on the _Call, and the attention function runs
ring_flash_attn_varlen_func (one process: flash_attn_varlen_func) instead of the dense call.

Not supported (NotImplementedError naming it): packed sequences given to the model without
shard_inputs (position_ids that restart, cu_seq_lens), logit softcapping, attention sinks,
position biases, 4D attention masks on the ring, bidirectional attention, output_attentions, a
balanced layout as apply's or shard_inputs' layout. Tested model families: MODEL_TYPES.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("ringflash.hf needs transformers: pip install 'ringflash[hf]'") from e

from ._checks import check_bool
from .balance import balanced_layout
from .comm import (
    INPUT_ERRORS,
    agree_across_grid,
    group_rank_world,
    resolve_group,
    resolve_groups,
    resolve_groups_or_error,
)
from .hybrid import head_plan
from .layout import local_positions, shard
from .local import flash_attn_func, flash_attn_varlen_func
from .ops import NAMESPACE
from .ring import ring_flash_attn_func, ring_flash_attn_varlen_func
from .schedule import check_divisible, check_layout, chunks_per_rank, is_balanced

# The transformers versions this module is tested with (pyproject.toml's `hf` extra).
TRANSFORMERS_MIN, TRANSFORMERS_BELOW = (5, 0), (6, 0)

ATTN_IMPLEMENTATION = "rf_ring"  # no "flash" in it: see the module docstring
MODEL_TYPES = ("llama", "mistral", "qwen2")  # config.model_type of the families tested
IGNORE_INDEX = -100  # transformers' loss functions' default
_CTX_KWARG = "ringflash_ctx"
_STATE_ATTR = "_ringflash_hf"

_PACKED = (
    "packed sequences (position_ids that restart inside a row, as DataCollatorWithFlattening "
    "makes, or cu_seq_lens / seq_idx) given to the model directly are not supported: pass the "
    "whole row to ringflash.hf.shard_inputs(input_ids, position_ids=... or cu_seqlens=...), which "
    "plans the documents' layout over the ring"
)
_PACKED_KWARG = "ringflash_packed"  # shard_inputs' batch -> the pre-hook: the documents and their layout


@dataclass(frozen=True)
class _Packed:
    """Packed documents of a one-row batch: the global boundaries and the balanced layout of
    the ring (R ranks) that shard_inputs sharded them with."""

    cu_seqlens: tuple
    layout: object

    def __repr__(self) -> str:  # in a batch printed for debugging: short
        return f"_Packed({len(self.cu_seqlens) - 1} documents, {self.cu_seqlens[-1]} tokens)"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


if _version_tuple(transformers.__version__) < TRANSFORMERS_MIN:  # pragma: no cover
    raise ImportError(
        f"ringflash.hf needs transformers >= {'.'.join(map(str, TRANSFORMERS_MIN))}, found {transformers.__version__}"
    )


@dataclass(frozen=True)
class _Call:
    """What the base model's pre-hook decided for one forward, handed to every attention call."""

    group: object
    layout: str
    ring: bool  # True: the inputs are this rank's shards and attention runs on the ring
    has_mask: bool  # a 2D attention mask was given to the forward
    world: int  # the ranks the sequence is sharded over: R x U with a head_group
    head_group: object = None
    packed: _Packed | None = None  # packed documents (one row): attention within each document


@dataclass
class _Applied:
    """Per model, on the model and on its base model (a deepcopy of the model copies it along)."""

    group: object
    layout: str
    original: str | None
    base: torch.nn.Module
    head_group: object = None
    generating: int = 0  # > 0 while the model's generate() runs: every forward is local


# ----------------------------------------------------------------------------- attention


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"ringflash.hf: {what}")


def _check_kwargs(module, kwargs) -> None:
    """Features the ring does not compute: raise, never give a different answer."""
    if kwargs.get("softcap") is not None:
        raise _unsupported(f"attention logit softcapping (softcap={kwargs['softcap']}) is not supported")
    if kwargs.get("s_aux") is not None:
        raise _unsupported("attention sinks (s_aux) are not supported")
    if kwargs.get("position_bias") is not None:
        raise _unsupported("an additive position bias (position_bias) is not supported")
    if kwargs.get("output_attentions"):
        raise _unsupported("output_attentions=True is not supported: attention weights are never materialized")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
        if kwargs.get(name) is not None:
            raise _unsupported(f"{_PACKED}; got {name}")


def _window_size(sliding_window, total_len: int) -> tuple[int, int]:
    """transformers' sliding window W lets query i see key j iff i - W < j <= i: ringflash's
    window_size=(W - 1, 0) with causal=True. (-1, -1) when the layer has none or the whole
    sequence (total_len tokens) fits in it, where it changes nothing."""
    if sliding_window is None or sliding_window <= 0 or total_len <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0)


def _ring_attention(q, k, v, *, scaling, call, padding, window_size, dropout_p):
    """The one place the ring is called: q (B, S_local, Hq, D), k, v (B, S_local, Hkv, D), this
    rank's shards; padding (B, S_local) bool, True = padded key, or None; window_size as
    _window_size gives it (a sliding-window layer: by global positions on the ring; packed
    documents, B = 1: within each document)."""
    if call.packed is not None:
        out = ring_flash_attn_varlen_func(
            q[0], k[0], v[0], call.packed.cu_seqlens, layout=call.packed.layout, causal=True, softmax_scale=scaling,
            window_size=window_size, group=call.group, head_group=call.head_group, dropout_p=dropout_p,
        )  # fmt: skip
        return out[None]
    return ring_flash_attn_func(
        q, k, v, causal=True, softmax_scale=scaling, group=call.group, layout=call.layout, key_padding_mask=padding,
        window_size=window_size, dropout_p=dropout_p, head_group=call.head_group,
    )  # fmt: skip


def ring_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function interface (registered as ATTN_IMPLEMENTATION).

    query (B, Hq, S, D), key / value (B, Hkv, Sk, D) as transformers passes them (they are
    transposed views here, not copies); attention_mask: what the registered mask function
    returned, a (B, Sk) bool tensor (True = attend) or None. Returns (out (B, S, Hq, D), None)
    in the inputs' dtype (the autocast dtype under torch.autocast, as sdpa).
    """
    call = kwargs.pop(_CTX_KWARG, None)
    if call is None:
        _, world = group_rank_world(None)
        if world > 1:
            raise RuntimeError(
                "ringflash.hf: the attention was called without the decision of the model's forward "
                "pre-hook (attention layers called directly?); call the model prepared by apply()"
            )
        call = _Call(None, "zigzag", ring=False, has_mask=attention_mask is not None, world=1)
    _check_kwargs(module, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        # the ring computes it, but transformers' masks for is_causal=False differ between 5.x versions
        raise _unsupported("bidirectional attention (is_causal=False) is not supported: causal LMs only")

    if attention_mask is not None and not (attention_mask.dim() == 2 and attention_mask.dtype == torch.bool):
        if call.ring:
            raise _unsupported(
                f"a {attention_mask.dim()}-D attention mask of dtype {attention_mask.dtype} is not "
                "supported on the ring: pass the 2D padding mask (batch, seq_len)"
            )
        # a prepared (4D) mask locally: generate() makes one for static caches; transformers' own sdpa is exact
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if call.has_mask and attention_mask is None:
        raise RuntimeError(
            "ringflash.hf: the forward was given an attention_mask but attention received none "
            f"(is the mask function registered for {ATTN_IMPLEMENTATION!r}?); padding would be ignored"
        )

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D) views
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        # as sdpa under autocast: attention in the autocast dtype (RoPE left q, k in float32)
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    padding = None if attention_mask is None else ~attention_mask  # ringflash: True = padded key

    sliding_window = kwargs.get("sliding_window")
    total = call.packed.cu_seqlens[-1] if call.packed is not None else k.shape[1] * call.world
    if call.ring:
        window_size = _window_size(sliding_window, total)
        out = _ring_attention(
            q, k, v, scaling=scaling, call=call, padding=padding, window_size=window_size, dropout_p=dropout
        )
    elif call.packed is not None:  # one process, the whole row: its documents
        cu = torch.tensor(call.packed.cu_seqlens, dtype=torch.int32, device=q.device)
        window_size = _window_size(sliding_window, total)
        out = flash_attn_varlen_func(
            q[0], k[0], v[0], cu, cu, causal=True, softmax_scale=scaling, window_size=window_size, dropout_p=dropout
        )[None]
    else:
        # local: the whole sequence (or, decoding, the cache's keys with the new queries last:
        # flash_attn_func's causal mask and window align bottom-right, as transformers' with a
        # DynamicCache)
        out = flash_attn_func(
            q,
            k,
            v,
            causal=True,
            softmax_scale=scaling,
            key_padding_mask=padding,
            window_size=_window_size(sliding_window, k.shape[1]),
            dropout_p=dropout,
        )
    return out, None


def ring_attention_mask(
    batch_size=None,
    q_length=None,
    kv_length=None,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """transformers' mask-function interface (registered as ATTN_IMPLEMENTATION; called with
    keywords: q_length / q_offset, or cache_position in early 5.x).

    attention_mask: the forward's 2D mask (B, L) as bool (True = real token), or None. Returns
    it covering the keys kv_offset .. kv_offset + kv_length (padded with False past its end,
    as transformers does for caches), or None when no mask was given. It never returns None
    for a given mask, even without padding, so every rank passes a mask to the ring or none
    does. The causal / window structure (mask_function) is not materialized: the attention
    function applies causality by global position and checks the window itself.
    """
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    kv_length = mask.shape[-1] - kv_offset if kv_length is None else kv_length
    if (missing := kv_offset + kv_length - mask.shape[-1]) > 0:
        mask = F.pad(mask, (0, missing), value=False)
    return mask[:, kv_offset : kv_offset + kv_length]


def _register() -> None:
    """Register (idempotently) the attention and mask functions in transformers' global interfaces."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_attention_mask)


# ----------------------------------------------------------------------------- the model


def _forward_params(base) -> list[str]:
    return [
        name
        for name, p in inspect.signature(base.forward).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _sharded_world(group, head_group) -> int:
    """The number of ranks the sequence is sharded over: the group's, times the head group's."""
    return group_rank_world(group)[1] * (1 if head_group is None else group_rank_world(head_group)[1])


def _agree_inputs(kwargs, packed, ids, group, head_group, api, error) -> None:
    """On the ring, the ranks agree on what decides the pre-hook's path (which of
    position_ids, attention_mask and packed documents are given; the sizes _check_not_packed
    reduces over) and on `error`, this rank's input error or None: a rank given position_ids
    alone would otherwise run that check's collectives while the others go on to the ring's,
    and a rank whose input is refused would leave the others waiting. One tiny agreement per
    forward (per group with a head group); under torch.compile, whose graph cannot read it,
    only this rank's error is raised."""
    if torch.compiler.is_compiling():
        if error is not None:
            raise error
        return
    position_ids, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    sized = packed is None  # a balanced layout's shards may differ in length
    fields = {
        "position_ids given": position_ids is not None,
        "attention_mask given": mask is not None,
        "packed documents given": packed is not None,
        "position_ids rows": 0 if position_ids is None else position_ids.shape[0],
        "position_ids length": 0 if position_ids is None or not sized else position_ids.shape[-1],
        "local length": 0 if ids is None or not sized else ids.shape[1],
    }
    agree_across_grid(group, head_group, fields, error, api, device=getattr(ids, "device", None))


def _check_not_packed(position_ids, group, head_group, layout, world, api) -> None:
    """Without an attention mask transformers treats position_ids that do not step by 1 as
    packed documents (a block-diagonal mask). On the ring, position_ids (b, S_local) are this
    rank's part of each row: a row is one document iff position_ids - global index is one
    constant over the whole row, on every rank of the ring (and of the head groups): one tiny
    all_reduce per group (the ranks agreed on the sizes first: _agree_inputs)."""
    S_local = position_ids.shape[-1]
    device = position_ids.device
    idx = local_positions(S_local * world, group=group, head_group=head_group, layout=layout, device=device)
    d = position_ids.to(torch.int64) - idx
    stats = torch.stack([d.amax(-1), -d.amin(-1)], -1)  # per row: max and -min of the offset
    for g in (group, head_group) if head_group is not None else (group,):  # a max over the ring, then the heads
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=resolve_group(g))
    if bool((stats[..., 0] != -stats[..., 1]).any()):
        raise _unsupported(_PACKED)


def _pre_hook(module, args, kwargs):
    """Base model forward pre-hook: decide ring or local for this forward (see module docstring)."""
    state: _Applied = module._ringflash_hf_base
    if _CTX_KWARG in kwargs:
        return None
    api = "ringflash.hf"
    kwargs = dict(kwargs)
    if args:  # positional -> keyword, so every input is seen by name
        kwargs.update(zip(_forward_params(module), args))
    world = _sharded_world(state.group, state.head_group)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # named past_key_values in early 5.x
    # generate() is local on each rank's whole prompt, even when its first forward gets no cache
    ring = world > 1 and cache is None and not state.generating
    mask = kwargs.get("attention_mask")
    packed = kwargs.pop(_PACKED_KWARG, None)

    def check_inputs():
        if packed is not None:  # shard_inputs' packed documents: their positions restart by design
            if not isinstance(packed, _Packed):
                raise TypeError(f"{api}: {_PACKED_KWARG} must come from ringflash.hf.shard_inputs, got {type(packed)}")
            if mask is not None:
                raise _unsupported("an attention_mask together with packed documents is not supported")
            if cache is not None or state.generating:
                raise _unsupported("packed documents with a KV cache (generation) are not supported")
            if packed.layout.world != group_rank_world(state.group)[1]:
                raise ValueError(
                    f"{api}: the packed batch was sharded for a ring of {packed.layout.world} ranks, the model "
                    f"runs on {group_rank_world(state.group)[1]}: shard_inputs and apply must get the same group"
                )
        if not ring:
            return
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
            if kwargs.get(name) is not None:
                raise _unsupported(f"{_PACKED}; got {name}")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise _unsupported(
                f"a {len(getattr(mask, 'shape', ()))}-D attention mask ({type(mask).__name__}) is not "
                "supported on the ring: pass the 2D padding mask (batch, seq_len) of this rank's tokens"
            )

    if ring:
        ids = kwargs.get("input_ids")
        ids = ids if ids is not None else kwargs.get("inputs_embeds")
        try:
            check_inputs()
            error = None
        except INPUT_ERRORS as e:
            error = e
        # every rank takes the same path below, or all raise (this rank's error quoted)
        _agree_inputs(kwargs, packed, ids, state.group, state.head_group, api, error)
        if ids is not None:
            S_local = ids.shape[1]
            if kwargs.get("position_ids") is None:
                # one device uses 0 .. S-1: the global positions of this rank's tokens
                kwargs["position_ids"] = local_positions(
                    S_local * world, group=state.group, head_group=state.head_group, layout=state.layout,
                    device=ids.device,
                ).unsqueeze(0)  # fmt: skip
            elif mask is None and packed is None:
                _check_not_packed(kwargs["position_ids"], state.group, state.head_group, state.layout, world, api)
        # a cache of sharded keys serves no later call; sdpa-equivalence needs none
        kwargs["use_cache"] = False
    else:
        check_inputs()
        if cache is None and mask is None and packed is None and kwargs.get("position_ids") is not None:
            # locally the row is whole: transformers would see packed documents where it steps by
            # other than 1; checked in an operator, which torch.compile keeps in the graph
            kwargs["position_ids"] = _unpacked_positions(kwargs["position_ids"])
    kwargs[_CTX_KWARG] = _Call(
        state.group, state.layout, ring=ring, has_mask=mask is not None, world=world, head_group=state.head_group,
        packed=packed,
    )  # fmt: skip
    return (), kwargs


@torch.library.custom_op(f"{NAMESPACE}::hf_unpacked_positions", mutates_args=())
def _unpacked_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids (b, S) of whole rows, returned (a copy) if every row steps by 1; else the
    packed-sequence NotImplementedError. An operator, so that reading the values does not end
    a torch.compile graph (the check runs when the graph does)."""
    if bool((position_ids.diff(dim=-1) != 1).any()):
        raise _unsupported(_PACKED)
    return position_ids.clone()


@_unpacked_positions.register_fake
def _(position_ids):
    return torch.empty_like(position_ids)


def _check_named_layout(layout, api) -> None:
    check_layout(layout, api)
    if is_balanced(layout):
        raise _unsupported(
            f"a balanced layout as {api}'s layout is not supported: pass layout 'zigzag' or 'contiguous' "
            "(packed documents go to shard_inputs as position_ids or cu_seqlens; it lays them out itself)"
        )


def _check_model(model, api, allow_untested) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"{api}: model must be a transformers PreTrainedModel (apply before wrapping it in DDP/FSDP), "
            f"got {type(model).__name__}"
        )
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise _unsupported(f"encoder-decoder models are not supported (model_type {config.model_type!r})")
    if config.model_type not in MODEL_TYPES and not allow_untested:
        raise _unsupported(
            f"model_type {config.model_type!r} is not among the tested families {MODEL_TYPES}; "
            "pass allow_untested=True to try it (its attention must go through transformers' "
            "AttentionInterface with a causal or padding mask, and RoPE from position_ids)"
        )
    params = inspect.signature(model.loss_function).parameters
    if "shift_labels" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        name = getattr(model.loss_function, "__name__", repr(model.loss_function))
        raise _unsupported(
            f"the model's loss function {name} does not take shift_labels: "
            "labels would be shifted again inside each shard"
        )


def apply(model, *, group=None, layout="zigzag", head_group=None, allow_untested=False):
    """Run `model`'s attention on the ring of `group`, in place; returns the model.

    model: a transformers PreTrainedModel of a tested family (MODEL_TYPES: Llama, Mistral,
    Qwen2), e.g. from AutoModelForCausalLM.from_config / from_pretrained. group: the process
    group of the sequence-parallel ranks (None: the default group), or a DeviceMesh as
    ring_flash_attn_func takes it (2-D: dim 0 the ring, dim 1 the head group). layout:
    "zigzag" (balanced causal work) or "contiguous"; shard_inputs and allreduce_grads must use
    the same group (and head_group) and shard_inputs the same layout.
    head_group: hybrid sequence parallelism (README: Hybrid): the U ranks sharing this rank's
    ring position; the sequence is sharded over the R x U grid and each attention call moves
    heads by all-to-all inside the head group (ring_flash_attn_func(head_group=)). The model's
    num_attention_heads and num_key_value_heads must split over U (ringflash.hybrid.head_plan):
    otherwise a ValueError here, listing the head_group sizes that work.
    A forward runs on the ring when the group (R x U ranks with a head_group) has more than one
    rank, no KV cache is passed in and it is not inside model.generate(); otherwise (no process
    group, world 1, a cache, generate()) attention is local and the input must be the whole
    sequence. Applying again rebinds group, layout and head_group. The backward is bitwise
    reproducible under torch.use_deterministic_algorithms(True) (the attention functions'
    deterministic=True; transformers' enable_full_determinism sets it), otherwise it may take
    the fused Hopper kernel (flash_attn_func's deterministic).
    """
    api = "ringflash.hf.apply"
    _check_named_layout(layout, api)
    group, head_group = resolve_groups(group, head_group, api)
    _check_model(model, api, allow_untested)
    if head_group is not None:
        Hq = getattr(model.config, "num_attention_heads", None)
        if not isinstance(Hq, int):
            raise _unsupported(f"{api}: a head_group needs the model's config.num_attention_heads, got {Hq!r}")
        Hkv = getattr(model.config, "num_key_value_heads", None) or Hq
        head_plan(Hq, Hkv, group_rank_world(head_group)[1], api)  # raises, naming the sizes that work
    if getattr(model, _STATE_ATTR, None) is not None:
        unapply(model)
    _register()
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise _unsupported(
            f"{type(model).__name__} cannot switch its attention implementation "
            f"(it stays {model.config._attn_implementation!r})"
        )
    base = model.base_model
    state = _Applied(group, layout, original, base, head_group)
    base._ringflash_hf_base = state
    base.register_forward_pre_hook(_pre_hook, with_kwargs=True)
    setattr(model, _STATE_ATTR, state)
    if callable(getattr(model, "generate", None)):
        model.generate = _LocalGenerate(model, model.__dict__.get("generate"))  # unapply restores it
    return model


class _LocalGenerate:
    """model.generate while applied: every forward inside it is local (each rank generates from
    its whole prompt), also the first one, which early 5.x and use_cache=False give no cache."""

    def __init__(self, model, previous=None):
        self.model, self.previous = model, previous

    def __call__(self, *args, **kwargs):
        model = self.model
        generate = self.previous or functools.partial(type(model).generate, model)
        state = getattr(model, _STATE_ATTR, None)
        if state is None:
            return generate(*args, **kwargs)
        state.generating += 1
        try:
            return generate(*args, **kwargs)
        finally:
            state.generating -= 1

    def __deepcopy__(self, memo):  # a copy of the model generates with the copy
        return _LocalGenerate(memo.get(id(self.model), self.model), copy.deepcopy(self.previous, memo))


def unapply(model):
    """Undo apply(): the original attention implementation, no hook. Returns the model."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"ringflash.hf.unapply: this {type(model).__name__} was not prepared by ringflash.hf.apply")
    base = state.base
    # by identity, not by a handle: a deepcopy of the model has the hook but its handle would point to
    # the original's hooks
    for key in [k for k, fn in base._forward_pre_hooks.items() if fn is _pre_hook]:
        del base._forward_pre_hooks[key]
        base._forward_pre_hooks_with_kwargs.pop(key, None)
    del base._ringflash_hf_base
    setattr(model, _STATE_ATTR, None)
    generate = model.__dict__.get("generate")
    if isinstance(generate, _LocalGenerate):
        if generate.previous is None:
            del model.generate
        else:
            model.generate = generate.previous
    model.set_attn_implementation(state.original)
    return model


# ----------------------------------------------------------------------------- inputs


def _check_2d(name, t, shape, api, integer=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != tuple(shape)):
        want = f"(batch, seq_len) = {tuple(shape)}" if shape is not None else "(batch, seq_len)"
        raise ValueError(f"{api}: {name} must have shape {want}, got {tuple(t.shape)}")
    if integer and (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"{api}: {name} must be an integer tensor, got {t.dtype}")


def _pad_length(S: int, world: int, layout: str) -> int:
    """How many tokens right-padding makes S divide into the layout's pieces over `world` ranks."""
    parts = world * chunks_per_rank(layout)
    return -S % parts


def shard_inputs(
    input_ids,
    *,
    labels=None,
    attention_mask=None,
    position_ids=None,
    group=None,
    layout="zigzag",
    num_items_in_batch=None,
    pad=False,
    head_group=None,
    cu_seqlens=None,
    sliding_window=None,
):
    """This rank's model inputs for a full batch, for a model prepared by apply().

    input_ids: (B, S) integer, the whole batch, the same on every rank of `group`.
    labels: (B, S) integer, transformers' usual unshifted labels (-100 = not counted);
      None: next-token labels from input_ids with padding positions ignored.
    attention_mask: (B, S), 1 / True = real token, 0 = padding (left or right), or None.
    position_ids: (B, S) or (1, S), or None: 0 .. S-1 on every row, as the model itself uses
      when given none (transformers' forward does not derive them from the attention mask;
      pass e.g. (attention_mask.cumsum(-1) - 1).clamp(min=0) for generate()'s convention).
      Without an attention mask, positions that restart inside the row (as
      DataCollatorWithFlattening makes: a new document wherever they do not step by 1, as
      transformers reads them) mean packed documents; see cu_seqlens.
    cu_seqlens: packed documents in a batch of one row (B = 1, no attention_mask): the
      document boundaries, a sequence of ints or an int tensor starting at 0 and ending at S
      (None: from restarting position_ids, if any). Each token attends only within its
      document (ring_flash_attn_varlen_func), the documents laid out over the ring by
      balanced_layout(cu_seqlens, R) (layout= and pad= then play no part); position_ids
      default to each token's position within its document; labels=None gives next-token
      labels that never cross a document boundary (each document's first token is not
      predicted, as DataCollatorWithFlattening's labels).
    sliding_window: packed documents for a model whose every layer slides (transformers'
      config.sliding_window, e.g. Mistral's): the layout is balanced for that window (fewer
      documents cut, K/V sent to neighbours only) instead of for causal attention. Either is
      exact: each layer applies its own mask; this only decides which rank holds what.
    num_items_in_batch: the loss's denominator; None: the number of label tokens of this
      batch. Pass the total over all micro-batches / data-parallel batches that one optimizer
      step averages over (see README: data parallelism).
    pad: right-pad S to the next length the layout divides (2 * world for zigzag, world for
      contiguous; world = R x U with a head_group) with attention_mask 0 and ignored labels,
      which changes no loss or gradient; False: such an S raises ValueError naming the lengths
      that work.
    group, layout, head_group: as given to apply() (a 2-D DeviceMesh as group too); with a
      head_group the tokens are sharded over the R x U grid exactly as ringflash.shard(...,
      head_group=) and local_positions(..., head_group=) do.

    Returns a dict of keyword arguments for model(**batch): input_ids, position_ids (global
    positions of this rank's tokens, so RoPE is right), attention_mask (if given), labels and
    shift_labels (both the labels shifted on the whole sequence, then sharded: transformers
    computes the loss when labels is not None and uses shift_labels without shifting again),
    num_items_in_batch (int64 0-dim tensor) and use_cache=False; each (B, S / P) tensor is
    this rank's shard (P = R x U with a head_group). The out.loss values of all P ranks add up
    to the one-device loss. Packed documents: the shards are the balanced layout's (their
    lengths may differ between ranks), and the batch also holds "ringflash_packed" (the
    documents and their layout, read by the model's pre-hook; no attention_mask).
    """
    api = "ringflash.hf.shard_inputs"
    _check_named_layout(layout, api)
    _check_sliding_window(sliding_window, api)
    check_bool("pad", pad, api)
    group, head_group = resolve_groups(group, head_group, api)
    _check_2d("input_ids", input_ids, None, api)
    B, S = input_ids.shape
    device = input_ids.device
    if attention_mask is not None:
        _check_2d("attention_mask", attention_mask, (B, S), api, integer=False)
        attention_mask = attention_mask.to(device)
    if labels is not None:
        _check_2d("labels", labels, (B, S), api)
        labels = labels.to(device)
    if position_ids is not None:
        if (
            not isinstance(position_ids, torch.Tensor)
            or position_ids.dim() != 2
            or position_ids.shape[1] != S
            or position_ids.shape[0] not in (1, B)
        ):
            got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise ValueError(f"{api}: position_ids must have shape ({B}, {S}) or (1, {S}), got {got}")
        if position_ids.is_floating_point() or position_ids.is_complex():
            raise TypeError(f"{api}: position_ids must be an integer tensor, got {position_ids.dtype}")
        position_ids = position_ids.to(device)
    packed = None
    if cu_seqlens is not None or (attention_mask is None and position_ids is not None and _restarts(position_ids)):
        window = _window_size(sliding_window, S)
        packed, position_ids = _packed_documents(
            cu_seqlens, position_ids, attention_mask, B, S, group, api, device, window
        )
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        if packed is not None:  # no prediction across a document boundary
            starts = torch.tensor(packed.cu_seqlens[1:-1], dtype=torch.long, device=device)
            labels = labels.index_fill(1, starts[starts < S], IGNORE_INDEX)
    # the whole sequence is shifted before sharding: token i predicts label i + 1, even across shards
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if num_items_in_batch is None:
        num_items_in_batch = (shift_labels != IGNORE_INDEX).sum()
    elif not isinstance(num_items_in_batch, torch.Tensor):
        if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, int) or num_items_in_batch < 1:
            raise ValueError(
                f"{api}: num_items_in_batch must be a positive int or a tensor, got {num_items_in_batch!r}"
            )
        num_items_in_batch = torch.tensor(num_items_in_batch, device=device)

    if packed is not None:
        sh = lambda t: shard(t, group=group, head_group=head_group, layout=packed.layout, dim=1).contiguous()
        local_labels = sh(shift_labels)
        return {
            "input_ids": sh(input_ids),
            "position_ids": sh(position_ids),
            "labels": local_labels,
            "shift_labels": local_labels,
            "num_items_in_batch": num_items_in_batch,
            "use_cache": False,
            _PACKED_KWARG: packed,
        }
    world = _sharded_world(group, head_group)
    extra = _pad_length(S, world, layout)
    if extra and not pad:
        check_divisible(S, world, layout, api)  # raises, naming the lengths that would do
    if extra:
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.int64, device=device)
        input_ids = F.pad(input_ids, (0, extra), value=0)
        attention_mask = F.pad(attention_mask, (0, extra), value=0)
        shift_labels = F.pad(shift_labels, (0, extra), value=IGNORE_INDEX)
        if position_ids is not None:
            step = position_ids[:, -1:] + torch.arange(1, extra + 1, device=device)
            position_ids = torch.cat([position_ids, step], dim=1)
        S += extra

    # contiguous: the loss views labels flat, and a contiguous layout's shard is a strided view
    sh = lambda t: shard(t, group=group, head_group=head_group, layout=layout, dim=1).contiguous()
    if position_ids is None:
        local_pos = local_positions(S, group=group, head_group=head_group, layout=layout, device=device).unsqueeze(0)
    else:
        local_pos = sh(position_ids)
    local_labels = sh(shift_labels)
    batch = {
        "input_ids": sh(input_ids),
        "position_ids": local_pos,
        "labels": local_labels,
        "shift_labels": local_labels,
        "num_items_in_batch": num_items_in_batch,
        "use_cache": False,
    }
    if attention_mask is not None:
        batch["attention_mask"] = sh(attention_mask)
    return batch


def _restarts(position_ids: torch.Tensor) -> bool:
    """Some row's positions do not step by 1 (transformers reads packed documents there)."""
    return bool((position_ids.diff(dim=-1) != 1).any())


def _check_sliding_window(sliding_window, api):
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"{api}: sliding_window must be None or a positive int, got {sliding_window!r}")


def _packed_documents(cu_seqlens, position_ids, attention_mask, B, S, group, api, device, window_size=(-1, -1)):
    """shard_inputs' packed documents: (_Packed, position_ids (1, S)) from cu_seqlens or from
    restarting position_ids (a new document wherever they do not step by 1, as transformers'
    find_packed_sequence_indices reads them), checked against each other when both are given;
    the layout balanced for causal attention within window_size (flash-attn's)."""
    if B != 1:
        raise _unsupported(f"packed documents in a batch of {B} rows are not supported: pack them into one row")
    if attention_mask is not None:
        raise _unsupported("an attention_mask together with packed documents is not supported")
    from_positions = None
    if position_ids is not None:
        steps = position_ids[0].diff() != 1
        from_positions = [0] + (torch.nonzero(steps).flatten() + 1).tolist() + [S]
    if cu_seqlens is None:
        cu = from_positions
    else:
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
                raise TypeError(f"{api}: cu_seqlens must be a 1-D int tensor, got {cu_seqlens.dtype} "
                                f"{tuple(cu_seqlens.shape)}")  # fmt: skip
            cu_seqlens = cu_seqlens.tolist()
        cu = list(cu_seqlens)
        if not cu or cu[-1] != S:
            raise ValueError(f"{api}: cu_seqlens must end at the sequence length {S}, got {cu[-4:]}")
        nonempty = sorted(set(cu))
        if from_positions is not None and from_positions != nonempty:
            raise ValueError(
                f"{api}: position_ids restart at {from_positions[1:-1][:8]} but cu_seqlens has documents "
                f"starting at {nonempty[1:-1][:8]}: one process would see other documents"
            )
    layout = balanced_layout(cu, group_rank_world(group)[1], causal=True, window_size=window_size)  # checks cu
    if position_ids is None:  # each token's position in its document
        position_ids = layout.document_positions(torch.arange(S, device=device))[None]
    return _Packed(tuple(cu), layout), position_ids


# ----------------------------------------------------------------------------- gradients


def allreduce_grads(model, group=None, *, head_group=None, bucket_mb: float = 256.0) -> None:
    """Sum every parameter's gradient over the ranks of `group` (None: the default group) and,
    with a head_group, over those of `head_group` as well, in place. Pass what apply() was given.

    Each rank's gradients are the gradients of its own part of the loss (the ring already
    brought the attention's dK/dV home), so the SUM, not DDP's average, is the gradient one
    device computes for the whole batch. With a head_group (hybrid: group the ring of R ranks,
    head_group the U ranks at its ring position, or a 2-D DeviceMesh as group) every rank of
    the R x U grid holds different tokens: the sum runs over the ring, then over the head
    group, i.e. over all R x U ranks. A model applied by apply() checks that the ranks summed
    over include its own ring and head group (group alone, without the head_group its model
    was applied with, would leave each rank part of the gradient): otherwise a ValueError, on
    every rank that takes part, before any gradient is changed; so do ranks whose trainable
    parameters differ in number, shapes or dtypes (one small all_gather per call).
    A parameter whose gradient is None on some ranks and not on others counts as zero where it
    is None; None on every rank stays None. Gradients are reduced in flat buckets of about
    `bucket_mb` MiB per (device, dtype). No-op without a process group or with one rank.

    With data parallelism as well (a DP x SP mesh: apply / shard_inputs / allreduce_grads on the
    SP group, or SP grid with its head_group, a different batch per SP group), average over the
    DP group afterwards (or let DDP on the DP group do it): the DP mean of one-device gradients.
    DDP or FSDP over ALL ranks instead averages over SP ranks too: then skip this function and
    backpropagate out.loss * sp_size (R x U with a head_group). For a token-weighted mean over
    DP, pass shard_inputs the label count summed over the DP group as num_items_in_batch and
    sum over DP instead of averaging.
    """
    api = "ringflash.hf.allreduce_grads"
    # groups this rank cannot use: their error agreed over `group` as the others' (below)
    group, head_group, error = resolve_groups_or_error(group, head_group, api)
    error = error or _check_reduction_covers(model, group, head_group, api)
    if _sharded_world(group, head_group) == 1:
        if error is not None:
            raise error
        return
    pgs = [resolve_group(g) for g in ((group,) if head_group is None else (group, head_group))]
    params = [p for p in model.parameters() if p.requires_grad]
    layouts = {p.grad.layout for p in params if p.grad is not None} - {torch.strided}
    if error is None and layouts:
        error = _unsupported(f"{api}: a sparse or non-strided gradient ({layouts.pop()}) is not supported")
    # every rank raises if one rank's check failed, or if the ranks' trainable parameters differ
    # (a layer frozen on one rank alone): the buckets below must be the same on every rank
    shapes = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
    fields = {
        "trainable parameters": len(params),
        "their shapes and dtypes (a digest)": int.from_bytes(hashlib.sha256(shapes).digest()[:7], "little"),
    }
    device = params[0].device if params else None
    agree_across_grid(group, head_group, fields, error, api, device=device)
    if not params:
        return
    # ranks agree on which gradients exist, so every rank reduces the same buckets
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    for pg in pgs:
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=pg)
    present = []
    for p, h in zip(params, has):
        if h:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            present.append(p.grad)
    limit = max(1, int(bucket_mb * 2**20))
    by_kind: dict = {}
    for g in present:  # insertion order follows the parameters: the same on every rank
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for grads in by_kind.values():
        bucket, size = [], 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if bucket and size + nbytes > limit:
                _reduce_bucket(bucket, pgs)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            _reduce_bucket(bucket, pgs)


def _group_ranks(group) -> set[int]:
    return set(dist.get_process_group_ranks(resolve_group(group)))


def _check_reduction_covers(model, group, head_group, api):
    """The ValueError to raise (or None) when a model prepared by apply() would have its
    gradients summed over ranks that leave out some of those it was applied with: each of
    them holds other tokens, whose part of the gradient would be missing."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None or not (dist.is_available() and dist.is_initialized()):
        return None
    need = _group_ranks(state.group) | (set() if state.head_group is None else _group_ranks(state.head_group))
    have = _group_ranks(group) | (set() if head_group is None else _group_ranks(head_group))
    if not (missing := sorted(need - have)):
        return None
    applied = "group" + (" and head_group" if state.head_group is not None else "")
    given = "group" + (" and head_group" if head_group is not None else "")
    return ValueError(
        f"{api}: the model was applied with a {applied} of global ranks {sorted(need)}, but the {given} given "
        f"leave out rank(s) {missing}, whose tokens' part of the gradient would be missing; pass the group "
        "and head_group given to apply()"
    )


def _reduce_bucket(grads, pgs) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    for pg in pgs:  # the ring's sum, then the head group's: the sum over the grid
        dist.all_reduce(flat, group=pg)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


__all__ = [
    "apply",
    "unapply",
    "shard_inputs",
    "allreduce_grads",
    "ring_attention_forward",
    "ring_attention_mask",
    "ATTN_IMPLEMENTATION",
    "MODEL_TYPES",
]
