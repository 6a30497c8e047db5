"""Shared plumbing of the benches: the repo on sys.path, GRPO-like length mixes and
records, interleaved median timing, and the result writer (bench/results/<name>.json plus
the one JSON line every bench prints last, which names the kernel set and threads; a bench
whose libraries log on exit calls `json_stdout()` first, so that line stays last).

Timings are medians of process CPU time with one thread by default (`--threads`,
`--clock wall`): the 2-core machines this runs on are shared, and with two threads a
busy neighbour turns OpenMP waits into seconds of noise, while one thread's CPU time
stays within a few percent run to run."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

import torch  # noqa: E402

MIXES = ("lognormal", "bimodal", "uniform")


def lengths(mix: str, n: int, *, seed: int = 0, max_len: int = 1024, prompt: tuple[int, int] = (32, 128)) -> list[int]:
    """`n` GRPO-like sample lengths (prompt + response), each in [2, max_len].

    lognormal: responses with a long tail (median max_len/8, sigma 0.9), as sampled answers are.
    bimodal: 75% short answers (median max_len/16), 25% that ran into the length limit.
    uniform: response lengths uniform up to the limit (no tail; the planner's easy case).
    """
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=gen)
    budget = max_len - p
    if mix == "lognormal":
        r = (torch.randn(n, generator=gen) * 0.9 + torch.log(torch.tensor(max_len / 8))).exp()
    elif mix == "bimodal":
        short = (torch.randn(n, generator=gen) * 0.5 + torch.log(torch.tensor(max_len / 16))).exp()
        long = budget * (0.9 + 0.1 * torch.rand(n, generator=gen))
        r = torch.where(torch.rand(n, generator=gen) < 0.75, short, long)
    elif mix == "uniform":
        r = torch.rand(n, generator=gen) * budget
    else:
        raise ValueError(f"lengths: unknown mix {mix!r}; expected one of {MIXES}")
    r = torch.minimum(r.round().long().clamp(min=1), budget)
    return [int(x) for x in (p + r)]


def records(seq_lens: list[int], *, vocab: int, seed: int = 0, prompt: tuple[int, int] = (32, 128)) -> list:
    """GRPO-like `Experience` records: every action field a trainer fills, episode scalars.

    The prompt is `min(uniform(prompt), T - 1)` tokens; `action_mask` covers the response.
    """
    from packing.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(seq_lens):
        p = min(int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=gen)), n - 1)
        mask = torch.arange(n - 1) >= p - 1
        logp = -torch.rand(n - 1, generator=gen)
        out.append(Experience(
            sequences=torch.randint(0, vocab, (n,), generator=gen), action_mask=mask, action_log_probs=logp,
            base_action_log_probs=logp - 0.01, rollout_log_probs=logp + 0.01,
            advantages=torch.randn(n - 1, generator=gen).where(mask, torch.zeros(())),
            rewards=torch.rand((), generator=gen), response_length=mask.sum(), total_length=torch.tensor(n),
            prompt_index=torch.tensor(i // 8),
        ))
    return out


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, dict]:
    """Median seconds of each fn, runs interleaved (a, b, a, b, ...) so a slow spell of a
    shared machine hits every candidate alike; `warmup` untimed rounds first.

    Returns name -> {"wall": median wall s, "cpu": median process CPU s (all threads),
    "wall_runs": [...], "cpu_runs": [...]}. On a machine shared with other jobs the CPU
    time is the steadier measure of the work; on an idle one the two agree.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    runs: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            runs[name]["cpu"].append(time.process_time() - c)
            runs[name]["wall"].append(time.perf_counter() - w)
    return {name: {"wall": statistics.median(r["wall"]), "cpu": statistics.median(r["cpu"]),
                   "wall_runs": [round(x, 4) for x in r["wall"]], "cpu_runs": [round(x, 4) for x in r["cpu"]]}
            for name, r in runs.items()}


def machine() -> dict:
    """What the figures depend on: torch's CPU kernel set, threads, torch version."""
    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpus": os.cpu_count()}


_JSON_OUT = None  # the original stdout once `json_stdout()` has sent fd 1 to stderr


def json_stdout() -> None:
    """Keep stdout for `emit`'s line: from here on, what this process and every process it
    starts write to stdout (vLLM's workers, which log as they exit, after `emit` too) goes
    to stderr, and `emit` prints on the original stdout, so its line is the last there.
    Call it before starting anything that logs."""
    global _JSON_OUT
    sys.stdout.flush()
    _JSON_OUT = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def provenance() -> dict:
    """The commit the figures were measured at (`+` if the work tree's code differed from it;
    bench/results/ does not count) and the UTC date."""
    from rl.trainer.metrics import code_commit

    return {"commit": code_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def emit(name: str, summary: dict, details: dict | None = None, *, clock: str | None = None) -> dict:
    """Write bench/results/<name>.json and print `summary` (+ machine, commit and date) as the last line."""
    line = {**summary, **({"clock": clock} if clock else {}), **machine(), **provenance()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"summary": line, "details": details or {}}, indent=1) + "\n")
    print(json.dumps(line), file=_JSON_OUT or sys.stdout, flush=True)
    return line


def quick_flag(description: str):
    """argparse with `--quick` (fewer repeats / smaller inputs), `--threads` and `--clock`."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller inputs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (default 1: one thread's CPU time is the same on a busy "
                             "machine as on an idle one; the ratios are of work, not of parallelism)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="which median the figures use: process CPU time (default) or wall time "
                             "(meaningful on an idle machine only)")
    return parser


def setup(args) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
