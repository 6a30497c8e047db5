"""`Experience`: one dataclass for a per-sample record and for a collated batch.

Three layouts share the class:

* record  - one sample, no batch axis: `sequences [T]`, action fields `[T-1]`,
            `routed_experts [L, K, T]`, episode fields 0-d.
* padded  - right-padded batch: `sequences [B, T]`, `attention_mask [B, T]`,
            action fields `[B, T-1]`, `routed_experts [B, L, K, T]` (-1 padded),
            episode fields `[B]`.
* packed  - THD pack: `sequences [1, N]`, `position_ids [1, N]`, action fields
            `[1, N]` (one trailing masked slot per sequence), `routed_experts
            [1, L, K, N]`, `packed_seq_lens` (python ints), episode fields `[B]`,
            and `shared_prompts` (packing/prompts.py: the compressed row `[1, N_c]` of
            the prompts its GRPO groups repeat, built once by the collate; None when
            no prompt repeats).

Every field declares its kind once, in its metadata, so the collate, `split` and
`to(device)` iterate kinds and never list field names a second time.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from packing.layout import cu_seqlens, to_device
from packing.prompts import SharedPrompts


class Kind(enum.Enum):
    TOKEN = "token"  # one entry per token: [T] / [B, T] / [1, N]
    ACTION = "action"  # slot k scores token k+1: [T-1] / [B, T-1] / [1, N]
    ROUTING = "routing"  # routed expert ids, sequence axis last: [L, K, T]
    EPISODE = "episode"  # one value per sample: 0-d / [B]
    MEDIA = "media"  # VLM inputs, opaque per sample; a batch holds a list
    PACK = "pack"  # describes a pack: position_ids [1, N], packed_seq_lens
    # this rank's rows of one forward of the batch (model/actor.py), no layout axis: set by the score stage and
    # read by the same rank's training forward of the same batch; never collated, split or exchanged
    FORWARD = "forward"


def _field(kind: Kind, doc: str) -> Any:
    return field(default=None, metadata={"kind": kind, "doc": doc})


@dataclass
class Experience:
    # token axis
    sequences: torch.Tensor | None = _field(Kind.TOKEN, "prompt + response token ids")
    attention_mask: torch.Tensor | None = _field(Kind.TOKEN, "real-token mask of a padded batch")
    # action axis
    action_mask: torch.Tensor | None = _field(Kind.ACTION, "True where the slot is a response token")
    action_log_probs: torch.Tensor | None = _field(Kind.ACTION, "log-probs under the policy")
    base_action_log_probs: torch.Tensor | None = _field(Kind.ACTION, "log-probs under the reference")
    rollout_log_probs: torch.Tensor | None = _field(Kind.ACTION, "log-probs the rollout engine saw")
    teacher_action_log_probs: torch.Tensor | None = _field(
        Kind.ACTION, "log-probs under the distillation teacher (algo.teacher, rl/algos/distill.py)")
    teacher_argmax_agrees: torch.Tensor | None = _field(
        Kind.ACTION, "1.0 where the teacher's and the student's most likely token agree (a distillation metric)")
    advantages: torch.Tensor | None = _field(Kind.ACTION, "per-token advantages")
    returns: torch.Tensor | None = _field(Kind.ACTION, "per-token returns")
    values: torch.Tensor | None = _field(Kind.ACTION, "critic values")
    kl: torch.Tensor | None = _field(Kind.ACTION, "per-token KL to the reference")
    # one forward's rows (Kind.FORWARD): the distillation teacher's top-k (algo.distill_kl=topk)
    teacher_topk_log_probs: torch.Tensor | None = _field(
        Kind.FORWARD, "the teacher's k largest log-probs per scored row of this rank's forward [..., k]")
    teacher_topk_ids: torch.Tensor | None = _field(Kind.FORWARD, "their token ids [..., k]")
    # routing replay
    routed_experts: torch.Tensor | None = _field(Kind.ROUTING, "top-k expert ids per MoE layer, -1 = live")
    # episode
    rewards: torch.Tensor | None = _field(Kind.EPISODE, "scalar reward")
    response_length: torch.Tensor | None = _field(Kind.EPISODE, "response tokens")
    total_length: torch.Tensor | None = _field(Kind.EPISODE, "prompt + response tokens")
    prompt_index: torch.Tensor | None = _field(Kind.EPISODE, "which prompt (GRPO group id)")
    turns: torch.Tensor | None = _field(Kind.EPISODE, "model turns of a multi-turn episode (rl/rollout/episodes.py)")
    policy_version: torch.Tensor | None = _field(
        Kind.EPISODE, "the policy version that generated the sample: how many steps' updates its weights held "
        "(rl/rollout/scheduler.py); a step's staleness is its step minus this")
    status: torch.Tensor | None = _field(
        Kind.EPISODE, "how the episode ended: rl/tasks/calls.py Status (done, max_turns, truncated, error, timeout)")
    # media
    pixel_values: torch.Tensor | list | None = _field(Kind.MEDIA, "image patches")
    image_grid_thw: torch.Tensor | list | None = _field(Kind.MEDIA, "image grid sizes")
    # pack description
    position_ids: torch.Tensor | None = _field(Kind.PACK, "[1, N], restarting at 0 per sequence")
    packed_seq_lens: list[int] | None = _field(Kind.PACK, "length of each packed sequence")
    shared_prompts: SharedPrompts | None = _field(
        Kind.PACK, "the layout with each repeated prompt once: keep [N_c], expand [N], attention boundaries "
        "(packing/prompts.py); derived from sequences, position_ids and action_mask by the collate, so a "
        "pack whose tokens or action_mask are replaced must drop it (None: no prompt repeats)")

    # ------------------------------------------------------------------ kinds
    @classmethod
    def names(cls, kind: Kind) -> list[str]:
        """Field names of one kind, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata["kind"] is kind]

    def present(self, kind: Kind) -> dict[str, Any]:
        """The non-None fields of one kind."""
        return {n: getattr(self, n) for n in self.names(kind) if getattr(self, n) is not None}

    def items(self) -> Iterator[tuple[str, Any]]:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value

    # ----------------------------------------------------------------- layout
    @property
    def is_packed(self) -> bool:
        return self.packed_seq_lens is not None

    @property
    def is_record(self) -> bool:
        return self.sequences is not None and self.sequences.dim() == 1

    @property
    def action_tokens(self) -> int:
        """The sampled tokens the loss scores: True slots of `action_mask`."""
        return int(self.action_mask.sum())

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """`[num_seqs + 1]` int32 cumulative lengths of a pack (what varlen kernels take)."""
        return cu_seqlens(self._require_pack())

    @property
    def max_seqlen(self) -> int:
        return max(self._require_pack())

    def _require_pack(self) -> list[int]:
        if self.packed_seq_lens is None:
            raise ValueError("packed_seq_lens is None: this Experience is not a pack (collate with packed=True)")
        return self.packed_seq_lens

    # -------------------------------------------------------------- transforms
    def to(self, device: torch.device | str, non_blocking: bool = False) -> Experience:
        """Every tensor on `device` (packing/layout.py `to_device`: non-blocking host-to-CUDA
        copies start from pinned memory)."""

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return to_device(value, device, non_blocking)
            if isinstance(value, SharedPrompts):
                return value.to(device, non_blocking=non_blocking)
            if isinstance(value, list):
                return [move(v) for v in value]
            return value

        return dataclasses.replace(self, **{name: move(value) for name, value in self.items()})

    def split(self) -> list[Experience]:
        """A padded or packed batch back into unpadded per-sample records."""
        if self.is_record:
            raise ValueError(f"split() takes a batch; this is a record (sequences {tuple(self.sequences.shape)})")
        if self.is_packed:
            lens = self.packed_seq_lens
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            token = lambda t, i: t[0, starts[i] : starts[i] + lens[i]]  # noqa: E731
            action = lambda t, i: t[0, starts[i] : starts[i] + lens[i] - 1]  # noqa: E731 (drop the trailing slot)
            routing = lambda t, i: t[0, ..., starts[i] : starts[i] + lens[i]]  # noqa: E731
        else:
            if self.attention_mask is None:
                raise ValueError("split() of a padded batch needs attention_mask [B, T]")
            lens = self.attention_mask.sum(-1).tolist()
            token = lambda t, i: t[i, : lens[i]]  # noqa: E731
            action = lambda t, i: t[i, : lens[i] - 1]  # noqa: E731
            routing = lambda t, i: t[i, ..., : lens[i]]  # noqa: E731

        records = []
        for i in range(len(lens)):
            rec: dict[str, Any] = {"sequences": token(self.sequences, i)}
            rec.update({n: action(v, i) for n, v in self.present(Kind.ACTION).items()})
            rec.update({n: routing(v, i) for n, v in self.present(Kind.ROUTING).items()})
            rec.update({n: v[i] for n, v in self.present(Kind.EPISODE).items()})
            rec.update({n: v[i] for n, v in self.present(Kind.MEDIA).items()})
            records.append(Experience(**rec))
        return records


def routing_shape(records: Sequence[Experience]) -> tuple[int, int] | None:
    """`(L, K)` of the records' routing fields, each `[L, K, T]` with T its record's sequence
    length; None when no record has one. The one check of a record's routing shape: a
    ValueError names the record, the field and its shape when one is not of that form or
    its `[L, K]` differs from the first one's."""
    first = None
    for i, rec in enumerate(records):
        T = rec.sequences.numel()
        for name, value in rec.present(Kind.ROUTING).items():
            if value.dim() != 3 or value.shape[-1] != T:
                raise ValueError(f"item {i}: field '{name}' has shape {tuple(value.shape)}, expected [L, K, {T}] "
                                 f"(sequence axis last, T={T})")
            if first is None:
                first = (i, list(value.shape[:2]))
            elif list(value.shape[:2]) != first[1]:
                raise ValueError(f"item {i}: field '{name}' has [L, K] = {list(value.shape[:2])}, expected "
                                 f"{first[1]} as on item {first[0]}")
    return None if first is None else tuple(first[1])
