"""launch/gpu_check.sh, rehearsed on CPU: its JSON and its two files, a failed or hung section
recorded while the next one runs, and the whole check with torch's 2.13-only collectives removed
(as on the GPU image's torch 2.11) inside its CPU budget (twice the GPU machine's: CPU_SLOWDOWN)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 360  # the GPU machine's budget for the whole check (issue 42.7)
CPU_BUDGET_S = 2 * BUDGET_S  # the CPU rehearsal's: 20 RL steps and two resumed runs on a shared 2-core CPU


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "launch/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_a_failed_section_is_recorded_the_next_runs_and_the_exit_code_is_1(gpu_check, monkeypatch, tmp_path, capsys):
    def broken(check):
        raise RuntimeError("varlen kernel exploded")

    monkeypatch.setattr(gpu_check, "section_train", broken)
    monkeypatch.setattr(gpu_check.Check, "worker", lambda self, name: {"ok": True, "figure": 1e-7})
    rc = gpu_check.main(["--device", "cpu", "--sections", "train,speed", "--work", str(tmp_path / "w"),
                         "--out", str(tmp_path / "out")])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and report["ok"] is False and report["failed"] == ["train"]
    assert "varlen kernel exploded" in report["train"]["error"]
    assert "varlen kernel exploded" in (tmp_path / "w" / "train.error").read_text()  # the traceback, in the tarball
    assert report["speed"]["ok"] is True and report["speed"]["figure"] == 1e-7
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json", "gpu_check_logs.tar.gz"]
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == report


def test_out_of_time_sections_are_failures_not_passes(gpu_check, tmp_path, capsys):
    rc = gpu_check.main(["--device", "cpu", "--sections", "env", "--budget", "0", "--work", str(tmp_path / "w"),
                         "--out", str(tmp_path / "out")])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and report["failed"] == ["env"] and "out of time" in report["env"]["error"]


def test_without_out_or_OUT_it_refuses(gpu_check, monkeypatch, tmp_path):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--sections", "env", "--work", str(tmp_path)])


def test_a_subprocess_failure_names_the_exit_code_and_the_log(gpu_check, tmp_path):
    check = gpu_check.Check("cpu", tmp_path, deadline=float("inf"))
    with pytest.raises(gpu_check.SectionFailed, match="exit 3"):
        check.run("x", [sys.executable, "-c", "print('last words'); raise SystemExit(3)"], limit=30)
    assert "last words" in (tmp_path / "x.log").read_text()


def test_a_timeout_kills_the_whole_process_tree(gpu_check, tmp_path):
    check = gpu_check.Check("cpu", tmp_path, deadline=float("inf"))
    pid_file = tmp_path / "grandchild.pid"
    spawn = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(gpu_check.SectionFailed, match="timeout"):
        check.run("slow", [sys.executable, "-c", spawn], limit=3)
    stat = Path(f"/proc/{pid_file.read_text()}/stat")

    def alive() -> bool:
        try:
            return stat.read_text().split(")")[-1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_a_resumed_run_must_repeat_the_first_runs_steps(gpu_check):
    first = [{"reward_mean": 0.1 * i, "loss": 1.0 + i, "grad_norm": 2.0} for i in range(4)]
    assert gpu_check.compare_resume(first, first[2:], 2, 1e-6)["ok"] is True
    other = [{**r, "loss": r["loss"] * (1 + 1e-3)} for r in first[2:]]  # the control: another step 2
    got = gpu_check.compare_resume(first, other, 2, 1e-6)
    assert got["ok"] is False and got["resume_rel"]["loss"] == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="resumed one 1"):
        gpu_check.compare_resume(first, first[3:], 2, 1e-6)


def gpu_check_sections() -> tuple[str, ...]:
    return ("env", "kernels", "train", "learn", "speed")


def test_the_sections_and_their_limits_fit_the_budget(gpu_check):
    assert gpu_check.SECTIONS == gpu_check_sections() and set(gpu_check.LIMIT_S) == set(gpu_check.SECTIONS)
    assert gpu_check.BUDGET_S <= BUDGET_S - 30  # the wheels' install and the tarball on top
    assert gpu_check.BUDGET_S * gpu_check.CPU_SLOWDOWN <= CPU_BUDGET_S - 30


def test_the_learn_section_needs_the_reward_to_rise_by_its_bound(gpu_check):
    assert gpu_check.reward_rise([0.0] * 5 + [0.5] * 10 + [0.4] * 5) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="4 steps logged"):
        gpu_check.reward_rise([0.1] * 4)
    full, tiny = gpu_check.learn_overrides("cuda", "full"), gpu_check.learn_overrides("cpu", "tiny")
    assert "model.param_dtype=bfloat16" in full and "trainer.max_steps=20" in full and "task=target_token" in full
    assert not any(o.startswith("task.prompts_per_step") for o in full)  # the run's batch on the GPU
    assert "task.prompts_per_step=4" in tiny and "trainer.device=cpu" in tiny


def test_nondeterministic_ops_are_read_from_the_log_once_each(gpu_check):
    line = ("UserWarning: index_add_cuda_ does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True, warn_only=True)'")
    assert gpu_check.nondeterministic_ops(f"step 0\n{line}\n{line}\nstep 1") == [line]
    assert gpu_check.nondeterministic_ops("step 0\nstep 1") == []


def test_dropping_the_2_13_names_removes_reset_iter_state_too(gpu_check, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    for name in gpu_check.TORCH_2_13_ONLY:
        monkeypatch.setattr(dist, name, getattr(dist, name))  # put back after the test
    monkeypatch.setattr(FSDPModule, "reset_iter_state", FSDPModule.reset_iter_state)
    gpu_check.drop_torch_2_13_names()
    assert not hasattr(FSDPModule, "reset_iter_state") and not hasattr(dist, "all_gather_single")


@pytest.mark.slow
def test_the_cpu_rehearsal_with_torch_2_11_names_writes_two_files_within_the_budget(tmp_path):
    """The script as the GPU machine runs it (bash, --out), on CPU with torch's 2.13-only collectives
    deleted in every process: every section runs its CPU path and passes; what needs CUDA says so."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    start = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "launch/gpu_check.sh"), "--out", str(out), "--device", "cpu",
                           "--drop-torch-2-13-names"], capture_output=True, text=True, timeout=CPU_BUDGET_S + 60,
                          env={**env, "PYTHON": sys.executable})
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds <= CPU_BUDGET_S, seconds
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check_logs.tar.gz"]  # the device brings back at most 8
    report = json.loads((out / "gpu_check.json").read_text())
    assert report == json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["failed"] == [] and report["torch_2_13_names_dropped"] is True
    assert report["size"] == "tiny" and set(report["not_checked"]) >= {"nccl_cp_ep", "vllm", "flash_attn",
                                                                        "sharded_replica", "lora_gpu"}
    assert [k for k in report if k in ("env", "kernels", "train", "learn", "speed")] == list(gpu_check_sections())

    env_ = report["env"]
    assert env_["torch_2_13_collectives"] is False  # the control: the names were really gone
    assert env_["gpu"] == "skipped: no CUDA" and env_["modules"]["hydra"] is not None
    assert env_["grouped_mm"]["present"] is False or env_["grouped_mm"]["ok"] is True
    head = env_["fp32_head"]
    assert head["path"] == "fp32 operands by vocabulary block" and head["rel_vs_fp64"] <= head["bound"]
    assert head["bf16_rounded_rel"] > 100 * head["bound"]  # the control: what the bf16 head gave

    kernels = report["kernels"]
    assert kernels["cuda"].startswith("skipped: no CUDA") and kernels["dtype"] == "float32"
    for layout in ("pack", "shared", "cp"):
        assert kernels["attention"][layout]["rel"] <= kernels["bound"], layout
    assert kernels["attention"]["pack"]["control_rel"] > kernels["bound"]
    moved = kernels["segments_on_the_layouts_device"]  # the CP segments of a layout off the host: no mixed op
    assert moved["ok"] and moved["layout_device"] == "meta"
    for model in ("dense", "moe"):
        m = kernels["model"][model]
        assert m["max_nats"] <= m["bound_max_nats"] < m["control_max_nats"] and m["mean_nats"] <= m["bound_mean_nats"]
        assert m["grad_rel"] <= m["bound_grad_rel"] and m["noise_max_nats"] > 0  # a measured floor, not an assumed one
    moe = kernels["model"]["moe"]  # the project's MoEBlocks, through grouped mm where torch has it
    assert moe["moe_blocks"] == 2 and (moe["grouped_mm_calls"] > 0) == hasattr(__import__("torch"), "_grouped_mm")

    train = report["train"]  # one-rank FSDP2 (gloo here) through the compat fallbacks, saved and resumed
    assert train["steps"] == 4 and train["backend"] == "gloo" and train["cuda"].startswith("skipped: no CUDA")
    assert max(train["resume_rel"].values()) <= train["resume_tolerance"]
    assert train["nondeterministic_ops"] == [] and train["resume_tolerance"] == 1e-6  # deterministic algorithms on

    learn = report["learn"]  # the tiny dense model learns target_token in 20 bf16 steps
    assert learn["steps"] == 20 and learn["reward_rise"] >= learn["bound"] == 0.3
    assert learn["compute_dtype"] == "bfloat16"

    speed = report["speed"]
    assert speed["tokens_per_s"] > 0 and speed["host_syncs_per_step"] >= 0
    assert speed["mfu"] == "skipped: no CUDA" and speed["peak_memory_gib"] == "skipped: no CUDA"
    assert speed["generation"]["tokens"] == speed["generation"]["expected_tokens"] == 8 * 16
    assert speed["generation"]["tokens_per_s"] > 0 and speed["generation"]["peak_memory_gib"] == "skipped: no CUDA"
    sync = speed["weight_sync"]  # fp32 masters; a tied head is sent as its own entry too
    assert sync["seconds"] > 0 and sync["bytes"] >= 4 * speed["params"]

    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
    assert {"gpu_check/env.log", "gpu_check/kernels.log", "gpu_check/train.log", "gpu_check/speed.log",
            "gpu_check/learn.log", "gpu_check/learn/metrics.jsonl",
            "gpu_check/train_first/metrics.jsonl", "gpu_check/train_resumed/metrics.jsonl"} <= set(names)
    assert not any("/checkpoints/" in n for n in names)  # weights stay behind


def test_the_kernels_section_takes_the_varlen_kernel_branch_on_every_layout(gpu_check, flash_on_cpu):
    """The CUDA branch of the kernels section (a varlen kernel with flash-attn's contract), with the
    reference stand-in as the kernel: the pack, the shared-prompt and the CP segments each reach it
    and stay within the fp32 bound of the masked truth; the withheld-boundary control breaks it."""
    import torch

    got = gpu_check._attention_parity(torch.device("cpu"), torch.float32)
    bound = gpu_check.KERNEL_BOUND[torch.float32]
    assert len(flash_on_cpu) == 5  # the pack, its control, the shared prompts, each of the 2 CP ranks
    for layout in ("pack", "shared", "cp"):
        assert got[layout]["rel"] <= bound, (layout, got[layout])
    assert got["pack"]["control_rel"] > bound
