"""Runs of identical blocks: record the probes on a shortened chain, extend the terms to full depth.

A 7B decoder is 32 identical layers, and every probe step would run all of them. A run of at least
MIN_RUN consecutive chain units that are children of one container, in its order, with the same
`signature` (type; every sub-module's type, parameter and buffer shapes/dtypes/requires_grad and plain
attributes other than the layer's index) is shortened while probing to its first unit, four (or five)
middle units and its last, so that an even number r of units is removed and every unit keeps the
parity of its index (the even/odd probes show it the same pairs). The container's `_modules` is
swapped for the step: `named_modules` keeps the full model's names, and a slice of a ModuleList (as
Hugging Face forwards take) holds the same modules. Then `extend`, per pair p:

    d, F of a removed unit     = those of the kept middle unit of its parity (units two apart are
                                 checked equal)
    B of unit i copying s      = B_s + grads_removed − ((i − s) / 2) · D_p
    D_p                        = B(middle k) − B(middle k + 2), checked equal for both parities
    grads_removed              = what the removed blocks add to the first unit's B (their gradients),
                                 from the full-depth step order_units records
    static                     = the full model's parameters + optimizer state (that same step)
    fixed                      = max(before the first block, after backward + Δ): Δ, what the
                                 removed blocks add after backward (gradients, optimizer step), from it

B_i is measured above the prefix P_i, which counts what earlier blocks stored in forward but freed
before backward (autocast's casts of biases): hence D_p differs from two blocks' gradients. The
full-depth step's pair (0, 0) terms are checked against the extension (`check_against`); any mismatch
means full-depth recording (searcher.py). Verification still runs the chosen plan at full depth.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ckpt_tune.tune.memory_model import UNAVAILABLE, BlockTerms, RunCut, Terms

# Shortest run worth shortening: six units are recorded in its place (two or more removed).
MIN_RUN = 8
# Attributes that number a layer (and so differ between identical layers).
_INDEX_ATTRS = ("idx", "index", "layer_id", "layer_number", "layer_num")
_PLAIN = (bool, int, float, str, type(None))


class NotRepeated(Exception):
    """The shortened recording did not show identical middle units: record at full depth."""


def _attrs(mod: nn.Module) -> tuple:
    out = []
    for k, v in sorted(vars(mod).items()):
        if k.startswith("_") or k == "training" or any(s in k.lower() for s in _INDEX_ATTRS):
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)):
            out.append((k, v))
    return tuple(out)


def signature(mod: nn.Module) -> tuple:
    """What makes two blocks interchangeable for the memory model."""
    return tuple(
        (
            name,
            type(m),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters(recurse=False)),
            tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False) if b is not None),
            _attrs(m),
        )
        for name, m in mod.named_modules()
    )


@dataclass(frozen=True)
class Repeat:
    """Chain units first..last (inclusive, full indices) are identical children of `parent`. Shortened,
    the run keeps its first unit, `middles` (4 or 5) middle units and its last: an even number of units
    is removed, so every unit keeps the parity of its index and takes its terms from the probe runs
    (even/odd checkpointed) it would have at full depth. `kept`: the parent's `_modules` keys then."""

    parent: str
    first: int
    last: int
    middles: int
    kept: tuple[str, ...]
    full_units: tuple[str, ...]

    @property
    def removed(self) -> int:
        return self.last - self.first - 1 - self.middles

    @property
    def short_units(self) -> tuple[str, ...]:
        u = self.full_units
        return (*u[: self.first + 1 + self.middles], *u[self.last :])

    def full_index(self, s: int) -> int:
        """The full chain index of short unit s."""
        return s if s <= self.first + self.middles else s + self.removed

    def source(self, i: int) -> int:
        """The short unit whose terms full unit i takes (of i's parity)."""
        a, e, h = self.first, self.last, self.middles
        if i <= a + h:
            return i
        if i < e:  # removed: the first or second middle unit, whichever has i's parity
            return a + 1 + (i - a - 1) % 2
        return i - self.removed

    def extended(self) -> dict[str, str]:
        """Full units whose terms are copied from another unit's recording -> that unit."""
        short = self.short_units
        return {
            u: short[self.source(i)] for i, u in enumerate(self.full_units) if self.first + self.middles < i < self.last
        }


def _split(name: str) -> tuple[str, str]:
    parent, _, key = name.rpartition(".")
    return parent, key


def find_repeat(model: nn.Module, units: tuple[str, ...]) -> Repeat | None:
    """The longest run of at least MIN_RUN identical consecutive units of one container, or None."""
    sigs: dict[str, Any] = {}

    def sig(u: str):
        if u not in sigs:
            sigs[u] = (type(model.get_submodule(u)), signature(model.get_submodule(u)))
        return sigs[u]

    best: tuple[int, int] | None = None
    n, i = len(units), 0
    while i < n:
        parent, _ = _split(units[i])
        keys = list(model.get_submodule(parent)._modules) if parent else list(model._modules)
        j = i
        while j + 1 < n:
            p2, k2 = _split(units[j + 1])
            _, k1 = _split(units[j])
            if p2 != parent or k2 not in keys or keys.index(k2) != keys.index(k1) + 1 or sig(units[j + 1]) != sig(units[i]):
                break
            j += 1
        if j - i + 1 >= MIN_RUN and (best is None or j - i > best[1] - best[0]):
            best = (i, j)
        i = j + 1
    if best is None:
        return None
    a, e = best
    parent = _split(units[a])[0]
    if not parent:
        return None  # the model itself is the container: nothing to swap safely
    h = 4 if (e - a - 1 - 4) % 2 == 0 else 5
    gone = {_split(units[i])[1] for i in range(a + 1 + h, e)}
    kept = tuple(k for k in model.get_submodule(parent)._modules if k not in gone)
    return Repeat(parent, a, e, h, kept, tuple(units))


