"""Tiny Qwen3-MoE helpers for tests/test_moe.py and the ep=2 worker it launches.

`ep_checks(rank, world_size)` runs in every rank of a gloo group (testing/distributed.py) and
returns the measured figures; the test asserts on them. Every rank builds the same seeded
model and the single-process references itself, so nothing but figures crosses processes.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers

from model import moe
from model.models import TINY_MOE
from model.parallelize import full_parameters
from model.moe import (
    shard_experts,
    ep_suffix_length,
    expert_load,
    is_expert_param,
    moe_token_weights,
    record_routing,
    reset_expert_load,
)

# packed sequence lengths per EP rank: unequal totals (16 vs 21) so rank 0 needs a 5-token suffix
RANK_LENGTHS = ([5, 7, 4], [6, 9, 6])


def tiny_moe(seed: int = 0, **overrides) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides}, attn_implementation="sdpa")
    return transformers.Qwen3MoeForCausalLM(config).float()


def packed_batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids [1, N]` and `position_ids [1, N]` restarting at 0 per sequence."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_MOE["vocab_size"], (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, pos


def logits_of(model, ids: torch.Tensor, pos: torch.Tensor, **kw) -> torch.Tensor:
    return model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False, **kw).logits


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`[B, N-1]`: log-prob of token k+1 under the logits at k."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def weighted_loss(log_probs: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed random weighting, so every token's gradient differs."""
    w = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(seed))
    return (log_probs * w).sum()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def param_kind(name: str) -> str:
    if is_expert_param(name):
        return "experts"
    if ".mlp.gate." in name:
        return "router"
    if ".self_attn." in name:
        return "attention"
    return "dense_other"  # embeddings, norms, lm_head


# -------------------------------------------------------------------- the ep worker
def _parity(model, rank: int, batch, ref_lp, ref_local, ref_total) -> dict[str, float]:
    """Max |diff| of an EP model against the single-process references, per kind of tensor.

    Dense grads compare with this rank's own batch; an expert shard's grad with the
    matching slice of the grad summed over every rank's batch (its tokens came from all)."""
    ids, pos = batch
    model.zero_grad(set_to_none=True)
    lp = token_log_probs(logits_of(model, ids, pos), ids)
    weighted_loss(lp, seed=rank).backward()
    diffs = {"log_probs": float((lp.detach() - ref_lp).abs().max())}
    for name, g in grads(model).items():
        kind = param_kind(name)
        if kind == "experts":
            n = g.shape[0]
            ref = ref_total[name][rank * n : (rank + 1) * n]
        else:
            ref = ref_local[name]
        diffs[kind] = max(diffs.get(kind, 0.0), float((g - ref).abs().max()))
    return diffs


