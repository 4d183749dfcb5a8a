"""Segments: consecutive blocks under one checkpoint (ckpt_tune/plan/segment.py), from `apply` to `search`.

Ground truth is tests/harness.py, whose segment wrapper is written independently with the public
torch.utils.checkpoint API; equality of losses, gradients, BatchNorm statistics and the random stream
against the unwrapped model is tested with the other plans in tests/test_apply.py.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from ckpt_tune.errors import PlanError
from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.plan.apply import applied_names, apply, remove
from ckpt_tune.tune.memory_model import predict, with_segment
from ckpt_tune.tune.planner import all_choices
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO, ResidualChain, _chain_batch, _mse_loss
from tests.harness import measured_peak

CHAIN = ZOO["residual_chain"]
SEG = ("blocks.2", "blocks.3", "blocks.4")


def step(model: nn.Module, batch, seed: int = 1):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = CHAIN.loss_fn(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


# -- the wrapper ---------------------------------------------------------------------------------------


def test_segment_recomputes_its_blocks_once_each_and_runs_their_hooks_once():
    model, batch = CHAIN.build(), CHAIN.make_batch(4)
    reference = copy.deepcopy(model)
    apply(model, [SEG])
    assert applied_names(model) == SEG
    calls = dict.fromkeys(SEG, 0)
    hooks = dict.fromkeys(SEG, 0)
    for name in SEG:
        block = model.get_submodule(name)
        block.fc1.register_forward_pre_hook(lambda m, a, n=name: calls.__setitem__(n, calls[n] + 1))
        block.register_forward_pre_hook(lambda m, a, n=name: hooks.__setitem__(n, hooks[n] + 1))
    assert same(step(model, batch), step(reference, batch))
    assert calls == dict.fromkeys(SEG, 2)  # forward, then the one recompute in backward
    assert hooks == dict.fromkeys(SEG, 1)  # the blocks' own hooks stay outside the checkpoint


def test_eval_and_no_grad_run_plain_and_remove_restores():
    model, batch = CHAIN.build(), CHAIN.make_batch(4)
    reference = copy.deepcopy(model)
    apply(model, [SEG])
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(batch[0]), reference(batch[0]))
    remove(model)
    assert applied_names(model) == ()
    assert all("forward" not in model.get_submodule(n).__dict__ for n in SEG)
    assert same(step(model, batch), step(reference, batch))


def test_blocks_out_of_order_raise_and_leave_no_region_open():
    class Skips(ResidualChain):
        def forward(self, x):
            for i in (0, 1, 2, 4, 3, 5, 6, 7, 8, 9):  # block 4 before block 3
                x = self.blocks[i](x)
            return self.head(x)

    torch.manual_seed(0)
    model, batch = Skips(), CHAIN.make_batch(4)
    apply(model, [SEG])
    with pytest.raises(RuntimeError, match="ran out of order"):
        step(model, batch)
    remove(model)
    # no saved-tensor hooks were left behind: a plain step still matches a fresh copy
    assert same(step(model, batch), step(copy.deepcopy(model), batch))


def test_a_block_that_raises_closes_the_region():
    model, batch = CHAIN.build(), CHAIN.make_batch(4)
    apply(model, [SEG])
    with pytest.raises(RuntimeError, match=r"size mismatch|shapes cannot be multiplied"):
        model(torch.randn(4, 3))
    reference = copy.deepcopy(model)
    remove(reference)
    assert same(step(model, batch), step(reference, batch))


def test_apply_refuses_bad_segments():
    model = CHAIN.build()
    with pytest.raises(PlanError, match="segment of 1 block"):
        apply(model, [("blocks.0",)])
    with pytest.raises(PlanError, match="more than once"):
        apply(model, [("blocks.0", "blocks.1"), "blocks.1"])
    with pytest.raises(PlanError, match="no module named"):
        apply(model, [("blocks.0", "blocks.99")])
    apply(model, ["blocks.3"])
    with pytest.raises(PlanError, match="already checkpointed"):
        apply(model, [SEG])
    remove(model)
    apply(model, [SEG])
    apply(model, [SEG])  # idempotent
    assert applied_names(model) == SEG


# -- memory ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        [SEG],
        [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3"), "blocks.5", ("blocks.6", "blocks.7", "blocks.8", "blocks.9")],
        [tuple(f"blocks.{i}" for i in range(10))],
    ],
)
def test_runner_measures_what_the_independent_harness_measures(plan):
    with StepRunner(CHAIN.build(), CHAIN.make_batch, CHAIN.loss_fn) as runner:
        got = runner.measure(256, checkpoint=plan).peak_bytes
    assert got == measured_peak(CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, 256, checkpoint=plan)


def test_segments_store_less_than_one_checkpoint_per_block():
    every = [f"blocks.{i}" for i in range(10)]
    pairs = [(f"blocks.{i}", f"blocks.{i + 1}") for i in range(0, 10, 2)]
    b = 512
    assert measured_peak(CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, b, checkpoint=pairs) < measured_peak(
        CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, b, checkpoint=every
    )


# vit_dropout (10 s) is make test-heavy: the two others keep the check in make test
@pytest.mark.parametrize("name", ["residual_chain", "mlp_blocks", pytest.param("vit_dropout", marks=pytest.mark.heavy)])
def test_estimated_segment_terms_are_close_and_measured_ones_exact(name):
    fx = ZOO[name]
    b = 64
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        s = Searcher(runner, segments=True)
        s.order_units(2)
        assert s.segment_keys, "blocks called as a chain can be segments"
        terms = s.terms(b)
        n = len(s.units)
        rng = random.Random(0)
        choices = []
        for _ in range(4):
            i = rng.randrange(n - 1)
            j = rng.randrange(i + 1, min(n, i + 4))
            choices.append(with_segment(tuple(rng.choice((0, 1)) for _ in range(n)), i, j))
        for choice in choices:
            names = s.names(choice)
            truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, b, checkpoint=names)
            estimate = predict(s.terms(b), choice)
            assert abs(estimate - truth) <= 0.02 * truth, (names, estimate, truth)
            s.verify(b, tuple(names), choice)  # records the plan: its segments' terms are measured now
            assert predict(s.terms(b), choice) == truth, names
    assert terms.segments  # estimates existed before any plan was verified


def test_chain_detection_keeps_segments_off_blocks_with_code_between_them():
    class Normed(ResidualChain):
        def __init__(self):
            super().__init__(depth=4)
            self.norm = nn.LayerNorm(64)

        def forward(self, x):
            x = self.blocks[1](self.blocks[0](x))
            x = self.norm(x)  # saves tensors between blocks 1 and 2: no segment may span it
            return self.head(self.blocks[3](self.blocks[2](x)))

    torch.manual_seed(0)
    with StepRunner(Normed(), _chain_batch, _mse_loss) as runner:
        s = Searcher(runner, segments=True)
        s.order_units(2)
    assert s.segment_keys == ((0, 1), (2, 3))


# -- search ------------------------------------------------------------------------------------------


def _small_chain(depth: int):
    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return ResidualChain(depth=depth)

    return build


def test_search_uses_segments_to_reach_a_larger_batch_and_the_plan_fits():
    every = [f"blocks.{i}" for i in range(10)]
    b0 = 1024
    budget = measured_peak(CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, b0, checkpoint=every)
    with StepRunner(CHAIN.build(), CHAIN.make_batch, CHAIN.loss_fn) as runner:
        res = Searcher(runner, segments=True).search(budget)
    assert res.batch_size > b0  # every block reaches b0 exactly; segments reach further
    assert any(e.is_segment for e in res.checkpoint)
    truth = measured_peak(CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, res.batch_size, checkpoint=list(res.checkpoint))
    assert truth <= budget
    assert res.verified_peak == truth
    assert abs(res.predicted_peak - truth) <= 0.03 * truth
    # the prediction made before the plan's first run is out of sample; a re-solve on that run is said
    assert abs(res.first_predicted_peak - truth) <= 0.03 * truth
    assert res.resolved == (res.first_predicted_peak != res.predicted_peak)


@pytest.mark.heavy  # 40 s: make test-heavy
def test_found_batch_is_the_largest_any_plan_reaches_by_brute_force():
    """A 4-block chain: 34 plans (each block stored or checkpointed, or in one of 6 segments). The
    found batch fits; at the next batch none of the 34 fits, measured by the independent harness."""
    build = _small_chain(4)
    budget = measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, 700, checkpoint=[f"blocks.{i}" for i in range(4)])
    with StepRunner(build(), CHAIN.make_batch, CHAIN.loss_fn) as runner:
        s = Searcher(runner, segments=True)
        res = s.search(budget)
        terms = s.terms(res.batch_size)
    choices = list(all_choices(terms))
    assert len(choices) == 34
    assert measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, res.batch_size, checkpoint=list(res.checkpoint)) <= budget
    for choice in choices:
        names = list(terms.names(choice))
        assert measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, res.batch_size + 1, checkpoint=names) > budget, names


@pytest.mark.heavy  # 30 s: make test-heavy
def test_plan_cost_is_the_optimum_over_all_plans_at_the_batch():
    build = _small_chain(4)
    b = 600
    every = [f"blocks.{i}" for i in range(4)]
    budget = measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, b, checkpoint=every)
    with StepRunner(build(), CHAIN.make_batch, CHAIN.loss_fn) as runner:
        s = Searcher(runner, segments=True)
        res = s.search(budget, batch_size=b)
        costs, terms = s.costs(b), s.terms(b)
    fitting = []
    for choice in all_choices(terms):
        names = list(terms.names(choice))
        if measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, b, checkpoint=names) <= budget:
            fitting.append(sum(c[1] if x < 0 else c[x] for c, x in zip(costs, choice, strict=True)))
    assert abs(res.recompute_fraction * res.step_ms - min(fitting)) <= 1e-3 * res.step_ms


@pytest.mark.heavy  # 26 s: a whole CLI search; test_search_sharded covers "no segments" in the searcher
def test_cli_no_segments_plans_one_checkpoint_per_module(tmp_path):
    import json
    import subprocess
    import sys

    from tests.fixtures.models import write_target_file

    target = write_target_file(tmp_path, "residual_chain")
    every = [f"blocks.{i}" for i in range(10)]
    budget = measured_peak(CHAIN.build, CHAIN.make_batch, CHAIN.loss_fn, 512, checkpoint=every)
    plans = {}
    for flag in ("--segments", "--no-segments"):
        p = subprocess.run(
            [sys.executable, "-m", "ckpt_tune", "search", target, "--device", "cpu", "--vram", str(budget), flag, "--json"],
            capture_output=True, text=True, timeout=600,
        )
        assert p.returncode == 0, p.stderr
        plans[flag] = json.loads(p.stdout)["plan"]
    assert all(isinstance(e, str) for e in plans["--no-segments"]["checkpoint"])
    assert plans["--no-segments"]["batch_size"] >= 512  # every block fits 512 exactly
    assert any(isinstance(e, list) for e in plans["--segments"]["checkpoint"])
    assert plans["--segments"]["batch_size"] > plans["--no-segments"]["batch_size"]


def test_an_in_place_op_between_blocks_breaks_the_chain():
    class InPlace(ResidualChain):
        def __init__(self):
            super().__init__(depth=3)

        def forward(self, x):
            x = self.blocks[0](x)
            x = torch.relu_(x)  # same tensor object, but an op (that saves its output) ran in between
            return self.head(self.blocks[2](self.blocks[1](x)))

    torch.manual_seed(0)
    with StepRunner(InPlace(), _chain_batch, _mse_loss) as runner:
        s = Searcher(runner, segments=True)
        s.order_units(2)
    assert s.segment_keys == ((1, 2),)


def test_an_output_two_blocks_take_is_no_link_of_a_chain():
    class Branches(ResidualChain):
        """HRNet's transitions: two branches of one block's output (a segment from that block into one of
        them would recompute the tensor the other branch takes, and changed the gradients)."""

        def __init__(self):
            super().__init__(depth=4)

        def forward(self, x):
            x = self.blocks[0](x)
            a, b = self.blocks[1](x), self.blocks[2](x)
            return self.head(self.blocks[3](a + b))

    torch.manual_seed(0)
    with StepRunner(Branches(), _chain_batch, _mse_loss) as runner:
        s = Searcher(runner, segments=True)
        s.order_units(2)
    assert s.segment_keys == ()


@pytest.mark.heavy  # 60 s: make test-heavy
def test_search_drops_segments_whose_recompute_cannot_repeat_the_forward():
    class SavesBetween(ResidualChain):
        """Between every two blocks the parent computes a term of the loss from the hidden state: the
        blocks still form a chain, but those saved tensors are inside a segment's region."""

        def __init__(self):
            super().__init__(depth=6)
            self.scale = nn.Parameter(torch.ones(64))

        def forward(self, x):
            aux = 0
            for block in self.blocks:
                x = block(x)
                aux = aux + (self.scale * x).mean()
            return self.head(x) + aux

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return SavesBetween()

    every = [f"blocks.{i}" for i in range(6)]
    budget = measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, 700, checkpoint=every)
    with StepRunner(build(), CHAIN.make_batch, CHAIN.loss_fn) as runner:
        s = Searcher(runner, segments=True)
        res = s.search(budget)
    assert not any(e.is_segment for e in res.checkpoint)
    assert any("dropped" in n for n in res.notes)
    assert measured_peak(build, CHAIN.make_batch, CHAIN.loss_fn, res.batch_size, checkpoint=list(res.checkpoint)) <= budget


