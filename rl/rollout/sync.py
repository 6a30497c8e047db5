"""Weight sync: the policy's FSDP2 shards -> the rollout engine, bucket by bucket.

    sync_weights(engine, policy)      # after every optimizer step (rl/trainer/trainer.py)

`full_parameter_buckets(model, bucket_bytes)` yields `(name, full tensor)` for every
state-dict entry of `model` (stock names and shapes, the engine's `load_weights` contract)
a bucket at a time: the entries are cut, in state-dict order, into buckets of at most
`bucket_bytes` of full tensors, and each tensor of a bucket is all-gathered straight into
its own buffer (`_gather_dim0`: no flat receive buffer to copy out of; the same public
collective on NCCL and gloo, so the path a GPU runs is the one the CPU tests run). What a
rank holds beyond its shards is one bucket's full tensors plus the tensor the engine is
still copying from the previous bucket, never the full model: peak
about `bucket_bytes` + one tensor (+ the padding of uneven splits). Measured (bench/results/sync_memory.json,
a 485 MiB fp32 model whose largest tensor is 62.5 MiB; peak extra and seconds, side by side): on 2
gloo ranks 125 MiB / 0.92 s one tensor at a time (`full_parameters`), 136 MiB / 0.88 s with 64 MiB
buckets, 434 MiB / 0.86 s with the default (242.5 MiB), 548 MiB / 0.83 s with 256 MiB; on 4 ranks
127 / 2.42, 136 / 2.67, 243 / 2.76 (default 121 MiB), 548 MiB / 2.41 s. On gloo the peak is about
twice the bucket: its all-gather holds an output-sized buffer of its own per tensor (one 62.5 MiB
tensor gathered alone peaks at 125 MiB) until after the bucket's last gather; sampled between the
yielded tensors the resident set is one bucket above the start. NCCL gathers in place.
Bucket boundaries depend only on global shapes, so every rank cuts the same buckets; it is
a collective: every rank iterates to the end.

How a full tensor is rebuilt: FSDP2 shards a parameter on dim 0 like `torch.chunk` (rank i
holds rows [i c, min((i+1) c, d0)), c = ceil(d0 / world), trailing ranks maybe none), so
an all-gather of c-row slots puts rank i's rows at rows i c of a world x c-row buffer whose
first d0 rows are the full tensor. An expert weight is then gathered the same way over its
EP group (each EP rank holds E / ep contiguous experts). A tied weight (embeddings = lm
head) is gathered once and yielded under each of its names. Anything else (a DTensor not
sharded on dim 0 of a 1-D mesh) falls back to `full_tensor()`.

The default bucket (`rollout.sync_bucket_bytes=null`, `default_bucket_bytes`) is one rank's
share of the model: its full bytes / world, at most `DEFAULT_BUCKET_BYTES` (256 MiB) and at
least the largest tensor. The sync then holds no more full tensors at once than the rank's
own parameter shard, so its peak falls with world size as the training state does. A larger
bucket buys no time: every tensor is one all-gather whatever the bucket (`_gather_dim0`), the
bucket only decides how many are gathered before the engine copies them (bench/results/sync_memory.json:
the same seconds, within noise, from one tensor at a time to 256 MiB). The figure is the same on every rank
(global sizes, the world size), so every rank cuts the same buckets.

`check_bucket_bytes` is the start-up check: a bucket smaller than the largest tensor is
refused, naming the setting, the bucket and the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from runtime import compat
from model.lora import has_adapters, is_adapter
from model.moe import expert_owners

DEFAULT_BUCKET_BYTES = 256 << 20  # rollout.sync_bucket_bytes=null: at most this (default_bucket_bytes)
SETTING = "rollout.sync_bucket_bytes"


@dataclass
class _Entry:
    """One distinct tensor of the state dict: its names (several when tied), the value as
    stored (a shard or a plain tensor), the full shape and bytes, the EP owner (or None)."""

    names: list[str]
    value: torch.Tensor
    shape: tuple[int, ...]
    nbytes: int
    experts: nn.Module | None


def _entries(model: nn.Module, adapters_only: bool = False) -> list[_Entry]:
    owners = expert_owners(model)
    # tied weights are one Parameter under several names (identity: the same on every rank)
    ids = {name: id(t) for name, t in [*model.named_parameters(remove_duplicate=False),
                                        *model.named_buffers(remove_duplicate=False)]}
    by_id: dict[int, _Entry] = {}
    out = []
    for name, value in model.state_dict().items():
        if adapters_only and not is_adapter(name):
            continue
        key = ids.get(name, id(value))
        if key in by_id:
            by_id[key].names.append(name)
            continue
        owner = owners.get(name)
        ep = owner.ep_size if owner is not None else 1
        shape = (value.shape[0] * ep, *value.shape[1:]) if ep > 1 else tuple(value.shape)
        entry = _Entry([name], value, shape, math.prod(shape) * value.element_size(), owner if ep > 1 else None)
        by_id[key] = entry
        out.append(entry)
    return out


def tensor_order(model: nn.Module, adapters_only: bool = False) -> list[tuple[list[str], tuple[int, ...], torch.dtype]]:
    """Every distinct full tensor a sync of `model` yields (`adapters_only`: a LoRA sync once the
    engine holds the base), in its order: (its names, tied ones together; full shape; dtype). A
    model built on the meta device gives the order without data."""
    return [(e.names, e.shape, e.value.dtype) for e in _entries(model, adapters_only)]


def full_tensor_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every distinct full tensor the sync yields, by (first) name; their sum is the
    size of an unsharded copy of `model` in its own dtype."""
    return {e.names[0]: e.nbytes for e in _entries(model)}


