"""The microbatch planner: equal microbatch counts per DP rank, token cap, KK balance."""

import hashlib
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packing.flops import FlopCost, flop_cost
from packing.partition import karmarkar_karp, tokens as _tokens
from packing.planner import lockstep_cost, microbatch_cost, plan_microbatches

PLANNER = Path(__file__).resolve().parents[1] / "packing" / "planner.py"
FLOPS = PLANNER.with_name("flops.py")
PARTITION = PLANNER.with_name("partition.py")
CAP, DP = 8192, 8


def long_tail(n: int, seed: int = 0) -> list[int]:
    """RL-rollout-like lengths: lognormal (median ~500 tokens), clipped to [16, 4096]."""
    rng = random.Random(seed)
    return [min(4096, max(16, round(rng.lognormvariate(6.2, 1.0)))) for _ in range(n)]


def tokens(indices, lengths) -> int:
    return sum(lengths[i] for i in indices)


def imbalance(groups: list[list[int]], lengths) -> float:
    totals = [tokens(g, lengths) for g in groups]
    return max(totals) / (sum(totals) / len(totals))


def spread(groups: list[list[int]], weights) -> int:
    totals = [tokens(g, weights) for g in groups]
    return max(totals) - min(totals)


def assert_valid(plan, lengths, dp_size, cap=None):
    """Every rank has the same count m, every sample once, cap held, empties only if forced."""
    assert len(plan) == dp_size
    m = len(plan[0])
    assert m >= 1
    assert all(len(rank) == m for rank in plan)
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    for rank in plan:
        if sum(len(mb) for mb in rank) >= m:
            assert all(rank), "a rank with enough samples got an empty microbatch"
        if cap is not None:
            assert all(tokens(mb, lengths) <= cap for mb in rank)
    return m


# ---------------------------------------------------------------- token-budget mode


@st.composite
def budget_case(draw):
    dp = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, 512), min_size=dp, max_size=300))
    cap = draw(st.integers(max(lengths), 4 * max(lengths)))
    return lengths, cap, dp


@settings(max_examples=50, deadline=None)
@given(budget_case())
def test_budget_mode_invariants(case):
    lengths, cap, dp = case
    plan = plan_microbatches(lengths, cap, dp)
    m = assert_valid(plan, lengths, dp, cap)
    # Never more steps than one-sample-per-microbatch on the fullest rank would need.
    assert m <= max(sum(len(mb) for mb in rank) for rank in plan)


def plan_stats(plan, lengths) -> dict:
    """Summary figures of a plan (what bench/planner.py reports, for assertions here)."""
    rank_tokens = [sum(_tokens(mb, lengths) for mb in rank) for rank in plan]
    mean = sum(rank_tokens) / len(rank_tokens)
    return {
        "microbatches_per_rank": max(len(rank) for rank in plan),
        "rank_tokens": rank_tokens,
        "dp_imbalance": max(rank_tokens) / mean if mean else 1.0,
        "max_microbatch_tokens": max((_tokens(mb, lengths) for rank in plan for mb in rank), default=0),
        "empty_microbatches": sum(1 for rank in plan for mb in rank if not mb),
    }


@pytest.mark.parametrize("n", [1024, 4096])
def test_long_tail_microbatch_count_and_dp_balance(n):
    lengths = long_tail(n)
    plan = plan_microbatches(lengths, CAP, DP)
    m = assert_valid(plan, lengths, DP, CAP)
    stats = plan_stats(plan, lengths)
    assert m <= math.ceil(sum(lengths) / (CAP * DP)) + 1
    assert stats["dp_imbalance"] <= 1.02
    assert stats["empty_microbatches"] == 0
    # Microbatch i runs in lockstep on every rank, so step i should be even across ranks.
    for i in range(m):
        assert imbalance([rank[i] for rank in plan], lengths) <= 1.05


def test_naive_contiguous_split_fails_the_balance_bound():
    # The control for the 1.02 threshold: equal-count contiguous chunks (what a plain
    # DistributedSampler without shuffling gives) are far off on the same mix.
    lengths = long_tail(1024)
    per_rank = len(lengths) // DP
    naive = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(DP)]
    planned = [[i for mb in rank for i in mb] for rank in plan_microbatches(lengths, CAP, DP)]
    assert imbalance(naive, lengths) > 1.02
    assert imbalance(naive, lengths) > imbalance(planned, lengths)


