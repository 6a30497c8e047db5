"""The training state as a checkpoint holds it (rl/trainer/checkpoint.py): one trained module
and its optimizer as DCP state dicts, and every rank's RNG states.

With world_size > 1 every entry is a DTensor, and DCP stores each shard at its global offsets,
so any layout loads any other's checkpoint. Expert weights take one extra step: FSDP2 describes
an expert parameter as a DTensor of global shape [E/ep, ...] over the ranks holding the *same*
EP shard, so EP ranks would write different tensors under one key. `_global_experts`
re-describes it, and its AdamW moments, as what it is: an [E, ...] tensor on the 2-D expert mesh
(ep, edp_cp), cut by EP rank and then by FSDP's torch.chunk within, which is DTensor's nested
(Shard(0), Shard(0)) (tests/test_checkpoint.py checks uneven and empty chunks).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard

from model.lora import has_adapters, is_adapter
from model.moe import is_expert_param
from runtime.parallel_dims import ParallelDims


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer, dims: ParallelDims) -> dict[str, Any]:
    """`{"weights": fqn -> tensor, "optimizer": {"state": fqn -> {...}, "param_groups": [...]}}`
    of one trained module, as DCP saves and loads it: sharded entries are DTensors of the
    parameter's global shape (expert shards re-described: see the module docstring); loading
    fills them in place. An optimizer that has not stepped yet gets its state initialised
    (a zero-lr step on zero gradients: the weights do not move). With LoRA adapters
    (model/lora.py) the frozen base is left out: it is rebuilt from the seed or
    `model.pretrained_path`, like the reference."""
    weights, optim = get_state_dict(module, optimizer, options=_options(module))
    if has_adapters(module):  # ignore_frozen_params keeps a tied weight's second name (lm_head of tied embeddings)
        weights = {k: v for k, v in weights.items() if is_adapter(k)}
    weights = {k: _global_experts(v, dims) if is_expert_param(k) else v for k, v in weights.items()}
    optim["state"] = {fqn: {k: _global_experts(v, dims) for k, v in s.items()} if is_expert_param(fqn) else s
                      for fqn, s in optim["state"].items()}
    return {"weights": weights, "optimizer": optim}


def load_sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                       dims: ParallelDims) -> None:
    """Put a `sharded_state` dict (filled by `dcp.load`) into the module and optimizer."""
    weights = {k: _fsdp_experts(v, dims) if is_expert_param(k) else v for k, v in state["weights"].items()}
    optim = dict(state["optimizer"])
    optim["state"] = {fqn: {k: _fsdp_experts(v, dims) for k, v in s.items()} if is_expert_param(fqn) else s
                      for fqn, s in optim["state"].items()}
    set_state_dict(module, optimizer, model_state_dict=weights, optim_state_dict=optim, options=_options(module))


def _options(module: nn.Module) -> StateDictOptions:
    """LoRA: the trainable adapters only (their frozen base is not checkpointed, nor expected)."""
    lora = has_adapters(module)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _global_experts(t: Any, dims: ParallelDims) -> Any:
    """An expert shard (FSDP2 DTensor [E/ep, ...] over `dims.expert_fsdp_mesh`) as the global
    [E, ...] DTensor over `dims.expert_mesh` (ep, edp_cp): the same local tensor, no copy."""
    if dims.ep == 1 or not isinstance(t, DTensor) or t.dim() == 0:
        return t
    if t.device_mesh != dims.expert_fsdp_mesh or tuple(t.placements) != (Shard(0),):
        raise RuntimeError(f"checkpoint: an expert entry is sharded as {t.placements} on {t.device_mesh}, expected "
                           f"Shard(0) on the expert FSDP mesh {dims.expert_fsdp_mesh}")
    shape = (t.shape[0] * dims.ep, *t.shape[1:])
    return DTensor.from_local(t.to_local(), dims.expert_mesh, [Shard(0), Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=t.stride())


def _fsdp_experts(t: Any, dims: ParallelDims) -> Any:
    """The inverse of `_global_experts`."""
    if dims.ep == 1 or not isinstance(t, DTensor) or t.dim() == 0:
        return t
    shape = (t.shape[0] // dims.ep, *t.shape[1:])
    return DTensor.from_local(t.to_local(), dims.expert_fsdp_mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=t.stride())


def rng_state(dims: ParallelDims) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate()}
    if dims.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(dims.device).numpy().tobytes()
    return state


def set_rng_state(state: dict[str, Any], dims: ParallelDims) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    random.setstate(state["python"])
    if "cuda" in state and dims.device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), dims.device)
