"""What the kernels read off a key bias besides its values: each batch row's keys past its last
visible one (a key padding mask's trailing padding, skipped) and its span of keys whose bias is
exactly 0 (computed without the bias, as if there were none).

A key of a zero-bias span takes the unbiased arithmetic, exp2(fma(q.k, scale, -m)), in every
kernel, forward and backward alike, and every other key fma(q.k, scale, bias) first: the
backward rebuilds each key's probabilities with the forward's arithmetic whichever kernels ran
the two. The span's ends are multiples of PLAIN_ALIGN, which every key block of the Gluon
kernels divides, so that each of their blocks lies wholly inside or outside it (one branch a
block); the Triton kernels choose key by key. The Gluon forward runs a tile's leading blocks
in the span through a copy of its key loop compiled without the bias, and the Gluon backward
(non-causal, head dims up to 64) a key block in the span through a copy of its consumer
likewise, so that such blocks pay no branch either: a key padding mask costs nothing
measurable where it hides nothing, but at D=64 the causal calls' 2-5%."""

import torch
import triton
import triton.language as tl

from . import configs
from .launcher import launch, on_device

# 64-, 128- and 192-key blocks all divide it
PLAIN_ALIGN = 384


def key_spans(key_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, 3) int32 of a (B, Sk) float32 key bias (natural-log units, -inf hides a key), per
    batch row: [key_hi, plain_lo, plain_hi]. key_hi: the row's last key the bias does not hide,
    plus one (0: every key hidden; Sk with configs.GLUON_CUT_KEY_PADDING off); the kernels
    skip the key blocks past it. [plain_lo, plain_hi): keys whose bias is 0.0, from the row's
    first such key up to the next nonzero one, shrunk to multiples of PLAIN_ALIGN (plain_hi
    rounded up past Sk when the zeros run to the end: keys past Sk are masked by position
    anyway); empty (0, 0) for a scale <= 0 (the unbiased arithmetic takes the max of the raw
    scores times a positive scale) or with configs.PLAIN_ZERO_BIAS_KEYS off. One small launch
    (a program a row), no host sync."""
    B, Sk = key_bias.shape
    spans = torch.empty(B, 3, dtype=torch.int32, device=key_bias.device)
    if B == 0 or Sk == 0:
        return spans.zero_()
    with on_device(key_bias):
        launch(
            _key_spans_kernel, (B,), key_bias, spans, Sk, key_bias.stride(0), key_bias.stride(1),
            CUT=configs.GLUON_CUT_KEY_PADDING, PLAIN=configs.PLAIN_ZERO_BIAS_KEYS and scale > 0, ALIGN=PLAIN_ALIGN,
            BLOCK=1024,
        )  # fmt: skip
    return spans


def spans_stand_in(key_bias: torch.Tensor) -> torch.Tensor:
    """A (B, 3) int32 tensor of key_spans' shape for a compile-only launch plan (the kernels are
    specialized by dtypes and alignment, not values; a CPU tensor, as the compile check binds)."""
    return torch.zeros(key_bias.shape[0], 3, dtype=torch.int32, device=key_bias.device)


@triton.jit(do_not_specialize=["Sk"])
def _key_spans_kernel(
    BIAS, SPANS, Sk, stride_b, stride_k, CUT: tl.constexpr, PLAIN: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """key_spans' row program_id(0): one pass over its keys in blocks, in order, keeping the last
    visible key, the first zero-bias key and the first nonzero one after it."""
    b = tl.program_id(0).to(tl.int64)
    row = BIAS + b * stride_b
    hi = Sk * 0  # (loop-carried int32 scalars)
    first_zero = Sk + 0
    first_after = Sk + 0
    for start in range(0, Sk, BLOCK):
        keys = start + tl.arange(0, BLOCK)
        ok = keys < Sk
        x = tl.load(row + keys.to(tl.int64) * stride_k, mask=ok, other=float("-inf"))
        hi = tl.maximum(hi, tl.max(tl.where(x > float("-inf"), keys + 1, 0), 0))
        # the first zero found is final: later blocks' keys are larger
        first_zero = tl.minimum(first_zero, tl.min(tl.where(ok & (x == 0.0), keys, Sk), 0))
        after = ok & (x != 0.0) & (keys >= first_zero)
        first_after = tl.minimum(first_after, tl.min(tl.where(after, keys, Sk), 0))
    if not CUT:
        hi = Sk + 0
    lo = (first_zero + ALIGN - 1) // ALIGN * ALIGN
    up = tl.where(first_after >= Sk, (Sk + ALIGN - 1) // ALIGN * ALIGN, first_after // ALIGN * ALIGN)
    up = tl.maximum(up, lo)
    if not PLAIN:
        lo = Sk * 0
        up = Sk * 0
    tl.store(SPANS + 3 * b, hi)
    tl.store(SPANS + 3 * b + 1, lo)
    tl.store(SPANS + 3 * b + 2, up)
