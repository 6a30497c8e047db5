"""Advantage estimators, one GAE, and whitening: one phase, after the scoring pass.

`compute_advantages(items, name, ...)` sets `advantages` and `returns` on `items`, laid out
like their `action_mask`: collated batches (padded `[B, T-1]`, packed `[1, N]` segmented by
`packed_seq_lens`) or records (`[T-1]`). It is called once per step, on the collated
batches, after the scoring pass has put `values` and `kl` on them. In three stages:

1. each sample's scalar, from the step's rewards and prompt groups (`prompt_index`): the
   registered estimator's function `fn(rewards [n], prompt_index [n], **options) -> [n]`.
   Every rank holds the whole step's rewards (`samples`: its stand-ins, packing/exchange.py),
   so group baselines see whole groups while each rank holds only its own batches; `rows`
   says which sample each batch row is.
2. per token, on the items' rows (one row per sequence):
   * `grpo`, `rloo` - the scalar is the advantage, broadcast over the response; a KL reward
     penalty (`kl_coef`) is folded into the reward first, r_i - kl_coef * sum_t kl_t (as verl).
   * token-level estimators (`gae`, `reinforce_pp`, `reinforce_pp_baseline`) - the scalar is
     the reward of the last response slot, `-kl_coef * kl_t` the reward of every response
     slot, and `gae` (the one GAE) turns them into advantages: against the critic's `values`
     with `lam` for `gae`; with values 0 and lam 1 (discounted returns) for REINFORCE++.
     returns = advantages + values.
3. whitening over every action token of the step (`whiten`; by default on for the
   token-level estimators): moments summed over the items and, with `group`, over the
   DP ranks; `returns` stay unwhitened (the critic's target).

Estimators (`algo.advantage`), each one function under `register_advantage_estimator`
(like verl's registry; `python -m rl.registry` lists them):

* `grpo`   - (r_i - mean_group) / (std_group + eps).
* `rloo`   - r_i - mean of the *other* samples of its group (leave-one-out baseline).
* `gae`    - generalized advantage estimation against the critic's `values`.
* `reinforce_pp` - REINFORCE++ (Hu 2025): token rewards -kl_coef * kl_t plus the reward on
             the last response slot, discounted by gamma into token-level returns, whitened
             over the batch. It is defined with the KL in the reward: with kl_coef > 0 the
             config requires kl_mode=reward (rl/config.py), so the KL is never also a loss.
* `reinforce_pp_baseline` - the same after subtracting the group-mean reward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packing import Experience
from packing.layout import cu_seqlens, group_by_prompt
from rl.choice import Registry


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: `fn(rewards [n], prompt_index [n] or None, **options)`
    gives each sample's scalar (options: its keyword-only parameters); `compute_advantages`
    lays it out per token."""

    name: str
    fn: Callable[..., torch.Tensor]
    whiten_by_default: bool = False  # whiten over every action token of the step unless algo.whiten_advantages says
    uses_critic: bool = False  # GAE against the critic's values (needs the scoring pass's values)
    needs_groups: bool = False  # a baseline from the other samples of a prompt: >= 2 samples per prompt
    # The scalar is the reward of the last response slot, discounted per token (a KL reward
    # penalty per token); otherwise it is every response token's advantage (a KL reward
    # penalty folded into the scalar reward, which needs every sample's KL on every rank).
    token_level: bool = False
    # Defined with the KL as a per-token reward penalty (REINFORCE++): kl_coef > 0 needs kl_mode=reward.
    kl_in_reward: bool = False


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "algo.advantage",
                                "rl/algos/advantages.py: register_advantage_estimator")


