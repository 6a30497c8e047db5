"""Advantages on unpadded records: GRPO (group-normalized) and PPO (GAE).

Records are per-sample `Experience`s with action fields `[T-1]`; each function sets
`advantages` and `returns` on the action axis (0 on prompt slots) in place.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

from packing import Experience


def grpo_advantages(records: Sequence[Experience], *, scale_by_std: bool = True, eps: float = 1e-6) -> None:
    """A_i = (r_i - mean_group) / (std_group + eps), broadcast over the response tokens.

    A group is the samples of one prompt (`prompt_index`). `scale_by_std=False` gives the
    Dr. GRPO variant (mean-centred only).
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for i, rec in enumerate(records):
        if rec.rewards is None or rec.prompt_index is None:
            raise ValueError(f"record {i}: GRPO needs 'rewards' and 'prompt_index' (got {rec.rewards}, {rec.prompt_index})")
        groups[int(rec.prompt_index)].append(i)
    for members in groups.values():
        rewards = torch.stack([torch.as_tensor(records[i].rewards, dtype=torch.float32) for i in members])
        adv = rewards - rewards.mean()
        if scale_by_std and len(members) > 1:
            adv = adv / (rewards.std() + eps)
        for i, a in zip(members, adv):
            mask = records[i].action_mask.to(torch.float32)
            records[i].advantages = a * mask
            records[i].returns = records[i].advantages.clone()


def gae_advantages(
    records: Sequence[Experience], *, gamma: float = 1.0, lam: float = 0.95, kl_coef: float = 0.0
) -> None:
    """Generalized advantage estimation over each record's response slots.

    The scalar reward lands on the last response slot; `kl_coef * kl` (when the record
    carries `kl`) is subtracted per token as a reward penalty. `values` are the critic's
    values at the same slots (slot k: the state after token k).
    """
    for i, rec in enumerate(records):
        if rec.values is None or rec.rewards is None:
            raise ValueError(f"record {i}: GAE needs 'values' and 'rewards'")
        slots = rec.action_mask.nonzero().flatten()
        values = rec.values.detach().float()
        token_rewards = torch.zeros_like(values)
        if kl_coef and rec.kl is not None:
            token_rewards -= kl_coef * rec.kl.float() * rec.action_mask
        advantages = torch.zeros_like(values)
        if len(slots):
            token_rewards[slots[-1]] += float(rec.rewards)
            last_gae, next_value = 0.0, 0.0
            for t in reversed(slots.tolist()):
                delta = token_rewards[t] + gamma * next_value - values[t]
                last_gae = delta + gamma * lam * last_gae
                advantages[t] = last_gae
                next_value = values[t]
        rec.advantages = advantages
        rec.returns = (advantages + values) * rec.action_mask
