"""Every loss mode gives the same loss and gradients in padded and packed layouts, and each
option gives the numbers worked out by hand on a tiny case."""

import dataclasses
import itertools
import math

import pytest
import torch

from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from packing import Experience, make_experience_batch
from rl.algos.advantages import compute_advantages
from rl.algos.losses import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    KLEstimator,
    LossAgg,
    PolicyLossConfig,
    TISLevel,
    aggregate,
    build_kl_controller,
    check_policy_loss_config,
    kl_penalty,
    loss_normalizer,
    per_sequence_mean,
    policy_loss,
    tis_weight,
    value_loss,
)
from rl.algos.schedule import LRSchedule, lr_lambda, make_lr_scheduler

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


NORM = 16.0  # seq-mean-token-sum-norm's constant (a response budget) in these tests


def agg(loss, b, mode, normalizer=None):
    return aggregate(loss, b, mode, normalizer, token_sum_norm=NORM)


CASES = [
    PolicyLossConfig(policy_loss=kind, tis_cap=tis, tis_level=level, dual_clip=dual)
    for kind, (tis, level), dual in itertools.product(
        ("ppo", "gspo", "cispo"), [(None, TISLevel.TOKEN), (2.0, TISLevel.TOKEN), (2.0, TISLevel.SEQUENCE)],
        [None, 3.0]
    )
    if not (kind == "cispo" and dual)  # dual-clip bounds the clipped surrogate; CISPO has none
] + [
    PolicyLossConfig(policy_loss="cispo", cispo_clip_low=0.1),
    PolicyLossConfig(policy_loss="cispo", cispo_clip_low=0.1, tis_cap=2.0, tis_level="sequence"),
    # guards small enough to bind on these records
    PolicyLossConfig(policy_loss="ppo", log_ratio_clamp=0.3, clip_high=10.0),
    PolicyLossConfig(policy_loss="cispo", log_ratio_clamp=0.3, tis_cap=3.0, tis_level="sequence"),
    PolicyLossConfig(policy_loss="gspo", gspo_log_ratio_max=0.05, clip_high=10.0),
]


def case_id(c):
    return (f"{c.policy_loss}-tis{c.tis_cap}-{c.tis_level}-dual{c.dual_clip}-low{c.cispo_clip_low}"
            f"-clamp{c.log_ratio_clamp}-gspomax{c.gspo_log_ratio_max}")


@pytest.mark.parametrize("mode", LossAgg)
@pytest.mark.parametrize("cfg", CASES, ids=case_id)
def test_policy_loss_is_layout_invariant(cfg, mode):
    assert_layout_invariant(lambda lp, b: agg(policy_loss(lp, b, cfg)[0], b, mode), make_records())


@pytest.mark.parametrize("clamp", [10.0, 0.3], ids=["default-clamp", "binding-clamp"])
@pytest.mark.parametrize("estimator", KLEstimator)
@pytest.mark.parametrize("mode", LossAgg)
def test_kl_and_entropy_losses_are_layout_invariant(estimator, mode, clamp):
    def fn(lp, b):
        kl = kl_penalty(lp, b.base_action_log_probs, estimator, clamp=clamp, log_ratio_clamp=0.5) * b.action_mask
        entropy_like = -(lp.exp() * lp) * b.action_mask
        return agg(kl - 0.01 * entropy_like, b, mode)

    assert_layout_invariant(fn, make_records())


@pytest.mark.parametrize("mode", LossAgg)
def test_value_loss_is_layout_invariant(mode):
    assert_layout_invariant(lambda v, b: agg(value_loss(v, b, clip=0.2), b, mode), make_records())


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
    with pytest.raises(ValueError, match=r"kl_estimator='k4': expected one of k1, k2, k3$"):
        kl_penalty(lp, ref, "k4")


def test_grpo_advantages_are_group_normalized():
    records = make_records()
    for i, r in enumerate(records):
        r.rewards, r.prompt_index = torch.tensor(float(i)), torch.tensor(i % 2)
    compute_advantages(records, "grpo")
    group0 = torch.stack([records[i].advantages[records[i].action_mask][0] for i in (0, 2, 4)])
    assert torch.allclose(group0, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)
    assert all(r.advantages[~r.action_mask].eq(0).all() for r in records)


