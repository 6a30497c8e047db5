"""Applying the parallelisms to a model, and the collectives the trainer needs around it.

    parallelize(actor, dims, param_dtype=torch.bfloat16, activation_checkpointing=True)

is the one composition (torchtitan's `parallelize_fn`); it calls each `apply_*` once, in
this order, each its own small function here, side by side, each a no-op where its size is 1:

1. `apply_context_parallel`: `cp_varlen` attention when cp > 1 (context parallelism shards
   the batch, not the model; the K/V gather lives in model/context_parallel.py);
2. `apply_expert_parallel`: every MoE model gets `MoEBlock`s (model/moe.py), so padding
   masks and routing replay always apply; with ep > 1 each rank keeps E/ep experts;
3. `apply_activation_checkpointing`: per decoder layer (when asked);
4. `apply_fsdp`: FSDP2 (`fully_shard`) when world_size > 1: each expert module over the
   ranks holding its shard (`dims.expert_fsdp_mesh`, edp x cp), each decoder layer, the input
   embedding when it is not tied to the lm head, and then the wrapper itself (Actor / Critic:
   its forward reads the lm head weight directly, so the lm head and the final norm are the
   root's) over every rank (`dims.fsdp_mesh`). A unit's gradients are reduce-scattered as one
   flat buffer in `reduce_dtype` (fp32; gloo also copies its input): the embedding and the lm
   head in one unit would make that transient two vocabulary matrices (0.6 GB a rank for
   49152 x 768, whatever the world size), each in its own unit one. A tied weight is read at
   both ends of the forward: it stays in the root, whose unshard covers both.
   Every microbatch loss is already a share of the step's global mean,
   so gradients are SUMMED (divide factor 1): the sum over (dp, cp) of each rank's
   gradient is the one-process gradient. On the CPU each sharded layer's backward first
   hands the host memory freed by the layer before it back to the OS (runtime/allocator.py).

A model on the meta device (a checkpoint's skeleton, `build_model(..., device="meta")`) is
parallelized the same way, shapes only; `model.loading.load_sharded` then reads each
rank's shard from the checkpoint.

`clip_grad_norm_` clips by the global norm (every dense and expert parameter counted once,
the same value on every rank). `full_parameters` yields the unsharded weights one tensor at
a time for the rollout copy.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from model import moe
from runtime.allocator import release_memory
from model.context_parallel import CP_VARLEN
from model.moe import expert_load, expert_owners, is_moe, moe_blocks, moe_state
from runtime.parallel_dims import ParallelDims, local_tensor


def parallelize(wrapper: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype | None = None,
                activation_checkpointing: bool = False, dense_ok: bool = False) -> nn.Module:
    """Apply CP attention, EP, activation checkpointing and FSDP2 to `wrapper` (an Actor or
    Critic holding a Hugging Face causal LM in `.model`) in place; returns it. `dense_ok`: a
    dense model under ep > 1 is whole on every EP rank (a distillation teacher beside an MoE
    policy) instead of an error."""
    model = wrapper.model
    if not on_meta(wrapper):  # a meta skeleton gets its storage on the device from load_sharded
        model.to(dims.device)
    apply_context_parallel(model, dims)
    apply_expert_parallel(model, dims, dense_ok=dense_ok)
    if not on_meta(wrapper):
        wrapper.to(dims.device)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(wrapper, dims, param_dtype=param_dtype)
    return wrapper


def on_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of `module` has no storage yet (the meta device)."""
    return any(local_tensor(t).is_meta for t in (*module.parameters(), *module.buffers()))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers)


# ------------------------------------------------------------ context parallelism
def apply_context_parallel(model: nn.Module, dims: ParallelDims) -> None:
    """cp > 1: attention through "cp_varlen" ("varlen" plus the K/V gather over the CP group
    when the forward passes a cp_context); the model's weights are not sharded by CP."""
    if dims.cp > 1:
        model.set_attn_implementation(CP_VARLEN)


# ------------------------------------------------------------- expert parallelism
def apply_expert_parallel(model: nn.Module, dims: ParallelDims, *, dense_ok: bool = False) -> None:
    """Every MoE model's sparse blocks become `MoEBlock`s holding this EP rank's experts
    (`model.moe.shard_experts` over `dims.ep_group`; all experts when ep == 1), once;
    ep > 1 on a dense model is an error naming parallel.ep (unless `dense_ok`)."""
    if not is_moe(model):
        if dims.ep > 1 and not dense_ok:
            raise ValueError(f"parallel.ep={dims.ep} but {type(model).__name__} has no experts; use ep=1 for dense "
                             f"models")
        return
    if not moe_blocks(model, strict=False):
        moe.shard_experts(model, dims.ep_group)


