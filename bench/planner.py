"""How good are the microbatch plans? `plan_microbatches` vs simpler balancers, by tokens and by FLOPs.

Tokens. 2048 samples of each length mix (bench/common.py, up to 8192 tokens), 8 DP ranks, a
cap of 16384 tokens per microbatch. Per plan:

    max_over_lower_bound  microbatches per rank / the plan-free lower bound
                          max(ceil(tokens / (ranks x cap)), ceil(#samples over cap/2 / ranks))
    over_cap              microbatches holding more than the cap (must be 0)
    imbalance             max rank tokens / mean rank tokens (DP balance)
    lockstep_over_ideal   sum over microbatch index i of the slowest rank's tokens at i,
                          over tokens / ranks: what a lockstep step costs against perfect balance
    ms                    planning time

The baseline (written here): longest first to the rank with the fewest tokens, then per
rank first-fit-decreasing into capped microbatches, ranks padded with empty microbatches
to the same count, heaviest first.

FLOPs. The same mixes up to 32768 tokens (2048 samples, 8 ranks, cap 65536: twice the
longest sample, as above), each sample costing `flop_cost(QWEN3_8B)` (Qwen3-8B's shape,
written out below; forward + backward ~4.5e10 FLOPs per token plus ~8.8e5 x tokens^2 for
causal attention, so a 32k sample costs 1.64x its tokens' worth). Three planners:

    tokens   plan_microbatches(lengths, cap, ranks): balances tokens
    flops    plan_microbatches(..., cost=flop_cost(QWEN3_8B)): balances FLOPs, cap kept
    verl     verl-style workload balancing (written here from its described mechanism):
             equal-count DP split by workload, every rank's microbatch count
             max ceil(rank tokens / cap), each rank split into that many microbatches by
             workload (KK), the cap not looked at again; workload = the same FLOP cost

    flop_lockstep_over_ideal  sum over microbatch index i of the costliest rank's FLOPs at i,
                              over FLOPs / ranks (what a lockstep step costs vs perfect balance)
    over_cap                  microbatches over the cap

Measured. 4 gloo ranks on 127.0.0.1 (one thread each) run their microbatches forward and
backward through a small decoder (`TINY`: 1 layer, hidden 256, 2 heads of 64, SwiGLU 512,
vocab 512; causal `scaled_dot_product_attention` per sample, so an 8k sample's attention
is ~1.6x its linear work) on 64 lognormal samples up to 8192 tokens (cap 16384), planned
by tokens and by `flop_cost(TINY)`. Each rank's process CPU time per microbatch (the 4
processes share the cores, so wall time says nothing; one thread's CPU time does), the
median of the repeats:

    step_spread_{tokens,flops}    slowest rank's total / mean rank total
    step_lockstep_{tokens,flops}  sum over microbatch i of the slowest rank's time at i,
                                  over the mean rank total (what lockstep execution costs)

The last line holds the project planner's worst case over the mixes (token bench; `over_cap`
counts the FLOP-aware plans too), the baseline's beside it, the FLOP figures per planner and
the measured spreads.

    python bench/planner.py [--quick] [--no-measure]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIXES, emit, lengths, quick_flag, setup  # noqa: E402  (common puts the repo root on sys.path)

import torch  # noqa: E402

from packing.flops import flop_cost  # noqa: E402
from packing.partition import karmarkar_karp  # noqa: E402
from packing.planner import lockstep_cost, plan_microbatches  # noqa: E402

SAMPLES, RANKS, CAP, MAX_LEN = 2048, 8, 16384, 8192
LONG_MAX_LEN, LONG_CAP = 32768, 65536

# Qwen3-8B's config.json values (the fields flop_cost reads); nothing is downloaded.
QWEN3_8B = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936)

# The measured run: a decoder small enough for 4 ranks on 2 cores, attention-heavy at 8k.
TINY = dict(num_hidden_layers=1, hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=512)
MEASURE_RANKS, MEASURE_MIX, MEASURE_SAMPLES, MEASURE_MAX_LEN, MEASURE_CAP = 4, "lognormal", 64, 8192, 16384


# ----------------------------------------------------------------- other planners


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


def verl_style(lens: list[int], cap: int, ranks: int, workload) -> list[list[list[int]]]:
    """verl's workload balancing as described (written here, not copied): the step split
    across DP ranks in equal counts by workload, one microbatch count for every rank (the
    most any rank needs by tokens), each rank's samples split into that many microbatches
    by workload. Nothing checks the cap after the split."""
    w = [workload(x) for x in lens]
    per_rank = karmarkar_karp(w, ranks, equal_size=True)
    m = max(max(1, math.ceil(sum(lens[i] for i in r) / cap)) for r in per_rank)
    plan = []
    for items in per_rank:
        parts = [[items[j] for j in p] for p in karmarkar_karp([w[i] for i in items], m)]
        plan.append(sorted(parts, key=lambda mb: -sum(w[i] for i in mb)))
    return plan


# ------------------------------------------------------------------------ figures


def check_plan(plan, n: int) -> int:
    m = max(len(p) for p in plan)
    if any(len(p) != m for p in plan):
        raise AssertionError("ranks have different microbatch counts: lockstep would hang")
    assert sorted(i for p in plan for mb in p for i in mb) == list(range(n)), "a sample lost or repeated"
    return m


def figures(plan, lens: list[int], cap: int, seconds: float) -> dict:
    ranks = len(plan)
    m = check_plan(plan, len(lens))
    tok = [[sum(lens[i] for i in mb) for mb in p] for p in plan]
    total = sum(lens)
    bound = max(math.ceil(total / (ranks * cap)), math.ceil(sum(1 for x in lens if 2 * x > cap) / ranks))
    rank_tokens = [sum(t) for t in tok]
    lockstep = sum(max(tok[r][i] for r in range(ranks)) for i in range(m))
    return {"microbatches": m, "lower_bound": bound, "max_over_lower_bound": m / bound,
            "over_cap": sum(t > cap for row in tok for t in row),
            "imbalance": max(rank_tokens) / (total / ranks), "lockstep_over_ideal": lockstep / (total / ranks),
            "ms": seconds * 1e3}


def flop_figures(plan, lens: list[int], cap: int, flops: list[float], seconds: float) -> dict:
    ranks = len(plan)
    m = check_plan(plan, len(lens))
    cost = [[sum(flops[i] for i in mb) for mb in p] for p in plan]
    ideal = sum(flops) / ranks
    # Written out here rather than taken from the planner, so the bench checks it.
    lockstep = sum(max(cost[r][i] for r in range(ranks)) for i in range(m))
    assert math.isclose(lockstep, lockstep_cost(plan, flops), rel_tol=1e-9)
    return {"microbatches": m, "flop_lockstep_over_ideal": lockstep / ideal,
            "flop_imbalance": max(sum(c) for c in cost) / ideal,
            "over_cap": sum(sum(lens[i] for i in mb) > cap for p in plan for mb in p), "ms": seconds * 1e3}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# ----------------------------------------------------------------- measured spread


class TinyDecoder(torch.nn.Module):
    """The matmuls `flop_cost` counts: per layer q, k, v, o projections, a SwiGLU MLP and
    causal attention within each sample of the packed microbatch; then an LM head."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, heads, kv, hd, inter = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                    "head_dim", "intermediate_size"))
        self.heads, self.kv, self.hd = heads, kv, hd

        def linear(i: int, o: int) -> torch.nn.Linear:
            return torch.nn.Linear(i, o, bias=False)

        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(q=linear(d, heads * hd), k=linear(d, kv * hd), v=linear(d, kv * hd),
                                     o=linear(heads * hd, d), gate=linear(d, inter), up=linear(d, inter),
                                     down=linear(inter, d)))
            for _ in range(cfg["num_hidden_layers"]))
        self.head = linear(d, cfg["vocab_size"])

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """x [N, d] packed, seq_lens summing to N -> logits [N, vocab]."""
        for layer in self.layers:
            q, k, v = layer["q"](x), layer["k"](x), layer["v"](x)
            out = []
            for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
                t = qs.shape[0]
                a = torch.nn.functional.scaled_dot_product_attention(
                    qs.view(1, t, self.heads, self.hd).transpose(1, 2), ks.view(1, t, self.kv, self.hd).transpose(1, 2),
                    vs.view(1, t, self.kv, self.hd).transpose(1, 2), is_causal=True, enable_gqa=self.kv != self.heads)
                out.append(a.transpose(1, 2).reshape(t, self.heads * self.hd))
            x = x + layer["o"](torch.cat(out))
            x = x + layer["down"](torch.nn.functional.silu(layer["gate"](x)) * layer["up"](x))
        return self.head(x)


