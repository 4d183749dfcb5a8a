"""Orchestration: measure a training step and record or compare its baseline.

`run_check` is what `ckpt-tune check` does; `assert_peak_within` is the same gate as a pytest
assertion. torch is imported only where a step is measured (the imports inside the functions below),
so `import ckpt_tune` and loading or comparing baselines stay light.

A sharded run (`world_size` > 1, `shard`) is recorded as rank 0 under the real engine with a fake
process group (measure/sharded.py; on the CPU or under fake tensors), sharded per the plan's shard
units or else the planner's blocks, as `search` shards it. Without `world_size`/`shard`, a check
records at the baseline's own (a baseline recorded at world size 8 is compared at world size 8); given
and different from the baseline's, they are settings that differ (exit 1), like any other.
"""

from __future__ import annotations

import contextlib
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
    batch_size: int | None = None,
    settings: Settings | None = None,
    plan: str | Path | Plan | Sequence[str] | None = None,
    world_size: int | None = None,
    shard: str | None = None,
) -> CheckResult:
    """What `ckpt-tune check` does. Records a baseline when there is none (or `update`), else compares.

    `world_size`/`shard`: a sharded run, recorded as its rank 0; None takes the baseline's (also with
    `update`), else a sharded plan's, else one device. Settings that differ from the baseline's are
    found before anything is measured (status "settings-differ"). Errors while measuring raise
    CkptTuneError; a corrupt baseline raises BaselineError.
    """
    # measure.session and measure.device import torch: here, not at the top (see the module docstring)
    from ckpt_tune.measure import session
    from ckpt_tune.measure.device import resolve_device

    settings = settings or session.Settings()
    batch_size, world_size, shard = session.run_of(settings, batch_size, world_size, shard)
    tol, rtol = parse_percent(tolerance), parse_percent(reserved_tolerance)
    path = Path(baseline_path)
    checkpoint, plan_obj = _plan_names(plan)
    device = resolve_device(settings.device)
    hf = settings.hf_config is not None
    old: Baseline | None = None
    if update:
        with contextlib.suppress(BaselineError):  # a broken file is what --update is for
            old = load_baseline(path) if path.exists() else None
    elif path.exists():
        old = load_baseline(path)
    n, stage = resolve_sharding(world_size, shard, old, plan_obj)
    wanted = CheckSettings(
        batch_size=batch_size,
        precision=settings.precision,
        optimizer=settings.optimizer,
        device=device,
        checkpoint=checkpoint,
        seq_len=settings.seq_len if hf else None,
        attn=settings.attn if hf else None,
        world_size=n,
        shard=stage,
        peft=settings.peft if hf else None,
    )
    plan_warnings = _plan_warnings(plan_obj, wanted)
    if old is not None and not update:
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
                warnings=tuple(plan_warnings),
                baseline_path=str(path),
                baseline_created=old.created,
            )
    prof = _measure(
        lambda: _profile(target, batch_size, replace(settings, device=device), checkpoint, n, stage, plan_obj)
    )
    measured = settings_of(prof, checkpoint, wanted.seq_len, wanted.attn, n, stage, wanted.peft)
    if old is not None and not update:
        res = compare(old, prof, tol, rtol, measured)
        return replace(res, warnings=res.warnings + tuple(plan_warnings), baseline_path=str(path))
    new = baseline_from_profile(prof, measured)
    write_baseline(new, path)
    res = compare(old, prof, tol, rtol, measured) if old is not None else first_result(new, tol, rtol)
    return replace(
        res,
        status="written",
        recorded=new,
        reasons=(),
        warnings=res.warnings + tuple(plan_warnings),
        baseline_path=str(path),
    )


def resolve_sharding(
    world_size: int | None, shard: str | None, baseline: Baseline | None = None, plan: Plan | None = None
) -> tuple[int, str]:
    """The (world_size, shard) a check records at: each one given, else the baseline's (a check, or an
    --update, records like with like), else a sharded plan's, else one device; the pair checked together."""
    from ckpt_tune.tune.sharding import check_shard

    source: CheckSettings | Plan | None = baseline.settings if baseline is not None else plan
    if source is not None and source.world_size > 1:
        if world_size is None:
            world_size = source.world_size
        if shard is None and world_size > 1:
            shard = source.shard
    return check_shard(world_size, shard)


def _profile(
    target: str | None,
    batch_size: int,
    settings: Settings,
    checkpoint: tuple[str, ...],
    world_size: int = 1,
    shard: str = "none",
    plan: Plan | None = None,
) -> StepProfile:
    """The step's profile: one device's (session.profile), or rank 0's of a sharded run, recorded under
    the real engine with the plan's shard units (or the planner's blocks)."""
    from ckpt_tune.measure import session

    if world_size == 1:
        return session.profile(target, batch_size=batch_size, settings=settings, checkpoint=checkpoint, scaling=False)
    from ckpt_tune.measure.device import resolve_device
    from ckpt_tune.tune.candidates import find_blocks

    hint = "use --device cpu (or --device meta for a step larger than this machine's RAM)"
    _require_engine(resolve_device(settings.device), world_size, shard, hint)
    units = plan.shard_units if plan is not None and plan.shard == shard and plan.shard_units else None
    prof = session.profile(
        target, batch_size=batch_size, settings=settings, checkpoint=checkpoint, scaling=False,
        world_size=world_size, shard=shard, units_of=(lambda _m: units) if units else find_blocks,
    )
    return _rank0(prof, world_size, shard)


