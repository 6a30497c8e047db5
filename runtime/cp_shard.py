"""Context parallelism's layout: where every token of a batch lives, this rank's shard of it,
and the one gather that restores the full sequence (the forward on the shard, and its
"cp_varlen" attention: model/context_parallel.py).

Layout. Every sequence is padded to a multiple of `2*cp` and cut into `2*cp` equal
chunks; CP rank r keeps chunks r and 2cp-1-r of every sequence ("zigzag", the
load-balanced layout of Transformer Engine / AutoModel): a rank holding an early, cheap
chunk of a causal sequence also holds a late, expensive one, so every rank does the same
attention work (`attention_work`). Every rank keeps `N_pad / cp` tokens.
* A pack `[1, N]` shards each packed sequence. The CP padding sits at the end of its own
  sequence, its positions continue that sequence, and it is masked from everything: no
  query sees it as a key, it scores nothing, its action fields are 0 / False.
* A padded batch `[B, T]` shards its one sequence axis the same way: T is padded to a
  multiple of 2cp and every row keeps the same columns.
Positions stay global (a local token's `position_ids` is its position in its own full
sequence), so RoPE needs no change, and the attention reads sequence boundaries from the
layout (`seq_id`), never from position_ids (transformers #39814: a shard without a
position 0 looks unpacked).

Why only the token axis is sharded. Slot k scores token k+1 of the same sequence, which
may live on another CP rank. Rather than gathering hidden states `[N, H]` to pair them,
the forward computes every slot's target id and validity on the full batch (every CP rank
collates the same microbatch) and shards them with the tokens; log-probs, entropy and
values are computed locally and only those per-token outputs are gathered back.

Gradients. The K/V gather's backward sums, over ranks, the gradients every rank's queries
send to this rank's keys (reduce-scatter): exact. `_restore_full_sequence`'s gather is
different: every CP rank computes the same loss on the full gathered axis, so summing
their gradients (what all_gather's backward does) would be cp times too large; its
backward returns only this rank's slice of the incoming gradient. Each rank then holds
the parameter gradient of its own tokens' contribution, and FSDP's SUM over the (dp, cp)
ranks is the gradient of one process, exactly (tests/test_context_parallel.py proves
both, and the cp-times error of the naive gather).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import compat
from packing.collate import ROUTING_PAD
from packing.experience import Experience, Kind
from packing.layout import cu_seqlens, padded_positions


# -------------------------------------------------------------------- layout
@dataclass(frozen=True, eq=False)
class CPLayout:
    """Where every token of a batch lives under context parallelism, seen from one CP rank.

    The *padded axis* is the batch's token axis with each sequence grown to
    `padded_lens[s]` (width `W_pad = sum(padded_lens)`); rank r's local tokens are
    `order[r]`, indices into it, in local order. Gathering every rank's local tokens in
    rank order gives the *gathered axis* `order.flatten()` of length `cp * S_local`.

    `seq_lens` are the real lengths (a pack's `packed_seq_lens`; a padded batch is one
    "sequence" of length T per row). `real [B, W_pad]` is False on CP padding and, for a
    padded batch, on its right padding.
    """

    cp: int
    rank: int
    packed: bool
    zigzag: bool
    seq_lens: tuple[int, ...]
    padded_lens: tuple[int, ...]
    order: torch.Tensor  # [cp, S_local] int64, padded-axis index of each rank's local tokens
    seq_id: torch.Tensor  # [W_pad] int64, sequence of each padded-axis token
    position: torch.Tensor  # [W_pad] int64, position within its own sequence
    source: torch.Tensor  # [W_pad] int64, index on the original token axis, -1 on CP padding
    real: torch.Tensor  # [B, W_pad] bool
    restore_index: torch.Tensor  # [W] int64, gathered-axis position of each original token
    # shared prompts (`Segments`): a query sees, within its sequence and causally, the keys of its
    # own segment and of its sequence's shared prefix; None = the whole sequence is one segment
    segment: torch.Tensor | None = None  # [W_pad] int64, segment of each padded-axis token (CP padding: its last)
    shared: torch.Tensor | None = None  # [W_pad] bool, True on a sequence's shared prefix

    # ------------------------------------------------------------ this rank
    @property
    def num_local(self) -> int:
        """S_local: tokens per CP rank (the same on every rank)."""
        return self.order.shape[1]

    @property
    def local_index(self) -> torch.Tensor:
        """`[S_local]` padded-axis (global flat) index of each local token."""
        return self.order[self.rank]

    @property
    def local_seq_id(self) -> torch.Tensor:
        return self.seq_id[self.local_index]

    @property
    def local_position(self) -> torch.Tensor:
        """`[S_local]` global position: the token's position within its own full sequence."""
        return self.position[self.local_index]

    @property
    def local_source(self) -> torch.Tensor:
        """`[S_local]` index on the original token axis (N for a pack, T for a padded batch), -1 on CP padding."""
        return self.source[self.local_index]

    @property
    def local_real(self) -> torch.Tensor:
        """`[B, S_local]` bool, False on padding (CP padding, and a padded batch's right padding)."""
        return self.real[:, self.local_index]

    def chunk_pair(self, rank: int | None = None) -> tuple[int, int]:
        """The two of each sequence's `2*cp` chunks that `rank` (default: this rank) keeps."""
        return _chunk_pair(self.cp, self.rank if rank is None else rank, self.zigzag)

    def to(self, device: torch.device | str) -> CPLayout:
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


