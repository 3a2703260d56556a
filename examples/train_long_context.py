"""Train a small GPT-style byte-level language model on ONE long sequence split across ranks.

Sequence parallelism: every rank holds all the parameters and 1/P of the tokens of each
sequence (its shard, layout zigzag or contiguous); attention runs on ringflash's ring, so each
token attends to the whole causal prefix although no rank ever holds the whole sequence.

    ringflash-run --nproc 2 examples/train_long_context.py            # CPU: gloo, ~1 min on 2 cores
    ringflash-run --nproc 2 examples/train_long_context.py --check    # and compare with one process
    ringflash-run --nproc 2 examples/train_long_context.py --packed --check              # packed documents
    ringflash-run --nproc 2 examples/train_long_context.py --packed --window 64 --check  # and a causal window
    python examples/train_long_context.py --steps 50                  # one process
    # 2 GPUs (NCCL), 128K tokens per sequence:
    ringflash-run --nproc 2 examples/train_long_context.py --seq-len 131072 \\
        --dtype bfloat16 --dim 512 --layers 4 --heads 8 --kv-heads 2 --steps 100 --log-every 5

--check: after the run, every rank also trains the same model (same seed, same data) in one
process on the full sequence with ringflash.flash_attn_func, for the first --check-steps
steps, and compares the per-step losses with the distributed run's; exit status 1 if they
differ by more than the tolerance (only meant for sizes one device can hold).

--packed: each step's sequence is one packed row of documents of random lengths (seeded, the
same on every rank; long-tailed, from 1 token to the whole row), as when training on packed
documents: a token attends only within its document, its RoPE position restarts at the
document's start, and a document's last token has no target. The ranks hold each step's
ringflash.balanced_layout shards (their sizes differ between ranks) and attend with
ring_flash_attn_varlen_func; --check's one process runs flash_attn_varlen_func on the whole row.
--window W: a causal sliding window of W keys (the token itself and the W - 1 before it).

The text is generated in-process from a seeded RNG (no downloads): paragraphs about characters
with made-up names, so there is both grammar to learn and names that can only be predicted by
looking back in the context.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringflash
from ringflash.dist_env import close, init_from_env

VOCAB = 256  # bytes
ROPE_BASE = 10000.0
IGNORE = -100  # a target with no token to predict (cross_entropy's ignore_index)


# ----------------------------------------------------------------------------- data

_SYLLABLES = ["ka", "lo", "mi", "zu", "ter", "bax", "ro", "ni", "vel", "qua", "dor", "shi", "pen", "yo"]
_VERBS = ["found", "lost", "painted", "carried", "sold", "hid", "borrowed", "fixed", "dropped", "counted"]
_THINGS = [
    "a red box",
    "the old map",
    "seven stones",
    "a tiny boat",
    "the blue lamp",
    "two keys",
    "a wooden spoon",
    "the silver coin",
    "three apples",
    "a broken clock",
]
_PLACES = [
    "near the river",
    "in the garden",
    "under the bridge",
    "at the market",
    "behind the mill",
    "on the hill",
    "in the kitchen",
    "by the sea",
]


def make_corpus(n_bytes: int, seed: int) -> torch.Tensor:
    """Deterministic synthetic text as uint8 bytes: paragraphs that introduce three made-up
    names and then tell short sentences about them."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(3)]
        text = f"once there were {names[0]}, {names[1]} and {names[2]}. "
        for _ in range(rng.randint(3, 8)):
            text += f"{rng.choice(names)} {rng.choice(_VERBS)} {rng.choice(_THINGS)} {rng.choice(_PLACES)}. "
        text += f"in the end {rng.choice(names)} went home.\n"
        parts.append(text)
        size += len(text)
    return torch.frombuffer(bytearray("".join(parts).encode()[:n_bytes]), dtype=torch.uint8)


def get_sequence(corpus: torch.Tensor, step: int, seq_len: int, seed: int):
    """The step's (inputs, targets), each (1, seq_len) int64: a window of seq_len + 1 bytes at an
    offset that depends only on (seed, step), so every rank and the --check run see the same data."""
    start = random.Random(seed * 1_000_003 + step).randrange(len(corpus) - seq_len)
    window = corpus[start : start + seq_len + 1].long()
    return window[None, :-1], window[None, 1:]


