"""The process's own memory figures from /proc (Linux), for the memory benches. Imports
nothing heavy: bench/rank_memory.py's ranks read it before train.py sets the allocator up."""

from pathlib import Path


def status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmHWM: peak resident set since exec or the last
    `reset_peak`; VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field} line")


def reset_peak() -> None:
    """VmHWM := VmRSS (/proc/self/clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")
