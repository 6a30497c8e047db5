"""End to end: `train.py` runs, writes metrics, learns, is deterministic and layout-invariant."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_commands import commands
from test_tasks import tokenizer, tokenizer_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow  # each test launches train.py (~5 s of imports per process)

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"tokens_per_s", "rollout_tokens_per_s", "train_tokens_per_s", "rollout_s", "step_s", "weight_sync_s"}


def train(tmp_path: Path, name: str, *overrides: str, nproc: int = 1) -> list[dict]:
    out = tmp_path / name
    args = [f"hydra.run.dir={out}", "trainer.progress=false", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return tmp, train(tmp, "default", "trainer.max_steps=16", "trainer.loggers=[jsonl,tensorboard,wandb,mlflow]")


def test_run_writes_metrics_and_a_plot(default_run):
    tmp, metrics = default_run
    assert [m["step"] for m in metrics] == list(range(16))
    required = {"step", "reward_mean", "loss", "tokens_per_s", "padding_efficiency", "policy_loss", "entropy",
                "clip_ratio", "tokens", "expert_load_max_over_mean"}
    assert required <= metrics[0].keys()
    assert (tmp / "default" / "curves.png").stat().st_size > 0
    # the sinks train.py wires from trainer.loggers, each with every step and the run's config
    import mlflow

    from tests.test_metrics import tensorboard_steps, wandb_history

    ids = json.loads((tmp / "default" / "loggers.json").read_text())
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # reading the run's file store, as the run wrote it
    client = mlflow.tracking.MlflowClient((tmp / "default" / "mlruns").resolve().as_uri())
    assert client.get_run(ids["mlflow"]).data.params["trainer.max_steps"] == "16"
    assert len(client.get_metric_history(ids["mlflow"], "reward_mean")) == 16
    assert [s for _, s, _ in wandb_history(tmp / "default")] == list(range(16))
    assert len(tensorboard_steps(tmp / "default" / "tensorboard")) == 16
    # trainer.log_samples (4 by default): each step's first 4 episodes, as ids (target_token has no tokenizer)
    rows = [json.loads(line) for line in (tmp / "default" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, k) for s in range(16) for k in range(4)]
    assert all(r["prompt_ids"] and len(r["turns"][0]["reply_ids"]) == r["response_length"] for r in rows)
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "samples")] == \
        [f"samples/step_{s:06d}.jsonl" for s in range(16)]
    assert len(list((tmp / "default" / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))) == 16


def test_reward_rises_and_does_not_without_learning(default_run, tmp_path):
    _, metrics = default_run
    frozen = train(tmp_path, "lr0", "trainer.max_steps=16", "trainer.lr=0.0")
    first = metrics[0]["reward_mean"]
    learned = sum(m["reward_mean"] for m in metrics[-3:]) / 3
    control = sum(m["reward_mean"] for m in frozen[-3:]) / 3
    assert learned > first + 0.2, (first, learned)
    assert control < first + 0.05, (first, control)  # lr=0: the same rollouts, no learning


def test_same_seed_gives_identical_metrics(default_run, tmp_path):
    _, metrics = default_run
    again = train(tmp_path, "again", "trainer.max_steps=3", "trainer.log_samples=0")
    assert untimed(again) == untimed(metrics[:3])  # logging samples changes nothing in the run
    assert not (tmp_path / "again" / "samples.jsonl").exists()  # log_samples=0: no file
    other = train(tmp_path, "other_seed", "trainer.max_steps=1", "seed=1")
    assert untimed(other)[0] != untimed(metrics)[0]


def test_packed_and_padded_agree_on_the_first_step(default_run, tmp_path):
    _, packed = default_run
    padded = train(tmp_path, "padded", "trainer.max_steps=1", "batch=padded")[0]
    for key in ("loss", "entropy", "grad_norm", "reward_mean"):
        assert abs(padded[key] - packed[0][key]) <= 1e-5 * max(1.0, abs(packed[0][key])), key
    assert packed[0]["padding_efficiency"] == 1.0 > padded["padding_efficiency"]


def test_unknown_or_mistyped_key_fails_at_start_up(tmp_path):
    for bad, needle in [("trainer.max_stepz=3", "max_stepz"), ("trainer.lr=fast", "lr")]:
        proc = subprocess.run([sys.executable, "train.py", bad, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and needle in proc.stderr, proc.stderr[-2000:]


PPO_FIGURES = ("reward_mean", "tokens", "loss", "entropy", "grad_norm", "value_loss", "critic_grad_norm", "kl")


def layout_gaps(a: list[dict], b: list[dict], keys=PPO_FIGURES, rel: float = 1e-5) -> list[tuple]:
    """`(step, key, a, b)` wherever two runs' figures differ by more than `rel` (relative to
    max(1, |a|)) or a figure is missing or not finite."""
    if len(a) != len(b):
        return [("steps", len(a), len(b))]
    return [(m["step"], k, m.get(k), n.get(k)) for m, n in zip(a, b) for k in keys
            if not (k in m and k in n and math.isfinite(m[k]) and abs(m[k] - n[k]) <= rel * max(1.0, abs(m[k])))]


def test_ppo_dense_padded_run_matches_the_packed_run(tmp_path):
    """PPO (critic, GAE, KL penalty) on the dense model: the padded run gives the packed run's
    figures, step for step, and the critic and the policy move. Control: the same check catches
    a value loss 1% off (the layouts agree to ~2e-7 on every kernel set)."""
    ppo = ("algo=ppo", "model=dense_tiny", "trainer.max_steps=3", "trainer.plot=false", "checkpoint.final=false")
    padded = train(tmp_path, "ppo_padded", *ppo, "batch=padded")
    packed = train(tmp_path, "ppo_packed", *ppo, "batch=packed")
    assert [m["step"] for m in padded] == [0, 1, 2]
    assert layout_gaps(packed, padded) == []
    assert padded[0]["padding_efficiency"] < 1.0 == packed[0]["padding_efficiency"]  # the layouts differ
    values = [m["value_loss"] for m in padded]
    assert values[0] > values[1] > values[2] > 0, values  # the critic fits the returns
    assert padded[0]["kl"] == 0.0 < padded[2]["kl"]  # the policy starts at the reference, then leaves it
    off = [dict(m, value_loss=m["value_loss"] * 1.01) for m in padded]
    assert [(step, key) for step, key, *_ in layout_gaps(packed, off)] == [(0, "value_loss"), (1, "value_loss"),
                                                                           (2, "value_loss")]


def test_layout_does_not_change_the_experiment(default_run, tmp_path):
    """torchrun 4 ranks (dp2 x cp2, ep2, FSDP2) and one process: same prompts, samples and updates."""
    _, one = default_run
    four = train(tmp_path, "cp2_ep2", "trainer.max_steps=3", "parallel=cp2_ep2", nproc=4)
    for a, b in zip(one[:3], four):
        assert a["reward_mean"] == b["reward_mean"] and a["tokens"] == b["tokens"]
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a[key], b[key])
    # the training forwards dispatch the same tokens to the same experts (routing replay)
    assert [m["expert_tokens"] for m in one[:3]] == [m["expert_tokens"] for m in four]
    assert [m["expert_load_max_over_mean"] for m in one[:3]] == [m["expert_load_max_over_mean"] for m in four]


def test_minibatches_and_epochs_update_off_policy_and_still_learn(tmp_path):
    """algo.mini_batches=4, algo.epochs=2: eight updates per rollout, so the ratio moves off 1."""
    metrics = train(tmp_path, "mb4_ep2", "trainer.max_steps=20", "algo.mini_batches=4", "algo.epochs=2")
    assert metrics[0]["optimizer_steps"] == 8
    assert max(m["clip_ratio"] for m in metrics) > 0 and max(m["approx_kl"] for m in metrics) > 0
    first, last = metrics[0]["reward_mean"], sum(m["reward_mean"] for m in metrics[-3:]) / 3
    assert last > first + 0.2, (first, last)
    cispo = train(tmp_path, "cispo", "trainer.max_steps=3", "algo.mini_batches=4", "algo.epochs=2",
                  "algo.policy_loss=cispo")
    assert untimed(cispo) != untimed(metrics[:3])  # the control: today the loss choice changes the run


def test_two_runs_started_together_get_their_own_folders_metrics_and_log(tmp_path):
    """Two runs launched at the same moment (run folders used to be outputs/<timestamp>, so
    both wrote one metrics.jsonl): each gets outputs/<timestamp>_<random suffix>, a valid
    metrics.jsonl of its own and a train.log holding the run's per-step lines and the commit of
    the code that made it."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "train.py"), "trainer.max_steps=2", "task.prompts_per_step=4",
           "task.samples_per_prompt=4", "trainer.progress=false", "trainer.plot=false", "checkpoint.final=false"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
    runs = sorted((tmp_path / "outputs").iterdir())
    assert len(runs) == 2, runs
    for run in runs:
        assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", run.name), run.name
        assert [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1]
        log = (run / "train.log").read_text()
        assert f"run folder {run};" in log and "step 0 reward" in log and "step 1 reward" in log, log
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        assert re.search(rf"code at commit {head.stdout.strip()}\+?\n", log) if head.returncode == 0 else \
            "code at commit unknown (not a git checkout)" in log, log


