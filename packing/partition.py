"""Balanced partitions, the microbatch planner's building blocks (packing/planner.py).

``karmarkar_karp`` splits items into ``k`` parts of near-equal weight; ``split_under_cap`` into
``m`` such parts that each stay under a token cap (Karmarkar-Karp, then moves and swaps), and
``split_bfd_bins`` into ``m`` parts from best-fit-decreasing bins, which always fit. Items are
indices into ``lens`` (token counts: what the cap bounds) and ``weights`` (what is balanced: the
token counts again, or per-sample costs). Deterministic: no RNG, ties broken by index.
"""

import heapq
import math
import numbers
import operator
from bisect import bisect_left, insort
from typing import Sequence

__all__ = ["best_fit_decreasing", "bin_lower_bound", "check_weight", "karmarkar_karp", "order_parts",
           "split_bfd_bins", "split_under_cap", "tokens", "total"]

_SUM = operator.itemgetter(0)

# One subset of a partial partition: (weight sum, sample indices).
_Subset = tuple[float, list[int]]


# --------------------------------------------------------------------------- KK


def karmarkar_karp(weights: Sequence[float], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split ``range(len(weights))`` into ``k`` parts of near-equal weight sums.

    Multi-way largest differencing method. With ``equal_size`` the part sizes differ by
    at most one (items are seeded in sorted chunks of ``k``, one per subset, and merges
    only ever join whole subsets, so every subset takes one item per chunk).

    Weights are ints (token counts: exact sums) or finite non-negative floats (costs).
    Returns ``k`` lists of indices, each sorted ascending, heaviest part first (ties by
    smallest index); parts may be empty when there are fewer than ``k`` items.
    """
    k = operator.index(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    w = [check_weight(f"weights[{i}]", x) for i, x in enumerate(weights)]
    if not w:
        return [[] for _ in range(k)]

    # Partial partitions are stored sparse: only their non-empty subsets, heaviest
    # first, with k - len(p) implicit empty ones after them. Merges then cost the
    # number of non-empty subsets rather than k, which matters when k is large.
    heap: list[tuple[float, int, list[_Subset]]] = []
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
    return order_parts(parts, w)


def _neg_spread(p: list[_Subset], k: int) -> float:
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


def order_parts(parts: list[list[int]], weights: Sequence[float]) -> list[list[int]]:
    """Heaviest first, ties (and empties) by smallest index; indices ascending."""
    parts = [sorted(p) for p in parts]
    return sorted(parts, key=lambda p: (-total(p, weights), p[0] if p else math.inf))


def total(indices: Sequence[int], values: Sequence[float]) -> float:
    """Sum of ``values`` (token counts or costs) over ``indices``."""
    return sum(values[i] for i in indices)


tokens = total  # the name where the values are token counts


def check_weight(name: str, value: object) -> float:
    """``value`` as a weight: an int, or a finite float; never negative (``name`` in the error)."""
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number, got {value!r}") from None
        v = float(value)  # type: ignore[assignment]
        if not math.isfinite(v):
            raise ValueError(f"{name} = {v} is not finite") from None
    if v < 0:
        raise ValueError(f"{name} = {v} is negative")
    return v


# ---------------------------------------------------------------- under a cap


def bin_lower_bound(items: Sequence[int], lens: Sequence[int], cap: int) -> int:
    # No two samples over half the cap can share a microbatch, which beats the token
    # bound when long samples dominate.
    return max(math.ceil(tokens(items, lens) / cap), sum(1 for i in items if 2 * lens[i] > cap))


def best_fit_decreasing(items: Sequence[int], lens: Sequence[int], cap: int) -> list[list[int]]:
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


def split_under_cap(
    items: list[int], lens: Sequence[int], weights: Sequence[float], cap: int, m: int, *, cheapest_move: bool = False
) -> list[list[int]] | None:
    """``m`` weight-balanced parts of ``items``, each under the token cap, or None if not found."""
    local = karmarkar_karp([weights[i] for i in items], m)
    parts = [[items[j] for j in p] for p in local]
    return parts if _repair_over_cap(parts, lens, weights, cap, cheapest_move) else None


def _repair_over_cap(
    parts: list[list[int]], lens: Sequence[int], weights: Sequence[float], cap: int, cheapest_move: bool = False
) -> bool:
    """Bring every part under the cap by moving or swapping samples; in place.

    KK balances well but knows nothing of the cap, so at a tight ``m`` one part can end
    a few tokens over (more with costs: cheap short samples crowd into fewer parts). Each
    step strictly lowers the heaviest over-cap part without pushing another part over, so
    the loop terminates. A move takes the largest sample that fits elsewhere (the biggest
    step towards the cap) or, with ``cheapest_move``, the cheapest that alone brings the
    part under the cap (the least weight shifted, which keeps a cost balance).
    """
    sums = [tokens(p, lens) for p in parts]
    costs = [total(p, weights) for p in parts]
    # Each step fixes or shrinks one over-cap part; past a few steps per part the
    # rank is better served by the BFD fallback than by more searching.
    for _ in range(4 * len(parts) + 8):
        over = [j for j in range(len(parts)) if sums[j] > cap]
        if not over:
            return True
        j = max(over, key=lambda j: (sums[j], -j))
        moved = _move_one(parts, sums, costs, j, lens, weights, cap, cheapest_move)
        if not (moved or _swap_one(parts, sums, j, lens, cap)):
            return False
    return False


def _move_one(
    parts: list[list[int]], sums: list[int], costs: list[float], j: int,
    lens: Sequence[int], weights: Sequence[float], cap: int, cheapest_move: bool,
) -> bool:
    # A sample of part j (largest first, or cheapest sufficient first) into the lightest
    # part (by weight) it fits in. With token weights that is the part with the most
    # room, so a sample that fits nowhere else does not fit there either.
    excess = sums[j] - cap
    if cheapest_move:
        order = sorted(parts[j], key=lambda i: (lens[i] < excess, weights[i] if lens[i] >= excess else -lens[i], i))
    else:
        order = sorted(parts[j], key=lambda i: (-lens[i], i))
    for i in order:
        fits = [t for t in range(len(parts)) if t != j and sums[t] + lens[i] <= cap]
        if fits:
            t = min(fits, key=lambda t: (costs[t], t))
            parts[j].remove(i)
            parts[t].append(i)
            sums[j] -= lens[i]
            sums[t] += lens[i]
            costs[j] -= weights[i]
            costs[t] += weights[i]
            return True
    return False


def _swap_one(parts: list[list[int]], sums: list[int], j: int, lens: Sequence[int], cap: int) -> bool:
    # Swap a sample out of the over-cap part for a shorter one, taking the swap that
    # lowers it the most while the other part stays under the cap (ties: lowest part,
    # then sample indices).
    best: tuple[int, int, int, int] | None = None  # (-gain, t, out, in)
    outs = [(lens[a], a) for a in parts[j]]
    for t in range(len(parts)):
        room = cap - sums[t]  # the most part t can gain
        # Parts are scanned in order, so a later one must gain strictly more to win.
        if t == j or room <= 0 or (best is not None and room <= -best[0]):
            continue
        for b in parts[t]:
            lb = lens[b]
            for la, a in outs:
                gain = la - lb
                if 0 < gain <= room:
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


def split_bfd_bins(
    items: list[int], lens: Sequence[int], weights: Sequence[float], cap: int, m: int
) -> list[list[int]]:
    """BFD bins (at most ``m`` of them), split heaviest-first until there are ``m``.

    Splitting a bin never breaks the cap, so this always succeeds; if the rank runs out
    of splittable bins it has fewer than ``m`` samples and is padded with empty ones.
    """
    bins = best_fit_decreasing(items, lens, cap)
    assert len(bins) <= m, (len(bins), m)
    while len(bins) < m:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins += [[] for _ in range(m - len(bins))]
            break
        b = max(splittable, key=lambda b: (total(bins[b], weights), -min(bins[b])))
        halves = karmarkar_karp([weights[i] for i in bins[b]], 2)
        bins[b : b + 1] = [[bins[b][j] for j in h] for h in halves]
    return bins
