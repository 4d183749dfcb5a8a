"""`ckpt-tune check` and `ckpt_tune.assert_peak_within`: a memory baseline as a CI gate.

The target measured here is small enough to count by hand. `Net` is fc1 = Linear(IN, W), act = GELU,
fc2 = Linear(W, OUT), loss = mean(out ** 2), at batch B, float32:

- fc1 saves its input (the batch):           B * IN * 4  = 256 bytes
- act (GELU) saves its input (fc1's output): B * W * 4   = 512 bytes at W = 32
- fc2 saves its input (act's output):        B * W * 4   = 512 bytes
- pow, outside every module, saves `out`:    B * OUT * 4 = 64 bytes
- parameters: (IN * W + W + W * OUT + OUT) * 4 = 2704 bytes at W = 32

so doubling W to 64 adds 512 bytes to act and to fc2 and nothing to fc1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ckpt_tune import Settings
from ckpt_tune import gate as ck
from ckpt_tune.errors import BaselineError, CkptTuneError, RegressionError
from ckpt_tune.gate.baseline import SETTING_KEYS
from ckpt_tune.measure.profiler import ModuleRecord, StepProfile
from ckpt_tune.plan.file import Plan, write_plan
from ckpt_tune.vocab import Parts
from tests.fixtures.models import LinearStack

FP32 = 4
B, IN, OUT, W = 4, 16, 4, 32
WIDE = 64


def param_bytes(w: int) -> int:
    return (IN * w + w + w * OUT + OUT) * FP32


TARGET_SRC = f'''
import os

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear({IN}, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, {OUT})

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build():
    return Net(int(os.environ.get("CHECK_TEST_WIDTH", "{W}")))


def make_batch(batch_size):
    return torch.randn(batch_size, {IN}, generator=torch.Generator().manual_seed(0))


def loss_fn(model, x):
    return model(x).pow(2).mean()
'''


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "net.py"
    path.write_text(TARGET_SRC)
    return f"{path}:build"


def check_args(target: str, baseline: Path, *extra: str) -> list[str]:
    return ["check", target, "--baseline", str(baseline), "--device", "cpu", "--batch-size", str(B), *extra]


def one_line(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at 120 columns


# --- the command, end to end ---------------------------------------------------------------------


def test_first_run_records_a_baseline_with_the_hand_counted_bytes(run, target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    code, _, err = run(*check_args(target, baseline))
    assert code == 0, err
    assert "baseline written" in err
    b = ck.load_baseline(baseline)
    assert b.modules == {"fc1": B * IN * FP32, "act": B * W * FP32, "fc2": B * W * FP32}  # 256, 512, 512
    assert b.unattributed_activation_bytes == B * OUT * FP32 == 64
    assert b.param_bytes == b.grad_bytes == param_bytes(W) == 2704
    assert b.activation_total_bytes == 256 + 512 + 512 + 64
    assert b.breakdown.total == b.peak_bytes
    assert b.settings == ck.CheckSettings(batch_size=B, precision="fp32", optimizer="adamw", device="cpu")
    assert b.torch_version == torch.__version__
    assert b.target == target


def test_same_model_passes_with_identical_bytes(run, target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    code, out, err = run(*check_args(target, baseline, "--json"))
    assert code == 0, err
    res = json.loads(out)
    assert res["status"] == "pass"
    assert res["peak_bytes"] == res["baseline_peak_bytes"] == ck.load_baseline(baseline).peak_bytes
    assert res["delta_bytes"] == 0
    assert res["modules"] == []  # no module changed by a byte
    assert all(p["delta"] == 0 for p in res["parts"])
    assert "pass" in err


def test_wider_model_exits_3_naming_the_modules_that_grew(run, target, tmp_path, monkeypatch):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    before = ck.load_baseline(baseline)
    monkeypatch.setenv("CHECK_TEST_WIDTH", str(WIDE))
    code, out, err = run(*check_args(target, baseline, "--json"))
    assert code == 3, err
    res = json.loads(out)
    assert res["status"] == "regressed"
    grown = {r["name"]: (r["before"], r["after"], r["delta"], r["fraction"]) for r in res["modules"]}
    # act and fc2 save B x W floats: 512 -> 1024 bytes; fc1 saves the unchanged batch
    assert grown == {"act": (512, 1024, 512, 1.0), "fc2": (512, 1024, 512, 1.0)}
    parts = {p["name"]: p["delta"] for p in res["parts"]}
    assert parts["param_bytes"] == param_bytes(WIDE) - param_bytes(W) == 2688
    assert parts["unattributed_activation_bytes"] == 0
    assert res["peak_bytes"] > res["limit_bytes"] == before.peak_bytes + before.peak_bytes * 5 // 100
    text = one_line(err)
    assert "REGRESSED" in text
    assert "grew most: act +512 B, fc2 +512 B" in text  # the error line names the cause
    assert "│ act │ 512 B │ 1.0 KiB │ +512 B │ +100.0% │" in text  # the module table
    assert f"exceeds the limit {res['limit_bytes']} bytes" in text
    assert ck.load_baseline(baseline) == before  # a failed check leaves the baseline alone


def test_update_records_the_new_size_on_purpose(run, target, tmp_path, monkeypatch):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    monkeypatch.setenv("CHECK_TEST_WIDTH", str(WIDE))
    code, _, err = run(*check_args(target, baseline, "--update"))
    assert code == 0, err
    assert "baseline updated" in err
    assert "+512 B" in err  # what changed is shown when updating too
    assert ck.load_baseline(baseline).modules == {"fc1": 256, "act": 1024, "fc2": 1024}
    assert run(*check_args(target, baseline))[0] == 0


def test_smaller_model_passes_as_improved_with_a_hint_to_update(run, target, tmp_path, monkeypatch):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    monkeypatch.setenv("CHECK_TEST_WIDTH", "16")
    code, out, err = run(*check_args(target, baseline, "--json"))
    assert code == 0, err
    res = json.loads(out)
    assert res["status"] == "improved"
    assert {r["name"]: r["delta"] for r in res["modules"]} == {"act": -256, "fc2": -256}
    assert "--update" in err


@pytest.mark.parametrize(
    ("flag", "value", "setting"),
    [
        ("--batch-size", "8", "batch_size"),
        ("--precision", "bf16", "precision"),
        ("--optimizer", "sgd", "optimizer"),
        ("--device", "meta", "device"),
    ],
)
def test_other_settings_exit_1_naming_the_setting(run, target, tmp_path, flag, value, setting):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    text = baseline.read_text()
    base_value = {"batch_size": str(B), "precision": "fp32", "optimizer": "adamw", "device": "cpu"}[setting]
    code, out, err = run(*check_args(target, baseline, flag, value, "--json"))
    assert code == 1, err
    res = json.loads(out)
    assert res["status"] == "settings-differ"
    assert res["peak_bytes"] is None  # nothing measured: no false pass or fail
    assert [(d["name"], str(d["baseline"]), d["current"]) for d in res["settings_diff"]] == [
        (setting, base_value, int(value) if setting == "batch_size" else value)
    ]
    assert f"{setting}: {base_value} in the baseline, {value} now" in one_line(err)
    assert f"{flag} {base_value}" in one_line(err)  # the hint says how to rerun
    assert baseline.read_text() == text


def test_plan_is_measured_and_recorded_as_a_setting(run, target, tmp_path):
    plan = tmp_path / "plan.yaml"
    write_plan(
        Plan(
            target=target,
            device="cpu",
            precision="fp32",
            optimizer="adamw",
            budget_bytes=None,
            batch_size=B,
            grad_accum_steps=1,
            checkpoint=("fc1",),
            predicted_peak_bytes=1,
            predicted_recompute_fraction=0.0,
        ),
        plan,
    )
    with_plan, without = tmp_path / "with_plan.yaml", tmp_path / "without.yaml"
    assert run(*check_args(target, with_plan, "--plan", str(plan)))[0] == 0
    assert ck.load_baseline(with_plan).settings.checkpoint == ("fc1",)
    assert run(*check_args(target, with_plan, "--plan", str(plan)))[0] == 0
    code, _, err = run(*check_args(target, with_plan))
    assert code == 1
    assert "checkpoint: fc1 in the baseline, no checkpointing now" in one_line(err)
    assert run(*check_args(target, without))[0] == 0
    code, _, err = run(*check_args(target, without, "--plan", str(plan)))
    assert code == 1
    assert "checkpoint: no checkpointing in the baseline, fc1 now" in one_line(err)


def test_corrupt_baseline_exits_1_with_the_file_and_field(run, target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    assert run(*check_args(target, baseline))[0] == 0
    good = baseline.read_text()
    baseline.write_text(good.replace("grad_bytes:", "grad_byte:"))
    code, out, err = run(*check_args(target, baseline))
    assert code == 1
    assert out == ""
    assert f"baseline file {baseline}: field 'grad_byte' is not a baseline field" in one_line(err)
    assert "did you mean 'grad_bytes'?" in err
    assert "Traceback" not in err


def test_ten_runs_on_cpu_report_identical_bytes(target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    settings = Settings(device="cpu")
    first = ck.run_check(target, baseline, batch_size=B, settings=settings)
    assert first.status == "written"
    results = [ck.run_check(target, baseline, batch_size=B, settings=settings) for _ in range(10)]
    assert {r.status for r in results} == {"pass"}
    assert {r.peak_bytes for r in results} == {first.recorded.peak_bytes}
    assert {r.modules for r in results} == {()}  # every module's bytes equal the baseline's
    assert {tuple(p.after for p in r.parts) for r in results} == {tuple(p.after for p in results[0].parts)}


def test_register_adds_a_check_command_with_help(main, run):
    code, out, _ = run("check", "--help")
    assert code == 0
    for option in ("--baseline", "--tolerance", "--reserved-tolerance", "--update", "--plan", "--json"):
        assert option in out


def test_real_cli_runs_check(target, tmp_path):
    """Through `python -m ckpt_tune`, as CI runs it."""
    baseline = tmp_path / "memory.yaml"
    cmd = [sys.executable, "-m", "ckpt_tune", *check_args(target, baseline)]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    env = {**os.environ, "CHECK_TEST_WIDTH": str(WIDE)}
    wide = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert wide.returncode == 3, wide.stderr
    assert "act +512 B" in wide.stderr


# --- the baseline file ---------------------------------------------------------------------------


def make_baseline(**changes) -> ck.Baseline:
    b = ck.Baseline(
        target="examples/gpt.py:build",
        settings=ck.CheckSettings(batch_size=8, precision="fp32", optimizer="adamw", device="cpu"),
        peak_bytes=1000,
        reserved_bytes=None,
        breakdown=Parts(params=100, grads=100, optimizer=200, activations=500, other=100),
        param_bytes=100,
        grad_bytes=100,
        optimizer_bytes=200,
        activation_total_bytes=700,
        unattributed_activation_bytes=30,
        modules={"a": 100, "b": 50, "c": 20},
        torch_version="2.13.0+cpu",
        measured_by="allocator events",
        created="2025-01-01T00:00:00+00:00",
    )
    return dataclasses.replace(b, **changes)


def test_baseline_file_round_trips_names_yaml_would_misread(tmp_path):
    long_name = "encoder.layers.11.self_attention.query_key_value.dropout"
    b = make_baseline(
        modules={"": 4, "0": 8, "true": 16, "null": 32, long_name: 1_234_567, "blocks.0": 64},
        settings=ck.CheckSettings(batch_size=8, precision="bf16-mixed", optimizer="sgd", device="cuda:1", checkpoint=("blocks.0", "blocks.2"), seq_len=1024, attn="sdpa"),
        reserved_bytes=4096,
    )
    path = ck.write_baseline(b, tmp_path / "sub" / "memory.yaml")
    assert ck.load_baseline(path) == b
    assert "peak_bytes: 1000" in path.read_text()
    assert yaml.safe_load(path.read_text())["modules"][long_name] == 1_234_567  # the comment stays a comment


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: "version: 1\ntarget: [unclosed\n", "is not valid YAML (line 3, column 1)"),
        (lambda t: "- 1\n- 2\n", "must hold a mapping of baseline fields, found list"),
        (lambda t: "", "must hold a mapping of baseline fields, found nothing"),
        (lambda t: _drop(t, "grad_bytes"), "field 'grad_bytes' is missing"),
        (lambda t: _drop(t, "  precision"), "field 'settings.precision' is missing"),
        (
            lambda t: t.replace("peak_bytes: 1000", "peak_bytes: big"),
            "field 'peak_bytes' must be an integer, got str 'big'",
        ),
        (
            lambda t: t.replace("peak_bytes: 1000", "peak_bytes: 1.5"),
            "field 'peak_bytes' must be an integer, got float 1.5",
        ),
        (
            lambda t: t.replace("batch_size: 8", "batch_size: true"),
            "field 'settings.batch_size' must be an integer",
        ),
        (
            lambda t: t.replace("batch_size: 8", "batch_size: 0"),
            "field 'settings.batch_size' must be >= 1, got 0",
        ),
        (
            lambda t: t.replace("precision: fp32", "precision: fp64"),
            "field 'settings.precision' is 'fp64', not one of",
        ),
        (lambda t: t.replace("device: cpu", "device: tpu"), "field 'settings.device' is 'tpu'"),
        (
            lambda t: t.replace("version: 1", "version: 2"),
            "field 'version' is 2; this ckpt-tune reads version 1",
        ),
        (lambda t: t.replace("  a: 100", "  a: -5"), "field 'modules.a' must be >= 0, got -5"),
        (lambda t: t.replace("  grads: 100", "  grads: [1]"), "field 'breakdown.grads' must be an integer"),
        (
            lambda t: t.replace("torch_version: 2.13.0+cpu", "torch_version: 2.4"),
            "field 'torch_version' must be a non-empty string",
        ),
        (
            lambda t: t.replace("param_bytes:", "params_bytes:"),
            "field 'params_bytes' is not a baseline field",
        ),
        (lambda t: _set(t, "settings", 3), "field 'settings' must be a mapping, got int"),
        (
            lambda t: _set(t, "modules", [1]),
            "field 'modules' must be a mapping of module name to bytes, got list",
        ),
    ],
)
def test_broken_baseline_files_name_the_file_and_the_field(tmp_path, edit, message):
    path = ck.write_baseline(make_baseline(), tmp_path / "memory.yaml")
    path.write_text(edit(path.read_text()))
    with pytest.raises(BaselineError) as exc:
        ck.load_baseline(path)
    assert exc.value.message.startswith(f"baseline file {path}")
    assert message in exc.value.message
    assert exc.value.hint
    assert exc.value.exit_code == 1


def _set(text: str, key: str, value) -> str:
    data = yaml.safe_load(text)
    data[key] = value
    return yaml.safe_dump(data)


def _drop(text: str, key: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(key + ":")) + "\n"


def test_missing_baseline_file_is_a_clear_error(tmp_path):
    with pytest.raises(BaselineError, match="not found"):
        ck.load_baseline(tmp_path / "nope.yaml")


def test_unquoted_timestamp_is_read_back_as_text(tmp_path):
    path = ck.write_baseline(make_baseline(), tmp_path / "memory.yaml")
    path.write_text(path.read_text().replace("'2025-01-01T00:00:00+00:00'", "2025-01-01"))
    assert ck.load_baseline(path).created == "2025-01-01"


# --- compare (pure) ------------------------------------------------------------------------------


def make_profile(peak: int = 1000, modules: dict[str, int] | None = None, **changes) -> StepProfile:
    mods = {"": 0, "a": 100, "b": 50, "c": 20} if modules is None else modules
    p = StepProfile(
        target="examples/gpt.py:build",
        device="cpu",
        precision="fp32",
        optimizer="adamw",
        batch_size=8,
        torch_version="2.13.0+cpu",
        measured_by="allocator events",
        peak_bytes=peak,
        peak_phase="backward",
        breakdown=Parts(100, 100, 200, 500, peak - 900),
        param_bytes=100,
        grad_bytes=100,
        optimizer_bytes=200,
        activation_total_bytes=700,
        unattributed_activation_bytes=30,
        modules=tuple(
            ModuleRecord(n, "Linear", n.count(".") + 1, v, v, 0, 0, 0, 0.0) for n, v in mods.items()
        ),
        scaling=None,
        step_ms=1.0,
    )
    return dataclasses.replace(p, **changes)


@pytest.mark.parametrize(
    ("peak", "status"),
    [(1000, "pass"), (1050, "pass"), (1051, "regressed"), (951, "pass"), (950, "pass"), (949, "improved")],
)
def test_tolerance_is_relative_to_the_baseline_peak(peak, status):
    # 5% of 1000 is 50: up to 1050 passes, below 950 is an improvement worth recording
    res = ck.compare(make_baseline(), make_profile(peak), "5%")
    assert (res.status, res.limit_bytes, res.delta_bytes) == (status, 1050, peak - 1000)
    assert res.exit_code == (3 if status == "regressed" else 0)


def test_limit_is_exact_in_integers():
    assert ck.limit_for(15200, 0.05) == 15960  # 15200 * 1.05 is 15960.000000000002 in floats
    assert ck.limit_for(10**15, 0.1) == 11 * 10**14
    assert ck.limit_for(999, 0.0) == 999


def test_module_diff_names_grown_new_and_removed_modules():
    # a grows 100 -> 150, d appears with 30, c (20) is gone from the model, b unchanged, e saves nothing
    prof = make_profile(1100, {"": 0, "a": 150, "b": 50, "d": 30, "e": 0})
    res = ck.compare(make_baseline(), prof, "5%")
    assert res.status == "regressed"
    assert [(r.name, r.kind, r.before, r.after, r.delta, r.fraction) for r in res.modules] == [
        ("a", "grew", 100, 150, 50, 0.5),
        ("d", "new", None, 30, 30, None),
        ("c", "removed", 20, None, -20, -1.0),
    ]
    text = ck.explain(res)
    assert "peak 1000 -> 1100 bytes" in text
    assert "modules that grew: a 100 -> 150 bytes (+50 (+50.0%)), d (new) 0 -> 30 bytes (+30)" in text
    assert "modules that shrank: c (removed) 20 -> 0 bytes (-20 (-100.0%))" in text
    with pytest.raises(RegressionError, match=r"grew most: a \+50 B, d \+30 B"):
        ck.raise_for_status(res)


def test_static_parts_and_unattributed_bytes_are_compared():
    prof = make_profile(
        1000, param_bytes=160, grad_bytes=160, optimizer_bytes=320, unattributed_activation_bytes=0
    )
    parts = {r.name: r.delta for r in ck.compare(make_baseline(), prof).parts}
    assert (parts["param_bytes"], parts["grad_bytes"], parts["optimizer_bytes"]) == (60, 60, 120)
    assert parts["unattributed_activation_bytes"] == -30
    assert parts["breakdown.other"] == 0


def test_cuda_reserved_bytes_have_their_own_tolerance():
    base = make_baseline(reserved_bytes=2000, settings=ck.CheckSettings(batch_size=8, device="cuda"))
    ok = ck.compare(base, make_profile(1000, device="cuda:0", cuda_reserved_bytes=2200), "5%", "10%")
    assert (ok.status, ok.reserved_limit_bytes) == ("pass", 2200)
    bad = ck.compare(base, make_profile(1000, device="cuda:0", cuda_reserved_bytes=2201), "5%", "10%")
    assert bad.status == "regressed"
    assert bad.reasons == (
        "CUDA reserved 2201 bytes (2.1 KiB) exceeds the limit 2200 bytes (2.1 KiB: baseline 2000 + 10%) by 1 bytes",
    )


def test_other_torch_version_warns_but_does_not_fail():
    res = ck.compare(make_baseline(), make_profile(1000, torch_version="2.4.0"))
    assert res.status == "pass"
    assert res.warnings == (
        "the baseline was measured with torch 2.13.0+cpu, this run with 2.4.0: "
        "a change may come from torch, not from the model",
    )


def test_differing_settings_win_over_the_numbers():
    res = ck.compare(make_baseline(), make_profile(1000, batch_size=4, precision="bf16-mixed"))
    assert res.status == "settings-differ"
    assert [(d.name, d.baseline, d.current) for d in res.settings_diff] == [
        ("batch_size", 8, 4),
        ("precision", "fp32", "bf16-mixed"),
    ]
    assert res.reasons == ()
    with pytest.raises(BaselineError) as exc:
        ck.raise_for_status(dataclasses.replace(res, baseline_path="memory.yaml"))
    assert exc.value.message == (
        "memory.yaml was measured under other settings "
        "(batch_size: 8 in the baseline, 4 now; precision: fp32 in the baseline, bf16-mixed now)"
    )
    assert "--batch-size 8 --precision fp32" in exc.value.hint
    assert "--update" in exc.value.hint


def test_device_index_and_checkpoint_order_do_not_count_as_differences():
    a = ck.CheckSettings(batch_size=8, device="cuda:0", checkpoint=("blocks.2", "blocks.0"))
    assert (
        ck.settings_diff(a, dataclasses.replace(a, device="cuda", checkpoint=("blocks.0", "blocks.2"))) == ()
    )
    assert [d.name for d in ck.settings_diff(a, dataclasses.replace(a, device="cpu"))] == ["device"]


# --- the Python API ------------------------------------------------------------------------------


def linear_batch(width: int):
    return lambda b: torch.randn(b, width, generator=torch.Generator().manual_seed(0))


def linear_loss(model, x):
    return model(x).pow(2).sum()


def test_assert_peak_within_passes_and_fails_with_numbers(tmp_path):
    # LinearStack (tests/fixtures/models.py): 4 bias-free Linear(w, w), each saving its B x w input
    baseline = tmp_path / "linear.yaml"
    kw = {"loss_fn": linear_loss, "batch_size": B, "device": "cpu"}
    with pytest.raises(AssertionError, match=r"no baseline at .*recorded one now"):
        ck.assert_peak_within(LinearStack(64), baseline, "5%", make_batch=linear_batch(64), **kw)
    recorded = ck.load_baseline(baseline)
    assert recorded.modules == {f"layers.{i}": B * 64 * FP32 for i in range(4)}  # 1024 bytes each
    assert recorded.unattributed_activation_bytes == B * 64 * FP32  # pow saves the output
    assert recorded.target == "<LinearStack>"

    res = ck.assert_peak_within(LinearStack(64), baseline, "5%", make_batch=linear_batch(64), **kw)
    assert (res.status, res.peak_bytes) == ("pass", recorded.peak_bytes)

    with pytest.raises(AssertionError) as exc:
        ck.assert_peak_within(LinearStack(128), baseline, "5%", make_batch=linear_batch(128), **kw)
    msg = str(exc.value)
    assert f"peak {recorded.peak_bytes} -> " in msg
    assert f"limit {ck.limit_for(recorded.peak_bytes, 0.05)} bytes (+5%)" in msg
    assert "layers.0 1024 -> 2048 bytes (+1024 (+100.0%))" in msg  # B x 128 x 4 bytes now
    assert "param_bytes 65536 -> 262144 (+196608)" in msg  # 4 x w x w x 4 bytes, w = 64 -> 128


def test_assert_peak_within_update_and_settings(tmp_path, monkeypatch):
    baseline = tmp_path / "linear.yaml"
    kw = {"batch_size": B, "device": "cpu"}
    res = ck.assert_peak_within(LinearStack(64), baseline, update=True, make_batch=linear_batch(64), **kw)
    assert res.status == "written"
    assert baseline.exists()
    monkeypatch.setenv(ck.UPDATE_ENV, "1")  # the switch for a whole test suite
    assert (
        ck.assert_peak_within(LinearStack(128), baseline, make_batch=linear_batch(128), **kw).status
        == "written"
    )
    monkeypatch.delenv(ck.UPDATE_ENV)
    assert (
        ck.assert_peak_within(LinearStack(128), baseline, make_batch=linear_batch(128), **kw).status == "pass"
    )
    with pytest.raises(BaselineError, match="optimizer: adamw in the baseline, sgd now"):
        ck.assert_peak_within(LinearStack(128), baseline, make_batch=linear_batch(128), optimizer="sgd", **kw)
    with pytest.raises(TypeError, match="make_batch"):
        ck.assert_peak_within(LinearStack(64), baseline)


def test_assert_peak_within_takes_a_target_string(target, tmp_path, monkeypatch):
    baseline = tmp_path / "memory.yaml"
    with pytest.raises(AssertionError, match="recorded one now"):
        ck.assert_peak_within(target, baseline, batch_size=B, device="cpu")
    assert ck.assert_peak_within(target, baseline, batch_size=B, device="cpu").status == "pass"
    monkeypatch.setenv("CHECK_TEST_WIDTH", str(WIDE))
    with pytest.raises(AssertionError, match=r"act 512 -> 1024 bytes \(\+512 \(\+100.0%\)\)"):
        ck.assert_peak_within(target, baseline, batch_size=B, device="cpu")
    # a Baseline object is compared, never written
    assert (
        ck.assert_peak_within(target, ck.load_baseline(baseline), "200%", batch_size=B, device="cpu").status
        == "pass"
    )


def test_import_ckpt_tune_stays_light():
    code = (
        "import sys, ckpt_tune; f = ckpt_tune.assert_peak_within; "
        "from ckpt_tune.gate import assert_peak_within; assert f is assert_peak_within; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_pytest_example_records_then_passes(tmp_path):
    """examples/ci/test_memory.py, as documented: the first run records and fails, the second passes."""
    example = Path(__file__).resolve().parents[1] / "examples" / "ci" / "test_memory.py"
    (tmp_path / "test_memory.py").write_text(example.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "mlp", "test_memory.py"]

    def pytest_run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)

    first = pytest_run()
    assert first.returncode == 1, first.stdout
    assert "recorded one now" in first.stdout
    assert (tmp_path / "baselines" / "mlp.yaml").exists()
    second = pytest_run()
    assert second.returncode == 0, second.stdout
    assert "1 passed" in second.stdout


@pytest.mark.gpu
def test_cuda_records_and_compares_reserved_bytes(target, tmp_path):
    baseline = tmp_path / "memory.yaml"
    settings = Settings(device="cuda")
    first = ck.run_check(target, baseline, batch_size=B, settings=settings)
    assert first.recorded.reserved_bytes is not None
    assert first.recorded.reserved_bytes >= first.recorded.peak_bytes
    again = ck.run_check(target, baseline, batch_size=B, settings=settings)
    assert again.status == "pass", ck.explain(again)
    assert again.reserved_limit_bytes == ck.limit_for(first.recorded.reserved_bytes, 0.10)


def test_report_lists_new_and_removed_modules(capsys):
    from ckpt_tune.cli.check import render_check

    prof = make_profile(1100, {"": 0, "a": 150, "b": 50, "d": 30})
    render_check(dataclasses.replace(ck.compare(make_baseline(), prof), baseline_path="memory.yaml"))
    err = one_line(capsys.readouterr().err)
    assert "│ a │ 100 B │ 150 B │ +50 B │ +50.0% │" in err
    assert "new modules (absent from the baseline): d +30 B" in err
    assert "removed modules: c -20 B" in err
    assert "REGRESSED: peak 1100 bytes" in err


def test_a_baseline_file_holds_every_setting_and_a_run_spec_validates_them():
    assert sorted(SETTING_KEYS) == sorted(f.name for f in dataclasses.fields(ck.CheckSettings))
    with pytest.raises(CkptTuneError, match="unknown precision 'fp8'"):
        ck.CheckSettings(batch_size=8, precision="fp8")
    with pytest.raises(CkptTuneError, match="batch_size must be an integer of at least 1, got None"):
        ck.CheckSettings()
    with pytest.raises(CkptTuneError, match="shard 'none' at world_size 8"):
        ck.CheckSettings(batch_size=8, world_size=8)
    # a device is read as the command line reads it: case and blanks aside
    assert ck.CheckSettings(batch_size=8, device="CUDA:1").device == "CUDA:1"
    assert Settings(device=" Auto ").device == " Auto "