def test_deterministic_and_input_type_independent():
    lengths = long_tail(1024, seed=3)
    first = plan_microbatches(lengths, CAP, DP)
    assert plan_microbatches(lengths, CAP, DP) == first
    assert plan_microbatches(tuple(lengths), CAP, DP) == first
    # Built from a dict and a set-derived key order: the values, not the container, decide.
    by_key = {f"sample-{i}": x for i, x in enumerate(lengths)}
    assert plan_microbatches(list(by_key.values()), CAP, DP) == first


def plans_in_fresh_processes(body: str) -> list:
    """Run `body` (Python that prints the plans as JSON, with the planner loaded by path as `p`,
    and packing/partition.py under its name, so the child does not pay for importing torch via
    `packing`) under three PYTHONHASHSEEDs: set and dict-of-str order changes with the seed, the
    plans must not. Returns the plans."""
    script = ("import importlib.util, json, random, sys\n"
              "def load(name, path):\n"
              "    spec = importlib.util.spec_from_file_location(name, path)\n"
              "    module = sys.modules[name] = importlib.util.module_from_spec(spec)\n"
              "    spec.loader.exec_module(module)\n"
              "    return module\n"
              f"load('packing.partition', {str(PARTITION)!r})\n"  # what the planner imports, by its name
              f"p = load('planner', {str(PLANNER)!r})\n"
              f"f = load('flops', {str(FLOPS)!r})\n" + body)
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        outputs.add(run.stdout)
    assert len(outputs) == 1
    return json.loads(outputs.pop())


def test_independent_of_hash_seed():
    assert plans_in_fresh_processes(
        "rng = random.Random(5)\n"
        "lengths = [rng.randint(1, 4096) for _ in range(512)]\n"
        "plans = [p.plan_microbatches(lengths, 8192, 4), p.plan_microbatches(lengths, None, 4, micro_batch_size=16)]\n"
        "print(json.dumps(plans))\n"
    )


def test_fast_for_4096_samples():
    lengths = long_tail(4096, seed=1)
    start = time.perf_counter()
    plan_microbatches(lengths, CAP, DP)
    assert time.perf_counter() - start < 2.0  # typically ~0.03 s; loose for loaded CI


def test_over_cap_sample_is_named():
    lengths = [100, 200, 9000, 50]
    with pytest.raises(ValueError, match=r"sample 2 has 9000 tokens.*max_tokens = 8192"):
        plan_microbatches(lengths, 8192, 2)


def test_short_rank_gets_samples_moved_instead_of_empty_microbatches():
    # KK alone gives {8000} | {4000, 4000, 100}: two microbatches needed on one rank but
    # a single sample on the other. Moving the short sample fixes it (and even lowers m).
    lengths = [8000, 4000, 4000, 100]
    plan = plan_microbatches(lengths, 8192, 2)
    assert_valid(plan, lengths, 2, 8192)
    assert plan_stats(plan, lengths)["empty_microbatches"] == 0


def test_unavoidable_empty_microbatch_is_padded_at_the_end():
    # Three samples that can't share: one rank needs 2 microbatches, the other has 1 sample.
    lengths = [5000, 5000, 5000]
    plan = plan_microbatches(lengths, 8192, 2)
    assert_valid(plan, lengths, 2, 8192)
    assert all(len(rank) == 2 for rank in plan)
    short = [rank for rank in plan if not all(rank)]
    assert len(short) == 1 and short[0][0] and short[0][1] == []


def test_microbatches_ordered_heaviest_first():
    lengths = long_tail(1024, seed=2)
    for rank in plan_microbatches(lengths, CAP, DP):
        totals = [tokens(mb, lengths) for mb in rank]
        assert totals == sorted(totals, reverse=True)
        assert all(mb == sorted(mb) for mb in rank)


