"""`task.options.*`: the options of each task kind.

A task kind's options are the keywords of its class's constructor (rl/tasks/registry.py `TASKS`),
following `**kwargs` up its base classes, less those the config passes itself (`NOT_OPTIONS`:
`task.prompts_path`, `task.reward_fn`, `task.tokenizer_path`, the model's vocabulary): their
names, types and defaults are the signature's. rl/tasks/registry.py `check_options` checks the
options a config gives against them (`rl.config.validate`: before any model or tokenizer is built).
"""

from __future__ import annotations

import inspect
import typing

# constructor keywords that are not task.options: the config's own keys (or the model's) pass them
NOT_OPTIONS = {"prompts_path": "task.prompts_path", "reward_fn": "task.reward_fn",
               "tokenizer_path": "task.tokenizer_path", "vocab_size": "the model's vocabulary (model.*)"}


def parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keywords `cls` accepts, following `**kwargs` up the base classes, with their types
    resolved (a class's own annotations win over a base's)."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        sig = inspect.signature(init)
        try:
            hints = typing.get_type_hints(init)
        except (NameError, TypeError):  # an annotation that does not resolve: kept as written
            hints = {}
        for p in list(sig.parameters.values())[1:]:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in out:
                out[p.name] = p.replace(annotation=hints.get(p.name, p.annotation))
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            break
    return out


def option_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The constructor keywords of task class `cls` that are `task.options` keys."""
    return {name: p for name, p in parameters(cls).items() if name not in NOT_OPTIONS}
