"""The host allocator of a training process: memory a rank frees in bulk goes back to the OS.

glibc's malloc serves an allocation above its mmap threshold with a mapping of its own,
returned to the OS on `free`; smaller ones come from its heaps (arenas), which keep freed
memory for reuse and give it back only from the top, past the trim threshold. Both are
dynamic by default: freeing a mapped chunk raises the mmap threshold to that chunk's size
(up to 32 MiB). After FSDP2 frees its first all-gather buffer, every later buffer up to that
size (gathered layers, activations, logits chunks) is carved from a heap and stays in the
process once freed: a rank's resident set keeps the largest transients of every phase of a
step, whatever its shard (bench/rank_memory.py, `RL_ALLOCATOR=system` arm).

Fixing both thresholds low (128 KiB) returned that memory but made every larger tensor a
fresh mapping, zeroed by the kernel on first touch: ~20% of every step (issue 39). Instead,
`release_memory()` hands the heaps' free pages back (glibc's `malloc_trim(0)`, which also
releases whole free pages inside a heap, not only at its top) where memory is freed in bulk
and would otherwise stay: after the model is built and loaded (rl/trainer/trainer.py), and in
a sharded (FSDP2) CPU run, whose rank's memory should fall with the world size, after each
stage of a step (rollout, scoring, update, weight sync) and before each decoder layer's
backward (model/parallelize.py), when FSDP2 has just freed the layer before's unsharded
gradients. Measured per phase at 4 ranks (bench/rank_memory.py), the backward was where a
sharded rank kept ~0.7 GB it no longer used: its freed gradients and activations were not
reused by the next layer's. A one-process run keeps its heap between steps (the next step
reuses it at full speed; trimming at its stage boundaries cost ~0.4 s a step of page faults
and lowered no peak): it trims once, after loading (bench/speed.py prices it against `system`).

`RL_ALLOCATOR=trim` is the default, stated; `RL_ALLOCATOR=system` makes `release_memory` do
nothing (glibc's own behaviour). A value the user set for glibc (`MALLOC_MMAP_THRESHOLD_`,
`GLIBC_TUNABLES`, ...) is glibc's business and stays in force; another allocator preloaded with
`LD_PRELOAD` (jemalloc, tcmalloc) has no `malloc_trim`: nothing is called. Without glibc
(macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import os

SWITCH = "RL_ALLOCATOR"  # trim (default) | system
CHOICES = ("trim", "system")


def allocator_mode() -> str:
    """`RL_ALLOCATOR`, checked: "trim" (the default) or "system"."""
    choice = os.environ.get(SWITCH) or "trim"
    if choice not in CHOICES:
        raise ValueError(f"{SWITCH}={choice!r}: expected one of {', '.join(CHOICES)} "
                         "(trim: memory freed in bulk goes back to the OS, the default; system: glibc's own behaviour)")
    return choice


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the process's malloc is not glibc's."""
    if os.environ.get("LD_PRELOAD"):  # jemalloc / tcmalloc: their own release policy
        return None
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, ValueError, OSError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_memory() -> bool:
    """Return the heaps' free pages to the OS (`malloc_trim(0)`) unless `RL_ALLOCATOR=system`;
    True if anything was called. Costs a walk over the heaps' free chunks (milliseconds), and
    the pages it returns fault back in when reused: call it where memory was freed in bulk
    and would otherwise stay, not per tensor."""
    trim = _malloc_trim() if allocator_mode() == "trim" else None
    if trim is None:
        return False
    trim(0)
    return True
