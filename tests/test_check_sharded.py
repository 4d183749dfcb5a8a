"""`ckpt-tune check` for a sharded run: the baseline records world_size and shard; a check re-records rank 0
at the baseline's own world size and stage (under the real engine, a fake process group) and compares like
with like; flags that disagree with the baseline are settings that differ (exit 1) with a hint.

The target is three residual MLP blocks and a head; CKPT_SHARDED_HIDDEN widens every block's hidden layer
(more parameters, and more saved activations), which is the change that adds memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_tune import gate as ck
from ckpt_tune.errors import BaselineError
from ckpt_tune.measure.sharded import measure_sharded
from ckpt_tune.tune.candidates import find_blocks
from tests.test_check import B, check_args, one_line

# B, check_args and one_line: the same batch and command line as the single-device check's

HIDDEN = 48

TARGET_SRC = f'''
import os

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.blocks = nn.ModuleList([Block(32, hidden) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).clone()


def build():
    torch.manual_seed(0)
    return Net(int(os.environ.get("CKPT_SHARDED_HIDDEN", "{HIDDEN}")))


def make_batch(batch_size):
    return torch.randn(batch_size, 8, 32, generator=torch.Generator().manual_seed(0))


def loss_fn(model, x):
    return model(x).pow(2).mean()
'''


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "sharded_net.py"
    path.write_text(TARGET_SRC)
    return f"{path}:build"


def load_module(target: str):
    import importlib.util

    path = target.rpartition(":")[0]
    spec = importlib.util.spec_from_file_location("sharded_net_for_truth", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_world_size_2_records_rank_0_then_passes_then_fails_when_memory_grows(run, target, tmp_path, monkeypatch):
    baseline = tmp_path / "memory.yaml"
    code, _, err = run(*check_args(target, baseline, "--world-size", "2", "--shard", "zero3"))
    assert code == 0, err
    assert "baseline written" in err
    assert "rank 0 of 2 under zero3" in one_line(err)
    b = ck.load_baseline(baseline)
    assert (b.settings.world_size, b.settings.shard) == (2, "zero3")
    text = baseline.read_text()
    assert "world_size: 2" in text
    assert "shard: zero3" in text
    assert "rank 0 of 2 under zero3" in b.measured_by
    # rank 0's step under fully_shard: the figure a fresh measure_sharded records, not one device's
    mod = load_module(target)
    model = mod.build()
    truth = measure_sharded(model, mod.make_batch, mod.loss_fn, B, world_size=2, shard="zero3", units=find_blocks(model))
    assert b.peak_bytes == truth.peak_bytes
    assert (b.param_bytes, b.optimizer_bytes) == (truth.param_bytes, truth.optimizer_bytes)
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert b.param_bytes < whole  # sharded: rank 0 holds about half the parameters

    # no flags: re-recorded at the baseline's world size and stage; identical bytes
    code, out, err = run(*check_args(target, baseline, "--json"))
    assert code == 0, err
    res = json.loads(out)
    assert res["status"] == "pass"
    assert res["delta_bytes"] == 0
    assert (res["settings"]["world_size"], res["settings"]["shard"]) == (2, "zero3")

    # the same flags pass too; a wider model fails with exit 3 naming what grew
    assert run(*check_args(target, baseline, "--world-size", "2", "--shard", "zero3"))[0] == 0
    monkeypatch.setenv("CKPT_SHARDED_HIDDEN", str(4 * HIDDEN))
    code, out, err = run(*check_args(target, baseline, "--json"))
    assert code == 3, err
    res = json.loads(out)
    assert res["status"] == "regressed"
    assert res["peak_bytes"] > res["limit_bytes"]
    grew = {r["name"] for r in res["modules"] if r["delta"] > 0}
    assert {f"blocks.{i}" for i in range(3)} <= {n.rpartition(".")[0] if n.count(".") > 1 else n for n in grew}, grew
    assert baseline.read_text() == text  # a failing check leaves the baseline alone


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize(
    ("flags", "named", "hint"),
    [
        (("--world-size", "4"), "world_size: 2 in the baseline, 4 now", "--world-size 2 (or leave both out)"),
        (("--shard", "zero2"), "shard: zero3 in the baseline, zero2 now", "--shard zero3 (or leave both out)"),
        (("--world-size", "1"), "world_size: 2 in the baseline, 1 now", "--world-size 2 --shard zero3 (or leave both out)"),
    ],
)
def test_flags_that_disagree_with_the_baseline_exit_1_with_a_hint(run, target, tmp_path, flags, named, hint):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline, "--world-size", "2", "--shard", "zero3"))[0] == 0
    text = baseline.read_text()
    code, out, err = run(*check_args(target, baseline, *flags, "--json"))
    assert code == 1, err
    res = json.loads(out)
    assert res["status"] == "settings-differ"
    assert res["peak_bytes"] is None
    assert named in one_line(err)
    assert hint in one_line(err)
    assert baseline.read_text() == text


def test_a_sharded_check_against_a_one_device_baseline_says_drop_the_flags(run, target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    assert "world_size" not in baseline.read_text()  # a one-device file is as it always was
    code, _, err = run(*check_args(target, baseline, "--world-size", "2", "--shard", "zero1"))
    assert code == 1, err
    assert "world_size: 1 in the baseline, 2 now" in one_line(err)
    assert "no --world-size or --shard (the baseline is one device's)" in one_line(err)


def test_bad_flag_pairs_and_files_are_clear_errors(run, target, tmp_path):
    code, _, err = run(*check_args(target, tmp_path / "m.yaml", "--world-size", "2"))
    assert code == 1
    assert "without a sharding stage" in one_line(err)
    base = ck.Baseline(
        target="t.py:build", settings=ck.CheckSettings(batch_size=4, device="cpu", world_size=8, shard="zero3"),
        peak_bytes=10, reserved_bytes=None, breakdown=dict.fromkeys(ck.BREAKDOWN_KEYS, 2), param_bytes=1,
        grad_bytes=1, optimizer_bytes=1, activation_total_bytes=0, unattributed_activation_bytes=0, modules={},
        torch_version="2", measured_by="x", created="2026-01-01T00:00:00+00:00",
    )
    path = ck.write_baseline(base, tmp_path / "b.yaml")
    assert ck.load_baseline(path) == base  # round trip
    # an old file (no world_size/shard) is one device
    old = path.read_text().replace("  world_size: 8", "").replace("  shard: zero3", "")
    old = "\n".join(line for line in old.splitlines() if "world_size" not in line and "shard:" not in line) + "\n"
    (tmp_path / "old.yaml").write_text(old)
    s = ck.load_baseline(tmp_path / "old.yaml").settings
    assert (s.world_size, s.shard) == (1, "none")
    # a stage without ranks, or ranks without a stage, names the field
    (tmp_path / "bad.yaml").write_text(path.read_text().replace("shard: zero3", "shard: none"))
    with pytest.raises(BaselineError, match=r"field 'settings\.shard'"):
        ck.load_baseline(tmp_path / "bad.yaml")


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_update_keeps_the_baselines_sharding_and_assert_peak_within_takes_it(run, target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline, "--world-size", "2", "--shard", "zero1"))[0] == 0
    code, _, err = run(*check_args(target, baseline, "--update"))
    assert code == 0, err
    s = ck.load_baseline(baseline).settings
    assert (s.world_size, s.shard) == (2, "zero1")
    # the pytest helper on a module: the baseline's world size and stage, no flags needed
    mod = load_module(target)
    res = ck.assert_peak_within(mod.build(), baseline, make_batch=mod.make_batch, loss_fn=mod.loss_fn, batch_size=B, device="cpu")
    assert res.status == "pass"
    assert res.delta_bytes == 0
    assert (res.settings.world_size, res.settings.shard) == (2, "zero1")
