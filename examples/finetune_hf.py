"""Fine-tune a transformers causal LM (Llama / Qwen2 / Mistral family, random weights from a config:
nothing is downloaded) at long context, each sequence sharded over the ranks with ringflash.hf.

    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/finetune_hf.py   # CPU: gloo
    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/finetune_hf.py --check
    python examples/finetune_hf.py --steps 20                      # one process (local attention)
    # 2 GPUs (NCCL), 128K tokens per sequence:
    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/finetune_hf.py \\
        --seq-len 131072 --hidden 1024 --layers 8 --heads 16 --kv-heads 4 --dtype bfloat16 --steps 50

(launch/run.sh examples/finetune_hf.py ... does the same with ringflash's defaults.) The model's
attention runs on the ring (ringflash.hf.apply); each step gives every rank its shard of the batch
(ringflash.hf.shard_inputs: global positions, labels shifted on the whole sequence, the global
label count), back-propagates its part of the loss and sums the gradients over the ranks
(ringflash.hf.allreduce_grads), so every rank takes the optimizer step one device would take.

--check: rank 0 also trains the same model (same seed, same batches) in one process on the whole
batch with transformers' own sdpa attention for --check-steps steps, and compares each step's loss
and gradients (before clipping) with the ring's; exit status 1 beyond the tolerance (only meant for
sizes one device can hold). --compile: torch.compile the model; each attention call on the ring is
one opaque operator for its forward and one for its backward (ringflash/ops.py), so the ring's
exchanges break no graph (fullgraph=True works too); a failure is reported as such (exit status 2).
The last line is a one-line verdict with the total time, imports and process-group start included.

The text is generated in-process (examples/train_long_context.py's synthetic stories, as bytes:
vocabulary 256, byte 0 is the padding token).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the verdict's total time includes the imports and the process-group start

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_long_context import make_corpus  # noqa: E402  (the same synthetic text)

import ringflash.hf as rhf  # noqa: E402
from ringflash.dist_env import close, init_from_env  # noqa: E402

VOCAB, PAD = 256, 0
FAMILIES = ("llama", "qwen2", "mistral")


def make_model(args, device, attn):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[
        args.family
    ]
    extra = {"sliding_window": None} if args.family == "mistral" else {}
    config = cls(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(args.seq_len, 2048),
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        **extra,
    )
    torch.manual_seed(args.seed)  # the same weights on every rank and in the --check reference
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device)


def get_batch(corpus, step, args):
    """The step's (input_ids, attention_mask), (batch, seq_len) each, the same on every rank.
    --padding left/right: every row but the first has 50-100% real tokens, the rest padding."""
    rng = random.Random(args.seed * 1_000_003 + step)
    ids = torch.full((args.batch, args.seq_len), PAD, dtype=torch.int64)
    mask = torch.zeros(args.batch, args.seq_len, dtype=torch.int64)
    for b in range(args.batch):
        n = args.seq_len if args.padding == "none" or b == 0 else rng.randint(args.seq_len // 2, args.seq_len)
        start = rng.randrange(len(corpus) - n)
        row = corpus[start : start + n].long()
        where = slice(args.seq_len - n, None) if args.padding == "left" else slice(0, n)
        ids[b, where], mask[b, where] = row, 1
    return ids, (None if args.padding == "none" else mask)


def train(args, corpus, device, *, ring: bool, steps: int, log=None, keep_grads=0):
    """Train a fresh model for `steps` steps; return (global loss per step, flat float32 gradients of
    the first keep_grads steps). ring: sharded over the default group with ringflash.hf; else the
    whole batch in this process with transformers' sdpa attention."""
    model = make_model(args, device, attn="sdpa")
    if ring:
        rhf.apply(model, layout=args.layout)
    if args.checkpointing:  # activation_checkpointing_enable in later transformers 5.x
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    step_fn = model
    if ring and args.compile:
        step_fn = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
    losses, grads = [], []
    for step in range(steps):
        ids, mask = (t if t is None else t.to(device) for t in get_batch(corpus, step, args))
        if ring:
            batch = rhf.shard_inputs(ids, attention_mask=mask, layout=args.layout)
        else:
            labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
            batch = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        with autocast:
            loss = step_fn(**batch).loss
        loss.backward()
        loss = loss.detach().float()
        if ring:
            rhf.allreduce_grads(model)  # the SUM over ranks: one device's gradients
            if dist.is_initialized():
                dist.all_reduce(loss)  # the ranks' parts add up to the batch's loss
        if step < keep_grads:
            grads.append(torch.cat([p.grad.float().reshape(-1).cpu() for p in model.parameters()]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the same gradients everywhere: same clip
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # .item() also waits for the GPU, for the timing
        if log:
            log(step, losses[-1])
    return losses, grads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (all ranks together)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--padding", choices=["none", "left", "right"], default="right")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="bfloat16: autocast (float32 weights and optimizer)",
    )
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the decoder layers")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (see above)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--check", action="store_true", help="compare with one process (see above)")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = p.parse_args(argv)
    if min(args.steps, args.check_steps, args.log_every, args.seq_len, args.batch) < 1:
        p.error("--steps, --check-steps, --log-every, --seq-len and --batch must be positive")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world, device = init_from_env(timeout_s=args.timeout)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    say(
        f"world {world} ({backend}, {device.type}), {args.family}, layout {args.layout}, {args.dtype}: "
        f"batch {args.batch} x {args.seq_len} tokens ({args.seq_len // world} per rank), {args.padding} padding; "
        f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads"
        + (", gradient checkpointing" if args.checkpointing else "")
        + (", torch.compile" if args.compile else "")
    )
    corpus = make_corpus(max(4 * args.seq_len, 1 << 18), args.seed)
    clock = {"t": 0.0, "step": 1}

    def log(step, loss):
        done = step + 1
        if done == 1:  # the first step pays for warm-up (connections, compiles): not timed
            say(f"step {done:5d}/{args.steps}  loss {loss:.4f}  (warm-up)")
            clock["t"] = time.perf_counter()
        elif done % args.log_every == 0 or done == args.steps:
            now = time.perf_counter()
            tok_s = (done - clock["step"]) * args.batch * args.seq_len / (now - clock["t"])  # global tokens
            say(f"step {done:5d}/{args.steps}  loss {loss:.4f}  {tok_s:,.0f} tok/s")
            clock.update(t=now, step=done)

    keep = min(args.check_steps, args.steps) if args.check else 0
    try:
        losses, grads = train(args, corpus, device, ring=True, steps=args.steps, log=log, keep_grads=keep)
    except Exception as e:
        if not args.compile:
            raise
        say(f"--compile: torch.compile of the model failed here ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
        say(
            f"verdict: FAILED (torch.compile of the model failed; run without --compile), "
            f"total {time.perf_counter() - T0:.1f} s"
        )
        close()
        return 2
    failures = []
    if not all(math.isfinite(x) for x in losses):
        failures.append("a loss is not finite")
    if args.steps >= 30 and not losses[-1] < 0.8 * losses[0]:
        failures.append("the loss did not fall by 20%")

    check = ""
    if args.check:
        ok = torch.ones(1)
        if rank == 0:
            ref_losses, ref_grads = train(args, corpus, device, ring=False, steps=keep, keep_grads=keep)
            # float32: summation order only; bfloat16: the activations' rounding differs too
            rtol = 1e-4 if args.dtype == "float32" else 5e-2
            say(f"check: {world}-rank ring vs 1-process sdpa, first {keep} steps (rtol {rtol:g})")
            worst = 0.0
            for i in range(keep):
                dl = abs(losses[i] - ref_losses[i]) / abs(ref_losses[i])
                dg = ((grads[i] - ref_grads[i]).norm() / ref_grads[i].norm()).item()
                worst = max(worst, dl, dg)
                say(
                    f"  step {i + 1}: loss ring {losses[i]:.6f} single {ref_losses[i]:.6f} rel diff {dl:.1e}; "
                    f"gradients rel diff {dg:.1e}"
                )
            ok[0] = float(worst <= rtol)
            check = f", check {'passed' if worst <= rtol else 'FAILED'} (max rel diff {worst:.1e})"
        if dist.is_initialized():
            dist.broadcast(ok, src=0)
        if not ok.item():
            failures.append("the check against one process failed")
    total = time.perf_counter() - T0
    say(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    verdict = "FAILED: " + "; ".join(failures) if failures else "OK"
    say(
        f"verdict: {verdict}: {args.steps} steps on {world} rank(s), loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        f"{check}, total {total:.1f} s"
    )
    close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
