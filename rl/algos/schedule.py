"""Learning-rate schedule: linear warmup, then constant or cosine decay.

`lr_lambda(step, ...)` is the multiplier of the base lr for the optimizer step with
0-based index `step` (what `torch.optim.lr_scheduler.LambdaLR` calls it with): during
warmup it ramps (step + 1) / warmup_steps, so the first step already moves (1/w, 2/w,
..., 1); then `constant` stays at 1 and `cosine` follows
min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2 with p = (step - warmup_steps)
/ (total_steps - warmup_steps), clamped to [0, 1].
"""

from __future__ import annotations

import functools
import math

import torch

from rl.choice import Choice


class LRSchedule(Choice):
    CONSTANT = "constant"
    COSINE = "cosine"


def lr_lambda(step: int, warmup_steps: int, total_steps: int, kind: LRSchedule | str = LRSchedule.CONSTANT,
              min_lr_ratio: float = 0.0) -> float:
    """The lr multiplier at optimizer step `step` (0-based); see the module docstring."""
    kind = LRSchedule.parse(kind, "lr_schedule")
    if warmup_steps < 0:
        raise ValueError(f"lr schedule: warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr schedule: min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind is LRSchedule.CONSTANT:
        return 1.0
    if total_steps <= warmup_steps:
        raise ValueError(f"lr schedule: cosine needs total_steps={total_steps} > warmup_steps={warmup_steps}")
    progress = min(max((step - warmup_steps) / (total_steps - warmup_steps), 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                      kind: LRSchedule | str = LRSchedule.CONSTANT, min_lr_ratio: float = 0.0):
    """A `LambdaLR` over `lr_lambda`; call `.step()` after each `optimizer.step()`."""
    lr_lambda(0, warmup_steps, total_steps, kind, min_lr_ratio)  # validate now, not at the first step
    if LRSchedule.parse(kind, "lr_schedule") is LRSchedule.COSINE and total_steps <= warmup_steps:
        raise ValueError(f"lr schedule: cosine needs total_steps={total_steps} > warmup_steps={warmup_steps}")
    fn = functools.partial(lr_lambda, warmup_steps=warmup_steps, total_steps=total_steps, kind=kind,
                           min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
