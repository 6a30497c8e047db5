"""How good are the microbatch plans? `plan_microbatches` vs a sorted-greedy baseline.

2048 samples of each length mix (bench/common.py, up to 8192 tokens), 8 DP ranks, a cap
of 16384 tokens per microbatch. Per plan:

    max_over_lower_bound  microbatches per rank / the plan-free lower bound
                          max(ceil(tokens / (ranks x cap)), ceil(#samples over cap/2 / ranks))
    over_cap              microbatches holding more than the cap (must be 0)
    imbalance             max rank tokens / mean rank tokens (DP balance)
    lockstep_over_ideal   sum over microbatch index i of the slowest rank's tokens at i,
                          over tokens / ranks: what a lockstep step costs against perfect balance
    ms                    planning time

The baseline (written here): longest first to the rank with the fewest tokens, then per
rank first-fit-decreasing into capped microbatches, ranks padded with empty microbatches
to the same count, heaviest first. The last line is the project planner's worst case over
the mixes (and the baseline's beside it).

    python bench/planner.py [--quick]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIXES, emit, lengths, quick_flag, setup  # noqa: E402

SAMPLES, RANKS, CAP, MAX_LEN = 2048, 8, 16384, 8192


def sorted_greedy(lens: list[int], cap: int, ranks: int) -> list[list[list[int]]]:
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    per_rank: list[list[int]] = [[] for _ in range(ranks)]
    totals = [0] * ranks
    for i in order:
        r = min(range(ranks), key=lambda k: (totals[k], k))
        per_rank[r].append(i)
        totals[r] += lens[i]
    plan = []
    for items in per_rank:  # longest first already
        bins: list[list[int]] = []
        sums: list[int] = []
        for i in items:
            b = next((b for b, s in enumerate(sums) if s + lens[i] <= cap), None)
            if b is None:
                bins.append([])
                sums.append(0)
                b = len(bins) - 1
            bins[b].append(i)
            sums[b] += lens[i]
        plan.append(sorted(bins, key=lambda mb: -sum(lens[i] for i in mb)))
    m = max(len(p) for p in plan)
    return [p + [[] for _ in range(m - len(p))] for p in plan]


def figures(plan, lens: list[int], cap: int, seconds: float) -> dict:
    ranks = len(plan)
    m = max(len(p) for p in plan)
    if any(len(p) != m for p in plan):
        raise AssertionError("ranks have different microbatch counts: lockstep would hang")
    tok = [[sum(lens[i] for i in mb) for mb in p] for p in plan]
    total = sum(lens)
    bound = max(math.ceil(total / (ranks * cap)), math.ceil(sum(1 for x in lens if 2 * x > cap) / ranks))
    rank_tokens = [sum(t) for t in tok]
    lockstep = sum(max(tok[r][i] for r in range(ranks)) for i in range(m))
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(len(lens))), "a sample lost or repeated"
    return {"microbatches": m, "lower_bound": bound, "max_over_lower_bound": m / bound,
            "over_cap": sum(t > cap for row in tok for t in row),
            "imbalance": max(rank_tokens) / (total / ranks), "lockstep_over_ideal": lockstep / (total / ranks),
            "ms": seconds * 1e3}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> dict:
    args = quick_flag(__doc__.splitlines()[0]).parse_args()
    setup(args)
    from packing.planner import plan_microbatches

    n = SAMPLES // 4 if args.quick else SAMPLES
    per_mix = {}
    for mix in MIXES:
        lens = lengths(mix, n, seed=0, max_len=MAX_LEN)
        ours, t_ours = timed(lambda: plan_microbatches(lens, max_tokens=CAP, dp_size=RANKS))
        base, t_base = timed(lambda: sorted_greedy(lens, CAP, RANKS))
        per_mix[mix] = {"tokens": sum(lens), "planner": figures(ours, lens, CAP, t_ours),
                        "sorted_greedy": figures(base, lens, CAP, t_base)}
        for name in ("planner", "sorted_greedy"):
            f = per_mix[mix][name]
            print(f"{mix:>9} {name:>13}: {f['microbatches']} microbatches/rank (bound {f['lower_bound']}), "
                  f"over cap {f['over_cap']}, DP imbalance {f['imbalance']:.6f}, "
                  f"lockstep/ideal {f['lockstep_over_ideal']:.4f}, {f['ms']:.1f} ms")

    def worst(name: str, key: str):
        return max(r[name][key] for r in per_mix.values())

    keys = ("max_over_lower_bound", "over_cap", "imbalance", "lockstep_over_ideal", "ms")
    summary = {k: round(worst("planner", k), 6) for k in keys}
    summary.update({f"baseline_{k}": round(worst("sorted_greedy", k), 6) for k in keys})
    return emit("planner", {**summary, "samples": n, "ranks": RANKS, "cap": CAP, "quick": args.quick},
                {"per_mix": per_mix})


if __name__ == "__main__":
    main()
