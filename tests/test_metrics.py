"""Run output: metrics.jsonl and TensorBoard continue a resumed run without its redone steps."""

import json
from pathlib import Path

import pytest

from rl.trainer.metrics import MetricsWriter, plot_curves


def tensorboard_steps(folder, tag="reward_mean") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)]


def test_a_resumed_run_replaces_the_steps_it_redoes_in_jsonl_and_tensorboard(tmp_path):
    first = MetricsWriter(tmp_path, loggers=["tensorboard"])
    for step in range(5):  # killed after step 4; its checkpoint holds 2 steps
        first.log({"step": step, "reward_mean": float(step)})
    first.close(plot=False)

    resumed = MetricsWriter(tmp_path, loggers=["tensorboard"], resume_step=2)
    for step in (2, 3):
        resumed.log({"step": step, "reward_mean": 10.0 + step})
    resumed.close(plot=False)

    lines = [(m["step"], m["reward_mean"]) for m in resumed.history]
    assert lines == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert tensorboard_steps(tmp_path / "tensorboard") == lines


def test_control_without_purging_tensorboard_shows_both_histories(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for values in ((0.0, 1.0, 2.0), (None, 11.0)):  # a second writer redoing step 1, no purge_step
        tb = SummaryWriter(str(tmp_path))
        for step, value in enumerate(values):
            if value is not None:
                tb.add_scalar("reward_mean", value, step)
        tb.close()
    assert len(tensorboard_steps(tmp_path)) > 3  # step 1 twice (and the stale step 2)


def test_the_curves_draw_evaluations_only_where_they_were_made(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = {}
    original = matplotlib.axes.Axes.plot

    def spy(self, x, y, *args, label=None, **kwargs):
        drawn[label] = (list(x), list(y))
        return original(self, x, y, *args, label=label, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    history = [{"step": s, "reward_mean": 0.1 * s, **({"eval_accuracy": 0.5} if s % 5 == 0 else {})}
               for s in range(11)]
    assert plot_curves(history, tmp_path / "curves.png").stat().st_size > 0
    assert drawn["eval_accuracy"] == ([0, 5, 10], [0.5, 0.5, 0.5])  # no gaps, no NaN
    assert drawn["reward_mean"][0] == list(range(11))


def test_the_curves_of_a_short_run_tick_at_whole_steps(tmp_path, monkeypatch):
    import matplotlib.figure

    ticks = []
    original = matplotlib.figure.Figure.savefig

    def spy(self, *args, **kwargs):  # the step axes' ticks inside the drawn limits, as saved
        for ax in self.axes:
            if ax.get_visible():
                lo, hi = ax.get_xlim()
                ticks.append([t for t in ax.get_xticks() if lo <= t <= hi])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    plot_curves([{"step": s, "reward_mean": 0.1 * s, "loss": 1.0} for s in range(2)], tmp_path / "curves.png")
    assert len(ticks) == 2 and all(t and all(float(x).is_integer() for x in t) for t in ticks), ticks


def test_metrics_jsonl_is_never_left_empty(tmp_path):
    """A run that fails before its first step leaves no metrics.jsonl, not an empty one; the
    first line makes it. Control: a run with one step has exactly that line."""
    failed = MetricsWriter(tmp_path)
    failed.close(plot=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # a run resumed from step 0
    MetricsWriter(tmp_path, resume_step=0).close(plot=False)
    assert not (tmp_path / "metrics.jsonl").exists()
    one = MetricsWriter(tmp_path)
    one.log({"step": 0, "reward_mean": 0.5})
    one.close(plot=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "reward_mean": 0.5}\n'


def test_a_failed_run_writes_its_error_to_the_log_and_a_failed_file(tmp_path):
    import logging

    from rl.trainer.metrics import FAILED, run_failed

    handler = logging.FileHandler(tmp_path / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        try:
            raise RuntimeError("the reward server is down")
        except RuntimeError as e:
            run_failed(tmp_path, e)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    log = (tmp_path / "train.log").read_text()
    assert "the run failed" in log and "Traceback" in log and "RuntimeError: the reward server is down" in log
    assert "RuntimeError: the reward server is down" in (tmp_path / FAILED).read_text()
    MetricsWriter(tmp_path).close(plot=False)  # the run continued in its folder (resume): no longer failed
    assert not (tmp_path / FAILED).exists()


def wandb_history(run_dir) -> list[tuple[str, int, float]]:
    """(run id, step, reward_mean) of every history record in W&B's offline run files under
    `run_dir`, in the order written: the .wandb file is a LevelDB-style log of protobuf
    `Record`s in 32 KiB blocks (7-byte file header, then crc32, length, type per chunk)."""
    import glob

    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")):
        data, pos, record = open(path, "rb").read(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            record += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last chunk of one
                rec = pb.Record()
                rec.ParseFromString(record)
                if rec.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                    out.append((path.split("-")[-1][:-6], int(items["_step"]), float(items["reward_mean"])))
            if kind in (0, 1, 4):
                record = b""
    return out


def test_wandb_offline_and_mlflow_file_store_continue_the_same_run_on_resume(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sinks = ["jsonl", "wandb", "mlflow"]
    first = MetricsWriter(tmp_path, loggers=sinks, project="p", config={"trainer": {"lr": 0.1}})
    for step in range(3):  # killed after step 2; its checkpoint holds 2 steps
        first.log({"step": step, "reward_mean": float(step), "note": "text is not a metric"})
    first.close(plot=False)
    resumed = MetricsWriter(tmp_path, loggers=sinks, project="p", resume_step=2)
    for step in (2, 3):
        resumed.log({"step": step, "reward_mean": 10.0 + step})
    resumed.close(plot=False)

    ids = json.loads((tmp_path / "loggers.json").read_text())
    history = wandb_history(tmp_path)
    assert {run for run, _, _ in history} == {ids["wandb"]}  # one run, continued
    assert [(s, v) for _, s, v in history] == [(0, 0.0), (1, 1.0), (2, 2.0), (2, 12.0), (3, 13.0)]
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").resolve().as_uri())
    run = client.get_run(ids["mlflow"])
    assert run.data.params["trainer.lr"] == "0.1" and run.info.run_name == tmp_path.name
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "reward_mean")] == \
        [(0, 0.0), (1, 1.0), (2, 2.0), (2, 12.0), (3, 13.0)]


def test_control_a_fresh_run_in_the_folder_starts_new_wandb_and_mlflow_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    seen = []
    for _ in range(2):  # resume_step 0: not a resumed run
        writer = MetricsWriter(tmp_path, loggers=["wandb", "mlflow"])
        writer.log({"step": 0, "reward_mean": 1.0})
        writer.close(plot=False)
        seen.append(json.loads((tmp_path / "loggers.json").read_text()))
    assert seen[0]["wandb"] != seen[1]["wandb"] and seen[0]["mlflow"] != seen[1]["mlflow"]
    assert len({run for run, _, _ in wandb_history(tmp_path)}) == 2


def test_the_code_commit_is_none_without_git_and_marks_a_changed_tree(monkeypatch, tmp_path):
    """train.log names the code's commit; a machine without git (or a copy outside a checkout)
    gets None, not a crash at start-up, and a changed tracked file adds `+`."""
    import subprocess

    from rl.trainer import metrics
    from rl.trainer.metrics import code_commit

    head = subprocess.run(["git", "-C", str(Path(metrics.__file__).parents[2]), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert code_commit().rstrip("+") == head
    real_run = subprocess.run

    def changed(cmd, **kw):  # `git status` reports a modified tracked file (the control: a result file only)
        if "status" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout=f" M {changed.path}\n", stderr="")
        return real_run(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", changed)
    changed.path = "rl/config/schema.py"
    assert code_commit() == head + "+"
    changed.path = "bench/results/peer.json"
    assert code_commit() == head
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary to be found
    monkeypatch.setattr(subprocess, "run", real_run)
    assert code_commit() is None


@pytest.mark.slow
def test_the_documented_command_opens_the_mlflow_file_store_and_needs_its_variable(tmp_path, monkeypatch):
    """docs/configuration.md's way to read a run's MLflow file store: its command, run as written on a
    store the trainer's sink wrote, lists the run; the control, without MLFLOW_ALLOW_FILE_STORE=true
    (MLflow 3's opt-in), fails."""
    import os
    import re
    import subprocess
    import sys

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    writer = MetricsWriter(tmp_path / "run", loggers=["jsonl", "mlflow"], project="p", config={})
    writer.log({"step": 0, "reward_mean": 0.5})
    writer.close(plot=False)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    code = re.search(r'`MLFLOW_ALLOW_FILE_STORE=true python -c "([^"]+)"`', doc).group(1)
    code = code.replace("outputs/<run>", str(tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI")}

    def read(**extra):
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                              timeout=300)

    opened = read(MLFLOW_ALLOW_FILE_STORE="true")
    assert opened.returncode == 0 and "run_name='run'" in opened.stdout, opened.stderr[-2000:]
    refused = read()
    assert refused.returncode != 0 and "MLFLOW_ALLOW_FILE_STORE=true" in refused.stderr


def test_cuda_peak_memory_per_stage_is_in_the_step_metrics(monkeypatch):
    """On CUDA each stage's peak (torch.cuda.max_memory_allocated, reset when the stage starts) is a
    step metric: here on CPU with the two CUDA calls mocked, each stage reading its own peak. Control:
    on the CPU path (not CUDA) no such key."""
    import torch

    from testing.inprocess import SMALL, trainer
    from rl.trainer import trainer as trainer_module

    tr = trainer("model=dense_tiny", "trainer.device=cpu", *SMALL)
    assert not any(k.startswith("peak_memory_") for k in tr.step(0))  # the control: CPU records none
    calls, peak = [], [0]

    def reset(device):
        calls.append(("reset", str(device)))
        peak[0] += 1

    monkeypatch.setattr(trainer_module.torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(trainer_module.torch.cuda, "max_memory_allocated",
                        lambda device: calls.append(("read", str(device))) or peak[0] * 2**30)
    tr.stage_peaks.on = True  # as on a CUDA device
    metrics = tr.step(1)
    got = {k: v for k, v in metrics.items() if k.startswith("peak_memory_")}
    assert got == {"peak_memory_rollout_gib": 1.0, "peak_memory_score_gib": 2.0, "peak_memory_train_gib": 3.0,
                   "peak_memory_sync_gib": 4.0}  # each stage its own, reset between them
    assert [c for c, _ in calls] == ["reset", "read", "reset", "read", "reset", "read", "reset", "read", "reset"]
    assert {d for _, d in calls} == {str(torch.device("cpu"))}  # the run's device, handed to the CUDA calls


def _maxes_of_two_cp_peers(rank: int, world_size: int) -> dict:
    """dp=1 x cp=2: rank 1, a CP peer, peaked higher; `reduce_maxes` and the DP-only reduction it replaced."""
    import torch

    from runtime.parallel_dims import init_distributed
    from rl.trainer.trainer import reduce_maxes

    dims = init_distributed(1, 2, 1, device="cpu")
    mine = {"peak_memory_train_gib": torch.tensor(1.0 + rank)}
    dp_only = float(mine["peak_memory_train_gib"])  # dims.dp_group is None (dp=1): no collective over DP
    return {"reduced": reduce_maxes(mine, dims)["peak_memory_train_gib"], "dp_only": dp_only,
            "dp_group": dims.dp_group is None}


@pytest.mark.slow
def test_a_cp_peers_larger_peak_is_the_steps_peak():
    """The step's `_max` metrics (memory peaks, the largest rollout log-prob gap) are the maximum over
    every rank: on dp=1 x cp=2 rank 1's peak of 2 GiB is what both ranks report. Control: the DP-only
    reduction (the DP group is one rank here) leaves rank 0 with its own 1 GiB."""
    from testing.distributed import run_distributed

    got = run_distributed(_maxes_of_two_cp_peers, 2, timeout=120)
    assert [r["reduced"] for r in got] == [2.0, 2.0]
    assert all(r["dp_group"] for r in got) and got[0]["dp_only"] == 1.0  # the control misses the peer's peak
