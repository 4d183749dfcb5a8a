"""Solve, run the plan, and tighten when it overshoots: the plan-verify loop (docs/design.md §4), the
one that `search` (tune/searcher.py, at each batch) and `diagnose` (diagnosis/) use.

The memory model can be optimistic where its additivity assumptions do not hold (a sub-module option
beside its predecessor, a segment's estimated terms). A plan is therefore reported as fitting only
once a recorded run says so; when it overshoots, the room given to the planner shrinks by the
overshoot and the planner runs again, after at most MAX_TIGHTENINGS tightenings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.tune.planner import Solution, solve

MAX_TIGHTENINGS = 3

R = TypeVar("R")


def plan_and_verify(
    solve_in: Callable[[int], Solution | None],
    budget: int,
    run: Callable[[Solution], tuple[int, R] | None],
    room: int | None = None,
    max_solves: int | None = None,
    tightenings: int = MAX_TIGHTENINGS,
) -> tuple[Solution, R] | None:
    """The cheapest plan whose recorded peak fits `budget`, and what `run` returned for it; None when the
    planner finds nothing within the (tightened) room, after `tightenings` tightenings (the plan solved
    after the last one is not run) or after `max_solves` solves.

    `solve_in(room)` solves for the cheapest plan predicted within `room` (on the terms as they are
    now); `run(solution)` records the plan and returns (its peak in bytes, anything the caller wants
    back), or None when it learned something that changes the terms (the plan is solved again, the
    room as it was). `room` starts the planner below the budget.
    """
    room = budget if room is None else room
    tightened = solves = 0
    while tightened < tightenings and (max_solves is None or solves < max_solves):
        sol = solve_in(room)
        if sol is None:
            return None
        solves += 1
        ran = run(sol)
        if ran is None:
            continue
        peak, out = ran
        if peak <= budget:
            return sol, out
        room = tighten(room, sol.peak, peak, budget)
        tightened += 1
    return None


def solving(terms: Terms, costs: tuple[tuple[float, ...], ...]) -> Callable[[int], Solution | None]:
    """`solve_in` for fixed terms and costs (what a diagnosis plans on)."""
    return lambda room: solve(terms, costs, room)


# A diagnosis runs the plan solved after the last tightening too: its runs are cheap (recorded moments).
DIAGNOSIS_TIGHTENINGS = MAX_TIGHTENINGS + 1


def tighten(room: int, predicted: int, measured: int, budget: int) -> int:
    """The planner's room after a plan predicted at `predicted` measured `measured` > `budget`: below
    that plan's own prediction by the overshoot, so the next plan differs (a plan predicted under a
    room already tightened would otherwise come back) and asks for what this one lacked."""
    return min(room, predicted) - (measured - budget)
