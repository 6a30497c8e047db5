"""Policy, value and KL losses, and their aggregation, for padded and packed batches.

Every per-token tensor is laid out like `experience.action_mask`: `[B, T-1]` padded or
`[1, N]` packed. Sequence-level quantities (GSPO's ratio, seq-mean aggregations, the
sequence IS correction) segment the pack by `packed_seq_lens`, never by treating the
row as one sequence.

Normalizers are passed in, not computed here: a token-mean over an optimizer step
divides by the step's global action-token count (all microbatches, all DP ranks), so the
sum of the per-microbatch losses is the same number however the step was cut
(`loss_normalizer` counts it from the step's records).

Numeric guards (as in verl and OpenRLHF), each a `PolicyLossConfig` field or a
`kl_penalty` argument, `None` = off:

* `log_ratio_clamp` (20): the token log-ratio log(pi/pi_old) is clamped to [-20, 20]
  before `exp` in PPO and CISPO, and log(pi_old/pi_rollout) likewise in TIS (for
  sequence TIS: the sequence's summed log-ratio);
* `gspo_log_ratio_max` (10): GSPO's sequence log-ratio is clamped to <= 10;
* `kl_penalty(..., log_ratio_clamp=20, clamp=10)`: k3's log-ratio to [-20, 20] before
  `exp`, and every estimator's output (k1, k2, k3) to [-10, 10].

A clamped value has no gradient beyond its bound: an outlier token stops pushing instead
of dominating the loss with an `exp` that overflows fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from packing import Experience
from rl.choice import Choice, Registry


class LossAgg(Choice):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"  # Dr. GRPO: token sum / a constant


class KLEstimator(Choice):
    K1 = "k1"  # log r
    K2 = "k2"  # (log r)^2 / 2
    K3 = "k3"  # 1/r - 1 + log r, r = pi / pi_ref (unbiased, >= 0, low variance)


class KLMode(Choice):
    LOSS = "loss"  # kl_coef * KL(pi || pi_ref) added to the actor loss
    REWARD = "reward"  # -kl_coef * KL per token in the reward (token-level estimators; reinforce_pp needs it)


class TISLevel(Choice):
    TOKEN = "token"
    SEQUENCE = "sequence"


# --------------------------------------------------------------- segmentation
def sequence_index(experience: Experience) -> torch.Tensor:
    """Sequence id of every action slot, `[B, T-1]` or `[1, N]` like `action_mask`."""
    mask = experience.action_mask
    if experience.is_packed:
        lens = torch.tensor(experience.packed_seq_lens, device=mask.device)
        return torch.repeat_interleave(torch.arange(len(lens), device=mask.device), lens).unsqueeze(0)
    return torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)


def num_sequences(experience: Experience) -> int:
    return len(experience.packed_seq_lens) if experience.is_packed else experience.action_mask.shape[0]


def per_sequence_sum(x: torch.Tensor, experience: Experience) -> torch.Tensor:
    """Sum of `x` (laid out like action_mask) over each sequence -> `[num_sequences]`."""
    if not experience.is_packed:
        return x.sum(-1)
    out = x.new_zeros(num_sequences(experience))
    return out.index_add(0, sequence_index(experience)[0], x[0])


def per_sequence_mean(x: torch.Tensor, experience: Experience) -> torch.Tensor:
    """Masked mean of `x` over each sequence's action tokens -> `[num_sequences]`."""
    mask = experience.action_mask.to(x.dtype)
    return per_sequence_sum(x * mask, experience) / per_sequence_sum(mask, experience).clamp(min=1)


def broadcast_to_tokens(per_seq: torch.Tensor, experience: Experience) -> torch.Tensor:
    """`[num_sequences]` -> laid out like action_mask."""
    return per_seq[sequence_index(experience)]


