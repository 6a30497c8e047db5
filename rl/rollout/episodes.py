"""Episodes: prompts -> rewarded records, in one turn or in several.

    records = run_episodes(engine, task, prompts, metas, prompt_indices=..., max_new_tokens=...,
                           temperature=..., seed=...)

A single-turn task: one `engine.generate` (rl/rollout/engine.py), then the task's reward
(`assign_rewards`). A multi-turn task (rl/tasks/base.py: one with an `environment`) plays one
`Environment` per sample, token-in / token-out:

    context = prompt ids                          (env.reset(meta) rendered: checked equal)
    for turn in range(task.max_turns):
        response = engine.generate(context)       every active sample, one call per turn
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

Tools (a task with a `toolbox`, rl/tasks/tool_task.py): a reply that calls a tool (parsed by the task's
`toolbox`, rl/tasks/tools.py) is answered by the tools, not the environment: their outputs, rendered
as the chat template's tool message, enter the context as observation tokens (action mask False,
cut like an environment answer), and the model replies again. A turn's calls run on a few threads
at once (a sandboxed call mostly waits for its process). The first reply that calls none, or
the last turn's, goes to `env.step`. A tool that raises or runs past `task.timeout_s` ends its
episode like a failing environment; what the code run by the `python` tool did (a timeout, the
memory limit, a refused write) is reported to the model in the tool message, and the episode goes on.

Seeds: turn 1 is the single-turn call (the same prompt indices and seed), so an episode's
first reply is the sample the single-turn task would draw. A later turn's call gives each
sample its own index, mixed from (turn, prompt index, its place in the group), so its draws
depend on neither the batch nor which other samples are still playing.
Every turn calls `generate`, with no prompt when no sample plays on: an engine that is a
collective (rl/rollout/engine.py `PolicyRolloutEngine`) sees the same calls on every rank.

The user's code (the reward, `task.environment()`, `reset`, `step`) runs through the task's
`calls` (rl/tasks/calls.py: `task.on_error`, `task.timeout_s`): with on_error=skip an exception
or a timeout ends that one episode with reward 0 and status `error` or `timeout` (an environment
that failed mid-episode is never called again; the tokens so far stay in its record, so the
step's calls to the engine are the same whatever failed); the run goes on. Every record gets a
`status` (rl/tasks/calls.py `Status`): `done` (the environment ended it, or a single-turn
reward), `max_turns` (the last turn came and the environment was not done), `truncated` (an
answer was cut, below), `error`, `timeout`; `episode_metrics` counts them per step.

Each sample gets its own copy of its prompt's meta (a deep copy): a reward or environment that
writes into it does not reach the other samples of its group. An environment whose `reset`
takes a `seed` keyword gets a per-sample seed, mixed from (the call's seed, i.e. the run's seed
and the step, the prompt index, the sample's place in its group): a stochastic environment
draws the same episodes when a run is resumed or repeated with the same seed.

An environment answer (or tool output) longer than `rl/tasks/chat.py answer_chars` characters (the
most that `task.max_observation_len` tokens can stand for) is cut to them before it is tokenized, so
an answer of any size costs what its start does, and counts as `truncated`.
An environment answer longer than `task.max_observation_len` tokens is cut to fit, not an error:
the answer's text tokens are cut at their end and the chat template's frame around them (the
end of the model's turn before, the next generation prompt after: the ids `observation_ids("")`
shares with the answer at its start and end) is kept, so the next turn still starts where the
template puts it; the episode goes on and ends with status `truncated` (unless it fails). When
even the frame does not fit, the episode ends there (status `truncated`).

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

import copy
import inspect
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from packing.experience import Experience
from rl.rollout.engine import make_record
from rl.rollout.sampler import group_places, sample_seed
from rl.tasks.calls import FP32_MAX, Status, UserCalls, assign_rewards, check_reward, task_calls
from rl.tasks.chat import answer_chars
from rl.tasks.processes import RemoteEnvironment
from rl.tasks.base import Task, check_parts, is_multi_turn
from rl.tasks.tools import Toolbox, ToolCall, ToolOutput

_ENV_SALT = 0x5EED_E7E7  # environment seeds are drawn apart from the engine's sample seeds


def run_episodes(engine, task: Task, prompts: Sequence[torch.Tensor], metas: Sequence[dict], *,
                 prompt_indices: Sequence[int], max_new_tokens: int, temperature: float,
                 seed: int) -> list[Experience]:
    """One rewarded record per prompt, in order (see the module docstring); `max_new_tokens`
    bounds each turn's reply."""
    check_parts(task)
    metas = [_own(meta) for meta in metas]  # one meta per sample, not one per prompt group
    if not is_multi_turn(task):
        records = engine.generate(list(prompts), prompt_indices=prompt_indices, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed)
        return assign_rewards(task, records, metas, task_calls(task))
    return _play(engine, task, prompts, metas, prompt_indices, max_new_tokens, temperature, seed)


