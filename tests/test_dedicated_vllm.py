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
* train.py resumed from a checkpoint: the generator's rollouts and the metrics are the uninterrupted run's;
* the tiny Qwen3-MoE (routing replay), k = 1: the generator's engine records the routes of the version
  each rollout used, the trainer receives them and replays them in every forward (control: a trainer
  replaying them shifted by one expert logs a large gap at the version-matched step 0);
* LoRA rank 4, k = 1: the full model pushed once, the adapters after, taken by vLLM as adapter versions;
  rollout j exactly version max(0, j - 1) (control: version 0, a generator without the adapter pushes,
  misses); a second run gives the same records.
The colocated refusal of vLLM with a rollout thread names the dedicated placement; on dedicated ranks
MoE, LoRA and cuda are accepted.
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


def test_vllm_on_dedicated_ranks_takes_moe_lora_and_cuda():
    from rl.config import checks

    def vllm(*extra):
        return compose(*SMALL, "model=dense_tiny", "parallel.rollout_ranks=1", "eval.every=0", "checkpoint.final=false",
                       "rollout.engine=vllm", *extra, world_size=2, check=False)

    # dense, MoE (routing replay), LoRA; cuda: each engine on its generator's GPU (test_vllm_engine.py)
    for extra in ((), ("model=moe_tiny",), ("model.lora.rank=4",), ("trainer.device=cuda",)):
        checks._check_dedicated(vllm(*extra))
    with pytest.raises(ValueError, match=r"parallel\.rollout_ranks=1 \(dedicated rollout ranks\): "
                                         r"rollout\.tensor_parallel_size=2: expected 1"):  # control: a refusal
        checks._check_dedicated(vllm("rollout.tensor_parallel_size=2"))


# ------------------------------------------------------------ vLLM on a generator rank, torchrun
def _rank(out: str, steps: int, control: str, overrides: list[str]) -> None:
    """A torchrun rank: the generator's records per step (and its engine's live LoRA adapter versions),
    or the trainer's metrics per step, its weights of every version (0 before step 0, j + 1 after step j),
    the bytes of each push it sent (version 0 at build, then one a step), the records the exchange handed
    it and, per MoE forward of its policy, whether it replayed routes; saved to `out`/rank<r>.pt.
    `control` "shift_routes": the trainer replays every received route shifted by one expert."""
    import dataclasses

    import torch.distributed as dist

    from runtime.parallel_dims import init_distributed
    from rl.rollout.dedicated import WeightPush
    from rl.trainer import trainer
    from rl.trainer.build import build_generator, build_trainer
    from test_dedicated import _received, _replayed
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
        if scheduler.engine.lora is not None:
            result["loras"] = sorted(scheduler.engine.llm.llm_engine.list_loras())
        generator.close()
    else:
        load, pushes = WeightPush.load_weights, []

        def push(self, weights):
            load(self, weights)
            pushes.append(self.loaded_bytes)

        WeightPush.load_weights = push
        received, replayed = _received(), _replayed()  # before the control's shift: the routes as they arrived
        if control == "shift_routes":
            exchange = trainer.exchange_records

            def shifted(*args):
                return [r if r is None or r.routed_experts is None else dataclasses.replace(
                    r, routed_experts=torch.where(r.routed_experts >= 0, (r.routed_experts + 1) % 8, -1))
                    for r in exchange(*args)]

            trainer.exchange_records = shifted
        tr = build_trainer(cfg, dims)
        result = {"metrics": [], "versions": [weights(tr)], "pushes": pushes, "received": received,
                  "replayed": replayed}
        for step in range(steps):
            result["metrics"].append(tr.step(step))
            result["versions"].append(weights(tr))
    torch.save(result, Path(out) / f"rank{dims.rank}.pt")
    dist.destroy_process_group()


def _torchrun(tmp_path: Path, name: str, *overrides: str, run: tuple[str, ...] = RUN, steps: int = STEPS,
              control: str = "none") -> tuple[dict, dict]:
    """(trainer, generator) results of a 2-rank torchrun of `_rank` over `run` + `overrides`."""
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(out),
           str(steps), control, *run, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))


def _policy(*overrides: str, moe: bool = False) -> torch.nn.Module:
    """A fresh policy-shaped model of the run (`RUN` and `overrides`: LoRA's adapters included), built
    from the seed, to load a version of the trainer's weights into; `moe`: its MoE blocks the training
    forward's (model/moe.py's MoEBlocks, every expert local), which record and replay routes."""
    from model.moe import shard_experts
    from rl.trainer.build import ModelBuilder

    model = ModelBuilder(compose(*overrides, world_size=2), None).policy_lm()
    return (shard_experts(model, None) if moe else model).eval()


