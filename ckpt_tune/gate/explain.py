"""A check's result as text for people: the plain-text report, the errors that end a command, and the
small formatters the `check` command's tables share with it. No torch, no files.
"""

from __future__ import annotations

from typing import Any

from ckpt_tune.errors import BaselineError, RegressionError
from ckpt_tune.gate.baseline import CheckResult
from ckpt_tune.plan.entry import Entry
from ckpt_tune.units import format_bytes, format_percent

FLAGS = {  # the command-line option that sets each compared setting, for hints
    "batch_size": "--batch-size",
    "precision": "--precision",
    "optimizer": "--optimizer",
    "device": "--device",
    "checkpoint": "--plan",
    "seq_len": "--seq-len",
    "attn": "--attn",
    "world_size": "--world-size",
    "shard": "--shard",
    "peft": "--peft",
}


def _flag(name: str, value: Any) -> str:
    """The option that sets a setting to `value`, as a user types it."""
    if name == "peft":
        if value is None:
            return "no --peft"
        return (f"--peft {value['method']} --lora-r {value['r']} --lora-alpha {value['alpha']} "
                f"--lora-dropout {value['dropout']:g} --lora-targets {','.join(value['targets'])}")
    return f"{FLAGS[name]} {value}"


def signed_bytes(n: int | None) -> str:
    """A change in bytes: "+512 B", "-20 B", "0 B"; "" for None (nothing to compare)."""
    if n is None:
        return ""
    return ("+" if n > 0 else "") + format_bytes(n)


def change_percent(fraction: float | None) -> str:
    """A relative change: "+50.0%", "-100.0%"; "" for None (no baseline bytes to divide by)."""
    return "" if fraction is None else format_percent(fraction, signed=True)


def show_setting(value: Any) -> str:
    """A setting for people: a checkpoint list as "blocks.0, blocks.2" (no brackets: rich reads them as markup)."""
    if isinstance(value, (list, tuple)):
        return ", ".join(Entry.of(e).label for e in value) if value else "no checkpointing"
    return str(value)


def _in_parens(fraction: float | None) -> str:
    return f" ({change_percent(fraction)})" if fraction is not None else ""


def _module_label(r) -> str:
    return f"{r.name or '(root)'}{' (new)' if r.kind == 'new' else ' (removed)' if r.kind == 'removed' else ''}"


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
            f"({format_bytes(result.baseline_peak_bytes)} -> {format_bytes(result.peak_bytes)}, {signed_bytes(d)}"
            f"{_in_parens(d / result.baseline_peak_bytes if result.baseline_peak_bytes else None)}); "
            f"limit {result.limit_bytes} bytes (+{format_percent(result.tolerance, digits=-1)})"
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
                    f"{_module_label(r)} {r.before or 0} -> {r.after or 0} bytes ({r.delta:+d}{_in_parens(r.fraction)})"
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
        sharding = ("world_size", "shard")
        flags = [_flag(d.name, d.baseline) for d in result.settings_diff if d.name not in ("checkpoint", *sharding)]
        for d in result.settings_diff:
            if d.name == "checkpoint":
                flags.append(
                    f"a --plan checkpointing {show_setting(d.baseline)}" if d.baseline else "no --plan"
                )
        rows = {d.name: d for d in result.settings_diff if d.name in sharding}
        if "world_size" in rows and rows["world_size"].baseline == 1:
            flags.append("no --world-size or --shard (the baseline is one device's)")
        elif rows:  # without the flags, check records at the baseline's world size and stage
            flags.append(" ".join(f"{FLAGS[k]} {rows[k].baseline}" for k in sharding if k in rows) + " (or leave both out)")
        raise BaselineError(
            f"{where} was measured under other settings ({named})",
            hint=f"rerun with the baseline's settings ({' '.join(flags)}), or record a new baseline with --update",
        )
    if result.status == "regressed":
        grew = [r for r in result.modules if r.delta > 0][:3]
        cause = (
            "; grew most: " + ", ".join(f"{r.name or '(root)'} {signed_bytes(r.delta)}" for r in grew)
            if grew
            else ""
        )
        raise RegressionError(
            f"memory regressed against {where}: {result.reasons[0]}{cause}",
            hint="if the growth is intended, record a new baseline with --update and commit it",
        )
