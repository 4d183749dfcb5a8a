"""Activation offload as a kind of plan choice (plan/offload.py; docs/design.md §4, §7): the same
gradients, saved tensors out of the device's peak under the CUDA allocator's rules, priced by the
transfers compute does not hide, planned and verified by `search`, refused on the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import session
from ckpt_tune.measure.session import Settings, build_runner
from ckpt_tune.plan import offload
from ckpt_tune.plan.apply import applied_names, apply, remove
from ckpt_tune.plan.entry import Action, Entry
from ckpt_tune.plan.file import Plan, load_plan, write_plan
from ckpt_tune.plan.kinds import parse_candidates
from ckpt_tune.plan.kinds.offload import DEVICE_FLOPS, exposed_transfer
from ckpt_tune.plan.patch import patch_snippet
from ckpt_tune.tune.search import search
from examples import gpt

GPT = "examples/gpt.py:build"
META = Settings(device="meta")
BLOCKS = [f"blocks.{i}" for i in range(6)]


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loss = gpt.loss_fn(model, batch)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_an_offloaded_block_gives_the_same_loss_and_gradients(monkeypatch) -> None:
    """Host copies forced (as a measurement standing in for a GPU makes them): bit for bit the same."""
    monkeypatch.setattr(offload, "HOST_ALLOCATIONS", contextlib.nullcontext)
    model, batch = gpt.build(n_layer=2), gpt.make_batch(4)
    want = _loss_and_grads(model, batch)
    apply(model, [Entry.offload("blocks.0"), "blocks.1"])
    assert applied_names(model) == ("blocks.0", "blocks.1")
    got = _loss_and_grads(model, batch)
    assert torch.equal(want[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1], strict=True))
    remove(model)
    assert applied_names(model) == ()
    assert "forward" not in model.get_submodule("blocks.0").__dict__


def test_a_module_is_offloaded_or_checkpointed_not_both() -> None:
    from ckpt_tune.errors import PlanError

    model = gpt.build(n_layer=2)
    apply(model, [Entry.offload("blocks.0")])
    with pytest.raises(PlanError, match="already offloaded"):
        apply(model, ["blocks.0"])
    remove(model)
    apply(model, ["blocks.0"])
    with pytest.raises(PlanError, match="already checkpointed"):
        apply(model, [Entry.offload("blocks.0")])


def test_offload_entries_in_the_plan_file_and_the_patch(tmp_path) -> None:
    entries = (Entry.offload("blocks.0"), Entry(("blocks.1",)))
    assert Entry.of("blocks.0@offload") == entries[0]
    assert Entry.of({"module": "blocks.0", "action": "offload"}) == entries[0]
    plan = Plan(target=GPT, device="meta", budget_bytes=1 << 30, batch_size=16, grad_accum_steps=1, checkpoint=entries,
                predicted_peak_bytes=1 << 29, predicted_recompute_fraction=0.5)
    path = write_plan(plan, tmp_path / "plan.yaml")
    assert "  - {module: blocks.0, action: offload}" in path.read_text()
    assert load_plan(path).checkpoint == entries
    # the snippet, with torch only, wraps what apply wraps
    model = gpt.build(n_layer=2)
    exec(patch_snippet(plan), {"model": model})
    assert applied_names(model) == ("blocks.0", "blocks.1")
    assert offload.is_offloaded(model.get_submodule("blocks.0"))
    remove(model)
    assert applied_names(model) == ()


def test_offloaded_saved_tensors_leave_the_device_peak_under_cuda_rules() -> None:
    """--device meta: the host copies are not device memory; what backward copies back is."""
    target = session.load(GPT, META)
    _, runner, _ = build_runner(target, META)
    with runner:
        plain = runner.measure(16).peak_bytes
        every = runner.measure(16, checkpoint=BLOCKS).peak_bytes
        off = runner.measure(16, checkpoint=[Entry.offload(b) for b in BLOCKS]).peak_bytes
    assert off < every < plain
    # checkpointing keeps each block's input (16 x 128 x 192 fp32 = 1.5 MiB); offloading keeps none
    assert every - off == 6 * 16 * 128 * 192 * 4


def test_exposed_transfer_is_what_compute_does_not_hide() -> None:
    link = 25e9
    assert exposed_transfer(25e6, 10.0, link, "ms") == pytest.approx(1e-6)  # 1 ms each way behind 10 ms
    assert exposed_transfer(25e6, 0.25, link, "ms") == pytest.approx(0.75 + 0.5)
    gflop = 25e6 / link * DEVICE_FLOPS / 1e9  # the same second in FLOPs under fake tensors
    assert exposed_transfer(25e6, 0.0, link, "GFLOP") == pytest.approx(2 * gflop)


def test_all_is_every_recompute_kind_and_offload_is_named() -> None:
    assert "offload" not in parse_candidates("all")
    assert parse_candidates("all,offload") == frozenset({"blocks", "submodules", "segments", "ops", "offload"})


@pytest.fixture(scope="module")
def every_block_peak() -> int:
    target = session.load(GPT, META)
    _, runner, _ = build_runner(target, META)
    with runner:
        return runner.measure(16, checkpoint=BLOCKS).peak_bytes


def _search(budget: int, **kw):
    # --device meta holds back a CUDA context (768 MiB) and a margin; here the budget is the usable bytes
    return search(GPT, vram=str(budget + (768 << 20)), batch_size=16, margin="0", settings=META,
                  candidates=frozenset({"blocks", "offload"}), **kw).result


def test_search_offloads_where_checkpointing_every_block_does_not_fit(every_block_peak) -> None:
    budget = int(every_block_peak * 0.97)
    res = _search(budget)
    offloaded = [e for e in res.checkpoint if e.action is Action.OFFLOAD]
    assert offloaded
    assert res.verified_peak <= budget
    assert res.predicted_peak == res.verified_peak
    assert any("modelled at 25 GB/s" in n for n in res.notes)


def test_search_prices_offload_by_the_host_link(every_block_peak) -> None:
    """Where checkpointing every block fits, a slow link keeps recompute; a link fast enough to hide
    every transfer makes offload the cheaper choice."""
    slow = _search(every_block_peak)
    assert not any(e.action is Action.OFFLOAD for e in slow.checkpoint)
    fast = _search(every_block_peak, host_link=1e18)
    assert any(e.action is Action.OFFLOAD for e in fast.checkpoint)
    assert fast.recompute_fraction < slow.recompute_fraction
    assert fast.verified_peak <= every_block_peak


def test_offload_on_the_cpu_is_refused(run) -> None:
    code, _, err = run("search", GPT, "--device", "cpu", "--vram", "100MiB", "--candidates", "blocks,offload")
    assert code == 1
    assert "on --device cpu they are the same memory" in err
    assert "Traceback" not in err
    with pytest.raises(CkptTuneError):
        search(GPT, vram="100MiB", settings=Settings(device="cpu"), candidates=frozenset({"offload"}))


def test_a_larger_batch_by_offload_is_not_taken_where_it_trains_slower() -> None:
    """Offload's transfers are not bounded by a forward: on this small model they fit one more sample
    at a step hundreds of times slower. With the batch free, the search compares with the recompute
    kinds alone and reports the plan that trains more samples per second."""
    budget = 200 << 20
    kw = dict(vram=str(budget + (768 << 20)), margin="0", settings=META)
    both = search(GPT, candidates=frozenset({"blocks", "segments", "offload"}), **kw).result
    recompute = search(GPT, candidates=frozenset({"blocks", "segments"}), **kw).result
    assert (both.batch_size, both.checkpoint) == (recompute.batch_size, recompute.checkpoint)
    assert not any(e.action is Action.OFFLOAD for e in both.checkpoint)
    note = next(n for n in both.notes if n.startswith("with offload: batch "))
    offload_batch = int(note.split("batch ")[1].split()[0])
    assert offload_batch > both.batch_size  # it did fit a larger batch, and was not taken
    assert "Reported: the one that trains more samples per second" in note
