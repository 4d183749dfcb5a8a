"""The README and the user docs run: every ```python block and every `ckpt-tune …` command that
README.md and docs/*.md show is a test (docs/design.md, the maintainers' design, and docs/cli.md, the
generated options table, are left out).

The extractor is our own (no Markdown dependency) and reads three places:

- fenced blocks (``` or ~~~): a block whose info string is `python` is a Python snippet; in any other
  fenced block, a line `$ ckpt-tune …` or `ckpt-tune …` is a command (output lines are not);
- indented code blocks (4 spaces, after a blank line): the same command lines;
- inline code spans `ckpt-tune SUB ARG…` with at least one argument after the subcommand (a bare
  `ckpt-tune check` in prose names the command, it does not run one); usage-table cells are spans too.

A trailing backslash joins the next line; `# …` is a shell comment, and `# exit N` in it is the exit
code the command must return (0 otherwise). Commands with placeholders (`TARGET`, `[--opt …]`, `N`,
`a|b`) cannot run: they are skipped, and `test_skipped_commands_are_usage_forms` fails on any skipped
command that is not a usage form, so a real command is never skipped silently.

Python blocks run in-process with `exec`, in a temporary directory holding a copy of `examples/` and the
plan file the README shows (`plan.yaml`), the repository root on `sys.path`, and the names a README
fragment takes from the user's code (`model`, `make_batch`, `loss_fn`: the bundled GPT example).
Commands run as `python -m ckpt_tune …` in that directory; `--out`, `--patch`, `--report`, `--save`,
`--baseline`, `--plot` and `--emit-out` paths are rewritten into it, so nothing is written into the repository.

The Llama-2-7B `--hf-config … --device meta` searches and the `--vram 24GB` searches on CPU (whose
large steps are recorded under fake tensors) take minutes each: they are marked `heavy`, left out of
`make test`, and run by `make test-heavy`.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# the documents whose code runs: the README and the user docs (tutorial, how-to, reference, explanation)
DOCS = [README, *sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in ("design.md", "cli.md"))]

# options whose value is a file the command writes: rewritten into the test's directory
OUTPUT_OPTIONS = ("--out", "--patch", "--report", "--save", "--baseline", "--plot", "--emit-out")
# a --vram above this, on a device that allocates for real (not meta), is not run in the fast set
FAST_BUDGET_BYTES = 2 * 2**30
SUBCOMMANDS = ("profile", "search", "check", "diagnose")
TIMEOUT_S = 1800  # per command: a hang fails instead of blocking the suite


# --- extraction ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    line: int  # 1-based line of its document where it starts
    text: str  # Python source, or the command line (prompt removed, continuations joined)
    kind: str  # "python" | "fenced" | "indented" | "inline"
    doc: str = "README.md"  # the document, relative to the repository

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def id(self) -> str:
        if self.kind == "python":
            first = next(
                (s for s in (x.strip() for x in self.text.splitlines()) if s and not s.startswith(("#", "import ", "from "))),
                self.text.strip().splitlines()[0] if self.text.strip() else "empty",
            )
            call = re.search(r"[\w.]+(?=\()", first)
            words = [call.group(0) if call else first.split()[0]]
        else:
            words = _strip_comment(self.text).split()[1:4]
        page = "" if self.doc == "README.md" else Path(self.doc).stem + "-"
        return f"{page}L{self.line}-" + "_".join(re.sub(r"[^\w.:/=-]", "", w) for w in words)


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_COMMAND_LINE = re.compile(r"^(\$\s+)?ckpt-tune(\s|$)")


def _strip_comment(cmd: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", cmd).strip()


def _commands_in(body: list[str], first_line: int, kind: str) -> list[Snippet]:
    out: list[Snippet] = []
    k = 0
    while k < len(body):
        text = body[k].strip()
        if _COMMAND_LINE.match(text):
            start = first_line + k
            parts = [text]
            while parts[-1].endswith("\\") and k + 1 < len(body):
                parts[-1] = parts[-1][:-1].rstrip()
                k += 1
                parts.append(body[k].strip())
            out.append(Snippet(start, re.sub(r"^\$\s+", "", " ".join(parts)), kind))
        k += 1
    return out


def extract(text: str) -> tuple[list[Snippet], list[Snippet]]:
    """(python blocks, command lines) of a Markdown text, in order of appearance."""
    python, commands, _ = _scan(text)
    return python, commands


def _scan(text: str) -> tuple[list[Snippet], list[Snippet], str]:
    """Python blocks, command lines, and the text with every code block blanked out (same lines)."""
    lines = text.splitlines()
    python: list[Snippet] = []
    commands: list[Snippet] = []
    prose = list(lines)  # code-block lines blanked out: what is left holds the inline spans
    i, prev_blank = 0, True
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            mark, lang = fence.group(1), fence.group(2).lower()
            close = re.compile(rf"^ {{0,3}}{re.escape(mark[0])}{{{len(mark)},}}\s*$")
            j = i + 1
            while j < len(lines) and not close.match(lines[j]):
                j += 1
            body = lines[i + 1 : j]
            if lang in ("python", "py"):
                python.append(Snippet(i + 2, "\n".join(body) + "\n", "python"))
            else:
                commands += _commands_in(body, i + 2, "fenced")
            prose[i : j + 1] = [""] * (min(j + 1, len(lines)) - i)
            i, prev_blank = j + 1, False
            continue
        if prev_blank and line.startswith("    ") and line.strip():
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            commands += _commands_in(lines[i:j], i + 1, "indented")
            prose[i:j] = [""] * (j - i)
            i, prev_blank = j, not lines[j - 1].strip()
            continue
        prev_blank = not line.strip()
        i += 1
    blanked = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", blanked):
        span = " ".join(m.group(1).replace("\\|", "|").split())
        if _COMMAND_LINE.match(span) and len(span.split()) >= 3:
            line_no = blanked.count("\n", 0, m.start()) + 1
            commands.append(Snippet(line_no, re.sub(r"^\$\s+", "", span), "inline"))
    commands.sort(key=lambda s: s.line)
    return python, commands, blanked


README_TEXT = README.read_text(encoding="utf-8")


def _all_docs() -> tuple[list[Snippet], list[Snippet]]:
    python: list[Snippet] = []
    commands: list[Snippet] = []
    for path in DOCS:
        rel = path.relative_to(REPO).as_posix()
        p, c = extract(path.read_text(encoding="utf-8"))
        python += [Snippet(s.line, s.text, s.kind, rel) for s in p]
        commands += [Snippet(s.line, s.text, s.kind, rel) for s in c]
    return python, commands


PYTHON_BLOCKS, COMMANDS = _all_docs()


def argv(cmd: str) -> list[str]:
    """The arguments after `ckpt-tune`, comments dropped."""
    return shlex.split(cmd, comments=True)[1:]


_PLACEHOLDER = re.compile(r"[\[\]<>|]|\.\.\.|^[A-Z][A-Z_]*$")


def unrunnable(cmd: str) -> str | None:
    """Why the command cannot run as written (a placeholder in it), or None."""
    try:
        tokens = argv(cmd)
    except ValueError as e:
        return f"unparsable: {e}"
    bad = [t for t in tokens if _PLACEHOLDER.search(t)]
    return f"placeholders {bad}" if bad else None


def is_usage_form(cmd: str) -> bool:
    """A synopsis line: `ckpt-tune SUB TARGET …` or one with `[--option …]` groups."""
    tokens = cmd.split()
    return (len(tokens) >= 3 and tokens[1] in SUBCOMMANDS and tokens[2] == "TARGET") or bool(
        re.search(r"\[--[\w-]+", cmd)
    )


def expected_exit(cmd: str) -> int:
    m = re.search(r"#.*?\bexit (\d+)", cmd)
    return int(m.group(1)) if m else 0


def option(args: list[str], name: str) -> str | None:
    for k, a in enumerate(args):
        if a == name and k + 1 < len(args):
            return args[k + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def budget_bytes(vram: str | None) -> int | None:
    """`24GB`/`24GiB`/`160MiB`/bytes as bytes (GB read as GiB, as the tool does); None for auto."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B)?\s*", vram or "", re.IGNORECASE)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()]) if m else None


