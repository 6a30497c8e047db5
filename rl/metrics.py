"""Run output on rank 0: metrics.jsonl (one JSON object per step), optional TensorBoard,
and a PNG of the reward and loss curves at the end of the run."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
    def __init__(self, out_dir: str | Path, *, enabled: bool = True, tensorboard: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.history: list[dict] = []
        self._file = None
        self._tb = None
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out_dir / "metrics.jsonl", "w")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))

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


def plot_curves(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key in zip(axes, ("reward_mean", "loss")):
        ax.plot(steps, [m.get(key, float("nan")) for m in history], marker=".")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
