"""Every figure the READMEs quote comes from a committed result file.

Convention. A figure block opens with an HTML comment naming its sources, result files in the repository:

    <!-- figures: benchmarks/results/accuracy.md, benchmarks/results/zoo.md -->

and runs to the next such comment, a `<!-- /figures -->`, or the next heading. Inside a block every
figure (a number with `%`, `x`, a time or byte unit; a decimal; a fraction such as `16/16`) must appear
in the text of one of its sources *as committed at HEAD* (`git show HEAD:<path>`), after normalising
(`−` to `-`, a leading `+` and thousands separators dropped, no space before the unit). A decimal with a
unit also matches the bare decimal (tables put the unit in the header: `wall s`, `plan peak (MiB)`):
`1.51x` matches `1.51`, `61.5 s` matches `61.5`; an integer with a unit needs the unit. Plain integers ("batch 18", "16 members") are not checked: too many are counts of
the prose's own. Code (fenced blocks, `inline code`) and comments are not figures.

Where figures must be sourced: all of benchmarks/README.md and docs/results.md; in README.md and the other
user docs only the blocks marked (the session transcript is an illustration of the output).
A figure in those places outside any block fails, like a figure its source does not contain.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "benchmarks/README.md": None,  # the whole file is checked
    "docs/results.md": None,
    # elsewhere only the blocks marked ("" names no section to check whole)
    "README.md": "",
    **{f"docs/{p.name}": "" for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("results.md", "design.md", "cli.md")},
}
OPEN = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->")
CLOSE = re.compile(r"<!--\s*/figures\s*-->")
UNIT = r"(?:%|x\b|\s?(?:ms|s|MiB|GiB|KiB)\b|\sB\b)"  # bytes need the space: `7B` is a model size
FIGURE = re.compile(
    r"(?<![\w.\-/])"
    r"(?:[+\-−]?\d[\d,]*(?:\.\d+)?" + UNIT +  # 1.01%, 13.6 s, 156.3 MiB, 1.51x, +128 B
    r"|\d+/\d+(?![\d/])"  # 16/16
    r"|[+\-−]?\d+\.\d+(?![\d.]))"  # a bare decimal
)


@dataclass
class Finding:
    doc: str
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.figure!r} {self.why}"


def normalise(token: str) -> str:
    t = token.replace("−", "-").replace(",", "")
    t = re.sub(r"\s+", "", t)
    return t.lstrip("+")


def bare(n: str) -> str:
    """The number of a normalised figure without its unit."""
    return re.match(r"-?[\d.]*\d", n).group(0) if re.match(r"-?\d", n) else n


def figures(text: str) -> list[str]:
    """The figure tokens of a line of prose (code spans and comments removed)."""
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"<!--.*?-->", " ", text)
    return [m.group(0) for m in FIGURE.finditer(text)]


def source_tokens(text: str) -> set[str]:
    """Every figure of a source file, normalised, and for `Nx` also the bare number."""
    out: set[str] = set()
    for tok in FIGURE.findall(text) + re.findall(r"\d[\d,]*(?:\.\d+)?", text):
        n = normalise(tok)
        out.add(n)
        if n.startswith("-") and n[1:].replace(".", "").isdigit():
            out.add(n)  # signed stays signed
    return out


def committed(path: str) -> str | None:
    """The file's text at HEAD (None if HEAD has no such file)."""
    p = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
    return p.stdout if p.returncode == 0 else None


