"""A step's records across data-parallel ranks: metadata to everyone, each sample moved once.

The records of a step stay on the rank that generated them. What the global decisions of
the step need (each sample's advantage scalar from the rewards and prompt groups, loss
normalizers, dynamic sampling, the microbatch plan) is a handful of numbers per sample, so only those are all-gathered:

    gather_metadata(records, key, ...) -> [StandIn]   every rank: the step's samples, in
                                                      global order, as lightweight records
    exchange(local, standins, dest, ...) -> [Experience | None]
                                                      each sample from the rank that generated
                                                      it to the ranks `dest` names, flat tensors

A `StandIn` holds only the episode scalars (`rewards`, `prompt_index`,
`response_length`, `total_length`, a multi-turn episode's `turns`, the `policy_version` that
generated it, the episode's `status`, with the records' dtypes)
and its record's count of action tokens (`action_tokens`: what the token-mean normalizer
counts); the action mask itself travels with the record (a multi-turn record's has holes: rl/rollout/episodes.py).
Every registered estimator's per-sample scalar reads only rewards and prompt groups
(rl/algos/advantages.py), so it gives the same numbers on stand-ins as on the records; the
per-token part runs later on the collated batches.
`StandIn.source` is `(dp rank that holds the record, key)`.

`exchange` moves every transported field (token, action, routing and episode fields) with
one `all_to_all_single` over the DP group, the splits computed on every rank from the
metadata: nothing is pickled and a rank receives only the samples it is a destination of.
Tensors travel as their bytes (a uint8 view: gloo has no int16 and no collective needs to
know a field's dtype); recorded routing ids are first converted to the narrowest signed
integer type that holds the step's ids and the `-1` marker (int8 up to 128 experts, int16
up to 32768) and converted back to their dtype (int64) on arrival.

Context parallelism: the CP peers of one DP rank generate the same samples, and every CP
rank of the training DP rank needs each of its samples. Each CP coordinate exchanges within
its own DP group (CP rank c of the sender -> CP rank c of the receiver): one collective, no
second hop, and no rank receives a sample twice (a broadcast from CP rank 0 would send the
same bytes again from one rank, after the exchange). Because this relies on the CP peers'
records being the same samples, the metadata gather (over every rank) compares each CP
rank's rows (lengths, reward, a checksum of the tokens) with those of CP rank 0 and raises
on every rank alike when they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

from packing.experience import Experience, Kind, routing_shape

# transported fields, in a fixed order every rank shares
FIELDS: tuple[str, ...] = tuple(Experience.names(Kind.TOKEN) + Experience.names(Kind.ACTION)
                                + Experience.names(Kind.ROUTING) + Experience.names(Kind.EPISODE))
_KIND = {name: kind for kind in (Kind.TOKEN, Kind.ACTION, Kind.ROUTING, Kind.EPISODE) for name in Experience.names(kind)}
DTYPES: tuple[torch.dtype, ...] = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ROUTING_TYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
ROW = ("prompt_index", "total_length", "response_length", "reward_bits", "action_tokens", "token_checksum", "turns",
       "policy_version", "status")
_HEAD = ("count", "layers", "topk", "routing_min", "routing_max")


@dataclass(frozen=True)
class Wire:
    """What a receiver needs to rebuild a round's records: per transported field its dtype
    code (index in DTYPES + 1; 0 = absent), the routing's layers and top-k, and the range of
    the routing ids (which decides their width in transit)."""

    codes: tuple[int, ...]
    layers: int
    topk: int
    low: int
    high: int


@dataclass(frozen=True, eq=False)
class StandIn:
    """A sample of the step as every rank sees it (see the module docstring): its episode
    scalars as 0-d tensors with the records' dtypes, read by the same names as an
    `Experience`'s (the advantage estimators, the planner and the metrics take either), and
    its record's number of action tokens; `source = (dp rank holding the record, key)`, `wire`
    its round's `Wire`. Not an `Experience`: it has no token fields, and nothing writes to it."""

    source: tuple[int, Hashable]
    wire: Wire
    action_tokens: int
    rewards: torch.Tensor
    prompt_index: torch.Tensor
    total_length: torch.Tensor
    response_length: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    status: torch.Tensor | None = None


def routing_dtype(low: int, high: int) -> torch.dtype:
    """The narrowest signed integer type holding every id in [low, high] (low is -1 or more)."""
    for dtype in _ROUTING_TYPES:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return dtype
    raise ValueError(f"routing ids in [{low}, {high}] fit no integer type")


# ------------------------------------------------------------------ metadata
def _schema(records: Sequence[Experience]) -> tuple[list[int], tuple[int, int]]:
    """Per transported field its dtype code (index in DTYPES + 1; 0 = absent), and the
    routing's (layers, topk); every record must carry the same fields."""
    codes = [0] * len(FIELDS)
    for i, rec in enumerate(records):
        if rec.present(Kind.MEDIA):
            raise ValueError(f"record {i}: media fields {sorted(rec.present(Kind.MEDIA))} cannot be exchanged "
                             f"(packing rejects media)")
        mine = [DTYPES.index(v.dtype) + 1 if (v := getattr(rec, name)) is not None else 0 for name in FIELDS]
        if i and mine != codes:
            diff = [n for n, a, b in zip(FIELDS, codes, mine) if a != b]
            raise ValueError(f"record {i}: fields {diff} differ from record 0's (presence or dtype): the records of a "
                             f"step must carry the same fields")
        codes = mine
    return codes, routing_shape(records) or (0, 0)


