"""The recorded terms of a search, per batch (docs/design.md §4), and the steps that verify a plan.

`TermStore.terms(b)` records the probes at batch b (on the shortened chain of identical blocks where
there is one, probing.py; else at full depth, shared out over the cores under fake tensors) and keeps
the memory model's terms. Segments' terms are estimated from the blocks' until a verified plan that has
them teaches their measured terms (`learn_segments`); a segment whose recompute failed is forbidden.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ckpt_tune.measure.forked import fork_map
from ckpt_tune.measure.runner import Measurement, StepRunner
from ckpt_tune.tune.batch_search import largest
from ckpt_tune.tune.memory_model import (
    RunCut,
    SegmentTerms,
    Terms,
    combine,
    cut_run,
    estimate_segments,
    predict,
    probe_configs,
    segment_terms,
    segments_of,
    with_step_of,
)
from ckpt_tune.tune.probing import OptionFailed, ProbeSteps
from ckpt_tune.tune.repeats import NotRepeated
from ckpt_tune.tune.search_state import REAL_ROOM, first_line
from ckpt_tune.tune.sharding import peak_of, per_gpu_terms, shard_moment


class TermStore(ProbeSteps):
    """Terms per batch and kind of iteration (`_terms_by_kind`), their segments, the verifications."""

    def terms(self, batch_size: int) -> Terms:
        """Terms of the iteration searched, probed at this batch (cached). With gradient accumulation
        the probes run two micro-batches and are cut at the second, where every gradient is live (as
        in every later micro-batch); the first is part of the iteration's fixed term."""
        if batch_size not in self.probed:
            self._at = batch_size
            with self._stage("probe"):
                while True:
                    try:
                        self.probed[batch_size] = self._probe(batch_size)
                        break
                    except OptionFailed as e:
                        self._drop_option(e.option, e.__cause__)
        return self._restrict(self.probed[batch_size])

    def _probe(self, batch_size: int) -> Terms:
        if self._over_if_probed(batch_size):
            return self._beyond_probes(batch_size)
        t = None
        if self.repeat is not None and self._kind == 1:
            try:
                t = self._shortened_terms(batch_size)
            except (torch.OutOfMemoryError, OptionFailed, KeyboardInterrupt):
                raise
            except Exception as e:  # NotRepeated, or the shortened chain failed: a refinement (§8)
                rep, self.repeat = self.repeat, None
                self.notes.append(
                    f"blocks {self.units[rep.first]}..{self.units[rep.last]} look identical but were recorded "
                    f"at full depth: {e if isinstance(e, NotRepeated) else first_line(e)}"
                )
                self.probed.clear()  # every batch on full-depth probes alike
                self.short_cuts.clear()
        if t is None:
            t = self._full_terms(batch_size)
            if t is None:
                # on a real GPU the no-checkpointing probe at a large batch can exceed the device:
                # fall back to the line through the two small batches (verification still runs)
                torch.cuda.empty_cache()
                self.notes.append(f"batch {batch_size}: a probe ran out of device memory; terms fitted from batches {self.b1} and {self.b2}")
                return self.terms(self.b1).interpolate(self.terms(self.b2), batch_size)
        t = replace(t, groups=self.spans)
        t = self.with_segments(t)
        if self.sharding == "arithmetic":
            params, opt, _grads = self.runner.state_bytes()
            t = per_gpu_terms(t, params, opt, self.world_size, self.shard, self.gathered_bytes())
        return t

    def _over_if_probed(self, batch_size: int) -> bool:
        """With `probes_within_budget`: whether the terms of the probed batches nearest this one put its
        plain step (a probe of every search) over the budget, less REAL_ROOM. The two small batches are
        always probed, and so is a batch with no line through probed batches yet (`--batch-size`)."""
        if not self.probes_within_budget or not self.budget or batch_size in (self.b1, self.b2):
            return False
        lo, hi = self.nearest(batch_size, self.probed)
        if lo not in self.probed or hi not in self.probed:  # no line yet: probed as asked
            return False
        t, none = self.fitted(batch_size, lo, hi), (0,) * len(self.units)
        return t.measured.get(none, predict(t, none)) > self.budget * (1 - REAL_ROOM)

    def _beyond_probes(self, batch_size: int) -> Terms:
        """Terms at a batch not probed, as its plain step would run past the budget on the device: on the
        line through the probed batches nearest it (`near`), after the largest batch whose plain step
        fits is probed, so that the line runs from as close as the budget lets a real step come. The plan
        chosen on them is verified for real as any (docs/design.md §4)."""
        fits = lambda b: not self._over_if_probed(b)  # noqa: E731
        anchor = min(largest(fits, self.b2), batch_size - 1)
        if anchor > self.b2 and anchor not in self.probed:
            self.terms(anchor)
        t = self.near(batch_size)
        self._lined.add(batch_size)
        real = max(b for b in self.probed if b not in self._lined)
        note = "probes past the budget were not run on the device: batches whose plain step would exceed it rest on the probed batches nearest them"
        self.notes[:] = [n for n in self.notes if not n.startswith(note)] + [f"{note} (the largest probed: batch {real})"]
        return t

    def _full_terms(self, batch_size: int) -> Terms | None:
        """Terms from the probe runs at full depth; None when a probe ran out of device memory. Under
        fake tensors the probes are shared out over the cores (measure/forked.py)."""
        configs = probe_configs(len(self.units), len(self.options), self._has)
        n = len(configs)
        reuse = self._order_cut is not None and self._kind == 1 and self._order_cut[0] == batch_size
        todo = [(j, label, choice) for j, (label, choice) in enumerate(configs.items()) if not (reuse and not any(choice))]
        # the plan prefetch expects at this batch, verified in the same share-out (probing.py `_verify_beside`)
        beside, self._beside = self._beside, None
        plan = beside if beside is not None and beside[0] == batch_size and (beside[0], beside[2]) not in self.speculated else None
        workers = self._workers(len(todo) + (plan is not None))
        # else the step's real timing, beside the second small batch's probes, on cores they leave free
        at = self._timing_guess() if batch_size == self.b2 and plan is None and todo else None
        timed = ("time", at) if at is not None and self._workers_beside(len(todo)) > 1 else None
        if timed is not None:
            workers = self._workers_beside(len(todo))
        items = [*todo, *(x for x in (plan, timed) if x is not None)]
        # only the no-checkpointing probe records the optimizer step; the others take its moments
        # (memory_model.with_step_of), as the shortened probes do
        borrow = self._kind == 1 and self._plain

        def run(t):
            if t is timed:
                return self._time_beside(at)
            if t is plan:
                return self._verify_beside(plan)
            return self._record_full(batch_size, *t, n, workers, not (borrow and any(t[2])))

        # a real verification runs in this process (forked ones record only fake steps), first
        real_plan = plan is not None and not self._fake_beside(plan[2])
        here = [len(todo)] if (real_plan or timed is not None) and self.real is not self.runner else []
        try:
            first = self._first_here([None if any(choice) else batch_size for _j, _label, choice in todo])
            got = fork_map(run, items, workers, here=here, leave=self._leave(workers) if here else 0, first=first)
        except torch.OutOfMemoryError:
            if batch_size in (self.b1, self.b2):
                raise
            return None  # the failed step's tensors are gone with the exception
        if timed is not None:
            got.pop()
        elif plan is not None:
            self._speculated(plan, got.pop())
        cuts, static = [], 0
        if reuse:  # order_units recorded the no-checkpointing step at this batch
            cuts.append(self._order_cut[1])
            static = self._order_cut[2]
        for cut, static_bytes, seconds in got:
            self._timed("full", seconds)
            cuts.append(cut)
            static = static_bytes
        if borrow:
            after = next(c.after for c in cuts if not any(c.choice))
            cuts = [with_step_of(c, after) if any(c.choice) else c for c in cuts]
        return combine(cuts, self.units, static, batch_size, self.options)

    def _record_full(
        self, batch_size: int, j: int, label: str, choice: tuple[int, ...], n: int, workers: int, optimizer_step: bool = True
    ) -> tuple[RunCut, int, float]:
        """(cut, static bytes, seconds) of probe j of n at full depth, with or without the optimizer
        step; it changes nothing of the searcher's, so a forked process can run it."""
        with self._probe_step(f"probing batch {batch_size} ({label} checkpointed)", j + 1, n, "full", workers) as seconds, self._option_probe(label):
            m = self.runner.measure(
                batch_size, checkpoint=self.names(choice), units=self.units, accum_steps=self._kind, optimizer_step=optimizer_step
            )
        tl = m.timeline
        return cut_run(tl.live_at, tl.max_between, tl.markers, self.units, choice, pick=-1), m.static_bytes, seconds[0]

    def with_segments(self, t: Terms) -> Terms:
        """The candidate segments' terms: measured where a verified plan had them, else estimated."""
        if not self.segment_keys:
            return t
        segs = estimate_segments(t, self.segment_keys)
        for key, seg in self._measured_segments.get(t.batch_size, {}).items():
            segs[key] = SegmentTerms(
                tuple(seg.d[p] if p in seg.measured else e for p, e in enumerate(segs[key].d)),
                tuple(seg.F[p] if p in seg.measured else e for p, e in enumerate(segs[key].F)),
                tuple(seg.B[p] if p in seg.measured else e for p, e in enumerate(segs[key].B)),
                seg.measured,
            )
        return replace(t, segments=segs)

    def learn_segments(self, batch_size: int, choice: tuple[int, ...], measurement) -> None:
        """Take the terms of the plan's segments from its recorded run (replacing their estimates)."""
        segs = segments_of(choice)
        if not segs:
            return
        tl = measurement.timeline
        cut = cut_run(tl.live_at, tl.max_between, tl.markers, self.units, choice, pick=-1)
        self._version += 1
        known = self._measured_segments.setdefault(batch_size, {})
        for i, j in segs:
            prev = self._prev_of(choice, i)
            known[(i, j)] = segment_terms(cut, i, j, prev, len(self.options), known.get((i, j)))
        old = self.probed[batch_size]
        new = self.with_segments(old)
        # segments dropped from these terms (drop_estimated_segments, _forbid_segments) stay dropped
        new = replace(new, segments={k: v for k, v in new.segments.items() if k in old.segments})
        if self.sharding == "arithmetic":  # the sharding arithmetic touches static only: keep it
            new = replace(new, static=old.static)
        self.probed[batch_size] = new

    def drop_estimated_segments(self, batch_size: int) -> None:
        """Keep only segments whose terms were measured (for the predecessor options measured)."""
        self.terms(batch_size)
        self._version += 1
        t = self.probed[batch_size]
        self.probed[batch_size] = replace(t, segments={k: v for k, v in t.segments.items() if v.measured})

    def _forbid_segments(self, segs: list[tuple[int, int]], why: str) -> None:
        """Drop segments a step with them failed in (their recompute did not repeat the forward, as code
        between their blocks saved tensors for backward; their first block runs inside the model's own
        checkpoint call): every segment spanning the same blocks' links goes."""
        links = {k for i, j in segs for k in range(i + 1, j + 1)}
        failed_groups = {key for key in segs if key in self.spans}
        for key in failed_groups:
            del self.spans[key]
        self.segment_keys = tuple(
            key for key in self.segment_keys
            if key not in failed_groups and (key in self.spans or not links & set(range(key[0] + 1, key[1] + 1)))
        )
        keep = set(self.segment_keys)
        self._version += 1
        for b, t in self.probed.items():
            self.probed[b] = replace(t, segments={k: v for k, v in t.segments.items() if k in keep})
        for known in self._measured_segments.values():
            for k in [k for k in known if k not in keep]:
                del known[k]
        names = ", ".join(f"{self.units[i]}..{self.units[j]}" for i, j in segs)
        self.notes.append(f"segments {names} dropped: a step with them failed ({why.splitlines()[0][:160]})")

    def fitted(self, batch_size: int, b1: int, b2: int) -> Terms:
        if batch_size in self.probed or batch_size in (b1, b2):
            return self.terms(batch_size)
        return self.terms(b1).interpolate(self.terms(b2), batch_size)

    def near(self, batch_size: int) -> Terms:
        """Terms at this batch on the line through the two probed batches nearest it (`nearest`). Once a
        search has probed larger batches, the line through the two small ones can be far off: a step's
        peak is not linear below a few samples (a ResNet-18 at 64x64 on this CPU: 16 MB per sample between
        batches 1 and 4, 1.8 MB from 4 to 84), and that line put its batch 42 at 1.2 GB where 84 fits in
        300 MiB."""
        return self.fitted(batch_size, *self.nearest(batch_size, self.probed))

    def nearest(self, batch_size: int, probed) -> tuple[int, int]:
        """The batches `near` draws its line through, of those `probed`: (b, b) where b is probed; else
        the nearest on each side where it lies between two; else the two nearest on its one side; else the
        two small batches (`fitted`)."""
        if batch_size in probed:
            return batch_size, batch_size
        below = [b for b in probed if b < batch_size]
        above = [b for b in probed if b > batch_size]
        if below and above:
            return max(below), min(above)
        side = sorted(sorted(below or above, key=lambda b: abs(b - batch_size))[:2])
        return (side[0], side[1]) if len(side) == 2 else (self.b1, self.b2)

    def verify(self, batch_size: int, names: tuple, choice: tuple[int, ...] = ()) -> int:
        n_seg = len(segments_of(choice))
        self._at = batch_size
        # run beside the probes (counted there), of one batch per iteration
        m = self._beside_runs.pop((batch_size, choice), None) if self.accum_steps == 1 else None
        if m is None:
            self.progress(f"verifying batch {batch_size} with {len(names)} checkpoints" + (f" ({n_seg} segments)" if n_seg else ""))
            with self._stage("verify"):
                m = self._measure_plan(batch_size, names, self.real)
            self.runs += 1
        if batch_size in self.probed:
            self.learn_segments(batch_size, choice, m)
        return self._plan_peak(m)

    def _plan_peak(self, m: Measurement) -> int:
        """A plan's peak from its recorded step: as recorded, or for a sharded step that cannot run here
        its recorded single-GPU moments, sharded by arithmetic."""
        if self.sharding != "arithmetic":
            return m.peak_bytes
        from ckpt_tune.tune.moments import moments_of

        moments = (shard_moment(x, self.world_size, self.shard, self.gathered_bytes()) for x in moments_of(m))
        return peak_of(moments).total

    def over_under_fake(self, batch_size: int, names: tuple, choice: tuple[int, ...], budget: int) -> int | None:
        """Where the probes are fake, a plan is recorded under fake tensors before its verification runs
        for real: its prediction adds terms up, and the sum can be low (a diffusers UNet on two threads,
        at batch 28: 896 KiB; docs/design.md §4), where a real step past the budget is an out-of-memory
        error on a device of the budget's size. The recorded peak where it, plus `real_gap`, is past
        `budget` (the plan is not run); None where it fits, the probes are real, or the plan ran beside
        them (recorded under fake tensors first, probing.py `_verify_beside`)."""
        if self.real is self.runner or (self.accum_steps == 1 and (batch_size, choice) in self._beside_runs):
            return None
        peak = self._fake_peaks.get((batch_size, choice))
        if peak is None:
            self.progress(f"recording batch {batch_size} with {len(names)} checkpoints under fake tensors before it runs")
            with self._stage("probe"):
                peak = self._plan_peak(self._measure_plan(batch_size, names, self.runner))
            self.runs += 1
            self._fake_peaks[(batch_size, choice)] = peak
        return peak if peak + self.real_gap > budget else None

    def learn_under_fake(self, batch_size: int, names: tuple, choice: tuple[int, ...]) -> int:
        """Probes under fake tensors: a plan whose segments' terms are estimated, recorded under fake
        tensors (as exact as the probes, allocating nothing) and its segments' terms learned from that
        run, so that the plan solved again is predicted on measured terms before any of it runs for real:
        an estimate can be low, and a real step past the budget is an out-of-memory error on a device of
        the budget's size (docs/design.md §4). Its recorded peak."""
        m = self._fake_plan_runs.pop((batch_size, choice), None)  # recorded beside the probes (`_fake_beside`)
        if m is None:
            self.progress(f"recording batch {batch_size} with {len(names)} checkpoints under fake tensors (estimated segments)")
            with self._stage("probe"):
                m = self._measure_plan(batch_size, names, self.runner)
        self.learn_segments(batch_size, choice, m)
        self._fake_peaks[(batch_size, choice)] = self._plan_peak(m)
        return m.peak_bytes

    def _measure_plan(self, batch_size: int, names, runner: StepRunner | None = None) -> Measurement:
        """One recorded iteration of a plan at full depth (the verification, here or beside the probes
        in a forked process): recorded per module where the sharding arithmetic needs the moments."""
        runner = runner or self.runner
        return runner.measure(
            batch_size, checkpoint=list(names), units=self.units, attribute=self.sharding == "arithmetic", accum_steps=self.accum_steps
        )

