"""Probe steps of a search, and how they are shared out over the cores (docs/design.md §3, §4).

`ProbeSteps` is the part of a search (search_state.py) that records probe steps on the shortened chain
of identical blocks (repeats.py) and shares independent work out over forked processes
(measure/forked.py):

- the first probes, recorded by a forked process while the ordering step runs (`_early_probes`);
- every probe of the batches the search asks for next, with the FLOP counts there, in one share-out
  (`prefetch`, `_record_shorts`);
- at the first batch the search settles on, the plan the fitted terms choose there, verified beside that
  batch's probes, and the frontier solved beside them (`_likely_plan`);
- the probes' cuts extended to full-depth terms (`_shortened_terms`).

It reads and fills the search's state (`SearchState`: its runner, chain, options and caches). Whatever
it records is the same to the byte on one core or many (tests/test_repeats.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import time

import torch

from ckpt_tune.measure.forked import fork_map, resident_bytes, usable_workers
from ckpt_tune.measure.runner import Measurement
from ckpt_tune.measure.scratch import forked_alike
from ckpt_tune.tune.memory_model import (
    RunCut,
    Terms,
    combine,
    cut_run,
    plan_entries,
    probe_configs,
    segments_of,
    with_step_of,
)
from ckpt_tune.tune.planner import solve
from ckpt_tune.tune.repeats import Repeat, check_against, extend, extended_fixed, find_repeat, shortened
from ckpt_tune.tune.search_state import SearchState

# Shortened probes recorded alongside the ordering step whatever its length; more while it runs.
EARLY_PROBES = 2
# A process's first fake step at a batch costs about this many later ones (the fake mode works out each
# op's outputs once per shape): after a real step of its own beside the probes, this process takes
# queued probes only while more than this many per forked process are left.
FIRST_FAKE_STEPS = 3


class OptionFailed(Exception):
    """The probe step of one finer option failed (ProbeSteps._option_probe)."""

    def __init__(self, option: str) -> None:
        super().__init__(option)
        self.option = option


class ProbeSteps(SearchState):
    """Probe steps on the shortened chain and their share-outs, for `Searcher` (see the module docstring)."""

    @property
    def _calibrates_here(self) -> bool:
        """Fake steps with the CPU allocator's rules, where a forked process would calibrate a kernel's
        scratch on fewer threads than this one's real steps run (scratch.forked_alike): the first probe
        of each batch (no checkpointing: every call of the step) is recorded in this process before any
        other is shared out (`_first_here`), and none is recorded beside the ordering step."""
        return self.runner.fake and self.runner.settings.fake_target == "cpu" and not forked_alike()

    def _first_here(self, batches: list[int]) -> list[int]:
        """Of a share-out's items at `batches` (their probe's batch; None for other items), the first
        of each batch no step of this process has recorded yet, where `_calibrates_here`: `fork_map`'s
        `first`, taken as recorded here."""
        if not self._calibrates_here:
            return []
        first = {}
        for k, b in enumerate(batches):
            if b is not None and b not in self._recorded_here:
                first.setdefault(b, k)
        self._recorded_here.update(first)
        return list(first.values())

    def _leave(self, workers: int) -> int:
        """Queued probes this process leaves to the forked ones after its real step (`fork_map`'s `leave`)."""
        return FIRST_FAKE_STEPS * (workers - 1)

    def _early_repeat(self) -> Repeat | None:
        """The run of identical blocks of the chain as the model declares it (find_blocks' order), when
        the first shortened probes may be recorded alongside the ordering step: fake steps, a plain or
        sharded runner, one batch per iteration, and room for a second process."""
        if not (self._plain and self.runner.fake and self._kind == 1 and usable_workers(2, resident_bytes()) >= 2):
            return None
        if self._calibrates_here:  # the first probes' calls are calibrated by the ordering step, here
            return None
        return find_repeat(self.runner.model, self.units)

    def _early_probes(self, rep: Repeat, b1: int, ordered: int) -> tuple | None:
        """In a forked process, while the ordering step is recorded: the probes of the shortened chain
        that every search records first (no checkpointing at both small batches: `EARLY_PROBES`), then
        the others at both, one after another until the file descriptor `ordered` can be read (the
        ordering step has ended), for the chain, run and options as the model declares them.
        `_keep_early` keeps them where the ordering step finds the same. Nothing of this process
        survives it: a failure means only that the probes are recorded later, as they would have been."""
        if os.getpid() == self._pid:  # the forked process died and fork_map runs its item here: too late
            return None
        try:
            self.repeat = rep
            self._set_options(b1)
            none = (0,) * len(rep.short_units)
            configs = [(label, choice) for label, choice in self._short_configs().items() if any(choice)]
            todo = [(b1, "none", none), (self.b2, "none", none), *((b, *c) for b in (b1, self.b2) for c in configs)]
            cuts = []
            for j, (b, label, choice) in enumerate(todo):
                if j >= EARLY_PROBES and select.select([ordered], [], [], 0)[0]:
                    break
                cuts.append((b, choice, *self._record_short(b, choice, label, (j + 1, len(todo)))))
            return self.units, rep, self.options, cuts
        except Exception:  # any failure: see the docstring
            return None

    def _keep_early(self, early: tuple | None) -> None:
        """Keep the probes `_early_probes` recorded if the ordering step found the chain, the run of
        identical blocks and the options they were recorded with."""
        if early is None or early[:3] != (self.units, self.repeat, self.options):
            return
        for b, choice, cut, seconds in sorted(early[3], key=lambda c: any(c[1])):  # the no-checkpointing probes first
            self._keep_short((b, choice), cut, seconds)

    @contextlib.contextmanager
    def _probe_step(self, what: str, j: int, n: int, kind: str, workers: int = 1):
        """One probe step, j of n at its batch, timed: yields a list that holds its seconds when it
        completes (`_timed` adds them to this kind's). Its progress line gives the time the remaining
        probes should take, as long each as the probes of this kind (shortened or full depth) this
        process recorded so far, `workers` at a time. In a forked process (measure/forked.py) the step
        is silent."""
        done = self._eta_s.setdefault(kind, [])
        left = f", about {sum(done) / len(done) * -(-(n - j + 1) // workers):.0f} s left for these probes" if done else ""
        on = f" ({workers} processes)" if workers > 1 else ""
        self._say(f"{what}: step {j} of {n}{on}{left}")
        seconds: list[float] = []
        t0 = time.perf_counter()
        yield seconds
        seconds.append(time.perf_counter() - t0)
        done.append(seconds[0])

    @contextlib.contextmanager
    def _option_probe(self, label: str):
        """The probe step of a policy option: a failure of the step (torch refuses the policy on this
        model, e.g. an in-place op on a kept output) drops the option instead of ending the search."""
        option = self.options[int(label.removeprefix("option"))] if label.startswith("option") else None
        try:
            yield
        except (torch.OutOfMemoryError, KeyboardInterrupt):
            raise
        except Exception as e:  # a refinement (docs/design.md §8): the option goes, the search goes on
            if option is None:
                raise
            raise OptionFailed(option) from e

    def _shortened_cut(self, batch_size: int, choice: tuple[int, ...], label: str = "none", step: tuple[int, int] = (1, 1)) -> RunCut:
        """One probe on the shortened chain (repeats.py), cached; `step`: its place among this batch's probes."""
        self._record_shorts([(batch_size, label, choice, step)])
        return self.short_cuts[(batch_size, choice)]

    def _record_short(self, batch_size: int, choice: tuple[int, ...], label: str, step: tuple[int, int], workers: int = 1) -> tuple[RunCut, float]:
        """(cut, seconds) of one probe on the shortened chain. It changes nothing of the searcher's, so
        a forked process can run it (measure/forked.py). After backward every configuration holds the
        same tensors (the gradients, the batch, the loss): only the no-checkpointing probe records the
        optimizer step, and `_keep_short` gives the others its moments (docs/design.md §4)."""
        rep = self.repeat
        short = rep.short_units
        what = f"probing batch {batch_size} on {len(short)} of {len(self.units)} blocks (identical blocks), {label} checkpointed"
        with self._probe_step(what, *step, "short", workers) as seconds, shortened(self.runner.model, rep), self._option_probe(label):
            names = plan_entries(short, self.options, choice)
            m = self.runner.measure(batch_size, checkpoint=names, units=short, optimizer_step=not any(choice))
        tl = m.timeline
        return cut_run(tl.live_at, tl.max_between, tl.markers, short, choice), seconds[0]

    def _keep_short(self, key: tuple[int, tuple[int, ...]], cut: RunCut, seconds: float) -> None:
        """Keep a shortened probe's cut; one without its optimizer step takes the step's moments from
        the no-checkpointing probe at its batch (kept first)."""
        self._timed("short", seconds)
        if any(key[1]):
            cut = with_step_of(cut, self.short_cuts[(key[0], (0,) * len(key[1]))].after)
        self.short_cuts[key] = cut

    def _short_configs(self) -> dict[str, tuple[int, ...]]:
        """The probe configurations of the shortened chain (memory_model.probe_configs)."""
        rep = self.repeat
        return probe_configs(len(rep.short_units), len(self.options), lambda s, opt: self._has(rep.full_index(s), opt))

    def _shortened_cuts(self, batch_size: int, configs: dict[str, tuple[int, ...]]) -> list[RunCut]:
        """Every probe of `configs` on the shortened chain at this batch, each as it would be recorded alone."""
        n = len(configs)
        self._record_shorts([(batch_size, label, choice, (j + 1, n)) for j, (label, choice) in enumerate(configs.items())])
        return [self.short_cuts[(batch_size, choice)] for choice in configs.values()]

    def _record_shorts(self, probes: list, timing: tuple[int, ...] = (), plan: tuple | None = None, budget: int | None = None) -> None:
        """Record the shortened probes (batch, label, choice, (j, n)) not yet recorded, count FLOPs at
        the `timing` batches not yet timed, and verify `plan` (batch, names, choice) at full depth, all
        shared out over the cores in one go (measure/forked.py): none depends on another. A
        configuration's no-checkpointing probe at its batch is recorded with it (`_keep_short` needs its
        moments)."""
        none = (0,) * len(self.repeat.short_units)
        todo = {(b, choice): (b, label, choice, step) for b, label, choice, step in probes}
        for b, _label, _choice, step in list(todo.values()):
            todo.setdefault((b, none), (b, "none", none, (1, step[1])))
        todo = {k: v for k, v in todo.items() if k not in self.short_cuts}
        items = [("short", v) for k, v in sorted(todo.items(), key=lambda kv: any(kv[0][1]))]
        # probes under fake tensors, steps on the device: step times are timed in this process when asked
        # for (nothing beside them), and the verification, a real step, runs in this process while forked
        # ones record the fake probes
        real = self.real is not self.runner
        if real:
            timing = ()
        # with a plan to verify, the frontier around its batch is solved after the FLOP count there (the
        # search's answer is most often that batch); on the small batches' terms, probed before
        rows = None
        if plan is not None and budget is not None and {self.b1, self.b2} <= set(self.probed):
            rows = (budget, plan[0], self.frontier_sizes(plan[0]), frozenset(self.probed))
        items += [("frontier" if rows and b == plan[0] else "time", b) for b in dict.fromkeys(timing) if b not in self._costs]
        items += [("verify", plan)] if plan is not None and (plan[0], plan[2]) not in self.speculated else []
        if not items:
            return
        workers = self._workers(len(items))
        # expected seconds, in probes, to take the longest first: a verification is a step at full
        # depth, a FLOP count a step with its optimizer step (the frontier's solves after it), as is
        # the no-checkpointing probe
        depth = len(self.units) / len(self.repeat.short_units)
        costs = [{"time": 1.2, "frontier": 1.5, "verify": depth}.get(k) or 1.0 + 0.2 * (not any(w[2])) for k, w in items]

        def run(item):
            kind, what = item
            t0 = time.perf_counter()
            if kind == "time":
                return self._time(what), time.perf_counter() - t0
            if kind == "frontier":
                timed = self._time(what)
                budget_, b, sizes, _ = rows
                frontier = [self._row(x, budget_, timed[0], timed[1]) for x in sizes]
                return timed, frontier, time.perf_counter() - t0
            if kind == "verify":
                return self._verify_beside(what), time.perf_counter() - t0
            b, label, choice, _step = what
            # numbered among this share-out's items: the progress line's time left is the share-out's
            return self._record_short(b, choice, label, (items.index(item) + 1, len(items)), workers)

        here = [k for k, (kind, w) in enumerate(items) if kind == "verify" and not self._fake_beside(w[2])] if real else []
        first = self._first_here([w[0] if kind == "short" and not any(w[2]) else None for kind, w in items])
        got = dict(zip(items, fork_map(run, items, workers, costs, here, self._leave(workers) if here else 0, first), strict=True))
        for (kind, what), res in sorted(got.items(), key=lambda kv: kv[0][0] != "short" or any(kv[0][1][2])):
            if kind == "time":
                self._costs[what] = res[0]
            elif kind == "frontier":
                self._costs[what] = res[0]
                budget_, b, sizes, known = rows
                self.frontiers[(self._kind, budget_, tuple(sizes), self.b1, self.b2, b)] = (res[1], self._version, known)
            elif kind == "verify":
                self._speculated(what, res[0])
            else:
                self._keep_short((what[0], what[2]), *res)

    def prefetch(self, batches: tuple[int, ...], timing: tuple[int, ...] = (), budget: int | None = None) -> None:
        """Under fake tensors with a shortened chain, record every probe of these batches (and count FLOPs
        at `timing`) in one share-out, before the search asks for them one batch at a time. A probe that
        fails here (an op policy torch refuses) is left to `terms`, which drops its option.

        With a `budget`, one batch not probed before and more than one process, the plan solved at that
        batch on terms fitted from the two small batches is verified in the same share-out (and the
        frontier around it solved): where the probed terms then give
        the same plan, the search takes that verification (`search`); the plan is still the one the
        probed terms choose, measured at full depth. Without a shortened chain the probes are recorded
        at full depth when the search asks for them (`TermStore._full_terms`): the plan is kept for that
        share-out (`_beside`)."""
        if not self._forks or self._kind != 1:
            return
        # in one process a verification beside the probes only runs sooner, or in vain where the plan differs
        alongside = budget is not None and len(batches) == 1 and self._workers(2) > 1
        plan = self._likely_plan(batches[0], budget) if alongside else None
        if self.repeat is None:
            self._beside = plan
            return
        configs = self._short_configs()
        n = len(configs)
        probes = [(b, label, choice, (j + 1, n)) for b in batches for j, (label, choice) in enumerate(configs.items())]
        # a probe that fails here is recorded again by `terms`, which drops its option or the shortened chain
        with self._stage("probe" if plan is None else "probe+verify"), contextlib.suppress(Exception):
            self._record_shorts(probes, timing, plan, budget)

    def _verify_beside(self, plan: tuple) -> int | None:
        """The peak of `plan` (batch, names, choice) verified beside the probes at its batch: on the device
        where the probes are fake (in this process, `fork_map`'s `here`), after it is recorded under fake
        tensors here and found within the budget (less `real_gap`): its prediction is on terms fitted
        through two small batches, a line that can be low by a few hundredths far from them (ResNet's
        CPU step on two threads at batch 121: 1.9% over the budget when it ran). None when it failed or
        did not fit: a guess of ours, dropped; the search verifies the plan it then chooses, and tells a
        failure there."""
        b, names, choice = plan
        if self._fake_beside(choice):  # a Measurement, for `_speculated`
            try:
                return self._measure_plan(b, names, self.runner)
            except Exception:  # the plan is run again where the search chooses it, which drops what failed
                return None
        if self.real is not self.runner:
            self._say(f"recording batch {b} with {len(names)} checkpoints under fake tensors, while the probes at that batch run")
            self.runs += 1
            self._fake_peaks[(b, choice)] = self._measure_plan(b, names, self.runner).peak_bytes
            if self._fake_peaks[(b, choice)] + self.real_gap > (self.budget or 0):
                return None
        self._say(f"verifying batch {b} with {len(names)} checkpoints, while the probes at that batch run")
        try:
            m = self._measure_plan(b, names, self.real)
            if segments_of(choice):  # its segments' terms are learned from this run (`verify`)
                self._beside_runs[(b, choice)] = m
            return m.peak_bytes
        except Exception:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return None

    def _fake_beside(self, choice: tuple[int, ...]) -> bool:
        """A plan beside the probes that is recorded under fake tensors, not run: one with segments
        (estimated terms: an estimate can be low) where the probes are fake (`_likely_plan`)."""
        return bool(segments_of(choice)) and self.real is not self.runner

    def _speculated(self, plan: tuple, peak: int | Measurement | None) -> None:
        if isinstance(peak, Measurement):  # recorded under fake tensors: its segments, for `learn_under_fake`
            self._fake_plan_runs[(plan[0], plan[2])] = peak
        elif peak is not None:
            self.runs += 1
            self.speculated[(plan[0], plan[2])] = peak

    def _likely_plan(self, b: int, budget: int) -> tuple | None:
        """(b, names, choice) of the plan the fitted terms choose at b, when its verification can be
        shared out with the probes there: b not yet probed, an iteration of one batch, and a measured
        step (not divided by arithmetic). A plan with segments is verified with them where the probes
        are real: the search learns their terms from that run (`verify`) as from one after the probes.
        With probes under fake tensors the verification is a real step, its predicted peak within the
        budget on the fitted terms; a plan with segments, whose terms are estimated, is recorded under
        fake tensors instead, in a forked process like the probes (`_fake_beside`), and the search
        learns its segments from that record before any of it runs for real (`learn_under_fake`)."""
        if b in self.probed or b in (self.b1, self.b2) or self.accum_steps != 1 or self.sharding == "arithmetic":
            return None
        t = self.fitted(b, self.b1, self.b2)
        sol = solve(t, self.costs(self.b1), budget)
        if sol is None:
            return None
        return b, tuple(sol.names(t)), sol.choice

    def _shortened_terms(self, batch_size: int) -> Terms | None:
        """Full-depth terms extended from probes on the shortened chain (repeats.extend); None when a
        probe ran out of device memory (the full-depth path decides what then)."""
        rep = self.repeat
        short = rep.short_units
        configs = self._short_configs()
        order_b, order_cut, static = self._order_cut
        try:
            cuts = self._shortened_cuts(batch_size, configs)
            # what the removed blocks add after backward (their gradients, the optimizer step's
            # temporaries) and to the first block's backward (their gradients): from the full-depth step
            none = self._shortened_cut(order_b, (0,) * len(short))
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None
        delta, grads = order_cut.after - none.after, order_cut.B[0] - none.B[0]
        last = len(self.units) - 1
        f_shift = order_cut.F[last] - none.F[rep.source(last)]
        terms = combine(cuts, short, static, batch_size, self.options)
        measured = {(0,) * len(self.units): static + order_cut.peak_above_static} if batch_size == order_b else {}
        terms = extend(terms, rep, static, extended_fixed(cuts, delta), grads, f_shift, measured)
        if batch_size == order_b:
            check_against(terms, order_cut)  # the full-depth step checks what it can
        return terms
