"""Per-sample seeded sampling: a sample's tokens depend on its seed, never on the batch.

Seeding: every sample has its own seed, `derive(seed, prompt_index, k)` where k counts the
earlier samples of the same prompt_index in the call; response token j is drawn by inverse
CDF with the uniform `uniform_noise(sample seed, j)` (a counter-based splitmix64 stream, the
whole batch in a few tensor ops). A sample's tokens therefore depend on neither batch
composition nor chunking nor padding: generating a prompt alone gives the same tokens as
generating it in a batch, up to the fp32 rounding of kernels whose blocking depends on the
batch's size. That rounding moves the inverse CDF's boundaries by ~1e-7; on SmolLM2's long
answers (256 tokens) 2 of 32 samples drew a neighbouring id once, and went on from there.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rl.seeds import derive

_MASK64 = (1 << 64) - 1


def group_places(prompt_indices: Sequence[int]) -> list[int]:
    """Each sample's place k in its group: the earlier samples of the same prompt_index."""
    seen: dict[int, int] = {}
    places = []
    for index in prompt_indices:
        places.append(seen.get(int(index), 0))
        seen[int(index)] = places[-1] + 1
    return places


def sample_seeds(seed: int, prompt_indices: Sequence[int]) -> list[int]:
    """Per-sample seeds: sample k of each prompt_index gets `derive(seed, index, k)` (rl/seeds.py)."""
    return [derive(seed, int(index), k) for index, k in zip(prompt_indices, group_places(prompt_indices))]


# ------------------------------------------------------------------ sampling
# splitmix64 (Steele et al.); torch has no uint64 arithmetic, so the bit patterns live in
# int64 tensors, whose additions and products wrap mod 2**64 like the unsigned ones
_GAMMA = 0x9E3779B97F4A7C15
_MUL1, _MUL2 = (c - (1 << 64) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def signed(x: int) -> int:
    """The int64 with the bit pattern of `x mod 2**64`."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (`>>` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def uniform_noise(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform float64 in [0, 1) per sample for response token `step`: output `step + 1`
    of the splitmix64 stream seeded with that sample's seed (`seeds` int64 `[B]`, the bit
    patterns of `sample_seeds`). Counter-based: a sample's draws depend on its seed and the
    step only, never on the batch, and a whole batch is drawn in a few tensor ops."""
    z = seeds + signed((step + 1) * _GAMMA)
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0**-53


def sample_inverse_cdf(log_probs: torch.Tensor, uniform: torch.Tensor, *, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """Token ids `[B]` drawn from `softmax` rows given as `log_probs [B, V]`, by inverse CDF
    with one uniform per row: the first id whose cumulative probability exceeds `u x total`
    (float64 sums; a zero-probability id is never drawn). `out`: a float64 `[B, V]` buffer
    to reuse for the cumulative sums."""
    cdf = torch.exp(log_probs, out=out) if out is not None else log_probs.double().exp_()
    cdf = cdf.cumsum_(-1)
    x = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=log_probs.shape[-1] - 1)
