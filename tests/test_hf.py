"""ringflash.hf: transformers causal LMs (Llama, Qwen2, Mistral) with attention on the ring, over gloo
with 1, 2 and 4 processes, against one process running transformers' own attention.

Tolerances are derived, not tuned: the ring in float32 is compared with a float64 one-process run
(transformers' sdpa), and its error may be at most 2x that of the same computation done plainly in
float32 against the same float64 run: one process, attention in one block in the flash algorithm's
arithmetic (_PlainFlash; sdpa's math backward rounds differently and is not what the ring computes),
with a floor of 2 float32 ulps of the largest value (the float32 run can be exact by luck). The ring
in float64 gets the same bound scaled by eps64 / eps32; under bfloat16 autocast the plain run is
under the same autocast, the floor 2 bfloat16 ulps. Each spawned world runs many checks: the
cost of this file is spawning processes and importing transformers.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

import ringflash.hf as rhf  # noqa: E402
from ringflash.local import use_backend  # noqa: E402
from ringflash.masks import Window  # noqa: E402

from dist_utils import run_world  # noqa: E402

VOCAB, HIDDEN, S = 96, 64, 48
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
ENV = {"RINGFLASH_BACKEND": "torch"}


# ----------------------------------------------------------------------------- models and data


def make_config(family, **over):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**{**common, **over})
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, **over})
    elif family == "mistral":
        # Mistral's default sliding_window (4096) is longer than these sequences: it changes nothing
        cfg = transformers.MistralConfig(**{**common, **over})
    else:
        raise ValueError(family)
    return cfg


def make_model(family, seed=0, dtype=torch.float32, attn="sdpa", **over):
    """A random-weights causal LM, identical on every rank for the same seed."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config(family, **over), attn_implementation=attn)
    return model.to(dtype)


def make_batch(seed, padding, B=2, length=S):
    """input_ids (B, length), attention_mask or None, labels or None.
    padding: "none"; "mixed": row 0 left-padded by 7, row 1 right-padded by 5 (on 2 ranks the zigzag
    shards put all padding on rank 0, none on rank 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, length), generator=g)
    if padding == "none":
        return ids, None
    mask = torch.ones(B, length, dtype=torch.int64)
    mask[0, :7] = 0
    mask[1, length - 5 :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def causal_lm_loss64(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ForCausalLMLoss (same arguments and meaning) without its cast of the logits to
    float32, so that a float64 model's loss is float64 too."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def to_dtype(model, dtype):
    """A copy of model in dtype (float64: with a float64 loss)."""
    m = copy.deepcopy(model).to(dtype)
    if dtype == torch.float64:
        m.loss_function = causal_lm_loss64
    return m


class _PlainFlash(torch.autograd.Function):
    """Attention done plainly (one block, the input's precision) in the flash algorithm's
    arithmetic: O = softmax(scale * Q K^T) V with the row's log-sum-exp kept, and the backward
    dS = P * (dO V^T - rowsum(dO * O)). sdpa's math backward takes the softmax gradient from P
    instead (rowsum(P * dP)): the same function, other roundings, and not the computation the
    ring does. q: (B, H, Sq, D), k, v: (B, H, Sk, D), allowed: bool, broadcast to (B, H, Sq, Sk)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, allowed, scale):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        lse = lse.masked_fill(lse == float("-inf"), 0.0)  # a row with no key: P = 0, O = 0
        o = torch.matmul(torch.exp(s - lse).to(v.dtype), v)
        ctx.save_for_backward(q, k, v, allowed, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, do):
        q, k, v, allowed, o, lse = ctx.saved_tensors
        s = (torch.matmul(q, k.transpose(-1, -2)) * ctx.scale).masked_fill(~allowed, float("-inf"))
        p = torch.exp(s - lse)
        dv = torch.matmul(p.to(do.dtype).transpose(-1, -2), do)
        delta = (do.float() * o.float()).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, v.transpose(-1, -2)) - delta)
        dq = torch.matmul(ds.to(k.dtype), k) * ctx.scale
        dk = torch.matmul(ds.to(q.dtype).transpose(-1, -2), q) * ctx.scale
        return dq, dk, dv, None, None


def plain_flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface for _PlainFlash (mask: sdpa's mask function's bool mask,
    or None for plain causal). Returns (B, Sq, H, D) and no weights."""
    if dropout:
        raise NotImplementedError("the plain flash baseline has no dropout")
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    Sq, Sk = query.shape[2], key.shape[2]
    if attention_mask is None:
        attention_mask = torch.ones(Sq, Sk, dtype=torch.bool, device=query.device).tril(Sk - Sq)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = _PlainFlash.apply(query, key, value, attention_mask.to(torch.bool), scale)
    return out.transpose(1, 2).contiguous(), None


PLAIN_FLASH = "rf_tests_plain"  # no "flash" in it: transformers would look for a flash-attn kernel
transformers.AttentionInterface.register(PLAIN_FLASH, plain_flash_attention)
transformers.AttentionMaskInterface.register(PLAIN_FLASH, transformers.masking_utils.sdpa_mask)


def reference(model, ids, mask, labels=None, position_ids=None, dtype=torch.float32, autocast=False, **kw):
    """Loss and gradients of one process on the whole batch: in float64 the reference, with the
    model's own (sdpa) attention; in another dtype the plain baseline, with _PlainFlash
    (autocast: under CPU bfloat16 autocast, float32 weights)."""
    m = to_dtype(model, dtype)
    if dtype != torch.float64:
        m.set_attn_implementation(PLAIN_FLASH)
    m.zero_grad(set_to_none=True)
    if labels is None:
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = m(input_ids=ids, attention_mask=mask, labels=labels, position_ids=position_ids, **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


def ring_run(
    model,
    ids,
    mask,
    labels=None,
    position_ids=None,
    group=None,
    layout="zigzag",
    drop=(),
    autocast=False,
    head_group=None,
    **kw,
):
    """The sequence-parallel step: this rank's loss part, summed over the group (and the head
    group: over the R x U grid); summed gradients."""
    m = to_dtype(model, next(model.parameters()).dtype)
    rhf.apply(m, group=group, layout=layout, head_group=head_group)
    batch = rhf.shard_inputs(
        ids,
        labels=labels,
        attention_mask=mask,
        position_ids=position_ids,
        group=group,
        layout=layout,
        head_group=head_group,
        **kw,
    )
    for key in drop:
        batch.pop(key)
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = m(**batch)
    out.loss.backward()
    rhf.allreduce_grads(m, group=group, head_group=head_group)
    loss = out.loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(loss, group=group)
        if head_group is not None:
            dist.all_reduce(loss, group=head_group)
    return loss, {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}, out


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check_close(name, got, ref64, plain32, dtype):
    """got's error against the float64 reference at most 2x that of the plain run (float32, scaled by
    eps64 / eps32 for a float64 `got`; for bfloat16 the plain run under the same autocast), with a floor
    of 2 ulps of the largest value (2 eps * max |value|)."""
    scale = ref64.abs().max().item()
    eps = torch.finfo(dtype).eps
    plain = max_err(plain32, ref64) * (EPS64 / EPS32 if dtype == torch.float64 else 1.0)
    bound = 2 * max(plain, 2 * eps * scale)
    err = max_err(got, ref64)
    assert math.isfinite(err) and err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (plain {plain:.3e})"
    return err / max(plain, 2 * eps * scale)


def compare(tag, got_loss, got_grads, ref64, ref32, dtype):
    """check_close on the loss and on every parameter's gradient; returns the largest error / allowed-error
    ratio's half (1.0 = at the bound)."""
    loss64, grads64 = ref64
    loss32, grads32 = ref32
    r = [check_close(f"{tag} loss", got_loss, loss64, loss32, dtype)]
    assert set(got_grads) == set(grads64), (tag, set(grads64) ^ set(got_grads))
    for n in grads64:
        r.append(check_close(f"{tag} grad {n}", got_grads[n], grads64[n], grads32[n], dtype))
    return max(r) / 2


