"""The trainer in-process, as train.py builds it, without a subprocess per run.

`compose(*overrides)` is the typed, validated `Config` train.py would get from the same
command-line overrides (Hydra's compose API on conf/); `trainer(*overrides)` builds the
Trainer for one process. The `*_rank` functions are rank bodies for `run_distributed`.
"""

from __future__ import annotations

import math

import torch

from rl.config import Config, load, validate
from rl.config import compose as compose_config
# a small step: 4 prompts x 4 samples of the default tiny MoE, a few hundred ms on CPU
SMALL = ("task.prompts_per_step=4", "task.samples_per_prompt=4", "trainer.progress=false")


def compose(*overrides: str, world_size: int = 1, check: bool = True) -> Config:
    """`load` (and `validate`, when `check`) of conf/config.yaml with `overrides`."""
    cfg = load(compose_config(overrides))  # train.py's composition, its errors explained
    if check:
        cfg = validate(cfg, world_size=world_size).cfg  # the config as the run uses it (model.param_dtype resolved)
    return cfg


def trainer(*overrides: str):
    """A one-process Trainer as train.py builds it (seeded like a run)."""
    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_trainer

    cfg = compose(*overrides)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device=cfg.trainer.device.value,
                            one_rank_group=cfg.model.param_dtype is not None)  # as train.py
    torch.manual_seed(cfg.seed)
    return build_trainer(cfg, dims)


def matches_recorded(got: list[dict], want: list[dict]) -> bool:
    """Every step's untimed metrics against recorded ones: the same keys, counts and samples exactly,
    the losses within 1e-3 (what one CPU kernel set gives another: 3e-5 measured between default and
    avx2)."""
    import pytest

    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(g[k] == pytest.approx(v, rel=1e-3, abs=1e-6) for k, v in w.items())
        for g, w in zip(got, want))


def all_finite(tr) -> bool:
    """Every weight and every optimizer state tensor of the policy (and critic) is finite."""
    tensors = [p for p in tr.actor.parameters()]
    for opt in (tr.optimizer, tr.critic_optimizer):
        if opt is not None:
            tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return all(bool(torch.isfinite(_local(t)).all()) for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t.detach()


def weights(tr) -> dict[str, torch.Tensor]:
    from model.parallelize import full_parameters

    return {k: v.clone() for k, v in full_parameters(tr.actor.model)}


# ----------------------------------------------------------------- rank bodies
def steps_rank(rank: int, world_size: int, overrides: tuple[str, ...], steps: int) -> list[dict]:
    """`steps` steps on `world_size` ranks; the metrics of each step and whether each rank
    ever ran a zero-weight (empty) microbatch."""
    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_trainer

    cfg = compose(*overrides, world_size=world_size)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    torch.manual_seed(cfg.seed)
    tr = build_trainer(cfg, dims)
    plan, tr.plan = tr.plan, None
    empties = []

    def plan_and_count(samples):
        step_plan = plan(samples)
        empties.extend(w == 0.0 for mb in step_plan.minibatches for w in mb.weights)
        return step_plan

    tr.plan = plan_and_count
    metrics = [tr.step(s) for s in range(steps)]
    return [{"metrics": metrics, "empty_microbatches": sum(empties)}]


def nan_loss_on_one_rank(rank: int, world_size: int, bad_rank: int) -> dict:
    """A NaN loss on `bad_rank` only, from step 1: every rank skips the update and stops
    with the same message; the weights stay those after step 0 on every rank."""
    import rl.algos.objective as objective_module
    from runtime.parallel_dims import init_distributed
    from rl.trainer.guard import DivergenceError
    from rl.trainer.build import build_trainer

    cfg = compose(*SMALL, "trainer.max_bad_steps=2", world_size=world_size)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    torch.manual_seed(cfg.seed)
    tr = build_trainer(cfg, dims)
    first = tr.step(0)
    after_first = weights(tr)
    original = objective_module.policy_loss

    def nan_here(log_probs, batch, algo):  # a NaN constant: the loss is NaN, its gradients stay finite
        loss, info = original(log_probs, batch, algo)
        return (loss + math.nan if rank == bad_rank else loss), info

    objective_module.policy_loss = nan_here
    second = tr.step(1)
    try:
        tr.step(2)
        error = None
    except DivergenceError as e:
        error = str(e)
    same = all(torch.equal(after_first[k], v) for k, v in weights(tr).items())
    return {"first": first, "second": second, "error": error, "unchanged": same, "finite": all_finite(tr)}
