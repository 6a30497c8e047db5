"""MoE: expert parallelism (ep=2 on gloo), synthetic-row masking, routing replay (R3), expert load."""

import copy

import pytest
import torch

from dist_moe_worker import RANK_LENGTHS, logits_of, packed_batch, tiny_moe, token_log_probs, weighted_loss
from testing.distributed import run_distributed
from tests.parity_check import PARITY_ULPS as SHARED_ULPS, assert_control_fails, assert_parity
from model.moe import (
    shard_experts,
    ep_suffix_length,
    expert_load,
    is_expert_param,
    moe_blocks,
    moe_token_weights,
    record_routing,
    reset_expert_load,
    routing_replay,
)

L, K, E = 2, 2, 8  # MoE layers, top-k, experts of the tiny model
LENGTHS = [5, 9, 6]  # one pack [1, 20]


@pytest.fixture(scope="module")
def stock():
    return tiny_moe(0)


@pytest.fixture(scope="module")
def model_a(stock):
    return shard_experts(copy.deepcopy(stock), None)


@pytest.fixture(scope="module")
def model_b(model_a):
    """A copy of A whose routers are perturbed enough to change its routing."""
    b = copy.deepcopy(model_a)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in moe_blocks(b):
            block.gate.weight.add_(0.1 * torch.randn(block.gate.weight.shape, generator=gen))
    return b


@pytest.fixture(scope="module")
def pack():
    return packed_batch(LENGTHS, seed=3)


def recorded(model, ids, pos, **kw):
    """(logits, routed_experts [B, L, K, T], router_logits per layer) of one no-grad forward."""
    with torch.no_grad(), record_routing(model) as rec:
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_router_logits=True, **kw)
    return out.logits, rec.routed_experts, out.router_logits


def live_top_k(router_logits: torch.Tensor) -> torch.Tensor:
    """[T, K] top-k ids exactly as the stock router picks them."""
    return torch.topk(torch.softmax(router_logits, -1, dtype=torch.float), K, dim=-1).indices


def router_grads(model, ids, pos, routed=None):
    model.zero_grad(set_to_none=True)
    with routing_replay(model, routed):
        logits = logits_of(model, ids, pos)
    weighted_loss(token_log_probs(logits, ids), seed=0).backward()
    g = [b.gate.weight.grad.clone() for b in moe_blocks(model)]
    model.zero_grad(set_to_none=True)
    return logits.detach(), g


# ------------------------------------------------------------------ single process
def test_unsharded_moe_block_matches_stock_model(stock, model_a, pack):
    ids, pos = pack
    with torch.no_grad():
        ours, theirs = logits_of(model_a, ids, pos), logits_of(stock, ids, pos)
    assert_parity("unsharded MoE block vs stock logits", (ours - theirs).abs().max(), theirs.abs().max())
    assert sorted(model_a.state_dict()) == sorted(stock.state_dict())


def test_record_routing_gives_live_top_k_in_pack_and_padded_layouts(model_a, pack):
    ids, pos = pack
    _, routed, router_logits = recorded(model_a, ids, pos)
    assert routed.shape == (1, L, K, ids.shape[1]) and routed.dtype == torch.int64
    for layer in range(L):
        assert torch.equal(routed[0, layer].T, live_top_k(router_logits[layer]))
    padded = torch.stack([ids[0, :9], ids[0, 9:18]])  # [B=2, T=9]
    with torch.no_grad(), record_routing(model_a) as rec:
        model_a(input_ids=padded, use_cache=False)
        model_a(input_ids=padded[:, :3], use_cache=False)  # successive forwards concatenate on T
    assert rec.routed_experts.shape == (2, L, K, 12)


def test_replay_reproduces_recorded_experts_under_a_perturbed_router(model_a, model_b, pack):
    ids, pos = pack
    _, routed_a, _ = recorded(model_a, ids, pos)
    _, routed_b_live, _ = recorded(model_b, ids, pos)
    assert not torch.equal(routed_b_live, routed_a), "the perturbation must change B's live routing"
    with routing_replay(model_b, routed_a):
        _, routed_b_replayed, _ = recorded(model_b, ids, pos)
    assert torch.equal(routed_b_replayed, routed_a)

    padded = torch.stack([ids[0, :9], ids[0, 9:18]])  # the padded layout [B, L, K, T] replays alike
    _, routed_a, _ = recorded(model_a, padded, None)
    with routing_replay(model_b, routed_a):
        _, routed_b_replayed, _ = recorded(model_b, padded, None)
    assert routed_a.shape == (2, L, K, 9) and torch.equal(routed_b_replayed, routed_a)