# ----------------------------------------------------------------------------- the grid


def _case(case, group=None, head_group=None):
    """One equivalence check: loss and every gradient of the ring run against one process."""
    family, padding = case["family"], case["padding"]
    dtype = case.get("dtype", torch.float32)
    seed = case.get("seed", 0)
    model = make_model(family, seed=seed, **case.get("config", {}))
    ids, mask = make_batch(seed + 1, padding)
    labels = None
    if case.get("labels") == "random_ignore":
        g = torch.Generator().manual_seed(seed + 2)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, -100)
    position_ids = None
    if case.get("positions") == "from_mask":  # generate()'s convention: each row counts from its first token
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    ref64 = reference(model, ids, mask, labels, position_ids, dtype=torch.float64)
    autocast = dtype == torch.bfloat16  # float32 weights, bfloat16 autocast, for the ring and the plain run
    ref32 = reference(model, ids, mask, labels, position_ids, dtype=torch.float32, autocast=autocast)
    ring_model = to_dtype(model, torch.float32 if autocast else dtype)
    if case.get("checkpointing"):
        # activation_checkpointing_enable in later 5.x, gradient_checkpointing_enable before
        (getattr(ring_model, "activation_checkpointing_enable", None) or ring_model.gradient_checkpointing_enable)()
        ring_model.train()
    loss, grads, _ = ring_run(
        ring_model,
        ids,
        mask,
        labels,
        position_ids,
        group=group,
        head_group=head_group,
        layout=case.get("layout", "zigzag"),
        drop=case.get("drop", ()),
        autocast=autocast,
    )
    return compare(str(case), loss, grads, ref64, ref32, dtype)


def _grid(rank, world, cases):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    for case in cases:
        _case(case)


CASES_2 = [dict(family=f, padding=p) for f in ("llama", "qwen2", "mistral") for p in ("none", "mixed")] + [
    dict(family="llama", padding="mixed", dtype=torch.float64),
    dict(family="qwen2", padding="none", dtype=torch.float64, layout="contiguous"),
    # 2.5x sdpa's float32 error in one gradient (sdpa's backward rounds otherwise); 1.3x the plain flash
    dict(family="mistral", padding="mixed", layout="contiguous", labels="random_ignore"),
    dict(family="llama", padding="mixed", checkpointing=True, positions="from_mask"),
    dict(family="qwen2", padding="mixed", checkpointing=True, dtype=torch.float64),
    dict(family="llama", padding="mixed", dtype=torch.bfloat16),  # bfloat16 autocast, float32 weights
]
CASES_4 = [
    dict(family="llama", padding="mixed"),
    dict(family="qwen2", padding="mixed", dtype=torch.float64, checkpointing=True),
    dict(family="mistral", padding="none", layout="contiguous", labels="random_ignore"),
]


# ----------------------------------------------------------------------------- traps, on 2 ranks


