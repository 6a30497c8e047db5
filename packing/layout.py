"""The one builder of each per-token layout index: boundaries, positions, prompt groups.

Every module that needs a pack's boundaries (`cu_seqlens`), a sequence's position ids or the
samples of one prompt calls these; none re-derives them.

    cu_seqlens([3, 2])                      -> tensor([0, 3, 5], int32)
    packed_positions([3, 2])                -> tensor([[0, 1, 2, 0, 1]])
    padded_positions(mask [[1, 1, 0]])      -> tensor([[0, 1, 1]])   (right padding repeats the last)
    group_by_prompt([7, 3, 7])              -> {7: [0, 2], 3: [1]}
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """`t.to(device)`. With `non_blocking` from host memory to a CUDA device the copy starts
    from a pinned (page-locked) copy of `t`: a pageable source would make the transfer
    synchronous; from pinned memory it is queued on the stream ahead of the kernels that read
    it, and the host goes on collating."""
    if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


def cu_seqlens(lens: Sequence[int] | torch.Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """`[n + 1]` int32 cumulative lengths starting at 0 (what varlen kernels take);
    `cu[:-1]` are the sequences' start offsets."""
    lens = torch.as_tensor(lens, dtype=torch.int32, device=device)
    return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))


def packed_positions(lens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """`[1, N]` int64 position ids of a pack, restarting at 0 at each sequence.

    A running sum of steps: +1 everywhere, except at each sequence start, where the step
    `1 - len(previous)` brings the count back to 0. Flat passes, no `repeat_interleave`
    (which cost ~5x more, and far more on a busy machine: bench/collate.py)."""
    lens = torch.as_tensor(lens, dtype=torch.int64)
    steps = torch.ones(int(lens.sum()), dtype=torch.int64)
    steps[0] = 0
    steps[lens[:-1].cumsum(0)] = 1 - lens[:-1]
    return steps.cumsum(0).unsqueeze(0)


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` int64 position ids of a right-padded batch, counted over its real tokens
    (`mask` 1/True where a token is real); a padding slot repeats the last real position."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def group_by_prompt(prompt_indices: Sequence[int] | torch.Tensor) -> dict[int, list[int]]:
    """`{prompt_index: [positions of its samples, in order]}` in first-seen order."""
    if isinstance(prompt_indices, torch.Tensor):
        prompt_indices = prompt_indices.tolist()
    groups: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompt_indices):
        groups[int(prompt)].append(i)
    return dict(groups)

