"""Rank bodies of tests/test_checkpoint.py: the run's own trainer (train.py's config and
`build_trainer`) on a layout, saved after one real step or loaded, reporting every entry of
the policy's training state as a full tensor. Only rank 0 returns figures."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

from runtime.parallel_dims import init_distributed
from model.parallelize import full_parameters
from rl.trainer.checkpoint import load_checkpoint, save_checkpoint
from rl.trainer.state import sharded_state
from rl.config import Config, load, register
from rl.trainer.build import build_trainer
from rl.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def config(*overrides: str) -> Config:
    """train.py's config with Hydra `overrides` (no run folder is made)."""
    register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return load(compose("config", overrides=list(overrides)))


def trainer_for(*overrides: str) -> tuple[Config, Trainer]:
    cfg = config(*overrides)
    dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device="cpu")
    return cfg, build_trainer(cfg, dims)


def full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """`weights.<name>` and `optimizer.<name>.<exp_avg|exp_avg_sq|step>` of the policy, gathered
    from the checkpoint's own description of them (expert entries: [E, ...] on the expert mesh).
    A collective."""
    state = sharded_state(trainer.actor, trainer.optimizer, trainer.dims)
    out = {f"weights.{k}": _full(v) for k, v in state["weights"].items()}
    out.update({f"optimizer.{fqn}.{k}": _full(v) for fqn, s in state["optimizer"]["state"].items()
                for k, v in s.items()})
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def save_after_one_step(rank: int, world_size: int, root: str, *overrides: str) -> dict | None:
    cfg, trainer = trainer_for(*overrides)
    trainer.step(0)  # AdamW moments are no longer zero
    save_checkpoint(trainer, Path(root), 1, cfg, trainer.dims)
    state = full_state(trainer)
    rollout = dict(full_parameters(trainer.actor.model))  # the weight sync's own gather, for a cross-check
    return {"state": state, "rollout": rollout} if rank == 0 else None


def load_and_report(rank: int, world_size: int, path: str, *overrides: str) -> dict | None:
    _, trainer = trainer_for(*overrides)
    step = load_checkpoint(trainer, path, trainer.dims)
    state = full_state(trainer)
    return {"step": step, "state": state} if rank == 0 else None
