"""Advantage estimators, whitening, batch-layout GAE, and DAPO's reward shaping / dynamic
sampling: tiny cases worked out by hand, and the batch GAE equal to the per-record one."""

import math

import pytest
import torch

from packing import Experience, make_experience_batch
from rl.algos.advantages import (
    AdvantageConfig,
    compute_advantages,
    gae_advantages,
    gae_advantages_batch,
    grpo_advantages,
    masked_moments,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten_advantages,
    whiten_with_moments,
)
from rl.tasks.reward import apply_overlong_penalty, filter_uniform_groups, overlong_penalty


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


# ----------------------------------------------------------------- group-based
def test_rloo_subtracts_the_mean_of_the_other_samples():
    recs = [record([False, True, True], r, prompt=0) for r in (1.0, 2.0, 6.0)] + \
           [record([False, False, True], r, prompt=7) for r in (0.0, 1.0)]
    rloo_advantages(recs)
    # group 0: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5; group 7: 1 and 0
    expected = [-3.0, -1.5, 4.5, -1.0, 1.0]
    for rec, a in zip(recs, expected):
        assert torch.allclose(response(rec), torch.full_like(response(rec), a))
        assert rec.advantages[~rec.action_mask].eq(0).all() and torch.equal(rec.returns, rec.advantages)
    with pytest.raises(ValueError, match=r"RLOO: prompt_index 3 has 1 sample; .* \(task.samples_per_prompt\)"):
        rloo_advantages([record([True], 1.0, prompt=3)])


def test_grpo_folds_a_kl_reward_penalty_into_the_reward():
    # rewards 1, 1; KL sums over the response 0 and 2 (the prompt slot's 9 is ignored); kl_coef 0.5
    recs = [record([False, True, True], 1.0, kl=[9.0, 0.0, 0.0]), record([False, True, True], 1.0, kl=[9.0, 0.5, 1.5])]
    grpo_advantages(recs, scale_by_std=False, kl_coef=0.5)  # shaped rewards 1 and 0: mean 0.5
    assert torch.allclose(response(recs[0]), torch.full((2,), 0.5))
    assert torch.allclose(response(recs[1]), torch.full((2,), -0.5))
    with pytest.raises(ValueError, match=r"record 0: kl_coef=0.5 .* needs 'kl'"):
        grpo_advantages([record([True], 1.0)], kl_coef=0.5)


# ---------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_kl_shaped_discounted_returns_then_global_whitening():
    a = record([False, True, True, True], 1.0, kl=[9.0, 0.2, 0.4, 0.0])
    b = record([False, True, True], 0.0, kl=[0.0, 0.2, 0.2])
    reinforce_pp_advantages([a, b], gamma=0.5, kl_coef=0.5)
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
    reinforce_pp_baseline_advantages([a, b], gamma=1.0)
    # group mean 0.5: rewards 0.5 and -0.5, undiscounted -> returns [0.5] * 3 and [-0.5] * 2
    assert a.returns[a.action_mask].tolist() == [0.5] * 3 and b.returns[b.action_mask].tolist() == [-0.5] * 2
    # whitened: mean 0.5 / 5 = 0.1; deviations 0.4 (x3), -0.6 (x2); variance (3*0.16 + 2*0.36) / 4 = 0.3
    std = math.sqrt(0.3 + 1e-8)
    assert torch.allclose(response(a), torch.full((3,), 0.4 / std), atol=1e-6)
    assert torch.allclose(response(b), torch.full((2,), -0.6 / std), atol=1e-6)


# ------------------------------------------------------------------------ GAE
def test_gae_hand_computed():
    rec = record([False, True, True], 1.0, values=[7.0, 0.5, 0.25])
    gae_advantages([rec], gamma=1.0, lam=1.0)  # A = R - V
    assert torch.allclose(response(rec), torch.tensor([0.5, 0.75]))
    gae_advantages([rec], gamma=0.5, lam=0.5)
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


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gae_on_a_batch_equals_gae_per_record(packed):
    opts = dict(gamma=0.9, lam=0.8, kl_coef=0.1)
    records = gae_records()
    gae_advantages(records, **opts)
    batch = make_experience_batch(gae_records(), packed=packed)
    assert gae_advantages_batch(batch, **opts) is batch
    for rec, part in zip(records, batch.split()):
        assert torch.allclose(part.advantages, rec.advantages, atol=1e-6, rtol=0)
        assert torch.allclose(part.returns, rec.returns, atol=1e-6, rtol=0)
    assert batch.advantages[~batch.action_mask].eq(0).all()  # prompt, padding and trailing pack slots
    assert records[3].advantages[3:5].eq(0).all() and records[3].advantages[1] != 0