def register_advantage_estimator(name: str, *, whiten_by_default: bool = False, uses_critic: bool = False,
                                 needs_groups: bool = False, token_level: bool = False,
                                 kl_in_reward: bool = False) -> Callable:
    """Register `fn` as `algo.advantage=<name>` (a decorator); the name must be new."""

    def register(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        ADVANTAGE_ESTIMATORS.add(name, Estimator(name, fn, whiten_by_default, uses_critic, needs_groups, token_level,
                                                 kl_in_reward))
        return fn

    return register


def get_advantage_estimator(name: str, key: str = "algo.advantage") -> Estimator:
    """The estimator registered as `name`; else an error naming `key` and the registered names."""
    return ADVANTAGE_ESTIMATORS.lookup(name, key)


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


# ------------------------------------------------------------------ estimators
def _groups(prompt_index: torch.Tensor | None, who: str) -> dict[int, list[int]]:
    """prompt -> the positions of its samples, in order of first appearance."""
    if prompt_index is None:
        raise ValueError(f"{who} needs 'prompt_index' on every sample")
    return group_by_prompt(prompt_index)


@register_advantage_estimator("grpo", needs_groups=True)
def grpo_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor | None, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_group) / (std_group + eps), broadcast over the response tokens.

    `scale_by_std=False` gives the Dr. GRPO variant (mean-centred only). std is the
    unbiased sample std; a group of one is only mean-centred (its advantage is 0).
    """
    adv = torch.zeros_like(rewards)
    for members in _groups(prompt_index, "GRPO").values():
        r = rewards[members]
        a = r - r.mean()
        if scale_by_std and len(members) > 1:
            a = a / (r.std() + eps)
        adv[members] = a
    return adv


@register_advantage_estimator("rloo", needs_groups=True)
def rloo_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor | None) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j over the other samples of i's group (REINFORCE
    leave-one-out), broadcast over the response tokens. Needs >= 2 samples per prompt."""
    adv = torch.zeros_like(rewards)
    for prompt, members in _groups(prompt_index, "RLOO").items():
        n = len(members)
        if n < 2:
            raise ValueError(f"RLOO: prompt_index {prompt} has {n} sample; a leave-one-out baseline needs "
                             f">= 2 samples per prompt (task.samples_per_prompt)")
        r = rewards[members]
        adv[members] = r - (r.sum() - r) / (n - 1)
    return adv


@register_advantage_estimator("gae", token_level=True, uses_critic=True, whiten_by_default=True)
def gae_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor | None) -> torch.Tensor:
    """Generalized advantage estimation against the critic's values: the reward on the last
    response slot (minus kl_coef * kl per token), delta_t = r_t + gamma V_next - V_t,
    A_t = delta_t + gamma lam A_next; returns = A + V (the critic's target)."""
    return rewards


