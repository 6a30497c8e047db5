"""Run folders and run state: one folder and one checkpoint set per job whatever the launch
(two torchrun agents on this machine as two nodes, static and c10d rendezvous, a shared and an
unshared folder); start-up decisions taken once for every rank; a folder held by one run at a
time; resume=auto falling back past a checkpoint that does not load."""

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
from rl.trainer.run_folder import LOCK, RunFolderInUse, claim
from testing.distributed import free_port, run_distributed
from tests.test_checkpoint import metrics
from run_folder_worker import decisions

ROOT = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}, "OMP_NUM_THREADS": "1",
       "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo"}
SMALL = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "trainer.progress=false", "trainer.plot=false"]


def two_nodes(cwds: list[Path], *args: str, rdzv: str) -> list[tuple[int, str]]:
    """Two torchrun agents of one process each, started together as nodes 0 and 1 (`rdzv`:
    static, `--master-addr --master-port --node-rank`; else c10d with `--rdzv-id rdzv`), each
    from its own working directory: (exit code, stderr) per agent."""
    port = free_port()
    procs, logs = [], []
    for node, cwd in enumerate(cwds):
        where = (["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank", str(node)]
                 if rdzv == "static" else
                 ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv])
        log = open(cwd / f"agent{node}.log", "w+")
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                       "--nproc-per-node", "1", *where, str(ROOT / "train.py"), *args],
                                      cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    out = []
    for proc, log in zip(procs, logs):
        code = proc.wait(timeout=600)
        log.seek(0)
        out.append((code, log.read()))
        log.close()
    return out


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_nodes_static_rendezvous_share_one_run_folder_whose_checkpoint_c10d_resumes(tmp_path):
    """Static rendezvous (torchrun's run id is `none`): both nodes write one run folder, named by
    the id rank 0 drew, whose checkpoint holds both ranks' shards. Then a c10d job with
    `resume=auto` continues it in place: still one folder, steps 0-2 in its metrics."""
    for code, log in two_nodes([tmp_path, tmp_path], "trainer.max_steps=2", *SMALL, rdzv="static"):
        assert code == 0, log[-4000:]
    (run,) = (tmp_path / "outputs").iterdir()  # one folder, not one per node
    assert run.name != "none" and run.name[:4].isdigit(), run.name  # the id rank 0 drew, not torchrun's `none`
    saved = run / "checkpoints" / "step_00000002"
    assert {"__0_0.distcp", "__1_0.distcp", "COMPLETE"} <= {p.name for p in saved.iterdir()}
    assert json.loads((saved / "COMPLETE").read_text())["world_size"] == 2 and steps(run) == [0, 1]
    for code, log in two_nodes([tmp_path, tmp_path], "resume=auto", "trainer.max_steps=3", *SMALL, rdzv="job-2"):
        assert code == 0, log[-4000:]
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [run.name] and steps(run) == [0, 1, 2]
    assert f"resumed from {saved} (2 steps done)" in (run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["static", "job-3"])
def test_two_nodes_on_unshared_folders_refuse_at_start_up_on_every_rank(tmp_path, rdzv):
    """Each node started in its own directory (a relative run folder on each node's own disk):
    every rank stops before any model is built, naming the rank that does not see rank 0's run
    folder and the shared-filesystem requirement; no checkpoint is written anywhere."""
    (a := tmp_path / "a").mkdir()
    (b := tmp_path / "b").mkdir()
    results = two_nodes([a, b], "trainer.max_steps=2", *SMALL, rdzv=rdzv)
    for code, log in results:
        assert code != 0, log[-4000:]
        assert "is not seen by every rank: rank 1" in log and "/b/outputs/" in log and "shared filesystem" in log, \
            log[-4000:]
    assert not list(tmp_path.rglob("COMPLETE")) and not list(tmp_path.rglob("*.distcp"))
    assert "step 0 reward" not in results[0][1]  # stopped at start-up