def test_a_segment_holds_no_tensor_between_steps():
    """What the recompute needs (the blocks' other arguments) is freed with the autograd graph, not kept
    on the model until the next step, where it would add to that step's peak."""
    import gc
    import weakref

    from ckpt_tune.plan.segment import SEGMENT_ATTR

    class ScaledLinear(nn.Linear):
        def forward(self, x, scale):
            return super().forward(x) * scale

    class WithScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(ScaledLinear(8, 8) for _ in range(3))

        def forward(self, x):
            scale = torch.full((8,), 0.5, requires_grad=True)
            self.last_scale = weakref.ref(scale)
            for block in self.blocks:
                x = block(x, scale=scale)  # an argument from outside the segment: held for the recompute
            return x.sum()

    model = WithScale()
    apply(model, [("blocks.0", "blocks.1", "blocks.2")])
    model(torch.randn(4, 8)).backward()
    gc.collect()
    segment = model.blocks[0].__dict__[SEGMENT_ATTR][0]
    assert segment.calls == []
    assert segment.outputs == {}
    assert model.last_scale() is None


# -- what the parent does between a segment's blocks -------------------------------------------------


class _Drop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class _Parent(nn.Module):
    """Blocks in a loop, with `between(i, x)` run by the parent after block i."""

    def __init__(self, between):
        super().__init__()
        self.blocks = nn.ModuleList(_Drop() for _ in range(3))
        self.between = between

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            x = self.between(i, x)
        return x.square().sum()