class Segments(NamedTuple):
    """Segments of a shared-prompt row (packing/prompts.py): each "sequence" is a unit, its
    shared prefix, then one segment per response that sees the prefix and itself only."""

    segment: torch.Tensor  # [W] int64 segment id of each token of the batch's token axis
    shared: torch.Tensor  # [W] bool, True on a unit's shared prefix

    @classmethod
    def of_units(cls, units) -> Segments:
        seg, shared, g = [], [], 0
        for prefix, responses in units:
            seg.append(torch.full((prefix,), g))
            shared.append(torch.full((prefix,), bool(responses)))
            g += 1
            for r in responses:
                seg.append(torch.full((r,), g))
                shared.append(torch.zeros(r, dtype=torch.bool))
                g += 1
        return cls(torch.cat(seg).long(), torch.cat(shared))


def cp_layout(experience: Experience, cp: int, rank: int, *, zigzag: bool = True,
              local_tokens: int | None = None, segments: Segments | None = None) -> CPLayout:
    """The CP layout of a pack `[1, N]` or a padded batch `[B, T]` for CP rank `rank` of `cp`.

    `zigzag=False` gives contiguous sharding (rank r keeps chunks 2r and 2r+1): correct,
    but the last rank does most of the causal attention work (a control and a baseline).
    `local_tokens` (packs only) grows the last sequence's CP padding until every rank
    holds that many tokens: the expert-parallel suffix, which every EP rank needs at the
    same count, is then just more CP padding (masked from attention, experts and losses).
    """
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp_layout: cp={cp!r}, expected an int >= 1")
    if not 0 <= rank < cp:
        raise ValueError(f"cp_layout: rank={rank}, expected 0 <= rank < cp={cp}")
    seqs = experience.sequences
    if seqs is None or seqs.dim() != 2:
        raise ValueError(f"cp_layout: sequences has shape {None if seqs is None else tuple(seqs.shape)}, "
                         "expected a pack [1, N] or a padded batch [B, T]")
    if experience.is_packed:
        lens = [int(n) for n in experience.packed_seq_lens]
        if seqs.shape[0] != 1 or sum(lens) != seqs.shape[1] or min(lens) < 1:
            raise ValueError(f"cp_layout: packed_seq_lens {lens} (sum {sum(lens)}) does not describe a pack "
                             f"[1, N] with sequences {tuple(seqs.shape)}")
        row_real = None
    else:
        if experience.attention_mask is None or experience.attention_mask.shape != seqs.shape:
            shape = None if experience.attention_mask is None else tuple(experience.attention_mask.shape)
            raise ValueError(f"cp_layout: a padded batch needs attention_mask {tuple(seqs.shape)}, got {shape}")
        if local_tokens is not None:
            raise ValueError("cp_layout: local_tokens (the EP suffix) is only defined for a pack")
        lens, row_real = [seqs.shape[1]], experience.attention_mask.bool()

    unit = 2 * cp
    padded = [-(-n // unit) * unit for n in lens]
    if local_tokens is not None:
        natural = sum(padded) // cp
        extra = (local_tokens - natural) * cp
        if local_tokens < natural or extra % unit:
            raise ValueError(f"cp_layout: local_tokens={local_tokens}, expected an even count >= {natural} "
                             f"(this pack's tokens per rank at cp={cp})")
        padded[-1] += extra
    layout = _build(lens, padded, cp, rank, zigzag=zigzag, packed=experience.is_packed, row_real=row_real)
    if segments is None:
        return layout
    if not experience.is_packed or segments.segment.shape != (seqs.shape[1],):
        raise ValueError(f"cp_layout: segments of shape {tuple(segments.segment.shape)} need a pack of as many "
                         f"tokens; sequences {tuple(seqs.shape)}")
    # CP padding takes its sequence's last segment (it comes after it: causal, never seen by a real token)
    last = cu_seqlens(lens)[1:].long() - 1
    src = torch.where(layout.source >= 0, layout.source, last[layout.seq_id])
    return dataclasses.replace(layout, segment=segments.segment[src],
                               shared=segments.shared[src] & (layout.source >= 0))


def _chunk_pair(cp: int, rank: int, zigzag: bool) -> tuple[int, int]:
    return (rank, 2 * cp - 1 - rank) if zigzag else (2 * rank, 2 * rank + 1)


def _build(lens, padded, cp, rank, *, zigzag, packed, row_real) -> CPLayout:
    pad_t = torch.tensor(padded)
    len_t = torch.tensor(lens)
    seq_id = torch.repeat_interleave(torch.arange(len(padded)), pad_t)
    pad_start = cu_seqlens(pad_t)[:-1].long()
    position = torch.arange(int(pad_t.sum())) - pad_start[seq_id]
    is_seq = position < len_t[seq_id]
    src_start = cu_seqlens(len_t)[:-1].long()
    source = torch.where(is_seq, src_start[seq_id] + position, torch.full_like(position, -1))

    # chunk j of sequence s: padded-axis [pad_start_s + j*c_s, pad_start_s + (j+1)*c_s)
    chunk = pad_t // (2 * cp)
    order = torch.stack([torch.cat([torch.arange(c) + s0 + j * c
                                    for s0, c in zip(pad_start.tolist(), chunk.tolist())
                                    for j in _chunk_pair(cp, r, zigzag)])
                         for r in range(cp)])

    if row_real is None:
        real = is_seq.unsqueeze(0)
    else:
        real = F.pad(row_real, (0, padded[0] - lens[0]), value=False)
    gathered_source = source[order.flatten()]
    keep = gathered_source >= 0
    restore = torch.empty(int(len_t.sum()), dtype=torch.long)
    restore[gathered_source[keep]] = torch.arange(gathered_source.numel())[keep]
    return CPLayout(cp=cp, rank=rank, packed=packed, zigzag=zigzag, seq_lens=tuple(lens), padded_lens=tuple(padded),
                    order=order, seq_id=seq_id, position=position, source=source, real=real,
                    restore_index=restore)


# ------------------------------------------------------------ shard / unshard
def shard_tokens(x: torch.Tensor, layout: CPLayout, *, fill=0, dim: int = 1) -> torch.Tensor:
    """This rank's slice of a token-axis tensor: `x [B, W, ...]` -> `[B, S_local, ...]`.

    `dim` is the token axis (`-1` for `routed_experts`); CP padding gets `fill`.
    """
    dim = dim % x.dim()
    width = layout.restore_index.numel()
    if x.shape[dim] != width:
        raise ValueError(f"shard_tokens: tensor of shape {tuple(x.shape)} has {x.shape[dim]} tokens on dim {dim}, "
                         f"expected {width} (the layout's token axis)")
    src = layout.local_source.to(x.device)
    fill_slice = torch.full_like(x.narrow(dim, 0, 1), fill)
    return torch.cat([x, fill_slice], dim).index_select(dim, torch.where(src >= 0, src, width))


def unshard(gathered: torch.Tensor, layout: CPLayout, *, dim: int = 1) -> torch.Tensor:
    """Every rank's local tensors, concatenated in rank order `[B, cp*S_local, ...]` -> the
    original token axis `[B, W, ...]` (CP padding dropped). Differentiable (index_select)."""
    expected = layout.cp * layout.num_local
    if gathered.shape[dim] != expected:
        raise ValueError(f"unshard: tensor of shape {tuple(gathered.shape)} has {gathered.shape[dim]} entries on "
                         f"dim {dim}, expected cp x S_local = {layout.cp} x {layout.num_local} = {expected}")
    return gathered.index_select(dim, layout.restore_index.to(gathered.device))


def shard(experience: Experience, cp: int, rank: int, *, zigzag: bool = True,
          local_tokens: int | None = None, segments: Segments | None = None) -> tuple[Experience, CPLayout]:
    """This CP rank's slice of a batch, and its layout.

    The local Experience holds `sequences [B, S_local]`, global `position_ids [B, S_local]`,
    `attention_mask [B, S_local]` (False on padding), every action field on the token axis
    `[B, S_local]` (0 / False on padding; a padded batch's `[B, T-1]` fields first get a
    trailing slot), `routed_experts [B, L, K, S_local]` (-1 on padding) and the episode
    fields unchanged. It has no `packed_seq_lens`: the layout describes its sequences.
    """
    layout = cp_layout(experience, cp, rank, zigzag=zigzag, local_tokens=local_tokens, segments=segments)
    return shard_experience(experience, layout), layout


def shard_experience(experience: Experience, layout: CPLayout) -> Experience:
    media = experience.present(Kind.MEDIA)
    if media:
        raise ValueError(f"shard: media field '{next(iter(media))}' cannot be sharded over the token axis "
                         f"(cp={layout.cp}); run multimodal batches with cp=1")
    ids = experience.sequences
    if experience.is_packed:
        positions = experience.position_ids
    else:  # as the unsharded forward counts them: over real tokens
        positions = padded_positions(experience.attention_mask)
    src = layout.local_source.to(ids.device)
    local_positions = torch.where(src >= 0, shard_tokens(positions, layout),
                                  layout.local_position.to(positions.device))
    fields: dict = {
        "sequences": shard_tokens(ids, layout),
        "position_ids": local_positions,
        "attention_mask": layout.local_real.to(ids.device),
    }
    for name, value in experience.present(Kind.ACTION).items():
        if not experience.is_packed:
            value = F.pad(value, (0, 1))  # [B, T-1] -> [B, T]: the slot of the last column scores nothing
        fields[name] = shard_tokens(value, layout)
    for name, value in experience.present(Kind.ROUTING).items():
        fields[name] = shard_tokens(value, layout, fill=ROUTING_PAD, dim=-1)
    fields.update(experience.present(Kind.EPISODE))
    return Experience(**fields)


# ----------------------------------------------------------------- balance
def attention_work(layout: CPLayout) -> int:
    """Causal attention work of this rank: visible keys summed over its real queries.

    A real query sees the real keys of its own sequence at positions <= its own.
    """
    real = layout.real.long()  # [B, W_pad]
    seen = real.cumsum(1)  # real keys up to and including each padded-axis index
    start = cu_seqlens(layout.padded_lens)[:-1].long()
    before = F.pad(seen, (1, 0))[:, start]  # real keys before each sequence starts
    idx = layout.local_index
    visible = seen[:, idx] - before[:, layout.seq_id[idx]]
    return int((visible * real[:, idx]).sum())


# -------------------------------------------------------------------- gathers
def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    compat.all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


class _GatherSum(torch.autograd.Function):
    """all_gather on `dim`; backward: reduce-scatter (each rank gets the SUM of every rank's
    gradient for its slice). Right when every rank's loss uses the gathered tensor
    differently (K/V: each rank's queries read other ranks' keys)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // dist.get_world_size(ctx.group), *moved.shape[1:]))
        compat.reduce_scatter_single(out, moved, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


class _GatherSlice(torch.autograd.Function):
    """all_gather on `dim`; backward: this rank's slice of the incoming gradient, no
    communication. Right when every rank computes the same loss on the gathered tensor."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.rank, ctx.size, ctx.dim = dist.get_rank(group), x.shape[dim], dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Differentiable all_gather of `x` on `dim` in rank order, gradients summed back (K/V)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSum.apply(x, group, dim)


def _restore_full_sequence(local: torch.Tensor, layout: CPLayout, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Per-token outputs of this rank's shard `[B, S_local, ...]` -> the full token axis `[B, W, ...]`.

    W is N for a pack (`[1, N]`, the original flat order, CP padding trimmed) and T for a
    padded batch (`[B, T]`; its action axis is `[:, :-1]`). The only un-sharding step.
    Every rank gets the full tensor; backward returns this rank's slice of the gradient
    (see the module docstring), so a loss computed identically on every CP rank followed by
    a SUM of the parameter gradients over the CP group equals the one-process gradient.
    """
    if local.shape[1] != layout.num_local:
        raise ValueError(f"_restore_full_sequence: local tensor of shape {tuple(local.shape)}, expected "
                         f"[B, {layout.num_local}, ...] (this rank's shard)")
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size != layout.cp:
        raise ValueError(f"_restore_full_sequence: the layout has cp={layout.cp}, the CP group has {size} ranks")
    gathered = local if size == 1 else _GatherSlice.apply(local, cp_group, 1)
    return unshard(gathered, layout)
