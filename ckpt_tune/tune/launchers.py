"""A plan as a launcher's configuration, with the peak of the closest layout it runs measured.

The library call behind `ckpt-tune search --emit`: plan/launchers.py maps the plan to the closest
layout torchtitan, DeepSpeed or `TrainingArguments` can express; this module counts the model's
blocks as each launcher does, runs one verification step of that layout at the plan's batch when it is
not the plan itself (the step the search verifies a plan with: `Searcher.verify`, at the plan's
accumulation, precision and sharding as the launcher runs them), and renders the text.

    settings = Settings(device="cpu")
    outcome = search("examples/gpt.py:build", "160MiB", settings=settings)
    print(emit(outcome.plan, "torchtitan", "examples/gpt.py:build", settings).text)
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ckpt_tune.measure.host import HostGuard
from ckpt_tune.measure.loader import Target
from ckpt_tune.measure.session import Settings, build_runner, load, user_errors
from ckpt_tune.plan.apply import own_checkpointing_paused
from ckpt_tune.plan.file import Plan
from ckpt_tune.plan.launchers import LAUNCHERS, Expressed, HfApi, Layers, closest, peak_line, render, runs_as
from ckpt_tune.tune.candidates import find_blocks
from ckpt_tune.tune.searcher import Searcher
from ckpt_tune.vocab import known


@dataclass(frozen=True)
class Emission:
    """A launcher's configuration for a plan.

    Attributes:
        expressed: the closest layout, its settings and what the launcher cannot express.
        peak_bytes: the closest layout's peak at the plan's batch: the plan's verified peak when the
            layout is the plan itself, else one recorded step of it (per rank for a sharded plan).
        measured: whether a step was run here (False: the search's verification is the peak).
        fake: whether that step ran under fake tensors.
        text: the configuration, its notes in comments.
    """

    expressed: Expressed
    peak_bytes: int
    measured: bool
    fake: bool
    text: str

    @property
    def fits(self) -> bool | None:
        budget = self.expressed.plan.budget_bytes
        return None if budget is None else self.peak_bytes <= budget

    @property
    def summary(self) -> str:
        """One line for the report: the layout and its peak."""
        e = self.expressed
        return f"{e.launcher}: {'the plan itself' if e.exact else 'closest'}: {e.layout}; {peak_line(e, self.peak_bytes, self.fake)}"

    def to_dict(self) -> dict[str, Any]:
        e = self.expressed
        return {
            "launcher": e.launcher,
            "exact": e.exact,
            "layout": e.layout,
            "closest": e.closest.to_dict(),
            "cannot": list(e.cannot),
            "settings": e.settings,
            "peak_bytes": self.peak_bytes,
            "measured": self.measured,
            "fits": self.fits,
        }


def emit(
    plan: Plan,
    launcher: str,
    target: str | Target | None,
    settings: Settings = Settings(),
    progress: Callable[[str], None] | None = None,
) -> Emission:
    """`plan` as `launcher`'s configuration, with the peak of the closest layout it runs.

    `target` and `settings` are those the plan was searched with (the model is built again from them).

    Raises:
        CkptTuneError: an unknown launcher, or the closest layout's step failed (user_errors).
    """
    precision, shard = runs_as(plan, known("launcher", launcher, LAUNCHERS, "--emit"))
    t = load(target, settings)
    runs = replace(settings, precision=precision)
    model, runner, _ = build_runner(t, runs, plan.world_size, shard, units_of=find_blocks)
    hf = hf_api() if launcher == "hf-args" else HfApi()
    expressed = closest(plan, launcher, Layers(tuple(find_blocks(model)), hf_layers(model)), hf)
    peak, measured, fake = plan.verified_peak_bytes, False, False
    if not expressed.exact or peak is None:
        # the layout measured as the plan's modules, a library's own checkpointing off (as `search` ran)
        with user_errors(f"the step of the closest {launcher} layout"), runner, own_checkpointing_paused(model):
            searcher = Searcher(runner, progress=progress, world_size=plan.world_size, shard=shard, segments=False)
            searcher.accum_steps = plan.grad_accum_steps
            peak = searcher.verify(plan.batch_size, expressed.closest.checkpoint)
        measured = True
        fake = plan.device == "meta" or (isinstance(runner, HostGuard) and bool(runner.fake_batches))
    return Emission(expressed, peak, measured, fake, render(expressed, peak, fake))


def hf_layers(model: nn.Module) -> tuple[str, ...] | None:
    """The names of transformers' `GradientCheckpointingLayer` modules in `model`, in module order:
    the layers `TrainingArguments(activation_checkpointing=True)` switches; None when the model is not a
    transformers `PreTrainedModel` (or transformers is not loaded, so it cannot be one)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52: the model's stack checkpoints each of its layers
        return tuple(find_blocks(model))
    return tuple(n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer))


def hf_api() -> HfApi:
    """What the installed transformers' `TrainingArguments` takes (plan/launchers.HfApi); without
    transformers, the long-standing `gradient_checkpointing`."""
    try:
        from transformers import PreTrainedModel, TrainingArguments
    except ImportError:
        return HfApi("gradient_checkpointing", every_n_layers=False)
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "activation_checkpointing" not in names:
        return HfApi("gradient_checkpointing", every_n_layers=False)
    enable = inspect.signature(PreTrainedModel.activation_checkpointing_enable).parameters
    return HfApi("activation_checkpointing", every_n_layers="every_n_layers" in enable)
