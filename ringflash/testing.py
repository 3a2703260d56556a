"""Tools for checking and timing, without a process group.

replay_ring plays every rank of a `world`-rank ring in turn inside one process (ReplayComm
stands in for the exchange), so the ring's device path can be compared with single-device
attention on one GPU, and one rank's share of the work timed without communication. Not for
training: the replay computes each rank's part sequentially.

The oracles: naive_attention (every score materialized, any dtype, float64 by default),
reference (its output and gradients in float64), flash_plain (the flash algorithm written
plainly, the baseline of a flash kernel's error), plain_errors (the error of the plain
computations against a reference, over several summation orders), max_err, rel_rms;
dropout_factors (naive_attention's weights under dropout). capture_graph: a call captured in
a CUDA graph as torch asks.
"""

from __future__ import annotations

import math

import torch

from .comm import LocalComm
from .layout import _check_balanced, _place, _split
from .merge import state_dtype
from .ring import _RingAttn, ring_call_spec
from .schedule import check_divisible, is_balanced


class ReplayComm:
    """Plays rank `rank` of a `world`-rank ring inside one process.

    The K/V blocks "received" at step s for step s + hop are copied from
    `blocks[(rank - s - hop) % world]`, the tuple of tensors (k, v, and the key bias if any)
    that rank holds. Gradient accumulators sent on at step s belong to the block of rank
    (rank - s) % world; with `record` set each is recorded in `sent_grads` as (owner rank, kv
    heads slice, [dk, dv]), and zeros come back, so adding the records of every replayed rank
    into dk[:, :, heads] / dv[:, :, heads] gives each block's dK/dV.
    """

    def __init__(self, rank: int, world: int, blocks, record: bool = True, overlap: bool = False):
        """overlap: make the copies on a side stream that the compute waits for only in
        wait(), as a network transfer runs beside the kernels (on a GPU; the copies still take
        the device's memory bandwidth). Default: on the current stream, in line."""
        if world < 2:
            raise ValueError("ReplayComm needs world >= 2")
        self.rank, self.world = rank, world
        self.blocks = blocks
        self.record = record
        self.sent_grads = []
        self.exchanges = {"kv": 0, "grad": 0}  # started exchanges of each kind
        device = blocks[0][0].device
        self.side = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    def start(self, send, recv, kind: str, *, step: int, heads: slice | None = None, hop: int = 1):
        self.exchanges[kind] += 1
        if self.side is None:
            self._exchange(send, recv, kind, step, heads, hop)
            return None
        main = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(main)  # what is sent, and the buffers' last readers, are done
        with torch.cuda.stream(self.side):
            self._exchange(send, recv, kind, step, heads, hop)
        return main

    def _exchange(self, send, recv, kind, step, heads, hop):
        if kind == "kv":
            for buf, t in zip(recv, self.blocks[(self.rank - step - hop) % self.world], strict=True):
                buf.copy_(t)
        else:
            if self.record:
                owner = (self.rank - step) % self.world
                self.sent_grads.append((owner, slice(None) if heads is None else heads, [t.clone() for t in send]))
            for t in recv:
                t.zero_()

    def wait(self, handles) -> None:
        if handles is not None:  # the stream the exchange was started from waits for it
            handles.wait_stream(self.side)


