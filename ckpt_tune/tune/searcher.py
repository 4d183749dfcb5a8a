"""`search`: the largest batch that fits a budget, the cheapest checkpoint plan that reaches it, verified.

1. Candidates (candidates.py, ordering.py): the innermost repeated blocks of the model as a chain in
   execution order, and the blocks holding them (groups) as runs of it checkpointed whole.
2. Probe (terms.py, probing.py): recorded runs at a batch size give the memory model's terms
   (memory_model.py); two batch sizes give them as a line in batch size.
3. Outer search over batch sizes on the fitted terms, then on terms probed at the batches themselves
   (batch_search.py), so the final answer rests on terms measured at that batch, not extrapolated.
4. Solve (planner.py) for the least recompute time under the budget (costs: step_costs.py).
5. Verify: run the plan and measure. A plan over budget is never reported as fitting: the room is
   tightened by the overshoot and the planner runs again.

`Searcher` is that loop; the state it shares with its parts is `SearchState` (search_state.py).
"""

from __future__ import annotations

import torch

from ckpt_tune.errors import CkptTuneError, NoFitError, UserCodeError
from ckpt_tune.measure.forked import fork_map
from ckpt_tune.tune.batch_search import largest, settle
from ckpt_tune.tune.floor import EveryBlockFloor
from ckpt_tune.tune.memory_model import predict, segments_of
from ckpt_tune.tune.ordering import Ordering
from ckpt_tune.tune.planner import Solution, min_peak, solve
from ckpt_tune.tune.search_result import FrontierRow, SearchResult
from ckpt_tune.tune.search_state import first_line
from ckpt_tune.tune.step_costs import StepCosts
from ckpt_tune.tune.terms import TermStore
from ckpt_tune.tune.verdicts import Verdicts
from ckpt_tune.tune.verify import plan_and_verify
from ckpt_tune.units import format_bytes

__all__ = ["FrontierRow", "SearchResult", "Searcher"]

# A batch the fitted (linear) terms put this far over budget is taken as not fitting without probing it.
# Terms are linear in batch size to within allocator granularity; 2% is far above what was observed.
SKIP_MARGIN = 0.02
# What torch says when BatchNorm meets one value per channel (a batch of 1 on a 1x1 feature map).
ONE_SAMPLE_FAILS = "more than 1 value per channel"
# Plans with estimated segment terms verified per batch before segments not yet measured are dropped.
SEGMENT_TRIALS = 4
GAP_NOTE = "a real step held up to"
# Solves per batch in the plan-verify loop (tightenings, segment trials, dropped refinements together)
# before the batch is taken as not fitting and the search tries one smaller, as after verify.MAX_TIGHTENINGS.
SOLVES_PER_BATCH = 4 * 8


