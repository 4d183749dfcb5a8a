"""`ckpt-tune check`: the command and its rendering. cli.py adds it with `check_cli.register(app)`.

Thin like every command: parse → `check.run_check` → render (stderr) → JSON (stdout) → exit code through
the error family (RegressionError 3, BaselineError 1), which cli.main turns into one line.
"""

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ckpt_tune.cli import options
from ckpt_tune.cli.options import (
    Attn,
    BatchFn,
    BatchSize,
    Device,
    HfConfig,
    Json,
    LoraAlpha,
    LoraDropout,
    LoraR,
    LoraTargets,
    LossFn,
    Optim,
    Peft,
    Precision,
    SeqLen,
    TargetArg,
)
from ckpt_tune.gate import change_percent, show_setting, signed_bytes
from ckpt_tune.plan.entry import member_names
from ckpt_tune.units import format_bytes, format_percent
from ckpt_tune.vocab import Part

_PART_LABELS = {  # the baseline's parts: the whole step's, then the breakdown's (labels: vocab.Part)
    "param_bytes": Part.PARAMS.label,
    "grad_bytes": Part.GRADS.label,
    "optimizer_bytes": Part.OPTIMIZER.label,
    "activation_total_bytes": "saved for backward (all)",
    "unattributed_activation_bytes": "  of which outside every module",
    **{f"breakdown.{p.value}": f"at the peak: {p.label}" for p in (Part.ACTIVATIONS, Part.OTHER)},
}


