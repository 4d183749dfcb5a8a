"""The kinds of plan entry, registered once: each says how it is written, read and applied.

A kind is one `Action` (docs/design.md §7). Its unit here gives everything the layers above look up
instead of branching on its name: its data forms in the plan file and JSON (`parse`, `data`), its
label in tables, its comment in the plan file, how it describes a module it wrapped (`state`), the
runtime modules of `ckpt_tune.plan` that hold its wrapper (torch only, embedded in the patch snippet as
they are) and the call of their function that applies one entry, which `ckpt_tune.apply` makes and the
snippet writes. The search's side of a kind (its options, probes, costs) is `tune/kinds.py`.

Pure: no torch at import (the runtime modules are imported when an entry is applied).
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ckpt_tune.errors import PlanError

# the op-level policies' names (plan/policy.py holds the rules; it imports torch, this module must not)
POLICIES = ("matmuls", "half-matmuls", "attention")
MARK = "@"  # `blocks.3@matmuls`, `blocks.3@offload`: a module and what is done to it


class Action(str, Enum):
    """What an entry does to the modules it names."""

    CHECKPOINT = "checkpoint"  # keep only the module's inputs; recompute its forward in backward
    SEGMENT = "segment"  # the same over a run of consecutive blocks, as one region
    SELECTIVE = "selective"  # checkpoint one module, but keep the outputs of the ops its policy names
    OFFLOAD = "offload"  # keep what one module saves for backward in host memory; nothing recomputed


Fields = tuple[tuple[str, ...], "str | None"]  # (modules, policy): an entry's fields


@functools.cache
def runtime_module(name: str):
    """The runtime module `ckpt_tune.plan.<name>` (imported on first use: this module stays pure)."""
    return importlib.import_module(f"ckpt_tune.plan.{name}")


@dataclass(frozen=True)
class Call:
    """The call that applies one entry: `function(target, *arguments, **keywords)`, where the target is
    the model (`module` None) or the named module of it, and `function` lives in `runtime`."""

    runtime: str
    function: str
    module: str | None
    arguments: tuple = ()
    keywords: tuple[tuple[str, Any], ...] = ()

    def source(self) -> str:
        """The call as Python source over a variable `model` (the patch snippet's line)."""
        target = "model" if self.module is None else f"model.get_submodule({json.dumps(self.module)})"
        args = [target, *map(_literal, self.arguments), *(f"{k}={_literal(v)}" for k, v in self.keywords)]
        return f"{self.function}({', '.join(args)})"

    def run(self, model) -> None:
        function = getattr(runtime_module(self.runtime), self.function)
        target = model if self.module is None else model.get_submodule(self.module)
        function(target, *self.arguments, **dict(self.keywords))


def _literal(value: Any) -> str:
    # json.dumps writes a valid Python literal for any name, and for a list of names
    return json.dumps(list(value) if isinstance(value, tuple) else value)


class Kind:
    """One kind of entry. Subclasses set the attributes and the methods their forms need.

    Attributes:
        action: the kind's `Action`.
        runtime: the modules of `ckpt_tune.plan` its wrapper needs, in the order the snippet embeds them.
        comment: what the plan file says beside an entry of this kind ("" for none).
        cost: what the step pays for it, as the patch snippet's header names it.
        whole: it checkpoints one module whole, as Hugging Face's per-layer switch does.
        recomputes: what it adds to the step is a recompute (at most a forward); False for offload,
            whose transfers are modelled and not bounded by the compute.
    """

    action: Action
    runtime: tuple[str, ...]
    comment = ""
    cost = "recompute"
    whole = False
    recomputes = True

    def parse(self, value: Any) -> Fields | None:
        """The entry's fields from a data form of this kind, None for a form of another kind."""
        raise NotImplementedError

    def check(self, modules: tuple[str, ...], policy: str | None) -> None:
        """Raise PlanError when the fields do not make an entry of this kind."""
        if len(modules) != 1 or policy is not None:
            raise PlanError(
                f"a {self.action.value} entry names one module and no policy, got {list(modules)!r}",
                hint=f"write the entry as {self.data(modules[:1], None)!r}",
            )

    def data(self, modules: tuple[str, ...], policy: str | None) -> Any:
        """The entry as the plan file and JSON write it."""
        return {"module": modules[0], "action": self.action.value}

    def label(self, modules: tuple[str, ...], policy: str | None) -> str:
        return f"{modules[0]}{MARK}{self.action.value}"

    def state(self, policy: str | None) -> str:
        """How a module wrapped as this entry is described ("blocks.3 is already ...")."""
        raise NotImplementedError

    def call(self, modules: tuple[str, ...], policy: str | None) -> Call:
        raise NotImplementedError

    def state_of(self, module) -> str | None:
        """`state(...)` when `module` is wrapped as an entry of this kind, else None."""
        raise NotImplementedError

    def undo(self, module) -> None:
        """Unwrap `module` if it is wrapped as an entry of this kind (a segment: all its blocks)."""
        raise NotImplementedError

    def _runtime(self):
        return runtime_module(self.runtime[-1])


class Checkpoint(Kind):
    action, runtime, whole = Action.CHECKPOINT, ("checkpoint",), True

    def parse(self, value):
        return ((value,), None) if isinstance(value, str) else None

    def data(self, modules, policy):
        return modules[0]

    def label(self, modules, policy):
        return modules[0]

    def state(self, policy):
        return "checkpointed whole"

    def call(self, modules, policy):
        return Call("checkpoint", "checkpoint_module", modules[0])

    def state_of(self, module):
        rt = self._runtime()
        return self.state(None) if rt.is_checkpointed(module) and rt.POLICY_ATTR not in module.__dict__ else None

    def undo(self, module):
        self._runtime().uncheckpoint_module(module)


class Segment(Kind):
    action, runtime = Action.SEGMENT, ("checkpoint", "segment")
    comment = "one segment: one checkpoint over these blocks"

    def parse(self, value):
        if not (isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value)):
            return None
        if len(value) < 2:
            raise PlanError(
                f"the plan lists a segment of {len(value)} block(s): {list(value)}",
                hint="a segment is two or more consecutive blocks; write a single block as its name alone",
            )
        return tuple(value), None

    def check(self, modules, policy):
        if len(modules) < 2 or policy is not None:
            raise PlanError(
                f"a segment is two or more consecutive blocks and no policy, got {list(modules)!r}",
                hint="write a single block as its name alone, a module under a policy as {module: NAME, policy: POLICY}",
            )

    def data(self, modules, policy):
        return list(modules)

    def label(self, modules, policy):
        return f"{modules[0]}..{modules[-1]}"

    def state(self, policy):
        return "checkpointed in a segment"

    def call(self, modules, policy):
        return Call("segment", "checkpoint_segment", None, (modules,))

    def state_of(self, module):
        return self.state(None) if self._runtime().SEGMENT_ATTR in module.__dict__ else None

    def undo(self, module):
        mark = module.__dict__.get(self._runtime().SEGMENT_ATTR)
        if mark is not None:
            mark[0].unwrap()  # all its blocks, and its hook on the model


