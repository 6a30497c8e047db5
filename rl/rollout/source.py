"""`RolloutSource`: this rank's rewarded records of one rollout round, a function of (seed, step,
round, policy version) alone. The scheduler (rl/rollout/scheduler.py) calls it in the foreground
(max_staleness=0, and dynamic sampling's extra rounds) or from its rollout thread, so it holds
no collective: the scheduler's `rollouts` gathers the samples' metadata on the main thread."""

from __future__ import annotations

import torch

from packing.experience import Experience
from rl.rollout.episodes import run_episodes
from rl.seeds import round_seed, sampling_seed
from rl.tasks.reward import apply_overlong_penalty


class RolloutSource:
    def __init__(self, cfg, dims, engine, task, *, part: tuple[int, int] | None = None) -> None:
        """`part` = (index, parts): which slice of the step's prompts this rank rolls out; None: its DP
        rank's of dp (a dedicated generator: its index among the parallel.rollout_ranks generators)."""
        self.cfg, self.dims, self.engine, self.task = cfg, dims, engine, task
        self.part = part if part is not None else (dims.dp_rank, dims.dp)

    def records(self, step: int, round_: int, version: int) -> list[Experience]:
        """This rank's records of one rollout round, rewarded, each stamped with the policy
        `version` the engine holds (the caller knows it). Every rank draws the round's global
        prompt list from the same seed and takes its DP slice, so which prompt a sample comes from
        (and its seed) never depends on the layout; prompt indices are unique within the step."""
        task, algo, (index, parts) = self.cfg.task, self.cfg.algo, self.part
        per_rank = task.prompts_per_step // parts
        first = index * per_rank
        seed = round_seed(self.cfg.seed, step, round_)
        # a JSONL task walks its lines in seeded epochs, step k from position k * prompts_per_step (rl/tasks/files.py)
        prompts = self.task.step_prompts(task.prompts_per_step, seed=seed, run_seed=self.cfg.seed,
                                         start=step * task.prompts_per_step if round_ == 0 else None)
        prompts = prompts[first:first + per_rank]
        rounds = algo.max_sampling_rounds if algo.dynamic_sampling else 1
        base = (step * rounds + round_) * task.prompts_per_step + first
        index = [base + i for i in range(per_rank) for _ in range(task.samples_per_prompt)]
        records = run_episodes(  # one engine.generate, or one per turn of a multi-turn task
            self.engine, self.task, [p for p, _ in prompts for _ in range(task.samples_per_prompt)],
            [m for _, m in prompts for _ in range(task.samples_per_prompt)], prompt_indices=index,
            max_new_tokens=task.max_new_tokens, temperature=self.cfg.model.temperature,
            seed=sampling_seed(self.cfg.seed, step),
        )
        if algo.overlong_buffer is not None:
            apply_overlong_penalty(records, task.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty_factor)
        for rec in records:
            rec.policy_version = torch.tensor(version)
            if not algo.routing_replay:
                rec.routed_experts = None
        return records
