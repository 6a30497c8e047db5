"""bench/sampling.py's wiring: on a model folder (a tiny random llama with the test tokenizer)
both arms, the rollout engine and `generate`, decode the same batches of 4 prompts x 8 samples
and are scored alike; the figures land in the bench's JSON. The figure itself (a real policy,
1920 samples an arm) is in bench/results/sampling.json and docs/lora.md."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

from model.models import build_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer, tokenizer_dir):  # noqa: F811
    out = tmp_path_factory.mktemp("policy")
    build_model("llama", seed=0, vocab_size=len(tokenizer), tie_word_embeddings=True).save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    return out


def load():
    spec = importlib.util.spec_from_file_location("sampling_bench", ROOT / "bench/sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_arms_sample_the_same_prompts(folder, tmp_path, monkeypatch):
    bench = load()
    monkeypatch.setattr(sys.modules["common"], "RESULTS", tmp_path)
    line = bench.main(["--model", str(folder), "--batches", "3"])
    assert line["samples"] == 3 * bench.PROMPTS * bench.GROUP
    assert 1 <= line["engine_length"] <= bench.NEW and 1 <= line["generate_length"] <= bench.NEW
    # a random model samples near-uniform ids: lengths agree on average (a few tokens of spread)
    assert abs(line["engine_length"] - line["generate_length"]) < 1.5, line
    assert json.loads((tmp_path / "sampling.json").read_text())["summary"]["samples"] == line["samples"]
