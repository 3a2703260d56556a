"""Plain-torch block operations with the kernels' semantics: the CPU backend and the oracle
the Triton kernels are tested against.

Work is chunked over query and key rows, so the full Sq x Sk score matrix is never built for
long sequences. Statistics are kept in float32 (float64 for float64 inputs). GQA is handled by
viewing the Hq query heads as (Hkv, group): no copies of K/V.
"""

from __future__ import annotations

import torch

from .masks import FULL, Visibility, block_visibility
from .merge import LOG2E, DeltaOf, SoftmaxState, state_dtype
from .merge import fold as fold_states

Q_CHUNK = 1024
K_CHUNK = 1024


def _grouped(x: torch.Tensor, heads_kv: int, dtype) -> torch.Tensor:
    """(B, S, Hq, D) -> (B, S, Hkv, G, D) in `dtype`; head h = hk * G + g."""
    B, S, H, D = x.shape
    return x.to(dtype).reshape(B, S, heads_kv, H // heads_kv, D)


def chunk_mask(q_pos0, n_q, k_pos0, n_k, window, bounds, i0, device):
    """(Visibility, mask) of query positions [q_pos0, q_pos0 + n_q) against key positions
    [k_pos0, k_pos0 + n_k): mask (n_q, n_k) bool, True where the query sees the key, for a
    PARTIAL chunk (None otherwise). bounds (RowBounds) rows start at local query row i0."""
    if bounds is None:
        vis = block_visibility(q_pos0, n_q, k_pos0, n_k, window)
        if vis is not Visibility.PARTIAL:
            return vis, None
        q_pos = torch.arange(q_pos0, q_pos0 + n_q, device=device)[:, None]
        k_pos = torch.arange(k_pos0, k_pos0 + n_k, device=device)[None, :]
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
        if window.left is not None:
            visible &= k_pos >= q_pos - window.left
        if window.right is not None:
            visible &= k_pos <= q_pos + window.right
        return vis, visible
    lo = bounds.k_lo[i0 : i0 + n_q].to(device).long()[:, None]
    hi = bounds.k_hi[i0 : i0 + n_q].to(device).long()[:, None]
    k_pos = torch.arange(k_pos0, k_pos0 + n_k, device=device)[None, :]
    visible = (k_pos >= lo) & (k_pos < hi)
    if not bool(visible.any()):
        return Visibility.NONE, None
    if bool(visible.all()):
        return Visibility.FULL, None
    return Visibility.PARTIAL, visible


def _scores2(qg, kj, qk_scale, mask, bias_j):
    """Scores in base-2 units (B, Hkv, G, n_q, n_k): q.k * scale * log2(e), plus the per-key
    bias (B, n_k) times log2(e) if any, entries outside `mask` (n_q, n_k) at -inf. The forward
    and the backward call this on the same chunks, so the backward's probabilities are the
    forward's."""
    s = torch.einsum("bihgd,bjhd->bhgij", qg, kj) * qk_scale
    if bias_j is not None:
        s = s + (bias_j.to(s.dtype) * LOG2E)[:, None, None, None, :]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _bias_slice(key_bias, j0, j1):
    return None if key_bias is None else key_bias[:, j0:j1]


def _kept(dropout, B, Hkv, G, rows: range, cols: range, device):
    """The keep mask (B, Hkv, G, n_q, n_k) of a chunk (query head h = hk * G + g), or None."""
    if dropout is None:
        return None
    return dropout.keep(B, Hkv * G, rows, cols, device).reshape(B, Hkv, G, len(rows), len(cols))


def forward(q, k, v, state, *, q_start, k_start, window, bounds, scale, fold, normalize, key_bias=None, dropout=None):
    """Attention of q (B, Sq, Hq, D) over k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) at global positions q_start..,
    k_start.., each query seeing the keys `window` (ringflash.masks.Window; None: every key)
    or `bounds` (masks.RowBounds of the Sq query rows) lets it, into `state` (a SoftmaxState
    for the Sq rows; see ringflash.merge).

    fold=True: state holds an incoming unnormalized state over other keys, and receives the
    merge of it with this block's. normalize=True: state.o receives o / l (in its dtype)
    instead of the unnormalized o. key_bias: optional (B, Sk) float, added to every query's
    scores of that key (-inf drops the key: key padding). dropout: optional
    ringflash.dropout.Dropout of the block: l sums every probability, the values are weighed by
    the kept ones times 1 / (1 - p).
    """
    B, Sq, Hq, _ = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    acc = state_dtype(q.dtype)
    qk_scale = scale * LOG2E
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(i0 + Q_CHUNK, Sq)
        n = i1 - i0
        qg = _grouped(q[:, i0:i1], Hkv, acc)
        if fold:
            o = state.o[:, i0:i1].to(acc)
            m, l = state.m[:, :, i0:i1].to(acc), state.l[:, :, i0:i1].to(acc)
        else:
            o, m, l = SoftmaxState.zeros((B, n, Hq, Dv), acc, q.device)
        for j0 in range(0, Sk, K_CHUNK):
            j1 = min(j0 + K_CHUNK, Sk)
            vis, mask = chunk_mask(q_start + i0, n, k_start + j0, j1 - j0, window or FULL, bounds, i0, q.device)
            if vis is Visibility.NONE:
                continue
            s = _scores2(qg, k[:, j0:j1].to(acc), qk_scale, mask, _bias_slice(key_bias, j0, j1))
            m_c = s.amax(dim=-1)
            pivot = torch.where(m_c == float("-inf"), torch.zeros_like(m_c), m_c)
            p = torch.exp2(s - pivot[..., None])
            keep = _kept(dropout, B, Hkv, Hq // Hkv, range(i0, i1), range(j0, j1), q.device)
            p_v = p if keep is None else torch.where(keep, p * dropout.keep_scale, 0.0)
            o_c = torch.einsum("bhgij,bjhd->bihgd", p_v, v[:, j0:j1].to(acc)).reshape(B, n, Hq, Dv)
            o, m, l = fold_states(o, m, l, o_c, m_c.reshape(B, Hq, n), p.sum(-1).reshape(B, Hq, n))
        state.m[:, :, i0:i1] = m
        state.l[:, :, i0:i1] = l
        state.o[:, i0:i1] = SoftmaxState(o, m, l).normalized(state.o.dtype) if normalize else o


def delta(o, do):
    """rowsum(dO * O): (B, S, H, Dv) x2 -> (B, H, S) in the state dtype."""
    acc = state_dtype(o.dtype)
    return (do.to(acc) * o.to(acc)).sum(-1).transpose(1, 2).contiguous()


_rowsum = delta  # for the backward, whose argument of that name shadows it


def scatter_rows(dst, rows, src):
    """dst[:, rows[i]] = src[:, i] for i < len(rows): dst (B, N, ...), src (B, >= len(rows),
    ...), rows int64 (distinct)."""
    dst.index_copy_(1, rows, src[:, : len(rows)])


def fuses_backward(
    q, k, v, *, window, bounds, key_bias=None, dropout=None, deterministic=False, whole_call=False
) -> bool:
    """Whether a block's dQ and dK/dV are best computed in one call: never here (the callers'
    separate dQ and dK/dV calls are the ones this backend was measured and tested with)."""
    return False


def backward(
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
    *,
    q_start,
    k_start,
    window,
    bounds,
    scale,
    accumulate,
    key_bias=None,
    dropout=None,
    deterministic=False,
    whole_call=False,
):
    """Gradients of one block (positions, window, bounds and dropout as in forward) given the
    final row statistics m, l and delta (B, Hq, Sq), or a merge.DeltaOf to compute it from.
    Always bitwise reproducible (deterministic and whole_call are accepted for the backends'
    common signature).

    dq (B, Sq, Hq, D), dk (B, Sk, Hkv, D) and dv (B, Sk, Hkv, Dv) (do: (B, Sq, Hq, Dv)) are added
    to (accumulate=True) or overwritten;
    dq=None skips dQ, dk=dv=None skips dK/dV.
    """
    if isinstance(delta, DeltaOf):
        delta = delta.value(do, _rowsum)
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    acc = state_dtype(q.dtype)
    qk_scale = scale * LOG2E
    # accumulators only for the gradients asked for
    dq_acc = None if dq is None else torch.zeros(B, Sq, Hkv, G, D, dtype=acc, device=q.device)
    dk_acc = None if dk is None else torch.zeros(B, Sk, Hkv, D, dtype=acc, device=q.device)
    dv_acc = None if dv is None else torch.zeros(B, Sk, Hkv, Dv, dtype=acc, device=q.device)
    for i0 in range(0, Sq, Q_CHUNK):
        i1 = min(i0 + Q_CHUNK, Sq)
        n = i1 - i0
        qg = _grouped(q[:, i0:i1], Hkv, acc)
        dog = _grouped(do[:, i0:i1], Hkv, acc)
        m_i = m[:, :, i0:i1].to(acc).reshape(B, Hkv, G, n)
        l_i = l[:, :, i0:i1].to(acc).reshape(B, Hkv, G, n)
        # p = exp2(s2 - m) / l as the forward computed it; a row that saw no key has p = 0
        m_i = torch.where(l_i > 0, m_i, torch.full_like(m_i, float("inf")))
        inv_l = torch.where(l_i > 0, 1.0 / l_i, torch.zeros_like(l_i))
        delta_i = delta[:, :, i0:i1].to(acc).reshape(B, Hkv, G, n)
        for j0 in range(0, Sk, K_CHUNK):
            j1 = min(j0 + K_CHUNK, Sk)
            vis, mask = chunk_mask(q_start + i0, n, k_start + j0, j1 - j0, window or FULL, bounds, i0, q.device)
            if vis is Visibility.NONE:
                continue
            kj, vj = k[:, j0:j1].to(acc), v[:, j0:j1].to(acc)
            s = _scores2(qg, kj, qk_scale, mask, _bias_slice(key_bias, j0, j1))
            p = torch.exp2(s - m_i[..., None]) * inv_l[..., None]
            dp = torch.einsum("bihgd,bjhd->bhgij", dog, vj)
            keep = _kept(dropout, B, Hkv, G, range(i0, i1), range(j0, j1), q.device)
            p_v = p
            if keep is not None:  # the forward's mask: dV takes the kept p, dS the kept dP, scaled
                p_v = torch.where(keep, p * dropout.keep_scale, 0.0)
                dp = torch.where(keep, dp * dropout.keep_scale, 0.0)
            ds = p * (dp - delta_i[..., None])
            if dq is not None:
                dq_acc[:, i0:i1] += torch.einsum("bhgij,bjhd->bihgd", ds, kj) * scale
            if dk is not None:
                dk_acc[:, j0:j1] += torch.einsum("bhgij,bihgd->bjhd", ds, qg) * scale
                dv_acc[:, j0:j1] += torch.einsum("bhgij,bihgd->bjhd", p_v, dog)
    for buf, grad in ((dq, dq_acc), (dk, dk_acc), (dv, dv_acc)):
        if buf is None:
            continue
        grad = grad.reshape(buf.shape)
        if accumulate:
            buf += grad.to(buf.dtype)
        else:
            buf.copy_(grad)
