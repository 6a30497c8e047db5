"""Sharded checkpoint loading: each rank reads only its own shard of a Hugging Face checkpoint.

    lm = build_model(None, pretrained_path=path, device="meta")   # the module tree, no storage
    wrapper = parallelize(Actor(lm, ...), dims)                    # EP + FSDP2 on meta: shard shapes only
    load_sharded(wrapper, path, dims)                              # allocate the local shards, fill them

A rank never holds a full copy of the weights in host memory: every parameter's local
tensor (its FSDP2 `Shard(0)` rows; under EP, rows of this rank's experts only) is read as a
row range straight from the checkpoint's safetensors (`safe_open(...).get_slice(name)[a:b]`)
and cast into place. What `from_pretrained` would do is reproduced exactly, so the loaded
weights are bit-identical to a plain load (tests/test_sharded_load.py):

- names: the checkpoint's keys are the module's state-dict keys, except the fused experts
  of `qwen3_moe`, which transformers merges at load time from per-expert tensors
  (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what `save_pretrained` writes):
  `gate_up_proj[e] = cat(gate_proj[e], up_proj[e])`, `down_proj[e] = down_proj[e]`; here only
  the rank's experts are read. A family with any other load-time conversion is refused.
- dtype: the skeleton is built in `model.dtype`; each slice is cast by `copy_` (the same
  round-to-nearest a plain load's `.to(dtype)` does).
- tied weights: a tied output head is the input embedding's Parameter (named once), so it
  is read once and stays tied (checked after allocation).
- buffers: non-persistent buffers (rotary `inv_freq`) are recomputed by the model's own
  `_init_weights`, as `from_pretrained` does for them; tensors that were real before loading
  (a critic's value head, MoE load counters) keep their values.

Bad input fails before any weight is read, naming `model.pretrained_path`, the tensor and
both shapes (a config override that does not match the checkpoint, a missing tensor).
`.bin` checkpoints are read memory-mapped (`torch.load(mmap=True)`), sliced the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from model.lora import stock_name
from model.moe import EXPERT_PARAM_NAMES, ExpertParallelExperts
from model.parallel_dims import ParallelDims, local_tensor

KEY = "model.pretrained_path"
# The load-time key conversions of transformers (`conversion_mapping`, what `from_pretrained`
# applies to a checkpoint's keys) that `_source` reproduces: (sources, targets, operations).
# A family with any other conversion is refused rather than loaded wrongly.
SUPPORTED_CONVERSIONS = {
    (("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"), ("mlp.experts.gate_up_proj",),
     ("MergeModulelist(dim=0)", "Concatenate(dim=1)")),
    (("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), ("MergeModulelist(dim=0)",)),
}


# ------------------------------------------------------------------ the checkpoint
class Checkpoint:
    """The tensors of a checkpoint folder, by key: shapes from the headers, row ranges on demand.

    A safetensors file is memory-mapped for one read at a time (`safe_open` per read): only
    the pages of the rows read become resident, and only until the read returns, so a rank's
    resident set never holds more of the file than one slice."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._bin: dict[str, _MappedStateDict] = {}  # .bin files: mapped once, until close
        index = self._index()
        if index is None:
            raise ValueError(f"{KEY}={str(folder)!r}: no model.safetensors, model.safetensors.index.json, "
                             f"pytorch_model.bin or pytorch_model.bin.index.json in the folder")
        self.files: dict[str, str] = index  # key -> file name

    def _index(self) -> dict[str, str] | None:
        for single, sharded in (("model.safetensors", "model.safetensors.index.json"),
                                ("pytorch_model.bin", "pytorch_model.bin.index.json")):
            if (self.folder / sharded).is_file():
                return dict(json.loads((self.folder / sharded).read_text())["weight_map"])
            if (self.folder / single).is_file():
                return {key: single for key in self._read(single, lambda f: list(f.keys()))}
        return None

    def _read(self, file: str, fn: Callable):
        """`fn(handle)` on the open file (safetensors' `safe_open` interface)."""
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(str(self.folder / file), framework="pt", device="cpu") as handle:
                return fn(handle)
        if file not in self._bin:  # a zip-format torch.save: storages stay on disk, slices read their pages
            self._bin[file] = _MappedStateDict(torch.load(self.folder / file, map_location="cpu", mmap=True,
                                                          weights_only=True))
        return fn(self._bin[file])

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:  # every shape of the file from its header, at once
            file = self.files[key]
            mine = [k for k, f in self.files.items() if f == file]
            self._shapes.update(self._read(file, lambda f: {k: tuple(f.get_slice(k).get_shape()) for k in mine}))
        return self._shapes[key]

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows `[start, stop)` of dim 0 of tensor `key` (a 0-d tensor: itself), a fresh CPU tensor
        of the stored dtype."""
        if self.shape(key) == ():
            return self._read(self.files[key], lambda f: f.get_tensor(key))
        return self._read(self.files[key], lambda f: f.get_slice(key)[start:stop])

    def whole(self, keys: list[str]) -> list[torch.Tensor]:
        """The tensors `keys`, whole, each file opened once."""
        out = {}
        for file in dict.fromkeys(self.files[k] for k in keys):
            mine = [k for k in keys if self.files[k] == file]
            out.update(self._read(file, lambda f: {k: f.get_tensor(k) for k in mine}))
        return [out[k] for k in keys]

    def close(self) -> None:
        self._bin.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _MappedStateDict:
    """A memory-mapped `torch.load` state dict with safetensors' `keys`/`get_slice` interface."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self):
        return self.state.keys()

    def get_slice(self, key: str):
        return _MappedSlice(self.state[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.state[key].clone()


class _MappedSlice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.tensor[rows].clone()


# ----------------------------------------------------------------- where each row comes from
@dataclass
class _Source:
    """How to read rows of one model tensor from the checkpoint: its full (checkpoint) shape
    and a function `rows(start, stop)`."""

    shape: tuple[int, ...]
    rows: Callable[[int, int], torch.Tensor]
    what: str  # the checkpoint key(s), for messages


def _source(ckpt: Checkpoint, name: str) -> _Source | None:
    """The checkpoint source of the model tensor `name` (a Hugging Face state-dict key)."""
    if name in ckpt:
        return _Source(ckpt.shape(name), lambda a, b: ckpt.rows(name, a, b), name)
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or leaf not in EXPERT_PARAM_NAMES:
        return None
    # fused experts [E, *, *] from per-expert linears (transformers' MergeModulelist + Concatenate)
    parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    count = 0
    while f"{prefix}.{count}.{parts[0]}.weight" in ckpt:
        count += 1
    if count == 0:
        return None
    keys = [[f"{prefix}.{e}.{p}.weight" for p in parts] for e in range(count)]
    first = [ckpt.shape(k) for k in keys[0]]
    for row in keys:
        for k, want in zip(row, first):
            if k not in ckpt or ckpt.shape(k) != want:
                raise ValueError(f"{KEY}={str(ckpt.folder)!r}: expert tensor {k} is "
                                 f"{'missing' if k not in ckpt else list(ckpt.shape(k))}, expected {list(want)} "
                                 f"like {keys[0][parts.index(k.rsplit('.', 2)[1])]}")
    shape = (count, sum(s[0] for s in first), *first[0][1:])

    def rows(a: int, b: int) -> torch.Tensor:  # experts a..b-1 only
        if b <= a:
            return torch.empty((0, *shape[1:]), dtype=ckpt.rows(keys[0][0], 0, 0).dtype)
        flat, n = ckpt.whole([k for e in range(a, b) for k in keys[e]]), len(parts)
        return torch.stack([torch.cat(flat[i:i + n]) for i in range(0, len(flat), n)])

    return _Source(shape, rows, f"{prefix}.{{0..{count - 1}}}.{'+'.join(parts)}.weight")


# ----------------------------------------------------------------------- the load
@dataclass
class _Entry:
    name: str  # in the wrapper
    source: _Source
    offset: int  # first checkpoint row of this rank's local rows
    rows: int  # local rows


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
    head, embed = lm.get_output_embeddings(), lm.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    modules = dict(wrapper.named_modules())
    non_persistent = {f"{m}.{b}" if m else b for m, mod in modules.items() for b in mod._non_persistent_buffers_set}

    with Checkpoint(folder) as ckpt:
        plan, keep, init = [], {}, set()
        named = list(wrapper.named_parameters()) + list(wrapper.named_buffers())
        for name, tensor in named:  # named once each: a tied head is the embedding's Parameter
            if not local_tensor(tensor).is_meta:
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
            plan.append(_plan_entry(ckpt, folder, name, key, tensor, modules.get(owner)))

        _allocate(wrapper, lm, dims.device, tied)
        tensors = dict(wrapper.named_parameters()) | dict(wrapper.named_buffers())
        for name, value in keep.items():
            local_tensor(tensors[name]).copy_(value)
        for owner in sorted(init):
            lm._init_weights(modules[owner])
        for e in plan:
            local = local_tensor(tensors[e.name])
            if e.rows:
                local.copy_(e.source.rows(e.offset, e.offset + e.rows).reshape(local.shape))
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


def _plan_entry(ckpt: Checkpoint, folder: str, name: str, key: str, tensor: torch.Tensor,
                owner: nn.Module | None) -> _Entry:
    """Where the local rows of `tensor` (model key `key`) come from; a ValueError naming the
    folder, the key and both shapes when the checkpoint cannot fill it."""
    source = _source(ckpt, key)
    full = tuple(tensor.shape)  # global shape (a DTensor's), before FSDP; after EP for experts
    first = 0
    if isinstance(owner, ExpertParallelExperts):  # this EP rank's experts: rows first_expert.. of the checkpoint
        first = owner.first_expert
        full = (owner.num_experts, *full[1:])
    if source is None:
        raise ValueError(f"{KEY}={folder!r}: the checkpoint has no tensor {key} (shape {list(full)} in the model "
                         f"built from its config.json and model.overrides)")
    if tuple(source.shape) != full:
        raise ValueError(f"{KEY}={folder!r}: checkpoint tensor {source.what} has shape {list(source.shape)}, the "
                         f"model built from its config.json and model.overrides expects {list(full)} for {key}")
    offset, rows = _local_rows(tensor)
    return _Entry(name, source, first + offset, rows)
