"""The profiler against allocator ground truth (tests/harness.py), and its promise to leave models alone."""

from __future__ import annotations

import pytest
import torch

from ckpt_tune.measure.profiler import profile_model
from ckpt_tune.measure.runner import StepRunner, StepSettings
from tests.fixtures.models import LINEAR_WIDTH, ZOO
from tests.harness import measured_peak

FP32 = 4


@pytest.mark.parametrize("name", sorted(ZOO))
def test_peak_matches_allocator_ground_truth(name):
    fx = ZOO[name]
    truth = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 8)
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 8, scaling=False)
    assert prof.peak_bytes == truth, f"{name}: profiled {prof.peak_bytes} vs allocator {truth}"


@pytest.mark.parametrize("batch", [2, 8])
def test_a_head_the_loss_does_not_use_is_freed_after_the_forward(batch):
    """GoogLeNet's pattern: the saved-tensor attribution must not keep a graph alive that backward never
    runs (a node that saves its own output would hold its grad_fn in a reference cycle)."""
    from tests.assets.targets import others

    truth = measured_peak(others.aux_heads, others.aux_heads_batch, others.aux_heads_loss, batch)
    prof = profile_model(others.aux_heads(), others.aux_heads_batch, others.aux_heads_loss, batch, scaling=False)
    assert prof.peak_bytes == truth


def test_layerdrop_is_off_while_measuring_so_the_peak_is_the_step_where_every_layer_runs():
    """Which layers run, and so which parameters get gradients and optimizer state, depends on the random
    stream under LayerDrop: the profile is of the worst case, and the model's setting is given back."""
    from tests.assets.targets import others

    def every_layer():
        model = others.layerdrop_stack()
        model.layerdrop = 0.0
        return model

    def loss(model, batch):
        return model(*batch)

    truth = measured_peak(every_layer, others.looped_batch, loss, 64)
    model = others.layerdrop_stack()
    prof = profile_model(model, others.looped_batch, loss, 64, scaling=False)
    assert prof.peak_bytes == truth
    assert model.layerdrop == 0.5


@pytest.mark.hf
def test_layerdrop_a_config_holds_is_off_while_measuring_too():
    """Wav2Vec2's encoder reads `config.layerdrop` at each call: measured with it on, a layer skipped at
    random left its markers out of a probe (a search stopped with KeyError: 'f>wav2vec2.encoder.layers.2')."""
    pytest.importorskip("transformers")
    from tests.assets.targets import others

    def every_layer():
        model = others.wav2vec2()
        model.config.layerdrop = 0.0
        return model

    def loss(model, batch):
        return model(**batch).loss

    model = others.wav2vec2()
    assert model.config.layerdrop == 0.5
    prof = profile_model(model, others.audio_batch, loss, 4, scaling=False)
    assert prof.peak_bytes == measured_peak(every_layer, others.audio_batch, loss, 4)
    assert model.config.layerdrop == 0.5


@pytest.mark.parametrize("name", ["mlp_blocks", "cnn_bn", "vit_dropout", "dict_batch"])
def test_modules_and_unattributed_sum_to_activation_total(name):
    fx = ZOO[name]
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 8, scaling=False)
    own = sum(m.activation_bytes for m in prof.modules)
    assert own + prof.unattributed_activation_bytes == prof.activation_total_bytes
    root = next(m for m in prof.modules if m.name == "")
    assert root.subtree_activation_bytes == own
    assert prof.breakdown.total == prof.peak_bytes
    assert min(vars(prof.breakdown).values()) >= 0


def test_linear_stack_saved_bytes_by_hand():
    fx = ZOO["linear_stack"]
    batch = 8
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, batch, scaling=False)
    layers = [m for m in prof.modules if m.type == "Linear"]
    # each bias-free Linear saves its input (batch x W fp32 values) for its weight's gradient
    for m in layers:
        assert m.activation_bytes == batch * LINEAR_WIDTH * FP32, m
    assert sum(m.activation_bytes for m in layers) == batch * LINEAR_WIDTH * FP32 * len(layers)
    assert prof.param_bytes == len(layers) * LINEAR_WIDTH * LINEAR_WIDTH * FP32
    assert prof.optimizer_bytes == 2 * prof.param_bytes + len(layers) * FP32  # exp_avg, exp_avg_sq, step


