"""Run output on rank 0: metrics.jsonl (one JSON object per step), optional TensorBoard,
and curves.png at the end of the run: the panels a run is read by (`CURVES`)."""

from __future__ import annotations

import json
from pathlib import Path


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
            path = self.out_dir / "metrics.jsonl"
            if resume_step > 0 and path.exists():
                self.history = [m for m in _read_lines(path) if m["step"] < resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
            tmp.replace(path)  # a kill here leaves either the old file or the kept lines, never half
            self._file = open(path, "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run hides the events of the steps it redoes (resume_step and later)
                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=resume_step or None)

    def log(self, metrics: dict) -> None:
        self.history.append(metrics)
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()  # nothing lost if the run dies mid-way
        if self._tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, metrics["step"])

    def close(self, plot: bool = True) -> Path | None:
        if not self.enabled:
            return None
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if plot and self.history:
            return plot_curves(self.history, self.out_dir / "curves.png")
        return None


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