def _rows(records: Sequence[Experience]) -> tuple[torch.Tensor, int, int]:
    """int64 `[n, len(ROW)]` and the routing id range."""
    rows, low, high = [], 0, 0
    for i, rec in enumerate(records):
        if rec.sequences is None or rec.rewards is None or rec.prompt_index is None or rec.action_mask is None:
            raise ValueError(f"record {i}: the exchange needs 'sequences', 'action_mask', 'rewards' and 'prompt_index'")
        T = rec.sequences.numel()
        R = int(rec.response_length) if rec.response_length is not None else int(rec.action_mask.sum())
        if rec.total_length is not None and int(rec.total_length) != T:
            raise ValueError(f"record {i}: total_length {int(rec.total_length)} != sequences.numel() {T}")
        for name, value in rec.present(Kind.ACTION).items():
            if value.shape != (T - 1,):
                raise ValueError(f"record {i}: {name} has shape {tuple(value.shape)}, expected ({T - 1},)")
        if rec.routed_experts is not None and rec.routed_experts.numel():  # its shape: `_schema`
            low = min(low, int(rec.routed_experts.min()))
            high = max(high, int(rec.routed_experts.max()))
        for name, value in rec.present(Kind.EPISODE).items():
            if value.dim() != 0:
                raise ValueError(f"record {i}: {name} has shape {tuple(value.shape)}, expected a 0-d tensor")
        seq = rec.sequences.detach().cpu().to(torch.int64)
        checksum = int((seq * torch.arange(1, T + 1, dtype=torch.int64)).sum())
        reward_bits = int(torch.tensor(float(rec.rewards), dtype=torch.float64).view(torch.int64))
        turns = int(rec.turns) if rec.turns is not None else 0  # a multi-turn episode's model turns
        version = int(rec.policy_version) if rec.policy_version is not None else -1
        status = int(rec.status) if rec.status is not None else -1  # how the episode ended (rl/tasks/calls.py)
        rows.append([int(rec.prompt_index), T, R, reward_bits, rec.action_tokens, checksum, turns, version, status])
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(ROW)), low, high


