"""A batch whose plans keep measuring over budget is given up for one smaller, however many solves that
batch took: the search answers at the largest batch with a verified plan, and says no plan fits (exit 3)
only where even the smallest batch has none. Simulated on CPU: every step recorded above a batch size
peaks over the budget, as where the memory model is optimistic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.plan.file import load_plan
from tests.fixtures.models import ZOO, write_target_file
from tests.harness import measured_peak

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def optimistic_above(monkeypatch, budget: int, fits_up_to: int) -> list[int]:
    """Every step recorded at a batch above `fits_up_to` peaks at least a byte over `budget` (the probes'
    terms come from their timelines, left as recorded, so the model still predicts a fit); returns the
    batch of each step recorded."""
    real = StepRunner.measure
    seen: list[int] = []

    def measure(self, batch_size, *args, **kwargs):
        m = real(self, batch_size, *args, **kwargs)
        seen.append(batch_size)
        if batch_size > fits_up_to:
            m = replace(m, peak_bytes=max(m.peak_bytes, budget + 1))
        return m

    monkeypatch.setattr(StepRunner, "measure", measure)
    return seen


def test_a_batch_whose_plans_keep_measuring_over_budget_steps_down(run, monkeypatch, tmp_path):
    budget, fits_up_to = 4 << 20, 12  # unpatched, mlp_blocks answers batch 30 at 4 MiB, verified
    target = write_target_file(tmp_path, "mlp_blocks")
    seen = optimistic_above(monkeypatch, budget, fits_up_to)
    out = tmp_path / "plan.yaml"
    code, stdout, err = run("search", target, "--device", "cpu", "--vram", f"{budget}B", "--out", str(out), "--json")
    assert code == 0, err
    # the search began at least 16 batches higher, each given up after two solves or more (a plan over
    # budget, then the step down): more than the 4 * 8 solves once allowed over all batches together
    assert max(seen) >= fits_up_to + 16
    plan = load_plan(out)
    assert plan.batch_size == fits_up_to  # the largest batch whose plan measured within the budget
    assert plan.verified_peak_bytes <= budget
    assert json.loads(stdout)["plan"]["batch_size"] == fits_up_to
    fx = ZOO["mlp_blocks"]
    truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, plan.batch_size, checkpoint=list(plan.checkpoint))
    assert truth == plan.verified_peak_bytes


def test_no_plan_fits_only_when_the_smallest_batch_has_none(run, monkeypatch, tmp_path):
    budget = 3_600_000  # unpatched, mlp_blocks answers batch 13
    target = write_target_file(tmp_path, "mlp_blocks")
    seen = optimistic_above(monkeypatch, budget, 0)  # nothing measured fits, at any batch
    code, _, err = run("search", target, "--device", "cpu", "--vram", f"{budget}B", "--candidates", "blocks", "--no-segments")
    assert code == 3
    assert "no verified plan fits" in err
    assert "at batch 1:" in err  # every batch down to the smallest was tried
    assert max(seen) > 8
