"""Orchestration: measure a training step and record or compare its baseline.

`run_check` is what `ckpt-tune check` does; `assert_peak_within` is the same gate as a pytest
assertion. torch is imported only where a step is measured (the imports inside the functions below),
so `import ckpt_tune` and loading or comparing baselines stay light.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tune.errors import BaselineError, CkptTuneError
from ckpt_tune.gate.baseline import (
    Baseline,
    CheckResult,
    CheckSettings,
    baseline_from_profile,
    load_baseline,
    settings_of,
    write_baseline,
)
from ckpt_tune.gate.compare import compare, first_result, settings_diff
from ckpt_tune.gate.explain import FLAGS, explain, raise_for_status
from ckpt_tune.plan.entry import plain
from ckpt_tune.plan.file import Plan, load_plan
from ckpt_tune.units import format_bytes, format_percent, parse_percent
from ckpt_tune.vocab import OPTIMIZERS, PRECISIONS

if TYPE_CHECKING:
    from torch import nn

    from ckpt_tune.measure.profiler import StepProfile
    from ckpt_tune.measure.session import Settings

UPDATE_ENV = "CKPT_TUNE_UPDATE_BASELINES"  # set to 1: assert_peak_within records instead of comparing


def run_check(
    target: str | None,
    baseline_path: str | Path,
    *,
    tolerance: str | float = "5%",
    reserved_tolerance: str | float = "10%",
    update: bool = False,
    batch_size: int = 8,
    settings: Settings | None = None,
    plan: str | Path | Plan | Sequence[str] | None = None,
) -> CheckResult:
    """What `ckpt-tune check` does. Records a baseline when there is none (or `update`), else compares.

    Settings that differ from the baseline's are found before anything is measured (status
    "settings-differ"). Errors while measuring raise CkptTuneError; a corrupt baseline raises BaselineError.
    """
    # measure.session and measure.device import torch: here, not at the top (see the module docstring)
    from ckpt_tune.measure import session
    from ckpt_tune.measure.device import resolve_device

    settings = settings or session.Settings()
    tol, rtol = parse_percent(tolerance), parse_percent(reserved_tolerance)
    _check_choice("precision", settings.precision, PRECISIONS)
    _check_choice("optimizer", settings.optimizer, OPTIMIZERS)
    path = Path(baseline_path)
    checkpoint, plan_obj = _plan_names(plan)
    device = resolve_device(settings.device)
    hf = settings.hf_config is not None
    wanted = CheckSettings(
        batch_size,
        settings.precision,
        settings.optimizer,
        device,
        checkpoint,
        settings.seq_len if hf else None,
        settings.attn if hf else None,
    )
    warnings = _plan_warnings(plan_obj, wanted)
    old: Baseline | None = None
    if update:
        with contextlib.suppress(BaselineError):  # a broken file is what --update is for
            old = load_baseline(path) if path.exists() else None
    elif path.exists():
        old = load_baseline(path)
        diff = settings_diff(old.settings, wanted)
        if diff:
            return CheckResult(
                status="settings-differ",
                target=target or settings.hf_config or "",
                settings=wanted,
                tolerance=tol,
                reserved_tolerance=rtol,
                baseline_peak_bytes=old.peak_bytes,
                peak_bytes=None,
                limit_bytes=None,
                baseline_reserved_bytes=old.reserved_bytes,
                settings_diff=diff,
                warnings=tuple(warnings),
                baseline_path=str(path),
                baseline_created=old.created,
            )
    prof = _measure(
        lambda: session.profile(
            target,
            batch_size=batch_size,
            settings=replace(settings, device=device),
            checkpoint=checkpoint,
            scaling=False,
        )
    )
    measured = settings_of(prof, checkpoint, wanted.seq_len, wanted.attn)
    if old is not None and not update:
        res = compare(old, prof, tol, rtol, measured)
        return replace(res, warnings=res.warnings + tuple(warnings), baseline_path=str(path))
    new = baseline_from_profile(prof, measured)
    write_baseline(new, path)
    res = compare(old, prof, tol, rtol, measured) if old is not None else first_result(new, tol, rtol)
    return replace(
        res,
        status="written",
        recorded=new,
        reasons=(),
        warnings=res.warnings + tuple(warnings),
        baseline_path=str(path),
    )


def _plan_names(plan: str | Path | Plan | Sequence[str] | None) -> tuple[tuple[str, ...], Plan | None]:
    if plan is None:
        return (), None
    if isinstance(plan, (str, Path, Plan, dict)):
        p = load_plan(plan)
        return plain(p.checkpoint), p
    return tuple(plan), None


def _measure(fn):
    """Run `fn` with the global RNG seeded (restored afterwards): models whose shapes depend on random
    draws (masks, routing) then measure the same on every run."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return fn()


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        raise CkptTuneError(
            f"unknown {name} {value!r}",
            f"{f'did you mean {close[0]!r}? ' if close else ''}use one of {', '.join(choices)}",
        )


