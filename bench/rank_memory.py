"""Host memory per rank of a one-step run, by world size: does it fall as ranks are added?

The run is the user's: `torchrun --standalone --nproc-per-node W train.py model=pretrained
model.pretrained_path=<178M Qwen3> trainer.max_steps=1` (task=target_token, GRPO, one step,
the final checkpoint, rollout.replica=auto), every other setting at its default and no
allocator variable set by this bench: the children's environment holds no `MALLOC_*`,
`GLIBC_TUNABLES` or `LD_PRELOAD` (removed from this process's own, if set, and said so), each
rank checks that before train.py runs, and the allocator is what train.py does with it
(runtime/allocator.py). The arms, side by side:

    default   train.py as a user runs it (runtime/allocator.py: glibc's memory handed back after
              loading and before each sharded layer's backward)
    system    the control: RL_ALLOCATOR=system, glibc's own behaviour (dynamic thresholds, no trim)
    fixed128k glibc's mmap and trim thresholds fixed at 128 KiB from the environment
              (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ = 131072) with RL_ALLOCATOR=system:
              the allocator before issue 39 (--arms fixed128k)
    sharded   the default allocator with rollout.replica=sharded: no rollout copy, generation
              from the FSDP2 shards; its rollout seconds against the default's are what the
              copy buys (--arms default sharded; rl/rollout/replica.py)

Each rank runs train.py's `main` through a small probe (`--rank`, below) that marks the
phases of the run by wrapping the functions train.py calls; at each boundary it reads the
rank's peak resident set since the last boundary (`VmHWM`, reset by /proc/self/clear_refs 5)
and, on CUDA, the peak device memory (`torch.cuda.max_memory_allocated`, reset by
`reset_peak_memory_stats`):

    floor       resident set after the imports, the config and the process group (what any rank pays)
    load        build_trainer: policy (sharded load), rollout engine (the replica) and its first sync
    rollout     Trainer.rollout: generation, rewards, the metadata all-gather
    training    Trainer.step after the rollout: plan, exchange, collate, score, forward/backward, AdamW
    sync        the step's weight sync, policy shards -> the rollout engine's replica (rl/rollout/sync.py)
    checkpoint  Checkpointer.after_step: the final DCP save

A rank's peak is the largest of all of them and of the gaps between (resume, metrics, the
curves plot). Also per rank: user / system CPU seconds and minor page faults (what returning
memory to the OS costs: every fresh mapping is zero-filled on first touch).

The checkpoint (the 178M random Qwen3 of bench/load_memory.py: 16 layers, hidden 768, vocab
49152, untied head, 705 MB in fp32, read as bf16) is written once to /tmp. A world is
launched only if the memory it needs fits (MemAvailable against world x the arm's per-rank peak
at its widest world so far, +10%); one that does not is reported as skipped.

    python bench/rank_memory.py                        # worlds 1 2 4 8: default arm; control at 1 2 4 (~5 min)
    python bench/rank_memory.py --quick                # worlds 1 4, both arms (~3 min on 2 cores)
    python bench/rank_memory.py --arms default system fixed128k --worlds 1 4 --control-worlds 1 4
    python bench/rank_memory.py --arms default sharded --worlds 4 --control-worlds 4   # what the copy buys

Last line: one JSON object (bench/results/rank_memory.json).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procfs import reset_peak, status

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PHASES = ("load", "rollout", "training", "sync", "checkpoint")
# what decides the allocator of a process at exec: the bench hands the children none of these
ALLOCATOR_ENV = ("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "RL_ALLOCATOR")
THRESHOLD = "131072"
ARMS = {
    "default": {},
    "system": {"RL_ALLOCATOR": "system"},
    "fixed128k": {"RL_ALLOCATOR": "system", "MALLOC_MMAP_THRESHOLD_": THRESHOLD, "MALLOC_TRIM_THRESHOLD_": THRESHOLD},
    "sharded": {},
}
ARM_OVERRIDES = {"sharded": ["rollout.replica=sharded"]}  # an arm's Hydra overrides beyond the run's


def allocator_env(env) -> dict[str, str]:
    """The variables of `env` that decide a process's allocator (MALLOC_*, GLIBC_TUNABLES, ...)."""
    return {k: v for k, v in env.items() if k.startswith(ALLOCATOR_ENV)}


