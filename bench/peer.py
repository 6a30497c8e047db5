"""How does this project compare with TRL's GRPOTrainer on the same job? (`make bench-peer`)

The job is `+experiment=smollm2_arithmetic`: SmolLM2-135M-Instruct learns two-digit addition
(task=arithmetic), 4 prompts x 8 samples per step, 16 new tokens, temperature 1.0, lr 1e-5,
GRPO with a token-mean loss, no KL, one update per step, grad clip 1.0, fp32, 2 threads.
The arms run one after the other, never side by side:

1. this project, default engine: `.venv/bin/python train.py +experiment=smollm2_arithmetic
   trainer.max_steps=N eval.every=N ...` (held-out evaluation before step 0 and after step N)
2. this project with `rollout.engine=vllm`, when the vLLM extra is installed in .venv
   (`make install-vllm`) and the config has `rollout.engine`; skipped otherwise
3. TRL 1.16.0's GRPOTrainer in .venv-trl: bench/peer_trl.py (its docstring lists the
   settings), trained on the same prompts in the same order (the project's step seeds)

Both sides evaluate the same `ArithmeticTask.heldout(n)` problems greedily (16 new tokens,
stop at <|im_end|>, reward 1 = correct) before and after training.

Figures of each arm (medians over the steps; evaluation is never inside a step):
    step_s             wall seconds per training step (generation + scoring + update)
    rollout_s          seconds generating (project: its rollout; TRL: its `transformers.generate` span)
    generated_tokens_per_s   response tokens / rollout_s
    train_tokens_per_s       prompt + response tokens / (step_s - rollout_s)
    accuracy_before/after    held-out greedy accuracy
and, last line, one JSON object (also bench/results/peer.json):
    speedup_vs_trl            TRL's step_s / the fastest project engine's step_s (steps/s ratio)
    speedup_vs_trl_hf_engine  the same for the default (transformers) engine
    speedup_vs_trl_vllm_engine  the same for the vLLM engine (when it ran)
    accuracy_before/after     the project (default engine); vllm_accuracy_* likewise
    trl_accuracy_before/after

    .venv/bin/python bench/peer.py --steps 40              # the comparison (`make bench-peer`)
    .venv/bin/python bench/peer.py --steps 2 --eval-prompts 16   # a check of the plumbing

Run it on an idle machine: on 2 shared cores a busy neighbour slows each 2-thread arm by a
different factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, emit  # noqa: E402

MODEL_DIR = ROOT / ".cache/models/SmolLM2-135M-Instruct"
SAMPLES_PER_STEP = 4 * 8  # conf/experiment/smollm2_arithmetic.yaml: prompts_per_step x samples_per_prompt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 40)), help="training steps of every arm")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out problems (eval.num_prompts)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="the project's arms also evaluate every k steps (a curve; default: before and after only)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every arm (OMP_NUM_THREADS)")
    p.add_argument("--engines", default="auto",
                   help="project engines, comma-separated (hf,vllm); auto = hf, plus vllm when installed")
    p.add_argument("--skip-trl", action="store_true", help="run only the project's arms (a plumbing check)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"), help="the TRL venv's interpreter")
    p.add_argument("--out", default=None, help="folder for the arms' runs and logs (default outputs/bench-peer/<time>)")
    return p.parse_args(argv)


def engine_option_exists() -> bool:
    """Whether this checkout's config has `rollout.engine` (the vLLM engine's switch)."""
    try:
        from rl.config import Config
    except Exception:  # noqa: BLE001 - an unimportable config: train.py will say why
        return False
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if "rollout" not in fields:
        return False
    rollout = fields["rollout"].default_factory()  # type: ignore[misc]
    return hasattr(rollout, "engine")


def project_engines(spec: str) -> tuple[list[str], str]:
    """The project engines to run, and why vLLM is or is not among them."""
    has_option = engine_option_exists()
    has_vllm = importlib.util.find_spec("vllm") is not None
    if spec != "auto":
        return [e.strip() for e in spec.split(",") if e.strip()], "as asked (--engines)"
    if has_option and has_vllm:
        return ["hf", "vllm"], "vllm installed"
    why = "vllm is not installed in .venv (make install-vllm)" if not has_vllm else "the config has no rollout.engine"
    return ["hf"], why


def run_logged(cmd: list[str], log_path: Path, env: dict) -> tuple[int, float]:
    """Run `cmd` from the repo root, its output to the console and to `log_path`; (rc, wall s)."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            log.write(line)
            if not line.startswith("WARNING: Location 'file:"):
                sys.stdout.write(line)
        rc = proc.wait()
    return rc, time.perf_counter() - t0


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def summarize(per_step: list[dict], before: float | None, after: float | None, wall_s: float) -> dict:
    """The figures of one arm from its per-step rows (step_s, rollout_s, generated_tokens, tokens)."""
    def rate(num: str, den) -> float | None:
        return _median([r[num] / den(r) for r in per_step if r.get(num) is not None and den(r) and den(r) > 0])

    step_s = _median([r["step_s"] for r in per_step])
    return {
        "steps": len(per_step),
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s if step_s else None,
        "rollout_s": _median([r["rollout_s"] for r in per_step]),
        "train_s": _median([r["step_s"] - r["rollout_s"] for r in per_step]),
        "generated_tokens_per_s": rate("generated_tokens", lambda r: r["rollout_s"]),
        "train_tokens_per_s": rate("tokens", lambda r: r["step_s"] - r["rollout_s"]),
        "generated_tokens_per_step": _median([r.get("generated_tokens") for r in per_step]),
        "accuracy_before": before,
        "accuracy_after": after,
        "wall_s": wall_s,
    }


