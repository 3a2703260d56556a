"""Shared by the ring tests: full inputs, one ring call's case, the check of a ring call
against the float64 oracle (run on every rank of a world), and the fields a call's ranks agree on."""

import contextlib
import inspect
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ringflash import ring_flash_attn_func, shard, unshard

from oracle import assert_within, plain_errors, reference

TORCH = {"RINGFLASH_BACKEND": "torch"}
TRITON = {"RINGFLASH_BACKEND": "triton", "TRITON_INTERPRET": "1"}


def full_inputs(B, S, Sk, Hq, Hkv, D, dtype, seed, Dv=None):
    """q, k, v, do: the full (unsharded) tensors, the same on every rank; v and do have head dim
    Dv (default D)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hkv, Dv or D, generator=g).to(dtype)
    do = torch.randn(B, S, Hq, Dv or D, generator=g).to(dtype)
    return q, k, v, do


def packed_case(lengths, causal, window_size, Hq, Hkv, dtype, seed, D=16, Dv=None):
    """Packed documents of `lengths` tokens: (cu_seqlens list, cu tensor, q, k, v, do (total, H,
    D; v and do: Dv, default D), the float64 reference run one document at a time, the plain
    same-dtype errors)."""
    from ringflash.testing import varlen_plain_errors, varlen_reference

    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, Dv or D, generator=g).to(dtype)
    do = torch.randn(T, Hq, Dv or D, generator=g).to(dtype)
    cu_t = torch.tensor(cu)
    kw = dict(causal=causal, window_size=window_size)
    ref = varlen_reference(q, k, v, do, cu_t, cu_t, **kw)
    return cu, cu_t, q, k, v, do, ref, varlen_plain_errors(q, k, v, do, cu_t, cu_t, ref, **kw)


def padding_mask(kind, B, Sk, seed):
    """A key padding mask: None, "bool" (30% padded) or "float" (an additive bias)."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed + 1)
    return torch.rand(B, Sk, generator=g) < 0.3 if kind == "bool" else torch.randn(B, Sk, generator=g)


@dataclass(frozen=True)
class Case:
    """One ring call: full sequence length S = chunk * 2 * world (Sk likewise). Out, lse and
    gradients are held to oracle.assert_within of the plain same-dtype computation (float64
    too: its floor is float64's ulps)."""

    layout: str
    causal: bool
    B: int
    chunk: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype
    seed: int
    mask: str | None = None
    kv_chunk: int | None = None  # cross-attention: keys of another length
    grad_chunks: int | None = None

    def __str__(self):
        kv = f"-kv{self.kv_chunk}" if self.kv_chunk else ""
        return (
            f"{self.layout}-{'causal' if self.causal else 'full'}-{self.Hq}x{self.Hkv}-"
            f"{str(self.dtype)[6:]}{kv}-{self.mask or 'nomask'}-s{self.seed}"
        )


def ring_vs_oracle(rank, world, case: Case, group=None):
    """The ring's out, lse and gradients, on this rank's shard and reassembled, against float64
    (bounds: Case's docstring)."""
    ring_world = dist.get_world_size(group)
    S = 2 * ring_world * case.chunk
    Sk = 2 * ring_world * (case.kv_chunk or case.chunk)
    q, k, v, do = full_inputs(case.B, S, Sk, case.Hq, case.Hkv, case.D, case.dtype, case.seed)
    mask = padding_mask(case.mask, case.B, Sk, case.seed)
    ref, ref_lse, *ref_grads = reference(q, k, v, do, causal=case.causal, key_padding_mask=mask)

    sh = lambda t: shard(t, group=group, layout=case.layout)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out, lse = ring_flash_attn_func(
        ql,
        kl,
        vl,
        causal=case.causal,
        group=group,
        layout=case.layout,
        return_lse=True,
        key_padding_mask=None if mask is None else sh(mask),
        grad_chunks=case.grad_chunks,
    )
    assert out.dtype == case.dtype and out.shape == ql.shape
    assert lse.dtype == (torch.float64 if case.dtype == torch.float64 else torch.float32)
    grads = torch.autograd.grad(out, (ql, kl, vl), sh(do))
    # the last collectives before any check: a rank that fails one leaves no other waiting
    whole_out, whole_dk = (unshard(t, group=group, layout=case.layout) for t in (out, grads[1]))
    plain = plain_errors(q, k, v, do, (ref, ref_lse, *ref_grads), causal=case.causal, key_padding_mask=mask)
    assert_within("out", out, sh(ref), plain["out"])
    assert_within("lse", lse, shard(ref_lse, group=group, layout=case.layout, dim=2), plain["lse"], sum_len=1)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == case.dtype
        assert_within(name, g, sh(r), plain[name])
    # reassembled on every rank
    assert_within("unshard(out)", whole_out, ref, plain["out"])
    assert_within("unshard(dk)", whole_dk, ref_grads[1], plain["dk"])


class _Stopped(Exception):
    pass


def sent_field_names(call, name="agree_across_ranks"):
    """The field names that call() hands to the agreement comm.<name> (agree_across_ranks or
    agree_across_grid), from ringflash.comm or ringflash.nn. A stand-in takes the agreement's
    place and ends the call there, so no rank enters a collective."""
    import ringflash.comm
    import ringflash.nn

    sent = []
    signature = inspect.signature(getattr(ringflash.comm, name))

    def stand_in(*args, **kwargs):
        sent.append(tuple(signature.bind(*args, **kwargs).arguments["fields"]))
        raise _Stopped

    with contextlib.ExitStack() as stack:
        for module in (ringflash.comm, ringflash.nn):
            if hasattr(module, name):  # nn calls agree_across_grid, which calls comm's agree_across_ranks
                stack.enter_context(mock.patch.object(module, name, stand_in))
        with pytest.raises(_Stopped):
            call()
    assert len(sent) == 1, sent
    return sent[0]