def _grads(model, x, seed=1):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


SEG3 = [("blocks.0", "blocks.1", "blocks.2")]


def test_random_draws_between_blocks_are_replayed_from_where_each_block_started():
    def layerdrop(i, x):  # what Hugging Face's Bart, Whisper, Wav2Vec2 do per layer, even at layerdrop 0
        torch.rand([])
        return x

    torch.manual_seed(0)
    model = _Parent(layerdrop)
    reference = copy.deepcopy(model)
    apply(model, SEG3)
    x = torch.randn(4, 16)
    assert same(_grads(model, x), _grads(reference, x))


def test_an_output_changed_in_place_before_the_next_block_is_refused():
    def scale(i, x):
        return x.mul_(2) if i == 0 else x

    torch.manual_seed(0)
    model = _Parent(scale)
    apply(model, SEG3)
    with pytest.raises(RuntimeError, match="changed in place"):
        model(torch.randn(4, 16))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # the region was closed


def test_parent_code_that_raises_between_blocks_leaves_no_region_open():
    fail = {"on": True}

    def maybe_raise(i, x):
        if i == 0 and fail["on"]:
            raise ValueError("between blocks")
        return x

    torch.manual_seed(0)
    model = _Parent(maybe_raise)
    reference = copy.deepcopy(model)
    apply(model, SEG3)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="between blocks"):
        model(x)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    fail["on"] = False
    assert same(_grads(model, x), _grads(reference, x))
    remove(model)
    assert not model._forward_hooks  # the segment's hook on the model is gone with it