# -------------------------------------------------------------------- fixed mode


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.data())
def test_fixed_mode_counts(dp, mbs, data):
    lengths = data.draw(st.lists(st.integers(1, 512), min_size=dp, max_size=300))
    if mbs == 1:  # uneven rank counts can't give equal step counts at one sample per step
        lengths = lengths[: len(lengths) - len(lengths) % dp]
    plan = plan_microbatches(lengths, dp_size=dp, micro_batch_size=mbs)
    m = assert_valid(plan, lengths, dp)
    counts = [sum(len(mb) for mb in rank) for rank in plan]
    assert max(counts) - min(counts) <= 1
    assert m == math.ceil(max(counts) / mbs)
    assert all(1 <= len(mb) <= mbs for rank in plan for mb in rank)


def test_fixed_mode_exact_chunks():
    lengths = list(range(1, 33))
    plan = plan_microbatches(lengths, dp_size=4, micro_batch_size=2)
    assert [[len(mb) for mb in rank] for rank in plan] == [[2] * 4] * 4
    # The last microbatch may be smaller when the count doesn't divide.
    plan = plan_microbatches(list(range(1, 11)), dp_size=2, micro_batch_size=2)
    assert [[len(mb) for mb in rank] for rank in plan] == [[2, 2, 1]] * 2


def test_fixed_mode_balances_tokens_across_ranks():
    lengths = long_tail(1024)
    plan = plan_microbatches(lengths, dp_size=DP, micro_batch_size=16)
    assert imbalance([[i for mb in rank for i in mb] for rank in plan], lengths) <= 1.02


def test_fixed_mode_impossible_counts_raise():
    # 9 samples, 2 ranks, 1 per microbatch: 5 steps on one rank, 4 samples on the other.
    with pytest.raises(ValueError, match=r"\[5, 4\]"):
        plan_microbatches([10] * 9, dp_size=2, micro_batch_size=1)


def test_fixed_mode_checks_the_cap():
    lengths = [3000, 3000, 3000, 3000]
    assert_valid(plan_microbatches(lengths, 6000, 2, micro_batch_size=2), lengths, 2, 6000)
    with pytest.raises(ValueError, match=r"rank \d microbatch 0 .*6000 tokens.*max_tokens = 5000"):
        plan_microbatches(lengths, 5000, 2, micro_batch_size=2)


# -------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        (([], 100, 1), {}, "lengths is empty"),
        (([5, 0, 3], 100, 1), {}, r"lengths\[1\] = 0"),
        (([5, -2], 100, 1), {}, r"lengths\[1\] = -2"),
        (([5, 3], 0, 1), {}, "max_tokens must be >= 1, got 0"),
        (([5, 3], -5, 1), {}, "max_tokens must be >= 1, got -5"),
        (([5, 3], 100, 0), {}, "dp_size must be >= 1, got 0"),
        (([5, 3],), {}, "got neither"),
        (([5, 3], None, 1), {"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
        (([5, 3], 100, 3), {}, r"len\(lengths\) = 2 < dp_size = 3"),
        (([5, 3], None, 3), {"micro_batch_size": 1}, r"len\(lengths\) = 2 < dp_size = 3"),
    ],
)
def test_validation_errors(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_microbatches(*args, **kwargs)


def test_non_integer_length_is_a_type_error():
    with pytest.raises(TypeError, match=r"lengths\[1\]"):
        plan_microbatches([5, 2.5], 100)


# ------------------------------------------------------------------ KK and stats


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=200), st.integers(1, 16), st.booleans())
def test_karmarkar_karp_partitions(weights, k, equal_size):
    parts = karmarkar_karp(weights, k, equal_size=equal_size)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    if len(weights) >= k:
        assert all(parts)
    if equal_size:
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # Each LDM merge's spread is at most the larger of its inputs', so by induction the
    # final spread is at most the heaviest single item.
    assert spread(parts, weights) <= max(weights, default=0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [2, 3, 8])
def test_karmarkar_karp_beats_round_robin(seed, k):
    weights = long_tail(256, seed)
    round_robin = [list(range(r, len(weights), k)) for r in range(k)]
    assert spread(karmarkar_karp(weights, k), weights) <= spread(round_robin, weights)
    assert spread(karmarkar_karp(weights, k, equal_size=True), weights) <= spread(round_robin, weights)


