"""Policy, value and KL losses, and their aggregation, for padded and packed batches.

Every per-token tensor is laid out like `experience.action_mask`: `[B, T-1]` padded or
`[1, N]` packed. Sequence-level quantities (GSPO's ratio, seq-mean aggregations, the
sequence IS correction) segment the pack by `packed_seq_lens`, never by treating the
row as one sequence.

Normalizers are passed in, not computed here: a token-mean over an optimizer step
divides by the step's global action-token count (all microbatches, all DP ranks), so the
sum of the per-microbatch losses is the same number however the step was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from packing import Experience

POLICY_LOSSES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


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
def aggregate(loss: torch.Tensor, experience: Experience, mode: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    `normalizer` is the global count this microbatch's share is divided by: action tokens
    for token-mean, sequences for the seq-mean modes. None = this batch's own count.
    """
    mask = experience.action_mask.to(loss.dtype)
    if mode == "token-mean":
        total = (loss * mask).sum()
        return total / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    if mode == "seq-mean-token-mean":
        per_seq = per_sequence_mean(loss, experience)
    elif mode == "seq-mean-token-sum":
        per_seq = per_sequence_sum(loss * mask, experience)
    else:
        raise ValueError(f"loss aggregation '{mode}' is not one of {AGGREGATIONS}")
    return per_seq.sum() / (normalizer if normalizer is not None else num_sequences(experience))


# --------------------------------------------------------------------- losses
@dataclass
class PolicyLossConfig:
    name: str = "ppo"  # ppo | gspo | cispo
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1: bounds the loss of negative-advantage tokens (dual-clip PPO)
    tis_cap: float | None = None  # truncated IS against rollout_log_probs; None = off
    tis_level: str = "token"  # token | sequence


def policy_loss(
    log_probs: torch.Tensor, experience: Experience, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss (unreduced) and per-token diagnostics."""
    old = experience.action_log_probs
    adv = experience.advantages
    if old is None or adv is None:
        raise ValueError("policy_loss needs experience.action_log_probs (old policy) and experience.advantages")
    mask = experience.action_mask
    log_ratio = (log_probs - old) * mask

    if cfg.name == "ppo":
        ratio = log_ratio.exp()
        loss, clipped = _clipped_surrogate(ratio, adv, cfg)
    elif cfg.name == "gspo":
        # sequence ratio (geometric mean of token ratios), with the token's own gradient path
        seq_log_ratio = broadcast_to_tokens(per_sequence_mean(log_ratio, experience), experience)
        ratio = (seq_log_ratio.detach() + log_probs - log_probs.detach()).exp()
        loss, clipped = _clipped_surrogate(ratio, adv, cfg)
    elif cfg.name == "cispo":
        # clip the (detached) IS weight, keep every token's gradient: -sg(min(r, 1+eps)) * A * logp
        ratio = log_ratio.exp()
        weight = ratio.clamp(max=1 + cfg.clip_high).detach()
        loss = -weight * adv * log_probs
        clipped = ratio > 1 + cfg.clip_high
    else:
        raise ValueError(f"policy loss '{cfg.name}' is not one of {POLICY_LOSSES}")

    if cfg.tis_cap is not None:
        loss = loss * _tis_weight(experience, cfg)
    return loss * mask, {"clip_ratio": clipped.float(), "ratio": ratio.detach()}


def _clipped_surrogate(ratio, adv, cfg):
    unclipped = -adv * ratio
    clipped_obj = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped_obj)
    clipped = clipped_obj > unclipped
    if cfg.dual_clip is not None:
        if cfg.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {cfg.dual_clip}")
        bounded = torch.minimum(loss, -adv * cfg.dual_clip)
        loss = torch.where(adv < 0, bounded, loss)
    return loss, clipped


def _tis_weight(experience: Experience, cfg: PolicyLossConfig) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap), detached: corrects for the rollout engine's numerics."""
    if experience.rollout_log_probs is None:
        raise ValueError("tis_cap is set but experience.rollout_log_probs is None")
    log_w = (experience.action_log_probs - experience.rollout_log_probs) * experience.action_mask
    if cfg.tis_level == "sequence":
        log_w = broadcast_to_tokens(per_sequence_mean(log_w, experience), experience)
    elif cfg.tis_level != "token":
        raise ValueError(f"tis_level '{cfg.tis_level}' is not one of ('token', 'sequence')")
    return log_w.exp().clamp(max=cfg.tis_cap).detach()


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return (-log_ratio).exp() - 1 + log_ratio
    raise ValueError(f"kl estimator '{estimator}' is not one of {KL_ESTIMATORS}")


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
