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

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import atexit, pathlib, subprocess, sys
import common
common.RESULTS = pathlib.Path(sys.argv[2])
if sys.argv[1] == "json_stdout":
    common.json_stdout()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5); print('worker: shutting down', flush=True)"])
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
