"""Advantage estimators on unpadded records, GAE on a collated batch, and whitening.

Records are per-sample `Experience`s with action fields `[T-1]`, `rewards` and
`prompt_index` 0-d, `action_mask` bool; each estimator sets `advantages` and `returns` on
the action axis (0 on prompt slots) in place. "A group" is the samples of one prompt
(`prompt_index`).

* `grpo`   - (r_i - mean_group) / (std_group + eps), broadcast over the response.
* `rloo`   - r_i - mean of the *other* samples of its group (leave-one-out baseline).
* `gae`    - generalized advantage estimation against the critic's `values`.
* `reinforce_pp` - REINFORCE++: per-token rewards -kl_coef * kl, plus the reward on the
             last response slot, discounted by gamma into token-level returns, then
             whitened over every action token of the batch.
* `reinforce_pp_baseline` - the same after subtracting the group-mean reward.

`kl_coef` (KL as a reward penalty, `kl_mode=reward`) reads `kl` from the records; for
grpo and rloo the penalty is folded into the scalar reward, r_i - kl_coef * sum_t kl_t
(as verl does), since their advantage is one number per sample.

Each estimator is one function registered under its name (`register_advantage_estimator`,
like verl's); `algo.advantage` names one, checked at start-up against the registry
(`python -m rl.registry` lists them). `compute_advantages(records, name, ...)` dispatches
and applies whitening (`whiten_advantages`), on by default for gae and the REINFORCE++ pair.
`gae_advantages_batch` computes GAE directly on a padded `[B, T-1]` or packed `[1, N]`
batch; `masked_moments` + `whiten_with_moments` whiten across microbatches and ranks.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from packing import Experience


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: `fn(records, **options)` sets `advantages` and
    `returns` on the step's records in place (options: its keyword-only parameters)."""

    name: str
    fn: Callable[..., None]
    whiten_by_default: bool = False  # whiten over every action token of the step unless algo.whiten_advantages says
    uses_critic: bool = False  # needs the critic's values: computed after the scoring pass (gae)
    needs_groups: bool = False  # a baseline from the other samples of a prompt: >= 2 samples per prompt


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage_estimator(name: str, *, whiten_by_default: bool = False, uses_critic: bool = False,
                                 needs_groups: bool = False) -> Callable:
    """Register `fn` as `algo.advantage=<name>` (a decorator); the name must be new."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered ({ADVANTAGE_ESTIMATORS[name].fn})")
        ADVANTAGE_ESTIMATORS[name] = Estimator(name, fn, whiten_by_default, uses_critic, needs_groups)
        return fn

    return register


def get_advantage_estimator(name: str, key: str = "algo.advantage") -> Estimator:
    """The estimator registered as `name`; else an error naming `key` and the registered names."""
    est = ADVANTAGE_ESTIMATORS.get(str(name))
    if est is None:
        raise ValueError(f"{key}={name!r}: not a registered advantage estimator; registered: "
                         f"{sorted(ADVANTAGE_ESTIMATORS)} (rl/algos/advantages.py: register_advantage_estimator)")
    return est


@dataclass
class AdvantageConfig:
    """Advantage fields, flat (an `AlgoConfig` may inherit it): `algo.advantage`, `algo.gamma`, ..."""

    advantage: str = "grpo"  # a registered estimator (python -m rl.registry lists them)
    gamma: float = 1.0  # discount (gae, reinforce_pp*)
    lam: float = 0.95  # GAE lambda
    grpo_scale_by_std: bool = True  # false: Dr. GRPO (mean-centred only)
    # Whiten advantages over all action tokens of the step; None = the estimator's default
    # (on for gae and reinforce_pp*, off for grpo and rloo).
    whiten_advantages: Optional[bool] = None


# ---------------------------------------------------------------- group-based
def _groups(records: Sequence[Experience], who: str) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, rec in enumerate(records):
        if rec.rewards is None or rec.prompt_index is None:
            raise ValueError(f"record {i}: {who} needs 'rewards' and 'prompt_index' "
                             f"(got {rec.rewards}, {rec.prompt_index})")
        groups[int(rec.prompt_index)].append(i)
    return groups


def sequence_rewards(records: Sequence[Experience], kl_coef: float = 0.0) -> torch.Tensor:
    """`[len(records)]` fp32: r_i - kl_coef * (sum of kl over record i's action slots)."""
    out = []
    for i, rec in enumerate(records):
        r = torch.as_tensor(rec.rewards, dtype=torch.float32)
        if kl_coef:
            r = r - kl_coef * (_kl(rec, i, kl_coef) * rec.action_mask).sum()
        out.append(r)
    return torch.stack(out)


def _kl(rec: Experience, i: int, kl_coef: float) -> torch.Tensor:
    if rec.kl is None:
        raise ValueError(f"record {i}: kl_coef={kl_coef} (a KL reward penalty) needs 'kl' on the record")
    return rec.kl.detach().float()


def _set_sequence_advantage(rec: Experience, a: torch.Tensor) -> None:
    rec.advantages = a * rec.action_mask.to(torch.float32)
    rec.returns = rec.advantages.clone()


@register_advantage_estimator("grpo", needs_groups=True)
def grpo_advantages(
    records: Sequence[Experience], *, scale_by_std: bool = True, eps: float = 1e-6, kl_coef: float = 0.0
) -> None:
    """A_i = (r_i - mean_group) / (std_group + eps), broadcast over the response tokens.

    `scale_by_std=False` gives the Dr. GRPO variant (mean-centred only). std is the
    unbiased sample std; a group of one is only mean-centred (its advantage is 0).
    """
    groups = _groups(records, "GRPO")
    rewards = sequence_rewards(records, kl_coef)
    for members in groups.values():
        r = rewards[members]
        adv = r - r.mean()
        if scale_by_std and len(members) > 1:
            adv = adv / (r.std() + eps)
        for i, a in zip(members, adv):
            _set_sequence_advantage(records[i], a)


@register_advantage_estimator("rloo", needs_groups=True)
def rloo_advantages(records: Sequence[Experience], *, kl_coef: float = 0.0) -> None:
    """A_i = r_i - mean_{j != i} r_j over the other samples of i's group (REINFORCE
    leave-one-out), broadcast over the response tokens. Needs >= 2 samples per prompt."""
    groups = _groups(records, "RLOO")
    rewards = sequence_rewards(records, kl_coef)
    for prompt, members in groups.items():
        n = len(members)
        if n < 2:
            raise ValueError(f"RLOO: prompt_index {prompt} has {n} sample; a leave-one-out baseline needs "
                             f">= 2 samples per prompt (task.samples_per_prompt)")
        r = rewards[members]
        baseline = (r.sum() - r) / (n - 1)
        for i, a in zip(members, r - baseline):
            _set_sequence_advantage(records[i], a)


# -------------------------------------------------------------- token-level
def _reverse_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                 lam: float) -> torch.Tensor:
    """GAE over rows `[S, L]`, visiting only masked slots (a gap carries the recursion over).

    delta_t = r_t + gamma * V_next - V_t ; A_t = delta_t + gamma * lam * A_next, where
    "next" is the next masked slot of the row (V_next = A_next = 0 after the last).
    With values = 0 and lam = 1, A_t is the discounted return sum_k gamma^k r_{t+k}.
    """
    rows = mask.shape[0]
    adv = torch.zeros_like(values)
    last_gae = values.new_zeros(rows)
    next_value = values.new_zeros(rows)
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = torch.where(m, gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, gae, torch.zeros_like(gae))
    return adv


