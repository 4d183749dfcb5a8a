"""The state a search shares among its parts (docs/design.md §4).

A search (`Searcher`, searcher.py) is one object made of parts, each in its own module and each a
subclass of `SearchState`: `Ordering` (ordering.py: the chain of candidate blocks and their options),
`StepCosts` (step_costs.py: what each option costs in time), `TermStore` (terms.py: the recorded terms
per batch, their segments, the verification steps) and `ProbeSteps` (probing.py: probes on the
shortened chain and their share-outs over the cores). Every attribute they read is set here, in
`SearchState.__init__`; what one part asks of another is declared here too, as a method that part
provides.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import torch

from ckpt_tune.errors import CkptTuneError, NoFitError
from ckpt_tune.measure.forked import Ahead, cores_left, resident_bytes, usable_workers
from ckpt_tune.measure.runner import Measurement, StepRunner
from ckpt_tune.measure.sharded import ShardedRunner
from ckpt_tune.measure.tensors import unique_bytes
from ckpt_tune.measure.timing import Timing
from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.file import FULLY_SHARDED
from ckpt_tune.plan.kinds import KINDS, RECOMPUTE, kind_of
from ckpt_tune.plan.segment import available as segment_available
from ckpt_tune.tune.candidates import find_blocks, find_groups, outside, scripted_modules, with_parameters
from ckpt_tune.tune.memory_model import (
    RunCut,
    SegmentTerms,
    Terms,
    plan_entries,
    price_out,
)
from ckpt_tune.tune.repeats import Repeat
from ckpt_tune.tune.search_result import FrontierRow, SearchResult
from ckpt_tune.tune.sharding import check_shard

# The host link offload's transfers are priced at, bytes/s: PCIe 4.0 x16 as a training host sees it
# (about 25 GB/s of its 32); `search --host-link` sets another (docs/design.md §4, offload).
HOST_LINK = 25e9


# A step runs for real only where the recorded terms put its peak this fraction under the budget: with
# probes under fake tensors (fake and real steps differ by tens of bytes; a margin for what they miss), and
# with every probe on the device because fake tensors could not record the step (terms.py `_probe`).
REAL_ROOM = 0.02

class SearchState:
    """The runners, the chain and its options, the caches and the counts of one search."""

    def __init__(
        self,
        runner: StepRunner,
        units: list[str] | None = None,
        progress: Callable[[str], None] | None = None,
        world_size: int = 1,
        shard: str = "none",
        segments: bool = False,
        candidates: frozenset[str] | None = None,
        real: StepRunner | None = None,
        host_link: float = HOST_LINK,
    ):
        # `runner` records the probes; `real` (default: the same runner) runs the steps that must be real:
        # step times, the verification, the user's plain step (docs/design.md §4, the probe policy)
        self.runner = runner
        self.real = runner if real is None else real
        self.budget: int | None = None  # the budget of the search under way (real steps stay within it)
        # every probe on the device because fake tensors could not record the step: a batch whose plain
        # step the nearest probed terms put over the budget is not probed (terms.py `_probe`)
        self.probes_within_budget = False
        self._lined: set[int] = set()  # batches whose terms were put on that line, not probed
        self.real_timed = 0  # real steps run to time the step (warm-up included), when probes are fake
        # most bytes a verified plan's real step held above its prediction on terms probed under fake
        # tensors at its batch: what fake tensors did not see (searcher.py `_below`)
        self.real_gap = 0
        self._real_timing: Timing | None = None  # the one real timing the costs scale from, then
        self._timed_beside: Timing | None = None  # a real timing run beside probes, at the batch guessed
        self._ahead: Ahead | None = None  # op policies being timed in a forked process (step_costs.py)
        # the kinds of choice the planner may use (plan/kinds/); None: every recompute kind
        self.candidates = frozenset(RECOMPUTE if candidates is None else candidates)
        self.kinds = [k for name, k in KINDS.items() if name in self.candidates]
        # the host link transfers to host memory are priced at (bytes/s), and each unit's saved bytes per
        # sample (`saved_per_sample`, measured when a kind asks: offload)
        self.host_link = host_link
        self.saved_per_unit: dict[str, float] = {}
        # also consider runs of consecutive blocks under one checkpoint (segment.py), where torch can
        self.use_segments = segments and any(k.runs for k in self.kinds) and segment_available()
        self.segment_keys: tuple[tuple[int, int], ...] = ()
        self.accum_steps = 1  # micro-batches per optimizer step of the iteration searched
        # caches per kind of iteration: 1 = one batch, 2 = a later micro-batch of an accumulated step
        self._terms_by_kind: dict[int, dict[int, Terms]] = {1: {}, 2: {}}
        self._segments_by_kind: dict[int, dict[int, dict[tuple[int, int], SegmentTerms]]] = {1: {}, 2: {}}
        # sharded data parallelism: every byte figure is per GPU (docs/design.md §6). `measured`: the
        # runner records rank 0 under the real engine (measure/sharded.py); else one device's step is
        # divided by arithmetic (sharding.py)
        self.world_size, self.shard = check_shard(world_size, shard)
        self.sharding = "none" if self.world_size == 1 else "arithmetic"
        if self.world_size > 1 and getattr(runner, "world_size", 1) == self.world_size:
            self.sharding = "measured"
        self.progress = progress or (lambda msg: None)
        self.units = tuple(units if units is not None else find_blocks(runner.model))
        # blocks that hold blocks (candidates.py): checkpointed whole, they cover a run of the chain
        self.groups: dict[str, list[str]] = {} if units is not None else find_groups(runner.model)
        # no repeated blocks: every module with parameters is marked, and the ordering step's calls
        # choose the chain and its groups (candidates.call_chain)
        self._refused: set[str] = set()  # modules refused as candidates (they change their input in place)
        self._found = units is None  # the chain is ckpt-tune's to choose (not given by the caller)
        self._by_calls = units is None and not self.units
        self.plain_ran = False
        self._at: int | None = None  # the batch last probed or verified (a failure's batch, `_plain_again`)
        if self._by_calls:
            self.units = tuple(with_parameters(runner.model))
        # composite modules outside the blocks (a bottleneck, a stem): the ordering step places them
        self._between = outside(runner.model, (*self.units, *self.groups)) if units is None and not self._by_calls else []
        self.spans: dict[tuple[int, int], str] = {}
        self.options: tuple[str, ...] = ("none", "block")
        self.repeats: dict[str, str] = {}  # unit -> its repeat option (candidates.repeated_inside)
        self._looping: tuple[str, ...] = ()  # modules run more than once, outside every unit
        self.b1, self.b2 = 1, 4  # the two small batch sizes every search probes
        self.notes: list[str] = []
        scripted = scripted_modules(runner.model) if units is None else []
        if scripted:
            more = f" and {len(scripted) - 3} more" if len(scripted) > 3 else ""
            self.notes.append(f"TorchScript modules are not candidates (torch refuses their hooks and a new forward): {', '.join(scripted[:3])}{more}")
        if self.shard in FULLY_SHARDED and self.use_segments:
            # a segment's recompute calls its blocks' forwards without FSDP's pre-forward hooks
            self.use_segments = False
            self.notes.append(f"segments are not offered under {self.shard}: each block is its own shard unit")
        self.runs = 0
        self._costs: dict[int, tuple[tuple[tuple[float, ...], ...], float]] = {}
        # the full-depth step order_units records: (batch, its cut with no checkpointing, static bytes);
        # it is also the "none" probe at that batch
        self._order_cut: tuple[int, RunCut, int] | None = None
        # a run of identical blocks probed on a shortened chain (repeats.py), and its recorded cuts
        self.repeat: Repeat | None = None
        self.short_cuts: dict[tuple[int, tuple[int, ...]], RunCut] = {}
        self.stage_seconds: dict[str, float] = {}
        self.probe_seconds: dict[str, list[float]] = {}  # seconds of each probe step recorded ("short", "full")
        self._eta_s: dict[str, list[float]] = {}  # the same, of the steps this process ran (progress lines)
        self._pid = os.getpid()  # a forked process that records probes (measure/forked.py) is not this one
        self._forks = False  # probes may be shared out over forked processes (set by order_units)
        self._recorded_here: set[int] = set()  # batches this process recorded a fake step at (probing.py `_first_here`)
        self._dropped: set[str] = set()  # finer options whose probe step failed (never offered again)
        # (batch, choice) -> the peak of a plan verified alongside the probes at that batch (prefetch)
        self.speculated: dict[tuple[int, tuple[int, ...]], int] = {}
        # the same plans' runs, which a verification of a plan with segments learns their terms from
        self._beside_runs: dict[tuple[int, tuple[int, ...]], Measurement] = {}
        # plans with segments recorded under fake tensors beside the probes (probing.py `_fake_beside`)
        self._fake_plan_runs: dict[tuple[int, tuple[int, ...]], Measurement] = {}
        # (batch, choice) -> the peak of a plan recorded at full depth under fake tensors (terms.py)
        self._fake_peaks: dict[tuple[int, tuple[int, ...]], int] = {}
        # (batch, names, choice): a plan to verify beside the full-depth probes at its batch (prefetch)
        self._beside: tuple | None = None
        # (batch, choice) -> its predicted peak when it was first run (the prediction before verification)
        self._first_predicted: dict[tuple[int, tuple[int, ...]], int] = {}
        # frontiers solved alongside probes (frontier()): key -> (rows, _version, batches probed then)
        self.frontiers: dict[tuple, tuple[list[FrontierRow], int, frozenset[int]]] = {}
        self._version = 0  # counts changes to recorded terms other than new batches (options, segments)
        self._settled = False  # whether this search's settle has probed a batch (see _min_peak_at)
        # (unit, policy) -> a policy's recompute time over the whole block's, measured by order_units
        self._ratios: dict[tuple[str, str], float] = {}

    @contextlib.contextmanager
    def _stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stage_seconds[name] = round(self.stage_seconds.get(name, 0.0) + time.perf_counter() - t0, 2)

    @property
    def _plain(self) -> bool:
        """A plain or sharded runner, the only ones whose steps may be shortened or forked: HostGuard
        (measure/host.py) bounds later steps by the ones it ran, which a shortened step would fool."""
        return type(self.runner) in (StepRunner, ShardedRunner)

    @property
    def _kind(self) -> int:
        return 1 if self.accum_steps == 1 else 2

    @property
    def probed(self) -> dict[int, Terms]:
        return self._terms_by_kind[self._kind]

    @property
    def _measured_segments(self) -> dict[int, dict[tuple[int, int], SegmentTerms]]:
        return self._segments_by_kind[self._kind]

    def _say(self, msg: str) -> None:
        """A progress line, from this process only: a forked one (measure/forked.py) is silent."""
        if os.getpid() == self._pid:
            self.progress(msg)

    def _timed(self, kind: str, seconds: float) -> None:
        """A probe step of this kind recorded (here or in a forked process) in `seconds`."""
        self.runs += 1
        self.probe_seconds.setdefault(kind, []).append(seconds)

    def _workers(self, items: int) -> int:
        """Processes to share `items` independent probe steps or solves out over (measure/forked.py):
        one, unless the steps are fake (order_units decides)."""
        return usable_workers(items, resident_bytes()) if self._forks and items else 1

    def _workers_beside(self, items: int) -> int:
        """Processes for `items` fake probes while this one times a real step (2 or more, else nothing
        runs beside it): the forked ones only on the cores the timing leaves free, its torch threads on
        a CPU (one to drive a GPU), so that they do not slow the step timed (docs/design.md §3)."""
        threads = 1 if self.real.device.type == "cuda" else torch.get_num_threads()
        return min(self._workers(items + 1), cores_left(threads) + 1)

    def refinement(self, what: str, where: str, run: Callable, instead):
        """`run()`, a refinement ckpt-tune adds to the user's step (docs/design.md §8): when it raises,
        a note names it, where and the error's first line, and `instead` is used (the search goes on)."""
        try:
            return run()
        except (torch.OutOfMemoryError, NoFitError, KeyboardInterrupt):
            raise
        except Exception as e:
            self.notes.append(f"{what} dropped for {where}: {first_line(e)}")
            return instead

    def _has(self, i: int, option: int) -> bool:
        name = self.options[option]
        return kind_of(self.options, option).has(self, self.units[i], name)

    def names(self, choice: tuple[int, ...]) -> list[Entry]:
        """Plan entries of a choice (memory_model.plan_entries)."""
        return list(plan_entries(self.units, self.options, choice, self.spans))

    def _restrict(self, t: Terms) -> Terms:
        """Without a kind of whole-module choices, no block is checkpointed whole (its terms stay in
        the model: segments are estimated from them)."""
        return t if any(k.groups for k in self.kinds) else price_out(t, [1])

    def forget_measured(self) -> None:
        """The options changed: every term, cost and speculated plan numbered them as they were."""
        for cache in (*self._terms_by_kind.values(), *self._segments_by_kind.values()):
            cache.clear()
        self.short_cuts.clear()
        self._costs.clear()
        self.speculated.clear()
        self._beside_runs.clear()
        self._fake_plan_runs.clear()
        self._fake_peaks.clear()
        self._beside = None
        self._first_predicted.clear()
        self._version += 1

    def _drop_option(self, name: str, error: BaseException) -> None:
        """A finer option whose probe step failed (an op policy that a block's in-place ops defeat)
        is no candidate: drop it and forget what was measured with it."""
        self._dropped.add(name)
        self.options = tuple(o for o in self.options if o != name)
        self.forget_measured()
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.notes.append(f"option {name} dropped: its probe step failed ({type(error).__name__}: {first[:160]})")

    def gathered_bytes(self) -> int:
        """ZeRO-3/FSDP all-gather one block's full parameters at a time: the largest block's bytes."""
        model = self.runner.model
        return max((unique_bytes(model.get_submodule(u).parameters()) for u in self.units), default=0)

    @staticmethod
    def _prev_of(choice: tuple[int, ...], i: int) -> int:
        """The predecessor option block i sees: a segment before it counts as checkpointed."""
        return 0 if i == 0 else (1 if choice[i - 1] < 0 else choice[i - 1])

    def _time_real(self, batch_size: int, checkpoint=(), repeats: int = 3) -> Timing:
        """`real.time_step`, its iterations (a warm-up only where none ran before) counted in
        `real_timed` where the probes are fake."""
        before = self.real.iterations
        t = self.real.time_step(batch_size, checkpoint=checkpoint, repeats=repeats)
        if self.real is not self.runner:
            self.real_timed += self.real.iterations - before
        return t

    @property
    def real_peaks(self) -> list[int]:
        """Peaks of the steps recorded for real, in order: the real runner's own list (runner.py
        `measure`), so that a step `HostGuard` records under fake tensors is not among them, and a
        search run again on the same runner counts what ran before it."""
        return self.real.real_peaks

    def _real_counts(self, res: SearchResult) -> None:
        """The result's counts of real steps: every recorded step the runner ran for real (where the
        probes ran under fake tensors, those beside them; where every step ran on the device, because
        fake tensors cannot record this step, all of them, so the output says how far past the budget
        the largest went), and where the probes were fake, the real steps run to time the step."""
        fake = self.real is not self.runner
        if fake or self.real_peaks:
            res.real_steps, res.largest_real_peak = len(self.real_peaks), max(self.real_peaks, default=None)
        if fake:
            res.timed_steps = self.real_timed

    # -- what one part asks of another ------------------------------------------------------
    def _set_options(self, batch_size: int) -> None:
        """The options of every block (ordering.py)."""
        raise NotImplementedError

    def policies_ahead(self, batch_size: int) -> None:
        """Op policies timed in a forked process while the ordering step runs (step_costs.py)."""
        raise NotImplementedError

    def _early_repeat(self) -> Repeat | None:
        """The run of identical blocks probed beside the ordering step (probing.py)."""
        raise NotImplementedError

    def _timing_guess(self) -> int | None:
        """The batch the real timing will run at, guessed before the second small batch is probed
        (step_costs.py)."""
        raise NotImplementedError

    def costs(self, batch_size: int) -> tuple[tuple[float, ...], ...]:
        """Recompute cost of each block's options at this batch (step_costs.py)."""
        raise NotImplementedError

    def _time(self, batch_size: int) -> tuple[tuple[tuple[float, ...], ...], float]:
        """(costs, step ms) at this batch, not cached (step_costs.py)."""
        raise NotImplementedError

    def terms(self, batch_size: int) -> Terms:
        """Terms probed at this batch, cached (terms.py)."""
        raise NotImplementedError

    def fitted(self, batch_size: int, b1: int, b2: int) -> Terms:
        """Terms at this batch, probed or on the line through b1 and b2 (terms.py)."""
        raise NotImplementedError

    def near(self, batch_size: int) -> Terms:
        """Terms at this batch on the line through the probed batches nearest it (terms.py)."""
        raise NotImplementedError

    def _measure_plan(self, batch_size: int, names, runner: StepRunner | None = None) -> Measurement:
        """One recorded iteration of a plan at full depth (terms.py)."""
        raise NotImplementedError

    def _shortened_terms(self, batch_size: int) -> Terms | None:
        """Full-depth terms from probes on the shortened chain (probing.py)."""
        raise NotImplementedError

    def frontier_sizes(self, b: int) -> list[int]:
        """The batch sizes the frontier shows around answer b (searcher.py)."""
        raise NotImplementedError

    def _row(self, b: int, budget: int, costs, step: float) -> FrontierRow:
        """The best plan at batch b, as a frontier row (searcher.py)."""
        raise NotImplementedError


def first_line(error: BaseException) -> str:
    """`Type: the first line of the message`, at most 160 characters of it."""
    text = str(error).strip()
    if isinstance(error, CkptTuneError):
        text = error.message
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}".rstrip(": ")
