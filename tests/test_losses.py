"""Every loss mode gives the same loss and gradients in padded and packed layouts."""

import dataclasses
import itertools

import pytest
import torch

from packing import Experience, make_experience_batch
from rl.advantages import gae_advantages, grpo_advantages
from rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate,
    kl_penalty,
    per_sequence_mean,
    policy_loss,
    value_loss,
)

LENGTHS = [7, 3, 12, 2, 9]


def make_records(seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        prompt = 1 + i % 3
        mask = torch.arange(n - 1) >= prompt - 1
        rnd = lambda: torch.randn(n - 1, generator=gen)  # noqa: E731
        out.append(
            Experience(
                sequences=torch.randint(0, 50, (n,), generator=gen),
                action_mask=mask,
                action_log_probs=-rnd().abs(),
                rollout_log_probs=-rnd().abs(),
                base_action_log_probs=-rnd().abs(),
                advantages=rnd(),
                values=rnd(),
                returns=rnd(),
            )
        )
    return out


def both_layouts(records, new_log_probs):
    """Collate with the (differentiable) new log-probs riding in the `kl` slot."""
    carried = [dataclasses.replace(r, kl=lp) for r, lp in zip(records, new_log_probs)]
    return [make_experience_batch(carried, packed=p) for p in (False, True)]


def leaves(records, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(-torch.rand(r.sequences.numel() - 1, generator=gen)).requires_grad_() for r in records]


def loss_and_grads(fn, records):
    results = []
    for layout in (0, 1):
        lps = leaves(records)
        batch = both_layouts(records, lps)[layout]
        loss = fn(batch.kl, batch)
        grads = torch.autograd.grad(loss, lps, allow_unused=True)
        results.append((loss.detach(), [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, lps)]))
    return results


def assert_layout_invariant(fn, records):
    (loss_pad, g_pad), (loss_pack, g_pack) = loss_and_grads(fn, records)
    assert torch.isfinite(loss_pad)
    assert abs(loss_pad - loss_pack) <= 1e-6 * max(1.0, abs(loss_pad)), (loss_pad, loss_pack)
    for a, b in zip(g_pad, g_pack):
        assert (a - b).abs().max() <= 1e-6
    assert any(g.abs().sum() > 0 for g in g_pad)  # the loss actually depends on the log-probs


CASES = [
    PolicyLossConfig(name=name, tis_cap=tis, tis_level=level, dual_clip=dual)
    for name, (tis, level), dual in itertools.product(
        POLICY_LOSSES, [(None, "token"), (2.0, "token"), (2.0, "sequence")], [None, 3.0]
    )
    if not (name == "cispo" and dual)  # dual-clip bounds the clipped surrogate; CISPO has none
]


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.name}-tis{c.tis_cap}-{c.tis_level}-dual{c.dual_clip}")
def test_policy_loss_is_layout_invariant(cfg, mode):
    assert_layout_invariant(lambda lp, b: aggregate(policy_loss(lp, b, cfg)[0], b, mode), make_records())


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_kl_and_entropy_losses_are_layout_invariant(estimator, mode):
    def fn(lp, b):
        kl = kl_penalty(lp, b.base_action_log_probs, estimator) * b.action_mask
        entropy_like = -(lp.exp() * lp) * b.action_mask
        return aggregate(kl - 0.01 * entropy_like, b, mode)

    assert_layout_invariant(fn, make_records())


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_value_loss_is_layout_invariant(mode):
    assert_layout_invariant(lambda v, b: aggregate(value_loss(v, b, clip=0.2), b, mode), make_records())


def test_control_sequence_losses_segment_by_packed_seq_lens():
    """Treating the pack as one sequence gives a different seq-mean loss: the test above can fail."""
    records = make_records()
    _, pack = both_layouts(records, leaves(records))
    per_token = pack.advantages * pack.action_mask
    right = aggregate(per_token, pack, "seq-mean-token-mean")
    as_one = dataclasses.replace(pack, packed_seq_lens=[sum(LENGTHS)])
    wrong = aggregate(per_token, as_one, "seq-mean-token-mean")
    assert abs(right - wrong) > 1e-2


def test_token_mean_with_global_normalizer_sums_over_microbatches():
    records = make_records()
    full = make_experience_batch(records, packed=True)
    global_tokens = float(full.action_mask.sum())
    whole = aggregate(full.advantages, full, "token-mean")
    parts = sum(
        aggregate(b.advantages, b, "token-mean", normalizer=global_tokens)
        for b in (make_experience_batch(records[:2], packed=True), make_experience_batch(records[2:], packed=False))
    )
    assert torch.allclose(whole, parts, atol=1e-6)


def test_ppo_clip_and_dual_clip_values():
    rec = Experience(
        sequences=torch.zeros(4, dtype=torch.long),
        action_mask=torch.ones(3, dtype=torch.bool),
        action_log_probs=torch.zeros(3),
        advantages=torch.tensor([1.0, -1.0, -1.0]),
    )
    b = make_experience_batch([rec], packed=True)
    lp = torch.tensor([[2.0, 1.0, 3.0, 1.0]]).log()  # ratios 2, 1, 3 (+ trailing slot)
    loss, info = policy_loss(lp, b, PolicyLossConfig(clip_low=0.2, clip_high=0.2))
    assert torch.allclose(loss[0, :3], torch.tensor([-1.2, 1.0, 3.0]))
    loss, _ = policy_loss(lp, b, PolicyLossConfig(dual_clip=2.5))
    assert torch.allclose(loss[0, :3], torch.tensor([-1.2, 1.0, 2.5]))  # negative advantage bounded at c*|A|
    assert info["clip_ratio"][0, :3].tolist() == [1.0, 0.0, 0.0]


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), torch.tensor([1.0]))
    assert torch.allclose(kl_penalty(lp, ref, "k2"), torch.tensor([0.5]))
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.tensor([torch.e**-1 - 1 + 1]))
    with pytest.raises(ValueError, match="kl estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_grpo_advantages_are_group_normalized():
    records = make_records()
    for i, r in enumerate(records):
        r.rewards, r.prompt_index = torch.tensor(float(i)), torch.tensor(i % 2)
    grpo_advantages(records)
    group0 = torch.stack([records[i].advantages[records[i].action_mask][0] for i in (0, 2, 4)])
    assert torch.allclose(group0, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)
    assert all(r.advantages[~r.action_mask].eq(0).all() for r in records)


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    records = make_records()
    for r in records:
        r.rewards = torch.tensor(1.0)
    gae_advantages(records, gamma=1.0, lam=1.0)
    for r in records:
        m = r.action_mask
        assert torch.allclose(r.advantages[m], 1.0 - r.values[m], atol=1e-5)
        assert torch.allclose(r.returns[m], torch.ones(int(m.sum())), atol=1e-5)


def test_gspo_ratio_is_per_sequence():
    records = make_records()
    _, pack = both_layouts(records, leaves(records))
    lp = pack.action_log_probs + 0.1 * pack.action_mask
    _, info = policy_loss(lp, pack, PolicyLossConfig(name="gspo"))
    per_seq = per_sequence_mean(info["ratio"].log(), pack)
    assert torch.allclose(per_seq, torch.full_like(per_seq, 0.1), atol=1e-5)