def run_project(engine: str, args, out: Path, env: dict, engine_option: bool) -> dict:
    run_dir = out / f"project_{engine}"
    cmd = [str(ROOT / ".venv/bin/python"), "train.py", "+experiment=smollm2_arithmetic",
           f"trainer.max_steps={args.steps}", f"eval.every={args.eval_every or max(args.steps, 1)}",  # evaluate before and after only
           f"eval.num_prompts={args.eval_prompts}", "checkpoint.final=false", "trainer.plot=false",
           "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    if engine_option:
        cmd.append(f"rollout.engine={engine}")
    elif engine != "hf":
        raise SystemExit(f"peer: --engines {engine}: this checkout's config has no rollout.engine")
    run_dir.mkdir(parents=True, exist_ok=True)
    rc, wall = run_logged(cmd, out / f"project_{engine}.log", env)
    if rc != 0:
        return {"error": f"train.py exited {rc}; see {out / f'project_{engine}.log'}", "wall_s": wall}
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "step_s" in x]
    evals = [x for x in lines if "eval_accuracy" in x]
    per_step = [{"step": x["step"], "step_s": x["step_s"], "rollout_s": x["rollout_s"],
                 "generated_tokens": x["response_length"] * SAMPLES_PER_STEP, "tokens": x["tokens"],
                 "reward_mean": x.get("reward_mean")} for x in steps]
    before = next((e["eval_accuracy"] for e in evals if e["step"] == 0), None)
    after = next((e["eval_accuracy"] for e in evals if e["step"] == args.steps and "step_s" not in e), None)
    return summarize(per_step, before, after, wall) | {"engine": engine, "run_dir": str(run_dir), "per_step": per_step}