def _raises(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _trap_hf_defaults(rank, world):
    """A batch without use_cache=False (transformers' default use_cache=True) and without
    position_ids still runs on the ring with global positions: the same loss and gradients."""
    model = make_model("llama", num_hidden_layers=1)  # one layer: tracing is the cost
    ids, mask = make_batch(3, "mixed")
    ref64, ref32 = reference(model, ids, mask, dtype=torch.float64), reference(model, ids, mask)
    assert model.config.use_cache
    loss, grads, out = ring_run(model, ids, mask, drop=("use_cache", "position_ids"))
    compare("hf defaults", loss, grads, ref64, ref32, torch.float32)
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None  # no cache of sharded keys
    # a deepcopy of an applied model (an EMA or teacher copy) runs on the ring too
    applied = rhf.apply(copy.deepcopy(model))
    twin = copy.deepcopy(applied)
    rhf.unapply(applied)  # leaves the copy as it is
    got = twin(**rhf.shard_inputs(ids, attention_mask=mask)).loss.detach()
    dist.all_reduce(got)
    assert torch.equal(got, loss)  # the same model and batch through the same kernels: the same bits


def _trap_padding_on_one_rank(rank, world):
    """On 2 ranks the mixed batch's padding is all on rank 0: transformers' flash mask function
    returns None on rank 1 and a mask on rank 0 (the ring would refuse); ours returns the mask."""
    from transformers.masking_utils import flash_attention_mask

    ids, mask = make_batch(1, "mixed")
    local = rhf.shard_inputs(ids, attention_mask=mask)["attention_mask"].bool()
    assert bool(local.all()) == (rank == 1)
    kw = dict(batch_size=2, kv_length=S // 2, attention_mask=local)
    if "q_length" in inspect.signature(flash_attention_mask).parameters:
        kw["q_length"] = S // 2
    else:  # early 5.x
        kw["cache_position"] = torch.arange(S // 2)
    stock = flash_attention_mask(**kw)
    assert (stock is None) == (rank == 1)
    ours = rhf.ring_attention_mask(batch_size=2, q_length=S // 2, kv_length=S // 2, attention_mask=local)
    assert ours is not None and torch.equal(ours, local)


def _trap_rank_without_labels(rank, world):
    """Rank 1 holds no label token: its loss is 0 (not NaN) and the sum is the one-device loss."""
    model = make_model("qwen2")
    ids, mask = make_batch(4, "none")
    labels = torch.full_like(ids, -100)
    labels[:, 1:11] = ids[:, 1:11]  # shifted: positions 0..9, all inside rank 0's first chunk
    ref64, ref32 = reference(model, ids, mask, labels, dtype=torch.float64), reference(model, ids, mask, labels)
    loss, grads, out = ring_run(model, ids, mask, labels)
    local = out.loss.item()
    assert math.isfinite(local) and (local == 0.0) == (rank == 1), local
    compare("labels on one rank", loss, grads, ref64, ref32, torch.float32)
    # the denominator is the caller's to choose (gradient accumulation, data parallelism)
    m = rhf.apply(make_model("qwen2"))
    half = m(**rhf.shard_inputs(ids, labels=labels, num_items_in_batch=40)).loss.detach()
    dist.all_reduce(half)
    # twice the label count: half the one-process loss
    check_close("half the loss", half, ref64[0] / 2, ref32[0] / 2, torch.float32)


def _trap_pad_to_divisible(rank, world):
    """S = 45 does not divide into 4 chunks: pad=True right-pads, which changes no loss or gradient."""
    model = make_model("mistral")
    ids, mask = make_batch(5, "mixed", length=45)
    ref64, ref32 = reference(model, ids, mask, dtype=torch.float64), reference(model, ids, mask)
    _raises(ValueError, "sequence length 45", lambda: rhf.shard_inputs(ids, attention_mask=mask))
    loss, grads, out = ring_run(model, ids, mask, pad=True)
    assert out.logits.shape[1] == 24
    compare("pad", loss, grads, ref64, ref32, torch.float32)
    loss, grads, _ = ring_run(model, ids, None, pad=True)  # no mask given: one is made for the padding
    compare(
        "pad without mask",
        loss,
        grads,
        reference(model, ids, None, dtype=torch.float64),
        reference(model, ids, None),
        torch.float32,
    )


def packed_batch(seed, lengths):
    """One row of packed documents: input_ids (1, T), position_ids restarting at each document
    (DataCollatorWithFlattening's), labels with each document's first token ignored (its
    labels), and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ids = torch.randint(1, VOCAB, (1, cu[-1]), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, cu[:-1]] = -100
    return ids, pos, labels, cu


def check_packed(model, lengths, seed, group=None, head_group=None, dtype=torch.float32, sliding_window=None):
    """Packed documents on the ring against one process's sdpa with the same restarting
    position_ids (use_cache=False: with a cache transformers does not look for documents), by
    position_ids and by cu_seqlens (with sliding_window: the layout balanced for it); the
    documents matter (an unpacked run differs)."""
    ids, pos, labels, cu = packed_batch(seed, lengths)
    ref64 = reference(model, ids, None, labels, pos, dtype=torch.float64, use_cache=False)
    ref32 = reference(model, ids, None, labels, pos, use_cache=False)
    grid = dict(group=group, head_group=head_group)
    loss, grads, _ = ring_run(to_dtype(model, dtype), ids, None, labels, pos, **grid)
    compare(f"packed {lengths} by position_ids", loss, grads, ref64, ref32, dtype)
    # the same documents by cu_seqlens (an empty one in front): positions and labels derived
    batch = rhf.shard_inputs(ids, cu_seqlens=torch.tensor([0] + cu), **grid)
    assert torch.equal(batch["position_ids"], rhf.shard_inputs(ids, position_ids=pos, **grid)["position_ids"])
    if sliding_window is not None:
        grid["sliding_window"] = sliding_window
        got = rhf.shard_inputs(ids, cu_seqlens=[0] + cu, **grid)["ringflash_packed"].layout
        assert got.window == Window(sliding_window - 1, 0) and got.window != batch["ringflash_packed"].layout.window
    loss, grads, _ = ring_run(to_dtype(model, dtype), ids, None, None, None, cu_seqlens=[0] + cu, **grid)
    compare(f"packed {lengths} by cu_seqlens", loss, grads, ref64, ref32, dtype)
    unpacked = reference(model, ids, None, labels, None, use_cache=False)[0]
    # 4e-4 to 7e-3 of the loss in these cases: far above compare's bounds (~5e-7 of it in float32)
    assert abs(unpacked.item() - ref32[0].item()) > 1e-6 * abs(ref32[0].item())


def _trap_packed(rank, world):
    """Packed documents (check_packed), a sliding window inside them; what is not supported
    raises: a batch of several packed rows, a mask with documents, cu_seqlens that disagree with
    the positions, restarting position_ids or cu_seq_lens given to the model directly."""
    check_packed(make_model("llama"), [5, 1, 20, 9, 13], seed=6)  # the 20-token one crosses the ranks
    check_packed(make_model("mistral", sliding_window=6), [30, 2, 16], seed=7, dtype=torch.float64)
    check_packed(make_model("mistral", sliding_window=6), [30, 2, 16], seed=7, dtype=torch.float64, sliding_window=6)
    ids, pos, labels, cu = packed_batch(8, [10, 14, 24])
    _raises(ValueError, "sliding_window must be None or a positive", lambda: rhf.shard_inputs(ids, sliding_window=0))
    two = (ids.expand(2, -1), pos.expand(2, -1))
    _raises(NotImplementedError, "batch of 2 rows", lambda: rhf.shard_inputs(two[0], position_ids=two[1]))
    _raises(
        NotImplementedError,
        "attention_mask together with packed",
        lambda: rhf.shard_inputs(ids, cu_seqlens=cu, attention_mask=torch.ones_like(ids)),
    )
    _raises(ValueError, "position_ids restart at", lambda: rhf.shard_inputs(ids, position_ids=pos, cu_seqlens=[0, 48]))
    _raises(ValueError, "must end at the sequence length 48", lambda: rhf.shard_inputs(ids, cu_seqlens=[0, 40]))
    model = rhf.apply(make_model("llama"), layout="contiguous")
    # position_ids that restart, given to the model without shard_inputs (each rank's part looks
    # like one document: contiguous layout, documents cut exactly at the shard boundary)
    ids, _ = make_batch(6, "none")
    half = torch.arange(S // 2)
    local = dict(input_ids=rhf.shard_inputs(ids, layout="contiguous")["input_ids"], position_ids=half.expand(2, -1))
    _raises(NotImplementedError, "packed sequences", lambda: model(**local))
    # with an attention mask transformers does not look for documents either: plain causal + RoPE
    packed = torch.cat([half, half]).expand(2, S)
    batch = rhf.shard_inputs(ids, position_ids=packed, attention_mask=torch.ones_like(ids), layout="contiguous")
    assert torch.isfinite(model(**batch).loss)
    # flash-attention style boundaries given to the model
    batch = rhf.shard_inputs(ids, layout="contiguous")
    cu = torch.tensor([0, S // 2, S], dtype=torch.int32)
    _raises(
        NotImplementedError,
        "cu_seq_lens_q",
        lambda: model(**batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=S // 2, max_length_k=S // 2),
    )


def _trap_unsupported(rank, world):
    """4D masks and output_attentions raise; a sliding window shorter than the sequence gives
    one process's loss; dropout in training drops the pairs one process drops."""
    ids, mask = make_batch(7, "mixed")
    batch = rhf.shard_inputs(ids, attention_mask=mask)
    window = make_model("mistral", sliding_window=16)
    got = ring_run(copy.deepcopy(window), ids, mask)[0]
    want, want64 = (reference(window, ids, mask, dtype=d)[0] for d in (torch.float32, torch.float64))
    check_close("sliding window loss", got, want64, want, torch.float32)
    unbounded = reference(make_model("mistral", sliding_window=None), ids, mask)[0]
    assert abs(unbounded.item() - want.item()) > 1e-4 * abs(want.item())  # the window binds: 2e-3 here
    wide = rhf.apply(make_model("mistral", sliding_window=S))  # a window as long as the sequence binds nothing
    assert torch.isfinite(wide(**batch).loss)

    # attention dropout in training: the ring drops the pairs one process drops (the same seed
    # per layer call), so the losses agree; eval mode drops nothing
    dropout = make_model("llama", attention_dropout=0.1)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    dropout.train()
    torch.manual_seed(5)
    got = ring_run(copy.deepcopy(dropout), ids, mask)[0]
    torch.manual_seed(5)
    one = ring_run(copy.deepcopy(dropout), ids, mask, group=alone)[0]
    # the reference: the same pairs dropped in float64; the baseline: the one-process run (sdpa
    # cannot drop the same pairs)
    torch.manual_seed(5)
    one64 = ring_run(to_dtype(dropout, torch.float64), ids, mask, group=alone)[0]
    check_close("dropout loss", got, one64, one, torch.float32)
    dropout.eval()
    want, want64 = (reference(dropout, ids, mask, dtype=d)[0] for d in (torch.float32, torch.float64))
    assert abs(got.item() - want.item()) > 1e-4 * abs(want.item())  # 6e-4 here: the dropout's effect
    ring = rhf.apply(copy.deepcopy(dropout)).eval()
    got = ring(**batch).loss.detach()
    dist.all_reduce(got)
    check_close("eval loss with dropout configured", got, want64, want, torch.float32)

    model = rhf.apply(make_model("llama"))
    four_d = torch.zeros(2, 1, S // 2, S // 2)
    _raises(NotImplementedError, "4-D attention mask", lambda: model(**{**batch, "attention_mask": four_d}))
    _raises(NotImplementedError, "output_attentions", lambda: model(**batch, output_attentions=True))


def _trap_mask_dropped(rank, world):
    """Without a registered mask function transformers drops the 2D mask for a custom name (left
    padding silently wrong): the attention notices that the forward had a mask and raises."""
    from transformers.masking_utils import AttentionMaskInterface

    model = rhf.apply(make_model("llama"))
    ids, mask = make_batch(8, "mixed")
    batch = rhf.shard_inputs(ids, attention_mask=mask)
    saved = AttentionMaskInterface._global_mapping.pop(rhf.ATTN_IMPLEMENTATION)
    try:
        _raises(RuntimeError, "attention received none", lambda: model(**batch))
    finally:
        AttentionMaskInterface.register(rhf.ATTN_IMPLEMENTATION, saved)
    assert torch.isfinite(model(**batch).loss)


def _trap_generation(rank, world):
    """With a KV cache (generate(), or a cache passed in) each rank computes locally on its whole
    input: the same tokens and logits as transformers' sdpa."""
    ref = make_model("llama", dtype=torch.float64)
    model = rhf.apply(copy.deepcopy(ref))
    ids, mask = make_batch(9, "none", length=12)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding, as for generation
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    assert torch.equal(copy.deepcopy(model).generate(ids, **kw), ref.generate(ids, **kw))  # the copy's own
    # without a cache every step recomputes the whole prefix: still local inside generate()
    assert torch.equal(model.generate(ids, use_cache=False, **kw), ref.generate(ids, **kw))
    # prefill then two decoding steps, against sdpa with the same caches (and sdpa in float32,
    # whose error, scaled to float64's precision, bounds ours)
    models = (model, ref, copy.deepcopy(ref).float())
    caches = [transformers.DynamicCache(config=m.config) for m in models]
    name = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"  # renamed in 5.x
    outs = [m(input_ids=ids, attention_mask=mask, **{name: c}, use_cache=True) for m, c in zip(models, caches)]
    for step in range(3):
        check_close(f"logits after {step} decoding steps", *(o.logits for o in outs), torch.float64)
        if step == 2:
            break
        nxt = outs[1].logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        outs = [m(input_ids=nxt, attention_mask=mask, **{name: c}, use_cache=True) for m, c in zip(models, caches)]


TRAPS_2 = [
    _trap_hf_defaults,
    _trap_padding_on_one_rank,
    _trap_rank_without_labels,
    _trap_pad_to_divisible,
    _trap_packed,
    _trap_unsupported,
    _trap_mask_dropped,
    _trap_generation,
]


def _world2(rank, world):
    torch.set_num_threads(1)
    for case in CASES_2:
        _case(case)
    for trap in TRAPS_2:
        trap(rank, world)


def test_two_ranks():
    """Every family, padding left and right, float32 and float64, both layouts, gradient
    checkpointing; then the traps (see each _trap_ docstring)."""
    run_world(_world2, 2, env=ENV)


# ----------------------------------------------------------------------------- 4 ranks, and DP x SP


def _dp_sp(rank, world):
    """A 2 x 2 mesh: sequence parallelism on ranks {0, 1} and {2, 3}, data parallelism across.
    (a) allreduce_grads over the SP group, then the DP average: the mean of the two one-process
    gradients. (b) DDP over all 4 ranks averages over SP too, so the loss is scaled by the SP size."""
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sp, dp = sp_groups[rank // 2], dp_groups[rank % 2]
    model = make_model("llama")
    batches = [make_batch(20 + i, "mixed") for i in range(2)]  # one batch per SP group
    # one process's float64 run the reference, its float32 run the plain baseline
    refs = {d: [reference(model, ids, mask, dtype=d) for ids, mask in batches] for d in (torch.float64, torch.float32)}
    want = {d: {n: (r[0][1][n] + r[1][1][n]) / 2 for n in r[0][1]} for d, r in refs.items()}
    ids, mask = batches[rank // 2]
    mine = {d: r[rank // 2] for d, r in refs.items()}

    loss, grads, _ = ring_run(model, ids, mask, group=sp)
    check_close("SP loss", loss, mine[torch.float64][0], mine[torch.float32][0], torch.float32)
    for n, g in grads.items():
        dist.all_reduce(g, group=dp)
        check_close(f"SP x DP grad {n}", g / 2, want[torch.float64][n], want[torch.float32][n], torch.float32)

    ddp = torch.nn.parallel.DistributedDataParallel(rhf.apply(copy.deepcopy(model), group=sp))
    out = ddp(**rhf.shard_inputs(ids, attention_mask=mask, group=sp))
    (out.loss * dist.get_world_size(sp)).backward()
    for n, p in ddp.module.named_parameters():
        check_close(f"DDP grad {n}", p.grad, want[torch.float64][n], want[torch.float32][n], torch.float32)


# hybrid: a 2 x 2 grid (ring of 2, head group of 2), 4 q / 2 kv heads: one kv head per rank
CASES_HYBRID = [
    dict(family="llama", padding="mixed"),  # row 0 left-padded (7 tokens), row 1 right-padded (5)
    dict(family="qwen2", padding="mixed", dtype=torch.float64, layout="contiguous", positions="from_mask"),
    dict(family="llama", padding="mixed", checkpointing=True, labels="random_ignore", seed=2),
    # bfloat16 autocast, MQA: the one kv head goes to both ranks of a head group (gradients summed back)
    dict(family="llama", padding="mixed", dtype=torch.bfloat16, config=dict(num_key_value_heads=1)),
]


def _hybrid(rank, world):
    """apply / shard_inputs / allreduce_grads with a head_group on a 2 x 2 grid (hybrid_cases.grid:
    rings {0, 2} and {1, 3}, head groups {0, 1} and {2, 3}). The loss summed over the 4 ranks and
    every gradient summed over the grid against one process (CASES_HYBRID); a sliding window and
    dropout flow through to the ring; what does not fit the grid raises; compiled with
    fullgraph, the eager results."""
    from torch.distributed.device_mesh import init_device_mesh

    from ringflash import local_positions

    from hybrid_cases import grid

    group, head_group = grid(2, 2)
    for case in CASES_HYBRID:
        _case(case, group=group, head_group=head_group)
    check_packed(make_model("qwen2"), [3, 22, 1, 14, 7], seed=9, group=group, head_group=head_group)

    # the pieces of the R x U grid, as ringflash.shard / local_positions place them; a 2-D mesh is the same grid
    ids, mask = make_batch(30, "mixed")
    batch = rhf.shard_inputs(ids, attention_mask=mask, group=group, head_group=head_group)
    pos = local_positions(S, group=group, head_group=head_group)
    assert pos.numel() == S // 4 and torch.equal(batch["position_ids"][0], pos)
    assert torch.equal(batch["input_ids"], ids[:, pos]) and torch.equal(batch["attention_mask"], mask[:, pos])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "heads"))
    by_mesh = rhf.shard_inputs(ids, attention_mask=mask, group=mesh)
    assert all(torch.equal(by_mesh[k], batch[k]) for k in ("input_ids", "attention_mask", "position_ids", "labels"))
    # lengths: S must divide into 2 R U = 8 pieces (zigzag), R U = 4 (contiguous); pad=True pads to that
    short, short_mask = ids[:, :42], mask[:, :42]
    _raises(
        ValueError,
        r"sequence length 42 does not divide into 8 .* \(e\.g\. 40 or 48\)",
        lambda: rhf.shard_inputs(short, attention_mask=short_mask, group=group, head_group=head_group),
    )
    padded = rhf.shard_inputs(short, attention_mask=short_mask, group=group, head_group=head_group, pad=True)
    assert padded["input_ids"].shape == (2, 12)  # 48 tokens
    contiguous = dict(group=group, head_group=head_group, layout="contiguous", pad=True)
    assert rhf.shard_inputs(short, **contiguous)["input_ids"].shape == (2, 11)  # 44 tokens

    # heads that do not split over the head group: apply() raises, naming the counts and the sizes that work
    for over, counts, works in (
        (dict(num_attention_heads=3, num_key_value_heads=1), "q heads 3 / k/v heads 1", "[1, 3]"),
        (dict(num_attention_heads=6, num_key_value_heads=3), "q heads 6 / k/v heads 3", "[1, 3, 6]"),
    ):
        odd = make_model("llama", num_hidden_layers=1, hidden_size=48, **over)  # 48: a multiple of 3 and 6
        for kw in (dict(group=group, head_group=head_group), dict(group=mesh)):
            _raises(
                ValueError,
                rf"head_group of 2 ranks .*{counts}.* sizes that work: \{works}",
                lambda: rhf.apply(odd, **kw),
            )
        assert odd.config._attn_implementation == "sdpa"  # left as it was

    # a sliding window shorter than the sequence and attention dropout (float64: the grid and one
    # process agree far below either's effect, checked below)
    alone = [dist.new_group([r]) for r in range(world)][rank]

    def dropout_loss(dtype, **kw):
        model = make_model("mistral", dtype=dtype, sliding_window=16, attention_dropout=0.1)
        model.loss_function = causal_lm_loss64
        torch.manual_seed(5)
        return model, ring_run(model.train(), ids, mask, drop=("position_ids",), **kw)[0].detach()

    model, grid = dropout_loss(torch.float64, group=group, head_group=head_group)
    one = dropout_loss(torch.float64, group=alone)[1]
    # the bound: one process's float32 error, scaled to float64's precision
    check_close("grid loss with dropout", grid, one, dropout_loss(torch.float32, group=alone)[1], torch.float64)
    no_dropout = ring_run(model.eval(), ids, mask, group=alone)[0].item()
    unbounded = make_model("mistral", dtype=torch.float64, sliding_window=None)
    unbounded.loss_function = causal_lm_loss64
    no_window = ring_run(unbounded, ids, mask, group=alone)[0].item()
    # both bind: dropout changes the loss (6e-4 of it here), and without dropout so does the window (4e-4)
    for what, a, b in (("dropout", no_dropout, one.item()), ("window", no_window, no_dropout)):
        assert abs(a - b) > 1e-6 * b, (what, a, b)

    # gradients summed over the ring only would miss the head group's part: refused on every rank
    m = rhf.apply(make_model("llama", num_hidden_layers=1), group=group, head_group=head_group)
    m(**batch).loss.backward()
    _raises(ValueError, r"leave out rank\(s\) \[" + str(rank ^ 1) + r"\]", lambda: rhf.allreduce_grads(m, group=group))
    rhf.allreduce_grads(m, group=mesh)  # the 2-D mesh: the same grid
    # packed documents in two rows, and restarting position_ids given to the model directly, raise
    # on the grid too, on every rank
    packed = torch.cat([torch.arange(S // 2)] * 2).expand(2, S)
    _raises(
        NotImplementedError,
        "batch of 2 rows",
        lambda: rhf.shard_inputs(ids, position_ids=packed, group=group, head_group=head_group),
    )
    local = dict(input_ids=batch["input_ids"], position_ids=packed[:, pos])
    _raises(NotImplementedError, "packed sequences", lambda: m(**local))

    # torch.compile(fullgraph=True) of the applied model on the grid: no graph break, and this
    # rank's loss and gradients exactly the eager model's (the same hybrid operators run)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = []
    for fn in (m, torch.compile(m, fullgraph=True, backend="aot_eager")):
        m.zero_grad(set_to_none=True)
        loss = fn(**batch).loss
        loss.backward()
        runs.append([loss.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _world4(rank, world):
    torch.set_num_threads(1)
    for case in CASES_4:
        _case(case)
    _dp_sp(rank, world)
    _hybrid(rank, world)


def test_four_ranks():
    """A subset of the grid on 4 ranks, the data-parallel recipes of the README on a 2 x 2 mesh,
    and hybrid sequence parallelism (a head_group) on a 2 x 2 grid (see _hybrid)."""
    run_world(_world4, 4, env=ENV)


# ----------------------------------------------------------------------------- one process


@pytest.fixture
def torch_backend():
    with use_backend("torch"):
        yield


@pytest.mark.parametrize(
    "case",
    [
        dict(family="llama", padding="mixed"),
        dict(family="qwen2", padding="mixed", dtype=torch.float64),
        dict(family="mistral", padding="none", checkpointing=True),
        dict(family="mistral", padding="mixed", config=dict(sliding_window=16)),
        dict(
            family="qwen2",
            padding="none",
            dtype=torch.float64,
            config=dict(use_sliding_window=True, sliding_window=12, max_window_layers=1),
        ),
    ],
    ids=str,
)
def test_no_process_group_is_local(case, torch_backend):
    """No process group: local attention, the same loss and gradients as transformers' sdpa."""
    assert not dist.is_initialized()
    _case(case)


def test_names_and_registration(torch_backend):
    """The implementation's name has no "flash" (transformers would treat it as a flash kernel),
    and its mask function is registered (without one transformers drops the 2D mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils.generic import is_flash_attention_requested

    assert "flash" not in rhf.ATTN_IMPLEMENTATION
    model = rhf.apply(make_model("llama"))
    assert model.config._attn_implementation == rhf.ATTN_IMPLEMENTATION
    assert not is_flash_attention_requested(model.config)
    assert ALL_ATTENTION_FUNCTIONS[rhf.ATTN_IMPLEMENTATION] is rhf.ring_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[rhf.ATTN_IMPLEMENTATION] is rhf.ring_attention_mask
    # a mask without padding is handed through, never None (ranks must agree on its presence)
    ones = torch.ones(2, 8, dtype=torch.bool)
    assert torch.equal(rhf.ring_attention_mask(2, 8, 8, attention_mask=ones), ones)
    assert rhf.ring_attention_mask(2, 8, 8, attention_mask=None) is None
    # a cache's offset and length: the keys kv_offset .. kv_offset + kv_length, False past the mask
    got = rhf.ring_attention_mask(2, 1, 10, kv_offset=0, attention_mask=ones)
    assert got.shape == (2, 10) and bool(got[:, :8].all()) and not bool(got[:, 8:].any())


def test_unapply_restores(torch_backend):
    model = make_model("qwen2")
    ids, mask = make_batch(11, "mixed")
    before = model(input_ids=ids, attention_mask=mask).logits
    hooks = len(model.base_model._forward_pre_hooks)
    rhf.apply(model, layout="contiguous")
    rhf.apply(model)  # applying again rebinds, it does not stack hooks
    assert len(model.base_model._forward_pre_hooks) == hooks + 1
    assert "generate" in model.__dict__  # wrapped: every forward inside generate() is local
    twin = copy.deepcopy(model)
    rhf.unapply(twin)  # removes the copy's hook, not the original's
    assert len(twin.base_model._forward_pre_hooks) == hooks and "generate" not in twin.__dict__
    assert len(model.base_model._forward_pre_hooks) == hooks + 1
    assert rhf.unapply(model) is model
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__
    assert len(model.base_model._forward_pre_hooks) == hooks
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)
    with pytest.raises(ValueError, match="not prepared"):
        rhf.unapply(model)


def test_packed_one_process(torch_backend):
    """One process: a DataCollatorWithFlattening batch (restarting position_ids, no mask) given to
    the model directly raises (the positions alone do not reach the attention); through
    shard_inputs (position_ids, or its flash-attention cu_seq_lens_q as cu_seqlens) each document
    attends within itself: transformers' own sdpa loss and gradients for the same batch."""
    ref = make_model("llama")
    model = rhf.apply(copy.deepcopy(ref))
    docs = [{"input_ids": list(range(1, 9))}, {"input_ids": list(range(3, 9))}]
    batch = transformers.DataCollatorWithFlattening()(docs)
    assert "attention_mask" not in batch and batch["position_ids"][0, 8] == 0
    with pytest.raises(NotImplementedError, match="packed sequences"):
        model(**batch)
    ref32 = reference(ref, batch["input_ids"], None, batch["labels"], batch["position_ids"], use_cache=False)
    ref64 = reference(ref, batch["input_ids"], None, batch["labels"], batch["position_ids"], dtype=torch.float64,
                      use_cache=False)  # fmt: skip
    got = ring_run(ref, batch["input_ids"], None, batch["labels"], batch["position_ids"])[:2]
    compare("packed, one process", *got, ref64, ref32, torch.float32)
    flash = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(docs)
    with pytest.raises(NotImplementedError, match="cu_seq_lens"):
        model(**flash)
    got = ring_run(ref, flash["input_ids"], None, flash["labels"], None, cu_seqlens=flash["cu_seq_lens_q"])[:2]
    compare("packed by cu_seqlens, one process", *got, ref64, ref32, torch.float32)


def test_local_4d_mask_uses_sdpa(torch_backend):
    """Locally (no ring) a prepared 4D mask, as generate() makes for static caches, goes to
    transformers' own sdpa: its answer exactly."""
    ref = make_model("llama")
    model = rhf.apply(copy.deepcopy(ref))
    ids, _ = make_batch(12, "none", length=10)
    keep = torch.ones(10, 10).tril().bool()
    keep[:, :2] = True  # a custom pattern: a prefix every query sees
    four_d = torch.zeros(2, 1, 10, 10).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(
        model(input_ids=ids, attention_mask=four_d).logits, ref(input_ids=ids, attention_mask=four_d).logits
    )


def test_unsupported_attention_arguments_raise(torch_backend):
    model = rhf.apply(make_model("llama"))
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    for kw, what in (
        (dict(softcap=30.0), "softcapping"),
        (dict(s_aux=torch.zeros(4)), "sinks"),
        (dict(position_bias=torch.zeros(1, 4, 8, 8)), "position bias"),
        (dict(is_causal=False), "bidirectional"),
    ):
        with pytest.raises(NotImplementedError, match=what):
            rhf.ring_attention_forward(attn, q, kv, kv, None, scaling=0.25, **kw)


def test_argument_errors_name_the_argument(torch_backend):
    ids, mask = make_batch(13, "mixed")
    with pytest.raises(
        ValueError,
        match=r"attention_mask must have shape \(batch, seq_len\) = \(2, 48\), "
        r"got \(2, 47\)",
    ):
        rhf.shard_inputs(ids, attention_mask=mask[:, 1:])
    with pytest.raises(TypeError, match="labels must be an integer tensor, got torch.float32"):
        rhf.shard_inputs(ids, labels=ids.float())
    with pytest.raises(ValueError, match=r"position_ids must have shape \(2, 48\) or \(1, 48\), got \(48,\)"):
        rhf.shard_inputs(ids, position_ids=torch.arange(48))
    with pytest.raises(ValueError, match="num_items_in_batch must be a positive int"):
        rhf.shard_inputs(ids, num_items_in_batch=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        rhf.apply(make_model("llama"), layout="ring")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        rhf.apply(torch.nn.Linear(2, 2))
    from ringflash import balanced_layout

    packed = balanced_layout([0, 20, 48], 1)  # shard_inputs plans packed documents' layout itself
    with pytest.raises(NotImplementedError, match="a balanced layout .* is not supported: pass layout"):
        rhf.apply(make_model("llama"), layout=packed)
    with pytest.raises(NotImplementedError, match="a balanced layout .* is not supported: pass layout"):
        rhf.shard_inputs(ids, layout=packed)
    with pytest.raises(ValueError, match="head_group given without group"):
        rhf.shard_inputs(ids, head_group=torch.distributed.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match="group must be None, a torch.distributed ProcessGroup"):
        rhf.shard_inputs(ids, group="world")
    with pytest.raises(TypeError, match="pad must be a bool"):
        rhf.shard_inputs(ids, pad="yes")
    with pytest.raises(TypeError, match="position_ids must be an integer tensor"):
        rhf.shard_inputs(ids, position_ids=torch.arange(ids.shape[1], dtype=torch.float32)[None])
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=32))
    with pytest.raises(NotImplementedError, match="model_type 'gpt2' is not among the tested families"):
        rhf.apply(gpt2)


def test_shard_inputs_one_rank(torch_backend):
    """World 1: the labels are shifted once, on the whole sequence; the count is of label tokens."""
    ids, mask = make_batch(14, "mixed")
    batch = rhf.shard_inputs(ids, attention_mask=mask)
    labels = ids.masked_fill(mask == 0, -100)
    want = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    assert torch.equal(batch["shift_labels"], want) and batch["labels"] is batch["shift_labels"]
    assert batch["num_items_in_batch"].item() == int((want != -100).sum())
    assert torch.equal(batch["position_ids"], torch.arange(S)[None]) and batch["use_cache"] is False
    rhf.allreduce_grads(make_model("llama"))  # no process group: nothing to do


# ----------------------------------------------------------------------------- the example


def test_finetune_example_check(tmp_path):
    """examples/finetune_hf.py on 2 ranks (torchrun, gloo): its --check against one process passes."""
    from commands import TWO_RANKS, run

    args = ["--check", "--steps", "3", "--seq-len", "128", "--family", "qwen2", "--padding", "left"]
    out = run(TWO_RANKS + ["examples/finetune_hf.py", *args, "--log-every", "1"], tmp_path, timeout=300)
    assert "world 2 (gloo, cpu), qwen2" in out and "tok/s" in out, out
    assert out.count("gradients rel diff") == 3 and "check passed" in out, out
    assert "verdict: OK: 3 steps on 2 rank(s)" in out.strip().splitlines()[-1], out


def test_compiled_model_matches_eager(torch_backend):
    """torch.compile(fullgraph=True) of an applied model on one process: no graph break, and its
    loss and gradients as accurate as the eager model's (against float64); packed documents too."""
    from torch._dynamo.utils import counters

    model = make_model("llama", num_hidden_layers=1)  # one layer: tracing is the cost
    ids, mask = make_batch(3, "mixed")
    ref64 = reference(model, ids, mask, dtype=torch.float64)
    ref32 = reference(model, ids, mask, dtype=torch.float32)
    eager = ring_run(model, ids, mask)
    torch._dynamo.reset()
    counters.clear()
    m = rhf.apply(to_dtype(model, torch.float32))
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    batch = rhf.shard_inputs(ids, attention_mask=mask)
    m.zero_grad(set_to_none=True)
    out = compiled(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    assert not counters["graph_break"], dict(counters["graph_break"])
    compare("compiled", out.loss.detach(), grads, ref64, ref32, torch.float32)
    compare("eager", eager[0], eager[1], ref64, ref32, torch.float32)
    # packed documents through the same compiled model (flash_attn_varlen_func inside)
    ids, pos, labels, _ = packed_batch(4, [5, 1, 20, 9, 13])
    ref64 = reference(model, ids, None, labels, pos, dtype=torch.float64, use_cache=False)
    ref32 = reference(model, ids, None, labels, pos, use_cache=False)
    m.zero_grad(set_to_none=True)
    out = compiled(**rhf.shard_inputs(ids, labels=labels, position_ids=pos))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    assert not counters["graph_break"], dict(counters["graph_break"])
    compare("compiled, packed", out.loss.detach(), grads, ref64, ref32, torch.float32)


def _sparse_grad_on_one_rank(rank, world):
    """A sparse gradient on one rank only (the embedding got none on the other): that rank
    raises its error and the other a ValueError, neither waits in the reduction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    x = model[0](torch.tensor([1, 2])) if rank == 0 else torch.randn(2, 4)
    model[1](x).sum().backward()
    pattern = "sparse or non-strided gradient" if rank == 0 else r"rank\(s\) \[0\] of the group rejected"
    with pytest.raises((NotImplementedError, ValueError), match=pattern):
        rhf.allreduce_grads(model)
    model[0].weight.grad = None
    rhf.allreduce_grads(model)  # the group still works
    assert model[0].weight.grad is None and model[1].weight.grad.shape == (2, 4)


def test_sparse_grad_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **ENV).run(_sparse_grad_on_one_rank)


def _pre_hook_inputs_on_one_rank(rank, world):
    """The pre-hook decides its path from what each rank was given: position_ids on rank 0
    alone (rank 0 would run the packed-positions check's collectives, rank 1 the ring's), or an
    input refused on rank 1 alone (a 3-D attention mask): every rank raises, none waits."""
    model = rhf.apply(make_model("llama", num_hidden_layers=1))
    ids, _ = make_batch(3, "none")
    batch = rhf.shard_inputs(ids)
    if rank == 1:
        batch.pop("position_ids")
    pattern = "disagree .*position_ids given: rank 0=1, rank 1=0"
    with pytest.raises(ValueError, match=pattern):
        model(**batch)
    batch = rhf.shard_inputs(ids)
    if rank == 1:
        batch["attention_mask"] = torch.ones(ids.shape[0], 1, batch["input_ids"].shape[1])
    pattern = "3-D attention mask" if rank == 1 else r"rank\(s\) \[1\] of the group rejected their inputs"
    with pytest.raises((NotImplementedError, ValueError), match=pattern):
        model(**batch)
    model(**rhf.shard_inputs(ids))  # the group still works


def test_pre_hook_inputs_on_one_rank_raise_on_every_rank(worlds):
    worlds(2, timeout=60, **ENV).run(_pre_hook_inputs_on_one_rank)


def _frozen_on_one_rank(rank, world):
    """A layer frozen on rank 1 alone: the ranks' trainable parameters differ, so the
    gradients' buckets would not match; every rank raises, none waits or sums mixed-up buckets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(rank == 0)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="disagree .*trainable parameters: rank 0=4, rank 1=2"):
        rhf.allreduce_grads(model)
    model[0].requires_grad_(True)
    model[0].weight.grad = model[0].bias.grad = None
    rhf.allreduce_grads(model)  # the group still works
    assert model[0].weight.grad is None and model[1].weight.grad.shape == (2, 4)


def test_frozen_layer_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **ENV).run(_frozen_on_one_rank)


def _head_group_on_one_rank(rank, world):
    """A head_group given to allreduce_grads or apply on rank 1 alone (a 2 x 1 grid there, the
    plain ring on rank 0), or one rank 1 cannot use (a 2-D DeviceMesh): every rank raises,
    naming head_group, none waits in another collective."""
    from torch.distributed.device_mesh import init_device_mesh

    solo = [dist.new_group([r]) for r in range(world)][rank]
    mesh = init_device_mesh("cpu", (world, 1))
    one, everyone = rank == 1, dist.group.WORLD
    given = r"disagree \(head_group size: rank 0=none, rank 1=1.*given on rank\(s\) \[1\] of the group only"
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 2)
    linear(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match=given):
        rhf.allreduce_grads(linear, group=everyone, head_group=solo if one else None)
    pattern = (
        "must be 1-D" if one else r"rank\(s\) \[1\] of the group rejected .*head_group as a DeviceMesh must be 1-D"
    )
    with pytest.raises(ValueError, match=pattern):
        rhf.allreduce_grads(linear, group=everyone, head_group=mesh if one else None)
    rhf.allreduce_grads(linear, group=everyone)  # the group still works
    model = rhf.apply(make_model("llama", num_hidden_layers=1), group=everyone, head_group=solo if one else None)
    ids, _ = make_batch(3, "none")
    with pytest.raises(ValueError, match=given):
        model(**rhf.shard_inputs(ids, group=everyone, head_group=solo if one else None))


def test_head_group_on_one_rank_raises_on_every_rank(worlds):
    worlds(2, timeout=60, **ENV).run(_head_group_on_one_rank)
