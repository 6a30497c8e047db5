"""Random-prompt toy tasks, made in code so that a tiny random-init model's reward rises within
~20 GRPO steps on CPU. Prompts are `num_symbols` ids from `low` up (ids below `low`, 4 by
default, are left to special tokens), of length 4..12, from a generator seeded by `seed`:

* `target_token` - reward = fraction of response tokens equal to `target` (7); prompt ids
                   span [4, vocab_size). The smoke task (tiny dense model: 0.02 -> ~0.8 in 20 steps).
* `copy_first`   - reward = fraction of response tokens equal to the first prompt token;
                   8 symbols (0.02 -> ~0.09 in 20 steps, ~0.3 in 40).
* `count_up`     - reward = fraction of response tokens that are their predecessor's
                   successor in the alphabet (wrapping; the first token's predecessor is the
                   last prompt token); 8 symbols (0.003 -> ~0.06 in 20 steps, ~0.6 in 40).
"""

from __future__ import annotations

from typing import Any

import torch

from rl.tasks.base import Prompt, Task, as_ids


class RandomPromptTask(Task):
    """Prompts of `num_symbols` ids from `low` up (None: every id in [low, vocab_size)),
    lengths in [min_len, max_len]; reward = fraction of response tokens equal to `wanted`."""

    num_symbols_default: int | None = None

    def __init__(self, *, vocab_size: int, low: int = 4, num_symbols: int | None = None, min_len: int = 4,
                 max_len: int = 12, stop_token_id: int | None = None) -> None:
        name = type(self).__name__
        num_symbols = num_symbols if num_symbols is not None else self.num_symbols_default
        num_symbols = vocab_size - low if num_symbols is None else num_symbols
        if low < 0 or num_symbols < 2 or low + num_symbols > vocab_size:
            raise ValueError(f"{name}: prompt ids [low={low}, low+num_symbols={low + num_symbols}) need "
                             f"low >= 0, num_symbols >= 2 and to fit in vocab_size={vocab_size}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"{name}: need 1 <= min_len={min_len} <= max_len={max_len}")
        self.vocab_size, self.low, self.high = vocab_size, low, low + num_symbols
        self.min_len, self.max_len = min_len, max_len
        self.max_prompt_len = max_len
        self.stop_token_id = stop_token_id
        self.min_vocab_size = self.high

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(int(seed))
        out = []
        for _ in range(n):
            length = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
            out.append((torch.randint(self.low, self.high, (length,), generator=g), {}))
        return out

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        response = as_ids(response_ids)
        if not response:
            return 0.0
        wanted = self.wanted(as_ids(prompt_ids), response)
        return sum(int(r == w) for r, w in zip(response, wanted)) / len(response)

    def wanted(self, prompt: list[int], response: list[int]) -> list[int]:
        """The right token at each response position."""
        raise NotImplementedError


class TargetToken(RandomPromptTask):
    def __init__(self, *, vocab_size: int, target: int = 7, **kwargs: Any) -> None:
        super().__init__(vocab_size=vocab_size, **kwargs)
        if not 0 <= target < vocab_size:
            raise ValueError(f"target_token: target={target} is outside the vocabulary [0, {vocab_size})")
        self.target = target
        self.min_vocab_size = max(self.min_vocab_size, target + 1)

    def wanted(self, prompt: list[int], response: list[int]) -> list[int]:
        return [self.target] * len(response)


class CopyFirst(RandomPromptTask):
    num_symbols_default = 8  # a small alphabet: the copy circuit shows within ~20 steps

    def wanted(self, prompt: list[int], response: list[int]) -> list[int]:
        return [prompt[0]] * len(response)


class CountUp(RandomPromptTask):
    num_symbols_default = 8

    def wanted(self, prompt: list[int], response: list[int]) -> list[int]:
        """Successor within the alphabet [low, high), wrapping; an id outside it has none (-1)."""
        before = [prompt[-1]] + response[:-1]
        return [self.low + (b + 1 - self.low) % (self.high - self.low) if self.low <= b < self.high else -1
                for b in before]