def big_real_budget(cmd: str) -> int | None:
    """The budget of a command that would allocate more than FAST_BUDGET_BYTES for real, else None."""
    args = argv(cmd)
    n = budget_bytes(option(args, "--vram"))
    if option(args, "--device") == "meta" or n is None or n <= FAST_BUDGET_BYTES:
        return None
    return n


def _command_param(s: Snippet):
    marks = []
    args = argv(s.text)
    if "--hf-config" in args:
        marks += [pytest.mark.slow, pytest.mark.heavy, pytest.mark.hf]
    if big_real_budget(s.text) is not None:
        # a GPU-sized budget on CPU: steps this machine cannot hold are recorded under fake tensors
        # (measure/host.py), so it runs anywhere, in about half a minute
        marks += [pytest.mark.slow, pytest.mark.heavy]
    return pytest.param(s, id=s.id, marks=marks)


RUNNABLE = [s for s in COMMANDS if unrunnable(s.text) is None]
SKIPPED = [s for s in COMMANDS if unrunnable(s.text) is not None]


# --- the extraction itself -------------------------------------------------------------------------


def test_extractor_reads_every_kind_of_block():
    text = "\n".join(
        [
            "intro `ckpt-tune check` and `ckpt-tune profile a.py:b --top 3`",
            "",
            "    ckpt-tune search a.py:b --vram 1GB   # exit 3: too small",
            "    ckpt-tune diagnose a.py:b \\",
            "        --vram 2GB",
            "",
            "```python",
            "import ckpt_tune",
            "```",
            "",
            "```",
            "$ ckpt-tune check a.py:b --baseline m.yaml",
            "ckpt-tune output lines that start so are commands too",
            "plan written to x.yaml",
            "```",
            "| `ckpt-tune search TARGET [--json]` | usage |",
        ]
    )
    python, commands = extract(text)
    assert [(p.line, p.text) for p in python] == [(8, "import ckpt_tune\n")]
    assert [(c.line, c.kind, c.text) for c in commands] == [
        (1, "inline", "ckpt-tune profile a.py:b --top 3"),
        (3, "indented", "ckpt-tune search a.py:b --vram 1GB   # exit 3: too small"),
        (4, "indented", "ckpt-tune diagnose a.py:b --vram 2GB"),
        (12, "fenced", "ckpt-tune check a.py:b --baseline m.yaml"),
        (13, "fenced", "ckpt-tune output lines that start so are commands too"),
        (16, "inline", "ckpt-tune search TARGET [--json]"),
    ]
    assert expected_exit(commands[1].text) == 3
    assert expected_exit(commands[2].text) == 0
    assert [unrunnable(c.text) is None for c in commands] == [True, True, True, True, True, False]