def test_karmarkar_karp_small_cases():
    assert karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([7], 2) == [[0], []]
    # The textbook LDM instance: 8-7, 6-5, then 4-1-1 leaves a difference of 2.
    assert spread(karmarkar_karp([4, 5, 6, 7, 8], 2), [4, 5, 6, 7, 8]) == 2
    with pytest.raises(ValueError, match="k must be >= 1"):
        karmarkar_karp([1, 2], 0)


def test_plan_stats():
    lengths = [100, 200, 300, 400]
    plan = [[[3], [0]], [[2], [1]]]
    assert plan_stats(plan, lengths) == {
        "microbatches_per_rank": 2,
        "rank_tokens": [500, 500],
        "dp_imbalance": 1.0,
        "max_microbatch_tokens": 400,
        "empty_microbatches": 0,
    }


# -------------------------------------------------------------------- cost mode

# Qwen3-8B's shape (its config.json values): forward + backward ~4.5e10 FLOPs per token,
# and a 32k-token sample's attention adds ~64% on top of its linear work.
QWEN3_8B = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, vocab_size=151936)
LONG_CAP = 65536


def long_tail_32k(n: int, seed: int = 0) -> list[int]:
    """Long-context rollouts: lognormal (median ~3k tokens), clipped to [16, 32768]."""
    rng = random.Random(seed)
    return [min(32768, max(16, round(rng.lognormvariate(8.0, 1.0)))) for _ in range(n)]


def lockstep_over_ideal(plan, costs) -> float:
    """Sum over microbatch steps of the costliest rank's microbatch, over cost / ranks
    (written out here, not the planner's `lockstep_cost`, which is checked against it)."""
    steps = len(plan[0])
    worst = sum(max(sum(costs[i] for i in rank[s]) for rank in plan) for s in range(steps))
    return worst / (sum(costs) / len(plan))


def test_flop_cost_of_a_dense_config_by_hand():
    cfg = SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=4, intermediate_size=16, vocab_size=10)
    # Per layer: q and o 8x8 each, k and v 8x4 each, gate/up/down 8x16 each; then the head 8x10.
    per_layer = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16
    assert per_layer == 576
    cost = flop_cost(cfg)
    assert cost == FlopCost(linear=6 * (2 * 576 + 80), attention=6 * 2 * 2 * 4)
    assert cost(10) == 6 * 1232 * 10 + 96 * 100
    # A mapping reads the same; head_dim defaults to hidden / heads; a VLM's text_config is used.
    assert flop_cost(vars(cfg)) == cost
    assert flop_cost({**vars(cfg), "head_dim": None}) == cost  # 8 / 2 = 4 again
    assert flop_cost(SimpleNamespace(text_config=cfg, vision_config=None)) == cost
    with pytest.raises(ValueError, match="no 'vocab_size'"):
        flop_cost({k: v for k, v in vars(cfg).items() if k != "vocab_size"})


def test_flop_cost_of_moe_counts_active_experts_not_all():
    dense = dict(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, head_dim=4, intermediate_size=16,
                 vocab_size=10)
    moe = {**dense, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "num_experts": 8}
    attention = 2 * 8 * 8 + 2 * 8 * 8  # q, o, k, v (no GQA here)
    experts, router = 3 * 8 * (2 * 6), 8 * 8
    assert flop_cost(moe).linear == 6 * (2 * (attention + experts + router) + 80)
    # Eight times the experts: only the router grows, not the MLP work per token.
    more = flop_cost({**moe, "num_experts": 64}).linear - flop_cost(moe).linear
    assert more == 6 * 2 * 8 * (64 - 8)
    assert more < 0.1 * 6 * 2 * 3 * 8 * 6 * (64 - 8)  # what counting every expert would add
    # Shared experts (Qwen2-MoE's size, DeepSeek's count) are active for every token.
    base = flop_cost(moe).linear
    assert flop_cost({**moe, "shared_expert_intermediate_size": 12}).linear - base == 6 * 2 * 3 * 8 * 12
    assert flop_cost({**moe, "n_shared_experts": 1}).linear - base == 6 * 2 * 3 * 8 * 6
    # Attention does not depend on the MLP.
    assert flop_cost(moe).attention == flop_cost(dense).attention == 6 * 2 * 2 * 4


