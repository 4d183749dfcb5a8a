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
from operator import itemgetter

from ckpt_tune.tune.memory_model import Terms, pair_index, predict, segment_code

_BY_PREFIX_COST_TOP, _BY_PREFIX_TOP_COST = itemgetter(0, 1, 2), itemgetter(0, 2, 1)  # sort keys of a state
ROUGH_CAP = 16  # states per front in solve's first pass, which only bounds the cost
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
    # storing every block costs nothing: where it fits and every other option of every block costs more
    # (segments cost their blocks' checkpoints), it is the one optimum, without a search
    none = (0,) * len(terms.blocks)
    if all(c[0] < min(c[1:], default=float("inf")) for c in costs) and (peak := predict(terms, none)) <= budget:
        return Solution(none, sum(c[0] for c in costs), peak)
    # a feasible plan first, on fronts thinned to ROUGH_CAP states (each keeps its smallest prefix, so it
    # finds a plan whenever one exists); no cheaper plan passes through a state that already costs more
    rough = _dp(terms, costs, room, lambda states: _thin(_pareto(states), ROUGH_CAP))
    if not rough:
        return None
    bound = min(s[1] for s in rough)
    ends = _dp(terms, costs, room, lambda states: _pareto([s for s in states if s[1] <= bound]))
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
    limit = float("inf") if room is None else room
    for i in range(n):
        blk, c_i, nxt = terms.blocks[i], costs[i], pending[i + 1]
        for prev, raw in pending[i].items():
            # per option: what it stores, its window's height above the prefix (max of F and B), its cost
            opts = [
                (own, (own,), blk.d[k], max(blk.F[k], blk.B[k]), c_i[own])
                for own in range(K)
                for k in (pair_index(prev, own, K),)
            ]
            segs = starts.get(i, ())
            for prefix, cost, top, ch in prune(raw):
                for own, code, d, fb, c in opts:
                    t = prefix + fb
                    if t < top:
                        t = top
                    if t <= limit:
                        lst = nxt.get(own)
                        if lst is None:
                            lst = nxt[own] = []
                        lst.append((prefix + d, cost + c, t, (code, ch)))
                for a, b in segs:
                    seg = terms.segments[(a, b)]
                    t = max(top, prefix + seg.F[prev], prefix + seg.B[prev])
                    if t <= limit:
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
    states.sort(key=_BY_PREFIX_COST_TOP)
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
    return _thin(kept, FRONT_CAP)


def _thin(kept: list, cap: int) -> list:
    """At most about `cap` states, evenly spread over the prefix; the ends (the smallest prefix, and on a
    Pareto front the cheapest) always stay."""
    if len(kept) <= cap:
        return kept
    thin = kept[:: len(kept) // cap + 1]
    return thin if thin[-1] is kept[-1] else [*thin, kept[-1]]


def _pareto_peak(states: list) -> list:
    """Keep states not dominated in (prefix, top); cost breaks ties."""
    states.sort(key=_BY_PREFIX_TOP_COST)
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
