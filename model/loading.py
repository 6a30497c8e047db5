"""Sharded checkpoint loading: each rank reads only its own shard of a Hugging Face checkpoint.

    lm = build_model(None, pretrained_path=path, device="meta")   # the module tree, no storage
    wrapper = parallelize(Actor(lm, ...), dims)                    # EP + FSDP2 on meta: shard shapes only
    load_sharded(wrapper, path, dims)                              # allocate the local shards, fill them

The reading is torch's own: `dcp.load(state, storage_reader=HuggingFaceStorageReader(path))`
into the parallelized model's tensors. For an FSDP2 DTensor DCP reads this rank's chunk only,
as a slice of the safetensors (`safe_open(...).get_slice(key)[rows]`), and `copy_`s it into
the local shard: the same round-to-nearest cast a plain load's `.to(dtype)` does. A rank never
holds a full copy of the weights, and the loaded weights are bit-identical to a plain
`from_pretrained` (tests/test_sharded_load.py; per-rank peak memory in bench/load_memory.py).
What is left here:

- the fused experts of `qwen3_moe`: transformers merges them at load time from per-expert
  tensors (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what `save_pretrained`
  writes): `gate_up_proj[e] = cat(gate_proj[e], up_proj[e])`, `down_proj[e] = down_proj[e]`.
  The key adapter gives DCP, for each expert in this rank's rows (under EP: its experts
  only), the per-expert keys as views of those rows. A family with any other load-time
  conversion is refused.
- tied weights: a tied output head is the input embedding's Parameter (named once), so it
  is read once and stays tied (checked after allocation).
- buffers: non-persistent buffers (rotary `inv_freq`) are recomputed by the model's own
  `_init_weights`, as `from_pretrained` does for them; tensors that were real before loading
  (a critic's value head, MoE load counters) keep their values.

Bad input fails before any weight is read, naming `model.pretrained_path`, the tensor and
both shapes (a config override that does not match the checkpoint, a missing tensor).
Safetensors only: a `.bin` checkpoint is refused with the conversion to run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from runtime.library_noise import quiet_single_process
from model.lora import stock_name
from model.moe import EXPERT_PARAM_NAMES, ExpertParallelExperts
from runtime.parallel_dims import ParallelDims, local_tensor

KEY = "model.pretrained_path"
# The load-time key conversions of transformers (`conversion_mapping`, what `from_pretrained`
# applies to a checkpoint's keys) that `_expert_keys` reproduces: (sources, targets, operations).
# A family with any other conversion is refused rather than loaded wrongly.
SUPPORTED_CONVERSIONS = {
    (("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"), ("mlp.experts.gate_up_proj",),
     ("MergeModulelist(dim=0)", "Concatenate(dim=1)")),
    (("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), ("MergeModulelist(dim=0)",)),
}


class _SliceReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader with one memory map per read: its own keeps a file mapped for all
    of the file's reads, so every page read stays resident until the end (the whole file at world
    size 1); here only the slice being read is (bench/load_memory.py)."""

    def read_data(self, plan, planner):
        from safetensors import safe_open

        for item in plan.items:
            with safe_open(filename=self.storage_data[item.storage_index].relative_path, framework="pt") as f:
                self._process_read_request(f, item, planner)
        return super().read_data(dataclasses.replace(plan, items=[]), planner)


def _reader(folder: str) -> tuple[HuggingFaceStorageReader, dict[str, tuple[int, ...]]]:
    """DCP's reader of the folder's safetensors and every tensor's shape (headers only)."""
    if not any(Path(folder).glob("*.safetensors")):
        found = "pytorch_model.bin weights" if any(Path(folder).glob("pytorch_model*.bin")) else "no weights"
        raise ValueError(f"{KEY}={folder!r}: {found}; the sharded loader reads safetensors only (convert once: "
                         f"`from_pretrained(path).save_pretrained(path, safe_serialization=True)`)")
    reader = _SliceReader(folder)
    return reader, {k: tuple(md.size) for k, md in reader.read_metadata().state_dict_metadata.items()}