def test_run_ids_taken_in_the_same_second_differ(monkeypatch):
    from rl.trainer.run_folder import run_id

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    ids = [run_id() for _ in range(20)]
    assert len(set(ids)) == 20 and len({i.rsplit("_", 1)[0] for i in ids}) <= 2  # same timestamp, new suffix


def test_a_config_error_names_the_key_before_the_heavy_imports_and_leaves_no_folder(tmp_path):
    """`trainer.max_step=1` (misspelt) and `trainer.lr=-1` stop before transformers or any
    model code is imported (python -X importtime lists every import) and before Hydra makes a
    run folder. Control: a valid command imports transformers and makes its folder."""
    for bad, says in [("trainer.max_step=1", "did you mean trainer.max_steps"),
                      ("trainer.lr=-1", "trainer.lr=-1.0: expected >= 0")]:
        proc = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), bad], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1 and "config error: " in proc.stderr and says in proc.stderr, proc.stderr[-2000:]
        assert "transformers" not in proc.stderr and not (tmp_path / "outputs").exists()
    ok = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), "trainer.max_steps=1",
                         "task.prompts_per_step=2", "task.samples_per_prompt=2", "trainer.progress=false",
                         "trainer.plot=false", "checkpoint.final=false"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ok.returncode == 0 and "transformers" in ok.stderr and len(list((tmp_path / "outputs").iterdir())) == 1
    assert "Failed to load" not in ok.stderr and "Enum subclass" not in ok.stderr  # no library noise at start-up