def _version_gap(version: dict, records: list, model: torch.nn.Module | None = None) -> float:
    """max |log-prob of the sampled tokens under the trainer's weights `version` - the engine's|
    (`model`: the policy's shape, by default the tiny dense Qwen3 of `RUN`)."""
    from model.models import build_model
    from test_vllm_engine import _hf_gap

    if model is None:
        model = build_model("qwen3", vocab_size=64, max_position_embeddings=512, head_dim=32,
                            attn_implementation="sdpa")
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


MOE_RUN = ("model=moe_tiny", *RUN[1:], "rollout.max_model_len=192", "rollout.max_staleness=1")  # as MOE_TINY
MOE_STEPS = 4


def _moe_scores(model: torch.nn.Module, version: dict, records: list) -> tuple[float, float, bool]:
    """The records' sampled tokens under the trainer's weights `version` (`model`: the MoE policy's shape
    with MoEBlocks, `_policy`): max |log-prob - the engine's| replaying each record's routes, the same
    replaying them shifted by one expert (a control: other routes score otherwise), and whether the live
    routing of every token but the last (no forward reads it: -1) is the record's (top-k sorted)."""
    from model.moe import record_routing, routing_replay

    missing, unexpected = model.load_state_dict(version, strict=False)
    assert not unexpected and set(missing) <= {n for n, _ in model.named_buffers()}, (missing, unexpected)
    replayed, shifted, live = [], [], True

    def gap(rec, routed) -> float:
        with torch.no_grad(), routing_replay(model, routed[None]), record_routing(model) as seen:
            logits = model(rec.sequences[None], use_cache=False).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, rec.sequences[1:, None])[:, 0]
        return float((lp - rec.rollout_log_probs)[rec.action_mask].abs().max()), seen.routed_experts[0]

    for rec in records:
        routes, last = rec.routed_experts, rec.sequences.numel() - 1
        g, _ = gap(rec, routes)
        replayed.append(g)
        g, _ = gap(rec, torch.where(routes >= 0, (routes + 1) % 8, routes))
        shifted.append(g)
        _, seen = gap(rec, torch.full_like(routes, -1))  # -1 everywhere: live routing
        live &= torch.equal(seen.sort(1).values[..., :last], routes.sort(1).values[..., :last])
    return max(replayed), min(shifted), live


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_moe_generator_records_the_routes_the_trainer_replays(tmp_path):
    """The tiny Qwen3-MoE (algo.routing_replay, the default), one trainer beside one vLLM generator at
    max_staleness=1, 4 steps: the generator's engine records each token's routes (`routed_experts
    [L=2, K=2, T]`, -1 for the last token), which are the live routing of version max(0, j - 1) of the
    trainer's weights on rollout j's tokens; replaying them that version scores the tokens as vLLM did
    (within 1e-4; the next version misses, and so do the routes shifted by one expert). The trainer
    receives them as sent and replays them in every forward of its policy; the rollout/train gap is
    below 1e-4 at step 0 (version-matched). The control: a trainer that replays the routes it receives
    shifted by one expert (the same step-0 records from the generator) logs a gap over 1e-3 at step 0."""
    from test_dedicated import _fields, _same

    trainer, generator = _torchrun(tmp_path, "moe", run=MOE_RUN, steps=MOE_STEPS)
    control, control_generator = _torchrun(tmp_path, "moe_shifted", run=MOE_RUN, steps=1, control="shift_routes")
    assert generator["engine"] == "VLLMRolloutEngine"
    versions, metrics, records = trainer["versions"], trainer["metrics"], generator["records"]
    assert [int(step[0].policy_version) for step in records] == [0, *range(MOE_STEPS - 1)]
    model = _policy(*MOE_RUN, moe=True)
    for j, step in enumerate(records):
        assert len(step) == 16
        for rec in step:
            routes, T = rec.routed_experts, rec.sequences.numel()
            assert routes.shape == (2, 2, T) and (routes[..., -1] == -1).all()
            assert (routes[..., :-1] >= 0).all() and (routes < 8).all()
        replayed, shifted, live = _moe_scores(model, versions[max(0, j - 1)], step)
        assert replayed < TOL < 10 * TOL < shifted and live, (j, replayed, shifted, live)
        if j:  # control: the version after it (the trainer's at step j) scores them otherwise
            assert _moe_scores(model, versions[j], step)[0] > 100 * TOL, j
    routes = [r.routed_experts for step in records for r in step]  # they carry information
    assert len({tuple(r[:, :, t].flatten().tolist()) for r in routes for t in range(r.shape[-1] - 1)}) > 8
    assert not all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(records[0], records[1]))

    # the trainer: the records as the generator sent them (routes included), replayed in every policy forward
    assert _same([_fields(step) for step in records], trainer["received"])
    assert trainer["replayed"] and all(trainer["replayed"])
    for j, m in enumerate(metrics):
        assert m["rollout_staleness_max"] == (1.0 if j else 0.0) and m["weight_sync_bytes"] > 0
    print("MoE rollout/train gap max per step", [f"{m['rollout_logprob_abs_diff_max']:.2e}" for m in metrics],
          "control step 0", f"{control['metrics'][0]['rollout_logprob_abs_diff_max']:.2e}")
    assert metrics[0]["rollout_logprob_abs_diff_max"] < TOL
    # the control: the same rollout 0, replayed shifted on the trainer
    assert _same([_fields(control_generator["records"][0])], [_fields(records[0])])
    assert control["replayed"] and all(control["replayed"])
    assert control["metrics"][0]["rollout_logprob_abs_diff_max"] > 1e-3


