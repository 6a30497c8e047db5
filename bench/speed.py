"""Is the headline step as fast as it was? (`make bench-speed`; the speed guard, not a test)

The headline job as `make train` runs it (+experiment=smollm2_arithmetic: SmolLM2-135M-Instruct,
4 prompts x 8 samples x 16 new tokens, GRPO, fp32, the default threads), without the held-out
evaluations and the checkpoint, in arms run side by side:

    default   train.py as a user runs it
    system    RL_ALLOCATOR=system: glibc's own allocator behaviour, nothing handed back to the OS
              (the control that prices runtime/allocator.py's `release_memory`)
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

The roofline, measured in the same run (bench/roofline.py): this process's fp32 and bf16 GEMM peak
at the model's shapes and its memory bandwidth, and each phase's achieved fraction of them:

    train_gflops_per_s, train_fraction_fp32_peak      the default arm's training FLOPs (forward and
        backward of the body on the shared-prompt pack, the head on action tokens; each step's from
        its metrics) over its train_s, and that over the fp32 GEMM peak
    prefill_*, decode{8,32}_*                          the transformers engine on the job's model, in
        this process: a prefill of 4 distinct prompts (32 rows), a decode step at 8 and 32 rows
        (the job's prompt length, 16 new tokens): ms, FLOP/s over the peak, bytes/s over the
        bandwidth; decode_floor_ms: the weights' bytes over the bandwidth

Then the default arm against the last recorded runs, each named by its commit and date:
bench/results/speed.json's default arm (as it was before this run replaces it) and
bench/results/peer.json's project arm (the run the README's figures come from). A ratio above 1
is a slower step now. Numbers move with the machine's load: compare runs made idle.

    .venv/bin/python bench/speed.py              # 2 rounds x 5 steps, both arms (~5 min idle)
    .venv/bin/python bench/speed.py --quick      # 1 round x 4 steps, default arm only (~1 min)
    .venv/bin/python bench/speed.py --tiny       # --quick on the tiny dense model (the JSON keys' check)

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
from roofline import decode_cost, engine_phases, machine, matmul_weights, prefill_cost, step_flops  # noqa: E402

ARMS = {"default": {}, "system": {"RL_ALLOCATOR": "system"},  # arm -> environment (and experiment, EXPERIMENTS)
        "fixed128k": {"RL_ALLOCATOR": "system", "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
        "lora": {}}
EXPERIMENTS = {"lora": "smollm2_arithmetic_lora"}
PHASES = ("step_s", "rollout_s", "train_s")
FIGURES = (*PHASES, "max_rss_gb")
EXPERIMENT = "smollm2_arithmetic"
MODEL_DIR = ROOT / ".cache/models/SmolLM2-135M-Instruct"
TINY = ["model=dense_tiny", "task=target_token", "task.prompts_per_step=4", "task.samples_per_prompt=8",
        "task.max_new_tokens=16"]  # --tiny: the job's shape on the tiny model
DECODE_ROWS = (8, 32)


def run_arm(arm: str, steps: int, work: Path, tiny: bool = False) -> list[dict]:
    """One train.py process of the headline job; its per-step phases (first step dropped), peak RSS
    and what the roofline counts (tokens, response_length, action_tokens, samples, group)."""
    run_dir = work / f"{arm}-{time.monotonic_ns()}"
    job = TINY if tiny else [f"+experiment={EXPERIMENTS.get(arm, EXPERIMENT)}"]
    cmd = [sys.executable, "train.py", *job, f"trainer.max_steps={steps}",
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
    from omegaconf import OmegaConf

    task = OmegaConf.load(run_dir / ".hydra" / "config.yaml").task
    return [{"step": r["step"], "step_s": r["step_s"], "rollout_s": r["rollout_s"],
             "train_s": r["step_s"] - r["rollout_s"], "max_rss_gb": rss,
             "tokens": r["tokens"], "response_length": r["response_length"], "action_tokens": r["action_tokens"],
             "samples": task.prompts_per_step * task.samples_per_prompt, "group": task.samples_per_prompt}
            for r in rows if "step_s" in r][1:]


def sig(x: float) -> float:
    """`x` to 3 significant digits (a tiny model's fractions are far below 0.001)."""
    return float(f"{x:.3g}")


def roofline(model, per_step: list[dict], quick: bool) -> dict:
    """The machine's roofline (bench/roofline.py) and each phase's fraction of it: training from
    the default arm's steps, prefill and decode from the engine on `model` in this process."""
    config, width = model.config, next(model.parameters()).element_size()
    prompt = round(statistics.median(r["tokens"] / r["samples"] - r["response_length"] for r in per_step))
    new = 16
    peak = machine(config, [*DECODE_ROWS, 4 * prompt, round(statistics.median(r["tokens"] for r in per_step))],
                   quick=quick)
    f32, bw = peak["gemm_fp32_flops_per_s"], peak["bandwidth_bytes_per_s"]
    out = {"gemm_fp32_gflops_per_s": sig(f32 / 1e9), "gemm_bf16_gflops_per_s": sig(peak["gemm_bf16_flops_per_s"] / 1e9),
           "bandwidth_gb_per_s": sig(bw / 1e9), "roofline_threads": peak["threads"]}
    flops = [step_flops(config, r) / r["train_s"] for r in per_step]
    out |= {"train_gflops_per_s": sig(statistics.median(flops) / 1e9),
            "train_fraction_fp32_peak": sig(statistics.median(flops) / f32)}
    repeats = 1 if quick else 3
    for rows in DECODE_ROWS:
        prefill_s, step_s = engine_phases(model, rows, prompt, new, repeats)
        flops_d, bytes_d = decode_cost(config, rows, prompt + (new + 1) / 2, width)
        out |= {f"decode{rows}_ms": sig(step_s * 1e3),
                f"decode{rows}_fraction_bandwidth": sig(bytes_d / step_s / bw),
                f"decode{rows}_fraction_fp32_peak": sig(flops_d / step_s / f32)}
        if rows == max(DECODE_ROWS):  # the job's prefill: its distinct prompts, copied to every row
            flops_p, bytes_p = prefill_cost(config, [prompt] * max(1, rows // 8), width)
            out |= {"prefill_ms": sig(prefill_s * 1e3), "prefill_fraction_fp32_peak": sig(flops_p / prefill_s / f32),
                    "prefill_fraction_bandwidth": sig(bytes_p / prefill_s / bw)}
    out["decode_floor_ms"] = sig(sum(matmul_weights(config)) * width / bw * 1e3)  # the weights once
    return out


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
    p.add_argument("--tiny", action="store_true", help="--quick on the tiny dense model (model=dense_tiny)")
    args = p.parse_args(argv)
    args.quick = args.quick or args.tiny
    if args.quick:
        args.rounds, args.steps, args.arms = 1, 3 if args.tiny else 4, ["default"]
    if args.steps < 2:
        raise SystemExit("speed: --steps must be >= 2 (a process's first step is dropped)")
    if not args.tiny and not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"speed: {MODEL_DIR} is missing: run `make model` first")
    before = recorded()
    per_arm: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_speed_") as work:
        for r in range(args.rounds):
            for arm in args.arms:
                got = run_arm(arm, args.steps, Path(work), args.tiny)
                per_arm[arm] += got
                load.append(os.getloadavg()[0])
                print(f"round {r} {arm}: " + " ".join(f"{k} {medians(got)[k]:.2f}" for k in PHASES), flush=True)
    summary: dict = {"experiment": "tiny" if args.tiny else EXPERIMENT, "rounds": args.rounds, "steps_per_process": args.steps,
                     "loadavg_1m_max": round(max(load), 2)}
    for arm, rows in per_arm.items():
        summary |= {f"{arm}_{k}": v for k, v in medians(rows).items()}
    for a, b in (("default", "system"), ("lora", "default")):  # a ratio above 1: a slower step / more memory
        if a in per_arm and b in per_arm:
            summary |= {f"{a}_vs_{b}_{k}": round(summary[f"{a}_{k}"] / summary[f"{b}_{k}"], 3) for k in FIGURES}
    from model.models import build_model

    model = build_model("qwen3", vocab_size=64) if args.tiny else build_model(None, pretrained_path=str(MODEL_DIR))
    summary |= roofline(model, per_arm["default"] if "default" in per_arm else next(iter(per_arm.values())), args.quick)
    load.append(os.getloadavg()[0])
    summary["loadavg_1m_max"] = round(max(load), 2)
    print("roofline: " + " ".join(f"{k} {v}" for k, v in summary.items() if k.startswith(("gemm", "bandwidth", "train_g",
          "train_f", "decode", "prefill"))), flush=True)
    now = provenance()
    if args.tiny:
        before = {}
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