def test_scaling_is_fixed_plus_per_sample():
    fx = ZOO["mlp_blocks"]
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 8)
    s = prof.scaling
    assert s is not None
    assert s.batch_sizes == (4, 8)
    truth4 = measured_peak(fx.build, fx.make_batch, fx.loss_fn, 4)
    assert s.peaks == (truth4, prof.peak_bytes)
    assert s.predict(8) == prof.peak_bytes
    assert s.per_sample_bytes * 4 == prof.peak_bytes - truth4
    assert s.fixed_bytes > prof.param_bytes  # at least the weights, gradients and optimizer state


def _state(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {m: m.training for m in model.modules()},
    )


@pytest.mark.parametrize("name", ["cnn_bn", "vit_dropout", "frozen_adapter"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-mixed"])
def test_profiling_leaves_the_model_unchanged(name, precision):
    fx = ZOO[name]
    model = fx.build()
    model.eval()
    model.get_submodule(next(n for n, _ in model.named_children())).train()
    before, modes = _state(model)
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    profile_model(model, fx.make_batch, fx.loss_fn, 4, settings=StepSettings(precision=precision))
    after, modes_after = _state(model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert modes_after == modes
    for k in before:
        assert after[k].dtype == dtypes[k]
        assert torch.equal(after[k], before[k]), k
    for m in model.modules():
        assert not m._forward_hooks
        assert not m._forward_pre_hooks
        assert not m._backward_hooks
    assert all(p.grad is None for p in model.parameters())
    assert all(getattr(p, "_post_accumulate_grad_hooks", None) in (None, {}) for p in model.parameters())


def test_runner_is_deterministic():
    fx = ZOO["vit_dropout"]
    with StepRunner(fx.build(), fx.make_batch, fx.loss_fn) as r:
        peaks = {r.measure(4).peak_bytes for _ in range(3)}
    assert len(peaks) == 1


@pytest.mark.parametrize(("optimizer", "states"), [("sgd", 0), ("sgd-momentum", 1), ("adam", 2), ("none", 0)])
def test_optimizer_state_bytes(optimizer, states):
    fx = ZOO["linear_stack"]
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 4, settings=StepSettings(optimizer=optimizer), scaling=False)
    step = 4 * 4 if optimizer == "adam" else 0  # one fp32 step counter per parameter tensor
    assert prof.optimizer_bytes == states * prof.param_bytes + step
    assert prof.peak_bytes == measured_peak(fx.build, fx.make_batch, fx.loss_fn, 4, optimizer=optimizer)


@pytest.mark.parametrize("name", ["mlp_blocks", "vit_dropout"])
def test_the_timeline_split_into_parts_adds_up_and_its_largest_point_is_the_breakdown(name):
    """`part_timeline` (what `profile --plot` stacks): each point's five parts sum to the live bytes of
    the timeline's point, and at the peak they are the breakdown's parts."""
    fx = ZOO[name]
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 8, scaling=False)
    assert len(prof.part_timeline) == len(prof.timeline)
    for (ms, live), (ms2, *parts) in zip(prof.timeline, prof.part_timeline):
        assert ms == ms2
        assert sum(parts) == live
        assert min(parts) >= 0
    b = prof.breakdown
    top = max(prof.part_timeline, key=lambda p: sum(p[1:]))
    assert sum(top[1:]) == prof.peak_bytes
    assert tuple(top[1:]) == (b.params, b.grads, b.optimizer, b.activations, b.other)


def test_a_command_runs_at_the_settings_batch_and_device_unless_given_its_own():
    from ckpt_tune import Settings, profile

    settings = Settings(device="meta", optimizer="sgd", batch_size=3)
    prof = profile("examples/gpt.py:build", settings=settings, scaling=False)
    assert (prof.batch_size, prof.device, prof.optimizer, prof.world_size) == (3, "meta", "sgd", 1)
    assert profile("examples/gpt.py:build", batch_size=2, settings=settings, scaling=False).batch_size == 2
