"""RingMultiheadAttention: a drop-in for torch.nn.MultiheadAttention whose attention runs on
the ring. The module never calls torch.distributed itself; ring_flash_attn_func does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    AttnDims,
    check_bool,
    check_tensor,
    key_bias_from_mask,
    resolve_scale,
)
from .comm import (
    INPUT_ERRORS,
    agree_across_grid,
    check_group_types,
    group_rank_world,
    is_mesh,
    resolve_groups,
    resolve_groups_or_error,
)
from .dense import dense_attention, gather_sequence, pair_bias
from .dropout import seed_tensor
from .layout import local_positions
from .local import flash_attn_func, flash_attn_varlen_func
from .merge import merge_attn_states, state_dtype
from .ops import shapes_only
from .ring import CALLER_FIELDS, _agreed_names, _ring_flash_attn
from .schedule import check_named_layout
from .weights import attention_weights


class RingMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention with the same constructor, parameters (state_dict loads both
    ways) and forward signature, for sequences sharded over the ranks of `group`.

    Inputs are this rank's shard of each sequence, in the module's layout: (B, L_local, E)
    with batch_first=True, else (L_local, B, E); unbatched (L_local, E) works too. Keys and
    values are sharded the same way as their own sequence (see ringflash.shard). The output
    is this rank's shard. group, layout, grad_accum_dtype, head_group and deterministic
    (keyword-only) are passed to ring_flash_attn_func (with a head_group, inputs are sharded over R x U ranks as
    ringflash.shard(..., head_group=) does, and num_heads must split over the head group). group
    may be a DeviceMesh as there: 1-D, or 2-D (ring dim, head dim) without head_group; the
    module keeps its process groups (self.group, self.head_group).

    need_weights=True (torch's default) also returns the attention weights of this rank's
    queries over every key of the sequence, keys in global (unsharded) order: (B, L_local, S)
    averaged over heads, or (B, num_heads, L_local, S) with average_attn_weights=False
    ((L_local, S) / (num_heads, L_local, S) unbatched), in the inputs' dtype. They are
    computed in a second pass from the attention's final lse and cost B x num_heads x
    L_local x S memory (twice, in float32, while being made); on more than one rank every
    rank gathers all keys (their gradients are summed back to the owners) and all ranks must
    pass the same need_weights (else all raise, compiled too).
    need_weights=False is the fast path: nothing of that size is made. Any head dim
    embed_dim / num_heads from 1 to 256; empty inputs give empty outputs; a bias of another
    dtype than its weight is promoted as torch's `+` does.

    Supported: self- and cross-attention, kdim/vdim, is_causal=True (attn_mask None or the
    causal mask as a hint; self-attention only), key_padding_mask of this
    rank's keys (bool: True = padding, or float: added to the scores).
    A query whose keys are all padded gets output 0 (torch gives NaN).
    attn_mask as torch documents it: bool (True: may not attend) or float (added to the
    scores), (L, S) or (B * num_heads, L, S), added to key_padding_mask as torch does. Each
    rank passes the rows of its own queries (L = L_local, in local order, as its query
    shard) over all S keys of the sequence in global (unsharded) order: e.g.
    shard(full_mask, dim=0) for a 2-D mask, dim=1 for a 3-D one; every rank must pass one or
    none (else all raise, compiled too). This is the exact, slower path:
    it materializes the (B, num_heads, L_local, S) scores and, on more than one rank, gathers
    all keys and values on every rank. With
    is_causal=True an attn_mask is taken as the causal hint (checked) and the fast path runs.
    add_bias_kv / add_zero_attn: torch appends their keys at the end of the sequence, seen by
    every query; here every rank holds them (parameters are replicated, the zero key is
    zero) and folds them into its own queries' state with the lse merge after the ring, so
    nothing more travels; their weight columns come last, as torch's. Their parameters'
    gradients on a rank cover that rank's queries (summed over ranks as any parameter's).
    dropout > 0 in training mode: attention dropout whose keep mask is a pure function of
    (seed, batch, head, global query index, global key index) (ringflash.dropout), so one
    device and any number of ranks and layouts drop exactly the same pairs; the seed is
    drawn from torch's default CPU generator per call (rank 0's is used by all), so
    torch.manual_seed reproduces a run. With need_weights=False it runs in the kernels
    (ring_flash_attn_func's dropout_p); with need_weights=True, or add_bias_kv / add_zero_attn,
    on the exact dense path (as an arbitrary attn_mask: B x num_heads x L_local x S memory, all
    keys gathered), which draws the same keep mask; the weights returned are the dropped ones,
    as torch's. Nested tensors, jagged or strided (batch_first, one rank,
    no masks): the sequences run as packed documents (flash_attn_varlen_func); weights are not
    returned.
    Not supported (NotImplementedError naming the argument): nested tensors on the ring; TorchScript
    (torch.jit.script) neither. Arguments that can never work (embed_dim not divisible by
    num_heads, more than 256 per head, a dropout outside [0, 1]) raise a ValueError when the
    module is built.
    """

    deterministic = False  # modules pickled before the argument existed

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
        *,
        group=None,
        layout="zigzag",
        grad_accum_dtype=None,
        head_group=None,
        deterministic=False,
    ):
        _check_construction(embed_dim, num_heads, dropout, kdim, vdim, grad_accum_dtype)
        check_bool("deterministic", deterministic, "RingMultiheadAttention")
        check_named_layout(layout, "RingMultiheadAttention")
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )
        check_group_types(group, head_group, "RingMultiheadAttention")
        if is_mesh(group) or is_mesh(head_group):  # the process groups the functions would take from it
            group, head_group = resolve_groups(group, head_group, "RingMultiheadAttention")
        self.group = group
        self.head_group = head_group
        self.layout = layout
        self.grad_accum_dtype = grad_accum_dtype
        self.deterministic = deterministic
        # torch's TransformerEncoderLayer has a fused inference fast path that reads these
        # weights and runs local attention itself, bypassing forward(); an attached hook is one
        # of the conditions that turns it off, on every torch version that has it.
        self.register_forward_pre_hook(_no_fast_path)

    def _projections(self):
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.split(E)
        return (w_q, b[0]), (w_k, b[1]), (w_v, b[2])

    def _check_projected(self, key, value, query, api):
        """What F.linear would refuse in the projections with a RuntimeError that one rank alone
        raises while the others wait in the ring: key / value sizes, an input's dtype (outside
        autocast) or device other than its weight's. Raised as input errors, agreed."""
        for name, x, (w, _), size in zip(
            ("query", "key", "value"), (query, key, value), self._projections(), (self.embed_dim, self.kdim, self.vdim)
        ):
            if x.shape[-1] != size:
                if name == "query":  # torch's words
                    raise InputError(f"{api}: was expecting embedding dimension of {size}, but got {x.shape[-1]}")
                raise InputError(f"{api}: {name} has embedding dimension {x.shape[-1]}, expected {size}")
            if x.device != w.device:
                raise ProjectionTypeError(f"{api}: {name} is on {x.device}, the module's weights on {w.device}")
            if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
                raise ProjectionTypeError(
                    f"{api}: {name} has dtype {x.dtype}, the module's weights {w.dtype} (F.linear refuses them)"
                )

    def _heads(self, query, key, value):
        """The projected q, k, v of (..., E*) inputs, as (..., num_heads, head_dim)."""
        heads = (self.num_heads, self.head_dim)
        return [_linear(x, w, b).unflatten(-1, heads) for x, (w, b) in zip((query, key, value), self._projections())]

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        api = "RingMultiheadAttention"
        if any(getattr(t, "is_nested", False) for t in (query, key, value)):
            return self._nested(query, key, value, key_padding_mask, attn_mask, is_causal, api)
        try:
            for name, t in (("query", query), ("key", key), ("value", value)):
                check_tensor(name, t, api)
            for name, t in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
                if t is not None:
                    check_tensor(name, t, api)
            check_bool("is_causal", is_causal, api)
            if self.training:  # the attribute is public: a schedule may have set it since construction
                _check_dropout(self.dropout, api)
            unbatched = not _batched(query, key, value, key_padding_mask, attn_mask, self.num_heads, api)
            self._check_projected(key, value, query, api)
            if unbatched:
                query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # (L, 1, E)
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.unsqueeze(0)
            if not self.batch_first or unbatched:  # (L, B, E) -> (B, L, E)
                query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            if attn_mask is not None and is_causal:  # the causal mask as a hint: the fast path
                _check_causal_hint(attn_mask, query.shape[1], api)
                attn_mask = None
        except INPUT_ERRORS as error:
            self._raise_together(error, query)
        out, weights = self._attention(query, key, value, key_padding_mask, attn_mask, is_causal, need_weights)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _attention(self, query, key, value, key_padding_mask, attn_mask, is_causal, need_weights):
        """(B, L, E) inputs -> (B, L, E) output, and with need_weights the weights
        (B, H, L, S) of these queries over all S keys (ringflash.weights), else None. An
        attn_mask takes the exact dense path (ringflash.dense)."""
        api = "RingMultiheadAttention"
        B, L, E = query.shape
        H, hd = self.num_heads, self.head_dim
        try:
            q, k, v = self._heads(query, key, value)
            scale = resolve_scale(None, hd, api)
            extra = self._extra_kv(B, q.dtype)
            dropping = self.dropout > 0.0 and self.training
            if self.head_group is not None and (attn_mask is not None or need_weights or extra is not None):
                raise NotImplementedError(
                    f"{api}: with a head_group, attn_mask, need_weights=True, add_bias_kv and add_zero_attn are not "
                    "supported yet (pass need_weights=False)"
                )
            # the mask's checks before the ranks agree: a bad mask on one rank raises on all
            S = k.shape[1] * group_rank_world(self.group)[1]
            acc = state_dtype(q.dtype)
            mask_bias = None if attn_mask is None else pair_bias(attn_mask, B, H, L, S, q.device, acc, api)
        except INPUT_ERRORS as error:
            self._raise_together(error, query)
        ring = dict(
            causal=is_causal, softmax_scale=None, window_size=(-1, -1), group=self.group, layout=self.layout,
            key_padding_mask=key_padding_mask, return_lse=True, grad_accum_dtype=self.grad_accum_dtype,
            grad_chunks=None, head_group=self.head_group, dropout_p=float(self.dropout) if dropping else 0.0,
            generator=None, deterministic=self.deterministic, api=api,
            # what picks the path below and the collectives after the ring, agreed in the ring's
            # one check before any rank goes its way (else ranks wait in different collectives)
            caller_fields=dict(
                zip(
                    CALLER_FIELDS,
                    (int(attn_mask is not None), int(bool(need_weights)), 0 if extra is None else extra[0].shape[1]),
                )
            ),
        )  # fmt: skip
        # dropout runs in the kernels; the weights it drops (need_weights) and the extra keys'
        # dropped columns come from the dense path, which draws the same keep mask
        if attn_mask is not None or (dropping and (need_weights or extra is not None)):
            seed = None
            if group_rank_world(self.group)[1] > 1:  # one rank: nothing to agree on
                # the dense path's collectives take k, v and the padding mask from the check
                # (compiled, it runs in an operator then: else nothing orders them after it)
                k, v, key_padding_mask, seed = _ring_flash_attn(q, k, v, **ring, agree_only=(k, v, key_padding_mask))
            o, weights = self._masked_attention(q, k, v, key_padding_mask, mask_bias, is_causal, extra, scale, seed)
            return self._out(o), (weights if need_weights else None)
        o, lse = _ring_flash_attn(q, k, v, **ring)
        if extra is not None:  # seen by every query: one more block, folded in with the lse merge
            o_x, lse_x = flash_attn_func(
                q, *extra, softmax_scale=scale, return_lse=True, deterministic=self.deterministic
            )
            o, lse = merge_attn_states(o, lse, o_x, lse_x)
            o = o.to(q.dtype)
        weights = None
        if need_weights:
            dims = AttnDims(B, L, k.shape[1], H, H, hd, hd)
            bias = key_bias_from_mask(key_padding_mask, dims, q.device, api, lse.dtype)
            weights = attention_weights(
                q, k, lse, scale=scale, causal=is_causal, key_bias=bias, group=self.group, layout=self.layout
            )
            if extra is not None:  # their columns come last, as in torch
                weights = torch.cat([weights, attention_weights(q, extra[0], lse, scale=scale, local=True)], -1)
        return self._out(o), weights

    def _nested(self, query, key, value, key_padding_mask, attn_mask, is_causal, api):
        """Nested tensors (B, j, E), jagged or strided (nn.TransformerEncoder makes strided ones
        from a padding mask), batch_first, one rank: the sequences packed as documents
        (flash_attn_varlen_func), every query seeing its own sequence's keys. Returns (a nested
        output of query's layout, None): no weights, as torch's nested fast path."""
        if query.dim() != 3:  # an empty nested tensor is 1-D: torch's words
            raise InputError(
                f"{api}: query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor"
            )
        if not all(getattr(t, "is_nested", False) for t in (query, key, value)):
            raise NotImplementedError(f"{api}: nested tensors must be all of query, key and value")
        if not self.batch_first:
            raise ValueError(f"{api}: nested tensors need batch_first=True, as torch's")
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError(f"{api}: nested tensors take no key_padding_mask or attn_mask (their lengths mask)")
        if group_rank_world(self.group)[1] > 1 or self.head_group is not None:
            raise NotImplementedError(
                f"{api}: nested tensors on the ring are not supported: pass the packed documents to "
                "ringflash.ring_flash_attn_varlen_func"
            )
        (q_rows, cu_q), (k_rows, cu_k), (v_rows, cu_v) = (_packed(t) for t in (query, key, value))
        # one tensor, or shared offsets, need no look at the values (data: a compiled graph
        # would break on it); distinct offsets are compared
        if key is not value and cu_k is not cu_v and not torch.equal(cu_k, cu_v):
            raise ValueError(f"{api}: key and value must hold sequences of the same lengths")
        if cu_q.numel() != cu_k.numel():
            raise ValueError(f"{api}: query holds {cu_q.numel() - 1} sequences, key {cu_k.numel() - 1}")
        hd = self.head_dim
        q, k, v = self._heads(q_rows, k_rows, v_rows)
        dropping = self.dropout > 0.0 and self.training
        extra = self._extra_kv(1, q.dtype)
        if dropping and extra is not None:
            raise NotImplementedError(f"{api}: nested tensors with dropout and add_bias_kv / add_zero_attn")
        o, lse = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            causal=is_causal,
            return_lse=True,
            dropout_p=float(self.dropout) if dropping else 0.0,
            deterministic=self.deterministic,
        )
        if extra is not None:  # seen by every query, folded in with the lse merge (see _extra_kv)
            o_x, lse_x = flash_attn_func(
                q[None], *extra, softmax_scale=resolve_scale(None, hd, api), return_lse=True,
                deterministic=self.deterministic,
            )  # fmt: skip
            o, lse = merge_attn_states(o[None], lse[None], o_x, lse_x)
            o = o[0].to(q.dtype)
        out = _linear(o.reshape(-1, self.embed_dim), self.out_proj.weight, self.out_proj.bias)
        if query.layout == torch.jagged:
            return torch.nested.nested_tensor_from_jagged(out, offsets=cu_q), None
        return torch.nested.as_nested_tensor(list(out.split(cu_q.diff().tolist()))), None

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module it scripts: a clear error, not TorchScript's
        raise NotImplementedError(
            "RingMultiheadAttention: TorchScript (torch.jit.script) is not supported; torch.compile is"
        )

    def _out(self, o):
        B, L = o.shape[:2]
        return _linear(o.reshape(B, L, self.embed_dim), self.out_proj.weight, self.out_proj.bias)

    def _extra_kv(self, B, dtype):
        """add_bias_kv's learned key/value and add_zero_attn's zero key/value, in torch's order,
        as (k, v) (B, n, H, head_dim) of `dtype`, or None. torch appends them at the end of the
        sequence; here every rank holds them (parameters are replicated) and every query sees
        them, so they are one more block each rank folds into its own queries' state."""
        H, hd = self.num_heads, self.head_dim
        ks, vs = [], []
        if self.bias_k is not None:
            ks.append(self.bias_k.to(dtype).view(1, 1, H, hd).expand(B, 1, H, hd))
            vs.append(self.bias_v.to(dtype).view(1, 1, H, hd).expand(B, 1, H, hd))
        if self.add_zero_attn:
            ks.append(torch.zeros(B, 1, H, hd, dtype=dtype, device=self.out_proj.weight.device))
            vs.append(ks[-1])
        return (torch.cat(ks, 1), torch.cat(vs, 1)) if ks else None

    def _raise_together(self, error, like) -> None:
        """Raise `error`, found in this rank's own input before the ranks agree, on every rank:
        on several ranks (eager) this rank first takes part in the one check the other ranks'
        calls run (ring._ring_flash_attn's, with this module's fields; with a head group the
        grid's), so that they raise too rather than wait for it in a collective (with groups
        this rank cannot use: over the group it would carry that error over,
        comm.resolve_groups_or_error). like: the query (its device carries the check)."""
        if not torch.compiler.is_compiling():
            api, device = "RingMultiheadAttention", getattr(like, "device", None)
            try:
                group, head_group, _ = resolve_groups_or_error(self.group, self.head_group, api)
            except INPUT_ERRORS:  # no group to agree over: this rank's own error, here
                raise error from None
            fields = dict.fromkeys(_agreed_names(CALLER_FIELDS), 0)
            if head_group is not None or group_rank_world(group)[1] > 1:
                agree_across_grid(group, head_group, fields, error, api, device=device)
        raise error

    def _masked_attention(self, q, k, v, key_padding_mask, mask_bias, is_causal, extra, scale, seed=None):
        """The dense path: an arbitrary attn_mask (mask_bias: dense.pair_bias's bias of it, or
        None), this rank's query rows over all keys in
        global order, (L_local, S) or (B * H, L_local, S), combined with key_padding_mask by
        adding both as biases, as torch does; or attention dropout in training (a keep mask
        of global query and key indices: ringflash.dropout). Exact, and materializes the
        (B, H, L_local, S) scores. seed: the dropout seed the ranks agreed on (an int64 scalar
        tensor), or None: one drawn here (one rank, or dropout 1, which keeps no pair)."""
        api = "RingMultiheadAttention"
        B, L, H, hd = q.shape
        _, world = group_rank_world(self.group)
        acc = state_dtype(q.dtype)
        S = k.shape[1] * world
        # one rank: every layout is the identity (and L need not divide into its chunks)
        q_idx = torch.arange(L) if world == 1 else local_positions(L * world, group=self.group, layout=self.layout)
        if mask_bias is not None:
            bias = mask_bias
        elif is_causal:
            if L * world != S:
                raise ValueError(f"{api}: is_causal=True needs as many queries as keys, got {L * world} and {S}")
            future = torch.arange(S, device=q.device)[None, :] > q_idx.to(q.device)[:, None]
            bias = torch.zeros(1, 1, L, S, dtype=acc, device=q.device).masked_fill_(future, float("-inf"))
        else:
            bias = torch.zeros(1, 1, L, S, dtype=acc, device=q.device)
        if key_padding_mask is not None:
            dims = AttnDims(B, L, k.shape[1], H, H, hd, hd)
            key_bias = key_bias_from_mask(key_padding_mask, dims, q.device, api, acc)
            bias = bias + gather_sequence(key_bias, group=self.group, layout=self.layout)[:, None, None, :]
        if extra is not None:  # visible to every query, as torch pads both masks for them
            bias = torch.cat([bias.expand(-1, -1, L, S), bias.new_zeros(*bias.shape[:2], L, extra[0].shape[1])], -1)
        dropout = None
        if self.dropout > 0.0 and self.training:
            dropout = (seed_tensor() if seed is None else seed, float(self.dropout), q_idx)
        return dense_attention(
            q, k, v, bias, scale=scale, group=self.group, layout=self.layout, extra_kv=extra, dropout=dropout
        )


