"""One exception family. The CLI catches it once and turns it into an exit code and one line.

Every error a user can cause says what was looked for, what was found, and what to try (`hint`).
"""

from __future__ import annotations


class CkptTuneError(Exception):
    """Base of every error the tool raises on purpose. `exit_code` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class TargetError(CkptTuneError):
    """The target string, file, module or function could not be resolved."""


class UserCodeError(CkptTuneError):
    """`build`, `make_batch`, `loss_fn` or the model's forward raised, or returned the wrong thing."""


class LimitationError(CkptTuneError):
    """The user's step runs as it is, but what ckpt-tune adds to it (wrappers, probes, timings) failed on
    this model, leaving nothing to plan: ckpt-tune's limitation, never the user's error."""


class BudgetError(CkptTuneError):
    """A memory budget could not be parsed or detected."""


class PlanError(CkptTuneError):
    """A plan file is unreadable, or names modules the model lacks."""


class BaselineError(CkptTuneError):
    """A baseline file is unreadable, or was recorded under different settings."""


class NoFitError(CkptTuneError):
    """The answer is "no": nothing fits the budget. Exit code 3."""

    exit_code = 3


class RegressionError(CkptTuneError):
    """`check` found the step uses more memory than its baseline allows. Exit code 3."""

    exit_code = 3
