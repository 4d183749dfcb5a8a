"""Solve, run the plan, and tighten when it overshoots: the plan-verify loop (docs/design.md §4).

The memory model can be optimistic where its additivity assumptions do not hold (a sub-module option
beside its predecessor, a segment's estimated terms). A plan is therefore reported as fitting only
once a recorded run says so; when it overshoots, the room given to the planner shrinks by the
overshoot and the planner runs again, at most MAX_TIGHTENINGS times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.tune.planner import Solution, solve

MAX_TIGHTENINGS = 3

R = TypeVar("R")


def plan_and_verify(
    terms: Terms,
    costs: tuple[tuple[float, ...], ...],
    budget: int,
    run: Callable[[Solution], tuple[int, R]],
    room: int | None = None,
) -> tuple[Solution, R] | None:
    """The cheapest plan whose recorded peak fits `budget`, and what `run` returned for it; None when the
    planner finds nothing within the (tightened) room. `run(solution)` records the plan and returns
    (its peak in bytes, anything the caller wants back). `room` starts the planner below the budget."""
    room = budget if room is None else room
    for _ in range(MAX_TIGHTENINGS + 1):
        sol = solve(terms, costs, room)
        if sol is None:
            return None
        peak, out = run(sol)
        if peak <= budget:
            return sol, out
        room = tighten(room, sol.peak, peak, budget)
    return None


def tighten(room: int, predicted: int, measured: int, budget: int) -> int:
    """The planner's room after a plan predicted at `predicted` measured `measured` > `budget`: below
    that plan's own prediction by the overshoot, so the next plan differs (a plan predicted under a
    room already tightened would otherwise come back) and asks for what this one lacked."""
    return min(room, predicted) - (measured - budget)
