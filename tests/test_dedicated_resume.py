"""Checkpoints and resume with dedicated rollout ranks (`parallel.rollout_ranks`, rl/rollout/dedicated.py).

Every rank writes its part of one checkpoint (the trainers their shards, each generator its queued
rollouts and RNG state) and rank 0 publishes it only when every part is there: a save whose
generator part rank 0 cannot see (folders not shared between nodes) is refused on every rank, and a
checkpoint whose generator part is lost is passed over by resume=auto. Under torchrun's restarts
(MAX_RESTARTS=1 launch/local.sh 4: 2 trainers, 2 generators, max_staleness=1, a checkpoint every 2
of 6 steps) a SIGKILL of a generator as it starts rollout 5 (during step 4, after the step-4
checkpoint) or of trainer 0 as it starts step 5 resumes from that checkpoint with every generator's
rollouts (prompts, versions, tokens, log-probs, rewards), the metrics and the final weights of the
uninterrupted run: rollout 4 (version 3, older than the checkpoint's 4) comes from the checkpoint,
rollout 5 (in flight at the kill) is generated again with version 4. The control resumes the same
checkpoint on another layout (1 trainer: the generators' rollouts, keyed by rank, are let go): step 4
is generated again with version 4, other records and another loss, while step 5 (version 4 either
way) is the same, so the difference is the queued rollouts alone.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from run_folder_worker import _error
from testing.distributed import run_distributed
from testing.inprocess import SMALL, compose

from runtime.library_noise import quiet_single_process
from rl.rollout.scheduler import unpack_rollouts

ROOT = Path(__file__).resolve().parents[1]
DENSE = (*SMALL, "model=dense_tiny", "task.prompts_per_step=4", "algo.tis_cap=2.0", "eval.every=0",
         "trainer.log_samples=0", "rollout.max_staleness=1")
RUN = ("trainer.max_steps=6", "trainer.plot=false", "checkpoint.every=2")
FOUR = ("parallel.rollout_ranks=2",)  # 4 ranks: trainers 0, 1; generators 2, 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault"), str(ROOT)])}


def launch(out: Path, nproc: int, *overrides: str, takes: Path, kill: str | None = None, restarts: bool = False):
    """train.py under torchrun (`restarts`: MAX_RESTARTS=1 launch/local.sh), the fault hook
    tests/fault/sitecustomize.py tracing every rollout taken into `takes` (and `kill`ing a rank)."""
    args = [f"hydra.run.dir={out}", *DENSE, *RUN, *overrides]
    cmd = (["launch/local.sh", str(nproc), *args] if restarts else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "train.py",
            *args])
    env = {**ENV, "RL_TEST_TAKES": str(takes), **({"RL_TEST_KILL": kill} if kill else {}),
           **({"MAX_RESTARTS": "1"} if restarts else {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def metrics(out: Path) -> list[dict]:
    """metrics.jsonl without its seconds (`*_s`: timings, which differ run to run)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def taken(path: Path, rank: int, attempt: int | None = None) -> list[dict]:
    """The RL_TEST_TAKES lines of `rank` (of one torchrun attempt), without the attempt and rank."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in t.items() if k not in ("attempt", "rank")} for t in lines
            if t["rank"] == rank and attempt in (None, t["attempt"])]


def policy(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The policy weights a checkpoint holds, whole."""
    meta = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith("actor.weights.")}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dedicated")
    ok(launch(root / "run", 4, *FOUR, takes=root / "takes.jsonl"))
    return metrics(root / "run"), root / "takes.jsonl", policy(root / "run" / "checkpoints" / "step_00000006")


def _check_restarted(runs: Path, proc, takes: Path, uninterrupted, killed: int) -> Path:
    """Rank `killed` SIGKILLed, then one run folder whose attempt 1 resumed from step 4 and finished
    as the uninterrupted run: every generator's rollouts (those of attempt 0 before the checkpoint,
    then attempt 1's), the metrics, the final weights."""
    want, want_takes, want_policy = uninterrupted
    ok(proc)
    (out,) = runs.iterdir()  # both attempts wrote one run folder
    log = proc.stdout + proc.stderr
    assert f"failed (exitcode: -9) local_rank: {killed} " in log, log[-4000:]  # torchrun saw the SIGKILL
    assert "torchrun restart 1" in log and f"resumed from {out / 'checkpoints' / 'step_00000004'}" in log, log[-4000:]
    for rank in (2, 3):
        mine, first, again = taken(want_takes, rank), taken(takes, rank, 0), taken(takes, rank, 1)
        assert [t["versions"] for t in mine] == [[0], [0], [1], [2], [3], [4]], rank
        assert [t["step"] for t in again] == [4, 5], rank  # step 4 from the checkpoint, step 5 generated again
        assert [t for t in first if t["step"] < 4] + again == mine, rank
        assert all(t in mine for t in first), rank  # what attempt 0 took after the checkpoint was the same too
    assert metrics(out) == want
    got = policy(out / "checkpoints" / "step_00000006")
    assert got.keys() == want_policy.keys()
    for name, value in want_policy.items():  # the same layout: bit for bit
        assert torch.equal(got[name], value), name
    return out


