"""model/allocator.py: memory a process frees goes back to the OS, by default, in train.py's ranks.

Each check runs in a fresh interpreter (glibc's thresholds are per process and one-way) that
plays the pattern that kept FSDP2's transients in a rank: one large buffer freed (glibc's dynamic
mmap threshold rises to its size), then many 1 MiB buffers touched and freed under a small
block that stays in use. With the thresholds fixed (configure_allocator) the 1 MiB buffers are
mappings of their own and go back on free; with glibc's own thresholds (RL_ALLOCATOR=system,
the control) they are carved from the heap, below the live block, and stay resident.

- configure_allocator returns the 1 MiB buffers to the OS; the control keeps them.
- its children (vLLM workers, spawned ranks) get the same from the environment alone.
- a value the user set (MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES) is kept and stays in force.
- RL_ALLOCATOR=system changes nothing; an unknown RL_ALLOCATOR value is an error naming it.
- train.py configures the allocator before it imports torch.
- bench/rank_memory.py's phase probe: per-phase host peaks reset at each boundary, device
  peaks (torch.cuda.max_memory_allocated on CUDA) read and reset per phase.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
BLOCKS = 96  # 1 MiB buffers freed under a live block

# The rank's pattern, in a fresh interpreter (live blocks between the buffers, as a rank's
# parameters and optimizer state sit between its transients). argv[1]: "configure" (call configure_allocator
# first) or "plain"; argv[2]: "spawn" to play the pattern in a child started after the call.
PATTERN = r"""
import ctypes, json, os, subprocess, sys
sys.path.insert(0, sys.argv[3])
done = None
if sys.argv[1] == "configure":
    from model.allocator import configure_allocator
    done = configure_allocator()
if sys.argv[2] == "spawn":  # the same program in a child that does not call configure_allocator
    child = subprocess.run([sys.executable, "-c", os.environ["PATTERN_CODE"], "plain", "here", sys.argv[3]],
                           capture_output=True, text=True, check=True)
    print(json.dumps({**json.loads(child.stdout), "configured": done}))
    sys.exit(0)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
MIB, N = 1 << 20, int(os.environ["BLOCKS"])
big = libc.malloc(16 * MIB); ctypes.memset(big, 1, 16 * MIB); libc.free(big)  # the first gather buffer
blocks, live = [], []
for i in range(N):
    blocks.append(libc.malloc(MIB))
    ctypes.memset(blocks[-1], 1, MIB)
    if i % 8 == 7:  # stays in use, above the last 8 buffers in the heap (too large for a hole below)
        live.append(libc.malloc(256 << 10))
held = rss()
for b in blocks:
    libc.free(b)
print(json.dumps({"returned": held - rss(), "configured": done,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any allocator setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "RL_ALLOCATOR"))}
    return {**env, "BLOCKS": str(BLOCKS), **extra}


def _pattern(mode: str, where: str = "here", **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PATTERN, mode, where, str(ROOT)], capture_output=True, text=True,
                          env=_clean_env(PATTERN_CODE=PATTERN, **env), timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_configured_process_returns_freed_buffers_and_the_control_keeps_them():
    on = _pattern("configure")
    assert on["configured"] == {"M_TRIM_THRESHOLD": "set 131072", "M_MMAP_THRESHOLD": "set 131072"}
    assert on["returned"] >= 0.9 * BLOCKS * MIB, on
    off = _pattern("configure", RL_ALLOCATOR="system")  # the opt-out: glibc's dynamic thresholds
    assert off["configured"] == {"M_TRIM_THRESHOLD": "off: RL_ALLOCATOR=system",
                                 "M_MMAP_THRESHOLD": "off: RL_ALLOCATOR=system"}
    assert off["env"] == {}
    assert off["returned"] <= 0.1 * BLOCKS * MIB, off  # the control: the same pattern keeps them resident
    assert _pattern("plain")["returned"] <= 0.1 * BLOCKS * MIB  # what an unconfigured process does


