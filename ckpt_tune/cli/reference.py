"""The options reference (docs/cli.md), written from the command line's own definitions so it cannot
drift from them: `python -m ckpt_tune.cli.reference > docs/cli.md`; tests/test_design_doc.py checks the
committed file equals the output."""

from __future__ import annotations

import typer

from ckpt_tune.cli import app

HEADER = (
    "# Every option\n\n"
    "Generated from the command line's own definitions by `python -m ckpt_tune.cli.reference > docs/cli.md`\n"
    "(a test checks this file is current). What the commands do and take: [reference.md](reference.md).\n"
)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _names(param) -> str:
    names = [*param.opts, *param.secondary_opts]
    if param.param_type_name == "argument":
        return f"`{param.name}` (argument)"
    return ", ".join(f"`{n}`" for n in names)


def _default(param) -> str:
    if param.param_type_name == "argument" or param.default is None or (getattr(param, "is_flag", False) and param.default is False):
        return ""
    return f"`{param.default}`"


def markdown() -> str:
    """docs/cli.md: per command, its summary and a table of its arguments and options."""
    group = typer.main.get_command(app)
    out = [HEADER]
    for name, command in group.commands.items():
        out += [f"## `ckpt-tune {name}`", "", _cell(command.help or ""), "",
                "| option | meaning | default |", "| --- | --- | --- |"]
        for param in command.params:
            if param.name == "help" or getattr(param, "hidden", False):
                continue
            out.append(f"| {_names(param)} | {_cell(param.help or '')} | {_default(param)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