def replay_ring(
    q,
    k,
    v,
    do,
    *,
    world,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    layout="zigzag",
    key_padding_mask=None,
    ranks=None,
    grad_accum_dtype=None,
    grad_chunks=None,
    overlap=False,
    deterministic=False,
):
    """Run the ring's schedule for `world` ranks inside one process on full tensors, without
    a process group: each rank in `ranks` (default all) is replayed in turn with ReplayComm.

    q, k, v, do: full (B, S, H, D) tensors (v and do: v's head dim Dv). Returns out, dq, dk, dv as full tensors
    (positions of ranks not replayed are zero; dk/dv then hold only the replayed ranks'
    contributions). window_size, grad_accum_dtype, grad_chunks, deterministic: as in ring_flash_attn_func
    (the summing of dK/dV over the replayed ranks is float32, float64 for float64 inputs). layout: a name or a
    ringflash.balanced_layout built for `world` (packed documents: B = 1, S the packed total; the
    K/V blocks padded as ring_flash_attn_varlen_func pads them: BalancedLayout.block_len).
    overlap: ReplayComm's.
    """
    _, spec, key_bias = ring_call_spec(
        q, k, v, causal, softmax_scale, layout, key_padding_mask, grad_accum_dtype, grad_chunks, "replay_ring",
        window_size, deterministic,
    )  # fmt: skip
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"replay_ring: world must be a positive int, got {world!r}")
    for name, t in (("q", q), ("k", k)):  # the shards are cut from the full tensors: none may lose rows
        if is_balanced(layout):
            _check_balanced(layout, t.shape[1], world, "replay_ring", f"{name} has", "world is")
        else:
            check_divisible(t.shape[1], world, layout, "replay_ring", f"{name}'s sequence length")
    k_shards, v_shards = _split(k, world, layout), _split(v, world, layout)
    kv_rows = [t.shape[1] for t in k_shards]  # before any padding
    if is_balanced(layout):  # as the ring call pads them: to the longest shard where they travel
        k_shards = [layout.pad_block(t, r, dim=1, window=spec.window) for r, t in enumerate(k_shards)]
        v_shards = [layout.pad_block(t, r, dim=1, window=spec.window) for r, t in enumerate(v_shards)]
    bias_shards = [None] * world if key_bias is None else _split(key_bias, world, layout)
    blocks = [(ks, vs) if bs is None else (ks, vs, bs) for ks, vs, bs in zip(k_shards, v_shards, bias_shards)]
    q_shards, do_shards = _split(q, world, layout), _split(do, world, layout)
    outs = [t.new_zeros(*t.shape[:-1], v.shape[-1]) for t in q_shards]  # (.., Dv)
    dqs = [torch.zeros_like(t) for t in q_shards]
    dks = [torch.zeros_like(t, dtype=state_dtype(k.dtype)) for t in k_shards]
    dvs = [torch.zeros_like(t, dtype=state_dtype(v.dtype)) for t in v_shards]
    for rank in range(world) if ranks is None else ranks:
        comm = ReplayComm(rank, world, blocks, overlap=overlap) if world > 1 else LocalComm()
        ql = q_shards[rank].detach().requires_grad_()
        kl, vl = k_shards[rank].detach().requires_grad_(), v_shards[rank].detach().requires_grad_()
        out, _ = _RingAttn.apply(ql, kl, vl, bias_shards[rank], spec, comm)
        dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), do_shards[rank])
        outs[rank], dqs[rank] = out.detach(), dq
        # a ring that needs one step keeps each rank's accumulators home: nothing recorded
        kept_home = world == 1 or not comm.exchanges["grad"]
        for owner, heads, (dk_part, dv_part) in [(rank, slice(None), (dk, dv))] if kept_home else comm.sent_grads:
            dks[owner][:, :, heads] += dk_part
            dvs[owner][:, :, heads] += dv_part
    return (  # the padding rows go
        _place(outs, layout),
        _place(dqs, layout),
        _place([t[:, :n].to(k.dtype) for t, n in zip(dks, kv_rows)], layout),
        _place([t[:, :n].to(v.dtype) for t, n in zip(dvs, kv_rows)], layout),
    )


# ----------------------------------------------------------------------------- oracles


