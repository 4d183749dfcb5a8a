"""`check`: measure a training step again and compare it with a stored memory baseline (a CI gate).

    result = run_check("examples/gpt.py:build", "memory.yaml", tolerance="5%", batch_size=8)
    ckpt_tune.assert_peak_within(model, "tests/memory/mlp.yaml", "5%", make_batch=make_batch)

A baseline (YAML, `write_baseline` / `load_baseline`) holds the peak, the breakdown at the peak, the
whole-step static parts and each module's activation bytes, with the settings it was measured under.
`compare` is pure: a baseline and a fresh StepProfile in, a CheckResult out (status, the rows that
changed, why it failed). On CPU the peak comes from allocator events and is the same to the byte on
every run of the same code; on CUDA it is `max_memory_allocated`, and the caching allocator's reserve
is compared under its own tolerance. torch is imported only where a step is measured, so loading
and comparing baselines stays light.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ckpt_tune.errors import BaselineError, CkptTuneError, RegressionError
from ckpt_tune.plan.file import Plan, entry_label, is_entry, load_plan, parse_yaml
from ckpt_tune.units import format_bytes, parse_percent
from ckpt_tune.vocab import OPTIMIZERS, PARTS, PRECISIONS

if TYPE_CHECKING:
    from torch import nn

    from ckpt_tune.measure.profiler import StepProfile
    from ckpt_tune.tune.search import Settings

BASELINE_VERSION = 1
BREAKDOWN_KEYS = PARTS
UPDATE_ENV = "CKPT_TUNE_UPDATE_BASELINES"  # set to 1: assert_peak_within records instead of comparing
_FLAGS = {  # the command-line option that sets each compared setting, for hints
    "batch_size": "--batch-size",
    "precision": "--precision",
    "optimizer": "--optimizer",
    "device": "--device",
    "checkpoint": "--plan",
    "seq_len": "--seq-len",
    "attn": "--attn",
}


@dataclass(frozen=True)
class CheckSettings:
    """What a baseline was measured under; a check under other settings would compare apples and pears."""

    batch_size: int  # micro-batch of the measured iteration
    precision: str  # one of PRECISIONS
    optimizer: str  # one of OPTIMIZERS (its state is part of the peak)
    device: str  # "cpu", "cuda", "cuda:N", "meta"; compared by kind, so cuda:0 matches cuda:1
    checkpoint: tuple[str, ...] = ()  # modules checkpointed by the --plan; () without one
    seq_len: int | None = None  # --hf-config targets only: the sequence length of the batch
    attn: str | None = None  # --hf-config targets only: the attention kernel


@dataclass(frozen=True)
class Baseline:
    target: str  # the target string it was measured from (informational: a rename is no failure)
    settings: CheckSettings
    peak_bytes: int  # largest live bytes of the iteration (CUDA: max_memory_allocated)
    reserved_bytes: int | None  # CUDA: max_memory_reserved; None elsewhere
    breakdown: dict[str, int]  # BREAKDOWN_KEYS: what was live at the peak moment
    param_bytes: int  # whole-step static parts
    grad_bytes: int
    optimizer_bytes: int
    activation_total_bytes: int  # everything saved for backward
    unattributed_activation_bytes: int  # saved outside every module (loss, loss_fn)
    modules: dict[str, int]  # module name -> own activation bytes; modules saving nothing omitted
    torch_version: str
    measured_by: str
    created: str  # ISO 8601, UTC
    version: int = BASELINE_VERSION


@dataclass(frozen=True)
class DiffRow:
    name: str  # module name, or a part such as "param_bytes" / "breakdown.other"
    kind: str  # "grew" | "shrank" | "same" | "new" (not in the baseline) | "removed" (gone from the model)
    before: int | None  # None: not in the baseline
    after: int | None  # None: not in the model any more
    delta: int
    fraction: float | None  # delta / before; None when before is absent or 0


@dataclass(frozen=True)
class SettingDiff:
    name: str
    baseline: Any
    current: Any


@dataclass(frozen=True)
class CheckResult:
    status: str  # "pass" | "improved" | "regressed" | "settings-differ" | "written"
    target: str
    settings: CheckSettings  # what was measured (or asked for, when nothing was measured)
    tolerance: float
    reserved_tolerance: float
    baseline_peak_bytes: int | None  # None: there was no baseline
    peak_bytes: int | None  # None: not measured (settings differ)
    limit_bytes: int | None  # the largest peak that passes
    baseline_reserved_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_limit_bytes: int | None = None
    settings_diff: tuple[SettingDiff, ...] = ()
    parts: tuple[DiffRow, ...] = ()  # static parts, unattributed activations, breakdown at the peak
    modules: tuple[DiffRow, ...] = ()  # modules whose bytes changed, largest growth first
    reasons: tuple[str, ...] = ()  # why it regressed
    warnings: tuple[str, ...] = ()
    baseline_path: str | None = None
    baseline_created: str | None = None
    recorded: Baseline | None = None  # the baseline this run wrote ("written")

    @property
    def delta_bytes(self) -> int | None:
        if self.peak_bytes is None or self.baseline_peak_bytes is None:
            return None
        return self.peak_bytes - self.baseline_peak_bytes

    @property
    def exit_code(self) -> int:
        return {"regressed": RegressionError.exit_code, "settings-differ": BaselineError.exit_code}.get(
            self.status, 0
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["delta_bytes"] = self.delta_bytes
        d["exit_code"] = self.exit_code
        return d


# --- measuring -------------------------------------------------------------------------------------


def settings_of(
    profile: StepProfile, checkpoint: Sequence[str] = (), seq_len: int | None = None, attn: str | None = None
) -> CheckSettings:
    return CheckSettings(
        profile.batch_size,
        profile.precision,
        profile.optimizer,
        profile.device,
        tuple(checkpoint),
        seq_len,
        attn,
    )


def baseline_from_profile(profile: StepProfile, settings: CheckSettings | None = None) -> Baseline:
    """The baseline record of a profiled step (`settings` adds what the profile does not carry: the plan)."""
    return Baseline(
        target=profile.target,
        settings=settings or settings_of(profile),
        peak_bytes=profile.peak_bytes,
        reserved_bytes=profile.cuda_reserved_bytes,
        breakdown={k: getattr(profile.breakdown, k) for k in BREAKDOWN_KEYS},
        param_bytes=profile.param_bytes,
        grad_bytes=profile.grad_bytes,
        optimizer_bytes=profile.optimizer_bytes,
        activation_total_bytes=profile.activation_total_bytes,
        unattributed_activation_bytes=profile.unattributed_activation_bytes,
        modules={m.name: m.activation_bytes for m in profile.modules if m.activation_bytes},
        torch_version=str(profile.torch_version),  # torch.__version__ is a str subclass YAML cannot write
        measured_by=profile.measured_by,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _plan_names(plan: str | Path | Plan | Sequence[str] | None) -> tuple[tuple[str, ...], Plan | None]:
    if plan is None:
        return (), None
    if isinstance(plan, (str, Path, Plan, dict)):
        p = load_plan(plan)
        return p.checkpoint, p
    return tuple(plan), None


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
    res = compare(old, prof, tol, rtol, measured) if old is not None else _first_result(new, tol, rtol)
    return replace(
        res,
        status="written",
        recorded=new,
        reasons=(),
        warnings=res.warnings + tuple(warnings),
        baseline_path=str(path),
    )


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
                f"(pass {_FLAGS[name]} {getattr(plan, name)} to measure the plan as made)"
            )
    return out


def _first_result(new: Baseline, tol: float, rtol: float) -> CheckResult:
    return CheckResult(
        status="written",
        target=new.target,
        settings=new.settings,
        tolerance=tol,
        reserved_tolerance=rtol,
        baseline_peak_bytes=None,
        peak_bytes=new.peak_bytes,
        limit_bytes=None,
        reserved_bytes=new.reserved_bytes,
    )


# --- comparing (pure) ------------------------------------------------------------------------------


def _device_kind(device: str) -> str:
    return device.split(":", 1)[0]


def settings_diff(baseline: CheckSettings, current: CheckSettings) -> tuple[SettingDiff, ...]:
    out = []
    for f in fields(CheckSettings):
        a, b = getattr(baseline, f.name), getattr(current, f.name)
        if f.name == "device":
            same = _device_kind(a) == _device_kind(b)
        elif f.name == "checkpoint":
            same = sorted(a) == sorted(b)  # the order of a plan's names does not change what runs
        else:
            same = a == b
        if not same:
            out.append(
                SettingDiff(
                    f.name, list(a) if isinstance(a, tuple) else a, list(b) if isinstance(b, tuple) else b
                )
            )
    return tuple(out)


def limit_for(baseline_bytes: int, tolerance: float) -> int:
    """The largest byte count within `tolerance` of the baseline: floor(baseline × (1 + tolerance)).

    Exact in integers: "5%" parsed as the float 0.05 is read back as the fraction 1/20."""
    return baseline_bytes + math.floor(baseline_bytes * Fraction(tolerance).limit_denominator(10**6))


def _same_target(a: str, b: str) -> bool:
    """Same function in a file of the same name: a checkout elsewhere, or a relative path, is no change."""
    (fa, _, na), (fb, _, nb) = a.rpartition(":"), b.rpartition(":")
    return na == nb and Path(fa).name == Path(fb).name


def _row(name: str, before: int | None, after: int | None) -> DiffRow:
    delta = (after or 0) - (before or 0)
    if before is None:
        kind = "new"
    elif after is None:
        kind = "removed"
    else:
        kind = "grew" if delta > 0 else "shrank" if delta < 0 else "same"
    return DiffRow(name, kind, before, after, delta, delta / before if before else None)


def compare(
    baseline: Baseline,
    profile: StepProfile,
    tolerance: str | float = "5%",
    reserved_tolerance: str | float = "10%",
    settings: CheckSettings | None = None,
) -> CheckResult:
    """Compare a fresh profile with a baseline. Pure: no file, no device.

    "regressed" when the peak exceeds floor(baseline × (1 + tolerance)) (or, on CUDA, the reserved bytes
    exceed theirs under `reserved_tolerance`); "improved" when it fell by more than the tolerance; else
    "pass". Settings that differ give "settings-differ" whatever the numbers.
    """
    tol, rtol = parse_percent(tolerance), parse_percent(reserved_tolerance)
    current = settings or settings_of(profile)
    diff = settings_diff(baseline.settings, current)
    limit = limit_for(baseline.peak_bytes, tol)
    peak = profile.peak_bytes
    reserved, base_reserved = profile.cuda_reserved_bytes, baseline.reserved_bytes
    rlimit = limit_for(base_reserved, rtol) if base_reserved is not None and reserved is not None else None

    now_modules = {m.name: m.activation_bytes for m in profile.modules}
    rows = [_row(n, b, now_modules.get(n)) for n, b in baseline.modules.items()]
    rows += [_row(n, None, a) for n, a in now_modules.items() if a and n not in baseline.modules]
    changed = sorted((r for r in rows if r.delta), key=lambda r: (-r.delta, r.name))

    parts = [
        _row(k, getattr(baseline, k), getattr(profile, k))
        for k in (
            "param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "activation_total_bytes",
            "unattributed_activation_bytes",
        )
    ]
    parts += [
        _row(f"breakdown.{k}", baseline.breakdown[k], getattr(profile.breakdown, k)) for k in BREAKDOWN_KEYS
    ]

    reasons = []
    if peak > limit:
        reasons.append(
            f"peak {peak} bytes ({format_bytes(peak)}) exceeds the limit {limit} bytes "
            f"({format_bytes(limit)}: baseline {baseline.peak_bytes} + {percent(tol)}) by {peak - limit} bytes"
        )
    if rlimit is not None and reserved > rlimit:
        reasons.append(
            f"CUDA reserved {reserved} bytes ({format_bytes(reserved)}) exceeds the limit {rlimit} bytes "
            f"({format_bytes(rlimit)}: baseline {base_reserved} + {percent(rtol)}) by {reserved - rlimit} bytes"
        )
    if diff:
        status = "settings-differ"
    elif reasons:
        status = "regressed"
    elif peak < baseline.peak_bytes - (limit - baseline.peak_bytes):
        status = "improved"
    else:
        status = "pass"
    warnings = []
    if str(profile.torch_version) != baseline.torch_version:
        warnings.append(
            f"the baseline was measured with torch {baseline.torch_version}, this run with "
            f"{profile.torch_version}: a change may come from torch, not from the model"
        )
    if not _same_target(profile.target, baseline.target):
        warnings.append(f"the baseline was measured for {baseline.target}, this run for {profile.target}")
    return CheckResult(
        status=status,
        target=profile.target,
        settings=current,
        tolerance=tol,
        reserved_tolerance=rtol,
        baseline_peak_bytes=baseline.peak_bytes,
        peak_bytes=peak,
        limit_bytes=limit,
        baseline_reserved_bytes=base_reserved,
        reserved_bytes=reserved,
        reserved_limit_bytes=rlimit,
        settings_diff=diff,
        parts=tuple(parts),
        modules=tuple(changed),
        reasons=tuple(reasons) if not diff else (),
        warnings=tuple(warnings),
        baseline_created=baseline.created,
    )


def percent(fraction: float) -> str:
    """0.05 -> "5%", 0.125 -> "12.5%": a tolerance as the user wrote it."""
    return f"{100 * fraction:.4g}%"


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + format_bytes(n)


def _pct(fraction: float | None) -> str:
    return "" if fraction is None else f" ({fraction:+.1%})"


def explain(result: CheckResult, top: int = 5) -> str:
    """The result in plain text with exact byte counts: the message of assert_peak_within's AssertionError."""
    lines = []
    if result.settings_diff:
        lines.append(
            "settings differ from the baseline's: "
            + "; ".join(
                f"{d.name} {show_setting(d.baseline)} in the baseline, {show_setting(d.current)} now"
                for d in result.settings_diff
            )
        )
    if result.peak_bytes is not None and result.baseline_peak_bytes is not None:
        d = result.peak_bytes - result.baseline_peak_bytes
        lines.append(
            f"peak {result.baseline_peak_bytes} -> {result.peak_bytes} bytes "
            f"({format_bytes(result.baseline_peak_bytes)} -> {format_bytes(result.peak_bytes)}, {_signed(d)}"
            f"{_pct(d / result.baseline_peak_bytes if result.baseline_peak_bytes else None)}); "
            f"limit {result.limit_bytes} bytes (+{percent(result.tolerance)})"
        )
    lines += result.reasons
    grew = [r for r in result.modules if r.delta > 0]
    shrank = [r for r in result.modules if r.delta < 0]
    for label, rows in (("grew", grew), ("shrank", shrank[::-1])):
        if rows:
            more = f", and {len(rows) - top} more" if len(rows) > top else ""
            lines.append(
                f"modules that {label}: "
                + ", ".join(
                    f"{r.name or '(root)'}{' (new)' if r.kind == 'new' else ' (removed)' if r.kind == 'removed' else ''} "
                    f"{r.before or 0} -> {r.after or 0} bytes ({r.delta:+d}{_pct(r.fraction)})"
                    for r in rows[:top]
                )
                + more
            )
    static = [r for r in result.parts if r.delta and not r.name.startswith("breakdown.")]
    if static:
        lines.append(
            "whole step: " + ", ".join(f"{r.name} {r.before} -> {r.after} ({r.delta:+d})" for r in static)
        )
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def raise_for_status(result: CheckResult) -> None:
    """RegressionError (exit 3) for "regressed", BaselineError (exit 1) for "settings-differ"."""
    where = result.baseline_path or "the baseline"
    if result.status == "settings-differ":
        named = "; ".join(
            f"{d.name}: {show_setting(d.baseline)} in the baseline, {show_setting(d.current)} now"
            for d in result.settings_diff
        )
        flags = [f"{_FLAGS[d.name]} {d.baseline}" for d in result.settings_diff if d.name != "checkpoint"]
        for d in result.settings_diff:
            if d.name == "checkpoint":
                flags.append(
                    f"a --plan checkpointing {show_setting(d.baseline)}" if d.baseline else "no --plan"
                )
        raise BaselineError(
            f"{where} was measured under other settings ({named})",
            hint=f"rerun with the baseline's settings ({' '.join(flags)}), or record a new baseline with --update",
        )
    if result.status == "regressed":
        grew = [r for r in result.modules if r.delta > 0][:3]
        cause = (
            "; grew most: " + ", ".join(f"{r.name or '(root)'} {_signed(r.delta)}" for r in grew)
            if grew
            else ""
        )
        raise RegressionError(
            f"memory regressed against {where}: {result.reasons[0]}{cause}",
            hint="if the growth is intended, record a new baseline with --update and commit it",
        )


