"""Every figure the READMEs quote is bound to a value of a committed result file, and agrees with it.

Convention. A figure block opens with an HTML comment naming its sources, JSON result files in the
repository (each benchmark writes a `.json`, its data, beside its `.md` table):

    <!-- figures: benchmarks/results/plan_quality.json, benchmarks/results/zoo.json -->

and runs to the next such comment, a `<!-- /figures -->`, or the next heading. Inside a block every
figure (a number with `%`, `x`, a time or byte unit; a decimal; a fraction such as `16/16`) is bound to
a value by a `bind` comment after it in the block: after a table, at the end of a paragraph, or right
after the figure. A bind comment binds, in order, the figures of the block's text since the previous
bind comment (or the block's start), one entry `FIGURE = VALUE` each, separated by `;`; it may span
lines:

    <!-- bind: 16/16 = summary.ckpt-tune.respected / summary.ckpt-tune.cases;
      +55.8% = summary["no checkpointing"].worst_overshoot -->
    <!-- bind models[model=examples/gpt.py:build].budgets[vram=160MiB]:
      160 MiB = budget_bytes; 5.3 s = rows[finder="ckpt-tune search"].wall_s -->

FIGURE repeats the figure as written: an entry that names another figure than the next one to bind
fails, and the rest of its comment is skipped. A figure left unbound at the block's end fails with its
line, as does an entry with no figure left before it to bind.

A VALUE is a path into a source, prefixed `FILE.json:` (the basename of one of the block's sources) or
not (the block's first source); after `bind BASE:` a path without a file is relative to BASE (itself a
path, or `FILE.json:` and a path). A path is keys separated by dots (`summary.exact`; a plain key is
letters, digits, `_` and `-`), `["any key"]` for the others, `[i]` for the i-th element of a list, and
`[field=value]` (or `[field="value"]`, or several: `[model=gru_lm, plan="random 1"]`) for the one
element of a list whose fields equal the values; no match or several matches fail, as does a path that
does not resolve. A VALUE may be `-PATH` (a negative value the prose gives as a magnitude), or, for a
figure the document derives, arithmetic on paths: `+ - * /` with a space each side, and parentheses
(`(meta - harness) / harness`); there are no number literals. A fraction figure `a/b` binds
`PATH / PATH`, and each side must equal its count.

The comparison is strict: the bound value, converted to the figure's unit and rounded as the figure is
shown, must be the figure. A shown `5.3 s` needs a value in [5.25, 5.35) seconds, a shown `-0.033%` one
in (-0.0335%, -0.0325%]; an unsigned or `+` figure needs a positive value (0 for a figure of zero may
come from either side). The value's unit is, by default, bytes for `B`/`KiB`/`MiB`/`GiB` (steps of
1024), seconds for `s`/`ms`, a fraction for `%` (0.0091 shows as `0.91%`), and a plain number for `x`
and bare decimals; `VALUE in UNIT` says the value is in another (`peak_rss_mib in MiB`, `error_pct in
%`). Figures are signed with `-`, `−` or `+`, thousands separators allowed. Plain integers ("batch 18",
"16 members") are not figures: too many are counts of the prose's own. Code (fenced or indented
blocks, `inline code`) and comments are not figures. A figure no result JSON holds (an older run's, a
figure only the `.md` computes, a number inside a message) does not belong in a block: say it in words
or leave it out.

Sources are read as committed at HEAD (`git show HEAD:<path>`), and each records its provenance.

Where figures must be bound: all of benchmarks/README.md and docs/results.md; in README.md and the other
user docs only the blocks marked (the session transcript is an illustration of the output).
A figure in those places outside any block fails, like an unbound figure.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from decimal import Decimal, localcontext
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = {
    "benchmarks/README.md": None,  # the whole file is checked
    "docs/results.md": None,
    # elsewhere only the blocks marked ("" names no section to check whole)
    "README.md": "",
    **{f"docs/{p.name}": "" for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("results.md", "design.md", "cli.md")},
}
OPEN = re.compile(r"<!--\s*figures:\s*(.*?)\s*-->", re.S)
CLOSE = re.compile(r"<!--\s*/figures\s*-->")
BIND = re.compile(r"<!--\s*bind\b(.*?)-->", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
UNIT = r"(?:%|x\b|\s?(?:ms|s|MiB|GiB|KiB)\b|\sB\b)"  # bytes need the space: `7B` is a model size
FIGURE = re.compile(
    r"(?:(?<![\w.\-/])|(?<=\d[-–]))"  # after a range's dash too: `9.5-13.8 s`
    r"(?:[+\-−]?\d[\d,]*(?:\.\d+)?" + UNIT +  # 1.01%, 13.6 s, 156.3 MiB, 1.51x, +128 B
    r"|\d+/\d+(?![\d/])"  # 16/16
    r"|[+\-−]?\d+\.\d+(?![\d.]))"  # a bare decimal
)
# a unit's size in its family's base unit: bytes, seconds, a plain number
SCALE = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "s": 1, "ms": Decimal("0.001"), "%": Decimal("0.01"), "x": 1, "": 1}
FAMILY = {"B": "bytes", "KiB": "bytes", "MiB": "bytes", "GiB": "bytes", "s": "time", "ms": "time", "%": "number", "x": "number", "": "number"}
DEFAULT_SOURCE_UNIT = {"bytes": "B", "time": "s", "number": ""}  # a `%` figure's value is a fraction


@dataclass
class Finding:
    doc: str
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.figure!r} {self.why}"


class BindError(Exception):
    """A binding that does not resolve or does not parse."""


def normalise(token: str) -> str:
    t = token.replace("−", "-").replace(",", "")
    t = re.sub(r"\s+", "", t)
    return t.lstrip("+")


# --- paths ------------------------------------------------------------------------------------------

_FIRST = re.compile(r"\s*(?P<key>[A-Za-z_][\w\-]*)")
_STEP = re.compile(
    r"""\s*(?:
      \.\s*(?P<key>[A-Za-z_][\w\-]*)
    | \[\s*(?P<index>-?\d+)\s*\]
    | \[\s*"(?P<qkey>(?:[^"\\]|\\.)*)"\s*\]
    | \[(?P<select>\s*[A-Za-z_][\w\-]*\s*=(?:"(?:[^"\\]|\\.)*"|[^\]"])*)\]
    )""",
    re.X,
)


def _unquote(s: str) -> str:
    return json.loads(f'"{s}"')


def _equal(field_value, wanted: str) -> bool:
    if isinstance(field_value, bool) or field_value is None:
        return json.dumps(field_value) == wanted
    if isinstance(field_value, (int, float)):
        try:
            return Decimal(str(field_value)) == Decimal(wanted)
        except ArithmeticError:
            return False
    return field_value == wanted


def resolve(data, path: str):
    """The value at `path` in `data` (see the module's docstring); BindError if it does not resolve."""
    path = path.strip()
    node, pos = data, 0
    while pos < len(path):
        m = (_FIRST if pos == 0 else _STEP).match(path, pos)
        if pos == 0 and not m:
            m = _STEP.match(path, pos)
            if m and m.group("key") is not None:
                m = None  # a path does not start with a dot
        if not m:
            raise BindError(f"cannot read the path {path!r} at {path[pos:]!r}")
        pos = m.end()
        where = path[:pos]
        groups = m.groupdict()
        if groups.get("key") is not None or groups.get("qkey") is not None:
            key = groups["key"] if groups.get("key") is not None else _unquote(groups["qkey"])
            if not isinstance(node, dict) or key not in node:
                raise BindError(f"{where!r} does not resolve (no key {key!r})")
            node = node[key]
        elif groups.get("index") is not None:
            i = int(groups["index"])
            if not isinstance(node, list) or not -len(node) <= i < len(node):
                raise BindError(f"{where!r} does not resolve (no element {i})")
            node = node[i]
        else:
            conditions = []
            for cond in _split(groups["select"], ","):
                field, eq, value = (x.strip() for x in cond.partition("="))
                if not re.fullmatch(r"[A-Za-z_][\w\-]*", field) or not eq:
                    raise BindError(f"{where!r}: cannot read the selector {cond.strip()!r}")
                quoted = re.fullmatch(r'"((?:[^"\\]|\\.)*)"', value)
                conditions.append((field, _unquote(quoted.group(1)) if quoted else value))
            if not isinstance(node, list):
                raise BindError(f"{where!r} selects in something that is not a list")
            hits = [e for e in node if isinstance(e, dict) and all(f in e and _equal(e[f], v) for f, v in conditions)]
            if len(hits) != 1:
                raise BindError(f"{where!r} matches {len(hits)} elements, not one")
            node = hits[0]
    if pos == 0:
        raise BindError("an empty path")
    return node


def _split(text: str, sep: str, limit: int = -1) -> list[str]:
    """`text` split at `sep` outside quotes and brackets."""
    parts, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i) and limit != 0:
            parts.append(text[start:i])
            start = i + len(sep)
            i = start
            limit -= 1
            continue
        i += 1
    parts.append(text[start:])
    return parts