@register_advantage_estimator("reinforce_pp", token_level=True, whiten_by_default=True, kl_in_reward=True)
def reinforce_pp_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor | None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token rewards -kl_coef * kl_t plus the reward on the last
    response slot, discounted by gamma into token-level returns, whitened over the batch."""
    return rewards


@register_advantage_estimator("reinforce_pp_baseline", token_level=True, whiten_by_default=True)
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, prompt_index: torch.Tensor | None) -> torch.Tensor:
    """REINFORCE++-baseline: each reward minus its group's mean reward, then REINFORCE++'s
    discounted, whitened token-level returns."""
    shaped = rewards.clone()
    for members in _groups(prompt_index, "REINFORCE++ with baseline").values():
        shaped[members] = shaped[members] - shaped[members].mean()
    return shaped


# ------------------------------------------------------------------------ GAE
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:
    """GAE over rows `[S, L]` (one sequence a row), visiting only masked slots (a gap carries
    the recursion over); 0 on unmasked slots.

    delta_t = r_t + gamma * V_next - V_t ; A_t = delta_t + gamma * lam * A_next, where
    "next" is the next masked slot of the row (V_next = A_next = 0 after the last).
    With values = 0 and lam = 1, A_t is the discounted return sum_k gamma^k r_{t+k}.
    Vectorized over rows: one loop over the longest row's slots.
    """
    rows = mask.shape[0]
    adv = torch.zeros_like(values)
    last_gae = values.new_zeros(rows)
    next_value = values.new_zeros(rows)
    for t in reversed(range(mask.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * last_gae
        last_gae = torch.where(m, step, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, step, torch.zeros_like(step))
    return adv


def _add_final_reward(token_rewards: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor) -> None:
    """token_rewards[s, last masked slot of row s] += rewards[s], in place (rows `[S, L]`)."""
    has = mask.any(-1)
    last = mask.shape[1] - 1 - mask.flip(-1).to(torch.int8).argmax(-1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    token_rewards[rows, last[has]] += rewards[has].to(token_rewards.dtype)


# ----------------------------------------------------------------- row views
def _row_view(item: Experience) -> tuple[Callable, Callable]:
    """(to_rows, from_rows): an action-axis tensor of `item` <-> one row per sequence `[S, L]`
    (zero-padded). A record is one row, a padded batch is rows already, a pack's flat
    `[1, N]` axis is cut at `packed_seq_lens`."""
    mask = item.action_mask
    if mask.dim() == 1:
        return (lambda x: x.unsqueeze(0)), (lambda rows: rows[0])
    if not item.is_packed:
        return (lambda x: x), (lambda rows: rows)
    lens = torch.tensor(item.packed_seq_lens, device=mask.device)
    starts = cu_seqlens(lens)[:-1].long()
    pos = torch.arange(int(lens.max()), device=lens.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [S, L]
    flat = (starts.unsqueeze(1) + pos.unsqueeze(0))[valid]  # row-major order = the pack's order

    def to_rows(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(valid.shape)
        rows[valid] = x[0, flat]
        return rows

    def from_rows(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_zeros((1, mask.shape[1]))
        out[0, flat] = rows[valid]
        return out

    return to_rows, from_rows


def _what(item: Experience, i: int) -> str:
    """How an error names item i: a record, a stand-in (no action mask left) or a batch."""
    if item.action_mask is None:
        return f"sample {i}"
    return f"record {i}" if item.action_mask.dim() == 1 else f"batch {i}"


def _kl_rows(item: Experience, i: int, kl_coef: float, to_rows: Callable) -> torch.Tensor:
    if item.kl is None:
        raise ValueError(f"{_what(item, i)}: kl_coef={kl_coef} (a KL reward penalty) needs 'kl'")
    return to_rows(item.kl.detach().float())


def _sample_scalars(sources: Sequence[Experience], kl_coef: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[n]` fp32 rewards, r_i - kl_coef * (sum of kl over sample i's action slots) when
    `kl_coef`, and `[n]` prompt indices (None if a source has none), over every row of `sources`."""
    rewards, prompts = [], []
    for i, src in enumerate(sources):
        if src.rewards is None:
            raise ValueError(f"{_what(src, i)}: advantages need 'rewards'")
        r = torch.as_tensor(src.rewards, dtype=torch.float32).reshape(-1).cpu()
        if kl_coef:
            if src.kl is None or src.action_mask is None:
                raise ValueError(f"{_what(src, i)}: kl_coef={kl_coef} (a KL reward penalty) needs 'kl'")
            to_rows, _ = _row_view(src)
            r = r - kl_coef * (_kl_rows(src, i, kl_coef, to_rows) * to_rows(src.action_mask)).sum(-1).cpu()
        rewards.append(r)
        prompts.append(None if src.prompt_index is None else torch.as_tensor(src.prompt_index).reshape(-1).cpu())
    prompt_index = None if any(p is None for p in prompts) else torch.cat(prompts) if prompts else None
    return (torch.cat(rewards) if rewards else torch.zeros(0)), prompt_index


# ------------------------------------------------------------------- dispatch
def _options(fn: Callable) -> set[str]:
    """An estimator's options: its keyword-only parameters."""
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


TOKEN_OPTIONS = {"gamma", "lam", "kl_coef"}  # the per-token stage's (gae and the KL reward penalty)