LORA = ("model.lora.rank=4", "rollout.max_staleness=1")
LORA_STEPS = 6


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_generator_takes_adapter_only_pushes_as_lora_versions(tmp_path):
    """LoRA rank 4 on the tiny dense Qwen3, one trainer beside one vLLM generator at max_staleness=1,
    6 steps: the first push (version 0, at build) sends the full model and every later one the adapters
    only (the bytes of tests/test_dedicated.py's LoRA test: 361,984 then 32,768), which the generator's
    vLLM engine takes as adapter versions (one live at the end); rollout j is exactly version
    max(0, j - 1) of the trainer's weights, base and adapters (its tokens scored by that version within
    1e-4; the controls: the version after it misses, and so does version 0, which a generator that left
    the adapter pushes unloaded would have used from rollout 2 on), and a second run gives the same
    records bit for bit (tokens, vLLM's log-probs, rewards, versions). The reward is not asserted: in 6
    steps it does not rise (measured 0.016 -> 0.016; 12 steps at trainer.lr=5e-2: 0.016 -> 0.055)."""
    from model.lora import adapter_bytes
    from rl.rollout.sync import full_tensor_bytes
    from rl.trainer.build import ModelBuilder
    from test_dedicated import _fields, _same

    trainer, generator = _torchrun(tmp_path, "lora", *LORA, steps=LORA_STEPS)
    _, again = _torchrun(tmp_path, "lora_again", *LORA, steps=LORA_STEPS)
    lm = ModelBuilder(compose(*RUN, *LORA, world_size=2), None).policy_lm("meta")
    full, adapters = sum(full_tensor_bytes(lm).values()), adapter_bytes(lm)
    assert trainer["pushes"] == [full] + [adapters] * LORA_STEPS and 0 < adapters < full / 10
    versions, metrics, records = trainer["versions"], trainer["metrics"], generator["records"]
    for j, m in enumerate(metrics):
        assert m["weight_sync_bytes"] == adapters and m["rollout_staleness_max"] == (1.0 if j else 0.0)
    assert len(generator["loras"]) == 1 and generator["loras"][0] >= LORA_STEPS - 1  # version v is adapter v + 1

    assert [int(step[0].policy_version) for step in records] == [0, *range(LORA_STEPS - 1)]
    model = _policy(*RUN, *LORA)
    gaps = []
    for j, step in enumerate(records):
        used = _version_gap(versions[max(0, j - 1)], step, model)
        after = _version_gap(versions[j], step, model) if j else None
        first = _version_gap(versions[0], step, model) if j >= 2 else None
        gaps.append((used, after, first))
    print("LoRA: |dlogp| under the version used, the next, version 0:", gaps)
    print("reward per step", [f"{m['reward_mean']:.3f}" for m in metrics], "rollout/train gap",
          [f"{m['rollout_logprob_abs_diff']:.2e}" for m in metrics])
    for j, (used, after, first) in enumerate(gaps):
        assert used < TOL, (j, used)
        assert j < 1 or after > 100 * TOL, (j, after)
        assert j < 2 or first > 100 * TOL, (j, first)
    assert metrics[0]["rollout_logprob_abs_diff_max"] < TOL < metrics[1]["rollout_logprob_abs_diff_max"]
    assert _same([_fields(step) for step in records], [_fields(step) for step in again["records"]])


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


if __name__ == "__main__":  # a torchrun rank of `_torchrun`: out, steps, control, overrides
    _rank(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
