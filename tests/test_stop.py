"""A stop signal (SIGTERM, SIGUSR1) ends a run at a step boundary with a checkpoint it resumes from.

- `StopSignal` records the signal instead of dying, restores the previous handlers after its
  block, and `requested()` is true on every rank once any rank got one (2 gloo ranks).
- One process, SIGTERM as step 3 begins: the step finishes, the run saves step_00000004, logs
  the stop and exits 0; `resume=auto` finishes it with the uninterrupted run's metrics.
- launch/slurm.sbatch itself (a stand-in srun that runs its command line on this machine; one
  node of 2 ranks, c10d on localhost, GLOO_SOCKET_IFNAME passed through): SIGUSR1 to the job
  step, as srun passes SLURM's time-limit warning on, reaches both ranks through torchrun;
  they stop after the same step with one complete checkpoint holding both ranks' shards, and
  the same script with resume=auto continues from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.parallel_dims import ParallelDims
from rl.trainer.checkpoint import complete_checkpoints
from rl.trainer.stop import StopSignal
from testing.distributed import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "step_s", "weight_sync_s"}
RUN = ["trainer.max_steps=8", "trainer.plot=false", "trainer.progress=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the handler
def test_a_stop_signal_is_recorded_and_the_previous_handlers_come_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    with StopSignal(ParallelDims()) as stop:
        assert not stop.requested() and stop.received is None  # control: nothing received, no stop
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process without the handler
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.received == "SIGUSR1"  # the first one is named
    assert {sig: signal.getsignal(sig) for sig in before} == before


def _one_rank_signalled(rank: int, world: int) -> tuple[bool, bool, str | None]:
    import torch.distributed as dist

    with StopSignal(ParallelDims(world_size=world)) as stop:
        first = stop.requested()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        dist.barrier()
        return first, stop.requested(), stop.received


@pytest.mark.slow
def test_every_rank_stops_when_one_rank_got_the_signal():
    got = run_distributed(_one_rank_signalled, 2)
    assert got == [(False, True, None), (False, True, "SIGTERM")]


# ------------------------------------------------------------- one process, end to end
def _train(out: Path, *overrides: str, signal_at: str | None = None) -> subprocess.CompletedProcess:
    hook = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault"), str(ROOT)]), "RL_TEST_KILL": signal_at,
            "RL_TEST_SIGNAL": "TERM"} if signal_at else {}
    return subprocess.run([sys.executable, "train.py", f"hydra.run.dir={out}", *RUN, *overrides], cwd=ROOT,
                          env={**ENV, **hook}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_sigterm_saves_the_step_it_stops_at_and_resume_gives_the_uninterrupted_metrics(tmp_path):
    whole, out = tmp_path / "whole", tmp_path / "run"
    done = _train(whole)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = _train(out, signal_at="in_step:3")  # SIGTERM to itself as step 3 begins
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    log = (out / "train.log").read_text()
    ckpt = out / "checkpoints" / "step_00000004"
    assert f"SIGTERM: stopped after 4 of 8 steps with the checkpoint {ckpt}" in log
    assert complete_checkpoints(out / "checkpoints") == [ckpt]
    assert [m["step"] for m in _metrics(out)] == [0, 1, 2, 3]
    resumed = _train(out, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt} (4 steps done)" in (out / "train.log").read_text()
    assert _metrics(out) == _metrics(whole)  # steps 4..7 bit for bit


# ------------------------------------------------------------ launch/slurm.sbatch, end to end
def _sbatch(tmp_path: Path, job: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """launch/slurm.sbatch as sbatch would start it on one node of 2 ranks, with `srun` a stand-in
    that drops its options and runs the command in its place (as srun's task, the same process)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": job, "NPROC": "2",
             "SLURM_SUBMIT_DIR": str(ROOT), "RDZV_PORT": str(free_port()), "MAX_RESTARTS": "0",
             "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["bash", str(ROOT / "launch" / "slurm.sbatch"), *overrides],
                            env={**ENV, "PATH": f"{bin_dir}:{ENV['PATH']}", **slurm, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signal_after_two_steps(proc: subprocess.Popen, out: Path, sig: signal.Signals) -> str:
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    proc.send_signal(sig)
    return proc.communicate(timeout=300)[0]


@pytest.mark.slow
def test_slurm_time_limit_signal_stops_every_rank_at_one_checkpoint_that_resumes(tmp_path):
    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "trainer.plot=false", "trainer.progress=false"]
    log = _signal_after_two_steps(_sbatch(tmp_path, "4242", *args, "trainer.max_steps=40"), out, signal.SIGUSR1)
    (ckpt,) = complete_checkpoints(out / "checkpoints")
    n = int(ckpt.name.removeprefix("step_"))
    assert 2 <= n < 40, log[-3000:]
    assert f"SIGUSR1: stopped after {n} of 40 steps" in (out / "train.log").read_text()
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(_metrics(out)) == n and "forcefully exiting" not in log  # both ranks left by themselves
    resumed = _sbatch(tmp_path, "4243", *args, f"trainer.max_steps={n + 2}", "resume=auto")
    tail = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, tail[-3000:]
    assert f"resumed from {ckpt} ({n} steps done)" in (out / "train.log").read_text()
    assert [m["step"] for m in _metrics(out)] == list(range(n + 2))

