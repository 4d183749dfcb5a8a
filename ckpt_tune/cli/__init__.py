"""ckpt-tune's command line: parse → call the library → render → exit code. No arithmetic here.

A hub in the style of accelerate's: it imports one leaf module per command (cli/profile.py, search.py,
check.py, diagnose.py) and registers their functions; no command imports the hub. The options the
commands share live in cli/options.py.

Exit codes: 0 success; 1 error (bad target or input, user code raised, ckpt-tune's own limitation); 2
usage; 3 the answer is "no" (nothing fits the budget, or `check` found a regression); 130 interrupted
(Ctrl-C).

Project configuration (cli/config.py: `[tool.ckpt-tune]` in pyproject.toml, or ckpt-tune.toml, found from
the current directory upward) becomes click's `default_map`: the root callback reads it before the command
parses its arguments, so a flag on the command line still wins. `main` wraps each command to say on stderr
which file was read and to name that file in an error a configured value caused.
"""

from __future__ import annotations

import gc
import os

# Before torch is imported: the profiler's C++ side warns about blocks allocated before recording
# started, which is expected here and says nothing to the user.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ckpt_tune.cli import check, diagnose, profile, search
from ckpt_tune.cli import config as project_config
from ckpt_tune.errors import CkptTuneError

app = typer.Typer(
    add_completion=True,  # --install-completion, --show-completion
    no_args_is_help=True,
    help="Where the memory of a PyTorch training step goes, and how to make it fit.",
    pretty_exceptions_enable=False,
)

_state: dict[str, Any] = {"debug": False, "config": None, "help": False}


def _version(value: bool) -> None:
    if value:
        from ckpt_tune import __version__

        sys.stdout.write(f"ckpt-tune {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="show full tracebacks")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option("--config", dir_okay=False, help="read option defaults from this ckpt-tune.toml or pyproject.toml only"),
    ] = None,
    no_config: Annotated[
        bool,
        typer.Option("--no-config", help=f"ignore ckpt-tune.toml and the tool.ckpt-tune table of pyproject.toml (also: {project_config.ENV_DISABLE}=1)"),
    ] = False,
) -> None:
    _state["debug"] = debug
    _state["config"] = None
    if config is not None and no_config:
        raise typer.BadParameter("give --config FILE or --no-config, not both", param_hint="--config")
    if no_config or (config is None and project_config.disabled_by_env()):
        return
    params = {name: {p.name for p in cmd.params if p.name} for name, cmd in ctx.command.commands.items()}
    try:
        found = project_config.load(Path.cwd(), params, explicit=config)
    except project_config.ConfigError:
        if _state["help"]:  # a broken configuration file does not hide --help
            return
        raise
    if found is not None:
        ctx.default_map = found.defaults
        _state["config"] = found


app.command()(profile.profile)
app.command()(search.search)
app.command()(check.check)
app.command()(diagnose.diagnose)


def _source(ctx, name: str) -> str | None:
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def _with_config(invoke: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A command's `invoke` that says which configuration file was read and, when the command fails on
    a value taken from it, names the file and key in the hint; an interrupt is said in one line."""

    def run(ctx):
        try:
            return configured(ctx)
        except KeyboardInterrupt:
            # typer turns the interrupt into a silent exit 130: say why the command stopped
            sys.stderr.write("interrupted (Ctrl-C)\n")
            raise

    def configured(ctx):
        found = _state["config"]
        if found is None:
            return invoke(ctx)
        # A TARGET on the command line beats a configured hf-config (which the session would prefer).
        if _source(ctx, "target") == "COMMANDLINE" and _source(ctx, "hf_config") == "DEFAULT_MAP":
            ctx.params["hf_config"] = None
        sys.stderr.write(f"config: {found.describe()}\n")
        try:
            return invoke(ctx)
        except CkptTuneError as e:
            if e.exit_code == 1:
                _name_config(e, found, ctx)
            raise

    return run


def _name_config(e: CkptTuneError, found, ctx) -> None:
    """Add to e's hint which configured values the message mentions, and where they were set."""
    notes = []
    for name, value in ctx.params.items():
        origin = found.origins.get((ctx.info_name, name))
        if origin is None or value is None or _source(ctx, name) != "DEFAULT_MAP":
            continue
        key, where = origin
        text = str(value)
        kind = project_config.KEYS.get(key)
        if kind == "spec":  # messages name the file of path/file.py:fn, unquoted
            mentioned = {text, text.rpartition(":")[0]}
        elif kind == "path":
            mentioned = {text}
        else:  # short words like "cpu": only quoted, or the option named
            mentioned = {repr(text), f"--{key}"}
        if any(m and m in e.message for m in mentioned):
            notes.append(f"{key} = {text!r} is set in {where}")
    if notes:
        note = "; ".join(notes) + " (override it on the command line, or use --no-config)"
        e.hint = f"{e.hint}; {note}" if e.hint else note


def _flag_help(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The command's --help option, shown as a flag like the others."""

    def get(ctx):
        option = make(ctx)
        if option is not None:
            option.metavar = ""
        return option

    return get


def main(argv: list[str] | None = None) -> None:
    """Entry point: click handles usage errors (exit 2); our error family becomes one line and its code."""
    args = sys.argv[1:] if argv is None else argv
    _state["help"] = "--help" in args
    command = typer.main.get_command(app)
    for sub in command.commands.values():
        sub.invoke = _with_config(sub.invoke)
    for cmd in (command, *command.commands.values()):
        for param in cmd.params:
            if getattr(param, "is_flag", False):
                param.metavar = ""  # a flag takes no value: shown as --json, not --json <bool>
        cmd.get_help_option = _flag_help(cmd.get_help_option)
    try:
        command(args)
    except KeyboardInterrupt:  # outside a command: while parsing
        sys.stderr.write("interrupted (Ctrl-C)\n")
        sys.exit(130)
    except CkptTuneError as e:
        if _state["debug"]:
            raise
        from rich.markup import escape

        from ckpt_tune.cli import render

        # Plain text, not markup: "[tool.ckpt-tune]" or a path with brackets must print as written.
        render.error(escape(e.message), escape(e.hint) if e.hint else None)
        sys.exit(e.exit_code)


def entry() -> None:
    """The `ckpt-tune` program (and `python -m ckpt_tune`): `main`, then the interpreter's exit without
    the collector. Its last collection walked everything a search built (a 7B's fake model and sharded
    states: 1.4 s of a 20 s search) for memory the process gives back whole as it ends; frozen, the
    objects are left to that. `atexit` handlers still run."""
    try:
        main()
    finally:
        # not where a nanobind extension is loaded (triton, which CUDA builds of torch bring and the
        # profiler imports): its objects left to the exit are reported as leaks, dozens of lines on stderr
        if "triton" not in sys.modules:
            gc.freeze()


if __name__ == "__main__":
    entry()
