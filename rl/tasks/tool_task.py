"""`python_tool`: arithmetic the model may compute with the built-in `python` tool (rl/tasks/tools.py,
rl/tasks/sandbox.py): a multi-turn task with a `toolbox`, whose calls rl/rollout/episode.py runs
between the model's replies.

An episode of `python_tool`: the problem (the tools declared by the chat template); each reply that
calls a tool gets the tool's output as the template's tool message and the model goes on; the
first reply that calls none is the answer, rewarded by `math_reward` (1.0 or 0.0). `max_turns`
replies at most (a call in the last one is not run: that reply is the answer).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from rl.tasks.answers import math_reward
from rl.tasks.arithmetic import ArithmeticProblems
from rl.tasks.chat import observation_encoder
from rl.tasks.tools import Toolbox, ToolFormat, ToolOutput, build_tools


class PythonToolTask(ArithmeticProblems):
    """`python_tool`: `arithmetic` with the `python` tool (see the module docstring). `tools`: the
    built-in tools by name; `sandbox`: the python tool's backend and limits (rl/tasks/sandbox.py
    `Limits`: backend, wall_s, cpu_s, memory_mb, max_processes, max_file_mb, max_output_bytes, scratch_mb); `tool_format`: how the
    model writes a call (rl/tasks/tools.py `ToolFormat`); `max_observation_len`: the longest tool
    message in tokens (a longer one is cut, status `truncated`)."""

    def __init__(self, tokenizer_path: str | os.PathLike, *, tools: Sequence[str] = ("python",),
                 sandbox: dict | None = None, tool_format: ToolFormat | str = ToolFormat.HERMES, max_turns: int = 3,
                 max_observation_len: int = 256,
                 template: str = "What is {problem}? You may run Python with the python tool. End your reply "
                                 "with the result.",
                 chat_template: str | None = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None, **kwargs: Any) -> None:
        super().__init__(tokenizer_path, template=template, chat_template=chat_template, system_prompt=system_prompt,
                         enable_thinking=enable_thinking, **kwargs)
        self.toolbox = Toolbox(build_tools(list(tools), sandbox), self.tokenizer, tool_format=tool_format,
                               chat_template=chat_template, system_prompt=system_prompt,
                               enable_thinking=enable_thinking)
        self.encode_messages = self.toolbox.encode_messages  # the prompt declares the tools
        self.observation_ids = observation_encoder(self.tokenizer, chat_template, enable_thinking)
        self.max_turns, self.max_observation_len = max_turns, max_observation_len
        longest = self.encode_messages(self.messages(f" {self.operators[0]} ".join([str(self.high)] * self.operands)))
        frame = self.toolbox.message_ids([ToolOutput("")])
        self.max_prompt_len = len(longest) + 4
        self.min_vocab_size = 1 + max(max(longest), max(frame), self.stop_token_id or 0)

    @classmethod
    def check_options(cls, options: dict) -> None:
        """arithmetic's options, then the tools by name, the sandbox's limits, the call format and the turns."""
        super().check_options(options)
        if options.get("chat_template") is None:
            raise ValueError("task=python_tool needs a chat template (task.options.chat_template): tools are "
                             "declared and answered by it")
        if options["max_turns"] < 2 or options["max_observation_len"] < 1:
            raise ValueError(f"task.options.max_turns={options['max_turns']}, task.options.max_observation_len="
                             f"{options['max_observation_len']}: expected >= 2 (a call, then the answer) and >= 1")
        ToolFormat.parse(options["tool_format"], "task.options.tool_format")
        build_tools(options["tools"], options.get("sandbox"))

    def environment(self) -> "AnswerEnvironment":
        return AnswerEnvironment(self)


class AnswerEnvironment:
    """A `python_tool` episode: the problem; the reply that calls no tool is the answer."""

    def __init__(self, task: PythonToolTask) -> None:
        self.task, self.answer = task, None

    def reset(self, prompt: dict) -> list[dict]:
        self.answer = prompt["answer"]
        return self.task.messages(prompt["problem"])

    def step(self, response_text: str) -> tuple[str | None, float, bool]:
        return None, math_reward(response_text, self.answer), True