_FILE = re.compile(r"\s*([\w\-]+\.json)\s*:")


@dataclass
class Ref:
    source: str | None  # a source's basename, None: the block's first
    path: str


def parse_ref(text: str, base: Ref | None) -> Ref:
    text = text.strip()
    m = _FILE.match(text)
    if m:
        return Ref(m.group(1), text[m.end():].strip())
    if base is None:
        return Ref(None, text)
    if not base.path:
        return Ref(base.source, text)
    return Ref(base.source, base.path + ("" if text.startswith("[") else ".") + text)


def _tokens(text: str) -> list[str]:
    """A VALUE's tokens: `(`, `)`, operators (binary ones need a space each side, `-` before an operand
    is a negation) and paths (whatever lies between, brackets and quotes kept whole)."""
    out, cur, depth, quoted, i = [], "", 0, False, 0

    def flush():
        nonlocal cur
        if cur.strip():
            out.append(cur.strip())
        cur = ""

    while i < len(text):
        c = text[i]
        if quoted or depth:
            cur += c
            if quoted and c == "\\" and i + 1 < len(text):
                cur += text[i + 1]
                i += 1
            elif c == '"':
                quoted = not quoted
            elif not quoted and c in "[]":
                depth += 1 if c == "[" else -1
        elif c == '"':
            quoted = True
            cur += c
        elif c == "[":
            depth += 1
            cur += c
        elif c in "()":
            flush()
            out.append(c)
        elif c.isspace() and re.match(r"\s+[/*+\-]\s", text[i:]):
            flush()
            m = re.match(r"\s+([/*+\-])", text[i:])
            out.append(" " + m.group(1) + " ")
            i += m.end() - 1
        elif c == "-" and not cur.strip():
            out.append("-")
        else:
            cur += c
        i += 1
    flush()
    return out