# ------------------------------------------------------------------ inside a rank
class CudaPeak:
    """The device side of a phase: `torch.cuda.max_memory_allocated` since the last reset."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda

    def reset(self) -> None:
        self.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return int(self.cuda.max_memory_allocated())


class PhaseMemory:
    """Peak host memory (and device memory, when `device` is given) of each phase of a run.

    `begin(name)` closes the open phase and opens `name`; `end()` closes the open phase. A
    phase's host figure is the resident set's high-water mark between its boundaries (the
    kernel's mark is reset at each boundary, /proc/self/clear_refs 5); where the mark cannot
    be reset, `resettable` is False and each figure is the peak since the process started.
    `peak()` is the largest mark over the whole process, phases and the gaps between them.
    `device` is an object with `reset()` and `peak()` (CudaPeak on CUDA); None records None."""

    def __init__(self, device=None) -> None:
        self.device, self.open, self.phases = device, None, {}
        self.floor = None  # the resident set when the first phase begins: imports + config + process group
        self.floor_peak = None  # the mark then: the imports' own transients included
        self.resettable = True
        self._max = 0
        self._t = 0.0

    def _mark(self) -> int:
        hwm = status("VmHWM")
        self._max = max(self._max, hwm)
        return hwm

    def _reset(self) -> None:
        try:
            reset_peak()
        except OSError:
            self.resettable = False
        if self.device is not None:
            self.device.reset()

    def begin(self, name: str) -> None:
        if self.floor is None:
            self.floor, self.floor_peak = status("VmRSS"), self._mark()
        if self.open is not None:
            self.end()  # its figures, then the reset
        else:
            self._mark()  # the gap before this phase
            self._reset()
        self.open, self._t = name, time.perf_counter()

    def end(self) -> None:
        if self.open is None:
            return
        self.phases[self.open] = {"host_peak": self._mark(), "host_end": status("VmRSS"),
                                  "device_peak": self.device.peak() if self.device is not None else None,
                                  "seconds": round(time.perf_counter() - self._t, 2)}
        self.open = None
        self._reset()  # the gap after it is measured on its own (its mark goes into peak())

    def peak(self) -> int:
        return max(self._max, status("VmHWM"))

    def report(self) -> dict:
        return {"floor": self.floor, "floor_peak": self.floor_peak, "resettable": self.resettable,
                "phases": self.phases, "peak": self.peak()}


def _wrap(owner, name: str, before=None, after=None) -> None:
    fn = getattr(owner, name, None)
    if fn is None:  # the run's stages were renamed: the phases below name what they wrap
        raise AttributeError(f"{getattr(owner, '__name__', owner)} has no {name!r}: update instrument() "
                             "in bench/rank_memory.py to the run's stages (train.py, rl/trainer/trainer.py)")

    def wrapped(*args, **kwargs):
        if before:
            before()
        out = fn(*args, **kwargs)
        if after:
            after()
        return out

    setattr(owner, name, wrapped)


def instrument(train_module, probe: PhaseMemory) -> None:
    """Mark the phases of `train_module.main` (train.py) on `probe`."""
    from rl.trainer import build as build_module, trainer as trainer_module
    from rl.trainer.checkpoint import Checkpointer
    from rl.trainer.trainer import Trainer

    _wrap(build_module, "build_trainer", lambda: probe.begin("load"), probe.end)
    _wrap(Trainer, "rollout", lambda: probe.begin("rollout"), lambda: probe.begin("training"))
    _wrap(trainer_module, "sync_weights", lambda: probe.begin("sync"))  # the step's last part
    _wrap(Trainer, "step", after=probe.end)
    _wrap(Checkpointer, "after_step", lambda: probe.begin("checkpoint"), probe.end)


def rank_main(out_dir: str, overrides: list[str]) -> None:
    """One torchrun rank: train.py's main under the phase probe; the report in out_dir/rank<r>.json."""
    env_at_start = allocator_env(os.environ)  # before train.py's top runs
    sys.path[0] = str(ROOT)  # the repo, not bench/ (whose module names are generic: step, memory, ...)
    import train  # its top sets up the allocator before anything large is allocated

    import torch

    after_import = allocator_env(os.environ)  # what train.py hands its own children
    device = CudaPeak() if torch.cuda.is_available() else None
    probe = PhaseMemory(device)
    instrument(train, probe)
    sys.argv = [str(ROOT / "train.py"), *overrides]
    # Hydra finds conf/ beside the file of a `__main__` task function (a module's is looked up as a package)
    train.main.__wrapped__.__module__ = "__main__"
    t0 = time.perf_counter()
    train.main()
    use = resource.getrusage(resource.RUSAGE_SELF)
    rank = int(os.environ.get("RANK", "0"))
    report = {**probe.report(), "seconds": round(time.perf_counter() - t0, 2), "cuda": device is not None,
              "user_s": round(use.ru_utime, 2), "sys_s": round(use.ru_stime, 2), "minor_faults": use.ru_minflt,
              "env_at_start": env_at_start, "env_after_import": after_import}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--rank":
    rank_main(sys.argv[2], sys.argv[3:])
    sys.exit(0)


# ------------------------------------------------------------------ the driver
def _meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field} line")