# ------------------------------------------------------------------ the fused experts
def _expert_keys(shapes: dict[str, tuple[int, ...]], folder: str,
                 key: str) -> tuple[tuple[int, ...], list[list[str]], str] | None:
    """The full shape of the fused expert tensor `key` ([E, *, *], transformers' MergeModulelist +
    Concatenate), its per-expert checkpoint keys expert by expert, and their description for
    messages; None when `key` is not one."""
    prefix, _, leaf = key.rpartition(".")
    if not prefix.endswith("mlp.experts") or leaf not in EXPERT_PARAM_NAMES:
        return None
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    count = 0
    while f"{prefix}.{count}.{parts[0]}.weight" in shapes:
        count += 1
    if count == 0:
        return None
    keys = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(count)]
    first = [shapes[k] for k in keys[0]]
    for row in keys:
        for k, want, like in zip(row, first, keys[0]):
            if shapes.get(k) != want:
                raise ValueError(f"{KEY}={folder!r}: expert tensor {k} is "
                                 f"{list(shapes[k]) if k in shapes else 'missing'}, expected {list(want)} like {like}")
    return ((count, sum(s[0] for s in first), *first[0][1:]), keys,
            f"{prefix}.{{0..{count - 1}}}.{'+'.join(parts)}.weight")