def test_flop_cost_of_qwen3_8b():
    cost = flop_cost(QWEN3_8B)
    # ~7.6e9 matmul weights (6.95e9 in the layers, 0.62e9 in the head) -> ~4.5e10 FLOPs per token.
    assert 4.4e10 < cost.linear < 4.6e10
    assert cost.attention == 6 * 36 * 32 * 128
    assert 0.6 < cost.attention * 32768 / cost.linear < 0.7  # a 32k sample: attention ~64% of linear


@st.composite
def long_tail_case(draw):
    dp = draw(st.integers(1, 8))
    # Powers of two times a jitter: mostly short samples, some up to 8k.
    length = st.builds(lambda e, f: max(1, round(2**e * f)), st.integers(0, 13), st.floats(0.5, 1.0))
    lengths = draw(st.lists(length, min_size=dp, max_size=200))
    cap = draw(st.integers(max(lengths), 3 * max(lengths)))
    attention = draw(st.sampled_from([0.0, 1e-3, 1.0, 50.0]))  # none .. attention-dominated
    return lengths, cap, dp, FlopCost(linear=1.0, attention=attention)


@settings(max_examples=40, deadline=None)
@given(long_tail_case())
def test_cost_mode_invariants_and_never_worse_than_tokens(case):
    lengths, cap, dp, cost = case
    plan = plan_microbatches(lengths, cap, dp, cost=cost)
    assert_valid(plan, lengths, dp, cap)  # equal counts, every sample once, cap held
    costs = [cost(x) for x in lengths]
    assert lockstep_cost(plan, costs) == pytest.approx(lockstep_over_ideal(plan, costs) * sum(costs) / dp)
    assert all(
        [sum(costs[i] for i in mb) for mb in rank] == sorted((sum(costs[i] for i in mb) for mb in rank), reverse=True)
        for rank in plan
    ), "microbatches not costliest first"
    tokens_plan = plan_microbatches(lengths, cap, dp)
    assert lockstep_over_ideal(plan, costs) <= lockstep_over_ideal(tokens_plan, costs) * (1 + 1e-9)


def bimodal_32k(n: int, seed: int = 0) -> list[int]:
    """A quarter of the rollouts run into a 32k limit; the rest are short answers (~1k)."""
    rng = random.Random(seed)
    return [rng.randint(29000, 32768) if rng.random() < 0.25 else max(16, round(rng.lognormvariate(7.0, 0.7)))
            for _ in range(n)]


def test_cost_mode_keeps_the_cap_where_workload_splitting_breaks_it():
    lengths = bimodal_32k(512, seed=1)
    cost = flop_cost(QWEN3_8B)
    costs = [cost(x) for x in lengths]
    assert_valid(plan_microbatches(lengths, LONG_CAP, DP, cost=cost), lengths, DP, LONG_CAP)
    # Control, verl's workload balancing: ranks of equal counts by cost, each split by
    # cost alone into ceil(tokens / cap) microbatches. Short samples are cheap per token,
    # so the microbatches that hold them overrun the cap.
    over = 0
    for items in karmarkar_karp(costs, DP, equal_size=True):
        m = math.ceil(tokens(items, lengths) / LONG_CAP)
        parts = karmarkar_karp([costs[i] for i in items], m)
        over += sum(tokens([items[j] for j in p], lengths) > LONG_CAP for p in parts)
    assert over > 0


def test_flop_aware_lockstep_is_near_ideal_where_token_balance_is_not():
    lengths = long_tail_32k(512, seed=1)
    cost = flop_cost(QWEN3_8B)
    costs = [cost(x) for x in lengths]
    by_tokens = plan_microbatches(lengths, LONG_CAP, DP)
    by_flops = plan_microbatches(lengths, LONG_CAP, DP, cost=cost)
    assert len(by_flops[0]) <= len(by_tokens[0])  # not bought with more microbatches
    assert lockstep_over_ideal(by_flops, costs) <= 1.01
    # Control: balancing tokens leaves the long samples' attention uneven.
    assert lockstep_over_ideal(by_tokens, costs) > 1.05


