"""loader.py: target strings in both forms, overrides, the default loss rule, and every error a user can cause."""

from __future__ import annotations

import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tune.errors import TargetError, UserCodeError
from ckpt_tune.measure.loader import DEFAULT_LOSS_RULE, Target, load_target
from ckpt_tune.measure.user_code import (
    build_model,
    call_model,
    compute_loss,
    default_loss,
    make_batch,
    move_to,
)

ASSETS = Path(__file__).parent / "assets"
TARGETS = ASSETS / "targets"
CASES = TARGETS / "cases.py"


def case(fn: str, batch_fn: str | None = None, loss_fn: str | None = None) -> Target:
    return load_target(f"{CASES}:{fn}", batch_fn=batch_fn, loss_fn=loss_fn)


def line_of(path: Path, text: str) -> int:
    """1-based line of `text` in `path`, so tests do not hard-code line numbers."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.fixture
def asset_pkg(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS / "pkg_root"))
    yield
    for name in [m for m in sys.modules if m.startswith("ckpt_tune_asset_pkg")]:
        del sys.modules[name]


# --- good targets ----------------------------------------------------------------------------


def test_file_target_records_where_each_part_came_from():
    spec = f"{TARGETS / 'good.py'}:build"
    target = load_target(spec)
    assert target.spec == spec
    assert target.file_path == (TARGETS / "good.py").resolve()
    assert target.fn_name == "build"
    assert target.batch_source == f"{TARGETS / 'good.py'}:make_batch"
    assert target.loss_fn is None
    assert target.loss_source == DEFAULT_LOSS_RULE
    assert not target.is_hf
    # imported under its own name, registered so dataclasses and pickling can find it
    assert target.module_name.startswith("_ckpt_tune_target_good_")
    assert sys.modules[target.module_name].__file__ == str(TARGETS / "good.py")


def test_file_target_end_to_end_default_loss_sums_output():
    target = load_target(f"{TARGETS / 'good.py'}:build")
    model = build_model(target)
    batch = make_batch(target, 5)
    assert batch.shape == (5, 4)
    loss = compute_loss(target, model, batch)
    # Linear(4, 3) on ones: every output row is W.sum(1) + b, summed over 5 rows
    expected = 5 * (model.weight.sum() + model.bias.sum())
    assert loss.requires_grad
    assert torch.allclose(loss, expected)


def test_relative_path_resolves_against_current_directory(monkeypatch):
    monkeypatch.chdir(TARGETS)
    target = load_target("good.py:build")
    assert target.file_path == (TARGETS / "good.py").resolve()
    assert target.batch_source == "good.py:make_batch"


def test_sibling_import_works_and_sys_path_is_restored():
    before = list(sys.path)
    target = load_target(f"{TARGETS / 'sibling.py'}:build")
    assert type(build_model(target)).__name__ == "TwoLayer"
    assert sys.path == before


def test_loss_fn_next_to_build_is_used():
    target = load_target(f"{TARGETS / 'with_loss.py'}:build")
    assert target.loss_source == f"{TARGETS / 'with_loss.py'}:loss_fn"
    model = build_model(target)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.0)
    # prediction 4 * 0.5 = 2 against target 0: mean squared error 4
    assert compute_loss(target, model, make_batch(target, 3)).item() == pytest.approx(4.0)


def test_package_module_target(asset_pkg):
    target = load_target("ckpt_tune_asset_pkg.models:build")
    assert target.file_path is None
    assert target.module_name == "ckpt_tune_asset_pkg.models"
    assert target.batch_source == "ckpt_tune_asset_pkg.models:make_batch"
    assert target.loss_source == "ckpt_tune_asset_pkg.models:loss_fn"
    model = build_model(target)
    batch = make_batch(target, 2)
    assert isinstance(batch, tuple)
    assert batch[0].shape == (2, 4)
    assert compute_loss(target, model, batch).shape == ()


def test_overrides_in_file_form_and_bare_name():
    target = case("build_dict", batch_fn=f"{CASES}:batch_dict", loss_fn="loss_sum")
    assert target.batch_source == f"{CASES}:batch_dict"
    assert target.loss_source == f"{CASES}:loss_sum"
    assert target.batch_fn(2)["x"].shape == (2, 4)
    # override from another file than the target's
    other = load_target(f"{TARGETS / 'good.py'}:build", batch_fn=f"{CASES}:batch_tuple")
    assert other.batch_source == f"{CASES}:batch_tuple"
    assert isinstance(make_batch(other, 3), tuple)


def test_override_in_package_form(asset_pkg):
    target = load_target(f"{TARGETS / 'good.py'}:build", loss_fn="ckpt_tune_asset_pkg.models:loss_fn")
    assert target.loss_source == "ckpt_tune_asset_pkg.models:loss_fn"


def test_override_replaces_missing_make_batch():
    target = load_target(f"{TARGETS / 'no_make_batch.py'}:build", batch_fn=f"{CASES}:make_batch")
    assert make_batch(target, 2).shape == (2, 4)


# --- the default loss rule, per batch kind ---------------------------------------------------


def test_dict_batch_and_output_loss_key():
    target = case("build_dict", batch_fn="batch_dict")
    model = build_model(target)
    batch = make_batch(target, 4)
    loss = compute_loss(target, model, batch)
    expected = (model.proj(batch["x"]) - batch["y"]).pow(2).mean()
    assert torch.allclose(loss, expected)


def test_dict_output_with_loss_none_falls_back_to_sum():
    model = build_model(case("build_dict"))
    out = call_model(model, {"x": torch.ones(2, 4)})
    assert out["loss"] is None
    assert torch.allclose(default_loss(out), out["logits"].sum())


def test_tuple_batch_sums_floating_outputs_only():
    target = case("build_tuple", batch_fn="batch_tuple")
    model = build_model(target)
    batch = make_batch(target, 3)
    loss = compute_loss(target, model, batch)
    h = model.proj(batch[0])
    # outputs (h, 2h, long zeros): the long tensor is skipped, so the loss is h.sum() + 2 * h.sum()
    assert torch.allclose(loss, 3 * h.sum())


def test_tensor_batch_scalar_output_is_the_loss():
    target = case("build_scalar")
    model = build_model(target)
    batch = make_batch(target, 2)
    assert torch.equal(compute_loss(target, model, batch), model(batch))


def test_dataclass_output_is_walked_recursively():
    model = build_model(case("build_dataclass"))
    x = torch.ones(2, 4)
    h = model.proj(x)
    # hidden h plus extra["aux"][0] = 2h
    assert torch.allclose(default_loss(model(x)), 3 * h.sum())


def test_attribute_loss_and_scalar_rules():
    Out = namedtuple("Out", ["loss", "logits"])
    loss = torch.tensor(2.5)
    assert default_loss(Out(loss=loss, logits=torch.ones(3))) is loss
    # a namedtuple whose loss is None is a tuple: sum of its floating tensors, 3 * 1.0
    assert default_loss(Out(loss=None, logits=torch.ones(3))).item() == 3.0
    assert default_loss(torch.tensor([7.0])).item() == 7.0


def test_output_with_no_floating_tensor_is_an_error():
    target = case("build_int_output")
    with pytest.raises(UserCodeError, match="no floating tensor") as info:
        compute_loss(target, build_model(target), make_batch(target, 2))
    assert "--loss-fn" in info.value.hint


def test_call_model_dispatch():
    seen = []

    class Recorder(nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((len(args), sorted(kwargs)))
            return torch.zeros(())

    m = Recorder()
    call_model(m, {"a": 1, "b": 2})
    call_model(m, [1, 2, 3])
    call_model(m, (1,))
    call_model(m, torch.ones(2))
    assert seen == [(0, ["a", "b"]), (3, []), (1, []), (1, [])]


def test_move_to_keeps_structure_and_non_tensors():
    Pair = namedtuple("Pair", ["a", "b"])
    obj = {"inputs": [torch.ones(2), (torch.zeros(1),)], "pair": Pair(torch.ones(1), 3), "meta": "keep"}
    moved = move_to(obj, torch.device("meta"))
    assert moved["inputs"][0].device.type == "meta"
    assert isinstance(moved["inputs"][1], tuple)
    assert moved["inputs"][1][0].device.type == "meta"
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].b == 3
    assert moved["meta"] == "keep"


def test_make_batch_moves_nested_tensors():
    target = case("build_dict", batch_fn="batch_nested")
    batch = make_batch(target, 3, device="meta")
    assert batch["inputs"][0].device.type == "meta"
    assert batch["inputs"][1][0].shape == (3,)
    assert batch["meta"] == "keep me"


# --- errors: target string, file, module, function --------------------------------------------


@pytest.mark.parametrize("spec", ["examples/gpt.py", "examples/gpt.py:", ":build", "", "a.py:bad-name"])
def test_bad_target_string_names_accepted_forms(spec):
    with pytest.raises(TargetError, match="bad target") as info:
        load_target(spec)
    assert "file.py:fn" in str(info.value)


def test_file_not_found_gives_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TargetError) as info:
        load_target("models/gpt.py:build")
    assert info.value.message == f"file not found: {tmp_path.resolve() / 'models' / 'gpt.py'}"
    assert str(tmp_path.resolve()) in info.value.hint


def test_file_without_py_suffix_suggests_it(monkeypatch):
    monkeypatch.chdir(TARGETS.parent)
    with pytest.raises(TargetError, match="file not found") as info:
        load_target("targets/good:build")
    assert info.value.hint == "did you mean targets/good.py?"


def test_module_not_importable():
    with pytest.raises(TargetError) as info:
        load_target("ckpt_tune_no_such_pkg.models:build")
    assert "ModuleNotFoundError: No module named 'ckpt_tune_no_such_pkg'" in info.value.message


def test_module_imports_something_missing(asset_pkg):
    with pytest.raises(TargetError) as info:
        load_target("ckpt_tune_asset_pkg.broken:build")
    msg = info.value.message
    assert "ModuleNotFoundError: No module named 'ckpt_tune_no_such_module'" in msg
    assert "broken.py:1" in msg
    assert "ckpt_tune_no_such_module" in info.value.hint


def test_file_imports_something_missing():
    path = TARGETS / "imports_missing.py"
    with pytest.raises(TargetError) as info:
        load_target(f"{path}:build")
    assert "ModuleNotFoundError: No module named 'ckpt_tune_no_such_module'" in info.value.message
    assert f"imports_missing.py:{line_of(path, 'import ckpt_tune_no_such_module')}" in info.value.message


def test_module_raises_while_importing():
    path = TARGETS / "raises_on_import.py"
    with pytest.raises(TargetError) as info:
        load_target(f"{path}:build")
    assert "raised KeyError: 'large'" in info.value.message
    assert f"raises_on_import.py:{line_of(path, 'DEPTH =')}" in info.value.message
    # the half-imported module is not left behind
    assert not [m for m in sys.modules if m.startswith("_ckpt_tune_target_raises_on_import")]


def test_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def build():\n    return (\n\nx = = 1\n")
    with pytest.raises(TargetError, match="SyntaxError") as info:
        load_target(f"{bad}:build")
    assert "broken.py:" in info.value.message


def test_script_that_exits_on_import():
    with pytest.raises(TargetError, match=r"SystemExit: usage: train\.py") as info:
        load_target(f"{TARGETS / 'exits_on_import.py'}:build")
    assert "__main__" in info.value.hint


def test_function_missing_lists_defined_callables_and_suggests():
    with pytest.raises(TargetError) as info:
        load_target(f"{TARGETS / 'good.py'}:buld")
    # sorted, only the module's own functions (not torch or nn imported into it)
    assert info.value.message.endswith("it defines: build, helper_not_a_target, make_batch")
    assert "'buld'" in info.value.message
    assert info.value.hint == f"did you mean {TARGETS / 'good.py'}:build?"


def test_function_missing_lists_at_most_ten():
    with pytest.raises(TargetError) as info:
        case("nope")
    listing = info.value.message.split("it defines: ")[1]
    assert listing.endswith(", …")
    assert len(listing.split(", ")) == 11  # ten names and the ellipsis
    # classes are callables too; uppercase sorts first
    assert listing.startswith("BadForward, DataclassModel, DictModel")


def test_build_not_callable():
    with pytest.raises(TargetError, match="is not a function: its type is int"):
        case("build_not_callable")


def test_make_batch_missing_says_where_and_suggests_batch_fn():
    with pytest.raises(TargetError) as info:
        load_target(f"{TARGETS / 'no_make_batch.py'}:build")
    assert "no make_batch(batch_size) in" in info.value.message
    assert "no_make_batch.py" in info.value.message
    assert "--batch-fn" in info.value.hint


def test_make_batch_not_callable():
    with pytest.raises(TargetError, match=r"make_batch.*is not a function: its type is str"):
        load_target(f"{TARGETS / 'bad_make_batch.py'}:build")


def test_override_missing_function():
    with pytest.raises(TargetError, match=r"no function 'batch_nope' in .*cases.py \(--batch-fn\)"):
        case("build_dict", batch_fn=f"{CASES}:batch_nope")


def test_override_bad_string():
    with pytest.raises(TargetError, match="bad --loss-fn"):
        case("build_dict", loss_fn="cases.py:")


# --- errors: running the user's functions ----------------------------------------------------


def test_build_raises_names_user_line():
    with pytest.raises(UserCodeError) as info:
        build_model(case("build_raises"))
    msg = info.value.message
    assert msg.startswith(f"{CASES}:build_raises raised KeyError: 'd_model'")
    assert msg.endswith(f"cases.py:{line_of(CASES, 'config[' + chr(34) + 'd_model')})")


def test_build_returns_int():
    target = load_target(f"{TARGETS / 'build_returns_int.py'}:build")
    with pytest.raises(UserCodeError, match=r"returned int, not a torch.nn.Module"):
        build_model(target)


def test_build_returns_model_and_optimizer():
    with pytest.raises(UserCodeError, match="returned tuple") as info:
        build_model(case("build_returns_pair"))
    assert "return only the model" in info.value.hint


def test_make_batch_raises_with_batch_size():
    target = case("build_dict", batch_fn="batch_raises")
    assert make_batch(target, 2).shape == (2, 4)
    with pytest.raises(UserCodeError) as info:
        make_batch(target, 8)
    msg = info.value.message
    assert f"{CASES}:batch_raises(8) raised RuntimeError: only have 2 samples, asked for 8" in msg
    assert f"cases.py:{line_of(CASES, 'only have 2 samples')}" in msg


@pytest.mark.parametrize(
    ("fn", "got"), [("batch_none", "returned None"), ("batch_no_tensor", "list with no tensor")]
)
def test_make_batch_returns_no_tensor(fn, got):
    with pytest.raises(UserCodeError, match=got) as info:
        make_batch(case("build_dict", batch_fn=fn), 2)
    assert "dict of tensors" in info.value.hint


def test_forward_raises():
    target = case("build_bad_forward")
    with pytest.raises(UserCodeError, match="forward raised ValueError: shapes do not line up") as info:
        compute_loss(target, build_model(target), make_batch(target, 2))
    assert f"cases.py:{line_of(CASES, 'shapes do not line up')}" in info.value.message
    assert "**batch" in info.value.hint


def test_loss_fn_raises():
    target = case("build_dict", loss_fn="loss_raises")
    with pytest.raises(UserCodeError, match=r"cases.py:loss_raises raised KeyError: 'labels'"):
        compute_loss(target, build_model(target), make_batch(target, 2))


def test_loss_not_scalar_says_shape():
    target = load_target(f"{TARGETS / 'good.py'}:build", loss_fn=f"{CASES}:loss_not_scalar")
    with pytest.raises(UserCodeError, match=r"has shape \(3, 3\); it must be a scalar") as info:
        compute_loss(target, build_model(target), make_batch(target, 3))
    assert ".mean()" in info.value.hint


def test_loss_not_tensor():
    target = case("build_scalar", loss_fn="loss_not_tensor")
    with pytest.raises(UserCodeError, match=r"is not a torch\.Tensor: its type is float"):
        compute_loss(target, build_model(target), make_batch(target, 2))


def test_loss_without_grad():
    target = case("build_scalar", loss_fn="loss_detached")
    model = build_model(target)
    with pytest.raises(UserCodeError, match="the loss does not depend on any trainable parameter"):
        compute_loss(target, model, make_batch(target, 2))
    # frozen parameters give the same error through the default rule
    plain = case("build_scalar")
    model.requires_grad_(False)
    with pytest.raises(UserCodeError, match="does not require grad"):
        compute_loss(plain, model, make_batch(plain, 2))
    # under no_grad the caller asked for no graph: not an error
    with torch.no_grad():
        assert compute_loss(plain, model, make_batch(plain, 2)).shape == ()


def test_out_of_memory_is_not_wrapped():
    def oom(batch_size):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    target = Target(
        spec="x.py:build",
        module_name="x",
        file_path=None,
        fn_name="build",
        build_fn=lambda: nn.Linear(1, 1),
        batch_fn=oom,
        loss_fn=None,
        batch_source="x.py:make_batch",
        loss_source=DEFAULT_LOSS_RULE,
    )
    with pytest.raises(torch.OutOfMemoryError):
        make_batch(target, 4)


def test_errors_print_as_one_line_and_a_hint():
    with pytest.raises(TargetError) as info:
        load_target(f"{TARGETS / 'no_make_batch.py'}:build")
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("hint: ")
