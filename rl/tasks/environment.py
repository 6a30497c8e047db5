"""`environment`: the user's multi-turn environment, played one episode per sample
(rl/rollout/episodes.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from rl.tasks.base import Environment, MultiTurnTask, Prompt, load_callable
from rl.tasks.chat import TextTask, chat_encoder, load_tokenizer, observation_encoder, user_turn
from rl.tasks.files import FileTask, read_prompts


class EnvironmentTask(TextTask, FileTask, MultiTurnTask):
    """`environment`: the user's multi-turn task. `prompts_path` is a JSONL of `{"prompt": str,
    ...}`; `environment` a class `module:Class` (or the class) with the `Environment` protocol,
    built as `Class(**environment_options)` once per sample; its `reset` receives the line (every
    key) and must return the first turn as messages (`[{"role": "user", "content":
    line["prompt"]}]` renders to the prompt's ids), its `step` the reply text. The episode's
    reward is the sum of its turns' (`task.reward` is not used). `heldout_path`: an optional
    second JSONL, played greedily for `eval.every` (the first `eval.num_prompts` lines).
    `max_observation_len`: the longest environment answer, in tokens (start-up sizes every
    sample with it; a longer one is an error naming the environment)."""

    has_heldout = True  # with task.options.heldout_path

    def __init__(self, prompts_path: str | os.PathLike, tokenizer_path: str | os.PathLike, *,
                 environment: str | type | None = None, environment_options: dict | None = None,
                 max_turns: int = 2, max_observation_len: int = 64, heldout_path: str | os.PathLike | None = None,
                 chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        if environment is None:
            raise ValueError("task=environment needs task.options.environment: the class 'module:Class' "
                             "(an Environment: reset(prompt) -> messages, step(reply) -> (observation, reward, done))")
        if max_turns < 1 or max_observation_len < 1:
            raise ValueError(f"task.options.max_turns={max_turns}, task.options.max_observation_len="
                             f"{max_observation_len}: expected >= 1 each")
        self.env_class = load_callable(environment, "task.options.environment") if isinstance(environment, str) \
            else environment
        self.env_options = dict(environment_options or {})
        self.reward_name = f"{getattr(self.env_class, '__module__', '?')}:{self.env_class.__qualname__}.step"
        self.max_turns, self.max_observation_len = max_turns, max_observation_len
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        self.encode_messages = chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.observation_ids = observation_encoder(tokenizer, chat_template, enable_thinking)
        encode = lambda text: self.encode_messages(user_turn(text))  # noqa: E731
        read = lambda path, key: read_prompts(path, encode, vocab_size, required=("prompt",), key=key,  # noqa: E731
                                               keep_prompt=True)
        self.items = read(prompts_path, "task.prompts_path")
        self.heldout_items = read(heldout_path, "task.options.heldout_path") if heldout_path is not None else None
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        every = self.items + (self.heldout_items or [])
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in every), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in every)

    def environment(self) -> Environment:
        return self.env_class(**self.env_options)

    def heldout(self, n: int) -> list[Prompt]:
        """The first n lines of `heldout_path`."""
        if self.heldout_items is None:
            raise ValueError("eval.every > 0 with task=environment needs task.options.heldout_path (a JSONL of "
                             "held-out prompts), or eval.every=0")
        if n > len(self.heldout_items):
            raise ValueError(f"eval.num_prompts={n}: task.options.heldout_path holds {len(self.heldout_items)} prompts")
        return [(torch.tensor(ids, dtype=torch.int64), dict(meta)) for ids, meta in self.heldout_items[:n]]

    reward = MultiTurnTask.reward  # not FileTask's: the environment's `step` rewards an episode