def test_readme_has_the_documented_calls():
    """The extractor finds what the README is known to hold: a change that hides blocks from it fails here."""
    assert any("ckpt_tune.apply(model" in b.text for b in PYTHON_BLOCKS)
    assert any("assert_peak_within" in b.text for b in PYTHON_BLOCKS)
    assert {argv(c.text)[0] for c in RUNNABLE} == set(SUBCOMMANDS)
    assert len(SKIPPED) >= len(SUBCOMMANDS)  # the usage table: one row per command


def test_skipped_commands_are_usage_forms():
    """Only synopsis lines (`TARGET`, `[--opt …]`) may be skipped; their options must exist."""
    assert SKIPPED
    for s in SKIPPED:
        assert is_usage_form(s.text), f"{s.where}: {s.text!r} cannot run ({unrunnable(s.text)})"
    env = _env()
    helps: dict[str, str] = {}
    for s in SKIPPED:
        sub = s.text.split()[1]
        assert sub in SUBCOMMANDS, f"{s.where}: unknown command {sub!r}"
        if sub not in helps:
            proc = subprocess.run(
                [sys.executable, "-m", "ckpt_tune", sub, "--help"],
                capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
            )
            assert proc.returncode == 0, proc.stderr
            helps[sub] = proc.stdout
        for opt in re.findall(r"--[a-z][\w-]*", s.text):
            assert re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", helps[sub]), (
                f"{s.where}: `ckpt-tune {sub}` has no option {opt}"
            )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_readme_paths_exist(doc: Path):
    """Repository paths a document names (`ckpt_tune/plan/segment.py`, `benchmarks/…`, *.md, links) exist,
    read from the repository root or from the document's own directory."""
    text = _scan(doc.read_text(encoding="utf-8"))[2]
    paths = {m.group(1) for m in re.finditer(r"`([\w./-]+/[\w./-]*)(?::\w+)?`", text)}
    paths |= set(re.findall(r"(?<![\w/.-])([\w/.-]+\.md)\b", text))
    paths |= {m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m.group(1)}
    paths = {p for p in paths if not p.startswith("path/to")}
    missing = sorted(p for p in paths if not ((REPO / p).exists() or (doc.parent / p).exists()))
    assert not missing, f"{doc.relative_to(REPO)} names files that do not exist: {missing}"


