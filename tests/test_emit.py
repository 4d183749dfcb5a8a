"""Plan files (docs/design.md §2), their validation, the patch snippet's text, and byte/percent units.

Pure: nothing here runs a model (tests/test_apply.py runs the snippet on models).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml

from ckpt_tune.errors import BudgetError, PlanError
from ckpt_tune.plan import checkpoint as plan_checkpoint
from ckpt_tune.plan.file import Plan, load_plan, plan_to_yaml, write_plan
from ckpt_tune.plan.patch import patch_snippet
from ckpt_tune.units import format_bytes, parse_percent
from ckpt_tune.vocab import OPTIMIZERS, PRECISIONS

GIB = 2**30

# The example of docs/design.md §2.
EXAMPLE = Plan(
    target="examples/gpt.py:build",
    device="cuda",
    precision="bf16-mixed",
    optimizer="adamw",
    budget_bytes=25769803776,  # 24 GiB
    batch_size=12,
    grad_accum_steps=1,
    checkpoint=("blocks.0", "blocks.2"),
    predicted_peak_bytes=24101123072,
    predicted_recompute_fraction=0.11,
)

KEY_ORDER = [
    "version",
    "target",
    "device",
    "precision",
    "optimizer",
    "budget_bytes",
    "batch_size",
    "grad_accum_steps",
    "checkpoint",
    "predicted_peak_bytes",
    "predicted_recompute_fraction",
]


def test_yaml_has_the_documented_keys_in_order() -> None:
    text = plan_to_yaml(EXAMPLE)
    data = yaml.safe_load(text)
    assert list(data) == KEY_ORDER  # no verified_peak_bytes when not verified
    assert data == {
        "version": 1,
        "target": "examples/gpt.py:build",
        "device": "cuda",
        "precision": "bf16-mixed",
        "optimizer": "adamw",
        "budget_bytes": 25769803776,
        "batch_size": 12,
        "grad_accum_steps": 1,
        "checkpoint": ["blocks.0", "blocks.2"],
        "predicted_peak_bytes": 24101123072,
        "predicted_recompute_fraction": 0.11,
    }
    # bytes as plain ints, with the size people read beside them: 24101123072 / 2**30 = 22.45
    assert "budget_bytes: 25769803776 " in text
    assert "# 24.00 GiB" in text
    assert "predicted_peak_bytes: 24101123072 " in text
    assert "# 22.45 GiB" in text
    assert "batch_size: 12" in text
    assert "# micro-batch per step" in text


def test_verified_peak_comes_last_when_present() -> None:
    plan = dataclasses.replace(EXAMPLE, verified_peak_bytes=23 * GIB)
    data = yaml.safe_load(plan_to_yaml(plan))
    assert list(data) == [*KEY_ORDER, "verified_peak_bytes"]
    assert data["verified_peak_bytes"] == 24696061952


def test_the_prediction_before_the_first_run_comes_after_the_verified_peak() -> None:
    plan = dataclasses.replace(EXAMPLE, verified_peak_bytes=23 * GIB, first_predicted_peak_bytes=24 * GIB, predicted_from_run=True)
    text = plan_to_yaml(plan)
    data = yaml.safe_load(text)
    assert list(data) == [*KEY_ORDER, "verified_peak_bytes", "first_predicted_peak_bytes", "predicted_from_run"]
    assert "# 24.00 GiB, predicted before the plan was first run" in text
    assert "solved again on terms learned from that run" in text


def test_recompute_fraction_is_rounded_to_four_decimals() -> None:
    plan = dataclasses.replace(EXAMPLE, predicted_recompute_fraction=0.123456)
    assert "predicted_recompute_fraction: 0.1235 " in plan_to_yaml(plan)


@pytest.mark.parametrize(
    "plan",
    [
        EXAMPLE,
        dataclasses.replace(EXAMPLE, verified_peak_bytes=22 * GIB, predicted_recompute_fraction=0.0),
        dataclasses.replace(EXAMPLE, budget_bytes=None, checkpoint=()),
        # names YAML would read as other types unless quoted: nn.Sequential children are "0", "1", ...
        dataclasses.replace(EXAMPLE, checkpoint=("0", "1.5", "true", "null", "layers.10", "a: b", "#x")),
        dataclasses.replace(EXAMPLE, target="my pkg/train.py:build", device="meta", precision="fp32"),
        dataclasses.replace(EXAMPLE, verified_peak_bytes=22 * GIB, first_predicted_peak_bytes=23 * GIB, predicted_from_run=True),
    ],
)
def test_write_then_load_round_trips(plan: Plan, tmp_path) -> None:
    path = write_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(path) == plan
    assert load_plan(str(path)) == plan


def test_load_accepts_a_mapping_and_a_plan() -> None:
    data = yaml.safe_load(plan_to_yaml(EXAMPLE))
    assert load_plan(data) == EXAMPLE
    assert load_plan(EXAMPLE) == EXAMPLE
    assert load_plan({**data, "checkpoint": None}).checkpoint == ()


MISSING = object()  # a change that deletes the key


def plan_data(plan: Plan, **changes) -> dict:
    """`plan` as its file's data, with keys changed (or deleted, with MISSING)."""
    data = yaml.safe_load(plan_to_yaml(plan))
    for key, value in changes.items():
        if value is MISSING:
            del data[key]
        else:
            data[key] = value
    return data


