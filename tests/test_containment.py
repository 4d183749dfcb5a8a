"""Whose failure is it (docs/design.md §8): what ckpt-tune adds to a user's step never takes a search
down, and a failure of ckpt-tune's is never reported as the user's. On models written the way other
libraries write them (tests/assets/targets/others.py); peaks judged by the independent harness."""

from __future__ import annotations

import copy

import pytest
import torch

import ckpt_tune
from ckpt_tune.errors import LimitationError, PlanError, UserCodeError
from ckpt_tune.measure.session import Settings
from ckpt_tune.tune.candidates import call_chain, find_blocks
from tests.assets.targets import others
from tests.harness import measured_peak, one_step

OTHERS = "tests/assets/targets/others.py"
CPU = Settings(device="cpu")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loss(model, batch):
    return model(**batch).loss if isinstance(batch, dict) else model(*batch)


def _same_step(build, batch, names) -> None:
    """One step of the model with `names` applied equals one without: loss, gradients, buffers, RNG."""
    plain = build()
    planned = copy.deepcopy(plain)
    ckpt_tune.apply(planned, names)
    a, b = one_step(plain, batch, _loss), one_step(planned, batch, _loss)
    assert torch.equal(a["loss"], b["loss"])
    assert a["grads"].keys() == b["grads"].keys()
    assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
    assert all(torch.equal(a["buffers"][k], b["buffers"][k]) for k in a["buffers"])
    assert torch.equal(a["rng"], b["rng"])


def test_a_list_the_parent_grows_after_the_call_is_recomputed_as_it_was() -> None:
    # each dense layer takes the block's list of features, which the block appends to after the call
    names = ["block2.denselayer1", "block2.denselayer2", "block2.denselayer3", "block2.denselayer4"]
    _same_step(others.densenet, others.densenet_batch(4), names)
    _same_step(others.densenet, others.densenet_batch(4), [names[:3]])  # a segment's first block too


def test_a_list_the_forward_changes_in_place_is_recomputed_as_it_was_called() -> None:
    # each stage writes its branches' outputs back into the list it was given (timm's HRNet)
    _same_step(others.in_place_lists, others.looped_batch(4), ["stages.0", "stages.2"])
    _same_step(others.in_place_lists, others.looped_batch(4), [["stages.0", "stages.1"]])  # a segment's first block


