"""ckpt-tune's command line: parse → call the library → render → exit code. No arithmetic here.

A hub in the style of accelerate's: it imports one leaf module per command (cli/profile.py, search.py,
check.py, diagnose.py) and registers their functions; no command imports the hub. The options the
commands share live in cli/options.py.

Exit codes: 0 success; 1 error (bad target or input, user code raised); 2 usage; 3 the answer is "no"
(nothing fits the budget, or `check` found a regression).
"""

from __future__ import annotations

import os

# Before torch is imported: the profiler's C++ side warns about blocks allocated before recording
# started, which is expected here and says nothing to the user.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import sys
from typing import Annotated

import typer

from ckpt_tune.cli import check, diagnose, profile, search
from ckpt_tune.errors import CkptTuneError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Where the memory of a PyTorch training step goes, and how to make it fit.",
    pretty_exceptions_enable=False,
)

_state = {"debug": False}


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="show full tracebacks")] = False) -> None:
    _state["debug"] = debug


app.command()(profile.profile)
app.command()(search.search)
app.command()(check.check)
app.command()(diagnose.diagnose)


def main() -> None:
    """Entry point: click handles usage errors (exit 2); our error family becomes one line and its code."""
    try:
        app()
    except CkptTuneError as e:
        if _state["debug"]:
            raise
        from ckpt_tune.cli import render

        render.error(e.message, e.hint)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
