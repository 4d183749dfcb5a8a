"""The documents that describe the package stay true to it: docs/design.md's layers table names every
module of the package, each in the row of its directory, and no module that does not exist (the map a
newcomer reads first); docs/cli.md is what the command line's own definitions generate; the README
stays short enough to finish."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ckpt_tune"


def _table() -> list[tuple[str, str]]:
    """(where, owns) cells of the rows of the table under "### Layers"."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### Layers", 1)[1]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("layer", "---"):
            rows.append((cells[1], cells[2]))
    return rows


def _modules() -> dict[str, list[str]]:
    """Directory relative to the package ('' for the root) -> its module files, less the dunder ones."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name.startswith("__"):
            continue
        rel = path.parent.relative_to(PACKAGE).as_posix()
        found.setdefault("" if rel == "." else rel, []).append(path.name)
    return found


def _row_of(rows: list[tuple[str, str]], directory: str, module: str) -> str | None:
    for where, owns in rows:
        dirs = re.findall(r"`(?:ckpt_tune/)?([a-z_/]+?)/`", where)
        files = re.findall(r"`([a-z_]+\.py)`", where)
        if (directory and directory in dirs) or (not directory and module in files):
            return owns + " " + where
    return None


def test_every_module_of_the_package_is_in_the_layers_table() -> None:
    rows = _table()
    missing = []
    for directory, modules in _modules().items():
        for module in modules:
            row = _row_of(rows, directory, module)
            if row is None or f"`{module}`" not in row:
                missing.append(f"{directory}/{module}" if directory else module)
    assert not missing, f"not in docs/design.md's layers table: {missing}"


def test_the_layers_table_names_no_module_that_does_not_exist() -> None:
    known = {m for modules in _modules().values() for m in modules} | {"__init__.py"}
    named = {m for where, owns in _table() for m in re.findall(r"`(?:[a-z_/]+/)?([a-z_]+\.py)`", where + owns)}
    assert named <= known, f"named in the layers table, not in the package: {sorted(named - known)}"


def test_the_options_reference_is_generated_from_the_command_line() -> None:
    from ckpt_tune.cli.reference import markdown

    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == markdown(), "docs/cli.md is stale: python -m ckpt_tune.cli.reference > docs/cli.md"


def test_the_readme_is_a_front_door() -> None:
    """At most 200 lines, and every page of docs/ it stands in front of is linked from it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 4
    unlinked = [p for p in pages if f"(docs/{p}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_no_module_of_the_package_is_over_400_lines() -> None:
    """A module owns one stage: one that grows past 400 lines is split by what it does."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these modules: {long}"