def _packed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A nested tensor (B, j, E), jagged or strided, as its rows packed (total, E) and the
    int64 offsets (B + 1,) of its sequences."""
    if t.layout == torch.jagged:
        return t.values(), t.offsets()
    parts = t.unbind()
    lengths = torch.tensor([0] + [p.shape[0] for p in parts], device=t.device)
    return torch.cat(parts), lengths.cumsum(0)


class InputError(ValueError, AssertionError):
    """Inputs of the wrong rank or shape: a ValueError, and an AssertionError with
    nn.MultiheadAttention's own wording, as torch raises for the same inputs (code written
    against torch's class catches it the same way)."""


class ProjectionTypeError(TypeError, RuntimeError):
    """An input the projections cannot take (dtype or device other than the weight's): a
    TypeError, and the RuntimeError F.linear raises for it in torch's module."""


def _batched(query, key, value, key_padding_mask, attn_mask, num_heads, api) -> bool:
    """Whether the inputs are batched (3-D query) or not (2-D), with torch's checks of the
    ranks and of an unbatched 3-D attn_mask's shape, in torch's words (InputError)."""

    def fail(message):
        raise InputError(f"{api}: {message}")

    dims = lambda t: None if t is None else t.dim()  # noqa: E731
    if query.dim() not in (2, 3):
        fail(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query tensor")
    batched = query.dim() == 3
    kind = "For batched (3-D) `query`" if batched else "For unbatched (2-D) `query`"
    if key.dim() != query.dim() or value.dim() != query.dim():
        fail(f"{kind}, expected `key` and `value` to be {query.dim()}-D but found {key.dim()}-D and "
             f"{value.dim()}-D tensors respectively")  # fmt: skip
    if dims(key_padding_mask) not in (None, query.dim() - 1):
        fail(f"{kind}, expected `key_padding_mask` to be `None` or {query.dim() - 1}-D but found "
             f"{key_padding_mask.dim()}-D tensor instead")  # fmt: skip
    if dims(attn_mask) not in (None, 2, 3):
        fail(f"{kind}, expected `attn_mask` to be `None`, 2-D or 3-D but found {attn_mask.dim()}-D tensor instead")
    if not batched and dims(attn_mask) == 3:
        expected = (num_heads, query.shape[0], key.shape[0])
        if attn_mask.shape != expected:
            fail(f"Expected `attn_mask` shape to be {expected} but got {attn_mask.shape}")
    return batched


def _linear(x, w, b):
    """F.linear of x (..., in) by w (out, in) and b (out,): (..., out). A bias of another dtype
    is promoted as torch's `+` does: some of F.linear's paths refuse such a bias, and
    nn.MultiheadAttention (which reaches them only with some layouts) returns the promoted
    result. A weight of another dtype than x fails as in torch. Under autocast F.linear casts
    all three itself, and its dtype is torch's (a float32 bias added after would promote)."""
    if b is None or b.dtype == x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, w, b)
    return F.linear(x, w) + b


