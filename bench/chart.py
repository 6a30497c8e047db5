"""bench/results/bench.png: one panel per bench from bench/results/<name>.json (a missing
result leaves its panel out). Prints one JSON line: the panels drawn and the PNG path.

    python bench/chart.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402


def _bars(ax, groups: dict[str, dict[str, float]], title: str, ylabel: str, *, log: bool = False, fmt: str = "{:.2f}"):
    """Grouped bars: groups {group: {series: value}}."""
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / max(len(series), 1)
    for j, s in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        vals = [groups[g].get(s, float("nan")) for g in groups]
        bars = ax.bar(xs, vals, width, label=s)
        ax.bar_label(bars, [fmt.format(v) if v == v else "" for v in vals], fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def step_panel(ax, r):
    per = r["details"]["per_mix"]
    groups = {m: {"speedup": x["speedup"], "ideal (token ratio)": x["ideal_token_ratio"],
                  "efficiency": x["efficiency"]} for m, x in per.items()}
    _bars(ax, groups, "step: packed vs padded fwd+bwd", "x")
    ax.axhline(0.95, color="grey", ls="--", lw=0.8)


def memory_panel(ax, r):
    per = r["details"]["per_mix"]
    _bars(ax, {m: {"packed/padded peak": x["packed_over_padded"], "token ratio": x["token_ratio"],
                   "1.15 x token ratio": 1.15 * x["token_ratio"]} for m, x in per.items()},
          "memory: one microbatch's peak", "ratio")


def collate_panel(ax, r):
    s = r["summary"]
    _bars(ax, {"token fields (~200k tokens)": {"ours": s["ours_ms"], "nemo-automodel": s["automodel_ms"]},
               "full Experience": {"ours": s["experience_collate_ms"]}},
          f"collate: {s['speedup_vs_automodel']}x automodel, {s['collate_pct_of_step']:.3f}% of a step",
          "ms", log=True, fmt="{:.1f}")


def planner_panel(ax, r):
    per = r["details"]["per_mix"]
    _bars(ax, {m: {"planner lockstep/ideal": x["planner"]["lockstep_over_ideal"],
                   "greedy lockstep/ideal": x["sorted_greedy"]["lockstep_over_ideal"],
                   "planner m/bound": x["planner"]["max_over_lower_bound"],
                   "greedy m/bound": x["sorted_greedy"]["max_over_lower_bound"]} for m, x in per.items()},
          "planner: 2048 samples, 8 ranks, cap 16384", "ratio", fmt="{:.3f}")
    ax.set_ylim(0.98, None)


def attention_panel(ax, r):
    packs = r["details"]["packs"]
    _bars(ax, {f"{p} (N={x['tokens']}, {x['n_seqs']} seqs)": {k: v["cpu" if r["summary"].get("clock") != "wall"
                                                                      else "wall"] * 1e3
                                                               for k, v in x["fwd_bwd_s"].items()}
               for p, x in packs.items()}, f"CPU varlen attention fwd+bwd (default: {r['summary']['best']})", "ms",
          fmt="{:.0f}")


def balance_panel(ax, cp, ep):
    groups = {}
    if cp:
        m = cp["summary"]["max_over_min_work"]
        groups["CP work max/min"] = {"zigzag": max(m["cp2_zigzag"], m["cp4_zigzag"]),
                                     "contiguous": max(m["cp2_contiguous"], m["cp4_contiguous"])}
    if ep:
        s = ep["summary"]
        groups["EP tokens max/mean"] = {"live": s["imbalance"], "suffix (masked)": s["suffix_imbalance"],
                                        "suffix unmasked": s["suffix_unmasked_imbalance"],
                                        "replay": s["replay_imbalance"]}
    _bars(ax, groups, "balance: CP ranks (cp=2,4), EP ranks (ep=4)", "max / min or mean", fmt="{:.3f}")


def main() -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    panels = [(name, fn) for name, fn in (("step", step_panel), ("memory", memory_panel), ("collate", collate_panel),
                                          ("planner", planner_panel), ("attention", attention_panel))
              if name in results]
    has_balance = "cp_balance" in results or "ep_balance" in results
    n = len(panels) + has_balance
    cols = 3
    rows = max((n + cols - 1) // cols, 1)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax, (name, fn) in zip(flat, panels):
        fn(ax, results[name])
    if has_balance:
        balance_panel(flat[len(panels)], results.get("cp_balance"), results.get("ep_balance"))
    for ax in flat[n:]:
        ax.set_visible(False)
    machine = next(iter(results.values()))["summary"] if results else {}
    fig.suptitle(f"make bench: torch {machine.get('torch')}, kernel set {machine.get('capability')}, "
                 f"{machine.get('threads')} threads", fontsize=11)
    fig.tight_layout()
    out = RESULTS / "bench.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    line = {"png": str(out.relative_to(RESULTS.parents[1])),
            "panels": [name for name, _ in panels] + (["balance"] if has_balance else [])}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
