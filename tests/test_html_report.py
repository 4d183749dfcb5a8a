"""The HTML report: self-contained, and rendered by headless Chromium with the timeline visible."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from ckpt_tune.cli.html_report import render_html, write_html
from ckpt_tune.diagnosis import diagnose
from ckpt_tune.diagnosis.oom import diagnose_oom
from tests.fixtures.models import write_target_file

ASSETS = Path(__file__).parent / "assets" / "oom"


@pytest.fixture(scope="module")
def diag(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = write_target_file(tmp_path_factory.mktemp("html"), "mlp_blocks")
        return diagnose(target, "5MiB", batch_size=32)
    finally:
        torch.set_num_threads(n)


def test_report_is_self_contained(diag):
    html = render_html(diag, diagnose_oom((ASSETS / "fragmentation_vllm_engine.txt").read_text()))
    assert html.startswith("<!DOCTYPE html>")
    for outside in ("<script", "src=", "href=", "@import", "url(", "<link"):
        assert outside not in html, outside
    assert html.count("<svg") >= 3  # timeline, live-at-peak bar, module bars (+ one mini bar per remedy)


def test_timeline_has_every_point_the_budget_and_the_peak(diag):
    html = render_html(diag)
    line = re.search(r'<polyline points="([^"]+)"', html)
    assert line is not None
    assert len(line[1].split()) == len(diag.profile.timeline)
    assert "budget 5.0 MiB" in html
    assert f"peak {diag.peak.total / 2**20:.1f} MiB" in html
    for phase in ("forward + loss", "backward"):
        assert phase in html
    # the remedy table lists every remedy, best first
    positions = [html.index(r.title.replace("&", "&amp;")) for r in diag.remedies]
    assert positions == sorted(positions)


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows of pixels."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8
            assert ctype in (2, 6)
            assert interlace == 0
            bpp = 4 if ctype == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def _count(pixels: list[bytes], rgb: str, tol: int = 6) -> int:
    want = bytes.fromhex(rgb.lstrip("#"))
    return sum(1 for p in pixels if all(abs(p[i] - want[i]) <= tol for i in range(3)))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium)")
def test_headless_chromium_renders_the_timeline(diag, tmp_path):
    page = write_html(tmp_path / "report.html", diag)
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile_dir:
        subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile_dir}", f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
            check=True, capture_output=True, timeout=120,
        )
    width, height, pixels = _png_pixels(shot)
    assert (width, height) == (1200, 1600)
    # the area under the live-byte curve (#c9dcef), its line (#2f5d8a) and the budget line (#cf222e)
    assert _count(pixels, "#c9dcef") > 100_000
    assert _count(pixels, "#2f5d8a", tol=30) > 500
    assert _count(pixels, "#cf222e", tol=30) > 300
