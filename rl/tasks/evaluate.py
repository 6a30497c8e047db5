"""Held-out evaluation: greedy pass@1 on problems the run never trains on.

    problems = task.heldout(eval.num_prompts)      # fixed for the run; never a training prompt
    evaluate(engine, task, problems, dims, ...)    # -> {"eval_accuracy", "eval_reward_mean", ...}

Each DP rank decodes its slice of the problems (rank r takes r, r + dp, ...) greedily with
the rollout engine, scores them with the task's reward, and one all-reduce sums the counts.
`eval_accuracy` is the fraction of problems whose reward is 1 (a correct answer);
`eval_reward_mean` the mean reward (the same thing for a 0/1 reward). Greedy decoding
draws no random numbers, so evaluating does not change the training run.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from model.parallel_dims import ParallelDims
from rl.tasks.task import Prompt, Task, assign_rewards


def heldout_problems(task: Task, n: int, task_name: str) -> list[Prompt]:
    """The task's first `n` held-out problems; an error naming the task when it has no
    held-out split (`eval.every` needs one)."""
    if not hasattr(task, "heldout"):
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
    correct = reward = 0.0
    most = -(-len(problems) // dims.dp)  # every rank calls generate as often (an engine may be a collective)
    for start in tqdm(range(0, most, batch_size), desc="held-out", unit="batch", leave=False, disable=not progress):
        chunk = mine[start:start + batch_size]
        records = engine.generate([problems[i][0] for i in chunk], prompt_indices=chunk,
                                  max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
        if not chunk:
            continue
        assign_rewards(task, records, [problems[i][1] for i in chunk])
        values = torch.stack([r.rewards for r in records]).double()
        correct += float((values >= 1.0).sum())
        reward += float(values.sum())
    sums = torch.tensor([correct, reward, float(len(mine))], dtype=torch.float64, device=dims.device)
    if dims.dp_group is not None:
        dist.all_reduce(sums, group=dims.dp_group)
    n = max(float(sums[2]), 1.0)
    return {"eval_accuracy": float(sums[0]) / n, "eval_reward_mean": float(sums[1]) / n,
            "eval_s": time.perf_counter() - t0}
