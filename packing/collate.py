"""The one collate: unpadded records -> a padded `[B, T]` batch or a THD pack `[1, N]`.

The pack's token schema (`input_ids`, restarting `position_ids`, per-sequence lengths)
is the one nemo-automodel's `pack_features_for_thd` + `packed_sequence_thd_collater`
build; `packing.layout.packed_positions` computes the positions with tensor ops, and tests/test_collate.py proves it
byte-identical to AutoModel's output.

Every action-axis field `[T_i - 1]` gets one trailing masked slot in a pack, so all
per-token tensors share the `[1, N]` axis: slot j of the pack scores token j+1 of the
same sequence, and the last slot of each sequence (which would score the next
sequence's first token) is 0 / False. A pack also carries its shared-prompt layout
(`shared_prompts`, packing/prompts.py), computed here once per collated batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from packing.experience import Experience, Kind, routing_shape
from packing.layout import packed_positions
from packing.prompts import shared_prompts

ROUTING_PAD = -1  # "no record: keep live routing"


def make_experience_batch(items: Sequence[Experience], packed: bool = False, *, pad_token_id: int = 0) -> Experience:
    """Collate per-sample records into one padded (`packed=False`) or packed batch."""
    _validate(items, packed)
    lengths = [item.sequences.numel() for item in items]
    batch: dict = {}

    if packed:
        batch["sequences"] = torch.cat([item.sequences for item in items]).to(torch.int64).unsqueeze(0)
        batch["position_ids"] = packed_positions([item.sequences.numel() for item in items])
        batch["packed_seq_lens"] = lengths
        for name in Experience.names(Kind.ACTION):
            values = _gather(items, name)
            if values is not None:
                # [T_i - 1] -> [T_i]: the trailing slot would score the next sequence's first token
                batch[name] = torch.cat([F.pad(v, (0, 1)) for v in values]).unsqueeze(0)
        # once per pack, here on the host: the forward only reads it (model/actor.py _shared_prompt_view)
        batch["shared_prompts"] = shared_prompts(batch["sequences"], batch["position_ids"], lengths,
                                                 batch.get("action_mask"))
    else:
        max_len = max(lengths)
        batch["sequences"] = _pad_stack([item.sequences for item in items], max_len, pad_token_id)
        batch["attention_mask"] = torch.arange(max_len) < torch.tensor(lengths).unsqueeze(1)
        for name in Experience.names(Kind.ACTION):
            values = _gather(items, name)
            if values is not None:
                batch[name] = _pad_stack(values, max_len - 1, 0)

    for name in Experience.names(Kind.ROUTING):
        values = _routing(items, name)
        if values is None:
            continue
        if packed:
            batch[name] = torch.cat(values, dim=-1).unsqueeze(0)
        else:
            batch[name] = _pad_stack(values, max(lengths), ROUTING_PAD)

    for name in Experience.names(Kind.EPISODE):
        values = _gather(items, name)
        if values is not None:
            batch[name] = torch.stack([torch.as_tensor(v) for v in values])

    for name in Experience.names(Kind.MEDIA):
        values = _gather(items, name)
        if values is not None:
            batch[name] = values  # opaque per sample: a list, so split() can hand each back

    return Experience(**batch)


# --------------------------------------------------------------------- tokens
def _pad_stack(values: list[torch.Tensor], length: int, pad_value) -> torch.Tensor:
    """Right-pad each tensor's last axis to `length` and stack on a new batch axis."""
    return torch.stack([F.pad(v, (0, length - v.shape[-1]), value=pad_value) for v in values])


# ----------------------------------------------------------------- gathering
def _gather(items: Sequence[Experience], name: str) -> list | None:
    """The field across items: None if absent everywhere; an error if only on some."""
    values = [getattr(item, name) for item in items]
    missing = [i for i, v in enumerate(values) if v is None]
    if len(missing) == len(values):
        return None
    if missing:
        first = next(i for i, v in enumerate(values) if v is not None)
        raise ValueError(
            f"field '{name}' is present on item {first} but missing (None) on item {missing[0]} "
            f"({len(missing)} of {len(values)} items); give it on every item or on none"
        )
    return values


def _routing(items: Sequence[Experience], name: str) -> list[torch.Tensor] | None:
    """Routing tensors `[L, K, T_i]`; items without a record get a `-1` block (live routing)."""
    present = [getattr(item, name) for item in items if getattr(item, name) is not None]
    if not present:
        return None
    layers, topk = present[0].shape[:2]
    like = present[0]
    return [
        item_value
        if (item_value := getattr(item, name)) is not None
        else torch.full((layers, topk, item.sequences.numel()), ROUTING_PAD, dtype=like.dtype)
        for item in items
    ]


# ---------------------------------------------------------------- validation
def _validate(items: Sequence[Experience], packed: bool) -> None:
    if len(items) == 0:
        raise ValueError("make_experience_batch: items is empty; need at least one Experience record")
    for i, item in enumerate(items):
        if not isinstance(item, Experience):
            raise TypeError(f"item {i}: expected an Experience record, got {type(item).__name__}")
        seq = item.sequences
        if seq is None or seq.dim() != 1:
            shape = None if seq is None else tuple(seq.shape)
            raise ValueError(f"item {i}: field 'sequences' has shape {shape}, expected a record [T] (no batch axis)")
        n = seq.numel()
        if n == 0:
            raise ValueError(f"item {i}: field 'sequences' has shape (0,): a zero-length sample cannot be collated")
        for name, value in item.present(Kind.ACTION).items():
            if tuple(value.shape) != (n - 1,):
                raise ValueError(
                    f"item {i}: action field '{name}' has shape {tuple(value.shape)}, expected ({n - 1},) = [T-1] "
                    f"for sequences of length T={n}"
                )
        if packed:
            media = item.present(Kind.MEDIA)
            if media:
                name, value = next(iter(media.items()))
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"item {i}: media field '{name}' ({shape}) cannot be packed; "
                    f"collate with packed=False for multimodal samples"
                )

    routing_shape(items)  # [L, K, T] each, one [L, K]
    # one dtype per field across items
    for kind in (Kind.TOKEN, Kind.ACTION, Kind.ROUTING, Kind.EPISODE):
        for name in Experience.names(kind):
            tensors = [(i, v) for i, item in enumerate(items) if isinstance(v := getattr(item, name), torch.Tensor)]
            if not tensors:
                continue
            j, ref = tensors[0]
            for i, value in tensors[1:]:
                if value.dtype != ref.dtype:
                    raise ValueError(f"item {i}: field '{name}' has dtype {value.dtype}, but item {j} has {ref.dtype}")