def ep_checks(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    out: dict = {}
    stock = tiny_moe(0)
    ep_model = shard_experts(copy.deepcopy(stock), group)
    batches = [packed_batch(lengths, seed=100 + r) for r, lengths in enumerate(RANK_LENGTHS)]
    ids, pos = batches[rank]
    N = ids.shape[1]

    # single-process references: this rank's batch alone, and summed over all ranks' batches
    lp_by_rank, grads_by_rank = [], []
    for r, (ids_r, pos_r) in enumerate(batches):
        stock.zero_grad(set_to_none=True)
        lp_r = token_log_probs(logits_of(stock, ids_r, pos_r), ids_r)
        weighted_loss(lp_r, seed=r).backward()
        lp_by_rank.append(lp_r.detach())
        grads_by_rank.append(grads(stock))
    stock.zero_grad(set_to_none=True)
    ref_local = grads_by_rank[rank]
    ref_total = {n: sum(g[n] for g in grads_by_rank) for n in ref_local}
    ref = (batches[rank], lp_by_rank[rank], ref_local, ref_total)

    out["parity"] = _parity(ep_model, rank, *ref)
    out["expert_shard"] = (ep_model.model.layers[0].mlp.experts.first_expert,
                           ep_model.model.layers[0].mlp.experts.num_local_experts)

    # control 1: a rank holding the wrong experts (rank r gets rank 1-r's slice)
    wrong = shard_experts(copy.deepcopy(stock), group)
    full = dict(stock.named_parameters())
    with torch.no_grad():
        for name, p in wrong.named_parameters():
            if is_expert_param(name):
                n = p.shape[0]
                other = (rank + 1) % world_size
                p.copy_(full[name][other * n : (other + 1) * n])
    out["control_wrong_owner"] = _parity(wrong, rank, *ref)

    # control 2: a dispatch that is not differentiable (plain all_to_all, no reverse exchange)
    differentiable = moe._all_to_all
    moe._all_to_all = lambda x, o, i, g: moe._exchange(x.detach(), o, i, g)
    try:
        out["control_detached_dispatch"] = _parity(ep_model, rank, *ref)
    finally:
        moe._all_to_all = differentiable
    ep_model.zero_grad(set_to_none=True)

    # EP suffix: equal token counts, synthetic rows masked out of the experts
    s = ep_suffix_length(N, group)
    out["suffix"] = s
    out["suffix_expected"] = max(map(sum, RANK_LENGTHS)) - N
    ids_s = torch.cat([ids, torch.zeros(1, s, dtype=ids.dtype)], 1)  # all-zero ids: identical rows
    pos_s = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(s)[None]], 1)  # continue the last sequence
    padding = torch.zeros(1, N + s, dtype=torch.bool)
    padding[:, N:] = True
    with torch.no_grad():
        reset_expert_load(ep_model)
        with record_routing(ep_model) as rec_ep:
            plain = logits_of(ep_model, ids, pos)
        load_plain = expert_load(ep_model), expert_load(ep_model, group)
        reset_expert_load(ep_model)
        with moe_token_weights(ep_model, (~padding).long()):
            suffixed = logits_of(ep_model, ids_s, pos_s)
        load_suffix = expert_load(ep_model), expert_load(ep_model, group)
        reset_expert_load(ep_model)
        logits_of(ep_model, ids_s, pos_s)  # control: the same suffix, unmasked
        load_unmasked = expert_load(ep_model, group)
        reset_expert_load(ep_model)
    out["suffix_real_token_diff"] = float((suffixed[:, :N] - plain).abs().max())
    out["load_local_equal"] = torch.equal(load_plain[0]["per_layer"], load_suffix[0]["per_layer"])
    out["load_group_equal"] = torch.equal(load_plain[1]["per_layer"], load_suffix[1]["per_layer"])
    out["load_plain"] = load_plain[1]
    out["load_unmasked"] = load_unmasked
    out["tokens_in_group"] = sum(map(sum, RANK_LENGTHS))

    # a rank whose rows are all synthetic still joins every exchange, forward and backward
    ep_model.zero_grad(set_to_none=True)
    all_synthetic = torch.full_like(padding, rank == 1)
    with moe_token_weights(ep_model, (~all_synthetic).long()):
        lp = token_log_probs(logits_of(ep_model, ids_s, pos_s), ids_s)
        weighted_loss(lp, seed=rank).backward()
    out["all_synthetic_rank_ok"] = all(p.grad is not None for name, p in ep_model.named_parameters()
                                       if is_expert_param(name))
    if rank == 0:  # rank 0's real tokens are unaffected by rank 1 sending nothing
        out["all_synthetic_peer_diff"] = float((lp.detach()[:, : N - 1] - lp_by_rank[0]).abs().max())
    ep_model.zero_grad(set_to_none=True)

    # routing does not depend on EP: recorded ids match an unsharded copy's
    local = shard_experts(copy.deepcopy(stock), None)
    with torch.no_grad(), record_routing(local) as rec_local:
        logits_of(local, ids, pos)
    out["routing_matches_unsharded"] = torch.equal(rec_ep.routed_experts, rec_local.routed_experts)

    # the gathered state dict is the stock one, key for key and bit for bit
    gathered = dict(full_parameters(ep_model))
    ref_state = stock.state_dict()
    out["gathered_keys_match"] = sorted(gathered) == sorted(ref_state)
    out["gathered_equal"] = all(torch.equal(gathered[k], ref_state[k]) for k in ref_state)

    out["shared"] = shared_prompt_checks(rank, world_size)

    # ep must divide the expert count
    try:
        shard_experts(tiny_moe(0, num_experts=3), group)
        out["indivisible_error"] = None
    except ValueError as e:
        out["indivisible_error"] = str(e)
    return out


