"""Hand-written SVG of plan_quality.json: step-time overhead against budget, one panel per model.

No plotting library: the SVG is a few lines and circles. A filled marker respected the budget (harness-
measured peak ≤ budget); a hollow one went over it.

    .venv/bin/python benchmarks/plot.py   # reads results/plan_quality.json, writes results/plan_quality.svg
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {
    "every block": "#7f7f7f",
    "sqrt(n) segments": "#1f77b4",
    "Chen greedy": "#2ca02c",
    "brute force (model)": "#ff7f0e",
    "ckpt-tune": "#d62728",
}
W, H, PAD = 300, 220, 40


def panel(model: dict, x0: int) -> list[str]:
    budgets = model["budgets"]
    fr = [e["fraction"] for e in budgets]
    ys = [v["overhead"] for e in budgets for k, v in e["plans"].items() if k in COLORS and "overhead" in v]
    lo, hi = min([1.0, *ys]), max([1.0, *ys])
    hi = hi + 0.05 * (hi - lo or 1)

    def px(f: float) -> float:
        return x0 + PAD + (f - min(fr) + 0.1) / (max(fr) - min(fr) + 0.2) * (W - 2 * PAD)

    def py(y: float) -> float:
        return H - PAD - (y - lo) / (hi - lo or 1) * (H - 2 * PAD)

    out = [
        f'<text x="{x0 + W / 2}" y="16" text-anchor="middle" font-size="13">{model["model"]} (batch {model["batch"]})</text>',
        f'<line x1="{x0 + PAD}" y1="{H - PAD}" x2="{x0 + W - PAD / 2}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{x0 + PAD}" y1="{PAD / 2}" x2="{x0 + PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{x0 + PAD}" y1="{py(1.0):.1f}" x2="{x0 + W - PAD / 2}" y2="{py(1.0):.1f}" stroke="#ccc" stroke-dasharray="3,3"/>',
    ]
    for v in (lo, (lo + hi) / 2, hi):
        out.append(f'<text x="{x0 + PAD - 4}" y="{py(v) + 4:.1f}" text-anchor="end" font-size="10">{v:.2f}x</text>')
    for f in fr:
        out.append(f'<text x="{px(f):.1f}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">{int(100 * f)}%</text>')
    for k, color in COLORS.items():
        pts = [(px(e["fraction"]), py(e["plans"][k]["overhead"]), e["plans"][k].get("fits")) for e in budgets
               if k in e["plans"] and "overhead" in e["plans"][k]]
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for x, y, fits in pts:
            fill = color if fits else "white"
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{fill}" stroke="{color}" stroke-width="1.5"/>')
    return out


def main() -> None:
    data = json.loads((RESULTS / "plan_quality.json").read_text())
    models = data["models"]
    width = W * len(models)
    body = []
    for i, m in enumerate(models):
        body += panel(m, i * W)
    ly = H + 10
    for j, (k, color) in enumerate(COLORS.items()):
        x = 20 + j * (width - 40) / len(COLORS)
        body.append(f'<circle cx="{x:.1f}" cy="{ly}" r="4" fill="{color}"/>')
        body.append(f'<text x="{x + 8:.1f}" y="{ly + 4}" font-size="11">{k}</text>')
    body.append(f'<text x="{width / 2}" y="{ly + 24}" text-anchor="middle" font-size="11">x: budget, % of the way from the '
                'every-block peak to the no-checkpointing peak; y: step time / without checkpointing; hollow: over budget</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{H + 46}" font-family="sans-serif">\n'
           '<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(body) + "\n</svg>\n")
    (RESULTS / "plan_quality.svg").write_text(svg)
    print(f"wrote {RESULTS / 'plan_quality.svg'}")


if __name__ == "__main__":
    main()