def _with(**changes) -> dict:
    return plan_data(EXAMPLE, **changes)


def assert_names_the_field(data: dict, field: str, words: str, tmp_path) -> PlanError:
    """Loading `data` from a file fails with one PlanError naming `field` and the file, with `words` and a hint."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert f"field '{field}'" in err.value.message
    assert words in err.value.message
    assert str(path) in err.value.message
    assert err.value.hint
    return err.value


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        *[({key: MISSING}, key, "is missing") for key in KEY_ORDER if key != "version"],
        ({"version": MISSING}, "version", "is missing"),
        ({"version": 2}, "version", "reads version 1"),
        ({"version": "1"}, "version", "reads version 1"),
        ({"target": ""}, "target", "non-empty string"),
        ({"target": 3}, "target", "non-empty string"),
        ({"device": "tpu"}, "device", "not one of cpu, cuda, meta"),
        ({"precision": "bf16mixed"}, "precision", "not one of"),
        ({"precision": "int8"}, "precision", "not one of"),
        ({"optimizer": "adamW"}, "optimizer", "not one of"),
        ({"budget_bytes": "24GiB"}, "budget_bytes", "must be an integer or null"),
        ({"budget_bytes": -1}, "budget_bytes", "must be >= 1"),
        ({"batch_size": 0}, "batch_size", "must be >= 1"),
        ({"batch_size": -4}, "batch_size", "must be >= 1"),
        ({"batch_size": 2.5}, "batch_size", "must be an integer"),
        ({"batch_size": True}, "batch_size", "must be an integer"),
        ({"grad_accum_steps": 0}, "grad_accum_steps", "must be >= 1"),
        ({"predicted_peak_bytes": -1}, "predicted_peak_bytes", "must be >= 0"),
        ({"predicted_peak_bytes": None}, "predicted_peak_bytes", "must be an integer"),
        ({"verified_peak_bytes": -5}, "verified_peak_bytes", "must be >= 0"),
        ({"first_predicted_peak_bytes": "1GiB"}, "first_predicted_peak_bytes", "must be an integer"),
        ({"predicted_from_run": "yes please"}, "predicted_from_run", "must be true or false"),
        ({"predicted_recompute_fraction": "11%"}, "predicted_recompute_fraction", "must be a number"),
        ({"predicted_recompute_fraction": -0.1}, "predicted_recompute_fraction", ">= 0"),
        ({"predicted_recompute_fraction": float("nan")}, "predicted_recompute_fraction", "finite"),
        ({"checkpoint": "blocks.0"}, "checkpoint", "list of module names"),
        ({"checkpoint": ["blocks.0", 1]}, "checkpoint", "list of module names"),
        ({"checkpoint": {"blocks.0": 1}}, "checkpoint", "list of module names"),
        ({"checkpoint": ["blocks.0", ""]}, "checkpoint", "root module"),
        ({"checkpoint": ["blocks.0", "blocks.0"]}, "checkpoint", "more than once"),
        ({"checkpoints": ["blocks.0"]}, "checkpoints", "not a plan field"),
    ],
)
def test_malformed_plans_name_the_field(changes: dict, field: str, words: str, tmp_path) -> None:
    assert_names_the_field(_with(**changes), field, words, tmp_path)


def test_hints_suggest_the_close_spelling() -> None:
    with pytest.raises(PlanError) as err:
        load_plan(_with(precision="bf16mixed"))
    assert "did you mean 'bf16-mixed'?" in err.value.hint
    with pytest.raises(PlanError) as err:
        load_plan(_with(checkpoints=["blocks.0"]))
    assert "did you mean 'checkpoint'?" in err.value.hint


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot read"),
        ("version: 1\ntarget: [unclosed\n", "not valid YAML (line 3"),
        ("- blocks.0\n- blocks.1\n", "must hold a mapping of plan fields, found list"),
        ("", "found nothing"),
        (b"\xff\xfe\x00bad", "not text"),
    ],
)
def test_unreadable_files_are_named(content, words: str, tmp_path) -> None:
    path = tmp_path / "plan.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(PlanError) as err:
        load_plan(path)
    assert f"plan file {path}" in err.value.message
    assert words in err.value.message


def test_load_refuses_other_types() -> None:
    with pytest.raises(PlanError, match="a file path, a mapping or a Plan, got list"):
        load_plan(["blocks.0"])  # type: ignore[arg-type]


def test_known_choices() -> None:
    assert PRECISIONS == ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
    assert OPTIMIZERS == ("adamw", "adam", "adamw-8bit", "paged-adamw-8bit", "sgd", "sgd-momentum", "none")


# ---------------------------------------------------------------------------------------------------
# Patch snippet text (tests/test_apply.py execs it on real models and compares gradients with apply)


@pytest.mark.parametrize("hf", [False, True])
def test_snippet_is_valid_python_that_needs_only_torch(hf: bool) -> None:
    source = patch_snippet(EXAMPLE, hf=hf)
    compile(source, "<patch snippet>", "exec")
    imports = [line.strip() for line in source.splitlines() if line.strip().startswith(("import ", "from "))]
    allowed = ["import types", "import torch", "import torch.utils.checkpoint", "from torch import nn"]
    allowed.append("from contextlib import contextmanager")
    if hf:
        allowed.append("from transformers.modeling_layers import GradientCheckpointingLayer")
    assert sorted(set(imports)) == sorted(allowed)
    assert "ckpt_tune" not in "".join(line.split("#")[0] for line in source.splitlines())  # in comments only
    assert "use_reentrant=False, preserve_rng_state=True" in source
    assert ('CKPT_MODULES = [\n    "blocks.0",\n    "blocks.2",\n]' in source) is hf  # the layers HF's switch turns on
    # the wrapper ckpt_tune.apply installs, embedded as it is: written once
    assert inspect.getsource(plan_checkpoint._ckpt_forward) in source
    assert 'checkpoint_module(model.get_submodule("blocks.2"))' in source
    assert source.rstrip().endswith("model = apply_checkpointing(model)")


def test_snippet_header_says_how_to_train() -> None:
    plan = dataclasses.replace(EXAMPLE, grad_accum_steps=4, verified_peak_bytes=22 * GIB)
    header = [line for line in patch_snippet(plan).splitlines() if line.startswith("#")][:5]
    assert header[1] == (
        "# Use micro-batch size 12 with 4 gradient-accumulation step(s) (48 samples per optimizer step)."
    )
    assert header[2] == (
        "# Predicted peak 22.45 GiB of a 24.00 GiB budget (verified by running it: 22.00 GiB)."
    )
    assert header[3] == "# Recompute adds about 11.0% to the step time."


def test_snippet_hf_form_uses_the_transformers_switch() -> None:
    source = patch_snippet(EXAMPLE, hf=True)
    assert 'enable({"use_reentrant": False})' in source
    assert "model.config.use_cache = False" in source
    assert "m.gradient_checkpointing = name in layers" in source
    assert "return _apply_plain(model)" in source  # the fallback for modules that are not layers
    assert "def _apply_plain(model)" not in patch_snippet(EXAMPLE)


def test_snippet_with_nothing_to_checkpoint() -> None:
    source = patch_snippet(dataclasses.replace(EXAMPLE, checkpoint=(), budget_bytes=None))
    compile(source, "<patch snippet>", "exec")
    assert "CKPT_MODULES = []" in patch_snippet(dataclasses.replace(EXAMPLE, checkpoint=(), budget_bytes=None), hf=True)
    assert "    return model" in source  # the plain form applies nothing
    assert "budget" not in source.splitlines()[2]


# ---------------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (100, "100 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (12 * 1024, "12.0 KiB"),
        (512 * 2**20, "512.0 MiB"),
        (3 * GIB // 2, "1.50 GiB"),
        (2**20 - 1, "1.0 MiB"),  # 1023.999 KiB rounds up into the next unit, not "1024.0 KiB"
        (GIB - 1, "1.00 GiB"),
        (24101123072, "22.45 GiB"),
        (3 * 2**40, "3.00 TiB"),
        (-3 * 2**20, "-3.0 MiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_takes_ints_only() -> None:
    with pytest.raises(TypeError):
        format_bytes(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "value"),
    [("10%", 0.10), ("2.5 %", 0.025), ("150%", 1.5), ("0.1", 0.1), (0.25, 0.25), (1, 1.0), ("0", 0.0)],
)
def test_parse_percent(text, value: float) -> None:
    assert parse_percent(text) == pytest.approx(value, abs=1e-12)


@pytest.mark.parametrize(
    ("text", "words"), [("10", "ambiguous"), ("-5%", ">= 0"), ("ten", "not a percentage")]
)
def test_parse_percent_refuses(text: str, words: str) -> None:
    with pytest.raises(BudgetError, match=words):
        parse_percent(text)
