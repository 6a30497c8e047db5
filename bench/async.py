"""What does rollout.max_staleness (1: one_step_off, 2: async) buy? Overlap, staleness, and a step-time simulator.

The same short job runs in three modes in one process, sync and one_step_off side by side with
their steps interleaved (sync step k, one_step_off step k, ...: a slow spell of the shared
machine hits both alike), then async alone (its thread generates whenever it may: interleaved,
it would also generate during the other arms' steps):

    sync          `rollout.max_staleness=0 algo.tis_cap=2.0`
    one_step_off  `rollout.max_staleness=1 algo.tis_cap=2.0` (step k+1's rollout generated in a
                  thread while step k trains; rl/rollout/scheduler.py)
    async         `rollout.max_staleness=2 algo.tis_cap=2.0` (a rollout thread two versions
                  ahead, weights through a staged copy)

The arms differ in `rollout.max_staleness` only (TIS in both, so the training work is the same); the
default job is train.py's own (tiny random MoE, target_token task, 16 prompts x 8 samples),
built in-process as train.py builds it (Hydra compose of conf/, `build_trainer`), with
`eval.every=0` and `trainer.max_steps=--steps`. Extra arguments are Hydra overrides for both.

Threads: OMP_NUM_THREADS=1 (set before torch is imported; `--threads 2` sets
OMP_WAIT_POLICY=PASSIVE instead). With two OpenMP threads and libgomp's default wait policy,
a sync run's OpenMP team spins in its waits and, on a loaded machine, its generation took ~10x
the same generation run from one_step_off's thread (1.56 s against 0.15 s, measured while
one_step_off was built; with PASSIVE 0.36 s): a CPU comparison would time libgomp's spinning,
not the overlap. One OpenMP thread does not spin, and each phase's time is one core's work
(as bench/common.py's one-thread default).

Per-phase seconds, medians over the steady-state steps (sync: steps 1.., step 0 warms up;
max_staleness k >= 1: the steps at staleness k but the last k, which generate nothing ahead),
from the trainer's metrics:

    sync          generate = rollout_s;  sync = weight_sync_s;  train = step_s - rollout_s - weight_sync_s
                  (collate, score, advantages, updates)
    k >= 1        generate = rollout_generate_s (the step's rollout, in the thread);  exposed = rollout_s
                  (what the rollout stage still costs the step: `take`'s wait, the metadata all-gather);
                  wait = rollout_publish_wait_s (the sync's wait for the thread: at k=1 the generation
                  not hidden);  sync = weight_sync_s;  train = step_s - rollout_s - wait - weight_sync_s

and `rollout_overlap` (mean: the fraction of the background generation that ran while the
step trained), the generation hidden behind training (overlap x generate), the staleness
histogram (samples by `rollout_staleness_mean`; a rollout's samples share one version) and
`rollout_stale_dropped`.

The simulator (`predict`): from one run's per-phase seconds, the steady-state step

    sync          generate + train + sync
    one_step_off  max(generate, train) + sync + exposed

(the weight sync waits for the generation and the training's last update, so it is never
hidden; `exposed` is one_step_off's measured take cost). It is applied to the sync run's
phases at the measured CPU ratio, and at GPU-like ratios (generate = 3x, 1x, 0.5x the measured
train; 3x is issue 26's GPU case), with its bound (r + 1) / max(r, 1) when sync and exposed
are 0. The check: the prediction at the CPU ratio against the measured one_step_off step
(`sim_error` = measured / predicted - 1), and the same formula on the phases as measured under
the overlap (`sim_error_contended`: what is left is the model's own error; the difference
between the two is contention).

`simulate` is the same hand-over as an event simulation over a list of per-step generation
seconds (one_step_off; async at a given staleness, whose thread also loads each version: `sync`
seconds again). With constant phases every mode steps at `predict`'s one_step_off step; the
deeper queue pays when rollouts vary from step to step (a long-answer job): the JSON's
`spread_<r>x_async_vs_off` is one_step_off's simulated step over async's (max_staleness=2)
with lognormal generation seconds (sigma 0.5, seeded) of mean r x the measured train.

On this 2-core CPU the overlap cannot buy the predicted wall-clock time in full: the thread's
generation and the main thread's training share the cores (and the machine's other jobs), so
both phases run slower while they overlap (`gen_slowdown`, `train_slowdown`). With one OpenMP
thread each, what one_step_off can gain here is the second core that sync leaves idle, and
only as far as the two Python threads do not wait on each other for the GIL (torch releases it
inside ops; a tiny model's ops are short, so much of its step holds it): `cores_busy` (process
CPU seconds / wall seconds of the step, every thread) says how much of a second core was used
(1.0 in sync). The max() assumes the two phases do not slow each other: on a GPU the thread's
kernels run on their own CUDA stream (rl/rollout/scheduler.py; not yet run on a GPU) but share
the device's SMs and memory bandwidth, so there too the prediction is an upper bound.

Measured here (default job, 10 steps, five runs): sync 0.124-0.131 s a step (generate ~0.055,
train ~0.072), one_step_off 0.137-0.142 s (overlap 0.99-1.0, staleness 1 for every sample after
step 0, 0 dropped); both phases 1.9-2.2x slower while they overlap, 1.00-1.35 cores busy (1.00
when a neighbour's job held the other core): predicted 0.071-0.074 s (1.75x), error +85-100%,
within 0.1% on the contended phases; at generate = 3x train 1.33x predicted. With
`task.max_new_tokens=48` one_step_off measured 1.14x faster with 1.55 cores busy, 0.91x with 1.00.

    python bench/async.py [--quick] [--steps N] [--threads 1|2] [hydra overrides ...]

`--quick`: 4 prompts x 4 samples, 5 steps (~10 s here; the default ~15 s). Last stdout line:
one JSON object (also bench/results/async.json, with every step's figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASYNC_K = 2  # the async arm's rollout.max_staleness
STALENESS = {"sync": 0, "one_step_off": 1, "async": ASYNC_K}  # each arm's rollout.max_staleness
MODES = {mode: (f"rollout.max_staleness={k}", "algo.tis_cap=2.0") for mode, k in STALENESS.items()}
SPREAD_SIGMA, SPREAD_SEED = 0.5, 0  # the simulator's varying-rollout case: lognormal generation seconds
GPU_RATIOS = (3.0, 1.0, 0.5)  # generation seconds / training seconds
QUICK = ("task.prompts_per_step=4", "task.samples_per_prompt=4")
NOTE = ("2-core CPU: the background generation and the training share the cores, so the overlap cannot buy "
        "the predicted wall-clock time in full; the overlap fraction, the staleness and the simulator's "
        "GPU-ratio step times are what transfer")


# ------------------------------------------------------------------ pure figures (tests/test_async_bench.py)
def predict(generate: float, train: float, sync: float = 0.0, exposed: float = 0.0) -> dict[str, float]:
    """Steady-state step seconds of each mode from per-phase seconds (the module docstring):
    sync runs generate, train, sync one after the other; one_step_off generates the next
    step's rollout while this one trains, so the longer of the two plus the weight sync (never
    hidden) and one_step_off's own take cost `exposed`. `hidden` is the fraction of the
    generation that runs behind training."""
    if min(generate, train, sync, exposed) < 0 or generate + train <= 0:
        raise ValueError(f"predict: phase seconds must be >= 0 and generate + train > 0, got generate={generate}, "
                         f"train={train}, sync={sync}, exposed={exposed}")
    step_sync = generate + train + sync
    step_off = max(generate, train) + sync + exposed
    return {"sync_step_s": step_sync, "one_step_off_step_s": step_off, "speedup": step_sync / step_off,
            "hidden": min(generate, train) / generate if generate > 0 else 0.0}


def simulate(generate: list[float], train: float, sync: float = 0.0, *, staleness: int = 1,
             exposed: float = 0.0) -> float:
    """Mean step seconds over len(generate) steps whose rollouts take `generate[j]` seconds (an
    event simulation of rl/rollout/scheduler.py's hand-over; phases do not slow each other).

    staleness=1 (one_step_off): step s starts when step s-1 is done and rollout s is; rollout
    s+1 starts with it; the sync (into the engine) waits for the training and for rollout s+1.
    staleness=k >= 2: rollout j starts when rollout j-1 is done and version j-k is published
    (the sync after step j-k-1), and first loads it into the engine (`sync` seconds again, in the
    thread); the sync after step s writes the stage (`sync` seconds) once rollout s+k has begun."""
    n = len(generate)
    if n == 0 or min([train, sync, exposed, *generate]) < 0 or staleness < 1:
        raise ValueError(f"simulate: expected steps, seconds >= 0 and staleness >= 1, got {n} steps, "
                         f"train={train}, sync={sync}, exposed={exposed}, staleness={staleness}")
    step_end = [0.0] * n
    if staleness == 1:
        r_end, prev = generate[0], 0.0  # step 0 generates in the foreground
        for s in range(n):
            start = max(prev, r_end) + exposed
            nxt = start + generate[s + 1] if s + 1 < n else start
            prev = step_end[s] = max(start + train, nxt) + sync
            r_end = nxt
        return step_end[-1] / n
    k, r_start, r_end = staleness, [0.0] * n, [0.0] * n
    published = lambda v: 0.0 if v <= 0 else step_end[v - 1]  # noqa: E731  (version v: after step v-1's sync)
    made, prev = 0, 0.0

    def rollouts_until(j: int) -> None:  # generate rollouts made..j (each needs only earlier steps' syncs)
        nonlocal made
        while made <= min(j, n - 1):
            v = max(0, made - k)
            r_start[made] = max(r_end[made - 1] if made else 0.0, published(v))
            r_end[made] = r_start[made] + (sync if v > 0 and made - k >= 0 else 0.0) + generate[made]
            made += 1

    for s in range(n):
        rollouts_until(s)
        start = max(prev, r_end[s]) + exposed
        trained = start + train
        if s + k < n:
            rollouts_until(s + k)  # rollout s+k needs version s: published after step s-1
            trained = max(trained, r_start[s + k])
        prev = step_end[s] = trained + sync
    return step_end[-1] / n


def steady(mode: str, steps: list[dict]) -> list[dict]:
    """The steps that show the mode's steady state: sync drops step 0 (warm-up); at k >= 1 the
    steps at staleness k with the thread still generating ahead (not the last k)."""
    k = STALENESS[mode]
    return steps[1:] if not k else [m for m in steps[:-k] if m["rollout_staleness_max"] == k]


def phases(mode: str, m: dict) -> dict[str, float]:
    """One step's per-phase seconds from its metrics (the module docstring's table)."""
    cores = {"cores_busy": m["process_cpu_s"] / m["step_s"]} if "process_cpu_s" in m else {}
    if not STALENESS[mode]:
        return {"generate": m["rollout_s"], "train": m["step_s"] - m["rollout_s"] - m["weight_sync_s"],
                "sync": m["weight_sync_s"], "step": m["step_s"], **cores}
    wait = m["rollout_publish_wait_s"]
    return {"generate": m["rollout_generate_s"], "exposed": m["rollout_s"], "wait": wait,
            "train": m["step_s"] - m["rollout_s"] - wait - m["weight_sync_s"], "sync": m["weight_sync_s"],
            "step": m["step_s"], "overlap": m.get("rollout_overlap", 0.0), **cores}


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    if not rows:
        raise ValueError("medians: no steady-state step (one_step_off needs --steps >= 3)")
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def staleness_histogram(steps: list[dict], samples_per_step: int) -> dict[str, int]:
    """Samples by staleness (steps behind the policy that trains on them) over the run: every
    sample of a one_step_off rollout has its rollout's version, so a step adds its
    `samples_per_step` to the bucket of `rollout_staleness_mean`."""
    hist: dict[str, int] = {}
    for m in steps:
        lo, hi = m["rollout_staleness_mean"], m["rollout_staleness_max"]
        if lo != hi or lo != int(lo):
            raise ValueError(f"step {m.get('step')}: rollout_staleness_mean={lo} and rollout_staleness_max={hi}: "
                             "expected one integer version for the step's whole rollout")
        key = str(int(lo))
        hist[key] = hist.get(key, 0) + samples_per_step
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def spread_case(train: float, sync: float, exposed: float, steps: int = 400) -> dict[str, dict[str, float]]:
    """`simulate` at each GPU ratio with rollouts whose seconds vary from step to step (lognormal,
    sigma SPREAD_SIGMA, seeded; mean = ratio x train: a long-answer job's rollouts differ by step):
    mean step seconds of sync, one_step_off (max_staleness 1) and async (ASYNC_K)."""
    import random

    rng = random.Random(SPREAD_SEED)
    draws = [rng.lognormvariate(0.0, SPREAD_SIGMA) for _ in range(steps)]
    out = {}
    for r in GPU_RATIOS:
        gen = [r * train * x / statistics.mean(draws) for x in draws]
        out[f"{r:g}x"] = {"sync": statistics.mean(gen) + train + sync,
                          "one_step_off": simulate(gen, train, sync, exposed=exposed),
                          "async": simulate(gen, train, sync, staleness=ASYNC_K, exposed=exposed)}
    return out


# ------------------------------------------------------------------------------------- the run
def run(steps: int, overrides: list[str]) -> tuple[dict[str, list[dict]], int]:
    """Both modes' metrics of every step (steps interleaved) and the samples per step."""
    import torch

    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir

    from model.parallel_dims import init_distributed
    from rl.config import load, register, validate
    from rl.trainer.trainer import build_trainer

    register()
    trainers, cfg = {}, None
    for mode, mode_overrides in MODES.items():
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = load(compose("config", overrides=[*overrides, *mode_overrides, f"trainer.max_steps={steps}",
                                                    "eval.every=0", "trainer.progress=false"]))
        validate(cfg, world_size=1)
        dims = init_distributed(cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.ep, device=cfg.trainer.device.value,
                                one_rank_group=cfg.model.param_dtype is not None)  # as train.py
        torch.manual_seed(cfg.seed)
        trainers[mode] = build_trainer(cfg, dims)
    metrics: dict[str, list[dict]] = {mode: [] for mode in trainers}
    # sync and one_step_off interleaved; async after them, alone: its thread generates whenever it may,
    # so interleaved it would also generate during the other arms' steps (free time no run of its own has)
    for arms in (("sync", "one_step_off"), ("async",)):
        for step in range(steps):
            for mode in arms:
                c0 = time.process_time()
                m = trainers[mode].step(step)
                metrics[mode].append(m | {"process_cpu_s": time.process_time() - c0})  # every thread's CPU time
            print(f"bench/async.py: step {step}: " + ", ".join(f"{mode} {metrics[mode][-1]['step_s']:.3f} s"
                                                               for mode in arms), file=sys.stderr, flush=True)
    return metrics, cfg.task.prompts_per_step * cfg.task.samples_per_prompt


def summarize(metrics: dict[str, list[dict]], samples_per_step: int) -> tuple[dict, dict]:
    """(the JSON line's figures, the details) from both modes' step metrics."""
    per = {mode: [phases(mode, m) for m in steady(mode, ms)] for mode, ms in metrics.items()}
    s, o = medians(per["sync"]), medians(per["one_step_off"])
    off_steps = metrics["one_step_off"]
    overlap = statistics.mean(p["overlap"] for p in per["one_step_off"])
    hidden_s = statistics.mean(p["overlap"] * p["generate"] for p in per["one_step_off"])
    ratio = s["generate"] / s["train"]
    cpu = predict(s["generate"], s["train"], s["sync"], o["exposed"])
    contended = predict(o["generate"], o["train"], o["sync"], o["exposed"])
    gpu = {f"{r:g}x": {**predict(r * s["train"], s["train"], s["sync"], o["exposed"]),
                       "bound": predict(r, 1.0)["speedup"]} for r in GPU_RATIOS}
    a, async_steps = medians(per["async"]), metrics["async"]
    spread = spread_case(s["train"], s["sync"], o["exposed"])
    r4 = lambda x: round(x, 4) + 0.0  # noqa: E731  (+ 0.0: no -0.0 in the JSON)
    summary = {
        "steps": len(off_steps), "samples_per_step": samples_per_step,
        "omp": "OMP_WAIT_POLICY=PASSIVE" if os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
        else f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "sync_step_s": r4(s["step"]), "sync_generate_s": r4(s["generate"]), "sync_train_s": r4(s["train"]),
        "sync_weight_sync_s": r4(s["sync"]),
        "off_step_s": r4(o["step"]), "off_generate_s": r4(o["generate"]), "off_train_s": r4(o["train"]),
        "off_wait_s": r4(o["wait"]), "off_exposed_s": r4(o["exposed"]), "off_weight_sync_s": r4(o["sync"]),
        "overlap_mean": r4(overlap), "hidden_generate_s": r4(hidden_s),
        "staleness_histogram": staleness_histogram(off_steps, samples_per_step),
        "stale_dropped": int(sum(m["rollout_stale_dropped"] for m in off_steps)),
        "cpu_ratio": r4(ratio), "measured_speedup": r4(s["step"] / o["step"]),
        "predicted_off_step_s": r4(cpu["one_step_off_step_s"]), "predicted_speedup": r4(cpu["speedup"]),
        "predicted_hidden": r4(cpu["hidden"]),
        "sim_error": r4(o["step"] / cpu["one_step_off_step_s"] - 1),
        "sim_error_contended": r4(o["step"] / contended["one_step_off_step_s"] - 1),
        "gen_slowdown": r4(o["generate"] / s["generate"]), "train_slowdown": r4(o["train"] / s["train"]),
        "sync_cores_busy": r4(s["cores_busy"]), "off_cores_busy": r4(o["cores_busy"]),
        **{f"gpu_speedup_{k}": r4(v["speedup"]) for k, v in gpu.items()},
        "async_staleness": ASYNC_K, "async_step_s": r4(a["step"]), "async_generate_s": r4(a["generate"]),
        "async_train_s": r4(a["train"]), "async_wait_s": r4(a["exposed"]), "async_weight_sync_s": r4(a["sync"]),
        "async_publish_wait_s": r4(a["wait"]), "async_overlap_mean": r4(statistics.mean(
            p["overlap"] for p in per["async"])), "measured_async_speedup": r4(s["step"] / a["step"]),
        "async_staleness_histogram": staleness_histogram(async_steps, samples_per_step),
        "async_stale_dropped": int(sum(m["rollout_stale_dropped"] for m in async_steps)),
        **{f"spread_{k}_async_vs_off": r4(v["one_step_off"] / v["async"]) for k, v in spread.items()},
        "note": NOTE,
    }
    details = {"sync": s, "one_step_off": o, "async": a, "simulated_spread": spread, "predicted_cpu": cpu, "predicted_contended": contended,
               "predicted_gpu": gpu, "per_step": per, "metrics": metrics}
    return summary, details


def table(summary: dict, details: dict) -> str:
    s, o = details["sync"], details["one_step_off"]
    rows = [f"{'phase (median s)':<22}{'sync':>10}{'one_step_off':>14}",
            f"{'step':<22}{s['step']:>10.4f}{o['step']:>14.4f}",
            f"{'generate':<22}{s['generate']:>10.4f}{o['generate']:>14.4f}  (one_step_off: the next step's, "
            "in the thread)",
            f"{'train':<22}{s['train']:>10.4f}{o['train']:>14.4f}  (one_step_off: while the thread generates)",
            f"{'weight sync':<22}{s['sync']:>10.4f}{o['sync']:>14.4f}",
            f"{'wait / exposed take':<22}{'':>10}{o['wait']:>7.4f} /{o['exposed']:.4f}",
            f"{'cores busy (CPU/wall)':<22}{s['cores_busy']:>10.3f}{o['cores_busy']:>14.3f}",
            f"overlap {summary['overlap_mean']:.3f} of the generation ({summary['hidden_generate_s']:.4f} s hidden); "
            f"staleness {summary['staleness_histogram']} samples, {summary['stale_dropped']} dropped",
            f"simulator at the CPU ratio {summary['cpu_ratio']:.2f} (generate/train): one_step_off "
            f"{summary['predicted_off_step_s']:.4f} s predicted, {o['step']:.4f} s measured (error "
            f"{summary['sim_error']:+.1%}; on the phases measured under the overlap "
            f"{summary['sim_error_contended']:+.1%}); "
            f"speed-up {summary['predicted_speedup']:.3f}x predicted, {summary['measured_speedup']:.3f}x measured"]
    for k, v in details["predicted_gpu"].items():
        rows.append(f"  GPU-like ratio generate = {k} train: sync {v['sync_step_s']:.4f} s, one_step_off "
                    f"{v['one_step_off_step_s']:.4f} s, speed-up {v['speedup']:.3f}x (bound {v['bound']:.3f}x)")
    a = details["async"]
    rows.append(f"async (max_staleness={ASYNC_K}): step {a['step']:.4f} s, generate {a['generate']:.4f}, train "
                f"{a['train']:.4f}, wait {a['exposed']:.4f}, sync into the stage {a['sync']:.4f} (publish wait "
                f"{a['wait']:.4f}), overlap {summary['async_overlap_mean']:.3f}; staleness "
                f"{summary['async_staleness_histogram']} samples, {summary['async_stale_dropped']} dropped")
    for k, v in details["simulated_spread"].items():
        rows.append(f"  varying rollouts (lognormal sigma {SPREAD_SIGMA}), generate = {k} train: sync {v['sync']:.4f} s, "
                    f"one_step_off {v['one_step_off']:.4f} s, async k={ASYNC_K} "
                    f"{v['async']:.4f} s")
    rows.append(NOTE)
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 prompts x 4 samples, 5 steps")
    p.add_argument("--steps", type=int, default=None, help="steps per mode (default 10; --quick 5)")
    p.add_argument("--threads", type=int, choices=(1, 2), default=1,
                   help="1: OMP_NUM_THREADS=1 (default); 2: two OpenMP threads with OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both modes (e.g. model=dense_tiny)")
    args = p.parse_args()
    steps = args.steps or (5 if args.quick else 10)
    if steps < ASYNC_K + 3:
        p.error(f"--steps {steps}: expected >= {ASYNC_K + 3} for a steady-state step of every arm (one_step_off's step 0 "
                f"generates in the foreground, async reaches staleness {ASYNC_K} at step {ASYNC_K}; the last steps "
                "generate nothing ahead)")
    # before torch is imported (libgomp reads them when it loads): see the module docstring
    if args.threads == 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    else:
        os.environ["OMP_NUM_THREADS"], os.environ["OMP_WAIT_POLICY"] = "2", "PASSIVE"
    sys.path.insert(0, str(ROOT / "bench"))
    from common import emit

    import torch

    torch.set_num_threads(args.threads)
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    metrics, samples = run(steps, [*(QUICK if args.quick else ()), *args.overrides])
    summary, details = summarize(metrics, samples)
    details |= {"overrides": args.overrides, "quick": args.quick, "wall_s": round(time.perf_counter() - t0, 1),
                "loadavg_start": load, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    print(table(summary, details), flush=True)
    emit("async", summary, details, clock="wall")


if __name__ == "__main__":
    main()
