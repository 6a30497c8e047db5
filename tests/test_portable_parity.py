"""Packed = padded on every CPU kernel set and thread count, within the stated fp32 tolerance.

torch fixes its CPU kernel set at start-up, so each kernel set is a fresh interpreter
running tests/parity_check.py (dense and MoE: packed vs padded log-probs, entropy and
grads, and the withheld-boundaries control) under `ATEN_CPU_CAPABILITY`, with 1 then 2
threads (the thread count only splits reductions, so it may change within a process).
The launches run two at a time; each prints one JSON line of figures in eps32 units
relative to the values' magnitude.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.parity_check import CONTROL_MARGIN, PARITY_ULPS

CHECK = Path(__file__).resolve().parent / "parity_check.py"


def kernel_sets() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return ["default"] + [cap for cap, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]


THREADS = (1, 2)
CASES = [(cap, threads) for cap in kernel_sets() for threads in THREADS]


def _launch(cap: str) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
    proc = subprocess.run([sys.executable, str(CHECK), "--threads", ",".join(map(str, THREADS))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ATEN_CPU_CAPABILITY={cap} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def results() -> dict:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(kernel_sets(), pool.map(_launch, kernel_sets())))


@pytest.mark.slow
@pytest.mark.parametrize("cap,threads", CASES, ids=[f"{c}-{t}thr" for c, t in CASES])
def test_packed_matches_padded_on_this_kernel_set(cap, threads):
    out = results()[cap]
    assert out["capability"] == cap.upper() and str(threads) in out["threads"]  # really forced
    for model, figures in out["threads"][str(threads)].items():
        print(f"{cap} x {threads} threads, {model}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()))
        for name in ("log_probs", "entropy", "grads"):
            assert figures[name] <= PARITY_ULPS, f"{cap} x {threads} threads, {model} {name}: {figures[name]:.2f} eps32"
        assert figures["control_log_probs"] >= CONTROL_MARGIN * PARITY_ULPS, f"{model}: the control no longer fails"
