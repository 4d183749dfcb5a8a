"""The comparison, pure: a baseline and a fresh StepProfile in, a CheckResult out. No torch, no files.

A peak passes up to floor(baseline × (1 + tolerance)), computed exactly in integers (`limit_for`). On
CPU the peak comes from allocator events and is the same to the byte on every run of the same code; on
CUDA it is `max_memory_allocated`, and the caching allocator's reserve is compared under its own
tolerance. Settings that differ from the baseline's decide the status whatever the numbers say.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tune.gate.baseline import (
    SETTING_KEYS,
    Baseline,
    CheckResult,
    CheckSettings,
    DiffRow,
    SettingDiff,
    settings_of,
)
from ckpt_tune.units import format_bytes, format_percent, parse_percent
from ckpt_tune.vocab import device_kind

if TYPE_CHECKING:
    from ckpt_tune.measure.profiler import StepProfile

_STATIC_PARTS = (
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "activation_total_bytes",
    "unattributed_activation_bytes",
)


def _shown(value):
    """A setting as data: a tuple as a list, a PeftSpec as its plan-file mapping."""
    if isinstance(value, tuple):
        return list(value)
    return value.to_data() if hasattr(value, "to_data") else value


def settings_diff(baseline: CheckSettings, current: CheckSettings) -> tuple[SettingDiff, ...]:
    out = []
    for name in SETTING_KEYS:
        a, b = getattr(baseline, name), getattr(current, name)
        if name == "device":
            same = device_kind(a) == device_kind(b)
        elif name == "checkpoint":
            same = sorted(a, key=str) == sorted(b, key=str)  # the order of a plan's entries does not change what runs
        else:
            same = a == b
        if not same:
            out.append(
                SettingDiff(name, _shown(a), _shown(b))
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

    parts = [_row(k, getattr(baseline, k), getattr(profile, k)) for k in _STATIC_PARTS]
    parts += [
        _row(f"breakdown.{p.value}", n, getattr(profile.breakdown, p.value)) for p, n in baseline.breakdown.items()
    ]

    reasons = []
    if peak > limit:
        reasons.append(
            f"peak {peak} bytes ({format_bytes(peak)}) exceeds the limit {limit} bytes "
            f"({format_bytes(limit)}: baseline {baseline.peak_bytes} + {format_percent(tol, digits=-1)}) "
            f"by {peak - limit} bytes"
        )
    if rlimit is not None and reserved > rlimit:
        reasons.append(
            f"CUDA reserved {reserved} bytes ({format_bytes(reserved)}) exceeds the limit {rlimit} bytes "
            f"({format_bytes(rlimit)}: baseline {base_reserved} + {format_percent(rtol, digits=-1)}) "
            f"by {reserved - rlimit} bytes"
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


def first_result(new: Baseline, tol: float, rtol: float) -> CheckResult:
    """The result of recording a baseline where there was none: nothing to compare, status "written"."""
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
