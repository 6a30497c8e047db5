"""Run output on rank 0: metrics.jsonl (one JSON object per step, made with the first step's
line: never left empty; the run's record, which resume and the curves read), samples.jsonl (each
step's first `trainer.log_samples` episodes, one JSON object each: rl/rollout/samples.py), the sinks named
in `trainer.loggers` (TensorBoard, Weights & Biases, MLflow), and curves.png at the end of the
run: the panels a run is read by (`CURVES`). A run that fails writes its error to train.log and
a `FAILED` file (`run_failed`), on any rank.

A resumed run continues the same run in every sink: TensorBoard hides the events of the steps
it redoes (purge_step); W&B and MLflow continue the run whose id `loggers.json` in the run
folder keeps. Neither can delete a logged step, so the steps a resumed run redoes are sent again
(W&B, which wants increasing steps, may drop them with a warning; MLflow keeps both values):
only the wall-clock figures differ, a resumed run redoes its steps bit for bit. The samples go to
W&B as a table `samples` per step and to MLflow as the artifact samples/step_<step>.jsonl (a
redone step's replaces it); samples.jsonl keeps the lines of the steps before a resumed run's first."""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any, Iterable

from rl.config.schema import Logger

FAILED = "FAILED"
RUN_IDS = "loggers.json"  # the W&B / MLflow run ids of this run folder: a resumed run continues them


class MetricsWriter:
    def __init__(self, out_dir: str | Path, *, enabled: bool = True, loggers: Iterable[Logger | str] = (),
                 resume_step: int = 0, project: str = "rl", config: dict | None = None) -> None:
        """`resume_step` > 0 (a resumed run): the lines of steps before it are kept from an
        existing metrics.jsonl and the file continues after them; later lines are dropped.
        `config` (the run's resolved config) is recorded by W&B and MLflow."""
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.history: list[dict] = []
        self._file = self._samples = None
        self._sinks: list[_Sink] = []
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / FAILED).unlink(missing_ok=True)  # a failed run continued in its folder (resume)
            self.path = self.out_dir / "metrics.jsonl"
            self.samples_path = self.out_dir / "samples.jsonl"
            self.history = _keep_before(self.path, resume_step)
            _keep_before(self.samples_path, resume_step)
            ids = _read_ids(self.out_dir) if resume_step > 0 else {}
            for name in dict.fromkeys(Logger(x) for x in loggers):
                if name is not Logger.JSONL:
                    self._sinks.append(_SINKS[name](self.out_dir, resume_step, project, config or {}, ids))
            if any(ids.values()):
                tmp = self.out_dir / (RUN_IDS + ".tmp")
                tmp.write_text(json.dumps(ids))
                tmp.replace(self.out_dir / RUN_IDS)

    def log(self, metrics: dict, samples: list[dict] | None = None) -> None:
        """The step's metrics, and its `samples` (rows of rl/rollout/samples.py; none: no line)."""
        self.history.append(metrics)
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()  # nothing lost if the run dies mid-way
        if samples:
            if self._samples is None:
                self._samples = open(self.samples_path, "a")
            self._samples.write("".join(json.dumps(row) + "\n" for row in samples))
            self._samples.flush()
        scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        for sink in self._sinks:
            sink.log(scalars, metrics["step"], samples or [])

    def close(self, plot: bool = True) -> Path | None:
        if not self.enabled:
            return None
        for file in (self._file, self._samples):
            if file is not None:
                file.close()
        for sink in self._sinks:
            sink.close()
        if plot and self.history:
            return plot_curves(self.history, self.out_dir / "curves.png")
        return None