def test_cost_none_plans_match_the_planner_before_cost_mode():
    # Digest of these plans from the planner as it was before `cost` existed (same inputs,
    # json of the plans): token and fixed mode must not have moved.
    plans = []
    for seed, dp in [(0, 1), (1, 3), (2, 8), (3, 16)]:
        lengths = long_tail(1024, seed)
        plans.append(plan_microbatches(lengths, 8192, dp))
        plans.append(plan_microbatches(lengths, 5000, dp, cost=None))
        plans.append(plan_microbatches(lengths, dp_size=dp, micro_batch_size=8))
    digest = hashlib.sha256(json.dumps(plans).encode()).hexdigest()
    assert digest == "6352a27551e5e6f2d8682fdb9abce9c00827c4e4cb8104e6218ffc4829367d36"


def test_cost_mode_deterministic_without_torch_and_hash_seed_independent():
    plans = plans_in_fresh_processes(
        "rng = random.Random(7)\n"
        "lengths = [min(32768, max(16, round(rng.lognormvariate(8.0, 1.0)))) for _ in range(256)]\n"
        "cost = f.flop_cost({'num_hidden_layers': 36, 'hidden_size': 4096, 'num_attention_heads': 32,\n"
        "                    'num_key_value_heads': 8, 'head_dim': 128, 'intermediate_size': 12288,\n"
        "                    'vocab_size': 151936})\n"
        "plans = [p.plan_microbatches(lengths, 65536, 8, cost=cost),\n"
        "         p.plan_microbatches(lengths, None, 8, micro_batch_size=8, cost=cost)]\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps(plans))\n"
    )
    lengths = long_tail_32k(4)  # different inputs: the in-process plan below must differ
    assert plans[0] != plan_microbatches(lengths, LONG_CAP, 2, cost=flop_cost(QWEN3_8B))
    # In process, with the same inputs, the plan is the subprocess's.
    rng = random.Random(7)
    same = [min(32768, max(16, round(rng.lognormvariate(8.0, 1.0)))) for _ in range(256)]
    assert plan_microbatches(same, LONG_CAP, 8, cost=flop_cost(vars(QWEN3_8B))) == plans[0]
    assert plan_microbatches(tuple(same), LONG_CAP, 8, cost=flop_cost(QWEN3_8B)) == plans[0]


def test_fixed_mode_with_cost_balances_cost_across_ranks():
    lengths = long_tail_32k(512, seed=2)
    cost = flop_cost(QWEN3_8B)
    costs = [cost(x) for x in lengths]
    by_flops = plan_microbatches(lengths, dp_size=DP, micro_batch_size=8, cost=cost)
    by_tokens = plan_microbatches(lengths, dp_size=DP, micro_batch_size=8)
    assert [len(r) for r in by_flops] == [len(r) for r in by_tokens]  # same slots
    flat = lambda plan: [[i for mb in rank for i in mb] for rank in plan]  # noqa: E731
    assert imbalance(flat(by_flops), costs) <= 1.001
    assert imbalance(flat(by_tokens), costs) > 1.004  # control: token balance is not cost balance


def test_lockstep_cost_by_hand():
    costs = [5.0, 1.0, 4.0, 2.0]
    plan = [[[0], [1]], [[2], [3]]]  # steps cost max(5, 4) + max(1, 2)
    assert lockstep_cost(plan, costs) == 7.0
    assert lockstep_cost([[[0, 1, 2, 3]]], costs) == 12.0


@pytest.mark.parametrize(
    "cost, pattern",
    [
        (lambda t: -1.0, r"cost\(lengths\[0\] = 5\) = -1.0 is negative"),
        (lambda t: float("nan"), r"cost\(lengths\[0\] = 5\) = nan is not finite"),
        (lambda t: "5", r"cost\(lengths\[0\] = 5\) must be a number"),
    ],
)
def test_bad_cost_values_are_named(cost, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        plan_microbatches([5, 3], 100, 1, cost=cost)


def test_flop_cost_rejects_bad_coefficients():
    with pytest.raises(ValueError, match="FlopCost.attention"):
        FlopCost(linear=1.0, attention=-1.0)
    with pytest.raises(ValueError, match="FlopCost.linear"):
        FlopCost(linear=math.inf, attention=0.0)


# ----------------------------------------------------- GRPO groups (shared-prompt forward)
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                          intermediate_size=1536, vocab_size=49152)


