"""bench/peer.py --seeds N: every arm at N seeds (the seed reaching train.py and TRL's script), reduced
to mean +- standard error per arm and the project - TRL difference seed by seed; and each arm's
fractions of the machine's roofline."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_peer():
    sys.path.insert(0, str(ROOT / "bench"))  # peer.py imports common and lora_seeds from there
    import peer

    return peer


def seed_summary(acc, trl_acc, reward, trl_reward, step_s, trl_step_s):
    return {"accuracy_after": acc, "trl_accuracy_after": trl_acc, "train_reward": reward,
            "trl_train_reward": trl_reward, "step_s": step_s, "trl_step_s": trl_step_s}


def test_over_seeds_by_hand():
    peer = load_peer()
    runs = [seed_summary(0.60, 0.70, 0.40, 0.30, 5.0, 19.0),
            seed_summary(0.70, 0.80, 0.50, None, 5.0, 18.0),  # TRL's reward missing at this seed
            seed_summary(0.80, 0.90, 0.60, 0.50, 5.3, 18.4)]
    out = peer.over_seeds(runs)
    assert out["seeds_n"] == 3
    # project accuracy 0.6, 0.7, 0.8: mean 0.7, sample sd 0.1, se 0.1 / sqrt(3)
    assert out["accuracy_after_mean"] == pytest.approx(0.7)
    assert out["accuracy_after_se"] == pytest.approx(0.1 / math.sqrt(3), abs=1e-4)
    assert out["trl_accuracy_after_mean"] == pytest.approx(0.8)
    # paired: every difference is -0.1, so its standard error is 0, though each arm's is not
    # (an unpaired sqrt(se_a^2 + se_b^2) would be 0.082)
    assert out["accuracy_after_diff"] == pytest.approx(-0.1) and out["accuracy_after_diff_se"] == 0
    assert out["accuracy_below_trl_beyond_2se"] is True
    # the seed without TRL's reward is left out of TRL's mean and of the difference, not counted as 0
    assert out["trl_train_reward_n"] == 2 and out["trl_train_reward_mean"] == pytest.approx(0.4)
    assert out["train_reward_n"] == 3 and out["train_reward_mean"] == pytest.approx(0.5)
    assert out["train_reward_diff_n"] == 2 and out["train_reward_diff"] == pytest.approx(0.1)
    assert out["step_s_mean"] == pytest.approx(5.1) and out["trl_step_s_mean"] == pytest.approx(18.4667, abs=1e-4)
    assert out["step_s_diff_se"] == pytest.approx(
        (sum((d + 13.3667) ** 2 for d in (-14.0, -13.0, -13.1)) / 2) ** 0.5 / math.sqrt(3), abs=1e-3)
    # within 2 SE: not flagged
    close = peer.over_seeds([seed_summary(0.70, 0.72, 0, 0, 1, 1), seed_summary(0.70, 0.66, 0, 0, 1, 1)])
    assert close["accuracy_after_diff"] == pytest.approx(0.01) and close["accuracy_below_trl_beyond_2se"] is False
    # one seed: a mean, no standard error (None, not NaN: the line stays valid JSON)
    one = peer.over_seeds(runs[:1])
    assert one["accuracy_after_mean"] == 0.6 and one["accuracy_after_se"] is None
    assert "accuracy_below_trl_beyond_2se" not in one
    json.loads(json.dumps(one, allow_nan=False))


def test_seeds_run_every_arm_at_each_seed(tmp_path, monkeypatch):
    """main with --seeds 2 --seed 3: train.py gets seed=3 then seed=4, TRL's script --seed 3 then 4,
    each seed's runs in their own folder; the reduction is of what the arms wrote."""
    peer = load_peer()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(peer, "MODEL_DIR", model)
    trl_python = tmp_path / "python"
    trl_python.write_text("")
    trl_python.chmod(0o755)
    seen = []

    def fake_run(cmd, log_path, env):  # what train.py / peer_trl.py would write, from the seed they got
        if cmd[1] == "train.py":
            seed = int(next(c for c in cmd if c.startswith("seed=")).split("=")[1])
            run_dir = Path(next(c for c in cmd if c.startswith("hydra.run.dir=")).split("=", 1)[1])
            rows = [{"step": 0, "eval_accuracy": 0.3}]
            rows += [{"step": s, "step_s": 5.0 + seed, "rollout_s": 2.0, "response_length": 4, "tokens": 1600,
                      "reward_mean": 0.1 * seed} for s in range(2)]
            rows += [{"step": 2, "eval_accuracy": 0.5 + 0.01 * seed}]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            seen.append(("project", seed, run_dir.parent.name))
        else:
            seed = int(cmd[cmd.index("--seed") + 1])
            out = Path(cmd[cmd.index("--out") + 1])
            out.write_text(json.dumps({"accuracy_before": 0.3, "accuracy_after": 0.55, "trl": "x", "config": {},
                                       "per_step": [{"step": s, "step_s": 20.0, "rollout_s": 8.0,
                                                     "generated_tokens": 128, "tokens": 1600,
                                                     "reward_mean": 0.2} for s in range(2)]}))
            seen.append(("trl", seed, out.parent.name))
        return 0, 1.0, {"loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}

    emitted = {}
    monkeypatch.setattr(peer, "roofline", lambda arms, shape: {})  # tested below (it measures the machine)
    monkeypatch.setattr(peer, "run_logged", fake_run)
    monkeypatch.setattr(peer, "emit", lambda name, summary, details: emitted.setdefault(name, summary))
    out = peer.main(["--seeds", "2", "--seed", "3", "--steps", "2", "--engines", "hf", "--out", str(tmp_path / "runs"),
                     "--trl-python", str(trl_python)])
    assert seen == [("project", 3, "seed3"), ("trl", 3, "seed3"), ("project", 4, "seed4"), ("trl", 4, "seed4")]
    assert list(emitted) == ["peer-seeds"] and out["seeds"] == [3, 4]
    assert out["accuracy_after_mean"] == pytest.approx(0.535) and out["accuracy_after_se"] == pytest.approx(0.005)
    assert out["accuracy_after_diff"] == pytest.approx(-0.015)
    assert out["train_reward_mean"] == pytest.approx(0.35) and out["trl_train_reward_mean"] == pytest.approx(0.2)
    assert out["step_s_mean"] == pytest.approx(8.5) and out["trl_step_s_mean"] == pytest.approx(20.0)
    for seed in (3, 4):  # each seed's own comparison beside it
        assert json.loads((tmp_path / f"runs/seed{seed}/peer.json").read_text())["summary"]["seed"] == seed
    assert json.loads((tmp_path / "runs/peer-seeds.json").read_text())["summary"]["seeds"] == [3, 4]


def test_each_arms_fraction_of_the_roofline(tmp_path, monkeypatch):
    """The job's training and generation FLOPs of each step (bench/roofline.py) over the arm's train_s and
    rollout_s, against the fp32 peak measured in the process; the same work counted for every arm."""
    peer = load_peer()
    import roofline
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=96, vocab_size=128)
    config.save_pretrained(tmp_path)
    monkeypatch.setattr(peer, "MODEL_DIR", tmp_path)
    peak = 1e9
    monkeypatch.setattr(roofline, "machine", lambda config, tokens: {
        "gemm_fp32_flops_per_s": peak, "gemm_bf16_flops_per_s": 2 * peak, "bandwidth_bytes_per_s": 5e9, "threads": 2})
    shape = peer.Shape(prompts_per_step=2, samples_per_prompt=4, max_new_tokens=16, options={}, lr=1e-5,
                       lora={"rank": 0}, teacher=None)
    step = {"step_s": 3.0, "rollout_s": 1.0, "generated_tokens": 8 * 5, "tokens": 8 * (5 + 10), "reward_mean": 0.5}
    arms = {"project_hf": {"per_step": [step, step]},
            "trl": {"per_step": [step | {"step_s": 9.0, "rollout_s": 4.0}, step | {"rollout_s": float("nan")}]}}
    out = peer.roofline(arms, shape)
    row = {"samples": 8, "group": 4, "tokens": 120, "response_length": 5, "action_tokens": 40}
    assert out["gemm_fp32_gflops_per_s"] == 1 and out["gemm_bf16_gflops_per_s"] == 2
    assert out["train_fraction_fp32_peak"] == pytest.approx(roofline.step_flops(config, row) / 2.0 / peak)
    assert out["rollout_fraction_fp32_peak"] == pytest.approx(roofline.rollout_flops(config, row) / 1.0 / peak)
    # TRL: the same work over its own times; its step without a generate span is left out
    assert out["trl_train_fraction_fp32_peak"] == pytest.approx(roofline.step_flops(config, row) / 5.0 / peak)
    assert out["trl_rollout_fraction_fp32_peak"] == pytest.approx(roofline.rollout_flops(config, row) / 4.0 / peak)