def measure_rank(rank: int, world: int, lens: list[int], plans: dict, repeats: int) -> dict:
    """CPU seconds of each of this rank's microbatches (forward + backward), per plan, per repeat."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = TinyDecoder(TINY)
    gen = torch.Generator().manual_seed(rank)
    x_warm = torch.randn(256, TINY["hidden_size"], generator=gen)
    model(x_warm, [128, 128]).square().mean().backward()  # first-call set-up out of the timings
    times: dict[str, list[list[float]]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, plan in plans.items():  # interleaved, so a slow spell hits both plans
            model.zero_grad(set_to_none=True)
            dist.barrier()  # all ranks run the same plan at the same time
            run = []
            for mb in plan[rank]:
                seq = [lens[i] for i in mb]
                if not seq:
                    run.append(0.0)
                    continue
                x = torch.randn(sum(seq), TINY["hidden_size"], generator=gen)
                start = time.process_time()
                model(x, seq).square().mean().backward()
                run.append(time.process_time() - start)
            times[name].append(run)
    return times


def measure_spread(repeats: int) -> dict:
    from testing.distributed import run_distributed

    lens = lengths(MEASURE_MIX, MEASURE_SAMPLES, seed=0, max_len=MEASURE_MAX_LEN)
    cost = flop_cost(TINY)
    flops = [cost(x) for x in lens]
    plans = {"tokens": plan_microbatches(lens, MEASURE_CAP, MEASURE_RANKS),
             "flops": plan_microbatches(lens, MEASURE_CAP, MEASURE_RANKS, cost=cost)}
    per_rank = run_distributed(measure_rank, MEASURE_RANKS, lens, plans, repeats, timeout=900, threads=1)
    out = {"samples": len(lens), "tokens": sum(lens), "max_len": max(lens),
           "samples_over_7k": sum(x > 7000 for x in lens), "ranks": MEASURE_RANKS, "cap": MEASURE_CAP,
           "repeats": repeats}
    for name, plan in plans.items():
        # [rank][microbatch] median over the repeats
        t = [[statistics.median(run[i] for run in per_rank[r][name]) for i in range(len(plan[r]))]
             for r in range(MEASURE_RANKS)]
        totals = [sum(row) for row in t]
        mean = sum(totals) / len(totals)
        steps = len(plan[0])
        model_cost = [sum(sum(flops[i] for i in mb) for mb in plan[r]) for r in range(MEASURE_RANKS)]
        out[name] = {
            "microbatches": steps, "rank_cpu_s": [round(x, 3) for x in totals],
            "spread": max(totals) / mean,
            "lockstep": sum(max(t[r][i] for r in range(MEASURE_RANKS)) for i in range(steps)) / mean,
            "predicted_spread": max(model_cost) / (sum(flops) / MEASURE_RANKS),
            "predicted_lockstep": lockstep_cost(plan, flops) / (sum(flops) / MEASURE_RANKS),
            "gflops_per_cpu_s": sum(flops) / sum(totals) / 1e9,
        }
        print(f"measured {name:>6}: {steps} microbatches/rank, rank CPU s {out[name]['rank_cpu_s']}, "
              f"spread {out[name]['spread']:.3f} (model {out[name]['predicted_spread']:.3f}), "
              f"lockstep {out[name]['lockstep']:.3f} (model {out[name]['predicted_lockstep']:.3f})")
    return out


# -------------------------------------------------------------------------- main


def main() -> dict:
    parser = quick_flag(__doc__.splitlines()[0])
    parser.add_argument("--no-measure", action="store_true", help="skip the measured 4-rank step-time spread")
    args = parser.parse_args()
    setup(args)

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

    cost = flop_cost(QWEN3_8B)
    per_long_mix = {}
    for mix in MIXES:
        lens = lengths(mix, n, seed=0, max_len=LONG_MAX_LEN)
        flops = [cost(x) for x in lens]
        planners = {"tokens": lambda: plan_microbatches(lens, LONG_CAP, RANKS),
                    "flops": lambda: plan_microbatches(lens, LONG_CAP, RANKS, cost=cost),
                    "verl": lambda: verl_style(lens, LONG_CAP, RANKS, cost)}
        per_long_mix[mix] = {"tokens": sum(lens), "flops": sum(flops)}
        for name, fn in planners.items():
            plan, seconds = timed(fn)
            f = per_long_mix[mix][name] = flop_figures(plan, lens, LONG_CAP, flops, seconds)
            print(f"{mix:>9} {name:>6} (32k, FLOPs): {f['microbatches']} microbatches/rank, over cap {f['over_cap']}, "
                  f"FLOP DP imbalance {f['flop_imbalance']:.4f}, "
                  f"FLOP lockstep/ideal {f['flop_lockstep_over_ideal']:.4f}, {f['ms']:.1f} ms")

    def worst(table: dict, name: str, key: str):
        return max(r[name][key] for r in table.values())

    keys = ("max_over_lower_bound", "over_cap", "imbalance", "lockstep_over_ideal", "ms")
    summary = {k: round(worst(per_mix, "planner", k), 6) for k in keys}
    summary["over_cap"] = max(summary["over_cap"], worst(per_long_mix, "flops", "over_cap"))
    summary.update({f"baseline_{k}": round(worst(per_mix, "sorted_greedy", k), 6) for k in keys})
    modes = ("tokens", "flops", "verl")
    summary["flop_lockstep_over_ideal"] = {m: round(worst(per_long_mix, m, "flop_lockstep_over_ideal"), 6)
                                           for m in modes}
    summary["flop_over_cap"] = {m: worst(per_long_mix, m, "over_cap") for m in modes}
    summary["flop_ms"] = round(worst(per_long_mix, "flops", "ms"), 3)
    details = {"per_mix": per_mix, "per_long_mix": per_long_mix,
               "flop_cost": {**dataclasses.asdict(cost), "config": QWEN3_8B}}
    if not args.no_measure:
        measured = measure_spread(repeats=1 if args.quick else 3)
        details["measured"] = measured
        for name in ("tokens", "flops"):
            summary[f"step_spread_{name}"] = round(measured[name]["spread"], 4)
            summary[f"step_lockstep_{name}"] = round(measured[name]["lockstep"], 4)
    return emit("planner", {**summary, "samples": n, "ranks": RANKS, "cap": CAP, "long_cap": LONG_CAP,
                            "quick": args.quick}, details)


if __name__ == "__main__":
    main()
