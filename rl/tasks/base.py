"""The `Task`: seeded prompts and what rewards a reply, built from parts, not from mixins.

Flow of one step (the engine never sees the task; rl/rollout/episodes.py plays the samples):

    prompts = task.step_prompts(n, seed=step_seed, ...)    # [(prompt_ids [P] int64, meta dict)]
    records = run_episodes(engine, task, [p for p, _ in prompts], [m for _, m in prompts], ...)

A task is one class over `Task` (never two bases) holding its parts:

* the prompt source: `prompts(n, seed)`, `step_prompts`, `heldout(n)` (`has_heldout`); the
  kinds that walk lines in seeded epochs take rl/tasks/files.py `Lines`;
* the chat renderer (a text task): `tokenizer`, `encode_messages(messages) -> ids` (a chat up to
  the generation prompt), `observation_ids(text) -> ids` (an answer as the tokens between two
  model turns: rl/tasks/chat.py builds both), `decode(ids) -> text`, `without_thinking(ids)`;
* the reward: a single-turn task's rubric, `reward(prompt_ids, response_ids, meta) -> float`;
* the environment factory (a multi-turn task): `environment()`, a fresh `Environment` per
  sample, whose `step` rewards the episode; `max_turns`, `max_observation_len`, `strip_thinking`;
* the tools (rl/tasks/tools.py `Toolbox`, a multi-turn task): `toolbox`, None without.

A task's kind is which of the two rewards it has (`is_multi_turn`: an environment factory):
`check_parts` refuses a class with both (a multi-turn task that inherits a single-turn kind's
`reward` would be played by its environment while its class names another reward) or neither.
The fields besides: `min_vocab_size` (the smallest vocabulary its ids fit in), `stop_token_id`
(None: every response runs to max_new_tokens), `max_prompt_len` (the longest prompt it gives,
None when unknown: start-up checks that a whole sample fits in `batch.max_tokens`), and `calls`
(how its user code is called, set by `build_task`; rl/tasks/calls.py checks rewards). The tasks
by kind: rl/tasks/synthetic.py (random-prompt toys), files.py (JSONL tasks, `math`),
arithmetic.py, tool_task.py, reasoning.py, environment.py (the user's environments);
rl/tasks/registry.py builds them by name.
"""

from __future__ import annotations

import importlib
import os
import sys
from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from rl.tasks.chat import without_thinking

Prompt = tuple[torch.Tensor, dict]


