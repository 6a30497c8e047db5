"""`task.options.*`: the options of each task kind, one source for the start-up checks and the
configuration reference.

A task kind's options are the keywords of its class's constructor (rl/tasks/registry.py `TASKS`),
following `**kwargs` up its base classes, less those the config passes itself (`NOT_OPTIONS`:
`task.prompts_path`, `task.reward_fn`, `task.tokenizer_path`, the model's vocabulary): their
names, types and defaults are the signature's. What each means is `MEANINGS` (by option name; by
`Class.name` where a task class, or one it derives from, reads an option its own way); an option with structure of its own lists
its keys too (`sandbox.*`: rl/tasks/sandbox.py `Limits`; `datasets.NAME.*`). rl/tasks/registry.py
`check_options` checks the options a config gives against them (`rl.config.validate`: before any
model or tokenizer is built), scripts/config_reference.py writes them into docs/config-reference.md,
and tests/test_config_reference.py fails on an option without a meaning.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass
from typing import Any

# constructor keywords that are not task.options: the config's own keys (or the model's) pass them
NOT_OPTIONS = {"prompts_path": "task.prompts_path", "reward_fn": "task.reward_fn",
               "tokenizer_path": "task.tokenizer_path", "vocab_size": "the model's vocabulary (model.*)"}

REQUIRED = inspect.Parameter.empty  # an option without a default

_CHAT = ("the prompt's chat template: `tokenizer` (the tokenizer's own), a Jinja template string, or null "
         "(the text as is)")
MEANINGS: dict[str, str] = {
    # random-prompt toys (rl/tasks/synthetic.py)
    "low": "the smallest prompt id (ids below it are left to special tokens)",
    "num_symbols": "prompt ids are drawn from low .. low + num_symbols - 1; null: the task's own (target_token: "
                   "every id up to the vocabulary, copy_first and count_up: 8)",
    "min_len": "the shortest prompt, in tokens",
    "max_len": "the longest prompt, in tokens",
    "target": "the token id every response token is rewarded for",
    "stop_token_id": "the token that ends a reply; null: the tokenizer's EOS (a toy task: none, every reply runs to "
                     "task.max_new_tokens)",
    # text tasks (rl/tasks/chat.py)
    "tokenizer": "a tokenizer folder for text prompts ({\"prompt\": ...} lines); the same as task.tokenizer_path "
                 "(give one of the two)",
    "chat_template": _CHAT,
    "system_prompt": "a system message before the user turn (null: none; needs a chat template)",
    "enable_thinking": "true|false: passed to a chat template that reads it (Qwen3: false = no reasoning block); "
                       "null: not passed",
    "template": "the user turn, with the problem in its field",
    "ArithmeticProblems.template": "the user turn; {problem} is replaced by the problem (\"38 + 17\")",
    "ReasoningGymTask.template": "the user turn; {question} is replaced by the dataset's question",
    # arithmetic (rl/tasks/arithmetic.py)
    "operands": "integers per problem (>= 2)",
    "ArithmeticProblems.low": "the smallest operand",
    "high": "the largest operand",
    "operators": "the operators drawn from, a string of + - * (usual precedence)",
    "heldout_every": "one in k problems (by a hash of its text) is held out for eval.every, never trained on",
    "feedback": "the user turn after a wrong answer",
    "max_turns": "model replies per episode at most",
    "PythonToolTask.max_turns": "model replies per episode at most: tool calls, then the answer (a call in the last "
                             "reply is not run)",
    "strip_thinking": "true: past replies lose their `<think>` blocks in the next turn's context (as Qwen3's "
                      "template renders them); only the last reply is trained",
    "max_observation_len": "the longest environment answer between two turns, in tokens (a longer one is cut: "
                           "status truncated)",
    "PythonToolTask.max_observation_len": "the longest tool message, in tokens (a longer one is cut: status truncated)",
    # python_tool (rl/tasks/tool_task.py, tools.py, sandbox.py)
    "tools": "the built-in tools the model may call, by name (rl/tasks/tools.py BUILTIN_TOOLS: python)",
    "tool_format": "how the model writes a tool call: hermes (Qwen, SmolLM), mistral, llama3, tokenizer (its "
                   "response_template) or markdown (each python code block of the reply runs in the python tool)",
    "sandbox": "the python tool's limits per call (rl/tasks/sandbox.py Limits): the keys below",
    "sandbox.wall_s": "wall-clock seconds before the code is stopped (status timeout)",
    "sandbox.cpu_s": "CPU seconds before the code is stopped (status cpu_limit)",
    "sandbox.memory_mb": "address space in MB (status memory_limit past it)",
    "sandbox.max_processes": "processes the code may run at once",
    "sandbox.max_file_mb": "the largest file the code may write, in MB",
    "sandbox.max_output_bytes": "what the model reads of the output: bytes of stdout and stderr kept (the rest cut)",
    "sandbox.scratch_mb": "backend=bwrap: the size in MB of the private tmpfs /tmp (scratch, HOME) and of /dev/shm",
    "sandbox.backend": "bwrap: kernel isolation by bubblewrap (namespaces, read-only filesystem, no capabilities); "
                       "process: a plain child process with rlimits and Python guards, NOT a security boundary "
                       "(docs/tools.md)",
    # environment (rl/tasks/environment.py)
    "environment": "your environment class, 'module:Class' (reset and step; text, message-level or gym-style)",
    "environment_options": "keywords of the environment class's constructor: Class(**environment_options), checked "
                           "against its signature at start-up",
    "interface": "how the class is called: auto (detected from reset/step), text, messages or gym",
    "heldout_path": "a JSONL of held-out prompts for eval.every (text and message-level environments)",
    "max_prompt_len": "gym-style: the longest first observation, in tokens (null: the longest of 16 resets)",
    # reasoning_gym (rl/tasks/reasoning.py)
    "dataset": "a reasoning-gym dataset name, e.g. basic_arithmetic, chain_sum, countdown (or datasets)",
    "dataset_config": "that dataset's config fields, e.g. {min_terms: 2, max_terms: 2}",
    "datasets": "instead of dataset: several, mixed by weight: {NAME: {weight: W, config: {...}}, ...}",
    "datasets.NAME.weight": "that dataset's share of the problems (> 0)",
    "datasets.NAME.config": "that dataset's config fields",
    "size": "training problems (walked in seeded epochs)",
    "dataset_seed": "the training problems' seed; the held-out ones come from past its range",
    "answer_tag": "the tag around the answer: the reply's last `<answer>...</answer>` block by default; \"\": the "
                  "whole reply",
    "answer_pattern": "a regular expression: the answer is its last match in the reply (instead of answer_tag; "
                      "for models that answer in prose)",
}


@dataclass(frozen=True)
class Option:
    """One `task.options` key of a task kind: `key` (dotted below task.options), its type as the
    source declares it, its default (`REQUIRED`: none) and what it means ("" where `MEANINGS` has
    nothing: tests/test_config_reference.py fails on it)."""

    key: str
    type: Any
    default: Any
    meaning: str


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


def meaning(cls: type, key: str) -> str:
    """What option `key` means to task class `cls`: `MEANINGS` by `Class.key` (cls or a base), else by key."""
    for klass in cls.__mro__:
        if f"{klass.__name__}.{key}" in MEANINGS:
            return MEANINGS[f"{klass.__name__}.{key}"]
    return MEANINGS.get(key, "")


def options_of(cls: type) -> list[Option]:
    """Every `task.options` key of task class `cls`, nested ones after their parent."""
    from rl.tasks.sandbox import Limits

    out = []
    for name, p in option_parameters(cls).items():
        out.append(Option(name, p.annotation, p.default, meaning(cls, name)))
        if name == "sandbox":
            hints = typing.get_type_hints(Limits)
            out += [Option(f"sandbox.{f.name}", hints[f.name], f.default, meaning(cls, f"sandbox.{f.name}"))
                    for f in dataclasses.fields(Limits)]
        elif name == "datasets":
            out += [Option("datasets.NAME.weight", float, 1.0, meaning(cls, "datasets.NAME.weight")),
                    Option("datasets.NAME.config", dict, {}, meaning(cls, "datasets.NAME.config"))]
    return out