@pytest.mark.slow
def test_a_generator_killed_mid_rollout_restarts_on_the_uninterrupted_records_and_weights(uninterrupted, tmp_path):
    """Generator 1 (rank 3) SIGKILLed as it starts rollout 5; the control resumes its step-4
    checkpoint with 1 trainer, which lets the generators' rollouts go (module docstring)."""
    want, want_takes, _ = uninterrupted
    runs = tmp_path / "outputs"
    proc = launch(runs / "${run_id:}", 4, *FOUR, takes=tmp_path / "takes.jsonl", kill="in_rollout:5:3", restarts=True)
    out = _check_restarted(runs, proc, tmp_path / "takes.jsonl", uninterrupted, killed=3)

    ok(launch(tmp_path / "control", 3, "parallel.rollout_ranks=2", f"resume={out / 'checkpoints' / 'step_00000004'}",
              takes=tmp_path / "control.jsonl"))
    assert "not restored on world_size=1 + rollout_ranks=2" in (tmp_path / "control" / "train.log").read_text()
    for g in (0, 1):  # generator g: rank 2 + g here, rank 1 + g in the control
        mine, ctl = taken(want_takes, 2 + g), taken(tmp_path / "control.jsonl", 1 + g)
        assert [t["step"] for t in ctl] == [4, 5] and ctl[0]["prompts"] == mine[4]["prompts"]
        assert ctl[0]["versions"] == [4] and ctl[0]["records"] != mine[4]["records"]  # generated again, another version
        assert ctl[1] == mine[5]  # rollout 5 uses version 4 either way: the layout alone changes no record
    got = metrics(tmp_path / "control")
    assert [m["step"] for m in got] == [4, 5] and got[0]["loss"] != want[4]["loss"]


@pytest.mark.slow
def test_a_trainer_killed_restarts_on_the_uninterrupted_records_and_weights(uninterrupted, tmp_path):
    """Trainer 0 (rank 0: the push's source, the checkpoint's publisher) SIGKILLed as it starts step 5."""
    runs = tmp_path / "outputs"
    proc = launch(runs / "${run_id:}", 4, *FOUR, takes=tmp_path / "takes.jsonl", kill="in_step:5:0", restarts=True)
    _check_restarted(runs, proc, tmp_path / "takes.jsonl", uninterrupted, killed=0)


# ------------------------------------------------------------------ every part or none
def parts_rank(rank: int, world: int, tmp: str) -> dict:
    """One trainer (rank 0) and one generator (rank 1), max_staleness=1: two steps, each saved into
    a shared folder; a save into folders the ranks do not share; the generator's part of the newest
    shared checkpoint deleted, then resume=auto chosen."""
    import torch.distributed as dist

    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_generator, build_trainer
    from rl.trainer.checkpoint import Checkpointer, complete_checkpoints, save_checkpoint

    tmp_path, out = Path(tmp), {}
    overrides = (*DENSE, "parallel.rollout_ranks=1", "checkpoint.keep=3")
    cfg = compose(*overrides, world_size=world)
    dims = init_distributed(1, 1, 1, device="cpu", rollout_ranks=1)
    torch.manual_seed(cfg.seed)
    part = build_generator(cfg, dims) if dims.generates else build_trainer(cfg, dims)
    shared = tmp_path / "run" / "checkpoints"
    for step in (0, 1):
        part.step(step)
        save_checkpoint(part, shared, step + 1, cfg, dims)
    out["files"] = sorted(p.name for p in (shared / "step_00000002").iterdir())
    mine = tmp_path / f"rank{rank}"  # a folder only this rank sees: the generator on a node of its own
    out["unshared"] = _error(lambda: save_checkpoint(part, mine, 3, cfg, dims))
    out["unshared_published"] = [p.name for p in complete_checkpoints(mine)]
    if rank == 0:
        (shared / "step_00000002" / "__1_0.distcp").unlink()  # the generator's part of the newest checkpoint
    dist.barrier()
    out["chosen"] = str(Checkpointer(compose(*overrides, "resume=auto", world_size=world), dims,
                                     tmp_path / "run").resume_from)
    out["kept"] = sorted(p.name for p in shared.iterdir())
    if dims.generates:
        part.close()
    return out


@pytest.mark.slow
def test_every_rank_writes_its_part_and_a_checkpoint_without_a_generators_part_is_never_resumed(tmp_path):
    """The generator's file holds its queued rollout (after 1 step: rollout 1, version 0); a save
    whose generator part rank 0 cannot see is refused on both ranks, unpublished; resume=auto passes
    over a checkpoint whose generator part is missing (set aside) for the one before it."""
    trainer, generator = run_distributed(parts_rank, 2, str(tmp_path), timeout=600)
    shared = tmp_path / "run" / "checkpoints"
    assert trainer["files"] == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "config.yaml",
                                "hf_config.json"]
    assert json.loads((shared / "step_00000001" / "COMPLETE").read_text())["rollout_ranks"] == 1
    meta = dcp.FileSystemReader(shared / "step_00000001").read_metadata()
    where = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
    assert where["rollout.records.rank1"] == where["rng.rank1.torch"] == "__1_0.distcp"
    assert not any(path == "__1_0.distcp" for key, path in where.items() if key.startswith("actor."))
    state = {"rollout": {"buffered_step": 0, "version": 0, "seconds": 0.0, "records": {"rank1": b""}}}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=shared / "step_00000001", no_dist=True)
    (queued,) = unpack_rollouts(state["rollout"], 1, 1)  # after 1 step: rollout 1, generated with version 0
    assert (queued.step, queued.version, len(queued.records)) == (1, 0, 16)

    for r in (trainer, generator):
        assert "__1_0.distcp (rank 1's shards) not found" in r["unshared"] and "not published" in r["unshared"], r
        assert r["unshared_published"] == []
        assert r["chosen"] == str(shared / "step_00000001")
    assert trainer["kept"] == ["step_00000001", "step_00000002.unloadable"]
