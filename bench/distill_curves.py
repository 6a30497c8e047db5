"""Issue 53's headline: on-policy distillation against RL, held-out accuracy per step over seeds.

The teacher is the RL run `make distill-teacher` trained (its held-out accuracy after the last step is
the teacher's); the threshold is `--share` (0.9) of it. For each arm (RL, distillation, and their LoRA
versions) it reads each seed's held-out accuracy by step, averages the seeds at the steps every seed
evaluated, and names the first evaluated step whose mean reaches the threshold, then the ratio of the
distilled student's step to RL's (the done-when asks <= 1/3), for the seed means and seed by seed (a
distillation seed against the RL seed of the same number: the same training prompts). Evaluations are every
`eval.every` steps, so a step is "first evaluated", an upper bound on the step that reached it. Beside them:
the held-out set's size N (eval.num_prompts of the runs) and the standard error of one evaluation at the
threshold, sqrt(t (1 - t) / N), and of a mean over the seeds.

`--earlier JSON` takes an earlier output of this script as well: its teacher, and its arms' seed curves
where the runs given now do not evaluate (a seed's steps evaluated in both keep the new value, and
`reproduced` lists both values at each such step, a check that the two runs agree); `sources` names, per
arm and seed, the run folder or the earlier JSON each curve comes from.

    .venv/bin/python bench/distill_curves.py --teacher-run outputs/<teacher run> \\
        --rl 0=outputs/<teacher run> --distill 0=DIR 1=DIR 2=DIR --distill-lora 0=DIR ... \\
        --rl-lora-seeds bench/results/peer-lora-seeds.json \\
        --out bench/results/distill-headline.json --plot docs/smollm2_distill_curves.png
    .venv/bin/python bench/distill_curves.py --earlier bench/results/distill-headline-every10.json \\
        --distill 0=DIR 1=DIR 2=DIR --rl 1=DIR --out bench/results/distill-headline.json --plot ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_seeds import ours  # noqa: E402


def runs(specs: list[str] | None) -> dict[int, dict[int, float]]:
    """SEED=run folder -> {seed: {step: held-out accuracy}}."""
    out = {}
    for spec in specs or []:
        seed, path = spec.split("=", 1)
        out[int(seed)] = {int(k): v for k, v in ours(Path(path))["evals"].items()}
    return out


def heldout_size(specs: list[str]) -> int | None:
    """eval.num_prompts of the runs (their .hydra/config.yaml); refuses runs that disagree."""
    import yaml

    sizes = {spec: yaml.safe_load((Path(spec.split("=", 1)[1]) / ".hydra" / "config.yaml").read_text())
             ["eval"]["num_prompts"] for spec in specs}
    if len(set(sizes.values())) > 1:
        raise SystemExit(f"distill_curves: the runs evaluate different held-out sets (eval.num_prompts): {sizes}")
    return next(iter(sizes.values()), None)


def merge(new: dict[int, dict[int, float]], earlier: dict[int, dict[int, float]]) -> tuple[dict, list]:
    """Each seed's curve: the new run's evaluations, and the earlier curve's at the steps the new run did
    not evaluate; and [seed, step, earlier, new] at each step both evaluated."""
    merged, reproduced = {}, []
    for seed in sorted(set(new) | set(earlier)):
        a, b = earlier.get(seed, {}), new.get(seed, {})
        merged[seed] = dict(sorted({**a, **b}.items()))
        reproduced += [[seed, s, a[s], b[s]] for s in sorted(set(a) & set(b))]
    return merged, reproduced


def arm(evals: dict[int, dict[int, float]], threshold: float) -> dict:
    """The seeds' curves, their mean at the steps every seed evaluated, and the first step reaching
    `threshold` (of the mean, and of each seed; None: not within the run)."""
    if not evals:
        return {}
    steps = sorted(set.intersection(*(set(e) for e in evals.values())))
    mean = {s: statistics.fmean(e[s] for e in evals.values()) for s in steps}

    def first(curve: dict[int, float]) -> int | None:
        return next((s for s in sorted(curve) if curve[s] >= threshold), None)

    return {"seeds": sorted(evals), "per_seed": {s: evals[s] for s in sorted(evals)},
            "mean": mean, "first_step_at_threshold": first(mean),
            "first_step_at_threshold_per_seed": {s: first(e) for s, e in sorted(evals.items())}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher-run", help="the run `make distill-teacher` trained the teacher with (or --earlier's)")
    p.add_argument("--earlier", help="an earlier output of this script: its teacher, and its seed curves where "
                                     "the runs given now do not evaluate")
    p.add_argument("--share", type=float, default=0.9, help="the threshold: this share of the teacher's accuracy")
    for name in ("rl", "distill", "rl-lora", "distill-lora"):
        p.add_argument(f"--{name}", nargs="*", help="SEED=run folder (metrics.jsonl)")
    p.add_argument("--rl-lora-seeds", help="bench/results/peer-lora-seeds.json: LoRA RL curves by seed "
                                           "(those seeds of --distill-lora that it holds)")
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    earlier = json.loads(Path(args.earlier).read_text()) if args.earlier else None
    if args.teacher_run:
        teacher_evals = ours(Path(args.teacher_run))["evals"]
        teacher, teacher_run = teacher_evals[max(teacher_evals)], str(args.teacher_run)
    elif earlier:
        teacher, teacher_run = earlier["teacher_accuracy"], earlier["teacher_run"]
    else:
        p.error("--teacher-run or --earlier: the teacher's accuracy comes from one of them")
    threshold = args.share * teacher
    given = {"rl": args.rl, "distill": args.distill, "rl_lora": args.rl_lora, "distill_lora": args.distill_lora}
    curves = {k: runs(v) for k, v in given.items()}
    sources = {k: {int(x.split("=", 1)[0]): x.split("=", 1)[1] for x in v or []} for k, v in given.items()}
    reproduced = {}
    for name in curves:
        held = {int(s): {int(k): v for k, v in c.items()}
                for s, c in ((earlier or {}).get("arms", {}).get(name) or {}).get("per_seed", {}).items()}
        for seed in held:  # the earlier JSON, where it adds steps the new run did not evaluate
            if seed not in sources[name]:
                sources[name][seed] = args.earlier
            elif set(held[seed]) - set(curves[name][seed]):
                sources[name][seed] += f" + {args.earlier} (steps {sorted(set(held[seed]) - set(curves[name][seed]))})"
        curves[name], reproduced[name] = merge(curves[name], held)
    if args.rl_lora_seeds:
        held = json.loads(Path(args.rl_lora_seeds).read_text())["per_seed"]
        for seed in curves["distill_lora"]:
            if str(seed) in held and seed not in curves["rl_lora"]:
                curves["rl_lora"][seed] = {int(k): v for k, v in held[str(seed)]["ours"]["evals"].items()}
    arms = {k: arm(v, threshold) for k, v in curves.items()}
    for name in arms:
        if arms[name]:
            arms[name]["sources"] = {s: sources[name][s] for s in sorted(sources[name])}
            arms[name]["reproduced"] = reproduced[name]  # [seed, step, earlier, new]
    ratios, per_seed = {}, {}
    for student, rl in (("distill", "rl"), ("distill_lora", "rl_lora")):
        a, b = arms[student].get("first_step_at_threshold"), arms[rl].get("first_step_at_threshold")
        ratios[student] = a / b if a is not None and b else None
        firsts = [arms[k].get("first_step_at_threshold_per_seed", {}) for k in (student, rl)]
        per_seed[student] = {s: firsts[0][s] / firsts[1][s] if firsts[0][s] is not None and firsts[1][s] else None
                             for s in sorted(set(firsts[0]) & set(firsts[1]))}
    n = heldout_size([x for v in given.values() for x in v or []])
    se = (threshold * (1 - threshold) / n) ** 0.5 if n else None
    result = {"teacher_accuracy": teacher, "share": args.share, "threshold": threshold, "teacher_run": teacher_run,
              "heldout_problems": n, "threshold_se_one_eval": se,
              "threshold_se_mean": {k: se / len(a["seeds"]) ** 0.5 for k, a in arms.items() if a and se},
              "steps_ratio_vs_rl": ratios, "steps_ratio_vs_rl_per_seed": per_seed, "arms": arms}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [p for p in (("distill", "rl", "full fine-tuning"), ("distill_lora", "rl_lora", "LoRA r16"))
                  if curves[p[0]] or curves[p[1]]]
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), sharey=True, squeeze=False)
        axes = axes[0]
        for ax, (student, rl, title) in zip(axes, panels):
            for name, color in ((rl, "tab:blue"), (student, "tab:orange")):
                for seed, e in curves[name].items():
                    ax.plot(sorted(e), [e[s] for s in sorted(e)], color=color, alpha=0.25, lw=1)
                if arms[name]:
                    m = arms[name]["mean"]
                    ax.plot(sorted(m), [m[s] for s in sorted(m)], color=color, marker="o", lw=2,
                            label=f"{'distillation' if name == student else 'RL (GRPO)'}, "
                                  f"mean of {len(curves[name])} seeds")
            ax.axhline(teacher, color="k", ls="--", lw=1, label=f"teacher {teacher:.3f}")
            ax.axhline(threshold, color="k", ls=":", lw=1, label=f"{args.share} x teacher")
            ax.set_title(title)
            ax.set_xlabel("training step")
            ax.legend(fontsize=7, loc="lower right")
        axes[0].set_ylabel(f"held-out greedy accuracy ({n or 200} problems)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    print(json.dumps({k: result[k] for k in ("teacher_accuracy", "threshold", "heldout_problems",
                                             "steps_ratio_vs_rl", "steps_ratio_vs_rl_per_seed")}))
    return result


if __name__ == "__main__":
    main()