def test_checking_a_pretrained_checkpoint_prints_no_library_noise(tmp_path):
    """The command-line check reads a pretrained checkpoint's family (`model.pretrained_path`),
    which imports transformers and with it torchao before Hydra starts: its kernel and enum
    messages stay silenced there too (they were the first lines of `make train`). The config error
    after the family check (a missing `task.prompts_path`) ends the run there; -X importtime shows
    that torchao was imported, so its messages would have been printed."""
    from model.models import build_model

    build_model("llama", seed=0).save_pretrained(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), "model=pretrained",
                           f"model.pretrained_path={tmp_path / 'ckpt'}", f"task.prompts_path={tmp_path / 'none.jsonl'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "task.prompts_path=" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"\| +torchao$", proc.stderr, re.M), "torchao was not imported: the check says nothing"
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("fails, says", [
    ("raise RuntimeError('the grader is down')", "RuntimeError: the grader is down"),
    ("import sys\n        sys.exit(0)", "UserExit: reward function flaky:reward raised SystemExit(0)")])
def test_a_run_that_fails_writes_its_error_to_train_log_and_marks_its_folder(tmp_path, fails, says):
    """A reward that raises (or calls `sys.exit()`: before, the run ended with neither log line nor
    FAILED) during the first rollout, with task.on_error=raise (the default, skip, counts it and goes
    on: tests/test_user_code.py): the message, naming the function, and traceback reach train.log
    (not only the terminal), the folder holds FAILED, and no empty metrics.jsonl."""
    (tmp_path / "flaky.py").write_text("calls = []\n\ndef reward(prompt_ids, response_ids):\n    calls.append(1)\n"
                                       f"    if len(calls) > 1:\n        {fails}\n    return 0.0\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [5, 6, 7]}\n')
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", "task=file",
                           "task.prompts_path=prompts.jsonl", "task.reward_fn=flaky:reward", "task.on_error=raise",
                           "trainer.progress=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr[-2000:]
    log = (out / "train.log").read_text()
    assert "the run failed" in log and "Traceback" in log and says in log, log
    assert says in (out / "FAILED").read_text()
    assert not (out / "metrics.jsonl").exists()


def test_a_sweep_names_its_run_folders_without_commas_or_equals(tmp_path):
    """`-m` (checked at start-up at the first value of each swept key): one folder per run,
    named by its overrides as key-value with '-' and '__' (no '=' or ',' to quote in a shell)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", "seed=0,1",
           "trainer.max_steps=1", "task.prompts_per_step=2", "task.samples_per_prompt=2", "trainer.progress=false",
           "trainer.plot=false", "checkpoint.final=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    common = "__task.prompts_per_step-2__task.samples_per_prompt-2__trainer.max_steps-1__trainer.plot-False__trainer.progress-False"
    assert names == [f"0_checkpoint.final-False__seed-0{common}", f"1_checkpoint.final-False__seed-1{common}"], names
    bad = subprocess.run(cmd[:3] + ["seed=0,1", "trainer.max_step=1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "did you mean trainer.max_steps" in bad.stderr  # a sweep is checked too


def test_the_readmes_own_data_command_runs_as_written_on_a_cpu(tmp_path, tokenizer):
    """README.md's `task=math` command, its DIR a (tiny) checkpoint folder holding its tokenizer and
    its gsm8k.jsonl a two-line file, plus a run folder and one step: it runs with the model's folder as
    its tokenizer (no task.tokenizer_path) at model=pretrained's learning rate, without the lr warning."""
    import shlex

    from model.models import build_model

    folder = tmp_path / "DIR"
    build_model("llama", seed=0, vocab_size=len(tokenizer), tie_word_embeddings=True).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"prompt": "What is 3 plus 4?", "answer": "7"}\n{"prompt": "What is 5 plus 2?", "answer": 7}\n')
    readme = (ROOT / "README.md").read_text()
    command = next(c for c in commands(readme) if "task=math" in c)
    args = [a.replace("=DIR", f"={folder}").replace("=gsm8k.jsonl", f"={data}") for a in shlex.split(command)[2:]]
    assert "task.tokenizer_path" not in command and "task.prompts_per_step=4" in args, command  # sized for a CPU
    metrics = train(tmp_path, "readme", *args, "trainer.max_steps=1", "trainer.plot=false", "checkpoint.final=false")
    assert len(metrics) == 1 and metrics[0]["lr"] == 1e-5 and metrics[0]["tokens"] > 0
    assert "trainer.lr=" not in (tmp_path / "readme" / "train.log").read_text()  # no lr warning
