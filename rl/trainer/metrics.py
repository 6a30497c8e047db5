"""Run output on rank 0: metrics.jsonl (one JSON object per step, made with the first step's
line: never left empty), optional TensorBoard, and curves.png at the end of the run: the
panels a run is read by (`CURVES`). A run that fails writes its error to train.log and a
`FAILED` file (`run_failed`), on any rank."""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path

FAILED = "FAILED"


class MetricsWriter:
    def __init__(self, out_dir: str | Path, *, enabled: bool = True, tensorboard: bool = False,
                 resume_step: int = 0) -> None:
        """`resume_step` > 0 (a resumed run): the lines of steps before it are kept from an
        existing metrics.jsonl and the file continues after them; later lines are dropped."""
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.history: list[dict] = []
        self._file = None
        self._tb = None
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / FAILED).unlink(missing_ok=True)  # a failed run continued in its folder (resume)
            self.path = path = self.out_dir / "metrics.jsonl"
            if resume_step > 0 and path.exists():
                self.history = [m for m in _read_lines(path) if m["step"] < resume_step]
            if self.history:
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
                tmp.replace(path)  # a kill here leaves either the old file or the kept lines, never half
            else:
                path.unlink(missing_ok=True)  # made by the first line
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run hides the events of the steps it redoes (resume_step and later)
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=resume_step or None)

    def log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if not self.enabled:
            return
        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()  # nothing lost if the run dies mid-way
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, metrics["step"])

    def close(self, plot: bool = True) -> Path | None:
        if not self.enabled:
            return None
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if plot and self.history:
            return plot_curves(self.history, self.out_dir / "curves.png")
        return None


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
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
