"""Tool calls in an episode: tools declared to the chat template, the reply's calls parsed, the
tools run, their results rendered as the template's tool message (rl/rollout/episodes.py plays it).

    box = Toolbox([python_tool(Limits())], tokenizer, tool_format="hermes")
    prompt = box.encode_messages([{"role": "user", "content": "What is 38 * 17?"}])  # tools= in the template
    calls = box.parse(reply_ids)                 # [ToolCall(name="python", arguments={"code": ...})]
    outputs = [box.run(c, user_calls) for c in calls]
    ids = box.message_ids(outputs)               # the tool message(s), up to the next generation prompt

A tool is a JSON schema (`Tool.schema()`, the `{"type": "function", "function": {...}}` form that
`tokenizer.apply_chat_template(tools=...)` renders; a template that ignores `tools`, such as
SmolLM2's, gets them described in the system turn instead, `Toolbox.describe`) and a function of the call's arguments returning
text (or a `ToolOutput`, text with a status). The reply is parsed by transformers' response parser
(`transformers.utils.chat_parsing.parse_response`) with a template per format (`ToolFormat`):

* `hermes`   - `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one tag per call (or a
               JSON list in one tag): Qwen2/2.5/3 and Qwen3-MoE, SmolLM2/SmolLM3, Hermes.
* `mistral`  - `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral's v3 tokenizers).
* `llama3`   - the whole reply one JSON object `{"name": ..., "parameters": {...}}`, optionally after
               `<|python_tag|>` (Llama 3.1+ JSON tool calling).
* `tokenizer`- the tokenizer's own `response_template` (`tokenizer.parse_response`), for models
               that ship one.
* `markdown` - each fenced ```python block of the reply is a call of the `python` tool (a code
               interpreter; small chat models such as SmolLM2-135M write these unprompted).

The reply is decoded with its special tokens (Mistral's `[TOOL_CALLS]` is one), the stop token at its
end dropped. A call the model got wrong (not JSON, no such tool, arguments that do not fit the tool's
JSON schema: checked with `jsonschema`, a wrong type included) is not a failure of anyone's code: its tool message says what was wrong (status `bad_call`) and the episode
goes on. The tool function runs through the task's `UserCalls` (rl/tasks/calls.py): an exception or a
call past `task.timeout_s` ends that episode (reward 0, status `error` / `timeout`), never the run.

The tool message is found the way rl/tasks/chat.py finds an environment answer: the conversation is
rendered with an assistant turn whose content is a sentinel, followed by the `tool` messages and
the generation prompt; the tokens after the sentinel are the ones the model's turn is followed by
(for Qwen: `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n
<|im_start|>assistant\\n`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jsonschema

from rl.choice import Choice, did_you_mean
from rl.tasks.calls import UserCalls
from rl.tasks.chat import encode_answers
from rl.tasks.sandbox import Limits, Outcome, check_backend, run_python


class ToolFormat(Choice):
    """`task.options.tool_format`: how the model writes a tool call."""

    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3 = "llama3"
    TOKENIZER = "tokenizer"
    MARKDOWN = "markdown"


_LAX = {"allow_non_json": True}  # a call that is not JSON comes back as text: reported to the model
RESPONSE_TEMPLATES: dict[ToolFormat, dict] = {
    ToolFormat.HERMES: {"start_anchor": "<|im_start|>assistant", "fields": {
        "content": {},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "content_args": _LAX}}},
    ToolFormat.MISTRAL: {"start_anchor": "[/INST]", "fields": {
        "content": {},
        "tool_calls": {"open": "[TOOL_CALLS]", "content": "json", "content_args": _LAX}}},
    ToolFormat.LLAMA3: {"start_anchor": "<|start_header_id|>assistant<|end_header_id|>", "fields": {
        "content": {},
        "tool_calls": {"open_pattern": r"^\s*(?:<\|python_tag\|>)?\s*(?=\{)", "content": "json",
                       "content_args": _LAX}}},
    ToolFormat.MARKDOWN: {"start_anchor": "<|im_start|>assistant", "fields": {
        "content": {},
        "tool_calls": {"open_pattern": r"```(?:python|py)[ \t]*\n", "close": "```", "repeats": True,
                       "content_args": {"strip": False},
                       "transform": {"name": "python", "arguments": {"code": "{content}"}}}}},
}


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from a reply; `problem` says why it cannot run (None: it can)."""

    name: str
    arguments: dict
    problem: str | None = None


