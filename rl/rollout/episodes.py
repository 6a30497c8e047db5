"""Episodes: prompts -> rewarded records, in one turn or in several.

    records = run_episodes(engine, task, prompts, metas, prompt_indices=..., max_new_tokens=...,
                           temperature=..., seed=...)

A single-turn task: one `engine.generate` (rl/rollout/engine.py), then the task's reward
(`assign_rewards`). A multi-turn task (rl/tasks/task.py `MultiTurnTask`) plays one
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

Seeds: turn 1 is the single-turn call (the same prompt indices and seed), so an episode's
first reply is the sample the single-turn task would draw. A later turn's call gives each
sample its own index, mixed from (turn, prompt index, its place in the group), so its draws
depend on neither the batch nor which other samples are still playing.
Every turn calls `generate`, with no prompt when no sample plays on: an engine that is a
collective (rl/rollout/engine.py `PolicyRolloutEngine`) sees the same calls on every rank.

Routing (MoE): each token's recorded routing is that of the turn it entered the engine in:
the prompt and turn 1's reply from turn 1, an observation and the reply after it from the
next turn's prefill and decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from packing.experience import Experience
from rl.rollout.engine import group_places, make_record, sample_seed
from rl.tasks.task import MultiTurnTask, Task, assign_rewards, check_reward


def is_multi_turn(task: Task) -> bool:
    return hasattr(task, "environment")


def run_episodes(engine, task: Task, prompts: Sequence[torch.Tensor], metas: Sequence[dict], *,
                 prompt_indices: Sequence[int], max_new_tokens: int, temperature: float,
                 seed: int) -> list[Experience]:
    """One rewarded record per prompt, in order (see the module docstring); `max_new_tokens`
    bounds each turn's reply."""
    if not is_multi_turn(task):
        records = engine.generate(list(prompts), prompt_indices=prompt_indices, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed)
        return assign_rewards(task, records, metas)
    return _play(engine, task, prompts, metas, prompt_indices, max_new_tokens, temperature, seed)


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

    @property
    def turns(self) -> int:
        return sum(sampled for _, sampled, _ in self.pieces)


def _play(engine, task: MultiTurnTask, prompts, metas, prompt_indices, max_new_tokens, temperature,
          seed) -> list[Experience]:
    if len(metas) != len(prompts) or len(prompt_indices) != len(prompts):
        raise ValueError(f"run_episodes: {len(prompts)} prompts, {len(metas)} metas, {len(prompt_indices)} "
                         f"prompt_indices (one each)")
    episodes, place = [], group_places(prompt_indices)
    for i, (prompt, meta) in enumerate(zip(prompts, metas)):
        env = task.environment()
        first = task.encode_messages(env.reset(meta))
        if first != prompt.tolist():
            raise ValueError(f"run_episodes: sample {i} (prompt index {int(prompt_indices[i])}): the environment's "
                             f"first turn renders to {len(first)} tokens, not the {prompt.numel()} of the task's "
                             f"prompt: `reset(meta)` must give the turn `prompts` encoded")
        episodes.append(_Episode(prompt, prompt, env))
    stop = getattr(engine, "stop_token_id", None)
    for turn in range(task.max_turns):
        playing = [i for i, ep in enumerate(episodes) if not ep.done]
        indices = ([int(prompt_indices[i]) for i in playing] if turn == 0 else
                   [sample_seed(turn, int(prompt_indices[i]), place[i]) for i in playing])
        if getattr(engine, "on_progress", None) is not None:
            engine.on_progress(turn=f"{turn + 1}/{task.max_turns}")
        records = engine.generate([episodes[i].context for i in playing], prompt_indices=indices,
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        for i, rec in zip(playing, records):
            ep, n = episodes[i], episodes[i].context.numel()
            response = rec.sequences[n:]
            ep.pieces.append((response, True, rec.rollout_log_probs[n - 1:]))
            if rec.routed_experts is not None:
                ep.routing.append(rec.routed_experts[..., sum(r.shape[-1] for r in ep.routing):])
            observation, reward, done = ep.env.step(task.decode(response))
            ep.reward += check_reward(reward, f"run_episodes: {type(ep.env).__name__}.step", i, prompt_indices[i])
            ep.done = bool(done) or turn == task.max_turns - 1
            if ep.done:
                continue
            if not isinstance(observation, str):
                raise ValueError(f"run_episodes: {type(ep.env).__name__}.step returned observation {observation!r} "
                                 f"with done=False for sample {i}: an episode that goes on needs the next user turn")
            ids = task.observation_ids(observation)
            if stop is not None and ids and ids[0] == stop and int(response[-1]) == stop:
                ids = ids[1:]  # the reply's stop token already closed the turn
            if len(ids) > task.max_observation_len:  # start-up sized every sample with the longest
                raise ValueError(f"run_episodes: {type(ep.env).__name__}.step answered sample {i} (prompt index "
                                 f"{int(prompt_indices[i])}) with {len(ids)} tokens, more than the task's "
                                 f"max_observation_len={task.max_observation_len} (task.options.max_observation_len)")
            obs = torch.tensor(ids, dtype=torch.int64)
            ep.pieces.append((obs, False, torch.zeros(obs.numel())))
            ep.context = torch.cat([rec.sequences, obs])
    out = []
    for i, ep in enumerate(episodes):
        tokens, sampled, log_probs = zip(*ep.pieces)
        rec = make_record(ep.prompt, torch.cat(tokens), torch.cat(log_probs), int(prompt_indices[i]),
                          torch.cat(ep.routing, -1) if ep.routing else None,
                          actions=torch.cat([torch.full((t.numel(),), s) for t, s in zip(tokens, sampled)]))
        rec.rewards = torch.tensor(ep.reward, dtype=torch.float32)
        rec.turns = torch.tensor(ep.turns)
        out.append(rec)
    return out