def check(doc: str, text: str, section: str | None, read=committed) -> list[Finding]:
    """Findings for one document: figures not in their block's sources, and figures outside any block where
    every figure must be sourced (`section` None: everywhere; a heading: inside that section)."""
    findings: list[Finding] = []
    sources: list[str] | None = None
    cache: dict[str, set[str] | None] = {}
    in_code = False
    checked = section is None
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith("    "):  # fenced or indented code
            continue
        if line.startswith("#"):
            sources = None
            if section is not None:
                level = len(section) - len(section.lstrip("#"))
                hl = len(line) - len(line.lstrip("#"))
                if line.strip() == section:
                    checked = True
                elif hl <= level:
                    checked = False
        m = OPEN.search(re.sub(r"`[^`]*`", " ", line))
        if m:
            sources = [s.strip() for s in m.group(1).split(",") if s.strip()]
            for s in sources:
                if s not in cache:
                    body = read(s)
                    cache[s] = None if body is None else source_tokens(body)
                if cache[s] is None:
                    findings.append(Finding(doc, no, s, "is not a committed file"))
        if CLOSE.search(line):
            sources = None
        for fig in figures(line):
            n = normalise(fig)
            if sources is None:
                if checked:
                    findings.append(Finding(doc, no, fig, "is outside every figure block"))
                continue
            pool = set().union(*(cache[s] or set() for s in sources))
            if n not in pool and not (bare(n) != n and "." in bare(n) and bare(n) in pool):
                findings.append(Finding(doc, no, fig, f"is in none of {', '.join(sources)} (as committed)"))
    return findings


@pytest.mark.parametrize("doc", list(DOCS))
def test_every_quoted_figure_is_in_a_committed_result(doc):
    findings = check(doc, (ROOT / doc).read_text(), DOCS[doc])
    assert not findings, f"{len(findings)} figure(s) without a committed source:\n" + "\n".join(map(str, findings))


def test_docs_cite_results():
    """The convention is in use: both documents cite result files, the benchmark README several."""
    cited = {d: {s for m in OPEN.finditer((ROOT / d).read_text()) for s in m.group(1).split(",")} for d in DOCS}
    assert len(cited["benchmarks/README.md"]) >= 4
    assert any("accuracy" in s for s in cited["docs/results.md"])


def test_checker_rejects_a_figure_its_source_lacks():
    src = {"r.md": "| gpt | 0.00% | 1.147x | 13.6 s | 156.3 MiB | 16/16 | +128 B |"}
    ok = "<!-- figures: r.md -->\nexact (0.00%), 1.147x and 1.15x? no: 13.6 s, 156.3 MiB, 16/16, 128 B, 1.147 s, a 7B model"
    found = check("d", ok, None, read=src.get)
    assert [f.figure for f in found] == ["1.15x"]
    assert [f.figure for f in check("d", "<!-- figures: r.md -->\n16 MiB", None, read=src.get)] == ["16 MiB"]
    wrong = "<!-- figures: r.md -->\n0.01% and 13.7 s and 17/16 and -128 B"
    assert [f.figure for f in check("d", wrong, None, read=src.get)] == ["0.01%", "13.7 s", "17/16", "-128 B"]


def test_checker_rejects_unsourced_figures_and_missing_sources():
    src = {"r.md": "0.00%"}
    doc = "# A\nfree 1.5x here\n## Measured accuracy\n0.00% unsourced\n<!-- figures: r.md, gone.md -->\n0.00%\n## B\n2.5x"
    found = check("d", doc, "## Measured accuracy", read=src.get)
    assert [(f.line, f.figure) for f in found] == [(4, "0.00%"), (5, "gone.md")]
    # outside the checked section nothing is required; code is never a figure
    assert check("d", "# A\n`1.23%`\n    4.56 s\n", None, read=src.get) == []


def test_cited_results_record_their_provenance():
    """Each cited result's JSON records the commit and whether the tree was clean (a dirty run: the hash of
    its diff). Results written before provenance was recorded are listed: run_all.sh rewrites them."""
    missing = []
    for doc in DOCS:
        for m in OPEN.finditer((ROOT / doc).read_text()):
            for s in (x.strip() for x in m.group(1).split(",")):
                body = committed(str(Path(s).with_suffix(".json")))
                if body is None:
                    continue
                prov = json.loads(body).get("provenance")
                if prov is None:
                    missing.append(s)
                    continue
                assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]), s
                assert prov["clean"] or re.fullmatch(r"[0-9a-f]{64}", prov["diff_sha256"] or ""), s
    if missing:
        pytest.xfail("written before provenance was recorded: " + ", ".join(sorted(set(missing))))