def grpo_batch(prompts: int, samples: int, seed: int = 0, prompt_range=(200, 600), response_range=(20, 200)):
    """(lengths, group ids, prompt lengths) of `prompts` GRPO groups of `samples` each."""
    rng = random.Random(seed)
    lengths, groups, plens = [], [], []
    for g in range(prompts):
        p = rng.randint(*prompt_range)
        for _ in range(samples):
            lengths.append(p + rng.randint(*response_range))
            groups.append(100 + g)
            plens.append(p)
    return lengths, groups, plens


def microbatch_of(plan) -> dict[int, list[tuple[int, int]]]:
    """sample -> (rank, microbatch) it lies in."""
    return {i: (r, k) for r, rank in enumerate(plan) for k, mb in enumerate(rank) for i in mb}


def split_groups(plan, groups) -> list[int]:
    """The group ids whose samples lie in more than one microbatch."""
    where = microbatch_of(plan)
    spread = {}
    for i, g in enumerate(groups):
        spread.setdefault(g, set()).add(where[i])
    return sorted(g for g, places in spread.items() if len(places) > 1)


@pytest.mark.parametrize("cost", [None, flop_cost(SMOLLM2)], ids=["tokens", "flops"])
def test_a_group_that_fits_stays_in_one_microbatch(cost):
    lengths, groups, plens = grpo_batch(16, 8)  # a group: ~3.5k tokens; the cap holds 2 or 3
    plan = plan_microbatches(lengths, 8192, 2, cost=cost, groups=groups, prompt_lengths=plens)
    assert_valid(plan, lengths, 2, 8192)
    assert split_groups(plan, groups) == []
    # control: planned sample by sample, groups are cut across microbatches
    assert split_groups(plan_microbatches(lengths, 8192, 2, cost=cost), groups)


@pytest.mark.parametrize("cost", [None, flop_cost(SMOLLM2)], ids=["tokens", "flops"])
def test_a_group_over_the_cap_is_cut_into_the_fewest_pieces(cost):
    lengths, groups, plens = grpo_batch(6, 16, prompt_range=(1500, 2500), response_range=(100, 600))
    cap = 16384  # a group: ~35-45k tokens, 3 pieces at least
    plan = plan_microbatches(lengths, cap, 1, cost=cost, groups=groups, prompt_lengths=plens)
    assert_valid(plan, lengths, 1, cap)
    where = microbatch_of(plan)
    for g in sorted(set(groups)):
        members = [i for i in range(len(lengths)) if groups[i] == g]
        fewest = len(plan_microbatches([lengths[i] for i in members], cap, 1)[0])  # BFD's count, >= the bound
        assert len({where[i] for i in members}) == fewest >= math.ceil(tokens(members, lengths) / cap)
    # on 2 ranks a piece is halved further only where a rank would otherwise idle
    plan = plan_microbatches(lengths, cap, 2, cost=cost, groups=groups, prompt_lengths=plens)
    assert_valid(plan, lengths, 2, cap)


def test_groups_are_cut_where_ranks_would_otherwise_idle():
    lengths, groups, plens = grpo_batch(2, 8)
    plan = plan_microbatches(lengths, 8192, 4, groups=groups, prompt_lengths=plens)
    assert_valid(plan, lengths, 4, 8192)
    assert all(rank[0] for rank in plan)  # 2 groups over 4 ranks: each halved, no rank idles


@st.composite
def grouped_case(draw):
    dp = draw(st.integers(1, 6))
    n_groups = draw(st.integers(1, 12))
    sizes = [draw(st.integers(1, 16)) for _ in range(n_groups)]
    plens = [draw(st.integers(1, 300)) for _ in range(n_groups)]
    lengths, groups, prompts = [], [], []
    for g, (size, p) in enumerate(zip(sizes, plens)):
        for _ in range(size):
            lengths.append(p + draw(st.integers(1, 300)))
            groups.append(g)
            prompts.append(p)
    if len(lengths) < dp:
        dp = len(lengths)
    cap = draw(st.integers(max(lengths), 6 * max(lengths)))
    return lengths, groups, prompts, cap, dp


