"""Blocks at every nesting level (tune/candidates.py, docs/design.md §4): the chain is the innermost
blocks, a block holding blocks is a run of the chain checkpointed as that module, and the plans reach
at least what checkpointing every innermost block reaches, measured by the independent harness."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from ckpt_tune import apply
from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.kinds.checkpoint import find_sub_options
from ckpt_tune.tune.candidates import chain_of, find_blocks, find_groups, group_spans
from ckpt_tune.tune.memory_model import BlockTerms, SegmentTerms, Terms, plan_entries, with_segment
from ckpt_tune.tune.planner import brute_force, solve
from ckpt_tune.tune.searcher import Searcher
from tests.harness import measured_peak, one_step
from tests.nested_models import TARGETS


def test_innermost_blocks_and_the_groups_that_hold_them():
    model = TARGETS["nested_resnet"].build()
    assert find_blocks(model) == list(TARGETS["nested_resnet"].innermost)
    assert find_groups(model) == {f"stages.{s}": [f"stages.{s}.0", f"stages.{s}.1"] for s in range(3)}
    # a stage that downsamples before its `blocks` list: the stage is the group (it covers the downsample)
    conv = TARGETS["convnext_like"].build()
    assert find_blocks(conv) == list(TARGETS["convnext_like"].innermost)
    assert set(find_groups(conv)) == {"stages.0", "stages.1", "stages.2"}
    assert find_sub_options(conv, find_blocks(conv)) == ["mlp"]


def test_layer_stacks_inside_a_block_are_not_blocks():
    """Two Linears of an MLP, or a Sequential of conv-norm-activation inside a block, are layers."""
    unet = TARGETS["nested_unet"].build()
    blocks = find_blocks(unet)
    assert "encoder.0.0" in blocks
    assert not any(".conv1." in b for b in blocks)
    assert find_sub_options(unet, blocks)[:2] == ["conv1", "conv2"]


def test_a_group_whose_blocks_are_no_chain_stays_one_block():
    """Experts see their own tokens (no chain): the layer holding them is the block."""
    groups = {"layers.0": ["layers.0.experts.0", "layers.0.experts.1"]}
    leaves = groups["layers.0"]
    assert chain_of(leaves, groups, lambda u: True, lambda u: False) == ["layers.0"]
    assert chain_of(leaves, groups, lambda u: True, lambda u: True) == leaves
    t = TARGETS["routed_moe"]
    with StepRunner(t.build(), t.make_batch, t.loss_fn) as runner:
        s = Searcher(runner)
        s.order_units(2)
    assert s.units == t.innermost
    assert s.spans == {}
    assert "experts" not in s.options  # a ModuleList cannot be called: never a finer option


def test_group_spans_and_their_plan_entries():
    units = ("s.0.0", "s.0.1", "s.1.0", "s.1.1", "head.0")
    groups = {"s.0": ["s.0.0", "s.0.1"], "s.1": ["s.1.0", "s.1.1"], "s": ["s.0.0", "s.0.1", "s.1.0", "s.1.1"]}
    spans = group_spans(units, groups)
    assert spans == {(0, 1): "s.0", (2, 3): "s.1", (0, 3): "s"}
    choice = with_segment((0, 0, 1, 0, 2), 0, 1)
    assert plan_entries(units, ("none", "block", "attn"), choice, spans) == (
        Entry(("s.0",)), Entry(("s.1.0",)), Entry(("head.0.attn",)),
    )
    # a run that is no group is a segment of the blocks' names
    assert plan_entries(units, ("none", "block"), with_segment((0,) * 5, 1, 2), spans) == (Entry(("s.0.1", "s.1.0")),)
    # both sub-modules of an `a+b` option, each under its own checkpoint
    assert plan_entries(units, ("none", "block", "attn", "mlp", "attn+mlp"), (4, 0, 0, 0, 0)) == (
        Entry(("s.0.0.attn",)), Entry(("s.0.0.mlp",)),
    )


@pytest.mark.parametrize("seed", range(12))
def test_dp_over_nested_runs_equals_brute_force(seed):
    """The tree of groups is a set of nested runs of the chain: the exact DP over runs is exact over it."""
    rng = random.Random(700 + seed)
    per, stages = rng.choice([(2, 2), (2, 3), (3, 2)])
    n = per * stages
    blocks = tuple(
        BlockTerms(
            tuple(rng.randint(5, 40) for _ in range(4)), tuple(rng.randint(1, 60) for _ in range(4)),
            tuple(rng.randint(20, 120) for _ in range(4)),
        )
        for _ in range(n)
    )
    spans = {(s * per, s * per + per - 1): f"stages.{s}" for s in range(stages)}
    spans[(0, n - 1)] = "stages"
    segs = {
        key: SegmentTerms(
            tuple(rng.randint(1, 20) for _ in range(2)), tuple(rng.randint(1, 60) for _ in range(2)),
            tuple(rng.randint(40, 200) for _ in range(2)),
        )
        for key in spans
    }
    t = Terms(1, tuple(f"u{i}" for i in range(n)), 0, 0, 10, blocks, segments=segs, groups=spans)
    costs = tuple((0.0, rng.uniform(1, 5)) for _ in range(n))
    for budget in range(60, 400, 17):
        dp, bf = solve(t, costs, budget), brute_force(t, costs, budget)
        assert (dp is None) == (bf is None)
        if dp is not None:
            assert dp.cost == pytest.approx(bf.cost)


def test_recomputed_blocks_inside_a_checkpointed_group_leave_one_marker():
    """A group checkpointed whole calls its blocks again in backward; the chain's markers come from the
    forward only, so the terms are cut where the blocks ran."""
    t = TARGETS["nested_resnet"]
    with StepRunner(t.build(), t.make_batch, t.loss_fn) as runner:
        m = runner.measure(4, checkpoint=[Entry(("stages.1",))], units=t.innermost)
    for u in t.innermost:
        assert len(m.timeline.markers["f>" + u]) == 1
        assert len(m.timeline.markers["b>" + u]) == 1


@pytest.mark.parametrize("name", ["nested_resnet", "convnext_like"])
def test_group_checkpoint_keeps_gradients_statistics_and_random_stream(name):
    t = TARGETS[name]
    plain = t.build()
    wrapped = copy.deepcopy(plain)
    apply(wrapped, ["stages.0", t.innermost[2], "stages.2"])
    batch = t.make_batch(4)
    a, b = one_step(plain, batch, t.loss_fn, seed=3), one_step(wrapped, batch, t.loss_fn, seed=3)
    assert torch.equal(a["rng"], b["rng"])
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    for n, g in a["grads"].items():
        assert torch.equal(g, b["grads"][n]), n
    for n, x in a["buffers"].items():
        assert torch.equal(x, b["buffers"][n]), n


def _every_innermost_budget(t, batch: int) -> int:
    """A budget that checkpointing every innermost block fits at `batch` and not at `batch + 1`:
    halfway between the two, as the independent harness measures them."""
    lo = measured_peak(t.build, t.make_batch, t.loss_fn, batch, t.innermost)
    hi = measured_peak(t.build, t.make_batch, t.loss_fn, batch + 1, t.innermost)
    assert hi > lo
    return (lo + hi) // 2


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.heavy) for n in ("nested_resnet", "convnext_like", "nested_unet")]
)
def test_search_reaches_the_batch_of_every_innermost_block(name):
    t = TARGETS[name]
    batch = 12
    budget = _every_innermost_budget(t, batch)
    with StepRunner(t.build(), t.make_batch, t.loss_fn) as runner:
        res = Searcher(runner, segments=True).search(budget)
    assert res.batch_size >= batch
    assert res.baselines["every block"].plan == tuple(Entry((u,)) for u in res.units)
    measured = measured_peak(t.build, t.make_batch, t.loss_fn, res.batch_size, res.checkpoint)
    assert measured <= budget
    assert measured == res.verified_peak or abs(measured - res.verified_peak) <= 256  # BatchNorm's throwaway copies


def test_groups_are_planned_without_segments():
    """--no-segments (one checkpoint per module) still offers a group: it is one module."""
    t = TARGETS["nested_resnet"]
    with StepRunner(t.build(), t.make_batch, t.loss_fn) as runner:
        s = Searcher(runner, segments=False)
        s.order_units(2)
    assert s.units[0] == "stem"  # a conv-norm-activation stack before the stages joins the chain
    assert s.segment_keys == ((1, 2), (3, 4), (5, 6))
    assert replace(Terms(1, s.units, 0, 0, 0, ()), groups=s.spans).names(with_segment((0,) * 7, 3, 4)) == (
        Entry(("stages.1",)),
    )


def test_a_model_that_cannot_train_on_one_sample_is_searched_from_batch_two():
    """BatchNorm over a 1x1 feature map needs two samples: torchvision's ResNet on 32x32 images, or this
    one on 4x4. The search starts at batch 2 instead of stopping with the model's error at batch 1."""
    from tests.nested_models import NestedResNet, _ce, _images

    tiny = _images(4, 10)
    with StepRunner(NestedResNet(), tiny, _ce) as runner:
        res = Searcher(runner).search(8 << 20)
    assert res.batch_size >= 2
    assert any("batches start at 2" in n for n in res.notes)