# --- the public API --------------------------------------------------------------------------------


def test_public_names_resolve():
    import ckpt_tune

    values = {n: getattr(ckpt_tune, n) for n in ckpt_tune.__all__}
    assert inspect.isfunction(ckpt_tune.apply)
    importlib.import_module("ckpt_tune.plan.apply")
    assert inspect.isfunction(ckpt_tune.apply)
    assert ckpt_tune.apply is ckpt_tune.apply_plan is values["apply"]
    assert all(not inspect.ismodule(v) for v in values.values())


def test_public_names_in_a_fresh_interpreter():
    """Submodules imported first (the order that once made `ckpt_tune.apply` a module) change nothing,
    and `import ckpt_tune` alone does not import torch, as the README says."""
    code = "\n".join(
        [
            "import sys",
            "import ckpt_tune",
            "assert 'torch' not in sys.modules, 'import ckpt_tune imported torch'",
            "import importlib, inspect, pkgutil",
            "import ckpt_tune.plan.apply",
            "assert inspect.isfunction(ckpt_tune.apply), ckpt_tune.apply",
            "for m in pkgutil.walk_packages(ckpt_tune.__path__, 'ckpt_tune.'):",
            "    if not m.name.endswith('__main__'):",
            "        importlib.import_module(m.name)",
            "bad = {n: getattr(ckpt_tune, n) for n in ckpt_tune.__all__ if inspect.ismodule(getattr(ckpt_tune, n))}",
            "assert not bad, bad",
            "assert inspect.isfunction(ckpt_tune.apply) and ckpt_tune.apply is ckpt_tune.apply_plan",
        ]
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr


def test_readme_documents_every_public_name():
    import ckpt_tune

    code = "\n".join(b.text for b in PYTHON_BLOCKS)
    missing = [n for n in ckpt_tune.__all__ if not re.search(rf"\bckpt_tune\.{n}\b", code)]
    assert not missing, f"no README python block uses ckpt_tune.{missing}"


# --- running it ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("COLUMNS", "120")
    return env


def _plan_file_text() -> str:
    """The plan file the README shows under 'The plan file' (`search --out plan.yaml` writes it)."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", README_TEXT, re.MULTILINE | re.DOTALL)
    plans = [b for b in blocks if b.startswith("# ckpt-tune plan")]
    assert plans, "README.md no longer shows a plan file"
    return plans[0]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory like the repository root for the README's relative paths: examples/ and plan.yaml."""
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "plan.yaml").write_text(_plan_file_text(), encoding="utf-8")
    return tmp_path


def _gpt_names() -> dict[str, object]:
    """What a README fragment takes from the user's code: the bundled GPT example's model and functions."""
    spec = importlib.util.spec_from_file_location("readme_gpt_example", REPO / "examples" / "gpt.py")
    assert spec is not None
    assert spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    return {"model": gpt.build(), "build": gpt.build, "make_batch": gpt.make_batch, "loss_fn": gpt.loss_fn}


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in PYTHON_BLOCKS])
def test_readme_python(block: Snippet, workdir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(REPO))
    namespace = {"__name__": "__readme__", **_gpt_names()}
    # padded so a traceback's line numbers are the document's
    code = compile("\n" * (block.line - 1) + block.text, str(REPO / block.doc), "exec")
    try:
        exec(code, namespace)
    except AssertionError as e:
        # README: a missing baseline is recorded and the test fails once, asking you to commit it
        if "no baseline at" not in str(e):
            raise
        exec(code, namespace)


@pytest.mark.parametrize("snippet", [_command_param(s) for s in RUNNABLE])
def test_readme_command(snippet: Snippet, workdir: Path):
    args = argv(snippet.text)
    outputs = []
    for k, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in OUTPUT_OPTIONS and (eq or k + 1 < len(args)):
            target = workdir / Path(value if eq else args[k + 1]).name
            outputs.append(target)
            if eq:
                args[k] = f"{name}={target}"
            else:
                args[k + 1] = str(target)
    if "--hf-config" in args:
        pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "ckpt_tune", *args],
        cwd=workdir, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    want = expected_exit(snippet.text)
    assert proc.returncode == want, (
        f"{snippet.where}: `{snippet.text}` exited {proc.returncode}, the document says {want}\n"
        f"{proc.stderr[-4000:]}"
    )
    if want == 0:
        for path in outputs:
            assert path.exists(), f"{snippet.where}: {path.name} was not written"
