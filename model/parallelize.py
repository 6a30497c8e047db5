"""Applying the parallelisms to a model, and the collectives the trainer needs around it.

- `parallelize`: expert parallelism for MoE models (every MoE model gets `MoEBlock`s, an
  unsharded one with `ep_group=None`, so padding masks and routing replay always apply).
  Context parallelism lives in the forward (it shards the batch, not the model); here the
  model only switches to the "cp_varlen" attention.
- `sync_gradients`: the loss of each microbatch is already a share of the step's global
  mean, so gradients are SUMMED: dense parameters over every rank (dp x cp), expert
  shards over the ranks holding the same shard (the EDP group and its CP peers).
- `full_state_dict`: the unsharded weights (expert shards gathered) for the rollout copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from model.context_parallel import CP_VARLEN
from model.moe import (
    apply_expert_parallel,
    expert_load,
    gather_expert_parallel_state_dict,
    is_expert_param,
    moe_blocks,
)


def is_moe(model: nn.Module) -> bool:
    return getattr(model.config, "num_experts", 0) > 0 or bool(moe_blocks(model, strict=False))


def parallelize(model: nn.Module, dims) -> nn.Module:
    if dims.cp > 1:  # "cp_varlen" is "varlen" plus the K/V gather when a cp_context is passed
        model.set_attn_implementation(CP_VARLEN)
    if is_moe(model) and not moe_blocks(model, strict=False):
        apply_expert_parallel(model, dims.ep_group if dims.ep > 1 else None)
    elif dims.ep > 1:
        raise ValueError(f"parallel.ep={dims.ep} but {type(model).__name__} has no experts; use ep=1 for dense models")
    return model


def sync_gradients(module: nn.Module, dims) -> None:
    """All-reduce (sum) gradients: dense over the world, experts over their EDP group."""
    if not dist.is_initialized() or dims.world_size == 1:
        return
    dense, experts = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # every rank must join each collective
            (experts if is_expert_param(name) and dims.ep > 1 else dense).append(p.grad)
    _all_reduce_flat(dense, None)
    # an expert shard lives on every rank of its EDP group and on their CP peers
    for group in (dims.edp_group, dims.cp_group):
        if experts and group is not None:
            _all_reduce_flat(experts, group)


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective instead of one per tensor
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def full_state_dict(model: nn.Module, dims) -> dict[str, torch.Tensor]:
    if moe_blocks(model, strict=False):
        return gather_expert_parallel_state_dict(model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def expert_load_metrics(model: nn.Module, dims) -> dict[str, float]:
    """Tokens dispatched per expert since the last `reset_expert_load`, summed over all ranks."""
    if not moe_blocks(model, strict=False):
        return {}
    load = expert_load(model, dist.group.WORLD if dist.is_initialized() else None)
    per_expert = load["per_expert"].double()
    mean = float(per_expert.mean())
    return {
        "expert_load_max_over_mean": float(per_expert.max()) / mean if mean else 0.0,
        "ep_rank_load_max_over_mean": load["imbalance"],
        "expert_tokens": float(per_expert.sum()),
    }