# ---------------------------------------------------------------- aggregation
def aggregate(
    loss: torch.Tensor,
    experience: Experience,
    mode: LossAgg | str,
    normalizer: float | None = None,
    *,
    token_sum_norm: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (laid out like action_mask) to a scalar.

    * `token-mean`: sum over action tokens / `normalizer` (action tokens).
    * `seq-mean-token-mean`: per sequence, the mean over its action tokens; summed / `normalizer`
      (sequences).
    * `seq-mean-token-sum`: per sequence, the sum over its action tokens; summed / `normalizer`
      (sequences).
    * `seq-mean-token-sum-norm` (Dr. GRPO): per sequence, the sum over its action tokens
      divided by the constant `token_sum_norm` (required; the trainer passes the response
      budget, `task.max_new_tokens`, unless configured); summed / `normalizer` (sequences).
      A constant, not a per-sequence length, so long and short responses weigh each token alike.

    `normalizer` is the global count this microbatch's share is divided by (see
    `loss_normalizer`): action tokens for token-mean, sequences for the seq-mean modes.
    None = this batch's own count.
    """
    mode = LossAgg.parse(mode, "loss_agg")
    mask = experience.action_mask.to(loss.dtype)
    if mode is LossAgg.TOKEN_MEAN:
        total = (loss * mask).sum()
        return total / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    if mode is LossAgg.SEQ_MEAN_TOKEN_MEAN:
        per_seq = per_sequence_mean(loss, experience)
    elif mode is LossAgg.SEQ_MEAN_TOKEN_SUM:
        per_seq = per_sequence_sum(loss * mask, experience)
    else:
        if token_sum_norm is None or not token_sum_norm > 0:
            raise ValueError(
                f"loss_agg='{mode}' divides each sequence's token sum by a constant: token_sum_norm "
                f"(algo.loss_agg_norm, default task.max_new_tokens x the task's max_turns) must be > 0, got {token_sum_norm!r}"
            )
        per_seq = per_sequence_sum(loss * mask, experience) / token_sum_norm
    return per_seq.sum() / (normalizer if normalizer is not None else num_sequences(experience))


def loss_normalizer(records: Sequence[Experience], mode: LossAgg | str) -> float:
    """The global count `aggregate` divides by for these records (one optimizer step's, or
    one mini-batch's): their action tokens for token-mean, their number otherwise."""
    if LossAgg.parse(mode, "loss_agg") is LossAgg.TOKEN_MEAN:
        return float(sum(r.action_tokens for r in records))
    return float(len(records))


# --------------------------------------------------------------------- losses
@dataclass
class PolicyLossConfig:
    """Every policy-loss field, flat: an `AlgoConfig` inherits it, so the YAML keys are
    `algo.policy_loss`, `algo.clip_low`, ... (plain dataclass: an OmegaConf structured config)."""

    policy_loss: str = "ppo"  # a registered policy loss (python -m rl.registry lists them)
    # PPO/GSPO: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    # CISPO: the IS weight is clipped above at 1 + clip_high; clip_low is not used (see cispo_clip_low).
    clip_low: float = 0.2
    clip_high: float = 0.2  # the ratio's upper clip, 1 + clip_high (DAPO's clip-higher: above clip_low)
    # c > 1: bounds the loss of negative-advantage tokens at c * |A| (dual-clip PPO; ppo/gspo only).
    dual_clip: Optional[float] = None
    # CISPO's lower bound on the IS weight, as an epsilon: weight >= 1 - cispo_clip_low.
    # None (default) = no lower bound, as in the MiniMax-M1 paper. A separate field from
    # clip_low so that PPO's default 0.2 does not silently bound CISPO.
    cispo_clip_low: Optional[float] = None
    # Truncated IS against experience.rollout_log_probs: weight min(pi_old / pi_rollout, tis_cap); None = off.
    tis_cap: Optional[float] = None
    # token: each token's own ratio; sequence: the product of the sequence's token ratios
    # (exp of the summed log-ratios), one weight for all its tokens.
    tis_level: TISLevel = TISLevel.TOKEN
    # |log-ratio| bound before exp in PPO, CISPO and TIS (None = off).
    log_ratio_clamp: Optional[float] = 20.0
    # Upper bound on GSPO's sequence log-ratio (None = off).
    gspo_log_ratio_max: Optional[float] = 10.0
    # how token losses become the step's loss: token-mean (over all tokens), seq-mean-token-mean (per sequence,
    # then over sequences), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO: token sums / loss_agg_norm)
    loss_agg: LossAgg = LossAgg.TOKEN_MEAN
    # seq-mean-token-sum-norm's constant (each sequence's token sum is divided by it);
    # None = the response budget (task.max_new_tokens, times max_turns for a multi-turn task), filled in by the trainer.
    loss_agg_norm: Optional[float] = None


def check_policy_loss_config(cfg: Any, prefix: str = "") -> None:
    """Raise a ValueError naming the key (`prefix` + field) of the first invalid field.

    Takes a `PolicyLossConfig`, a subclass, or an OmegaConf node with the same keys, so
    the trainer can check `cfg.algo` at start-up with `prefix="algo."`."""
    get_policy_loss(cfg.policy_loss, f"{prefix}policy_loss")
    TISLevel.parse(cfg.tis_level, f"{prefix}tis_level")
    LossAgg.parse(cfg.loss_agg, f"{prefix}loss_agg")
    checks = [
        ("clip_low", cfg.clip_low, 0 <= cfg.clip_low < 1, "in [0, 1)"),
        ("clip_high", cfg.clip_high, cfg.clip_high >= 0, ">= 0"),
        ("dual_clip", cfg.dual_clip, cfg.dual_clip is None or cfg.dual_clip > 1, "> 1 or null"),
        ("cispo_clip_low", cfg.cispo_clip_low, cfg.cispo_clip_low is None or 0 <= cfg.cispo_clip_low <= 1,
         "in [0, 1] or null"),
        ("tis_cap", cfg.tis_cap, cfg.tis_cap is None or cfg.tis_cap > 0, "> 0 or null"),
        ("log_ratio_clamp", cfg.log_ratio_clamp, cfg.log_ratio_clamp is None or cfg.log_ratio_clamp > 0,
         "> 0 or null"),
        ("gspo_log_ratio_max", cfg.gspo_log_ratio_max, cfg.gspo_log_ratio_max is None or cfg.gspo_log_ratio_max > 0,
         "> 0 or null"),
        ("loss_agg_norm", cfg.loss_agg_norm, cfg.loss_agg_norm is None or cfg.loss_agg_norm > 0, "> 0 or null"),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise ValueError(f"{prefix}{name}={value!r}: expected {expected}")


# A policy loss: (log_probs, log_ratio, experience, cfg) -> (per-token loss, clipped, ratio),
# each laid out like action_mask. log_ratio = (log_probs - old) * mask; `clipped` marks the
# tokens whose ratio or IS weight was clipped, `ratio` the ratio each token's loss used.
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, Experience, PolicyLossConfig],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_LOSSES = Registry("policy loss", "algo.policy_loss", "rl/algos/losses.py: register_policy_loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register `fn` as `algo.policy_loss=<name>` (a decorator); the name must be new."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.add(name, fn)
        return fn

    return register


def get_policy_loss(name: str, key: str = "algo.policy_loss") -> PolicyLossFn:
    """The loss registered as `name`; else an error naming `key` and the registered names."""
    return POLICY_LOSSES.lookup(name, key)


@register_policy_loss("ppo")
def ppo_loss(log_probs, log_ratio, experience, cfg):
    """Clipped surrogate on the token ratio (+ dual-clip)."""
    ratio = _clamp(log_ratio, cfg.log_ratio_clamp).exp()
    loss, clipped = _clipped_surrogate(ratio, experience.advantages, cfg)
    return loss, clipped, ratio


@register_policy_loss("gspo")
def gspo_loss(log_probs, log_ratio, experience, cfg):
    """Clipped surrogate on the sequence ratio (the geometric mean of its token ratios),
    with each token's own gradient path; sequences segmented by `packed_seq_lens`."""
    seq_log_ratio = broadcast_to_tokens(per_sequence_mean(log_ratio, experience), experience)
    log_seq_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()
    if cfg.gspo_log_ratio_max is not None:
        log_seq_ratio = log_seq_ratio.clamp(max=cfg.gspo_log_ratio_max)
    ratio = log_seq_ratio.exp()
    loss, clipped = _clipped_surrogate(ratio, experience.advantages, cfg)
    return loss, clipped, ratio


@register_policy_loss("cispo")
def cispo_loss(log_probs, log_ratio, experience, cfg):
    """MiniMax-M1: clip the (detached) IS weight, keep every token's gradient: -sg(clip(r)) * A * logp."""
    ratio = _clamp(log_ratio, cfg.log_ratio_clamp).exp()
    low = None if cfg.cispo_clip_low is None else 1 - cfg.cispo_clip_low
    weight = ratio.clamp(min=low, max=1 + cfg.clip_high).detach()
    loss = -weight * experience.advantages * log_probs
    clipped = ratio > 1 + cfg.clip_high
    if low is not None:
        clipped = clipped | (ratio < low)
    return loss, clipped, ratio


def policy_loss(
    log_probs: torch.Tensor, experience: Experience, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss (unreduced, 0 on masked slots) of the registered loss
    `cfg.policy_loss`, and per-token diagnostics.

    `log_probs` are the current policy's, laid out like `experience.action_mask`;
    `experience.action_log_probs` are the old policy's. Diagnostics (detached, not masked):
    `clip_ratio` (1 where the ratio or IS weight was clipped), `ratio` (the ratio each
    token's loss used: GSPO's is its sequence's), `approx_kl` (k3 estimate of
    KL(pi_old || pi) per token: r - 1 - log r, r = pi / pi_old). The config is checked once,
    at start-up (`check_policy_loss_config`, from `rl.config.validate`).
    """
    old = experience.action_log_probs
    if old is None or experience.advantages is None:
        raise ValueError("policy_loss needs experience.action_log_probs (old policy) and experience.advantages")
    mask = experience.action_mask
    log_ratio = (log_probs - old) * mask
    loss, clipped, ratio = get_policy_loss(cfg.policy_loss)(log_probs, log_ratio, experience, cfg)
    if cfg.tis_cap is not None:
        loss = loss * tis_weight(experience, cfg)
    approx_kl = k3(_clamp(log_ratio.detach(), cfg.log_ratio_clamp))
    return loss * mask, {"clip_ratio": clipped.float(), "ratio": ratio.detach(), "approx_kl": approx_kl}


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(p || q) per token sampled from p: r - 1 - log r, with
    `log_ratio` = log r = log q - log p (unbiased, >= 0, low variance)."""
    return log_ratio.exp() - 1 - log_ratio


def _clamp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def _clipped_surrogate(ratio, adv, cfg):
    unclipped = -adv * ratio
    clipped_obj = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped_obj)
    clipped = clipped_obj > unclipped
    if cfg.dual_clip is not None:
        bounded = torch.minimum(loss, -adv * cfg.dual_clip)
        loss = torch.where(adv < 0, bounded, loss)
    return loss, clipped


def tis_weight(experience: Experience, cfg: PolicyLossConfig) -> torch.Tensor:
    """Truncated IS weight against the rollout engine's numerics, detached, laid out like action_mask.

    token:    w_t = min(exp(clamp(log pi_old(y_t) - log pi_rollout(y_t))), tis_cap)
    sequence: w   = min(exp(clamp(sum_t of those log-ratios over the sequence's action
              tokens)), tis_cap) = min(pi_old(y) / pi_rollout(y), tis_cap), the product of
              the token ratios, broadcast to the sequence's tokens.
    The clamp is `log_ratio_clamp` ([-20, 20] by default).
    """
    if cfg.tis_cap is None:
        raise ValueError("tis_weight: tis_cap is None (truncated IS is off)")
    if experience.rollout_log_probs is None:
        raise ValueError("tis_cap is set but experience.rollout_log_probs is None")
    log_w = (experience.action_log_probs - experience.rollout_log_probs) * experience.action_mask
    if TISLevel.parse(cfg.tis_level, "tis_level") is TISLevel.SEQUENCE:
        log_w = broadcast_to_tokens(per_sequence_sum(log_w, experience), experience)
    return _clamp(log_w, cfg.log_ratio_clamp).exp().clamp(max=cfg.tis_cap).detach()


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: KLEstimator | str = KLEstimator.K3,
    *,
    clamp: float | None = 10.0,
    log_ratio_clamp: float | None = 20.0,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With log r = log_probs - ref_log_probs: k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r with log r first clamped to [-log_ratio_clamp, log_ratio_clamp]
    (unclamped, exp overflows fp32 once pi_ref/pi > e^88). Every output is then clamped to
    [-clamp, clamp]. None = that clamp off.
    """
    estimator = KLEstimator.parse(estimator, "kl_estimator")
    log_ratio = log_probs - ref_log_probs
    if estimator is KLEstimator.K1:
        kl = log_ratio
    elif estimator is KLEstimator.K2:
        kl = 0.5 * log_ratio**2
    else:
        kl = k3(-_clamp(log_ratio, log_ratio_clamp))
    return _clamp(kl, clamp)


def value_loss(values: torch.Tensor, experience: Experience, clip: float | None = 0.2) -> torch.Tensor:
    """Per-token clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2)."""
    returns, old = experience.returns, experience.values
    if returns is None:
        raise ValueError("value_loss needs experience.returns")
    loss = (values - returns) ** 2
    if clip is not None and old is not None:
        clipped = old + (values - old).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss * experience.action_mask


# ---------------------------------------------------------------- KL control
@dataclass
class KLConfig:
    """KL-to-reference fields, flat (an `AlgoConfig` may inherit it beside `PolicyLossConfig`)."""

    kl_coef: float = 0.0  # the (initial) coefficient; 0 = no KL term
    kl_estimator: KLEstimator = KLEstimator.K3  # k1: log r, k2: (log r)^2 / 2, k3: 1/r - 1 + log r (r = pi / pi_ref)
    kl_mode: KLMode = KLMode.LOSS  # loss: kl_coef x KL added to the loss; reward: -kl_coef x KL per token in the reward
    # Adaptive coefficient (Ziegler et al. 2019) when set: steer the measured KL toward kl_target.
    kl_target: Optional[float] = None
    kl_horizon: float = 10000.0  # samples over which a 20% KL error moves the coefficient by 20%
    kl_clamp: Optional[float] = 10.0  # |KL estimate| bound per token (None = off)
    kl_log_ratio_clamp: Optional[float] = 20.0  # k3's |log-ratio| bound before exp (None = off)


class FixedKLController:
    """A constant KL coefficient with the adaptive controller's interface."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences".

    After each step, with e = clip(current_kl / target - 1, -0.2, 0.2):
        value <- value * (1 + e * n_steps / horizon)
    `n_steps` is how many samples (in `horizon`'s unit) the step's `current_kl` was
    measured over; a KL above target raises the coefficient, below lowers it.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not init_kl_coef > 0:
            raise ValueError(f"AdaptiveKLController: init_kl_coef (algo.kl_coef) must be > 0, got {init_kl_coef}")
        if not target > 0:
            raise ValueError(f"AdaptiveKLController: target (algo.kl_target) must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon (algo.kl_horizon) must be > 0, got {horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl is {current_kl}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def build_kl_controller(kl_coef: float, target: float | None = None, horizon: float = 10000.0):
    """`AdaptiveKLController` when `target` is set (and kl_coef > 0), else `FixedKLController`."""
    if target is None or not kl_coef:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target, horizon)
