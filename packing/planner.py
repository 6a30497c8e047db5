"""Microbatch planning: which samples go to which DP rank, and in which microbatch.

A training step runs every DP rank through its microbatches in lockstep: microbatch
``i`` on rank 0 runs at the same time as microbatch ``i`` on every other rank, and the
gradient all-reduce (or FSDP's all-gathers / reduce-scatters inside each forward and
backward) needs every rank to take part the same number of times. So the plan must
give every rank the *same number* of microbatches ``m``; a rank that ran one step
fewer would hang the others in a collective. And because each step waits for its
slowest rank, both the ranks' total tokens and the tokens of microbatch ``i`` across
ranks should be as even as possible.

Token-budget mode (``max_tokens``), in four steps:

1. **DP split.** The samples are split into ``dp_size`` groups of near-equal token
   totals with the multi-way Karmarkar-Karp largest differencing method (LDM, packing/partition.py). Each
   sample starts as its own partial partition (one subset holding it, ``k - 1``
   empty); the two partial partitions with the largest spread (max subset - min
   subset) are merged so that the heaviest subset of one joins the lightest of the
   other, which cancels most of both spreads. Done ``n - 1`` times this gives far
   better balance than greedy assignment, in ``O(n log n + n k)`` at worst.
2. **Short ranks.** If a rank would hold fewer samples than the microbatch count the
   other ranks need, it would have to run empty microbatches; small samples are moved
   to it from ranks with samples to spare, as long as that does not raise ``m``.
3. **Microbatch count.** ``m`` lies between ``max_r L_r`` and ``max_r BFD_r``, where
   ``L_r = max(ceil(tokens_r / max_tokens), #samples over half the cap)`` is a lower
   bound on rank ``r``'s microbatch count and ``BFD_r`` the bin count best-fit-decreasing
   needs (always feasible, and usually within one of the bound). The lowest counts are
   tried first: fewer microbatches means fewer lockstep steps.
4. **Per-rank packing.** Each rank's samples are split into exactly ``m`` parts by
   Karmarkar-Karp again (so its microbatches carry near-equal tokens), then a part that
   went over the cap is repaired by moving or swapping samples. If the repair fails,
   the rank falls back to its BFD bins, split (heaviest first, in two by KK) until
   there are ``m``. Microbatches are ordered heaviest first on every rank, which pairs
   like with like in each lockstep step.

**Cost mode** (``cost=``). The cap bounds a microbatch's *memory*; its *time* grows faster
than its tokens, because attention grows with the square of each sample's length. Given a
per-sample ``cost(tokens)`` (e.g. packing/flops.py :func:`flop_cost` of the model config, ``a * t + b * t**2``)
the plan balances cost, while the cap, still counted in tokens, is never exceeded. In a
lockstep step the costliest of the ``dp_size`` microbatches sets the pace, so what must be
even is the cost of the microbatches that run *side by side*, not of one rank's
microbatches, which the cap often forbids (a microbatch holding one 32k-token sample costs
more than a full one of short samples). So all ``dp_size * m`` microbatches are planned
at once and then dealt out:

1. **Microbatch count.** ``m`` between ``ceil(L / dp_size)`` and ``ceil(BFD / dp_size)``,
   with ``L`` and ``BFD`` as in step 3 above, over all samples; the lowest first.
2. **Packing.** All samples are split into ``dp_size * m`` parts of near-equal cost by
   Karmarkar-Karp, then parts over the cap are repaired as in step 4 above, except that a
   move takes the cheapest sample that alone brings the part under the cap (the least
   cost shifted); the BFD fallback likewise.
3. **Dealing.** The parts, costliest first, are taken ``dp_size`` at a time: the ``i``-th
   batch of ``dp_size`` becomes microbatch ``i`` of every rank, so like runs with like,
   and within it the costliest part goes to the rank with the least cost so far.
4. **Safeguard.** Where the cap binds hard, the repairs can undo much of the cost
   balance, and the token plan sometimes balances cost better. Both are computed and the
   one with the lower :func:`lockstep_cost` is kept (ties: fewer microbatches), so cost
   mode is never worse than token mode by its own measure.

(verl's workload balancing splits each rank into ``ceil(tokens / cap)`` workload-balanced
microbatches and never looks at the cap again, so a microbatch of cheap short samples can
exceed it.) As in token mode, ``m`` is not raised to buy balance: with few samples per
rank, a handful of more microbatches would sometimes balance better.

**GRPO groups** (``groups=``, with ``prompt_lengths``). The shared-prompt training forward
(model/actor.py) runs a prompt once for all the samples of one microbatch that repeat it, so
a group cut across microbatches pays its prompt in each. The plan is then made over units:
a whole group, or, where a group's tokens exceed the cap, each of the fewest pieces of it
that fit (BFD's count, balanced by Karmarkar-Karp); with fewer units than ranks the largest
is halved until every rank can have one. A rank left with an empty microbatch while it holds
samples to spare halves its heaviest one (between groups where it holds several). The cap counts every sample's tokens, as collated.
A microbatch's cost (:func:`microbatch_cost`) charges a prompt once: ``cost(P)`` less per
sample past a group's first, which for :class:`FlopCost` is exactly the FLOPs of the shared
pack. In cost mode the grouped plan is compared with the sample-by-sample one by that cost,
and the cheaper lockstep kept.

A rank holding fewer than ``m`` samples gets empty microbatches (``[]``) at the end of
its list; this only happens when there are too few samples to go round. The trainer
must still run a forward/backward for each of them (e.g. on a dummy sample with zero
loss weight), or its collectives fall out of step with the other ranks.

Fixed mode (``micro_batch_size``): the samples are split across ranks in equal counts
(differing by at most one) by an equal-cardinality Karmarkar-Karp, then every rank is
cut into the same ``m = ceil(max rank count / micro_batch_size)`` microbatches of at
most ``micro_batch_size`` samples each, full ones first, with samples assigned
longest-first to the lightest microbatch that still has a free slot (with ``cost``, the
costliest first to the cheapest, and the ranks balanced by cost).

Everything is deterministic: no RNG, no set or dict iteration, ties broken by sample
index. Pure Python (no torch), a few tens of milliseconds for thousands of samples
(cost mode: about twice that, since it plans by tokens as well).
"""

