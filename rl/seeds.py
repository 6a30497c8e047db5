"""Every seed a run draws, derived from its `seed` here: layout-independent samples and lossless
resume rest on these being functions of (seed, step, round, prompt index, place) alone.

`derive(seed, *parts)` is splitmix64 mixing (Steele et al.) of the seed and each part in turn:
a sample's seed (`derive(step seed, prompt index, k)`, rl/rollout/sampler.py), an environment's
(rl/rollout/episodes.py), a JSONL task's epoch order (`derive(seed, epoch)`, rl/tasks/files.py).

The step's two top seeds stay linear in (seed, step, round), as they were before `derive`:
`round_seed` draws the round's prompts and `sampling_seed` its samples. Their values are recorded
in figures that a mixing function would change (tests/one_step_off_metrics.json, the scheduler,
resume and exchange tests' recorded metrics, and the peer bench's TRL arm, which replays the
prompts of `round_seed`): derive(seed, step, round) draws other prompts and other samples. Linear
is safe here: within a run both grow with the step and never repeat (up to a billion steps); runs
of seeds s and s + 1 meet only 1_000_003 (prompts) and 7919 (samples) steps apart; and each
sample's seed below them is mixed.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def derive(seed: int, *parts: int) -> int:
    """A 63-bit seed from `seed` and `parts` (ints, any sign: their low 64 bits are mixed)."""
    h = 0x9E3779B97F4A7C15
    for v in (seed, *parts):
        h = ((h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def round_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of step `step`'s prompts in rollout round `round_` (dynamic sampling's extra rounds)."""
    return seed * 1_000_003 + step + round_ * 1_000_000_007


def sampling_seed(seed: int, step: int) -> int:
    """The seed step `step`'s samples are drawn from (each sample's own: `derive` of it)."""
    return seed * 7919 + step