def parse_value(text: str, base: Ref | None):
    """(tree, source unit or None) of a VALUE: a tree of ("ref", Ref), ("neg", x), (op, x, y)."""
    unit = None
    m = re.search(r"\s+in\s+(%|ms|s|B|KiB|MiB|GiB|x)\s*$", text)
    if m:
        unit, text = m.group(1), text[: m.start()]
    toks, pos = _tokens(text), 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def expr():
        node = term()
        while peek() in (" + ", " - "):
            node = (take().strip(), node, term())
        return node

    def term():
        node = factor()
        while peek() in (" * ", " / "):
            node = (take().strip(), node, factor())
        return node

    def factor():
        t = peek()
        if t is None or t == ")" or t.startswith(" "):
            raise BindError(f"cannot read the value {text.strip()!r}")
        take()
        if t == "-":
            return ("neg", factor())
        if t == "(":
            node = expr()
            if peek() != ")":
                raise BindError(f"an unclosed parenthesis in {text.strip()!r}")
            take()
            return node
        return ("ref", parse_ref(t, base))

    tree = expr()
    if pos != len(toks):
        raise BindError(f"cannot read the value {text.strip()!r} at {' '.join(toks[pos:])!r}")
    return tree, unit


def evaluate(tree, lookup) -> Decimal:
    """The tree's value, exact (a float's Decimal is its binary value); lookup(Ref) gives a path's."""
    kind = tree[0]
    if kind == "ref":
        v = lookup(tree[1])
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise BindError(f"{tree[1].path!r} is {v!r}, not a number")
        return Decimal(v)
    if kind == "neg":
        return -evaluate(tree[1], lookup)
    a, b = evaluate(tree[1], lookup), evaluate(tree[2], lookup)
    if kind == "/":
        if b == 0:
            raise BindError("a division by zero")
        return a / b
    return {"*": a * b, "+": a + b, "-": a - b}[kind]


