"""Held-out evaluation: greedy pass@1 on problems the run never trains on.

    problems = task.heldout(eval.num_prompts)      # fixed for the run; never a training prompt
    evaluate(engine, task, problems, dims, ...)    # -> {"eval_accuracy", "eval_reward_mean", ...}

Each DP rank decodes its slice of the problems (rank r takes r, r + dp, ...) greedily with
the rollout engine, scores them with the task's reward, and one all-reduce sums the counts.
`eval_accuracy` is the fraction of problems whose reward is 1 (a correct answer);
`eval_reward_mean` the mean reward (the same thing for a 0/1 reward). A multi-turn task
plays its episodes (rl/rollout/episodes.py): `eval_accuracy` counts the final answer, and
`eval_accuracy_turn1` the problems solved on the first reply, `eval_turns_mean` the model
turns taken. Greedy decoding draws no random numbers, so evaluating does not change the
training run.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from runtime.parallel_dims import ParallelDims
from rl.rollout.episodes import run_episodes
from rl.tasks.base import Prompt, Task, is_multi_turn


def heldout_problems(task: Task, n: int, task_name: str) -> list[Prompt]:
    """The task's first `n` held-out problems; an error naming the task when it has no
    held-out split (`eval.every` needs one)."""
    if not task.has_heldout:
        raise ValueError(f"eval.every > 0 but task {task_name!r} has no held-out split (a `heldout(n)` method); "
                         f"set eval.every=0, or use a task with one (arithmetic)")
    return task.heldout(n)


@torch.no_grad()
def evaluate(engine, task: Task, problems: list[Prompt], dims: ParallelDims, *, max_new_tokens: int,
             batch_size: int = 64, progress: bool = False) -> dict[str, float]:
    """Greedy pass@1 over `problems`, split over the DP ranks (a collective over the DP group);
    `progress`: a bar of this rank's batches."""
    t0 = time.perf_counter()
    mine = list(range(dims.dp_rank, len(problems), dims.dp))
    sums = torch.zeros(5, dtype=torch.float64)  # correct, reward, problems, correct on turn 1, turns
    most = -(-len(problems) // dims.dp)  # every rank calls generate as often (an engine may be a collective)
    for start in tqdm(range(0, most, batch_size), desc="held-out", unit="batch", leave=False, disable=not progress):
        chunk = mine[start:start + batch_size]
        records = run_episodes(engine, task, [problems[i][0] for i in chunk], [problems[i][1] for i in chunk],
                               prompt_indices=chunk, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
        if not chunk:
            continue
        values = torch.stack([r.rewards for r in records]).double()
        turns = torch.stack([r.turns for r in records]).double() if is_multi_turn(task) else torch.ones_like(values)
        sums += torch.stack([(values >= 1.0).sum(), values.sum(), torch.tensor(float(len(chunk))),
                             ((values >= 1.0) & (turns == 1)).sum(), turns.sum()]).double()
    sums = sums.to(dims.device)
    if dims.dp_group is not None:
        dist.all_reduce(sums, group=dims.dp_group)
    correct, reward, n, first, turns = (float(v) for v in sums)
    n = max(n, 1.0)
    out = {"eval_accuracy": correct / n, "eval_reward_mean": reward / n}
    if is_multi_turn(task):
        out |= {"eval_accuracy_turn1": first / n, "eval_turns_mean": turns / n}
    return out | {"eval_s": time.perf_counter() - t0}
