"""Apply a plan to a model in place: wrap the named modules with non-reentrant activation checkpointing.

Only memory and time may change (docs/design.md §5): same loss, gradients, BatchNorm running statistics and
random stream. The wrapper replaces `forward` on the module *instance*, so module names, state_dict keys
and hooks are untouched; the module's own hooks (FSDP's included) stay outside the checkpoint and run
once. The patch snippet of `plan/patch.py` does the same with plain torch and uses the same
attribute names, so `applied_names` and `remove` recognise modules wrapped by either. A segment (a list
of consecutive blocks in the plan) is checkpointed as one region by ckpt_tune/plan/segment.py, which the
patch snippet embeds.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import types
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch import nn

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.entry import Action, Entry, entries_of, member_names
from ckpt_tune.plan.file import Plan, load_plan
from ckpt_tune.plan.offload import OFFLOAD_FORWARD, is_offloaded, offload, restore
from ckpt_tune.plan.policy import context_fn
from ckpt_tune.plan.segment import (
    INNER_ATTR,
    SEGMENT_ATTR,
    SEGMENT_FORWARD,
    Segment,
    inner_forward,
    running_stats,
    throwaway_running_stats,
)

log = logging.getLogger(__name__)

# Shared with the patch snippet (plan/patch.py): the wrapper's function name marks a wrapped module, and a
# forward the instance had before wrapping (e.g. one set by accelerate) is kept under this attribute.
_WRAPPER_NAME = "_ckpt_forward"
_INNER_ATTR = INNER_ATTR
# The op-level policy (plan/policy.py) of a module wrapped for an Action.SELECTIVE entry.
_POLICY_ATTR = "_ckpt_policy"
# Set on the root module by `apply`: the configs whose `use_cache` it turned off, for `remove`.
_SAVED_CACHE_ATTR = "_ckpt_tune_use_cache_off"


def _ckpt_forward(self: nn.Module, *args, **kwargs):
    """The instance-level forward of a wrapped module (bound with MethodType, so deepcopy binds the copy)."""
    inner = inner_forward(self)
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    calls = 0
    policy = self.__dict__.get(_POLICY_ATTR)
    # under an op policy the recompute must run exactly the forward's ops: the throwaway copies of
    # the running statistics are made here, outside the checkpointed region
    spares = [b.clone() for *_, b in running_stats(self)] if policy is not None else None

    def run(*a):
        # checkpoint calls this once in forward and again for each recompute in backward.
        nonlocal calls
        calls += 1
        if calls == 1:
            return inner(*a, **kwargs)
        with throwaway_running_stats(self, spares):
            return inner(*a, **kwargs)

    # kwargs reach `run` by closure, not through checkpoint(), so a module keyword named like one of
    # checkpoint's own (debug, context_fn, determinism_check) cannot collide.
    extra = {"context_fn": context_fn(policy)} if policy is not None else {}
    # the arguments as they are now: a list the caller appends to after this call (DenseNet's earlier
    # features) must reach the recompute as it was, so containers are copied (tensors are not)
    args, kwargs = torch.utils._pytree.tree_map(lambda x: x, (args, kwargs))
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **extra)


def _is_wrapped(module: nn.Module) -> bool:
    own = module.__dict__.get("forward")
    return getattr(own, "__name__", None) in (_WRAPPER_NAME, SEGMENT_FORWARD, OFFLOAD_FORWARD)


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
        name
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", None) is True
        and any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(m).__mro__)
    ]
    for name in found:
        for layer in hf_on:
            if layer == name or layer.startswith(name + ".") or name.startswith(layer + "."):
                raise PlanError(
                    f"Hugging Face gradient checkpointing is already on for {layer!r}, "
                    f"so checkpointing {name!r} as well would recompute it twice",
                    hint="call model.gradient_checkpointing_disable() before applying the plan",
                )


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
        _WRAPPERS[entry.action](model, entry, [modules[n] for n in entry.modules])
    return model


def _checkpoint(model: nn.Module, entry: Entry, blocks: list[nn.Module]) -> None:
    """Action.CHECKPOINT: one module under non-reentrant checkpoint, or a run of blocks as one region;
    Action.SELECTIVE: one module under checkpoint with its op policy (plan/policy.py)."""
    if not entry.is_segment:
        module = blocks[0]
        if _is_wrapped(module):
            if is_offloaded(module) or module.__dict__.get(_POLICY_ATTR) != entry.policy:
                policy = module.__dict__.get(_POLICY_ATTR)
                what = "offloaded" if is_offloaded(module) else f"checkpointed under policy {policy}" if policy else "checkpointed whole"
                raise PlanError(
                    f"{entry.modules[0]} is already {what}",
                    hint="call ckpt_tune.remove(model) first, or apply one plan only",
                )
            return
        own = module.__dict__.get("forward")
        if own is not None:
            setattr(module, _INNER_ATTR, own)
        if entry.policy is not None:
            setattr(module, _POLICY_ATTR, entry.policy)
        module.forward = types.MethodType(_ckpt_forward, module)
        return
    if _same_segment(blocks):
        return
    wrapped = [n for n, b in zip(entry.modules, blocks, strict=True) if _is_wrapped(b)]
    if wrapped:
        raise PlanError(
            f"cannot checkpoint {entry.label} as one segment: {wrapped[0]} is already checkpointed",
            hint="call ckpt_tune.remove(model) first, or apply one plan only",
        )
    Segment(blocks, f"segment {entry.label}").wrap(root=model)


def _offload(model: nn.Module, entry: Entry, blocks: list[nn.Module]) -> None:
    """Action.OFFLOAD: what the module saves for backward kept in host memory (plan/offload.py)."""
    if _is_wrapped(blocks[0]) and not is_offloaded(blocks[0]):
        raise PlanError(
            f"{entry.modules[0]} is already checkpointed: it cannot be offloaded too",
            hint="call ckpt_tune.remove(model) first, or apply one plan only",
        )
    offload(blocks[0])


# One wrapper per kind of entry (docs/design.md §7).
_WRAPPERS = {Action.CHECKPOINT: _checkpoint, Action.SELECTIVE: _checkpoint, Action.OFFLOAD: _offload}


def _same_segment(blocks: list[nn.Module]) -> bool:
    """True when `blocks` are already wrapped as exactly one segment, in this order."""
    marks = [b.__dict__.get(SEGMENT_ATTR) for b in blocks]
    return all(m is not None for m in marks) and all(
        m[0] is marks[0][0] and m[1] == i and m[0].blocks[i] is b for i, (m, b) in enumerate(zip(marks, blocks, strict=True))
    ) and len(marks[0][0].blocks) == len(blocks)


def remove(model: nn.Module) -> None:
    """Undo `apply` (or the patch snippet): restore every wrapped module's original forward, and the
    `use_cache` settings `apply` turned off."""
    for module in model.modules():
        if not _is_wrapped(module):
            continue
        if SEGMENT_ATTR in module.__dict__:
            module.__dict__[SEGMENT_ATTR][0].unwrap()  # all its blocks, and its hook on the model
            continue
        if is_offloaded(module):
            restore(module)
            continue
        inner = module.__dict__.pop(_INNER_ATTR, None)
        module.__dict__.pop(_POLICY_ATTR, None)
        del module.__dict__["forward"]
        if inner is not None:
            module.forward = inner
    for config in model.__dict__.pop(_SAVED_CACHE_ATTR, []):
        config.use_cache = True
