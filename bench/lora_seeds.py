"""Issue 43's accuracy comparison over seeds: this project's LoRA runs against TRL's, pair by pair.

Each pair trains on the same prompts in the same order (bench/peer_trl.py draws the project's step
prompts), so besides the held-out accuracy after the last step it compares two figures with less
noise than one final evaluation: the mean held-out accuracy over the late evaluations both arms ran
(`eval.every=10` in the experiment, `--eval-every 10` there), and the training reward, step by step on the same
prompts. Standard errors are over the pairs.

    .venv/bin/python bench/lora_seeds.py --ours 4=outputs/<run> ... --trl 4=bench/results/peer-lora-trl-seed4.json ... \\
        --out bench/results/peer-lora-seeds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def ours(run: Path) -> dict:
    """A run folder's held-out accuracies by step (step s: after s updates; the one after the last
    step is a row of its own) and its training reward per step."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = {r["step"]: r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    reward = {r["step"]: r["reward_mean"] for r in rows if "reward_mean" in r}
    return {"run": run.name, "evals": evals, "reward": [reward[s] for s in sorted(reward)]}


def trl(path: Path) -> dict:
    d = json.loads(path.read_text())
    evals = {e["step"]: e["accuracy"] for e in d.get("evals", [])} or {0: d["accuracy_before"],
                                                                         d["steps"]: d["accuracy_after"]}
    return {"file": path.name, "evals": evals, "reward": [s["reward_mean"] for s in d["per_step"]]}


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and its standard error (sample standard deviation / sqrt(n); NaN for one value)."""
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), se


def paired(a: list[float], b: list[float]) -> dict:
    """Each side's mean and their difference pair by pair, with its standard error over the pairs."""
    diffs = [x - y for x, y in zip(a, b)]
    diff, se = mean_se(diffs)
    return {"ours": statistics.fmean(a), "trl": statistics.fmean(b), "diff": diff, "se": se, "pairs": len(diffs)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ours", nargs="+", required=True, help="SEED=run folder")
    p.add_argument("--trl", nargs="+", required=True, help="SEED=bench/peer_trl.py JSON")
    p.add_argument("--late", type=int, default=20, help="the late evaluations: from this step on")
    p.add_argument("--out")
    args = p.parse_args(argv)
    a = {int(s): ours(Path(r)) for s, r in (x.split("=", 1) for x in args.ours)}
    b = {int(s): trl(Path(r)) for s, r in (x.split("=", 1) for x in args.trl)}
    seeds = sorted(set(a) & set(b))
    steps = {s: min(len(a[s]["reward"]), len(b[s]["reward"])) for s in seeds}
    final = {s: max(b[s]["evals"]) for s in seeds}
    missing = [s for s in seeds if final[s] not in a[s]["evals"]]
    if missing:
        raise SystemExit(f"lora_seeds: seeds {missing}: no evaluation after step {final[missing[0]]} in our run")

    def late(run, s):
        return [acc for step, acc in run["evals"].items() if step >= args.late and step in b[s]["evals"]]

    curves = [s for s in seeds if len(late(b[s], s)) > 1]  # TRL evaluated between, not only before and after
    result = {
        "seeds": seeds,
        "final": paired([a[s]["evals"][final[s]] for s in seeds], [b[s]["evals"][final[s]] for s in seeds]),
        "late_evals": {"from_step": args.late, "seeds": curves, **paired(
            [statistics.fmean(late(a[s], s)) for s in curves], [statistics.fmean(late(b[s], s)) for s in curves])}
        if curves else None,
        "train_reward": paired([statistics.fmean(a[s]["reward"][:steps[s]]) for s in seeds],
                               [statistics.fmean(b[s]["reward"][:steps[s]]) for s in seeds]),
        "train_reward_second_half": paired([statistics.fmean(a[s]["reward"][steps[s] // 2:steps[s]]) for s in seeds],
                                           [statistics.fmean(b[s]["reward"][steps[s] // 2:steps[s]]) for s in seeds]),
        "per_seed": {s: {"ours": a[s], "trl": b[s]} for s in seeds},
    }
    print(f"{'seed':>4} {'ours final':>10} {'trl final':>9} {'ours late':>9} {'trl late':>8} "
          f"{'ours reward':>11} {'trl reward':>10}")
    for s in seeds:
        la, lb = late(a[s], s), late(b[s], s)
        print(f"{s:>4} {a[s]['evals'][final[s]]:>10.3f} {b[s]['evals'][final[s]]:>9.3f} "
              f"{(statistics.fmean(la) if len(lb) > 1 else float('nan')):>9.3f} "
              f"{(statistics.fmean(lb) if len(lb) > 1 else float('nan')):>8.3f} "
              f"{statistics.fmean(a[s]['reward'][:steps[s]]):>11.3f} {statistics.fmean(b[s]['reward'][:steps[s]]):>10.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("seeds", "final", "late_evals", "train_reward",
                                             "train_reward_second_half")}))
    return result


if __name__ == "__main__":
    main()