def capture_graph(fn, warmup: int = 3):
    """(graph, result): fn() captured once in a torch.cuda.CUDAGraph after `warmup` calls on a
    side stream, as torch.cuda.graph asks (kernels compiled, launch plans made, the allocator
    settled); result is what the captured call returned, its tensors rewritten by every
    graph.replay(). fn reads and writes the same tensors on every replay: put new inputs into
    them in place (copy_) before replaying."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _visible(Sq, Sk, causal, window_size, q_pos, k_pos, device):
    """(Sq, Sk) bool: query i sees key j, flash-attn's rule at positions q_pos / k_pos
    (default: bottom-right aligned), or None when every pair is visible."""
    left, right = window_size
    right = 0 if causal else right
    if left == -1 and right == -1:
        return None
    if q_pos is None:
        q_pos, k_pos = torch.arange(Sq) + (Sk - Sq), torch.arange(Sk)
    q_pos, k_pos = q_pos.to(device)[:, None], k_pos.to(device)[None, :]
    visible = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if left != -1:
        visible &= k_pos >= q_pos - left
    if right != -1:
        visible &= k_pos <= q_pos + right
    return visible


def naive_attention(
    q, k, v, *, scale=None, causal=False, window_size=(-1, -1), q_pos=None, k_pos=None, dtype=None,
    key_padding_mask=None, drop=None,
):  # fmt: skip
    """Attention computed the obvious way, in `dtype` (default float64), differentiable.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv). causal and window_size as flash-attn's, by global
    positions q_pos / k_pos (default: bottom-right alignment). key_padding_mask (B, Sk): bool
    (True = ignored) or float (added to the scores). drop: optional (B, Hq, Sq, Sk) factors of
    the weights (dropout: keep / (1 - p)); lse is that of the weights before them. Returns out
    (B, Sq, Hq, Dv) and lse (B, Hq, Sq); a row with no visible key gives 0 and -inf.
    """
    dtype = dtype or torch.float64
    q, k, v = (t.to(dtype) for t in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if key_padding_mask is not None:
        m = key_padding_mask.to(s.device)
        bias = (
            torch.zeros(m.shape, dtype=dtype, device=s.device).masked_fill(m, float("-inf"))
            if m.dtype == torch.bool
            else m.to(dtype)
        )
        s = s + bias[:, None, None, :]
    visible = _visible(Sq, Sk, causal, window_size, q_pos, k_pos, s.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    # rows that see no key: output 0, lse -inf, zero gradients (and no NaN from autograd)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s.float() if dtype in (torch.float16, torch.bfloat16) else s, dim=-1).to(dtype)
    # softmax subtracts the row max, so the dominant weight of a row is exact however large the
    # scores; exp(s - lse) would carry lse's rounding (~1e-3 at |s| ~ 1e4) into every weight
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    if drop is not None:
        p = p * drop.to(device=p.device, dtype=dtype)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def dropout_factors(seed: int, p: float, B: int, Hq: int, Sq: int, Sk: int, device="cpu") -> torch.Tensor:
    """naive_attention's `drop` for attention dropout: keep / (1 - p), float64 (B, Hq, Sq, Sk),
    the keep mask of ringflash.dropout over whole-sequence indices."""
    from .dropout import keep_mask

    idx = lambda n: torch.arange(n, device=device)  # noqa: E731
    return keep_mask(seed, p, idx(B), idx(Hq), idx(Sq), idx(Sk)).double() / (1 - p)


def max_err(a, b) -> float:
    """Max abs difference, treating equal infinities as equal."""
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    return torch.where(same_inf, torch.zeros_like(a), (a - b).abs()).max().item()


def reference(q, k, v, do, **kw):
    """(out, lse, dq, dk, dv) of naive_attention in float64 (kw: its options)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, **kw)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, (q, k, v), do.double()))


def plain_errors(q, k, v, do, ref, *, orders=1, seed=0, **kw):
    """The error against `ref` (reference()'s tuple) of the same attention done plainly in q's
    dtype: {"out", "lse", "dq", "dk", "dv"} -> max abs error. out, lse and dv: autograd through
    a softmax; dq and dk: for float32 and float64, the flash algorithm written plainly
    (flash_plain: its delta = rowsum(dO * out) cancels, which autograd's softmax backward does
    not), for 16-bit dtypes autograd (a 16-bit flash_plain would round the scores to 16 bits).

    orders > 1: the max over that many summation orders (the head dims of q/k and of v/dO
    permuted at random, `seed`): each order is an equally plain computation, and at large
    scores which one a kernel's rounding resembles is luck.
    """
    g = torch.Generator().manual_seed(seed)
    D, Dv = q.shape[-1], v.shape[-1]
    errs = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for i in range(orders):
        if i == 0:
            pk, pv = torch.arange(D), torch.arange(Dv)
        else:
            pk, pv = torch.randperm(D, generator=g), torch.randperm(Dv, generator=g)
        uk, uv = torch.argsort(pk), torch.argsort(pv)
        qp, kp, vp = (
            q.detach()[..., pk].requires_grad_(),
            k.detach()[..., pk].requires_grad_(),
            v.detach()[..., pv].requires_grad_(),
        )
        out, lse = naive_attention(qp, kp, vp, dtype=q.dtype, **kw)
        dq, dk, dv = torch.autograd.grad(out, (qp, kp, vp), do[..., pv].to(q.dtype))
        if q.dtype in (torch.float32, torch.float64):
            _, _, dq, dk, _ = flash_plain(qp, kp, vp, do[..., pv], **kw)
        got = (out[..., uv], lse, dq[..., uk], dk[..., uk], dv[..., uv])
        for name, x, r in zip(errs, got, ref):
            errs[name] = max(errs[name], max_err(x, r))
    return errs


