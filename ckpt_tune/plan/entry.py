"""What a plan does, as a type: an entry names what it acts on and what it does there (docs/design.md §7).

An entry acts on one module (`blocks.3`) or on a run of consecutive blocks (`blocks.2..blocks.4`, a
segment), and its `action` says what happens there. Each action is a kind of entry registered in
plan/kinds/, which holds its data forms, label and wrapper; `Entry` is the value they share.

Pure: no torch, no device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.kinds import ENTRY_KINDS, POLICIES, Action, Call, EntryKind, parse

__all__ = ["POLICIES", "Action", "Entry", "entries_of", "member_names", "plain", "to_data"]


@dataclass(frozen=True)
class Entry:
    """One choice of a plan.

    Attributes:
        modules: the names (from `model.named_modules()`) it acts on: one module, or two or more
            consecutive blocks, called as a chain, that act as one region (a segment).
        action: what it does there (given a policy, `selective`; over two or more blocks, `segment`).
        policy: for `selective`, the op-level policy (plan/policy.py POLICIES); None otherwise.
    """

    modules: tuple[str, ...]
    action: Action = Action.CHECKPOINT
    policy: str | None = None

    def __post_init__(self) -> None:
        if not self.modules or not all(isinstance(n, str) for n in self.modules):
            raise PlanError(
                f"a plan entry names one module or a run of modules, got {list(self.modules)!r}",
                hint="write a module name, or a list of consecutive blocks' names",
            )
        if self.policy is not None and self.action in (Action.CHECKPOINT, Action.SELECTIVE):
            object.__setattr__(self, "action", Action.SELECTIVE)
        elif self.action is Action.CHECKPOINT and len(self.modules) > 1:
            object.__setattr__(self, "action", Action.SEGMENT)
        self.kind.check(self.modules, self.policy)

    @classmethod
    def selective(cls, module: str, policy: str) -> Entry:
        return cls((module,), Action.SELECTIVE, policy)

    @classmethod
    def offload(cls, module: str) -> Entry:
        return cls((module,), Action.OFFLOAD)

    @classmethod
    def of(cls, value: Any) -> Entry:
        """An entry from its data form: a module name, a list/tuple of names (a segment), a mapping
        `{module: NAME, policy: POLICY}` or its short form `NAME@POLICY` (a module under an op
        policy), `{module: NAME, action: offload}` or `NAME@offload` (a module offloaded), or an Entry."""
        if isinstance(value, Entry):
            return value
        action, modules, policy = parse(value)
        return cls(modules, action, policy)

    @property
    def kind(self) -> EntryKind:
        return ENTRY_KINDS[self.action]

    @property
    def is_segment(self) -> bool:
        return len(self.modules) > 1

    @property
    def label(self) -> str:
        """`blocks.0`, `blocks.2..blocks.4` for a segment, `blocks.3@matmuls` under a policy,
        `blocks.3@offload` offloaded."""
        return self.kind.label(self.modules, self.policy)

    def to_data(self) -> str | list[str] | dict[str, str]:
        """The entry as the plan file and JSON write it: a name, a list of names for a segment, or
        `{module, policy}` for a module under an op policy, `{module, action: offload}` offloaded."""
        return self.kind.data(self.modules, self.policy)

    def call(self) -> Call:
        """The call of its kind's runtime that applies it (`ckpt_tune.apply` runs it, the snippet writes it)."""
        return self.kind.call(self.modules, self.policy)


def entries_of(values: Iterable[Any]) -> tuple[Entry, ...]:
    """Entries from their data forms (see `Entry.of`)."""
    return tuple(Entry.of(v) for v in values)


def member_names(entries: Iterable[Any]) -> list[str]:
    """Every module name of a list of entries (or their data forms), segments flattened, in order."""
    return [n for e in entries for n in Entry.of(e).modules]


def plain(entries: Iterable[Any]) -> tuple[str | tuple[str, ...], ...]:
    """Entries as hashable data: a module name, a tuple of names for a segment, `name@policy` for a
    module under an op policy, `name@offload` (a baseline's settings, the result files of the benchmarks)."""
    return tuple(e.modules if e.is_segment else e.label for e in map(Entry.of, entries))


def to_data(entries: Iterable[Entry]) -> list[str | list[str]]:
    """The data form of a list of entries (YAML, JSON, the harness of the tests)."""
    return [Entry.of(e).to_data() for e in entries]
