"""Checkpoint candidates: which modules of a model the planner may choose (docs/design.md §4).

A *block* is a child of an `nn.ModuleList`/`nn.Sequential`/`nn.ModuleDict` that repeats one type and has
parameters (inside another block, see `_all_blocks`). A model without any (ALBERT's one shared layer, a
network of distinct modules) gets its candidates from a recorded step instead (`call_chain`).
Blocks nest: a ResNet stage (`stages.0`) is a block of `stages` and holds the residual blocks
`stages.0.0`, `stages.0.1`; a Swin stage holds its attention blocks. The candidates form a tree:

- the *leaves* are the innermost blocks (no block inside them): the chain the memory model cuts at,
  and what "every block" means;
- a *group* is a block with blocks inside it; checkpointing it whole covers its leaves as one run
  (an interval of the chain, like a segment), and planning through it means choosing for its leaves.

Finer options (a leaf's large sub-modules, op policies, offload) are the kinds' (plan/kinds/).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from torch import nn

from ckpt_tune.measure.instrument import hookable


def _all_blocks(model: nn.Module) -> list[str]:
    """Names of every block at every nesting level, in registration order: children of containers
    whose type occurs twice or more among the children of the model's containers (of the container
    alone, when it is itself a block).

    Inside a block, a container's children are blocks only when they are all of one type and are
    more than a stack of layers (`_is_block_like`): a ResNet stage's residual blocks are, the
    conv-norm-activation layers of a MobileNet block and the two Linears of an MLP are not. Whether they also
    form a chain is seen when the step runs (`chain_of`)."""
    scripted = scripted_modules(model)  # TorchScript: never wrapped
    containers = [
        (n, m) for n, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and not any(n == s or _inside(n, s) for s in scripted)
    ]
    # a type repeats across the model's containers: diffusers' down blocks hold one ResNet block each
    every = Counter(type(c) for _, m in containers for c in m.children())
    found: list[str] = []
    for name, mod in containers:
        children = list(mod.named_children())
        types = [type(c) for _, c in children]
        inner = any(_inside(name, f) for f in found)
        if inner and (len(set(types)) != 1 or not all(_is_block_like(c) for _, c in children)):
            continue
        if not _is_block_like(mod):  # a DoubleConv's conv-norm-activation layers: the stack is the unit
            continue
        for cname, child in children:
            # a block that is itself a container (a Sequential block) counts its own children only
            seen = types.count(type(child)) if name in found else every[type(child)]
            if seen >= 2 and hookable(child) and any(True for _ in child.parameters()):
                found.append(f"{name}.{cname}" if name else cname)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(found, key=order.__getitem__)


def _is_block_like(module: nn.Module) -> bool:
    """Has sub-modules, and is not a plain Sequential of single layers (conv, norm, activation)."""
    children = list(module.children())
    if not children:
        return False
    return not (isinstance(module, nn.Sequential) and all(not any(True for _ in c.children()) for c in children))


def scripted_modules(model: nn.Module) -> list[str]:
    """The outermost TorchScript modules below the root (`torch.jit.script`), in registration order:
    no module in them is a candidate (measure/instrument.py `hookable`)."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if name and not hookable(mod) and not any(_inside(name, f) for f in found):
            found.append(name)
    return found


def _inside(name: str, group: str) -> bool:
    return name.startswith(group + ".")


def _blocks(model: nn.Module) -> list[str]:
    """`_all_blocks`, less the blocks inside a block that holds one leaf only: diffusers'
    `Transformer2DModel` holds one transformer block, and checkpointing it whole (its projections
    and norm too) is the choice a user names."""
    every = _all_blocks(model)
    leaves = [b for b in every if not any(_inside(o, b) for o in every)]
    single = [g for g in every if g not in leaves and sum(_inside(x, g) for x in leaves) == 1]
    return [b for b in every if not any(_inside(b, g) for g in single)]


def find_blocks(model: nn.Module) -> list[str]:
    """The innermost blocks (the leaves of the candidate tree), in registration order."""
    every = _blocks(model)
    return [b for b in every if not any(_inside(o, b) for o in every)]


def with_parameters(model: nn.Module) -> list[str]:
    """Every module below the root that holds trainable parameters and is not inside a stack of single
    layers (`_is_block_like`), in registration order: the modules a recorded step marks when the model
    has no repeated blocks (`call_chain` chooses among them)."""
    found: list[str] = []
    stacks: list[str] = []
    for name, mod in model.named_modules():
        if not name or any(_inside(name, s) for s in stacks) or not hookable(mod):
            continue
        if any(p.requires_grad for p in mod.parameters()):
            found.append(name)
            if list(mod.children()) and not _is_block_like(mod):
                stacks.append(name)  # a Sequential of conv-norm-activation: a unit, never split
    return found


def outside(model: nn.Module, units: list[str] | tuple[str, ...]) -> list[str]:
    """Composite `with_parameters` modules that neither hold nor sit inside a unit: what may run between
    units (a U-Net's bottleneck between its encoder and decoder lists, a stem before the stages). Single
    layers are left unmarked: a norm between two blocks is code between them, which keeps segments off
    that link (the ordering step's `chained`)."""
    return [
        n for n in with_parameters(model)
        if list(model.get_submodule(n).children()) and not any(n == u or _inside(n, u) or _inside(u, n) for u in units)
    ]