def flash_plain(
    q, k, v, do, *, scale=None, causal=False, window_size=(-1, -1), key_padding_mask=None, dtype=None, drop=None
):
    """The flash algorithm written plainly, in `dtype` (default q's): the baseline a flash
    kernel's error is measured against. Forward with the best state a flash kernel keeps (row
    max m and normalizer l in base-2 units, out = exp2(s2 - m) v / l); backward with delta =
    rowsum(dO * out) and dS = P (dP - delta), P rebuilt from (m, l). Unlike autograd through a
    softmax (which cancels against sum(P dP) computed from the same P), dS then inherits the
    rounding of out through delta: that part of dq and dk's error is the algorithm's own.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), do (B, Sq, Hq, Dv). causal and
    window_size as flash-attn's,
    aligned bottom-right; drop as naive_attention's (dropout: the values are weighed by P drop,
    dS = P (dP drop - delta)). Returns out, lse, dq, dk, dv (lse natural log; rows that see no
    key: 0 and -inf).
    """
    dtype = dtype or q.dtype
    q, k, v, do = (t.detach().to(dtype) for t in (q, k, v, do))
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    log2e = 1.4426950408889634
    kr, vr = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s2 = torch.einsum("bihd,bjhd->bhij", q, kr) * (scale * log2e)
    if key_padding_mask is not None:
        m = key_padding_mask
        bias = torch.zeros(m.shape, dtype=dtype).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m.to(dtype)
        s2 = s2 + (bias * log2e)[:, None, None, :]
    visible = _visible(Sq, Sk, causal, window_size, None, None, s2.device)
    if visible is not None:
        s2 = s2.masked_fill(~visible, float("-inf"))
    m = s2.amax(-1, keepdim=True)
    seen = m > float("-inf")
    m = torch.where(seen, m, torch.full_like(m, float("inf")))
    e = torch.exp2(s2 - m)
    l = e.sum(-1, keepdim=True)
    inv_l = torch.where(seen, 1.0 / torch.where(seen, l, torch.ones_like(l)), torch.zeros_like(l))
    p = e * inv_l
    drop = None if drop is None else drop.to(device=p.device, dtype=dtype)
    p_v = p if drop is None else p * drop
    out = torch.einsum("bhij,bjhd->bihd", p_v, vr)
    lse = torch.where(seen, (m + torch.log2(l)) / log2e, torch.full_like(m, float("-inf"))).squeeze(-1)
    delta = (do * out).sum(-1).transpose(1, 2)[..., None]  # (B, Hq, Sq, 1)
    dp = torch.einsum("bihd,bjhd->bhij", do, vr)
    if drop is not None:
        dp = dp * drop
    ds = p * (dp - delta)
    dq = torch.einsum("bhij,bjhd->bihd", ds, kr) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q).reshape(B, Sk, Hkv, G, D).sum(3) * scale
    dv = torch.einsum("bhij,bihd->bjhd", p_v, do).reshape(B, Sk, Hkv, G, -1).sum(3)
    return out, lse, dq, dk, dv


def rel_rms(got, want) -> float:
    """Relative RMS error of got against want (both cast to float64)."""
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def documents(cu_seqlens):
    """[(start, stop)] of each document of cu_seqlens (int tensor or list)."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return list(zip(cu, cu[1:]))


def varlen_reference(q, k, v, do, cu_q, cu_k, **kw):
    """reference() of packed documents, one document at a time (an oracle that shares nothing
    with the kernels' masks): q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), do
    (total_q, Hq, Dv). Returns out (total_q, Hq, Dv), lse (Hq, total_q), dq, dk, dv, float64."""
    parts = []
    for (qa, qb), (ka, kb) in zip(documents(cu_q), documents(cu_k)):
        if qb > qa and kb > ka:
            r = reference(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], do[None, qa:qb], **kw)
            parts.append(((qa, qb), (ka, kb), r))
    f64 = dict(dtype=torch.float64, device=q.device)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], **f64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), **f64)
    dq, dk, dv = torch.zeros(q.shape, **f64), torch.zeros(k.shape, **f64), torch.zeros(v.shape, **f64)
    for (qa, qb), (ka, kb), (o, ls, gq, gk, gv) in parts:
        out[qa:qb], lse[:, qa:qb], dq[qa:qb], dk[ka:kb], dv[ka:kb] = o[0], ls[0], gq[0], gk[0], gv[0]
    return out, lse, dq, dk, dv


def varlen_plain_errors(q, k, v, do, cu_q, cu_k, ref, **kw):
    """plain_errors() of packed documents, one document at a time: the largest error of each
    plain computation over the documents, against `ref` (varlen_reference's tuple)."""
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref = ref
    errs = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for (qa, qb), (ka, kb) in zip(documents(cu_q), documents(cu_k)):
        if qb > qa and kb > ka:
            r = (out_ref[None, qa:qb], lse_ref[None, :, qa:qb], dq_ref[None, qa:qb], dk_ref[None, ka:kb],
                 dv_ref[None, ka:kb])  # fmt: skip
            e = plain_errors(q[None, qa:qb], k[None, ka:kb], v[None, ka:kb], do[None, qa:qb], r, **kw)
            errs = {n: max(errs[n], e[n]) for n in errs}
    return errs
