"""The host allocator of a training process: memory a rank frees goes back to the OS.

glibc's malloc serves an allocation above its mmap threshold with a mapping of its own,
returned to the OS on `free`; smaller ones come from its heaps (arenas), which keep freed
memory for reuse and give it back only from the top, past the trim threshold. Both are
dynamic by default: freeing a mapped chunk raises the mmap threshold to that chunk's size
(up to 32 MiB) and the trim threshold to twice that. After FSDP2 frees its first all-gather
buffer, every later buffer up to that size (gathered layers, activations, logits chunks)
is carved from a heap and stays in the process once freed: a rank's resident set keeps its
largest transients, whatever its shard (bench/rank_memory.py, `RL_ALLOCATOR=system` arm).

`configure_allocator()` fixes both at 128 KiB (glibc's starting mmap threshold; fixing it
turns the dynamic rise off) with `mallopt`, which governs every allocation after the call,
and puts the same values in the environment (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`,
read by glibc at a process's start) for the processes a run starts. train.py calls it first,
before the imports that allocate (torch, its OpenMP runtime, the model), so every torchrun
rank (launch/, make) has it unasked.

Opting out: `RL_ALLOCATOR=system` leaves glibc's own (dynamic) thresholds; `RL_ALLOCATOR=trim`
is the default, stated. A value the user set for either parameter (its variable, or
`glibc.malloc.mmap_threshold` / `trim_threshold` in `GLIBC_TUNABLES`) is kept; another
allocator preloaded with `LD_PRELOAD` (jemalloc, tcmalloc) does not read glibc's `mallopt`,
so it is unaffected. Without glibc (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import os

THRESHOLD = 128 * 1024  # bytes: glibc's own starting mmap threshold, held fixed
SWITCH = "RL_ALLOCATOR"  # trim (default) | system
CHOICES = ("trim", "system")
# mallopt parameter -> (its number in malloc.h, the environment variable, the GLIBC_TUNABLES name)
PARAMETERS = {
    "M_TRIM_THRESHOLD": (-1, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
    "M_MMAP_THRESHOLD": (-3, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
}


def _user_value(env: str, tunable: str) -> str | None:
    """The user's own setting of a parameter: its variable, or its entry in GLIBC_TUNABLES."""
    if os.environ.get(env):
        return f"{env}={os.environ[env]}"
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        if item.partition("=")[0] == tunable:
            return f"GLIBC_TUNABLES {item}"
    return None


def configure_allocator(threshold: int = THRESHOLD) -> dict[str, str]:
    """Fix glibc's mmap and trim thresholds at `threshold` bytes for this process (mallopt)
    and its children (environment), keeping any value the user set; nothing with
    RL_ALLOCATOR=system. Returns what happened to each parameter: "set <bytes>",
    "kept <the user's setting>", "off: RL_ALLOCATOR=system" or "unavailable: <why>"."""
    choice = os.environ.get(SWITCH) or "trim"
    if choice not in CHOICES:
        raise ValueError(f"{SWITCH}={choice!r}: expected one of {', '.join(CHOICES)} "
                         "(trim: freed memory goes back to the OS, the default; system: glibc's own thresholds)")
    if choice == "system":
        return {name: f"off: {SWITCH}=system" for name in PARAMETERS}
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, ValueError, OSError) as e:  # not glibc: its tunables do not exist
        return {name: f"unavailable: not glibc ({e})" for name in PARAMETERS}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {}
    for name, (number, env, tunable) in PARAMETERS.items():
        user = _user_value(env, tunable)
        if user is not None:  # glibc read it at this process's start; the children inherit it
            done[name] = f"kept {user}"
        elif mallopt(number, threshold) != 1:
            done[name] = f"unavailable: mallopt({name}, {threshold}) failed"
        else:
            os.environ[env] = str(threshold)
            done[name] = f"set {threshold}"
    return done
