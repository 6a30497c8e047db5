"""Rank body of the FSDP2 gradient parity: three optimizer steps with FSDP2 on a world of
ranks vs one process on the same global batch. tests/test_fsdp.py runs it on gloo ranks
(testing/distributed.py).

Every rank builds the same seeded model and the same global batch of records, trains on
its own plan entry (token-mean normalized by the global action-token count), clips by the
global norm and steps AdamW, three times; it also runs the one-process reference itself,
so only figures cross processes.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from model.actor import Actor
from model.models import TINY_MOE, build_model
from runtime.parallel_dims import ParallelDims, init_distributed, local_tensor
from model.parallelize import clip_grad_norm_, full_parameters, parallelize
from packing import make_experience_batch, plan_microbatches
from rl.algos.losses import PolicyLossConfig, aggregate, policy_loss
from testing.records import make_records

LENGTHS = [5, 17, 9, 33, 12, 7, 21, 3, 14, 26, 8, 11]
# Overrides of the tiny models (model/models.py TINY, TINY_MOE): half the width, a quarter of the
# vocabulary, half the experts. Each case trains twice (sharded and one process) on every rank.
SMALL = dict(vocab_size=64, hidden_size=32, head_dim=8, intermediate_size=64)
SMALL_MOE = dict(SMALL, moe_intermediate_size=16, num_experts=4)
STEPS, CLIP, LR = 3, 0.01, 1e-2


def _model(name: str):
    return build_model(name, seed=0, **(SMALL_MOE if name == "qwen3_moe" else SMALL))


def train(name: str, dims: ParallelDims, records, packed: bool, *, mean_reduction: bool = False) -> dict:
    actor = parallelize(Actor(_model(name), dims=dims), dims)
    if mean_reduction:  # the control: FSDP's default divides the summed gradient by the group size
        for m in actor.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(float(m._get_fsdp_state()._fsdp_param_group.mesh_info.mesh.size()))
    # eps 1e-5: Adam divides by sqrt(v) + eps, so rounding noise in a ~0 gradient cannot move a weight by ~lr
    optimizer = torch.optim.AdamW(actor.parameters(), lr=LR, eps=1e-5)
    normalizer = float(sum(r.action_mask.sum() for r in records))
    plan = plan_microbatches([r.sequences.numel() for r in records], 64, dims.dp)
    norms = []
    for _ in range(STEPS):
        for mb in plan[dims.dp_rank]:
            batch = make_experience_batch([records[i] for i in mb], packed=packed).to(dims.device)
            loss = aggregate(policy_loss(actor(batch), batch, PolicyLossConfig())[0], batch, "token-mean", normalizer)
            loss.backward()
        norms.append(float(clip_grad_norm_(actor.parameters(), CLIP, dims)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    local = sum(local_tensor(p).numel() * p.element_size() for p in actor.parameters())
    local += sum(local_tensor(t).numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    return {"params": dict(full_parameters(actor.model)), "norms": norms, "state_bytes": local,
            "microbatches": len(plan[dims.dp_rank]), "all_dtensor": all(isinstance(p, DTensor) for p in actor.parameters())}


def fsdp_checks(rank: int, world_size: int, name: str, ep: int, cp: int = 1, packed: bool = True,
                mean_reduction: bool = False) -> dict:
    dims = init_distributed(dp=-1, cp=cp, ep=ep)
    moe = dict(TINY_MOE, **SMALL_MOE)
    routed = (moe["num_hidden_layers"], moe["num_experts_per_tok"], moe["num_experts"]) if name == "qwen3_moe" else None
    records = make_records(LENGTHS, vocab=SMALL["vocab_size"], seed=3, routed=routed)
    sharded = train(name, dims, records, packed, mean_reduction=mean_reduction)
    one = train(name, ParallelDims(device=dims.device), records, packed=True)
    scale = max(float(v.abs().max()) for v in one["params"].values())
    diff = max(float((sharded["params"][k] - v).abs().max()) for k, v in one["params"].items())
    return {"param_diff": diff / scale, "norms": sharded["norms"], "one_norms": one["norms"],
            "state_bytes": sharded["state_bytes"], "replicated_bytes": one["state_bytes"],
            "params": sharded["params"], "microbatches": sharded["microbatches"],
            "all_dtensor": sharded["all_dtensor"]}
