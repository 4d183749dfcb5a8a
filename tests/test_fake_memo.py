"""measure/fake_memo.py: outputs rebuilt from remembered metadata record what dispatching the op records."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ckpt_tune.measure import fake
from ckpt_tune.measure.fake import FakeRecorder
from ckpt_tune.measure.fake_memo import OpMemo
from ckpt_tune.measure.runner import StepSettings
from ckpt_tune.measure.session import Settings, fake_twin, load
from ckpt_tune.tune.candidates import find_blocks


def _by_hand() -> list[int]:
    """Views, in-place ops, `_unsafe_view` (whose schema says fresh, and which returns its input's
    storage), a resize through out=, new storages and their frees."""
    with FakeRecorder("cpu") as rec:
        a = torch.empty(1000)
        b = a * 2
        v = b.view(10, 100).t()
        w = torch.ops.aten._unsafe_view.default(b, [100, 10])  # b's storage: no allocation
        a.mul_(3)
        out = torch.empty(0)
        torch.add(b, 1, out=out)  # resizes out
        parts = b.split(250)
        del b, v, w, parts
        c = torch.empty(10, dtype=torch.float64)
        del c, out
    return rec.timeline.deltas


def test_ops_rebuilt_from_the_memo_record_what_dispatched_ops_record(monkeypatch):
    monkeypatch.setattr(fake, "MEMO", None)
    with fake.running():
        expected = _by_hand()
    memo = OpMemo()
    monkeypatch.setattr(fake, "MEMO", memo)
    with fake.running():
        first, again = _by_hand(), _by_hand()
    assert expected == [4000, 4000, 4000, -4000, 80, -80, -4000]  # a, b, out resized; b dies; c; out dies
    assert first == again == expected
    assert memo.hits > 0


def test_a_view_from_the_memo_shares_its_arguments_storage_and_an_in_place_op_returns_it():
    memo = OpMemo()
    aten = torch.ops.aten
    with fake.running():
        x = torch.empty(4, 6)
        y = torch.empty(4, 4)
        for _ in range(2):
            t = memo.call(aten.t.default, (x,), {}, lambda: aten.t.default(x))
            same = memo.call(aten.mul_.Scalar, (x, 2.0), {}, lambda: aten.mul_.Scalar(x, 2.0))
            new = memo.call(aten.mm.default, (x, x.t()), {}, lambda: aten.mm.default(x, x.t()))
            into = memo.call(aten.mm.out, (x, x.t()), {"out": y}, lambda: aten.mm.out(x, x.t(), out=y))
    assert memo.hits == 4
    assert t.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert (t.shape, t.stride()) == ((6, 4), (1, 6))
    assert same is x
    assert into is y
    assert new.untyped_storage()._cdata != x.untyped_storage()._cdata
    assert new.shape == (4, 4)


def _step_timelines(spec: str) -> list[tuple]:
    runner = fake_twin(load(spec, Settings(device="cpu")), StepSettings(device="cpu"))
    units = find_blocks(runner.model)
    got = []
    for b, checkpoint in ((2, ()), (3, units[::2]), (2, units), (3, ())):
        m = runner.measure(b, checkpoint=checkpoint, units=units)
        tl = m.timeline
        got.append((m.peak_bytes, tl.times, tl.deltas, tl.live, tl.markers))
    return got


SPECS = [
    "examples/gpt.py:build",
    pytest.param("examples/hf_gpt2.py:build", marks=pytest.mark.hf),
    pytest.param(
        "examples/qlora_gpt.py:build",
        marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes"),
    ),
]


@pytest.mark.parametrize("spec", SPECS)
def test_steps_recorded_with_the_memo_equal_steps_dispatched_to_the_fake_mode(monkeypatch, spec):
    """Every event and marker of four steps (plain and checkpointed, two batches), to the byte."""
    monkeypatch.setattr(fake, "MEMO", None)
    expected = _step_timelines(spec)
    memo = OpMemo()
    monkeypatch.setattr(fake, "MEMO", memo)
    assert _step_timelines(spec) == expected
    assert memo.hits > 1000
