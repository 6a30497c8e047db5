"""The tasks by name: `build_task(name, **kwargs)` builds any of them (`task.name`); None-valued
kwargs are dropped, so a caller can pass every task option and each task takes the ones it knows."""

from __future__ import annotations

from typing import Any, Callable

from rl.choice import Choice, did_you_mean
from rl.tasks.arithmetic import ArithmeticRetryTask, ArithmeticTask
from rl.tasks.base import Task, check_parts
from rl.tasks.calls import UserCalls, probe_reward
from rl.tasks.environment import EnvironmentTask
from rl.tasks.files import FileTask, MathTask
from rl.tasks.options import NOT_OPTIONS, option_parameters, parameters
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
    """A task by name; None-valued kwargs are dropped, unknown ones are an error naming them, and
    its options are checked (`check_options`) before it is built. `calls` (rl/tasks/calls.py:
    `task.on_error`, `task.timeout_s`) is kept as `task.calls`: how the rollout calls its reward or
    environments (None: `UserCalls.strict()`)."""
    name = TaskName.parse(name, "task.name")  # an unknown name: a ValueError listing the tasks
    cls = TASKS[name]
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    params = parameters(cls)
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"task '{name.value}' got unknown options {unknown}; it takes {sorted(params)}")
    check_options(name, {k: v for k, v in kwargs.items() if k not in NOT_OPTIONS})
    task = cls(**kwargs)
    vocab = kwargs.get("vocab_size")
    if vocab is not None and task.min_vocab_size > vocab:
        raise ValueError(f"task '{name.value}' needs a vocabulary of at least {task.min_vocab_size} ids, the model "
                         f"has {vocab}")
    check_parts(task)  # its reward is its kind's: a single-turn rubric or an environment, not both
    task.calls = calls
    if calls is not None:
        calls.share(task)  # task.isolation=process: the workers' zygote, holding the task, forked now
    probe_reward(task, calls)
    return task


def check_options(name: TaskName | str, options: dict) -> None:
    """`task.options` of task kind `name`, checked without building anything heavy (what
    `rl.config.validate` runs before any model or tokenizer is built): every key is one of the
    kind's options (rl/tasks/options.py; a misspelt one names the closest), and the kind's own
    `Task.check_options` passes on them with the defaults filled in (a None value: the default)."""
    name = TaskName.parse(name, "task.name")
    cls = TASKS[name]
    known = option_parameters(cls)
    for key in options:
        if key in NOT_OPTIONS:
            raise ValueError(f"task.options.{key}: not a task option; set {NOT_OPTIONS[key]}")
        if key not in known:
            raise ValueError(f"task.options.{key}: task={name.value} has no such option"
                             f"{did_you_mean(key, known) or '.'} Its options: {', '.join(known) or '(none)'}")
    given = {k: v for k, v in options.items() if v is not None}
    cls.check_options({k: p.default for k, p in known.items() if p.default is not p.empty} | given)
