"""The export (rl/trainer/export.py) warns when the policy it writes never moved from the run's
start (LoRA: every lora_B tensor still zero; full fine-tuning: the weights equal the pretrained
checkpoint's or the seed's random init), and prints no torch/torchao import noise."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from testing.inprocess import SMALL, compose, trainer
from test_families import RUN_SIZE, tiny_checkpoint

from rl.trainer.checkpoint import save_checkpoint
from rl.trainer.export import export

ROOT = Path(__file__).resolve().parents[1]
MOVES = ("algo.entropy_coef=0.01",)  # a gradient whatever the rewards: lr > 0 moves the policy


def exported_warnings(tmp_path, caplog, name: str, *overrides: str) -> list[str]:
    """One step of a run with `overrides`, checkpointed and exported; the export's warnings."""
    tr = trainer(*SMALL, *overrides)
    tr.step(0)
    saved = save_checkpoint(tr, tmp_path / name / "checkpoints", 1, compose(*SMALL, *overrides), tr.dims)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="export"):
        export(saved, tmp_path / name / "hf")
    return [r.getMessage() for r in caplog.records if r.name == "export"]


def test_a_full_fine_tuning_export_warns_when_the_weights_equal_the_pretrained_checkpoint(tmp_path, caplog):
    path = tiny_checkpoint(tmp_path / "ck", "llama", True, **RUN_SIZE)  # tied: the head is the embedding
    run = ("model=pretrained", f"model.pretrained_path={path}", *MOVES)
    still, = exported_warnings(tmp_path, caplog, "lr0", *run, "trainer.lr=0")
    assert still.startswith("export: the weights of ") and f"equal the run's starting weights ({path})" in still
    assert "trainer.lr=0" in still and "no prompt group had rewards that differ" in still
    assert exported_warnings(tmp_path, caplog, "moved", *run, "trainer.lr=1e-3") == []  # the control


def test_a_random_init_export_warns_when_the_weights_equal_the_seeds_init(tmp_path, caplog):
    still, = exported_warnings(tmp_path, caplog, "lr0", "model=dense_tiny", "trainer.lr=0", *MOVES)
    assert "equal the run's starting weights (the random init of seed 0)" in still
    assert exported_warnings(tmp_path, caplog, "moved", "model=dense_tiny", *MOVES) == []  # the control


def test_a_lora_export_warns_when_every_lora_b_is_zero(tmp_path, caplog):
    lora = ("model=dense_tiny", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]", *MOVES)
    still, = exported_warnings(tmp_path, caplog, "lr0", *lora, "trainer.lr=0")
    assert still.startswith("export: all 4 lora_B tensors of ") and "the merged model is the base" in still
    assert exported_warnings(tmp_path, caplog, "moved", *lora, "trainer.lr=1e-2") == []  # the control


@pytest.mark.slow
def test_the_export_entry_point_prints_no_library_noise():
    """`python -m rl.trainer.export` installs runtime/library_noise.py's filters before transformers
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
