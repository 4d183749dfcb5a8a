"""`ckpt-tune diagnose`: the command and its rendering. cli.py adds it with `diagnose_cli.register(app)`.

Thin like every command: parse → `diagnose.diagnose` / `oom.diagnose_oom` → render (stderr) → report and
JSON (stdout) → exit code through the error family (NoFitError 3), which cli.main turns into one line.
"""

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.panel import Panel
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
    Margin,
    Optim,
    Peft,
    Precision,
    SeqLen,
    TargetArg,
)
from ckpt_tune.units import format_bytes, format_percent
from ckpt_tune.vocab import Part

_PARTS = tuple((p.value, p.label) for p in Part)


def diagnose(
    target: TargetArg = None,
    vram: Annotated[
        str | None,
        typer.Option(help="budget: 24GB (read as GiB), 24GiB, 24000MiB, bytes, or auto; with --oom-message, defaults to its GPU's capacity"),
    ] = None,
    batch_size: BatchSize = 8,
    device: Device = None,
    precision: Precision = "fp32",
    optimizer: Optim = "adamw",
    margin: Margin = None,
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
        typer.Option("--world-size", min=1, help="per GPU of a sharded run over N GPUs (cpu/meta: rank 0 recorded under the engine)"),
    ] = None,
    shard: Annotated[str | None, typer.Option(help="zero1 | zero2 | zero3 | fsdp (with --world-size)")] = None,
    lora_rank: Annotated[int, typer.Option("--lora-rank", min=1, help="rank of the LoRA remedy's adapters")] = 8,
    oom_message: Annotated[
        str | None, typer.Option("--oom-message", help="a file holding PyTorch's out-of-memory message, or - for stdin")
    ] = None,
    report_path: Annotated[Path | None, typer.Option("--report", help="write a self-contained HTML report here")] = None,
    as_json: Json = False,
) -> None:
    """Why the step runs out of memory, where its peak is, and the remedies ranked by what fits and what it costs."""
    from ckpt_tune.cli import render as report
    from ckpt_tune.diagnosis.oom import diagnose_oom

    oom = None
    if oom_message is not None:
        text = sys.stdin.read() if oom_message == "-" else _read(oom_message)
        oom = diagnose_oom(text)
        render_oom(oom)
    if target is None and hf_config is None:
        if oom is None:
            raise typer.BadParameter("give TARGET (or --hf-config) with --vram, or --oom-message FILE", param_hint="TARGET")
        _finish(None, oom, report_path, as_json, options.print_json)
        return
    if vram is None:
        if oom is None:
            raise typer.BadParameter("--vram is required (e.g. --vram 24GB)", param_hint="--vram")
        vram = str(oom.message.total)
        report.err.print(f"budget: the GPU's capacity from the OOM message, {format_bytes(oom.message.total)}")
    from ckpt_tune.diagnosis import diagnose as run
    from ckpt_tune.diagnosis import no_fit_error

    settings = options.settings(device, precision, optimizer, batch_fn, loss_fn, hf_config, seq_len, attn,
                                peft=options.peft_spec(peft, lora_r, lora_alpha, lora_dropout, lora_targets))
    with report.progress("diagnosing") as update:
        d = run(target, vram, batch_size=batch_size, margin=margin, settings=settings, world_size=world_size,
                shard=shard, lora_rank=lora_rank, progress=update)
    render_diagnosis(d)
    _finish(d, oom, report_path, as_json, options.print_json)
    err = no_fit_error(d)
    if err is not None:
        raise err


def _read(path: str) -> str:
    from ckpt_tune.errors import CkptTuneError

    try:
        return Path(path).read_text(errors="replace")
    except OSError as e:
        raise CkptTuneError(f"cannot read --oom-message {path}: {e.strerror}", "pass a file, or - to read stdin") from e


def _finish(d, oom, report_path, as_json, print_json) -> None:
    from ckpt_tune.cli import render as report

    if report_path is not None:
        from ckpt_tune.cli.html_report import write_html

        write_html(report_path, d, oom)
        report.err.print(f"report written to {escape(str(report_path))}")
    if as_json:
        out = d.to_dict() if d is not None else {}
        if oom is not None:
            out["oom"] = oom.to_dict()
        print_json(out)


def _pct(part: int, whole: int) -> str:
    return format_percent(part / whole) if whole else "-"


def render_oom(o) -> None:
    from ckpt_tune.cli import render as report

    m = o.message
    color = "yellow" if o.cause == "fragmentation" else "red"
    lines = [f"[bold {color}]{escape(o.cause)}[/bold {color}]: {escape(o.summary)}", ""]
    lines += [f"  {escape(x)}" for x in o.details]
    lines += ["", "[bold]what to do[/bold]"] + [f"  • {escape(r)}" for r in o.recommendations]
    report.err.print(Panel("\n".join(lines), title=f"{m.kind} out-of-memory message ({m.form} format)", title_align="left"))


