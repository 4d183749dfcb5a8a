"""Figures of a step's memory and of a search: PNG or SVG files, and inline SVG for the HTML report.

`profile_figure` draws the recorded step (live bytes over time, stacked by part, the peak marked) above
the modules that save the most for backward; `search_figure` draws a search's frontier (peak against
batch size, the budget, the two baselines, the verified plan) above its recompute cost. matplotlib is
the optional extra `plot` (`pip install 'ckpt-tune[plot]'`), imported when a figure is drawn. No pyplot:
a `matplotlib.figure.Figure` is rendered by the Agg (PNG) or SVG canvas the file name asks for, so the
user's backend, open figures and rcParams stay as they were (the few settings used apply inside
`rc_context` only). Drawing only: every number comes from the profile or the search outcome.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import Part

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_tune.measure.profiler import StepProfile
    from ckpt_tune.tune.search import SearchOutcome

FORMATS = ("png", "svg")
INSTALL_HINT = "pip install 'ckpt-tune[plot]'"
# one colour per part, in every figure and in the HTML report
PART_COLORS = {
    Part.PARAMS.value: "#4c78a8",
    Part.GRADS.value: "#f58518",
    Part.OPTIMIZER.value: "#e45756",
    Part.ACTIVATIONS.value: "#54a24b",
    Part.OTHER.value: "#b279a2",
}
# bottom to top: the states that last the whole step first, then what comes and goes
STACK = (Part.PARAMS, Part.OPTIMIZER, Part.GRADS, Part.ACTIVATIONS, Part.OTHER)
UNSPLIT_COLOR = "#bab0ac"  # gradients + activations + other, for a profile that keeps no split
PHASE_FILL = {"make_batch": "#eeeeee", "forward + loss": "#e3eefa", "backward": "#fdecd9", "optimizer step": "#e5f3e1"}
SHORT_PHASE = {"make_batch": "batch", "forward + loss": "forward", "backward": "backward", "optimizer step": "step"}
BUDGET_COLOR = "#cf222e"
RC = {"svg.fonttype": "none", "svg.hashsalt": "ckpt-tune", "font.size": 10, "axes.titlesize": 12, "axes.titleweight": "bold"}


def check_path(path: str | Path) -> Path:
    """The figure file `path`, checked before any work: a .png or .svg name in an existing directory.

    Raises:
        CkptTuneError: another extension, or a directory that does not exist.
    """
    p = Path(path)
    ext = p.suffix.lower().lstrip(".")
    if ext not in FORMATS:
        raise CkptTuneError(f"cannot tell the figure's format from {str(p)!r}", "name the file .png or .svg")
    if not p.parent.is_dir():
        raise CkptTuneError(f"cannot write the figure {str(p)!r}: directory {str(p.parent)!r} does not exist",
                            "create the directory first, or write the figure elsewhere")
    return p


def byte_ticks(top: float, n: int = 5) -> list[float]:
    """Tick values from 0 to `top`: at most n+1 round steps in the largest binary unit below `top`."""
    unit = 1
    while unit * 1024 <= top:
        unit *= 1024
    step = float(unit)
    for mult in (0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500):
        step = unit * mult
        if top / step <= n:
            break
    return [i * step for i in range(int(top // step) + 1)]


# -- the step ------------------------------------------------------------------------------------------


def profile_figure(prof: StepProfile, path: str | Path, top: int = 10, budget: int | None = None) -> Path:
    """Write the step's figure to `path` (.png or .svg): memory over time stacked by part with the
    peak marked (and `budget`, bytes, as a line when given), above the `top` modules that save the most
    for backward. Returns the path.

    Raises:
        CkptTuneError: matplotlib is missing, or `path` is not a .png/.svg file in an existing directory.
    """
    p = check_path(path)
    rows = _module_rows(prof, top)
    bars = max(1.5, 0.26 * len(rows) + 0.7)  # inches for the module panel
    with _figure(figsize=(11.5, 5.2 + (bars if rows else 0))) as fig:
        if rows:
            grid = fig.add_gridspec(2, 1, height_ratios=(4.6, bars))
            _timeline(fig.add_subplot(grid[0]), prof, budget)
            _modules(fig.add_subplot(grid[1]), rows)
        else:
            _timeline(fig.add_subplot(), prof, budget)
        fig.suptitle(f"Memory of one training step: {prof.target}, batch {prof.batch_size} "
                     f"({prof.device}, {prof.precision}, {prof.optimizer})", fontsize=13)
        _save(fig, p)
    return p


def profile_svg(prof: StepProfile, budget: int | None = None) -> str:
    """The step's memory over time stacked by part, as an SVG element to place inside an HTML page: no
    XML prolog, no ids, no references (`url(...)`, `href`), text as text.

    Raises:
        CkptTuneError: matplotlib is missing.
    """
    with _figure(figsize=(11.5, 4.6)) as fig:
        _timeline(fig.add_subplot(), prof, budget, title=False)  # the page's heading names it
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return _inline(buf.getvalue(), "live memory over the step, by part")


def part_series(prof: StepProfile) -> list[tuple[str, str, list[int]]] | None:
    """(label, colour, bytes per timeline point) bottom to top, from the profile's split of its
    timeline into the five parts; None when the profile keeps no such split."""
    split = prof.part_timeline
    if not split or len(split) != len(prof.timeline):
        return None
    order = list(Part)
    return [(part.label, PART_COLORS[part.value], [row[1 + order.index(part)] for row in split]) for part in STACK]


def _timeline(ax: Any, prof: StepProfile, budget: int | None, title: bool = True) -> None:
    pts = list(prof.timeline)
    if not pts:
        ax.text(0.5, 0.5, "no timeline recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    clock = prof.time_unit == "ms"  # under fake tensors the recorder counts events instead of time
    scale = 1.0 if clock else 1e6
    xs = [t * scale for t, _ in pts]
    totals = [v for _, v in pts]
    ph = {k: v * scale for k, v in (prof.phases or {}).items()}
    t_end = max(xs[-1], ph.get("step", 0.0)) or 1.0
    b = prof.breakdown
    at_peak = dict(b.items())
    series = part_series(prof)
    if series is None:  # the static parts are constant over the step; the rest is drawn as one band
        static = prof.param_bytes + prof.optimizer_bytes
        rest = at_peak[Part.GRADS] + at_peak[Part.ACTIVATIONS] + at_peak[Part.OTHER]
        series = [
            (Part.PARAMS.label, PART_COLORS[Part.PARAMS.value], [prof.param_bytes] * len(pts)),
            (Part.OPTIMIZER.label, PART_COLORS[Part.OPTIMIZER.value], [prof.optimizer_bytes] * len(pts)),
            ("gradients, activations, other (not split)", UNSPLIT_COLOR, [max(v - static, 0) for v in totals]),
        ]
        values = [at_peak[Part.PARAMS], at_peak[Part.OPTIMIZER], rest]
    else:
        values = [at_peak[p] for p in STACK]
    if xs[0] > 0:  # before the step's first allocation only weights and optimizer state are live: the
        # runner frees the previous gradients before recording starts (docs/design.md §3)
        at_start = {Part.PARAMS.label: prof.param_bytes, Part.OPTIMIZER.label: prof.optimizer_bytes}
        xs, totals = [0.0, *xs], [prof.param_bytes + prof.optimizer_bytes, *totals]
        series = [(label, color, [at_start.get(label, 0), *s]) for label, color, s in series]
    labels = [f"{label}: {format_bytes(v)}" for (label, _, _), v in zip(series, values, strict=True)]
    ax.stackplot(xs, *[s for _, _, s in series], colors=[c for _, c, _ in series], labels=labels, linewidth=0)
    ax.plot(xs, totals, color="#24292f", linewidth=0.8, label="_total")
    ymax = max(prof.peak_bytes, budget or 0, *totals) * 1.32
    ax.set_xlim(0, t_end)
    ax.set_ylim(0, ymax)
    bands = (("make_batch", "iter", "batch"), ("forward + loss", "batch", "loss"), ("backward", "loss", "backward"), ("optimizer step", "backward", "step"))
    for label, a, z in bands:
        x0, x1 = ph.get(a), t_end if z == "step" else ph.get(z)
        if x0 is None or x1 is None or x1 <= x0:
            continue
        ax.axvspan(x0, x1, color=PHASE_FILL[label], zorder=0, linewidth=0)
        width = (x1 - x0) / t_end
        short = label if width > 0.014 * len(label) else SHORT_PHASE[label] if width > 0.06 else ""
        if short:
            ax.text((x0 + x1) / 2, 1.01, short, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=9, color="#57606a")
    ax.set_axisbelow(True)
    _byte_axis(ax.yaxis, ymax * 0.98)
    ax.grid(axis="y", color="#d8dee4", linewidth=0.6)
    ax.set_ylabel("live memory")
    ax.set_xlabel("time since the step started (ms)" if clock else "progress through the step (allocator events; fake tensors keep no clock)")
    if budget is not None:
        ax.axhline(budget, color=BUDGET_COLOR, linestyle=(0, (6, 3)), linewidth=1.5, label=f"budget: {format_bytes(budget)}")
    # the peak: the timeline's largest point, or the start when the previous step's gradients set it
    start = prof.peak_bytes > max(totals) and prof.peak_phase.startswith("start")
    k = max(range(len(totals)), key=totals.__getitem__)
    px, py = (0.0, prof.peak_bytes) if start else (xs[k], totals[k])
    ax.plot([px], [py], marker="o", markersize=8, markerfacecolor="white", markeredgecolor=BUDGET_COLOR, markeredgewidth=2, zorder=5)
    right = px > t_end / 2
    ax.annotate(f"peak {format_bytes(prof.peak_bytes)}\n{_clip(prof.peak_phase, 48)}", xy=(px, py),
                xytext=(0.03 if right else 0.97, 0.95), textcoords="axes fraction", ha="left" if right else "right", va="top",
                fontsize=10, fontweight="bold", bbox={"boxstyle": "round,pad=0.4", "fc": "white", "ec": "#d0d7de"},
                arrowprops={"arrowstyle": "-", "color": "#6e7781", "linestyle": (0, (3, 2)), "linewidth": 1}, zorder=6)
    handles, names = ax.get_legend_handles_labels()  # the parts top of the stack first, as drawn; the budget last
    order = sorted(range(len(names)), key=lambda i: (names[i].startswith("budget"), -i))
    ax.legend([handles[i] for i in order], [names[i] for i in order], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
              frameon=False, title="live at the peak", title_fontsize=9, alignment="left")
    if title:
        ax.set_title("Live memory over the step, by part", loc="left", pad=16)


def _module_rows(prof: StepProfile, top: int) -> list[tuple[str, int]]:
    from ckpt_tune.measure.profiler import OUTSIDE

    rows = [(m.name or "(root)", m.activation_bytes) for m in prof.modules if m.activation_bytes]
    if prof.unattributed_activation_bytes:  # the loss and code outside every module: often the largest
        rows.append((OUTSIDE, prof.unattributed_activation_bytes))
    return sorted(rows, key=lambda r: -r[1])[:max(top, 0)]


def _modules(ax: Any, rows: list[tuple[str, int]]) -> None:
    names = [_clip(n, 44) for n, _ in rows]
    values = [v for _, v in rows]
    ys = range(len(rows))
    ax.barh(ys, values, color=PART_COLORS[Part.ACTIVATIONS.value], height=0.68)
    ax.set_yticks(list(ys), names, fontsize=9)
    ax.invert_yaxis()
    biggest = max(values)
    for y, v in zip(ys, values, strict=True):
        ax.text(v + biggest * 0.01, y, format_bytes(v), va="center", fontsize=8.5, color="#57606a")
    ax.set_xlim(0, biggest * 1.16)
    _byte_axis(ax.xaxis, biggest * 1.14)
    ax.grid(axis="x", color="#d8dee4", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel("bytes saved for backward by the module's own ops, over the step")
    ax.set_title(f"Largest saved activations by module (top {len(rows)})", loc="left")


# -- the search ----------------------------------------------------------------------------------------


def search_figure(outcome: SearchOutcome, path: str | Path) -> Path:
    """Write a search's figure to `path` (.png or .svg): the frontier's predicted peak against batch
    size with the budget, the two baselines at the answer's batch and the plan with its verified peak;
    below, the recompute each costs. Returns the path.

    Raises:
        CkptTuneError: matplotlib is missing, or `path` is not a .png/.svg file in an existing directory.
    """
    p = check_path(path)
    res, budget = outcome.result, outcome.budget.usable_bytes
    per = " per GPU" if outcome.world_size > 1 else ""
    batch = "micro-batch size" if res.grad_accum_steps > 1 else "batch size"
    rows = sorted(res.frontier, key=lambda r: r.batch_size)
    first = res.predicted_peak if res.first_predicted_peak is None else res.first_predicted_peak
    plan_label = (f"ckpt-tune plan at {res.batch_size}: {format_bytes(res.verified_peak)} verified "
                  f"({format_bytes(first)} predicted), {100 * res.recompute_fraction:.1f}% recompute")
    marks = {"no checkpointing": ("X", "#6e7781"), "every block": ("s", "#8250df")}
    with _figure(figsize=(10.5, 7.6)) as fig:
        peak_ax, cost_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2.3, 1))
        xs = [r.batch_size for r in rows]
        dodge = 0.02 * (max([*xs, res.batch_size]) - min([*xs, res.batch_size]) or 1)
        for ax, key in ((peak_ax, "peak"), (cost_ax, "cost")):
            ys = [r.predicted_peak if key == "peak" else 100 * r.recompute_fraction for r in rows]
            ax.plot(xs, ys, color="#4c78a8", linewidth=1.6, zorder=2, label="_line")
            for fits in (True, False):
                sel = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r.fits == fits]
                if sel:
                    ax.plot(*zip(*sel, strict=True), linestyle="none", marker="o", markersize=7, zorder=3, markeredgecolor="#4c78a8",
                            markerfacecolor="#4c78a8" if fits else "white", markeredgewidth=1.6,
                            label=f"best plan per batch (predicted): {'fits' if fits else 'over the budget'}" if key == "peak" else "_")
            for label, row in res.baselines.items():  # a little left of the plan's star, which would hide them
                marker, color = marks.get(label, ("D", "#6e7781"))
                y = row.predicted_peak if key == "peak" else 100 * row.recompute_fraction
                text = f"{label} at {row.batch_size}: {format_bytes(row.predicted_peak)} (measured)"
                ax.plot([row.batch_size - dodge], [y], linestyle="none", marker=marker, markersize=9, color=color, zorder=4,
                        label=text if key == "peak" else "_")
            y = res.verified_peak if key == "peak" else 100 * res.recompute_fraction
            ax.plot([res.batch_size], [y], linestyle="none", marker="*", markersize=17, color="#2da44e", markeredgecolor="#116329",
                    zorder=5, label=plan_label if key == "peak" else "_")
            ax.grid(color="#d8dee4", linewidth=0.6)
            ax.set_axisbelow(True)
        peak_ax.axhline(budget, color=BUDGET_COLOR, linestyle=(0, (6, 3)), linewidth=1.5, zorder=1, label=f"budget{per}: {format_bytes(budget)}")
        tops = [budget, res.verified_peak, *(r.predicted_peak for r in rows), *(r.predicted_peak for r in res.baselines.values())]
        ymax = max(tops) * 1.12
        peak_ax.set_ylim(0, ymax)
        _byte_axis(peak_ax.yaxis, ymax * 0.98)
        peak_ax.set_ylabel(f"peak memory of the step{per}")
        peak_ax.legend(loc="best", fontsize=9, framealpha=0.95, edgecolor="#d0d7de")
        k = res.grad_accum_steps
        largest = all(not r.fits for r in rows if r.batch_size > res.batch_size)
        peak_ax.set_title(
            f"The plan: micro-batch {res.batch_size} × {k} accumulation steps (effective batch {res.batch_size * k})" if k > 1
            else f"Largest batch that fits: {res.batch_size}" if largest else f"The plan at batch {res.batch_size}", loc="left")
        costs = [100 * r.recompute_fraction for r in (*rows, *res.baselines.values())] + [100 * res.recompute_fraction]
        cost_ax.set_ylim(0, max(max(costs) * 1.25, 1.0))
        cost_ax.yaxis.set_major_formatter(_formatter(lambda v: f"{v:.0f}%"))
        cost_ax.set_ylabel("recompute (% of step)")
        cost_ax.set_xlabel(batch + ("" if k == 1 else f" (× {k} accumulation steps)"))
        cost_ax.set_title("What checkpointing costs: extra step time spent recomputing", loc="left", fontsize=11)
        ticks = sorted({*xs, res.batch_size})
        cost_ax.set_xticks(ticks)
        lo, hi = min(ticks) - dodge, max(ticks)
        pad = max((hi - lo) * 0.05, 0.5)
        cost_ax.set_xlim(lo - pad, hi + pad)
        fig.suptitle(f"Search: {outcome.plan.target} ({outcome.plan.device}, {outcome.plan.precision}, "
                     f"budget {format_bytes(budget)}{per})", fontsize=13)
        _save(fig, p)
    return p


# -- matplotlib ----------------------------------------------------------------------------------------


def require_matplotlib() -> Any:
    """The `matplotlib` module.

    Raises:
        CkptTuneError: matplotlib is not installed (the hint says how to install the extra).
    """
    try:
        import matplotlib
        import matplotlib.figure  # the Figure class, loaded with it
    except ImportError as e:
        raise CkptTuneError("drawing a figure needs matplotlib, which is not installed", INSTALL_HINT) from e
    return matplotlib


@contextlib.contextmanager
def _figure(figsize: tuple[float, float]) -> Iterator[Any]:
    """A Figure outside pyplot, with this module's rc settings applied while it is drawn."""
    matplotlib = require_matplotlib()
    with matplotlib.rc_context(RC):
        from matplotlib.figure import Figure

        yield Figure(figsize=figsize, layout="constrained")


