"""Plain-torch block operations with the kernels' semantics: the CPU backend and the oracle
the Triton kernels are tested against.

Work is chunked over query and key rows, so the full Sq x Sk score matrix is never built for
long sequences. Statistics are kept in float32 (float64 for float64 inputs). GQA is handled by
viewing the Hq query heads as (Hkv, group): no copies of K/V.
"""
from __future__ import annotations

import torch

from .masks import Visibility, block_visibility
from .merge import _merge, state_dtype

Q_CHUNK = 1024
K_CHUNK = 1024


def _grouped(x: torch.Tensor, heads_kv: int, dtype) -> torch.Tensor:
    """(B, S, Hq, D) -> (B, S, Hkv, G, D) in `dtype`; head h = hk * G + g."""
    B, S, H, D = x.shape
    return x.to(dtype).reshape(B, S, heads_kv, H // heads_kv, D)


def _scores(qg, kj, scale, q_pos0, k_pos0, vis, bias_j):
    """Scaled scores (B, Hkv, G, n_q, n_k), plus the per-key bias (B, n_k) if any, with
    invisible entries at -inf."""
    s = torch.einsum("bihgd,bjhd->bhgij", qg, kj) * scale
    if bias_j is not None:
        s = s + bias_j.to(s.dtype)[:, None, None, None, :]
    if vis is Visibility.PARTIAL:
        q_pos = torch.arange(q_pos0, q_pos0 + s.shape[-2], device=s.device)
        k_pos = torch.arange(k_pos0, k_pos0 + s.shape[-1], device=s.device)
        s = s.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    return s


def _bias_slice(key_bias, j0, j1):
    return None if key_bias is None else key_bias[:, j0:j1]


def forward(q, k, v, *, q_start, k_start, causal, scale, out_o, out_lse, fold, key_bias=None):
    """Attention of q (B, Sq, Hq, D) over k, v (B, Sk, Hkv, D) by global positions.

    Writes out_o (B, Sq, Hq, D) and out_lse (B, Hq, Sq). With fold=True they hold an incoming
    state (normalized o, lse) over other keys, and the result is that state merged with this
    block's. key_bias: optional (B, Sk) float, added to every query's scores of that key
    (-inf drops the key: key padding).
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    acc = state_dtype(q.dtype)
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(i0 + Q_CHUNK, Sq)
        n = i1 - i0
        qg = _grouped(q[:, i0:i1], Hkv, acc)
        if fold:
            o = out_o[:, i0:i1].to(acc)
            lse = out_lse[:, :, i0:i1].to(acc)
        else:
            o = torch.zeros(B, n, Hq, D, dtype=acc, device=q.device)
            lse = torch.full((B, Hq, n), float("-inf"), dtype=acc, device=q.device)
        for j0 in range(0, Sk, K_CHUNK):
            j1 = min(j0 + K_CHUNK, Sk)
            vis = block_visibility(q_start + i0, n, k_start + j0, j1 - j0, causal)
            if vis is Visibility.NONE:
                continue
            s = _scores(qg, k[:, j0:j1].to(acc), scale, q_start + i0, k_start + j0, vis, _bias_slice(key_bias, j0, j1))
            lse_c = torch.logsumexp(s, dim=-1)
            pivot = torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), lse_c)
            p = torch.exp(s - pivot[..., None])
            o_c = torch.einsum("bhgij,bjhd->bihgd", p, v[:, j0:j1].to(acc)).reshape(B, n, Hq, D)
            o, lse = _merge(o, lse, o_c, lse_c.reshape(B, Hq, n))
        out_o[:, i0:i1] = o
        out_lse[:, :, i0:i1] = lse


def delta(o, do):
    """rowsum(dO * O): (B, S, H, D) x2 -> (B, H, S) in the state dtype."""
    acc = state_dtype(o.dtype)
    return (do.to(acc) * o.to(acc)).sum(-1).transpose(1, 2).contiguous()


def backward(q, k, v, lse, do, delta, dq, dk, dv, *, q_start, k_start, causal, scale, accumulate,
             key_bias=None):
    """Gradients of one block given the final lse (B, Hq, Sq) and delta (B, Hq, Sq).

    dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D) are added to (accumulate=True) or overwritten;
    dq=None skips dQ, dk=dv=None skips dK/dV.
    """
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    acc = state_dtype(q.dtype)
    # accumulators only for the gradients asked for
    dq_acc = None if dq is None else torch.zeros(B, Sq, Hkv, G, D, dtype=acc, device=q.device)
    dk_acc = None if dk is None else torch.zeros(B, Sk, Hkv, D, dtype=acc, device=q.device)
    dv_acc = None if dv is None else torch.zeros(B, Sk, Hkv, D, dtype=acc, device=q.device)
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(i0 + Q_CHUNK, Sq)
        n = i1 - i0
        qg = _grouped(q[:, i0:i1], Hkv, acc)
        dog = _grouped(do[:, i0:i1], Hkv, acc)
        lse_i = lse[:, :, i0:i1].to(acc).reshape(B, Hkv, G, n)
        # A row that saw no key has p = 0 everywhere: exp(s - inf).
        lse_i = torch.where(lse_i == float("-inf"), torch.full_like(lse_i, float("inf")), lse_i)
        delta_i = delta[:, :, i0:i1].to(acc).reshape(B, Hkv, G, n)
        for j0 in range(0, Sk, K_CHUNK):
            j1 = min(j0 + K_CHUNK, Sk)
            vis = block_visibility(q_start + i0, n, k_start + j0, j1 - j0, causal)
            if vis is Visibility.NONE:
                continue
            kj, vj = k[:, j0:j1].to(acc), v[:, j0:j1].to(acc)
            s = _scores(qg, kj, scale, q_start + i0, k_start + j0, vis, _bias_slice(key_bias, j0, j1))
            p = torch.exp(s - lse_i[..., None])
            dp = torch.einsum("bihgd,bjhd->bhgij", dog, vj)
            ds = p * (dp - delta_i[..., None])
            if dq is not None:
                dq_acc[:, i0:i1] += torch.einsum("bhgij,bjhd->bihgd", ds, kj) * scale
            if dk is not None:
                dk_acc[:, j0:j1] += torch.einsum("bhgij,bihgd->bjhd", ds, qg) * scale
                dv_acc[:, j0:j1] += torch.einsum("bhgij,bihgd->bjhd", p, dog)
    for buf, grad in ((dq, dq_acc), (dk, dk_acc), (dv, dv_acc)):
        if buf is None:
            continue
        grad = grad.reshape(buf.shape)
        if accumulate:
            buf += grad.to(buf.dtype)
        else:
            buf.copy_(grad)
