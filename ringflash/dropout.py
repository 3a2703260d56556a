"""Attention dropout whose keep mask is a pure function of (seed, batch, head, global query
index, global key index), so that one device and any number of ranks, in any layout, drop
exactly the same (query, key) pairs.

The random bits are Philox-4x32 with 10 rounds, the generator of Triton's tl.philox /
tl.randint, keyed by the 64-bit seed (low word k0, high word k1) with the counter
(key index, query index, head, batch): the first output word r decides, keep iff
r >= threshold(p) = round(p * 2^32), an integer comparison that a kernel can make bit for
bit as this plain-torch version does (tests check the two against each other). A fresh seed
is drawn from torch's generator of the device for every call (draw_seed), so torch.manual_seed
reproduces a run, as with torch's own dropout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import _exchange_device, group_rank_world, resolve_group

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
N_ROUNDS = 10


def _mul_hi_lo(a: int, x: torch.Tensor):
    """(high, low) 32-bit words of the 64-bit product of the constant a and x, both < 2^32,
    in int64 arithmetic without overflow (x split into 16-bit halves)."""
    x_hi, x_lo = x >> 16, x & 0xFFFF
    lo_part, mid = a * x_lo, a * x_hi  # each < 2^48
    hi = (mid + (lo_part >> 16)) >> 16
    lo = (((mid & 0xFFFF) << 16) + lo_part) & _M32
    return hi, lo


def philox4x32(c0, c1, c2, c3, seed: int, n_rounds: int = N_ROUNDS):
    """Philox-4x32 of counters c0..c3 (int64 tensors holding values in [0, 2^32), broadcast
    together) under the 64-bit key `seed`: four int64 tensors of 32-bit words, as Triton's
    tl.philox(seed, c0, c1, c2, c3) gives them (as uint32)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) for c in (c0, c1, c2, c3)))
    for _ in range(n_rounds):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """Keep iff the random word r (uniform in [0, 2^32)) >= threshold: P(keep) = 1 - p up to
    2^-32."""
    return min(round(p * 2**32), 2**32)


def keep_mask(seed: int, p: float, batch, heads, q_idx, k_idx) -> torch.Tensor:
    """bool (len(batch), len(heads), len(q_idx), len(k_idx)): True where the pair is kept.
    batch, heads, q_idx, k_idx: int64 1-D tensors of global indices (the query and key
    indices of the whole, unsharded sequences)."""
    r, _, _, _ = philox4x32(
        k_idx[None, None, None, :], q_idx[None, None, :, None], heads[None, :, None, None], batch[:, None, None, None],
        seed,
    )  # fmt: skip
    return r >= threshold(p)


def draw_seed(device) -> int:
    """A fresh 64-bit seed from torch's default generator of `device` (advancing it, as
    torch's dropout advances it), so torch.manual_seed reproduces the masks."""
    return int(torch.randint(0, 2**63 - 1, (), device=device, dtype=torch.int64))


def agreed_seed(device, group=None) -> int:
    """draw_seed on every rank of `group`, then the first rank's for all: every rank advances
    its own generator once and drops the same pairs (a collective every rank must call)."""
    seed = draw_seed(device)
    _, world = group_rank_world(group)
    if world == 1:
        return seed
    group = resolve_group(group)
    dev = _exchange_device(group, device)
    every = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(every, torch.tensor([seed], dtype=torch.int64, device=dev), group=group)
    return int(every[0])