# --- figures ---------------------------------------------------------------------------------------

_NUMBER = re.compile(r"([+\-]?)(\d+(?:\.\d+)?)\s?(%|x|ms|s|MiB|GiB|KiB|B)?$")


def agreement(fig: str, tree, lookup, unit: str | None) -> str | None:
    """None if the figure is the bound value as displayed, else why not (BindError: no value)."""
    with localcontext() as ctx:
        ctx.prec = 60
        frac = re.fullmatch(r"(\d+)/(\d+)", normalise(fig))
        if frac:
            if tree[0] != "/":
                return "is a fraction: bind it to `PATH / PATH`"
            a, b = evaluate(tree[1], lookup), evaluate(tree[2], lookup)
            if (Decimal(frac.group(1)), Decimal(frac.group(2))) != (a, b):
                return f"is not {a.normalize():f}/{b.normalize():f}"
            return None
        value = evaluate(tree, lookup)
        m = _NUMBER.match(fig.replace("−", "-").replace(",", "").strip())
        if not m:
            return "is not a figure the checker can read"
        sign, digits, fig_unit = m.group(1), m.group(2), m.group(3) or ""
        source = unit if unit is not None else DEFAULT_SOURCE_UNIT[FAMILY[fig_unit]]
        if FAMILY[source] != FAMILY[fig_unit] or (fig_unit in ("x", "") and source == "%"):
            return f"is in {fig_unit or 'no unit'}, the value in {source or 'no unit'}"
        value = value * Decimal(SCALE[source]) / Decimal(SCALE[fig_unit])
        shown = Decimal(digits)
        half = Decimal(1).scaleb(-len(digits.partition(".")[2])) / 2
        if shown == 0:
            ok = -half < value < half
        elif sign == "-":
            ok = -shown - half < value <= -shown + half
        else:
            ok = shown - half <= value < shown + half
        if not ok:
            places = len(digits.partition(".")[2]) + 2  # two digits more than the figure shows
            near = value.quantize(Decimal(1).scaleb(-places)).normalize()
            return f"is not the bound value {near:f}{' ' + fig_unit if fig_unit else ''} (rounded as shown)"
    return None


# --- documents --------------------------------------------------------------------------------------


def committed(path: str) -> str | None:
    """The file's text at HEAD (None if HEAD has no such file)."""
    p = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True, check=False)
    return p.stdout if p.returncode == 0 else None


def _logical_lines(text: str):
    """(line number, text) with a comment that spans lines joined into its first line; code blanked."""
    lines = text.splitlines()
    i, in_code = 0, False
    while i < len(lines):
        no, line = i + 1, lines[i]
        i += 1
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or line.startswith("    "):  # fenced or indented code
            continue
        while line.count("<!--") > line.count("-->") and i < len(lines):
            line += "\n" + lines[i]
            i += 1
        yield no, line


