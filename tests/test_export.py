"""The export's entry point (rl/trainer/export.py) prints no torch/torchao import noise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_export_entry_point_prints_no_library_noise():
    """`python -m rl.trainer.export` installs model/library_noise.py's filters before transformers
    and peft import torchao; the control (peft imported alone) shows the noise on this machine."""
    import torch

    def stderr(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=300).stderr

    noise = ("Failed to load ", "is an Enum subclass")
    control = stderr("import peft")
    if not torch.cuda.is_available():  # on CUDA torchao's kernels load: only the enum lines
        assert all(n in control for n in noise), control[-2000:]
    quiet = stderr("import rl.trainer.export, peft")  # as `python -m rl.trainer.export` starts
    assert not any(n in quiet for n in noise), quiet[-2000:]
