"""Op-level policies in the search (docs/design.md §4): offered per `--candidates`, priced, verified,
and dropped with a note where torch refuses them. Peaks are judged by the independent harness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.plan.entry import Action, to_data
from ckpt_tune.plan.kinds import policy_of
from ckpt_tune.tune.memory_model import predict
from ckpt_tune.tune.planner import solve
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO
from tests.harness import measured_peak

FX = ZOO["vit_dropout"]
B = 16


@pytest.fixture
def cheap_policies(monkeypatch):
    """Policies priced at half a whole-block checkpoint: whether one pays on this machine is a measured
    figure (benchmarks/ops.py); these tests check what follows from the price, not the price."""
    import ckpt_tune.tune.step_costs as step_costs_module

    def half(runner, batch_size, units, policies, repeats=3):
        return {(u, p): 0.5 for u in units for p in policies}, {}

    monkeypatch.setattr(step_costs_module, "policy_ratios", half)


def searcher(fx=FX, candidates=None) -> Searcher:
    runner = StepRunner(fx.build(), fx.make_batch, fx.loss_fn, StepSettings(device="cpu"))
    runner.__enter__()
    return Searcher(runner, segments=True, candidates=candidates)


def test_candidates_choose_the_kinds_of_choice_offered(cheap_policies) -> None:
    only_blocks = searcher(candidates=frozenset({"blocks"}))
    only_blocks.order_units(B)
    assert only_blocks.options == ("none", "block")
    assert only_blocks.segment_keys == ()
    every = searcher()
    every.order_units(B)
    policies = [policy_of(o) for o in every.options if policy_of(o)]
    # the ViT's attention runs as bmm (no fused kernel): a policy keeping only fused attention keeps nothing
    assert policies == ["matmuls", "half-matmuls"]
    assert any("left out: attention" in n for n in every.notes)
    assert "attn" in every.options
    assert every.segment_keys


def test_with_ops_the_plan_is_never_dearer_and_its_peak_is_exact(cheap_policies) -> None:
    from ckpt_tune.tune.memory_model import price_out

    s = searcher()
    s.order_units(B)
    terms, costs = s.terms(B), s.costs(B)
    none, every = predict(terms, (0,) * len(s.units)), predict(terms, (1,) * len(s.units))
    policies = [k for k, o in enumerate(s.options) if policy_of(o)]
    # to check a policy's bytes wherever it could go, make it cheaper still
    cheap = tuple(tuple(c * (0.1 if k in policies else 1.0) for k, c in enumerate(row)) for row in costs)
    used = 0
    for frac in (0.2, 0.5, 0.8):
        budget = int(every + frac * (none - every))
        with_ops, no_ops = solve(terms, costs, budget), solve(price_out(terms, policies), costs, budget)
        assert with_ops is not None
        assert no_ops is not None
        assert with_ops.cost <= no_ops.cost + 1e-9
        sol = solve(terms, cheap, budget)
        names = s.names(sol.choice)
        used += any(e.action is Action.SELECTIVE for e in names)
        truth = measured_peak(FX.build, FX.make_batch, FX.loss_fn, B, checkpoint=to_data(names))
        assert truth == sol.peak <= budget, (names, truth, sol.peak)
    assert used == 3


class InPlaceBlock(nn.Module):
    """A block that changes a matmul's output in place: torch refuses to keep it for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h.relu_()
        return x + self.down(h)


class InPlaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(InPlaceBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_policy_torch_refuses_is_left_out_with_a_note() -> None:
    torch.manual_seed(0)
    runner = StepRunner(
        InPlaceNet(), lambda n: torch.randn(n, 32), lambda m, x: m(x).square().mean(), StepSettings(device="cpu")
    )
    with runner:
        s = Searcher(runner)
        res = s.search(10**9, batch_size=8)
        assert s.options == ("none", "block")
        assert any("matmuls left out" in n and "mutated" in n for n in s.notes), s.notes
        assert res.verified_peak is not None


def test_a_policy_as_dear_as_the_whole_block_is_left_out(monkeypatch) -> None:
    import ckpt_tune.tune.step_costs as step_costs_module

    def dear(runner, batch_size, units, policies, repeats=3):
        return {(u, p): 0.95 if p == "matmuls" else 0.7 for u in units for p in policies}, {}

    monkeypatch.setattr(step_costs_module, "policy_ratios", dear)
    s = searcher()
    s.order_units(B)
    assert [policy_of(o) for o in s.options if policy_of(o)] == ["half-matmuls"]
    assert any("matmuls left out: its recompute costs 0.95x" in n for n in s.notes), s.notes
    assert min(s.costs(B)[0][1:]) > 0


def test_under_fake_tensors_a_policy_as_dear_as_the_whole_block_on_its_roofline_is_left_out(monkeypatch) -> None:
    """No device to time under fake tensors: the roofline share of the block's forward that a policy
    recomputes is its price, and the same rule leaves out one at nine tenths of the block or more."""
    import ckpt_tune.tune.step_costs as step_costs_module
    from ckpt_tune.measure import fake_inputs, loader

    def shares(runner, batch_size, units, policies, repeats=3):
        return {(u, p): {"matmuls": 0.95, "half-matmuls": 0.7}.get(p, 1.0) for u in units for p in policies}

    def timed(*a, **k):
        raise AssertionError("no policy is timed under fake tensors")

    monkeypatch.setattr(step_costs_module, "recompute_shares", shares)
    monkeypatch.setattr(step_costs_module, "policy_ratios", timed)
    target = loader.Target("vit", __name__, None, "build", FX.build, FX.make_batch, FX.loss_fn, "make_batch", "loss_fn")
    model, batch_fn = fake_inputs.build_fake_model(target), fake_inputs.fake_batch_fn(target)
    with StepRunner(model, batch_fn, FX.loss_fn, StepSettings(device="meta")) as runner:
        s = Searcher(runner)
        s.order_units(2)
    assert [policy_of(o) for o in s.options if policy_of(o)] == ["half-matmuls"]
    assert any("matmuls left out: its recompute costs 0.95x checkpointing the whole block on a roofline" in n for n in s.notes), s.notes
    assert any("left out: attention" in n for n in s.notes), s.notes  # a share of 1.0: it keeps nothing


@pytest.mark.parametrize("bad", ["blocks,opz", ""])
def test_unknown_candidate_kinds_are_refused_with_a_hint(bad) -> None:
    from ckpt_tune.errors import CkptTuneError
    from ckpt_tune.plan.kinds import parse_candidates

    with pytest.raises(CkptTuneError) as info:
        parse_candidates(bad)
    assert info.value.hint


@pytest.mark.parametrize("room", [1.05, 8.0])
def test_op_policies_are_timed_at_a_batch_whose_step_fits_the_budget(monkeypatch, room) -> None:
    """The op policies are timed by real forwards on the device (`policy_ratios`): at the second small
    batch only where its plain step fits the budget, so that timing them never runs the device past it;
    with room, at the second small batch."""
    import ckpt_tune
    import ckpt_tune.tune.step_costs as step_costs_module
    from ckpt_tune.measure.session import Settings

    asked: list[int] = []

    def ratios(runner, batch_size, units, policies, repeats=3):
        asked.append(batch_size)
        return {(u, p): 0.95 for u in units for p in policies}, {}

    monkeypatch.setattr(step_costs_module, "policy_ratios", ratios)
    gpt = "examples/gpt.py:build"
    from ckpt_tune.measure import loader

    t = loader.load_target(gpt)
    budget = int(room * measured_peak(t.build_fn, t.batch_fn, t.loss_fn, 1))
    ckpt_tune.search(gpt, vram=str(budget), settings=Settings(device="cpu"))
    assert asked
    assert all(measured_peak(t.build_fn, t.batch_fn, t.loss_fn, b) <= budget for b in asked), (asked, budget)
    if room > 2:
        assert 4 in asked
