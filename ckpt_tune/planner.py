"""The exact planner: the cheapest checkpoint placement whose predicted peak fits a budget.

Every constraint of the memory model is (stored prefix) + (a term of block i alone, given its
predecessor's choice) ≤ room, so a left-to-right dynamic program over the stored prefix is exact. The
prefix is kept exactly, as a Pareto front of (prefix bytes, recompute cost) per predecessor choice, so
the answer is the true optimum of the model, not of a rounded one. The problem contains knapsack: no
greedy is optimal (DESIGN.md §4). `brute_force` enumerates all 2^n choices; tests check the two agree.

Pure: no device, no model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ckpt_tune.memory_model import Terms, pair_index, predict

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
    len(terms.blocks)
    room = budget - terms.static - terms.base
    if terms.fixed - terms.base > room:
        return None
    # front[prev] = list of (prefix, cost, top, choice-so-far); top = largest constraint value so far.
    fronts: dict[int, list[tuple[int, float, int, tuple[int, ...]]]] = {0: [(0, 0.0, terms.fixed - terms.base, ())]}
    for i, blk in enumerate(terms.blocks):
        nxt: dict[int, list] = {o: [] for o in range(terms.k)}
        for prev, states in fronts.items():
            for prefix, cost, top, ch in states:
                for own in range(terms.k):
                    k = pair_index(prev, own, terms.k)
                    t = max(top, prefix + blk.F[k], prefix + blk.B[k])
                    if t > room:
                        continue
                    nxt[own].append((prefix + blk.d[k], cost + costs[i][own], t, (*ch, own)))
        fronts = {k: _pareto(v) for k, v in nxt.items() if v}
        if not fronts:
            return None
    best = min((s for v in fronts.values() for s in v), key=lambda s: (s[1], s[2], sum(s[3])))
    return Solution(best[3], best[1], terms.static + terms.base + best[2])


def min_peak(terms: Terms, costs: Costs) -> Solution:
    """The choice with the smallest predicted peak (ties: the cheapest)."""
    fronts: dict[int, list[tuple[int, float, int, tuple[int, ...]]]] = {0: [(0, 0.0, terms.fixed - terms.base, ())]}
    for i, blk in enumerate(terms.blocks):
        nxt: dict[int, list] = {o: [] for o in range(terms.k)}
        for prev, states in fronts.items():
            for prefix, cost, top, ch in states:
                for own in range(terms.k):
                    k = pair_index(prev, own, terms.k)
                    t = max(top, prefix + blk.F[k], prefix + blk.B[k])
                    nxt[own].append((prefix + blk.d[k], cost + costs[i][own], t, (*ch, own)))
        fronts = {k: _pareto_peak(v) for k, v in nxt.items()}
    best = min((s for v in fronts.values() for s in v), key=lambda s: (s[2], s[1]))
    return Solution(best[3], best[1], terms.static + terms.base + best[2])


def _pareto(states: list) -> list:
    """Keep states not dominated in (prefix, cost, top): smaller is better in each."""
    states.sort(key=lambda s: (s[0], s[1], s[2]))
    kept: list = []
    for s in states:
        if any(k[1] <= s[1] and k[2] <= s[2] for k in kept):  # kept ones have prefix ≤ s's
            continue
        kept.append(s)
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


def brute_force(terms: Terms, costs: Costs, budget: int) -> Solution | None:
    """Reference solver: every choice. Only for small n (tests, benchmarks)."""
    best: Solution | None = None
    for choice in itertools.product(range(terms.k), repeat=len(terms.blocks)):
        peak = predict(terms, choice)
        if peak > budget:
            continue
        cost = sum(c[x] for c, x in zip(costs, choice, strict=True))
        if best is None or (cost, peak) < (best.cost, best.peak):
            best = Solution(choice, cost, peak)
    return best