def _require_engine(device: str, world_size: int, shard: str, hint: str) -> None:
    """A sharded check records rank 0 under the real engine, which runs on the CPU or under fake tensors only."""
    from ckpt_tune.measure import session

    if not session.sharded_engine(device, world_size):
        raise CkptTuneError(
            f"a {shard} run over {world_size} ranks is recorded on the CPU or under fake tensors, not on {device}: "
            "its rank 0 runs under the real engine with a fake process group",
            hint,
        )


def _rank0(prof: StepProfile, world_size: int, shard: str) -> StepProfile:
    return replace(prof, measured_by=f"{prof.measured_by}; rank 0 of {world_size} under {shard} (a fake process group)")


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
    world_size: int | None = None,
    shard: str | None = None,
) -> CheckResult:
    """Measure one training iteration and assert its peak is within `tolerance` of `baseline`.

    `target_or_model`: a target string ("path/to/file.py:build"; `make_batch`/`loss_fn` may then be
    "file.py:fn" overrides), or an nn.Module with `make_batch=` (batch_size -> batch) and optionally
    `loss_fn=` (model, batch -> scalar; default: docs/design.md §2's rule). A module is moved to `device`.

    `baseline`: a Baseline, or a YAML path. A missing file is recorded and the assertion fails, so a
    baseline that was never committed cannot pass in CI; `update=True` (or the environment variable
    CKPT_TUNE_UPDATE_BASELINES=1) records a new one and passes. Raises AssertionError with the numbers
    on a regression, BaselineError when the settings differ or the file is broken. Returns the result.

    `world_size`/`shard`: rank 0 of a sharded run, recorded under the real engine (CPU or meta);
    None takes the baseline's (as `ckpt-tune check`), else one device.
    """
    from torch import nn

    if update is None:
        update = os.environ.get(UPDATE_ENV, "") not in ("", "0")
    if isinstance(target_or_model, str):
        from ckpt_tune.measure import session

        if callable(make_batch) or callable(loss_fn):
            raise TypeError("with a target string, make_batch= and loss_fn= are 'file.py:fn' strings")
        settings = session.Settings(device=device, precision=precision, optimizer=optimizer, batch_fn=make_batch, loss_fn=loss_fn)
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
                world_size=world_size,
                shard=shard,
            )
            return res if update else _assert(res)
        checkpoint, plan_obj = _plan_names(plan)
        n, stage = resolve_sharding(world_size, shard, baseline, plan_obj)
        prof = _measure(lambda: _profile(target_or_model, batch_size, settings, checkpoint, n, stage, plan_obj))
    elif isinstance(target_or_model, nn.Module):
        if not callable(make_batch):
            raise TypeError(
                "assert_peak_within(model, ...) needs make_batch=, a function batch_size -> batch"
            )
        checkpoint, plan_obj = _plan_names(plan)
        known = baseline if isinstance(baseline, Baseline) else None
        if known is None and Path(baseline).exists():
            with contextlib.suppress(BaselineError):  # a broken file fails where it is compared (or is updated)
                known = load_baseline(baseline)
        n, stage = resolve_sharding(world_size, shard, known, plan_obj)
        prof = _profile_module(
            target_or_model, make_batch, loss_fn, batch_size, device, precision, optimizer, checkpoint, n, stage
        )
    else:
        raise TypeError(
            f"assert_peak_within takes a target string or an nn.Module, got {type(target_or_model).__name__}"
        )
    current = settings_of(prof, checkpoint, world_size=n, shard=stage)
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
    model, make_batch, loss_fn, batch_size, device, precision, optimizer, checkpoint, world_size=1, shard="none"
) -> StepProfile:
    from ckpt_tune.measure import user_code
    from ckpt_tune.measure.device import resolve_device
    from ckpt_tune.measure.profiler import profile_model
    from ckpt_tune.measure.runner import StepSettings

    dev = resolve_device(device)
    # validated before the model moves; the sharded run too, so the profile records it
    step = StepSettings(device=dev, precision=precision, optimizer=optimizer, world_size=world_size, shard=shard)
    model.to(dev)

    def batch_fn(b: int):
        return user_code.move_to(make_batch(b), dev)

    def loss(m, batch):
        return loss_fn(m, batch) if loss_fn is not None else user_code.default_loss(user_code.call_model(m, batch))

    runner = None
    if world_size > 1:
        from ckpt_tune.measure.sharded import ShardedRunner
        from ckpt_tune.tune.candidates import find_blocks

        _require_engine(dev, world_size, shard, 'pass device="cpu"')
        runner = ShardedRunner(model, batch_fn, loss, step, world_size=world_size, shard=shard, units=tuple(find_blocks(model)))
    prof = profile_model(
        model,
        batch_fn,
        loss,
        batch_size=batch_size,
        settings=step,
        target=f"<{type(model).__name__}>",
        scaling=False,
        checkpoint=checkpoint,
        runner=runner,
    )
    return _rank0(prof, world_size, shard) if world_size > 1 else prof
