"""The tasks by name: `build_task(name, **kwargs)` builds any of them (`task.name`); None-valued
kwargs are dropped, so a caller can pass every task option and each task takes the ones it knows."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from rl.choice import Choice
from rl.tasks.arithmetic import ArithmeticRetryTask, ArithmeticTask
from rl.tasks.base import Task, probe_reward
from rl.tasks.calls import UserCalls
from rl.tasks.environment import EnvironmentTask
from rl.tasks.files import FileTask, MathTask
from rl.tasks.reasoning import ReasoningGymTask
from rl.tasks.synthetic import CopyFirst, CountUp, TargetToken
from rl.tasks.tool_task import PythonToolTask


class TaskName(Choice):
    """`task.name`: the built-in tasks."""

    TARGET_TOKEN = "target_token"
    COPY_FIRST = "copy_first"
    COUNT_UP = "count_up"
    FILE = "file"
    MATH = "math"
    ARITHMETIC = "arithmetic"
    ARITHMETIC_RETRY = "arithmetic_retry"
    PYTHON_TOOL = "python_tool"
    ENVIRONMENT = "environment"
    REASONING_GYM = "reasoning_gym"


TASKS: dict[TaskName, Callable[..., Task]] = {
    TaskName.TARGET_TOKEN: TargetToken,
    TaskName.COPY_FIRST: CopyFirst,
    TaskName.COUNT_UP: CountUp,
    TaskName.FILE: FileTask,
    TaskName.MATH: MathTask,
    TaskName.ARITHMETIC: ArithmeticTask,
    TaskName.ARITHMETIC_RETRY: ArithmeticRetryTask,
    TaskName.PYTHON_TOOL: PythonToolTask,
    TaskName.ENVIRONMENT: EnvironmentTask,
    TaskName.REASONING_GYM: ReasoningGymTask,
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