def test_gae_with_gamma_lambda_one_is_reward_minus_value():
    records = make_records()
    for r in records:
        r.rewards = torch.tensor(1.0)
    compute_advantages(records, "gae", whiten=False, gamma=1.0, lam=1.0)
    for r in records:
        m = r.action_mask
        assert torch.allclose(r.advantages[m], 1.0 - r.values[m], atol=1e-5)
        assert torch.allclose(r.returns[m], torch.ones(int(m.sum())), atol=1e-5)


def test_gspo_ratio_is_per_sequence():
    records = make_records()
    _, pack = both_layouts(records, leaves(records))
    lp = pack.action_log_probs + 0.1 * pack.action_mask
    _, info = policy_loss(lp, pack, PolicyLossConfig(policy_loss="gspo"))
    per_seq = per_sequence_mean(info["ratio"].log(), pack)
    assert torch.allclose(per_seq, torch.full_like(per_seq, 0.1), atol=1e-5)


# ------------------------------------------------------------ config types
def test_choices_accept_the_enum_or_its_string_and_name_the_key_on_a_typo():
    assert LossAgg("seq-mean-token-sum-norm") is LossAgg.SEQ_MEAN_TOKEN_SUM_NORM and LossAgg.TOKEN_MEAN == "token-mean"
    records = make_records()
    b = make_experience_batch(records, packed=True)
    lp = b.action_log_probs
    with pytest.raises(ValueError, match=r"policy_loss='nope': not a registered policy loss; registered: "
                                         r"\['cispo', 'gspo', 'ppo'\]"):
        policy_loss(lp, b, PolicyLossConfig(policy_loss="nope"))
    with pytest.raises(ValueError, match=r"tis_level='seq': expected one of token, sequence$"):
        policy_loss(lp, b, PolicyLossConfig(tis_cap=2.0, tis_level="seq"))
    with pytest.raises(ValueError, match=r"loss_agg='mean': expected one of token-mean, seq-mean-token-mean, "
                                         r"seq-mean-token-sum, seq-mean-token-sum-norm$"):
        aggregate(lp, b, "mean")
    with pytest.raises(ValueError, match=r"'k4' is not a KLEstimator; expected one of k1, k2, k3$"):
        KLEstimator("k4")


def test_policy_loss_config_is_a_flat_structured_config_with_enum_fields():
    @dataclasses.dataclass
    class Algo(PolicyLossConfig, KLConfig):  # how an AlgoConfig inherits the fields: keys stay flat
        name: str = "grpo"

    yaml = OmegaConf.create({"policy_loss": "cispo", "loss_agg": "seq-mean-token-sum-norm", "tis_level": "sequence",
                             "cispo_clip_low": 0.1, "kl_estimator": "k2", "kl_mode": "reward"})
    cfg = OmegaConf.merge(OmegaConf.structured(Algo), yaml)
    assert cfg.policy_loss == "cispo" and cfg.loss_agg is LossAgg.SEQ_MEAN_TOKEN_SUM_NORM
    assert cfg.tis_level is TISLevel.SEQUENCE and cfg.kl_estimator is KLEstimator.K2 and cfg.cispo_clip_low == 0.1
    check_policy_loss_config(cfg, prefix="algo.")
    b = make_experience_batch(make_records(), packed=True)
    loss, _ = policy_loss(b.action_log_probs, b, OmegaConf.to_object(cfg))
    assert torch.isfinite(loss).all()
    with pytest.raises(ValidationError, match="loss_agg"):
        OmegaConf.merge(OmegaConf.structured(Algo), {"loss_agg": "nope"})
    with pytest.raises(ValueError, match="algo.policy_loss='nope': not a registered policy loss"):  # the registry's
        check_policy_loss_config(OmegaConf.merge(cfg, {"policy_loss": "nope"}), prefix="algo.")
    with pytest.raises(ValueError, match=r"algo.clip_low=1.5: expected in \[0, 1\)"):
        check_policy_loss_config(OmegaConf.merge(cfg, {"clip_low": 1.5}), prefix="algo.")
    with pytest.raises(ValueError, match="algo.dual_clip=0.5: expected > 1 or null"):
        check_policy_loss_config(OmegaConf.merge(cfg, {"dual_clip": 0.5}), prefix="algo.")
    with pytest.raises(ValueError, match="algo.cispo_clip_low=1.5: expected in"):
        check_policy_loss_config(OmegaConf.merge(cfg, {"cispo_clip_low": 1.5}), prefix="algo.")