def test_control_gae_batch_without_segmentation_differs():
    """The pack read as one sequence mixes neighbours: the equality above can fail."""
    batch = make_experience_batch(gae_records(), packed=True)
    right = gae_advantages_batch(batch, gamma=0.9, lam=0.8).advantages.clone()
    wrong = gae_advantages_batch(make_experience_batch(gae_records(), packed=True), gamma=0.9, lam=0.8)
    wrong.packed_seq_lens = None  # now the [1, N] row is one sequence with the last reward
    wrong.rewards = wrong.rewards[-1:]
    assert (gae_advantages_batch(wrong, gamma=0.9, lam=0.8).advantages - right).abs().max() > 1e-2


# ------------------------------------------------------------------- whitening
def test_whitening_is_the_same_over_records_padded_and_packed_batches():
    records = gae_records()
    gae_advantages(records, gamma=0.9, lam=0.8)
    ref = [r.advantages.clone() for r in records]
    whiten_advantages(records)
    tokens = torch.cat([r[m.action_mask] for r, m in zip(ref, records)])
    white = torch.cat([response(r) for r in records])
    assert torch.allclose(white, (tokens - tokens.mean()) / tokens.std(), atol=1e-5)
    for packed in (False, True):
        # two microbatches of one step: moments are summed before whitening
        parts = [make_experience_batch(gae_records()[:2], packed=packed),
                 make_experience_batch(gae_records()[2:], packed=packed)]
        for p in parts:
            gae_advantages_batch(p, gamma=0.9, lam=0.8)
        moments = sum(masked_moments(p.advantages, p.action_mask) for p in parts)
        got = torch.cat([whiten_with_moments(p.advantages, p.action_mask, moments)[p.action_mask] for p in parts])
        assert torch.allclose(got, white, atol=1e-6)


# -------------------------------------------------------------------- dispatch
def estimator_records():
    recs = gae_records()
    for i, r in enumerate(recs):
        r.prompt_index = torch.tensor(i % 2)  # groups of 3 and 2
    return recs


@pytest.mark.parametrize("estimator", ["grpo", "gae", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_compute_advantages_dispatches_and_whitens_by_default(estimator):
    opts = dict(gamma=0.9, lam=0.8, kl_coef=0.1, scale_by_std=True)  # every option; each estimator takes its own
    got = estimator_records()
    compute_advantages(got, estimator, whiten=False, **opts)
    direct = estimator_records()
    fn = {"grpo": lambda r: grpo_advantages(r, kl_coef=0.1),
          "gae": lambda r: gae_advantages(r, gamma=0.9, lam=0.8, kl_coef=0.1),
          "rloo": lambda r: rloo_advantages(r, kl_coef=0.1),
          "reinforce_pp": lambda r: reinforce_pp_advantages(r, gamma=0.9, kl_coef=0.1, whiten=False),
          "reinforce_pp_baseline": lambda r: reinforce_pp_baseline_advantages(r, gamma=0.9, kl_coef=0.1, whiten=False)}
    fn[estimator](direct)
    for g, d in zip(got, direct):
        assert torch.allclose(g.advantages, d.advantages) and torch.allclose(g.returns, d.returns)

    default = estimator_records()
    compute_advantages(default, estimator, **opts)
    tokens = torch.cat([response(r) for r in default])
    whitened = estimator not in ("grpo", "rloo")
    assert (abs(float(tokens.mean())) < 1e-6 and abs(float(tokens.std()) - 1) < 1e-4) == whitened


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match=r"advantage='ppo': not a registered advantage estimator; registered: "
                                         r"\['gae', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', 'rloo'\]"):
        compute_advantages(estimator_records(), "ppo")
    with pytest.raises(TypeError, match=r"unknown options \['gama'\]"):
        compute_advantages(estimator_records(), "gae", gama=0.9)
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


def test_a_registered_estimator_is_checked_by_the_config_and_dispatched(monkeypatch):
    from inprocess import compose

    from rl.algos.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    monkeypatch.setattr("rl.algos.advantages.ADVANTAGE_ESTIMATORS", dict(ADVANTAGE_ESTIMATORS))
    with pytest.raises(ValueError, match=r"algo.advantage='max_baseline': not a registered advantage estimator"):
        compose("algo.advantage=max_baseline")

    @register_advantage_estimator("max_baseline", needs_groups=True)
    def max_baseline(records, *, kl_coef=0.0):
        """r_i - max of its group."""
        groups = {}
        for i, r in enumerate(records):
            groups.setdefault(int(r.prompt_index), []).append(i)
        for members in groups.values():
            best = max(float(records[i].rewards) for i in members)
            for i in members:
                records[i].advantages = (records[i].rewards - best) * records[i].action_mask.float()
                records[i].returns = records[i].advantages.clone()

    assert compose("algo.advantage=max_baseline").algo.advantage == "max_baseline"
    with pytest.raises(ValueError, match="max_baseline with task.samples_per_prompt=1"):
        compose("algo.advantage=max_baseline", "task.samples_per_prompt=1")
    recs = estimator_records()
    compute_advantages(recs, "max_baseline")
    assert all(float(r.advantages.max()) <= 0 for r in recs) and any(float(r.advantages.min()) < 0 for r in recs)
