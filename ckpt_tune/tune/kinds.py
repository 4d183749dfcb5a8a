"""The kinds of plan choice the search offers (`search --candidates`), registered once (docs/design.md §7).

Every block of the chain has options: 0 stored normally, 1 checkpointed whole, and the finer options
the kinds add (`Terms.options` names them all). A kind here is what the search, the memory model and
the costs look up instead of branching on its name: its `--candidates` word, the options it adds to
every block (`offer`, which may record what pricing them needs), whether a block has one (`has`), the
plan entries an option becomes (`entries`; their data forms, wrappers and patch text are the entry
kinds of plan/kinds.py), how a block under it looks to its neighbours in the memory model
(`neighbour`), what it costs in time (`cost`) and where it is refused (`refusal`). Structural kinds
(whole blocks and the groups holding them, segments) add no finer option; their flags say what the
search does for them.

Option names: `attn`, `attn+mlp` (sub-modules), `@matmuls` (an op policy), `@offload`; a block's
option `@x` is the entry `block@x` (plan/kinds.py's short form). Options are resolved by index (`kind_of`):
option 1 is the whole block whatever a finer option is named (EfficientNet's MBConv has a sub-module
named `block`).

Pure at import (no torch): the CLI's `--help` reads the kinds' words and help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.kinds import KINDS as ENTRY_KINDS
from ckpt_tune.plan.kinds import MARK, POLICIES, Action
from ckpt_tune.vocab import known

NONE, BLOCK = "none", "block"  # options 0 and 1 of every block

# What FLOPs stand for under fake tensors, where offload's transfers are priced against them: an
# H100/H200's dense bf16 matmul throughput, FLOP/s (measure/op_costs.py prices memory-bound ops the same way).
DEVICE_FLOPS = 990e12


def exposed_transfer(nbytes: float, forward: float, host_link: float, unit: str) -> float:
    """The time offloading a block adds to the step, in the timing's unit (ms, or GFLOP under fake
    tensors): its saved bytes go to host memory while its forward runs and come back while its backward
    (about twice the forward) runs, over a host link of `host_link` bytes/s; what the compute does not
    hide is added. Modelled, not measured (docs/design.md §4)."""
    seconds = nbytes / host_link
    each_way = seconds * 1e3 if unit == "ms" else seconds * DEVICE_FLOPS / 1e9
    return max(max(each_way - forward, 0.0) + max(each_way - 2 * forward, 0.0), 1e-6)


@dataclass(frozen=True)
class Pricing:
    """What the costs of one batch are computed from (tune/step_costs.py fills it).

    Attributes:
        forward: module name -> forward time (ms, or GFLOP under fake tensors) at the timed batch.
        scale: the factor from the timed batch to the priced one.
        unit: "ms" or "GFLOP".
        batch_size: the priced batch.
        shares: (block, policy) -> share of the block's forward in the ops the policy recomputes.
        saved: block -> bytes per sample its forward saves (what offloading it moves).
        host_link: bytes/s of the host link offload's transfers are priced at.
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
    """One kind of plan choice of the search.

    Attributes:
        name: its `--candidates` word.
        help: what it offers, as `--help` says it.
        entry: the `Action` of the entries its options become (plan/kinds.py).
        recompute: one of `all` (the default): its entries recompute (their entry kind's `recomputes`);
            else offered only when named.
        groups: whole-module choices: option 1, and the groups of blocks that hold runs of them.
        runs: runs of consecutive blocks under one checkpoint (segments).
        inside: modules inside a block, a module a block runs several times among them.
    """

    name: str
    help: str
    entry: Action
    groups = False
    runs = False
    inside = False

    @property
    def recompute(self) -> bool:
        return ENTRY_KINDS[self.entry].recomputes

    def offer(self, search: Any, batch_size: int) -> tuple[str, ...]:
        """The finer options this kind adds to every block (option names); () for none."""
        return ()

    def owns(self, option: str) -> bool:
        """Whether a finer option (index 2 and up) is this kind's."""
        return False

    def has(self, search: Any, unit: str, option: str) -> bool:
        """Whether block `unit` can take `option` (one it cannot is priced out)."""
        return True

    def entries(self, unit: str, option: str) -> tuple[Entry, ...]:
        return Entry.of(unit + option),

    def neighbour(self, option: str) -> int:
        """The basic option (0 stored, 1 checkpointed) a block under `option` looks like to its neighbours."""
        return 1

    def cost(self, pricing: Pricing, unit: str, option: str) -> float:
        """The time `option` adds to the step in block `unit` (the pricing's unit)."""
        return pricing.recompute([m for e in self.entries(unit, option) for m in e.modules])

    def refusal(self, device: str) -> str | None:
        """Why this kind cannot be offered on `device`, or None."""
        return None