def test_replay_with_the_same_router_equals_live_exactly(model_a, pack):
    ids, pos = pack
    _, routed_a, _ = recorded(model_a, ids, pos)
    live, live_grads = router_grads(model_a, ids, pos)
    replayed, replay_grads = router_grads(model_a, ids, pos, routed_a)
    assert torch.equal(replayed, live)
    for g_live, g_replay in zip(live_grads, replay_grads):
        assert_parity("router grads, replay vs live", (g_replay - g_live).abs().max(), g_live.abs().max())


def test_router_gets_gradients_under_replay(model_a, model_b, pack):
    ids, pos = pack
    _, routed_a, _ = recorded(model_a, ids, pos)
    _, g = router_grads(model_b, ids, pos, routed_a)
    assert all(grad.abs().sum() > 0 for grad in g)


def test_all_minus_one_replay_is_live_routing(model_b, pack):
    ids, pos = pack
    none_recorded = torch.full((1, L, K, ids.shape[1]), -1)
    live, live_grads = router_grads(model_b, ids, pos)
    replayed, replay_grads = router_grads(model_b, ids, pos, none_recorded)
    assert torch.equal(replayed, live)
    assert all(torch.equal(a, b) for a, b in zip(live_grads, replay_grads))


def test_mixed_replay_uses_records_where_present_and_live_routing_elsewhere(model_a, model_b, pack):
    ids, pos = pack
    _, routed_a, _ = recorded(model_a, ids, pos)
    mixed = routed_a.clone()
    mixed[:, 0, :, ::3] = -1  # layer 0: every third token live
    mixed[:, 1] = -1  # layer 1: all live
    with routing_replay(model_b, mixed):
        _, used, router_logits = recorded(model_b, ids, pos)
    live = torch.stack([live_top_k(router_logits[layer]).T for layer in range(L)])[None]  # [1, L, K, N]
    has_record = mixed >= 0
    assert torch.equal(used[has_record], routed_a[has_record])
    assert torch.equal(used[~has_record], live[~has_record])
    assert not torch.equal(used, routed_a) and has_record.any()