def resolve_bucket_bytes(model: nn.Module, bucket_bytes: int | None, *, world: int | None = None) -> int:
    """`bucket_bytes`, checked against the largest tensor; None: `default_bucket_bytes` over
    `world` ranks (None: the default process group's size, 1 without one)."""
    return _limit(full_tensor_bytes(model), bucket_bytes, world)


def default_bucket_bytes(sizes: dict[str, int], world: int) -> int:
    """One rank's share of the model (the full bytes of `sizes` / `world`, rounded up), at most
    `DEFAULT_BUCKET_BYTES` and at least the largest tensor (the module docstring)."""
    share = -(-sum(sizes.values()) // max(world, 1))
    return max(min(DEFAULT_BUCKET_BYTES, share), max(sizes.values(), default=0))


def _limit(sizes: dict[str, int], bucket_bytes: int | None, world: int | None = None) -> int:
    if bucket_bytes is None:
        if world is None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return default_bucket_bytes(sizes, world)
    check_bucket_bytes(sizes, bucket_bytes)
    return int(bucket_bytes)


def check_bucket_bytes(sizes: dict[str, int], bucket_bytes: int) -> None:
    """A ValueError naming `rollout.sync_bucket_bytes`, its value and the largest tensor
    when a bucket cannot hold that tensor."""
    if not sizes:
        return
    name = max(sizes, key=sizes.get)
    if bucket_bytes < sizes[name]:
        raise ValueError(f"{SETTING}={bucket_bytes} ({bucket_bytes / 2**20:.1f} MiB) is smaller than the largest "
                         f"tensor, {name} ({sizes[name]} bytes, {sizes[name] / 2**20:.1f} MiB): a bucket holds "
                         f"whole tensors; set {SETTING} >= {sizes[name]} (or null: one rank's share of the "
                         f"model, at most {DEFAULT_BUCKET_BYTES >> 20} MiB and at least the largest tensor)")


@torch.no_grad()
def buckets(model: nn.Module, bucket_bytes: int | None = None, *,
            adapters_only: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The `(name, full tensor)` pairs of `model`'s state dict (`adapters_only`: its LoRA
    adapters' only), one bucket (a list) at a time."""
    entries = _entries(model, adapters_only)
    limit = _limit({e.names[0]: e.nbytes for e in entries}, bucket_bytes)
    bucket: list[_Entry] = []
    size = 0
    for entry in entries:
        if bucket and size + entry.nbytes > limit:
            yield _gather(bucket)
            bucket, size = [], 0
        bucket.append(entry)
        size += entry.nbytes
    if bucket:
        yield _gather(bucket)


@torch.no_grad()
def full_parameter_buckets(model: nn.Module, bucket_bytes: int | None = None, *,
                           adapters_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, full tensor)` for every state-dict entry of `model` (`adapters_only`: every
    adapter tensor), gathered a bucket at a time (see the module docstring); the engine's
    `load_weights` takes this stream."""
    for bucket in buckets(model, bucket_bytes, adapters_only=adapters_only):
        yield from bucket
        del bucket  # let the bucket go before the next is gathered (the consumer holds at most its last item)


def sync_weights(engine, model: nn.Module) -> None:
    """The engine gets `model`'s weights in buckets of `engine.sync_bucket_bytes` (None: the
    default); nothing for an engine that generates from the policy itself (`needs_sync`).
    LoRA (model/lora.py): once the engine holds the frozen base (`holds_base`), the adapters only."""
    if engine.needs_sync:
        adapters_only = engine.holds_base and has_adapters(model)
        engine.load_weights(full_parameter_buckets(model, engine.sync_bucket_bytes, adapters_only=adapters_only))


# ------------------------------------------------------------------ gathering
def _gather(bucket: list[_Entry]) -> list[tuple[str, torch.Tensor]]:
    """Full tensors of one bucket: the FSDP stage (dim-0 shards over each entry's mesh),
    then the EP stage (expert slices over each EP group), each grouped by (group, dtype)."""
    full: dict[int, torch.Tensor] = {}
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(bucket):
        v = e.value
        if not isinstance(v, DTensor):
            full[i] = v.detach()
        elif v.device_mesh.ndim == 1 and tuple(v.placements) == (Shard(0),) and v.dim() >= 1:
            groups.setdefault((v.device_mesh.get_group(), v.dtype), []).append(i)
        else:
            full[i] = v.full_tensor()
    for (group, _), idx in groups.items():
        for i, t in zip(idx, _gather_dim0([bucket[i].value.to_local() for i in idx],
                                          [bucket[i].value.shape for i in idx], group)):
            full[i] = t
    ep_groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(bucket):
        if e.experts is not None:
            ep_groups.setdefault((e.experts.ep_group, full[i].dtype), []).append(i)
    for (group, _), idx in ep_groups.items():
        for i, t in zip(idx, _gather_dim0([full[i] for i in idx], [bucket[i].shape for i in idx], group)):
            full[i] = t
    return [(name, full[i]) for i, e in enumerate(bucket) for name in e.names]


def _gather_dim0(locals_: list[torch.Tensor], shapes: list[tuple[int, ...]], group) -> list[torch.Tensor]:
    """Full tensors of `shapes` from each rank's `torch.chunk` share of dim 0 (`locals_`,
    this rank's), all-gathered over `group`.

    Each tensor is gathered straight into its own buffer of world x c rows (c = ceil(d0 /
    world)): rank i's rows land at rows i c .., so the first d0 rows are the full tensor and
    only trailing rows are padding. A full-size shard is sent as it is; a short or empty
    one (the last ranks of an uneven split) as a zero-padded copy of c rows.

    One all-gather per tensor, on every backend: one flat all-gather of the whole bucket would
    need a copy out of a rank-major buffer (gloo's coalesced all-gather does that: peak 2.5 x
    the bucket against 1.3 x one at a time on 2 ranks, bench/results/sync_memory.json), and coalescing
    on NCCL takes a private torch API; a collective's launch (tens of microseconds) times a
    model's few hundred tensors is a few milliseconds a sync."""
    world = dist.get_world_size(group)
    outs, ins = [], []
    for t, shape in zip(locals_, shapes):
        slot = -(-shape[0] // world) * math.prod(shape[1:])  # c rows
        outs.append(torch.empty(world * slot, dtype=t.dtype, device=t.device))
        if t.numel() == slot:
            ins.append(t.reshape(-1))
        else:
            padded = torch.zeros(slot, dtype=t.dtype, device=t.device)
            padded[:t.numel()] = t.reshape(-1)
            ins.append(padded)
    for out, inp in zip(outs, ins):
        compat.all_gather_single(out, inp, group=group)
    return [out[:math.prod(shape)].view(shape) for out, shape in zip(outs, shapes)]


class StagedWeights:
    """A host copy of the policy's full weights between the trainer and a rollout thread
    (`rollout.max_staleness` >= 2, rl/rollout/scheduler.py): `sync_weights(stage, model)` writes it like
    an engine (`needs_sync`, `sync_bucket_bytes`, `load_weights`), the thread hands `items()` to
    the real engine's `load_weights` when it is idle. The buffers are allocated on the first load
    and written in place after (pinned on CUDA, so the copies in and out run at full bus speed);
    `load_weights` returns with the copy complete, so the thread may read it at once."""

    needs_sync = True
    holds_base = True  # LoRA: the engine behind the stage got the base at build (rl/rollout/build.py): adapters only

    def __init__(self, sync_bucket_bytes: int | None, *, pin: bool = False) -> None:
        self.sync_bucket_bytes, self.pin = sync_bucket_bytes, pin
        self._host: dict[str, torch.Tensor] = {}

    def load_weights(self, weights) -> None:
        pairs = weights.items() if isinstance(weights, dict) else weights
        device = None
        for name, tensor in pairs:
            buf = self._host.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = self._host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
            device = tensor.device if tensor.is_cuda else device
        if device is not None:
            torch.cuda.current_stream(device).synchronize()  # the device->host copies are done before the hand-over

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._host.items())
