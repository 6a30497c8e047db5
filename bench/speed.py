"""Is the headline step as fast as it was? (`make bench-speed`; the speed guard, not a test)

The headline job as `make train` runs it (+experiment=smollm2_arithmetic: SmolLM2-135M-Instruct,
4 prompts x 8 samples x 16 new tokens, GRPO, fp32, the default threads), without the held-out
evaluations and the checkpoint, in arms run side by side:

    default   train.py as a user runs it
    system    RL_ALLOCATOR=system: glibc's own allocator behaviour, nothing handed back to the OS
              (the control that prices model/allocator.py's `release_memory`)
    fixed128k glibc's mmap and trim thresholds fixed at 128 KiB (the allocator before issue 39;
              `--arms default system fixed128k`)
    lora      the same job with rank-16 adapters (+experiment=smollm2_arithmetic_lora, docs/lora.md):
              `--arms default lora` writes bench/results/speed-lora.json

The arms are interleaved: `--rounds` rounds, each one process per arm of `--steps` steps, so a
neighbour's load or the machine's clock falls on both. A process's first step is dropped (its first
allocations, warm caches). Figures per arm, medians over the kept steps (seconds):

    step_s      the whole step (rollout, scoring, update, weight sync)
    rollout_s   generation and rewards
    train_s     step_s - rollout_s (collate, scoring, forward/backward, optimizer, sync)
    max_rss_gb  the process's peak resident memory (median over its processes)

Then the default arm against the last recorded runs, each named by its commit and date:
bench/results/speed.json's default arm (as it was before this run replaces it) and
bench/results/peer.json's project arm (the run the README's figures come from). A ratio above 1
is a slower step now. Numbers move with the machine's load: compare runs made idle.

    .venv/bin/python bench/speed.py              # 2 rounds x 5 steps, both arms (~5 min idle)
    .venv/bin/python bench/speed.py --quick      # 1 round x 4 steps, default arm only (~1 min)

Last line: one JSON object (also bench/results/speed.json; not written by --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, emit, provenance  # noqa: E402

ARMS = {"default": {}, "system": {"RL_ALLOCATOR": "system"},  # arm -> environment (and experiment, EXPERIMENTS)
        "fixed128k": {"RL_ALLOCATOR": "system", "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
        "lora": {}}
EXPERIMENTS = {"lora": "smollm2_arithmetic_lora"}
PHASES = ("step_s", "rollout_s", "train_s")
FIGURES = (*PHASES, "max_rss_gb")
EXPERIMENT = "smollm2_arithmetic"
MODEL_DIR = ROOT / ".cache/models/SmolLM2-135M-Instruct"


def run_arm(arm: str, steps: int, work: Path) -> list[dict]:
    """One train.py process of the headline job; its per-step phases (first step dropped) and peak RSS."""
    run_dir = work / f"{arm}-{time.monotonic_ns()}"
    cmd = [sys.executable, "train.py", f"+experiment={EXPERIMENTS.get(arm, EXPERIMENT)}", f"trainer.max_steps={steps}",
           "eval.every=0", "checkpoint.every=0", "checkpoint.final=false", "trainer.plot=false", "trainer.progress=false",
           f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_ALLOCATOR", "MALLOC_"))} | ARMS[arm]
    log = work / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak RSS
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"speed: arm {arm} failed ({code}):\n{log.read_text()[-4000:]}")
    rss = usage.ru_maxrss / 2**20  # KiB -> GiB
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{"step": r["step"], "step_s": r["step_s"], "rollout_s": r["rollout_s"],
             "train_s": r["step_s"] - r["rollout_s"], "max_rss_gb": rss} for r in rows if "step_s" in r][1:]


def medians(per_step: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in per_step), 3) for k in FIGURES}


def recorded() -> dict:
    """The last recorded figures of the headline step: {source: {phases..., commit, date}}."""
    out = {}
    for name, prefix in (("speed", "default_"), ("peer", "")):
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            continue
        s = json.loads(path.read_text())["summary"]
        got = {k: s.get(prefix + k) for k in PHASES}
        if got["step_s"] is not None:
            out[name] = got | {"commit": s.get("commit"), "date": s.get("date")}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="steps per process (the first one is dropped)")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["default", "system"])
    p.add_argument("--quick", action="store_true", help="1 round x 4 steps of the default arm; results not written")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.arms = 1, 4, ["default"]
    if args.steps < 2:
        raise SystemExit("speed: --steps must be >= 2 (a process's first step is dropped)")
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"speed: {MODEL_DIR} is missing: run `make model` first")
    before = recorded()
    per_arm: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as work:
        for r in range(args.rounds):
            for arm in args.arms:
                got = run_arm(arm, args.steps, Path(work))
                per_arm[arm] += got
                load.append(os.getloadavg()[0])
                print(f"round {r} {arm}: " + " ".join(f"{k} {medians(got)[k]:.2f}" for k in PHASES), flush=True)
    summary: dict = {"experiment": EXPERIMENT, "rounds": args.rounds, "steps_per_process": args.steps,
                     "loadavg_1m_max": round(max(load), 2)}
    for arm, rows in per_arm.items():
        summary |= {f"{arm}_{k}": v for k, v in medians(rows).items()}
    for a, b in (("default", "system"), ("lora", "default")):  # a ratio above 1: a slower step / more memory
        if a in per_arm and b in per_arm:
            summary |= {f"{a}_vs_{b}_{k}": round(summary[f"{a}_{k}"] / summary[f"{b}_{k}"], 3) for k in FIGURES}
    now = provenance()
    for name, rec in before.items():
        ratios = {k: round(summary[f"default_{k}"] / rec[k], 3) for k in PHASES if rec.get(k)}
        summary |= {f"vs_{name}_{k}": v for k, v in ratios.items()}
        summary[f"vs_{name}_at"] = f"{rec['commit']} {rec['date']}"
        print(f"default arm at {now['commit']} vs {name}.json at {rec['commit']} ({rec['date']}): "
              + " ".join(f"{k} x{v:.2f}" for k, v in ratios.items()), flush=True)
    if args.quick:  # a check, not a record
        print(json.dumps(summary | now), flush=True)
        return summary
    return emit("speed-lora" if "lora" in per_arm else "speed", summary, {"per_step": per_arm})


if __name__ == "__main__":
    main()
