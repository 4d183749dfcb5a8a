"""The exact planner: the cheapest checkpoint placement whose predicted peak fits a budget.

Every constraint of the memory model is (stored prefix) + (a term of block i alone, given its
predecessor's choice) ≤ room, so a left-to-right dynamic program over the stored prefix is exact. The
prefix is kept exactly, as a Pareto front of (prefix bytes, recompute cost) per predecessor choice, so
the answer is the true optimum of the model, not of a rounded one. The problem contains knapsack: no
greedy is optimal (docs/design.md §4). `brute_force` enumerates every choice (K^n options, plus segments); tests check the two agree.

Pure: no device, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tune.tune.memory_model import Terms, pair_index, predict, segment_code

FRONT_CAP = 20000  # Pareto points kept per step before thinning (never reached by models of ≤ 200 blocks seen)


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # option per block: 0 stored, 1 checkpointed, 2.. a sub-module checkpointed
    cost: float  # recompute cost: sum of the checkpointed modules' forward times (ms)
    peak: int  # predicted peak bytes

    def names(self, terms: Terms) -> tuple[str, ...]:
        return terms.names(self.choice)


Costs = tuple[tuple[float, ...], ...]  # costs[i][option]: recompute time (ms) of block i under that option


def solve(terms: Terms, costs: Costs, budget: int) -> Solution | None:
    """Least-cost choice with predict(terms, choice) ≤ budget, or None when no choice fits."""
    room = budget - terms.static - terms.base
    if terms.fixed - terms.base > room:
        return None
    ends = _dp(terms, costs, room, _pareto)
    if not ends:
        return None
    best = min(ends, key=lambda s: (s[1], s[2], _checkpointed(s[3])))
    return Solution(best[3], best[1], terms.static + terms.base + best[2])


def min_peak(terms: Terms, costs: Costs) -> Solution:
    """The choice with the smallest predicted peak (ties: the cheapest)."""
    ends = _dp(terms, costs, None, _pareto_peak)
    best = min(ends, key=lambda s: (s[2], s[1]))
    return Solution(best[3], best[1], terms.static + terms.base + best[2])


def _checkpointed(choice: tuple[int, ...]) -> int:
    """Tie-break among equal-cost plans: fewer checkpointed blocks, then no segments."""
    return sum(1 for c in choice if c) * 2 + sum(1 for c in choice if c < 0)


def _dp(terms: Terms, costs: Costs, room: int | None, prune) -> list:
    """Left to right over the blocks; a state is (prefix, cost, top, choice) per position and option of
    the block before it. A block takes one of its options; a segment i..j jumps to j + 1 as a
    checkpointed predecessor (memory_model.py)."""
    n, K = len(terms.blocks), terms.k
    starts: dict[int, list[tuple[int, int]]] = {}
    for i, j in sorted(terms.segments):
        starts.setdefault(i, []).append((i, j))
    seg_cost = {
        key: sum(costs[m][1] for m in range(key[0], key[1] + 1)) for key in terms.segments
    }
    # a state's choice is a linked list (codes, parent): copying tuples would make each step O(n)
    pending: list[dict[int, list]] = [{} for _ in range(n + 1)]
    pending[0][0] = [(0, 0, terms.fixed - terms.base, None)]
    for i in range(n):
        blk = terms.blocks[i]
        for prev, raw in pending[i].items():
            for prefix, cost, top, ch in prune(raw):
                for own in range(K):
                    k = pair_index(prev, own, K)
                    t = max(top, prefix + blk.F[k], prefix + blk.B[k])
                    if room is None or t <= room:
                        pending[i + 1].setdefault(own, []).append((prefix + blk.d[k], cost + costs[i][own], t, ((own,), ch)))
                for a, b in starts.get(i, ()):
                    seg = terms.segments[(a, b)]
                    t = max(top, prefix + seg.F[prev], prefix + seg.B[prev])
                    if room is None or t <= room:
                        code = segment_code(a, b)
                        pending[b + 1].setdefault(1, []).append((prefix + seg.d[prev], cost + seg_cost[(a, b)], t, (code, ch)))
        pending[i] = {}
    return [(*s[:3], _unlink(s[3])) for raw in pending[n].values() for s in prune(raw)]


def _unlink(node) -> tuple[int, ...]:
    parts = []
    while node is not None:
        parts.append(node[0])
        node = node[1]
    return tuple(c for part in reversed(parts) for c in part)


def _pareto(states: list) -> list:
    """Keep the states that can still lead to the cheapest plan (ties: the smallest peak).

    What a state allows later depends on its prefix alone (every later constraint is prefix + a term
    ≤ room, and `top` already fits), so a state is dropped when another has a prefix no larger and a
    lower cost, or the same cost and a `top` no larger. One sweep in prefix order.
    """
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    kept: list = []
    best_cost, best_top = None, None
    for s in states:
        if best_cost is not None and (best_cost < s[1] or (best_cost == s[1] and best_top <= s[2])):
            continue
        kept.append(s)
        if best_cost is None or s[1] < best_cost:
            best_cost, best_top = s[1], s[2]
        else:
            best_top = min(best_top, s[2])
    if len(kept) > FRONT_CAP:
        kept = kept[:: len(kept) // FRONT_CAP + 1]
    return kept


def _pareto_peak(states: list) -> list:
    """Keep states not dominated in (prefix, top); cost breaks ties."""
    states.sort(key=lambda s: (s[0], s[2], s[1]))
    kept: list = []
    best_top = None
    for s in states:
        if best_top is not None and s[2] >= best_top:
            continue
        kept.append(s)
        best_top = s[2]
    return kept


def all_choices(terms: Terms):
    """Every choice: each block one of its options, or part of one of the segments in `terms`."""

    def rest(i: int):
        if i == len(terms.blocks):
            yield ()
            return
        for own in range(terms.k):
            for tail in rest(i + 1):
                yield (own, *tail)
        for a, b in terms.segments:
            if a == i:
                for tail in rest(b + 1):
                    yield (*segment_code(a, b), *tail)

    yield from rest(0)


def choice_cost(costs: Costs, choice: tuple[int, ...]) -> float:
    """Recompute cost of a choice: a segment's blocks each cost what they cost checkpointed alone."""
    return sum(c[1] if x < 0 else c[x] for c, x in zip(costs, choice, strict=True))


def brute_force(terms: Terms, costs: Costs, budget: int) -> Solution | None:
    """Reference solver: every choice, segments included. Only for small n (tests, benchmarks)."""
    best: Solution | None = None
    for choice in all_choices(terms):
        peak = predict(terms, choice)
        if peak > budget:
            continue
        cost = choice_cost(costs, choice)
        if best is None or (cost, peak) < (best.cost, best.peak):
            best = Solution(choice, cost, peak)
    return best