def render_diagnosis(d) -> None:
    """Verdict, states against the budget, the moments, what is live at the peak, the ranked remedies."""
    from ckpt_tune.cli import render as report
    from ckpt_tune.diagnosis import states_exceed_text, summarize

    err = report.err
    b = d.budget
    per = ""
    if d.world_size > 1:
        how = (f"rank 0 recorded under {d.shard} (a fake process group, measure/sharded.py)" if d.sharding == "measured"
               else "one device's step divided by arithmetic (tune/sharding.py)")
        per = f"; per GPU of {d.world_size} ({d.shard}): {how}"
    err.print(
        escape(f"{d.target}: batch {d.batch_size}, {d.device}, {d.precision}, optimizer {d.optimizer}{per}")
        + f"\nbudget: {escape(b.source)}; usable {format_bytes(b.usable_bytes)}"
    )
    if d.states_exceed:
        err.print(f"[bold red]{escape(states_exceed_text(d))}[/bold red]")
    elif d.floor is not None and not d.floor.fits:
        err.print(
            f"[bold red]even {escape(d.floor.title)} the step peaks at {format_bytes(d.floor.peak_bytes)}[/bold red] "
            f"({escape(d.floor.peak_where)}) against a {format_bytes(b.usable_bytes)} budget; weights + gradients + "
            f"optimizer state are {format_bytes(d.states_bytes)} of it"
        )
    color = "green" if d.fits else "red"
    err.print(f"[bold {color}]{escape(summarize(d))}[/bold {color}]")
    err.print(moments_table(d))
    err.print(peak_panel(d))
    if d.remedies:
        err.print(remedies_table(d))
    for note in d.notes:
        err.print(f"[dim]note:[/dim] {escape(note)}")


def moments_table(d) -> Table:
    t = Table(title="Largest moment of each phase" + (" (per GPU)" if d.world_size > 1 else ""), title_justify="left")
    t.add_column("phase")
    t.add_column("where")
    for _, label in _PARTS:
        t.add_column(label, justify="right")
    t.add_column("total", justify="right")
    peak = d.peak
    for m in d.moments:
        cells = [format_bytes(getattr(m, k)) for k, _ in _PARTS]
        total = format_bytes(m.total)
        if m is peak:
            total = f"[bold]{total}[/bold]"
        t.add_row(m.phase, escape(m.where), *cells, total)
    return t


def peak_panel(d, top: int = 8) -> Panel:
    p = d.peak
    g = Table.grid(padding=(0, 2))
    g.add_column()
    g.add_column(justify="right")
    g.add_column(justify="right")
    for k, label in _PARTS:
        g.add_row(label, format_bytes(getattr(p, k)), _pct(getattr(p, k), p.total))
    g.add_row("[bold]peak[/bold]", f"[bold]{format_bytes(p.total)}[/bold]", f"{_pct(p.total, d.budget.usable_bytes)} of budget")
    mods = Table(title="saved activations live then, by module", title_justify="left", box=None)
    mods.add_column("module")
    mods.add_column("live", justify="right")
    mods.add_column("of the peak", justify="right")
    from ckpt_tune.measure.profiler import OUTSIDE

    for name, n in p.modules[:top]:
        mods.add_row(escape(name or OUTSIDE), format_bytes(n), _pct(n, p.total))
    if len(p.modules) > top:
        rest = sum(n for _, n in p.modules[top:])
        mods.add_row(f"… {len(p.modules) - top} more", format_bytes(rest), _pct(rest, p.total))
    from rich.console import Group

    return Panel(Group(g, "", mods), title=f"Live at the peak: {escape(p.where)}", title_align="left")


def remedies_table(d) -> Table:
    t = Table(title="Remedies, best first (fits, then: keeps what is trained, fewer GPUs, lower risk, less time)", title_justify="left")
    t.add_column("#", justify="right")
    t.add_column("remedy")
    t.add_column("peak after", justify="right")
    t.add_column("fits", justify="center")
    t.add_column("basis")
    t.add_column("cost")
    t.add_column("GPUs", justify="right")
    for i, r in enumerate(d.remedies, 1):
        t.add_row(
            str(i), escape(r.title), format_bytes(r.peak_bytes), "[green]yes[/green]" if r.fits else "[red]no[/red]",
            escape(r.basis), escape(r.cost), str(r.gpus),
        )
    return t