def check(doc: str, text: str, section: str | None, read=committed) -> list[Finding]:
    """Findings for one document: figures unbound or not agreeing with their binding, bindings that do
    not resolve, and figures outside any block where every figure must be bound (`section` None:
    everywhere; a heading: inside that section)."""
    findings: list[Finding] = []
    sources: list[str] | None = None
    data: dict[str, object] = {}
    pending: list[tuple[int, str]] = []
    checked = section is None

    def close_block():
        nonlocal sources
        for no, fig in pending:
            findings.append(Finding(doc, no, fig, "is not bound to a value (no `bind` entry for it)"))
        pending.clear()
        sources = None

    def bind(no: int, body: str):
        if sources is None:
            findings.append(Finding(doc, no, body.strip()[:40], "is a binding outside every figure block"))
            return
        # `bind:` or `bind BASE:` (BASE may start `FILE.json:`)
        head_text = body.strip()
        if head_text.startswith(":"):
            base, entries = None, head_text[1:]
        else:
            m = _FILE.match(head_text)
            rest = head_text[m.end():] if m else head_text
            parts = _split(rest, ":", 1)
            if len(parts) == 2 and len(_split(parts[0], "=")) == 1:
                base = parse_ref((m.group(0) if m else "") + parts[0], None)
                entries = parts[1]
            elif m:  # `bind FILE.json: entries`: paths from that file's root
                base, entries = Ref(m.group(1), ""), rest
            else:
                findings.append(Finding(doc, no, head_text[:40], "is a binding without `:`"))
                return
        for entry in (e for e in _split(entries, ";") if e.strip()):
            parts = _split(entry, "=", 1)
            if len(parts) != 2:
                findings.append(Finding(doc, no, entry.strip(), "is an entry without `FIGURE = VALUE`"))
                continue
            fig_text, value_text = parts[0].strip(), parts[1].strip()
            if not pending:
                findings.append(Finding(doc, no, fig_text, "is bound but no figure before it is left to bind"))
                continue
            fig_no, fig = pending[0]
            if normalise(fig) != normalise(fig_text):
                findings.append(Finding(doc, fig_no, fig, f"is where the binding names {fig_text!r} (the rest of it skipped)"))
                return
            pending.pop(0)
            try:
                tree, unit = parse_value(value_text, base)
                why = agreement(fig, tree, lookup, unit)
            except BindError as e:
                findings.append(Finding(doc, fig_no, fig, f"is bound to {value_text!r}: {e}"))
                continue
            if why:
                findings.append(Finding(doc, fig_no, fig, f"{why} ({value_text})"))

    def lookup(ref: Ref):
        name = ref.source or PurePosixPath(sources[0]).name
        full = next((s for s in sources if PurePosixPath(s).name == name), None)
        if full is None:
            raise BindError(f"{name} is not a source of this block")
        if data.get(full) is None:
            raise BindError(f"{full} is not a committed JSON file")
        return resolve(data[full], ref.path)

    for no, line in _logical_lines(text):
        if line.startswith("#"):
            close_block()
            if section is not None:
                level = len(section) - len(section.lstrip("#"))
                hl = len(line) - len(line.lstrip("#"))
                if line.strip() == section:
                    checked = True
                elif hl <= level:
                    checked = False
        line = re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)
        pos = 0
        for c in [*list(COMMENT.finditer(line)), None]:
            end = c.start() if c else len(line)
            for fig in (m.group(0) for m in FIGURE.finditer(line[pos:end])):
                if sources is None:
                    if checked:
                        findings.append(Finding(doc, no, fig, "is outside every figure block"))
                else:
                    pending.append((no, fig))
            if c is None:
                break
            pos = c.end()
            comment = c.group(0)
            if (m := OPEN.fullmatch(comment)):
                close_block()
                sources = [s.strip() for s in m.group(1).split(",") if s.strip()]
                for s in sources:
                    if s not in data:
                        body = read(s)
                        try:
                            data[s] = None if body is None or not s.endswith(".json") else json.loads(body)
                        except ValueError:
                            data[s] = None
                    if data[s] is None:
                        findings.append(Finding(doc, no, s, "is not a committed JSON file"))
            elif CLOSE.fullmatch(comment):
                close_block()
            elif (m := BIND.fullmatch(comment)):
                bind(no, m.group(1))
    close_block()
    return findings


