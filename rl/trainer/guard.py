"""The divergence guard: no non-finite number reaches the weights, the optimizer state or
a checkpoint.

A step is *bad* when one of its terms is not finite, checked in this order (the first one
found names the step):

    rewards      the step's rewards (global: every rank holds the whole step)
    advantages   this rank's collated advantages (after GAE and whitening)
    loss         any microbatch's actor or critic loss on this rank
    grad_norm    the global gradient norm (critic_grad_norm: the critic's)

A bad step's update is skipped on every rank alike, without an extra collective: a rank
that saw a non-finite reward, advantage or loss fills its gradient shards with NaN before
the clip (`poison`), so the global gradient norm, already one all-reduce over every rank,
is NaN on every rank and every rank takes the same branch. Which term it was travels in
the step's metric sums (`nonfinite_<term>`, reduced with the other metrics), so every
rank names the same term. `trainer.max_bad_steps` bad steps in a row stop the run with a
`DivergenceError` naming the step and the term; a good step resets the count.

A rollout whose logits are not finite (the weights themselves diverged: no skip can undo
that) stops the run at once, naming the step and `logits`.

Entropy collapse is a warning, not an error: a mean entropy below `trainer.min_entropy`
(None: off) says the policy is turning deterministic, the usual sign of a too-large
learning rate that still gives finite numbers.

No learning signal is a warning too: a step on which no prompt group's rewards differ
(`reward_varied_groups` 0) gives every group-relative advantage 0, so loss and grad_norm are 0
and nothing moves (a reply format the reward never reads, a reward that never fires, a tiny
random model on a text task). The first such step warns, naming what the task's reward reads
(`Task.signal_hint`: reasoning-gym's `answer_tag` / `answer_pattern`, the math answer checker,
the user's reward), and the warning repeats every `SIGNAL_REPEAT` such steps while the streak
lasts; a step with a group whose rewards differ ends the streak (logged at INFO).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger("train")

LOCAL_TERMS = ("rewards", "advantages", "loss")  # seen by one rank; grad_norm is global already


SIGNAL_REPEAT = 10  # the no-signal warning: on the first step of a streak, then every 10 steps of it


class DivergenceError(RuntimeError):
    """`trainer.max_bad_steps` consecutive steps had a non-finite term."""


class DivergenceGuard:
    def __init__(self, max_bad_steps: int, min_entropy: float | None = None, *, verbose: bool = True,
                 signal_hint: str = "", teacher_signal: bool = False) -> None:
        self.max_bad_steps, self.min_entropy = max_bad_steps, min_entropy
        # on-policy distillation: the teacher's per-token signal does not need rewards that differ
        self.teacher_signal = teacher_signal
        self.verbose = verbose  # rank 0 logs; every rank raises
        self.signal_hint = signal_hint  # the task's likely cause of no reward signal (`Task.signal_hint`)
        self.bad_steps = 0  # consecutive
        self.uniform_steps = 0  # consecutive steps without reward variance inside any group
        self._seen: dict[str, torch.Tensor] = {}  # term -> "non-finite somewhere" (a 0-d bool on the device)

    # ------------------------------------------------------------ during a step
    def begin(self, *, rewards: list[torch.Tensor], advantages: list[torch.Tensor | None]) -> None:
        """A new step: forget the last one's terms, check its rewards and this rank's advantages."""
        self._seen = {}
        self.check("rewards", torch.stack(rewards) if rewards else None)
        self.check("advantages", *advantages)

    def check(self, term: str, *values: torch.Tensor | None) -> None:
        """Note whether `values` hold a non-finite number (no host sync: read once per update)."""
        for v in values:
            if v is not None:
                bad = ~torch.isfinite(v.detach()).all()
                self._seen[term] = bad if term not in self._seen else self._seen[term] | bad

    def seen(self) -> list[str]:
        """The terms found non-finite on this rank since `begin`, in `LOCAL_TERMS` order."""
        return [t for t in LOCAL_TERMS if t in self._seen and bool(self._seen[t])]

    def flags(self) -> dict[str, torch.Tensor]:
        """Per-term 0/1 for the step's metric sums (summed over ranks there)."""
        seen = self.seen()
        return {f"nonfinite_{t}": torch.tensor(float(t in seen)) for t in LOCAL_TERMS}

    @contextlib.contextmanager
    def rollout(self, step: int) -> Iterator[None]:
        """Around the step's rollout: a non-finite logit (the engine's FloatingPointError)
        means the weights themselves diverged, which no skipped update can undo: stop now."""
        try:
            yield
        except FloatingPointError as e:
            raise DivergenceError(f"step {step}: non-finite logits in the rollout ({e}): the updates before this "
                                  f"step diverged; lower trainer.lr or trainer.grad_clip") from e

    # -------------------------------------------------------------- at the end
    def end(self, step: int, metrics: dict[str, float]) -> None:
        """Take the reduced `nonfinite_*` flags out of `metrics`, add `bad_steps`, warn on a
        skipped update or a collapsed entropy, raise after `max_bad_steps` bad steps in a row."""
        flags = {t: metrics.pop(f"nonfinite_{t}", 0.0) > 0 for t in LOCAL_TERMS}
        skipped = metrics.get("skipped_update", 0.0) > 0
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        metrics["bad_steps"] = self.bad_steps
        if skipped:
            term = next((t for t in LOCAL_TERMS if flags[t]), None)
            if term is None:
                term = "grad_norm" if not math.isfinite(metrics.get("grad_norm", 0.0)) else "critic_grad_norm"
            message = (f"step {step}: non-finite {term}; the update was skipped on every rank "
                       f"({self.bad_steps} bad step(s) in a row, trainer.max_bad_steps={self.max_bad_steps})")
            if self.bad_steps >= self.max_bad_steps:
                raise DivergenceError(
                    f"{message}: stopping. The weights and optimizer state are those before the first bad step "
                    f"(no NaN/inf reached them). Lower trainer.lr or trainer.grad_clip, or check the reward "
                    f"function and task.max_new_tokens.")
            if self.verbose:
                log.warning(message)
        self._check_signal(step, metrics)
        entropy = metrics.get("entropy")
        if self.min_entropy is not None and entropy is not None and entropy < self.min_entropy and self.verbose:
            log.warning("step %d: mean entropy %.3g is below trainer.min_entropy=%g: the policy is collapsing "
                        "(a learning rate too large for the task?)", step, entropy, self.min_entropy)

    def _check_signal(self, step: int, metrics: dict[str, float]) -> None:
        """Warn on the first step without a prompt group whose rewards differ, and every
        `SIGNAL_REPEAT` steps while none does; the end of such a streak is logged."""
        if self.teacher_signal or metrics.get("reward_varied_groups", 1.0) != 0:
            if self.uniform_steps and self.verbose:
                log.info("step %d: a prompt group's rewards differ again, after %d step(s) without", step,
                         self.uniform_steps)
            self.uniform_steps = 0
            return
        self.uniform_steps += 1
        if (self.uniform_steps - 1) % SIGNAL_REPEAT or not self.verbose:
            return
        reward = metrics.get("reward_mean", math.nan)
        cause = ("no reward fired (reward_mean 0)" if reward == 0 else
                 f"every sample of a prompt scored alike (reward_mean {reward:.4g}: a constant reward, or a task "
                 f"out of the model's reach or too easy)")
        log.warning("step %d: no prompt group had rewards that differ (reward_varied_groups=0, %d step(s) in a row; "
                    "repeated every %d such steps): every group-relative advantage is 0, so loss and grad_norm are 0 "
                    "and the policy does not learn. %s; %s. More task.samples_per_prompt or a higher "
                    "model.temperature widen the groups.", step, self.uniform_steps, SIGNAL_REPEAT,
                    cause[0].upper() + cause[1:], self.signal_hint or "check the reward on a few replies")


@torch.no_grad()
def poison(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Fill this rank's gradients (its FSDP shards) with NaN, so the global norm is NaN."""
    for p in parameters:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.fill_(float("nan"))
