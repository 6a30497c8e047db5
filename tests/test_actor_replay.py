"""Routing replay (R3) through the Actor: rollout routing rides the pack and routes training."""

import copy

import pytest
import torch

from conftest import make_records
from tests.parity_check import assert_control_fails, assert_parity
from model.actor import Actor
from model.models import build_model
from model.moe import shard_experts, record_routing
from packing import Experience, make_experience_batch

LENGTHS = [6, 19, 11, 4]


@pytest.fixture(scope="module")
def models():
    a = shard_experts(build_model("qwen3_moe", seed=0, initializer_range=0.2), None)
    b = copy.deepcopy(a)
    with torch.no_grad():  # a perturbed router: live routing of B differs from A's
        for layer in b.model.layers:
            layer.mlp.gate.weight.add_(0.5 * torch.randn_like(layer.mlp.gate.weight))
    return a, b


def recorded(model, records):
    """What a rollout engine stores: A's live routing per record, [L, K, T]."""
    pack = make_experience_batch(records, packed=True)
    with torch.no_grad(), record_routing(model) as rec:
        Actor(model, replay=False)(pack)
    routing = Experience(sequences=pack.sequences, packed_seq_lens=pack.packed_seq_lens, routed_experts=rec.routed_experts)
    for r, split in zip(records, routing.split()):
        r.routed_experts = split.routed_experts
    return records


def routing_used(model, batch, replay):
    with torch.no_grad(), record_routing(model) as rec:
        out = Actor(model, replay=replay)(batch)
    return out, rec.routed_experts


def test_training_routes_with_the_rollout_record_in_both_layouts(models):
    a, b = models
    records = recorded(a, make_records(LENGTHS, seed=1))
    pack = make_experience_batch(records, packed=True)
    lp_live, ids_live = routing_used(b, pack, replay=False)
    lp_pack, ids_pack = routing_used(b, pack, replay=True)
    assert not torch.equal(ids_live, pack.routed_experts)  # control: B alone routes differently
    assert torch.equal(ids_pack, pack.routed_experts)  # replay: B routes exactly as A did
    padded = make_experience_batch(records, packed=False)
    lp_pad, _ = routing_used(b, padded, replay=True)
    mask = padded.action_mask
    scale = lp_pad[mask].abs().max()
    assert_parity("replayed log-probs packed vs padded", (lp_pad[mask] - lp_pack[pack.action_mask]).abs().max(), scale)
    assert_control_fails("live vs replayed routing", (lp_live - lp_pack).abs().max(), scale)


def test_minus_one_records_keep_live_routing(models):
    _, b = models
    records = make_records(LENGTHS, seed=2)
    pack = make_experience_batch(records, packed=True)
    lp_live, _ = routing_used(b, pack, replay=False)
    for r in records:
        r.routed_experts = torch.full((2, 2, r.sequences.numel()), -1)
    lp_replay, _ = routing_used(b, make_experience_batch(records, packed=True), replay=True)
    assert torch.equal(lp_live, lp_replay)


def test_router_gets_gradients_under_replay(models):
    a, b = models
    records = recorded(a, make_records(LENGTHS, seed=3))
    b = copy.deepcopy(b)
    pack = make_experience_batch(records, packed=True)
    Actor(b, replay=True)(pack)[pack.action_mask].sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in b.model.layers)
