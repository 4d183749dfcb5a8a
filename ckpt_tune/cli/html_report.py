"""`diagnose --report report.html`: one self-contained HTML file (inline CSS and SVG, no script, no network).

The memory timeline of the step (live bytes over time, the phases marked, the peak annotated with what
is live), the same step stacked by part (plot.py's figure, inline SVG; left out, with a note, when
matplotlib is not installed), what is live at the peak by category and by module, the largest moment of
each phase, the ranked remedies, and the reading of an OOM message when one was given. Pure: data in, a
string out.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from ckpt_tune.cli.plot import PART_COLORS, PHASE_FILL, byte_ticks, profile_svg
from ckpt_tune.diagnosis import Diagnosis
from ckpt_tune.diagnosis.oom import OomDiagnosis
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure.profiler import OUTSIDE
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import Part

COLORS = PART_COLORS
# the parts' labels, "other" shortened to fit the peak callout's two columns
LABELS = {p.value: p.label for p in Part} | {Part.OTHER.value: "batch, logits, temporaries"}
HALO = ' stroke="#ffffff" stroke-width="3" paint-order="stroke"'  # text stays readable over the curve

CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif;color:#1f2328;background:#f6f8fa;margin:0}
main{max-width:1120px;margin:0 auto;padding:24px 28px 40px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:16px;margin:26px 0 10px;color:#24292f}
.sub{color:#57606a;font-size:13px;margin-bottom:14px}
.chip{display:inline-block;background:#fff;border:1px solid #d0d7de;border-radius:12px;padding:2px 10px;margin:0 6px 6px 0;font-size:12px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:14px 16px;margin-bottom:14px}
.verdict{font-size:15px;font-weight:600;border-radius:8px;padding:12px 16px;margin:8px 0 14px}
.bad{background:#ffebe9;border:1px solid #ff8182;color:#82071e} .good{background:#dafbe1;border:1px solid #4ac26b;color:#116329}
.warn{background:#fff8c5;border:1px solid #d4a72c;color:#4d2d00}
table{border-collapse:collapse;width:100%;font-size:13px} th{text-align:left;color:#57606a;font-weight:600;border-bottom:1px solid #d0d7de;padding:6px 8px}
td{padding:6px 8px;border-bottom:1px solid #eaeef2;vertical-align:top} td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.yes{color:#116329;font-weight:600} .no{color:#a40e26;font-weight:600} .muted{color:#57606a;font-size:12px}
.legend span{display:inline-block;margin-right:14px;font-size:12px} .legend i{display:inline-block;width:10px;height:10px;margin-right:5px;border-radius:2px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:14px}
"""


def _fmt(n: int) -> str:
    return escape(format_bytes(int(n)))


def _per_gpu_curve(d: Diagnosis) -> bool:
    """The recorded timeline is one GPU's: one device, or rank 0 recorded under the sharding engine."""
    return d.world_size == 1 or d.sharding == "measured"