class Selective(Kind):
    action, runtime = Action.SELECTIVE, ("policy", "checkpoint")
    comment = "checkpointed under an op policy"

    def parse(self, value):
        if isinstance(value, str):
            name, at, policy = value.rpartition(MARK)
            return ((name,), policy) if at and policy in POLICIES else None
        if not isinstance(value, dict) or "action" in value:
            return None
        if set(value) != {"module", "policy"} or not all(isinstance(v, str) for v in value.values()):
            raise PlanError(
                f"a plan entry with an op policy has the keys module and policy, got {value!r}",
                hint="e.g. {module: blocks.3, policy: matmuls}",
            )
        return (value["module"],), value["policy"]

    def check(self, modules, policy):
        if policy not in POLICIES:
            raise PlanError(
                f"unknown op policy {policy!r} for {modules[0]}", hint=f"a policy is one of {', '.join(POLICIES)}"
            )
        if len(modules) != 1:
            raise PlanError(
                f"an op policy applies to one module, got a segment {list(modules)!r}",
                hint="write the entry as {module: NAME, policy: POLICY}",
            )

    def data(self, modules, policy):
        return {"module": modules[0], "policy": policy}

    def label(self, modules, policy):
        return f"{modules[0]}{MARK}{policy}"

    def state(self, policy):
        return f"checkpointed under policy {policy}"

    def call(self, modules, policy):
        return Call("checkpoint", "checkpoint_module", modules[0], keywords=(("policy", policy),))

    def state_of(self, module):
        rt = self._runtime()
        policy = module.__dict__.get(rt.POLICY_ATTR)
        return self.state(policy) if rt.is_checkpointed(module) and policy is not None else None

    def undo(self, module):
        self._runtime().uncheckpoint_module(module)


class Offload(Kind):
    action, runtime = Action.OFFLOAD, ("offload",)
    comment = "saved tensors kept in host memory"
    cost, recomputes = "host transfers (modelled)", False

    def parse(self, value):
        if isinstance(value, str):
            name, at, word = value.rpartition(MARK)
            return ((name,), None) if at and word == self.action.value else None
        if not isinstance(value, dict) or "action" not in value:
            return None
        if set(value) != {"module", "action"} or value["action"] != self.action.value or not isinstance(value["module"], str):
            raise PlanError(
                f"a plan entry with an action is {{module: NAME, action: offload}}, got {value!r}",
                hint="the only action written this way is offload",
            )
        return (value["module"],), None

    def state(self, policy):
        return "offloaded"

    def call(self, modules, policy):
        return Call("offload", "offload", modules[0])

    def state_of(self, module):
        return self.state(None) if self._runtime().is_offloaded(module) else None

    def undo(self, module):
        self._runtime().restore(module)


# The registry, in the order a data form is tried (a plain name, the last resort, is a checkpoint).
KINDS: dict[Action, Kind] = {k.action: k for k in (Offload(), Selective(), Segment(), Checkpoint())}


def parse(value: Any) -> tuple[Action, tuple[str, ...], str | None]:
    """(action, modules, policy) of an entry's data form (see `ckpt_tune.plan.entry.Entry.of`)."""
    for kind in KINDS.values():
        parts = kind.parse(value)
        if parts is not None:
            return (kind.action, *parts)
    raise PlanError(
        f"a plan entry is a module name, a list of module names or a module with a policy, got {value!r}",
        hint='e.g. "blocks.0", ["blocks.2", "blocks.3"] for one checkpoint over both, '
        "or {module: blocks.3, policy: matmuls}",
    )
