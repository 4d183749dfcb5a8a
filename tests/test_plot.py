"""The figures: `profile --plot`, the search figure, the report's inline figure, and the error without matplotlib."""

from __future__ import annotations

import json
import struct
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict
from html import escape
from pathlib import Path

import pytest

import ckpt_tune
from ckpt_tune.cli import plot
from ckpt_tune.cli.html_report import render_html
from ckpt_tune.diagnosis import diagnose
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure.profiler import StepProfile
from ckpt_tune.measure.session import Settings
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import Part
from tests.fixtures.models import write_target_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def svg_texts(svg: str) -> list[str]:
    """Every text the SVG shows (text as text: svg.fonttype 'none')."""
    root = ET.fromstring(svg)
    return ["".join(el.itertext()) for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "text"]


def stack_legend(breakdown: dict[str, int]) -> list[str]:
    """The legend of the stacked timeline: each part with its bytes at the peak; all five parts where the
    profile keeps its timeline split by part, else the two static parts and the rest as one band."""
    if "part_timeline" in StepProfile.__dataclass_fields__:
        return [f"{p.label}: {format_bytes(breakdown[p.value])}" for p in Part]
    rest = breakdown["grads"] + breakdown["activations"] + breakdown["other"]
    return [f"{Part.PARAMS.label}: {format_bytes(breakdown['params'])}", f"{Part.OPTIMIZER.label}: {format_bytes(breakdown['optimizer'])}",
            f"gradients, activations, other (not split): {format_bytes(rest)}"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return write_target_file(tmp_path_factory.mktemp("plot"), "mlp_blocks")


def test_profile_plot_writes_png_and_svg_through_the_cli(run, target, tmp_path):
    png, svg = tmp_path / "step.png", tmp_path / "step.svg"
    code, out, err = run("profile", target, "--device", "cpu", "-b", "4", "--plot", str(png), "--json")
    assert code == 0, err
    assert f"figure written to {png}" in err
    width, height = png_size(png)
    assert width >= 1200
    assert height >= 900
    assert png.stat().st_size > 40_000  # two drawn panels, not an empty canvas
    prof = json.loads(out)

    code, _, err = run("profile", target, "--device", "cpu", "-b", "4", "--plot", str(svg))
    assert code == 0, err
    texts = svg_texts(svg.read_text())
    joined = "\n".join(texts)
    for label in ("live memory", "time since the step started (ms)", "Live memory over the step, by part",
                  "bytes saved for backward by the module's own ops, over the step", "live at the peak"):
        assert label in texts, label
    # the peak, where it is, what is live then, and the module that saves the most, as measured
    assert f"peak {format_bytes(prof['peak_bytes'])}" in joined
    assert prof["peak_phase"] in joined
    for entry in stack_legend(prof["breakdown"]):
        assert entry in texts, entry
    largest = max(prof["modules"], key=lambda m: m["activation_bytes"])
    assert largest["name"] in texts
    assert format_bytes(largest["activation_bytes"]) in texts
    assert "batch 4" in joined


def test_a_bad_plot_path_is_refused_before_the_step_runs(run, target, tmp_path):
    code, _, err = run("profile", target, "--device", "cpu", "--plot", str(tmp_path / "step.pdf"))
    assert code == 1
    assert "Traceback" not in err
    assert ".png or .svg" in err
    code, _, err = run("profile", target, "--device", "cpu", "--plot", str(tmp_path / "nowhere" / "step.png"))
    assert code == 1
    assert "does not exist" in err
    assert list(tmp_path.iterdir()) == []


def test_search_plot_through_the_cli(run, target, tmp_path):
    png = tmp_path / "frontier.png"
    code, _, err = run("search", target, "--device", "cpu", "--vram", "4MiB", "--candidates", "blocks", "--no-segments",
                       "--plot", str(tmp_path / "frontier.pdf"))
    assert code == 1
    assert ".png or .svg" in err
    assert "searching" not in err
    code, out, err = run("search", target, "--device", "cpu", "--vram", "4MiB", "--candidates", "blocks", "--no-segments",
                         "--plot", str(png), "--json")
    assert code == 0, err
    assert f"figure written to {png}" in err
    assert png_size(png)[0] >= 1200
    assert png.stat().st_size > 40_000
    assert json.loads(out)["plan"]["checkpoint"]


def test_search_figure_of_a_real_search(target, tmp_path):
    out = ckpt_tune.search(target, vram="4MiB", settings=Settings(device="cpu"), segments=False, candidates=frozenset({"blocks"}))
    res = out.result
    assert res.checkpoint  # the budget needs checkpointing: a plan, and baselines that differ from it
    png = plot.search_figure(out, tmp_path / "search.png")
    assert png == tmp_path / "search.png"
    assert png_size(png)[0] >= 1200
    assert png.stat().st_size > 40_000
    texts = svg_texts(plot.search_figure(out, tmp_path / "search.svg").read_text())
    first = res.predicted_peak if res.first_predicted_peak is None else res.first_predicted_peak
    assert (f"ckpt-tune plan at {res.batch_size}: {format_bytes(res.verified_peak)} verified "
            f"({format_bytes(first)} predicted), {100 * res.recompute_fraction:.1f}% recompute") in texts
    for label, row in res.baselines.items():
        assert f"{label} at {row.batch_size}: {format_bytes(row.predicted_peak)} (measured)" in texts
    assert f"budget: {format_bytes(out.budget.usable_bytes)}" in texts
    for row in res.frontier:  # every frontier batch is a tick of the shared batch axis
        assert str(row.batch_size) in texts
    for label in ("batch size", "peak memory of the step", "recompute (% of step)"):
        assert label in texts


@pytest.fixture(scope="module")
def diag(target):
    return diagnose(target, "8MiB", batch_size=8)


def test_the_report_embeds_the_figure_inline(diag):
    d = diag
    html = render_html(d)
    assert "<h2>Memory by part over the step</h2>" in html
    for outside in ("<script", "src=", "href=", "@import", "url(", "<link"):
        assert outside not in html, outside
    start = html.index("<svg", html.index("Memory by part over the step"))
    svg = html[start: html.index("</svg>", start) + len("</svg>")]
    texts = svg_texts(svg)  # well-formed XML, no ids left to collide with the page's
    assert ' id="' not in svg
    assert f"peak {format_bytes(d.profile.peak_bytes)}" in "\n".join(texts)
    assert f"budget: {format_bytes(d.budget.usable_bytes)}" in texts
    for entry in stack_legend(asdict(d.profile.breakdown)):
        assert entry in texts, entry


def test_without_matplotlib_one_clear_error(run, target, diag, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    code, _, err = run("profile", target, "--device", "cpu", "--plot", str(tmp_path / "step.png"))
    assert code == 1
    assert "Traceback" not in err
    assert "matplotlib" in err
    assert "pip install 'ckpt-tune[plot]'" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CkptTuneError) as e:
        plot.require_matplotlib()
    assert e.value.hint == "pip install 'ckpt-tune[plot]'"
    html = render_html(diag)  # the report is still written, with its own timeline and a note instead of the figure
    assert "Memory timeline of one step" in html
    assert "Memory by part over the step" not in html
    assert escape("pip install 'ckpt-tune[plot]'") in html


def test_drawing_leaves_the_users_matplotlib_alone(target, tmp_path):
    import matplotlib

    backend, rc = matplotlib.get_backend(), dict(matplotlib.rcParams)
    had_pyplot = "matplotlib.pyplot" in sys.modules
    prof = ckpt_tune.profile(target, batch_size=2, settings=Settings(device="cpu"), scaling=False)
    plot.profile_figure(prof, tmp_path / "a.svg")
    assert matplotlib.get_backend() == backend
    assert dict(matplotlib.rcParams) == rc
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot


def test_byte_ticks_are_round_binary_steps():
    mib = 1 << 20
    assert plot.byte_ticks(200 * mib) == [0, 50 * mib, 100 * mib, 150 * mib, 200 * mib]
    assert plot.byte_ticks(3.5 * (1 << 30)) == [0, 1 << 30, 2 << 30, 3 << 30]
    assert [format_bytes(int(v)) for v in plot.byte_ticks(100 * 1024)] == ["0 B", "20.0 KiB", "40.0 KiB", "60.0 KiB", "80.0 KiB", "100.0 KiB"]