def timeline_svg(d: Diagnosis, width: int = 1060, height: int = 380) -> str:
    """Live bytes over the step; phase bands; the budget and weights + optimizer lines; the peak, annotated."""
    prof = d.profile
    pts = list(prof.timeline)
    if not pts:
        return '<p class="muted">no timeline recorded</p>'
    ph = prof.phases or {}
    t_end = max(pts[-1][0], ph.get("step", 0.0)) or 1.0
    peak = d.peak if _per_gpu_curve(d) else None
    peak_ms = peak.ms if peak else max(pts, key=lambda p: p[1])[0]
    peak_bytes = peak.total if peak else prof.peak_bytes
    budget = d.budget.usable_bytes
    ymax = max(peak_bytes, budget, max(v for _, v in pts)) * 1.4
    left, right, top, bottom = 78, 16, 30, 40
    pw, phh = width - left - right, height - top - bottom

    def x(ms: float) -> float:
        return left + pw * ms / t_end

    def y(b: float) -> float:
        return top + phh * (1 - b / ymax)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="memory timeline">']
    bands = [("make_batch", ph.get("iter", 0.0), ph.get("batch")), ("forward + loss", ph.get("batch"), ph.get("loss")),
             ("backward", ph.get("loss"), ph.get("backward")), ("optimizer step", ph.get("backward"), ph.get("step", t_end))]
    for label, a, b in bands:
        if a is None or b is None or b <= a:
            continue
        out.append(f'<rect x="{x(a):.1f}" y="{top}" width="{max(x(b) - x(a), 0.5):.1f}" height="{phh}" fill="{PHASE_FILL[label]}"/>')
        short = label if x(b) - x(a) > 8 * len(label) else label.split()[-1] if x(b) - x(a) > 34 else ""
        if short:
            out.append(f'<text x="{(x(a) + x(b)) / 2:.1f}" y="{top - 8}" text-anchor="middle" font-size="12" fill="#57606a">{short}</text>')
    for v in byte_ticks(ymax * 0.98):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#d8dee4" stroke-width="0.6"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end" font-size="11" fill="#57606a">{_fmt(int(v))}</text>')
    for k in range(6):
        ms = t_end * k / 5
        anchor = "start" if k == 0 else "end" if k == 5 else "middle"
        out.append(f'<text x="{x(ms):.1f}" y="{top + phh + 16}" text-anchor="{anchor}" font-size="11" fill="#57606a">{ms:.1f} ms</text>')
    poly = [f"{x(pts[0][0]):.1f},{y(0):.1f}"] + [f"{x(t):.1f},{y(v):.1f}" for t, v in pts] + [f"{x(pts[-1][0]):.1f},{y(0):.1f}"]
    out.append(f'<polygon points="{" ".join(poly)}" fill="#c9dcef" fill-opacity="0.9" stroke="none"/>')
    out.append(f'<polyline points="{" ".join(poly[1:-1])}" fill="none" stroke="#2f5d8a" stroke-width="1.6"/>')
    static = prof.param_bytes + prof.optimizer_bytes
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(static):.1f}" y2="{y(static):.1f}" stroke="#4c78a8" stroke-dasharray="2 3" stroke-width="1"/>')
    out.append(f'<text x="{left + 6}" y="{y(static) - 5:.1f}" font-size="11" fill="#2f5d8a"{HALO}>weights + optimizer state {_fmt(static)}</text>')
    color = "#cf222e"
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(budget):.1f}" y2="{y(budget):.1f}" stroke="{color}" stroke-dasharray="7 4" stroke-width="1.6"/>')
    label = "budget" + (" per GPU" if d.world_size > 1 else "")
    out.append(f'<text x="{left + pw - 6}" y="{y(budget) - 6:.1f}" text-anchor="end" font-size="12" font-weight="600" fill="{color}"{HALO}>{label} {_fmt(budget)}</text>')
    px, py = x(peak_ms), y(peak_bytes)
    out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="5.5" fill="#fff" stroke="#cf222e" stroke-width="2.2"/>')
    out.append(_callout(d, px, py, left, left + pw, top, peak_bytes))
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + phh}" stroke="#8c959f"/>')
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + phh}" y2="{top + phh}" stroke="#8c959f"/>')
    out.append("</svg>")
    return "".join(out)