def run_trl(args, out: Path, env: dict) -> dict:
    if not os.access(args.trl_python, os.X_OK):
        raise SystemExit(f"peer: {args.trl_python} not found: build .venv-trl first (make bench-peer does)")
    result_path = out / "trl.json"
    cmd = [args.trl_python, "bench/peer_trl.py", "--model", str(MODEL_DIR), "--steps", str(args.steps),
           "--eval-prompts", str(args.eval_prompts), "--threads", str(args.threads), "--out", str(result_path)]
    rc, wall = run_logged(cmd, out / "trl.log", env)
    if rc != 0:
        raise SystemExit(f"peer: the TRL arm exited {rc}; see {out / 'trl.log'}")
    res = json.loads(result_path.read_text())
    return summarize(res["per_step"], res["accuracy_before"], res["accuracy_after"], wall) | {
        "trl": res["trl"], "config": res["config"], "per_step": res["per_step"]}


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not (MODEL_DIR / "config.json").exists():
        raise SystemExit(f"peer: {MODEL_DIR} is missing: run `make model` first")
    out = Path(args.out) if args.out else ROOT / "outputs/bench-peer" / time.strftime("%Y%m%d-%H%M%S")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    import torch

    torch.set_num_threads(args.threads)  # the machine line of the result reads the arms' thread count

    engines, why = project_engines(args.engines)
    option = engine_option_exists()
    print(f"peer: {args.steps} steps, {args.eval_prompts} held-out problems, {args.threads} threads; "
          f"project engines {engines} ({why}); runs in {out}", flush=True)
    arms: dict[str, dict] = {}
    for engine in engines:
        arms[f"project_{engine}"] = run_project(engine, args, out, env, option)
        if engine == "hf" and "error" in arms["project_hf"]:
            raise SystemExit(f"peer: {arms['project_hf']['error']}")
    if not args.skip_trl:
        arms["trl"] = run_trl(args, out, env)

    trl = arms.get("trl", {})
    ok = {k: v for k, v in arms.items() if k.startswith("project_") and v.get("step_s")}
    fastest = min(ok, key=lambda k: ok[k]["step_s"]) if ok else None
    hf, vllm = arms.get("project_hf", {}), arms.get("project_vllm", {})
    summary = {
        "steps": args.steps,
        "eval_prompts": args.eval_prompts,
        "speedup_vs_trl": ratio(trl.get("step_s"), ok[fastest]["step_s"]) if fastest else None,
        "fastest_engine": fastest.removeprefix("project_") if fastest else None,
        "speedup_vs_trl_hf_engine": ratio(trl.get("step_s"), hf.get("step_s")),
        "speedup_vs_trl_vllm_engine": ratio(trl.get("step_s"), vllm.get("step_s")),
        "step_s": hf.get("step_s"),
        "vllm_step_s": vllm.get("step_s"),
        "trl_step_s": trl.get("step_s"),
        "generated_tokens_per_s": hf.get("generated_tokens_per_s"),
        "vllm_generated_tokens_per_s": vllm.get("generated_tokens_per_s"),
        "trl_generated_tokens_per_s": trl.get("generated_tokens_per_s"),
        "train_tokens_per_s": hf.get("train_tokens_per_s"),
        "vllm_train_tokens_per_s": vllm.get("train_tokens_per_s"),
        "trl_train_tokens_per_s": trl.get("train_tokens_per_s"),
        "generation_speedup_vs_trl": ratio(hf.get("generated_tokens_per_s"), trl.get("generated_tokens_per_s")),
        "train_speedup_vs_trl": ratio(hf.get("train_tokens_per_s"), trl.get("train_tokens_per_s")),
        "vllm_generation_speedup_vs_trl": ratio(vllm.get("generated_tokens_per_s"), trl.get("generated_tokens_per_s")),
        "accuracy_before": hf.get("accuracy_before"),
        "accuracy_after": hf.get("accuracy_after"),
        "vllm_accuracy_before": vllm.get("accuracy_before"),
        "vllm_accuracy_after": vllm.get("accuracy_after"),
        "trl_accuracy_before": trl.get("accuracy_before"),
        "trl_accuracy_after": trl.get("accuracy_after"),
        "wall_s": sum(a.get("wall_s", 0.0) for a in arms.values()),
        "engines": engines,
        "vllm_note": why,
        "trl": trl.get("trl"),
        "runs": str(out),
    }
    if "error" in vllm:
        summary["vllm_error"] = vllm["error"]
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}
    (out / "peer.json").write_text(json.dumps({"summary": summary, "details": {"arms": arms}}, indent=1) + "\n")
    if args.skip_trl:  # a partial run never replaces the comparison in bench/results
        print(json.dumps(summary), flush=True)
        return summary
    return emit("peer", summary, {"arms": arms})


if __name__ == "__main__":
    main()