import math
import operator
from typing import Callable, Sequence

from packing.partition import (best_fit_decreasing, bin_lower_bound, check_weight, karmarkar_karp, order_parts,
                               split_bfd_bins, split_under_cap, tokens, total)

__all__ = ["lockstep_cost", "microbatch_cost", "plan_microbatches"]

Plan = list[list[list[int]]]

# Microbatch counts tried above the lower bound before settling for the BFD count.
_EXTRA_TRIES = 2


# ------------------------------------------------------------------- validation


def _check_positive_int(name: str, value: object) -> int:
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if len(lengths) == 0:
        raise ValueError("lengths is empty: there is nothing to plan")
    out = []
    for i, x in enumerate(lengths):
        try:
            v = operator.index(x)
        except TypeError:
            raise TypeError(f"lengths[{i}] must be an int, got {x!r}") from None
        if v <= 0:
            raise ValueError(f"lengths[{i}] = {v}: every sample needs a positive token count")
        out.append(v)
    return out


def _check_groups(groups: Sequence[int], prompt_lengths: Sequence[int] | None, lens: list[int], *,
                  need_prompts: bool) -> tuple[list[int], list[int] | None]:
    """``groups`` and ``prompt_lengths`` checked against ``lens``: one entry per sample, a
    prompt length in [1, length] and the same within a group (needed only with a cost)."""
    if len(groups) != len(lens):
        raise ValueError(f"groups has {len(groups)} entries, expected {len(lens)} (one per sample, like lengths)")
    if prompt_lengths is None:
        if need_prompts:
            raise ValueError("groups with cost needs prompt_lengths (what a shared prompt saves)")
        return list(groups), None
    if len(prompt_lengths) != len(lens):
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries, expected {len(lens)} (one per sample)")
    prompts: dict[int, int] = {}
    out = []
    for i, (g, p) in enumerate(zip(groups, prompt_lengths)):
        p = operator.index(p)
        if not 1 <= p <= lens[i]:
            raise ValueError(f"prompt_lengths[{i}] = {p}: must lie in [1, lengths[{i}] = {lens[i]}]")
        if prompts.setdefault(g, p) != p:
            raise ValueError(f"group {g!r}: prompt_lengths {prompts[g]} and {p} (sample {i}) differ; "
                             "a group's samples share one prompt")
        out.append(p)
    return list(groups), out


