"""The `Task` base: seeded prompts and a reward per (prompt, response); rewards assigned per sample.

Flow of one step (the engine never sees the task; rl/rollout/episodes.py is the bridge):

    prompts = task.step_prompts(n, seed=step_seed, ...)    # [(prompt_ids [P] int64, meta dict)]
    records = engine.generate([p for p, _ in prompts], prompt_indices=..., ...)
    assign_rewards(task, records, [m for _, m in prompts])  # sets rec.rewards (0-d fp32)

A multi-turn task (`MultiTurnTask`: `arithmetic_retry`; `environment`, the user's class named
in the config) instead hands out an `Environment` per sample, and `run_episodes` calls
`generate` once per turn (rl/rollout/episodes.py).

Every task is a `Task`: `prompts(n, seed)`, `reward(prompt_ids, response_ids, meta) -> float`,
`min_vocab_size` (the smallest vocabulary its ids fit in), `stop_token_id` (None: every
response runs to max_new_tokens), `max_prompt_len` (the longest prompt it gives, None when
unknown: start-up checks that a whole sample fits in `batch.max_tokens`), `max_turns` and
`max_observation_len` (1 and 0 for a single-turn task), `has_heldout` with `heldout(n)` (a
held-out split for `eval.every`), and `calls` (how its user code is called, set by
`build_task`). The tasks by kind: rl/tasks/synthetic.py (random-prompt toys), files.py (JSONL
tasks, `math`), arithmetic.py, environment.py (the user's environments); rl/tasks/registry.py
builds them by name.

A reward must be a finite real number that fits in fp32 (the trainer's rewards are fp32: 1e39 is inf
there): `assign_rewards` rejects NaN, inf, |x| > 3.4e38, None, bools and strings with a ValueError
naming the reward function, the record, its prompt index and the value (with task.on_error=skip:
that sample's status `error`).
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from packing.experience import Experience
from rl.tasks.calls import OnError, Status, UserCalls

Prompt = tuple[torch.Tensor, dict]
FP32_MAX = torch.finfo(torch.float32).max  # a reward (or an episode's sum of them) beyond it is inf in fp32


class Task(ABC):
    """A task: prompts and their reward (see the module docstring). Subclasses set
    `min_vocab_size` and override what differs from these defaults."""

    min_vocab_size: int
    stop_token_id: int | None = None
    max_prompt_len: int | None = None  # the longest prompt, in tokens; None: not known
    max_turns: int = 1  # model turns per sample
    max_observation_len: int = 0  # the longest environment answer between two turns, in tokens
    reward_name: str | None = None  # how errors name the reward (`module:function`); None: `Class.reward`
    has_heldout: bool = False  # `heldout(n)` gives problems the run never trains on
    calls: UserCalls | None = None  # how the rollout calls its user code (build_task); None: every error raised

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The task's options (`task.options`: every one, defaults filled in; rl/tasks/options.py)
        checked without building anything heavy (no tokenizer, no model; an environment's module is
        imported): a ValueError naming `task.options.<key>`. rl/tasks/registry.py `check_options` calls it from
        `rl.config.validate` and before building a task; a kind with options to check overrides it."""

    @abstractmethod
    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """n prompts drawn from `seed`."""

    @abstractmethod
    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        """The reward of one response (`assign_rewards` checks it is a finite real number)."""

    def step_prompts(self, n: int, *, seed: int, run_seed: int, start: int | None) -> list[Prompt]:
        """A rollout round's n prompts: `prompts(n, seed)`. A task that walks its lines in epochs
        (rl/tasks/files.py `FileTask`) takes positions `start`.. of its stream seeded by `run_seed`
        instead (`start=None`: dynamic sampling's extra rounds, drawn by `seed`)."""
        return self.prompts(n, seed=seed)

    def heldout(self, n: int) -> list[Prompt]:
        """The first n held-out problems (a task with `has_heldout`)."""
        raise ValueError(f"{type(self).__name__} has no held-out split")

    def signal_hint(self) -> str:
        """What to check when no prompt group's rewards differ (the divergence guard's warning,
        rl/trainer/guard.py): by default the reward itself, by its name."""
        name = self.reward_name or f"{type(self).__name__}.reward"
        if name == "rl.tasks.answers:math_reward":
            return ("the reward (rl.tasks.answers:math_reward) compares the reply's last \\boxed{...}, else its last "
                    "number, with the answer: check that the replies end in the answer (a prompt or "
                    "task.options.system_prompt asking for it helps) and are not cut at task.max_new_tokens")
        return f"check the reward ({name}) on a few replies: it never told them apart"


