"""The exact planner against brute force, on random and adversarial terms (pure, milliseconds)."""

from __future__ import annotations

import random

import pytest

from ckpt_tune.memory_model import BlockTerms, Terms, predict
from ckpt_tune.planner import brute_force, min_peak, solve


def _random_terms(rng: random.Random, n: int) -> Terms:
    blocks = []
    for _ in range(n):
        kept = rng.randint(5, 100)
        ckpt = rng.randint(1, kept)
        free_prev = rng.randint(0, 5)  # a block that does not keep its input frees its predecessor's output
        d = (kept, ckpt, kept - free_prev, ckpt)
        fwd = rng.randint(1, 60)
        bwd = rng.randint(kept, kept + 80)
        blocks.append(BlockTerms(d, (fwd, fwd + 1, fwd, fwd), (bwd, bwd + rng.randint(0, 20), bwd, bwd)))
    return Terms(1, tuple(f"b{i}" for i in range(n)), static=1000, base=10, fixed=rng.randint(0, 200), blocks=tuple(blocks))


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    t = _random_terms(rng, n)
    costs = tuple(rng.uniform(0.5, 3.0) for _ in range(n))
    lo, hi = min_peak(t, costs).peak, predict(t, (0,) * n)
    for budget in (lo - 1, lo, (lo + hi) // 2, hi):
        dp, bf = solve(t, costs, budget), brute_force(t, costs, budget)
        if bf is None:
            assert dp is None
            continue
        assert dp is not None
        assert abs(dp.cost - bf.cost) < 1e-9
        assert predict(t, dp.choice) == dp.peak <= budget


def test_min_peak_is_the_smallest_over_all_choices():
    rng = random.Random(7)
    for n in range(1, 9):
        t = _random_terms(rng, n)
        costs = tuple(1.0 for _ in range(n))
        assert min_peak(t, costs).peak == brute_force(t, costs, 10**12 * 0 + min_peak(t, costs).peak).peak


def test_knapsack_case_greedy_gets_wrong():
    # Three blocks; we must shed 10 units of stored bytes before the last block's backward. Greedy by
    # bytes-per-ms takes block a (9 saved for 1 ms), then needs another (a+c costs 1.6, a+b 2.5): the
    # optimum is block b alone (10 saved for 1.5 ms).
    def blk(kept, ckpt):
        return BlockTerms((kept, ckpt, kept, ckpt), (0, 0, 0, 0), (0, 0, 0, 0))

    last = BlockTerms((0, 0, 0, 0), (0, 0, 0, 0), (5, 5, 5, 5))
    t = Terms(1, ("a", "b", "c", "last"), 0, 0, 0, (blk(10, 1), blk(11, 1), blk(10, 9), last))
    costs = (1.0, 1.5, 0.6, 0.0)
    # stored before the last block: 31; budget 26 = 21 stored + 5 -> shed 10
    sol = solve(t, costs, 26)
    assert sol is not None
    assert sol.choice[:3] == (0, 1, 0)
    assert sol.cost == 1.5
    assert brute_force(t, costs, 26).cost == 1.5


def test_nothing_fits_returns_none():
    t = _random_terms(random.Random(3), 4)
    assert solve(t, (1.0,) * 4, t.static) is None


def test_large_chain_solves_quickly_enough_to_be_interactive():
    rng = random.Random(11)
    t = _random_terms(rng, 48)
    costs = tuple(rng.uniform(0.5, 3.0) for _ in range(48))
    budget = (min_peak(t, costs).peak + predict(t, (0,) * 48)) // 2
    sol = solve(t, costs, budget)
    assert sol is not None
    assert predict(t, sol.choice) <= budget
