"""The training objective of one microbatch: `Objective(...)(batch, log_probs, entropy, values, aux)`
returns `(loss, terms)`, so the trainer runs forward -> objective -> backward.

`loss` is what is differentiated: the actor objective (policy loss, `kl_coef` x the KL to the
reference with `kl_mode=loss`, minus `entropy_coef` x the entropy, plus `router_aux_loss_coef` x
the MoE load-balancing loss, plus `distill_kl_coef` x the exact top-k reverse KL to a
distillation teacher with `distill_kl=topk`) plus `vf_coef` x the value loss when a critic's `values` are given
(the actor and critic share no parameters, so one backward gives each its own gradient).
`terms` are the metrics of the microbatch, each already its share of the mini-batch's global
mean (the trainer sums them, weighted, over microbatches and DP ranks); a `_max` key is a
maximum over microbatches instead.
"""

from __future__ import annotations

from typing import Protocol

import torch

from packing import Experience
from rl.algos.losses import KLEstimator, KLMode, LossAgg, aggregate, k3, kl_penalty, policy_loss, value_loss


class ObjectiveConfig(Protocol):
    """The `algo.*` fields `Objective` reads itself; `policy_loss` reads the rest of
    `PolicyLossConfig`'s. rl/config/schema.py `AlgoConfig` is one (rl.algos sits below rl.config
    and does not import it)."""

    loss_agg: LossAgg
    kl_coef: float
    kl_estimator: KLEstimator
    kl_mode: KLMode
    kl_clamp: float | None
    kl_log_ratio_clamp: float | None
    entropy_coef: float
    distill_kl_coef: float
    router_aux_loss_coef: float
    vf_coef: float
    value_clip: float | None


class Objective:
    """Built once from `algo.*` (an `ObjectiveConfig`: the run's `AlgoConfig`), the Dr. GRPO
    constant `token_sum_norm`, the KL controller (its current `value` is read at each call) and
    the policy's MoE layer count (the router aux loss is averaged over layers).

    `algo.*` stays one flat group (the policy-loss, KL and advantage fields side by side, not
    `algo.loss.*` / `algo.kl.*`): TRL's and OpenRLHF's users type these keys flat (TRL's `beta`,
    `epsilon`, `loss_type`; OpenRLHF's `init_kl_coef`, `advantage_estimator`), and verl nests by
    worker (actor, critic, ref), not by concept, so a nesting here would follow neither."""

    def __init__(self, algo: ObjectiveConfig, *, token_sum_norm: float, kl_ctl, moe_layers: int = 0) -> None:
        self.algo, self.token_sum_norm, self.kl_ctl, self.moe_layers = algo, token_sum_norm, kl_ctl, moe_layers

    def kl(self, log_probs: torch.Tensor, ref: torch.Tensor, estimator=None) -> torch.Tensor:
        """Per-token KL(pi || pi_ref) by `algo.kl_estimator` (or `estimator`), clamped as configured."""
        algo = self.algo
        return kl_penalty(log_probs, ref, estimator or algo.kl_estimator, clamp=algo.kl_clamp,
                          log_ratio_clamp=algo.kl_log_ratio_clamp)

    def aggregate(self, loss: torch.Tensor, batch: Experience, normalizer: float) -> torch.Tensor:
        """A per-token loss to this microbatch's share of the mini-batch's, by `algo.loss_agg`."""
        return aggregate(loss, batch, self.algo.loss_agg, normalizer, token_sum_norm=self.token_sum_norm)

    def __call__(self, batch: Experience, log_probs: torch.Tensor, entropy: torch.Tensor,
                 values: torch.Tensor | None = None, aux: list | tuple = (), *, normalizer: float, tokens: float,
                 all_tokens: int, topk_kl: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`log_probs`, `entropy` (and the critic's `values`) laid out like `batch.action_mask`; `aux`
        the (loss, tokens) pairs of `model.moe.router_aux_loss`. `normalizer`: what the loss shares are
        divided by (`loss_normalizer` of the mini-batch for algo.loss_agg), `tokens` its global action
        tokens (the token metrics' denominator), `all_tokens` its global tokens (prompt + response).
        `topk_kl`: each action token's exact reverse KL over the teacher's top-k (model/actor.py), or None."""
        algo = self.algo
        if batch.action_log_probs is None:  # one update per rollout: the old policy is this one
            batch.action_log_probs = log_probs.detach()
        pg, info = policy_loss(log_probs, batch, algo)
        loss = self.aggregate(pg, batch, normalizer)
        terms = {"policy_loss": loss.detach()}
        if algo.kl_coef and algo.kl_mode == KLMode.LOSS:
            kl_loss = self.aggregate(self.kl(log_probs, batch.base_action_log_probs) * batch.action_mask, batch,
                                     normalizer)
            loss = loss + self.kl_ctl.value * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * self.aggregate(entropy * batch.action_mask, batch, normalizer)
        if topk_kl is not None:  # algo.distill_kl=topk; a token whose term is exactly 0 is counted, never clamped
            m = batch.action_mask
            loss = loss + algo.distill_kl_coef * self.aggregate(topk_kl * m, batch, normalizer)
            terms["distill_topk_kl"] = (topk_kl.detach() * m).sum() / tokens
            terms["distill_topk_kl_zero"] = ((topk_kl.detach() == 0) & m.bool()).sum() / tokens  # a token share
        if aux:  # token-weighted over every rank's real tokens of the mini-batch, averaged over layers
            balance = sum(a * n for a, n in aux) / (all_tokens * self.moe_layers)
            loss = loss + algo.router_aux_loss_coef * balance
            terms["router_aux_loss"] = balance.detach()
        terms["loss"] = loss.detach()  # the actor objective as optimized: every term included
        if values is not None:
            vloss = algo.vf_coef * self.aggregate(value_loss(values, batch, algo.value_clip), batch, normalizer)
            terms["value_loss"] = vloss.detach()
            loss = loss + vloss
        m = batch.action_mask
        terms["entropy"] = (entropy.detach() * m).sum() / tokens
        terms["clip_ratio"] = (info["clip_ratio"] * m).sum() / tokens
        terms["approx_kl"] = (info["approx_kl"] * m).sum() / tokens  # k3 of old -> new
        if batch.base_action_log_probs is not None:
            terms["kl"] = (self.kl(log_probs.detach(), batch.base_action_log_probs, "k3") * m).sum() / tokens
        if batch.teacher_action_log_probs is not None:  # on-policy distillation (rl/algos/distill.py)
            teacher = batch.teacher_action_log_probs
            terms["distill_reverse_kl"] = ((log_probs.detach() - teacher) * m).sum() / tokens  # log p_s - log p_t
            terms["teacher_log_prob"] = (teacher * m).sum() / tokens
        if batch.teacher_argmax_agrees is not None:  # the share of tokens where both argmaxes agree
            terms["distill_argmax_agreement"] = (batch.teacher_argmax_agrees * m).sum() / tokens
        if batch.rollout_log_probs is not None:  # rollout engine vs training forward (fix: algo.tis_cap)
            gap = (log_probs.detach() - batch.rollout_log_probs) * m  # log(pi_train / pi_rollout)
            terms["rollout_logprob_abs_diff"] = gap.abs().sum() / tokens
            terms["rollout_kl"] = k3(gap).sum() / tokens  # KL(rollout || training)
            terms["rollout_logprob_abs_diff_max"] = gap.abs().max()
        return loss, terms