class Task(ABC):
    """A task: its parts (see the module docstring). A kind sets `min_vocab_size`, gives prompts,
    and either overrides `reward` (single-turn) or sets `environment` (multi-turn)."""

    min_vocab_size: int
    stop_token_id: int | None = None
    max_prompt_len: int | None = None  # the longest prompt, in tokens; None: not known
    reward_name: str | None = None  # how errors name the reward (`module:function`); None: `Class.reward`
    has_heldout: bool = False  # `heldout(n)` gives problems the run never trains on
    calls: Any = None  # rl/tasks/calls.py UserCalls: how the rollout calls its user code (build_task); None: strict
    # the chat renderer (a text task)
    tokenizer: Any = None
    encode_messages: Callable[[list[dict]], list[int]] | None = None
    observation_ids: Callable[[str], list[int]] | None = None
    # the environment factory (a multi-turn task: a method `environment(self) -> Environment`) and its turns
    environment: Callable[[], "Environment"] | None = None
    max_turns: int = 1  # model turns per sample
    max_observation_len: int = 0  # the longest environment answer between two turns, in tokens
    strip_thinking: bool = False  # task.options.strip_thinking: past replies' reasoning leaves the context
    toolbox: Any = None  # the tools (rl/tasks/tools.py Toolbox) a multi-turn task's replies may call

    @classmethod
    def check_options(cls, options: dict) -> None:
        """The task's options (`task.options`: every one, defaults filled in; rl/tasks/options.py)
        checked without building anything heavy (no tokenizer, no model; an environment's module is
        imported): a ValueError naming `task.options.<key>`. rl/tasks/registry.py `check_options` calls it from
        `rl.config.validate` and before building a task; a kind with options to check overrides it."""

    @abstractmethod
    def prompts(self, n: int, seed: int) -> list[Prompt]:
        """n prompts drawn from `seed`."""

    def reward(self, prompt_ids: Any, response_ids: Any, meta: dict) -> float:
        """A single-turn task's reward of one response (rl/tasks/calls.py checks it is a finite real
        number). A multi-turn task has none: its environment's `step` rewards an episode."""
        raise TypeError(f"{type(self).__name__}: the environment's `step` rewards an episode "
                        f"(rl/rollout/episodes.py)")

    def step_prompts(self, n: int, *, seed: int, run_seed: int, start: int | None) -> list[Prompt]:
        """A rollout round's n prompts: `prompts(n, seed)`. A task that walks its lines in epochs
        (rl/tasks/files.py `Lines`) takes positions `start`.. of its stream seeded by `run_seed`
        instead (`start=None`: dynamic sampling's extra rounds, drawn by `seed`)."""
        return self.prompts(n, seed=seed)

    def heldout(self, n: int) -> list[Prompt]:
        """The first n held-out problems (a task with `has_heldout`)."""
        raise ValueError(f"{type(self).__name__} has no held-out split")

    def decode(self, ids: Any) -> str:
        """Reply ids -> the text a reward or an environment reads: special tokens skipped."""
        if self.tokenizer is None:
            raise TypeError(f"{type(self).__name__} has no tokenizer to decode replies with")
        return self.tokenizer.decode(as_ids(ids), skip_special_tokens=True)

    def without_thinking(self, ids: list[int]) -> list[int]:
        """A past reply as the next turn's context holds it (`strip_thinking`, rl/tasks/chat.py
        `without_thinking`); unchanged without a tokenizer."""
        return ids if self.tokenizer is None else without_thinking(self.tokenizer, ids)

    def signal_hint(self) -> str:
        """What to check when no prompt group's rewards differ (the divergence guard's warning,
        rl/trainer/guard.py): by default the reward itself, by its name."""
        name = reward_name(self)
        if name == "rl.tasks.answers:math_reward":
            return ("the reward (rl.tasks.answers:math_reward) compares the reply's last \\boxed{...}, else its last "
                    "number, with the answer: check that the replies end in the answer (a prompt or "
                    "task.options.system_prompt asking for it helps) and are not cut at task.max_new_tokens")
        return f"check the reward ({name}) on a few replies: it never told them apart"


def reward_name(task: Task) -> str:
    """How errors name a task's reward: its `reward_name` (`module:function`), else `Class.reward`."""
    return task.reward_name or f"{type(task).__name__}.reward"


def as_ids(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


def is_multi_turn(task: Task) -> bool:
    """A task whose samples are episodes of several turns: it has an environment factory."""
    return getattr(task, "environment", None) is not None


def check_parts(task: Task) -> None:
    """The task's reward is its kind's: a single-turn task has its own `reward` and no environment,
    a multi-turn one an environment and no single-turn `reward` (see the module docstring); a
    TypeError naming the class otherwise."""
    rubric = getattr(type(task), "reward", Task.reward) is not Task.reward
    if is_multi_turn(task) and rubric:
        raise TypeError(f"{type(task).__name__} has an environment and a single-turn reward "
                        f"({_owner(type(task), 'reward')}.reward): a multi-turn task's episode is rewarded by its "
                        f"environment's step; build it from a prompt source without a reward")
    if not is_multi_turn(task) and not rubric:
        raise TypeError(f"{type(task).__name__} has neither a reward nor an environment: a single-turn task "
                        f"overrides `reward`, a multi-turn one sets `environment`")


def _owner(cls: type, name: str) -> str:
    return next(k.__name__ for k in cls.__mro__ if name in vars(k))


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


def longest_sample(task: Task, max_new_tokens: int) -> int | None:
    """The most tokens one sample of `task` can hold with replies of up to `max_new_tokens`: its
    longest prompt, plus a reply per turn of a multi-turn task (`max_turns`) and an environment
    answer of up to `max_observation_len` between two turns. None when the task does not say how
    long its prompts are. What start-up checks against `batch.max_tokens`, and the vLLM engine's
    `max_model_len` (rl/rollout/build.py): the last turn's context holds every earlier one."""
    prompt, turns = task.max_prompt_len, task.max_turns
    if prompt is None:
        return None
    return int(prompt) + max_new_tokens * turns + (turns - 1) * task.max_observation_len
