"""The every-block floor of a search's answer (docs/design.md §4).

The plan is never below what checkpointing every innermost block reaches: the "checkpoint every X" a
user would write. Where the chain's units are not those blocks, or the planner's estimate fell short,
that configuration is run above the chain's answer; when it fits a larger batch, it is the answer.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ckpt_tune.plan.entry import entries_of
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.memory_model import predict
from ckpt_tune.tune.search_result import FrontierRow, SearchResult
from ckpt_tune.tune.search_state import REAL_ROOM, SearchState
from ckpt_tune.units import format_bytes

FLOOR_STEPS_UP = 4  # batches above the every-block floor's estimate tried one by one


class EveryBlockFloor(SearchState):
    """`_floor(res, budget)`: the search's answer, or checkpointing every block where that reaches more."""

    def floor_may_differ(self) -> bool:
        """Whether checkpointing every innermost block is a configuration the chain does not hold: its
        blocks are not the chain's units (a holder taken whole, a DenseNet's stages), or the model's
        own forward loops over modules."""
        leaves = self._leaves()
        return set(leaves) != set(self.units) if leaves else bool(self._looping)

    def _floor_over(self, batch: int, budget: int) -> bool:
        """Whether every block checkpointed at this batch is predicted over the budget, less REAL_ROOM,
        on the terms of the probed batches nearest it (terms.py `near`): where the probes run on the
        device because fake tensors could not record the step, such a step is not run. Only where the
        chain holds that configuration (else the search leaves the floor out there)."""
        t = self.near(batch)
        return predict(t, (1,) * len(self.units)) > budget * (1 - REAL_ROOM)

    def _leaves(self) -> tuple[str, ...]:
        """The innermost blocks, less those refused as candidates and those inside another of them (a
        module shared into each block, as CoaT's convolutional position encodings: checkpointing the
        block recomputes it)."""
        model = self.runner.model
        blocks = [n for n in find_blocks(model) if n not in self._refused]
        inner = {id(sub) for n in blocks for sub in model.get_submodule(n).modules() if sub is not model.get_submodule(n)}
        return tuple(n for n in blocks if id(model.get_submodule(n)) not in inner)

    def _floor(self, res: SearchResult, budget: int) -> SearchResult:
        """The plan is never below what checkpointing every innermost block reaches (docs/design.md §4):
        the "checkpoint every X" a user would write. Where the chain's units are not those blocks (a
        group taken whole because its blocks are not a chain, a module that loops over its blocks), or
        the planner's estimate fell short, that configuration is run at the next batch; when it fits, it
        is the answer at the largest batch its measured peaks reach, verified. Every step it runs is
        checkpointed: one that runs out of device memory does not fit."""
        leaves = self._leaves()
        what = "every block"
        if not leaves and self._looping:  # a loop in the model's own forward: each call checkpointed
            leaves, what = self._looping, "the modules that run more than once per step"
        if not leaves:
            return res

        def peak_at(batch: int) -> int:
            if self.probes_within_budget and self._floor_over(batch, budget):
                return budget + 1  # not run: its step on the device would go past the budget
            self._at = batch
            self.runs += 1
            try:
                return self.runner.measure(batch, checkpoint=leaves).peak_bytes
            except torch.OutOfMemoryError:
                return budget + 1

        b = res.batch_size
        above = peak_at(b + 1)
        if above > budget:
            return res
        per = max(above - peak_at(b), 1)
        best, peak = b + 1, above
        guess = b + 1 + (budget - above) // per
        while guess > best:
            got = peak_at(guess)
            if got <= budget:
                best, peak = guess, got
                break
            guess -= max(1, -(-(got - budget) // per))
        for _ in range(FLOOR_STEPS_UP):  # the linear estimate is from two runs: one more batch may fit
            got = peak_at(best + 1)
            if got > budget:
                break
            best, peak = best + 1, got
        if self.real is not self.runner:  # probed under fake tensors: the answer is verified for real
            self.runs += 1
            peak = self._measure_plan(best, leaves, self.real).peak_bytes
            if peak > budget:
                return res
        # the checkpointed step's time: its blocks' forwards run twice, the plain step's once
        timing = self._time_real(best, checkpoint=leaves)
        again = sum(timing.forward_ms.get(n, 0.0) for n in leaves)
        recompute = again / max(timing.step_ms - again, 1e-9)
        predicted = above + (best - b - 1) * per  # linear in the batch from the two runs, made before `best` ran
        out = replace(
            res,
            batch_size=best,
            checkpoint=entries_of(leaves),
            predicted_peak=predicted,
            first_predicted_peak=predicted,
            resolved=False,
            verified_peak=peak,
            recompute_fraction=round(recompute, 4),
            step_ms=timing.step_ms - again,
            units=leaves,
            baselines={},
            notes=[*res.notes, f"checkpointing {what} ({len(leaves)}: {leaves[0]}{', …' if len(leaves) > 1 else ''}) reaches batch {best}, the "
                   f"chain's plan batch {b}: the answer is {what}, verified at {format_bytes(peak)}"],
        )
        # the plain step at this batch is not run (on a device of the budget's size it would not fit)
        out.baselines["every block"] = FrontierRow(best, out.checkpoint, peak, out.recompute_fraction, True)
        out.probes = self.runs
        self._real_counts(out)
        return out