def test_routed_experts_with_wrong_shape_raise_naming_the_field(model_a, pack):
    ids, pos = pack
    N = ids.shape[1]
    with pytest.raises(ValueError, match=r"routed_experts has 3 MoE layers.*expected L=2"):
        with routing_replay(model_a, torch.zeros(1, 3, K, N, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"routed_experts has top-k 3.*expected K=2"):
        with routing_replay(model_a, torch.zeros(1, L, 3, N, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"routed_experts has shape \(2, 2, 20\), expected \[B, L=2, K=2, T\]"):
        with routing_replay(model_a, torch.zeros(L, K, N, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"routed_experts holds ids in \[8, 8\], expected -1 \(live\) or \[0, 8\)"):
        with routing_replay(model_a, torch.full((1, L, K, N), E)):
            pass
    with pytest.raises(ValueError, match=r"routed_experts has shape \(1, 2, 2, 19\), expected \[1, 2, 2, 20\]"):
        with torch.no_grad(), routing_replay(model_a, torch.zeros(1, L, K, N - 1, dtype=torch.long)):
            logits_of(model_a, ids, pos)
    partial = torch.zeros(1, L, K, N, dtype=torch.long)
    partial[0, 0, 1, 4] = -1
    with pytest.raises(ValueError, match=r"-1 in some but not all"):
        with torch.no_grad(), routing_replay(model_a, partial):
            logits_of(model_a, ids, pos)


def test_zero_token_weights_keep_synthetic_rows_out_of_the_experts(model_a, pack):
    ids, pos = pack
    N, s = ids.shape[1], 6
    ids_s = torch.cat([ids, torch.zeros(1, s, dtype=ids.dtype)], 1)
    pos_s = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(s)[None]], 1)
    padding = torch.arange(N + s)[None] >= N
    with torch.no_grad():
        reset_expert_load(model_a)
        plain = logits_of(model_a, ids, pos)
        load_plain = expert_load(model_a)
        reset_expert_load(model_a)
        with moe_token_weights(model_a, (~padding).long()), record_routing(model_a) as rec:
            suffixed = logits_of(model_a, ids_s, pos_s)
        load_suffix = expert_load(model_a)
        reset_expert_load(model_a)
        logits_of(model_a, ids_s, pos_s)
        load_unmasked = expert_load(model_a)
        reset_expert_load(model_a)
    assert_parity("logits with vs without a masked suffix", (suffixed[:, :N] - plain).abs().max(), plain.abs().max())
    assert torch.equal(load_suffix["per_layer"], load_plain["per_layer"])
    assert load_plain["per_layer"].sum() == L * K * N
    assert load_unmasked["per_layer"].sum() == L * K * (N + s)  # the control: unmasked rows are counted
    assert (rec.routed_experts[..., N:] == -1).all() and (rec.routed_experts[..., :N] >= 0).all()
    assert load_plain["per_rank"].tolist() == [L * K * N] and load_plain["imbalance"] == 1.0
    with pytest.raises(ValueError, match=r"moe token weights have shape \(1, 20\), expected \[1, 26\]"):
        with torch.no_grad(), moe_token_weights(model_a, (~padding[:, :N]).long()):
            logits_of(model_a, ids_s, pos_s)


def test_expert_parameters_are_named_apart_from_dense_ones(model_a):
    names = [n for n, _ in model_a.named_parameters() if is_expert_param(n)]
    assert names == [f"model.layers.{i}.mlp.experts.{w}" for i in range(L) for w in ("gate_up_proj", "down_proj")]
    assert is_expert_param("_fsdp_wrapped_module.model.layers.3.mlp.experts.down_proj")
    assert not is_expert_param("model.layers.0.mlp.gate.weight")
    assert not is_expert_param("model.layers.0.self_attn.q_proj.weight")


def test_without_a_group_there_is_no_suffix_and_bad_counts_raise():
    assert ep_suffix_length(17, None) == 0
    with pytest.raises(ValueError, match="local_tokens"):
        ep_suffix_length(-1, None)


def test_models_without_moe_blocks_raise(stock, model_a):
    with pytest.raises(ValueError, match="call shard_experts"):
        with record_routing(stock):
            pass
    with pytest.raises(ValueError, match="applied twice"):
        shard_experts(model_a, None)


# ------------------------------------------------------------------ ep=2 on gloo
@pytest.fixture(scope="module")
def ep2():
    from dist_moe_worker import ep_checks

    return run_distributed(ep_checks, 2, timeout=180)


@pytest.fixture(scope="module")
def ep2_scales(stock):
    """max |reference| per kind of tensor of the ep=2 checks, in one process: their tolerances' scale."""
    from dist_moe_worker import grads, param_kind

    scales: dict[str, float] = {}
    summed: dict[str, torch.Tensor] = {}
    for r, lengths in enumerate(RANK_LENGTHS):
        model = copy.deepcopy(stock)
        ids, pos = packed_batch(lengths, seed=100 + r)
        logits = logits_of(model, ids, pos)
        lp = token_log_probs(logits, ids)
        weighted_loss(lp, seed=r).backward()
        for kind, t in [("logits", logits), ("log_probs", lp), *((param_kind(n), g) for n, g in grads(model).items())]:
            scales[kind] = max(scales.get(kind, 0.0), float(t.detach().abs().max()))
        for n, g in grads(model).items():
            summed[n] = summed.get(n, 0) + g
    for n, g in summed.items():  # an expert shard is compared with the grad summed over ranks
        scales[param_kind(n)] = max(scales[param_kind(n)], float(g.abs().max()))
    return scales


@pytest.mark.slow
def test_ep2_matches_one_process_in_log_probs_and_every_gradient(ep2, ep2_scales):
    for rank, r in enumerate(ep2):
        assert r["expert_shard"] == (4 * rank, 4)
        assert set(r["parity"]) == {"log_probs", "router", "attention", "dense_other", "experts"}
        for kind, diff in r["parity"].items():
            assert_parity(f"ep=2 vs one process, rank {rank} {kind}", diff, ep2_scales[kind])


@pytest.mark.slow
def test_ep2_parity_check_catches_wrong_ownership_and_a_detached_dispatch(ep2, ep2_scales):
    for r in ep2:
        assert_control_fails("wrong expert owner, log-probs", r["control_wrong_owner"]["log_probs"],
                             ep2_scales["log_probs"])
        detached = max(d / ep2_scales[kind] for kind, d in r["control_detached_dispatch"].items())
        assert_control_fails("detached dispatch, grads (relative per kind)", detached, 1.0)  # forward is unchanged


@pytest.mark.slow
def test_ep2_suffix_equalizes_tokens_without_touching_real_outputs_or_expert_load(ep2, ep2_scales):
    assert [r["suffix"] for r in ep2] == [r["suffix_expected"] for r in ep2] == [5, 0]
    total = sum(map(sum, RANK_LENGTHS))
    for r in ep2:
        assert_parity("ep=2 logits with vs without the suffix", r["suffix_real_token_diff"], ep2_scales["logits"])
        assert r["load_local_equal"] and r["load_group_equal"]
        assert r["load_plain"]["per_layer"].sum() == L * K * total  # every real token-slot, no synthetic one
        assert r["load_unmasked"]["per_layer"].sum() == L * K * (total + 5)  # control: unmasked suffix counted
        per_rank = r["load_plain"]["per_rank"].double()
        assert per_rank.sum() == L * K * total
        assert r["load_plain"]["imbalance"] == float(per_rank.max()) / float(per_rank.mean())
        assert r["all_synthetic_rank_ok"]  # a rank with nothing to send still exchanges, grads defined
    assert_parity("log-probs beside an all-synthetic peer", ep2[0]["all_synthetic_peer_diff"], ep2_scales["log_probs"])


@pytest.mark.slow
def test_ep2_shared_prompts_equal_the_unshared_pack_of_one_process(ep2):
    """Each EP rank runs its GRPO pack with shared prompts (tests/dist_moe_worker.py
    `shared_prompt_checks`): the EP suffix is computed on the compressed rows (rank 1 pads 43 to
    74), and log-probs, every gradient kind, the aux loss, its token count, the expert load and
    the recorded routing equal the one-process unshared pack's. Control: unit token weights."""
    rows = ep2[0]["shared"]["rows"]
    assert rows[0] != rows[1]
    for rank, r in enumerate(ep2):
        s = r["shared"]
        assert s["rows_seen"] == [max(rows)] and rows[rank] < s["n"], s  # compressed + suffix: equal on every rank
        f = s["figures"]
        assert f["tokens_equal"] and f["load_equal"] and f["routed_equal"], f
        for kind in ("log_probs", "aux", "router", "attention", "dense_other", "experts"):
            assert_parity(f"ep=2 shared vs one-process unshared, rank {rank} {kind}", *f[kind], k=SHARED_ULPS)
        control = s["control_unit_weights"]
        assert not control["tokens_equal"] and not control["load_equal"]
        assert_control_fails(f"ep=2 unit weights, rank {rank} aux", *control["aux"], k=SHARED_ULPS)


@pytest.mark.slow
def test_ep2_routing_state_dict_and_divisibility(ep2):
    for r in ep2:
        assert r["routing_matches_unsharded"]
        assert r["gathered_keys_match"] and r["gathered_equal"]
        assert "num_experts=3 is not divisible by the expert-parallel size ep=2" in r["indivisible_error"]


def test_router_aux_loss_counts_real_tokens_only_and_is_layout_invariant(model_a):
    """The load-balancing loss is the same for a pack and the padded batch of the same
    records, a synthetic suffix does not change it, and it reaches the routers."""
    from conftest import make_records
    from model.actor import Actor, _forward_slots
    from model.moe import router_aux_loss
    from runtime.parallel_dims import ParallelDims
    from packing import make_experience_batch

    records = make_records([7, 19, 4, 12], seed=5)
    pack, padded = (make_experience_batch(records, packed=p) for p in (True, False))

    def loss(batch, pad=None):
        with router_aux_loss(model_a) as aux:
            _forward_slots(model_a, batch, ParallelDims(), replay=False, pad=pad)
        assert len(aux) == L and all(n == sum(len(r.sequences) for r in records) for _, n in aux)
        return sum(a for a, _ in aux) / L

    model_a.zero_grad(set_to_none=True)
    packed_loss = loss(pack)
    packed_loss.backward()
    assert model_a.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert_parity("aux loss, padded vs packed", abs(loss(padded) - packed_loss), packed_loss)
        assert_parity("aux loss with a 9-token EP suffix", abs(loss(pack, pad=9) - packed_loss), packed_loss)
    with torch.no_grad(), router_aux_loss(model_a, enabled=False) as aux:
        Actor(model_a)(pack)
    assert aux == []
