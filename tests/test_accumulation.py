"""Gradient accumulation: from the second micro-batch on, every gradient is live through forward and
backward, so a micro-batch that fits alone may not fit with accumulation. `search --target-batch`
plans and verifies the accumulated iteration; ground truth is tests/harness.py with `accum_steps`."""

from __future__ import annotations

import pytest

from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.tune.search import _fit_target_batch
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO
from tests.harness import measured_peak


@pytest.mark.parametrize(("name", "plan"), [("mlp_blocks", []), ("residual_chain", ["blocks.1", ("blocks.3", "blocks.4")])])
def test_runner_measures_an_accumulated_iteration_as_the_harness_does(name, plan):
    fx = ZOO[name]
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        single = runner.measure(64, checkpoint=plan).peak_bytes
        accumulated = runner.measure(64, checkpoint=plan, accum_steps=3).peak_bytes
    assert accumulated == measured_peak(fx.build, fx.make_batch, fx.loss_fn, 64, checkpoint=plan, accum_steps=3)
    assert accumulated > single  # the summed gradients are live through the later micro-batches


def test_target_batch_plan_fits_with_its_accumulation_steps():
    fx = ZOO["residual_chain"]
    every = [f"blocks.{i}" for i in range(10)]
    budget = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 512, checkpoint=every)
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        s = Searcher(runner, segments=True)
        alone = s.search(budget)
        want = 3 * (alone.batch_size // 4) * 4  # divisible by 2..4 and 6: a micro-batch of a useful size
        res = _fit_target_batch(s, alone, want, budget)
    assert 3 <= res.grad_accum_steps <= 6
    assert res.batch_size * res.grad_accum_steps == want
    truth = measured_peak(
        fx.build, fx.make_batch, fx.loss_fn, res.batch_size, checkpoint=list(res.checkpoint), accum_steps=res.grad_accum_steps
    )
    assert truth <= budget
    assert res.verified_peak == truth
    assert abs(res.predicted_peak - truth) <= 0.03 * truth
    # the micro-batch that fits alone does not fit with accumulation: it overshoots by the gradients
    over = measured_peak(
        fx.build, fx.make_batch, fx.loss_fn, alone.batch_size, checkpoint=list(alone.checkpoint), accum_steps=3
    )
    assert over > budget


def test_a_later_search_that_chooses_other_op_policies_forgets_what_was_measured_with_the_old_ones(monkeypatch):
    """Which op policies are worth offering is timed, so the target batch's second search may offer
    others than the first: terms and costs numbered by the old options are not reused (they once
    ended in an IndexError in the frontier's solve)."""
    import ckpt_tune.tune.step_costs as step_costs_module

    fx = ZOO["vit_dropout"]
    # every policy priced at half a block's recompute the first time it is timed (worth offering), then
    # at a whole block's (not worth it): the timing a busy machine can give
    calls = []

    def ratios(runner, batch_size, units, policies, repeats=3):
        calls.append(batch_size)
        return {(u, p): 0.5 if len(calls) == 1 else 1.0 for u in units for p in policies}, {}

    monkeypatch.setattr(step_costs_module, "policy_ratios", ratios)
    budget = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 24)
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        s = Searcher(runner, segments=False, candidates=frozenset({"blocks", "ops"}))
        alone = s.search(budget)
        first = s.options
        again = s.search(budget)  # the same search, timed again: no op policy is worth it now
        assert len(first) > len(s.options) == 2
        # every term it solved on numbers the options it has now
        assert s.terms(s.b1).k == s.terms(s.b2).k == s.terms(again.batch_size).k == len(s.options)
        res = _fit_target_batch(s, alone, 2 * alone.batch_size, budget)
        rows = s.frontier(budget, s.frontier_sizes(res.batch_size), s.b1, s.b2, res.batch_size)
    assert rows
    assert res.batch_size * res.grad_accum_steps == 2 * alone.batch_size
    truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, again.batch_size, checkpoint=list(again.checkpoint))
    assert again.verified_peak == truth <= budget
