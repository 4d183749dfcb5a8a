"""The batch search over a peak function, without a model (ckpt_tune/tune/batch_search.py)."""

from __future__ import annotations

import pytest

from ckpt_tune.tune.batch_search import MAX_BATCH, largest, settle


def _linear(fixed: int, per: int, calls: list[int]):
    def peak(b: int) -> int:
        calls.append(b)
        return fixed + per * b

    return peak


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 9, 1000, MAX_BATCH])
def test_largest_finds_the_last_batch_a_monotone_test_holds_for(limit: int) -> None:
    assert largest(lambda b: b <= limit, 1) == limit


def test_largest_is_zero_when_the_first_batch_fails_and_stops_at_the_cap() -> None:
    assert largest(lambda b: False, 1) == 0
    assert largest(lambda b: True, 1) == MAX_BATCH


@pytest.mark.parametrize("budget", [1_000 + 100 * 4, 1_000 + 100 * 17 + 50, 1_000 + 100 * 250])
@pytest.mark.parametrize("guess", [1, 5, 17, 40, 900])
def test_settle_answers_the_largest_fitting_batch_from_any_guess(budget: int, guess: int) -> None:
    calls: list[int] = []
    answer = (budget - 1_000) // 100
    b = settle(_linear(1_000, 100, calls), lambda x: True, guess, budget, 1, 4)
    assert b == answer
    assert len(calls) == len(set(calls)), "each batch is probed once"
    assert answer + 1 in calls, "the next batch is shown not to fit"


def test_settle_needs_few_probes_on_a_linear_peak_from_a_good_guess() -> None:
    calls: list[int] = []
    assert settle(_linear(1_000, 100, calls), lambda x: True, 30, 1_000 + 100 * 30 + 10, 1, 4) == 30
    assert sorted(calls) == [4, 30, 31]


def test_settle_skips_a_batch_the_fitted_terms_rule_out() -> None:
    calls: list[int] = []
    # the secant through the probed batches puts batch 10 over, and the fitted terms agree: not probed
    b = settle(_linear(1_000, 100, calls), lambda x: x < 10, 9, 1_000 + 100 * 9 + 50, 1, 4)
    assert b == 9
    assert sorted(calls) == [4, 9]


def test_settle_is_zero_when_the_smallest_batch_does_not_fit() -> None:
    calls: list[int] = []
    assert settle(_linear(1_000, 100, calls), lambda x: True, 8, 1_050, 1, 4) == 0
    assert sorted(calls) == [1, 4]


def test_settle_on_a_peak_that_is_not_linear() -> None:
    def peak(b: int) -> int:  # steps of 4 samples (an allocator's rounding), then over at 23
        return 1_000 + 64 * ((b + 3) // 4) + (10**6 if b >= 23 else 0)

    assert settle(peak, lambda x: True, 5, 10**5, 1, 4) == 22