@settings(max_examples=60, deadline=None)
@given(grouped_case(), st.booleans())
def test_grouped_plans_keep_the_cap_and_every_sample_once(case, with_cost):
    lengths, groups, prompts, cap, dp = case
    cost = flop_cost(SMOLLM2) if with_cost else None
    plan = plan_microbatches(lengths, cap, dp, cost=cost, groups=groups, prompt_lengths=prompts)
    assert_valid(plan, lengths, dp, cap)
    if not with_cost and len(set(groups)) >= dp:
        # token mode: a group that fits lies on one rank; it is cut there only where the rank
        # would otherwise idle through an empty microbatch (`_fill_empty`)
        where = microbatch_of(plan)
        for g in set(groups):
            members = [i for i, h in enumerate(groups) if h == g]
            if tokens(members, lengths) <= cap:
                assert len({where[i][0] for i in members}) == 1


def test_microbatch_cost_is_the_flops_of_the_shared_pack():
    """The body runs the prompt once and each response once; the prompt's queries see the
    prompt causally, a response's queries the prompt and themselves causally (FlopCost's
    convention: t**2 / 2 query-key pairs for t causal tokens, each costing 2 * attention)."""
    cost = flop_cost(SMOLLM2)
    P, responses = 1800, [300, 450, 120, 600]
    lengths, groups, plens = [P + r for r in responses], [7] * 4, [P] * 4
    body_tokens = P + sum(responses)
    pairs = P**2 / 2 + sum(r * P + r**2 / 2 for r in responses)
    shared = cost.linear * body_tokens + 2 * cost.attention * pairs
    assert math.isclose(microbatch_cost(range(4), lengths, cost, groups, plens), shared, rel_tol=1e-12)
    unshared = sum(cost(t) for t in lengths)
    assert math.isclose(unshared - shared, 3 * cost(P), rel_tol=1e-12)  # control: each extra copy of the prompt
    # a group cut in two microbatches pays its prompt in each
    halves = microbatch_cost([0, 1], lengths, cost, groups, plens) + microbatch_cost([2, 3], lengths, cost, groups,
                                                                                      plens)
    assert math.isclose(halves - shared, cost(P), rel_tol=1e-12)
    # another group's samples share nothing with these
    other = microbatch_cost([0, 1, 4], lengths + [P + 10], cost, groups + [8], plens + [P])
    assert math.isclose(other, microbatch_cost([0, 1], lengths, cost, groups, plens) + cost(P + 10), rel_tol=1e-12)


def test_grouped_flop_plan_costs_less_than_planning_sample_by_sample():
    cost = flop_cost(SMOLLM2)
    lengths, groups, plens = grpo_batch(16, 8, seed=3, prompt_range=(1000, 2000))
    shared = lambda mb: microbatch_cost(mb, lengths, cost, groups, plens)  # noqa: E731
    grouped = plan_microbatches(lengths, 16384, 4, cost=cost, groups=groups, prompt_lengths=plens)
    by_sample = plan_microbatches(lengths, 16384, 4, cost=cost)
    assert_valid(grouped, lengths, 4, 16384)
    assert lockstep_cost(grouped, shared) < 0.8 * lockstep_cost(by_sample, shared)


def test_group_argument_errors():
    with pytest.raises(ValueError, match="groups has 1 entries, expected 2"):
        plan_microbatches([5, 3], 100, 1, groups=[0])
    with pytest.raises(ValueError, match="groups with cost needs prompt_lengths"):
        plan_microbatches([5, 3], 100, 1, groups=[0, 0], cost=lambda t: t)
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\] = 4: must lie in \[1, lengths\[1\] = 3\]"):
        plan_microbatches([5, 3], 100, 1, groups=[0, 0], prompt_lengths=[2, 4])
    with pytest.raises(ValueError, match="group 0: prompt_lengths 2 and 1 .sample 1. differ"):
        plan_microbatches([5, 3], 100, 1, groups=[0, 0], prompt_lengths=[2, 1])