def show_setting(value: Any) -> str:
    """A setting for people: a checkpoint list as "blocks.0, blocks.2" (no brackets: rich reads them as markup)."""
    if isinstance(value, (list, tuple)):
        return ", ".join(entry_label(e) for e in value) if value else "no checkpointing"
    return str(value)


# --- the file --------------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    """One YAML scalar as safe_dump writes it: names like "0" or "true" stay strings when read back."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10_000)
        .removesuffix("\n")
        .removesuffix("\n...")
        .strip()
    )


def _line(key: str, value: Any, comment: str | None = None, indent: int = 0) -> str:
    text = f"{' ' * indent}{_scalar(key)}: {_scalar(value)}" if value is not ... else f"{' ' * indent}{key}:"
    # the space before "#" is what makes it a comment: "12# x" would read back as the string "12# x"
    return f"{text.ljust(39)} # {comment}" if comment else text


def baseline_to_yaml(b: Baseline) -> str:
    s = b.settings
    lines = [
        "# ckpt-tune memory baseline. `ckpt-tune check TARGET --baseline <this file>` fails when the",
        "# training step's peak grows past it; record a new one on purpose with --update and commit it.",
        _line("version", b.version),
        _line("target", b.target),
        _line("created", b.created),
        _line("torch_version", b.torch_version),
        _line("measured_by", b.measured_by),
        _line("settings", ..., "the check measures under these; others fail with exit 1"),
        _line("batch_size", s.batch_size, indent=2),
        _line("precision", s.precision, indent=2),
        _line("optimizer", s.optimizer, indent=2),
        _line("device", s.device, indent=2),
        _line(
            "checkpoint",
            [e if isinstance(e, str) else list(e) for e in s.checkpoint],
            "modules checkpointed by the --plan",
            indent=2,
        ),
    ]
    if s.seq_len is not None or s.attn is not None:
        lines += [_line("seq_len", s.seq_len, indent=2), _line("attn", s.attn, indent=2)]
    lines += [
        _line("peak_bytes", b.peak_bytes, format_bytes(b.peak_bytes)),
        _line(
            "reserved_bytes",
            b.reserved_bytes,
            "CUDA caching allocator reserve"
            + (f": {format_bytes(b.reserved_bytes)}" if b.reserved_bytes is not None else ""),
        ),
        _line("breakdown", ..., "live at the peak moment; adds up to peak_bytes"),
        *(_line(k, b.breakdown[k], format_bytes(b.breakdown[k]), indent=2) for k in BREAKDOWN_KEYS),
        _line("param_bytes", b.param_bytes, "whole step: " + format_bytes(b.param_bytes)),
        _line("grad_bytes", b.grad_bytes, format_bytes(b.grad_bytes)),
        _line("optimizer_bytes", b.optimizer_bytes, format_bytes(b.optimizer_bytes)),
        _line(
            "activation_total_bytes",
            b.activation_total_bytes,
            "saved for backward: " + format_bytes(b.activation_total_bytes),
        ),
        _line(
            "unattributed_activation_bytes",
            b.unattributed_activation_bytes,
            "saved outside every module: " + format_bytes(b.unattributed_activation_bytes),
        ),
    ]
    if b.modules:
        lines.append(_line("modules", ..., "bytes each module's own ops save for backward; 0 omitted"))
        lines += [_line(name, n, format_bytes(n), indent=2) for name, n in b.modules.items()]
    else:
        lines.append(_line("modules", {}))
    return "\n".join(lines) + "\n"