def check(
    target: TargetArg = None,
    baseline: Annotated[
        Path, typer.Option("--baseline", help="baseline YAML; written when missing or with --update")
    ] = ...,
    tolerance: Annotated[
        str, typer.Option(help="allowed growth of the peak over the baseline, e.g. 5% or 0.05")
    ] = "5%",
    reserved_tolerance: Annotated[
        str, typer.Option("--reserved-tolerance", help="allowed growth of CUDA reserved bytes")
    ] = "10%",
    update: Annotated[
        bool, typer.Option("--update", help="measure and overwrite the baseline (exit 0)")
    ] = False,
    batch_size: BatchSize = 8,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="measure with this plan's checkpointing applied")
    ] = None,
    device: Device = None,
    precision: Precision = "fp32",
    optimizer: Optim = "adamw",
    batch_fn: BatchFn = None,
    loss_fn: LossFn = None,
    hf_config: HfConfig = None,
    seq_len: SeqLen = 512,
    attn: Attn = "sdpa",
    peft: Peft = None,
    lora_r: LoraR = 16,
    lora_alpha: LoraAlpha = 32,
    lora_dropout: LoraDropout = 0.05,
    lora_targets: LoraTargets = "all-linear",
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            min=1,
            help="rank 0 of a sharded run over N ranks, recorded under the real engine (cpu/meta); default: the baseline's",
        ),
    ] = None,
    shard: Annotated[
        str | None, typer.Option(help="zero1 | zero2 | zero3 | fsdp (with --world-size); default: the baseline's")
    ] = None,
    top: Annotated[int, typer.Option(help="rows in the module diff")] = 10,
    as_json: Json = False,
) -> None:
    """Fail (exit 3) when the step's peak memory grew past a stored baseline; record one if missing."""
    from ckpt_tune import gate as ck
    from ckpt_tune.cli import render as report

    settings = options.settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn,
                                peft=options.peft_spec(peft, lora_r, lora_alpha, lora_dropout, lora_targets))
    with report.progress("measuring") as _:
        result = ck.run_check(
            target,
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
    render_check(result, top=top)
    if as_json:
        options.print_json(result.to_dict())
    ck.raise_for_status(result)


def _fmt(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _verdict(result) -> str:
    tol = format_percent(result.tolerance, digits=-1)
    s = result.status
    if s == "regressed":
        return "[bold red]REGRESSED[/bold red]: " + escape("; ".join(result.reasons))
    if s == "improved":
        return (
            f"[bold green]improved[/bold green]: the peak fell by more than {tol} "
            f"({signed_bytes(result.delta_bytes)}); record it with --update so the gate tightens"
        )
    if s == "pass":
        hint = "; a smaller peak can be recorded with --update" if (result.delta_bytes or 0) < 0 else ""
        return f"[bold green]pass[/bold green]: peak within {tol} of the baseline ({signed_bytes(result.delta_bytes)}){hint}"
    if s == "settings-differ":
        return "[bold red]settings differ[/bold red]: nothing was measured; the baseline's settings are needed for a fair comparison"
    rec = result.recorded
    what = "updated" if result.baseline_peak_bytes is not None else "written"
    return (
        f"[bold]baseline {what}[/bold]: {escape(str(result.baseline_path))}, peak {format_bytes(rec.peak_bytes)} "
        f"({rec.settings.device}, {rec.settings.precision}, {rec.settings.optimizer}, batch {rec.settings.batch_size}, "
        + (f"rank 0 of {rec.settings.world_size} under {rec.settings.shard}, " if rec.settings.world_size > 1 else "")
        + f"{len(rec.modules)} modules saving activations); commit it"
    )


def _settings_table(result) -> Table:
    t = Table()
    for col in ("setting", "baseline", "this run"):
        t.add_column(col)
    for d in result.settings_diff:
        t.add_row(d.name, escape(show_setting(d.baseline)), escape(show_setting(d.current)))
    return t


def _peak_table(result) -> Table:
    t = Table()
    for col in ("", "baseline", "now", "change", "%", "limit"):
        t.add_column(col, justify="left" if not col else "right")
    base = result.baseline_peak_bytes
    t.add_row(
        "peak",
        _fmt(base),
        _fmt(result.peak_bytes),
        signed_bytes(result.delta_bytes),
        change_percent(result.delta_bytes / base if base and result.delta_bytes is not None else None),
        f"{_fmt(result.limit_bytes)} (+{format_percent(result.tolerance, digits=-1)})"
        if result.limit_bytes is not None
        else "",
    )
    if result.baseline_reserved_bytes is not None or result.reserved_bytes is not None:
        rb, rn = result.baseline_reserved_bytes, result.reserved_bytes
        d = rn - rb if rb is not None and rn is not None else None
        t.add_row(
            "CUDA reserved",
            _fmt(rb),
            _fmt(rn),
            signed_bytes(d),
            change_percent(d / rb if d is not None and rb else None),
            f"{_fmt(result.reserved_limit_bytes)} (+{format_percent(result.reserved_tolerance, digits=-1)})"
            if result.reserved_limit_bytes is not None
            else "",
        )
    for r in result.parts:
        if r.name in _PART_LABELS:
            t.add_row(
                _PART_LABELS[r.name],
                _fmt(r.before),
                _fmt(r.after),
                signed_bytes(r.delta) if r.delta else "",
                change_percent(r.fraction) if r.delta else "",
                "",
            )
    return t


def _module_table(result, top: int) -> Table:
    grew = [r for r in result.modules if r.delta > 0]
    shrank = [r for r in result.modules if r.delta < 0][::-1]
    t = Table()
    for col in ("module", "baseline", "now", "change", "%"):
        t.add_column(col, justify="left" if col == "module" else "right")
    for rows in (grew[:top], shrank[:top]):
        for r in rows:
            tag = {"new": " (new)", "removed": " (removed)"}.get(r.kind, "")
            t.add_row(
                escape(r.name or "(root)") + tag,
                _fmt(r.before),
                _fmt(r.after),
                signed_bytes(r.delta),
                change_percent(r.fraction),
            )
    hidden = max(0, len(grew) - top) + max(0, len(shrank) - top)
    if hidden:
        t.add_row(f"… {hidden} more (see --json)", "", "", "", "")
    return t


def render_check(result, top: int = 10) -> None:
    """The check result on stderr: settings, peak and static parts, the module diff, the verdict."""
    from ckpt_tune.cli.render import err

    s = result.settings
    against = f" against {result.baseline_path}" if result.baseline_peak_bytes is not None else ""
    recorded = f" (recorded {result.baseline_created})" if result.baseline_created else ""
    err.print(
        escape(f"{result.target}{against}{recorded}") + f": batch {s.batch_size}, {s.device}, {s.precision}, "
        f"optimizer {s.optimizer}" + (f", checkpointing {len(member_names(s.checkpoint))} modules" if s.checkpoint else "")
        + (f", rank 0 of {s.world_size} under {s.shard}" if s.world_size > 1 else "")
    )
    if result.settings_diff:
        err.print("[bold]settings that differ from the baseline's[/bold]")
        err.print(_settings_table(result))
    if result.peak_bytes is not None and result.baseline_peak_bytes is not None:
        err.print("[bold]peak memory and its parts[/bold]")
        err.print(_peak_table(result))
    elif result.recorded is not None:
        b = result.recorded.breakdown
        err.print("at the peak: " + ", ".join(f"{p.value} {format_bytes(n)}" for p, n in b.items()))
    if result.modules:
        grew = sum(r.delta > 0 for r in result.modules)
        err.print(
            f"[bold]saved activations by module[/bold]: {grew} grew, {len(result.modules) - grew} shrank"
            f"{' (largest changes first)' if len(result.modules) > 1 else ''}"
        )
        err.print(_module_table(result, top))
        for kind, label in (
            ("new", "new modules (absent from the baseline)"),
            ("removed", "removed modules"),
        ):
            rows = [r for r in result.modules if r.kind == kind]
            if rows:
                names = ", ".join(f"{r.name or '(root)'} {signed_bytes(r.delta)}" for r in rows[:top])
                more = f", and {len(rows) - top} more" if len(rows) > top else ""
                err.print(f"{label}: {escape(names)}{more}")
    for w in result.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(w)}")
    err.print(_verdict(result))