@pytest.mark.slow
def test_start_up_decisions_are_taken_once_and_an_unshared_checkpoint_is_never_published(tmp_path):
    """Two gloo ranks with different local state take one decision: the replica plan (rank 1
    reads 1 byte free), the checkpoint resume=auto loads (only rank 0 sees it), vLLM's random-init
    folder (one per node, same name). A save into folders the ranks do not share is refused on both
    ranks without COMPLETE; a truncated, then a garbled, newest checkpoint is fallen back past on
    both ranks and kept aside."""
    r0, r1 = run_distributed(decisions, 2, str(tmp_path), timeout=600)
    assert r0["own_budget"] > 10**6 and r1["own_budget"] == 1  # the control: their own readings differ
    assert r0["replica"] == r1["replica"] == "sharded" and "least over 2 ranks" in r0["replica_source"]
    for r in (r0, r1):
        assert "is not seen by every rank: rank 1" in r["unshared_probe"], r["unshared_probe"]
        assert "__1_0.distcp (rank 1's shards) not found" in r["unshared_save"], r["unshared_save"]
        assert "not published" in r["unshared_save"] and r["unshared_published"] == []
    assert "COMPLETE" not in r0["unshared_tmp"] and "__0_0.distcp" in r0["unshared_tmp"]
    assert r0["own_listing"] == ["step_00000001", "step_00000002"] and r1["own_listing"] == []  # the control
    assert r0["chosen"] == r1["chosen"] == str(tmp_path / "shared" / "checkpoints" / "step_00000002")
    ckpts = tmp_path / "shared" / "checkpoints"
    assert r0["truncated_fallback"] == r1["truncated_fallback"] == (str(ckpts / "step_00000001"), 1)
    assert r0["garbage_chosen"] == r1["garbage_chosen"] == str(ckpts / "step_00000003")  # the files look whole
    assert r0["garbage_fallback"] == r1["garbage_fallback"] == 1
    assert r0["kept"] == ["step_00000001", "step_00000002.unloadable", "step_00000003.unloadable"]
    log = "\n".join(r0["log"])
    assert f"{ckpts / 'step_00000002' / '__1_0.distcp'} (rank 1's shards) holds" in log and "truncated" in log, log
    assert "kept as step_00000002.unloadable; resuming from step_00000001" in log, log
    assert "step_00000003 does not load (rank " in log and "kept as step_00000003.unloadable" in log, log
    assert r0["init_folder"][0] == r1["init_folder"][0] and r0["init_folder"][1:] == ("node0", True)
    assert r1["init_folder"][1:] == ("node1", True)


def test_a_locked_folder_refuses_a_second_claim_naming_the_holder_until_released(tmp_path):
    """flock is per open file: a second claim in this very process conflicts like another run's."""
    first = claim([tmp_path / "run"], ParallelDims())
    holder = json.loads((tmp_path / "run" / LOCK).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(RunFolderInUse, match=rf"in use by another run: pid {os.getpid()} on host "):
        claim([tmp_path / "run"], ParallelDims())
    claim([tmp_path / "other"], ParallelDims()).close()  # another folder: free
    first.close()
    claim([tmp_path / "run"], ParallelDims()).close()  # released


def holder(run: Path) -> tuple[int, bool] | None:
    """(pid, whether its ranks' token is written) from a run folder's lock file."""
    try:
        got = json.loads((run / LOCK).read_text())
    except (OSError, ValueError):
        return None
    return got["pid"], bool(got["token"])


@pytest.mark.slow
def test_a_second_run_in_the_same_folder_refuses_naming_the_first_and_a_killed_run_releases_it(tmp_path):
    """Run 1 holds `run/` (then trains); run 2, started there meanwhile, refuses at start-up naming run 1's
    pid and leaves its folder alone (no FAILED mark, no line in its train.log, its .hydra/ as it was). Once run 1 is
    SIGKILLed, a third run continues in the folder at once (the kernel released the lock)."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *SMALL]
    first = subprocess.Popen([*cmd, "trainer.max_steps=100000"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while holder(run) != (first.pid, True):  # until run 1 holds the folder, its ranks have checked it
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = subprocess.run([*cmd, "trainer.max_steps=1"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode != 0 and first.poll() is None
        assert f"in use by another run: pid {first.pid} on host" in second.stderr, second.stderr[-3000:]
        assert not (run / "FAILED").exists() and "in use" not in (run / "train.log").read_text()
        assert "trainer.max_steps=100000" in (run / ".hydra" / "overrides.yaml").read_text()  # Hydra never ran
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = subprocess.run([*cmd, "trainer.max_steps=1", "checkpoint.final=false"], cwd=tmp_path, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert steps(run) == [0]


@pytest.mark.slow
def test_resume_auto_falls_back_past_a_truncated_newest_checkpoint_and_keeps_it(tmp_path):
    """4 steps saved every 2; the newest checkpoint's shard file cut in half. resume=auto loads
    step 2, logs the failing file, keeps the checkpoint as step_00000004.unloadable, and redoes
    steps 2-3 bit for bit (the metrics the first run logged)."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}", *SMALL, "trainer.max_steps=4",
           "checkpoint.every=2"]
    first = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    uninterrupted = metrics(run)
    shard = run / "checkpoints" / "step_00000004" / "__0_0.distcp"
    os.truncate(shard, cut := shard.stat().st_size // 2)
    again = subprocess.run([*cmd, "resume=auto"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert f"checkpoint {run / 'checkpoints' / 'step_00000004'} does not load ({shard} (rank 0's shards) holds" in log
    assert "kept as step_00000004.unloadable; resuming from step_00000002" in log, log
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} (2 steps done)" in log, log
    assert (run / "checkpoints" / "step_00000004.unloadable" / "__0_0.distcp").stat().st_size == cut  # kept as it was
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert metrics(run) == uninterrupted  # steps 2-3 redone bit for bit