def environment_seed(seed: int, prompt_index: int, place: int) -> int:
    """The seed an environment's `reset(prompt, seed=...)` gets: a function of the call's seed
    (the run's seed and the step), the prompt index and the sample's place in its group."""
    return sample_seed(sample_seed(seed, _ENV_SALT, 0), prompt_index, place)


def episode_metrics(samples: Sequence[Experience]) -> dict[str, float]:
    """The step's episodes by status, `episodes_<status>` (rl/tasks/calls.py `Status`); nothing
    for records without one."""
    if not samples or samples[0].status is None:
        return {}
    counts = Counter(int(s.status) for s in samples)
    return {f"episodes_{status.label}": float(counts.get(int(status), 0)) for status in Status}


def _own(meta: dict) -> dict:
    try:
        return copy.deepcopy(meta)
    except Exception:  # noqa: BLE001 - something that cannot be deep-copied: a copy of the dict itself
        return dict(meta)


def _kind(env: Any) -> str:
    """How errors name an environment: its class (its class in the child, task.isolation=process)."""
    return getattr(env, "class_name", None) if isinstance(env, RemoteEnvironment) else type(env).__name__


def _takes_seed(reset: Any) -> bool:
    try:
        return "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class Turn:
    """One model turn of an episode (the record's `trace`, see the module docstring). `reply` and
    `message`: [start, end) in the record's response of the reply and of the answer or tool message
    that followed it in the context (None: none did); `calls`: the tool calls the reply made, each
    with its output (None: the tool raised or ran past task.timeout_s); `environment`: the reply went
    to the environment's `step`, which gave `answer` and `reward`; `cut`: the answer or tool message
    was cut to task.max_observation_len; `failed`: the status (`error`, `timeout`) the user's code
    ended the episode with in this turn."""

    piece: int  # the reply's index in _Episode.pieces, until `_Episode.spans` sets reply and message
    reply: tuple[int, int] = (0, 0)
    message: tuple[int, int] | None = None
    calls: list[tuple[ToolCall, ToolOutput | None]] = field(default_factory=list)
    environment: bool = False
    answer: str | None = None
    reward: float | None = None
    cut: bool = False
    failed: str | None = None


@dataclass
class _Episode:
    """One sample's episode so far: `context` the tokens the next turn is generated from."""

    prompt: torch.Tensor
    context: torch.Tensor
    env: object
    pieces: list[tuple[torch.Tensor, bool, torch.Tensor]] = field(default_factory=list)  # (tokens, sampled, log-probs)
    routing: list[torch.Tensor] = field(default_factory=list)  # [L, K, n] per turn: the tokens new in it
    reward: float = 0.0
    done: bool = False
    status: Status | None = None  # set when the episode ends otherwise than `done`
    truncated: bool = False  # an answer was cut to task.max_observation_len
    past: int = 0  # replies turned into context by task.strip_thinking
    trace: list[Turn] = field(default_factory=list)  # the record's `trace`

    @property
    def turns(self) -> int:
        return self.past + sum(sampled for _, sampled, _ in self.pieces)

    def forget_thinking(self, task: Task) -> None:
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
                tokens = torch.tensor(task.without_thinking(tokens.tolist()), dtype=torch.int64)
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