def check_env(arm: str, ranks: list[dict]) -> None:
    """The figure is honest: each rank started with the arm's allocator variables and no others,
    and train.py handed its children no allocator variable of its own."""
    want = ARMS[arm]
    for r, rep in enumerate(ranks):
        if rep["env_at_start"] != want:
            raise AssertionError(f"arm {arm} rank {r}: allocator variables at start {rep['env_at_start']}, "
                                 f"expected {want}")
        if rep["env_after_import"] != want:  # train.py sets no allocator variable (runtime/allocator.py)
            raise AssertionError(f"arm {arm} rank {r}: after train.py's import the allocator variables are "
                                 f"{rep['env_after_import']}: runtime/allocator.py did not run as expected")


def run_world(world: int, arm: str, folder: Path, extra: list[str], timeout: float) -> dict:
    """One torchrun launch of the probe; per-rank reports and the launch's wall seconds."""
    work = Path(tempfile.mkdtemp(prefix=f"rank_memory_{arm}_w{world}_"))
    try:
        overrides = ["model=pretrained", f"model.pretrained_path={folder}", "trainer.max_steps=1",
                     "trainer.progress=false", f"hydra.run.dir={work / 'run'}", *ARM_OVERRIDES.get(arm, []), *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith(ALLOCATOR_ENV)}
        env.update(ARMS[arm])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(__file__).resolve()), "--rank", str(work), *overrides]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            raise RuntimeError(f"arm {arm} world {world} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-6000:]}")
        ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
        log = (work / "run" / "train.log").read_text() if (work / "run" / "train.log").is_file() else ""
        replica = next((ln.split(" - ", 1)[-1] for ln in log.splitlines() if "rollout.replica=" in ln), None)
        return {"ranks": ranks, "wall_s": round(wall, 1), "replica": replica}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(run: dict) -> dict:
    """Max over ranks of each figure (GB), per phase."""
    ranks = run["ranks"]
    gb = lambda b: round(b / 1e9, 3)  # noqa: E731
    out = {"peak_gb": gb(max(r["peak"] for r in ranks)), "floor_gb": gb(max(r["floor"] for r in ranks)),
           "floor_peak_gb": gb(max(r["floor_peak"] for r in ranks))}
    for ph in PHASES:
        got = [r["phases"][ph] for r in ranks if ph in r["phases"]]
        if got:
            out[f"{ph}_gb"] = gb(max(g["host_peak"] for g in got))
            out[f"{ph}_end_gb"] = gb(max(g["host_end"] for g in got))
            out[f"{ph}_s"] = max(g["seconds"] for g in got)
            if got[0]["device_peak"] is not None:
                out[f"{ph}_cuda_gb"] = gb(max(g["device_peak"] for g in got))
    out.update(user_s=max(r["user_s"] for r in ranks), sys_s=max(r["sys_s"] for r in ranks),
               minor_faults=max(r["minor_faults"] for r in ranks), wall_s=run["wall_s"])
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--control-worlds", type=int, nargs="+", default=[1, 2, 4],
                        help="worlds of the arms other than default (8 ranks with glibc's defaults need ~18 GB)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["default", "system"])
    parser.add_argument("--quick", action="store_true", help="worlds 1 and 4 only")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="extra Hydra overrides of every run (e.g. rollout.replica=sharded)")
    args = parser.parse_args()
    if args.quick:
        args.worlds = args.control_worlds = [1, 4]

    sys.path.insert(0, str(BENCH))
    from common import emit  # noqa: E402  (puts the repo root on sys.path)
    from load_memory import FOLDER, write_checkpoint  # noqa: E402  (the same 178M checkpoint)

    removed = sorted(allocator_env(os.environ))
    if removed:
        print(f"not handed to the ranks (this shell sets them): {removed}", flush=True)
    size = write_checkpoint(0, 1)["bytes"]
    print(f"checkpoint {FOLDER}: {size / 1e6:.0f} MB", flush=True)
    load = [os.getloadavg()]
    runs, summary, skipped = {}, {}, []
    for arm in args.arms:
        last = None  # the arm's per-rank peak at its widest world so far: per rank, a wider world needs less
        for world in sorted(args.worlds if arm == "default" else args.control_worlds):
            need, avail = (last or 3.2e9) * world * 1.1, _meminfo("MemAvailable")
            if need > avail:
                skipped.append(f"{arm} world {world}: needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available")
                print("skipped:", skipped[-1], flush=True)
                continue
            run = run_world(world, arm, FOLDER, args.overrides, args.timeout)
            check_env(arm, run["ranks"])
            load.append(os.getloadavg())
            runs[f"{arm}_world{world}"] = run
            s = summary[f"{arm}_world{world}"] = summarize(run)
            last = max(r["peak"] for r in run["ranks"])
            phases = " ".join(f"{ph} {s[f'{ph}_gb']:.2f}" for ph in PHASES if f"{ph}_gb" in s)
            print(f"{arm} world {world}: peak {s['peak_gb']:.3f} GB per rank (floor {s['floor_gb']:.3f}; {phases}), "
                  f"user {s['user_s']:.0f} s sys {s['sys_s']:.0f} s, {s['minor_faults']} minor faults, "
                  f"{s['wall_s']:.0f} s wall; {run['replica']}", flush=True)
    line = {"checkpoint_bytes": size, "overrides": args.overrides, "removed_env": removed, "skipped": skipped,
            "loadavg_1m_max": round(max(x[0] for x in load), 2),
            "loadavg_1m_mean": round(sum(x[0] for x in load) / len(load), 2),
            "import_floor_gb": summary.get("default_world1", {}).get("floor_gb")}
    for arm in args.arms:
        one = summary.get(f"{arm}_world1", {}).get("peak_gb")
        for key, s in summary.items():
            if key.startswith(arm + "_world"):
                line[f"peak_gb_{key}"] = s["peak_gb"]
                line[f"rollout_s_{key}"] = s.get("rollout_s")  # generation's seconds: what the copy buys (sharded)
                if one and not key.endswith("_world1"):
                    line[f"ratio_{key}"] = round(s["peak_gb"] / one, 3)
    for key, s in summary.items():  # the control and the default side by side, at one world
        arm, _, world = key.partition("_world")
        if arm != "default" and f"default_world{world}" in summary:
            line[f"default_vs_{key}"] = round(summary[f"default_world{world}"]["peak_gb"] / s["peak_gb"], 3)
    emit("rank_memory", line, {"summary": summary, "runs": runs, "loadavg": load})


if __name__ == "__main__":
    main()