def _plan_warnings(plan: Plan | None, wanted: CheckSettings) -> list[str]:
    if plan is None:
        return []
    out = []
    for name in ("batch_size", "precision", "optimizer"):
        if getattr(plan, name) != getattr(wanted, name):
            out.append(
                f"the plan was made for {name} {getattr(plan, name)}; measuring with {getattr(wanted, name)} "
                f"(pass {FLAGS[name]} {getattr(plan, name)} to measure the plan as made)"
            )
    return out


# --- for test suites -------------------------------------------------------------------------------


def assert_peak_within(
    target_or_model: str | nn.Module,
    baseline: str | Path | Baseline,
    tolerance: str | float = "5%",
    *,
    make_batch=None,
    loss_fn=None,
    batch_size: int = 8,
    device: str | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    plan: str | Path | Plan | Sequence[str] | None = None,
    reserved_tolerance: str | float = "10%",
    update: bool | None = None,
) -> CheckResult:
    """Measure one training iteration and assert its peak is within `tolerance` of `baseline`.

    `target_or_model`: a target string ("path/to/file.py:build"; `make_batch`/`loss_fn` may then be
    "file.py:fn" overrides), or an nn.Module with `make_batch=` (batch_size -> batch) and optionally
    `loss_fn=` (model, batch -> scalar; default: docs/design.md §2's rule). A module is moved to `device`.

    `baseline`: a Baseline, or a YAML path. A missing file is recorded and the assertion fails, so a
    baseline that was never committed cannot pass in CI; `update=True` (or the environment variable
    CKPT_TUNE_UPDATE_BASELINES=1) records a new one and passes. Raises AssertionError with the numbers
    on a regression, BaselineError when the settings differ or the file is broken. Returns the result.
    """
    from torch import nn

    if update is None:
        update = os.environ.get(UPDATE_ENV, "") not in ("", "0")
    if isinstance(target_or_model, str):
        from ckpt_tune.measure import session

        if callable(make_batch) or callable(loss_fn):
            raise TypeError("with a target string, make_batch= and loss_fn= are 'file.py:fn' strings")
        settings = session.Settings(device, precision, optimizer, make_batch, loss_fn)
        if not isinstance(baseline, Baseline):  # what the CLI does: settings checked before measuring
            res = run_check(
                target_or_model,
                baseline,
                tolerance=tolerance,
                reserved_tolerance=reserved_tolerance,
                update=update,
                batch_size=batch_size,
                settings=settings,
                plan=plan,
            )
            return res if update else _assert(res)
        checkpoint = _plan_names(plan)[0]
        prof = _measure(
            lambda: session.profile(target_or_model, batch_size, settings, checkpoint=checkpoint, scaling=False)
        )
    elif isinstance(target_or_model, nn.Module):
        if not callable(make_batch):
            raise TypeError(
                "assert_peak_within(model, ...) needs make_batch=, a function batch_size -> batch"
            )
        checkpoint = _plan_names(plan)[0]
        prof = _profile_module(
            target_or_model, make_batch, loss_fn, batch_size, device, precision, optimizer, checkpoint
        )
    else:
        raise TypeError(
            f"assert_peak_within takes a target string or an nn.Module, got {type(target_or_model).__name__}"
        )
    current = settings_of(prof, checkpoint)
    if isinstance(baseline, Baseline):
        return _assert(compare(baseline, prof, tolerance, reserved_tolerance, current))
    path = Path(baseline)
    if update or not path.exists():
        new = baseline_from_profile(prof, current)
        write_baseline(new, path)
        res = replace(
            first_result(new, parse_percent(tolerance), parse_percent(reserved_tolerance)),
            recorded=new,
            baseline_path=str(path),
        )
        return res if update else _assert(res)
    return _assert(
        replace(
            compare(load_baseline(path), prof, tolerance, reserved_tolerance, current),
            baseline_path=str(path),
        )
    )


def _assert(res: CheckResult) -> CheckResult:
    if res.status == "written":
        raise AssertionError(
            f"no baseline at {res.baseline_path}: recorded one now (peak {res.peak_bytes} bytes, "
            f"{format_bytes(res.peak_bytes or 0)}); commit it and rerun"
        )
    if res.status == "settings-differ":
        raise_for_status(res)
    if res.status == "regressed":
        raise AssertionError(
            f"training-step memory regressed against {res.baseline_path or 'the baseline'} "
            f"(tolerance {format_percent(res.tolerance, digits=-1)}):\n{explain(res)}"
        )
    return res


def _profile_module(
    model, make_batch, loss_fn, batch_size, device, precision, optimizer, checkpoint
) -> StepProfile:
    from ckpt_tune.measure import loader
    from ckpt_tune.measure.device import resolve_device
    from ckpt_tune.measure.profiler import profile_model
    from ckpt_tune.measure.runner import StepSettings

    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    dev = resolve_device(device)
    model.to(dev)

    def batch_fn(b: int):
        return loader.move_to(make_batch(b), dev)

    def loss(m, batch):
        return loss_fn(m, batch) if loss_fn is not None else loader.default_loss(loader.call_model(m, batch))

    return profile_model(
        model,
        batch_fn,
        loss,
        batch_size=batch_size,
        settings=StepSettings(dev, precision, optimizer),
        target=f"<{type(model).__name__}>",
        scaling=False,
        checkpoint=checkpoint,
    )
