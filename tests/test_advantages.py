"""Advantage estimators, the one GAE, whitening, and DAPO's reward shaping / dynamic sampling:
tiny cases worked out by hand, and `compute_advantages` on padded and packed batches equal to
per-sequence reference loops written here (the module has one vectorized GAE, no loop)."""

import math

import pytest
import torch
import torch.distributed as dist

from packing import Experience, make_experience_batch
from rl.algos.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    masked_moments,
    reinforce_pp_baseline_advantages,
    whiten_advantages,
    whiten_with_moments,
)
from rl.tasks.reward import apply_overlong_penalty, filter_uniform_groups, overlong_penalty
from testing.distributed import run_distributed


def record(mask, reward=0.0, prompt=0, kl=None, values=None):
    """A record whose action_mask is `mask` (list of bools); sequences are dummies."""
    n = len(mask)
    return Experience(
        sequences=torch.zeros(n + 1, dtype=torch.long),
        action_mask=torch.tensor(mask),
        rewards=torch.tensor(float(reward)),
        prompt_index=torch.tensor(prompt),
        kl=None if kl is None else torch.tensor(kl, dtype=torch.float32),
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


def response(rec):
    return rec.advantages[rec.action_mask]


# ------------------------------------------------- per-sequence references
def ref_rewards(records):
    """Each record's reward, one Python float each."""
    return [float(r.rewards) for r in records]


def ref_group_advantages(records, kind, eps=1e-6):
    """grpo / rloo / the REINFORCE++ baseline's shaped reward, sample by sample."""
    rewards = ref_rewards(records)
    out = []
    for i, r in enumerate(records):
        group = [rewards[j] for j, o in enumerate(records) if int(o.prompt_index) == int(r.prompt_index)]
        mean = sum(group) / len(group)
        if kind == "grpo":
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
            out.append((rewards[i] - mean) / (std + eps))
        elif kind == "rloo":
            out.append(rewards[i] - (sum(group) - rewards[i]) / (len(group) - 1))
        else:
            out.append(rewards[i] - mean)
    return out


def ref_gae(rec, reward, gamma, lam, kl_coef=0.0, values=None):
    """(advantages, returns) `[T-1]` of one record: the reward on its last response slot,
    -kl_coef * kl on every response slot, GAE over the response slots in reverse."""
    values = rec.values.float() if values is None else values
    slots = rec.action_mask.nonzero().flatten().tolist()
    rewards = {t: -kl_coef * float(rec.kl[t]) if kl_coef else 0.0 for t in slots}
    if slots:
        rewards[slots[-1]] += reward
    adv = torch.zeros(rec.action_mask.shape)
    last_gae, next_value = 0.0, 0.0
    for t in reversed(slots):
        last_gae = rewards[t] + gamma * next_value - float(values[t]) + gamma * lam * last_gae
        adv[t] = last_gae
        next_value = float(values[t])
    return adv, (adv + values) * rec.action_mask


def ref_returns(rec, reward, gamma, kl_coef=0.0):
    """REINFORCE++'s discounted return G_t = r_t + gamma * G_next over the response slots."""
    return ref_gae(rec, reward, gamma, 1.0, kl_coef, values=torch.zeros(rec.action_mask.shape))[0]


def reference(name, records, gamma=0.9, lam=0.8, kl_coef=0.1):
    """(advantages, returns) per record of estimator `name`, unwhitened."""
    if name in ("grpo", "rloo"):  # sequence-level: no KL reward
        adv = [torch.full(r.action_mask.shape, a) * r.action_mask
               for a, r in zip(ref_group_advantages(records, name), records)]
        return adv, adv
    if name == "gae":
        out = [ref_gae(r, float(r.rewards), gamma, lam, kl_coef) for r in records]
        return [a for a, _ in out], [g for _, g in out]
    shaped = ref_group_advantages(records, "baseline") if name == "reinforce_pp_baseline" else ref_rewards(records)
    g = [ref_returns(r, s, gamma, kl_coef) for r, s in zip(records, shaped)]
    return g, g


def close(got, want, atol=1e-5):
    return all(torch.allclose(g.float(), w.float(), atol=atol, rtol=0) for g, w in zip(got, want))


# ----------------------------------------------------------------- group-based
def test_rloo_subtracts_the_mean_of_the_other_samples():
    recs = [record([False, True, True], r, prompt=0) for r in (1.0, 2.0, 6.0)] + \
           [record([False, False, True], r, prompt=7) for r in (0.0, 1.0)]
    compute_advantages(recs, "rloo")
    # group 0: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5; group 7: 1 and 0
    expected = [-3.0, -1.5, 4.5, -1.0, 1.0]
    for rec, a in zip(recs, expected):
        assert torch.allclose(response(rec), torch.full_like(response(rec), a))
        assert rec.advantages[~rec.action_mask].eq(0).all() and torch.equal(rec.returns, rec.advantages)
    with pytest.raises(ValueError, match=r"RLOO: prompt_index 3 has 1 sample; .* \(task.samples_per_prompt\)"):
        compute_advantages([record([True], 1.0, prompt=3)], "rloo")


def test_group_baselines_of_rewards_near_the_fp32_limit_stay_finite():
    """Rewards pass check_reward up to fp32's max (rl/tasks/calls.py), but a group's sum (its mean,
    RLOO's baseline) and squares (GRPO's std) of such rewards overflow fp32: NaN advantages, the step
    skipped, on values a reward can take from the model's text (-abs(float(answer) - target))."""
    rewards = (1e38, 1e38, 2e38, 3e38)
    r = torch.tensor(rewards)
    assert r.mean().isinf()  # the hazard: the group's mean of four in-range rewards, in fp32
    for name, want in (("grpo", [-0.78335, -0.78335, 0.26112, 1.30558]), ("rloo", [-1e38, -1e38, 0.33333e38,
                                                                              1.66667e38])):
        recs = [record([False, True], x, prompt=0) for x in rewards]
        compute_advantages(recs, name)
        got = [float(response(rec)[0]) for rec in recs]
        assert all(math.isfinite(g) for g in got), (name, got)
        assert got == pytest.approx(want, rel=1e-4), (name, got)


def test_every_estimator_is_float64_from_the_rewards_to_the_whitened_advantages():
    """The same rewards through the token-level estimators: the group mean (reinforce_pp_baseline)
    and the whitening moments (all three) are float64, so each gives the whitened deviations of the
    group, (-0.78335, -0.78335, 0.26112, 1.30558), cast to fp32 last. Control: the estimator fed fp32
    rewards (what a per-estimator upcast left to each estimator would miss) has no finite advantage."""
    rewards, want = (1e38, 1e38, 2e38, 3e38), [-0.78335, -0.78335, 0.26112, 1.30558]
    for name in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        recs = [record([False, True], x, prompt=0, values=[0.0, 0.0]) for x in rewards]
        compute_advantages(recs, name, gamma=1.0, lam=1.0)
        got = [float(response(rec)[0]) for rec in recs]
        assert got == pytest.approx(want, rel=1e-4), (name, got)
        assert all(rec.advantages.dtype == rec.returns.dtype == torch.float32 for rec in recs)
    inputs = AdvantageInputs(rewards=torch.tensor(rewards), prompt_index=torch.zeros(4, dtype=torch.long),
                             rows=torch.arange(4), mask=torch.ones(4, 1, dtype=torch.bool), values=None, kl=None,
                             lacking={})
    fp32, _ = reinforce_pp_baseline_advantages(inputs)
    assert not fp32.isfinite().any()

def test_sequence_level_estimators_refuse_a_kl_reward_they_would_ignore():
    """grpo and rloo read no per-token KL (their group baselines would need every sample's KL on
    every rank): a non-zero kl_coef is an error, not a silent no-op; kl_coef=0 is fine."""
    for name in ("grpo", "rloo"):
        with pytest.raises(ValueError, match=rf"advantage={name} reads no per-token KL: kl_coef=0.5 would be ignored "
                                             r"\(the KL reward is read by gae, reinforce_pp, reinforce_pp_baseline\)"):
            compute_advantages(estimator_records(), name, kl_coef=0.5)
        compute_advantages(estimator_records(), name, kl_coef=0.0)


# ---------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_kl_shaped_discounted_returns_then_global_whitening():
    a = record([False, True, True, True], 1.0, kl=[9.0, 0.2, 0.4, 0.0])
    b = record([False, True, True], 0.0, kl=[0.0, 0.2, 0.2])
    compute_advantages([a, b], "reinforce_pp", gamma=0.5, kl_coef=0.5)
    # a: token rewards -0.1, -0.2, -0 + 1 -> G = [-0.1 + 0.5 * 0.3, -0.2 + 0.5 * 1, 1] = [0.05, 0.3, 1]
    # b: token rewards -0.1, -0.1 + 0 -> G = [-0.1 + 0.5 * -0.1, -0.1] = [-0.15, -0.1]
    assert torch.allclose(a.returns[a.action_mask], torch.tensor([0.05, 0.3, 1.0]), atol=1e-6)
    assert torch.allclose(b.returns[b.action_mask], torch.tensor([-0.15, -0.1]), atol=1e-6)
    # whitened over all 5 tokens: mean 1.1 / 5 = 0.22; unbiased variance
    # (0.17^2 + 0.08^2 + 0.78^2 + 0.37^2 + 0.32^2) / 4 = 0.883 / 4 = 0.22075
    std = math.sqrt(0.22075 + 1e-8)
    assert torch.allclose(response(a), torch.tensor([-0.17, 0.08, 0.78]) / std, atol=1e-5)
    assert torch.allclose(response(b), torch.tensor([-0.37, -0.32]) / std, atol=1e-5)
    assert a.advantages[0] == 0 and a.returns[0] == 0


def test_reinforce_pp_baseline_subtracts_the_group_mean_reward_first():
    a = record([False, True, True, True], 1.0, prompt=4)
    b = record([False, True, True], 0.0, prompt=4)
    compute_advantages([a, b], "reinforce_pp_baseline", gamma=1.0)
    # group mean 0.5: rewards 0.5 and -0.5, undiscounted -> returns [0.5] * 3 and [-0.5] * 2
    assert a.returns[a.action_mask].tolist() == [0.5] * 3 and b.returns[b.action_mask].tolist() == [-0.5] * 2
    # whitened: mean 0.5 / 5 = 0.1; deviations 0.4 (x3), -0.6 (x2); variance (3*0.16 + 2*0.36) / 4 = 0.3
    std = math.sqrt(0.3 + 1e-8)
    assert torch.allclose(response(a), torch.full((3,), 0.4 / std), atol=1e-6)
    assert torch.allclose(response(b), torch.full((2,), -0.6 / std), atol=1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_reinforce_pp_reads_the_kl_reward_per_token_on_a_batch(packed):
    """The trainer's call: a batch after scoring (its `kl`), the step's rewards from the
    samples. Returns = the per-sequence reference with -kl_coef * kl_t on every response
    slot; the same reference without the KL (the control) is far off. lam is GAE's only."""
    records = gae_records()
    batch = make_experience_batch(gae_records(), packed=packed)
    compute_advantages([batch], "reinforce_pp", samples=records, rows=[list(range(len(records)))], whiten=False,
                       gamma=0.9, lam=0.5, kl_coef=0.1)
    parts = batch.split()
    want = [ref_returns(r, float(r.rewards), 0.9, kl_coef=0.1) for r in records]
    assert close([p.returns for p in parts], want) and close([p.advantages for p in parts], want)
    without_kl = [ref_returns(r, float(r.rewards), 0.9) for r in records]
    assert max(float((p.returns - w).abs().max()) for p, w in zip(parts, without_kl)) > 1e-2
    # whitened (the default): the reference returns whitened over every response token of the step
    compute_advantages([batch], "reinforce_pp", samples=records, rows=[list(range(len(records)))], gamma=0.9,
                       kl_coef=0.1)
    tokens = torch.cat([w[r.action_mask] for w, r in zip(want, records)])
    white = torch.cat([p.advantages[p.action_mask] for p in batch.split()])
    assert torch.allclose(white, (tokens - tokens.mean()) / tokens.std(), atol=1e-5)


def test_reinforce_pp_needs_the_kl_it_is_told_to_read():
    batch = make_experience_batch([record([False, True], 1.0), record([True, True], 0.0)], packed=True)
    with pytest.raises(ValueError, match=r"batch 0: kl_coef=0.1 \(a KL reward penalty\) needs 'kl'"):
        compute_advantages([batch], "reinforce_pp", kl_coef=0.1)


def test_reinforce_pp_reads_the_kl_as_a_reward_and_never_as_a_loss(monkeypatch):
    """algo.advantage=reinforce_pp with algo.kl_coef > 0: the KL is its reward penalty, so
    kl_mode=loss is refused at start-up, and a step adds no KL loss term while every
    sequence's returns are the per-sequence reference with its KL (and not without it)."""
    import rl.trainer.trainer as trainer_module
    from testing.inprocess import SMALL, compose, trainer

    with pytest.raises(ValueError, match=r"algo.advantage=reinforce_pp with algo.kl_coef=0.05 and algo.kl_mode=loss: "
                                         r"reinforce_pp puts the KL in the reward"):
        compose("algo.advantage=reinforce_pp", "algo.kl_coef=0.05")  # kl_mode: loss by default
    tr = trainer(*SMALL, "algo.advantage=reinforce_pp", "algo.kl_coef=0.05", "algo.kl_mode=reward", "algo.gamma=0.9")
    calls = []
    original = trainer_module.compute_advantages

    def spy(items, *args, **kwargs):
        original(items, *args, **kwargs)
        calls.append((items, kwargs))

    monkeypatch.setattr(trainer_module, "compute_advantages", spy)
    metrics = [tr.step(s) for s in range(2)]  # step 0: policy == reference, KL 0; step 1: KL > 0
    assert all("kl_loss" not in m and "kl" in m for m in metrics) and metrics[1]["kl"] > 0
    items, kwargs = calls[-1]
    assert kwargs["kl_coef"] == 0.05 and len(calls) == 2  # once per step
    parts = [p for b in items for p in b.split()]
    want = [ref_returns(p, float(p.rewards), 0.9, kl_coef=0.05) for p in parts]
    control = [ref_returns(p, float(p.rewards), 0.9) for p in parts]
    assert close([p.returns for p in parts], want)
    assert max(float((p.returns - c).abs().max()) for p, c in zip(parts, control)) > 1e-6


# ------------------------------------------------------------------------ GAE
def test_gae_hand_computed():
    rec = record([False, True, True], 1.0, values=[7.0, 0.5, 0.25])
    compute_advantages([rec], "gae", whiten=False, gamma=1.0, lam=1.0)  # A = R - V
    assert torch.allclose(response(rec), torch.tensor([0.5, 0.75]))
    compute_advantages([rec], "gae", whiten=False, gamma=0.5, lam=0.5)
    # delta_2 = 1 - 0.25 = 0.75 = A_2; delta_1 = 0 + 0.5 * 0.25 - 0.5 = -0.375; A_1 = -0.375 + 0.25 * 0.75
    assert torch.allclose(response(rec), torch.tensor([-0.1875, 0.75]))
    assert torch.allclose(rec.returns[rec.action_mask], torch.tensor([-0.1875 + 0.5, 0.75 + 0.25]))


def gae_records(seed=0):
    gen = torch.Generator().manual_seed(seed)
    masks = [
        [False, False, True, True, True, True],
        [False, True],
        [False] * 3 + [True] * 8,
        [False, True, True, False, False, True, True, True],  # a masked gap (multi-turn): carried over
        [True] * 4,
    ]
    out = []
    for i, m in enumerate(masks):
        n = len(m)
        out.append(record(m, float(torch.randn(1, generator=gen)), prompt=i // 2,
                          kl=torch.rand(n, generator=gen).tolist(), values=torch.randn(n, generator=gen).tolist()))
    return out


@pytest.mark.parametrize("layout", ["padded", "packed", "records"])
def test_gae_on_a_batch_equals_the_per_sequence_reference(layout):
    opts = dict(gamma=0.9, lam=0.8, kl_coef=0.1)
    records = gae_records()
    want = [ref_gae(r, float(r.rewards), **opts) for r in records]
    if layout == "records":
        items = parts = gae_records()
    else:
        items = [make_experience_batch(gae_records(), packed=layout == "packed")]
    compute_advantages(items, "gae", whiten=False, **opts)
    if layout != "records":
        batch = items[0]
        assert batch.advantages.shape == batch.returns.shape == batch.action_mask.shape  # set in place, its layout
        assert batch.advantages[~batch.action_mask].eq(0).all()  # prompt, padding and trailing pack slots
        parts = batch.split()
    assert close([p.advantages for p in parts], [a for a, _ in want], atol=1e-6)
    assert close([p.returns for p in parts], [g for _, g in want], atol=1e-6)
    assert parts[3].advantages[3:5].eq(0).all() and parts[3].advantages[1] != 0


def test_control_gae_batch_without_segmentation_differs():
    """The pack read as one sequence mixes neighbours: the equality above can fail."""
    batch = make_experience_batch(gae_records(), packed=True)
    compute_advantages([batch], "gae", whiten=False, gamma=0.9, lam=0.8)
    wrong = make_experience_batch(gae_records(), packed=True)
    wrong.packed_seq_lens = None  # now the [1, N] row is one sequence with the last reward
    wrong.rewards = wrong.rewards[-1:]
    compute_advantages([wrong], "gae", whiten=False, gamma=0.9, lam=0.8)
    assert (wrong.advantages - batch.advantages).abs().max() > 1e-2


# ------------------------------------------------------------------- whitening
def test_whitening_is_the_same_over_records_padded_and_packed_batches():
    records = gae_records()
    compute_advantages(records, "gae", whiten=False, gamma=0.9, lam=0.8)
    ref = [r.advantages.clone() for r in records]
    whiten_advantages(records)
    tokens = torch.cat([r[m.action_mask] for r, m in zip(ref, records)])
    white = torch.cat([response(r) for r in records])
    assert torch.allclose(white, (tokens - tokens.mean()) / tokens.std(), atol=1e-5)
    for packed in (False, True):
        # two microbatches of one step: moments are summed before whitening
        parts = [make_experience_batch(gae_records()[:2], packed=packed),
                 make_experience_batch(gae_records()[2:], packed=packed)]
        compute_advantages(parts, "gae", whiten=False, gamma=0.9, lam=0.8)
        moments = sum(masked_moments(p.advantages, p.action_mask) for p in parts)
        got = torch.cat([whiten_with_moments(p.advantages, p.action_mask, moments)[p.action_mask] for p in parts])
        assert torch.allclose(got, white, atol=1e-6)
        # the same in one call (gae whitens by default); a zero-weight repeat is whitened, not counted
        parts.append(make_experience_batch(gae_records()[:1], packed=packed))
        compute_advantages(parts, "gae", weights=[1.0, 1.0, 0.0], gamma=0.9, lam=0.8)
        got = torch.cat([p.advantages[p.action_mask] for p in parts[:2]])
        assert torch.allclose(got, white, atol=1e-6)
        assert torch.allclose(parts[2].advantages[parts[2].action_mask], response(records[0]), atol=1e-6)


# ------------------------------------------------ batches holding part of the step
def estimator_records():
    recs = gae_records()
    for i, r in enumerate(recs):
        r.prompt_index = torch.tensor(i % 2)  # groups of 3 and 2
    return recs


ESTIMATORS = ["grpo", "gae", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
# the trainer's view of one step: microbatches holding parts of groups, in another order,
# and a zero-weight repeat of sample 0 (a rank short of samples)
ROWS, WEIGHTS = [[3, 0], [4, 2, 1], [0]], [1.0, 1.0, 0.0]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_batches_holding_part_of_the_step_get_the_whole_steps_advantages(estimator, packed):
    opts = dict(gamma=0.9, lam=0.8, scale_by_std=True, whiten=True)  # whitened: moments over the whole step
    kl_coef = 0.0 if estimator in ("grpo", "rloo") else 0.1  # the trainer reads a KL reward per token only
    whole = estimator_records()
    compute_advantages(whole, estimator, kl_coef=kl_coef, **opts)
    records = estimator_records()
    batches = [make_experience_batch([estimator_records()[j] for j in r], packed=packed) for r in ROWS]
    compute_advantages(batches, estimator, samples=records, rows=ROWS, weights=WEIGHTS, kl_coef=kl_coef, **opts)
    for b, rows in zip(batches, ROWS):
        for part, j in zip(b.split(), rows):
            assert torch.allclose(part.advantages, whole[j].advantages, atol=1e-5, rtol=0), (rows, j)
            assert torch.allclose(part.returns, whole[j].returns, atol=1e-5, rtol=0), (rows, j)
    # controls: rows naming other samples; for a group baseline, each batch as if it were the step
    wrong = [make_experience_batch([estimator_records()[j] for j in r], packed=packed) for r in ROWS]
    compute_advantages(wrong, estimator, samples=records, rows=[r[::-1] for r in ROWS[:2]] + [[1]], weights=WEIGHTS,
                       kl_coef=kl_coef, **opts)
    assert not all(torch.allclose(w.advantages, b.advantages, atol=1e-3) for w, b in zip(wrong, batches))
    if estimator in ("grpo", "reinforce_pp_baseline"):
        alone = [make_experience_batch([estimator_records()[j] for j in r], packed=packed) for r in ROWS[:2]]
        for a in alone:
            compute_advantages([a], estimator, kl_coef=kl_coef, **opts)
        assert not all(torch.allclose(a.advantages, b.advantages, atol=1e-3) for a, b in zip(alone, batches))


def whitening_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank r holds the batches of ROWS[r::2]; the moments are all-reduced over the world."""
    records = estimator_records()
    rows, weights = ROWS[rank::world_size], WEIGHTS[rank::world_size]
    batches = [make_experience_batch([estimator_records()[j] for j in r], packed=True) for r in rows]
    compute_advantages(batches, "reinforce_pp", samples=records, rows=rows, weights=weights, group=dist.group.WORLD,
                       gamma=0.9, kl_coef=0.1)
    return [p.advantages for b in batches for p in b.split()]


@pytest.mark.slow
def test_whitening_over_dp_ranks_equals_one_process():
    whole = estimator_records()
    compute_advantages(whole, "reinforce_pp", gamma=0.9, kl_coef=0.1)
    results = run_distributed(whitening_rank, 2)
    for rank, got in enumerate(results):
        want = [whole[j].advantages for r in ROWS[rank::2] for j in r]
        assert close(got, want, atol=1e-6)
    alone = estimator_records()[3:5]  # control: rank 0's samples whitened alone
    compute_advantages(alone, "reinforce_pp", gamma=0.9, kl_coef=0.1)
    assert not close([alone[0].advantages], [whole[3].advantages], atol=1e-3)


# -------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_dispatch_by_name_gives_that_estimators_numbers_and_no_others(estimator):
    """Each name gives its own per-sequence reference, and not any other estimator's (the
    control: a dispatcher that ran one estimator for every name fails here). Whitening
    is on by default exactly for gae and the REINFORCE++ pair."""
    # every option (each estimator takes its own); the KL reward only where the estimator reads it
    opts = dict(gamma=0.9, lam=0.8, kl_coef=0.1 if estimator not in ("grpo", "rloo") else 0.0, scale_by_std=True)
    got = estimator_records()
    compute_advantages(got, estimator, whiten=False, **opts)
    adv, ret = reference(estimator, estimator_records())
    assert close([g.advantages for g in got], adv) and close([g.returns for g in got], ret)
    for other in ESTIMATORS:
        if other != estimator:
            assert not close([g.advantages for g in got], reference(other, estimator_records())[0], atol=1e-3), other

    default = estimator_records()
    compute_advantages(default, estimator, **opts)
    tokens = torch.cat([response(r) for r in default])
    whitened = estimator not in ("grpo", "rloo")
    assert (abs(float(tokens.mean())) < 1e-6 and abs(float(tokens.std()) - 1) < 1e-4) == whitened


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match=r"advantage='ppo': not a registered advantage estimator; registered: "
                                         r"\['distill', 'gae', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo'\]"):
        compute_advantages(estimator_records(), "ppo")
    with pytest.raises(TypeError, match=r"unknown options \['gama'\]"):
        compute_advantages(estimator_records(), "gae", gama=0.9)
    batch = make_experience_batch(estimator_records()[:2], packed=True)
    with pytest.raises(ValueError, match=r"items hold \[2\] sequences, rows \[3\]"):
        compute_advantages([batch], "grpo", samples=estimator_records(), rows=[[0, 1, 2]])
    batch.values = None
    with pytest.raises(ValueError, match=r"advantage=gae needs the critic's 'values': batch 0 has none"):
        compute_advantages([batch], "gae")
    assert AdvantageConfig().advantage == "grpo" and AdvantageConfig().whiten_advantages is None


# ----------------------------------------------------- DAPO: shaping and sampling
def test_overlong_penalty_is_linear_in_the_last_buffer_tokens():
    # max_len 20, buffer 4: free up to 16 tokens, then -1/4 per token, -1 from 20 on
    assert [overlong_penalty(n, 20, 4) for n in (10, 16, 17, 18, 20, 25)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(17, 20, 4, penalty_factor=0.5) == -0.125
    got = overlong_penalty(torch.tensor([16, 19, 30]), 20, 4)
    assert got.dtype == torch.float32 and got.tolist() == [0.0, -0.75, -1.0]
    with pytest.raises(ValueError, match=r"need 0 < buffer_len=0 <= max_len=20"):
        overlong_penalty(3, 20, 0)
    recs = [record([True], 1.0), record([True], 0.5)]
    recs[0].response_length, recs[1].response_length = torch.tensor(18), torch.tensor(3)
    apply_overlong_penalty(recs, max_len=20, buffer_len=4)
    assert [float(r.rewards) for r in recs] == [0.5, 0.5] and recs[0].rewards.dtype == torch.float32


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    rewards = {0: [1.0, 1.0, 1.0], 1: [0.0, 1.0, 0.0], 2: [0.0, 0.0], 3: [1.0]}
    recs = [record([True], r, prompt=p) for p, rs in rewards.items() for r in rs]
    recs = recs[::2] + recs[1::2]  # groups interleaved: the kept order is the input order
    kept, dropped = filter_uniform_groups(recs)
    assert dropped == [0, 2]  # group 3 has one sample: nothing to compare, kept
    assert kept == [r for r in recs if int(r.prompt_index) in (1, 3)]
    assert sorted(int(r.prompt_index) for r in kept) == [1, 1, 1, 3]
    recs[2].rewards = None
    with pytest.raises(ValueError, match=r"record 2: dynamic sampling needs 'rewards' and 'prompt_index'"):
        filter_uniform_groups(recs)


def test_a_registered_estimator_is_checked_by_the_config_and_dispatched(monkeypatch):
    from testing.inprocess import compose

    from rl.algos.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    monkeypatch.setattr("rl.algos.advantages.ADVANTAGE_ESTIMATORS", ADVANTAGE_ESTIMATORS.copy())
    with pytest.raises(ValueError, match=r"algo.advantage='max_baseline': not a registered advantage estimator"):
        compose("algo.advantage=max_baseline")

    @register_advantage_estimator("max_baseline", needs_groups=True)
    def max_baseline(x):
        """r_i - max of its group, on every response token."""
        same = x.prompt_index.unsqueeze(0) == x.prompt_index.unsqueeze(1)
        scalars = x.rewards - torch.where(same, x.rewards.unsqueeze(0), -torch.inf).max(1).values
        advantages = x.per_row(scalars).unsqueeze(1) * x.mask
        return advantages, advantages

    assert compose("algo.advantage=max_baseline").algo.advantage == "max_baseline"
    with pytest.raises(ValueError, match="max_baseline with task.samples_per_prompt=1"):
        compose("algo.advantage=max_baseline", "task.samples_per_prompt=1")
    recs = estimator_records()
    compute_advantages(recs, "max_baseline")
    assert all(float(r.advantages.max()) <= 0 for r in recs) and any(float(r.advantages.min()) < 0 for r in recs)