class Searcher(Ordering, StepCosts, TermStore, EveryBlockFloor, Verdicts):
    """Holds a StepRunner and the units; caches probes per batch size (`SearchState` has the arguments)."""

    # -- the search -------------------------------------------------------------------------
    def largest_fitting(self, budget: int, b1: int, b2: int) -> int:
        """Largest batch whose min-peak plan fits, on terms fitted from b1 and b2 (0 if none)."""
        costs = self.costs(b1)
        return largest(lambda b: min_peak(self.fitted(b, b1, b2), costs).peak <= budget, b1)

    def _min_peak_at(self, b: int, b1: int, budget: int) -> int:
        """Smallest predicted peak at b, on terms probed at b itself (and FLOPs counted there, should b
        be the answer, in the same share-out)."""
        # the first batch settle probes is the fitted guess, most often the answer: its plan is verified
        # alongside (a later one is a step of a walk, where a verification each would mostly be wasted)
        first = not self._settled and b not in (self.b1, self.b2)
        self._settled = self._settled or first
        self.prefetch((b,), timing=(b,) if b not in (self.b1, self.b2) else (), budget=budget if first else None)
        return min_peak(self.terms(b), self.costs(b1)).peak

    def _settle(self, guess: int, budget: int, b1: int, b2: int) -> int:
        """The largest batch that fits on terms probed at that batch, with the next one shown not to
        (batch_search.settle, from the fitted guess)."""
        b = settle(lambda x: self._min_peak_at(x, b1, budget), lambda x: self._may_fit(x, budget, b1, b2), guess, budget, b1, b2)
        if b == 0:
            raise self._no_fit(budget, b1)
        return b

    def _may_fit(self, b: int, budget: int, b1: int, b2: int) -> bool:
        """False when the terms of the probed batches nearest b (`near`) put it more than SKIP_MARGIN over
        budget: no need to probe it."""
        if b in self.probed:
            return True
        return min_peak(self.near(b), self.costs(b1)).peak <= budget * (1 + SKIP_MARGIN)

    def feasible_at(self, b: int, budget: int) -> Solution | None:
        return solve(self.terms(b), self.costs(b), budget)

    def search(self, budget: int, batch_size: int | None = None, b1: int | None = None, b2: int | None = None) -> SearchResult:
        """The largest batch that fits `budget` (or `batch_size`) and its cheapest verified plan. A
        failure after the user's plain step ran is ckpt-tune's (docs/design.md §8): LimitationError."""
        try:
            res = self._search(budget, batch_size, b1, b2)
            # under fake tensors only where the floor is a configuration the chain does not hold (each
            # of its steps is recorded, and a chain of the innermost blocks has it already)
            floor = not self.runner.fake or self.floor_may_differ()
            # probes on the device, within the budget: only a floor the terms can predict (floor.py)
            floor = floor and not (self.probes_within_budget and self.floor_may_differ())
            if batch_size is None and self.world_size == 1 and self.accum_steps == 1 and floor:
                res = self.refinement("the every-block floor", "the plan", lambda: self._floor(res, budget), res)
                res.notes.extend(n for n in self.notes if n not in res.notes)  # a note of its dropping
            return res
        except (torch.OutOfMemoryError, MemoryError, KeyboardInterrupt):
            raise
        except CkptTuneError as e:
            if not self.plain_ran or not isinstance(e, UserCodeError):
                raise
            self._plain_again()
            raise self._limitation(e) from e
        except Exception as e:
            if not self.plain_ran:
                raise
            self._plain_again()
            raise self._limitation(e) from e

    def _first_steps(self, batch_size: int) -> None:
        """The ordering step; with probes under fake tensors, the user's step run for real first
        (`_real_plain`), so that whatever the user's code keeps from its first call (a cached batch, a
        lazily built buffer) is made of real tensors, as in training."""
        if not self.plain_ran and self.real is not self.runner:
            self._real_plain(batch_size)
            self.policies_ahead(batch_size)
        try:
            self.order_units(batch_size)
        finally:
            if self._ahead is not None:  # not asked for (the ordering offered no op policy, or failed)
                self._ahead.close()
                self._ahead = None

    def _real_plain(self, batch_size: int) -> None:
        """Probes under fake tensors: the user's step run for real once, at the first small batch, as it
        is (the first step of any search), so that a failure of the real step is the user's and what
        fails later is ckpt-tune's. Recorded from cold on a CPU, as a fake step is: one iteration, not a
        warm-up and then the recorded one (runner.py `measure`)."""
        self._say(f"running the step for real at batch {batch_size}")
        self.real.measure(batch_size, cold=True)
        self.runs += 1
        self.plain_ran = True

    def _plain_again(self) -> None:
        """After a failure: the user's plain step at the batch it happened at, with nothing of ckpt-tune's
        added. It raising (make_batch or the model cannot take that batch) is the user's error."""
        if self._at is not None and (self._at != self.b1 or self.real is not self.runner):
            self.real.measure(self._at)

    def _search(self, budget: int, batch_size: int | None, b1: int | None, b2: int | None) -> SearchResult:
        self.b1, self.b2 = b1 or self.b1, b2 or self.b2
        self._settled = False
        self.budget = budget
        try:
            self._first_steps(self.b1)
        except Exception as e:  # raised by the user's model (session.user_errors words it for the user)
            if self.b1 != 1 or ONE_SAMPLE_FAILS not in str(e):
                raise
            # BatchNorm over a 1x1 feature map cannot train on one sample: the smallest batch is 2
            self.notes.append("batch 1 cannot train this model (BatchNorm needs more than one value per channel): batches start at 2")
            self.b1 = 2
            self._first_steps(self.b1)
        b1, b2 = self.b1, self.b2
        over = self._states_over(budget)  # the ordering step has built every state: nothing to probe
        if over is not None:
            raise over
        self.prefetch((b1, b2) if batch_size is None else (batch_size, b1, b2), timing=(batch_size or b1,))
        if batch_size is None:
            guess = self.largest_fitting(budget, b1, b2)
            if guess == 0:
                raise self._no_fit(budget, b1)
            b = self._settle(guess, budget, b1, b2)
        else:
            b = batch_size
        while True:
            found, verified = self._plan_at(b, budget)
            if found is not None:
                return self._reported(b, *found, budget)
            if batch_size is None and b > b1:  # this batch does not fit after all: a smaller one
                b = self._below(b, budget, b1, b2)
                continue
            raise self._no_fit(budget, b, verified)

    def _below(self, b: int, budget: int, b1: int, b2: int) -> int:
        """The batch to try after no plan fitted at b: one smaller, or, where a real step held more than
        its prediction on fake-probed terms (`real_gap`: an allocation fake tensors do not see, such as a
        CPU kernel's workspace at larger batches), the largest batch that fits the budget less that gap
        (fitted, then settled on probes), where smaller: each batch on the way down would otherwise
        verify a plan for real past the budget (docs/design.md §4)."""
        room = budget - self.real_gap
        if self.real_gap <= 0 or room <= 0 or b - 1 <= b1:
            return b - 1
        guess = self.largest_fitting(room, b1, b2)
        if not 0 < guess < b - 1:
            return b - 1
        try:
            return max(min(self._settle(guess, room, b1, b2), b - 1), b1)
        except NoFitError:
            return b - 1

    def _plan_at(self, b: int, budget: int) -> tuple[tuple[Solution, tuple[int, bool]] | None, dict]:
        """The plan-verify loop at batch b (verify.py), with what a search adds to a plan's run: a plan
        verified alongside the probes is not run again; one that fails is solved again without the
        refinements it used; one with estimated segment terms is solved again on the terms its run
        measured; where the probes are fake, one is recorded under fake tensors before it runs for real,
        and runs only where that fits (`over_under_fake`). Should the solves run out before a plan solved
        on measured terms fits, the cheapest plan that was verified within the budget when solved on
        estimated terms is reported (its prediction the one made before its run): a plan that fits, found
        and measured, is not given up for a smaller batch. ((solution, (verified peak, solved again after its run)) or None, {choice: peak})."""
        verified: dict[tuple[int, ...], int] = {}  # choice -> its measured peak, at batch b
        fitted: list[Solution] = []  # solved on estimated segment terms, verified within the budget
        recorded: list[tuple[Solution, tuple]] = []  # the same, recorded within it under fake tensors
        trials = 0

        def run(sol: Solution) -> tuple[int, tuple[int, bool]] | None:
            nonlocal trials
            rerun = sol.choice in verified  # solved again after its own run, on terms learned from it
            if not rerun:
                self._first_predicted.setdefault((b, sol.choice), sol.peak)
            if sol.choice not in verified and (b, sol.choice) in self.speculated and self.accum_steps == 1 and not segments_of(sol.choice):
                verified[sol.choice] = self.speculated[(b, sol.choice)]  # verified alongside the probes at b
            if sol.choice not in verified:
                segs = segments_of(sol.choice)
                estimated = any(self._prev_of(sol.choice, i) not in self.terms(b).segments[(i, j)].measured for i, j in segs)
                try:
                    if estimated and self.real is not self.runner:
                        names = tuple(sol.names(self.terms(b)))
                        if self.learn_under_fake(b, names, sol.choice) <= budget:
                            recorded.append((sol, names))
                        trials += 1
                        if trials >= SEGMENT_TRIALS:
                            self.drop_estimated_segments(b)
                        return None
                    names = tuple(sol.names(self.terms(b)))
                    over = self.over_under_fake(b, names, sol.choice, budget)
                    if over is not None:  # recorded past the budget under fake tensors: not run, solved tighter
                        verified[sol.choice] = over
                        return over, (over, rerun)
                    verified[sol.choice] = self.verify(b, names, sol.choice)
                    if self.real is not self.runner:
                        self._gap(b, verified[sol.choice] - self._fake_peaks.get((b, sol.choice), sol.peak))
                except (torch.OutOfMemoryError, NoFitError, KeyboardInterrupt):
                    raise
                except Exception as e:
                    if not self._drop_refinements(sol.choice, e):
                        raise
                    return None
                if estimated:
                    # the segments' terms are measured now: solve again on them before trusting the plan
                    if verified[sol.choice] <= budget:
                        fitted.append(sol)
                    trials += 1
                    if trials >= SEGMENT_TRIALS:
                        self.drop_estimated_segments(b)
                    return None
            return verified[sol.choice], (verified[sol.choice], rerun)

        solve_in = lambda room: solve(self.terms(b), self.costs(b), room)  # noqa: E731
        found = plan_and_verify(solve_in, budget, run, room=budget - self.real_gap, max_solves=SOLVES_PER_BATCH)
        if found is None and not fitted and recorded:
            # probes under fake tensors: the cheapest such plan recorded within the budget, verified now
            best, names = min(recorded, key=lambda x: x[0].cost)
            verified[best.choice] = self.verify(b, names, best.choice)
            if verified[best.choice] <= budget:
                fitted.append(best)
        if found is None and fitted:
            best = min(fitted, key=lambda x: x.cost)
            self.notes.append(
                f"batch {b}: solved again on measured segment terms, no plan fitted before the solves ran out; "
                "reported: the cheapest plan that was verified within the budget, solved on estimated terms"
            )
            found = best, (verified[best.choice], False)
        return found, verified

    def _gap(self, b: int, over: int) -> None:
        """A real step at b held `over` bytes above its plan's record under fake tensors (where none, its
        prediction on fake-probed terms): an allocation fake tensors do not see. The batches below are
        planned with that much less room (`_below`), every record is judged with it
        (`over_under_fake`), and the output says so."""
        if over <= self.real_gap or over <= 0:
            return
        self.real_gap = over
        self.notes[:] = [n for n in self.notes if not n.startswith(GAP_NOTE)]
        self.notes.append(
            f"{GAP_NOTE} {format_bytes(over)} above its record under fake tensors "
            f"(at batch {b}); smaller batches were planned with that much less room"
        )

    def _reported(self, b: int, sol: Solution, verified: tuple[int, bool], budget: int) -> SearchResult:
        """The result for the plan verified at b, with the prediction made before its first run."""
        peak, rerun = verified
        res = self._result(b, sol, peak, budget)
        res.first_predicted_peak = self._first_predicted.get((b, sol.choice), sol.peak)
        res.resolved = rerun and res.first_predicted_peak != sol.peak
        if res.resolved:
            res.notes.append(
                f"predicted at {format_bytes(res.first_predicted_peak)} before its first run, where its "
                f"segments' terms were estimated; solved again on the terms that run measured: "
                f"{format_bytes(res.predicted_peak)}, the plan file's predicted_peak_bytes"
            )
        return res

    def _drop_refinements(self, choice: tuple[int, ...], error: BaseException) -> bool:
        """A plan failed when run: drop what it used beyond checkpointing whole blocks (its segments,
        groups, sub-module options and op policies) and say so; False when it used none of those."""
        segs = segments_of(choice)
        runs = [key for key in segs if key not in self.spans]
        groups = [key for key in segs if key in self.spans]
        finer = sorted({k for k in choice if k >= 2})
        if not (runs or groups or finer):
            return False
        if runs or groups:
            # what failed, not the user's function it failed in (session.user_errors words the call)
            while isinstance(error.__cause__, Exception):
                error = error.__cause__
            self._forbid_segments(runs + groups, first_line(error))
        for k in finer:
            self._drop_option(self.options[k], error)
        return True

    def _result(self, b: int, sol: Solution, verified: int, budget: int) -> SearchResult:
        costs, step = self.costs(b), self.step_ms(b)
        res = SearchResult(
            batch_size=b,
            checkpoint=sol.names(self.terms(b)),
            predicted_peak=sol.peak,
            verified_peak=verified,
            recompute_fraction=round(sol.cost / step, 4),
            budget=budget,
            units=self.units,
            step_ms=step,
        )
        n = len(self.units)
        t = self.terms(b)
        for label, choice in (("no checkpointing", (0,) * n), ("every block", (1,) * n)):
            peak = t.measured.get(choice, predict(t, choice))
            cost = sum(c[x] for c, x in zip(costs, choice, strict=False))
            res.baselines[label] = FrontierRow(b, t.names(choice), peak, round(cost / step, 4), peak <= budget)
        res.probes = self.runs
        res.notes.extend(self.notes)
        res.extended_terms = self.repeat.extended() if self.repeat is not None and self._kind == 1 else {}
        res.stage_seconds = dict(self.stage_seconds)
        self._real_counts(res)
        return res

    def frontier_sizes(self, b: int) -> list[int]:
        """The batch sizes the frontier shows around answer b."""
        return sorted({self.b1, self.b2, max(1, b // 2), b, b + 1})

    def frontier(self, budget: int, batch_sizes: list[int], b1: int, b2: int, timed_at: int) -> list[FrontierRow]:
        """Best plan per batch size on the terms of the probed batches nearest it (`near`); recompute as a
        fraction of the step timed at `timed_at`.
        Rows solved alongside the probes at `timed_at` (`_record_shorts`) are taken as they came where
        nothing they rest on changed since: the same options, the same probed batches nearest them."""
        got = self.frontiers.get((self._kind, budget, tuple(batch_sizes), b1, b2, timed_at))
        kept: dict[int, FrontierRow] = {}
        if got is not None and got[1] == self._version:
            kept = {r.batch_size: r for r in got[0] if self.nearest(r.batch_size, got[2]) == self.nearest(r.batch_size, self.probed)}
        todo = [b for b in batch_sizes if b not in kept]
        if not todo:
            return [kept[b] for b in batch_sizes]
        # probed here, before the solves are shared out, and before the costs are read: a probe that drops
        # a failing option renumbers the options and clears the costs timed with it
        self.terms(b1), self.terms(b2)
        costs, step = self.costs(timed_at), self.step_ms(timed_at)
        # each batch's solve is pure arithmetic on recorded terms: under fake tensors, where a 70B's
        # loose budget at batch 1 makes a large DP, they are shared out over the cores (measure/forked.py)
        rows = dict(zip(todo, fork_map(lambda b: self._row(b, budget, costs, step), todo, self._workers(len(todo))), strict=True))
        return [kept.get(b) or rows[b] for b in batch_sizes]

    def _row(self, b: int, budget: int, costs, step: float) -> FrontierRow:
        t = self.near(b)
        sol = solve(t, costs, budget)
        if sol is None:
            mp = min_peak(t, costs)
            return FrontierRow(b, mp.names(t), mp.peak, round(mp.cost / step, 4), False)
        return FrontierRow(b, sol.names(t), sol.peak, round(sol.cost / step, 4), True)