# -------------------------------------------------------- activation checkpointing
def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations.

    The layer's forward (inside its `__call__`, so FSDP's hooks stay outside the
    recomputed region) runs under a non-reentrant `checkpoint`. MoE blocks read per-forward
    state (padding mask, routing replay); the recompute runs later, inside backward, so the
    state of the first run is captured and put back for the recompute, which also does not
    count the expert load or record routing a second time.
    """
    for layer in decoder_layers(model):
        if getattr(layer, "_checkpointed", False):
            continue
        layer.forward = _checkpointed(layer.forward, moe_blocks(layer, strict=False))
        layer._checkpointed = True


def _checkpointed(forward, blocks):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        state, calls = moe_state(blocks), [0]

        def body(*inner):
            calls[0] += 1
            with moe_state(blocks, state, recompute=calls[0] > 1):
                return forward(*inner, **kwargs)

        return checkpoint(body, *args, use_reentrant=False)

    return run


# ------------------------------------------------------------------------ FSDP2
def apply_fsdp(wrapper: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 over the world (a no-op for one process): experts over `dims.expert_fsdp_mesh`,
    decoder layers, an untied input embedding and the wrapper over `dims.fsdp_mesh`;
    gradients summed. A frozen `wrapper` (no parameter requires grad) holds only its shards
    between forwards, its root's included."""
    if dims.fsdp_mesh is None:  # one process without a process group (model.param_dtype gives it one)
        return
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    model = wrapper.model
    for block in moe_blocks(model, strict=False):
        fully_shard(block.experts, mesh=dims.expert_fsdp_mesh, mp_policy=mp)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dims.fsdp_mesh, mp_policy=mp)
        if dims.device.type == "cpu":  # host transients: the layer's backward starts once the last one's are freed
            layer.register_full_backward_pre_hook(_release_host_memory)
    if not tied_embeddings(model):  # a tied weight is read at both ends: the root's unshard covers both
        fully_shard(model.get_input_embeddings(), mesh=dims.fsdp_mesh, mp_policy=mp)
    # FSDP2 leaves the root (lm head, final norm, tied embeddings) gathered after forward for the backward
    # that reshards it; a frozen model (the reference copy, the teacher) has none: resharded after each forward
    frozen = not any(p.requires_grad for p in wrapper.parameters())
    fully_shard(wrapper, mesh=dims.fsdp_mesh, mp_policy=mp, reshard_after_forward=True if frozen else None)
    for module in wrapper.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # SUM: each microbatch loss is a share of the global mean
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM collective (gloo has no PREMUL_SUM)


def _release_host_memory(module: nn.Module, grad_output) -> None:
    """Before a sharded layer's backward: the previous layer's unsharded gradients and
    weights, which FSDP2 has just reduce-scattered and freed, back to the OS (runtime/allocator.py)."""
    release_memory()


def sharded_on_host(wrapper: nn.Module) -> bool:
    """True when FSDP2 sharded `wrapper` on the CPU: its rank's host memory should fall with the
    world size, so the trainer also hands back what each stage of a step freed (runtime/allocator.py)."""
    return isinstance(wrapper, FSDPModule) and next(wrapper.parameters()).device.type == "cpu"


def tied_embeddings(model: nn.Module) -> bool:
    """True when the causal LM's input embedding and lm head are one Parameter."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


# --------------------------------------------------------------- gradient norm
@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm before.

    Each rank holds a disjoint piece of the model's gradients (FSDP shards; expert shards
    of different EP ranks are different experts), so the global norm is the square root of
    the sum over all ranks of the local squared norms: the same value on every rank. Each
    local norm is one fp32 reduction of the gradient as it is (no widened copy: an fp64 copy
    was twice an fp32 gradient, four times a bf16 one); their squares are summed in fp32.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [local_tensor(g) for g in grads]
    if dims.distributed and any(not isinstance(g, DTensor) for g in grads):
        raise RuntimeError("clip_grad_norm_: with world_size > 1 every gradient must be an FSDP shard (DTensor)")
    sq = torch.zeros((), dtype=torch.float32, device=dims.device)
    for g in local:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    if dims.distributed:
        dist.all_reduce(sq, group=dims.trainer_group)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
    return norm.float()


# ---------------------------------------------------------------- weight sync
@torch.no_grad()
def full_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` for every state-dict entry of `model` (stock names and shapes),
    one tensor at a time: an FSDP shard is all-gathered (`full_tensor`), an expert shard is
    then all-gathered over its EP group. A collective: every rank iterates it to the end.
    Peak extra memory is one full tensor (the largest: an expert weight `[E, 2I, H]`)."""
    experts = expert_owners(model)
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        owner = experts.get(name)
        if owner is not None and owner.ep_size > 1:
            parts = [torch.empty_like(full) for _ in range(owner.ep_size)]
            dist.all_gather(parts, full.contiguous(), group=owner.ep_group)
            full = torch.cat(parts)
        yield name, full


def expert_load_metrics(model: nn.Module, dims: ParallelDims) -> dict[str, float]:
    """Tokens dispatched per expert since the last `reset_expert_load`, summed over all ranks."""
    if not moe_blocks(model, strict=False):
        return {}
    load = expert_load(model, dims.trainer_group)
    per_expert = load["per_expert"].double()
    mean = float(per_expert.mean())
    per_layer = load["per_layer"].double()
    layers = {f"expert_load_max_over_mean_layer{i}": float(row.max() / row.mean()) if row.mean() > 0 else 0.0
              for i, row in enumerate(per_layer)}
    return {
        **layers,
        "expert_load_max_over_mean": float(per_expert.max()) / mean if mean else 0.0,
        "ep_rank_load_max_over_mean": load["imbalance"],
        "expert_tokens": float(per_expert.sum()),
    }