class _Sink:
    """One metrics sink: made at the run's start (or resume), sent each step's scalars and samples, closed."""

    def log(self, scalars: dict[str, float], step: int, samples: list[dict]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _TensorBoard(_Sink):
    def __init__(self, out_dir: Path, resume_step: int, project: str, config: dict, ids: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run hides the events of the steps it redoes (resume_step and later)
        self._writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step or None)

    def log(self, scalars: dict[str, float], step: int, samples: list[dict]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _Wandb(_Sink):
    def __init__(self, out_dir: Path, resume_step: int, project: str, config: dict, ids: dict) -> None:
        import wandb

        try:
            self._run = wandb.init(project=project, name=out_dir.name, id=ids.get("wandb"), resume="allow",
                                   dir=str(out_dir), config=config)
        except Exception as e:  # wandb's own message first (no API key, no network ...)
            raise RuntimeError(f"trainer.loggers has wandb, and wandb.init failed: {e}. Log in (`wandb login`), "
                               "or run without a network with WANDB_MODE=offline (`wandb sync` later)") from e
        ids["wandb"] = self._run.id
        self._table = wandb.Table

    def log(self, scalars: dict[str, float], step: int, samples: list[dict]) -> None:
        if samples:  # one table a step, its nested values (turns, tool calls) as JSON text
            columns = list(dict.fromkeys(key for row in samples for key in row))
            scalars = scalars | {"samples": self._table(columns=columns, data=[
                [_cell(row.get(key)) for key in columns] for row in samples])}
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class _MLflow(_Sink):
    def __init__(self, out_dir: Path, resume_step: int, project: str, config: dict, ids: dict) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):  # no server named: a file store in the run folder
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
            mlflow.set_tracking_uri((out_dir / "mlruns").resolve().as_uri())
        if ids.get("mlflow"):
            self._run = mlflow.start_run(run_id=ids["mlflow"])
        else:
            mlflow.set_experiment(project)
            self._run = mlflow.start_run(run_name=out_dir.name)
            ids["mlflow"] = self._run.info.run_id
            # MLflow's params are flat, values cut to its 6000 characters; an empty dict holds no param
            mlflow.log_params({k: str(v)[:6000] for k, v in flatten(config).items() if v != {}})
        self._mlflow = mlflow

    def log(self, scalars: dict[str, float], step: int, samples: list[dict]) -> None:
        self._mlflow.log_metrics(scalars, step=step)
        if samples:
            self._mlflow.log_text("".join(json.dumps(row) + "\n" for row in samples),
                                  f"samples/step_{step:06d}.jsonl")

    def close(self) -> None:
        self._mlflow.end_run()


_SINKS = {Logger.TENSORBOARD: _TensorBoard, Logger.WANDB: _Wandb, Logger.MLFLOW: _MLflow}


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def _keep_before(path: Path, resume_step: int) -> list[dict]:
    """A JSONL file of a run (a line per step, or per sample with its step) continued by a resumed run
    from `resume_step` (0: a new run): the lines of earlier steps kept, in place; the file removed when
    none is (the first line written makes it again)."""
    kept = [m for m in _read_lines(path) if m["step"] < resume_step] if resume_step > 0 and path.exists() else []
    if kept:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
        tmp.replace(path)  # a kill here leaves either the old file or the kept lines, never half
    else:
        path.unlink(missing_ok=True)
    return kept


def _read_ids(out_dir: Path) -> dict:
    path = out_dir / RUN_IDS
    return json.loads(path.read_text()) if path.exists() else {}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1, "c": {}}} -> {"a.b": 1, "a.c": {}}: every leaf of nested dicts under its dotted
    key (an empty dict is a leaf, so a checkpoint's config that gains its first key differs there)."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def code_commit() -> str | None:
    """The git commit of this code, short, with `+` when a tracked file differs from it (a bench's
    own outputs under bench/results/ do not count); None outside a git checkout or without git."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)  # noqa: E731
    try:
        head = git("rev-parse", "--short", "HEAD")
    except OSError:  # no git on this machine
        return None
    if head.returncode:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    dirty = any(not line[3:].startswith("bench/results/") for line in changed)
    return head.stdout.strip() + ("+" if dirty else "")


def run_failed(out_dir: str | Path, error: BaseException) -> None:
    """A run stopped by `error`: its message and traceback go to the run's log file (train.log,
    Hydra's file handler; the terminal gets them from Hydra) and to `out_dir/FAILED`, which
    marks the folder (removed again when a resumed run continues in it)."""
    text = "".join(traceback.format_exception(error))
    rank = os.environ.get("RANK", "0")
    record = logging.LogRecord("train", logging.ERROR, __file__, 0, "rank %s: the run failed:\n%s", (rank, text), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    with open(Path(out_dir) / FAILED, "a") as f:
        f.write(f"rank {rank}: {text}")


def _read_lines(path: Path) -> list[dict]:
    """metrics.jsonl's lines; a last line cut short by a kill is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


# panel title -> the metrics.jsonl keys drawn in it (a key absent from every step is skipped,
# and so is a panel with none of its keys)
CURVES: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean",),
    "held-out accuracy": ("eval_accuracy", "eval_accuracy_turn1"),
    "loss": ("loss", "policy_loss", "value_loss"),
    "entropy": ("entropy",),
    "grad norm": ("grad_norm",),
    "KL to reference": ("kl", "kl_loss"),
    "response length": ("response_length",),
    "clip fraction": ("clip_ratio",),
    "throughput (tokens/s)": ("tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s"),
}


def plot_curves(history: list[dict], path: Path) -> Path:
    """A grid of one subplot per `CURVES` panel that has data in `history`, against step."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = {title: [k for k in keys if any(k in m for m in history)] for title, keys in CURVES.items()}
    panels = {title: keys for title, keys in panels.items() if keys}
    cols = min(4, max(len(panels), 1))
    rows = max(math.ceil(len(panels) / cols), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        for key in keys:  # the steps that have the key (evaluations are every eval.every steps)
            at = [m for m in history if key in m]
            ax.plot([m["step"] for m in at], [m[key] for m in at], marker=".", label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: a short run ticks 0, 1, 2, not 0.25
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
