"""`check`: measure a training step again and compare it with a stored memory baseline (a CI gate).

    result = run_check("examples/gpt.py:build", "memory.yaml", tolerance="5%", batch_size=8)
    ckpt_tune.assert_peak_within(model, "tests/memory/mlp.yaml", "5%", make_batch=make_batch)

One module per stage, each importing only the ones above it in this list:

- baseline.py: the data types (CheckSettings, Baseline, DiffRow, SettingDiff, CheckResult) and the
  baseline file, written and read through the package's YAML codec (yamlio.py).
- compare.py: `compare`, pure: a baseline and a fresh StepProfile in, a CheckResult out.
- explain.py: the result as text for people (`explain`), and the errors that end a command.
- run.py: `run_check` (the command) and `assert_peak_within` (the pytest helper): the only place that
  measures, and so the only one that imports torch, inside its functions.
"""

from ckpt_tune.gate.baseline import (
    BASELINE_VERSION,
    BREAKDOWN_KEYS,
    Baseline,
    CheckResult,
    CheckSettings,
    DiffRow,
    SettingDiff,
    baseline_from_profile,
    baseline_to_yaml,
    load_baseline,
    settings_of,
    write_baseline,
)
from ckpt_tune.gate.compare import compare, limit_for, settings_diff
from ckpt_tune.gate.explain import change_percent, explain, raise_for_status, show_setting, signed_bytes
from ckpt_tune.gate.run import UPDATE_ENV, assert_peak_within, run_check

__all__ = [
    "BASELINE_VERSION",
    "BREAKDOWN_KEYS",
    "UPDATE_ENV",
    "Baseline",
    "CheckResult",
    "CheckSettings",
    "DiffRow",
    "SettingDiff",
    "assert_peak_within",
    "baseline_from_profile",
    "baseline_to_yaml",
    "change_percent",
    "compare",
    "explain",
    "limit_for",
    "load_baseline",
    "raise_for_status",
    "run_check",
    "settings_diff",
    "settings_of",
    "show_setting",
    "signed_bytes",
    "write_baseline",
]
