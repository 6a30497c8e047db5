"""One sample's episode, token-in / token-out: `Episode` owns its turns, the tools its replies call,
the environment's answers (cut to fit), past thinking stripped, its status and its finished record;
rl/rollout/episodes.py `run_episodes` only batches the engine's calls over the episodes:

    episode.reset()                      # context = the prompt (multi-turn: env.reset(meta) rendered, checked equal)
    while not episode.done:              # one `engine.generate` per turn from `context`, every playing sample at once
        episode.start(reply)             # the reply's tool calls start (a turn's calls overlap, on threads)
        episode.step(reply)              # the next turn's `context`, or `done`
    record = episode.record()

A single-turn task's episode is its one reply, rewarded by the task's `reward` (rl/tasks/calls.py
`reward_record`, through the task's `calls`: status `done`, or `error` / `timeout`): the record is the
engine's. A multi-turn task's (rl/tasks/base.py: it has an `environment`):

    context = prompt ids
    for turn in range(task.max_turns):
        response = the reply generated from context
        observation, reward, done = env.step(task.decode(response))
        context += response + task.observation_ids(observation)     unless done

The trainer scores exactly the tokens the engine produced: nothing is decoded and encoded
again. The record (`make_record`) is the whole episode, `sequences [T]` = prompt, response
1, observation 1, response 2, ...; its `action_mask` is True on the slots that score the
sampled tokens and False on the environment's, so it has holes; `rollout_log_probs` are the
engine's per turn (0 on the environment's slots); `response_length` counts every token after
the prompt; `rewards` is the sum of the turns' rewards; `turns` the model turns taken.
Everything downstream (exchange, packing, shared prompts, CP, losses, advantages) reads
the mask, so a hole costs nothing special: GAE carries its recursion over it.

When the model's reply ends with the stop token and the observation starts with it (the
chat template's end-of-turn is the stop token, as in ChatML), the observation's copy is
dropped: the turn is closed once. A reply cut at `max_new_tokens` keeps the template's
end-of-turn from the observation.

Tools (a task with a `toolbox`, rl/tasks/tool_task.py): a reply that calls a tool (parsed by the
toolbox, rl/tasks/tools.py) is answered by the tools, not the environment: their outputs, rendered
as the chat template's tool message, enter the context as observation tokens (action mask False,
cut like an environment answer), and the model replies again. A turn's calls run on a few threads
at once (a sandboxed call mostly waits for its process). The first reply that calls none, or
the last turn's, goes to `env.step`. A tool that raises or runs past `task.timeout_s` ends its
episode like a failing environment; what the code run by the `python` tool did (a timeout, the
memory limit, a refused write) is reported to the model in the tool message, and the episode goes on.

The user's code (`task.environment()`, `reset`, `step`, the tools) runs through the task's `calls`
(rl/tasks/calls.py: `task.on_error`, `task.timeout_s`): with on_error=skip an exception or a
timeout ends that one episode with reward 0 and status `error` or `timeout` (an environment that
failed mid-episode is never called again; the tokens so far stay in its record, so the step's
calls to the engine are the same whatever failed); the run goes on. Every record gets a `status`
(rl/tasks/calls.py `Status`): `done` (the environment ended it, or a single-turn reward),
`max_turns` (the last turn came and the environment was not done), `truncated` (an answer was
cut, below), `error`, `timeout`.

An environment answer (or tool output) longer than `rl/tasks/chat.py answer_chars` characters (the
most that `task.max_observation_len` tokens can stand for) is cut to them before it is tokenized, so
an answer of any size costs what its start does, and counts as `truncated`.
An environment answer longer than `task.max_observation_len` tokens is cut to fit, not an error:
the answer's text tokens are cut at their end and the chat template's frame around them (the
end of the model's turn before, the next generation prompt after: the ids `observation_ids("")`
shares with the answer at its start and end) is kept, so the next turn still starts where the
template puts it; the episode goes on and ends with status `truncated` (unless it fails). When
even the frame does not fit, the episode ends there (status `truncated`).

task.strip_thinking: after each turn the replies so far lose their reasoning (`forget_thinking`).

The turns as they went: each record of a multi-turn task carries `trace`, a list of `Turn` (one per
model turn: where its reply and the answer after it lie in the response, the tool calls with their
outputs, the environment's answer and reward, a cut, a failure). It is a plain attribute, not an
`Experience` field: it stays on the rank that generated the record (never exchanged, collated or
checkpointed; a rollout restored from a checkpoint has none). rl/rollout/samples.py reads it for
the step's tool and environment counts and for `trainer.log_samples`.

Routing (MoE): each token's recorded routing is that of the turn it entered the engine in:
the prompt and turn 1's reply from turn 1, an observation and the reply after it from the
next turn's prefill and decode.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from packing.experience import Experience
from rl.rollout.engine import make_record
from rl.seeds import derive
from rl.tasks.base import Task, is_multi_turn
from rl.tasks.calls import FP32_MAX, Status, UserCalls, check_reward, reward_record
from rl.tasks.chat import answer_chars
from rl.tasks.processes import RemoteEnvironment
from rl.tasks.tools import ToolCall, ToolOutput

_TOOL_THREADS = 8
# one pool for the process (its threads start on first use): they keep their UserCalls workers from turn to turn
_tool_pool = ThreadPoolExecutor(_TOOL_THREADS, thread_name_prefix="tools")
_ENV_SALT = 0x5EED_E7E7  # environment seeds are drawn apart from the engine's sample seeds


def environment_seed(seed: int, prompt_index: int, place: int) -> int:
    """The seed an environment's `reset(prompt, seed=...)` gets: a function of the call's seed
    (the run's seed and the step), the prompt index and the sample's place in its group."""
    return derive(derive(seed, _ENV_SALT, 0), prompt_index, place)


@dataclass
class Turn:
    """One model turn of an episode (the record's `trace`, see the module docstring). `reply` and
    `message`: [start, end) in the record's response of the reply and of the answer or tool message
    that followed it in the context (None: none did); `calls`: the tool calls the reply made, each
    with its output (None: the tool raised or ran past task.timeout_s); `environment`: the reply went
    to the environment's `step`, which gave `answer` and `reward`; `cut`: the answer or tool message
    was cut to task.max_observation_len; `failed`: the status (`error`, `timeout`) the user's code
    ended the episode with in this turn."""

    piece: int  # the reply's index in Episode.pieces, until `Episode.spans` sets reply and message
    reply: tuple[int, int] = (0, 0)
    message: tuple[int, int] | None = None
    calls: list[tuple[ToolCall, ToolOutput | None]] = field(default_factory=list)
    environment: bool = False
    answer: str | None = None
    reward: float | None = None
    cut: bool = False
    failed: str | None = None


class Play:
    """What the episodes of one `run_episodes` call share: the task, how its user code is called
    (`calls`), the engine's stop token, the bound on an answer's characters, and the chat template's
    frames around an empty answer (rendered once, when a cut first needs them). The tools run on the
    process's one pool, `_tool_pool`."""

    def __init__(self, task: Task, calls: UserCalls, stop: int | None, seed: int) -> None:
        self.task, self.calls, self.stop, self.seed = task, calls, stop, seed
        self.name = task.reward_name or f"{type(task).__name__}.environment"
        self.tools_of = f"tools of {type(task).__name__}"
        tokenizer = task.tokenizer  # answers are cut to `chars` characters before they are tokenized
        self.chars = answer_chars(tokenizer, task.max_observation_len) if tokenizer is not None else None
        self._frames: dict[str, list[int]] = {}

    def frame(self, kind: str) -> list[int]:
        """The template's ids around an empty answer: kind `observation` (an environment's), `tool`."""
        if kind not in self._frames:
            self._frames[kind] = (list(self.task.observation_ids("")) if kind == "observation" else
                                  self.task.toolbox.message_ids([ToolOutput("")]))
        return self._frames[kind]


class Episode:
    """One sample's episode (see the module docstring): `reset()`, then per turn `start(reply)` and
    `step(reply)`, each turn's reply generated from `context`, until `done`; `record()` the finished
    record. `i`: the sample's place in the call, `index` its prompt index,
    `place` its place in its prompt's group."""

    def __init__(self, play: Play, i: int, prompt: torch.Tensor, meta: dict, index: int, place: int) -> None:
        self.play, self.i, self.prompt, self.meta, self.index, self.place = play, i, prompt, meta, index, place
        self.context, self.env, self.reply = prompt, None, None
        self.pieces: list[tuple[torch.Tensor, bool, torch.Tensor]] = []  # (tokens, sampled, log-probs)
        self.routing: list[torch.Tensor] = []  # [L, K, n] per turn: the tokens new in it
        self.reward, self.done, self.truncated, self.past = 0.0, False, False, 0  # past: replies made context
        self.status: Status | None = None  # set when the episode ends otherwise than `done`
        self.trace: list[Turn] = []  # the record's `trace`
        self.tools: Future | tuple | None = None  # this turn's tool calls: (status, calls, outputs) or its future

    def where(self, turn: int | None = None) -> str:
        at = f"run_episodes: sample {self.i} (prompt index {self.index})"
        return at if turn is None else f"{at}, turn {turn + 1}"

    def seed_index(self, turn: int) -> int:
        """The index turn `turn`'s generation draws this sample with: turn 1's is its prompt index
        (the single-turn sample), a later one's mixed from (turn, prompt index, place in group)."""
        return self.index if turn == 0 else derive(turn, self.index, self.place)

    @property
    def turns(self) -> int:
        return self.past + sum(sampled for _, sampled, _ in self.pieces)

    def reset(self) -> None:
        """The first turn: its context is the prompt. A multi-turn task's environment is built and reset
        (its first turn must render to the prompt's ids); a failure still takes turn 1 (the step's
        first call is the same), then ends the episode."""
        play, task = self.play, self.play.task
        if not is_multi_turn(task):
            return
        guard = play.calls.guard(f"environment {play.name}", self.where())
        with guard:
            self.env = env = play.calls.environment(task.environment, what=f"{play.name}: environment()")
            kwargs = {"seed": environment_seed(play.seed, self.index, self.place)} if _takes_seed(env.reset) else {}
            first = task.encode_messages(play.calls.run(env.reset, self.meta, what=f"{_kind(env)}.reset", **kwargs))
            if first != self.prompt.tolist():
                raise ValueError(f"{self.where()}: the environment's first turn renders to {len(first)} tokens, not "
                                 f"the {self.prompt.numel()} of the task's prompt: `reset(meta)` must give the turn "
                                 f"`prompts` encoded")
        self.status = guard.status

    def start(self, reply: Experience) -> None:
        """The reply's tool calls, parsed here and run on the play's pool (a sandboxed call mostly
        waits for its child process, so a turn's calls overlap); `step` takes their outputs."""
        play, task, turn = self.play, self.play.task, len(self.trace)
        self.tools = None
        if task.toolbox is None or turn >= task.max_turns - 1 or self.status is not None:
            return
        with (guard := play.calls.guard(play.tools_of, self.where(turn))):
            called = task.toolbox.parse(reply.sequences[self.context.numel():], play.stop)
        if guard.status is not None:
            self.tools = (guard.status, [], [])
        else:
            self.tools = _tool_pool.submit(self._run_tools, called, turn) if called else (None, [], [])

    def _run_tools(self, called: list[ToolCall], turn: int) -> tuple[Status | None, list[ToolCall], list[ToolOutput]]:
        """(a failure's status or None, the calls, their outputs: none when it failed), a sample's
        calls in order; an exception or a timeout fails this sample only: its status, through `calls`."""
        play, outputs = self.play, []
        with (guard := play.calls.guard(play.tools_of, self.where(turn))):
            outputs = [play.task.toolbox.run(call, play.calls) for call in called]
        return guard.status, called, outputs if guard.status is None else []

    def step(self, reply: Experience) -> None:
        """Take the turn's `reply` (the engine's record of it, from `context`): a single-turn task's
        reward; else the tools' message or the environment's answer appended, as the next `context`,
        or the episode `done`."""
        if not is_multi_turn(self.play.task):
            reward_record(self.play.task, reply, self.meta, self.play.calls, self.i)
            self.reply, self.done = reply, True
            return
        n, turn = self.context.numel(), len(self.trace)
        response = reply.sequences[n:]
        self.trace.append(Turn(len(self.pieces)))
        self.pieces.append((response, True, reply.rollout_log_probs[n - 1:]))
        if reply.routed_experts is not None:
            self.routing.append(reply.routed_experts[..., sum(r.shape[-1] for r in self.routing):])
        if self.status is not None:  # failed before its first turn
            self.fail(self.status)
        elif not self._tool_turn(reply, response, turn):
            self._environment_turn(reply, response, turn)
        if not self.done and self.play.task.strip_thinking:
            self.forget_thinking()

    def _tool_turn(self, reply: Experience, response: torch.Tensor, turn: int) -> bool:
        """The tools' outputs as the next context (or the failure of a call); False when the reply
        called none (or the tools do not run this turn): the environment takes it."""
        if self.tools is None:
            return False
        play, log = self.play, self.trace[-1]
        status, called, outputs = self.tools.result() if isinstance(self.tools, Future) else self.tools
        self.tools = None
        log.calls = [(c, outputs[k] if k < len(outputs) else None) for k, c in enumerate(called)]
        if status is None and outputs:
            if play.chars is not None and any(len(o.text) > play.chars for o in outputs):  # as an environment answer
                outputs, self.truncated = [ToolOutput(o.text[:play.chars], o.status) for o in outputs], True
            with (guard := play.calls.guard(play.tools_of, self.where(turn))):
                ids = play.task.toolbox.message_ids(outputs)
            status = guard.status
        if status is not None:
            self.fail(status)
            return True
        if not outputs:
            return False
        log.cut = self._append_answer(reply, response, ids, lambda: play.frame("tool"))
        return True

    def _environment_turn(self, reply: Experience, response: torch.Tensor, turn: int) -> None:
        """The reply to the environment's `step`: its reward added, its answer (cut to fit) as the
        next context, or the episode done (status `max_turns` when the last turn came first)."""
        play, task, log = self.play, self.play.task, self.trace[-1]
        who, log.environment = f"{_kind(self.env)}.step", True
        with (guard := play.calls.guard(f"environment {play.name}", self.where(turn))):
            observation, reward, done = play.calls.run(self.env.step, task.decode(response), what=who)
            reward = check_reward(reward, f"run_episodes: {who}", self.i, self.index)
            if not abs(self.reward + reward) <= FP32_MAX:
                raise ValueError(f"run_episodes: {who}: sample {self.i}'s rewards sum to {self.reward + reward!r} "
                                 f"after turn {turn + 1}, beyond fp32's range (|sum| <= {FP32_MAX:.4g})")
            if not done and turn < task.max_turns - 1 and not isinstance(observation, str):
                raise ValueError(f"run_episodes: {who} returned observation {observation!r} with done=False for "
                                 f"sample {self.i}: an episode that goes on needs the next user turn")
        if guard.status is not None:
            return self.fail(guard.status)
        self.reward += reward
        log.reward, log.answer = reward, observation if isinstance(observation, str) else None
        self.done = bool(done) or turn == task.max_turns - 1
        if self.done:
            if not done:
                self.status = Status.MAX_TURNS
            return
        if play.chars is not None and len(observation) > play.chars:  # cut before it is tokenized
            observation, self.truncated = observation[:play.chars], True
        with (guard := play.calls.guard(f"chat template of {play.name}", self.where(turn))):
            ids = list(task.observation_ids(observation))
        if guard.status is not None:
            return self.fail(guard.status)
        log.cut = self._append_answer(reply, response, ids, lambda: play.frame("observation"))

    def _append_answer(self, reply: Experience, response: torch.Tensor, ids: list[int], frame) -> bool:
        """Append an answer's ids (an environment's or the tools', in the chat template) as tokens
        the model did not sample: the reply's stop token not repeated, cut to task.max_observation_len
        inside the template's `frame()` (status truncated; the episode ends when not even the frame
        fits). True when it was cut."""
        stop, limit = self.play.stop, self.play.task.max_observation_len
        closed = stop is not None and ids and ids[0] == stop and int(response[-1]) == stop
        if closed:
            ids = ids[1:]  # the reply's stop token already closed the turn
        cut = len(ids) > limit
        if cut:  # start-up sized every sample with the longest
            ids = cut_observation(ids, limit, frame()[1:] if closed else frame())
            self.truncated = True
            if ids is None:  # not even the template's frame fits: the episode ends here
                self.done = True
                return True
        obs = torch.tensor(ids, dtype=torch.int64)
        self.pieces.append((obs, False, torch.zeros(obs.numel())))
        self.context = torch.cat([reply.sequences, obs])
        return cut

    def forget_thinking(self) -> None:
        """task.strip_thinking: the replies so far lose their reasoning (`task.without_thinking`, as a
        Qwen3-style template renders past turns) and become context, not actions: the next reply is
        sampled from the stripped history, and only the last reply is trained (the earlier ones were
        sampled from a context the record no longer holds)."""
        if self.routing:
            raise ValueError("task.options.strip_thinking with recorded MoE routing: the routing of stripped "
                             "tokens cannot be kept; set task.options.strip_thinking=false")
        pieces = []
        for tokens, sampled, log_probs in self.pieces:
            if sampled:
                tokens = torch.tensor(self.play.task.without_thinking(tokens.tolist()), dtype=torch.int64)
                log_probs, sampled, self.past = torch.zeros(tokens.numel()), False, self.past + 1
            pieces.append((tokens, sampled, log_probs))
        self.pieces = pieces
        self.context = torch.cat([self.prompt, *(tokens for tokens, _, _ in pieces)])

    def fail(self, status: Status) -> None:
        self.status, self.done, self.reward = status, True, 0.0
        self.trace[-1].failed = status.label

    def spans(self) -> list[Turn]:
        """The trace, each turn's reply and message placed in the response (the pieces' final lengths:
        strip_thinking shortens past replies)."""
        starts = [0]
        for tokens, _, _ in self.pieces:
            starts.append(starts[-1] + tokens.numel())
        ends = [t.piece for t in self.trace[1:]] + [len(self.pieces)]
        for turn, end in zip(self.trace, ends):
            turn.reply = (starts[turn.piece], starts[turn.piece + 1])
            turn.message = (starts[turn.piece + 1], starts[end]) if end > turn.piece + 1 else None
        return self.trace

    def record(self) -> Experience:
        """The finished record: a single-turn task's is the engine's, rewarded; a multi-turn task's
        is the whole episode (see the module docstring)."""
        if self.reply is not None:
            return self.reply
        tokens, sampled, log_probs = zip(*self.pieces)
        rec = make_record(self.prompt, torch.cat(tokens), torch.cat(log_probs), self.index,
                          torch.cat(self.routing, -1) if self.routing else None,
                          actions=torch.cat([torch.full((t.numel(),), s) for t, s in zip(tokens, sampled)]))
        rec.rewards = torch.tensor(self.reward, dtype=torch.float32)
        rec.turns = torch.tensor(self.turns)
        status = self.status if self.status in (Status.ERROR, Status.TIMEOUT) else \
            Status.TRUNCATED if self.truncated else self.status or Status.DONE
        rec.status = torch.tensor(int(status))
        rec.trace = self.spans()  # not an Experience field: this rank's (see the module docstring)
        return rec


def cut_observation(ids: list[int], limit: int, frame: list[int]) -> list[int] | None:
    """`ids` (an environment answer in the chat template) cut to `limit` tokens: the tokens it
    shares with `frame` (the template around an empty answer) at its start and at its end are
    kept, the answer's own tokens cut at their end; None when the frame alone exceeds `limit`."""
    if len(ids) <= limit:
        return ids
    head = 0
    while head < min(len(frame), len(ids)) and ids[head] == frame[head]:
        head += 1
    tail = 0
    while tail < min(len(frame), len(ids)) - head and ids[-1 - tail] == frame[-1 - tail]:
        tail += 1
    keep = limit - head - tail
    if keep < 0:
        return None
    return ids[:head + keep] + ids[len(ids) - tail:]


def _kind(env: Any) -> str:
    """How errors name an environment: its class (its class in the child, task.isolation=process)."""
    return getattr(env, "class_name", None) if isinstance(env, RemoteEnvironment) else type(env).__name__


def _takes_seed(reset: Any) -> bool:
    try:
        return "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return False
