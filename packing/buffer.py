"""The replay buffer: unpadded per-sample records, nothing else.

Rollouts arrive right-padded (`[B, T]`); `append` strips the padding on every axis
(token, action, routing) so the buffer holds exactly the real tokens, and a later
collate packs them without ever having padded them for training.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from packing.experience import Experience


class ReplayBuffer:
    def __init__(self) -> None:
        self._records: list[Experience] = []

    def append(self, experience: Experience | Iterable[Experience]) -> None:
        """Add a right-padded or packed batch, or an iterable of records."""
        if isinstance(experience, Experience):
            records = [experience] if experience.is_record else experience.split()
        else:
            records = list(experience)
        for i, record in enumerate(records):
            if not isinstance(record, Experience) or not record.is_record:
                shape = getattr(getattr(record, "sequences", None), "shape", None)
                raise ValueError(f"record {i}: expected an Experience with sequences [T], got sequences {shape}")
            if record.attention_mask is not None:
                raise ValueError(f"record {i}: a record carries no attention_mask (it is unpadded by construction)")
        self._records.extend(records)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Experience]:
        return iter(self._records)

    def __getitem__(self, index: int) -> Experience:
        return self._records[index]

    @property
    def lengths(self) -> list[int]:
        """Token count of each record (what the microbatch planner takes)."""
        return [r.sequences.numel() for r in self._records]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def clear(self) -> None:
        self._records.clear()