def _play(engine, task: Task, prompts, metas, prompt_indices, max_new_tokens, temperature,
          seed) -> list[Experience]:
    if len(metas) != len(prompts) or len(prompt_indices) != len(prompts):
        raise ValueError(f"run_episodes: {len(prompts)} prompts, {len(metas)} metas, {len(prompt_indices)} "
                         f"prompt_indices (one each)")
    calls, episodes, place = task_calls(task), [], group_places(prompt_indices)
    name = task.reward_name or f"{type(task).__name__}.environment"
    for i, (prompt, meta) in enumerate(zip(prompts, metas)):
        ep = _Episode(prompt, prompt, None)
        guard = calls.guard(f"environment {name}", f"run_episodes: sample {i} (prompt index {int(prompt_indices[i])})")
        with guard:
            ep.env = env = calls.environment(task.environment, what=f"{name}: environment()")
            kwargs = {"seed": environment_seed(seed, int(prompt_indices[i]), place[i])} if _takes_seed(env.reset) else {}
            first = task.encode_messages(calls.run(env.reset, meta, what=f"{_kind(env)}.reset", **kwargs))
            if first != prompt.tolist():
                raise ValueError(f"run_episodes: sample {i} (prompt index {int(prompt_indices[i])}): the environment's "
                                 f"first turn renders to {len(first)} tokens, not the {prompt.numel()} of the task's "
                                 f"prompt: `reset(meta)` must give the turn `prompts` encoded")
        if guard.status is not None:  # it still takes turn 1 (the step's first call is the same), then ends
            ep.status = guard.status
        episodes.append(ep)
    stop = getattr(engine, "stop_token_id", None)
    frame = None  # observation_ids(""): the template's frame around an answer, for cutting a long one
    toolbox = task.toolbox
    tool_frame = None  # the same for a tool message
    tools_of = f"tools of {type(task).__name__}"
    tokenizer = getattr(task, "tokenizer", None)  # answers are cut to `chars` characters before they are tokenized
    chars = answer_chars(tokenizer, task.max_observation_len) if tokenizer is not None else None
    for turn in range(task.max_turns):
        playing = [i for i, ep in enumerate(episodes) if not ep.done]
        if task.strip_thinking and turn > 0:
            for i in playing:
                episodes[i].forget_thinking(task)
        indices = ([int(prompt_indices[i]) for i in playing] if turn == 0 else
                   [sample_seed(turn, int(prompt_indices[i]), place[i]) for i in playing])
        if getattr(engine, "on_progress", None) is not None:
            engine.on_progress(turn=f"{turn + 1}/{task.max_turns}")
        records = engine.generate([episodes[i].context for i in playing], prompt_indices=indices,
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        answered = {}  # sample -> (a failure's status or None, its tool outputs: [] when it called none)
        if toolbox is not None and turn < task.max_turns - 1:
            where = lambda i: (f"run_episodes: sample {i} (prompt index {int(prompt_indices[i])}), "  # noqa: E731
                               f"turn {turn + 1}")
            answered = _run_tools(toolbox, calls, stop, tools_of, where,
                                  [(i, rec.sequences[episodes[i].context.numel():]) for i, rec in zip(playing, records)
                                   if episodes[i].status is None])
        for i, rec in zip(playing, records):
            ep, n = episodes[i], episodes[i].context.numel()
            response = rec.sequences[n:]
            ep.trace.append(turn_log := Turn(len(ep.pieces)))
            ep.pieces.append((response, True, rec.rollout_log_probs[n - 1:]))
            if rec.routed_experts is not None:
                ep.routing.append(rec.routed_experts[..., sum(r.shape[-1] for r in ep.routing):])
            if ep.status is not None:  # failed before its first turn
                ep.fail(ep.status)
                continue
            if i in answered:
                status, called, outputs = answered[i]
                turn_log.calls = [(c, outputs[k] if k < len(outputs) else None) for k, c in enumerate(called)]
                if status is None and outputs:
                    if chars is not None and any(len(o.text) > chars for o in outputs):  # as an environment answer
                        outputs, ep.truncated = [ToolOutput(o.text[:chars], o.status) for o in outputs], True
                    with (guard := calls.guard(tools_of, where(i))):
                        ids = toolbox.message_ids(outputs)
                    status = guard.status
                if status is not None:
                    ep.fail(status)
                    continue
                if outputs:  # the tools answered: the model goes on, the environment is not asked
                    if tool_frame is None:
                        tool_frame = toolbox.message_ids([ToolOutput("")])
                    turn_log.cut = _observe(ep, rec, response, ids, task.max_observation_len, stop, tool_frame)
                    continue
            who = f"{_kind(ep.env)}.step"
            turn_log.environment = True
            guard = calls.guard(f"environment {name}", f"run_episodes: sample {i} (prompt index "
                                                        f"{int(prompt_indices[i])}), turn {turn + 1}")
            with guard:
                observation, reward, done = calls.run(ep.env.step, task.decode(response), what=who)
                reward = check_reward(reward, f"run_episodes: {who}", i, prompt_indices[i])
                if not abs(ep.reward + reward) <= FP32_MAX:
                    raise ValueError(f"run_episodes: {who}: sample {i}'s rewards sum to {ep.reward + reward!r} after turn "
                                     f"{turn + 1}, beyond fp32's range (|sum| <= {FP32_MAX:.4g})")
                if not done and turn < task.max_turns - 1 and not isinstance(observation, str):
                    raise ValueError(f"run_episodes: {who} returned observation {observation!r} with done=False for "
                                     f"sample {i}: an episode that goes on needs the next user turn")
            if guard.status is not None:
                ep.fail(guard.status)
                continue
            ep.reward += reward
            turn_log.reward, turn_log.answer = reward, observation if isinstance(observation, str) else None
            ep.done = bool(done) or turn == task.max_turns - 1
            if ep.done:
                if not done:
                    ep.status = Status.MAX_TURNS
                continue
            if chars is not None and len(observation) > chars:  # cut before it is tokenized: any size costs the same
                observation, ep.truncated = observation[:chars], True
            with (guard := calls.guard(f"chat template of {name}", f"run_episodes: sample {i}, turn {turn + 1}")):
                ids = list(task.observation_ids(observation))
            if guard.status is not None:
                ep.fail(guard.status)
                continue
            if frame is None and len(ids) > task.max_observation_len:
                frame = list(task.observation_ids(""))
            turn_log.cut = _observe(ep, rec, response, ids, task.max_observation_len, stop, frame)
    for ep in episodes:
        calls.release(ep.env)  # task.isolation=process: the episode's process ends
    out = []
    for i, ep in enumerate(episodes):
        tokens, sampled, log_probs = zip(*ep.pieces)
        rec = make_record(ep.prompt, torch.cat(tokens), torch.cat(log_probs), int(prompt_indices[i]),
                          torch.cat(ep.routing, -1) if ep.routing else None,
                          actions=torch.cat([torch.full((t.numel(),), s) for t, s in zip(tokens, sampled)]))
        rec.rewards = torch.tensor(ep.reward, dtype=torch.float32)
        rec.turns = torch.tensor(ep.turns)
        status = ep.status if ep.status in (Status.ERROR, Status.TIMEOUT) else \
            Status.TRUNCATED if ep.truncated else ep.status or Status.DONE
        rec.status = torch.tensor(int(status))
        rec.trace = ep.spans()  # not an Experience field: this rank's (see the module docstring)
        out.append(rec)
    return out


_TOOL_THREADS = 8
# one pool for the process (its threads start on first use): they keep their UserCalls workers from turn to turn
_tool_pool = ThreadPoolExecutor(_TOOL_THREADS, thread_name_prefix="tools")


def _run_tools(toolbox: Toolbox, calls: UserCalls, stop: int | None, what: str, where,
               replies: list[tuple[int, torch.Tensor]]
               ) -> dict[int, tuple[Status | None, list[ToolCall], list[ToolOutput]]]:
    """Each reply's tool calls, parsed here and run on up to `_TOOL_THREADS` threads (a sandboxed
    call mostly waits for its child process, so a turn's calls overlap), a sample's calls in order:
    (a failure's status or None, the calls, their outputs: none when it failed). An exception or a
    timeout fails that sample only: its status, through `calls`."""
    out: dict[int, tuple[Status | None, list[ToolCall], list[ToolOutput]]] = {}
    parsed: dict[int, list[ToolCall]] = {}
    for i, response in replies:
        with (guard := calls.guard(what, where(i))):
            parsed[i] = toolbox.parse(response, stop)
        if guard.status is not None:
            out[i] = (guard.status, [], [])

    def run(i: int) -> tuple[Status | None, list[ToolCall], list[ToolOutput]]:
        outputs: list[ToolOutput] = []
        with (guard := calls.guard(what, where(i))):
            outputs = [toolbox.run(call, calls) for call in parsed[i]]
        return guard.status, parsed[i], outputs if guard.status is None else []

    futures = {i: _tool_pool.submit(run, i) for i in parsed if parsed[i]}
    for i in parsed:
        if i not in out:
            out[i] = futures[i].result() if i in futures else (None, [], [])
    return out


def _observe(ep: _Episode, rec: Experience, response: torch.Tensor, ids: list[int], limit: int, stop: int | None,
             frame: list[int] | None) -> bool:
    """Append an answer's ids (an environment's or the tools', in the chat template) to the episode
    as tokens the model did not sample: the reply's stop token not repeated, cut to `limit` inside
    the template's `frame` (status truncated; the episode ends when not even the frame fits).
    True when it was cut."""
    closed = stop is not None and ids and ids[0] == stop and int(response[-1]) == stop
    if closed:
        ids = ids[1:]  # the reply's stop token already closed the turn
    cut = len(ids) > limit
    if cut:  # start-up sized every sample with the longest
        ids = cut_observation(ids, limit, frame[1:] if closed else frame)
        ep.truncated = True
        if ids is None:  # not even the template's frame fits: the episode ends here
            ep.done = True
            return True
    obs = torch.tensor(ids, dtype=torch.int64)
    ep.pieces.append((obs, False, torch.zeros(obs.numel())))
    ep.context = torch.cat([rec.sequences, obs])
    return cut


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
