"""The exact planner against brute force, on random and adversarial terms (pure, milliseconds)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ckpt_tune.plan.entry import Entry
from ckpt_tune.tune.memory_model import BlockTerms, SegmentTerms, Terms, predict, segments_of, with_segment
from ckpt_tune.tune.planner import all_choices, brute_force, choice_cost, min_peak, solve


def _random_terms(rng: random.Random, n: int, k: int = 2) -> Terms:
    """Random but plausible terms; with k > 2, options 2.. checkpoint a part of the block."""
    blocks = []
    for _ in range(n):
        kept = rng.randint(5, 100)
        per_option = [kept, rng.randint(1, kept)] + [rng.randint(1, kept) for _ in range(k - 2)]
        free_prev = rng.randint(0, 5)  # a block that does not keep its input frees its predecessor's output
        d, f, b = [], [], []
        fwd, bwd = rng.randint(1, 60), rng.randint(kept, kept + 80)
        for prev in range(k):
            for own in range(k):
                d.append(per_option[own] - (free_prev if prev == 1 and own != 1 else 0))
                f.append(fwd + (1 if own == 1 else 0))
                b.append(bwd + (rng.randint(0, 20) if own else 0))
        blocks.append(BlockTerms(tuple(d), tuple(f), tuple(b)))
    options = ("none", "block", *[f"part{j}" for j in range(k - 2)])
    return Terms(1, tuple(f"b{i}" for i in range(n)), 1000, 10, rng.randint(0, 200), tuple(blocks), options=options)


def _costs(rng: random.Random, n: int, k: int = 2):
    return tuple((0.0, *(rng.uniform(0.5, 3.0) for _ in range(k - 1))) for _ in range(n))


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    k = 2 if seed < 25 else 4  # whole blocks only, then with two finer options per block
    n = rng.randint(1, 10 if k == 2 else 6)
    _assert_dp_equals_brute_force(_random_terms(rng, n, k), _costs(rng, n, k))


def _assert_dp_equals_brute_force(t: Terms, costs) -> None:
    """At four budgets from below the smallest peak to the no-checkpointing peak: the DP's plan costs
    what the brute force's does, and its reported peak is its predicted one, within the budget."""
    lo, hi = min_peak(t, costs).peak, predict(t, (0,) * len(t.blocks))
    assert lo == min(predict(t, c) for c in all_choices(t))
    for budget in (lo - 1, lo, (lo + hi) // 2, hi):
        dp, bf = solve(t, costs, budget), brute_force(t, costs, budget)
        if bf is None:
            assert dp is None
            continue
        assert dp is not None
        assert abs(dp.cost - bf.cost) < 1e-9
        assert predict(t, dp.choice) == dp.peak <= budget
        assert abs(choice_cost(costs, dp.choice) - dp.cost) < 1e-9


def test_min_peak_is_the_smallest_over_all_choices():
    rng = random.Random(7)
    for n in range(1, 9):
        t = _random_terms(rng, n)
        costs = tuple((0.0, 1.0) for _ in range(n))
        assert min_peak(t, costs).peak == brute_force(t, costs, min_peak(t, costs).peak).peak


def test_knapsack_case_greedy_gets_wrong():
    # Three blocks; we must shed 10 units of stored bytes before the last block's backward. Greedy by
    # bytes-per-ms takes block a (9 saved for 1 ms), then needs another (a+c costs 1.6, a+b 2.5): the
    # optimum is block b alone (10 saved for 1.5 ms).
    def blk(kept, ckpt):
        return BlockTerms((kept, ckpt, kept, ckpt), (0, 0, 0, 0), (0, 0, 0, 0))

    last = BlockTerms((0, 0, 0, 0), (0, 0, 0, 0), (5, 5, 5, 5))
    t = Terms(1, ("a", "b", "c", "last"), 0, 0, 0, (blk(10, 1), blk(11, 1), blk(10, 9), last))
    costs = ((0.0, 1.0), (0.0, 1.5), (0.0, 0.6), (0.0, 0.0))
    # stored before the last block: 31; budget 26 = 21 stored + 5 -> shed 10
    sol = solve(t, costs, 26)
    assert sol is not None
    assert sol.choice[:3] == (0, 1, 0)
    assert sol.cost == 1.5
    assert brute_force(t, costs, 26).cost == 1.5


def test_nothing_fits_returns_none():
    t = _random_terms(random.Random(3), 4)
    assert solve(t, ((0.0, 1.0),) * 4, t.static) is None


def test_large_chain_solves_quickly_enough_to_be_interactive():
    rng = random.Random(11)
    t = _random_terms(rng, 48, 4)
    costs = _costs(rng, 48, 4)
    budget = (min_peak(t, costs).peak + predict(t, (0,) * 48)) // 2
    sol = solve(t, costs, budget)
    assert sol is not None
    assert predict(t, sol.choice) <= budget


def _with_random_segments(rng: random.Random, t: Terms, max_len: int = 4) -> Terms:
    """Segments i..j with plausible terms: little stored (one input), a backward holding the blocks'."""
    n, segs = len(t.blocks), {}
    for i in range(n):
        for j in range(i + 1, min(n, i + max_len)):
            if rng.random() < 0.7:
                held = sum(t.blocks[m].d[0] for m in range(i, j + 1))
                d = tuple(rng.randint(1, 20) for _ in range(t.k))
                f = tuple(rng.randint(1, 60) for _ in range(t.k))
                b = tuple(held + rng.randint(0, 80) for _ in range(t.k))
                segs[(i, j)] = SegmentTerms(d, f, b)
    return replace(t, segments=segs)


@pytest.mark.parametrize("seed", range(30))
def test_dp_with_segments_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    k = 2 if seed < 20 else 3
    n = rng.randint(2, 8 if k == 2 else 5)
    _assert_dp_equals_brute_force(_with_random_segments(rng, _random_terms(rng, n, k)), _costs(rng, n, k))


def test_a_segment_is_chosen_when_only_it_fits():
    """Two blocks whose stored inputs overflow the budget when checkpointed one by one; as one segment
    they store one input: the only plan that fits, at the cost of checkpointing both."""
    blk = BlockTerms(d=(50, 50, 50, 30), F=(5, 5, 5, 5), B=(60, 60, 60, 60))
    t = Terms(1, ("b0", "b1"), 0, 0, 0, (blk, blk), segments={(0, 1): SegmentTerms((30, 30), (40, 40), (90, 90))})
    costs = ((0.0, 1.0), (0.0, 2.0))
    # every plan without the segment: block 0 stores 50 under block 1's backward term 60
    assert {predict(t, c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]} == {50 + 60}
    assert predict(t, with_segment((0, 0), 0, 1)) == 90
    sol = solve(t, costs, 95)
    assert sol is not None
    assert segments_of(sol.choice) == [(0, 1)]
    assert sol.choice == with_segment((0, 0), 0, 1)
    assert sol.cost == 3.0
    assert t.names(sol.choice) == (Entry(("b0", "b1")),)


def test_a_plan_that_overshot_cannot_come_back_after_tightening() -> None:
    """The room goes below the failed plan's own prediction by the overshoot: a plan predicted at 80
    under a room of 100 that measured 105 against a budget of 100 leaves a room of 75."""
    from ckpt_tune.tune.verify import tighten

    assert tighten(100, 80, 105, 100) == 75
    assert tighten(70, 80, 105, 100) == 65  # an already tighter room stays the bound


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_from_thinned_fronts_keeps_the_optimum(seed):
    """solve's first pass on fronts of ROUGH_CAP states bounds the exact pass: on chains too long for
    the brute force, at budgets from tight to loose, it returns the plan the unbounded DP does."""
    from ckpt_tune.tune import planner

    rng = random.Random(100 + seed)
    n, k = 32, 4
    t, costs = _random_terms(rng, n, k), _costs(rng, n, k)
    lo, hi = min_peak(t, costs).peak, predict(t, (0,) * n)
    for budget in (lo, lo + (hi - lo) // 8, (lo + hi) // 2, hi):
        room = budget - t.static - t.base
        ends = planner._dp(t, costs, room, planner._pareto)
        best = min(ends, key=lambda s: (s[1], s[2], planner._checkpointed(s[3])))
        sol = solve(t, costs, budget)
        assert (sol.choice, sol.cost, sol.peak) == (best[3], best[1], t.static + t.base + best[2])


def test_the_plan_verify_loop_tightens_resolves_and_gives_up() -> None:
    """verify.plan_and_verify, the loop of search and diagnose, over a planner that answers a plan
    predicted at the room (its choice: the solve's number)."""
    from ckpt_tune.tune.planner import Solution
    from ckpt_tune.tune.verify import MAX_TIGHTENINGS, plan_and_verify

    rooms: list[int] = []

    def solve_in(room: int) -> Solution:
        rooms.append(room)
        return Solution(choice=(len(rooms),), peak=room, cost=0.0)

    # every run 10 over the budget: tightened MAX_TIGHTENINGS times, then given up
    assert plan_and_verify(solve_in, 100, lambda s: (110, None)) is None
    assert rooms == [100 - 10 * i for i in range(MAX_TIGHTENINGS)]
    # the second run fits: its plan and what the run returned
    rooms.clear()
    sol, out = plan_and_verify(solve_in, 100, lambda s: (110 - 20 * (s.choice == (2,)), s.choice))
    assert (sol.choice, out, rooms) == ((2,), (2,), [100, 90])
    # a run that learned something (None): solved again in the same room, not tightened
    rooms.clear()
    found = plan_and_verify(solve_in, 100, lambda s: None if s.choice == (1,) else (s.peak, "ok"), room=95)
    assert (found[1], rooms) == ("ok", [95, 95])
    # max_solves bounds every solve, re-solves included; no plan within the room: None at once
    rooms.clear()
    assert plan_and_verify(solve_in, 100, lambda s: None, max_solves=5) is None
    assert len(rooms) == 5
    assert plan_and_verify(lambda room: None, 100, lambda s: (0, None)) is None
