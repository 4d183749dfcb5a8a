"""On a GPU of exactly the budget's size, search's plain probes at a large batch run out of memory.
Simulated on CPU: the plain (no checkpointing) step raises OutOfMemoryError above a batch size."""

from __future__ import annotations

import torch

from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO
from tests.harness import measured_peak


def test_search_survives_plain_steps_that_do_not_fit_the_device(monkeypatch):
    fx = ZOO["mlp_blocks"]
    real_measure, real_time = StepRunner.measure, StepRunner.time_step

    def measure(self, batch_size, checkpoint=(), units=(), attribute=False, accum_steps=1, optimizer_step=True):
        if batch_size > 8 and not checkpoint:
            raise torch.OutOfMemoryError("simulated: the plain step exceeds the device")
        return real_measure(self, batch_size, checkpoint, units, attribute, accum_steps, optimizer_step)

    def time_step(self, batch_size, checkpoint=(), repeats=3):
        if batch_size > 8 and not checkpoint:
            raise torch.OutOfMemoryError("simulated: the plain step exceeds the device")
        return real_time(self, batch_size, checkpoint, repeats)

    monkeypatch.setattr(StepRunner, "measure", measure)
    monkeypatch.setattr(StepRunner, "time_step", time_step)
    every = [f"blocks.{i}" for i in range(6)]
    budget = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 24, checkpoint=every)
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        res = Searcher(runner).search(budget)
    assert res.batch_size > 8
    assert any("ran out of device memory" in n for n in res.notes)
    assert any("times scaled" in n for n in res.notes)
    truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, res.batch_size, checkpoint=list(res.checkpoint))
    assert res.verified_peak == truth <= budget


def test_states_over_the_budget_end_the_search_after_its_first_step():
    """Weights + gradients + optimizer state alone over the budget: no plan or batch can help, so the
    search answers after the one step that built them, without probing or timing anything."""
    import pytest

    from ckpt_tune.errors import NoFitError

    fx = ZOO["mlp_blocks"]
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        params, opt, _ = runner.state_bytes()
        s = Searcher(runner)
        with pytest.raises(NoFitError, match=r"optimizer state alone are .* more than the budget before any activation"):
            s.search(params + opt)  # the gradients are as large as the parameters: over
    assert s.runs == 1
    assert "probe" not in s.stage_seconds
    assert "timing" not in s.stage_seconds