def test_children_get_the_thresholds_through_the_environment():
    child = _pattern("configure", "spawn")  # the child itself never calls configure_allocator
    assert child["env"] == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert child["returned"] >= 0.9 * BLOCKS * MIB, child
    control = _pattern("configure", "spawn", RL_ALLOCATOR="system")
    assert control["env"] == {} and control["returned"] <= 0.1 * BLOCKS * MIB, control


@pytest.mark.parametrize("setting", [{"MALLOC_MMAP_THRESHOLD_": str(32 * MIB)},
                                     {"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={32 * MIB}"}])
def test_a_user_value_is_kept_and_stays_in_force(setting):
    got = _pattern("configure", **setting)
    name, value = next(iter(setting.items()))
    kept = f"kept {name}={value}" if name.startswith("MALLOC_") else f"kept GLIBC_TUNABLES {value}"
    assert got["configured"] == {"M_TRIM_THRESHOLD": "set 131072", "M_MMAP_THRESHOLD": kept}
    assert got["env"].get("MALLOC_MMAP_THRESHOLD_") == setting.get("MALLOC_MMAP_THRESHOLD_")  # not overwritten
    # the user's 32 MiB threshold governs: the 1 MiB buffers come from the heap and stay
    assert got["returned"] <= 0.1 * BLOCKS * MIB, got


def test_an_unknown_switch_value_names_the_variable(monkeypatch):
    from model.allocator import configure_allocator

    monkeypatch.setenv("RL_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match=r"RL_ALLOCATOR='jemalloc': expected one of trim, system"):
        configure_allocator()


# train.py's top under a finder that stops the run at torch's first import, recording the
# allocator variables then: configure_allocator ran first iff they are set by that point.
FIRST_TORCH = r"""
import importlib.abc, json, os, runpy, sys
sys.path.insert(0, sys.argv[1])
class Stop(Exception):
    pass
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}))
            raise Stop
sys.meta_path.insert(0, Finder())
try:
    runpy.run_path(os.path.join(sys.argv[1], "train.py"), run_name="not_main")
except Stop:
    pass
"""


def test_train_py_configures_the_allocator_before_importing_torch():
    def env_at_torch(**extra):
        done = subprocess.run([sys.executable, "-c", FIRST_TORCH, str(ROOT)], capture_output=True, text=True,
                              env=_clean_env(**extra), timeout=60)
        assert done.returncode == 0 and done.stdout, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    assert env_at_torch() == {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    assert env_at_torch(RL_ALLOCATOR="system") == {}  # the control: opted out, nothing set


def _rank_memory():
    if str(ROOT / "bench") not in sys.path:  # as when run as a script: its siblings (procfs) importable
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("rank_memory", ROOT / "bench" / "rank_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeDevice:
    """torch.cuda's peak counter as CudaPeak uses it: a peak per phase, reset at each boundary."""

    def __init__(self, peaks):
        self.peaks, self.resets = list(peaks), 0

    def reset(self):
        self.resets += 1

    def peak(self):
        return self.peaks[self.resets - 1]


def test_phase_probe_resets_the_host_mark_and_reads_the_device_peak_per_phase():
    probe = _rank_memory().PhaseMemory(FakeDevice([111, 222, 333]))
    probe.begin("load")
    buf = mmap.mmap(-1, 64 * MIB)  # a mapping of its own: its pages leave the process on close
    buf.write(b"\1" * (64 * MIB))
    buf.close()
    probe.begin("rollout")  # closes load
    probe.end()
    report = probe.report()
    assert report["resettable"]
    load, rollout = report["phases"]["load"], report["phases"]["rollout"]
    assert load["host_peak"] - report["floor"] >= 60 * MIB  # the 64 MiB transient is load's
    assert rollout["host_peak"] < load["host_peak"] - 32 * MIB  # reset at the boundary: not rollout's
    assert report["peak"] >= load["host_peak"]  # the process's peak keeps it
    assert (load["device_peak"], rollout["device_peak"]) == (111, 222)
