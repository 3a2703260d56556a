"""Training with torch.compile on one device: a transformer of nn.TransformerEncoderLayer with
RingMultiheadAttention, and a Hugging Face Llama prepared by ringflash.hf, each trained for a
few steps eagerly and compiled (fullgraph), at 32K tokens by default.

    python -m benchmarks.compile_train                  # one GPU: bf16 autocast, inductor
    python -m benchmarks.compile_train --smoke          # tiny CPU run (CI keeps it working)

For each model: the first step's loss and gradients, eager and compiled under the same
autocast, are compared with an eager float32 step (autocast off): the compiled step's error may
be at most 2x the eager step's (floor: 2 ulps of the autocast dtype times the largest value).
Then both train `--steps` steps (AdamW, the same data) and their losses and tokens/s (median
step time after the first, which compiles) are printed side by side. The last line is the
verdict.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from ringflash.nn import RingMultiheadAttention


class RingTransformer(nn.Module):
    """Embedding, `layers` causal nn.TransformerEncoderLayer with RingMultiheadAttention, head."""

    def __init__(self, vocab, dim, heads, layers, device):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, device=device)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True, device=device
            )
            layer.self_attn = RingMultiheadAttention(dim, heads, batch_first=True, device=device)
            self.layers.append(layer)
        self.head = nn.Linear(dim, vocab, device=device)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, is_causal=True, src_mask=None)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def ring_transformer(args, device):
    torch.manual_seed(0)
    model = RingTransformer(args.vocab, args.dim, args.heads, args.layers, device)
    ids = torch.randint(0, args.vocab, (1, args.seq_len + 1), device=device, generator=_gen(device))
    return model, lambda m: m(ids[:, :-1], ids[:, 1:])


def hf_llama(args, device):
    import transformers

    import ringflash.hf as rhf

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device)
    rhf.apply(model)  # world 1: local attention through ringflash
    ids = torch.randint(0, args.vocab, (1, args.seq_len), device=device, generator=_gen(device))
    batch = rhf.shard_inputs(ids)
    return model, lambda m: m(**batch).loss


def _gen(device):
    return torch.Generator(device=device).manual_seed(1)


def _step_grads(model, loss_fn, autocast_dtype, device):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        loss = loss_fn(model)
    loss.backward()
    grads = torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])
    return loss.detach().double(), grads


def _err(a, b):
    return (a - b).abs().max().item()


def check_first_step(name, model, compiled, loss_fn, args, device):
    """Errors of the eager and compiled autocast steps against an eager float32 step."""
    ref_loss, ref_grads = _step_grads(model, loss_fn, None, device)
    e_loss, e_grads = _step_grads(model, loss_fn, args.autocast, device)
    c_loss, c_grads = _step_grads(compiled, loss_fn, args.autocast, device)
    eps = torch.finfo(args.autocast or torch.float32).eps
    ok, parts = True, []
    for what, ref, e, c in (("loss", ref_loss, e_loss, c_loss), ("grads", ref_grads, e_grads, c_grads)):
        bound = 2 * max(_err(e, ref), 2 * eps * ref.abs().max().item())
        good = _err(c, ref) <= bound
        ok &= good
        parts.append(f"{what} error eager {_err(e, ref):.3e} compiled {_err(c, ref):.3e} bound {bound:.3e}")
    print(f"{name}: first step vs eager float32: " + "; ".join(parts) + ("" if ok else "  FAILED"), flush=True)
    return ok


def train(model, loss_fn, args, device):
    """Losses and step times (s) of args.steps AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=args.autocast or torch.float32, enabled=args.autocast is not None):
            loss = loss_fn(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a host sync: the step is done
        times.append(time.perf_counter() - t0)
    return losses, times


def run_model(name, build, args, device):
    from torch._dynamo.utils import counters

    model, loss_fn = build(args, device)
    torch._dynamo.reset()
    counters.clear()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, fullgraph=True, backend=args.backend)
    ok = check_first_step(name, model, compiled, loss_fn, args, device)
    eager_model = copy.deepcopy(model)
    e_losses, e_times = train(eager_model, loss_fn, args, device)
    c_losses, c_times = train(compiled, loss_fn, args, device)
    breaks = sum(counters["graph_break"].values())
    ok &= breaks == 0
    tok = lambda times: args.seq_len / statistics.median(times[1:] if len(times) > 1 else times)
    row = {
        "model": name,
        "eager_losses": e_losses,
        "compiled_losses": c_losses,
        "eager_tok_s": tok(e_times),
        "compiled_tok_s": tok(c_times),
        "graph_breaks": breaks,
        "ok": ok,
    }
    for i, (a, b) in enumerate(zip(e_losses, c_losses), 1):
        print(f"{name}: step {i}/{args.steps} loss eager {a:.5f} compiled {b:.5f}", flush=True)
    print(
        f"{name}: {args.seq_len} tokens/step: eager {row['eager_tok_s']:.0f} tok/s, compiled "
        f"{row['compiled_tok_s']:.0f} tok/s ({row['compiled_tok_s'] / row['eager_tok_s']:.2f}x), "
        f"graph breaks {breaks}",
        flush=True,
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default=None, help="torch.compile backend (default: inductor; aot_eager with --smoke)")
    ap.add_argument("--models", nargs="+", default=["mha", "hf"], choices=["mha", "hf"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU sizes, float32, aot_eager")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.autocast = torch.bfloat16 if device.type == "cuda" else None
    if args.smoke:
        args.seq_len, args.dim, args.heads, args.layers, args.vocab, args.steps = 64, 64, 4, 1, 128, 3
    args.backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    builders = {"mha": ring_transformer, "hf": hf_llama}
    print(
        f"compile_train: {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
        f"{torch.__version__}, backend {args.backend}, autocast {args.autocast}, {args.seq_len} tokens, "
        f"dim {args.dim}, heads {args.heads}, layers {args.layers}",
        flush=True,
    )
    rows = [run_model(name, builders[name], args, device) for name in args.models]
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "device": str(device), "torch": torch.__version__}, indent=1))
    ok = all(r["ok"] for r in rows)
    print(f"verdict: {'OK' if ok else 'FAILED'}: {', '.join(r['model'] for r in rows)} compiled (fullgraph) vs eager")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
