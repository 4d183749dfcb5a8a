"""`Study`: the recorded steps of one diagnosis and the checkpoint plans found on them.

Steps are recorded once per (batch size, checkpointed blocks) and cached as moments (sharding.Moment).
`sharding` says what a moment is under `--world-size N --shard S`: "measured" when the study's runner
records rank 0 under PyTorch's own engine (measure/sharded.py; on the CPU and under fake tensors), so a
moment is already one GPU's and `per_gpu` leaves it alone; "arithmetic" when it cannot (a CUDA device),
where moments are one device's and `per_gpu` divides them (tune/sharding.py). The remedies
(remedies.py) are built from what a study records and plans; `result` assembles the Diagnosis.

One fake process group exists per process: a sharded runner (`fresh_runner`) is never entered while the
study's own runner is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from torch import nn

from ckpt_tune.diagnosis.result import Diagnosis, Remedy, rank_remedies
from ckpt_tune.measure.device import Budget
from ckpt_tune.measure.profiler import StepProfile, build_profile, module_records
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.measure.tensors import unique_bytes
from ckpt_tune.plan.apply import own_checkpointing_paused
from ckpt_tune.plan.entry import Entry
from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.tune.moments import moments_of
from ckpt_tune.tune.planner import Solution, min_peak
from ckpt_tune.tune.searcher import Searcher
from ckpt_tune.tune.sharding import (
    Moment,
    StaticBytes,
    accumulate_moment,
    peak_of,
    per_gpu_terms,
    shard_moment,
    static_per_gpu,
)
from ckpt_tune.tune.verify import DIAGNOSIS_TIGHTENINGS, plan_and_verify, solving

Names = tuple[Entry, ...]  # a checkpoint plan: its entries, in execution order


class Study:
    """The recorded steps of one diagnosis (cached per batch size and checkpointed blocks) and the
    remedies built from them. Moments are kept as recorded: rank 0's under a sharded runner
    (`sharding` "measured"), else one device's, which `per_gpu` divides by arithmetic."""

    def __init__(
        self,
        model: nn.Module,
        runner: StepRunner,
        step: StepSettings,
        target: str,
        batch_size: int,
        budget: Budget,
        n: int,
        shard: str,
        lora_rank: int,
        progress: Callable[[str], None] | None,
    ) -> None:
        self.model, self.runner, self.step, self.target = model, runner, step, target
        self.b, self.budget, self.usable = batch_size, budget, budget.usable_bytes
        self.n, self.shard, self.lora_rank = n, shard, lora_rank
        # vocab.SHARDINGS: how a per-GPU figure is had (see the module docstring)
        self.sharding = "none" if n == 1 else "measured" if getattr(runner, "world_size", 1) == n else "arithmetic"
        # the sharded runner's shard units (session.build_runner's, the planner's blocks)
        self.shard_units: tuple[str, ...] | None = getattr(runner, "units", None) if self.sharding == "measured" else None
        self.say: Callable[[str], None] = progress or (lambda msg: None)
        # set by start(), from the first recorded step
        self.prof: StepProfile | None = None
        self.searcher: Searcher | None = None
        self.units: tuple[str, ...] = ()  # checkpoint candidates, in execution order
        self.gathered = 0  # the all-gathered working set of ZeRO-3/FSDP, bytes
        self.in_flight = 0  # one autograd node's parameter gradients during accumulation, bytes
        self.states: StaticBytes | None = None  # weights, gradients, optimizer state per GPU
        self.base: Moment | None = None  # today's peak per GPU
        # what the remedies find
        self.raw: dict[tuple[int, Names], tuple[Moment, ...]] = {}
        self.remedies: list[Remedy] = []
        self.notes: list[str] = []
        self.floor: Remedy | None = None
        # sharding stages chosen by arithmetic while the runner is open, recorded after it closed
        # (shard_remedies.sharding, shard_remedies.sharded_runs)
        self.shard_choices: list = []
        self._min_plan: tuple[Names, float] | None = None
        self._recording = False  # True while self.runner is open
        self._held: contextlib.ExitStack | None = None  # what `recording` undoes when the runner closes

    @property
    def fits(self) -> bool:
        """Today's step fits the budget (False until start() has recorded it)."""
        return self.base is not None and self.base.total <= self.usable

    def add(self, *remedies: Remedy | None) -> None:
        self.remedies.extend(r for r in remedies if r is not None)

    # -- recorded steps ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Open the runner: within the `with`, `moments` may record steps it has not seen yet."""
        with self.runner, contextlib.ExitStack() as self._held:
            self._recording = True
            try:
                yield
            finally:
                self._recording = False

    def moments(self, b: int, names: Names = ()) -> tuple[Moment, ...]:
        key = (b, tuple(names))
        if key not in self.raw:
            if not self._recording:  # the runner's optimizer is gone once it closed: a record now would be wrong
                raise RuntimeError(f"diagnose: batch {b} with {names} was not recorded while the runner was open")
            self.say(f"recording batch {b}" + (f", {len(names)} blocks checkpointed" if names else ""))
            self.raw[key] = moments_of(self.runner.measure(b, checkpoint=list(names), attribute=True))
        return self.raw[key]

    def per_gpu(self, m: Moment) -> Moment:
        """One GPU's moment: a recorded rank-0 moment as it is, one device's divided by arithmetic."""
        if self.sharding != "arithmetic":
            return m
        return shard_moment(m, self.n, self.shard, self.gathered)

    def fresh_runner(self, settings: StepSettings | None = None, world_size: int = 1, shard: str = "none") -> StepRunner:
        """A new runner for the study's model under other `settings`, to enter once the study's own runner
        is closed: sharded like the study's when that one records rank 0, or as asked (`world_size` > 1,
        `shard`), else a plain one. The two share the model, and one fake process group can exist per
        process: entering one while the study's runner is open is refused here."""
        if self._recording:
            raise RuntimeError("diagnose: a second runner on the model while the study's own runner is open")
        settings = settings or self.step
        if world_size == 1 and self.sharding == "measured":
            world_size, shard = self.n, self.shard
        batch_fn, loss_fn = self.runner.batch_fn, self.runner.loss_fn
        if world_size > 1:
            from ckpt_tune.measure.sharded import ShardedRunner

            return ShardedRunner(self.model, batch_fn, loss_fn, settings, world_size=world_size, shard=shard, units=self.shard_units_of())
        return StepRunner(self.model, batch_fn, loss_fn, settings)

    def shard_units_of(self) -> tuple[str, ...]:
        """Shard units of a sharded runner of this model: the study's runner's, else the planner's blocks
        (as session.build_runner shards them for `search` and `diagnose`)."""
        if self.shard_units is not None:
            return self.shard_units
        from ckpt_tune.tune.candidates import find_blocks

        return tuple(find_blocks(self.model))

    def peak(self, raws: Iterable[Moment], fn: Callable[[Moment], Moment] = lambda m: m) -> Moment:
        return peak_of(self.per_gpu(fn(m)) for m in raws)

    def start(self) -> None:
        """Record today's step: its profile, moments, timing, checkpoint candidates and states per GPU."""
        b = self.b
        self.say(f"recording batch {b}")
        m = self.runner.measure(b, attribute=True)
        timing = self.runner.time_step(b, repeats=3)
        self.prof = build_profile(m, module_records(self.model, m, timing), None, timing, self.step, self.target)
        if self.sharding == "measured":
            engine = "ZeroRedundancyOptimizer" if self.shard == "zero1" else "FSDP2 fully_shard"
            self.prof = replace(self.prof, measured_by=f"{self.prof.measured_by}; rank 0 of {self.n} under {self.shard} "
                                f"({engine}, a fake process group: measure/sharded.py)")
        self.raw[(b, ())] = moments_of(m)
        # today's step as the user runs it, recorded; the checkpoint plans replace a library's own
        # checkpointing, off from here while the runner is open (plan/apply.py own_checkpointing_paused)
        paused = self._held.enter_context(own_checkpointing_paused(self.model))
        self.notes.extend(p.note(recorded_with_it=True) for p in paused)
        # a sharded runner's steps are rank 0's already: the searcher plans on them as they are
        n, shard = (self.n, self.shard) if self.sharding == "measured" else (1, "none")
        self.searcher = Searcher(self.runner, progress=self.say, world_size=n, shard=shard)
        if self.searcher.units:
            self.searcher.order_units(1)
        self.units = self.searcher.units
        rec = {r.name: r for r in self.prof.modules}
        leaves = [n for n, mod in self.model.named_modules() if next(mod.children(), None) is None]
        # the all-gathered working set of ZeRO-3/FSDP for the arithmetic: one wrapped block, or one layer
        # without blocks (a recorded sharded step holds its real all-gather buffers in its timeline)
        self.gathered = max([rec[u].param_bytes for u in self.units if u in rec] or [rec[n].param_bytes for n in leaves if n in rec] or [0])
        # one autograd node's parameter gradients (a layer's weight and bias), in flight during accumulation
        # (this rank's shards under a sharded runner)
        self.in_flight = max(
            [unique_bytes(p for p in mod.parameters(recurse=False) if p.requires_grad) for mod in self.model.modules()] or [0]
        )
        if self.sharding == "measured":  # rank 0's own shards; its all-gather buffers are in the moments
            self.states = StaticBytes(self.prof.param_bytes, self.prof.grad_bytes, self.prof.optimizer_bytes)
        else:
            self.states = static_per_gpu(self.prof.param_bytes, self.prof.grad_bytes, self.prof.optimizer_bytes, self.n, self.shard, self.gathered)
        self.base = self.peak(self.raw[(b, ())])
        if not self.units:
            self.notes.append("no repeated blocks (children of a ModuleList/Sequential) found: checkpointing has no candidates")

    def result(self) -> Diagnosis:
        p = self.prof
        return Diagnosis(
            target=self.target, device=p.device, precision=p.precision, optimizer=p.optimizer, batch_size=self.b,
            budget=self.budget, world_size=self.n, shard=self.shard, sharding=self.sharding, profile=p,
            moments=tuple(self.per_gpu(m) for m in self.raw[(self.b, ())]), states=self.states, floor=self.floor,
            remedies=rank_remedies(self.remedies), units=self.units, notes=tuple(self.notes),
        )

    # -- checkpoint plans -------------------------------------------------------------------------
    def terms(self, b: int) -> Terms:
        t = self.searcher.terms(b)
        if self.sharding == "arithmetic":
            t = per_gpu_terms(t, self.prof.param_bytes, self.prof.optimizer_bytes, self.n, self.shard, self.gathered)
        return t

    def step_ms(self) -> float:
        """Today's step time (ms), the denominator of every recompute fraction."""
        return self.searcher.step_ms(self.b)

    def fit_plan(
        self, b: int, accumulate: bool = False, terms_fn: Callable[[Terms], Terms] | None = None
    ) -> tuple[Names, float, Moment]:
        """The cheapest plan at micro-batch b whose recorded per-GPU peak fits (the planner's choice,
        tightened by any overshoot, as Searcher.search); else the smallest-peak plan. (names, recompute ms, peak)
        `terms_fn`: a change to the memory model first (e.g. some options priced out)."""
        fn = (lambda m: accumulate_moment(m, self.prof.grad_bytes, self.in_flight)) if accumulate else (lambda m: m)
        terms, costs = self.terms(b), self.searcher.costs(b)
        if terms_fn is not None:
            terms = terms_fn(terms)

        def run(sol: Solution) -> tuple[int, tuple[Names, Moment]]:
            names = self.names(sol.choice)
            pk = self.peak(self.moments(b, names), fn)
            return pk.total, (names, pk)

        room = self.usable - (self.states.grads if accumulate else 0)
        found = plan_and_verify(solving(terms, costs), self.usable, run, room, tightenings=DIAGNOSIS_TIGHTENINGS)
        if found is not None:
            sol, (names, pk) = found
            return names, sol.cost, pk
        mp = min_peak(terms, costs)
        names = self.names(mp.choice)
        return names, mp.cost, self.peak(self.moments(b, names), fn)

    def min_plan(self) -> tuple[Names, float]:
        """The smallest-peak plan at the batch size: (names, recompute ms)."""
        if self._min_plan is None:
            mp = min_peak(self.terms(self.b), self.searcher.costs(self.b))
            self._min_plan = (self.names(mp.choice), mp.cost)
        return self._min_plan

    def compose(
        self, fn: Callable[[Moment], Moment], terms_fn: Callable[[Terms], Terms] | None = None
    ) -> tuple[Moment, Names, float]:
        """A state-side remedy alone; else with the cheapest checkpoint plan that fits with it (planned on
        `terms_fn(terms)`, the remedy's change to the memory model, and checked on recorded moments);
        else with the smallest-peak plan. (peak, plan, recompute fraction)"""
        alone = self.peak(self.moments(self.b), fn)
        if alone.total <= self.usable or not self.units:
            return alone, (), 0.0
        if terms_fn is not None:
            found = self.cheapest_plan(fn, terms_fn)
            if found is not None:
                return found
        names, cost = self.min_plan()
        both = self.peak(self.moments(self.b, names), fn)
        if both.total <= self.usable:
            return both, names, cost / self.step_ms()
        return alone, (), 0.0

    def cheapest_plan(
        self, fn: Callable[[Moment], Moment], terms_fn: Callable[[Terms], Terms]
    ) -> tuple[Moment, Names, float] | None:
        terms, costs = terms_fn(self.terms(self.b)), self.searcher.costs(self.b)

        def run(sol: Solution) -> tuple[int, tuple[Names, Moment]]:
            names = self.names(sol.choice)
            pk = self.peak(self.moments(self.b, names), fn)
            return pk.total, (names, pk)

        found = plan_and_verify(solving(terms, costs), self.usable, run, tightenings=DIAGNOSIS_TIGHTENINGS)
        if found is None:
            return None
        sol, (names, pk) = found
        return pk, names, sol.cost / self.step_ms()

    def names(self, choice: tuple[int, ...]) -> Names:
        """The plan entries of a planner choice (whole blocks, a block's sub-module where the searcher offers
        one, or a run of blocks checkpointed as one segment)."""
        return tuple(self.searcher.names(choice))

    def ckpt_label(self, names: Names) -> str:
        return f"{len(names)} of {len(self.units)} blocks"