def test_a_segment_whose_last_block_is_in_eval_mode_still_closes():
    torch.manual_seed(0)
    model = _Parent(lambda i, x: x)
    reference = copy.deepcopy(model)
    apply(model, SEG3)
    for m in (model, reference):
        m.train()
        m.blocks[2].eval()  # e.g. a frozen layer kept in eval mode: decided at the first block
    x = torch.randn(4, 16)
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        m(x).backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_segment_names_that_yaml_would_misread_round_trip(tmp_path):
    from ckpt_tune.plan.entry import to_data
    from ckpt_tune.plan.file import Plan, load_plan, write_plan

    entries = (("d.x]", "d.y"), ("d.a, b", "d.c"), ("0", "null"), ("blocks.0", "blocks.1"))
    plan = Plan(target="t.py:build", budget_bytes=1, batch_size=1, grad_accum_steps=1, checkpoint=entries, predicted_peak_bytes=1,
                predicted_recompute_fraction=0.1)
    loaded = load_plan(write_plan(plan, tmp_path / "plan.yaml")).checkpoint
    assert loaded == plan.checkpoint
    assert [tuple(e) for e in to_data(loaded)] == list(entries)
    assert "  - [blocks.0, blocks.1]" in (tmp_path / "plan.yaml").read_text()


