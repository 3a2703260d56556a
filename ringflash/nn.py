"""RingMultiheadAttention: a drop-in for torch.nn.MultiheadAttention whose attention runs on
the ring. The module never calls torch.distributed itself; ring_flash_attn_func does.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .ring import ring_flash_attn_func
from .schedule import check_layout


class RingMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention with the same constructor, parameters (state_dict loads both
    ways) and forward signature, for sequences sharded over the ranks of `group`.

    Inputs are this rank's shard of each sequence, in the module's layout: (B, L_local, E)
    with batch_first=True, else (L_local, B, E); unbatched (L_local, E) works too. Keys and
    values are sharded the same way as their own sequence (see ringflash.shard). The output
    is this rank's shard, and attention weights are never materialized: the second return
    value is always None. group, layout, grad_accum_dtype and head_group (keyword-only) are
    passed to ring_flash_attn_func (with a head_group, inputs are sharded over R x U ranks as
    ringflash.shard(..., head_group=) does, and num_heads must split over the head group).

    Supported: self- and cross-attention, kdim/vdim, is_causal=True (attn_mask None or the
    causal mask as a hint, as torch documents; self-attention only), key_padding_mask of this
    rank's keys (bool: True = padding, or float: added to the scores), dropout in eval mode.
    A query whose keys are all padded gets output 0 (torch gives NaN).
    Not supported (NotImplementedError naming the argument): an arbitrary attn_mask,
    add_bias_kv, add_zero_attn, dropout > 0 while training.
    """

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
    ):
        if add_bias_kv:
            raise NotImplementedError("RingMultiheadAttention: add_bias_kv=True is not supported")
        if add_zero_attn:
            raise NotImplementedError("RingMultiheadAttention: add_zero_attn=True is not supported")
        check_layout(layout, "RingMultiheadAttention")
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            kdim=kdim,
            vdim=vdim,
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )
        self.group = group
        self.head_group = head_group
        self.layout = layout
        self.grad_accum_dtype = grad_accum_dtype
        self._warned_weights = False
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
        if self.dropout > 0.0 and self.training:
            raise NotImplementedError(
                f"{api}: dropout={self.dropout} in training mode is not supported (use dropout=0.0, or eval mode)"
            )
        if any(getattr(t, "is_nested", False) for t in (query, key, value)):
            raise NotImplementedError(
                f"{api}: nested tensors are not supported (nn.TransformerEncoder: pass enable_nested_tensor=False)"
            )
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # (L, 1, E)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                f"{api}: query, key, value must be 2-D or 3-D, got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        if not self.batch_first or unbatched:  # (L, B, E) -> (B, L, E)
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if attn_mask is not None:
            if not is_causal:
                raise NotImplementedError(
                    f"{api}: attn_mask is not supported (an arbitrary mask cannot be "
                    "sharded); use is_causal=True or key_padding_mask"
                )
            _check_causal_hint(attn_mask, query.shape[1], api)
        if need_weights and not self._warned_weights:
            warnings.warn(
                f"{api}: attention weights are never materialized; attn_weights is None. "
                "Pass need_weights=False to silence this.",
                stacklevel=2,
            )
            self._warned_weights = True
        out = self._attention(query, key, value, key_padding_mask, is_causal)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        return out, None

    def _attention(self, query, key, value, key_padding_mask, is_causal):
        """(B, L, E) inputs -> (B, L, E) output."""
        B, L, E = query.shape
        H, hd = self.num_heads, self.head_dim
        (w_q, b_q), (w_k, b_k), (w_v, b_v) = self._projections()
        q = F.linear(query, w_q, b_q).view(B, L, H, hd)
        k = F.linear(key, w_k, b_k).view(B, key.shape[1], H, hd)
        v = F.linear(value, w_v, b_v).view(B, value.shape[1], H, hd)
        o = ring_flash_attn_func(
            q,
            k,
            v,
            causal=is_causal,
            group=self.group,
            layout=self.layout,
            key_padding_mask=key_padding_mask,
            grad_accum_dtype=self.grad_accum_dtype,
            head_group=self.head_group,
        )
        return self.out_proj(o.reshape(B, L, E))


def _no_fast_path(module, args):
    return None


def _check_causal_hint(mask, length, api):
    """Accept attn_mask with is_causal=True only if it looks like the causal mask of the
    local length (shape, and a spot check of its first and last rows), as torch's hint."""
    if mask.shape[-2:] != (length, length):
        raise ValueError(
            f"{api}: is_causal=True with an attn_mask of shape {tuple(mask.shape)}; expected the "
            f"causal mask ({length}, {length}) or None"
        )
    m = mask.reshape(-1, length, length)[0]
    hidden = m if m.dtype == torch.bool else torch.isneginf(m)
    first_ok = not hidden[0, 0] and bool(hidden[0, 1:].all())
    last_ok = not bool(hidden[-1].any())
    if not (first_ok and last_ok):
        raise ValueError(f"{api}: is_causal=True but attn_mask is not the causal mask")