def _add_final_reward(token_rewards: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor) -> None:
    """token_rewards[s, last masked slot of row s] += rewards[s], in place (rows `[S, L]`)."""
    has = mask.any(-1)
    last = mask.shape[1] - 1 - mask.flip(-1).to(torch.int8).argmax(-1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    token_rewards[rows, last[has]] += rewards[has].to(token_rewards.dtype)


@register_advantage_estimator("gae", whiten_by_default=True, uses_critic=True)
def gae_advantages(
    records: Sequence[Experience], *, gamma: float = 1.0, lam: float = 0.95, kl_coef: float = 0.0
) -> None:
    """Generalized advantage estimation over each record's response slots.

    The scalar reward lands on the last response slot; `kl_coef * kl` is subtracted per
    token as a reward penalty. `values` are the critic's values at the same slots (slot k:
    the state after token k). returns = advantages + values (the critic's target).
    No whitening here: `compute_advantages` or `whiten_advantages` applies it.
    """
    for i, rec in enumerate(records):
        if rec.values is None or rec.rewards is None:
            raise ValueError(f"record {i}: GAE needs 'values' and 'rewards'")
        slots = rec.action_mask.nonzero().flatten()
        values = rec.values.detach().float()
        token_rewards = torch.zeros_like(values)
        if kl_coef:
            token_rewards -= kl_coef * _kl(rec, i, kl_coef) * rec.action_mask
        advantages = torch.zeros_like(values)
        if len(slots):
            token_rewards[slots[-1]] += float(rec.rewards)
            last_gae, next_value = 0.0, 0.0
            for t in reversed(slots.tolist()):
                delta = token_rewards[t] + gamma * next_value - values[t]
                last_gae = delta + gamma * lam * last_gae
                advantages[t] = last_gae
                next_value = values[t]
        rec.advantages = advantages
        rec.returns = (advantages + values) * rec.action_mask


def gae_advantages_batch(
    batch: Experience, *, gamma: float = 1.0, lam: float = 0.95, kl_coef: float = 0.0
) -> Experience:
    """`gae_advantages` on a collated batch: sets `batch.advantages` and `batch.returns`
    (laid out like `action_mask`: padded `[B, T-1]` or packed `[1, N]`, segmented by
    `packed_seq_lens`) from `batch.values`, `batch.rewards [B]` and `batch.kl`; returns the batch.

    Vectorized over sequences (one loop over the longest sequence's slots), so the scoring
    pass need not split the batch into records and collate it again.
    """
    if batch.values is None or batch.rewards is None:
        raise ValueError("gae_advantages_batch needs batch.values and batch.rewards")
    if batch.is_record:
        raise ValueError("gae_advantages_batch takes a collated batch; use gae_advantages for records")
    mask = batch.action_mask.bool()
    values = batch.values.detach().float()
    token_rewards = torch.zeros_like(values)
    if kl_coef:
        if batch.kl is None:
            raise ValueError(f"gae_advantages_batch: kl_coef={kl_coef} (a KL reward penalty) needs batch.kl")
        token_rewards -= kl_coef * batch.kl.detach().float() * mask
    to_rows, from_rows = _row_view(batch)
    mask_r = to_rows(mask)
    token_rewards_r = to_rows(token_rewards)
    _add_final_reward(token_rewards_r, mask_r, torch.as_tensor(batch.rewards, dtype=torch.float32).reshape(-1))
    advantages = from_rows(_reverse_gae(token_rewards_r, to_rows(values), mask_r, gamma, lam))
    batch.advantages = advantages
    batch.returns = (advantages + values) * mask
    return batch


def _row_view(batch: Experience) -> tuple[Callable, Callable]:
    """(to_rows, from_rows): action-axis tensor <-> one row per sequence `[S, L]` (zero-padded).

    Padded batches are already rows; a pack's flat `[1, N]` axis is cut at `packed_seq_lens`.
    """
    if not batch.is_packed:
        return (lambda x: x), (lambda x: x)
    lens = torch.tensor(batch.packed_seq_lens, device=batch.action_mask.device)
    starts = lens.cumsum(0) - lens
    pos = torch.arange(int(lens.max()), device=lens.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [S, L]
    flat = (starts.unsqueeze(1) + pos.unsqueeze(0))[valid]  # row-major order = the pack's order

    def to_rows(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(valid.shape)
        rows[valid] = x[0, flat]
        return rows

    def from_rows(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros((1, batch.action_mask.shape[1]))
        out[0, flat] = rows[valid]
        return out

    return to_rows, from_rows


@register_advantage_estimator("reinforce_pp", whiten_by_default=True)
def reinforce_pp_advantages(
    records: Sequence[Experience], *, gamma: float = 1.0, kl_coef: float = 0.0, whiten: bool = True,
    baseline: bool = False,
) -> None:
    """REINFORCE++ (Hu 2025): token-level KL-shaped returns, whitened over the batch.

    Per record, on its action slots: r_t = -kl_coef * kl_t, plus the scalar reward on the
    last action slot; returns G_t = r_t + gamma * G_{t+1} (over action slots). `returns` =
    G; `advantages` = G whitened over every action token of `records` (`whiten=False`
    leaves them unwhitened). `baseline=True` is `reinforce_pp_baseline_advantages`.
    """
    for i, rec in enumerate(records):
        if rec.rewards is None:
            raise ValueError(f"record {i}: REINFORCE++ needs 'rewards'")
    if not records:
        return
    rewards = torch.stack([torch.as_tensor(r.rewards, dtype=torch.float32) for r in records])
    if baseline:
        for members in _groups(records, "REINFORCE++ with baseline").values():
            rewards[members] = rewards[members] - rewards[members].mean()
    # one row per record (zero-padded), so the scan loops over the longest response once
    lengths = [rec.action_mask.shape[0] for rec in records]
    device = records[0].action_mask.device
    mask = torch.zeros(len(records), max(lengths), dtype=torch.bool, device=device)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    for i, (rec, n) in enumerate(zip(records, lengths)):
        mask[i, :n] = rec.action_mask
        if kl_coef:
            token_rewards[i, :n] -= kl_coef * _kl(rec, i, kl_coef) * rec.action_mask
    _add_final_reward(token_rewards, mask, rewards.to(device))
    returns = _reverse_gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    for rec, row, n in zip(records, returns, lengths):
        rec.returns = row[:n].clone()
        rec.advantages = row[:n].clone()
    if whiten:
        whiten_advantages(records)


@register_advantage_estimator("reinforce_pp_baseline", whiten_by_default=True)
def reinforce_pp_baseline_advantages(
    records: Sequence[Experience], *, gamma: float = 1.0, kl_coef: float = 0.0, whiten: bool = True
) -> None:
    """REINFORCE++-baseline: each reward minus its group's mean reward, then `reinforce_pp_advantages`."""
    reinforce_pp_advantages(records, gamma=gamma, kl_coef=kl_coef, whiten=whiten, baseline=True)


# ------------------------------------------------------------------ whitening
def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[3]` float64 (count, sum, sum of squares) of `x` over `mask`: add these over
    microbatches (and all-reduce SUM over DP ranks) before `whiten_with_moments`."""
    m = mask.bool()
    v = x.detach().double()[m]
    return torch.stack([v.new_tensor(float(v.numel())), v.sum(), (v * v).sum()])


def whiten_with_moments(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, *, eps: float = 1e-8,
                        shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) on masked slots, 0 elsewhere; mean and the unbiased
    variance (n - 1) come from `moments` (global). `shift_mean=False` keeps the mean."""
    n, s, ss = (float(v) for v in moments)
    mean = s / max(n, 1.0)
    var = (ss - n * mean * mean) / (n - 1) if n > 1 else 0.0
    out = x - mean if shift_mean else x
    out = out * (max(var, 0.0) + eps) ** -0.5
    return out * mask.to(x.dtype)


def whiten_advantages(items: Sequence[Experience], *, eps: float = 1e-8, shift_mean: bool = True) -> None:
    """Whiten `advantages` over every action token of `items` (records or batches: one step),
    in place. `returns` are left as they are (the critic's target stays unwhitened)."""
    if not items:
        return
    moments = sum(masked_moments(it.advantages, it.action_mask) for it in items)
    for it in items:
        it.advantages = whiten_with_moments(it.advantages, it.action_mask, moments, eps=eps, shift_mean=shift_mean)


# ------------------------------------------------------------------- dispatch
def _options(fn: Callable) -> set[str]:
    """An estimator's options (keyword-only parameters); whitening is the dispatcher's."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY} - {"whiten", "baseline"}


def compute_advantages(
    records: Sequence[Experience], estimator: str, *, whiten: bool | None = None, **opts
) -> None:
    """Set `advantages` and `returns` on `records` (one step's) with the registered estimator.

    `opts` may hold any estimator's options (gamma, lam, kl_coef, scale_by_std, eps);
    each estimator takes the ones it knows, an option no estimator knows is an error.
    `whiten`: whiten advantages over all action tokens of `records`; None = the
    estimator's default (`whiten_by_default`: gae and reinforce_pp* on, grpo and rloo off).
    """
    est = get_advantage_estimator(estimator, "advantage")
    known = set().union(*(_options(e.fn) for e in ADVANTAGE_ESTIMATORS.values()))
    unknown = sorted(set(opts) - known)
    if unknown:
        raise TypeError(f"compute_advantages: unknown options {unknown}; the estimators take {sorted(known)}")
    kwargs = {k: v for k, v in opts.items() if k in _options(est.fn)}
    if "whiten" in inspect.signature(est.fn).parameters:
        kwargs["whiten"] = False  # whitened below, like every estimator
    est.fn(records, **kwargs)
    if est.whiten_by_default if whiten is None else whiten:
        whiten_advantages(records)
