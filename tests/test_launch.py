"""Launch scripts print the exact command they run; the GPU check and the memory plan work on CPU.

- launch/slurm.sbatch --dry-run: the `srun ... torchrun ...` line from fake SLURM variables
  (2 nodes of 8 GPUs), with and without `scontrol` on PATH; outside SLURM, from the stand-ins
  it names on stderr; the socket interfaces passed to the ranks when set. (Its SIGUSR1 before
  the time limit, run end to end with a stand-in srun: tests/test_stop.py.)
- launch/local.sh --dry-run / DRY_RUN=1: the torchrun line, `--max-restarts` included.
- the launch scripts are valid bash (launch/gpu_check.sh's rehearsal: tests/test_gpu_check.py).
- bench/memory_plan.py counts the published parameters from meta models and says what fits.
- every repository path or module that a tracked file names exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_2x8 = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT)}


def _bash(script: str, *args: str, env: dict | None = None, path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    """Run a launch script with only `env` set (no inherited SLURM_*, MAX_RESTARTS, ...)."""
    return subprocess.run(["bash", str(ROOT / script), *args], capture_output=True, text=True, timeout=30,
                          env={"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **(env or {})})


def _dry_run(script: str, *args: str, **kw) -> list[str]:
    done = _bash(script, *args, **kw)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    return shlex.split(lines[0])


def _srun_line(head: str = "gpu07", restarts: str = "3", nproc: str = "8", port: str = "29500", nodes: str = "2",
               job: str = "4242", shutdown: str = "270", env: tuple[str, ...] = ()) -> list[str]:
    return ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", *(["env", *env] if env else []),
            ".venv/bin/torchrun", "--nnodes", nodes, "--nproc-per-node", nproc,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}", "--rdzv-id", job,
            "--max-restarts", restarts, "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "--shutdown-timeout", shutdown, "train.py", "trainer.max_steps=3"]


# ------------------------------------------------------------------- SLURM
def test_slurm_dry_run_prints_srun_torchrun_with_rendezvous_on_the_first_node():
    assert _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=SLURM_2x8) == _srun_line()


def test_slurm_dry_run_reads_overrides_from_the_environment():
    env = {**SLURM_2x8, "MAX_RESTARTS": "1", "NPROC": "4", "RDZV_PORT": "29601", "SHUTDOWN_TIMEOUT": "500"}
    del env["SLURM_JOB_NUM_NODES"]  # older SLURM: only SLURM_NNODES
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=env)
    assert line == _srun_line(restarts="1", nproc="4", port="29601", shutdown="500")


def test_slurm_passes_the_socket_interfaces_to_the_ranks_when_set():
    env = {**SLURM_2x8, "NCCL_SOCKET_IFNAME": "ib0,ib1", "GLOO_SOCKET_IFNAME": "eth0"}
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=env)
    assert line == _srun_line(env=("NCCL_SOCKET_IFNAME=ib0,ib1", "GLOO_SOCKET_IFNAME=eth0"))
    only_gloo = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3",
                         env={**SLURM_2x8, "GLOO_SOCKET_IFNAME": "lo"})
    assert only_gloo == _srun_line(env=("GLOO_SOCKET_IFNAME=lo",))


def test_slurm_generator_nodes_give_the_last_whole_nodes_to_dedicated_rollout_ranks():
    """GENERATOR_NODES=G: parallel.rollout_ranks = G x NPROC (torchrun's last ranks are the last
    nodes' blocks, so generators and trainers get disjoint nodes), named on stderr. The control:
    without it the line has no rollout_ranks; a count that leaves no trainer, is not a number, or
    comes with parallel.rollout_ranks already given is refused naming GENERATOR_NODES."""
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env={**SLURM_2x8, "GENERATOR_NODES": "1"})
    assert line == [*_srun_line(), "parallel.rollout_ranks=8"]
    four = {**SLURM_2x8, "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]", "NPROC": "4",
            "GENERATOR_NODES": "3"}
    done = _bash("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=four)
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == [*_srun_line(nproc="4", nodes="4"), "parallel.rollout_ranks=12"]
    assert "the last 3 of 4 nodes generate (parallel.rollout_ranks=12), the first 1 train" in done.stderr
    assert "rollout_ranks" not in " ".join(_dry_run("launch/slurm.sbatch", "--dry-run", env=SLURM_2x8))
    for bad, message in [("2", r"GENERATOR_NODES=2: expected an integer in \[1, 2\)"),
                         ("0", r"GENERATOR_NODES=0: expected"), ("x", r"GENERATOR_NODES=x: expected")]:
        done = _bash("launch/slurm.sbatch", "--dry-run", env={**SLURM_2x8, "GENERATOR_NODES": bad})
        assert done.returncode == 2 and re.search(message, done.stderr), done.stderr
    done = _bash("launch/slurm.sbatch", "--dry-run", "parallel.rollout_ranks=4", env={**SLURM_2x8, "GENERATOR_NODES": "1"})
    assert done.returncode == 2 and "GENERATOR_NODES=1 sets parallel.rollout_ranks=8" in done.stderr, done.stderr


def test_slurm_time_limit_signal_is_usr1_to_the_batch_shell_and_the_script_execs_srun():
    """SLURM's warning goes to the script alone (B:), which by then is srun (exec): srun turns a
    SIGTERM into SIGKILL for its tasks, a SIGUSR1 it passes on (torchrun: --signals-to-handle)."""
    text = (ROOT / "launch/slurm.sbatch").read_text()
    assert re.search(r"(?m)^#SBATCH --signal=B:USR1@300$", text) and re.search(r'(?m)^exec "\$\{cmd\[@\]\}"$', text)


def test_slurm_dry_run_keeps_an_override_with_spaces_as_one_argument():
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "task.options={a: 1}", env=SLURM_2x8)
    assert line[-2:] == ["train.py", "task.options={a: 1}"]


def test_slurm_first_node_comes_from_scontrol_when_it_is_on_path(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && printf "head-a\\nhead-b\\n"\n')
    fake.chmod(0o755)
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=SLURM_2x8,
                    path=f"{tmp_path}:/usr/bin:/bin")
    assert line == _srun_line(head="head-a")


@pytest.mark.parametrize("nodelist,first", [("gpu[07-08]", "gpu07"), ("gpu[11,13-14],cpu01", "gpu11"),
                                            ("node7", "node7"), ("node7,node9", "node7"), ("a-b[3-4]", "a-b3")])
def test_slurm_first_node_without_scontrol(nodelist, first):
    line = _dry_run("launch/slurm.sbatch", "--dry-run", env={**SLURM_2x8, "SLURM_JOB_NODELIST": nodelist})
    assert line[line.index("--rdzv-endpoint") + 1] == f"{first}:29500"


@pytest.mark.parametrize("missing", ["SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_GPUS_ON_NODE"])
def test_slurm_without_its_variables_fails_naming_the_variable(missing):
    env = {k: v for k, v in SLURM_2x8.items() if k != missing}
    done = _bash("launch/slurm.sbatch", "trainer.max_steps=3", env=env)  # a run, not a dry run: no srun reached
    assert done.returncode != 0 and missing in done.stderr and not done.stdout


def test_slurm_dry_run_outside_slurm_stands_in_for_what_sbatch_sets_and_says_so():
    """No SLURM variable at all (a laptop, CI): 1 node, localhost, 8 GPUs, job id dry-run, each
    named on stderr; what is set is used and not named."""
    done = _bash("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3")
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == _srun_line(head="localhost", nodes="1", job="dry-run")
    assert done.stderr.strip() == ("slurm.sbatch --dry-run: not set, standing in: SLURM_JOB_NUM_NODES=1 "
                                   "SLURM_JOB_NODELIST=localhost SLURM_GPUS_ON_NODE=8 SLURM_JOB_ID=dry-run")
    done = _bash("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3",
                 env={"SLURM_NNODES": "4", "NPROC": "2", "SLURM_JOB_NODELIST": "gpu[3-6]"})
    assert shlex.split(done.stdout) == _srun_line(head="gpu3", nodes="4", nproc="2", job="dry-run")
    assert done.stderr.strip() == "slurm.sbatch --dry-run: not set, standing in: SLURM_JOB_ID=dry-run"


def test_the_documented_slurm_dry_run_is_what_the_script_prints():
    """docs/configuration.md shows `launch/slurm.sbatch --dry-run trainer.max_steps=3` outside SLURM
    with its stderr and stdout lines: the script prints exactly those."""
    doc = (ROOT / "docs/configuration.md").read_text()
    block = doc[doc.index("$ launch/slurm.sbatch --dry-run trainer.max_steps=3"):].split("```")[0].splitlines()
    done = _bash("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3")
    assert block[1:3] == [done.stderr.strip(), done.stdout.strip()]


# ------------------------------------------------------------------- local
def test_local_dry_run_prints_torchrun_with_max_restarts_0_by_default():
    line = _dry_run("launch/local.sh", "4", "trainer.max_steps=3", env={"DRY_RUN": "1"})
    assert line == [".venv/bin/torchrun", "--standalone", "--nproc-per-node", "4", "--max-restarts", "0",
                    "train.py", "trainer.max_steps=3"]


def test_local_dry_run_flag_and_max_restarts_and_default_nproc():
    assert _dry_run("launch/local.sh", "--dry-run", env={"MAX_RESTARTS": "1"}) == [
        ".venv/bin/torchrun", "--standalone", "--nproc-per-node", "8", "--max-restarts", "1", "train.py"]


def test_local_rejects_an_override_in_place_of_nproc():
    done = _bash("launch/local.sh", "--dry-run", "trainer.max_steps=3")
    assert done.returncode == 2 and "NPROC=trainer.max_steps=3" in done.stderr


# ------------------------------------------------------ the files they name
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
KNOWN = {*TRACKED, *(str(p) for f in TRACKED for p in Path(f).parents)}  # the tracked files and their folders
# a path under a top-level folder (packing/collate.py, bench/results), not part of a longer path or name
TOP = sorted({re.escape(f.split("/")[0]) for f in TRACKED if "/" in f})
NAMED_PATH = re.compile(rf"(?<![\w/.])(?:{'|'.join(TOP)})/[\w./-]*\w")
# a dotted module reference (packing.experience.routing_shape); `model.` also starts config keys (model.name)
NAMED_MODULE = re.compile(r"(?<![\w/.])(?:packing|rl|scripts)(?:\.\w+)+")


def _defines(module: str, name: str) -> bool:
    return re.search(rf"(?m)^\s*(?:(?:async )?def |class )?{name}\b|import [^\n]*\b{name}\b",
                     (ROOT / module).read_text()) is not None


def _missing_module(ref: str) -> bool:
    """`ref` names no module of the repo, or its first name after the module is not defined there."""
    path, *names = ref.split(".")
    for name in names:
        if path.endswith(".py"):
            return not _defines(path, name)
        if f"{path}/{name}.py" in KNOWN:
            path = f"{path}/{name}.py"
        elif f"{path}/{name}" in KNOWN:
            path = f"{path}/{name}"
        else:  # a name of the package itself
            return not (f"{path}/__init__.py" in KNOWN and _defines(f"{path}/__init__.py", name))
    return False


def stale_references(path: Path) -> list[str]:
    """The repository paths and dotted module references named in the file `path` that name
    nothing tracked."""
    text = path.read_text()
    return sorted({p for p in NAMED_PATH.findall(text) if p not in KNOWN}
                  | {m for m in NAMED_MODULE.findall(text) if _missing_module(m)})


def test_every_tracked_file_names_only_paths_and_modules_that_exist():
    """Source, tests, docs, README, conf, launch, Makefile, CI, benches and their results."""
    stale = {}
    for name in TRACKED:
        try:
            found = stale_references(ROOT / name)
        except (UnicodeDecodeError, FileNotFoundError):  # a binary file; one deleted but not yet staged
            continue
        if found:
            stale[name] = found
    assert stale == {}


def test_the_stale_reference_check_reports_a_missing_path_and_module(tmp_path):
    """Control: the check that passes above reports what names nothing (and only that)."""
    gone = "test_" + "grad_sync"  # built here, so this file names no missing path itself
    note = tmp_path / "note.md"
    note.write_text(f"the rank body of tests/{gone}.py (tests/dist_train_worker.py); outputs/tests/x.py;\n"
                    f"packing.{gone}.run beside packing.experience.routing_shape and rl.rollout.sync.{gone};\n"
                    "python tests/parity_check.py, tests/test_fsdp.py's bound, conf/model/*.yaml, rl.config")
    assert stale_references(note) == [f"packing.{gone}.run", f"rl.rollout.sync.{gone}", f"tests/{gone}.py"]


# --------------------------------------------------------------- GPU check
def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_launch_scripts_are_valid_bash():
    for script in ("launch/gpu_check.sh", "launch/local.sh", "launch/slurm.sbatch"):
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


# ------------------------------------------------------------- memory plan
def test_memory_plan_counts_published_parameters_and_says_what_fits(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    common = importlib.import_module("common")  # bench/common.py: its result writer
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    plan = _load("bench/memory_plan.py", "memory_plan")
    summary = plan.main([])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == summary and (tmp_path / "memory_plan.json").exists()
    assert summary["params"] == {"SmolLM2-135M": 134_515_008, "Qwen2.5-7B": 7_615_616_512, "Qwen3-8B": 8_190_735_360,
                                 "Qwen3-30B-A3B": 30_532_122_624, "Qwen3-235B-A22B": 235_093_634_560}
    # rollout.replica=auto on 8 x 80 GB: the dense models keep a copy, the 30B MoE's (114 GiB in fp32) cannot
    assert summary["rollout_chosen"] == {"Qwen2.5-7B": "keep", "Qwen3-8B": "keep", "Qwen3-30B-A3B": "sharded"}
    assert "Qwen3-8B@8:dp8xcp1xep1,T8k" in summary["fits"]
    assert "Qwen3-235B-A22B@8:dp8xcp1xep8,T8k" in summary["does_not_fit"]  # 16 B x 235e9 / 8 alone is 440 GiB
    # the sharded state is params / world whatever ep is; ep only shrinks the gathered layer
    rows = {plan.layout_id(r): r for r in json.loads((tmp_path / "memory_plan.json").read_text())["details"]["rows"]}
    ep1, ep8 = rows["Qwen3-30B-A3B@8:dp8xcp1xep1,T8k"], rows["Qwen3-30B-A3B@8:dp8xcp1xep8,T8k"]
    assert ep1["adam"] == ep8["adam"] == pytest.approx(8 * 30_532_122_624 / 8 / 2**30)
    assert ep8["transient"] < ep1["transient"]
    # placements: a trainer holds 16 B x P / T of state and no copy; a generator the bf16 copy and the KV cache of
    # N / R colocated GPUs, no state. The control: R = 2 instead of 4 (T = 6) shrinks the trainer's state to 16 P / 6
    # and doubles the generator's KV cache
    placements = {(r["model"], r["rollout_ranks"]): r
                  for r in json.loads((tmp_path / "memory_plan.json").read_text())["details"]["placements"]}
    p8 = 8_190_735_360
    r4, r2 = placements[("Qwen3-8B", 4)], placements[("Qwen3-8B", 2)]
    assert r4["trainer_state"] == pytest.approx(16 * p8 / 4 / 2**30) and r2["trainer_state"] == pytest.approx(16 * p8 / 6 / 2**30)
    assert r4["generator_copy"] == r2["generator_copy"] == pytest.approx(2 * p8 / 2**30)
    assert r2["generator_kv"] == pytest.approx(2 * r4["generator_kv"]) and r2["generator"] > r4["generator"]
    assert r4["generator"] < r4["trainer"] < r4["colocated"] + r4["trainer_state"]


@pytest.mark.parametrize("args,experiment", [("", "smollm2_arithmetic"),
                                             ("+experiment=smollm2_arithmetic_retry seed=1", "smollm2_arithmetic_retry")])
def test_make_train_runs_one_experiment_the_args_may_name(args, experiment):
    """`make train ARGS="+experiment=..."` (README) replaces the headline experiment: Hydra
    refuses two `+experiment=` (control: the old recipe's two fail to compose)."""
    from testing.inprocess import compose

    dry = subprocess.run(["make", "-n", "train", f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True, check=True)
    words = shlex.split([line for line in dry.stdout.splitlines() if "train.py" in line][-1])
    overrides = words[words.index("train.py") + 1:]
    assert [o for o in overrides if o.startswith("+experiment=")] == [f"+experiment={experiment}"]
    assert compose(*overrides, check=False).task.name.value == experiment.removeprefix("smollm2_")
    if args:
        with pytest.raises(Exception, match="Multiple values for experiment"):
            compose("+experiment=smollm2_arithmetic", *overrides, check=False)
