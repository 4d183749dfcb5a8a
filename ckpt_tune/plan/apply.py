"""Apply a plan to a model in place: each entry wrapped by its kind's runtime (plan/kinds/).

Only memory and time may change (docs/design.md §5): same loss, gradients, BatchNorm running statistics and
random stream. The wrappers (plan/checkpoint.py, plan/segment.py, plan/offload.py) replace `forward` on
the module *instance*, so module names, state_dict keys and hooks are untouched; the module's own hooks
(FSDP's included) stay outside and run once. The patch snippet of `plan/patch.py` embeds the same
runtime modules and makes the same calls, so `applied_names` and `remove` recognise modules wrapped by
either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from torch import nn

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.entry import Entry, entries_of, member_names
from ckpt_tune.plan.file import Plan, load_plan
from ckpt_tune.plan.kinds import ENTRY_KINDS
from ckpt_tune.plan.segment import is_segment

log = logging.getLogger(__name__)

# Set on the root module by `apply`: the configs whose `use_cache` it turned off, for `remove`.
_SAVED_CACHE_ATTR = "_ckpt_tune_use_cache_off"


def _wrapped_as(module: nn.Module) -> str | None:
    """How a module of ours is wrapped, in its kind's words (`Kind.state`), or None."""
    return next((s for kind in ENTRY_KINDS.values() if (s := kind.state_of(module)) is not None), None)


def _is_wrapped(module: nn.Module) -> bool:
    return _wrapped_as(module) is not None


def applied_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the modules of `model` that are wrapped (by `apply` or by the patch snippet), in order;
    each block of a segment is listed by its own name."""
    return tuple(name for name, m in model.named_modules() if _is_wrapped(m))


def _names_from(plan_or_path: Plan | str | Path | dict | Sequence) -> tuple[Entry, ...]:
    if isinstance(plan_or_path, (Plan, str, Path, dict)):
        return load_plan(plan_or_path).checkpoint
    if isinstance(plan_or_path, Sequence):
        return entries_of(plan_or_path)
    raise PlanError(
        f"cannot apply {type(plan_or_path).__name__}: expected a Plan, a plan file path, a mapping or a list "
        "of module names (a segment: a list of consecutive blocks' names)",
        hint='e.g. ckpt_tune.apply(model, "plan.yaml") or ckpt_tune.apply(model, ["blocks.0", "blocks.2"])',
    )


def _resolve(model: nn.Module, entries: Sequence[Entry]) -> dict[str, nn.Module]:
    """name -> module for every name of the entries, refusing the root, unknown names, a segment of
    fewer than two blocks, a name listed twice and a module listed with one of its ancestors."""
    names = member_names(entries)
    if "" in names:
        raise PlanError(
            "the plan names the root module '' (the whole model)",
            hint="checkpoint submodules such as the repeated blocks; checkpointing the whole model saves nothing",
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PlanError(f"the plan lists {twice[0]!r} more than once", hint="list each module once")
    found: dict[str, nn.Module] = {}
    missing: list[str] = []
    for name in names:
        try:
            found[name] = model.get_submodule(name)
        except AttributeError:
            missing.append(name)
    if missing:
        known = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
        close: list[str] = []
        for name in missing:
            close += [c for c in difflib.get_close_matches(name, known, n=5, cutoff=0.6) if c not in close]
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise PlanError(
            f"the model has no module named {shown} ({len(known)} named modules)",
            hint=(f"close matches: {', '.join(close[:5])}" if close else "no close matches")
            + "; was the plan made for this model? names come from model.named_modules()",
        )
    # Already-wrapped modules count too: wrapping an ancestor of one later would nest checkpoints.
    listed = dict(found)
    for name in applied_names(model):
        listed.setdefault(name, model.get_submodule(name))
    by_id = {}
    for name, m in listed.items():
        by_id.setdefault(id(m), name)
    for name, m in listed.items():
        for sub in m.modules():
            other = by_id.get(id(sub))
            if sub is not m and other is not None and (name in found or other in found):
                raise PlanError(
                    f"the plan checkpoints both {name!r} and {other!r}, which is inside it",
                    hint=f"keep one of them: checkpointing {name!r} already recomputes {other!r}",
                )
    _refuse_hf_checkpointing_overlap(model, found)
    return found


def _refuse_hf_checkpointing_overlap(model: nn.Module, found: dict[str, nn.Module]) -> None:
    """A planned module that contains, or sits inside, a Hugging Face layer whose own checkpointing is
    on would be checkpointed twice over: measured peaks and recompute times would not be the plan's."""
    hf_on = [
        name for name, m in HF_CHECKPOINTING.modules(model) if any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(m).__mro__)
    ]
    for name in found:
        for layer in hf_on:
            if layer == name or layer.startswith(name + ".") or name.startswith(layer + "."):
                raise PlanError(
                    f"Hugging Face gradient checkpointing is already on for {layer!r}, "
                    f"so checkpointing {name!r} as well would recompute it twice",
                    hint=f"call {HF_CHECKPOINTING.off} before applying the plan",
                )