@pytest.mark.parametrize("doc", list(DOCS))
def test_every_quoted_figure_is_bound_to_a_committed_result(doc):
    findings = check(doc, (ROOT / doc).read_text(), DOCS[doc])
    assert not findings, f"{len(findings)} figure(s) unbound or not as bound:\n" + "\n".join(map(str, findings))


def test_docs_cite_results():
    """The convention is in use: both documents cite result files, the benchmark README several."""
    cited = {d: {s.strip() for m in OPEN.finditer((ROOT / d).read_text()) for s in m.group(1).split(",")} for d in DOCS}
    assert len(cited["benchmarks/README.md"]) >= 4
    assert any("accuracy" in s for s in cited["docs/results.md"])
    assert all(s.endswith(".json") for c in cited.values() for s in c)


SRC = {
    "r.json": json.dumps(
        {
            "rows": [
                {"method": "none", "fits": 0, "cases": 16, "overshoot": 0.5579756580080437, "time_s": 5.25, "bytes": -16384},
                {"method": "ckpt-tune", "fits": 16, "cases": 16, "overshoot": None, "time_s": 5.3499, "bytes": 1024},
                {"method": "twin", "fits": 1, "cases": 2},
                {"method": "twin", "fits": 2, "cases": 2},
            ],
            "summary": {"out of sample, all": {"max_abs": 0.009104739923197809, "ratio": 1.5079}},
            "rss_mib": 794.2,
        }
    ),
    "o.json": json.dumps({"rows": [{"overshoot": 0.5}]}),
}


def _found(doc: str) -> list[tuple[int, str]]:
    return [(f.line, f.figure) for f in check("d", doc, None, read=SRC.get)]


def test_checker_accepts_figures_bound_to_their_values():
    doc = (
        "<!-- figures: r.json -->\n"
        "ckpt-tune respected 16/16 budgets; none 0/16, over by up to +55.8% (0.91% error), 5.3 s, 5.35 s,\n"
        "1.0 KiB, 1,024 B and −16,384 B, 16,384 B low, 1.51x, 794 MiB, 1.06x.\n"
        "<!-- bind rows[method=ckpt-tune]: 16/16 = fits / cases; 0/16 = r.json: rows[0].fits / r.json: rows[0].cases -->\n"
        "<!-- bind: +55.8% = rows[method=none].overshoot; 0.91% = summary[\"out of sample, all\"].max_abs;\n"
        "  5.3 s = rows[0].time_s; 5.35 s = rows[1].time_s; 1.0 KiB = rows[1].bytes; 1,024 B = r.json: rows[method=\"ckpt-tune\", cases=16].bytes;\n"
        "  −16,384 B = rows[0].bytes; 16,384 B = -rows[0].bytes; 1.51x = summary[\"out of sample, all\"].ratio;\n"
        "  794 MiB = rss_mib in MiB; 1.06x = (rows[1].bytes - r.json: rows[0].bytes) / (rows[1].cases * rows[1].bytes) -->\n"
    )
    assert _found(doc) == []
    assert _found("<!-- figures: o.json, r.json -->\n+55.8%, 16/16<!-- bind r.json: +55.8% = rows[0].overshoot;\n 16/16 = rows[1].fits / rows[1].cases -->") == []


def test_checker_rejects_a_figure_bound_to_another_row():
    doc = "<!-- figures: r.json -->\nckpt-tune respected 0/16 budgets, +55.8%\n<!-- bind: 0/16 = rows[method=ckpt-tune].fits / rows[method=ckpt-tune].cases; +55.8% = rows[method=ckpt-tune].overshoot -->"
    found = check("d", doc, None, read=SRC.get)
    assert [(f.line, f.figure) for f in found] == [(2, "0/16"), (2, "+55.8%")]
    assert "is not 16/16" in found[0].why
    assert "None, not a number" in found[1].why


