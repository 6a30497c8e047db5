"""Checkpoints: a run stopped, killed or restarted continues with the uninterrupted run's
metrics bit for bit; a save is atomic; checkpoints reshard across world sizes; the export
is a Hugging Face folder with the policy's logits; another model's checkpoint is refused."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from checkpoint_worker import config, load_and_report, save_after_one_step, trainer_for
from testing.distributed import run_distributed
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from model.models import build_model
from runtime.parallel_dims import ParallelDims
from rl.trainer.checkpoint import Checkpointer, check_config, complete_checkpoints, find_checkpoint, load_checkpoint
from rl.trainer.export import main as export_main
from rl.config import validate

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "step_s", "weight_sync_s",
          "rollout_generate_s", "rollout_wait_s", "rollout_overlap", "rollout_publish_wait_s", "rollout_queue"}
RUN = ["trainer.max_steps=8", "trainer.plot=false", "trainer.progress=false"]
OFF = ["rollout.mode=one_step_off", "algo.tis_cap=2.0"]  # step k+1's rollout generated while step k trains
ASYNC = ["rollout.mode=async", "rollout.max_staleness=2", "algo.tis_cap=2.0"]  # rollout j: policy version j - 2
FOUR = ["parallel=cp2_ep2", "task.prompts_per_step=8", "task.samples_per_prompt=4"]  # dp2 x cp2, ep2
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def launch(out: Path, *overrides: str, nproc: int = 1, kill: str | None = None, restarts: int | None = None,
           trace: Path | None = None):
    """train.py in a subprocess (torchrun for nproc > 1; launch/local.sh when `restarts` is
    set); `kill` sets RL_TEST_KILL, `trace` RL_TEST_TRACE for the fault hook tests/fault/sitecustomize.py."""
    args = [f"hydra.run.dir={out}", *overrides]
    if restarts is not None:
        cmd = ["launch/local.sh", str(nproc), *args]
    elif nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "train.py",
               *args]
    hook = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault"), str(ROOT)]),
            **({"RL_TEST_KILL": kill} if kill else {}), **({"RL_TEST_TRACE": str(trace)} if trace else {})}
    env = {**ENV, **(hook if kill or trace else {}), **({"MAX_RESTARTS": str(restarts)} if restarts else {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def trained(trace: Path) -> list[dict]:
    """The RL_TEST_TRACE lines: per trained step and rank, the prompt indices of the samples
    that rank generated for it and a digest of their tokens."""
    return [json.loads(line) for line in trace.read_text().splitlines()]


# -------------------------------------------------------------- in process
def test_expert_shards_are_nested_chunks_of_the_global_tensor():
    """An expert entry saved as [E, ...] on the (ep, edp_cp) mesh with (Shard(0), Shard(0)):
    DTensor's offsets equal EP's contiguous slice followed by FSDP2's torch.chunk inside it,
    uneven and empty chunks included."""
    for experts, ep, fsdp in [(8, 2, 2), (8, 2, 3), (8, 4, 3), (8, 2, 6), (128, 8, 16), (6, 2, 4)]:
        rows = torch.arange(experts)
        for ep_rank in range(ep):
            mine = rows.view(ep, -1)[ep_rank]  # ExpertParallelExperts: experts [r*E/ep, (r+1)*E/ep)
            chunks = list(torch.chunk(mine, fsdp)) + [mine[:0]] * fsdp  # FSDP2: torch.chunk, then empty
            for fsdp_rank in range(fsdp):
                shape, offset = _compute_local_shape_and_global_offset(
                    (experts, 3), (ep, fsdp), [ep_rank, fsdp_rank], [Shard(0), Shard(0)])
                want = chunks[fsdp_rank]
                assert shape == (len(want), 3), (experts, ep, fsdp, ep_rank, fsdp_rank)
                if len(want):
                    assert offset[0] == int(want[0]), (experts, ep, fsdp, ep_rank, fsdp_rank)


def test_only_complete_checkpoints_are_found(tmp_path):
    for name, marker in [("step_00000002", True), ("step_00000004", False), ("step_00000006.tmp", True),
                         ("step_00000003", True)]:
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / "COMPLETE").write_text("{}")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert find_checkpoint(tmp_path) == tmp_path / "step_00000003"
    for bad, why in [(tmp_path / "step_00000004", "no COMPLETE"), (tmp_path / "step_00000006.tmp", "no COMPLETE"),
                     (tmp_path / "nowhere", "folder not found")]:
        with pytest.raises(ValueError, match=why):
            find_checkpoint(bad)
    cfg = config("resume=" + str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="resume=.*nowhere.*folder not found"):
        Checkpointer(cfg, ParallelDims(), tmp_path)
    for bad, key in [("checkpoint.keep=0", "checkpoint.keep"), ("checkpoint.every=-1", "checkpoint.every")]:
        with pytest.raises(ValueError, match=key):
            validate(config(bad), world_size=1)
    fresh = Checkpointer(config("resume=auto", f"checkpoint.dir={tmp_path / 'empty'}"), ParallelDims(), tmp_path)
    assert fresh.resume_from is None  # nothing saved yet: start fresh
    never = Checkpointer(config("resume=never", f"checkpoint.dir={tmp_path}"), ParallelDims(), tmp_path)
    assert never.resume_from is None  # checkpoints exist, but `never` starts fresh


def test_a_checkpoint_of_another_model_or_algorithm_is_refused_naming_the_key(tmp_path):
    small = ["task.prompts_per_step=2", "task.samples_per_prompt=2", "model=moe_tiny"]
    saved = save_after_one_step(0, 1, str(tmp_path), *small)
    path = tmp_path / "step_00000001"
    again = load_and_report(0, 1, str(path), *small)  # the control: the same model loads
    assert again["step"] == 1 and all(torch.equal(again["state"][k], v) for k, v in saved["state"].items())
    with pytest.raises(ValueError, match=r"model has num_local_experts=8, this run's has num_local_experts=4 "  # before a model
                                         r"\(from model\.overrides\.num_experts\)"):         # is built
        Checkpointer(config(*small, f"resume={path}", "+model.overrides.num_experts=4"), ParallelDims(), tmp_path)
    # the same model spelled another way: a default passed explicitly resumes (the control above refuses)
    Checkpointer(config(*small, f"resume={path}", "+model.overrides.num_experts=8"), ParallelDims(), tmp_path)
    with pytest.raises(ValueError, match=r"model\.name='qwen3_moe'"):
        check_config(path, config(*small, "model=dense_tiny"))
    _, other = trainer_for(*small, "+model.overrides.num_experts=4")  # past the config check: the tensors differ
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: shape \[8, 64, 64\] in the checkpoint, \[4, 64, 64\]"):
        load_checkpoint(other, path, other.dims)
    _, ppo = trainer_for(*small, "algo=ppo", "algo.kl_coef=0")  # a critic the checkpoint does not hold
    with pytest.raises(ValueError, match=r"critic\.weights\.[\w.]+: not in the checkpoint"):
        load_checkpoint(ppo, path, ppo.dims)


# ------------------------------------------------------ end to end, one process
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    ok(launch(out, *RUN))
    return metrics(out)


@pytest.mark.slow
def test_killed_run_resumes_with_the_uninterrupted_metrics(uninterrupted, tmp_path):
    out = tmp_path / "run"
    killed = launch(out, *RUN, "checkpoint.every=2", kill="after_step:5")  # SIGKILL once 5 steps are done
    assert killed.returncode == -signal.SIGKILL
    assert len(metrics(out)) == 5  # steps 0..4 logged; the newest checkpoint holds 4
    ok(launch(out, *RUN, "checkpoint.every=2", "resume=auto"))
    assert metrics(out) == uninterrupted  # step 4 re-run once, not duplicated; 5..7 bit for bit
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000006", "step_00000008"]


def readme(cwd: Path, *args: str, kill: str | None = None):
    """`python train.py <args>` run from `cwd` (its runs go to cwd/outputs/<run id>), as a user types it."""
    hook = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault"), str(ROOT)]), "RL_TEST_KILL": kill}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env={**ENV, **(hook if kill else {})},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_readme_resume_command_continues_the_killed_run_in_its_own_folder(tmp_path):
    """`python train.py resume=auto checkpoint.every=5`, verbatim, after a SIGKILL: it finds the
    newest run of the same experiment under outputs/ (not a newer run of another seed) and
    continues it in place: one folder holds the checkpoints and the uninterrupted run's
    metrics.jsonl, bit for bit. Then `resume=auto checkpoint.dir=<run>/checkpoints` extends it
    in that folder too."""
    (alone := tmp_path / "alone").mkdir()
    ok(readme(alone, "checkpoint.every=5"))
    (uninterrupted,) = (alone / "outputs").iterdir()
    (here := tmp_path / "here").mkdir()
    killed = readme(here, "checkpoint.every=5", kill="after_step:7")
    assert killed.returncode == -signal.SIGKILL
    (run,) = (here / "outputs").iterdir()
    ok(readme(here, "seed=1", "checkpoint.every=5", "trainer.max_steps=5"))  # another experiment, saved later
    resumed = readme(here, "resume=auto", "checkpoint.every=5")
    ok(resumed)
    assert f"resume=auto: continuing {run.relative_to(here)}" in resumed.stderr, resumed.stderr[-2000:]
    assert len(list((here / "outputs").iterdir())) == 2  # no third folder
    assert metrics(run) == metrics(uninterrupted) and len(metrics(run)) == 20
    assert "resumed from " + str(run / "checkpoints" / "step_00000005") in (run / "train.log").read_text()
    assert (run / "curves.png").is_file() and not (run / "FAILED").exists()
    ok(readme(here, "resume=auto", "checkpoint.every=5", f"checkpoint.dir={run / 'checkpoints'}", "trainer.max_steps=22"))
    assert len(list((here / "outputs").iterdir())) == 2 and [m["step"] for m in metrics(run)] == list(range(22))
    assert metrics(run)[:20] == metrics(uninterrupted)


@pytest.mark.slow
def test_kill_during_a_save_leaves_the_previous_checkpoint(uninterrupted, tmp_path):
    out = tmp_path / "run"
    killed = launch(out, *RUN, "checkpoint.every=2", kill="in_save:4")  # shards written, not yet published
    assert killed.returncode == -signal.SIGKILL
    assert (out / "checkpoints" / "step_00000004.tmp").is_dir()
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000002"]
    resumed = launch(out, *RUN, "checkpoint.every=2", f"resume={out / 'checkpoints'}")  # its newest complete one
    ok(resumed)
    assert "resumed from " + str(out / "checkpoints" / "step_00000002") in resumed.stdout + resumed.stderr
    assert metrics(out) == uninterrupted
    assert not list((out / "checkpoints").glob("*.tmp"))


@pytest.fixture(scope="module")
def uninterrupted_off(tmp_path_factory):
    root = tmp_path_factory.mktemp("off")
    ok(launch(root / "run", *RUN, *OFF, trace=root / "trace.jsonl"))
    return metrics(root / "run"), trained(root / "trace.jsonl")


@pytest.mark.slow
def test_one_step_off_killed_with_a_rollout_in_flight_resumes_on_the_same_samples(uninterrupted_off, tmp_path):
    """rollout.mode=one_step_off, one process: SIGKILL while step 6's rollout is being generated
    (in the background, during step 5's training). The newest checkpoint (4 steps) holds step 4's
    rollout, generated during step 3 with policy version 3 and not yet trained; the resumed run
    trains on it and goes on with the uninterrupted run's samples (every step's prompts once,
    the same tokens) and metrics. The control: the same checkpoint resumed without its buffered
    rollout (rollout.mode=sync lets it go) trains step 4 on the same prompts but other samples
    (generated by version 4), so its metrics differ."""
    want, want_trace = uninterrupted_off
    prompts = [set(t["prompts"]) for t in want_trace]  # the prompts (GRPO groups) each step trained
    assert len(prompts) == 8 and len(set().union(*prompts)) == sum(map(len, prompts))  # none in two steps
    assert [m["rollout_staleness_max"] for m in want] == [0.0] + [1.0] * 7  # step 0 generated in the foreground
    assert all(m["rollout_stale_dropped"] == 0 for m in want)
    out = tmp_path / "run"
    killed = launch(out, *RUN, *OFF, "checkpoint.every=2", kill="in_rollout:6", trace=tmp_path / "killed.jsonl")
    assert killed.returncode == -signal.SIGKILL
    assert len(metrics(out)) == 5  # steps 0..4 logged; the newest checkpoint holds 4 and step 4's rollout
    assert trained(tmp_path / "killed.jsonl")[:5] == want_trace[:5]
    four = out / "checkpoints" / "step_00000004"
    control = launch(tmp_path / "control", *RUN, *OFF, "rollout.mode=sync", f"resume={four}", kill="after_step:5",
                     trace=tmp_path / "control.jsonl")  # killed once step 4 is done
    assert control.returncode == -signal.SIGKILL
    assert "buffered rollouts (rollout.mode=one_step_off or async) are let go" in control.stdout + control.stderr
    (step4,) = trained(tmp_path / "control.jsonl")
    assert step4["prompts"] == want_trace[4]["prompts"] and step4["tokens"] != want_trace[4]["tokens"]
    (got,) = metrics(tmp_path / "control")
    assert got["step"] == 4 and (got["reward_mean"], got["loss"]) != (want[4]["reward_mean"], want[4]["loss"])

    resumed = launch(out, *RUN, *OFF, "checkpoint.every=2", "resume=auto", trace=tmp_path / "resumed.jsonl")
    ok(resumed)
    assert trained(tmp_path / "resumed.jsonl") == want_trace[4:]  # steps 4..7: the same prompts, the same tokens
    assert metrics(out) == want


@pytest.mark.slow
def test_async_killed_with_rollouts_in_flight_resumes_on_the_same_samples(tmp_path):
    """rollout.mode=async, max_staleness=2, one process: SIGKILL as step 7's rollout begins (it
    needs version 5: during step 5, after the step-4 checkpoint, before the step-6 one). That
    checkpoint holds the rollouts generated ahead with versions older than its own (steps 4 and 5,
    versions 2 and 3): the resumed run trains on them and goes on with the uninterrupted run's
    samples (every step's prompts once, the same tokens) and metrics. The control: the same
    checkpoint resumed with max_staleness=1 drops them (counted), so step 4 trains on its prompts
    generated again by version 4: other tokens, other metrics."""
    ok(launch(tmp_path / "one", *RUN, *ASYNC, trace=tmp_path / "one.jsonl"))
    want, want_trace = metrics(tmp_path / "one"), trained(tmp_path / "one.jsonl")
    prompts = [set(t["prompts"]) for t in want_trace]
    assert len(prompts) == 8 and len(set().union(*prompts)) == sum(map(len, prompts))
    assert [m["rollout_staleness_max"] for m in want] == [0.0, 1.0] + [2.0] * 6
    out = tmp_path / "run"
    killed = launch(out, *RUN, *ASYNC, "checkpoint.every=2", kill="in_rollout:7", trace=tmp_path / "killed.jsonl")
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in complete_checkpoints(out / "checkpoints")][-1] == "step_00000004"
    assert trained(tmp_path / "killed.jsonl")[:4] == want_trace[:4]
    four = out / "checkpoints" / "step_00000004"
    control = launch(tmp_path / "control", *RUN, *ASYNC, "rollout.max_staleness=1", f"resume={four}",
                     kill="after_step:5", trace=tmp_path / "control.jsonl")
    assert control.returncode == -signal.SIGKILL
    (step4,) = trained(tmp_path / "control.jsonl")
    assert step4["prompts"] == want_trace[4]["prompts"] and step4["tokens"] != want_trace[4]["tokens"]
    (got,) = metrics(tmp_path / "control")
    per_step = len(want_trace[4]["prompts"])  # samples (one process: all of them)
    assert got["rollout_stale_dropped"] in (2 * per_step, 3 * per_step)  # 4, 5 (and 6, if generated before the save)
    assert got["loss"] != want[4]["loss"]

    resumed = launch(out, *RUN, *ASYNC, "checkpoint.every=2", "resume=auto", trace=tmp_path / "resumed.jsonl")
    ok(resumed)
    assert trained(tmp_path / "resumed.jsonl") == want_trace[4:]
    assert metrics(out) == want


# ------------------------------------------------- end to end, torchrun 4 ranks
@pytest.fixture(scope="module")
def uninterrupted_four(tmp_path_factory):
    out = tmp_path_factory.mktemp("four") / "run"
    ok(launch(out, *RUN, *FOUR, nproc=4))
    return metrics(out)


@pytest.mark.slow
def test_four_ranks_killed_then_resume_auto_continue_the_run_in_its_folder(uninterrupted_four, tmp_path):
    """torchrun 4 ranks (dp2 x cp2, ep2), no restarts: rank 1 SIGKILLs itself once 4 steps are
    done and the group stops. A new torchrun (a new run id) with `resume=auto` finds that run
    under outputs/ on every rank and finishes it in its folder with the uninterrupted metrics."""
    hook = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault"), str(ROOT)])}

    def torchrun(*args, kill=None):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               str(ROOT / "train.py"), *RUN, *FOUR, "checkpoint.every=2", *args]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**ENV, **hook, **({"RL_TEST_KILL": kill} if kill else {})})

    assert torchrun(kill="after_step:4:1").returncode != 0
    (run,) = (tmp_path / "outputs").iterdir()
    resumed = torchrun("resume=auto")
    ok(resumed)
    assert list((tmp_path / "outputs").iterdir()) == [run]
    assert "resumed from " + str(run / "checkpoints" / "step_00000004") in (run / "train.log").read_text()
    assert metrics(run) == uninterrupted_four


@pytest.mark.slow
def test_four_ranks_killed_after_four_of_eight_steps_restart_resume_and_finish_alike(uninterrupted_four, tmp_path):
    """MAX_RESTARTS=1 launch/local.sh 4 (dp2 x cp2, ep2; resume left at `never`): rank 1
    SIGKILLs itself once 4 steps are done; torchrun restarts the group, which finds its run
    folder again (torchrun's run id), resumes from the step-4 checkpoint and finishes with
    the uninterrupted metrics."""
    runs = tmp_path / "outputs"
    proc = launch(runs / "${run_id:}", *RUN, *FOUR, "checkpoint.every=2", nproc=4, kill="after_step:4:1", restarts=1)
    ok(proc)
    (out,) = list(runs.iterdir())  # both attempts wrote one run folder
    log = proc.stdout + proc.stderr
    assert "torchrun restart 1" in log and "resumed from " + str(out / "checkpoints" / "step_00000004") in log
    assert metrics(out) == uninterrupted_four


@pytest.mark.slow
@pytest.mark.parametrize("mode, kill", [(OFF, "in_rollout:6:1"), (ASYNC, "in_rollout:7:1")], ids=["one_step_off", "async"])
def test_four_ranks_killed_with_a_rollout_in_flight_restart_on_the_same_samples(mode, kill, tmp_path):
    """4 ranks (dp2 x cp2, ep2), MAX_RESTARTS=1: rank 1 SIGKILLs itself as a rollout begins in the
    background after the step-4 checkpoint (one_step_off: step 6's, during step 5's training;
    async at max_staleness=2: step 7's, which needs version 5); torchrun restarts the group from
    the step-4 checkpoint, whose buffered rollouts every rank gets back: each rank trains on the
    samples (prompts and tokens) of the uninterrupted run, no step's prompts skipped or repeated,
    and the metrics are the uninterrupted run's."""
    ok(launch(tmp_path / "one", *RUN, *FOUR, *mode, nproc=4, trace=tmp_path / "one.jsonl"))
    want, want_trace = metrics(tmp_path / "one"), trained(tmp_path / "one.jsonl")
    runs = tmp_path / "outputs"
    proc = launch(runs / "${run_id:}", *RUN, *FOUR, *mode, "checkpoint.every=2", nproc=4, kill=kill,
                  restarts=1, trace=tmp_path / "two.jsonl")
    ok(proc)
    (out,) = list(runs.iterdir())
    assert "resumed from " + str(out / "checkpoints" / "step_00000004") in proc.stdout + proc.stderr
    got = trained(tmp_path / "two.jsonl")
    for rank in range(4):
        mine = [{k: v for k, v in t.items() if k != "attempt"} for t in want_trace if t["rank"] == rank]
        first = [t for t in got if t["rank"] == rank and t["attempt"] == 0]
        again = [t for t in got if t["rank"] == rank and t["attempt"] == 1]
        assert len(mine) == 8 and len(first) >= 5, rank
        assert [{k: v for k, v in t.items() if k != "attempt"} for t in first[:4] + again] == mine, rank
    assert metrics(out) == want


# ------------------------------------------------ resharding, export, restart from it
@pytest.mark.slow
def test_saved_at_world_4_loads_at_world_2_and_1_and_exports_the_policy(tmp_path):
    """dp2 x cp2, ep2 with 2 experts: each EP rank's one expert is FSDP-sharded over two ranks,
    one of which holds nothing (the empty-chunk case); weights and AdamW moments are compared."""
    small = ["task.prompts_per_step=4", "task.samples_per_prompt=4", "+model.overrides.num_experts=2"]
    saved = run_distributed(save_after_one_step, 4, str(tmp_path / "ck"), "parallel=cp2_ep2", *small)[0]
    for name, full in saved["rollout"].items():  # the checkpoint's view of the experts is the layout's
        assert torch.equal(saved["state"]["weights.model." + name], full), name
    path = tmp_path / "ck" / "step_00000001"
    two = run_distributed(load_and_report, 2, str(path), "parallel=ep2", *small)[0]
    one = load_and_report(0, 1, str(path), *small)
    for got in (two, one):
        assert got["step"] == 1 and got["state"].keys() == saved["state"].keys()
        for key, value in saved["state"].items():
            assert torch.equal(got["state"][key], value), key
    assert any(v.abs().max() > 0 for k, v in saved["state"].items() if k.endswith("experts.down_proj.exp_avg"))

    out = tmp_path / "hf"
    export_main([str(path), str(out)])  # python -m rl.trainer.export CKPT OUT
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    exported = AutoModelForCausalLM.from_pretrained(out)
    policy = build_model("qwen3_moe", attn_implementation="sdpa", **config(*small).model.overrides)
    policy.load_state_dict({k: v for k, v in saved["rollout"].items()})
    ids = torch.randint(0, policy.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, policy(ids).logits)

    run = tmp_path / "from_export"
    ok(launch(run, "model=pretrained", "model.name=qwen3_moe", "model.dtype=float32", f"model.pretrained_path={out}",
              "trainer.max_steps=1", "trainer.plot=false", "trainer.progress=false"))
    assert len(metrics(run)) == 1