@contextlib.contextmanager
def shortened(model: nn.Module, rep: Repeat, forward_only: bool = False):
    """The model with the run shortened (see the module docstring). For a training step every gradient
    is freed first, so the step's optimizer sees only the shortened model's, and the removed blocks' are
    put back after; `forward_only`: no backward runs, every gradient stays as it is."""
    parent = model.get_submodule(rep.parent)
    full = parent._modules
    removed = [] if forward_only else [p for k, m in full.items() if k not in rep.kept for p in m.parameters()]
    grads = [(p, p.grad) for p in removed]
    if not forward_only:
        for p in model.parameters():
            p.grad = None
    parent._modules = OrderedDict((k, full[k]) for k in rep.kept)
    try:
        yield
    finally:
        parent._modules = full
        for p, g in grads:
            p.grad = g


def extend(
    short: Terms, rep: Repeat, static: int, fixed: int, grads_removed: int, last_f_shift: int = 0, measured: dict | None = None
) -> Terms:
    """Full-depth terms from the shortened recording's (module docstring).

    B_i is measured above the stored prefix P_i, and P_i counts what earlier blocks stored in forward
    but freed before backward (autocast's casts of biases, say): B falls by the same amount D_p per two
    blocks down a run for pair p, the removed blocks' gradients included. So a full unit i that takes
    short unit s's terms, with i - s = ΔE more earlier units (even), has
        B_i = B_s + grads_removed − (ΔE / 2) · D_p
    where grads_removed is what the removed blocks add to the first unit's B (their gradients, from
    the full-depth step). The chain's last unit's forward window runs past the end of forward, where
    those transients are freed; if its peak comes after that, its F depends on how many blocks there
    are, which is not modelled: `last_f_shift` (the full-depth step's F of the last unit minus the
    shortened step's, pair (0, 0)) must be 0. Raises NotRepeated unless that holds and middle units
    two apart have equal d and F and the same D_p."""
    a = rep.first
    m = short.blocks[a + 1 : a + 5]
    if any(m[j].d != m[j + 2].d or m[j].F != m[j + 2].F for j in (0, 1)):
        raise NotRepeated("middle blocks store or peak differently in forward")
    two = [tuple(x - y for x, y in zip(m[j].B, m[j + 2].B, strict=True)) for j in (0, 1)]
    if two[0] != two[1]:
        raise NotRepeated("middle blocks' backward terms do not change evenly along the run")
    if last_f_shift:
        raise NotRepeated(f"the last block's forward peak depends on the depth ({last_f_shift:+d} B at full depth)")
    blocks = []
    for i in range(len(rep.full_units)):
        s = rep.source(i)
        bt = short.blocks[s]
        half = (i - s) // 2
        B = tuple(x if x >= UNAVAILABLE else x + grads_removed - half * dp for x, dp in zip(bt.B, two[0], strict=True))
        blocks.append(BlockTerms(bt.d, bt.F, B))
    return replace(
        short, units=rep.full_units, static=static, fixed=fixed, blocks=tuple(blocks), measured=dict(measured or {}),
        segments={}, groups={},
    )


def check_against(terms: Terms, cut: RunCut) -> None:
    """The extended terms of pair (0, 0) against a full-depth run with no checkpointing (raises NotRepeated)."""
    for i, bt in enumerate(terms.blocks):
        if (bt.d[0], bt.F[0], bt.B[0]) != (cut.d[i], cut.F[i], cut.B[i]):
            raise NotRepeated(f"the extended terms of block {terms.units[i]} differ from the full-depth step's")


def extended_fixed(cuts: list[RunCut], delta_after: int) -> int:
    """The full model's fixed term from the shortened runs: the part after backward (optimizer step)
    grows by what the removed blocks add there, measured once at full depth."""
    return max(max(c.before, c.after + delta_after) for c in cuts)


def extend_forward(forward: dict[str, float], rep: Repeat) -> dict[str, float]:
    """Per-module forward costs of the full model: each removed unit (and its sub-modules) costs what
    the first middle unit does."""
    out = dict(forward)
    for unit, ref in rep.extended().items():
        for k, v in forward.items():
            if k == ref or k.startswith(ref + "."):
                out.setdefault(unit + k[len(ref) :], v)
    return out


def count_flops(runner, batch_size: int) -> tuple[dict[str, float], dict[str | None, float]]:
    """`StepRunner.count_flops` after the warm-up `time_step` does first, so the counts are the same."""
    runner.warm_up(batch_size)
    return runner.count_flops(batch_size)
