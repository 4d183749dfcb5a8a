"""The only place that renders with rich. Everything goes to stderr; --json output goes to stdout."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from ckpt_tune.measure.profiler import StepProfile
from ckpt_tune.plan.entry import Entry, member_names
from ckpt_tune.units import format_bytes

err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 120)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


@contextlib.contextmanager
def progress(message: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr; yields a function that updates its text."""
    if not enabled or not err.is_terminal:
        yield lambda msg: None
        return
    with err.status(message) as status:
        yield lambda msg: status.update(f"{message}: {msg}")


def profile_table(prof: StepProfile, top: int = 15, depth: int | None = None) -> Table:
    t = Table(title=f"Activation memory by module, batch {prof.batch_size} ({prof.device}, {prof.precision})", title_justify="left")
    t.add_column("module")
    t.add_column("type")
    t.add_column("saved (own)", justify="right")
    t.add_column("saved (subtree)", justify="right")
    t.add_column("share of step", justify="right")
    t.add_column("output", justify="right")
    t.add_column("params", justify="right")
    t.add_column("fwd ms" if prof.time_unit == "ms" else "fwd GFLOP", justify="right")
    rows = [m for m in prof.modules if m.name and (depth is None or m.depth <= depth)]
    rows.sort(key=lambda m: m.subtree_activation_bytes if depth is not None else m.activation_bytes, reverse=True)
    for m in rows[:top]:
        t.add_row(
            m.name,
            m.type,
            format_bytes(m.activation_bytes),
            format_bytes(m.subtree_activation_bytes),
            _pct(m.subtree_activation_bytes if depth is not None else m.activation_bytes, prof.peak_bytes),
            format_bytes(m.output_bytes),
            format_bytes(m.param_bytes),
            f"{m.forward_ms:.2f}",
        )
    if prof.unattributed_activation_bytes:
        t.add_row(
            "(outside every module)", "loss / loss_fn", format_bytes(prof.unattributed_activation_bytes), "",
            _pct(prof.unattributed_activation_bytes, prof.peak_bytes), "", "", "",
        )
    return t


def breakdown_panel(prof: StepProfile) -> Panel:
    b = prof.breakdown
    t = Table.grid(padding=(0, 2))
    t.add_column()
    t.add_column(justify="right")
    t.add_column(justify="right")
    for part, val in b.items():  # the five parts, with their labels (vocab.Part)
        t.add_row(part.label, format_bytes(val), _pct(val, prof.peak_bytes))
    t.add_row("[bold]peak[/bold]", f"[bold]{format_bytes(prof.peak_bytes)}[/bold]", "100%")
    lines = [
        t,
        "",
        f"peak reached in: [bold]{prof.peak_phase}[/bold]",
        f"whole step: params {format_bytes(prof.param_bytes)}, grads {format_bytes(prof.grad_bytes)}, "
        f"optimizer {format_bytes(prof.optimizer_bytes)}, saved for backward {format_bytes(prof.activation_total_bytes)} "
        f"(of which outside every module {format_bytes(prof.unattributed_activation_bytes)})",
    ]
    if prof.scaling:
        s = prof.scaling
        lines.append(
            f"scaling: peak ≈ {format_bytes(s.fixed_bytes)} + {format_bytes(s.per_sample_bytes)} × batch "
            f"(measured at batch {s.batch_sizes[0]} and {s.batch_sizes[1]})"
        )
    if prof.cuda_reserved_bytes is not None:
        lines.append(f"CUDA reserved (caching allocator): {format_bytes(prof.cuda_reserved_bytes)}")
    cost = f"step time {prof.step_ms:.1f} ms" if prof.time_unit == "ms" else f"step {prof.step_ms:.1f} GFLOP (fake tensors: FLOPs, not time)"
    lines.append(f"{cost}; measured by {prof.measured_by}")
    return Panel(Group(*lines), title="Where the peak goes (live at the peak moment)", title_align="left")


def render_profile(prof: StepProfile, top: int = 15, depth: int | None = None) -> None:
    err.print(profile_table(prof, top, depth))
    err.print(breakdown_panel(prof))