def _callout(d: Diagnosis, px: float, py: float, x0: float, x1: float, y0: float, peak_bytes: int) -> str:
    """A box beside the peak with what is live then."""
    if _per_gpu_curve(d):
        p = d.peak
        parts = {k: getattr(p, k) for k in COLORS}
        where = p.where
    else:
        b = d.profile.breakdown
        parts = {k: getattr(b, k) for k in COLORS}
        where = d.profile.peak_phase
    w, h = 430, 84
    # in the upper corner away from the peak: the headroom above the curve (ymax is 1.4 × the peak)
    bx = x0 + 12 if px > (x0 + x1) / 2 else x1 - 12 - w
    by = y0 + 6
    lx = bx + w if bx < px else bx
    out = [f'<line x1="{px:.1f}" y1="{py:.1f}" x2="{lx:.1f}" y2="{by + h / 2:.1f}" stroke="#8c959f" stroke-width="1" stroke-dasharray="3 2"/>',
           f'<rect x="{bx:.1f}" y="{by:.1f}" width="{w}" height="{h}" rx="6" fill="#ffffff" fill-opacity="0.97" stroke="#d0d7de"/>',
           f'<text x="{bx + 12:.1f}" y="{by + 19:.1f}" font-size="13" font-weight="700" fill="#1f2328">peak {_fmt(peak_bytes)}'
           f'<tspan font-weight="400" fill="#57606a"> · {escape(where[:44])}</tspan></text>']
    for i, (k, v) in enumerate(parts.items()):
        cx, cy = bx + 12 + (i % 2) * 205, by + 40 + (i // 2) * 17
        out.append(f'<rect x="{cx:.1f}" y="{cy - 9:.1f}" width="9" height="9" rx="2" fill="{COLORS[k]}"/>')
        out.append(f'<text x="{cx + 14:.1f}" y="{cy:.1f}" font-size="12" fill="#24292f">{escape(LABELS[k])}: {_fmt(v)}</text>')
    return "".join(out)


def stacked_bar_svg(parts: dict[str, int], width: int = 500, height: int = 26) -> str:
    total = sum(parts.values()) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">']
    xpos = 0.0
    for k, v in parts.items():
        w = width * v / total
        out.append(f'<rect x="{xpos:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{COLORS[k]}"><title>{escape(LABELS[k])}: {_fmt(v)}</title></rect>')
        xpos += w
    out.append("</svg>")
    return "".join(out)


def module_bars_svg(d: Diagnosis, top: int = 12, width: int = 1060) -> str:
    """Saved activations by module (own bytes), with the part still live at the peak in a darker shade."""
    prof = d.profile
    live = dict(d.peak.modules) if _per_gpu_curve(d) else {}
    rows = [(m.name or "(root)", m.activation_bytes, live.get(m.name, 0)) for m in prof.modules if m.activation_bytes]
    if prof.unattributed_activation_bytes:  # the loss and code outside every module: often the largest
        rows.append((OUTSIDE, prof.unattributed_activation_bytes, live.get("", 0)))
    rows = sorted(rows, key=lambda r: -r[1])[:top]
    if not rows:
        return '<p class="muted">nothing saved for backward</p>'
    biggest = rows[0][1]
    label_w, bar_w, rh = 260, width - 260 - 120, 22
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{rh * len(rows) + 8}">']
    for i, (name, total, now) in enumerate(rows):
        yy = 4 + i * rh
        w_total, w_now = bar_w * total / biggest, bar_w * min(now, total) / biggest
        out.append(f'<text x="{label_w - 8}" y="{yy + 14}" text-anchor="end" font-size="12" fill="#24292f">{escape(name[:38])}</text>')
        out.append(f'<rect x="{label_w}" y="{yy + 3}" width="{max(w_total, 1):.1f}" height="{rh - 8}" rx="2" fill="#a9d3a0"/>')
        if w_now:
            out.append(f'<rect x="{label_w}" y="{yy + 3}" width="{w_now:.1f}" height="{rh - 8}" rx="2" fill="#54a24b"/>')
        out.append(f'<text x="{label_w + w_total + 8:.1f}" y="{yy + 14}" font-size="11" fill="#57606a">{_fmt(total)}</text>')
    out.append("</svg>")
    return "".join(out)


def parts_figure(d: Diagnosis) -> str:
    """The step's live bytes stacked by part (plot.profile_svg) in its own card; without matplotlib, a
    note saying how to get it."""
    try:
        svg = profile_svg(d.profile, d.budget.usable_bytes if _per_gpu_curve(d) else None)
    except CkptTuneError as e:
        return f"<div class='muted'>The step by part is drawn with matplotlib: {escape(e.hint or '')}</div>"
    return f"<h2>Memory by part over the step</h2><div class='card'>{svg}</div>"


def _mini_bar(peak: int, budget: int, width: int = 120) -> str:
    scale = max(peak, budget) * 1.05 or 1
    bx, ok = width * peak / scale, peak <= budget
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="12"><rect x="0" y="2" width="{bx:.1f}" height="8" rx="2" '
            f'fill="{"#4ac26b" if ok else "#ff8182"}"/><line x1="{width * budget / scale:.1f}" x2="{width * budget / scale:.1f}" '
            f'y1="0" y2="12" stroke="#cf222e" stroke-width="1.5"/></svg>')


def _remedy_rows(d: Diagnosis) -> str:
    rows = []
    for i, r in enumerate(d.remedies, 1):
        fits = '<span class="yes">fits</span>' if r.fits else '<span class="no">no</span>'
        gpus = f"{r.gpus}" if r.gpus > 1 else "1"
        rows.append(
            f"<tr><td class='n'>{i}</td><td>{escape(r.title)}<div class='muted'>{escape(r.assumes)}</div></td>"
            f"<td class='n'>{_fmt(r.peak_bytes)}<br>{_mini_bar(r.peak_bytes, d.budget.usable_bytes)}</td><td>{fits}</td>"
            f"<td>{escape(r.basis)}</td><td>{escape(r.cost)}</td><td class='n'>{gpus}</td></tr>"
        )
    return "".join(rows)


def _moment_rows(d: Diagnosis) -> str:
    rows = []
    peak = d.peak
    for m in d.moments:
        style = " style='font-weight:600'" if m is peak else ""
        cells = "".join(f"<td class='n'>{_fmt(getattr(m, k))}</td>" for k in COLORS)
        rows.append(f"<tr{style}><td>{escape(m.phase)}</td><td>{escape(m.where)}</td>{cells}<td class='n'>{_fmt(m.total)}</td></tr>")
    return "".join(rows)


