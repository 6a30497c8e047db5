"""Reward shaping and reward-based sample filtering (DAPO, Yu et al. 2025).

* `overlong_penalty` - soft punishment of responses that run into the length budget:
  0 up to `max_len - buffer_len` tokens, then linear down to -1 at `max_len`, -1 beyond;
  times `penalty_factor`. `apply_overlong_penalty` adds it to each record's reward.
* `filter_uniform_groups` - dynamic sampling: a prompt group whose rewards are all equal
  has zero group-relative advantage, so it only dilutes the step; drop it (the trainer
  then samples more prompts until the step is full, a bounded number of times).
* `varied_groups` - the fraction of prompt groups whose rewards differ (logged each step as
  `reward_varied_groups`; 0 means no group-relative advantage anywhere: nothing to learn).
"""

from __future__ import annotations

from typing import Sequence

import torch

from packing import Experience
from packing.layout import group_by_prompt


def overlong_penalty(response_length, max_len: int, buffer_len: int, penalty_factor: float = 1.0):
    """DAPO's overlong reward shaping for a response of `response_length` tokens:

        0                                        if L <= max_len - buffer_len
        (max_len - buffer_len - L) / buffer_len  if max_len - buffer_len < L <= max_len
        -1                                       if L > max_len
    times `penalty_factor`. `response_length` may be an int (-> float) or a tensor (elementwise).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_penalty: need 0 < buffer_len={buffer_len} <= max_len={max_len}")
    length = torch.as_tensor(response_length, dtype=torch.float64)
    penalty = ((max_len - buffer_len - length) / buffer_len).clamp(-1.0, 0.0) * penalty_factor
    if isinstance(response_length, torch.Tensor):
        return penalty.to(torch.float32)
    return float(penalty)


def apply_overlong_penalty(records: Sequence[Experience], max_len: int, buffer_len: int,
                           penalty_factor: float = 1.0) -> None:
    """rec.rewards += overlong_penalty(rec.response_length, ...), in place (0-d fp32 kept)."""
    for i, rec in enumerate(records):
        if rec.rewards is None or rec.response_length is None:
            raise ValueError(f"record {i}: overlong shaping needs 'rewards' and 'response_length'")
        shaped = float(rec.rewards) + overlong_penalty(int(rec.response_length), max_len, buffer_len, penalty_factor)
        rec.rewards = torch.tensor(shaped, dtype=torch.float32)


def filter_uniform_groups(records: Sequence[Experience]) -> tuple[list[Experience], list[int]]:
    """DAPO dynamic sampling: `(kept, dropped_groups)`.

    `kept` are the records (in their order) of every prompt group whose rewards are not all
    equal; `dropped_groups` the sorted `prompt_index`es of the groups dropped. A group of
    one sample is kept (nothing to compare it with: with one sample per prompt, filtering
    would drop everything).
    """
    for i, rec in enumerate(records):
        if rec.rewards is None or rec.prompt_index is None:
            raise ValueError(f"record {i}: dynamic sampling needs 'rewards' and 'prompt_index' "
                             f"(got {rec.rewards}, {rec.prompt_index})")
    groups = {p: [float(records[i].rewards) for i in members]
              for p, members in group_by_prompt([int(rec.prompt_index) for rec in records]).items()}
    dropped = sorted(p for p, r in groups.items() if len(r) > 1 and max(r) == min(r))
    gone = set(dropped)
    return [rec for rec in records if int(rec.prompt_index) not in gone], dropped


def varied_groups(records: Sequence[Experience]) -> float:
    """The fraction of prompt groups (of two samples or more) whose rewards are not all equal;
    1.0 when there is no such group (nothing to compare)."""
    groups = [[float(records[i].rewards) for i in members]
              for members in group_by_prompt([int(rec.prompt_index) for rec in records]).values() if len(members) > 1]
    return sum(max(r) != min(r) for r in groups) / len(groups) if groups else 1.0