class Blocks(Kind):
    name, groups = "blocks", True
    entry = Action.CHECKPOINT
    help = "whole blocks and the stages holding them"

    def entries(self, unit, option):
        return (Entry((unit,)),)


class Submodules(Kind):
    name, inside = "submodules", True
    entry = Action.CHECKPOINT
    help = "a block's attention or MLP"

    def offer(self, search, batch_size):
        from ckpt_tune.tune.candidates import find_sub_options

        subs = find_sub_options(search.runner.model, search.units)
        # modules run more than once inside a unit: checkpointed at each call (a shared layer's loop)
        return (*subs, *(o for o in dict.fromkeys(search.repeats.values()) if o not in subs))

    def owns(self, option):
        return not option.startswith(MARK)

    def has(self, search, unit, option):
        from ckpt_tune.tune.candidates import has_sub_option

        return search.repeats.get(unit) == option or has_sub_option(search.runner.model, unit, option)

    def entries(self, unit, option):
        return tuple(Entry((f"{unit}.{sub}",)) for sub in option.split("+"))

    def neighbour(self, option):
        return 0  # the block keeps its input and output as when stored


class Segments(Kind):
    name, runs = "segments", True
    entry = Action.SEGMENT
    help = "runs of blocks under one checkpoint"


class Ops(Kind):
    name = "ops"
    entry = Action.SELECTIVE
    help = "op-level policies of a block: keep matmul outputs, recompute the rest"

    def offer(self, search, batch_size):
        policies = search.refinement("op policies", "every block", lambda: search.useful_policies(batch_size), [])
        return tuple(MARK + p for p in policies)

    def owns(self, option):
        return option.startswith(MARK) and option[len(MARK):] in POLICIES

    def cost(self, pricing, unit, option):
        return pricing.recompute([unit], pricing.shares[(unit, policy_of(option))])


class Offload(Kind):
    name, entry = "offload", Action.OFFLOAD
    help = "a block's saved tensors kept in host memory; GPUs and --device meta only"
    option = MARK + Action.OFFLOAD.value

    def offer(self, search, batch_size):
        ok = search.refinement("offload", "every block", lambda: search.measure_offload(batch_size), False)
        return (self.option,) if ok else ()

    def owns(self, option):
        return option == self.option

    def neighbour(self, option):
        return 0  # it makes its output as a stored block does

    def cost(self, pricing, unit, option):
        # the transfers its forward and backward do not hide
        nbytes = pricing.saved.get(unit, 0.0) * pricing.batch_size
        return exposed_transfer(nbytes, pricing.scale * pricing.forward.get(unit, 0.0), pricing.host_link, pricing.unit)

    def refusal(self, device):
        if device == "cpu":
            return "offload keeps saved tensors in host memory instead of the device's; on --device cpu they are the same memory"
        return None


KINDS: dict[str, Kind] = {k.name: k for k in (Blocks(), Submodules(), Segments(), Ops(), Offload())}
RECOMPUTE = frozenset(name for name, k in KINDS.items() if k.recompute)


def kind_of(options: tuple[str, ...], k: int) -> Kind | None:
    """The kind of option k of `options` (None for option 0, stored; option 1 is the whole block)."""
    if k < 2:
        return KINDS["blocks"] if k == 1 else None
    return next(kind for kind in KINDS.values() if kind.owns(options[k]))


def policy_of(option: str) -> str | None:
    """The op policy an option stands for, or None."""
    return option[len(MARK):] if KINDS["ops"].owns(option) else None


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
