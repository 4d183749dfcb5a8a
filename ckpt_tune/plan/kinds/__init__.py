"""The kinds of plan choice, registered once (docs/design.md §7): one module of this package each.

A kind's module holds its entry kind (the plan's side: data forms, label, wrapper call, patch text)
and its choice kind (the search's side: `--candidates` word, options, memory-model case, cost,
refusal); its wrapper is one runtime module of `ckpt_tune.plan`. Search, diagnosis and the CLI look
kinds up here; none branches on a kind's name. A new kind is a module here, its runtime module, and
its line in each registry below.

Pure: no torch at import (the CLI's `--help` reads the kinds' words and help).
"""

from __future__ import annotations

from typing import Any

from ckpt_tune.errors import CkptTuneError, PlanError
from ckpt_tune.plan.kinds import checkpoint, offload, segment, selective
from ckpt_tune.plan.kinds.base import (
    BLOCK,
    MARK,
    NONE,
    POLICIES,
    Action,
    Call,
    EntryKind,
    Kind,
    Pricing,
    runtime_module,
)
from ckpt_tune.plan.kinds.selective import policy_of
from ckpt_tune.vocab import known

__all__ = [
    "BLOCK", "ENTRY_KINDS", "KINDS", "MARK", "NONE", "POLICIES", "RECOMPUTE", "Action", "Call", "EntryKind",
    "Kind", "Pricing", "candidates_help", "kind_of", "neighbour_like", "parse", "parse_candidates",
    "policy_of", "runtime_module",
]

# The entry kinds, in the order a data form is tried (a plain name, the last resort, is a checkpoint).
ENTRY_KINDS: dict[Action, EntryKind] = {
    k.action: k for k in (offload.ENTRY, selective.ENTRY, segment.ENTRY, checkpoint.ENTRY)
}
# The choice kinds, in the order `--help` names them and the search offers their options.
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (checkpoint.Blocks(), checkpoint.Submodules(), segment.Segments(), selective.Ops(), offload.Offload())
}
RECOMPUTE = frozenset(name for name, k in KINDS.items() if k.recompute)


def parse(value: Any) -> tuple[Action, tuple[str, ...], str | None]:
    """(action, modules, policy) of an entry's data form (see `ckpt_tune.plan.entry.Entry.of`)."""
    for kind in ENTRY_KINDS.values():
        parts = kind.parse(value)
        if parts is not None:
            return (kind.action, *parts)
    raise PlanError(
        f"a plan entry is a module name, a list of module names or a module with a policy, got {value!r}",
        hint='e.g. "blocks.0", ["blocks.2", "blocks.3"] for one checkpoint over both, '
        "or {module: blocks.3, policy: matmuls}",
    )


def kind_of(options: tuple[str, ...], k: int) -> Kind | None:
    """The kind of option k of `options` (None for option 0, stored; option 1 is the whole block)."""
    if k < 2:
        return KINDS["blocks"] if k == 1 else None
    return next(kind for kind in KINDS.values() if kind.owns(options[k]))


def neighbour_like(options: tuple[str, ...], k: int) -> int:
    """The basic option (0 stored, 1 checkpointed) option k looks like to the blocks next to it."""
    return k if k < 2 else kind_of(options, k).neighbour(options[k])


def parse_candidates(text: str) -> frozenset[str]:
    """`blocks,ops` -> the kinds named (`all`: every recompute kind, to which others may be added:
    `all,offload`); an unknown one is an error."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise CkptTuneError("--candidates names no kind of choice", f"use a comma-separated list of {', '.join(KINDS)}")
    named = {known("candidate kind", w, (*KINDS, "all"), "--candidates kind") for w in words}
    return frozenset(named - {"all"} | (RECOMPUTE if "all" in named else set()))


def candidates_help() -> str:
    """`--candidates`'s help, from the kinds."""
    recompute = ", ".join(f"{k.name} ({k.help})" for k in KINDS.values() if k.recompute)
    others = ", ".join(f"{k.name} ({k.help})" for k in KINDS.values() if not k.recompute)
    count = ("none", "one", "two", "three", "four", "five", "six")[len(RECOMPUTE)]
    return f"kinds of choice the planner may use, comma-separated: {recompute}; or all (these {count}); add {others}"