def test_segments_dropped_from_the_terms_stay_dropped_when_a_plan_is_learned(monkeypatch):
    """After `drop_estimated_segments`, learning the measured terms of a verified plan must not bring
    the dropped estimates back (they would cost the search more verification runs)."""
    import types

    import ckpt_tune.tune.terms as terms_module
    from ckpt_tune.tune.memory_model import BlockTerms, RunCut, Terms

    s = Searcher(types.SimpleNamespace(model=None), units=["b0", "b1", "b2", "b3"], segments=True)
    s.segment_keys = ((0, 1), (1, 2), (2, 3), (0, 2))
    blk = BlockTerms((10,) * 4, (5,) * 4, (20,) * 4)
    s.probed[8] = s.with_segments(Terms(8, s.units, 0, 0, 0, (blk,) * 4))
    monkeypatch.setattr(terms_module, "cut_run", lambda *a, **k: RunCut((), 0, 0, (10,) * 4, (5,) * 4, (20,) * 4, 0))
    run = types.SimpleNamespace(timeline=types.SimpleNamespace(live_at=None, max_between=None, markers=None))
    plan = with_segment((0, 0, 0, 0), 0, 1)
    s.learn_segments(8, plan, run)
    s.drop_estimated_segments(8)
    assert sorted(s.probed[8].segments) == [(0, 1)]
    s.learn_segments(8, plan, run)
    assert sorted(s.probed[8].segments) == [(0, 1)]