# ----------------------------------------------------------------- public entry


def plan_microbatches(
    lengths: Sequence[int],
    max_tokens: int | None = None,
    dp_size: int = 1,
    *,
    micro_batch_size: int | None = None,
    cost: Callable[[int], float] | None = None,
    groups: Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> Plan:
    """Plan microbatches for ``dp_size`` ranks: ``plan[rank][i]`` is a list of indices
    into ``lengths`` (tokens per sample) forming microbatch ``i`` on ``rank``.

    Every rank gets the same number of microbatches, every sample appears exactly once.
    With ``max_tokens`` alone, microbatches are token-capped and balanced (see module
    docstring); with ``micro_batch_size`` they hold at most that many samples, and a
    ``max_tokens`` given as well is checked, not planned for. ``cost`` (e.g.
    ``flop_cost(model_config)``) maps a sample's token count to its compute cost; given,
    the ranks and microbatches balance cost instead of tokens (the cap stays on tokens).

    ``groups`` (a group id per sample: samples of one id share their first
    ``prompt_lengths[i]`` tokens, a GRPO group) plans for the shared-prompt forward, which
    runs a prompt once per microbatch holding its samples (token-budget modes; fixed mode
    ignores it). A group is kept in one microbatch where the cap allows (the cap still
    counts every sample's tokens: the collated pack's), else cut into the fewest pieces
    under it, each kept together. With ``cost`` a microbatch costs :func:`microbatch_cost`
    (each prompt charged once), and the grouped plan is kept unless planning sample by
    sample gives a lower :func:`lockstep_cost` by that measure.
    """
    dp_size = _check_positive_int("dp_size", dp_size)
    if max_tokens is None and micro_batch_size is None:
        raise ValueError("pass max_tokens (token-budget mode) or micro_batch_size (fixed mode); got neither")
    if max_tokens is not None:
        max_tokens = _check_positive_int("max_tokens", max_tokens)
    if micro_batch_size is not None:
        micro_batch_size = _check_positive_int("micro_batch_size", micro_batch_size)
    lens = _check_lengths(lengths)
    # What the splits balance: the tokens themselves, or each sample's cost.
    weights: Sequence[float] = lens
    if cost is not None:
        weights = [check_weight(f"cost(lengths[{i}] = {x})", cost(x)) for i, x in enumerate(lens)]
    if len(lens) < dp_size:
        raise ValueError(
            f"len(lengths) = {len(lens)} < dp_size = {dp_size}: every DP rank needs at least one sample"
        )
    if micro_batch_size is not None:
        return _plan_fixed(lens, weights, dp_size, micro_batch_size, max_tokens)
    assert max_tokens is not None
    for i, x in enumerate(lens):
        if x > max_tokens:
            raise ValueError(
                f"sample {i} has {x} tokens, more than max_tokens = {max_tokens}: it fits in no microbatch "
                "(raise max_tokens or truncate the sample)"
            )
    if groups is not None:
        return _plan_groups(lens, weights, max_tokens, dp_size, cost,
                            _check_groups(groups, prompt_lengths, lens, need_prompts=cost is not None))
    if cost is None:
        return _plan_tokens(lens, max_tokens, dp_size)
    return _plan_costs(lens, weights, max_tokens, dp_size)


def lockstep_cost(plan: Plan, weights: Sequence[float] | Callable[[list[int]], float]) -> float:
    """What a lockstep step of ``plan`` costs: the sum over microbatch steps ``i`` of the
    costliest rank's microbatch ``i``. ``weights``: per-sample costs (a microbatch costs their
    sum; ``sum(weights) / len(plan)`` is the ideal), or a microbatch's cost as a function of
    its sample indices (:func:`microbatch_cost`)."""
    mb_cost = weights if callable(weights) else (lambda mb: total(mb, weights))
    steps = max((len(rank) for rank in plan), default=0)
    return sum(max(mb_cost(rank[i]) if i < len(rank) else 0 for rank in plan) for i in range(steps))


def microbatch_cost(items: Sequence[int], lengths: Sequence[int], cost: Callable[[int], float],
                    groups: Sequence[int], prompt_lengths: Sequence[int]) -> float:
    """Cost of the microbatch ``items`` under the shared-prompt forward: each sample's
    ``cost(lengths[i])``, less ``cost(P)`` for every sample past the first of a group in it
    (``P`` its ``prompt_lengths``): the prompt runs once, and the cost of a causal prefix
    does not depend on what follows it. For :class:`FlopCost`, a group of ``n`` samples
    with responses ``R_j`` costs ``linear * (P + sum R_j) + attention * (P**2 + sum(2 P R_j + R_j**2))``:
    the prompt's tokens once, each response's tokens and its queries over the prompt and itself."""
    seen = set()
    summed = 0.0
    for i in items:
        summed += cost(lengths[i])
        if groups[i] in seen:
            summed -= cost(prompt_lengths[i])
        seen.add(groups[i])
    return summed


# ------------------------------------------------------------ token-budget mode
# The helpers take `lens` for what fits under the cap and `weights` for what is balanced:
# the token counts again in token mode, the samples' costs in cost mode.


def _plan_tokens(lens: list[int], cap: int, dp_size: int) -> Plan:
    ranks = karmarkar_karp(lens, dp_size)
    _fill_short_ranks(ranks, lens, cap)
    lower = max(bin_lower_bound(r, lens, cap) for r in ranks)
    upper = max(len(best_fit_decreasing(r, lens, cap)) for r in ranks)
    # Fewer microbatches means fewer lockstep steps, so try the counts just above the
    # lower bound first (BFD is rarely more than one over it, so two tries suffice);
    # `upper` always succeeds thanks to the BFD fallback.
    for m in range(lower, min(upper, lower + _EXTRA_TRIES)):
        packed = [split_under_cap(r, lens, lens, cap, m) for r in ranks]
        if all(p is not None for p in packed):
            return [order_parts(p, lens) for p in packed]  # type: ignore[arg-type]
    plan = []
    for r in ranks:
        parts = split_under_cap(r, lens, lens, cap, upper) or split_bfd_bins(r, lens, lens, cap, upper)
        plan.append(order_parts(parts, lens))
    return plan


def _plan_costs(lens: list[int], costs: Sequence[float], cap: int, dp_size: int) -> Plan:
    # All dp * m microbatches at once, then dealt out in lockstep steps (module docstring).
    items = list(range(len(lens)))
    lower = math.ceil(bin_lower_bound(items, lens, cap) / dp_size)
    upper = math.ceil(len(best_fit_decreasing(items, lens, cap)) / dp_size)
    for m in range(lower, min(upper, lower + _EXTRA_TRIES)):
        bins = split_under_cap(items, lens, costs, cap, dp_size * m, cheapest_move=True)
        if bins is not None:
            break
    else:
        m = upper
        bins = split_under_cap(items, lens, costs, cap, dp_size * m, cheapest_move=True)
        bins = bins or split_bfd_bins(items, lens, costs, cap, dp_size * m)
    # Where the cap binds hard, repairs can cost more balance than they keep; the token
    # plan is then sometimes the better cost balance. Keep the cheaper lockstep.
    by_cost = [order_parts(r, costs) for r in _deal(bins, costs, dp_size)]
    by_tokens = [order_parts(r, costs) for r in _plan_tokens(lens, cap, dp_size)]
    return min(by_cost, by_tokens, key=lambda plan: (lockstep_cost(plan, costs), len(plan[0])))


def _deal(bins: list[list[int]], costs: Sequence[float], dp_size: int) -> Plan:
    """Deal ``dp_size * m`` microbatches to the ranks, ``dp_size`` per lockstep step.

    Costliest first: step ``i`` takes the next ``dp_size`` microbatches, so the ones that
    run side by side are the ones closest in cost, and within a step the costliest goes
    to the rank with the least cost so far (which keeps the ranks' totals even too).
    Every rank's list comes out costliest first.
    """
    assert len(bins) % dp_size == 0, (len(bins), dp_size)
    plan: Plan = [[] for _ in range(dp_size)]
    totals = [0.0] * dp_size
    ordered = order_parts(bins, costs)
    for start in range(0, len(ordered), dp_size):
        free = list(range(dp_size))
        for mb in ordered[start : start + dp_size]:
            r = min(free, key=lambda r: (totals[r], r))
            free.remove(r)
            plan[r].append(mb)
            totals[r] += total(mb, costs)
    return plan


def _fill_short_ranks(ranks: list[list[int]], lens: Sequence[int], cap: int) -> None:
    """Move small samples to ranks holding fewer samples than the microbatch count.

    Such a rank would otherwise idle through empty microbatches. A move costs a little
    DP balance (the smallest sample is moved), so it is only kept if ``m`` does not rise.
    """
    bins = [len(best_fit_decreasing(r, lens, cap)) for r in ranks]
    for _ in range(len(lens)):
        m = max(bins)
        short = [r for r in range(len(ranks)) if len(ranks[r]) < m]
        donors = [r for r in range(len(ranks)) if len(ranks[r]) > m]
        if not short or not donors:
            return
        dst = min(short, key=lambda r: (len(ranks[r]), r))
        src = max(donors, key=lambda r: (len(ranks[r]), r))
        moved = min(ranks[src], key=lambda i: (lens[i], i))
        ranks[src].remove(moved)
        ranks[dst].append(moved)
        ranks[dst].sort()
        new_src = len(best_fit_decreasing(ranks[src], lens, cap))
        new_dst = len(best_fit_decreasing(ranks[dst], lens, cap))
        if max(new_src, new_dst) > m:
            ranks[dst].remove(moved)
            ranks[src].append(moved)
            ranks[src].sort()
            return
        bins[src], bins[dst] = new_src, new_dst


# -------------------------------------------------------------- grouped samples


def _plan_groups(lens: list[int], weights: Sequence[float], cap: int, dp_size: int,
                 cost: Callable[[int], float] | None, checked: tuple[list[int], list[int] | None]) -> Plan:
    """Token-budget or cost planning over units (a group, or a piece of one) instead of
    samples (``plan_microbatches``' ``groups``)."""
    groups, prompts = checked
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    units: list[list[int]] = []
    for group in members.values():  # first-seen order
        if tokens(group, lens) <= cap:
            units.append(group)
        else:  # the fewest pieces under the cap, balanced
            k = len(best_fit_decreasing(group, lens, cap))
            units += split_under_cap(group, lens, lens, cap, k) or best_fit_decreasing(group, lens, cap)
    while len(units) < dp_size:  # every rank needs a unit: halve the largest group piece
        u = max((u for u in range(len(units)) if len(units[u]) > 1), key=lambda u: (tokens(units[u], lens), -u))
        units[u : u + 1] = [[units[u][j] for j in half] for half in karmarkar_karp([lens[i] for i in units[u]], 2)]
    units = [sorted(u) for u in units]
    unit_lens = [tokens(u, lens) for u in units]
    if cost is None:
        plan = _plan_tokens(unit_lens, cap, dp_size)
    else:
        assert prompts is not None
        shared = lambda mb: microbatch_cost(mb, lens, cost, groups, prompts)  # noqa: E731
        plan = _plan_costs(unit_lens, [shared(u) for u in units], cap, dp_size)
    plan = [[sorted(i for u in mb for i in units[u]) for mb in rank] for rank in plan]
    weigh = (lambda mb: tokens(mb, lens)) if cost is None else shared  # noqa: E731
    for rank in plan:
        _fill_empty(rank, lens, groups, weigh)
    if cost is None:
        return plan
    by_sample = _plan_costs(lens, weights, cap, dp_size)
    return min(plan, by_sample, key=lambda p: (lockstep_cost(p, shared), len(p[0])))


def _fill_empty(rank: list[list[int]], lens: Sequence[int], groups: Sequence[int],
                weigh: Callable[[list[int]], float]) -> None:
    """A rank left with fewer units than microbatches would idle through an empty one while it
    holds samples to spare: halve its heaviest microbatch of 2+ samples into the empty slot,
    between groups where it holds several (by KK on their tokens), else through its one group
    (its prompt then runs in both). Halving never breaks the cap. In place, heaviest first."""
    while [] in rank:
        full = [k for k, mb in enumerate(rank) if len(mb) > 1]
        if not full:
            return
        k = max(full, key=lambda k: (tokens(rank[k], lens), -k))
        pieces: dict[int, list[int]] = {}
        for i in rank[k]:
            pieces.setdefault(groups[i], []).append(i)
        parts = list(pieces.values()) if len(pieces) > 1 else [[i] for i in rank[k]]
        halves = karmarkar_karp([tokens(p, lens) for p in parts], 2)
        rank[k] = sorted(i for j in halves[0] for i in parts[j])
        rank[rank.index([])] = sorted(i for j in halves[1] for i in parts[j])
        rank.sort(key=lambda mb: (-weigh(mb), mb[0] if mb else math.inf))


# ------------------------------------------------------------------ fixed mode


def _plan_fixed(lens: list[int], weights: Sequence[float], dp_size: int, mbs: int, cap: int | None) -> Plan:
    ranks = karmarkar_karp(weights, dp_size, equal_size=True)
    counts = [len(r) for r in ranks]
    m = math.ceil(max(counts) / mbs)
    if min(counts) < m:
        raise ValueError(
            f"micro_batch_size = {mbs} with dp_size = {dp_size}: the {len(lens)} samples split into rank counts "
            f"{counts}, so the fullest rank needs {m} microbatches but a rank holds only {min(counts)} samples; "
            f"use a sample count divisible by dp_size or a larger micro_batch_size"
        )
    plan = [_fill_slots(r, weights, _slot_sizes(len(r), m, mbs)) for r in ranks]
    if cap is not None:
        for rank, mbs_of_rank in enumerate(plan):
            for i, mb in enumerate(mbs_of_rank):
                if tokens(mb, lens) > cap:
                    raise ValueError(
                        f"rank {rank} microbatch {i} (samples {mb}) has {tokens(mb, lens)} tokens, "
                        f"more than max_tokens = {cap}"
                    )
    return plan


def _slot_sizes(count: int, m: int, mbs: int) -> list[int]:
    # Full microbatches first, but leave at least one sample for each one still to come.
    sizes = []
    for j in range(m):
        size = min(mbs, count - (m - j - 1))
        sizes.append(size)
        count -= size
    return sizes


def _fill_slots(items: list[int], weights: Sequence[float], sizes: list[int]) -> list[list[int]]:
    # Heaviest first into the lightest microbatch with a free slot (LPT with slot caps).
    parts: list[list[int]] = [[] for _ in sizes]
    sums = [0] * len(sizes)
    for i in sorted(items, key=lambda i: (-weights[i], i)):
        open_ = [j for j in range(len(sizes)) if len(parts[j]) < sizes[j]]
        j = min(open_, key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += weights[i]
    return [sorted(p) for p in parts]
