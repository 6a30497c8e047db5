"""Rank body of tests/test_grad_sync.py: one optimizer step's gradients on world=4 vs one process.

Every rank builds the same seeded model and the same global batch of records, trains on
its own plan entry (packed, token-mean normalized by the global action-token count), syncs
gradients the way the trainer does, and compares with one process on the whole batch.
"""

from __future__ import annotations

import copy

import torch

from conftest import make_records
from model.actor import Actor
from model.models import build_model
from model.moe import is_expert_param
from model.parallel_dims import init_distributed
from model.parallelize import parallelize, sync_gradients
from packing import make_experience_batch, plan_microbatches
from rl.losses import PolicyLossConfig, aggregate, policy_loss

LENGTHS = [5, 17, 9, 33, 12, 7, 21, 3, 14, 26, 8, 11]
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def _grads(model, records, normalizer, packed, dims=None):
    actor = Actor(model, dims=dims)
    for items in records:
        batch = make_experience_batch(items, packed=packed)
        loss = aggregate(policy_loss(actor(batch), batch, PolicyLossConfig())[0], batch, "token-mean", normalizer)
        loss.backward()


def grad_sync_checks(rank: int, world_size: int, name: str, ep: int, cp: int = 1, packed: bool = True,
                     break_sync: bool = False) -> dict:
    dims = init_distributed(dp=-1, cp=cp, ep=ep)
    overrides = {k: v for k, v in TINY.items() if name == "qwen3_moe" or k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")}
    base = build_model(name, seed=0, **overrides)
    routed = (2, 2, 4) if name == "qwen3_moe" else None
    records = make_records(LENGTHS, vocab=64, seed=3, routed=routed)
    normalizer = float(sum(r.action_mask.sum() for r in records))

    reference = parallelize(copy.deepcopy(base), type(dims)())  # one process, every expert local
    _grads(reference, [records], normalizer, packed=True)
    ref = {n: p.grad for n, p in reference.named_parameters()}

    model = parallelize(copy.deepcopy(base), dims)
    plan = plan_microbatches([r.sequences.numel() for r in records], 64, dims.dp)
    _grads(model, [[records[i] for i in mb] for mb in plan[dims.dp_rank]], normalizer, packed, dims)
    if not break_sync:
        sync_gradients(model, dims)

    diffs = {"dense": 0.0, "experts": 0.0}
    scale = max(float(g.abs().max()) for g in ref.values())
    local = ep_local = 0
    for n, p in model.named_parameters():
        expected = ref[n]
        if is_expert_param(n) and ep > 1:
            shard = expected.shape[0] // ep
            expected = expected[dims.ep_rank * shard:(dims.ep_rank + 1) * shard]
            ep_local += 1
        kind = "experts" if is_expert_param(n) else "dense"
        diffs[kind] = max(diffs[kind], float((p.grad - expected).abs().max()))
        local += 1
    return {"diffs": diffs, "scale": scale, "microbatches": len(plan[dims.dp_rank]), "expert_params": ep_local}
