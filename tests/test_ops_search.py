"""Op-level policies in the search (docs/design.md §4): offered per `--candidates`, priced, verified,
and dropped with a note where torch refuses them. Peaks are judged by the independent harness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.plan.entry import Action, to_data
from ckpt_tune.tune.memory_model import policy_of, predict
from ckpt_tune.tune.planner import solve
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO
from tests.harness import measured_peak

FX = ZOO["vit_dropout"]
B = 16


def searcher(fx=FX, candidates=None) -> Searcher:
    runner = StepRunner(fx.build(), fx.make_batch, fx.loss_fn, StepSettings(device="cpu"))
    runner.__enter__()
    return Searcher(runner, segments=True, candidates=candidates)


def test_candidates_choose_the_kinds_of_choice_offered() -> None:
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


def test_with_ops_the_plan_is_never_dearer_and_its_peak_is_exact() -> None:
    s = searcher()
    s.order_units(B)
    terms, costs = s.terms(B), s.costs(B)
    plain = s._restrict(terms)
    none, every = predict(terms, (0,) * len(s.units)), predict(terms, (1,) * len(s.units))
    without = [k for k, o in enumerate(s.options) if policy_of(o)]
    from ckpt_tune.tune.memory_model import price_out

    used = 0
    for frac in (0.2, 0.5, 0.8):
        budget = int(every + frac * (none - every))
        with_ops, no_ops = solve(plain, costs, budget), solve(price_out(plain, without), costs, budget)
        assert with_ops is not None
        assert no_ops is not None
        assert with_ops.cost <= no_ops.cost + 1e-9
        names = s.names(with_ops.choice)
        used += any(e.action is Action.SELECTIVE for e in names)
        truth = measured_peak(FX.build, FX.make_batch, FX.loss_fn, B, checkpoint=to_data(names))
        assert truth == with_ops.peak <= budget, (names, truth, with_ops.peak)
    assert used  # at some budget a policy is the cheapest way


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


def test_a_policy_torch_refuses_is_dropped_with_a_note() -> None:
    torch.manual_seed(0)
    runner = StepRunner(
        InPlaceNet(), lambda n: torch.randn(n, 32), lambda m, x: m(x).square().mean(), StepSettings(device="cpu")
    )
    with runner:
        s = Searcher(runner)
        s.order_units(8)
        assert any(policy_of(o) for o in s.options)
        s.terms(8)
        kept = [policy_of(o) for o in s.options if policy_of(o)]
        assert "matmuls" not in kept
        assert "half-matmuls" not in kept
        assert any("dropped" in n and "mutated" in n for n in s.notes), s.notes
        res = s.search(10**9, batch_size=8)
        assert res.verified_peak is not None


@pytest.mark.parametrize("bad", ["blocks,opz", ""])
def test_unknown_candidate_kinds_are_refused_with_a_hint(bad) -> None:
    from ckpt_tune.errors import CkptTuneError
    from ckpt_tune.vocab import candidate_kinds

    with pytest.raises(CkptTuneError) as info:
        candidate_kinds(bad)
    assert info.value.hint