# ---------------------------------------------------------- hand-computed cases
def one_sequence_batch(log_probs_old, advantages, packed=True):
    n = len(log_probs_old)
    rec = Experience(
        sequences=torch.zeros(n + 1, dtype=torch.long),
        action_mask=torch.ones(n, dtype=torch.bool),
        action_log_probs=torch.tensor(log_probs_old, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
    )
    return make_experience_batch([rec], packed=packed)


def test_sequence_tis_weight_is_the_product_of_token_ratios():
    """3 tokens with pi_old/pi_rollout = e^0.5 each: the sequence weight is e^1.5 (not the
    geometric mean e^0.5), truncated at the cap; a second sequence keeps its own weight."""
    a = Experience(sequences=torch.zeros(4, dtype=torch.long), action_mask=torch.ones(3, dtype=torch.bool),
                   action_log_probs=torch.full((3,), -1.0), rollout_log_probs=torch.full((3,), -1.5))
    b = Experience(sequences=torch.zeros(3, dtype=torch.long), action_mask=torch.ones(2, dtype=torch.bool),
                   action_log_probs=torch.full((2,), -1.0), rollout_log_probs=torch.full((2,), -0.75))
    for packed in (False, True):
        batch = make_experience_batch([a, b], packed=packed)
        m = batch.action_mask
        seq10 = tis_weight(batch, PolicyLossConfig(tis_cap=10.0, tis_level="sequence"))[m]
        expected = torch.tensor([math.exp(1.5)] * 3 + [math.exp(-0.5)] * 2)  # 3 * 0.5 and 2 * -0.25
        assert torch.allclose(seq10, expected, rtol=1e-6)
        seq4 = tis_weight(batch, PolicyLossConfig(tis_cap=4.0, tis_level="sequence"))[m]
        assert torch.allclose(seq4, torch.tensor([4.0] * 3 + [math.exp(-0.5)] * 2), rtol=1e-6)
        tok = tis_weight(batch, PolicyLossConfig(tis_cap=10.0, tis_level="token"))[m]
        assert torch.allclose(tok, torch.tensor([math.exp(0.5)] * 3 + [math.exp(-0.25)] * 2), rtol=1e-6)


def test_ppo_log_ratio_is_clamped_before_exp():
    b = one_sequence_batch([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    lp = torch.tensor([[100.0, -100.0, 1.0, 0.0]], requires_grad=True)  # log-ratios 100, -100, 1 (+ trailing slot)
    wide = dict(clip_low=0.999, clip_high=1e30)  # so the clip itself never binds
    loss, info = policy_loss(lp, b, PolicyLossConfig(**wide))
    assert torch.allclose(info["ratio"][0, :3], torch.tensor([math.exp(20), math.exp(-20), math.e]), rtol=1e-5)
    assert torch.isfinite(loss).all()
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and torch.isclose(grad[0, 2], torch.tensor(-math.e))  # -A * r
    _, unclamped = policy_loss(lp, b, PolicyLossConfig(**wide, log_ratio_clamp=None))
    assert torch.isinf(unclamped["ratio"][0, 0])  # exp(100) overflows fp32


def test_gspo_sequence_log_ratio_is_clamped_at_10():
    b = one_sequence_batch([0.0, 0.0], [1.0, 1.0])
    lp = torch.tensor([[11.0, 13.0, 0.0]])  # sequence log-ratio (11 + 13) / 2 = 12
    _, info = policy_loss(lp, b, PolicyLossConfig(policy_loss="gspo", clip_high=1e30))
    assert torch.allclose(info["ratio"][0, :2], torch.full((2,), math.exp(10)), rtol=1e-5)
    _, info = policy_loss(lp, b, PolicyLossConfig(policy_loss="gspo", clip_high=1e30, gspo_log_ratio_max=None))
    assert torch.allclose(info["ratio"][0, :2], torch.full((2,), math.exp(12)), rtol=1e-5)


def test_cispo_weight_has_an_optional_lower_bound():
    ratios = [0.5, 1.0, 2.0, 0.85]
    adv = [1.0, 1.0, 1.0, -2.0]
    b = one_sequence_batch([0.0] * 4, adv)
    lp = torch.tensor([ratios + [1.0]]).log().requires_grad_()  # old log-probs are 0: ratio = pi
    for low, weights, clipped in [
        (None, [0.5, 1.0, 1.2, 0.85], [0, 0, 1, 0]),  # MiniMax-M1: only 1 + clip_high = 1.2 bounds
        (0.2, [0.8, 1.0, 1.2, 0.85], [1, 0, 1, 0]),  # weight >= 1 - 0.2
    ]:
        loss, info = policy_loss(lp, b, PolicyLossConfig(policy_loss="cispo", clip_high=0.2, cispo_clip_low=low))
        w, a = torch.tensor(weights), torch.tensor(adv)
        assert torch.allclose(loss[0, :4], -w * a * torch.tensor(ratios).log(), atol=1e-6)
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        assert torch.allclose(grad[0, :4], -w * a, atol=1e-6)  # the weight is detached: every token keeps its gradient
        assert info["clip_ratio"][0, :4].tolist() == clipped


def test_approx_kl_diagnostic():
    b = one_sequence_batch([0.0], [1.0])
    _, info = policy_loss(torch.tensor([[0.5, 0.0]]), b, PolicyLossConfig())
    assert torch.isclose(info["approx_kl"][0, 0], torch.tensor(math.exp(0.5) - 1 - 0.5))


def test_kl_estimator_outputs_are_clamped_and_k3_no_longer_overflows():
    lp, ref = torch.tensor([-100.0, -3.0, 15.0, -0.5]), torch.zeros(4)  # log-ratios -100, -3, 15, -0.5
    raw = kl_penalty(lp, ref, "k3", clamp=None, log_ratio_clamp=None)
    assert torch.isinf(raw[0])  # exp(100) overflows fp32: one token would own the loss
    assert torch.isclose(raw[1], torch.tensor(math.exp(3) - 1 - 3))  # 16.09
    k3 = kl_penalty(lp, ref, "k3")
    assert torch.isfinite(k3).all() and k3.abs().max() <= 10
    assert k3[:3].tolist() == [10.0, 10.0, 10.0]  # exp(20) - 21, exp(3) - 4 = 16.09, exp(-15) + 14 all above 10
    assert torch.isclose(k3[3], torch.tensor(math.exp(0.5) - 1 - 0.5))  # inside the bounds: unchanged
    # the log-ratio clamp alone: exp(20) - 1 - 20, finite
    assert torch.isclose(kl_penalty(lp[:1], ref[:1], "k3", clamp=None), torch.tensor(math.exp(20) - 21.0), rtol=1e-6)
    assert kl_penalty(lp, ref, "k1").tolist() == [-10.0, -3.0, 10.0, -0.5]
    assert kl_penalty(lp, ref, "k2").tolist() == [10.0, 4.5, 10.0, 0.125]
    # one outlier among 100 ordinary tokens: its share of the token-mean stays bounded
    many = torch.cat([torch.full((100,), -0.1), torch.tensor([-100.0])])
    mean = kl_penalty(many, torch.zeros(101), "k3").mean()
    assert mean < (100 * (math.exp(0.1) - 1 - 0.1) + 10) / 101 + 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_aggregations_on_two_sequences(packed):
    """Token losses [1, 2, 3] and [4, 5]: every mode's value worked out by hand."""
    recs = [Experience(sequences=torch.zeros(n + 2, dtype=torch.long),
                       action_mask=torch.tensor([False] + [True] * n), advantages=torch.tensor([99.0] + v))
            for n, v in [(3, [1.0, 2.0, 3.0]), (2, [4.0, 5.0])]]
    b = make_experience_batch(recs, packed=packed)
    loss = b.advantages  # 99 sits on a prompt slot: masked out everywhere
    assert aggregate(loss, b, "token-mean") == pytest.approx(15 / 5)
    assert aggregate(loss, b, "seq-mean-token-mean") == pytest.approx((6 / 3 + 9 / 2) / 2)
    assert aggregate(loss, b, "seq-mean-token-sum") == pytest.approx((6 + 9) / 2)
    assert aggregate(loss, b, "seq-mean-token-sum-norm", token_sum_norm=10.0) == pytest.approx((6 / 10 + 9 / 10) / 2)
    sum_norm = aggregate(loss, b, LossAgg.SEQ_MEAN_TOKEN_SUM_NORM, normalizer=4, token_sum_norm=10.0)
    assert sum_norm == pytest.approx(1.5 / 4)  # a global sequence count divides instead of this batch's 2
    with pytest.raises(ValueError, match="token_sum_norm .* must be > 0, got None"):
        aggregate(loss, b, "seq-mean-token-sum-norm")
    assert loss_normalizer(recs, "token-mean") == 5 and loss_normalizer(recs, "seq-mean-token-sum-norm") == 2


# ------------------------------------------------------------------ KL control
def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=1.0, horizon=100)
    ctl.update(current_kl=1.5, n_steps=10)  # error 0.5, clipped to 0.2: x (1 + 0.2 * 10 / 100)
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=0.9, n_steps=50)  # error -0.1: x (1 - 0.1 * 50 / 100)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.95)
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    assert isinstance(build_kl_controller(0.1, target=1.0, horizon=100), AdaptiveKLController)
    assert isinstance(build_kl_controller(0.1), FixedKLController)
    with pytest.raises(ValueError, match=r"target \(algo.kl_target\) must be > 0, got 0"):
        AdaptiveKLController(0.1, 0, 100)


# -------------------------------------------------------------------- LR schedule
def test_lr_schedule_warmup_then_constant_or_cosine():
    assert [lr_lambda(s, 4, 10, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_lambda(s, 4, 10, LRSchedule.COSINE) for s in (0, 3, 4, 7, 10, 12)]
    assert cos == pytest.approx([0.25, 1.0, 1.0, 0.5, 0.0, 0.0])  # step 7: half way, (1 + cos(pi/2)) / 2
    assert lr_lambda(7, 4, 10, "cosine", min_lr_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_lambda(0, 0, 10, "constant") == 1.0
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make_lr_scheduler(opt, warmup_steps=2, total_steps=4, kind="cosine")
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 1.0])  # warmup 1/2, 2/2; cosine at p = 0, 1/2
    with pytest.raises(ValueError, match=r"lr_schedule='linear': expected one of constant, cosine$"):
        lr_lambda(0, 0, 10, "linear")
    with pytest.raises(ValueError, match="cosine needs total_steps=4 > warmup_steps=4"):
        make_lr_scheduler(opt, warmup_steps=4, total_steps=4, kind="cosine")


# ---------------------------------------------------------------- the registry
def test_a_registered_policy_loss_is_one_function_and_the_config_accepts_it(monkeypatch):
    from rl.algos.losses import POLICY_LOSSES, register_policy_loss

    monkeypatch.setattr("rl.algos.losses.POLICY_LOSSES", POLICY_LOSSES.copy())  # registered for this test only
    with pytest.raises(ValueError, match="not a registered policy loss"):
        check_policy_loss_config(PolicyLossConfig(policy_loss="vanilla_pg"))

    @register_policy_loss("vanilla_pg")
    def vanilla_pg(log_probs, log_ratio, experience, cfg):
        """-A * log p: no ratio, no clipping."""
        return -experience.advantages * log_probs, torch.zeros_like(log_probs, dtype=torch.bool), log_ratio.exp()

    b = make_experience_batch(make_records(), packed=True)
    lp = b.action_log_probs.clone().requires_grad_(True)
    loss, info = policy_loss(lp, b, PolicyLossConfig(policy_loss="vanilla_pg"))
    torch.testing.assert_close(loss, -b.advantages * lp.detach() * b.action_mask)
    assert float(info["clip_ratio"].sum()) == 0
    with pytest.raises(ValueError, match="'vanilla_pg' is already registered"):
        register_policy_loss("vanilla_pg")(vanilla_pg)
