"""The memory model: hand-checkable arithmetic, and predictions against allocator ground truth."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.memory_model import BlockTerms, Terms, cut_run, estimate_segments, predict, probe_configs
from ckpt_tune.tune.searcher import Searcher
from tests.fixtures.models import ZOO
from tests.harness import measured_peak

MiB = 2**20


def _block(stored_kept, stored_ckpt, fwd, bwd):
    # terms that do not depend on the predecessor: the same value for both s_prev
    d = (stored_kept, stored_ckpt, stored_kept, stored_ckpt)
    return BlockTerms(d, (fwd, fwd, fwd, fwd), (bwd, bwd, bwd, bwd))


def test_predict_is_prefix_plus_block_term():
    # three blocks that keep 10 MiB each, or 2 MiB when checkpointed; forward peak 12 MiB above the
    # prefix, backward peak 15 MiB above the prefix; 100 MiB of weights and optimizer state; 4 MiB batch
    blocks = tuple(_block(10 * MiB, 2 * MiB, 12 * MiB, 15 * MiB) for _ in range(3))
    t = Terms(batch_size=1, units=("a", "b", "c"), static=100 * MiB, base=4 * MiB, fixed=5 * MiB, blocks=blocks)
    # nothing checkpointed: the last block's backward sees 20 MiB stored before it + 15 MiB
    assert predict(t, (0, 0, 0)) == 100 * MiB + 4 * MiB + (10 + 10) * MiB + 15 * MiB
    # checkpointing the first two: prefix before the last block is 2 + 2 MiB
    assert predict(t, (1, 1, 0)) == 100 * MiB + 4 * MiB + (2 + 2) * MiB + 15 * MiB
    # checkpointing the last block alone changes nothing: nothing comes after it
    assert predict(t, (0, 0, 1)) == predict(t, (0, 0, 0))


def test_predecessor_dependent_terms_are_used():
    # a block that frees its predecessor's output when it does not keep it: d depends on (s_prev, s_own)
    a = BlockTerms((8, 1, 8, 1), (0, 0, 0, 0), (0, 0, 0, 0))
    b = BlockTerms((8, 1, 5, 1), (3, 3, 3, 3), (9, 9, 9, 9))
    t = Terms(1, ("a", "b"), static=0, base=0, fixed=0, blocks=(a, b))
    assert predict(t, (0, 0)) == 8 + 9  # pair (0, 0) of b, prefix 8
    assert predict(t, (1, 0)) == 1 + 9  # prefix 1 (a checkpointed)
    assert predict(t, (1, 1)) == 1 + 9


def test_probe_configs_cover_every_pair_of_every_block():
    for n in range(1, 7):
        runs = probe_configs(n).values()
        for i in range(1, n):
            pairs = {(c[i - 1], c[i]) for c in runs}
            assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_cut_run_on_a_hand_made_curve():
    # live curve: before block 0 rises to 5; block 0 forward peaks at 9, ends at 7; block 1 forward
    # peaks at 12, ends 10 at the backward; block 1 backward peaks at 14; block 0 backward peaks at 11;
    # optimizer step at 6.
    times = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    live = [5, 9, 7, 12, 10, 14, 8, 11, 4, 6]
    markers = {"iter": [0], "f>a": [2], "f>b": [4], "b>b": [5.5], "b>a": [7.5], "backward": [8.5], "step": [10]}

    def live_at(t):
        before = [v for tt, v in zip(times, live, strict=False) if tt < t]
        return before[-1] if before else 0

    def max_between(t0, t1):
        vals = [v for tt, v in zip(times, live, strict=False) if t0 <= tt < t1] + [live_at(t0)]
        return max(vals), None

    cut = cut_run(live_at, max_between, markers, ("a", "b"), (0, 0))
    assert cut.base == 5  # live when block a starts
    assert cut.d == (7 - 5, 0)
    assert cut.F == (9 - 5, 12 - 7)  # block b's region runs to its backward
    assert cut.B == (11 - 5 - 0, 14 - 5 - 2)
    # outside the blocks: 5 before block a, and from the end of backward (still 11 until t=9) on
    assert cut.fixed == 11
    assert cut.peak_above_static == 14


def test_finer_options_are_the_composite_children_every_block_has():
    from ckpt_tune.plan.kinds.checkpoint import find_sub_options

    vit = ZOO["vit_dropout"].build()
    assert find_sub_options(vit, find_blocks(vit)) == ["attn", "mlp", "attn+mlp"]
    assert find_sub_options(ZOO["cnn_bn"].build(), ["blocks.0", "blocks.1"]) == []


def test_find_blocks_takes_repeated_children_outermost_first():
    assert find_blocks(ZOO["mlp_blocks"].build()) == [f"blocks.{i}" for i in range(6)]
    assert find_blocks(ZOO["linear_stack"].build()) == [f"layers.{i}" for i in range(4)]
    assert find_blocks(ZOO["lstm_tied"].build()) == []


@pytest.mark.parametrize("name", ["mlp_blocks", "unet_skips", "vit_dropout", "cnn_bn", "frozen_adapter"])
def test_predictions_match_allocator_for_checkpoint_plans(name):
    fx = ZOO[name]
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as runner:
        s = Searcher(runner)
        s.order_units(2)
        terms = s.terms(8)
    choices = list(itertools.product(range(terms.k), repeat=len(s.units)))
    random.Random(0).shuffle(choices)
    for choice in choices[:6]:
        names = list(terms.names(choice))
        truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 8, checkpoint=names)
        pred = predict(terms, choice)
        # exact up to the BatchNorm guard's throwaway copies of running statistics (a few hundred bytes)
        assert abs(pred - truth) <= 0.001 * truth, f"{name} {names}: predicted {pred}, allocator {truth}"


def test_fitted_terms_estimate_a_segment_again_and_fit_only_what_was_measured() -> None:
    """A segment's estimated term is a maximum over its blocks; which block holds it changes with the
    batch (ResNet on a CPU: one block's backward at batch 1, the next's from batch 2 on), and a line
    through two maxima is low past them. Interpolated terms estimate it again from the fitted blocks."""

    def at(b: int, measured: frozenset[int] = frozenset()) -> Terms:
        a = BlockTerms((10 * b,) * 4, (0,) * 4, (100,) * 4)  # stores 10 B per sample, backward 100 B flat
        c = BlockTerms((10 * b,) * 4, (0,) * 4, (20 * b,) * 4)  # backward 20 B per sample
        t = Terms(b, ("a", "c"), static=0, base=0, fixed=0, blocks=(a, c))
        seg = estimate_segments(t, [(0, 1)])[(0, 1)]
        return replace(t, segments={(0, 1): replace(seg, measured=measured)})

    assert at(1).segments[(0, 1)].B == (100, 100)
    assert at(4).segments[(0, 1)].B == (120, 120)
    fitted = at(1).interpolate(at(4), 12)
    # at batch 12 block c's backward under block a's stored bytes: 120 + 240, not 100 + 20 * 11 / 3
    assert fitted.segments[(0, 1)] == at(12).segments[(0, 1)]
    assert fitted.segments[(0, 1)].B == (360, 360)
    # a segment recorded at both batches is fitted as it was measured, for the options measured
    measured = at(1, frozenset({0})).interpolate(at(4, frozenset({0})), 12).segments[(0, 1)]
    assert measured.B == (174, 360)
    assert measured.measured == {0}