def gather_metadata(records: Sequence[Experience], key: Hashable = 0, *, dp_rank: int = 0, dp: int = 1, cp: int = 1,
                    device: torch.device | str = "cpu") -> list[StandIn]:
    """Every rank: one `StandIn` per sample of the step, DP rank by DP rank (the order
    `all_gather_object` of the records gave), from `len(ROW)` int64 numbers per sample
    and a small header per rank, gathered over all `dp * cp` ranks (world rank =
    dp_rank * cp + cp_rank). `source = (dp rank, (key, index in its records))`."""
    rows, low, high = _rows(records)
    codes, (layers, topk) = _schema(records)
    head = torch.tensor([len(records), layers, topk, low, high, *codes], dtype=torch.int64)
    world = dp * cp
    if world > 1:
        device = torch.device(device)
        heads = [torch.empty(head.numel(), dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(heads, head.to(device), group=dist.group.WORLD)
        heads = [h.cpu() for h in heads]
        width = max(int(h[0]) for h in heads)
        padded = torch.zeros(width, len(ROW), dtype=torch.int64)
        padded[:len(records)] = rows
        parts = [torch.empty(width, len(ROW), dtype=torch.int64, device=device) for _ in range(world)]
        dist.all_gather(parts, padded.to(device), group=dist.group.WORLD)
        parts = [p.cpu()[:int(h[0])] for p, h in zip(parts, heads)]
        for r in range(world):  # CP peers must hold the same samples (see the module docstring)
            ref = (r // cp) * cp
            if not (torch.equal(heads[r], heads[ref]) and torch.equal(parts[r], parts[ref])):
                raise RuntimeError(f"gather_metadata: rank {r} (dp {r // cp}, cp {r % cp}) generated other samples "
                                   f"than its CP rank 0 (rank {ref}): CP peers must generate the same samples")
        heads, parts = heads[::cp], parts[::cp]
    else:
        heads, parts = [head], [rows]
    filled = [h for h in heads if int(h[0])]
    for h in filled[1:]:
        if not torch.equal(h[1:3], filled[0][1:3]) or not torch.equal(h[len(_HEAD):], filled[0][len(_HEAD):]):
            raise ValueError("gather_metadata: DP ranks generated records with different fields or routing shapes")
    first = filled[0] if filled else head
    wire = Wire(tuple(int(c) for c in first[len(_HEAD):]), int(first[1]), int(first[2]),
                min(int(h[3]) for h in heads), max(int(h[4]) for h in heads))
    dtype = {name: DTYPES[c - 1] for name, c in zip(FIELDS, wire.codes) if c}
    out = []
    for src, block in enumerate(parts):
        for i, (prompt, T, R, bits, actions, _, turns, version, status) in enumerate(block.tolist()):
            episode = {name: torch.tensor(value, dtype=dtype[name])
                       for name, value in (("response_length", R), ("turns", turns), ("policy_version", version),
                                           ("status", status)) if name in dtype}
            s = StandIn(source=(src, (key, i)), wire=wire, action_tokens=actions,
                        rewards=torch.tensor(torch.tensor(bits).view(torch.float64).item(), dtype=dtype["rewards"]),
                        prompt_index=torch.tensor(prompt, dtype=dtype["prompt_index"]),
                        total_length=torch.tensor(T, dtype=dtype.get("total_length", torch.int64)), **episode)
            out.append(s)
    return out


# ------------------------------------------------------------------ exchange
def _numel(kind: Kind, T: int, layers: int, topk: int) -> int:
    return {Kind.TOKEN: T, Kind.ACTION: T - 1, Kind.ROUTING: layers * topk * T, Kind.EPISODE: 1}[kind]


def _shape(kind: Kind, T: int, layers: int, topk: int) -> tuple[int, ...]:
    return {Kind.TOKEN: (T,), Kind.ACTION: (T - 1,), Kind.ROUTING: (layers, topk, T), Kind.EPISODE: ()}[kind]


def exchange(local: Mapping[Hashable, Experience], standins: Sequence[StandIn], dest: Sequence[Sequence[int]], *,
             dp_rank: int = 0, dp: int = 1, group: dist.ProcessGroup | None = None,
             device: torch.device | str = "cpu") -> list[Experience | None]:
    """Deliver each sample to the DP ranks `dest[j]` names: the result holds, at j, the
    record of `standins[j]` where this rank is one of `dest[j]` (a new `Experience` with the
    generating rank's transported fields, bit for bit, on the CPU), else None.

    `local` maps this rank's keys (`StandIn.source[1]`) to its records. One
    `all_to_all_single` per present field over `group` (the DP group of this CP coordinate;
    None: one DP rank, nothing moves)."""
    out: list[Experience | None] = [None] * len(standins)
    if not standins:
        return out
    wires = {s.wire for s in standins}  # one per rollout round
    if len({(w.codes, w.layers, w.topk) for w in wires}) > 1:
        raise ValueError("exchange: the rounds of the step carry different fields or routing shapes")
    first = next(iter(wires))
    layers, topk = first.layers, first.topk
    fields = [(name, DTYPES[c - 1]) for name, c in zip(FIELDS, first.codes) if c]
    wanted = [(s.source[0], d, j) for j, s in enumerate(standins) for d in sorted(set(dest[j]))]
    if group is None or dp == 1:
        for src, d, j in wanted:
            if d == dp_rank:
                rec = local[standins[j].source[1]]  # nothing moves: the record's own tensors
                out[j] = Experience(**{name: getattr(rec, name) for name, _ in fields})
        return out
    device = torch.device(device)
    send = sorted((d, j) for src, d, j in wanted if src == dp_rank)  # to rank d, in global order
    recv = sorted((src, j) for src, d, j in wanted if d == dp_rank)  # from rank src, in global order
    lengths = [int(s.total_length) for s in standins]
    mine: dict[int, dict[str, torch.Tensor]] = {j: {} for _, j in recv}
    narrow = routing_dtype(min(w.low for w in wires), max(w.high for w in wires))
    for name, dtype in fields:
        kind = _KIND[name]
        wire = narrow if kind is Kind.ROUTING else dtype
        n = [_numel(kind, T, layers, topk) * wire.itemsize for T in lengths]  # bytes per sample
        in_splits = [sum(n[j] for d2, j in send if d2 == d) for d in range(dp)]
        out_splits = [sum(n[j] for s2, j in recv if s2 == s) for s in range(dp)]
        pieces = [_to_wire(getattr(local[standins[j].source[1]], name), wire, kind) for _, j in send]
        inp = (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)).to(device)
        buf = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(buf, inp, out_splits, in_splits, group=group)
        del inp, pieces
        flat, offset = buf.cpu(), 0
        for _, j in recv:
            piece = flat[offset:offset + n[j]]
            offset += n[j]
            shape = _shape(kind, lengths[j], layers, topk)
            mine[j][name] = piece.view(wire).to(dtype).reshape(shape).clone()  # .to: the routing's own dtype back
        del buf, flat
    for j, values in mine.items():
        out[j] = Experience(**values)
    return out


def _to_wire(value: torch.Tensor, wire: torch.dtype, kind: Kind) -> torch.Tensor:
    """The bytes of `value` in the wire type (routing ids converted by value: narrowed)."""
    flat = value.detach().reshape(-1)
    return (flat.to(wire) if kind is Kind.ROUTING else flat).contiguous().view(torch.uint8)
