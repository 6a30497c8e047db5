"""bench/distill_curves.py: the first evaluated step at 0.9 x the teacher per arm (seed mean and seed by
seed), the ratio distillation / RL, the held-out set's size and standard error, and an earlier headline's
curves merged where the new runs do not evaluate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # as tests/test_roofline.py
import distill_curves as curves  # noqa: E402


def run(tmp_path: Path, name: str, evals: dict[int, float], num_prompts: int = 200) -> str:
    """A run folder as the trainer writes it: metrics.jsonl rows with eval_accuracy, .hydra/config.yaml."""
    folder = tmp_path / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval_accuracy": a}) + "\n"
                                                  for s, a in evals.items()))
    (folder / ".hydra" / "config.yaml").write_text(f"eval:\n  every: 2\n  num_prompts: {num_prompts}\n")
    return str(folder)


def earlier(tmp_path: Path) -> str:
    """An earlier headline: teacher 0.6 (threshold 0.54), RL seeds 0-1 evaluated every 10 steps."""
    d = {"teacher_accuracy": 0.6, "teacher_run": "outputs/teacher", "arms": {
        "rl": {"per_seed": {"0": {"0": 0.3, "10": 0.5, "20": 0.6}, "1": {"0": 0.3, "10": 0.56, "20": 0.6}}},
        "distill": {"per_seed": {"0": {"0": 0.3, "10": 0.58}}}}}
    (tmp_path / "earlier.json").write_text(json.dumps(d))
    return str(tmp_path / "earlier.json")


def test_first_steps_ratios_and_the_merge_of_an_earlier_headline(tmp_path):
    d0 = run(tmp_path, "d0", {0: 0.3, 2: 0.4, 4: 0.55, 6: 0.5, 8: 0.6, 10: 0.58})  # first 4, not 8
    d1 = run(tmp_path, "d1", {0: 0.3, 2: 0.4, 4: 0.5, 6: 0.5, 8: 0.56, 10: 0.6})
    r1 = run(tmp_path, "r1", {0: 0.3, 2: 0.4, 4: 0.45, 6: 0.5, 8: 0.55, 10: 0.59})  # step 10: 0.59 vs earlier 0.56
    out = curves.main(["--earlier", earlier(tmp_path), "--distill", f"0={d0}", f"1={d1}", "--rl", f"1={r1}",
                       "--out", str(tmp_path / "h.json")])
    assert out["teacher_accuracy"] == 0.6 and out["threshold"] == pytest.approx(0.54)
    rl, distill = out["arms"]["rl"], out["arms"]["distill"]
    # RL seed 1: the new run's steps 0-10 and the earlier run's 20; seed 0 only the earlier's
    assert rl["per_seed"][1] == {0: 0.3, 2: 0.4, 4: 0.45, 6: 0.5, 8: 0.55, 10: 0.59, 20: 0.6}
    assert rl["reproduced"] == [[1, 0, 0.3, 0.3], [1, 10, 0.56, 0.59]]
    assert rl["sources"][0].endswith("earlier.json") and rl["sources"][1].endswith("earlier.json (steps [20])")
    assert distill["sources"][0] == d0  # the earlier curve adds no step to it
    assert rl["first_step_at_threshold_per_seed"] == {0: 20, 1: 8}
    assert sorted(rl["mean"]) == [0, 10, 20] and rl["first_step_at_threshold"] == 10  # (0.5 + 0.59) / 2
    # distillation: the new seed 0 keeps its step 10 (0.58), the earlier one is in `reproduced`
    assert distill["first_step_at_threshold_per_seed"] == {0: 4, 1: 8}
    assert distill["mean"][4] == pytest.approx(0.525) and distill["first_step_at_threshold"] == 8
    assert out["steps_ratio_vs_rl"]["distill"] == pytest.approx(8 / 10)
    assert out["steps_ratio_vs_rl_per_seed"]["distill"] == {0: pytest.approx(4 / 20), 1: pytest.approx(8 / 8)}
    assert out["heldout_problems"] == 200
    assert out["threshold_se_one_eval"] == pytest.approx((0.54 * 0.46 / 200) ** 0.5)
    assert out["threshold_se_mean"]["distill"] == pytest.approx((0.54 * 0.46 / 200) ** 0.5 / 2 ** 0.5)
    assert json.loads((tmp_path / "h.json").read_text())["arms"]["rl"]["first_step_at_threshold"] == 10


def test_refuses_runs_on_different_heldout_sets_and_a_missing_teacher(tmp_path):
    a, b = run(tmp_path, "a", {0: 0.3}, 200), run(tmp_path, "b", {0: 0.3}, 100)
    with pytest.raises(SystemExit, match="num_prompts"):
        curves.main(["--earlier", earlier(tmp_path), "--distill", f"0={a}", f"1={b}"])
    with pytest.raises(SystemExit):  # neither --teacher-run nor --earlier
        curves.main(["--distill", f"0={a}"])
