"""vLLM on dedicated rollout ranks (`parallel.rollout_ranks`, rl/rollout/dedicated.py, `rollout.engine=vllm`):
a generator runs a vLLM engine of its own (its engine core a process of its own) over the random-init
folder, loads each push through the engine's own `load_weights` (as a colocated sync), and at
max_staleness >= 1 loads a version from its stage on the rollout thread, between rollouts.

torchrun 2 ranks (one trainer, one generator; vLLM's engine core cannot start under the test launcher's
daemon processes), the tiny dense Qwen3 learning target_token:
* max_staleness=1: the reward rises, the rollout/train gap is logged (`rollout_logprob_abs_diff(_max)`,
  `rollout_kl`), rollout j is exactly version max(0, j - 1) of the trainer's weights (its tokens
  scored by a forward of that version; control: the version after it misses), and a second run gives
  the same records bit for bit (tokens, rollout log-probs, rewards, versions);
* control, max_staleness=0: the same step 0, other records from step 1 on, and every rollout
  scored by its own version (a push not loaded would miss);
* train.py resumed from a checkpoint: the generator's rollouts and the metrics are the uninterrupted run's.
The colocated refusal of vLLM with a rollout thread names the dedicated placement; the start-up refusals
on dedicated ranks (MoE) name their keys; cuda is accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testing.inprocess import SMALL, compose

ROOT = Path(__file__).resolve().parents[1]
RUN = ("model=dense_tiny", "+model.overrides.head_dim=32", "trainer.device=cpu", "rollout.engine=vllm", *SMALL,
       "task.max_new_tokens=8", "algo.tis_cap=2.0", "eval.every=0", "checkpoint.final=false", "trainer.log_samples=0",
       "trainer.lr=1e-2", "parallel.rollout_ranks=1")
STEPS = 12
TOL = 1e-4  # fp32: vLLM's log-prob of a sampled token vs a training forward's, measured ~5e-7 (tests/test_vllm_engine.py)


# ------------------------------------------------------------ start-up checks (no vLLM needed)
@pytest.mark.parametrize("staleness", [("rollout.max_staleness=1",), ("rollout.mode=async", "rollout.max_staleness=2")])
def test_colocated_vllm_with_a_rollout_thread_is_refused_naming_the_dedicated_placement(monkeypatch, staleness):
    """Colocated: refused before vLLM is imported, the message pointing to parallel.rollout_ranks.
    Control: the same config on dedicated rollout ranks passes the check (it reaches the vLLM import)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError: the refusal comes first
    asynchronous = ("rollout.engine=vllm", "algo.tis_cap=2.0", *staleness)
    with pytest.raises(ValueError, match=r"rollout\.(max_staleness|mode)=\w+ with rollout\.engine=vllm colocated: .*"
                                         r"run vLLM asynchronously on dedicated rollout ranks "
                                         r"\(parallel\.rollout_ranks=R: the last R ranks of the job only generate"):
        compose(*asynchronous, world_size=2)
    with pytest.raises(ImportError, match="make install-vllm"):
        compose(*asynchronous, "model=dense_tiny", "parallel.rollout_ranks=1", "eval.every=0",
                "checkpoint.final=false", world_size=2)


def test_vllm_on_dedicated_ranks_accepts_cuda_and_refuses_moe_naming_its_key(monkeypatch):
    from rl.config import checks

    cfg = compose(*SMALL, "model=dense_tiny", "parallel.rollout_ranks=1", "eval.every=0", "checkpoint.final=false",
                  world_size=2)
    vllm = compose(*SMALL, "model=dense_tiny", "parallel.rollout_ranks=1", "eval.every=0", "checkpoint.final=false",
                   "rollout.engine=vllm", world_size=2, check=False)
    checks._check_dedicated(vllm, "qwen3")  # cpu, dense: accepted
    with pytest.raises(ValueError, match=r"parallel\.rollout_ranks=1 \(dedicated rollout ranks\): rollout\.engine=vllm "
                                         r"with model family qwen3_moe: routing replay"):
        checks._check_dedicated(vllm, "qwen3_moe")
    monkeypatch.setattr(checks, "resolve_device", lambda _: torch.device("cuda"))
    checks._check_dedicated(vllm, "qwen3")  # cuda: accepted, each engine on its generator's GPU (test_vllm_engine.py)
    checks._check_dedicated(cfg, "qwen3")  # control: the project's engine on cuda


# ------------------------------------------------------------ vLLM on a generator rank, torchrun
def _rank(out: str, steps: int, overrides: list[str]) -> None:
    """A torchrun rank: the generator's records per step, or the trainer's metrics per step and its
    weights of every version (0 before step 0, j + 1 after step j), saved to `out`/rank<r>.pt."""
    import torch.distributed as dist

    from runtime.parallel_dims import init_distributed
    from rl.trainer.build import build_generator, build_trainer
    from testing.inprocess import weights

    cfg = compose(*overrides, world_size=int(os.environ["WORLD_SIZE"]))
    dims = init_distributed(cfg.parallel.dp, device="cpu", rollout_ranks=cfg.parallel.rollout_ranks)
    torch.manual_seed(cfg.seed)
    if dims.generates:
        generator = build_generator(cfg, dims)
        scheduler, take = generator.scheduler, generator.scheduler.take
        result = {"records": [], "engine": type(scheduler.engine).__name__}

        def keep(step):  # the records each take hands over, step by step
            taken = take(step)
            result["records"].append(taken.records)
            return taken

        scheduler.take = keep
        for step in range(steps):
            generator.step(step)
        generator.close()
    else:
        tr = build_trainer(cfg, dims)
        result = {"metrics": [], "versions": [weights(tr)]}
        for step in range(steps):
            result["metrics"].append(tr.step(step))
            result["versions"].append(weights(tr))
    torch.save(result, Path(out) / f"rank{dims.rank}.pt")
    dist.destroy_process_group()


