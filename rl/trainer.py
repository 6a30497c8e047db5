"""The body of one RL step: rollout -> buffer -> plan -> collate -> forward -> loss -> step -> sync.

Data flow across ranks: each DP rank rolls out its share of the step's prompts (CP
peers of one DP rank generate the same samples from the same seed); the records are
all-gathered, so every rank holds the step's global batch, computes GRPO advantages and
the global token normalizer locally, and runs the planner identically. Each DP rank
then trains on its own plan entry. Records are small (token ids and a few per-token
floats); at cluster scale an all-to-all of just the planned records replaces the gather.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from model.actor import Actor, Critic
from model.moe import moe_blocks, reset_expert_load
from model.parallel_dims import ParallelDims
from model.parallelize import expert_load_metrics, full_state_dict, sync_gradients
from packing import Experience, ReplayBuffer, make_experience_batch, plan_microbatches
from rl.advantages import gae_advantages, grpo_advantages
from rl.config import Config
from rl.tasks import score
from rl.losses import PolicyLossConfig, aggregate, kl_penalty, num_sequences, policy_loss, value_loss


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, *, actor: Actor, critic: Critic | None,
                 reference: Actor | None, engine, task) -> None:
        self.cfg, self.dims = cfg, dims
        self.actor, self.critic, self.reference = actor, critic, reference
        self.engine, self.task = engine, task
        self.buffer = ReplayBuffer()
        self.optimizer = torch.optim.AdamW(
            actor.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
        )
        self.critic_optimizer = (
            torch.optim.AdamW(critic.parameters(), lr=cfg.algo.critic_lr) if critic is not None else None
        )
        algo = cfg.algo
        self.loss_cfg = PolicyLossConfig(
            name=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
            dual_clip=algo.dual_clip, tis_cap=algo.tis_cap, tis_level=algo.tis_level,
        )

    # ----------------------------------------------------------------- rollout
    def rollout(self, step: int) -> list[Experience]:
        """This DP rank's samples, then the global batch gathered from every DP rank."""
        task, dims = self.cfg.task, self.dims
        if task.prompts_per_step % dims.dp:
            raise ValueError(f"task.prompts_per_step={task.prompts_per_step} must divide over dp={dims.dp} ranks")
        per_rank = task.prompts_per_step // dims.dp
        first = step * task.prompts_per_step + dims.dp_rank * per_rank
        prompts = self.task.prompts(per_rank, seed=self.cfg.seed * 1_000_003 + step * dims.dp + dims.dp_rank)
        ids = [p for p, _ in prompts for _ in range(task.samples_per_prompt)]
        index = [first + i for i in range(per_rank) for _ in range(task.samples_per_prompt)]
        records = self.engine.generate(
            ids, prompt_indices=index, max_new_tokens=task.max_new_tokens,
            temperature=task.rollout_temperature, seed=self.cfg.seed * 7919 + step,
        )
        score(self.task, records, [m for _, m in prompts for _ in range(task.samples_per_prompt)])
        if not self.cfg.algo.routing_replay:
            for rec in records:
                rec.routed_experts = None
        return self._gather_over_dp(records)

    def _gather_over_dp(self, records: list[Experience]) -> list[Experience]:
        if not dist.is_initialized() or self.dims.world_size == 1:
            return records
        gathered: list[Any] = [None] * self.dims.world_size
        mine = records if self.dims.cp_rank == 0 else None  # CP peers hold the same samples
        dist.all_gather_object(gathered, mine)
        return [rec for part in gathered if part is not None for rec in part]

    # -------------------------------------------------------------------- step
    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        records = self.rollout(step)
        t_rollout = time.perf_counter() - t0
        algo = self.cfg.algo
        if algo.name == "grpo":
            grpo_advantages(records, scale_by_std=algo.grpo_scale_by_std)
        elif algo.name != "ppo":
            raise ValueError(f"algo.name '{algo.name}' is not one of ('grpo', 'ppo')")

        self.buffer.clear()
        self.buffer.append(records)
        plan = self._plan()
        local = [[self.buffer[i] for i in mb] for mb in plan[self.dims.dp_rank]]
        local = [self._score(items) for items in local]  # ref log-probs, values, GAE: no grad
        global_tokens = sum(float(r.action_mask.sum()) for r in records)
        global_seqs = len(records)
        normalizer = global_tokens if algo.loss_agg == "token-mean" else global_seqs

        self.actor.train()
        if moe_blocks(self.actor.model, strict=False):
            reset_expert_load(self.actor.model)  # the load metric counts the training forward only
        stats = _Stats()
        processed = 0  # tokens the forward saw, padding included
        local_real = sum(item.sequences.numel() for items in local for item in items)
        for items in local:
            batch = make_experience_batch(items, packed=self.cfg.batch.packed)
            processed += batch.sequences.numel()
            log_probs, entropy = self.actor(batch, return_entropy=True)
            # one optimizer step per rollout: the old policy is the current one, so its
            # log-probs come from this forward instead of a second pass
            batch.action_log_probs = log_probs.detach()
            pg, info = policy_loss(log_probs, batch, self.loss_cfg)
            loss = aggregate(pg, batch, algo.loss_agg, normalizer)
            terms = {"policy_loss": loss.detach()}
            if algo.kl_coef and algo.kl_mode == "loss":
                kl = kl_penalty(log_probs, batch.base_action_log_probs, algo.kl_estimator) * batch.action_mask
                kl_loss = aggregate(kl, batch, algo.loss_agg, normalizer)
                loss = loss + algo.kl_coef * kl_loss
                terms["kl_loss"] = kl_loss.detach()
            if algo.entropy_coef:
                ent_loss = aggregate(entropy * batch.action_mask, batch, algo.loss_agg, normalizer)
                loss = loss - algo.entropy_coef * ent_loss
            terms["loss"] = loss.detach()  # the actor objective as optimized: every term included
            loss.backward()
            if self.critic is not None:
                values = self.critic(batch)
                vloss = algo.vf_coef * aggregate(value_loss(values, batch, algo.value_clip), batch, algo.loss_agg, normalizer)
                vloss.backward()
                terms["value_loss"] = vloss.detach()
            m = batch.action_mask
            terms["entropy"] = (entropy.detach() * m).sum() / global_tokens
            terms["clip_ratio"] = (info["clip_ratio"] * m).sum() / global_tokens
            if batch.base_action_log_probs is not None:
                terms["kl"] = (kl_penalty(log_probs.detach(), batch.base_action_log_probs, "k3") * m).sum() / global_tokens
            stats.add(terms)

        grad_norm = self._optimizer_step()
        self.engine.load_weights(full_state_dict(self.actor.model, self.dims))
        elapsed = time.perf_counter() - t0

        metrics = stats.reduce(self.dims)
        real = sum(r.sequences.numel() for r in records)
        metrics.update(
            step=step,
            reward_mean=float(torch.stack([r.rewards for r in records]).mean()),
            response_length=float(torch.stack([torch.as_tensor(r.response_length) for r in records]).float().mean()),
            tokens=real,
            action_tokens=int(global_tokens),
            tokens_per_s=real / elapsed,
            rollout_s=t_rollout,
            step_s=elapsed,
            padding_efficiency=_all_sum(float(local_real), self.dims) / max(_all_sum(float(processed), self.dims), 1.0),
            microbatches=len(plan[0]),
            grad_norm=float(grad_norm),
        )
        metrics.update(expert_load_metrics(self.actor.model, self.dims))
        return metrics

    def _plan(self) -> list[list[list[int]]]:
        b = self.cfg.batch
        if b.micro_batch_size is not None:
            return plan_microbatches(self.buffer.lengths, b.max_tokens, self.dims.dp, micro_batch_size=b.micro_batch_size)
        return plan_microbatches(self.buffer.lengths, b.max_tokens, self.dims.dp)

    @torch.no_grad()
    def _score(self, items: list[Experience]) -> list[Experience]:
        """Fields read before the update: reference log-probs, values, KL reward penalty, GAE."""
        algo = self.cfg.algo
        kl_reward = bool(algo.kl_coef) and algo.kl_mode == "reward"
        if not items or (self.reference is None and self.critic is None):
            return items
        batch = make_experience_batch(items, packed=self.cfg.batch.packed)
        updates: dict[str, torch.Tensor] = {}
        if kl_reward:
            self.actor.eval()
            updates["action_log_probs"] = self.actor(batch)
        if self.reference is not None:
            updates["base_action_log_probs"] = self.reference(batch)
        if self.critic is not None:
            updates["values"] = self.critic(batch)
        if kl_reward:
            updates["kl"] = kl_penalty(updates["action_log_probs"], updates["base_action_log_probs"], algo.kl_estimator)
        scored = dataclasses.replace(batch, **updates).split()
        if algo.name == "ppo":
            gae_advantages(scored, gamma=algo.gamma, lam=algo.lam, kl_coef=algo.kl_coef if algo.kl_mode == "reward" else 0.0)
        return scored

    def _optimizer_step(self) -> torch.Tensor:
        sync_gradients(self.actor, self.dims)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), self.cfg.trainer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            sync_gradients(self.critic, self.dims)
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.trainer.grad_clip)
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad(set_to_none=True)
        return grad_norm


class _Stats:
    """Sums of per-microbatch terms; each term is already divided by a global count."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}

    def add(self, terms: dict[str, torch.Tensor]) -> None:
        for k, v in terms.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)

    def reduce(self, dims: ParallelDims) -> dict[str, float]:
        # every term is a share of a global mean: sum over DP ranks (CP peers hold the same value)
        return {k: _all_sum(v, dims) for k, v in sorted(self.sums.items())}


def _all_sum(value: float, dims: ParallelDims) -> float:
    if not dist.is_initialized() or dims.dp == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=dims.dp_group)
    return float(t)
