"""What the kernels read off a key bias besides its values: each batch row's keys past its last
visible one (a key padding mask's trailing padding, skipped) and its span of keys whose bias is
exactly 0 (computed without the bias, as if there were none).

A key of a zero-bias span takes the unbiased arithmetic, exp2(fma(q.k, scale, -m)), in every
kernel, forward and backward alike, and every other key fma(q.k, scale, bias) first: the
backward rebuilds each key's probabilities with the forward's arithmetic whichever kernels ran
the two. The span's ends are multiples of PLAIN_ALIGN, which every key block of the Gluon
kernels divides, so that each of their blocks lies wholly inside or outside it (one branch a
block); the Triton kernels choose key by key. The Gluon forward pays one FMA a score on a
span's blocks instead of two: a key padding mask costs nothing where it hides nothing."""

import torch

from . import configs

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
    scores times a positive scale) or with configs.PLAIN_ZERO_BIAS_KEYS off. Small device ops,
    no host sync."""
    B, Sk = key_bias.shape
    device = key_bias.device
    spans = torch.zeros(B, 3, dtype=torch.int32, device=device)
    if Sk == 0:
        return spans
    keys = torch.arange(Sk, device=device, dtype=torch.int32)
    if configs.GLUON_CUT_KEY_PADDING:
        spans[:, 0] = torch.where(key_bias > float("-inf"), keys + 1, 0).amax(dim=1)
    else:
        spans[:, 0] = Sk
    if configs.PLAIN_ZERO_BIAS_KEYS and scale > 0:
        zero = key_bias == 0
        first_zero = torch.where(zero, keys, Sk).amin(dim=1)
        first_after = torch.where(~zero & (keys >= first_zero[:, None]), keys, Sk).amin(dim=1)
        a = PLAIN_ALIGN
        lo = (first_zero + a - 1) // a * a
        hi = torch.where(first_after == Sk, (Sk + a - 1) // a * a, first_after // a * a)
        spans[:, 1] = lo
        spans[:, 2] = torch.maximum(hi, lo)
    return spans