@torch.no_grad()
def compute_advantages(
    items: Sequence[Experience], estimator: str, *, samples: Sequence[Experience] | None = None,
    rows: Sequence[Sequence[int]] | None = None, weights: Sequence[float] | None = None,
    group: dist.ProcessGroup | None = None, whiten: bool | None = None, gamma: float = 1.0, lam: float = 0.95,
    kl_coef: float = 0.0, **options,
) -> None:
    """Set `advantages` and `returns` on `items` (collated batches or records) with the
    registered `estimator` (see the module docstring).

    `samples`: the step's samples (records or stand-ins: `rewards`, `prompt_index`), whose
    scalars the estimator computes; `rows[i][k]` is the position in `samples` of item i's
    row k. None: the items' own rows are the step. `weights[i] == 0` marks a repeated item
    (a zero-weight microbatch) left out of the whitening moments; `group`: the process
    group whose ranks hold the rest of the step (the moments are summed over it).
    `kl_coef`: a KL reward penalty read from the items' `kl` (`kl_mode=reward`).
    `options`: any estimator's (scale_by_std, eps); each takes its own, one no estimator
    knows is an error. `whiten`: None = the estimator's default (`whiten_by_default`).
    """
    est = get_advantage_estimator(estimator, "advantage")
    known = set().union(*(_options(e.fn) for e in ADVANTAGE_ESTIMATORS.values()))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"compute_advantages: unknown options {unknown}; the estimators take "
                        f"{sorted(known | TOKEN_OPTIONS)}")
    views = [_row_view(it) for it in items]
    masks = [to_rows(it.action_mask.bool()) for it, (to_rows, _) in zip(items, views)]
    if samples is None:  # the items' rows are the step's samples, in order
        samples, first = items, 0
        rows = []
        for m in masks:
            rows.append(list(range(first, first + m.shape[0])))
            first += m.shape[0]
    elif rows is None or len(rows) != len(items) or any(m.shape[0] != len(r) for m, r in zip(masks, rows)):
        raise ValueError(f"compute_advantages: with samples, rows must name the sample of every sequence of each "
                         f"item: items hold {[m.shape[0] for m in masks]} sequences, rows "
                         f"{None if rows is None else [len(r) for r in rows]}")
    # 1. each sample's scalar, over the whole step (a sequence-level estimator folds the KL in here)
    rewards, prompt_index = _sample_scalars(samples, 0.0 if est.token_level else kl_coef)
    scalars = est.fn(rewards, prompt_index, **{k: v for k, v in options.items() if k in _options(est.fn)})
    # 2. per token, on every item's rows at once (zero-padded to the longest)
    if items:
        width = max(m.shape[1] for m in masks)
        pad = lambda x: F.pad(x, (0, width - x.shape[1]))  # noqa: E731
        mask = torch.cat([pad(m) for m in masks])
        scalar = scalars[torch.tensor([j for r in rows for j in r], dtype=torch.long)].to(mask.device)
        if est.token_level:
            advantages, returns = _token_level(est, items, views, pad, mask, scalar, gamma, lam, kl_coef)
        else:
            advantages = scalar.unsqueeze(1) * mask.to(torch.float32)
            returns = advantages.clone()
        first = 0
        for it, m, (_, from_rows) in zip(items, masks, views):
            n, length = m.shape
            it.advantages = from_rows(advantages[first:first + n, :length])
            it.returns = from_rows(returns[first:first + n, :length])
            first += n
    # 3. whitening over the step
    if est.whiten_by_default if whiten is None else whiten:
        whiten_advantages(items, weights=weights, group=group)


def _token_level(est: Estimator, items: Sequence[Experience], views: list, pad: Callable, mask: torch.Tensor,
                 scalar: torch.Tensor, gamma: float, lam: float, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) rows: `scalar` on each row's last masked slot, -kl_coef * kl on
    every masked slot, through `gae` against the critic's values (or 0 with lam 1)."""
    if est.uses_critic:
        missing = [i for i, it in enumerate(items) if it.values is None]
        if missing:
            first = missing[0]
            raise ValueError(f"advantage={est.name} needs the critic's 'values': {_what(items[first], first)} has none")
        values = torch.cat([pad(to_rows(it.values.detach().float())) for it, (to_rows, _) in zip(items, views)])
    else:
        values = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    token_rewards = torch.zeros_like(values)
    if kl_coef:
        kl = torch.cat([pad(_kl_rows(it, i, kl_coef, to_rows))
                        for i, (it, (to_rows, _)) in enumerate(zip(items, views))])
        token_rewards -= kl_coef * kl * mask
    _add_final_reward(token_rewards, mask, scalar)
    advantages = gae(token_rewards, values, mask, gamma, lam if est.uses_critic else 1.0)
    return advantages, (advantages + values) * mask


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


def whiten_advantages(items: Sequence[Experience], *, weights: Sequence[float] | None = None,
                      group: dist.ProcessGroup | None = None, eps: float = 1e-8, shift_mean: bool = True) -> None:
    """Whiten `advantages` over every action token of the step, in place: `items` (records or
    batches) and, with `group`, the items of the group's other ranks (moments all-reduced).
    Items of weight 0 (repeats) are whitened but not counted. `returns` are left as they are
    (the critic's target stays unwhitened)."""
    if not items and group is None:
        return
    device = items[0].advantages.device if items else torch.device("cpu")
    counted = [it for i, it in enumerate(items) if weights is None or weights[i]]
    moments = sum((masked_moments(it.advantages, it.action_mask) for it in counted),
                  torch.zeros(3, dtype=torch.float64, device=device))
    if group is not None:
        dist.all_reduce(moments, group=group)
    for it in items:
        it.advantages = whiten_with_moments(it.advantages, it.action_mask, moments, eps=eps, shift_mean=shift_mean)