def _torchrun(tmp_path: Path, name: str, *overrides: str) -> tuple[dict, dict]:
    """(trainer, generator) results of a 2-rank torchrun of `_rank`."""
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out),
           str(STEPS), *RUN, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def _version_gap(version: dict, records: list) -> float:
    """max |log-prob of the sampled tokens under the trainer's weights `version` - the engine's|."""
    from model.models import build_model
    from test_vllm_engine import _hf_gap

    model = build_model("qwen3", vocab_size=64, max_position_embeddings=512, head_dim=32, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(version, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head: the embedding
    return _hf_gap(model.eval(), records)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generator_trains_with_one_step_off_rollouts_and_its_records_repeat(tmp_path):
    from test_dedicated import _fields, _same

    trainer, generator = _torchrun(tmp_path, "k1", "rollout.max_staleness=1")
    _, again = _torchrun(tmp_path, "k1_again", "rollout.max_staleness=1")
    control_trainer, control = _torchrun(tmp_path, "k0", "rollout.max_staleness=0")
    assert generator["engine"] == "VLLMRolloutEngine"
    versions, metrics = trainer["versions"], trainer["metrics"]
    records = [_fields(step) for step in generator["records"]]
    assert len(records) == STEPS and all(len(step) == 16 for step in records)  # 4 prompts x 4 samples a step

    # rollout j is version max(0, j - 1): its tokens scored by that version's weights, not by the next one
    assert [int(step[0]["policy_version"]) for step in records] == [0, *range(STEPS - 1)]
    for j, step in enumerate(generator["records"]):
        used = _version_gap(versions[max(0, j - 1)], step)
        assert used < TOL, (j, used)
        if j:  # control: the version after it (the trainer's at step j) scores them otherwise
            assert _version_gap(versions[j], step) > 100 * TOL, j
    # the run's rollout/train gap (the engine's log-probs against the training forward's), logged each step:
    # step 0 fresh, then one version stale
    for j, m in enumerate(metrics):
        assert {"rollout_logprob_abs_diff", "rollout_logprob_abs_diff_max", "rollout_kl"} <= m.keys()
        assert m["rollout_staleness_max"] == (1.0 if j else 0.0) and m["weight_sync_bytes"] > 0
    assert metrics[0]["rollout_logprob_abs_diff_max"] < TOL < metrics[1]["rollout_logprob_abs_diff_max"]
    rewards = [m["reward_mean"] for m in metrics]
    print("reward per step", [f"{r:.3f}" for r in rewards], "rollout/train gap",
          [f"{m['rollout_logprob_abs_diff']:.2e}" for m in metrics])
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.1, rewards  # it learns (measured 0.016 -> 0.242)

    assert _same(records, [_fields(step) for step in again["records"]]), "two runs gave other records"
    # control, max_staleness=0: rollout j is version j, so the same step 0 and other records from step 1 on,
    # each step's rollout scored exactly by the trainer's weights at that step
    synchronous = [_fields(step) for step in control["records"]]
    assert _same(records[:1], synchronous[:1]) and not _same(records[1:2], synchronous[1:2])
    assert [int(step[0]["policy_version"]) for step in synchronous] == list(range(STEPS))
    assert all(m["rollout_logprob_abs_diff_max"] < TOL for m in control_trainer["metrics"])


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generator_resumes_from_a_checkpoint_on_the_uninterrupted_records(tmp_path):
    """train.py, 6 steps at max_staleness=1, a checkpoint every 2 (tests/test_dedicated_resume.py's
    `launch`), then a run resumed from the step-4 checkpoint: the generator's vLLM engine receives the
    checkpoint's policy (version 4) before its queued rollout 4 (version 3) is put back, so rollouts 4
    and 5 are the uninterrupted run's (prompts, versions, tokens, log-probs, rewards) and so are the
    metrics. Rollout 5 is generated with the pushed version 4: checked by hand, a generator that
    receives the resume push into a throwaway stage (its vLLM engine left at version 0) takes another
    rollout 5 and fails this test."""
    from test_dedicated_resume import launch, metrics, ok, taken

    vllm = ("+model.overrides.head_dim=32", "trainer.device=cpu", "rollout.engine=vllm", "parallel.rollout_ranks=1")
    ok(launch(tmp_path / "run", 2, *vllm, takes=tmp_path / "run.jsonl"))
    ok(launch(tmp_path / "resumed", 2, *vllm, f"resume={tmp_path / 'run' / 'checkpoints' / 'step_00000004'}",
              takes=tmp_path / "resumed.jsonl"))
    mine, again = taken(tmp_path / "run.jsonl", 1), taken(tmp_path / "resumed.jsonl", 1)
    assert [t["versions"] for t in mine] == [[0], [0], [1], [2], [3], [4]]
    assert [t["step"] for t in again] == [4, 5] and again == mine[4:]
    assert len({t["records"] for t in mine}) == 6  # a digest per rollout: they differ step to step
    assert metrics(tmp_path / "resumed") == metrics(tmp_path / "run")[4:]


if __name__ == "__main__":  # a torchrun rank of `_torchrun`: out, steps, overrides
    _rank(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
