"""What a plan does, as a type: an entry names what it acts on and what it does there (docs/design.md §7).

An entry acts on one module (`blocks.3`) or on a run of consecutive blocks (`blocks.2..blocks.4`, a
segment), and its `action` says what happens there: `checkpoint` (non-reentrant activation
checkpointing over the module, or over the whole run as one region), `selective` (checkpointing one
module under an op-level policy of plan/policy.py: the outputs of the ops the policy names are kept,
the rest recomputed) or `offload` (the tensors one module saves for backward kept in host memory,
plan/offload.py).

Each action has one YAML form (`to_data`/`of`, written and read by plan/file.py), one wrapper
(plan/apply.py; the patch snippet of plan/patch.py mirrors it) and its cost terms in the memory model
(tune/memory_model.py turns the planner's choices into entries). A new kind of choice adds a member to
`Action` and those three pieces, and nothing else.

Pure: no torch, no device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ckpt_tune.errors import PlanError

# the policies' names (plan/policy.py holds the rules; it imports torch, this module must not)
POLICIES = ("matmuls", "half-matmuls", "attention")


class Action(str, Enum):
    """What an entry does to the modules it names."""

    CHECKPOINT = "checkpoint"  # keep only the inputs; recompute the forward in backward (one region)
    SELECTIVE = "selective"  # checkpoint one module, but keep the outputs of the ops its policy names
    OFFLOAD = "offload"  # keep what one module saves for backward in host memory; nothing recomputed


@dataclass(frozen=True)
class Entry:
    """One choice of a plan.

    Attributes:
        modules: the names (from `model.named_modules()`) it acts on: one module, or two or more
            consecutive blocks, called as a chain, that act as one region (a segment).
        action: what it does there.
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
        if self.action is Action.OFFLOAD and (self.policy is not None or len(self.modules) != 1):
            raise PlanError(
                f"an offload entry names one module and no policy, got {list(self.modules)!r}",
                hint="write the entry as {module: NAME, action: offload}",
            )
        if self.policy is not None or self.action is Action.SELECTIVE:
            if self.policy not in POLICIES:
                raise PlanError(
                    f"unknown op policy {self.policy!r} for {self.modules[0]}",
                    hint=f"a policy is one of {', '.join(POLICIES)}",
                )
            if len(self.modules) != 1:
                raise PlanError(
                    f"an op policy applies to one module, got a segment {list(self.modules)!r}",
                    hint="write the entry as {module: NAME, policy: POLICY}",
                )
            object.__setattr__(self, "action", Action.SELECTIVE)

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
        if isinstance(value, str):
            name, at, policy = value.rpartition("@")
            if at and policy == Action.OFFLOAD.value:
                return cls.offload(name)
            return cls.selective(name, policy) if at and policy in POLICIES else cls((value,))
        if isinstance(value, dict) and set(value) == {"module", "action"}:
            if value["action"] != Action.OFFLOAD.value or not isinstance(value["module"], str):
                raise PlanError(
                    f"a plan entry with an action is {{module: NAME, action: offload}}, got {value!r}",
                    hint="the only action written this way is offload",
                )
            return cls.offload(value["module"])
        if isinstance(value, dict):
            if set(value) != {"module", "policy"} or not all(isinstance(v, str) for v in value.values()):
                raise PlanError(
                    f"a plan entry with an op policy has the keys module and policy, got {value!r}",
                    hint="e.g. {module: blocks.3, policy: matmuls}",
                )
            return cls.selective(value["module"], value["policy"])
        if isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
            if len(value) < 2:
                raise PlanError(
                    f"the plan lists a segment of {len(value)} block(s): {list(value)}",
                    hint="a segment is two or more consecutive blocks; write a single block as its name alone",
                )
            return cls(tuple(value))
        raise PlanError(
            f"a plan entry is a module name, a list of module names or a module with a policy, got {value!r}",
            hint='e.g. "blocks.0", ["blocks.2", "blocks.3"] for one checkpoint over both, '
            "or {module: blocks.3, policy: matmuls}",
        )

    @property
    def is_segment(self) -> bool:
        return len(self.modules) > 1

    @property
    def label(self) -> str:
        """`blocks.0`, `blocks.2..blocks.4` for a segment, `blocks.3@matmuls` under a policy,
        `blocks.3@offload` offloaded."""
        if self.action is Action.OFFLOAD:
            return f"{self.modules[0]}@{Action.OFFLOAD.value}"
        if self.policy is not None:
            return f"{self.modules[0]}@{self.policy}"
        return self.modules[0] if not self.is_segment else f"{self.modules[0]}..{self.modules[-1]}"

    def to_data(self) -> str | list[str] | dict[str, str]:
        """The entry as the plan file and JSON write it: a name, a list of names for a segment, or
        `{module, policy}` for a module under an op policy, `{module, action: offload}` offloaded."""
        if self.action is Action.OFFLOAD:
            return {"module": self.modules[0], "action": Action.OFFLOAD.value}
        if self.policy is not None:
            return {"module": self.modules[0], "policy": self.policy}
        return self.modules[0] if not self.is_segment else list(self.modules)


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
