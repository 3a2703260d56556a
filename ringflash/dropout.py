"""Attention dropout whose keep mask is a pure function of (seed, batch, head, global query
index, global key index), so that one device and any number of ranks, in any layout, drop
exactly the same (query, key) pairs.

The random bits are Philox-4x32 with 10 rounds, the generator of Triton's tl.philox /
tl.randint, keyed by the 64-bit seed (low word k0, high word k1) with the counter
(key index, query index, head, batch): the first output word r decides, keep iff
r >= threshold(p) = round(p * 2^32), an integer comparison that a kernel can make bit for
bit as this plain-torch version does (tests check the two against each other). A fresh seed
is drawn from torch's default (CPU) generator for every call (seed_tensor), so torch.manual_seed
reproduces a run, as with torch's own dropout.

Inside a block operation (Dropout): the kept probabilities are scaled by 1 / (1 - p) before
they weigh the values, while the normalizer l sums them all, so the softmax state (m, l, o) of
a dropped block folds and merges as any other and the backward rebuilds the same mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._checks import check_not_capturing
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


def _as_int32(word: int) -> int:
    """A 32-bit word as the signed int32 with the same bits (a kernel argument that Triton
    always types int32, whatever the value)."""
    return word - (1 << 32) if word >= 1 << 31 else word


@dataclass(frozen=True)
class Dropout:
    """Attention dropout of one block operation: the pair (query q0 + i, key k0 + j) of batch
    b and query head h0 + h, i, j and h the block's own rows and heads, is dropped unless
    keep_mask(seed, p, b, h0 + h, q0 + i, k0 + j) keeps it; kept probabilities are scaled by
    1 / (1 - p). q0, k0: the indices, in the whole (unsharded) query and key sequences, of the
    block's first rows; h0: the index of its first query head. 0 < p < 1 (p = 0 is no Dropout,
    p = 1 drops everything: the callers' cases)."""

    seed: int
    p: float
    q0: int = 0
    k0: int = 0
    h0: int = 0

    def __post_init__(self):
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"Dropout.p must be in (0, 1), got {self.p!r}")

    def at(self, q0: int, k0: int) -> Dropout:
        """The same draw for a block whose first rows are query q0 and key k0."""
        return Dropout(self.seed, self.p, q0, k0, self.h0)

    def heads_from(self, h0: int) -> Dropout:
        """The same draw for the block's query heads from h0 on."""
        return Dropout(self.seed, self.p, self.q0, self.k0, self.h0 + h0)

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def keep(self, batch: int, heads: int, q_rows: range, k_rows: range, device) -> torch.Tensor:
        """bool (batch, heads, len(q_rows), len(k_rows)) of the block's local rows."""
        idx = lambda n, start=0: torch.arange(start, start + n, device=device)  # noqa: E731
        return keep_mask(
            self.seed, self.p, idx(batch), idx(heads, self.h0), idx(len(q_rows), self.q0 + q_rows.start),
            idx(len(k_rows), self.k0 + k_rows.start),
        )  # fmt: skip

    def kernel_args(self) -> tuple[int, int, int, int, int, int, float]:
        """(seed low word, seed high word, threshold - 2^31, q0, k0, h0, keep_scale) for the kernels,
        words as int32 (tiles.dropout_keep compares the random word, shifted the same way, as a
        signed int32)."""
        return (
            _as_int32(self.seed & _M32), _as_int32((self.seed >> 32) & _M32), threshold(self.p) - (1 << 31),
            self.q0, self.k0, self.h0, self.keep_scale,
        )  # fmt: skip


def seed_tensor(generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh seed in [0, 2^63), an int64 scalar on the CPU, from `generator` (a CPU
    torch.Generator; None: torch's default CPU generator), advancing it as torch's dropout
    advances its generator, so torch.manual_seed (or generator.manual_seed) reproduces the
    masks. A CPU generator whatever the inputs' device: drawing needs no device sync."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64, generator=generator)


def draw_seed(generator: torch.Generator | None = None) -> int:
    """seed_tensor(generator) as an int."""
    return int(seed_tensor(generator))


def first_ranks_seed(seed: int, device, *groups) -> int:
    """The seed of the first rank of each of `groups` in turn (a ring, then its head group: the
    grid's first rank's), for every rank (a collective every rank of the groups must call; no
    group: the default one): ranks whose generators differ still drop the same pairs."""
    for group in groups or (None,):
        _, world = group_rank_world(group)
        if world == 1:
            continue
        group = resolve_group(group)
        dev = _exchange_device(group, device)
        every = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_gather(every, torch.tensor([seed], dtype=torch.int64, device=dev), group=group)
        seed = int(every[0])
    return seed


def agreed_seed(device, *groups, generator: torch.Generator | None = None) -> int:
    """draw_seed(generator) on every rank, then first_ranks_seed over `groups` for all: every
    rank advances its own generator once and drops the same pairs."""
    return first_ranks_seed(draw_seed(generator), device, *groups)


def check_dropout(dropout_p, generator, api: str) -> float:
    """dropout_p as a float in [0, 1], and generator None or a CPU torch.Generator (the seeds
    are drawn there), or a ValueError naming the argument."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{api}: dropout_p must be a probability in [0, 1], got {dropout_p!r}")
    if generator is not None and (not isinstance(generator, torch.Generator) or generator.device.type != "cpu"):
        got = getattr(generator, "device", type(generator).__name__)
        raise ValueError(f"{api}: generator must be None or a CPU torch.Generator (seeds are drawn there), got {got}")
    if 0.0 < dropout_p < 1.0:
        check_not_capturing(api, "dropout draws a fresh seed on the host for every call")
    return float(dropout_p)


def operator_dropout(dropout_p: float, generator=None) -> tuple[float, torch.Tensor | None]:
    """(dropout_p, seed) as the attention operators take them: a fresh seed_tensor(generator)
    when some pairs are dropped and some kept; (0.0, None) otherwise (p = 1 runs without
    dropout and all_dropped zeroes the output)."""
    if 0.0 < dropout_p < 1.0:
        return dropout_p, seed_tensor(generator)
    return 0.0, None


def all_dropped(out: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """dropout_p = 1 drops every weight: the output is 0 (its gradients too; lse stays)."""
    return out * 0.0 if dropout_p == 1.0 else out