def write_baseline(baseline: Baseline, path: str | Path) -> Path:
    path = Path(path)
    try:
        if path.parent != Path():
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(baseline_to_yaml(baseline), encoding="utf-8")
    except OSError as exc:
        raise BaselineError(f"cannot write baseline file {path}: {exc.strerror or exc}") from exc
    return path


_TOP_KEYS = tuple(f.name for f in fields(Baseline))
_SETTING_KEYS = tuple(f.name for f in fields(CheckSettings))
_OPTIONAL_SETTINGS = ("checkpoint", "seq_len", "attn")
_FIX = "baseline files are written by `ckpt-tune check`: fix the field, or record a new one with --update"


class _Reader:
    """Field checks that name the file and the field in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, problem: str, hint: str = _FIX) -> BaselineError:
        return BaselineError(f"{self.where}: field '{key}' {problem}", hint=hint)

    def keys(self, data: Any, allowed: tuple[str, ...], optional: tuple[str, ...], prefix: str = "") -> dict:
        if not isinstance(data, dict):
            raise self.fail(prefix.rstrip(".") or "(file)", f"must be a mapping, got {_kind(data)}")
        for k in data:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                raise self.fail(
                    prefix + str(k),
                    "is not a baseline field",
                    f"did you mean {close[0]!r}?" if close else f"fields are: {', '.join(allowed)}",
                )
        for k in allowed:
            if k not in data and k not in optional:
                raise self.fail(prefix + k, "is missing")
        return data

    def integer(self, value: Any, key: str, minimum: int | None = 0, nullable: bool = False) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(
                key, f"must be an integer{' or null' if nullable else ''}, got {_kind(value)} {value!r}"
            )
        if minimum is not None and value < minimum:
            raise self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def text(self, value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(
                key,
                f"must be a non-empty string, got {_kind(value)} {value!r}",
                "quote it in the YAML file, e.g. '2.4.0'" if isinstance(value, (int, float)) else _FIX,
            )
        if choices is not None and value not in choices:
            raise self.fail(key, f"is {value!r}, not one of {', '.join(choices)}")
        return value


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def load_baseline(path: str | Path) -> Baseline:
    """A validated Baseline from its YAML file. Any problem raises BaselineError naming the file and field."""
    path = Path(path)
    where = f"baseline file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BaselineError(
            f"{where} not found", hint=f"record one with `ckpt-tune check TARGET --baseline {path}`"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineError(f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}") from exc
    data = parse_yaml(text, where, BaselineError, "restore it from version control, or record a new one with --update")
    r = _Reader(where)
    if not isinstance(data, dict):
        raise BaselineError(
            f"{where} must hold a mapping of baseline fields, found {_kind(data)}",
            hint="restore it from version control, or record a new one with --update",
        )
    r.keys(data, _TOP_KEYS, ("reserved_bytes",))
    if isinstance(data["version"], bool) or data["version"] != BASELINE_VERSION:
        raise r.fail(
            "version",
            f"is {data['version']!r}; this ckpt-tune reads version {BASELINE_VERSION}",
            "record a new baseline with --update",
        )
    s = r.keys(data["settings"], _SETTING_KEYS, _OPTIONAL_SETTINGS, "settings.")
    ckpt = s.get("checkpoint") or []
    if not isinstance(ckpt, list) or not all(is_entry(n) for n in ckpt):
        raise r.fail(
            "settings.checkpoint",
            f"must be a list of module names (a segment: a list of two or more), got {ckpt!r}",
        )
    device = r.text(s["device"], "settings.device")
    if _device_kind(device) not in ("cpu", "cuda", "meta"):
        raise r.fail("settings.device", f"is {device!r}, not cpu, cuda, cuda:N or meta")
    settings = CheckSettings(
        batch_size=r.integer(s["batch_size"], "settings.batch_size", 1),
        precision=r.text(s["precision"], "settings.precision", PRECISIONS),
        optimizer=r.text(s["optimizer"], "settings.optimizer", OPTIMIZERS),
        device=device,
        checkpoint=tuple(n if isinstance(n, str) else tuple(n) for n in ckpt),
        seq_len=r.integer(s.get("seq_len"), "settings.seq_len", 1, nullable=True),
        attn=None if s.get("attn") is None else r.text(s["attn"], "settings.attn"),
    )
    bd = r.keys(data["breakdown"], BREAKDOWN_KEYS, (), "breakdown.")
    # "other" is what is left of the peak after the named parts, and may dip below zero.
    breakdown = {k: r.integer(bd[k], f"breakdown.{k}", None if k == "other" else 0) for k in BREAKDOWN_KEYS}
    mods = data["modules"] or {}
    if not isinstance(mods, dict):
        raise r.fail("modules", f"must be a mapping of module name to bytes, got {_kind(mods)}")
    modules = {}
    for name, n in mods.items():
        if isinstance(name, bool) or not isinstance(name, (str, int)):
            raise r.fail("modules", f"has a key {name!r} that is not a module name")
        modules[str(name)] = r.integer(n, f"modules.{name}")
    created = data["created"]
    if isinstance(created, (datetime.date, datetime.datetime)):  # YAML reads an unquoted timestamp as one
        created = created.isoformat()
    return Baseline(
        target=r.text(data["target"], "target"),
        settings=settings,
        peak_bytes=r.integer(data["peak_bytes"], "peak_bytes", 1),
        reserved_bytes=r.integer(data.get("reserved_bytes"), "reserved_bytes", 0, nullable=True),
        breakdown=breakdown,
        param_bytes=r.integer(data["param_bytes"], "param_bytes"),
        grad_bytes=r.integer(data["grad_bytes"], "grad_bytes"),
        optimizer_bytes=r.integer(data["optimizer_bytes"], "optimizer_bytes"),
        activation_total_bytes=r.integer(data["activation_total_bytes"], "activation_total_bytes"),
        unattributed_activation_bytes=r.integer(
            data["unattributed_activation_bytes"], "unattributed_activation_bytes"
        ),
        modules=modules,
        torch_version=r.text(data["torch_version"], "torch_version"),
        measured_by=r.text(data["measured_by"], "measured_by"),
        created=r.text(created, "created"),
    )


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
    `loss_fn=` (model, batch -> scalar; default: DESIGN.md §2's rule). A module is moved to `device`.

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
            _first_result(new, parse_percent(tolerance), parse_percent(reserved_tolerance)),
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
            f"(tolerance {percent(res.tolerance)}):\n{explain(res)}"
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
