"""Verifiable tasks: seeded prompts and a reward per (prompt, response).

Flow of one step (the engine never sees the task; `score` is the only bridge):

    prompts = task.prompts(n, seed=step_seed)              # [(prompt_ids [P] int64, meta dict)]
    records = engine.generate([p for p, _ in prompts], prompt_indices=..., ...)
    score(task, records, [m for _, m in prompts])          # sets rec.rewards (0-d fp32)

A `Task` gives `prompts(n, seed)`, `reward(prompt_ids, response_ids, meta) -> float`,
`min_vocab_size` (the smallest vocabulary its ids fit in) and `stop_token_id` (None: every
response runs to max_new_tokens).

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

`FileTask` is the user's task: a JSONL file of prompts and a `module:function` reward.
`build_task(name, **kwargs)` builds any of them by name; None-valued kwargs are dropped,
so a caller can pass every task option and each task takes the ones it knows.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import os
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from packing.experience import Experience

Prompt = tuple[torch.Tensor, dict]


@runtime_checkable
class Task(Protocol):
    min_vocab_size: int
    stop_token_id: int | None

    def prompts(self, n: int, seed: int) -> list[Prompt]: ...

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float: ...


def score(task: Task, records: Sequence[Experience], metas: Sequence[dict]) -> list[Experience]:
    """Set `rec.rewards` (0-d fp32) on each record from `task.reward`; returns the records."""
    if len(records) != len(metas):
        raise ValueError(f"score: {len(records)} records but {len(metas)} metas (one per record)")
    for i, (rec, meta) in enumerate(zip(records, metas)):
        n_prompt = rec.sequences.numel() - int(rec.response_length)
        value = task.reward(rec.sequences[:n_prompt], rec.sequences[n_prompt:], meta)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"score: the reward of record {i} is {value!r}; a task's reward must be a finite float")
        rec.rewards = torch.tensor(float(value), dtype=torch.float32)
    return list(records)


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
    (text, tokenized with `tokenizer`: a Hugging Face tokenizer or a local pretrained path);
    every other key goes to the reward as a keyword: `fn(prompt_ids: list[int],
    response_ids: list[int], **meta) -> float`. `prompts(n, seed)` takes n prompts in an
    order shuffled by `seed` (cycling if n exceeds the file). `stop_token_id` defaults to
    the tokenizer's EOS when a tokenizer is given.
    """

    def __init__(self, prompts_path: str | os.PathLike, reward_fn: str | Callable, tokenizer: Any = None, *,
                 vocab_size: int | None = None, stop_token_id: int | None = None) -> None:
        self.reward_fn = load_callable(reward_fn) if isinstance(reward_fn, str) else reward_fn
        if not callable(self.reward_fn):
            raise TypeError(f"FileTask: reward_fn {reward_fn!r} is not callable")
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer
        self.items = _read_prompts(prompts_path, tokenizer, vocab_size)
        self.min_vocab_size = 1 + max(max(ids) for ids, _ in self.items)
        if stop_token_id is None and tokenizer is not None:
            stop_token_id = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_id = stop_token_id

    def __len__(self) -> int:
        return len(self.items)

    def prompts(self, n: int, seed: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(int(seed))
        order = torch.randperm(len(self.items), generator=g).tolist()
        picks = [order[i % len(order)] for i in range(n)]
        return [(torch.tensor(self.items[j][0], dtype=torch.int64), dict(self.items[j][1])) for j in picks]

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        return float(self.reward_fn(_ids(prompt_ids), _ids(response_ids), **meta))


def load_callable(spec: str) -> Callable:
    """`"package.module:function"` -> the function (the repo root is importable under torchrun)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"reward_fn '{spec}' is not of the form 'module:function' (e.g. 'my_rewards:exact_match')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"reward_fn '{spec}': cannot import module '{module_name}' ({e})") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"reward_fn '{spec}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward_fn '{spec}': '{attr}' is a {type(obj).__name__}, not a callable")
    return obj


def _read_prompts(path: str | os.PathLike, tokenizer: Any, vocab_size: int | None) -> list[tuple[list[int], dict]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"FileTask: prompts file '{path}' does not exist")
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"FileTask: {where} is not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise ValueError(f"FileTask: {where} is a JSON {type(obj).__name__}, expected an object")
            if "prompt_ids" in obj:
                ids = obj.pop("prompt_ids")
                obj.pop("prompt", None)
                if not isinstance(ids, list) or not ids or not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
                    raise ValueError(f"FileTask: {where}: 'prompt_ids' must be a non-empty list of ints")
            elif "prompt" in obj:
                text = obj.pop("prompt")
                if tokenizer is None:
                    raise ValueError(
                        f"FileTask: {where} gives 'prompt' text but no tokenizer was given; pass "
                        f"tokenizer=<local pretrained path> or give 'prompt_ids'"
                    )
                if not isinstance(text, str):
                    raise ValueError(f"FileTask: {where}: 'prompt' must be a string, got {type(text).__name__}")
                ids = list(tokenizer.encode(text))
                if not ids:
                    raise ValueError(f"FileTask: {where}: 'prompt' tokenizes to no tokens")
            else:
                raise ValueError(f"FileTask: {where} has neither 'prompt_ids' nor 'prompt' (keys: {sorted(obj)})")
            if "response_ids" in obj:
                raise ValueError(f"FileTask: {where}: 'response_ids' is reserved (the reward receives the response under that name)")
            bad = [v for v in ids if v < 0 or (vocab_size is not None and v >= vocab_size)]
            if bad:
                raise ValueError(f"FileTask: {where}: prompt id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            items.append((ids, obj))
    if not items:
        raise ValueError(f"FileTask: prompts file '{path}' holds no prompts")
    return items


# --------------------------------------------------------------------- registry
TASKS: dict[str, Callable[..., Task]] = {
    "target_token": TargetToken,
    "copy_first": CopyFirst,
    "count_up": CountUp,
    "file": FileTask,
}


def build_task(name: str, **kwargs: Any) -> Task:
    """A task by name; None-valued kwargs are dropped, unknown ones are an error naming them."""
    if name not in TASKS:
        raise ValueError(f"task '{name}' is not one of {sorted(TASKS)}")
    cls = TASKS[name]
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    params = _params(cls)
    unknown = sorted(set(kwargs) - params)
    if unknown:
        raise TypeError(f"task '{name}' got unknown options {unknown}; it takes {sorted(params)}")
    task = cls(**kwargs)
    vocab = kwargs.get("vocab_size")
    if vocab is not None and task.min_vocab_size > vocab:
        raise ValueError(f"task '{name}' needs a vocabulary of at least {task.min_vocab_size} ids, the model has {vocab}")
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
