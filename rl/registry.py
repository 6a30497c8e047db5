"""`python -m rl.registry`: the registered advantage estimators and policy losses.

Adding one is one function in one file: `@register_advantage_estimator("name")` in
rl/algos/advantages.py or `@register_policy_loss("name")` in rl/algos/losses.py (or any module imported
before the config is checked); `algo.advantage=name` / `algo.policy_loss=name` then work.
"""

from __future__ import annotations

import inspect

from rl.algos.advantages import ADVANTAGE_ESTIMATORS
from rl.algos.losses import POLICY_LOSSES


def describe() -> str:
    def first_line(fn) -> str:
        return " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())

    lines = ["advantage estimators (algo.advantage):"]
    for name, est in sorted(ADVANTAGE_ESTIMATORS.items()):
        flags = [f for f, on in (("critic", est.uses_critic), ("groups", est.needs_groups),
                                 ("whitened", est.whiten_by_default)) if on]
        lines.append(f"  {name:24s} {first_line(est.fn)}" + (f" [{', '.join(flags)}]" if flags else ""))
    lines.append("policy losses (algo.policy_loss):")
    for name, fn in sorted(POLICY_LOSSES.items()):
        lines.append(f"  {name:24s} {first_line(fn)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