def between(
    marked: list[str], units: list[str], runs_once: Callable[[str], bool], window: Callable[[str], tuple[float, float, float]], model: nn.Module
) -> list[str]:
    """The composite modules of `marked` (`outside`) that run once with a backward entirely before,
    between or after the units, outermost first: units of the chain as well, so that "every block"
    is every module a user would checkpoint. `window(name)`: (forward start, forward end, backward
    start). Single layers (a head, an embedding) are left out: checkpointing one saves nothing."""
    spans = [window(u) for u in units]
    found: list[str] = []
    for n in marked:
        if any(_inside(n, f) for f in found) or not runs_once(n) or not list(model.get_submodule(n).children()):
            continue
        f0, f1, _ = window(n)
        if all(f1 <= a or f0 >= b for a, b, _ in spans):
            found.append(n)
    return found


def call_chain(
    names: list[str],
    calls: Callable[[str], int],
    runs_once: Callable[[str], bool],
    start: Callable[[str], float],
    follows: Callable[[str, str], bool],
) -> tuple[list[str], dict[str, list[str]]]:
    """(units, groups) of a model without repeated blocks, from one recorded step over `names`
    (`with_parameters`). A module is split into the marked modules below it when none of them was
    called more than once and those that ran with a backward (`runs_once`) form a chain
    (`follows(a, b)`: b's forward starts after a's ends, and its backward before a's); recursively. One
    that cannot be split (it calls a shared layer six times, like ALBERT's encoder) is a unit itself
    when it ran once with a backward. A split module of two or more units is a group: checkpointed
    whole, it covers their run. `calls(name)`: forward calls in the step; `start(name)`: when the first
    began."""
    called = [n for n in names if calls(n) > 0]  # a ModuleList is never called: its children are its parent's
    kids: dict[str, list[str]] = {}
    for n in called:
        parent = max((o for o in called if _inside(n, o)), key=len, default="")
        kids.setdefault(parent, []).append(n)
    groups: dict[str, list[str]] = {}

    def expand(name: str) -> list[str]:
        whole = [name] if name and runs_once(name) else []
        mine = kids.get(name, [])
        if any(calls(k) > 1 for k in mine):
            return whole
        chain = sorted((k for k in mine if runs_once(k)), key=start)
        if not chain or any(not follows(a, b) for a, b in itertools.pairwise(chain)):
            return whole
        units = [u for k in chain for u in expand(k)]
        if whole and len(units) >= 2:
            groups[name] = units
        return units or whole

    return expand(""), groups


def outermost_repeated(
    model: nn.Module, names: list[str], calls: Callable[[str], list[float]], with_backward: Callable[[str], bool]
) -> list[str]:
    """The outermost composite modules of `names` that run more than once per step with a backward (a
    shared layer called in a loop, like ALBERT's encoder layer): checkpointing one is what a user writes
    in the loop, every call keeping its input only and recomputed on its own in backward. `calls(name)`:
    the start of each forward call."""
    repeated = [
        n for n in names if len(calls(n)) > 1 and with_backward(n) and list(model.get_submodule(n).children())
    ]
    return [n for n in repeated if not any(_inside(n, o) for o in repeated)]


def repeated_inside(
    model: nn.Module, units: tuple[str, ...], names: list[str], calls: Callable[[str], list[float]],
    window: Callable[[str], tuple[float, float]], with_backward: Callable[[str], bool],
) -> dict[str, str]:
    """Each unit of `units` that holds `outermost_repeated` modules -> its repeat option: their names
    relative to the unit, joined by `+`. Only modules whose every call starts within the unit's forward
    count (`window(unit)`: its start and end); a module the unit shares with code outside it is left
    out, as checkpointing it would change other units too."""
    found: dict[str, str] = {}
    for u in units:
        t0, t1 = window(u)
        mine = [n for n in names if _inside(n, u) and all(t0 <= t <= t1 for t in calls(n))]
        outer = outermost_repeated(model, mine, calls, with_backward)
        if outer:
            found[u] = "+".join(n[len(u) + 1 :] for n in outer)
    return found


def find_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each block that holds blocks -> its leaves, in registration order, outermost groups first."""
    every = _blocks(model)
    leaves = [b for b in every if not any(_inside(o, b) for o in every)]
    return {g: [b for b in leaves if _inside(b, g)] for g in every if any(_inside(o, g) for o in every)}


def chain_of(leaves: list[str], groups: dict[str, list[str]], runs_once, linked) -> list[str]:
    """The units of the chain: the leaves, except that a group whose leaves are not a chain of blocks
    run once per step (experts picked by a router, a block called twice, branches fed the same input)
    is taken whole, as one unit. `runs_once(name)`, `linked(name)` (its input is the previous block's
    output) tell, from a recorded step; the caller orders and checks the chain."""
    units = list(leaves)
    # innermost groups first, so an outer group replaces what an inner one already replaced
    for g in sorted(groups, key=lambda x: -x.count(".")):
        mine = [u for u in units if _inside(u, g)]
        if mine and not (all(runs_once(u) for u in mine) and all(linked(u) for u in mine[1:])):
            at = units.index(mine[0])
            units = [u for u in units if u not in mine]
            units.insert(at, g)
    return units


def group_spans(units: tuple[str, ...], groups: dict[str, list[str]]) -> dict[tuple[int, int], str]:
    """(first, last) unit index -> group name, for every group whose units form a run of two or more
    of the chain and are all its units (a group checkpointed whole stores none of them). Where two
    groups cover the same run (a stage that is nothing but its `blocks` list), the outer one is kept."""
    spans: dict[tuple[int, int], str] = {}
    for g in sorted(groups, key=lambda x: x.count("."), reverse=True):
        idx = [i for i, u in enumerate(units) if _inside(u, g)]
        if len(idx) >= 2 and idx == list(range(idx[0], idx[-1] + 1)):
            spans[(idx[0], idx[-1])] = g  # outer groups come last and win
    return spans