def _positive_int(name, value, api):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{api}: {name} must be a positive int, got {value!r}")


def _check_dropout(dropout, api):
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout <= 1.0:
        raise ValueError(f"{api}: dropout must be a probability in [0, 1], got {dropout!r}")


def _check_construction(embed_dim, num_heads, dropout, kdim, vdim, grad_accum_dtype):
    """What can never work, found when the module is built, in the module's own terms."""
    api = "RingMultiheadAttention"
    _positive_int("embed_dim", embed_dim, api)
    _positive_int("num_heads", num_heads, api)
    for name, dim in (("kdim", kdim), ("vdim", vdim)):
        if dim is not None:
            _positive_int(name, dim, api)
    if embed_dim % num_heads:
        raise ValueError(f"{api}: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
    if embed_dim // num_heads > MAX_HEAD_DIM:
        raise ValueError(
            f"{api}: embed_dim / num_heads = {embed_dim} / {num_heads} = {embed_dim // num_heads} per head; "
            f"at most {MAX_HEAD_DIM} is supported (use num_heads >= {-(-embed_dim // MAX_HEAD_DIM)})"
        )
    _check_dropout(dropout, api)
    if grad_accum_dtype is not None and grad_accum_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{api}: grad_accum_dtype must be None or a floating dtype, got {grad_accum_dtype!r}")


def _no_fast_path(module, args):
    return None


def _check_causal_hint(mask, length, api):
    """Accept attn_mask (length, length) or (N, length, length), bool or float, with
    is_causal=True only if it looks like the causal mask of the local length (shape, and a
    spot check of its first and last rows), as torch's hint.
    Under torch.compile only the shape is checked: reading the values would end the graph; on
    the meta device there are none."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{api}: attn_mask must be bool or floating point, got {mask.dtype}")
    if mask.shape[-2:] != (length, length):
        raise ValueError(
            f"{api}: is_causal=True with an attn_mask of shape {tuple(mask.shape)}; expected the "
            f"causal mask ({length}, {length}) or None"
        )
    if shapes_only(mask):
        return  # traced or meta: no values to read; the shape above is checked
    m = mask.reshape(-1, length, length)[0]
    # a float mask hides a key with -inf (torch's causal masks) or its dtype's lowest value
    # (transformers' masks): added to a score, either gives the key weight exactly 0
    hidden = m if m.dtype == torch.bool else m <= torch.finfo(m.dtype).min
    first_ok = not hidden[0, 0] and bool(hidden[0, 1:].all())
    last_ok = not bool(hidden[-1].any())
    if not (first_ok and last_ok):
        raise ValueError(f"{api}: is_causal=True but attn_mask is not the causal mask")
