"""The ordering step of a search (docs/design.md §4): the chain of candidate blocks, their options.

`Ordering.order_units` records the step once at full depth with every candidate marked, and keeps the
blocks that run once per step and follow each other as a chain in execution order; without repeated
blocks, the chain is found in the step's calls (candidates.call_chain). Modules that change their
input in place are refused (a checkpoint keeps its input for the recompute).
"""

from __future__ import annotations

import contextlib
import os

import torch

from ckpt_tune.measure.forked import fork_map
from ckpt_tune.measure.op_costs import saved_bytes
from ckpt_tune.plan.kinds import BLOCK, NONE
from ckpt_tune.tune.candidates import (
    between,
    call_chain,
    chain_of,
    group_spans,
    outermost_repeated,
    outside,
    repeated_inside,
    with_parameters,
)
from ckpt_tune.tune.memory_model import cut_run
from ckpt_tune.tune.probing import ProbeSteps
from ckpt_tune.tune.repeats import find_repeat

# Longest run of consecutive blocks considered as one checkpoint segment. A segment holds all its
# blocks' saved tensors in backward, so long ones lose to shorter ones wherever blocks are alike.
# Chains of more than SEGMENT_WORK // MAX_SEGMENT blocks get shorter segments, to keep the planner's
# work (blocks × segment lengths) interactive.
MAX_SEGMENT = 8
SEGMENT_WORK = 640


