"""ckpt-tune: where the memory of a PyTorch training step goes, and how to make it fit.

The public API, one function per command plus the plan:

    import ckpt_tune
    prof = ckpt_tune.profile("examples/gpt.py:build", batch_size=8)
    outcome = ckpt_tune.search("examples/gpt.py:build", vram="600MiB")
    ckpt_tune.apply(model, "plan.yaml")            # or outcome.plan
    ckpt_tune.shard(model, "plan.yaml")            # a plan for several ranks: fully_shard per the plan, after apply
    ckpt_tune.assert_peak_within(model_or_target, baseline="memory.yaml")

Names load on first use, so `import ckpt_tune` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "Settings",
    "apply",
    "apply_plan",
    "assert_peak_within",
    "check",
    "diagnose",
    "load_plan",
    "profile",
    "remove",
    "search",
    "shard",
]

# public name -> (module, attribute in it)
_LAZY: dict[str, tuple[str, str]] = {
    "Plan": ("ckpt_tune.plan.file", "Plan"),
    "Settings": ("ckpt_tune.measure.session", "Settings"),
    "apply": ("ckpt_tune.plan.apply", "apply"),
    "apply_plan": ("ckpt_tune.plan.apply", "apply"),
    "remove": ("ckpt_tune.plan.apply", "remove"),
    "assert_peak_within": ("ckpt_tune.gate", "assert_peak_within"),
    "check": ("ckpt_tune.gate", "run_check"),
    "diagnose": ("ckpt_tune.diagnosis", "diagnose"),
    "load_plan": ("ckpt_tune.plan.file", "load_plan"),
    "profile": ("ckpt_tune.measure.session", "profile"),
    "search": ("ckpt_tune.tune.search", "search"),
    "shard": ("ckpt_tune.plan.shard", "shard"),
}

if TYPE_CHECKING:  # pragma: no cover
    from ckpt_tune.diagnosis import diagnose
    from ckpt_tune.gate import assert_peak_within
    from ckpt_tune.gate import run_check as check
    from ckpt_tune.measure.session import Settings, profile
    from ckpt_tune.plan.apply import apply, remove
    from ckpt_tune.plan.apply import apply as apply_plan
    from ckpt_tune.plan.file import Plan, load_plan
    from ckpt_tune.plan.shard import shard
    from ckpt_tune.tune.search import search


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # resolve once; also wins over a submodule of the same name
        return value
    raise AttributeError(f"module 'ckpt_tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