# --------------------------------------------------- shared prompts at ep=2 (same launch)
# per EP rank: GRPO groups (prompt length, response lengths) whose compressed rows differ (74 vs 43), so
# rank 1 appends a 31-row EP suffix to its shared rows
SHARED_GROUPS = ([(7, [3, 5, 1, 9]), (12, [4, 4, 2, 6]), (9, [6])], [(12, [2, 2, 3, 2]), (10, [4, 4])])
SHARED_AUX = 0.01


def _shared_run(actor, batch) -> dict:
    """One forward+backward of the policy term + SHARED_AUX x aux loss, and every figure of it."""
    model = actor.model
    model.zero_grad(set_to_none=True)
    reset_expert_load(model)
    with moe.router_aux_loss(model) as aux, record_routing(model) as rec:
        lp = actor(batch)
    tokens = torch.stack([n for _, n in aux])
    balance = sum(a * n for a, n in aux) / (batch.sequences.numel() * len(aux))  # as the trainer
    mask = batch.action_mask.float()
    (((-batch.advantages * lp) * mask).sum() / mask.sum() + SHARED_AUX * balance).backward()
    out = {"log_probs": lp.detach(), "aux": torch.stack([a.detach() for a, _ in aux]), "tokens": tokens,
           "load": expert_load(model)["per_layer"], "routed": rec.routed_experts[..., :batch.sequences.shape[1]],
           "grads": grads(model)}
    model.zero_grad(set_to_none=True)
    reset_expert_load(model)
    return out


def shared_prompt_checks(rank: int, world_size: int) -> dict:
    """The shared-prompt forward of a varlen tiny MoE at ep=2 (each rank its own GRPO pack, the EP
    suffix on the compressed rows) against the unshared pack in one process: (diff, scale) per
    figure, exact flags for the counts and records, and a control (unit token weights)."""
    from model import actor as actor_module
    from model.actor import Actor
    from model.models import build_model
    from runtime.parallel_dims import ParallelDims, build_mesh
    from packing.collate import make_experience_batch
    from test_shared_prompt import body_tokens
    from testing.records import grpo_records

    dims = ParallelDims(dp=world_size, ep=world_size, world_size=world_size)
    build_mesh(dims)
    base = build_model("qwen3_moe", seed=0)
    local = shard_experts(copy.deepcopy(base), None)
    ep_model = shard_experts(copy.deepcopy(base), dims.ep_group)
    packs = [make_experience_batch(grpo_records(g, seed=r, hole=False), packed=True)
             for r, g in enumerate(SHARED_GROUPS)]
    pack = packs[rank]
    refs = [_shared_run(Actor(local), p) for p in packs]
    ref = refs[rank]
    with body_tokens(ep_model) as seen:
        got = _shared_run(Actor(ep_model, dims=dims, share_prompts=True), pack)
    rows = [p.shared_prompts.keep.numel() for p in packs]
    out = {"rows_seen": seen, "rows": rows, "n": pack.sequences.shape[1]}

    def figures(run) -> dict:
        f = {"log_probs": (float((run["log_probs"] - ref["log_probs"]).abs().max()),
                           float(ref["log_probs"].abs().max())),
             "aux": (float((run["aux"] - ref["aux"]).abs().max()), float(ref["aux"].abs().max()))}
        for name, g in run["grads"].items():
            kind = param_kind(name)
            if kind == "experts":  # an expert shard: every rank's tokens reached it
                n = g.shape[0]
                r = sum(x["grads"][name] for x in refs)[rank * n:(rank + 1) * n]
            else:
                r = ref["grads"][name]
            d, sc = f.get(kind, (0.0, 0.0))
            f[kind] = (max(d, float((g - r).abs().max())), max(sc, float(r.abs().max())))
        f["tokens_equal"] = torch.equal(run["tokens"], ref["tokens"])
        f["load_equal"] = torch.equal(run["load"], ref["load"])
        f["routed_equal"] = torch.equal(run["routed"], ref["routed"])
        return f

    out["figures"] = figures(got)
    view = actor_module._shared_prompt_view
    actor_module._shared_prompt_view = lambda *a: (v := view(*a))._replace(weight=(v.weight > 0).long())
    try:
        out["control_unit_weights"] = figures(_shared_run(Actor(ep_model, dims=dims, share_prompts=True), pack))
    finally:
        actor_module._shared_prompt_view = view
    return out

