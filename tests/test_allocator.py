"""runtime/allocator.py: memory a rank frees in bulk goes back to the OS at the step's phase
boundaries, and between them freed memory is reused at glibc's full speed.

Each check runs in a fresh interpreter (glibc's thresholds are per process and one-way) that
plays the pattern that kept FSDP2's transients in a rank: one large buffer freed (glibc's dynamic
mmap threshold rises to its size), then many 1 MiB buffers touched and freed under a small
block that stays in use: they are carved from the heap, below the live block.

- release_memory hands those buffers back; with RL_ALLOCATOR=system (the control) they stay.
- between two releases the heap reuses them: allocating and touching them again costs no page
  fault; the control, glibc's thresholds fixed at 128 KiB (the allocator of issue 39's report),
  maps and zero-fills every one anew.
- where: once after the model is loaded; in a sharded (FSDP2) CPU run also after each stage of
  a step and before each decoder layer's backward (FSDP2 has just freed the layer before's
  unsharded gradients); never in a one-process step.
- an unknown RL_ALLOCATOR value is an error naming it, from train.py before anything is built.
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
# parameters and optimizer state sit between its transients): the buffers freed, then allocated
# and touched again (`faults`: the minor page faults of that second round), freed again, then
# release_memory (`returned`: what the process's resident set lost over the second free and the release).
PATTERN = r"""
import ctypes, json, os, resource, sys
sys.path.insert(0, sys.argv[1])
from runtime.allocator import release_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
MIB, N = 1 << 20, int(os.environ["BLOCKS"])
big = libc.malloc(16 * MIB); ctypes.memset(big, 1, 16 * MIB); libc.free(big)  # the first gather buffer
live = []
def touch_all():
    blocks = []
    for i in range(N):
        blocks.append(libc.malloc(MIB))
        ctypes.memset(blocks[-1], 1, MIB)
        if i % 8 == 7 and len(live) < N // 8:  # stays in use, above the last 8 buffers in the heap
            live.append(libc.malloc(256 << 10))
    return blocks
for b in touch_all():
    libc.free(b)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = touch_all()  # the next phase's transients, as large as the last one's
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
held = rss()
for b in blocks:
    libc.free(b)
released = release_memory()
print(json.dumps({"returned": held - rss(), "faults": faults, "released": released}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any allocator setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "RL_ALLOCATOR"))}
    return {**env, "BLOCKS": str(BLOCKS), **extra}


def _pattern(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PATTERN, str(ROOT)], capture_output=True, text=True,
                          env=_clean_env(**env), timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_release_returns_the_freed_heap_and_the_control_keeps_it():
    on = _pattern()
    assert on["released"] and on["returned"] >= 0.9 * BLOCKS * MIB, on
    off = _pattern(RL_ALLOCATOR="system")  # the opt-out: glibc's own behaviour
    assert not off["released"] and off["returned"] <= 0.1 * BLOCKS * MIB, off


def test_freed_memory_is_reused_without_page_faults_between_releases():
    """The speed side: the default leaves glibc's thresholds dynamic, so a phase's transients
    come back from the heap; fixed 128 KiB thresholds (the control) map and zero-fill each."""
    pages = BLOCKS * MIB // mmap.PAGESIZE
    reused = _pattern()
    assert reused["faults"] <= 0.1 * pages, reused
    fixed = _pattern(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    assert fixed["faults"] >= 0.9 * pages, fixed


def _releases_in_a_step(*overrides: str) -> tuple[int, int, int]:
    """(release_memory calls while the trainer is built, calls during one step, decoder layers)."""
    import torch.distributed as dist

    from model import parallelize
    from rl.trainer import build as build_module, trainer as trainer_module
    from testing.inprocess import SMALL, trainer

    calls = []
    count = lambda: calls.append(1) or True  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build_module, "release_memory", count)  # build_trainer's
        mp.setattr(trainer_module, "release_memory", count)  # the step's
        mp.setattr(parallelize, "release_memory", count)
        try:
            tr = trainer(*SMALL, "model=dense_tiny", "trainer.device=cpu", *overrides)
            built = len(calls)
            tr.step(0)
            return built, len(calls) - built, len(parallelize.decoder_layers(tr.actor.model))
        finally:
            if dist.is_initialized():  # the one-rank group of model.param_dtype: gone before the next test
                dist.destroy_process_group()


def test_release_points_after_loading_and_before_each_sharded_layers_backward():
    """Wiring: the trainer releases once after building; a sharded model (FSDP2, here the
    one-rank group of model.param_dtype) after each stage of a step (rollout, scoring, update,
    sync) and before every decoder layer's backward; a one-process model without FSDP2 never
    during a step (the headline run keeps glibc's full speed)."""
    for checkpointing in ("false", "true"):  # activation checkpointing recomputes each layer's forward
        built, during, layers = _releases_in_a_step("model.param_dtype=bfloat16",
                                                    f"trainer.activation_checkpointing={checkpointing}")
        stages = 4
        assert built == 1 and during - stages >= layers >= 2 and (during - stages) % layers == 0, (built, during)
    built, during, _ = _releases_in_a_step()
    assert (built, during) == (1, 0)


def test_an_unknown_switch_value_names_the_variable(monkeypatch):
    from runtime.allocator import allocator_mode

    monkeypatch.setenv("RL_ALLOCATOR", "jemalloc")
    with pytest.raises(ValueError, match=r"RL_ALLOCATOR='jemalloc': expected one of trim, system"):
        allocator_mode()
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          env=_clean_env(RL_ALLOCATOR="jemalloc"), timeout=120)
    assert done.returncode != 0 and "RL_ALLOCATOR='jemalloc'" in done.stderr


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