class Ordering(ProbeSteps):
    """The ordering step: it sets the chain (`units`, `groups`, `spans`, `segment_keys`) and `options`."""

    def order_units(self, batch_size: int) -> None:
        """Keep blocks that run once per step in a chain; order them by execution. A group whose
        blocks do not form a chain of their own is one unit (candidates.chain_of)."""
        self.progress(f"recording batch {batch_size} at full depth (orders the blocks; also the no-checkpointing probe)")
        with self._stage("order"):
            rep = self._early_repeat()
            if rep is None:
                self._order_units(batch_size)
                return
            # this process records the ordering step, a forked one the first probes until it ends
            # (`_early_probes`: the pipe reads once this process has written to it)
            ordered, done = os.pipe()

            def job(k: int):
                if k:
                    return self._early_probes(rep, batch_size, ordered)
                try:
                    return self._order_units(batch_size)
                finally:
                    os.write(done, b"1")

            try:
                _, early = fork_map(job, [0, 1], 2, here=[0])
            finally:
                os.close(ordered)
                os.close(done)
            self._keep_early(early)

    def _set_options(self, batch_size: int) -> None:
        """The options of every block: stored, checkpointed whole, then the finer options of each kind
        offered (plan/kinds/: sub-modules, the useful op policies, offload)."""
        options = (NONE, BLOCK, *(o for k in self.kinds for o in k.offer(self, batch_size)))
        if self.options != options:  # a later search chose others (timed op policies): nothing measured holds
            self.forget_measured()
        self.options = options

    def saved_per_sample(self, batch_size: int) -> dict[str, float]:
        """Each unit's bytes per sample of the tensors its forward saves for backward, parameters left
        out (op_costs.saved_bytes, one forward at `batch_size`, measured once); the costs read them."""
        if not self.saved_per_unit:
            saved = saved_bytes(self.runner, batch_size, self.units)
            self.saved_per_unit = {u: n / batch_size for u, n in saved.items()}
        return self.saved_per_unit

    def _order_units(self, batch_size: int, why: str = "no repeated blocks") -> None:
        marked = (*self.units, *self.groups, *self._between)
        with inputs_changed(self.runner.model, marked) as changed:
            m = self.runner.measure(batch_size, units=marked)
        self._recorded_here.add(batch_size)
        # the user's step ran as it is: whatever fails from here on is ckpt-tune's (under fake tensors, the
        # real step ran before: `_first_steps`)
        self.plain_ran = self.plain_ran or self.real is self.runner
        self.runs += 1
        self._refused |= set(changed)
        if changed:
            # a checkpoint keeps its input for the recompute: one changed in place inside the region
            # fails backward (a classifier opening with Dropout(inplace=True)); refused before it runs
            self.units = tuple(u for u in self.units if u not in changed)
            self.groups = {g: v for g, v in self.groups.items() if g not in changed}
            self._between = [u for u in self._between if u not in changed]
            self.notes.append(
                "not candidates, as they change their input in place (a checkpoint keeps it for the recompute): "
                + ", ".join(sorted(changed, key=marked.index))
            )
        mk = m.timeline.markers

        def runs_once(u: str) -> bool:
            return len(mk.get("f>" + u, [])) == 1 and len(mk.get("b>" + u, [])) == 1

        def follows(a: str, b: str) -> bool:
            return mk["f>" + b][0] >= mk["f<" + a][0] and mk["b>" + b][0] <= mk["b>" + a][0]

        if self._by_calls:
            marked = list(self.units)
            self.units, self.groups = call_chain(
                marked, lambda u: len(mk.get("f>" + u, [])), runs_once, lambda u: mk["f>" + u][0], follows
            )
            self.notes.append(
                f"{why}: the chain is {len(self.units)} modules that run once, found in the "
                f"step's calls ({len(self.groups)} holding others)"
            )
        ok = [u for u in chain_of(list(self.units), self.groups, runs_once, lambda u: u in m.chained) if runs_once(u)]
        if self._between and ok:
            window = lambda u: (mk["f>" + u][0], mk["f<" + u][0], mk["b>" + u][0])  # noqa: E731
            more = between(self._between, ok, runs_once, window, self.runner.model)
            if more:
                ok += more
                self.notes.append(f"modules outside the repeated blocks, in the chain too: {', '.join(more)}")
        ok.sort(key=lambda u: mk["f>" + u][0])
        # backward must visit them in reverse forward order, each forward must end before the next starts
        chain: list[str] = []
        for u in ok:
            if chain and not follows(chain[-1], u):
                continue
            chain.append(u)
        if not chain and not self._by_calls and self._found:
            # the repeated blocks each run more than once per step (a recurrent or looped model): the
            # modules that call them are the candidates, as where there are no blocks at all
            why = f"the repeated blocks ({self.units[0] if self.units else 'none'} and others) run more than once per step"
            self._by_calls, self.groups, self._between = True, {}, []
            self.units = tuple(with_parameters(self.runner.model))
            return self._order_units(batch_size, why)
        self.units = tuple(chain)
        if self._by_calls:
            self._repeated(marked, mk)
        self.spans = group_spans(self.units, {g: v for g, v in self.groups.items() if g not in self.units})
        if not any(k.groups for k in self.kinds):  # groups are whole modules checkpointed
            self.spans = {}
        self.repeat = find_repeat(self.runner.model, self.units) if self._plain else None
        # fake steps allocate nothing and compete for no RAM: independent probes may run side by side
        self._forks = self._plain and self.runner.fake
        self._set_options(batch_size)
        keys: set[tuple[int, int]] = set(self.spans)
        if self.use_segments:
            # a segment may span blocks called as a chain: each one's input is the previous one's output
            linked = [u in m.chained for u in self.units]
            n = len(self.units)
            longest = max(2, min(MAX_SEGMENT, SEGMENT_WORK // max(n, 1)))
            keys |= {
                (i, j) for i in range(n) for j in range(i + 1, min(i + longest, n)) if all(linked[i + 1 : j + 1])
            }
        self.segment_keys = tuple(sorted(keys))
        # the same configuration as the "none" probe at this batch (extra markers allocate nothing)
        tl = m.timeline
        none = (0,) * len(self.units)
        self._order_cut = (batch_size, cut_run(tl.live_at, tl.max_between, tl.markers, self.units, none), m.static_bytes)

    def _repeated(self, marked: list[str], mk: dict[str, list[int]]) -> None:
        """Modules that run more than once per step (docs/design.md §4): inside a unit, a finer option of
        that unit (`repeats`); outside every unit (a loop in the model's own forward), the floor's set
        (`_looping`)."""
        calls = lambda n: mk.get("f>" + n, [])  # noqa: E731
        backward = lambda n: bool(mk.get("b>" + n))  # noqa: E731
        names = [n for n in marked if n not in self._refused]
        if any(k.inside for k in self.kinds):
            window = lambda u: (mk["f>" + u][0], mk["f<" + u][0])  # noqa: E731
            self.repeats = repeated_inside(self.runner.model, self.units, names, calls, window, backward)
        rest = [n for n in outside(self.runner.model, self.units) if n in names]
        self._looping = tuple(outermost_repeated(self.runner.model, rest, calls, backward))
        shown = [f"{u}.{sub}" for u, opt in self.repeats.items() for sub in opt.split("+")]
        if shown:
            self.notes.append(
                "modules that run more than once per step, offered checkpointed at each call: "
                + ", ".join(f"{n} ({len(calls(n))} calls)" for n in shown)
            )


@contextlib.contextmanager
def inputs_changed(model: torch.nn.Module, names):
    """Yields the set of `names` whose forward changed one of its tensor arguments in place (its
    version counter moved between the call and the return), filled as the step runs."""
    changed: set[str] = set()
    before: dict[str, list] = {}

    def pre(name):
        def hook(mod, args, kwargs):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            before[name] = [(t, t._version) for t in leaves if isinstance(t, torch.Tensor)]

        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            if any(t._version != v for t, v in before.pop(name, ())):
                changed.add(name)

        return hook

    handles = []
    for name in dict.fromkeys(names):
        mod = model.get_submodule(name)
        handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(name), with_kwargs=True))
    try:
        yield changed
    finally:
        for h in handles:
            h.remove()
