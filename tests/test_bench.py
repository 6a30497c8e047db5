"""A bench's last stdout line is its JSON object even when a process it started logs after it.

The probe is a bench in miniature: it starts a worker that prints to stdout once the bench
has emitted (as vLLM's engine processes do when they shut down), registers an exit log of
its own, then `emit`s. With `bench/common.py json_stdout()` called first, stdout holds the
JSON line alone; the control runs the same probe without it, and the line is not last.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
# the worker logs once the bench has exited (its parent changes): after the JSON line whatever the load
WORKER = "import os, time\\nparent = os.getppid()\\nwhile os.getppid() == parent:\\n    time.sleep(0.01)\\n" \\
    "print('worker: shutting down', flush=True)"
import atexit, pathlib, subprocess, sys
import common
common.RESULTS = pathlib.Path(sys.argv[2])
if sys.argv[1] == "json_stdout":
    common.json_stdout()
subprocess.Popen([sys.executable, "-c", WORKER])
atexit.register(print, "bench: exit log")
common.emit("probe", {"figure": 1.5})
"""


def probe(mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # the worker holds the pipe: run() returns once it has printed and exited too
    return subprocess.run([sys.executable, "-c", PROBE, mode, str(tmp_path)], cwd=ROOT / "bench", capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "bench")})


def test_the_json_line_is_last_on_stdout_although_a_worker_logs_after_it(tmp_path):
    done = probe("json_stdout", tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[-1])["figure"] == 1.5, done.stdout
    assert "worker: shutting down" in done.stderr and "bench: exit log" in done.stderr
    assert json.loads((tmp_path / "probe.json").read_text())["summary"] == json.loads(lines[-1])


def test_control_without_json_stdout_the_workers_log_comes_last(tmp_path):
    done = probe("plain", tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "worker: shutting down" in lines and "bench: exit log" in lines
    assert json.loads(lines[0])["figure"] == 1.5 and not lines[-1].startswith("{"), done.stdout


ROOFLINE_KEYS = ("gemm_fp32_gflops_per_s", "gemm_bf16_gflops_per_s", "bandwidth_gb_per_s", "train_gflops_per_s",
                 "train_fraction_fp32_peak", "prefill_ms", "prefill_fraction_fp32_peak", "prefill_fraction_bandwidth",
                 "decode8_ms", "decode8_fraction_bandwidth", "decode8_fraction_fp32_peak", "decode32_ms",
                 "decode32_fraction_bandwidth", "decode32_fraction_fp32_peak", "decode_floor_ms")


@pytest.mark.slow
def test_bench_speed_reports_every_phase_against_the_roofline():
    """`bench/speed.py --tiny`: the default arm on the tiny model, then the roofline measured in the
    same run; its JSON line carries the machine's peaks and each phase's fraction of them."""
    done = subprocess.run([sys.executable, "bench/speed.py", "--tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    line = json.loads(done.stdout.splitlines()[-1])
    missing = [k for k in ROOFLINE_KEYS if k not in line]
    assert not missing, (missing, line)
    assert all(line[k] > 0 for k in ROOFLINE_KEYS), line
    # the peaks bound the phases they rate (a fraction is its phase's rate over the peak)
    assert line["train_gflops_per_s"] == pytest.approx(line["train_fraction_fp32_peak"] * line["gemm_fp32_gflops_per_s"],
                                                       rel=0.05, abs=0.01)
    assert line["default_train_s"] > 0
