"""Per-sample records, the unpadded replay buffer, microbatch planning and the collate."""

from packing.experience import Experience, Kind
from packing.buffer import ReplayBuffer
from packing.collate import make_experience_batch
from packing.planner import plan_microbatches

__all__ = ["Experience", "Kind", "ReplayBuffer", "make_experience_batch", "plan_microbatches"]
