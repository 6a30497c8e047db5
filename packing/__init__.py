"""Per-sample records, microbatch planning and the collate."""

from packing.experience import Experience, Kind
from packing.collate import make_experience_batch
from packing.planner import plan_microbatches

__all__ = ["Experience", "Kind", "make_experience_batch", "plan_microbatches"]