def test_densenet_blocks_in_a_module_dict_are_planned_and_verified() -> None:
    assert find_blocks(others.densenet())[:1] == ["block1.denselayer1"]
    budget = 6 << 20
    # op policies left out: whether they pay is timed on this CPU, so a loaded machine may choose one, and the
    # harness's selective wrapper makes no throwaway copies of BatchNorm's running statistics (528 B less)
    out = ckpt_tune.search(
        f"{OTHERS}:densenet", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:densenet_batch"),
        candidates=frozenset({"blocks", "submodules", "segments"}),
    )
    plan = out.plan
    assert plan.verified_peak_bytes <= budget
    real = measured_peak(others.densenet, others.densenet_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real == plan.verified_peak_bytes
    _same_step(others.densenet, others.densenet_batch(4), plan.checkpoint)


@pytest.mark.hf
def test_a_shared_layer_called_six_times_is_planned_through_the_module_that_calls_it() -> None:
    pytest.importorskip("transformers")
    budget = 24 << 20
    out = ckpt_tune.search(f"{OTHERS}:albert", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch"))
    assert "albert.encoder" in out.result.units  # the shared layer runs six times: its caller is the unit
    assert any("no repeated blocks" in n for n in out.result.notes)
    # ... and the shared layer is a candidate of its own, checkpointed at each of its six calls
    assert any("albert.encoder.albert_layer_groups.0 (6 calls)" in n for n in out.result.notes), out.result.notes
    plan = out.plan
    assert "albert.encoder.albert_layer_groups.0" in [e.modules[0] for e in plan.checkpoint], plan.checkpoint
    assert plan.verified_peak_bytes <= budget
    assert plan.batch_size >= out.result.baselines["every block"].batch_size
    real = measured_peak(others.albert, others.tokens_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real == plan.verified_peak_bytes
    _same_step(others.albert, others.tokens_batch(2), plan.checkpoint)


@pytest.mark.hf
@pytest.mark.slow
def test_a_stock_hugging_face_decoder_with_its_cache_on_plans_with_default_options() -> None:
    pytest.importorskip("transformers")
    assert others.gpt2().config.use_cache is True
    budget = 40 << 20
    out = ckpt_tune.search(f"{OTHERS}:gpt2", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch"))
    plan = out.plan
    assert plan.verified_peak_bytes <= budget
    assert not any("dropped" in n for n in out.result.notes), out.result.notes  # the op-policy timing ran
    real = measured_peak(others.gpt2, others.tokens_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real <= budget
    _same_step(others.gpt2, others.tokens_batch(2), plan.checkpoint)


def test_blocks_that_each_run_twice_are_planned_through_the_modules_that_call_them() -> None:
    budget = 7 << 19  # 3.5 MiB: the step at batch 400 is 4.4 MiB without checkpointing
    out = ckpt_tune.search(f"{OTHERS}:looped", vram=str(budget), batch_size=400, settings=Settings(device="cpu", batch_fn=f"{OTHERS}:looped_batch"))
    assert any("run more than once per step" in n for n in out.result.notes), out.result.notes
    assert "core" in out.result.units  # its layers run twice: the module that loops over them is the unit
    plan = out.plan
    # the layers are candidates of their own, each checkpointed at both its calls: below checkpointing `core`
    assert [e.modules[0] for e in plan.checkpoint] == ["core.layers.0", "core.layers.1"], plan.checkpoint
    whole = measured_peak(others.looped, others.looped_batch, _loss, plan.batch_size, checkpoint=["core"])
    assert plan.verified_peak_bytes < whole
    assert plan.verified_peak_bytes <= budget
    real = measured_peak(others.looped, others.looped_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real == plan.verified_peak_bytes
    _same_step(others.looped, others.looped_batch(2), plan.checkpoint)


def test_a_layer_the_model_itself_loops_over_is_checkpointed_at_each_call() -> None:
    # no module runs once around the loop: the chain is empty, and the floor checkpoints the layer
    budget = 5 << 20
    out = ckpt_tune.search(f"{OTHERS}:shared_loop", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:looped_batch"))
    plan = out.plan
    assert [e.modules[0] for e in plan.checkpoint] == ["layer"], plan.checkpoint
    assert plan.verified_peak_bytes <= budget
    real = measured_peak(others.shared_loop, others.looped_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real == plan.verified_peak_bytes
    plain = measured_peak(others.shared_loop, others.looped_batch, _loss, plan.batch_size)
    assert plain > budget  # checkpointing the layer is what reaches this batch
    _same_step(others.shared_loop, others.looped_batch(2), plan.checkpoint)


def test_under_fake_tensors_the_floor_runs_where_the_chain_does_not_hold_it() -> None:
    """--device meta: every step is recorded under fake tensors, and the floor (checkpointing every
    innermost block, here the layer the model loops over) still answers where the chain cannot."""
    budget = 5 << 20
    out = ckpt_tune.search(f"{OTHERS}:shared_loop", vram=str(budget + (768 << 20)), margin="0",
                           settings=Settings(device="meta", batch_fn=f"{OTHERS}:looped_batch"))
    assert [e.modules[0] for e in out.plan.checkpoint] == ["layer"], out.plan.checkpoint
    assert out.plan.verified_peak_bytes <= budget
    assert any("reaches batch" in n for n in out.result.notes), out.result.notes


def test_the_floor_leaves_out_a_block_shared_into_the_others() -> None:
    """The innermost blocks include a module shared into each of the others (CoaT's position encodings):
    the floor checkpoints the blocks that hold it, not both (which apply refuses), and is not dropped."""
    assert find_blocks(others.shared_into_blocks())[:1] == ["encodings.0"]
    budget = 6 << 20
    out = ckpt_tune.search(f"{OTHERS}:shared_into_blocks", vram=str(budget),
                           settings=Settings(device="cpu", batch_fn=f"{OTHERS}:looped_batch"))
    assert not any("dropped" in n for n in out.result.notes), out.result.notes
    plan = out.plan
    assert plan.verified_peak_bytes <= budget
    real = measured_peak(others.shared_into_blocks, others.looped_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint)
    assert real == plan.verified_peak_bytes


def test_a_buffer_the_forward_replaces_is_not_updated_again_by_the_recompute() -> None:
    # I-BERT's range trackers assign a new tensor to their buffers in training: checkpointed blocks
    # (and a segment) leave them as one step without checkpointing does
    _same_step(others.range_tracked, others.looped_batch(8), ["blocks.0", "blocks.2"])
    _same_step(others.range_tracked, others.looped_batch(8), [["blocks.0", "blocks.1"]])
    # and so does the patch snippet, which carries its own copy of the wrapper
    from ckpt_tune.plan.file import Plan
    from ckpt_tune.plan.patch import patch_snippet

    plan = Plan(target="t.py:build", device="cpu", precision="fp32", optimizer="adamw", budget_bytes=None, batch_size=8,
                grad_accum_steps=1, checkpoint=("blocks.0", "blocks.2"), predicted_peak_bytes=0, predicted_recompute_fraction=0.0)
    patched = {"model": others.range_tracked()}
    exec(compile(patch_snippet(plan), "<patch snippet>", "exec"), patched)
    a = one_step(others.range_tracked(), others.looped_batch(8), _loss)
    b = one_step(patched["model"], others.looped_batch(8), _loss)
    assert all(torch.equal(a["buffers"][k], b["buffers"][k]) for k in a["buffers"])
    assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"])


def test_a_search_says_layerdrop_was_off_while_it_measured() -> None:
    out = ckpt_tune.search(f"{OTHERS}:layerdrop_stack", vram=str(4 << 20), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:looped_batch"))
    assert any(n.startswith("LayerDrop off while measuring") for n in out.result.notes), out.result.notes
    plan = out.plan
    assert plan.verified_peak_bytes <= 4 << 20
    every_layer = measured_peak(others.layerdrop_stack, others.looped_batch, _loss, plan.batch_size, checkpoint=plan.checkpoint,
                                wrap=lambda m: setattr(m, "layerdrop", 0.0))
    assert every_layer == plan.verified_peak_bytes


def test_a_refinement_that_raises_is_dropped_with_a_note_and_the_search_goes_on(monkeypatch) -> None:
    import ckpt_tune.tune.step_costs as step_costs_module

    def broken(*args, **kwargs):
        raise RuntimeError("Trying to backward through the graph a second time")

    monkeypatch.setattr(step_costs_module, "policy_ratios", broken)
    out = ckpt_tune.search(f"{OTHERS}:densenet", vram=str(6 << 20), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:densenet_batch"))
    assert out.plan.verified_peak_bytes <= 6 << 20
    assert "op policies dropped for every block: RuntimeError: Trying to backward through the graph a second time" in out.result.notes


def test_a_failure_of_ckpt_tunes_own_after_the_plain_step_is_its_limitation(monkeypatch, run) -> None:
    import ckpt_tune.tune.searcher as searcher_module

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(searcher_module, "solve", broken)
    with pytest.raises(LimitationError):
        ckpt_tune.search(f"{OTHERS}:late_batch", vram="1MiB", batch_size=2, settings=CPU)
    code, _, err = run("search", f"{OTHERS}:late_batch", "--device", "cpu", "--vram", "1MiB", "--batch-size", "2")
    assert code == 1
    assert err.startswith("error: ckpt-tune could not plan this model"), err
    assert "IndexError: list index out of range" in err
    assert "the training step raised" not in err
    assert "Traceback" not in err
    assert "limitation of ckpt-tune" in err


def test_the_users_step_failing_at_a_later_batch_stays_the_users_error() -> None:
    with pytest.raises(UserCodeError, match="at most 2 samples") as e:
        ckpt_tune.search(f"{OTHERS}:late_batch", vram="1MiB", settings=CPU)
    assert not isinstance(e.value, LimitationError)


def test_call_chain_splits_what_runs_as_a_chain_and_keeps_a_caller_of_a_shared_layer_whole() -> None:
    # a: embeddings (two leaves, a chain), b: encoder calling b.shared three times, c: head
    names = ["a", "a.x", "a.y", "b", "b.list", "b.list.shared", "b.shared_inner", "c"]
    calls = {"a": 1, "a.x": 1, "a.y": 1, "b": 1, "b.list": 0, "b.list.shared": 3, "b.shared_inner": 3, "c": 1}
    start = {n: i for i, n in enumerate(names)}
    units, groups = call_chain(names, calls.__getitem__, lambda n: calls[n] == 1, start.__getitem__, lambda a, b: start[a] < start[b])
    assert units == ["a.x", "a.y", "b", "c"]
    assert groups == {"a": ["a.x", "a.y"]}
    # modules that overlap in time are no chain: their parent stays whole
    units, groups = call_chain(["p", "p.u", "p.v"], lambda n: 1, lambda n: True, lambda n: 0, lambda a, b: False)
    assert units == ["p"]
    assert groups == {}


def test_a_sequential_of_single_layers_is_checkpointed_whole_and_a_bottleneck_joins_the_chain() -> None:
    from ckpt_tune.measure.runner import StepRunner, StepSettings
    from ckpt_tune.tune.candidates import outside
    from ckpt_tune.tune.searcher import Searcher
    from tests.test_examples import load_example

    unet = load_example("unet")
    model = unet.build()
    blocks = find_blocks(model)
    assert blocks == ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "decoder.2"]
    assert "bottleneck" in outside(model, blocks)
    with StepRunner(model, unet.make_batch, unet.loss_fn, StepSettings(device="cpu")) as runner:
        s = Searcher(runner)
        s.order_units(1)
    assert s.units == ("encoder.0", "encoder.1", "encoder.2", "bottleneck", "decoder.0", "decoder.1", "decoder.2")


def test_diffusers_blocks_of_one_each_are_candidates_and_a_transformer_is_checkpointed_whole() -> None:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    )
    blocks = find_blocks(model)
    # one ResNet block per down block: the type repeats across the model, so each is a candidate
    assert {"down_blocks.0.resnets.0", "down_blocks.1.resnets.0", "mid_block.resnets.0"} <= set(blocks)
    # a Transformer2DModel holds one transformer block: checkpointed whole, projections and norm too
    assert {"down_blocks.0.attentions.0", "mid_block.attentions.0", "up_blocks.1.attentions.1"} <= set(blocks)
    assert not any(".transformer_blocks." in b for b in blocks)


class _InPlaceHead(torch.nn.Module):
    """Blocks, then a classifier that opens with Dropout(inplace=True), as torchvision's EfficientNet."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)) for _ in range(3)
        )
        self.classifier = torch.nn.Sequential(torch.nn.Dropout(0.2, inplace=True), torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.classifier(x * 2).square().mean()


def test_a_module_that_changes_its_input_in_place_is_refused_before_it_runs() -> None:
    from ckpt_tune.measure.runner import StepRunner, StepSettings
    from ckpt_tune.tune.searcher import Searcher

    torch.manual_seed(0)
    with StepRunner(_InPlaceHead(), lambda b: torch.randn(b, 16), lambda m, x: m(x), StepSettings(device="cpu")) as runner:
        s = Searcher(runner)
        res = s.search(1 << 20, batch_size=4)
    assert s.units == ("blocks.0", "blocks.1", "blocks.2")
    assert any("change their input in place" in n and "classifier" in n for n in res.notes)


def test_a_segment_cannot_start_inside_the_models_own_checkpoint_and_leaves_torch_as_it_was() -> None:
    """A segment opened in a block the model checkpoints itself would end after that checkpoint's region:
    saved-tensor hooks, a stack, would end out of order (torch's internal assert, and every later step of
    the process broken). It is refused before it opens; the next steps run; a search drops the segments
    with a note and answers a plan verified within the budget."""
    model = others.self_checkpointed()
    ckpt_tune.apply(model, [["blocks.0", "blocks.1"]])
    with pytest.raises(RuntimeError, match="inside a checkpoint the model makes itself"):
        model(*others.wide_batch(4)).backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    _same_step(others.self_checkpointed, others.wide_batch(4), ["blocks.0", "blocks.2"])
    budget = 3 << 20
    out = ckpt_tune.search(f"{OTHERS}:self_checkpointed", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:wide_batch"))
    assert out.plan.verified_peak_bytes <= budget
    real = measured_peak(others.self_checkpointed, others.wide_batch, _loss, out.plan.batch_size, checkpoint=out.plan.checkpoint)
    assert real <= budget


@pytest.mark.hf
def test_a_model_with_hugging_faces_own_checkpointing_on_is_searched_with_it_off_and_told() -> None:
    """The user turned on Hugging Face's gradient checkpointing and still runs out of memory: the search
    plans with it off (a plan replaces it; applied over it, a layer would be checkpointed twice) and says so."""
    pytest.importorskip("transformers")
    budget = 40 << 20
    out = ckpt_tune.search(f"{OTHERS}:gpt2_checkpointed", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch"))
    assert out.plan.verified_peak_bytes <= budget
    assert any(n.startswith("Hugging Face gradient checkpointing was on") for n in out.result.notes), out.result.notes
    model = others.gpt2_checkpointed()
    with pytest.raises(PlanError, match="gradient_checkpointing_disable"):
        ckpt_tune.apply(model, out.plan.checkpoint)
    model.gradient_checkpointing_disable()
    real = measured_peak(others.gpt2, others.tokens_batch, _loss, out.plan.batch_size, checkpoint=out.plan.checkpoint)
    assert real <= budget


def test_a_model_with_timms_own_checkpointing_on_is_searched_with_it_off_and_told() -> None:
    """timm's `set_grad_checkpointing(True)` runs the blocks under `checkpoint_seq`: the search turns the
    flag off (no segment could start inside it), gives it back after, and says so."""
    pytest.importorskip("timm")
    settings = Settings(device="cpu", batch_fn=f"{OTHERS}:images_batch", loss_fn=f"{OTHERS}:images_loss")
    budget = 40 << 20
    out = ckpt_tune.search(f"{OTHERS}:timm_checkpointed", vram=str(budget), settings=settings)
    assert out.plan.verified_peak_bytes <= budget
    assert any(n.startswith("timm's gradient checkpointing was on") and "set_grad_checkpointing(False)" in n for n in out.result.notes), out.result.notes
    assert not any("dropped" in n for n in out.result.notes), out.result.notes

    def unchecked():
        model = others.timm_checkpointed()
        model.set_grad_checkpointing(False)
        return model

    real = measured_peak(unchecked, others.images_batch, others.images_loss, out.plan.batch_size, checkpoint=out.plan.checkpoint)
    assert real == out.plan.verified_peak_bytes


@pytest.mark.hf
def test_diagnose_records_todays_step_with_hugging_faces_checkpointing_and_plans_without_it() -> None:
    pytest.importorskip("transformers")
    on = ckpt_tune.diagnose(f"{OTHERS}:gpt2_checkpointed", vram="4MiB", settings=Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch"))
    off = ckpt_tune.diagnose(f"{OTHERS}:gpt2", vram="4MiB", settings=Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch"))
    assert on.profile.peak_bytes < off.profile.peak_bytes  # today's step: Hugging Face's checkpointing on
    assert any(n.startswith("Hugging Face gradient checkpointing is on") for n in on.notes), on.notes
    assert any(r.kind == "checkpoint" for r in on.remedies), [r.kind for r in on.remedies]


@pytest.mark.hf
def test_the_closest_launcher_layout_of_a_model_with_hugging_faces_checkpointing_on_is_measured() -> None:
    """`--emit` measures the closest layout TrainingArguments can express (the plan's sub-modules are not
    one) on a model built again from the target, Hugging Face's checkpointing off as the search ran."""
    pytest.importorskip("transformers")
    from ckpt_tune.tune.launchers import emit

    settings = Settings(device="cpu", batch_fn=f"{OTHERS}:tokens_batch")
    out = ckpt_tune.search(f"{OTHERS}:gpt2_checkpointed", vram=str(40 << 20), settings=settings, candidates=frozenset({"submodules"}))
    e = emit(out.plan, "hf-args", f"{OTHERS}:gpt2_checkpointed", settings)
    assert e.measured
    assert not e.expressed.exact
    closest = e.expressed.closest.checkpoint
    assert e.peak_bytes == measured_peak(others.gpt2, others.tokens_batch, _loss, out.plan.batch_size, checkpoint=closest)


def test_frontier_rows_rest_on_the_probed_batches_nearest_them() -> None:
    """Between the probed batches the frontier interpolates the nearest two: a ResNet-18's peak is far
    from linear below a few samples, and the line through batches 1 and 4 put the row at half the answer
    at 1.2 GB, not fitting, where the answer fits 300 MiB. The row equals the harness's peak of its plan."""
    settings = Settings(device="cpu", batch_fn=f"{OTHERS}:images_64", loss_fn=f"{OTHERS}:images_loss")
    budget = 300 << 20
    out = ckpt_tune.search(f"{OTHERS}:resnet18", vram=str(budget), settings=settings)
    half = next(r for r in out.result.frontier if r.batch_size == max(1, out.plan.batch_size // 2))
    assert half.fits
    real = measured_peak(others.resnet18, others.images_64, others.images_loss, half.batch_size, checkpoint=half.plan)
    assert real == half.predicted_peak
    peaks = [r.predicted_peak for r in out.result.frontier]
    assert peaks == sorted(peaks)


def test_a_step_fake_tensors_cannot_record_is_probed_on_the_device_within_the_budget() -> None:
    """Experts picked by boolean masks: fake tensors cannot record the step, so its probes run on the
    device. None runs past the budget (the plain step at the answer peaked at 2.3x it on such a model): a
    batch whose plain step the nearest probed batches put over the budget rests on their line, and the
    plan chosen there is verified for real."""
    budget = 16 << 20
    out = ckpt_tune.search(f"{OTHERS}:routed", vram=str(budget), settings=Settings(device="cpu", batch_fn=f"{OTHERS}:routed_batch"))
    res = out.result
    assert any(n.startswith("every probe ran on the device") for n in res.notes), res.notes
    assert any(n.startswith("probes past the budget were not run") for n in res.notes), res.notes
    assert res.real_steps
    assert res.largest_real_peak <= budget
    assert out.plan.verified_peak_bytes <= budget
    assert measured_peak(others.routed, others.routed_batch, _loss, out.plan.batch_size, checkpoint=out.plan.checkpoint) <= budget


def test_the_frontiers_line_runs_through_the_nearest_probed_batches() -> None:
    from types import SimpleNamespace

    from ckpt_tune.tune.terms import TermStore

    near = lambda b, probed: TermStore.nearest(SimpleNamespace(b1=1, b2=4), b, probed)  # noqa: E731
    assert near(4, {1, 4, 84}) == (4, 4)
    assert near(42, {1, 4, 6, 84, 85}) == (6, 84)
    assert near(100, {1, 4, 84, 85}) == (84, 85)
    assert near(2, {1, 4}) == (1, 4)
    assert near(9, {1}) == (1, 4)


def test_torchscript_blocks_are_profiled_and_searched_without_being_candidates() -> None:
    """torch refuses hooks on a TorchScript module and its forward cannot be replaced: the step is
    recorded without marking it (it used to stop as "the training step raised"), and the search plans
    what it can, with a note."""
    settings = Settings(device="cpu", batch_fn=f"{OTHERS}:wide_batch")
    prof = ckpt_tune.profile(f"{OTHERS}:scripted", batch_size=4, settings=settings)
    assert prof.peak_bytes > 0
    budget = 3 << 20
    out = ckpt_tune.search(f"{OTHERS}:scripted", vram=str(budget), settings=settings)
    assert not out.plan.checkpoint
    assert out.plan.verified_peak_bytes <= budget
    assert any(n.startswith("TorchScript modules are not candidates") for n in out.result.notes), out.result.notes
    assert measured_peak(others.scripted, others.wide_batch, _loss, out.plan.batch_size) <= budget
