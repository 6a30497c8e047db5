"""The shared-prompt layout of a pack: each prompt its GRPO group repeats, held once.

A GRPO group's samples share their prompt tokens. `shared_prompts(pack)` (run once per
collated pack by packing/collate.py, on the CPU) finds them and describes the *compressed*
row `[1, N_c]` the model body runs instead of the pack `[1, N]`: each distinct prompt once
(but its last token), then every member's segment (that token and its response), and the
samples nobody shares a prompt with. `keep [N_c]` picks the compressed rows out of the pack,
`expand [N]` puts per-row outputs back on the pack's slots, and the attention boundaries
(`cu_seq_lens_q/k`, `kv_index`) say what every row attends to: a shared prefix row its prefix
causally, a member's row the prefix and its own segment's earlier tokens (model/attention.py
`_shared_prompt_attention`). Rows keep their positions, so every row's hidden state is the
unshared pack's.

The grouping rule: a sample's prompt is its tokens before its first response token,
P = (first True slot of its `action_mask`) + 1 (slot k scores token k+1; rl/rollout/engine.py
`make_record`); samples whose first P token ids and positions are equal (compared exactly,
not by `prompt_index`) form a group. A sample alone, or with no response slot, is a unit of
its own (an ordinary causal sequence).

What a group shares is its prompt's first P-1 tokens: the last prompt token (slot P-1, the
first action slot, which scores each member's own first response token) opens every
member's response segment. So every compressed row scores one target (the token after it
in every sample it stands for), and per-row outputs (log-probs, values) can be computed on
the compressed rows and expanded after: what context parallelism needs, since there the rows
live on other ranks than the slots that read them. A prompt of one token shares nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import torch

from packing.layout import cu_seqlens, to_device

Unit = tuple[int, tuple[int, ...]]  # (prompt length P, response lengths (R_1, ...)); () = a causal sequence


@dataclass(frozen=True, eq=False)
class SharedPrompts:
    """The compressed row of a shared-prompt pack and its attention boundaries.

    The compressed row holds `units` in order: unit (P, (R_1, ...)) is P prompt rows, then R_j
    rows per response. Segment i of the attention (a prompt, a response, a unit alone, an EP
    suffix): queries are rows `cu_seq_lens_q[i]:cu_seq_lens_q[i+1]` (the segments tile the
    row in order); keys/values are rows `kv_index[cu_seq_lens_k[i]:cu_seq_lens_k[i+1]]`, causal
    aligned bottom-right (query j of a segment with `len_q` queries and `len_k` keys sees keys
    `<= j + len_k - len_q`): flash-attn's varlen contract with `cu_seqlens_k != cu_seqlens_q`.
    `lens_q`/`lens_k`/`max_length_*` are host copies, so no kernel asks the device for them.
    """

    units: tuple[Unit, ...]  # (shared prefix length, response segment lengths) per unit, in row order
    keep: torch.Tensor  # int64 [N_c]: the pack slot each compressed row copies
    expand: torch.Tensor  # int64 [N]: the compressed row each pack slot reads
    multiplicity: torch.Tensor  # int64 [N_c + suffix]: pack slots each row stands for (its group's size
    #                             on a shared prompt row, 1 on a response or a unit alone, 0 on the suffix)
    cu_seq_lens_q: torch.Tensor  # int32 [S + 1]
    cu_seq_lens_k: torch.Tensor  # int32 [S + 1]
    kv_index: torch.Tensor  # int64 [sum(lens_k)]: the row of every key of every segment
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    suffix: int = 0  # trailing synthetic rows (the EP suffix): a segment of their own, in no unit
    _masks: dict = field(default_factory=dict, repr=False)  # (len_q, len_k, device) -> bool mask

    @property
    def max_length_q(self) -> int:
        return max(self.lens_q)

    @property
    def max_length_k(self) -> int:
        return max(self.lens_k)

    @property
    def num_rows(self) -> int:
        """Rows of the compressed row, the suffix included: `N_c + suffix`."""
        return sum(self.lens_q)

    def mask(self, len_q: int, len_k: int, device) -> torch.Tensor | None:
        """None where sdpa's top-left `is_causal` is right (`len_q == len_k`), else the
        bottom-right causal `[len_q, len_k]` bool mask (built once per shape and device)."""
        if len_q == len_k:
            return None
        key = (len_q, len_k, str(device))
        if key not in self._masks:
            self._masks[key] = torch.ones(len_q, len_k, dtype=torch.bool, device=device).tril(len_k - len_q)
        return self._masks[key]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SharedPrompts:
        moved = {f.name: to_device(getattr(self, f.name), device, non_blocking) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved, _masks={})

    def with_suffix(self, pad: int) -> SharedPrompts:
        """The layout with `pad` synthetic rows appended as one causal segment of their own: no
        real row attends to them. Device ops only (no host sync); `keep`/`expand` unchanged."""
        if pad < 0 or self.suffix:
            raise ValueError(f"with_suffix: pad={pad} on a layout with suffix={self.suffix}; expected pad >= 0 "
                             "on a layout without one")
        if pad == 0:
            return self
        n = self.num_rows
        rows = torch.arange(n, n + pad, device=self.kv_index.device)
        return dataclasses.replace(
            self, cu_seq_lens_q=torch.cat([self.cu_seq_lens_q, self.cu_seq_lens_q[-1:] + pad]),
            cu_seq_lens_k=torch.cat([self.cu_seq_lens_k, self.cu_seq_lens_k[-1:] + pad]),
            kv_index=torch.cat([self.kv_index, rows]),
            multiplicity=torch.nn.functional.pad(self.multiplicity, (0, pad)),
            lens_q=(*self.lens_q, pad), lens_k=(*self.lens_k, pad),
            suffix=pad, _masks={})


def layout_of_units(units: Sequence[tuple[int, Sequence[int]]], keep: torch.Tensor | None = None,
                    expand: torch.Tensor | None = None) -> SharedPrompts:
    """The attention boundaries of `units` (in row order, each `(P, [R_1, ...])`), with the
    pack mapping `keep`/`expand` (None: the compressed row is the pack, `arange(N_c)`)."""
    lens_q, lens_k, kv, start, norm = [], [], [], 0, []
    for prompt, responses in units:
        prompt, responses = int(prompt), tuple(int(r) for r in responses)
        if prompt < 1 or any(r < 1 for r in responses):
            raise ValueError(f"shared prompts: unit (prompt {prompt}, responses {list(responses)}) has a length < 1; "
                             "every prompt and response needs >= 1 token")
        norm.append((prompt, responses))
        prompt_rows = torch.arange(start, start + prompt)
        lens_q.append(prompt)
        lens_k.append(prompt)
        kv.append(prompt_rows)
        start += prompt
        for r in responses:
            lens_q.append(r)
            lens_k.append(prompt + r)
            kv += [prompt_rows, torch.arange(start, start + r)]
            start += r
    if not lens_q:
        raise ValueError("shared prompts: units is empty; a pack holds at least one sequence")
    keep = torch.arange(start) if keep is None else keep
    expand = torch.arange(start) if expand is None else expand
    if keep.numel() != start:
        raise ValueError(f"shared prompts: keep has shape {tuple(keep.shape)}, expected [{start}] (the units' rows)")
    if expand.numel() and int(expand.max()) >= start:
        raise ValueError(f"shared prompts: expand reads row {int(expand.max())}, the units hold {start} rows")
    return SharedPrompts(tuple(norm), keep, expand, torch.bincount(expand, minlength=start), cu_seqlens(lens_q),
                         cu_seqlens(lens_k), torch.cat(kv), tuple(lens_q), tuple(lens_k))


def shared_prompts(sequences: torch.Tensor, position_ids: torch.Tensor, seq_lens: Sequence[int],
                   action_mask: torch.Tensor | None) -> SharedPrompts | None:
    """The shared-prompt layout of a pack (`sequences`/`position_ids`/`action_mask [1, N]`,
    `seq_lens` its sequences' lengths), or None when no prompt repeats or there is no
    `action_mask` (it says where each prompt ends). Host work: run it where the pack is
    built (on the CPU, once), not in the forward. Units come in order of each group's first
    sample; a group's prompt rows copy its first member's prompt."""
    if action_mask is None:
        return None
    lens = [int(t) for t in seq_lens]
    ids, pos = sequences[0].cpu(), position_ids[0].cpu()
    first_action = _first_true(action_mask[0].bool().cpu(), lens)
    groups: dict = {}  # key -> [(start, length, prompt length)]
    start = 0
    for i, (t, k) in enumerate(zip(lens, first_action)):
        p = k  # the shared prefix: the prompt (k + 1 tokens, the group's key) but its last token
        key = (p, ids[start:start + p + 1].numpy().tobytes(), pos[start:start + p + 1].numpy().tobytes()) \
            if 0 < p < t else i
        groups.setdefault(key, []).append((start, t, p))
        start += t
    if all(len(members) == 1 for members in groups.values()):
        return None
    units, keep, expand = [], [], torch.empty(start, dtype=torch.long)
    offset = 0
    for members in groups.values():
        if len(members) == 1:
            s, t, _ = members[0]
            units.append((t, ()))
            keep.append(torch.arange(s, s + t))
            expand[s:s + t] = torch.arange(offset, offset + t)
            offset += t
            continue
        p = members[0][2]
        units.append((p, tuple(t - p for _, t, _ in members)))
        keep.append(torch.arange(members[0][0], members[0][0] + p))
        prompt = torch.arange(offset, offset + p)
        offset += p
        for s, t, _ in members:
            keep.append(torch.arange(s + p, s + t))
            expand[s:s + p] = prompt
            expand[s + p:s + t] = torch.arange(offset, offset + t - p)
            offset += t - p
    return layout_of_units(units, torch.cat(keep), expand)


def _first_true(mask: torch.Tensor, lens: list[int]) -> list[int]:
    """Per packed sequence of `mask [N]`, the offset of its first True slot (its length if none)."""
    starts = cu_seqlens(lens)[:-1].long()
    hits = torch.cat([mask.nonzero().squeeze(1), torch.tensor([mask.numel()])])  # a sentinel past the end
    first = hits[torch.searchsorted(hits, starts)] - starts
    return torch.minimum(first, torch.tensor(lens)).tolist()
