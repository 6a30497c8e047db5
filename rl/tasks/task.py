"""Verifiable tasks: seeded prompts and a reward per (prompt, response).

Flow of one step (the engine never sees the task; rl/rollout/episodes.py is the bridge):

    prompts = task.prompts(n, seed=step_seed)              # [(prompt_ids [P] int64, meta dict)]
    records = engine.generate([p for p, _ in prompts], prompt_indices=..., ...)
    assign_rewards(task, records, [m for _, m in prompts])  # sets rec.rewards (0-d fp32)

A multi-turn task (`MultiTurnTask`: `arithmetic_retry`; `environment`, the user's class named
in the config) instead hands out an `Environment` per sample, and `run_episodes` calls
`generate` once per turn (rl/rollout/episodes.py).

A `Task` gives `prompts(n, seed)`, `reward(prompt_ids, response_ids, meta) -> float`,
`min_vocab_size` (the smallest vocabulary its ids fit in), `stop_token_id` (None: every
response runs to max_new_tokens) and, where known, `max_prompt_len` (the longest prompt it
gives: start-up checks that a whole sample fits in `batch.max_tokens`).

Built-ins are made in code, so a tiny random-init model's reward rises within ~20 GRPO
steps on CPU. Prompts are `num_symbols` ids from `low` up (ids below `low`, 4 by default,
are left to special tokens), of length 4..12, from a generator seeded by `seed`:

* `target_token` - reward = fraction of response tokens equal to `target` (7); prompt ids
                   span [4, vocab_size). The smoke task (tiny dense model: 0.02 -> ~0.8 in 20 steps).
* `copy_first`   - reward = fraction of response tokens equal to the first prompt token;
                   8 symbols (0.02 -> ~0.09 in 20 steps, ~0.3 in 40).
* `count_up`     - reward = fraction of response tokens that are their predecessor's
                   successor in the alphabet (wrapping; the first token's predecessor is the
                   last prompt token); 8 symbols (0.003 -> ~0.06 in 20 steps, ~0.6 in 40).

`FileTask` is the user's task: a JSONL file of prompts and a `module:function` reward
on token ids. `MathTask` (`math`) is a text task: a JSONL of `{"prompt", "answer"}`, a
local tokenizer folder, an optional chat template, and a reward on the decoded response
text, `fn(response_text, **meta)`; the default reward is the rule-based answer checker
`math_reward` (the last `\\boxed{...}`, else the last number, against `answer`).
`build_task(name, **kwargs)` builds any of them by name; None-valued kwargs are dropped,
so a caller can pass every task option and each task takes the ones it knows.

A reward must be a finite real number: `assign_rewards` rejects NaN, inf, None, bools and strings
with a ValueError naming the reward function, the record, its prompt index and the value.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import numbers
import os
import re
import sys
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from packing.experience import Experience
from rl.choice import Choice
from rl.tasks.calls import OnError, Status, UserCalls

Prompt = tuple[torch.Tensor, dict]


@runtime_checkable
class Task(Protocol):
    min_vocab_size: int
    stop_token_id: int | None

    def prompts(self, n: int, seed: int) -> list[Prompt]: ...

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float: ...


@runtime_checkable
class Environment(Protocol):
    """One episode of a multi-turn task; the task makes a new one per sample (`environment()`)."""

    def reset(self, prompt: dict) -> list[dict]:
        """The episode's first turn as chat messages, from the prompt's meta (`task.prompts`
        gave the same turn as ids: the rollout checks they agree)."""

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        """The model's reply (decoded without special tokens) -> (the environment's answer as
        the next user turn, or None when done; this turn's reward; done). The episode's
        reward is the sum of its turns' rewards."""


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose samples are episodes (rl/rollout/episodes.py): besides a `Task`'s fields,
    `environment()` (a fresh `Environment`), `max_turns` (model turns at most),
    `encode_messages(messages) -> ids` (a chat rendered up to the generation prompt: what
    `reset`'s messages must give), `observation_ids(text) -> ids` (an environment answer as
    the tokens that follow the model's turn, up to the next generation prompt),
    `max_observation_len` (the longest such answer, in tokens) and `decode(ids) -> text`."""

    max_turns: int
    max_observation_len: int

    def environment(self) -> Environment: ...

    def encode_messages(self, messages: list[dict]) -> list[int]: ...

    def observation_ids(self, text: str) -> list[int]: ...

    def decode(self, ids: Any) -> str: ...


def assign_rewards(task: Task, records: Sequence[Experience], metas: Sequence[dict],
                   calls: UserCalls | None = None) -> list[Experience]:
    """Set `rec.rewards` (0-d fp32) and `rec.status` on each record from `task.reward`; returns
    the records.

    A reward that is not a finite real number (NaN, inf, None, a bool, a string such as
    "0.5") is a ValueError naming the reward function, the record, its prompt index and
    the value. A 0-d real tensor is taken as its value. `calls` (rl/tasks/calls.py; None:
    `UserCalls.strict()`, every error raised) says what an exception or a timeout does: with
    `on_error=skip` that record gets reward 0 and status `error` (or `timeout`), the others
    go on.
    """
    if len(records) != len(metas):
        raise ValueError(f"assign_rewards: {len(records)} records but {len(metas)} metas (one per record)")
    calls = calls or UserCalls.strict()
    who = f"assign_rewards: reward function {reward_name(task)}"
    for i, (rec, meta) in enumerate(zip(records, metas)):
        n_prompt = rec.sequences.numel() - int(rec.response_length)
        guard = calls.guard(f"reward function {reward_name(task)}", f"sample {i} (prompt index {_index(rec)})")
        value = 0.0
        with guard:
            value = calls.run(task.reward, rec.sequences[:n_prompt], rec.sequences[n_prompt:], meta,
                              what=f"reward function {reward_name(task)}")
            value = check_reward(value, who, i, rec.prompt_index)
        rec.rewards = torch.tensor(value if guard.status is None else 0.0, dtype=torch.float32)
        rec.status = torch.tensor(int(guard.status if guard.status is not None else Status.DONE))
    return list(records)


def _index(rec: Experience) -> str:
    return "?" if rec.prompt_index is None else str(int(rec.prompt_index))


def step_prompts(task: Task, n: int, *, seed: int, run_seed: int, start: int | None) -> list[Prompt]:
    """A rollout round's n prompts: a task that walks its lines in epochs (`prompts_at`, FileTask
    and the tasks built on it) takes positions `start`.. of its stream, seeded by `run_seed`;
    any other task, or `start=None` (dynamic sampling's extra rounds), draws `prompts(n, seed)`."""
    if start is not None and hasattr(task, "prompts_at"):
        return task.prompts_at(start, n, run_seed)
    return task.prompts(n, seed=seed)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch `epoch`'s order of lines in a run seeded `seed` (splitmix64 mixing)."""
    h = 0x9E3779B97F4A7C15
    for v in (seed, epoch):
        h = ((h ^ (v & 0xFFFF_FFFF_FFFF_FFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def check_reward(value: Any, who: str, i: int, prompt_index: Any) -> float:
    """`value` as a float; a ValueError naming `who` (the reward function), the record, its
    prompt index and the value unless it is a finite real number (a 0-d real tensor counts)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        prompt = "?" if prompt_index is None else int(prompt_index)
        raise ValueError(
            f"{who} returned {value!r} ({type(value).__name__}) for record {i} (prompt index {prompt}); a reward "
            f"must be a finite real number (float or int), not NaN, inf, None, a bool or a string")
    return float(value)


def reward_name(task: Task) -> str:
    """How errors name a task's reward: its `reward_name` (`module:function`), else `Class.reward`."""
    return getattr(task, "reward_name", None) or f"{type(task).__name__}.reward"


def _ids(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


# ------------------------------------------------------------------- built-ins
class RandomPromptTask:
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
        response = _ids(response_ids)
        if not response:
            return 0.0
        wanted = self.wanted(_ids(prompt_ids), response)
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


# -------------------------------------------------------------------- user task
class FileTask:
    """Prompts from a JSONL file, reward from a `module:function`.

    Each non-blank line is a JSON object holding `prompt_ids` (a list of ints) or `prompt`
    (text, tokenized with the tokenizer: `tokenizer_path`, a local tokenizer folder, or
    `tokenizer`, a Hugging Face tokenizer object or such a folder); every other key goes
    to the reward as a keyword: `fn(prompt_ids: list[int], response_ids: list[int], **meta)
    -> float`. `stop_token_id` defaults to the tokenizer's EOS when a tokenizer is given.

    The trainer walks the lines in epochs (`prompts_at`): epoch e is every line once, in an
    order shuffled by (the run's seed, e), and step k takes the next `prompts_per_step`
    positions of that stream, k * prompts_per_step on: each line is seen once per epoch, and
    where a step starts is a function of the seed and the step, so a resumed run takes exactly
    the prompts the uninterrupted one would (no state to save). `prompts(n, seed)` takes n
    prompts in an order shuffled by `seed` (cycling if n exceeds the file): what dynamic
    sampling's extra rounds draw.
    """

    def __init__(self, prompts_path: str | os.PathLike, reward_fn: str | Callable, tokenizer: Any = None, *,
                 tokenizer_path: str | os.PathLike | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        self.reward_fn, self.reward_name = _reward_callable(reward_fn)
        if tokenizer is not None and tokenizer_path is not None:
            raise ValueError("FileTask: give tokenizer or tokenizer_path (task.tokenizer_path), not both")
        if tokenizer_path is not None:
            tokenizer = load_tokenizer(tokenizer_path)
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer, key="tokenizer")
        self.tokenizer = tokenizer
        encode = None if tokenizer is None else (lambda text: list(tokenizer.encode(text)))
        self.items = _read_prompts(prompts_path, encode, vocab_size, reserved=("response_ids",))
        self.stop_token_id = stop_token_id if stop_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in self.items), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(len(self.items), generator=g).tolist()
        picks = [order[i % len(order)] for i in range(n)]
        return [(torch.tensor(self.items[j][0], dtype=torch.int64), dict(self.items[j][1])) for j in picks]

    def prompts_at(self, start: int, n: int, seed: int) -> list[Prompt]:
        """The prompts at positions start, ..., start + n - 1 of the run's stream of lines: position
        p is line `order(p // len)[p % len]`, where order(e) is a permutation of every line drawn
        from (`seed`, e) (see the class docstring)."""
        orders: dict[int, list[int]] = {}
        out = []
        for position in range(start, start + n):
            epoch, k = divmod(position, len(self.items))
            if epoch not in orders:
                g = torch.Generator().manual_seed(epoch_seed(seed, epoch))
                orders[epoch] = torch.randperm(len(self.items), generator=g).tolist()
            ids, meta = self.items[orders[epoch][k]]
            out.append((torch.tensor(ids, dtype=torch.int64), dict(meta)))
        return out

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> Any:
        """The reward function's value as returned (`assign_rewards` checks it is a finite real number)."""
        return self.reward_fn(_ids(prompt_ids), _ids(response_ids), **meta)


# ------------------------------------------------------------------- text tasks
class TextDecoding:
    """`decode(ids) -> text` for a task holding a `tokenizer`: the ids as its reward (and an
    environment) reads them, special tokens skipped."""

    tokenizer: Any

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(_ids(ids), skip_special_tokens=True)


class MathTask(TextDecoding, FileTask):
    """`math`: text prompts with a reference answer, rewarded on the decoded response text.

    `prompts_path` is a JSONL of `{"prompt": str, "answer": str | number, ...}` (every key
    but `prompt` goes to the reward). `tokenizer_path` is a local tokenizer folder (as
    written by `save_pretrained`; nothing is downloaded). `chat_template`: "tokenizer" (the
    default, as for the other text tasks) = wrapped as one user message (after
    `system_prompt`, if any) with the tokenizer's own chat template and its generation
    prompt; any other string = a Jinja chat template used the same way; None = the prompt
    text is tokenized as is.
    The reward is `fn(response_text, **meta) -> float` on the response decoded without
    special tokens; `reward_fn` (a callable or "module:function") defaults to `math_reward`.
    """

    def __init__(self, prompts_path: str | os.PathLike, tokenizer_path: str | os.PathLike, *,
                 reward_fn: str | Callable | None = None, chat_template: str | None = "tokenizer",
                 system_prompt: str | None = None, enable_thinking: bool | None = None,
                 vocab_size: int | None = None, stop_token_id: int | None = None) -> None:
        self.reward_fn, self.reward_name = _reward_callable(reward_fn if reward_fn is not None else math_reward)
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        encode = _chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.items = _read_prompts(prompts_path, lambda text: encode(_user(text)), vocab_size,
                                   required=("prompt", "answer"),
                                   reserved=("response_text",))
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        self.min_vocab_size = 1 + max(max(max(ids) for ids, _ in self.items), self.stop_token_id or 0)
        self.max_prompt_len = max(len(ids) for ids, _ in self.items)

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> Any:
        return self.reward_fn(self.decode(response_ids), **meta)


class ArithmeticTask(TextDecoding):
    """`arithmetic`: problems such as "What is 38 + 17?" generated in code, answered in text.

    A problem is `operands` integers drawn from [low, high] joined by operators drawn from
    `operators` (a string of `+-*`), evaluated with the usual precedence. Every problem
    belongs to exactly one split, decided by a hash of its text: one in `heldout_every` is
    held out, so the training prompts (`prompts(n, seed)`) and the held-out evaluation
    problems (`heldout(n)`, a fixed list) can never share a problem, whatever the seeds.
    The prompt is `template` with the problem as one user message in the tokenizer's chat
    template (`chat_template="tokenizer"`; a Jinja string works too; None = plain text);
    generation stops at the tokenizer's end-of-turn token (its EOS). The reward is the
    rule-based checker `math_reward` on the decoded response (its last number against the
    answer): 1.0 or 0.0.
    """

    def __init__(self, tokenizer_path: str | os.PathLike, *, operands: int = 2, low: int = 10, high: int = 99,
                 operators: str = "+", heldout_every: int = 8,
                 template: str = "What is {problem}? Start your reply with the result.",
                 chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, vocab_size: int | None = None,
                 stop_token_id: int | None = None) -> None:
        if operands < 2:
            raise ValueError(f"task.options.operands={operands}: expected >= 2")
        if not 0 <= low <= high:
            raise ValueError(f"task.options.low={low}, task.options.high={high}: expected 0 <= low <= high")
        if not operators or set(operators) - set("+-*"):
            raise ValueError(f"task.options.operators={operators!r}: expected a non-empty string of '+', '-', '*'")
        if heldout_every < 2:
            raise ValueError(f"task.options.heldout_every={heldout_every}: expected >= 2 (1 in k problems held out)")
        if "{problem}" not in template:
            raise ValueError(f"task.options.template={template!r} has no '{{problem}}' field")
        self.operands, self.low, self.high, self.operators = operands, low, high, operators
        self.heldout_every, self.template = heldout_every, template
        self.space = (high - low + 1) ** operands * len(operators) ** (operands - 1)  # distinct problems
        self.tokenizer = tokenizer = load_tokenizer(tokenizer_path)
        self.encode_messages = _chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.chat_template, self.enable_thinking = chat_template, enable_thinking
        self.reward_name = "rl.tasks.task:math_reward"
        self.stop_token_id = stop_token_id if stop_token_id is not None else tokenizer.eos_token_id
        longest = self.encode_messages(self.messages(f" {operators[0]} ".join([str(high)] * operands)))
        self.max_prompt_len = len(longest) + 4  # digits tokenize one by one: the widest operands, plus slack
        self.min_vocab_size = 1 + max(max(longest), self.stop_token_id or 0)
        if vocab_size is not None and self.min_vocab_size > vocab_size:
            raise ValueError(f"task 'arithmetic': the tokenizer's ids reach {self.min_vocab_size - 1}, outside the "
                             f"model's vocabulary of {vocab_size}")

    # ---------------------------------------------------------------- problems
    def _draw(self, g: torch.Generator) -> str:
        nums = torch.randint(self.low, self.high + 1, (self.operands,), generator=g).tolist()
        ops = torch.randint(len(self.operators), (self.operands - 1,), generator=g).tolist()
        text = str(nums[0])
        for op, num in zip(ops, nums[1:]):
            text += f" {self.operators[op]} {num}"
        return text

    def is_heldout(self, problem: str) -> bool:
        import hashlib

        return int.from_bytes(hashlib.sha1(problem.encode()).digest()[:8], "little") % self.heldout_every == 0

    def _problems(self, n: int, seed: int, heldout: bool) -> list[str]:
        g = torch.Generator().manual_seed(int(seed))
        out: list[str] = []
        seen: set[str] = set()
        for _ in range(200 * n + 1000):  # rejection sampling; the held-out split is ~1/heldout_every
            if len(out) == n:
                return out
            problem = self._draw(g)
            if self.is_heldout(problem) == heldout and (not heldout or problem not in seen):
                out.append(problem)
                seen.add(problem)
        raise ValueError(f"task 'arithmetic': could not draw {n} {'held-out' if heldout else 'training'} problems "
                         f"from a space of {self.space}")

    def messages(self, problem: str) -> list[dict]:
        """The first turn: `template` with the problem, as one user message."""
        return _user(self.template.format(problem=problem))

    def _prompt(self, problem: str) -> Prompt:
        answer = arithmetic_value(problem)
        ids = self.encode_messages(self.messages(problem))
        return torch.tensor(ids, dtype=torch.int64), {"answer": answer, "problem": problem}

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """n training prompts (never a held-out problem), drawn from `seed`."""
        return [self._prompt(p) for p in self._problems(n, seed, heldout=False)]

    def heldout(self, n: int) -> list[Prompt]:
        """The first n problems of the held-out split: distinct, the same list in every run."""
        limit = self.space // self.heldout_every
        if n > limit // 2:
            raise ValueError(f"eval.num_prompts={n}: the held-out split of task 'arithmetic' has ~{limit} problems "
                             f"(1 in task.options.heldout_every={self.heldout_every} of {self.space}); ask for "
                             f"at most {limit // 2}, or widen the operands")
        return [self._prompt(p) for p in self._problems(n, seed=-1 & 0xFFFF_FFFF, heldout=True)]

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        return math_reward(self.decode(response_ids), meta["answer"])


class ArithmeticRetryTask(ArithmeticTask):
    """`arithmetic_retry`: `arithmetic` as a two-turn episode. A wrong first answer gets
    `feedback` ("Incorrect, try again.") as the next user turn and the model answers again;
    the reward is the last answer's (`math_reward`, 1.0 or 0.0), so a problem solved on the
    second try scores as one solved on the first. `max_turns` model turns at most."""

    def __init__(self, tokenizer_path: str | os.PathLike, *, feedback: str = "Incorrect, try again.",
                 max_turns: int = 2, **kwargs: Any) -> None:
        super().__init__(tokenizer_path, **kwargs)
        if max_turns < 1:
            raise ValueError(f"task.options.max_turns={max_turns}: expected >= 1")
        self.feedback, self.max_turns = feedback, max_turns
        self.observation_ids = _observation_encoder(self.tokenizer, self.chat_template, self.enable_thinking)
        self.max_observation_len = len(self.observation_ids(feedback))

    def environment(self) -> "RetryEnvironment":
        return RetryEnvironment(self)


class RetryEnvironment:
    """An `arithmetic_retry` episode: the problem, then `feedback` after each wrong answer
    until the answer is right or the task's `max_turns` replies are spent."""

    def __init__(self, task: ArithmeticRetryTask) -> None:
        self.task, self.answer, self.turns = task, None, 0

    def reset(self, prompt: dict) -> list[dict]:
        self.answer, self.turns = prompt["answer"], 0
        return self.task.messages(prompt["problem"])

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        self.turns += 1
        reward = math_reward(response_text, self.answer)
        if reward == 1.0 or self.turns >= self.task.max_turns:
            return None, reward, True
        return self.task.feedback, 0.0, False


class EnvironmentTask(TextDecoding, FileTask):
    """`environment`: the user's multi-turn task. `prompts_path` is a JSONL of `{"prompt": str,
    ...}`; `environment` a class `module:Class` (or the class) with the `Environment` protocol,
    built as `Class(**environment_options)` once per sample; its `reset` receives the line (every
    key) and must return the first turn as messages (`[{"role": "user", "content":
    line["prompt"]}]` renders to the prompt's ids), its `step` the reply text. The episode's
    reward is the sum of its turns' (`task.reward` is not used). `heldout_path`: an optional
    second JSONL, played greedily for `eval.every` (the first `eval.num_prompts` lines).
    `max_observation_len`: the longest environment answer, in tokens (start-up sizes every
    sample with it; a longer one is an error naming the environment)."""

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
        self.encode_messages = _chat_encoder(tokenizer, chat_template, system_prompt, tokenizer_path, enable_thinking)
        self.observation_ids = _observation_encoder(tokenizer, chat_template, enable_thinking)
        encode = lambda text: self.encode_messages(_user(text))  # noqa: E731
        read = lambda path, key: _read_prompts(path, encode, vocab_size, required=("prompt",), key=key,  # noqa: E731
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

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        raise TypeError("task=environment: the environment's `step` rewards an episode (rl/rollout/episodes.py)")


def arithmetic_value(problem: str) -> int:
    """The value of "a op b op c ..." (integers, `+ - *`, single spaces), `*` binding tighter."""
    tokens = problem.split()
    terms, sign, product = [], 1, int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(num)
        else:
            terms.append(sign * product)
            sign, product = (1 if op == "+" else -1), int(num)
    return sum(terms) + sign * product


def _chat_encoder(tokenizer: Any, chat_template: str | None, system_prompt: str | None,
                  tokenizer_path: Any, enable_thinking: bool | None = None) -> Callable[[list[dict]], list[int]]:
    """messages -> prompt ids: the messages (after `system_prompt`) in the tokenizer's chat
    template ("tokenizer") or a Jinja template, with the generation prompt; or, with
    `chat_template=None`, the messages' texts as is (one message: its text). `enable_thinking`
    (`task.options.enable_thinking`; None: not passed) reaches the template as the variable of
    that name: Qwen3's template opens an empty `<think></think>` block when it is false; a
    template that does not read it renders the same."""
    if chat_template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task.options.chat_template='tokenizer' but the tokenizer at '{tokenizer_path}' "
                         f"has no chat template; give a Jinja template instead (plain text: "
                         f"task.options.chat_template=\"{{{{ messages[-1]['content'] }}}}\")")
    if chat_template is None and system_prompt is not None:
        raise ValueError("task.options.system_prompt needs task.options.chat_template (a system message only "
                         "exists in a chat)")

    def encode(messages: list[dict]) -> list[int]:
        if chat_template is None:
            return list(tokenizer.encode("\n".join(m["content"] for m in messages)))
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        rendered = tokenizer.apply_chat_template(
            system + list(messages), tokenize=False, add_generation_prompt=True,
            chat_template=None if chat_template == "tokenizer" else chat_template, **_thinking(enable_thinking),
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))

    return encode


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


_SENTINEL = "\x00reply\x00"


def _thinking(enable_thinking: bool | None) -> dict:
    return {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}


def _observation_encoder(tokenizer: Any, chat_template: str | None,
                         enable_thinking: bool | None = None) -> Callable[[str], list[int]]:
    """text -> the ids of a user turn that answers an assistant turn, up to the next
    generation prompt: what the chat template puts after an assistant message's content
    (its end-of-turn, the user message, the assistant header), found by rendering a
    conversation whose assistant content is a sentinel. With `chat_template=None`: the
    text on its own line."""
    if chat_template is None:
        return lambda text: list(tokenizer.encode(f"\n{text}\n", add_special_tokens=False))
    template = None if chat_template == "tokenizer" else chat_template

    def encode(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            _user("?") + [{"role": "assistant", "content": _SENTINEL}] + _user(text), tokenize=False,
            add_generation_prompt=True, chat_template=template, **_thinking(enable_thinking))
        if _SENTINEL not in rendered:
            raise ValueError("the chat template drops earlier assistant turns: a multi-turn episode cannot be "
                             "rendered token-in/token-out with it")
        return list(tokenizer.encode(rendered[rendered.index(_SENTINEL) + len(_SENTINEL):], add_special_tokens=False))

    return encode


def load_tokenizer(path: str | os.PathLike, key: str = "task.tokenizer_path") -> Any:
    """A Hugging Face tokenizer from a local folder; never the hub."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}: folder not found: '{path}' (a local tokenizer folder, as written by "
                                f"save_pretrained; nothing is downloaded)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}: '{path}' holds no loadable tokenizer ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------- the answer checker
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?")


def extract_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), else the last number in
    `text` (`-12`, `1,234.5`, `3/4`), else None."""
    last = None
    for m in _BOXED.finditer(text):
        depth, start = 1, m.end()
        for j in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                last = text[start:j]
                break
    if last is not None:
        return last.strip()
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def normalize_answer(answer: Any) -> str:
    """A canonical string: no spaces, `$`, `\\left`/`\\right`, `\\!`, trailing `.`;
    `\\dfrac{a}{b}`/`\\frac{a}{b}` -> `a/b`; thousands separators dropped from numbers."""
    s = str(answer).strip()
    for junk in ("$", "\\left", "\\right", "\\!", "\\,", " "):
        s = s.replace(junk, "")
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return re.sub(r"\((-?[\d.]+)\)", r"\1", s)


def _as_number(s: str) -> float | None:
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)(?:/(-?\d+(?:\.\d+)?))?", s)
    if m is None:
        return None
    num, den = float(m.group(1)), (float(m.group(2)) if m.group(2) else 1.0)
    return None if den == 0 else num / den


def answers_match(predicted: Any, reference: Any) -> bool:
    """Equal after `normalize_answer`, or equal as numbers (fractions allowed) to 1e-6 relative."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    return x is not None and y is not None and abs(x - y) <= 1e-6 * max(1.0, abs(y))


def math_reward(response_text: str, answer: Any, **meta: Any) -> float:
    """1.0 if the response's answer (`extract_answer`) matches `answer`, else 0.0."""
    predicted = extract_answer(response_text)
    return float(predicted is not None and answers_match(predicted, answer))


def _reward_callable(reward_fn: str | Callable) -> tuple[Callable, str]:
    """(fn, its name for errors): a "module:function" spec is loaded and names itself."""
    if isinstance(reward_fn, str):
        return load_callable(reward_fn), reward_fn
    if not callable(reward_fn):
        raise TypeError(f"reward_fn {reward_fn!r} is not callable")
    name = f"{getattr(reward_fn, '__module__', '?')}:{getattr(reward_fn, '__qualname__', type(reward_fn).__name__)}"
    return reward_fn, name


def load_callable(spec: str, key: str = "task.reward_fn") -> Callable:
    """`"package.module:function"` (or `module:Class`) -> the object. The module is looked up on
    sys.path, with the working directory added at its end (`python train.py` puts train.py's
    folder on sys.path, not the folder it is run from); an error names `key`, the spec and
    where the module was looked for."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"{key} '{spec}' is not of the form 'module:function' (e.g. 'my_rewards:exact_match')")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise ImportError(f"{key} '{spec}': importing module '{module_name}' failed ({e})") from e
        places = ", ".join(p or "." for p in sys.path)
        raise ImportError(f"{key} '{spec}': cannot import module '{module_name}': no {module_name.replace('.', '/')}.py "
                          f"in the working directory ({os.getcwd()}) or on sys.path ({places}); put it in the "
                          f"working directory or add its folder to PYTHONPATH") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{key} '{spec}': module '{module_name}' ({getattr(module, '__file__', '?')}) "
                                 f"has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{key} '{spec}': '{attr}' is a {type(obj).__name__}, not a callable")
    return obj


def probe_reward(task: Task, calls: UserCalls | None = None) -> None:
    """Call the task's reward once, at start-up, on a probe sample (its first prompt and a
    one-token response: the stop token, else the prompt's first token), so a reward function
    that raises or returns no number stops the run before a model is built, not after the first
    rollout. With `calls.on_error=skip` (the trainer's default) an exception (or a timeout) is a
    warning instead: a function that fails on some samples (the probe's one-token response is an
    odd one) must not keep the run from starting, and the steps count its failures; a value that
    is not a number is always an error (a type mistake fails on every sample). A multi-turn task's
    reward is its environment's (played in the rollout): not probed."""
    if isinstance(task, MultiTurnTask) or not hasattr(task, "reward"):
        return
    calls = calls or UserCalls.strict()
    (prompt_ids, meta), = task.prompts(1, seed=0)
    response = [task.stop_token_id if task.stop_token_id is not None else int(prompt_ids[0])]
    who = f"the reward function {reward_name(task)}"
    try:  # with task.timeout_s: a reward that hangs on the probe is a timeout, not a start-up that never ends
        value = calls.run(task.reward, prompt_ids, torch.tensor(response), dict(meta), what=who)
    except Exception as e:
        message = (f"{who} raised {type(e).__name__}: {e} on a probe sample at start-up (a prompt of the task, "
                   f"response ids {response}, keywords {sorted(meta)})")
        if calls.on_error is OnError.RAISE:
            raise ValueError(message) from e
        logging.getLogger(__name__).warning("%s; task.on_error=skip: the run starts, and each step counts the samples "
                                            "whose reward fails (episodes_error, episodes_timeout)", message)
        return
    check_reward(value, f"{who} (called once at start-up on a probe sample)", 0, None)  # a wrong type: always an error


def _read_prompts(path: str | os.PathLike, encode: Callable[[str], list[int]] | None, vocab_size: int | None, *,
                  required: Sequence[str] = (), reserved: Sequence[str] = (),
                  key: str = "task.prompts_path", keep_prompt: bool = False) -> list[tuple[list[int], dict]]:
    """[(prompt ids, meta)] from a JSONL file; `encode` tokenizes a `prompt` text (None: no
    tokenizer; `keep_prompt`: the text stays in the meta). Every line must hold the `required`
    keys and none of the `reserved` ones."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{key}: prompts file '{path}' does not exist")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: {where} is not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{key}: {where} is a JSON {type(obj).__name__}, expected an object")
            missing = [k for k in required if k not in obj]
            if missing:
                raise ValueError(f"{key}: {where} has no {missing} (keys: {sorted(obj)})")
            if "prompt_ids" in obj:
                ids = obj.pop("prompt_ids")
                if not keep_prompt:
                    obj.pop("prompt", None)
                if not isinstance(ids, list) or not ids or not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
                    raise ValueError(f"{key}: {where}: 'prompt_ids' must be a non-empty list of ints")
            elif "prompt" in obj:
                text = obj["prompt"] if keep_prompt else obj.pop("prompt")
                if encode is None:
                    raise ValueError(
                        f"{key}: {where} gives 'prompt' text but no tokenizer was given; set "
                        f"task.tokenizer_path=<local tokenizer folder> or give 'prompt_ids'"
                    )
                if not isinstance(text, str):
                    raise ValueError(f"{key}: {where}: 'prompt' must be a string, got {type(text).__name__}")
                ids = encode(text)
                if not ids:
                    raise ValueError(f"{key}: {where}: 'prompt' tokenizes to no tokens")
            else:
                raise ValueError(f"{key}: {where} has neither 'prompt_ids' nor 'prompt' (keys: {sorted(obj)})")
            for name in reserved:
                if name in obj:
                    raise ValueError(f"{key}: {where}: '{name}' is reserved "
                                     f"(the reward receives the response under that name)")
            bad = [v for v in ids if v < 0 or (vocab_size is not None and v >= vocab_size)]
            if bad:
                raise ValueError(f"{key}: {where}: prompt id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            items.append((ids, obj))
    if not items:
        raise ValueError(f"{key}: prompts file '{path}' holds no prompts")
    return items


# --------------------------------------------------------------------- registry
class TaskName(Choice):
    """`task.name`: the built-in tasks."""

    TARGET_TOKEN = "target_token"
    COPY_FIRST = "copy_first"
    COUNT_UP = "count_up"
    FILE = "file"
    MATH = "math"
    ARITHMETIC = "arithmetic"
    ARITHMETIC_RETRY = "arithmetic_retry"
    ENVIRONMENT = "environment"


TASKS: dict[TaskName, Callable[..., Task]] = {
    TaskName.TARGET_TOKEN: TargetToken,
    TaskName.COPY_FIRST: CopyFirst,
    TaskName.COUNT_UP: CountUp,
    TaskName.FILE: FileTask,
    TaskName.MATH: MathTask,
    TaskName.ARITHMETIC: ArithmeticTask,
    TaskName.ARITHMETIC_RETRY: ArithmeticRetryTask,
    TaskName.ENVIRONMENT: EnvironmentTask,
}


def build_task(name: TaskName | str, *, calls: UserCalls | None = None, **kwargs: Any) -> Task:
    """A task by name; None-valued kwargs are dropped, unknown ones are an error naming them.
    `calls` (rl/tasks/calls.py: `task.on_error`, `task.timeout_s`) is kept as `task.calls`:
    how the rollout calls its reward or environments (None: `UserCalls.strict()`)."""
    name = TaskName.parse(name, "task.name")  # an unknown name: a ValueError listing the tasks
    cls = TASKS[name]
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    params = _params(cls)
    unknown = sorted(set(kwargs) - params)
    if unknown:
        raise TypeError(f"task '{name.value}' got unknown options {unknown}; it takes {sorted(params)}")
    task = cls(**kwargs)
    vocab = kwargs.get("vocab_size")
    if vocab is not None and task.min_vocab_size > vocab:
        raise ValueError(f"task '{name.value}' needs a vocabulary of at least {task.min_vocab_size} ids, the model "
                         f"has {vocab}")
    task.calls = calls
    probe_reward(task, calls)
    return task


def _params(cls: type) -> set[str]:
    """Keyword names `cls` accepts, following `**kwargs` up the base classes."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        names |= {p.name for p in sig.parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            break
    return names