def _expert_views(local: torch.Tensor, keys: list[list[str]], first: int,
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint key -> the view of `local` (this rank's rows of a fused expert
    tensor, global experts `first`..) it fills: gate_proj then up_proj along dim 1."""
    views = {}
    for i in range(local.shape[0]):
        row = 0
        for key in keys[first + i]:
            views[key] = local[i, row:row + shapes[key][0]]
            row += shapes[key][0]
    return views


# ----------------------------------------------------------------------- the load
@dataclass
class _Entry:
    name: str  # in the wrapper
    key: str  # in the checkpoint, or the fused expert tensor's model key
    experts: list[list[str]] | None  # a fused expert tensor's per-expert keys
    first_expert: int  # under EP: this rank's first global expert


def _lm_prefix(wrapper: nn.Module) -> tuple[str, nn.Module]:
    """The outermost Hugging Face model inside `wrapper` and its name prefix ("" when it is the wrapper)."""
    from transformers import PreTrainedModel

    for name, module in wrapper.named_modules():
        if isinstance(module, PreTrainedModel):
            return (name + "." if name else ""), module
    raise ValueError(f"load_sharded: {type(wrapper).__name__} holds no Hugging Face PreTrainedModel")


def _check_conversions(lm: nn.Module, folder: str) -> None:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    model_type = lm.config.model_type
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        described = (tuple(_patterns(conversion.source_patterns)), tuple(_patterns(conversion.target_patterns)),
                     tuple(f"{type(op).__name__}(dim={getattr(op, 'dim', None)})"
                           for op in getattr(conversion, "operations", [])))
        if described not in SUPPORTED_CONVERSIONS:
            raise ValueError(f"{KEY}={folder!r}: a {model_type!r} checkpoint needs the load-time key conversion "
                             f"{described}, which the sharded loader does not reproduce")


def _patterns(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """(first row, rows) of this rank's local part of `tensor` along dim 0 (the whole tensor
    when it is not a DTensor); only dim-0 sharding (FSDP2's Shard(0)) is expected."""
    if tensor.dim() == 0:
        return 0, 1
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    if any(not isinstance(p, Shard) or p.dim != 0 for p in tensor.placements if not p.is_replicate()):
        raise ValueError(f"load_sharded: placements {tensor.placements} are not dim-0 shards")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return int(offset[0]), int(shape[0])


@torch.no_grad()
def load_sharded(wrapper: nn.Module, path: str | Path, dims: ParallelDims) -> nn.Module:
    """Allocate every meta tensor of `wrapper` (already parallelized) on `dims.device` and fill
    it from the checkpoint folder `path`: parameters and persistent buffers with this rank's
    rows read from the checkpoint, non-persistent buffers by the model's `_init_weights`.
    Tensors that are not on meta keep their values. Returns `wrapper`."""
    folder = str(path)
    prefix, lm = _lm_prefix(wrapper)
    _check_conversions(lm, folder)
    reader, shapes = _reader(folder)
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    modules = dict(wrapper.named_modules())
    non_persistent = {f"{m}.{b}" if m else b for m, mod in modules.items() for b in mod._non_persistent_buffers_set}

    plan, keep, init = [], {}, set()
    for name, tensor in list(wrapper.named_parameters()) + list(wrapper.named_buffers()):
        if not local_tensor(tensor).is_meta:  # named once each: a tied head is the embedding's Parameter
            keep[name] = local_tensor(tensor).detach().clone()
            continue
        owner = name.rpartition(".")[0]
        if name in non_persistent:
            init.add(owner)
            continue
        if not name.startswith(prefix):
            raise ValueError(f"load_sharded: {name} is on the meta device but outside the Hugging Face model "
                             f"(nothing in the checkpoint fills it)")
        key = stock_name(name[len(prefix):])  # a LoRA-wrapped linear's base weight: its checkpoint key
        plan.append(_plan_entry(shapes, folder, name, key, tensor, modules.get(owner)))

    _allocate(wrapper, lm, dims.device, tied)
    tensors = dict(wrapper.named_parameters()) | dict(wrapper.named_buffers())
    for name, value in keep.items():
        local_tensor(tensors[name]).copy_(value)
    for owner in sorted(init):
        lm._init_weights(modules[owner])
    state = {}  # checkpoint key -> what it fills: the DTensor itself, or a view of this rank's expert rows
    for e in plan:
        if e.experts is None:
            state[e.key] = tensors[e.name]
        else:
            state |= _expert_views(local_tensor(tensors[e.name]), e.experts,
                                   e.first_expert + _local_rows(tensors[e.name])[0], shapes)
    with quiet_single_process():
        # with dedicated rollout ranks the trainers read alone (parallel.rollout_ranks: the trainers' group)
        group = dims.trainer_group if dims.rollout_ranks else None
        alone = not dist.is_initialized() or bool(dims.rollout_ranks and group is None)  # one trainer: no collective
        dcp.load(state, storage_reader=reader, no_dist=alone, process_group=group)
    return wrapper


@torch.no_grad()
def materialize(lm: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate an unsharded meta model (`build_model(..., device="meta")`) on `device` without
    reading a value: parameters and persistent buffers are left uninitialized for the caller
    to fill whole (the rollout replica: the first weight sync, which refuses a partial state
    dict), non-persistent buffers (rotary `inv_freq`) are computed by the model's
    `_init_weights`, a tied head is tied again. Returns `lm`. No checkpoint read, no host copy:
    a replica on a GPU costs its device bytes only."""
    real = [name for name, t in [*lm.named_parameters(), *lm.named_buffers()] if not t.is_meta]
    if real:  # allocating would throw their values away
        raise ValueError(f"materialize: {len(real)} tensors of the model already hold values (e.g. {real[0]}); "
                         "it takes a model built on the meta device")
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    owners = [mod for mod in lm.modules() if mod._non_persistent_buffers_set]
    _allocate(lm, lm, torch.device(device), tied)
    for mod in owners:
        lm._init_weights(mod)
    return lm


def _allocate(module: nn.Module, lm: nn.Module, device: torch.device, tied: bool) -> None:
    """`module.to_empty(device)`, keeping a tied head tied: a plain module's `to_empty` gives
    each module its own new Parameter (FSDP2 keeps shared parameters shared itself)."""
    module.to_empty(device=device)
    if tied and lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
        lm.tie_weights()
        if lm.get_output_embeddings().weight is not lm.get_input_embeddings().weight:
            raise RuntimeError("the tied output head came apart while allocating")


def _plan_entry(shapes: dict[str, tuple[int, ...]], folder: str, name: str, key: str, tensor: torch.Tensor,
                owner: nn.Module | None) -> _Entry:
    """Where `tensor` (model key `key`) comes from; a ValueError naming the folder, the key and
    both shapes when the checkpoint cannot fill it."""
    full = tuple(tensor.shape)  # global shape (a DTensor's), before FSDP; after EP for experts
    first = 0
    if isinstance(owner, ExpertParallelExperts):  # this EP rank's experts: rows first_expert.. of the checkpoint
        first = owner.first_expert
        full = (owner.num_experts, *full[1:])
    shape, experts, what = (shapes[key], None, key) if key in shapes else \
        _expert_keys(shapes, folder, key) or (None, None, key)
    if shape is None:
        raise ValueError(f"{KEY}={folder!r}: the checkpoint has no tensor {key} (shape {list(full)} in the model "
                         f"built from its config.json and model.overrides)")
    if experts is None and isinstance(owner, ExpertParallelExperts) and tensor.shape[0] != owner.num_experts:
        raise ValueError(f"{KEY}={folder!r}: {key} is stored fused ([experts, ...]) and parallel.ep splits the "
                         f"experts: save the checkpoint with transformers' save_pretrained (per-expert tensors)")
    if shape != full:
        raise ValueError(f"{KEY}={folder!r}: checkpoint tensor {what} has shape {list(shape)}, the "
                         f"model built from its config.json and model.overrides expects {list(full)} for {key}")
    return _Entry(name, key, experts, first)
