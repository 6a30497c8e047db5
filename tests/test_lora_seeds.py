"""bench/lora_seeds.py pairs the project's LoRA runs with TRL's by seed: the final and late
held-out evaluations at the same steps, the training reward over the steps both ran."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("lora_seeds", ROOT / "bench/lora_seeds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def our_run(tmp_path: Path, name: str, evals: dict[int, float], rewards: list[float]) -> Path:
    """A run folder as the trainer writes it: an evaluation before step s sits in step s's row,
    the one after the last step in a row of its own."""
    rows = [{"step": s, "reward_mean": r, **({"eval_accuracy": evals[s]} if s in evals else {})}
            for s, r in enumerate(rewards)]
    rows += [{"step": s, "eval_accuracy": a} for s, a in evals.items() if s >= len(rewards)]
    (tmp_path / name).mkdir()
    (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / name


def trl_result(tmp_path: Path, name: str, evals: dict[int, float] | None, rewards: list[float]) -> Path:
    d = {"steps": len(rewards), "accuracy_before": 0.3, "accuracy_after": 0.7,
         "per_step": [{"step": s, "reward_mean": r} for s, r in enumerate(rewards)]}
    if evals is not None:
        d["evals"] = [{"step": s, "accuracy": a} for s, a in evals.items()]
    (tmp_path / name).write_text(json.dumps(d))
    return tmp_path / name


def test_pairs_by_seed_and_step(tmp_path):
    lora_seeds = load()
    a1 = our_run(tmp_path, "a1", {0: 0.3, 2: 0.5, 4: 0.6}, [0.1, 0.2, 0.3, 0.4])
    a2 = our_run(tmp_path, "a2", {0: 0.3, 2: 0.4, 4: 0.8}, [0.0, 0.2, 0.2, 0.6])
    b1 = trl_result(tmp_path, "b1", {0: 0.3, 2: 0.7, 4: 0.7}, [0.2, 0.2, 0.4, 0.4])
    b2 = trl_result(tmp_path, "b2", None, [0.1, 0.1, 0.3, 0.3])  # before and after only: final pairs, no curve
    out = lora_seeds.main(["--ours", f"1={a1}", f"2={a2}", "9=" + str(a1), "--trl", f"1={b1}", f"2={b2}",
                           "--late", "2", "--out", str(tmp_path / "r.json")])
    assert out["seeds"] == [1, 2]  # seed 9 has no TRL arm
    assert out["final"]["ours"] == pytest.approx(0.7) and out["final"]["trl"] == pytest.approx(0.7)
    assert out["final"]["se"] == pytest.approx(0.1)  # differences -0.1 and +0.1
    assert out["late_evals"]["seeds"] == [1]
    assert out["late_evals"]["ours"] == pytest.approx(0.55) and out["late_evals"]["trl"] == pytest.approx(0.7)
    assert out["train_reward"]["diff"] == pytest.approx((0.25 - 0.3 + 0.25 - 0.2) / 2)
    assert out["train_reward_second_half"]["ours"] == pytest.approx((0.35 + 0.4) / 2)
    assert json.loads((tmp_path / "r.json").read_text())["final"]["pairs"] == 2


def test_a_run_without_the_final_evaluation_is_refused(tmp_path):
    lora_seeds = load()
    a = our_run(tmp_path, "a", {0: 0.3, 2: 0.5}, [0.1, 0.2, 0.3, 0.4])  # stopped before its last evaluation
    b = trl_result(tmp_path, "b", {0: 0.3, 4: 0.7}, [0.2, 0.2, 0.4, 0.4])
    with pytest.raises(SystemExit, match="no evaluation after step 4"):
        lora_seeds.main(["--ours", f"1={a}", "--trl", f"1={b}"])


def test_without_a_trl_curve_the_late_figure_is_null(tmp_path):
    lora_seeds = load()
    a = our_run(tmp_path, "a", {0: 0.3, 2: 0.5, 4: 0.6}, [0.1, 0.2, 0.3, 0.4])
    b = trl_result(tmp_path, "b", None, [0.2, 0.2, 0.4, 0.4])
    out = lora_seeds.main(["--ours", f"1={a}", "--trl", f"1={b}", "--out", str(tmp_path / "r.json")])
    assert out["late_evals"] is None and json.loads((tmp_path / "r.json").read_text())["late_evals"] is None
