"""What every kind of plan choice is made of (docs/design.md §7): the vocabulary and the two faces.

A kind is one module of this package. Its *entry kind* (`EntryKind`) is the plan's side: how an
entry of its `Action` is written and read (plan file, JSON), labelled, applied (the `Call` of its
runtime module's function, which `ckpt_tune.plan.apply` runs and the patch snippet writes), described
when found on a module, and undone. Its *choice kind* (`Kind`) is the search's side: its
`--candidates` word, the options it adds to every block, what an option becomes as plan entries, how a
block under it looks to its neighbours in the memory model, what it costs in time and where it is
refused. Several choice kinds may make entries of one action (whole blocks and their sub-modules are
both checkpoints).

Pure: no torch at import (runtime modules are imported when an entry is applied; a kind that reads a
model imports torch inside the function that does).
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ckpt_tune.errors import PlanError

# the op-level policies' names (plan/policy.py holds the rules; it imports torch, this module must not)
POLICIES = ("matmuls", "half-matmuls", "attention")
MARK = "@"  # `blocks.3@matmuls`, `blocks.3@offload`: a module and what is done to it
NONE, BLOCK = "none", "block"  # options 0 and 1 of every block: stored, checkpointed whole


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


class EntryKind:
    """The plan's side of a kind: one `Action`. Subclasses set the attributes and the methods their forms need.

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


@dataclass(frozen=True)
class Pricing:
    """What the costs of one batch are computed from (tune/step_costs.py fills it).

    Attributes:
        forward: module name -> forward time (ms, or GFLOP under fake tensors) at the timed batch.
        scale: the factor from the timed batch to the priced one.
        unit: "ms" or "GFLOP".
        batch_size: the priced batch.
        shares: (block, policy) -> share of the block's forward in the ops the policy recomputes.
        saved: block -> bytes per sample its forward saves for backward.
        host_link: bytes/s of the host link transfers are priced at.
    """

    forward: dict[str, float]
    scale: float
    unit: str
    batch_size: int
    shares: dict[tuple[str, str], float] = field(default_factory=dict)
    saved: dict[str, float] = field(default_factory=dict)
    host_link: float = 25e9

    def recompute(self, modules: list[str], share: float = 1.0) -> float:
        return self.scale * max(sum(self.forward.get(m, 0.0) for m in modules) * share, 1e-6)


class Kind:
    """The search's side of a kind: one kind of plan choice.

    Every block of the chain has options: 0 stored, 1 checkpointed whole (`NONE`, `BLOCK`), then the
    finer options the kinds offer, resolved by index (option 1 is the whole block whatever a finer
    option is named). The methods receive the search, and use only its public services.

    Attributes:
        name: its `--candidates` word.
        help: what it offers, as `--help` says it.
        entry: the entry kind its options become.
        groups: whole-module choices: option 1, and the groups of blocks that hold runs of them.
        runs: runs of consecutive blocks under one checkpoint (segments).
        inside: modules inside a block, a module a block runs several times among them.
        timed: its options are priced from block runs timed on the device (op policies: the search may
            time them ahead, beside the ordering step).
    """

    name: str
    help: str
    entry: EntryKind
    groups = False
    runs = False
    inside = False
    timed = False

    @property
    def recompute(self) -> bool:
        """Offered by `all`: what it adds to the step is a recompute (its entry kind's `recomputes`)."""
        return self.entry.recomputes

    def offer(self, search: Any, batch_size: int) -> tuple[str, ...]:
        """The finer options this kind adds to every block (option names); () for none."""
        return ()

    def owns(self, option: str) -> bool:
        """Whether a finer option (index 2 and up) is this kind's."""
        return False

    def has(self, search: Any, unit: str, option: str) -> bool:
        """Whether block `unit` can take `option` (one it cannot is priced out)."""
        return True

    def entries(self, unit: str, option: str) -> tuple[Any, ...]:
        """The plan entries `option` of block `unit` becomes, in their data form (`Entry.of` reads it)."""
        return (unit + option,)

    def modules(self, unit: str, option: str) -> list[str]:
        """The modules `option` of block `unit` recomputes."""
        return [unit]

    def neighbour(self, option: str) -> int:
        """The basic option (0 stored, 1 checkpointed) a block under `option` looks like to its neighbours."""
        return 1

    def cost(self, pricing: Pricing, unit: str, option: str) -> float:
        """The time `option` adds to the step in block `unit` (the pricing's unit)."""
        return pricing.recompute(self.modules(unit, option))

    def refusal(self, device: str) -> str | None:
        """Why this kind cannot be offered on `device`, or None."""
        return None