@runtime_checkable
class Environment(Protocol):
    """One episode of a multi-turn task; the task makes a new one per sample (`environment()`).
    A user's class only needs these two methods (no base class); rl/tasks/environment.py adapts
    gym-style and message-level classes to it."""

    def reset(self, prompt: dict) -> list[dict]:
        """The episode's first turn as chat messages, from the prompt's meta (`task.prompts`
        gave the same turn as ids: the rollout checks they agree)."""

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        """The model's reply (decoded without special tokens) -> (the environment's answer as
        the next user turn, or None when done; this turn's reward; done). The episode's
        reward is the sum of its turns' rewards."""


class MultiTurnTask(Task):
    """A task whose samples are episodes (rl/rollout/episodes.py): besides a `Task`'s fields,
    `environment()` (a fresh `Environment`), `max_turns` (model turns at most),
    `encode_messages(messages) -> ids` (a chat rendered up to the generation prompt: what
    `reset`'s messages must give), `observation_ids(text) -> ids` (an environment answer as
    the tokens that follow the model's turn, up to the next generation prompt),
    `max_observation_len` (the longest such answer, in tokens) and `decode(ids) -> text`.
    The episode's reward is its environment's: `reward` is not used."""

    encode_messages: Callable[[list[dict]], list[int]]
    observation_ids: Callable[[str], list[int]]
    strip_thinking: bool = False  # task.options.strip_thinking: past replies' reasoning leaves the context

    def without_thinking(self, ids: list[int]) -> list[int]:
        """A past reply as the next turn's context holds it (`strip_thinking`): unchanged here."""
        return ids

    @abstractmethod
    def environment(self) -> Environment:
        """A fresh environment for one sample."""

    @abstractmethod
    def decode(self, ids: Any) -> str:
        """Reply ids -> the text the environment reads."""

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        raise TypeError(f"{type(self).__name__}: the environment's `step` rewards an episode "
                        f"(rl/rollout/episodes.py)")


def as_ids(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


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


def check_reward(value: Any, who: str, i: int, prompt_index: Any) -> float:
    """`value` as a float; a ValueError naming `who` (the reward function), the record, its
    prompt index and the value unless it is a finite real number within fp32's range (a 0-d real
    tensor counts)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool and not value.is_complex():
        value = value.item()
    prompt = "?" if prompt_index is None else int(prompt_index)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
            not isinstance(value, numbers.Integral) and not math.isfinite(value)):
        raise ValueError(
            f"{who} returned {value!r} ({type(value).__name__}) for record {i} (prompt index {prompt}); a reward "
            f"must be a finite real number (float or int), not NaN, inf, None, a bool or a string")
    try:
        fits = abs(float(value)) <= FP32_MAX
    except OverflowError:  # an int past float64's range
        fits = False
    if not fits:
        raise ValueError(f"{who} returned {value!r} for record {i} (prompt index {prompt}); a reward must fit in "
                         f"fp32 (|reward| <= {FP32_MAX:.4g}): the trainer holds rewards in fp32, where it is inf")
    return float(value)


def reward_name(task: Task) -> str:
    """How errors name a task's reward: its `reward_name` (`module:function`), else `Class.reward`."""
    return task.reward_name or f"{type(task).__name__}.reward"


def task_calls(task: Task) -> UserCalls:
    """How the task's user code is called: the trainer's `task.calls` (task.on_error,
    task.timeout_s), else every error raised (`UserCalls.strict()`)."""
    return task.calls or UserCalls.strict()


def probe_reward(task: Task, calls: UserCalls | None = None) -> None:
    """Call the task's reward once, at start-up, on a probe sample (its first prompt and a
    one-token response: the stop token, else the prompt's first token), so a reward function
    that raises or returns no number stops the run before a model is built, not after the first
    rollout. With `calls.on_error=skip` (the trainer's default) an exception (or a timeout) is a
    warning instead: a function that fails on some samples (the probe's one-token response is an
    odd one) must not keep the run from starting, and the steps count its failures; a value that
    is not a number is always an error (a type mistake fails on every sample). A multi-turn task's
    reward is its environment's (played in the rollout): not probed."""
    if isinstance(task, MultiTurnTask):
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


# ------------------------------------------------------------- the user's code
def reward_callable(reward_fn: str | Callable) -> tuple[Callable, str]:
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
