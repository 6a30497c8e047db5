"""Episodes: prompts -> rewarded records, one `Episode` per sample (rl/rollout/episode.py), in one
turn or in several alike:

    records = run_episodes(engine, task, prompts, metas, prompt_indices=..., max_new_tokens=...,
                           temperature=..., seed=...)

`run_episodes` only batches the engine's calls: each turn, one `engine.generate` over the samples
still playing, each reply handed to its episode, which owns the rest (the reward or the environment,
the tools, the answers cut to fit, past thinking, the status and the record).

Seeds: turn 1 is the single-turn call (the same prompt indices and seed), so an episode's
first reply is the sample the single-turn task would draw. A later turn's call gives each
sample its own index, mixed from (turn, prompt index, its place in the group), so its draws
depend on neither the batch nor which other samples are still playing.
Every turn calls `generate`, with no prompt when no sample plays on: an engine that is a
collective (rl/rollout/engine.py `PolicyRolloutEngine`) sees the same calls on every rank.

Each sample gets its own copy of its prompt's meta (a deep copy): a reward or environment that
writes into it does not reach the other samples of its group. An environment whose `reset`
takes a `seed` keyword gets a per-sample seed (rl/rollout/episode.py `environment_seed`), mixed from (the call's seed,
i.e. the run's seed and the step, the prompt index, the sample's place in its group): a stochastic
environment draws the same episodes when a run is resumed or repeated with the same seed.
`episode_metrics` counts the step's records by status.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Sequence

import torch

from packing.experience import Experience
from rl.rollout.episode import Episode, Play
from rl.rollout.sampler import group_places
from rl.tasks.base import Task, check_parts, is_multi_turn
from rl.tasks.calls import Status, task_calls

def run_episodes(engine, task: Task, prompts: Sequence[torch.Tensor], metas: Sequence[dict], *,
                 prompt_indices: Sequence[int], max_new_tokens: int, temperature: float,
                 seed: int) -> list[Experience]:
    """One rewarded record per prompt, in order (see the module docstring); `max_new_tokens`
    bounds each turn's reply."""
    if len(metas) != len(prompts) or len(prompt_indices) != len(prompts):
        raise ValueError(f"run_episodes: {len(prompts)} prompts, {len(metas)} metas, {len(prompt_indices)} "
                         f"prompt_indices (one each)")
    check_parts(task)
    play = Play(task, task_calls(task), getattr(engine, "stop_token_id", None), seed)
    places = group_places(prompt_indices)
    episodes = [Episode(play, i, prompt, _own(meta), int(index), place)  # one meta per sample, not per group
                for i, (prompt, meta, index, place) in enumerate(zip(prompts, metas, prompt_indices, places))]
    for episode in episodes:
        episode.reset()
    for turn in range(task.max_turns):
        playing = [episode for episode in episodes if not episode.done]
        if is_multi_turn(task) and getattr(engine, "on_progress", None) is not None:
            engine.on_progress(turn=f"{turn + 1}/{task.max_turns}")
        replies = engine.generate([episode.context for episode in playing],
                                  prompt_indices=[episode.seed_index(turn) for episode in playing],
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        for episode, reply in zip(playing, replies):
            episode.start(reply)  # its tool calls run meanwhile
        for episode, reply in zip(playing, replies):
            episode.step(reply)
    for episode in episodes:
        play.calls.release(episode.env)  # task.isolation=process: the episode's process ends
    return [episode.record() for episode in episodes]


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