def test_checker_rejects_unbound_figures():
    doc = "<!-- figures: r.json -->\n16/16 and 5.3 s\n<!-- bind: 16/16 = rows[1].fits / rows[1].cases -->\n1.51x\n<!-- /figures -->\n2.5x"
    assert _found(doc) == [(2, "5.3 s"), (4, "1.51x"), (6, "2.5x")]
    # an entry naming another figure than the one it stands on, and an entry with nothing to bind
    doc = "<!-- figures: r.json -->\n5.3 s<!-- bind: 5.4 s = rows[0].time_s; 1.51x = summary[\"out of sample, all\"].ratio -->"
    found = check("d", doc, None, read=SRC.get)
    assert [(f.figure, f.why[:20]) for f in found] == [("5.3 s", "is where the binding"), ("5.3 s", "is not bound to a va")]
    doc = "<!-- figures: r.json -->\n5.3 s<!-- bind: 5.3 s = rows[0].time_s; 1.51x = summary[\"out of sample, all\"].ratio -->"
    assert [(f.figure, f.why[:20]) for f in check("d", doc, None, read=SRC.get)] == [("1.51x", "is bound but no figu")]


def test_checker_rejects_paths_that_do_not_resolve_or_match_several():
    for path, why in [
        ("rows[method=twin].fits", "matches 2 elements, not one"),
        ("rows[method=nobody].fits", "matches 0 elements, not one"),
        ("rows[method=twin, fits=3].cases", "matches 0 elements, not one"),
        ("rows[7].fits", "no element 7"),
        ("summary.max_abs", "no key 'max_abs'"),
        ("other.json: rows[0].fits", "other.json is not a source"),
    ]:
        found = check("d", f"<!-- figures: r.json -->\n1.5x<!-- bind: 1.5x = {path} -->", None, read=SRC.get)
        assert len(found) == 1, (path, found)
        assert why in found[0].why, (path, found)


def test_checker_rounding_is_strict():
    def ok(fig: str, value: str, unit: str = "") -> bool:
        src = {"v.json": json.dumps({"v": json.loads(value)})}
        doc = f"<!-- figures: v.json -->\n{fig}<!-- bind: {fig} = v{unit} -->"
        return check("d", doc, None, read=src.get) == []

    assert ok("5.3 s", "5.25")
    assert ok("5.3 s", "5.3499")
    assert not ok("5.3 s", "5.3500001")
    assert not ok("5.3 s", "5.2499")
    assert ok("5.30 s", "5.3049")
    assert not ok("5.30 s", "5.3051")
    assert ok("5.30 s", "5.2951")
    assert ok("5 s", "5.3")
    assert not ok("5 s", "5.5")
    assert ok("0.91%", "0.0091")
    assert not ok("0.91%", "0.00904")
    assert not ok("0.91%", "0.91")
    assert ok("0.91%", "0.91", " in %")
    assert ok("0.00%", "-1.7e-7")
    assert not ok("0.00%", "0.00005")
    assert ok("-0.033%", "-0.000331")
    assert not ok("0.033%", "-0.000331")
    assert ok("156.3 MiB", str(156.3 * 2**20))
    assert not ok("156.3 MiB", "156.3")
    assert ok("480 ms", "0.4801")
    assert not ok("480 ms", "480")
    assert ok("1.147x", "1.1466")
    assert not ok("1.15x", "1.1449")
    assert not ok("16/16", "16")


def test_checker_requires_blocks_and_committed_json_sources():
    doc = "# A\nfree 1.5x here\n## Measured accuracy\n0.91% unbound\n<!-- figures: r.json, gone.json -->\n\n## B\n2.5x"
    found = check("d", doc, "## Measured accuracy", read=SRC.get)
    assert [(f.line, f.figure) for f in found] == [(4, "0.91%"), (5, "gone.json")]
    # outside the checked section nothing is required; code is never a figure
    assert check("d", "# A\n`1.23%`\n    4.56 s\n", None, read=SRC.get) == []
    assert [f.why for f in check("d", "1.5x <!-- bind: 1.5x = v -->", "", read=SRC.get)] == ["is a binding outside every figure block"]


def test_cited_results_record_their_provenance():
    """Each cited result records the commit and whether the tree was clean (a dirty run: the hash of its
    diff). Results written before provenance was recorded are listed: run_all.sh rewrites them."""
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