@dataclass(frozen=True)
class ToolOutput:
    """A tool's answer: `text` (what the model reads) and `status` (`ok`, `bad_call`, or the
    tool's own, e.g. the sandbox's `timeout`, `memory_limit`, `refused`)."""

    text: str
    status: str = "ok"


@dataclass(frozen=True)
class Tool:
    """A tool: its name, description and JSON schema of arguments, and the function called with them."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., str | ToolOutput] = field(compare=False)

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def python_tool(limits: Limits | None = None) -> Tool:
    """The built-in `python` tool: the code runs in the sandbox (rl/tasks/sandbox.py) with `limits`;
    the model reads what it printed, then a status line unless it ended normally."""
    limits = limits or Limits()

    def run(code: str) -> ToolOutput:
        result = run_python(code, limits)
        text = result.output
        if result.truncated:
            text += f"\n[output cut to {limits.max_output_bytes} bytes]"
        if result.status is not Outcome.OK:
            text += "\n[" + _STATUS_TEXT[result.status].format(l=limits, refused="; ".join(result.refused)) + "]"
        return ToolOutput(text.strip("\n") or "(no output)", result.status.value)

    return Tool("python", "Run Python code and return what it prints (stdout and stderr). Each call starts "
                "afresh in a sandbox: no network; files can be written only in the working directory, which is "
                "emptied after the call; limits on time, memory and processes apply.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                 "required": ["code"]}, run)


_STATUS_TEXT = {
    Outcome.ERROR: "status: error",
    Outcome.TIMEOUT: "status: timeout: stopped after {l.wall_s} s",
    Outcome.CPU_LIMIT: "status: cpu_limit: stopped after {l.cpu_s} s of CPU time",
    Outcome.MEMORY_LIMIT: "status: memory_limit: over {l.memory_mb} MB",
    Outcome.REFUSED: "status: refused: {refused}",
    Outcome.KILLED: "status: killed",
}

BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool}


class Toolbox:
    """A task's tools and how its model's chat template declares, writes and answers them (see the
    module docstring). `chat_template`: "tokenizer" (its own), a Jinja string; `system_prompt` goes
    first; `enable_thinking` reaches a template that reads it."""

    def __init__(self, tools: Sequence[Tool], tokenizer: Any, *, tool_format: ToolFormat | str = ToolFormat.HERMES,
                 chat_template: str = "tokenizer", system_prompt: str | None = None,
                 enable_thinking: bool | None = None) -> None:
        if not tools:
            raise ValueError("task.options.tools: expected at least one tool")
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"task.options.tools: names repeat: {names}")
        self.tools = {t.name: t for t in tools}
        self.validators = {}  # a call's arguments are checked against its tool's JSON schema (bad_call if not)
        for t in tools:
            try:
                validator = jsonschema.validators.validator_for(t.parameters)
                validator.check_schema(t.parameters)
            except jsonschema.exceptions.SchemaError as e:
                raise ValueError(f"tool {t.name!r}: its parameters are not a valid JSON schema: {e.message}") from e
            self.validators[t.name] = validator(t.parameters)
        self.schemas = [t.schema() for t in tools]
        self.tokenizer = tokenizer
        self.format = ToolFormat.parse(tool_format, "task.options.tool_format")
        if self.format is ToolFormat.MARKDOWN and "python" not in self.tools:
            raise ValueError("task.options.tool_format=markdown runs code blocks with the python tool: add python "
                             "to task.options.tools")
        if self.format is ToolFormat.TOKENIZER and getattr(tokenizer, "response_template", None) is None:
            raise ValueError("task.options.tool_format=tokenizer but the tokenizer has no response_template; "
                             f"pick one of {[f.value for f in ToolFormat if f is not ToolFormat.TOKENIZER]}")
        self.template = None if chat_template == "tokenizer" else chat_template
        if self.template is None and not tokenizer.chat_template:
            raise ValueError("task.options.chat_template='tokenizer' but the tokenizer has no chat template: "
                             "tool calls need a chat template (give a Jinja one)")
        self.extra = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        probe = [{"role": "user", "content": "?"}]
        self.declared_by_template = self._render(probe) != self._render(probe, tools=False)
        if not self.declared_by_template:  # e.g. SmolLM2's template ignores `tools`: say it in the system turn
            described = self.describe()
            self.system = [{"role": "system", "content": described if system_prompt is None
                            else f"{system_prompt}\n\n{described}"}]

    # ------------------------------------------------------------- rendering
    def _render(self, messages: list[dict], tools: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas if tools else None, tokenize=False,
                                                  add_generation_prompt=True, chat_template=self.template,
                                                  **self.extra)

    def describe(self) -> str:
        """The tools and how to call them, for a chat template that does not declare tools itself
        (the Hermes wording Qwen's template uses, in this task's call format)."""
        tools = "\n".join(json.dumps(s) for s in self.schemas)
        example = _CALL_EXAMPLE[self.format]
        return (f"You may call one or more functions to assist with the user query. You are provided with function "
                f"signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
                f"call, write its name and arguments as JSON:\n{example}")

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """The first turn, tools declared, up to the generation prompt."""
        return self._encode(self._render(self.system + list(messages)))

    def message_ids(self, outputs: Sequence[ToolOutput]) -> list[int]:
        """The tool messages (one per output, in order) as the tokens after the model's turn, up to
        the next generation prompt; the outputs' own text never becomes special tokens
        (rl/tasks/chat.py `encode_answers`)."""
        def render(texts: list[str]) -> str:
            messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
            messages += [{"role": "tool", "content": text} for text in texts]
            rendered = self._render(self.system + messages)
            if _SENTINEL not in rendered:
                raise ValueError("the chat template drops earlier assistant turns: tool results cannot be rendered "
                                 "token-in/token-out with it")
            return rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]

        return encode_answers(self.tokenizer, render, [o.text for o in outputs])  # no forged special tokens

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # --------------------------------------------------------------- parsing
    def parse(self, reply_ids: Sequence[int], stop_token_id: int | None = None) -> list[ToolCall]:
        """The tool calls of a reply (token ids of the model's turn), in order; [] when it makes none."""
        ids = [int(i) for i in reply_ids]
        if ids and stop_token_id is not None and ids[-1] == stop_token_id:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.parse_text(text)

    def parse_text(self, text: str) -> list[ToolCall]:
        try:
            if self.format is ToolFormat.TOKENIZER:
                message = self.tokenizer.parse_response(text, prefix="", tools=self.schemas)
            else:
                from transformers.utils.chat_parsing import parse_response

                message = parse_response(text, RESPONSE_TEMPLATES[self.format], prefix="", tools=self.schemas)
            raw = message.get("tool_calls") or []
            raw = raw if isinstance(raw, list) else [raw]
            flat = [c for item in raw for c in (item if isinstance(item, list) else [item])]
            return [self._call(c) for c in flat]
        except RecursionError:  # JSON nested past the interpreter's recursion limit (decoding or validating it)
            return [ToolCall("?", {}, "a tool call's JSON is nested too deeply to be read")]

    def _call(self, raw: Any) -> ToolCall:
        if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
            raw = raw["function"]  # the OpenAI-style {"type": "function", "function": {...}}
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return ToolCall("?", {}, f"a tool call must be a JSON object with a name, got: {str(raw)[:200]}")
        name = raw["name"]
        args = raw.get("arguments", raw.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if name not in self.tools:
            return ToolCall(name, {}, f"no tool named {name!r}; the tools are {sorted(self.tools)}")
        if not isinstance(args, dict):
            return ToolCall(name, {}, f"the arguments of {name!r} must be a JSON object, got: {str(args)[:200]}")
        schema = self.tools[name].parameters
        missing = [k for k in schema.get("required", []) if k not in args]
        unknown = sorted(set(args) - set(schema.get("properties", {})))  # the function takes no other keyword
        if missing or unknown:
            return ToolCall(name, args, f"{name!r} takes {sorted(schema.get('properties', {}))} (required "
                                        f"{schema.get('required', [])}); missing {missing}, unknown {unknown}")
        wrong = jsonschema.exceptions.best_match(self.validators[name].iter_errors(args))
        if wrong is not None:  # a wrongly typed argument, a value out of its enum, ...
            where = "".join(f"[{p!r}]" for p in wrong.absolute_path)
            return ToolCall(name, args, f"the arguments of {name!r} do not fit its schema: arguments{where}: "
                                        f"{wrong.message[:300]}")
        return ToolCall(name, args)

    # --------------------------------------------------------------- running
    def run(self, call: ToolCall, calls: UserCalls | None = None) -> ToolOutput:
        """The call's output. A call the model got wrong answers `bad_call`; the tool's function runs
        through `calls` (its exception or timeout propagates: the episode's guard ends the episode)."""
        if call.problem is not None:
            return ToolOutput(f"[status: bad_call: {call.problem}]", "bad_call")
        calls = calls or UserCalls.strict()
        out = calls.run_on_thread(self.tools[call.name].fn, what=f"tool {call.name!r}", **call.arguments)
        if isinstance(out, ToolOutput):
            return out
        if not isinstance(out, str):
            raise TypeError(f"tool {call.name!r} returned {type(out).__name__}; a tool returns text (str) or a "
                            f"ToolOutput")
        return ToolOutput(out)


_SENTINEL = "\x00reply\x00"
_CALL_EXAMPLE = {
    ToolFormat.HERMES: '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    ToolFormat.MISTRAL: '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]',
    ToolFormat.LLAMA3: '{"name": <function-name>, "parameters": <args-json-object>} (the whole reply)',
    ToolFormat.TOKENIZER: '{"name": <function-name>, "arguments": <args-json-object>}',
    ToolFormat.MARKDOWN: "```python\n<code>\n``` (a python code block is run by the python tool)",
}


def build_tools(names: Sequence[str], sandbox: dict | None = None) -> list[Tool]:
    """Built-in tools by name (`task.options.tools`), the `python` tool with `task.options.sandbox`
    (rl/tasks/sandbox.py `Limits` fields)."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"task.options.tools={names!r}: expected a list of tool names, e.g. [python]")
    for i, name in enumerate(names):
        if name not in BUILTIN_TOOLS:
            raise ValueError(f"task.options.tools[{i}]={name!r}: no such tool{did_you_mean(name, BUILTIN_TOOLS)} "
                             f"(the built-in tools: {', '.join(sorted(BUILTIN_TOOLS))})")
    limits = sandbox_limits(sandbox) if "python" in names else None
    return [python_tool(limits) if n == "python" else BUILTIN_TOOLS[n]() for n in names]


def sandbox_limits(sandbox: dict | None) -> Limits:
    """`task.options.sandbox` as the python tool's `Limits`, its backend checked to run here
    (rl/tasks/sandbox.py `check_backend`: bwrap missing or unable to make namespaces is refused, naming
    the fix); every error names the key."""
    fields = [f.name for f in dataclasses.fields(Limits)]
    for key in sandbox or {}:
        if key not in fields:
            raise ValueError(f"task.options.sandbox.{key}: no such limit{did_you_mean(key, fields) or '.'} The limits "
                             f"(rl/tasks/sandbox.py Limits): {', '.join(fields)}")
    limits = Limits(**(sandbox or {}))
    try:
        check_backend(limits.backend)
    except RuntimeError as e:
        raise ValueError(f"task.options.sandbox.backend={limits.backend.value}: {e}") from e
    return limits
