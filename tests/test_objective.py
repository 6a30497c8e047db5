"""The objective of one microbatch (rl/algos/objective.py) is the whole of what the trainer
optimizes: called alone on a collated batch after the trainer's forwards, it returns the terms
`train_microbatch` records, and the backward of its loss gives `train_microbatch`'s gradients."""

import pytest
import torch

from testing.inprocess import SMALL, trainer
from rl.trainer.trainer import Stats


@pytest.fixture(scope="module")
def step():
    """The default MoE policy with a critic (GAE), a KL loss, an entropy bonus, the router aux loss and
    truncated IS (every term of the objective), and its first mini-batch, collated, scored and with
    advantages, as `train` gets it."""
    tr = trainer(*SMALL, "algo.advantage=gae", "algo.kl_coef=0.05", "algo.entropy_coef=0.01",
                 "algo.router_aux_loss_coef=0.01", "algo.tis_cap=2.0")
    rollouts = tr.rollout(0)
    minibatches = tr.collate(rollouts, tr.plan(rollouts.samples))
    tr.score(minibatches)
    tr.advantages(rollouts.samples, minibatches)
    return tr, minibatches[0]


def grads(tr) -> dict[str, torch.Tensor]:
    """The actor's and critic's parameter gradients, then zeroed."""
    out = {f"{i}.{n}": p.grad.clone() for i, m in enumerate((tr.actor, tr.critic)) for n, p in m.named_parameters()
           if p.grad is not None}
    tr.actor.zero_grad(set_to_none=True)
    tr.critic.zero_grad(set_to_none=True)
    return out


def objective_alone(tr, mb, batch, **change):
    """Forward (actor, in `router_aux_loss`; critic) -> the objective -> backward: its terms and gradients."""
    from model.moe import router_aux_loss

    with router_aux_loss(tr.actor.model) as aux:
        log_probs, entropy = tr.actor(batch, return_entropy=True)
    values = change.pop("values") if "values" in change else tr.critic(batch)
    sizes = {"normalizer": mb.plan.normalizer, "tokens": mb.plan.tokens, "all_tokens": mb.plan.all_tokens} | change
    loss, terms = tr.objective(batch, log_probs, entropy, values, aux, **sizes)
    loss.backward()
    return terms, grads(tr)


def test_the_objective_alone_gives_train_microbatchs_terms_and_gradients(step):
    tr, mb = step
    batch = mb.batches[0]
    grads(tr)
    stats = Stats()
    tr.train_microbatch(batch, 1.0, mb, stats)
    want, want_grads = stats.sums, grads(tr)
    assert {"loss", "policy_loss", "kl_loss", "value_loss", "router_aux_loss", "entropy", "kl",
            "rollout_kl"} <= want.keys()
    assert any(k.startswith("1.") for k in want_grads)  # the critic's gradients are in the comparison

    terms, got_grads = objective_alone(tr, mb, batch)
    assert stats.maxes.keys() == {k for k in terms if k.endswith("_max")}
    assert {k: v.double() for k, v in terms.items() if k in want} == want
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[k], g) for k, g in want_grads.items())

    # controls: another normalizer changes the loss and every gradient; no values, no critic gradients
    wrong, wrong_grads = objective_alone(tr, mb, batch, normalizer=2 * mb.plan.normalizer)
    assert not torch.equal(wrong["loss"].double(), want["loss"])
    assert not any(torch.equal(wrong_grads[k], g) for k, g in want_grads.items() if g.abs().max() > 0)
    no_critic, actor_only = objective_alone(tr, mb, batch, values=None)
    assert "value_loss" not in no_critic and not any(k.startswith("1.") for k in actor_only)


def test_the_run_config_has_every_field_the_objective_reads():
    """`Objective` types `algo` by a Protocol (rl.algos does not import rl.config): `AlgoConfig` has
    each field it declares (a field renamed on one side alone fails here)."""
    import dataclasses

    from rl.algos.objective import ObjectiveConfig
    from rl.config.schema import AlgoConfig

    declared = set(ObjectiveConfig.__annotations__)
    assert declared and declared <= {f.name for f in dataclasses.fields(AlgoConfig)}, declared