def oom_html(o: OomDiagnosis) -> str:
    m = o.message
    cls = "warn" if o.cause == "fragmentation" else "bad"
    recs = "".join(f"<li>{escape(r)}</li>" for r in o.recommendations)
    det = "".join(f"<li>{escape(x)}</li>" for x in o.details)
    return (
        f"<h2>Out-of-memory message</h2><div class='verdict {cls}'>{escape(o.cause)}: {escape(o.summary)}</div>"
        f"<div class='card'><ul>{det}</ul><b>What to do</b><ul>{recs}</ul>"
        f"<div class='muted'>{escape(m.text[:600])}</div></div>"
    )


def render_html(d: Diagnosis | None, oom: OomDiagnosis | None = None) -> str:
    """The whole report as one HTML string."""
    body = []
    if d is not None:
        b = d.budget
        chips = [f"batch {d.batch_size}", d.device, d.precision, f"optimizer {d.optimizer}", f"budget {format_bytes(b.usable_bytes)}"]
        if d.world_size > 1:
            chips.append(f"{d.shard} over {d.world_size} GPUs (per-GPU numbers)")
        body.append(f"<h1>ckpt-tune diagnose</h1><div class='sub'>{escape(d.target)}</div>")
        body.append("".join(f"<span class='chip'>{escape(c)}</span>" for c in chips))
        from ckpt_tune.diagnosis import states_exceed_text, summarize

        body.append(f"<div class='verdict {'good' if d.fits else 'bad'}'>{escape(summarize(d))}</div>")
        if d.states_exceed:
            body.append(f"<div class='verdict warn'>{escape(states_exceed_text(d))}</div>")
        elif d.floor is not None and not d.floor.fits:
            body.append(f"<div class='verdict warn'>even {escape(d.floor.title)} the peak is {_fmt(d.floor.peak_bytes)}</div>")
        body.append("<h2>Memory timeline of one step</h2><div class='card'>")
        body.append(timeline_svg(d))
        if d.world_size > 1 and not _per_gpu_curve(d):
            body.append("<div class='muted'>The curve is the step on one device without sharding; the budget and the tables are per GPU.</div>")
        elif d.world_size > 1:
            body.append(f"<div class='muted'>The curve is rank 0's step of {d.world_size}, recorded under {escape(d.shard)} "
                        "(a fake process group); the budget and the tables are per GPU.</div>")
        body.append(f"<div class='muted'>{escape(b.source)}; measured by {escape(d.profile.measured_by)}</div></div>")
        body.append(parts_figure(d))
        p = d.peak
        parts = {k: getattr(p, k) for k in COLORS}
        legend = "".join(f"<span><i style='background:{COLORS[k]}'></i>{escape(LABELS[k])} {_fmt(v)}</span>" for k, v in parts.items())
        body.append(f"<h2>What is live at the peak ({escape(p.where)})</h2><div class='card'>{stacked_bar_svg(parts, 1060)}<div class='legend'>{legend}</div>")
        body.append("<table><tr><th>phase</th><th>largest moment</th>" + "".join(f"<th>{escape(LABELS[k])}</th>" for k in COLORS)
                    + f"<th>total</th></tr>{_moment_rows(d)}</table></div>")
        body.append("<h2>Saved activations by module</h2><div class='card'>")
        body.append(module_bars_svg(d))
        body.append("<div class='muted'>light: saved during the step; dark: still live at the peak</div></div>")
        if d.remedies:
            body.append("<h2>Remedies, best first</h2><div class='card'><table><tr><th>#</th><th>remedy</th><th>peak after</th>"
                        f"<th>fits</th><th>basis</th><th>cost</th><th>GPUs</th></tr>{_remedy_rows(d)}</table></div>")
        if d.notes:
            body.append("<div class='muted'>" + "<br>".join(escape(n) for n in d.notes) + "</div>")
    if oom is not None:
        if d is None:
            body.append("<h1>ckpt-tune diagnose</h1>")
        body.append(oom_html(oom))
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>ckpt-tune diagnose</title>"
        f"<style>{CSS}</style></head><body><main>{''.join(body)}</main></body></html>"
    )


def write_html(path: str | Path, d: Diagnosis | None, oom: OomDiagnosis | None = None) -> Path:
    p = Path(path)
    p.write_text(render_html(d, oom), encoding="utf-8")
    return p