def render_search(outcome, plan_yaml: str, patch: str, elapsed_s: float) -> None:
    res, budget = outcome.result, outcome.budget
    err.print(f"budget: {budget.source}; usable {format_bytes(budget.usable_bytes)}")
    if outcome.world_size > 1:
        how = (
            "rank 0's step recorded under the real engine (fake process group), collective buffers included"
            if outcome.sharding == "measured"
            else "the sharded states by arithmetic on the recorded single-device step (the engine is recorded "
            "only on --device cpu or meta)"
        )
        err.print(f"per GPU of {outcome.world_size} ({outcome.shard}): every peak below is one GPU's, {how}")
    t = Table(title="Frontier: best plan per batch size", title_justify="left")
    for col in ("batch", "checkpointed blocks", "predicted peak", "recompute", "fits"):
        t.add_column(col, justify="right" if col != "checkpointed blocks" else "left")
    for r in res.frontier:
        t.add_row(
            str(r.batch_size), _plan_label(r.plan, res.units), format_bytes(r.predicted_peak),
            f"{100 * r.recompute_fraction:.1f}%", "[green]yes[/green]" if r.fits else "[red]no[/red]",
        )
    err.print(t)
    b = Table(title=f"At batch {res.batch_size}", title_justify="left")
    for col in ("strategy", "checkpointed", "peak", "recompute", "fits"):
        b.add_column(col, justify="left" if col in ("strategy", "checkpointed") else "right")
    for label, row in res.baselines.items():
        b.add_row(label, _count(row.plan, res.units), format_bytes(row.predicted_peak) + " (measured)",
                  f"{100 * row.recompute_fraction:.1f}%", "yes" if row.fits else "no")
    # the prediction made before the plan was first run, against what that run measured (a figure solved
    # again on terms the run itself measured is in the notes, not here)
    predicted = res.predicted_peak if res.first_predicted_peak is None else res.first_predicted_peak
    b.add_row("[bold]ckpt-tune plan[/bold]", _count(res.checkpoint, res.units),
              f"{format_bytes(predicted)} predicted, {format_bytes(res.verified_peak)} verified",
              f"{100 * res.recompute_fraction:.1f}%", "[green]yes[/green]")
    err.print(b)
    for note in res.notes:
        err.print(note)
    err.print(Panel(Syntax(plan_yaml, "yaml", theme="ansi_dark", background_color="default"), title="plan", title_align="left"))
    err.print(Panel(Syntax(patch, "python", theme="ansi_dark", background_color="default"), title="patch", title_align="left"))
    extended = f"; terms of {len(res.extended_terms)} identical blocks extended, not recorded" if res.extended_terms else ""
    real = ""
    if res.real_steps is not None and res.timed_steps is None:  # every step ran on the device
        largest = res.largest_real_peak or 0
        past = f", {largest / res.budget:.2f}x the budget" if largest > res.budget else ""
        real = f": all real; the largest peaked at {format_bytes(largest)}{past}"
    elif res.real_steps is not None:  # probes under fake tensors: what ran for real
        real = (
            f": {res.probes - res.real_steps} under fake tensors, {res.real_steps} real, and {res.timed_steps} real steps "
            f"timed; the largest real step peaked at {format_bytes(res.largest_real_peak or 0)}"
        )
    err.print(f"searched in {elapsed_s:.1f} s ({res.probes} recorded steps{real}{extended})")


def _plan_label(plan: tuple[Entry, ...], units: tuple[str, ...]) -> str:
    if not plan:
        return "(none)"
    labels = [e.label for e in plan]
    segs = sum(1 for e in plan if e.is_segment)
    if len(plan) == len(units) and not segs:
        return f"all {len(units)}"
    if len(plan) <= 4:
        return ", ".join(labels)
    blocks = len(member_names(plan))
    what = f"{blocks} of {len(units)}" + (f" in {len(plan)} checkpoints" if segs else "")
    return f"{what}: {', '.join(labels[:3])}, …"


def _count(plan: tuple[Entry, ...], units: tuple[str, ...]) -> str:
    """`4/6`, or `6/6 (2 segments)` when blocks share checkpoints."""
    segs = sum(1 for e in plan if e.is_segment)
    return f"{len(member_names(plan))}/{len(units)}" + (f" ({segs} segment{'s' if segs > 1 else ''})" if segs else "")


def error(message: str, hint: str | None) -> None:
    err.print(f"[bold red]error:[/bold red] {message}")
    if hint:
        err.print(f"[dim]hint:[/dim] {hint}")
