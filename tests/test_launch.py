"""Launch scripts print the exact command they run; the GPU check and the memory plan work on CPU.

- launch/slurm.sbatch --dry-run: the `srun ... torchrun ...` line from fake SLURM variables
  (2 nodes of 8 GPUs), with and without `scontrol` on PATH.
- launch/local.sh --dry-run / DRY_RUN=1: the torchrun line, `--max-restarts` included.
- launch/gpu_check.sh is valid bash; launch/gpu_check.py assembles its JSON line, records a
  failing section and runs its parity / CP sections on CPU (gloo) as a rehearsal.
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
import time
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


def _srun_line(head: str = "gpu07", restarts: str = "3", nproc: str = "8", port: str = "29500") -> list[str]:
    return ["srun", "--ntasks-per-node=1", ".venv/bin/torchrun", "--nnodes", "2", "--nproc-per-node", nproc,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}", "--rdzv-id", "4242",
            "--max-restarts", restarts, "train.py", "trainer.max_steps=3"]


# ------------------------------------------------------------------- SLURM
def test_slurm_dry_run_prints_srun_torchrun_with_rendezvous_on_the_first_node():
    assert _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=SLURM_2x8) == _srun_line()


def test_slurm_dry_run_reads_overrides_from_the_environment():
    env = {**SLURM_2x8, "MAX_RESTARTS": "1", "NPROC": "4", "RDZV_PORT": "29601"}
    del env["SLURM_JOB_NUM_NODES"]  # older SLURM: only SLURM_NNODES
    line = _dry_run("launch/slurm.sbatch", "--dry-run", "trainer.max_steps=3", env=env)
    assert line == _srun_line(restarts="1", nproc="4", port="29601")


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
    done = _bash("launch/slurm.sbatch", "--dry-run", env=env)
    assert done.returncode != 0 and missing in done.stderr and not done.stdout


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
    note.write_text(f"the rank body of tests/{gone}.py (scripts/dist_train_worker.py); outputs/tests/x.py;\n"
                    f"packing.{gone}.run beside packing.experience.routing_shape and rl.rollout.sync.{gone};\n"
                    "python scripts/parity_check.py, tests/test_fsdp.py's bound, conf/model/*.yaml, rl.config")
    assert stale_references(note) == [f"packing.{gone}.run", f"rl.rollout.sync.{gone}", f"tests/{gone}.py"]


# --------------------------------------------------------------- GPU check
def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return _load("launch/gpu_check.py", "gpu_check")


def test_gpu_check_script_is_valid_bash():
    for script in ("launch/gpu_check.sh", "launch/local.sh", "launch/slurm.sbatch"):
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


def test_gpu_check_records_a_failed_section_runs_the_rest_and_exits_1(gpu_check, monkeypatch, tmp_path, capsys):
    def broken(check):
        raise RuntimeError("flash-attn kernel exploded")

    monkeypatch.setattr(gpu_check, "section_parity", broken)
    monkeypatch.setattr(gpu_check, "section_cp", lambda check: {"ok": True, "dense_float32": {"packed": 1e-7}})
    rc = gpu_check.main(["--device", "cpu", "--sections", "parity,cp", "--work", str(tmp_path)])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and report["ok"] is False and report["failed"] == ["parity"]
    assert "flash-attn kernel exploded" in report["parity"]["error"]
    assert report["cp"]["ok"] is True and report["cp"]["dense_float32"] == {"packed": 1e-7}
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report


def test_gpu_check_skips_sections_without_enough_gpus_and_out_of_time(gpu_check, tmp_path):
    assert gpu_check.needs_gpus("cp", 1, "cuda") == "needs 2 GPUs, found 1"
    assert gpu_check.needs_gpus("train", 1, "cuda") is None
    report = gpu_check.assemble({"parity": {"ok": True}, "cp": {"skipped": "needs 2 GPUs, found 1"}}, {}, 1.0)
    assert report["ok"] is True and report["skipped"] == ["cp"] and report["failed"] == []


def test_gpu_check_subprocess_failure_names_the_exit_code_and_log(gpu_check, tmp_path):
    check = gpu_check.Check("cpu", tmp_path, deadline=float("inf"), ngpu=0)
    with pytest.raises(gpu_check.SectionFailed, match="exit 3"):
        check.run("x", [sys.executable, "-c", "print('last words'); raise SystemExit(3)"], limit=30)
    assert "last words" in (tmp_path / "x.log").read_text()


def test_gpu_check_timeout_kills_the_whole_process_tree(gpu_check, tmp_path):
    check = gpu_check.Check("cpu", tmp_path, deadline=float("inf"), ngpu=0)
    pid_file = tmp_path / "grandchild.pid"
    spawn = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(gpu_check.SectionFailed, match="timeout"):
        check.run("slow", [sys.executable, "-c", spawn], limit=3)
    stat = Path(f"/proc/{pid_file.read_text()}/stat")  # like torchrun's ranks: gone, or a zombie awaiting reaping

    def alive() -> bool:
        try:
            return stat.read_text().split(")")[-1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously; a loaded machine takes a moment
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_gpu_check_compares_layouts_and_summarizes_training(gpu_check):
    one = [{"reward_mean": 0.1 * i, "loss": 1.0, "grad_norm": 2.0} for i in range(3)]
    close = [{**r, "loss": r["loss"] + 5e-5} for r in one]
    assert gpu_check.compare_layouts(one, close)["ok"] is True
    far = [{**r, "grad_norm": 2.1} for r in one]
    assert gpu_check.compare_layouts(one, far)["ok"] is False
    rows = [{"reward_mean": 0.02 + 0.04 * i} for i in range(20)]
    assert gpu_check.summarize_train(rows, 20) == {"ok": True, "steps": 20, "reward_first": 0.02,
                                                    "reward_last": pytest.approx(0.78)}
    assert gpu_check.summarize_train(rows[:5], 20)["ok"] is False


def test_gpu_check_async_section_wants_one_step_off_samples_at_staleness_1(gpu_check):
    off = [{"reward_mean": 0.1 * i, "loss": 1.0, "grad_norm": 2.0, "rollout_staleness_max": min(i, 1),
            "rollout_overlap": 0.9} for i in range(4)]
    k2 = [{**r, "rollout_staleness_max": min(i, 2)} for i, r in enumerate(off)]
    got = gpu_check.summarize_async({"one_step_off": off, "async_k1": off, "async_k2": k2})
    assert got["ok"] is True and got["k2_staleness"] == [0.0, 1.0, 2.0, 2.0]
    assert got["overlap"]["async_k1"] == pytest.approx(0.9)
    other = [{**r, "loss": 1.1} for r in off]  # the control: other samples at max_staleness=1
    assert gpu_check.summarize_async({"one_step_off": off, "async_k1": other, "async_k2": k2})["ok"] is False
    assert gpu_check.summarize_async({"one_step_off": off, "async_k1": off, "async_k2": off})["ok"] is False


def _rehearse(tmp_path, sections: str) -> dict:
    """launch/gpu_check.py's `sections` on the CPU: its report (the last stdout line), checked ok."""
    done = subprocess.run([sys.executable, str(ROOT / "launch/gpu_check.py"), "--device", "cpu",
                           "--sections", sections, "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and report["ok"] is True, json.dumps(report, indent=1)
    return report


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu_async(tmp_path):
    report = _rehearse(tmp_path, "async")
    assert report["async"]["k1_vs_one_step_off"]["loss"] <= report["async"]["k1_vs_one_step_off"]["tolerance"]


@pytest.mark.slow
def test_gpu_check_rehearsal_on_cpu_parity_and_cp_over_gloo(tmp_path):
    report = _rehearse(tmp_path, "parity,shared,cp")
    for kind in ("dense", "moe"):
        assert report["parity"][kind]["logp_rel"] <= report["parity"]["tolerance"] < report["parity"][kind]["control_rel"]
    assert report["cp"]["backend"] == "gloo" and report["cp"]["dense_float32"]["packed"] <= 1e-5
    shared = report["shared"]  # dense and MoE through the shared forward, within the limit, every count equal
    assert shared["ok"] is True and shared["qwen3"]["rows"][1] < shared["qwen3"]["rows"][0]
    assert shared["qwen3_moe"]["load_equal"] and shared["qwen3_moe"]["aux_eps"] <= 16


# ------------------------------------------------------------- memory plan
def test_memory_plan_counts_published_parameters_and_says_what_fits(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    common = importlib.import_module("common")  # bench/common.py: its result writer
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    plan = _load("bench/memory_plan.py", "memory_plan")
    summary = plan.main([])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == summary and (tmp_path / "memory_plan.json").exists()
    assert summary["params"] == {"Qwen2.5-7B": 7_615_616_512, "Qwen3-8B": 8_190_735_360,
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


@pytest.mark.parametrize("args,experiment", [("", "smollm2_arithmetic"),
                                             ("+experiment=smollm2_arithmetic_retry seed=1", "smollm2_arithmetic_retry")])
def test_make_train_runs_one_experiment_the_args_may_name(args, experiment):
    """`make train ARGS="+experiment=..."` (README) replaces the headline experiment: Hydra
    refuses two `+experiment=` (control: the old recipe's two fail to compose)."""
    from inprocess import compose

    dry = subprocess.run(["make", "-n", "train", f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True, check=True)
    words = shlex.split([line for line in dry.stdout.splitlines() if "train.py" in line][-1])
    overrides = words[words.index("train.py") + 1:]
    assert [o for o in overrides if o.startswith("+experiment=")] == [f"+experiment={experiment}"]
    assert compose(*overrides, check=False).task.name.value == experiment.removeprefix("smollm2_")
    if args:
        with pytest.raises(Exception, match="Multiple values for experiment"):
            compose("+experiment=smollm2_arithmetic", *overrides, check=False)