def get_packed_row(corpus: torch.Tensor, step: int, seq_len: int, seed: int):
    """The step's sequence (get_sequence) cut into documents: (inputs, targets, cu_seqlens),
    cu_seqlens int32 (n_docs + 1,). Document lengths are log-uniform between 1 token and the
    whole row, from their own seeded stream: many short documents and a few long ones, the
    same on every rank. A document's last token gets target IGNORE: its next byte belongs to
    the next document, which it cannot see."""
    inputs, targets = get_sequence(corpus, step, seq_len, seed)
    rng = random.Random(f"documents {seed} {step}")
    bounds = [0]
    while bounds[-1] < seq_len:
        bounds.append(min(bounds[-1] + int(math.exp(rng.uniform(0.0, math.log(seq_len + 1)))), seq_len))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    targets = targets.clone()
    targets[0, cu_seqlens[1:].long() - 1] = IGNORE
    return inputs, targets, cu_seqlens


# ----------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()  # the statistics in float32 under bf16 autocast
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


def rope_tables(positions: torch.Tensor, head_dim: int):
    """cos, sin (S, head_dim / 2) in float32 for the given token positions."""
    inv_freq = ROPE_BASE ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate the two halves of each head of x (B, S, H, D) (GPT-NeoX style)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin, attn_fn):
        """attn_fn: (q, k, v) -> out, all (B, S, heads, head_dim)."""
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.head_dim)
        k, v = self.wkv(x).view(B, S, 2, self.n_kv_heads, self.head_dim).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # The attention kernels take q, k, v in one dtype and keep their own float32 state:
        # run them outside autocast, in the dtype the projections produced.
        with torch.autocast(x.device.type, enabled=False):
            out = attn_fn(q, k.to(q.dtype), v.to(q.dtype))
        return self.wo(out.reshape(B, S, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim):
        super().__init__()
        hidden = 4 * dim * 2 // 3
        self.w_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, n_heads, n_kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim)

    def forward(self, x, cos, sin, attn_fn):
        x = x + self.attn(self.attn_norm(x), cos, sin, attn_fn)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only LM over bytes. The attention function (forward's attn_fn) and the positions
    are the only things that differ between the sequence-parallel model (ring attention on the
    local shard) and the one-process reference (flash attention on the full sequence)."""

    def __init__(self, dim, n_layers, n_heads, n_kv_heads):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.head_dim = dim // n_heads
        for name, p in self.named_parameters():  # small init; output projections scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, positions, attn_fn):
        """tokens (B, S) int64, their RoPE positions (S,) (GLOBAL positions; within the document
        for packed rows) and attn_fn (q, k, v) -> out (B, S, heads, head_dim) -> logits (B, S, VOCAB)."""
        cos, sin = rope_tables(positions, self.head_dim)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin, attn_fn)
        return F.linear(self.norm(x), self.embed.weight)  # LM head tied to the embedding


# ----------------------------------------------------------------------------- training


def all_reduce_grads(model: nn.Module) -> None:
    """Each rank's gradients are partial sums over its own tokens' loss terms (ring attention
    already sends dK/dV home across ranks): summing them over ranks gives the full gradient.
    One flat buffer: a single collective per step."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def one_row(varlen_fn):
    """The model's (1, S, heads, head_dim) q, k, v as the packed (S, heads, head_dim) tensors
    the varlen functions take, and their output back."""
    return lambda q, k, v: varlen_fn(q[0], k[0], v[0])[None]


def step_batch(args, corpus, device, step: int, *, distributed: bool):
    """This process's part of the step's data: (inputs, targets, positions, attn_fn, n_targets).

    inputs and targets (1, S_local), RoPE positions (S_local,), attn_fn the attention for the
    model, n_targets the number of targets in the WHOLE sequence (the loss's denominator on
    every rank). distributed=True: this rank's shard, ring attention over the default process
    group; False: the full sequence, one-device attention (the --check reference)."""
    window = (args.window - 1, 0) if args.window else (-1, -1)
    if args.packed:
        inputs, targets, cu_seqlens = get_packed_row(corpus, step, args.seq_len, args.seed)
    else:
        inputs, targets = get_sequence(corpus, step, args.seq_len, args.seed)
    # counted before sharding: the same on every rank (at least 1: a row of one-token documents
    # has no target, and its loss is then 0, not 0 / 0)
    n_targets = max(int((targets != IGNORE).sum()), 1)
    inputs, targets = inputs.to(device), targets.to(device)
    if not distributed:
        positions = torch.arange(args.seq_len, device=device)
        if args.packed:
            # positions restart at each document (the distributed run's document_positions)
            doc_lens = cu_seqlens.diff().long()
            positions -= cu_seqlens[:-1].long().repeat_interleave(doc_lens).to(device)
            cu, longest = cu_seqlens.to(device), int(doc_lens.max())
            attn_fn = one_row(
                partial(ringflash.flash_attn_varlen_func, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                        max_seqlen_k=longest, causal=True, window_size=window)
            )  # fmt: skip
        else:
            attn_fn = partial(ringflash.flash_attn_func, causal=True, window_size=window)
        return inputs, targets, positions, attn_fn, n_targets
    # --grad-accum input: the ring's gradient accumulators in the attention inputs' 16-bit
    # dtype (autocast's bfloat16), which lets a longer sequence fit (README: Memory)
    accum = torch.bfloat16 if args.grad_accum == "input" and args.dtype == "bfloat16" else None
    ring = dict(causal=True, window_size=window, grad_accum_dtype=accum)
    if args.packed:  # a new set of documents every step: a new balanced layout every step
        world = dist.get_world_size() if dist.is_initialized() else 1
        layout = ringflash.balanced_layout(cu_seqlens, world, causal=True, window_size=window)
        attn_fn = one_row(
            partial(ringflash.ring_flash_attn_varlen_func, cu_seqlens=cu_seqlens.to(device), layout=layout, **ring)
        )
    else:
        layout = args.layout
        attn_fn = partial(ringflash.ring_flash_attn_func, layout=layout, **ring)
    # inputs, targets and positions in the same layout as attention
    inputs, targets = (ringflash.shard(t, layout=layout) for t in (inputs, targets))
    positions = ringflash.local_positions(args.seq_len, layout=layout, device=device)
    if args.packed:
        # RoPE restarting at each document: a document's angles are those it has alone. (RoPE
        # scores depend only on offsets within a document, so the losses do not show this.)
        positions = layout.document_positions(positions)
    return inputs, targets, positions, attn_fn, n_targets


def train(args, corpus, device, *, distributed: bool, steps: int, log=None) -> list[float]:
    """Train a fresh model (seed args.seed) for `steps` steps; return the global loss per step.

    distributed=True: this rank's shard of each sequence, ring attention over the default
    process group, gradients summed over ranks. False: the full sequence in this process,
    one-device flash attention (the --check reference)."""
    world = dist.get_world_size() if distributed and dist.is_initialized() else 1
    torch.manual_seed(args.seed)  # identical parameters on every rank and in the reference
    model = GPT(args.dim, args.layers, args.heads, args.kv_heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    losses = []
    for step in range(steps):
        inputs, targets, positions, attn_fn, n_targets = step_batch(args, corpus, device, step, distributed=distributed)
        with autocast:
            logits = model(inputs, positions, attn_fn)
        # sum over local targets / global target count: summed over ranks, the mean loss, however
        # unequal the ranks' shards (balanced layouts) and wherever the ignored targets fall
        loss_sum = F.cross_entropy(
            logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        (loss_sum / n_targets).backward()
        loss_sum = loss_sum.detach()
        if world > 1:
            all_reduce_grads(model)
            dist.all_reduce(loss_sum)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # same grads everywhere: same clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum.item() / n_targets)  # .item() also syncs the GPU for timing
        if log:
            log(step, losses[-1])
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (all ranks together)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument(
        "--layout",
        choices=["zigzag", "contiguous"],
        help="how the sequence is sharded (default zigzag); --packed: balanced_layout, every step",
    )
    p.add_argument("--packed", action="store_true", help="packed documents of random lengths (see above)")
    p.add_argument("--window", type=int, help="a causal sliding window of this many keys (default: none)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="bfloat16: autocast the matmuls and attention (float32 weights and optimizer)",
    )
    p.add_argument(
        "--grad-accum",
        choices=["float32", "input"],
        default="float32",
        help="the ring's gradient accumulators: float32 (exact), or with --dtype bfloat16 the "
        "inputs' bfloat16 (less memory, gradient error growing with the number of ranks)",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--check", action="store_true", help="compare with a one-process run (see above)")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = p.parse_args(argv)
    if min(args.steps, args.check_steps, args.log_every, args.seq_len, 1 if args.window is None else args.window) < 1:
        p.error("--steps, --check-steps, --log-every, --seq-len and --window must be positive")
    if args.packed and args.layout:
        p.error("--packed lays each step's documents out with balanced_layout: --layout is for the unpacked sequence")
    if not args.packed:
        args.layout = args.layout or "zigzag"
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error("--dim must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if (args.dim // args.heads) % 2:
        p.error("head dim (--dim / --heads) must be even for RoPE")
    return args


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    rank, world, device = init_from_env(timeout_s=args.timeout)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    parts = world * (2 if args.layout == "zigzag" else 1)
    if not args.packed and args.seq_len % parts:  # a balanced layout takes any length
        lo = args.seq_len // parts * parts
        say(
            f"--seq-len {args.seq_len} does not split into {parts} equal chunks for layout {args.layout!r} on "
            f"{world} ranks: use a multiple of {parts}, e.g. {lo or parts} or {lo + parts}"
        )
        close()
        return 2
    backend = dist.get_backend() if dist.is_initialized() else "none"
    accum = "bfloat16" if args.grad_accum == "input" and args.dtype == "bfloat16" else "float32"
    if args.packed:
        shards = "packed documents of random lengths, shards balanced per step (sizes differ)"
    else:
        shards = f"{args.seq_len // world} per rank"
    say(
        f"world {world} ({backend}, {device.type}), layout {args.layout or 'balanced'}, {args.dtype}, {accum} "
        f"gradient accumulators: sequence of {args.seq_len} tokens, {shards}"
        f"{f', causal window of {args.window} keys' if args.window else ''}; dim {args.dim}, {args.layers} layers, "
        f"{args.heads} heads / {args.kv_heads} kv heads"
    )
    corpus = make_corpus(max(4 * (args.seq_len + 1), 1 << 18), args.seed)

    clock = {"t": 0.0, "step": 1}

    def log(step, loss):
        done = step + 1
        if done == 1:  # the first step pays for warm-up (connections, kernel compiles): not timed
            say(f"step {done:5d}/{args.steps}  loss {loss:.4f}  (warm-up)")
            clock["t"] = time.perf_counter()
        elif done % args.log_every == 0 or done == args.steps:
            now = time.perf_counter()
            tok_s = (done - clock["step"]) * args.seq_len / (now - clock["t"])  # global tokens
            say(f"step {done:5d}/{args.steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s")
            clock.update(t=now, step=done)

    losses = train(args, corpus, device, distributed=True, steps=args.steps, log=log)
    say(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    status = 0
    if args.steps >= 50 and not losses[-1] < 0.75 * losses[0]:
        say("FAILED: the loss did not fall by 25%")
        status = 1

    if args.check:
        n = min(args.check_steps, args.steps)
        ref = train(args, corpus, device, distributed=False, steps=n)
        # float32: only summation order differs. bf16: rounding of activations differs too.
        rtol = 1e-4 if args.dtype == "float32" else 2e-2
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        single = "flash_attn_varlen_func" if args.packed else "flash_attn_func"
        say(f"check: {world}-rank ring vs 1-process {single}, first {n} steps (rtol {rtol:g})")
        for i, (a, b) in enumerate(zip(losses, ref)):
            say(f"  step {i + 1}: ring {a:.6f}  single {b:.6f}  rel diff {abs(a - b) / abs(b):.1e}")
        if worst <= rtol:
            say(f"check passed: max rel diff {worst:.1e}")
        else:
            say(f"check FAILED: max rel diff {worst:.1e} > {rtol:g}")
            status = 1
    close()
    verdict = "OK" if status == 0 else "FAILED"
    say(
        f"{verdict}: {args.steps} steps on {world} rank(s), loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        f"{', check passed' if args.check and status == 0 else ''}; total {time.perf_counter() - started:.1f} s"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