def _save(fig: Any, path: Path) -> None:
    """Render first, then write: a failed render leaves no partial file."""
    fmt = path.suffix.lower().lstrip(".")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=144, metadata={"Date": None} if fmt == "svg" else {"Software": None})
    try:
        path.write_bytes(buf.getvalue())
    except OSError as e:
        raise CkptTuneError(f"cannot write the figure {str(path)!r}: {e.strerror or e}", "write it to another path") from e


def _formatter(fn: Any) -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: fn(v))


def _byte_axis(axis: Any, top: float) -> None:
    axis.set_ticks(byte_ticks(top))
    axis.set_major_formatter(_formatter(lambda v: format_bytes(round(v))))


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2 - 1] + "…" + text[-(n - n // 2):]


def _inline(svg: bytes, label: str) -> str:
    """matplotlib's SVG as an element for an HTML page: markers (`<use>`) copied in place, clipping and
    metadata dropped (the drawing stays within its axes), namespaces dropped, the stylesheet an attribute."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg)

    def local(tag: str) -> str:
        return tag.rsplit("}", 1)[-1]

    shapes = {el.get("id"): el for el in root.iter() if el.get("id") and local(el.tag) != "g"}
    for parent in list(root.iter()):
        kids = list(parent)
        for child in kids:
            parent.remove(child)
        for child in kids:
            name = local(child.tag)
            if name == "use":
                href = next((v for k, v in child.attrib.items() if local(k) == "href"), "")
                shape = copy.deepcopy(shapes[href.lstrip("#")])
                child = ET.Element("g", {"transform": f"translate({child.get('x', '0')} {child.get('y', '0')})", "style": child.get("style", "")})
                child.append(shape)
            if name not in ("metadata", "defs"):  # defs: the markers copied in, clip paths, the stylesheet
                parent.append(child)
    for el in root.iter():
        el.tag = local(el.tag)
        for k in [k for k in el.attrib if k in ("id", "clip-path") or k.startswith("{")]:
            del el.attrib[k]
    root.set("xmlns", "http://www.w3.org/2000/svg")
    root.set("style", "width:100%;height:auto;stroke-linejoin:round;stroke-linecap:butt")
    root.set("role", "img")
    root.set("aria-label", label)
    return ET.tostring(root, encoding="unicode")
