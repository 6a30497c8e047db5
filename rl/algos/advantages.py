"""Advantage estimators, one GAE, and whitening: one phase, after the scoring pass.

`compute_advantages(items, name, ...)` sets `advantages` and `returns` on `items`, laid out
like their `action_mask`: collated batches (padded `[B, T-1]`, packed `[1, N]` segmented by
`packed_seq_lens`) or records (`[T-1]`). It is called once per step, on the collated
batches, after the scoring pass has put `values` and `kl` on them:

1. it lays the items out as `AdvantageInputs`: one row per sequence over its action slots
   (`[S, L]`, zero-padded), which sample of the step each row is, and the step's rewards and
   prompt groups. Every rank holds the whole step's rewards (`samples`: its stand-ins,
   runtime/exchange.py), so group baselines see whole groups while each rank holds only its
   own batches.
2. the registered estimator computes `(advantages, returns)` on those rows, itself: each is
   one function `fn(inputs, **its options)` under `register_advantage_estimator` (like
   verl's registry; `python -m rl.registry` lists them). Adding one is one function.
3. whitening over every action token of the step (`whiten`; by default on for the estimators
   registered `whiten_by_default`): moments summed over the items and, with `group`, over the
   DP ranks; `returns` stay unwhitened (the critic's target).

Everything from the rewards to the whitened advantages is float64, cast to fp32 onto the items
last: a group's sum or squares of in-range fp32 rewards (four of (1, 1, 2, 3) x 1e38) overflow
fp32, which would make every estimator's baseline inf and its advantages NaN.

Estimators (`algo.advantage`):

* `grpo`   - (r_i - mean_group) / (std_group + eps), broadcast over the response.
* `rloo`   - r_i - mean of the *other* samples of its group (leave-one-out baseline).
* `gae`    - generalized advantage estimation against the critic's `values`: the reward on
             the last response slot, -kl_coef * kl_t on every response slot (`kl_mode=reward`);
             returns = advantages + values.
* `reinforce_pp` - REINFORCE++ (Hu 2025): the same token rewards discounted by gamma into
             token-level returns (GAE with values 0 and lam 1), whitened over the batch. It is
             defined with the KL in the reward: with kl_coef > 0 the config requires
             kl_mode=reward (`rl.config.validate`), so the KL is never also a loss.
* `reinforce_pp_baseline` - the same after subtracting the group-mean reward.
* `distill` - on-policy distillation: each action token's -(log p_student - log p_teacher)
             (student: the old / rollout log-probs `action_log_probs`, teacher:
             `teacher_action_log_probs`, rl/algos/distill.py), discounted by
             `distill_discount` into a return-to-go (0: each token its own term); the task's
             reward is not read. `compute_advantages(..., distill_coef=c)` adds c x the same
             term to any other estimator's advantages instead.

An estimator reads the per-token KL reward when it takes a `kl_coef` option; the sequence-level
ones (grpo, rloo) do not (a rank holds only its own samples' KL, and their baselines need every
sample's), and giving them a non-zero `kl_coef` is an error.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packing import Experience
from packing.layout import cu_seqlens, group_by_prompt
from rl.choice import Registry


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads: the step's samples (`rewards`, `prompt_index`: every rank holds
    all of them) and this rank's sequences, one row each over their action slots."""

    rewards: torch.Tensor  # [n] float64: every sample of the step
    prompt_index: torch.Tensor | None  # [n], the GRPO group of each sample (None: a source had none)
    rows: torch.Tensor  # [S] int64: the sample each row is
    mask: torch.Tensor  # [S, L] bool: the action slots of each row
    values: torch.Tensor | None  # [S, L] float64: the critic's (scoring pass), None without a critic
    kl: torch.Tensor | None  # [S, L] float64: per-token KL to the reference, None if an item has none
    lacking: dict[str, str]  # "values" / "kl" / ... -> the first item without it ("batch 0", "record 3"): for errors
    log_probs: torch.Tensor | None = None  # [S, L] float64: the student's old log-probs (action_log_probs)
    teacher_log_probs: torch.Tensor | None = None  # [S, L] float64: the teacher's (teacher_action_log_probs)

    def per_row(self, scalars: torch.Tensor) -> torch.Tensor:
        """`[n]` per-sample values -> `[S]` per row, on the rows' device."""
        return scalars[self.rows].to(self.mask.device)


@dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: `fn(inputs: AdvantageInputs, **options) -> (advantages,
    returns)`, both `[S, L]` (options: its keyword-only parameters)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    whiten_by_default: bool = False  # whiten over every action token of the step unless algo.whiten_advantages says
    uses_critic: bool = False  # GAE against the critic's values (needs the scoring pass's values)
    needs_groups: bool = False  # a baseline from the other samples of a prompt: >= 2 samples per prompt
    # Defined with the KL as a per-token reward penalty (REINFORCE++): kl_coef > 0 needs kl_mode=reward.
    kl_in_reward: bool = False

    @property
    def options(self) -> set[str]:
        return _options(self.fn)

    @property
    def reads_kl(self) -> bool:
        """Takes a per-token KL reward (`kl_coef`): the token-level estimators."""
        return "kl_coef" in self.options


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "algo.advantage",
                                "rl/algos/advantages.py: register_advantage_estimator")


def register_advantage_estimator(name: str, *, whiten_by_default: bool = False, uses_critic: bool = False,
                                 needs_groups: bool = False, kl_in_reward: bool = False) -> Callable:
    """Register `fn` as `algo.advantage=<name>` (a decorator); the name must be new."""

    def register(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable:
        ADVANTAGE_ESTIMATORS.add(name, Estimator(name, fn, whiten_by_default, uses_critic, needs_groups, kl_in_reward))
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


def _broadcast(x: AdvantageInputs, scalars: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's scalar on every action slot of its rows: (advantages, returns) alike."""
    advantages = x.per_row(scalars).unsqueeze(1) * x.mask.to(scalars.dtype)
    return advantages, advantages.clone()


@register_advantage_estimator("grpo", needs_groups=True)
def grpo_advantages(x: AdvantageInputs, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (r_i - mean_group) / (std_group + eps), broadcast over the response tokens.

    `scale_by_std=False` gives the Dr. GRPO variant (mean-centred only). std is the
    unbiased sample std; a group of one is only mean-centred (its advantage is 0).
    """
    adv = torch.zeros_like(x.rewards)
    for members in _groups(x.prompt_index, "GRPO").values():
        r = x.rewards[members]
        a = r - r.mean()
        if scale_by_std and len(members) > 1:
            a = a / (r.std() + eps)
        adv[members] = a
    return _broadcast(x, adv)


@register_advantage_estimator("rloo", needs_groups=True)
def rloo_advantages(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = r_i - mean_{j != i} r_j over the other samples of i's group (REINFORCE
    leave-one-out), broadcast over the response tokens. Needs >= 2 samples per prompt."""
    adv = torch.zeros_like(x.rewards)
    for prompt, members in _groups(x.prompt_index, "RLOO").items():
        n = len(members)
        if n < 2:
            raise ValueError(f"RLOO: prompt_index {prompt} has {n} sample; a leave-one-out baseline needs "
                             f">= 2 samples per prompt (task.samples_per_prompt)")
        r = x.rewards[members]
        adv[members] = r - (r.sum() - r) / (n - 1)
    return _broadcast(x, adv)


@register_advantage_estimator("gae", uses_critic=True, whiten_by_default=True)
def gae_advantages(x: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95,
                   kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation against the critic's values: the reward on the last
    response slot (minus kl_coef * kl per token), delta_t = r_t + gamma V_next - V_t,
    A_t = delta_t + gamma lam A_next; returns = A + V (the critic's target)."""
    if x.values is None:
        raise ValueError(f"advantage=gae needs the critic's 'values': {x.lacking['values']} has none")
    advantages = gae(token_rewards(x, x.rewards, kl_coef), x.values, x.mask, gamma, lam)
    return advantages, (advantages + x.values) * x.mask


@register_advantage_estimator("reinforce_pp", whiten_by_default=True, kl_in_reward=True)
def reinforce_pp_advantages(x: AdvantageInputs, *, gamma: float = 1.0,
                            kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): token rewards -kl_coef * kl_t plus the reward on the last
    response slot, discounted by gamma into token-level returns, whitened over the batch."""
    returns = discounted_returns(token_rewards(x, x.rewards, kl_coef), x.mask, gamma)
    return returns, returns.clone()


@register_advantage_estimator("reinforce_pp_baseline", whiten_by_default=True)
def reinforce_pp_baseline_advantages(x: AdvantageInputs, *, gamma: float = 1.0,
                                     kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: each reward minus its group's mean reward, then REINFORCE++'s
    discounted, whitened token-level returns."""
    shaped = x.rewards.clone()
    for members in _groups(x.prompt_index, "REINFORCE++ with baseline").values():
        shaped[members] = shaped[members] - shaped[members].mean()
    returns = discounted_returns(token_rewards(x, shaped, kl_coef), x.mask, gamma)
    return returns, returns.clone()


@register_advantage_estimator("distill")
def distill_advantages(x: AdvantageInputs, *, distill_discount: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: r_t = -(log p_student - log p_teacher) of each sampled token,
    A_t = sum_{k >= t} distill_discount^(k - t) r_k (0: A_t = r_t). With discount 1 the expected
    policy gradient is the exact gradient of the sequence's reverse KL(p_student || p_teacher)
    (tests/test_distill.py, by enumeration). The task's reward is not read."""
    advantages = discounted_returns(distill_rewards(x), x.mask, distill_discount)
    return advantages, advantages.clone()


def distill_rewards(x: AdvantageInputs) -> torch.Tensor:
    """`[S, L]`: -(log p_student - log p_teacher) on every action slot, 0 elsewhere."""
    for name, field_name in (("log_probs", "action_log_probs"), ("teacher_log_probs", "teacher_action_log_probs")):
        if getattr(x, name) is None:
            raise ValueError(f"on-policy distillation needs '{field_name}' on every item: {x.lacking[field_name]} "
                             "has none (the score stage puts them there when algo.teacher.path is set)")
    return -(x.log_probs - x.teacher_log_probs) * x.mask


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


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over each row's masked slots (GAE with values 0 and lam 1)."""
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)


def token_rewards(x: AdvantageInputs, rewards: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """`[S, L]`: -kl_coef * kl_t on every action slot (a KL reward penalty, when `kl_coef`),
    plus each row's sample reward (`rewards [n]`) on its last action slot."""
    out = torch.zeros(x.mask.shape, dtype=rewards.dtype, device=x.mask.device)
    if kl_coef:
        if x.kl is None:
            raise ValueError(f"{x.lacking['kl']}: kl_coef={kl_coef} (a KL reward penalty) needs 'kl'")
        out -= kl_coef * x.kl * x.mask
    has = x.mask.any(-1)
    last = x.mask.shape[1] - 1 - x.mask.flip(-1).to(torch.int8).argmax(-1)
    rows = torch.arange(x.mask.shape[0], device=x.mask.device)[has]
    out[rows, last[has]] += x.per_row(rewards)[has].to(out.dtype)
    return out


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
    """How an error names item i: a stand-in (runtime/exchange.py), a record or a batch."""
    if not isinstance(item, Experience):
        return f"sample {i}"
    return f"record {i}" if item.action_mask.dim() == 1 else f"batch {i}"


def _sample_scalars(sources: Sequence[Experience]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[n]` float64 rewards and `[n]` prompt indices (None if a source has none), over every row of `sources`."""
    rewards, prompts = [], []
    for i, src in enumerate(sources):
        if src.rewards is None:
            raise ValueError(f"{_what(src, i)}: advantages need 'rewards'")
        rewards.append(torch.as_tensor(src.rewards, dtype=torch.float32).reshape(-1).cpu().double())
        prompts.append(None if src.prompt_index is None else torch.as_tensor(src.prompt_index).reshape(-1).cpu())
    prompt_index = None if any(p is None for p in prompts) else torch.cat(prompts) if prompts else None
    return (torch.cat(rewards) if rewards else torch.zeros(0, dtype=torch.float64)), prompt_index


# ------------------------------------------------------------------- dispatch
def _options(fn: Callable) -> set[str]:
    """An estimator's options: its keyword-only parameters."""
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}


@torch.no_grad()
def compute_advantages(
    items: Sequence[Experience], estimator: str, *, samples: Sequence[Experience] | None = None,
    rows: Sequence[Sequence[int]] | None = None, weights: Sequence[float] | None = None,
    group: dist.ProcessGroup | None = None, whiten: bool | None = None, distill_coef: float = 0.0, **options,
) -> None:
    """Set `advantages` and `returns` on `items` (collated batches or records) with the
    registered `estimator` (see the module docstring).

    `samples`: the step's samples (records or stand-ins: `rewards`, `prompt_index`), whose
    rewards the estimator reads; `rows[i][k]` is the position in `samples` of item i's
    row k. None: the items' own rows are the step. `weights[i] == 0` marks a repeated item
    (a zero-weight microbatch) left out of the whitening moments; `group`: the process
    group whose ranks hold the rest of the step (the moments are summed over it).
    `options`: any estimator's (gamma, lam, kl_coef, scale_by_std, eps); each takes its own,
    one no estimator knows is an error, and so is a non-zero `kl_coef` (a KL reward read from
    the items' `kl`) for an estimator that reads no KL. `whiten`: None = the estimator's
    default (`whiten_by_default`). `distill_coef`: adds that times the distillation advantage
    (`distill_advantages`, with the `distill_discount` option) to the estimator's, before whitening.
    """
    est = get_advantage_estimator(estimator, "advantage")
    known = set().union(*(e.options for e in ADVANTAGE_ESTIMATORS.values()))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"compute_advantages: unknown options {unknown}; the estimators take {sorted(known)}")
    if options.get("kl_coef") and not est.reads_kl:
        reading = sorted(e.name for e in ADVANTAGE_ESTIMATORS.values() if e.reads_kl)
        raise ValueError(f"advantage={est.name} reads no per-token KL: kl_coef={options['kl_coef']} would be "
                         f"ignored (the KL reward is read by {', '.join(reading)})")
    views = [_row_view(it) for it in items]
    masks = [to_rows(it.action_mask.bool()) for it, (to_rows, _) in zip(items, views)]
    if samples is None:  # the items' rows are the step's samples, in order
        ends = list(itertools.accumulate(m.shape[0] for m in masks))
        samples, rows = items, [list(range(e - m.shape[0], e)) for m, e in zip(masks, ends)]
    elif rows is None or len(rows) != len(items) or any(m.shape[0] != len(r) for m, r in zip(masks, rows)):
        raise ValueError(f"compute_advantages: with samples, rows must name the sample of every sequence of each "
                         f"item: items hold {[m.shape[0] for m in masks]} sequences, rows "
                         f"{None if rows is None else [len(r) for r in rows]}")
    if items:
        inputs = _inputs(items, views, masks, samples, rows)
        advantages, returns = est.fn(inputs, **{k: v for k, v in options.items() if k in est.options})
        if distill_coef:
            advantages = advantages + distill_coef * distill_advantages(
                inputs, distill_discount=options.get("distill_discount", 0.0))[0]
        first = 0
        for it, m, (_, from_rows) in zip(items, masks, views):
            n, length = m.shape
            it.advantages = from_rows(advantages[first:first + n, :length])  # float64 until whitened
            it.returns = from_rows(returns[first:first + n, :length]).float()
            first += n
    if est.whiten_by_default if whiten is None else whiten:
        whiten_advantages(items, weights=weights, group=group)
    for it in items:
        it.advantages = it.advantages.float()


def _inputs(items: Sequence[Experience], views: list[tuple[Callable, Callable]], masks: list[torch.Tensor],
            samples: Sequence[Experience], rows: Sequence[Sequence[int]]) -> AdvantageInputs:
    """The items' rows as an estimator reads them: float64 token fields zero-padded to one width."""
    width = max(m.shape[1] for m in masks)
    pad = lambda x: F.pad(x, (0, width - x.shape[1]))  # noqa: E731

    def per_token(name: str) -> torch.Tensor | None:  # `[S, L]` rows of a token field, None if an item lacks it
        if any(getattr(it, name) is None for it in items):
            return None
        return torch.cat([pad(to_rows(getattr(it, name).detach().double())) for it, (to_rows, _) in zip(items, views)])

    rewards, prompt_index = _sample_scalars(samples)
    lacking = {name: next((_what(it, i) for i, it in enumerate(items) if getattr(it, name) is None), "")
               for name in ("values", "kl", "action_log_probs", "teacher_action_log_probs")}
    return AdvantageInputs(
        rewards=rewards, prompt_index=prompt_index, rows=torch.tensor([j for r in rows for j in r], dtype=torch.long),
        mask=torch.cat([pad(m) for m in masks]), values=per_token("values"), kl=per_token("kl"),
        lacking=lacking, log_probs=per_token("action_log_probs"),
        teacher_log_probs=per_token("teacher_action_log_probs"))


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