@dataclasses.dataclass(frozen=True)
class OwnCheckpointing:
    """A library's own activation checkpointing, switched by a boolean attribute on its modules that
    their forward reads at each call (docs/design.md §7)."""

    flag: str
    library: str
    off: str  # the user's call that turns it off

    def modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(name, module) of each module of `model` whose flag is on."""
        return [(name or "(the model)", m) for name, m in model.named_modules() if getattr(m, self.flag, None) is True]

    def switch(self, modules: Sequence[nn.Module], on: bool) -> None:
        for m in modules:
            setattr(m, self.flag, on)


HF_CHECKPOINTING = OwnCheckpointing("gradient_checkpointing", "Hugging Face gradient checkpointing", "model.gradient_checkpointing_disable()")
TIMM_CHECKPOINTING = OwnCheckpointing("grad_checkpointing", "timm's gradient checkpointing", "model.set_grad_checkpointing(False)")
OWN_CHECKPOINTING = (HF_CHECKPOINTING, TIMM_CHECKPOINTING)


@dataclasses.dataclass(frozen=True)
class Paused:
    """A library's checkpointing that was on, and the modules whose flag `own_checkpointing_paused` turned off."""

    own: OwnCheckpointing
    names: tuple[str, ...]

    def note(self, recorded_with_it: bool = False) -> str:
        """The note a command gives: searched with it off (`recorded_with_it`: today's step was recorded
        with it on, the plans without)."""
        on = f"({len(self.names)} modules, first {self.names[0]})"
        if recorded_with_it:
            return (f"{self.own.library} is on {on}: today's step was recorded with it; the checkpoint plans "
                    f"replace it: call {self.own.off} before applying one")
        return f"{self.own.library} was on {on}: searched with it off, which the plan replaces: call {self.own.off} before applying the plan"


@contextlib.contextmanager
def own_checkpointing_paused(model: nn.Module) -> Iterator[list[Paused]]:
    """A library's own activation checkpointing (Hugging Face's, timm's) off while a plan is searched for
    the model: a plan replaces it, `apply` refuses to checkpoint a Hugging Face layer twice over, and no
    segment can start inside a checkpoint the model makes itself (plan/segment.py). The flags are back as
    they were after. Yields what was on ([] where nothing was)."""
    on = [(own, dict(mods)) for own in OWN_CHECKPOINTING if (mods := own.modules(model))]
    for own, mods in on:
        own.switch(list(mods.values()), False)
    try:
        yield [Paused(own, tuple(mods)) for own, mods in on]
    finally:
        for own, mods in on:
            own.switch(list(mods.values()), True)


def _turn_off_use_cache(model: nn.Module) -> None:
    """Hugging Face models: the recompute would append to the KV cache a second time, so training under
    checkpointing needs `config.use_cache = False` (what HF's own gradient checkpointing asks for).
    The configs changed are recorded on the root so that `remove` restores them."""
    saved = model.__dict__.setdefault(_SAVED_CACHE_ATTR, [])
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            saved.append(config)
            log.info("set %s.config.use_cache = False for checkpointing", type(m).__name__)


@contextlib.contextmanager
def cache_off(model: nn.Module):
    """Hugging Face's `use_cache` off while the block runs, as `apply` leaves it for a checkpointed
    model: a block run alone again with the arguments of its first call would fill the cache twice."""
    saved = [m.config for m in model.modules() if getattr(getattr(m, "config", None), "use_cache", None) is True]
    for config in saved:
        config.use_cache = False
    try:
        yield
    finally:
        for config in saved:
            config.use_cache = True


def apply(model: nn.Module, plan_or_path: Plan | str | Path | dict | Sequence) -> nn.Module:
    """Wrap the modules the plan names with non-reentrant checkpoint, in place; returns `model`.

    Accepts a Plan, a plan file path, a mapping with the plan file's keys, or a list whose entries are
    module names or segments (lists of the names of consecutive blocks, checkpointed as one region:
    ckpt_tune/plan/segment.py). Idempotent: a module already wrapped is left as it is. Raises PlanError for
    names the model lacks, for the root module, for a module listed together with one of its ancestors,
    for a segment whose blocks are already wrapped otherwise, and for modules that Hugging Face's own
    checkpointing already covers. Hugging Face models get `config.use_cache = False` (a KV cache would
    be filled again by the recompute); `remove` restores it.
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"apply needs an nn.Module, got {type(model).__name__}")
    entries = _names_from(plan_or_path)
    modules = _resolve(model, entries)
    if modules:
        _turn_off_use_cache(model)
    for entry in entries:
        _apply_entry(model, entry, [modules[n] for n in entry.modules])
    return model


def _apply_entry(model: nn.Module, entry: Entry, modules: list[nn.Module]) -> None:
    """Run the entry's call (plan/kinds/), unless its modules are wrapped so already; a module wrapped
    otherwise is an error."""
    if entry.is_segment and is_segment(modules):
        return
    state = entry.kind.state(entry.policy)
    for name, module in zip(entry.modules, modules, strict=True):
        now = _wrapped_as(module)
        if now is not None and (entry.is_segment or now != state):
            raise PlanError(
                f"{name} is already {now}, so it cannot be {state} too ({entry.label})",
                hint="call ckpt_tune.remove(model) first, or apply one plan only",
            )
    entry.call().run(model)


def remove(model: nn.Module) -> None:
    """Undo `apply` (or the patch snippet): restore every wrapped module's original forward, and the
    `use_cache` settings `apply` turned off."""
    for module in model.modules():
        for kind in ENTRY_KINDS.values():
            kind.undo(module)
    for config in model.__dict__.pop(_SAVED_CACHE_ATTR, []):
        config.use_cache = True
