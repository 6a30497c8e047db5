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
   totals with the multi-way Karmarkar-Karp largest differencing method (LDM). Each
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

A rank holding fewer than ``m`` samples gets empty microbatches (``[]``) at the end of
its list; this only happens when there are too few samples to go round. The trainer
must still run a forward/backward for each of them (e.g. on a dummy sample with zero
loss weight), or its collectives fall out of step with the other ranks.

Fixed mode (``micro_batch_size``): the samples are split across ranks in equal counts
(differing by at most one) by an equal-cardinality Karmarkar-Karp, then every rank is
cut into the same ``m = ceil(max rank count / micro_batch_size)`` microbatches of at
most ``micro_batch_size`` samples each, full ones first, with samples assigned
longest-first to the lightest microbatch that still has a free slot.

Everything is deterministic: no RNG, no set or dict iteration, ties broken by sample
index. Pure Python, a few tens of milliseconds for thousands of samples.
"""

from __future__ import annotations

import heapq
import math
import operator
from bisect import bisect_left, insort
from typing import Sequence

__all__ = ["karmarkar_karp", "plan_microbatches"]

Plan = list[list[list[int]]]

_SUM = operator.itemgetter(0)

# Microbatch counts tried above the lower bound before settling for the BFD count.
_EXTRA_TRIES = 2

# One subset of a partial partition: (token sum, sample indices).
_Subset = tuple[int, list[int]]


# --------------------------------------------------------------------------- KK


def karmarkar_karp(weights: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split ``range(len(weights))`` into ``k`` parts of near-equal weight sums.

    Multi-way largest differencing method. With ``equal_size`` the part sizes differ by
    at most one (items are seeded in sorted chunks of ``k``, one per subset, and merges
    only ever join whole subsets, so every subset takes one item per chunk).

    Returns ``k`` lists of indices, each sorted ascending, heaviest part first (ties by
    smallest index); parts may be empty when there are fewer than ``k`` items.
    """
    k = operator.index(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    w = [operator.index(x) for x in weights]
    for i, x in enumerate(w):
        if x < 0:
            raise ValueError(f"weights[{i}] = {x} is negative")
    if not w:
        return [[] for _ in range(k)]

    # Partial partitions are stored sparse: only their non-empty subsets, heaviest
    # first, with k - len(p) implicit empty ones after them. Merges then cost the
    # number of non-empty subsets rather than k, which matters when k is large.
    heap: list[tuple[int, int, list[_Subset]]] = []
    if equal_size:
        order = sorted(range(len(w)), key=lambda i: (-w[i], i))
        order += [-1] * (-len(order) % k)  # zero-weight padding, dropped below
        for seq, start in enumerate(range(0, len(order), k)):
            subsets = [(w[i] if i >= 0 else 0, [i]) for i in order[start : start + k]]
            heap.append((_neg_spread(subsets, k), seq, subsets))
    else:
        heap = [(-x, i, [(x, [i])]) for i, x in enumerate(w)]
    heapq.heapify(heap)

    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = _merge(a, b, k)
        heapq.heappush(heap, (_neg_spread(merged, k), seq, merged))
        seq += 1

    parts = [sorted(i for i in idx if i >= 0) for _, idx in heap[0][2]]
    parts += [[] for _ in range(k - len(parts))]
    return _order_parts(parts, w)


def _neg_spread(p: list[_Subset], k: int) -> int:
    # Negated so heapq (a min-heap) pops the largest spread first.
    return (p[-1][0] if len(p) == k else 0) - p[0][0]


def _merge(a: list[_Subset], b: list[_Subset], k: int) -> list[_Subset]:
    """Pair a's i-th heaviest subset with b's i-th lightest: this cancels the spreads.

    Padded to k, position p of the result joins a[p] (if p < len(a)) with b's
    (k-1-p)-th heaviest (if p >= k - len(b)); only where both exist is anything joined.
    """
    la, lb = len(a), len(b)
    lo = k - lb  # first position holding a subset of b
    if lo >= la:  # no overlap: the non-empty subsets just sit side by side
        merged = a + b
    else:
        joined = [_join(a[p], b[k - 1 - p]) for p in range(lo, la)]
        merged = a[:lo] + joined + b[: k - la]
    merged.sort(key=_SUM, reverse=True)  # stable, so ties keep a deterministic order
    return merged


def _join(x: _Subset, y: _Subset) -> _Subset:
    # Both inputs are consumed, so extend the longer list in place instead of copying.
    (sx, lx), (sy, ly) = x, y
    if len(lx) < len(ly):
        lx, ly = ly, lx
    lx.extend(ly)
    return sx + sy, lx


def _order_parts(parts: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """Heaviest first, ties (and empties) by smallest index; indices ascending."""
    parts = [sorted(p) for p in parts]
    return sorted(parts, key=lambda p: (-_tokens(p, lengths), p[0] if p else math.inf))


def _tokens(indices: Sequence[int], lengths: Sequence[int]) -> int:
    return sum(lengths[i] for i in indices)


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


# ----------------------------------------------------------------- public entry


def plan_microbatches(
    lengths: Sequence[int],
    max_tokens: int | None = None,
    dp_size: int = 1,
    *,
    micro_batch_size: int | None = None,
) -> Plan:
    """Plan microbatches for ``dp_size`` ranks: ``plan[rank][i]`` is a list of indices
    into ``lengths`` (tokens per sample) forming microbatch ``i`` on ``rank``.

    Every rank gets the same number of microbatches, every sample appears exactly once.
    With ``max_tokens`` alone, microbatches are token-capped and balanced (see module
    docstring); with ``micro_batch_size`` they hold at most that many samples, and a
    ``max_tokens`` given as well is checked, not planned for.
    """
    dp_size = _check_positive_int("dp_size", dp_size)
    if max_tokens is None and micro_batch_size is None:
        raise ValueError("pass max_tokens (token-budget mode) or micro_batch_size (fixed mode); got neither")
    if max_tokens is not None:
        max_tokens = _check_positive_int("max_tokens", max_tokens)
    if micro_batch_size is not None:
        micro_batch_size = _check_positive_int("micro_batch_size", micro_batch_size)
    lens = _check_lengths(lengths)
    if len(lens) < dp_size:
        raise ValueError(
            f"len(lengths) = {len(lens)} < dp_size = {dp_size}: every DP rank needs at least one sample"
        )
    if micro_batch_size is not None:
        return _plan_fixed(lens, dp_size, micro_batch_size, max_tokens)
    assert max_tokens is not None
    return _plan_tokens(lens, max_tokens, dp_size)


# ------------------------------------------------------------ token-budget mode


def _plan_tokens(lens: list[int], cap: int, dp_size: int) -> Plan:
    for i, x in enumerate(lens):
        if x > cap:
            raise ValueError(
                f"sample {i} has {x} tokens, more than max_tokens = {cap}: it fits in no microbatch "
                "(raise max_tokens or truncate the sample)"
            )
    ranks = karmarkar_karp(lens, dp_size)
    _fill_short_ranks(ranks, lens, cap)
    lower = max(_bin_lower_bound(r, lens, cap) for r in ranks)
    upper = max(len(_best_fit_decreasing(r, lens, cap)) for r in ranks)
    # Fewer microbatches means fewer lockstep steps, so try the counts just above the
    # lower bound first (BFD is rarely more than one over it, so two tries suffice);
    # `upper` always succeeds thanks to the BFD fallback.
    for m in range(lower, min(upper, lower + _EXTRA_TRIES)):
        packed = [_split_under_cap(r, lens, cap, m) for r in ranks]
        if all(p is not None for p in packed):
            return [_order_parts(p, lens) for p in packed]  # type: ignore[arg-type]
    plan = []
    for r in ranks:
        parts = _split_under_cap(r, lens, cap, upper) or _split_bfd_bins(r, lens, cap, upper)
        plan.append(_order_parts(parts, lens))
    return plan


def _bin_lower_bound(items: Sequence[int], lens: Sequence[int], cap: int) -> int:
    # No two samples over half the cap can share a microbatch, which beats the token
    # bound when long samples dominate.
    return max(math.ceil(_tokens(items, lens) / cap), sum(1 for i in items if 2 * lens[i] > cap))


def _best_fit_decreasing(items: Sequence[int], lens: Sequence[int], cap: int) -> list[list[int]]:
    """Longest first, each into the fullest bin it fits (bisect: O(n log n) comparisons)."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (free tokens, bin id), sorted
    for i in sorted(items, key=lambda i: (-lens[i], i)):
        pos = bisect_left(rooms, (lens[i], -1))
        if pos < len(rooms):
            free, b = rooms.pop(pos)
        else:
            free, b = cap, len(bins)
            bins.append([])
        bins[b].append(i)
        insort(rooms, (free - lens[i], b))
    return bins


def _fill_short_ranks(ranks: list[list[int]], lens: Sequence[int], cap: int) -> None:
    """Move small samples to ranks holding fewer samples than the microbatch count.

    Such a rank would otherwise idle through empty microbatches. A move costs a little
    DP balance (the smallest sample is moved), so it is only kept if ``m`` does not rise.
    """
    bins = [len(_best_fit_decreasing(r, lens, cap)) for r in ranks]
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
        new_src = len(_best_fit_decreasing(ranks[src], lens, cap))
        new_dst = len(_best_fit_decreasing(ranks[dst], lens, cap))
        if max(new_src, new_dst) > m:
            ranks[dst].remove(moved)
            ranks[src].append(moved)
            ranks[src].sort()
            return
        bins[src], bins[dst] = new_src, new_dst


def _split_under_cap(items: list[int], lens: Sequence[int], cap: int, m: int) -> list[list[int]] | None:
    """``m`` token-balanced parts of ``items``, each under the cap, or None if not found."""
    local = karmarkar_karp([lens[i] for i in items], m)
    parts = [[items[j] for j in p] for p in local]
    return parts if _repair_over_cap(parts, lens, cap) else None


def _repair_over_cap(parts: list[list[int]], lens: Sequence[int], cap: int) -> bool:
    """Bring every part under the cap by moving or swapping samples; in place.

    KK balances well but knows nothing of the cap, so at a tight ``m`` one part can end
    a few tokens over. Each step strictly lowers the heaviest over-cap part without
    pushing another part over, so the loop terminates.
    """
    sums = [_tokens(p, lens) for p in parts]
    # Each step fixes or shrinks one over-cap part; past a few steps per part the
    # rank is better served by the BFD fallback than by more searching.
    for _ in range(4 * len(parts) + 8):
        over = [j for j in range(len(parts)) if sums[j] > cap]
        if not over:
            return True
        j = max(over, key=lambda j: (sums[j], -j))
        if not (_move_one(parts, sums, j, lens, cap) or _swap_one(parts, sums, j, lens, cap)):
            return False
    return False


def _move_one(parts: list[list[int]], sums: list[int], j: int, lens: Sequence[int], cap: int) -> bool:
    # Largest sample that fits into the lightest other part: biggest step towards the cap.
    others = [t for t in range(len(parts)) if t != j]
    if not others:
        return False
    t = min(others, key=lambda t: (sums[t], t))
    for i in sorted(parts[j], key=lambda i: (-lens[i], i)):
        if sums[t] + lens[i] <= cap:
            parts[j].remove(i)
            parts[t].append(i)
            sums[j] -= lens[i]
            sums[t] += lens[i]
            return True
    return False


def _swap_one(parts: list[list[int]], sums: list[int], j: int, lens: Sequence[int], cap: int) -> bool:
    # Swap a sample out of the over-cap part for a shorter one, taking the swap that
    # lowers it the most while the other part stays under the cap.
    best: tuple[int, int, int, int] | None = None  # (-gain, t, out, in)
    for t in range(len(parts)):
        if t == j:
            continue
        for a in parts[j]:
            for b in parts[t]:
                gain = lens[a] - lens[b]
                if gain > 0 and sums[t] + gain <= cap:
                    cand = (-gain, t, a, b)
                    if best is None or cand < best:
                        best = cand
    if best is None:
        return False
    neg_gain, t, a, b = best
    parts[j].remove(a)
    parts[t].remove(b)
    parts[j].append(b)
    parts[t].append(a)
    sums[j] += neg_gain
    sums[t] -= neg_gain
    return True


def _split_bfd_bins(items: list[int], lens: Sequence[int], cap: int, m: int) -> list[list[int]]:
    """BFD bins (at most ``m`` of them), split heaviest-first until there are ``m``.

    Splitting a bin never breaks the cap, so this always succeeds; if the rank runs out
    of splittable bins it has fewer than ``m`` samples and is padded with empty ones.
    """
    bins = _best_fit_decreasing(items, lens, cap)
    assert len(bins) <= m, (len(bins), m)
    while len(bins) < m:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins += [[] for _ in range(m - len(bins))]
            break
        b = max(splittable, key=lambda b: (_tokens(bins[b], lens), -min(bins[b])))
        halves = karmarkar_karp([lens[i] for i in bins[b]], 2)
        bins[b : b + 1] = [[bins[b][j] for j in h] for h in halves]
    return bins


# ------------------------------------------------------------------ fixed mode


def _plan_fixed(lens: list[int], dp_size: int, mbs: int, cap: int | None) -> Plan:
    ranks = karmarkar_karp(lens, dp_size, equal_size=True)
    counts = [len(r) for r in ranks]
    m = math.ceil(max(counts) / mbs)
    if min(counts) < m:
        raise ValueError(
            f"micro_batch_size = {mbs} with dp_size = {dp_size}: the {len(lens)} samples split into rank counts "
            f"{counts}, so the fullest rank needs {m} microbatches but a rank holds only {min(counts)} samples; "
            f"use a sample count divisible by dp_size or a larger micro_batch_size"
        )
    plan = [_fill_slots(r, lens, _slot_sizes(len(r), m, mbs)) for r in ranks]
    if cap is not None:
        for rank, mbs_of_rank in enumerate(plan):
            for i, mb in enumerate(mbs_of_rank):
                if _tokens(mb, lens) > cap:
                    raise ValueError(
                        f"rank {rank} microbatch {i} (samples {mb}) has {_tokens(mb, lens)} tokens, "
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


def _fill_slots(items: list[int], lens: Sequence[int], sizes: list[int]) -> list[list[int]]:
    # Longest-first into the lightest microbatch with a free slot (LPT with slot caps).
    parts: list[list[int]] = [[] for _ in sizes]
    sums = [0] * len(sizes)
    for i in sorted(items, key=lambda i: (-lens[i], i)):
        open_ = [j for j in range(len(sizes)) if len(parts[j]) < sizes[j]]
        j = min(open_, key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += lens[i]
    return [sorted(p) for p in parts]
