"""`search`: the largest batch that fits a budget, the cheapest checkpoint plan that reaches it, verified.

1. Candidates (candidates.py): the innermost repeated blocks of the model as a chain in execution
   order, and the blocks holding them (groups) as runs of it checkpointed whole.
2. Probe: four recorded runs (none / all / even / odd checkpointed) at a batch size give the memory
   model's terms (memory_model.py); two batch sizes give them as a line in batch size.
3. Outer search over batch sizes on the fitted terms, then re-probe at the chosen batch itself, so the
   final answer rests on terms measured at that batch, not extrapolated.
4. Solve (planner.py) for the least recompute time under the budget.
5. Verify: run the plan and measure. A plan over budget is never reported as fitting: the room is
   tightened by the overshoot and the planner runs again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from ckpt_tune.errors import CkptTuneError, LimitationError, NoFitError, UserCodeError
from ckpt_tune.measure.forked import fork_map
from ckpt_tune.measure.op_costs import policy_ratios, recompute_shares
from ckpt_tune.measure.runner import Measurement, StepRunner
from ckpt_tune.measure.tensors import unique_bytes
from ckpt_tune.measure.timing import Timing
from ckpt_tune.plan.entry import POLICIES, Entry, entries_of, to_data
from ckpt_tune.plan.file import FULLY_SHARDED
from ckpt_tune.plan.segment import available as segment_available
from ckpt_tune.tune.candidates import (
    between,
    call_chain,
    chain_of,
    find_blocks,
    find_groups,
    find_sub_options,
    group_spans,
    has_sub_option,
    outermost_repeated,
    outside,
    repeated_inside,
    with_parameters,
)
from ckpt_tune.tune.memory_model import (
    RunCut,
    SegmentTerms,
    Terms,
    combine,
    cut_run,
    estimate_segments,
    plan_entries,
    policy_of,
    policy_option,
    predict,
    price_out,
    probe_configs,
    segment_terms,
    segments_of,
    with_step_of,
)
from ckpt_tune.tune.planner import Solution, min_peak, solve
from ckpt_tune.tune.probing import OptionFailed, ProbeSteps
from ckpt_tune.tune.repeats import (
    NotRepeated,
    Repeat,
    count_flops,
    extend_forward,
    find_repeat,
    shortened,
)
from ckpt_tune.tune.sharding import check_shard, peak_of, per_gpu_terms, shard_moment, static_per_gpu
from ckpt_tune.tune.verify import MAX_TIGHTENINGS, tighten
from ckpt_tune.units import format_bytes
from ckpt_tune.vocab import CANDIDATES

MAX_BATCH = 1 << 16
# An op policy whose recompute costs more than this fraction of checkpointing the whole block in every
# block is left out: it keeps more bytes than the whole-block checkpoint for (within timing noise, or
# the roofline's error under fake tensors) no less time, and each policy offered costs a recorded step
# per probed batch.
WORTH_A_POLICY = 0.9
# A batch the fitted (linear) terms put this far over budget is taken as not fitting without probing it.
# Terms are linear in batch size to within allocator granularity; 2% is far above what was observed.
SKIP_MARGIN = 0.02
# Longest run of consecutive blocks considered as one checkpoint segment. A segment holds all its
# blocks' saved tensors in backward, so long ones lose to shorter ones wherever blocks are alike.
# Chains of more than SEGMENT_WORK // MAX_SEGMENT blocks get shorter segments, to keep the planner's
# work (blocks × segment lengths) interactive.
MAX_SEGMENT = 8
SEGMENT_WORK = 640
# What torch says when BatchNorm meets one value per channel (a batch of 1 on a 1x1 feature map).
ONE_SAMPLE_FAILS = "more than 1 value per channel"
# Plans with estimated segment terms verified per batch before segments not yet measured are dropped.
SEGMENT_TRIALS = 4
# Solves per batch in the plan-verify loop (tightenings, segment trials, dropped refinements together)
# before the batch is taken as not fitting and the search tries one smaller, as after MAX_TIGHTENINGS.
SOLVES_PER_BATCH = 4 * 8
# With probes under fake tensors, a step runs for real only where the recorded terms put its peak this
# fraction under the budget (fake and real steps differ by tens of bytes; a margin for what they miss).
REAL_ROOM = 0.02


@dataclass(frozen=True)
class FrontierRow:
    batch_size: int
    plan: tuple[Entry, ...]
    predicted_peak: int
    recompute_fraction: float
    fits: bool

    def to_dict(self) -> dict:
        """JSON form: entries as the plan file writes them."""
        return {**asdict(self), "plan": to_data(self.plan)}


FLOOR_STEPS_UP = 4  # batches above the every-block floor's estimate tried one by one


@dataclass
class SearchResult:
    batch_size: int
    checkpoint: tuple[Entry, ...]
    predicted_peak: int
    verified_peak: int
    recompute_fraction: float
    budget: int
    units: tuple[str, ...]
    step_ms: float
    frontier: list[FrontierRow] = field(default_factory=list)
    baselines: dict[str, FrontierRow] = field(default_factory=dict)
    probes: int = 0  # recorded runs spent
    grad_accum_steps: int = 1
    notes: list[str] = field(default_factory=list)
    # units whose terms were not recorded but copied from an identical unit's (repeats.py) -> that unit
    extended_terms: dict[str, str] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage of the search
    # the plan's predicted peak before it was first run (None: not run by the search), and whether the
    # reported prediction was solved again on terms learned from that run (estimated segments measured)
    first_predicted_peak: int | None = None
    resolved: bool = False
    # probes recorded under fake tensors (the probe policy): of `probes`, those recorded for real; the real
    # steps run to time the step (warm-up included); the largest real recorded peak. None where every
    # step ran on the device
    real_steps: int | None = None
    timed_steps: int | None = None
    largest_real_peak: int | None = None


class Searcher(ProbeSteps):
    """Holds a StepRunner and the units; caches probes per batch size."""

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
    ):
        # `runner` records the probes; `real` (default: the same runner) runs the steps that must be real:
        # step times, the verification, the user's plain step (docs/design.md §4, the probe policy)
        self.runner = runner
        self.real = runner if real is None else real
        self.budget: int | None = None  # the budget of the search under way (real steps stay within it)
        self.real_peaks: list[int] = []  # peaks of the real recorded steps, when probes are fake
        self.real_timed = 0  # real steps run to time the step (warm-up included), when probes are fake
        self._real_timing: Timing | None = None  # the one real timing the costs scale from, then
        # the kinds of choice the planner may use (vocab.CANDIDATES); None: all
        self.candidates = frozenset(CANDIDATES if candidates is None else candidates)
        # also consider runs of consecutive blocks under one checkpoint (segment.py), where torch can
        self.use_segments = segments and "segments" in self.candidates and segment_available()
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
        self._repeats: dict[str, str] = {}  # unit -> its repeat option (candidates.repeated_inside)
        self._looping: tuple[str, ...] = ()  # modules run more than once, outside every unit
        self.b1, self.b2 = 1, 4  # the two small batch sizes every search probes
        self.notes: list[str] = []
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
        self._short_cuts: dict[tuple[int, tuple[int, ...]], RunCut] = {}
        self.stage_seconds: dict[str, float] = {}
        self._probe_s: dict[str, list[float]] = {}  # seconds of each probe step recorded ("short", "full")
        self._eta_s: dict[str, list[float]] = {}  # the same, of the steps this process ran (progress lines)
        self._pid = os.getpid()  # a forked process that records probes (measure/forked.py) is not this one
        self._forks = False  # probes may be shared out over forked processes (set by order_units)
        self._dropped: set[str] = set()  # finer options whose probe step failed (never offered again)
        # (batch, choice) -> the peak of a plan verified alongside the probes at that batch (prefetch)
        self._speculated: dict[tuple[int, tuple[int, ...]], int] = {}
        # (batch, choice) -> its predicted peak when it was first run (the prediction before verification)
        self._first_predicted: dict[tuple[int, tuple[int, ...]], int] = {}
        # frontiers solved alongside probes (frontier()): key -> (rows, _version, batches probed then)
        self._frontiers: dict[tuple, tuple[list[FrontierRow], int, frozenset[int]]] = {}
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

    # -- measurements ---------------------------------------------------------------------
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
        """The options of every block: stored, checkpointed whole, its sub-modules, the useful op policies."""
        subs = find_sub_options(self.runner.model, self.units) if "submodules" in self.candidates else []
        # modules run more than once inside a unit: checkpointed at each call (a shared layer's loop)
        subs += [o for o in dict.fromkeys(self._repeats.values()) if o not in subs]
        policies = self._refinement("op policies", "every block", lambda: self._useful_policies(batch_size), []) if "ops" in self.candidates else []
        options = ("none", "block", *subs, *(policy_option(p) for p in policies))
        if self.options != options:  # a later search chose others (timed op policies): nothing measured holds
            self._forget_measured()
        self.options = options

    def _refinement(self, what: str, where: str, run: Callable, instead):
        """`run()`, a refinement ckpt-tune adds to the user's step (docs/design.md §8): when it raises,
        a note names it, where and the error's first line, and `instead` is used (the search goes on)."""
        try:
            return run()
        except (torch.OutOfMemoryError, NoFitError, KeyboardInterrupt):
            raise
        except Exception as e:
            self.notes.append(f"{what} dropped for {where}: {_first_line(e)}")
            return instead

    def _order_units(self, batch_size: int, why: str = "no repeated blocks") -> None:
        marked = (*self.units, *self.groups, *self._between)
        with _inputs_changed(self.runner.model, marked) as changed:
            m = self.runner.measure(batch_size, units=marked)
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
        if "blocks" not in self.candidates:  # groups are whole modules checkpointed: the "blocks" kind
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
        that unit (`_repeats`); outside every unit (a loop in the model's own forward), the floor's set
        (`_looping`)."""
        calls = lambda n: mk.get("f>" + n, [])  # noqa: E731
        backward = lambda n: bool(mk.get("b>" + n))  # noqa: E731
        names = [n for n in marked if n not in self._refused]
        if "submodules" in self.candidates:
            window = lambda u: (mk["f>" + u][0], mk["f<" + u][0])  # noqa: E731
            self._repeats = repeated_inside(self.runner.model, self.units, names, calls, window, backward)
        rest = [n for n in outside(self.runner.model, self.units) if n in names]
        self._looping = tuple(outermost_repeated(self.runner.model, rest, calls, backward))
        shown = [f"{u}.{sub}" for u, opt in self._repeats.items() for sub in opt.split("+")]
        if shown:
            self.notes.append(
                "modules that run more than once per step, offered checkpointed at each call: "
                + ", ".join(f"{n} ({len(calls(n))} calls)" for n in shown)
            )

    def _useful_policies(self, batch_size: int) -> list[str]:
        """The op policies that keep something in some block (one forward, measure/op_costs.py): a
        policy that keeps nothing is checkpointing the whole block, at the price of a recorded step."""
        shares = self._recompute_shares(batch_size, POLICIES, repeats=1)
        useful = [p for p in POLICIES if any(shares[(u, p)] < 1.0 for u in self.units)]
        if len(useful) < len(POLICIES):
            self.notes.append(
                "op policies that keep no op of any block, left out: "
                + ", ".join(p for p in POLICIES if p not in useful)
            )
        if not useful:
            return []
        if self.real.fake:
            # no device to time: a policy's cost is the share of the block's forward in the ops it
            # recomputes, on a roofline (the shares above, which price it in `_time` too)
            dear = {p: min(shares[(u, p)] for u in self.units) for p in useful}
            where = f"on a roofline of its ops (counted at batch {batch_size})"
        else:
            # each kind of block timed alone under each policy, at the second small batch: a policy
            # torch refuses is left out before any step is recorded with it
            at = max(batch_size, self.b2)
            self._ratios, refused = policy_ratios(self.real, at, self.units, useful)
            for p, why in refused.items():
                self.notes.append(f"op policy {p} left out: torch refused it on this model ({why})")
            useful = [p for p in useful if p not in refused]
            dear = {p: min(self._ratios[(u, p)] for u in self.units) for p in useful}
            where = f"on this device (measured at batch {at})"
        # one that costs about as much as checkpointing the whole block (WORTH_A_POLICY) is left out
        for p, worst in dear.items():
            if worst > WORTH_A_POLICY:
                self.notes.append(f"op policy {p} left out: its recompute costs {worst:.2f}x checkpointing the whole block {where}")
        useful = [p for p in useful if dear[p] <= WORTH_A_POLICY]
        return [p for p in useful if policy_option(p) not in self._dropped]

    def _recompute_shares(self, batch_size: int, policies, repeats: int = 3) -> dict[tuple[str, str], float]:
        """op_costs.recompute_shares of the chain; under fake tensors, identical blocks' on the shortened
        chain (a share is a count of FLOPs and bytes, the same for each of them)."""
        rep = self.repeat if self.runner.fake else None
        if rep is None:
            return recompute_shares(self.runner, batch_size, self.units, policies, repeats)
        with shortened(self.runner.model, rep, forward_only=True):  # the last step's gradients stay
            short = recompute_shares(self.runner, batch_size, rep.short_units, policies, repeats)
        ref = rep.extended()
        return {(u, p): short[(ref.get(u, u), p)] for u in self.units for p in policies}

    def _has(self, i: int, option: int) -> bool:
        name = self.options[option]
        return (
            policy_of(name) is not None or self._repeats.get(self.units[i]) == name
            or has_sub_option(self.runner.model, self.units[i], name)
        )

    def _drop_option(self, name: str, error: BaseException) -> None:
        """A finer option whose probe step failed (an op policy that a block's in-place ops defeat)
        is no candidate: drop it and forget what was measured with it."""
        self._dropped.add(name)
        self.options = tuple(o for o in self.options if o != name)
        self._forget_measured()
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.notes.append(f"option {name} dropped: its probe step failed ({type(error).__name__}: {first[:160]})")

    def _forget_measured(self) -> None:
        """The options changed: every term, cost and speculated plan numbered them as they were."""
        for cache in (*self._terms_by_kind.values(), *self._segments_by_kind.values()):
            cache.clear()
        self._short_cuts.clear()
        self._costs.clear()
        self._speculated.clear()
        self._first_predicted.clear()
        self._version += 1

    def _restrict(self, t: Terms) -> Terms:
        """Without the "blocks" kind, no block is checkpointed whole (its terms stay in the model:
        segments are estimated from them)."""
        return t if "blocks" in self.candidates else price_out(t, [1])

    def names(self, choice: tuple[int, ...]) -> list[Entry]:
        """Plan entries of a choice (memory_model.plan_entries)."""
        return list(plan_entries(self.units, self.options, choice, self.spans))

    def costs(self, batch_size: int) -> tuple[tuple[float, ...], ...]:
        """Recompute cost of each block's options: the checkpointed module's forward time (ms) at this batch."""
        return self._timing(batch_size)[0]

    def step_ms(self, batch_size: int) -> float:
        return self._timing(batch_size)[1]

    def _timing(self, batch_size: int) -> tuple[tuple[tuple[float, ...], ...], float]:
        if batch_size not in self._costs:
            with self._stage("timing"):
                self._costs[batch_size] = self._time(batch_size)
        return self._costs[batch_size]

    def _time(self, batch_size: int) -> tuple[tuple[tuple[float, ...], ...], float]:
        scale, oom, t = 1.0, False, None
        if self.repeat is not None and self.real.fake:
            # FLOPs of identical blocks are identical: count them on the shortened chain
            self._say(f"counting FLOPs at batch {batch_size} on {len(self.repeat.short_units)} of {len(self.units)} blocks")
            rep = self.repeat
            with shortened(self.runner.model, rep):
                forward, step = count_flops(self.runner, batch_size)
            mid = step.get(rep.short_units[rep.first + 1], 0.0)
            total = step[None] + rep.removed * mid
            t = Timing(batch_size, (), max(total, 1e-9), extend_forward(forward, rep), unit="GFLOP")
        if t is None and self.real is not self.runner:
            t, scale = self._time_within_budget(batch_size)
        if t is None:
            try:
                t = self.runner.time_step(batch_size, repeats=3)
            except torch.OutOfMemoryError:
                oom = True  # the plain step at this batch exceeds the device (a real GPU): time a small one
        if oom:
            torch.cuda.empty_cache()
            self.notes.append(f"batch {batch_size}: the plain step does not fit the device; times scaled from batch {self.b2}")
            t, scale = self.runner.time_step(self.b2, repeats=3), batch_size / self.b2

        policies = [p for o in self.options if (p := policy_of(o)) is not None]
        at = batch_size if scale == 1.0 else self.b2
        # a policy's cost relative to its block's forward: on a device, its time against checkpointing
        # the whole block (measured once by order_units); under fake tensors, the share of the forward
        # in the ops it recomputes, on a roofline
        shares = self._recompute_shares(at, policies) if self.real.fake else self._ratios

        def cost(u: str, k: int) -> float:
            policy = policy_of(self.options[k])
            if policy is not None:  # the block's forward, less the ops the policy keeps
                return scale * max(t.forward_ms.get(u, 0.0) * shares[(u, policy)], 1e-6)
            mods = [u] if k == 1 else [f"{u}.{sub}" for sub in self.options[k].split("+")]
            return scale * max(sum(t.forward_ms.get(x, 0.0) for x in mods), 1e-6)

        costs = tuple((0.0, *(cost(u, k) for k in range(1, len(self.options)))) for u in self.units)
        return costs, scale * t.step_ms

    def _time_within_budget(self, batch_size: int) -> tuple[Timing, float]:
        """(timing, scale) for `batch_size` when probes are fake: one real step timed, at the largest batch
        whose plain step the terms of the small batches put REAL_ROOM under the budget (every block
        checkpointed at the first small batch where none does), scaled linearly in the batch
        (docs/design.md §4)."""
        if self._real_timing is None:
            none = (0,) * len(self.units)

            def plain_fits(b: int) -> bool:
                t = self.fitted(b, self.b1, self.b2)
                return t.measured.get(none, predict(t, none)) <= (self.budget or 0) * (1 - REAL_ROOM)

            at = _largest(plain_fits, self.b1)
            checkpoint = [] if at else list(self.units)
            at = at or self.b1
            self._say(f"timing the step at batch {at} on the device" + (", every block checkpointed" if checkpoint else ""))
            t = self.real.time_step(at, checkpoint=checkpoint, repeats=3)
            # checkpointed, the blocks' forwards ran twice: the plain step's time runs them once
            again = sum(t.forward_ms.get(u, 0.0) for u in checkpoint)
            self._real_timing = replace(t, step_ms=max(t.step_ms - again, 1e-9))
            self.real_timed += 4  # a warm-up and three timed steps (measure/runner.py)
            self.notes.append(
                f"step times measured on the device at batch {at}{' with every block checkpointed' if checkpoint else ''}"
                " and scaled linearly to other batches (the probes ran under fake tensors)"
            )
        return self._real_timing, batch_size / self._real_timing.batch_size

    @property
    def _kind(self) -> int:
        return 1 if self.accum_steps == 1 else 2

    @property
    def _terms(self) -> dict[int, Terms]:
        return self._terms_by_kind[self._kind]

    @property
    def _measured_segments(self) -> dict[int, dict[tuple[int, int], SegmentTerms]]:
        return self._segments_by_kind[self._kind]

    def terms(self, batch_size: int) -> Terms:
        """Terms of the iteration searched, probed at this batch (cached). With gradient accumulation
        the probes run two micro-batches and are cut at the second, where every gradient is live (as
        in every later micro-batch); the first is part of the iteration's fixed term."""
        if batch_size not in self._terms:
            self._at = batch_size
            with self._stage("probe"):
                while True:
                    try:
                        self._terms[batch_size] = self._probe(batch_size)
                        break
                    except OptionFailed as e:
                        self._drop_option(e.option, e.__cause__)
        return self._restrict(self._terms[batch_size])

    def _probe(self, batch_size: int) -> Terms:
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
                    f"at full depth: {e if isinstance(e, NotRepeated) else _first_line(e)}"
                )
                self._terms.clear()  # every batch on full-depth probes alike
                self._short_cuts.clear()
        if t is None:
            t = self._full_terms(batch_size)
            if t is None:
                # on a real GPU the no-checkpointing probe at a large batch can exceed the device:
                # fall back to the line through the two small batches (verification still runs)
                torch.cuda.empty_cache()
                self.notes.append(f"batch {batch_size}: a probe ran out of device memory; terms fitted from batches {self.b1} and {self.b2}")
                return self.terms(self.b1).interpolate(self.terms(self.b2), batch_size)
        t = replace(t, groups=self.spans)
        t = self._with_segments(t)
        if self.sharding == "arithmetic":
            params, opt, _grads = self.runner.state_bytes()
            t = per_gpu_terms(t, params, opt, self.world_size, self.shard, self.gathered_bytes())
        return t

    def _full_terms(self, batch_size: int) -> Terms | None:
        """Terms from the probe runs at full depth; None when a probe ran out of device memory. Under
        fake tensors the probes are shared out over the cores (measure/forked.py)."""
        configs = probe_configs(len(self.units), len(self.options), self._has)
        n = len(configs)
        reuse = self._order_cut is not None and self._kind == 1 and self._order_cut[0] == batch_size
        todo = [(j, label, choice) for j, (label, choice) in enumerate(configs.items()) if not (reuse and not any(choice))]
        workers = self._workers(len(todo))
        # only the no-checkpointing probe records the optimizer step; the others take its moments
        # (memory_model.with_step_of), as the shortened probes do
        borrow = self._kind == 1 and self._plain
        try:
            got = fork_map(lambda t: self._record_full(batch_size, *t, n, workers, not (borrow and any(t[2]))), todo, workers)
        except torch.OutOfMemoryError:
            if batch_size in (self.b1, self.b2):
                raise
            return None  # the failed step's tensors are gone with the exception
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

    def _with_segments(self, t: Terms) -> Terms:
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

    def _learn_segments(self, batch_size: int, choice: tuple[int, ...], measurement) -> None:
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
        old = self._terms[batch_size]
        new = self._with_segments(old)
        # segments dropped from these terms (drop_estimated_segments, _forbid_segments) stay dropped
        new = replace(new, segments={k: v for k, v in new.segments.items() if k in old.segments})
        if self.sharding == "arithmetic":  # the sharding arithmetic touches static only: keep it
            new = replace(new, static=old.static)
        self._terms[batch_size] = new

    def drop_estimated_segments(self, batch_size: int) -> None:
        """Keep only segments whose terms were measured (for the predecessor options measured)."""
        self.terms(batch_size)
        self._version += 1
        t = self._terms[batch_size]
        self._terms[batch_size] = replace(t, segments={k: v for k, v in t.segments.items() if v.measured})

    def gathered_bytes(self) -> int:
        """ZeRO-3/FSDP all-gather one block's full parameters at a time: the largest block's bytes."""
        model = self.runner.model
        return max((unique_bytes(model.get_submodule(u).parameters()) for u in self.units), default=0)

    def fitted(self, batch_size: int, b1: int, b2: int) -> Terms:
        if batch_size in self._terms or batch_size in (b1, b2):
            return self.terms(batch_size)
        return self.terms(b1).interpolate(self.terms(b2), batch_size)

    def verify(self, batch_size: int, names: tuple, choice: tuple[int, ...] = ()) -> int:
        n_seg = len(segments_of(choice))
        self.progress(
            f"verifying batch {batch_size} with {len(names)} checkpoints" + (f" ({n_seg} segments)" if n_seg else "")
        )
        self._at = batch_size
        with self._stage("verify"):
            m = self._measure_plan(batch_size, names, self.real)
        self.runs += 1
        if batch_size in self._terms:
            self._learn_segments(batch_size, choice, m)
        if self.sharding != "arithmetic":
            return m.peak_bytes
        # a sharded step cannot run here: its recorded single-GPU moments, sharded by arithmetic
        from ckpt_tune.tune.moments import moments_of

        moments = (shard_moment(x, self.world_size, self.shard, self.gathered_bytes()) for x in moments_of(m))
        return peak_of(moments).total

    def _measure_plan(self, batch_size: int, names, runner: StepRunner | None = None) -> Measurement:
        """One recorded iteration of a plan at full depth (the verification, here or beside the probes
        in a forked process): recorded per module where the sharding arithmetic needs the moments."""
        runner = runner or self.runner
        m = runner.measure(
            batch_size, checkpoint=list(names), units=self.units, attribute=self.sharding == "arithmetic", accum_steps=self.accum_steps
        )
        if runner is self.real and self.real is not self.runner:
            self.real_peaks.append(m.peak_bytes)
        return m

    # -- the search -------------------------------------------------------------------------
    def largest_fitting(self, budget: int, b1: int, b2: int) -> int:
        """Largest batch whose min-peak plan fits, on terms fitted from b1 and b2 (0 if none)."""
        costs = self.costs(b1)

        return _largest(lambda b: min_peak(self.fitted(b, b1, b2), costs).peak <= budget, b1)

    def _min_peak_at(self, b: int, b1: int, budget: int) -> int:
        """Smallest predicted peak at b, on terms probed at b itself (and FLOPs counted there, should b
        be the answer, in the same share-out)."""
        # the first batch settle probes is the fitted guess, most often the answer: its plan is verified
        # alongside (a later one is a step of a walk, where a verification each would mostly be wasted)
        first = not self._settled and b not in (self.b1, self.b2)
        self._settled = self._settled or first
        self.prefetch((b,), timing=(b,) if b not in (self.b1, self.b2) else (), budget=budget if first else None)
        return min_peak(self.terms(b), self.costs(b1)).peak

    def _settle(self, guess: int, budget: int, b1: int, b2: int) -> int:
        """The largest batch that fits on terms probed at that batch, with the next one shown not to.

        Starts from the fitted guess and moves by secant steps through the last two probed batches (the
        smallest peak is close to linear in the batch), keeping a bracket [lo fits, hi does not].
        """
        seen: dict[int, int] = {}

        def peak(b: int) -> int:
            if b not in seen:
                seen[b] = self._min_peak_at(b, b1, budget)
            return seen[b]

        lo, hi = (b2, None) if peak(b2) <= budget else (b1, b2)
        if peak(lo) > budget:
            raise self._no_fit(budget, b1)
        b = min(max(guess, lo + 1), hi - 1) if hi is not None else max(guess, lo + 1)
        for _ in range(16):
            if hi is not None and hi - lo <= 1:
                break
            if peak(b) <= budget:
                lo = b
            else:
                hi = b
            if hi is not None and hi - lo <= 1:
                break
            p, q = sorted(seen, key=lambda x: abs(x - b))[:2] if len(seen) >= 2 else (lo, b)
            slope = (seen[q] - seen[p]) / (q - p) if q != p else 0
            nxt = p + int((budget - seen[p]) // slope) if slope > 0 else lo + 1
            upper = hi - 1 if hi is not None else MAX_BATCH
            if hi is None and nxt <= lo and not self._may_fit(lo + 1, budget, b1, b2):
                break  # the fitted line puts lo + 1 clearly over budget: no probe needed
            b = min(max(nxt, lo + 1), upper)
            if b in seen:  # no progress by secant: bisect the bracket
                b = (lo + upper + 1) // 2 if hi is not None else lo + 1
                if b in seen:
                    break
        while (hi is None or hi > lo + 1) and self._may_fit(lo + 1, budget, b1, b2) and peak(lo + 1) <= budget:
            lo += 1
        return lo

    def _may_fit(self, b: int, budget: int, b1: int, b2: int) -> bool:
        """False when the fitted terms put b more than SKIP_MARGIN over budget: no need to probe it."""
        if b in self._terms:
            return True
        return min_peak(self.fitted(b, b1, b2), self.costs(b1)).peak <= budget * (1 + SKIP_MARGIN)

    def feasible_at(self, b: int, budget: int) -> Solution | None:
        return solve(self.terms(b), self.costs(b), budget)

    def search(self, budget: int, batch_size: int | None = None, b1: int | None = None, b2: int | None = None) -> SearchResult:
        """The largest batch that fits `budget` (or `batch_size`) and its cheapest verified plan. A
        failure after the user's plain step ran is ckpt-tune's (docs/design.md §8): LimitationError."""
        try:
            res = self._search(budget, batch_size, b1, b2)
            if batch_size is None and self.world_size == 1 and self.accum_steps == 1 and not self.real.fake:
                res = self._refinement("the every-block floor", "the plan", lambda: self._floor(res, budget), res)
            return res
        except (torch.OutOfMemoryError, MemoryError, KeyboardInterrupt):
            raise
        except CkptTuneError as e:
            if not self.plain_ran or not isinstance(e, UserCodeError):
                raise
            self._plain_again()
            raise self._limitation(e) from e
        except Exception as e:
            if not self.plain_ran:
                raise
            self._plain_again()
            raise self._limitation(e) from e

    def _floor(self, res: SearchResult, budget: int) -> SearchResult:
        """The plan is never below what checkpointing every innermost block reaches (docs/design.md §4):
        the "checkpoint every X" a user would write. Where the chain's units are not those blocks (a
        group taken whole because its blocks are not a chain, a module that loops over its blocks), or
        the planner's estimate fell short, that configuration is run at the next batch; when it fits, it
        is the answer at the largest batch its measured peaks reach, verified. Every step it runs is
        checkpointed: one that runs out of device memory does not fit."""
        leaves = tuple(n for n in find_blocks(self.runner.model) if n not in self._refused)
        what = "every block"
        if not leaves and self._looping:  # a loop in the model's own forward: each call checkpointed
            leaves, what = self._looping, "the modules that run more than once per step"
        if not leaves:
            return res

        def peak_at(batch: int) -> int:
            self._at = batch
            self.runs += 1
            try:
                return self.runner.measure(batch, checkpoint=leaves).peak_bytes
            except torch.OutOfMemoryError:
                return budget + 1

        b = res.batch_size
        above = peak_at(b + 1)
        if above > budget:
            return res
        per = max(above - peak_at(b), 1)
        best, peak = b + 1, above
        guess = b + 1 + (budget - above) // per
        while guess > best:
            got = peak_at(guess)
            if got <= budget:
                best, peak = guess, got
                break
            guess -= max(1, -(-(got - budget) // per))
        for _ in range(FLOOR_STEPS_UP):  # the linear estimate is from two runs: one more batch may fit
            got = peak_at(best + 1)
            if got > budget:
                break
            best, peak = best + 1, got
        if self.real is not self.runner:  # probed under fake tensors: the answer is verified for real
            self.runs += 1
            peak = self._measure_plan(best, leaves, self.real).peak_bytes
            if peak > budget:
                return res
        # the checkpointed step's time: its blocks' forwards run twice, the plain step's once
        timing = self.real.time_step(best, checkpoint=leaves)
        self.real_timed += 4 if self.real is not self.runner else 0
        again = sum(timing.forward_ms.get(n, 0.0) for n in leaves)
        recompute = again / max(timing.step_ms - again, 1e-9)
        predicted = above + (best - b - 1) * per  # linear in the batch from the two runs, made before `best` ran
        out = replace(
            res,
            batch_size=best,
            checkpoint=entries_of(leaves),
            predicted_peak=predicted,
            first_predicted_peak=predicted,
            resolved=False,
            verified_peak=peak,
            recompute_fraction=round(recompute, 4),
            step_ms=timing.step_ms - again,
            units=leaves,
            baselines={},
            notes=[*res.notes, f"checkpointing {what} ({len(leaves)}: {leaves[0]}{', …' if len(leaves) > 1 else ''}) reaches batch {best}, the "
                   f"chain's plan batch {b}: the answer is {what}, verified at {format_bytes(peak)}"],
        )
        # the plain step at this batch is not run (on a device of the budget's size it would not fit)
        out.baselines["every block"] = FrontierRow(best, out.checkpoint, peak, out.recompute_fraction, True)
        out.probes = self.runs
        self._real_counts(out)
        return out

    def _real_counts(self, res: SearchResult) -> None:
        """The result's counts of real steps, where the probes ran under fake tensors."""
        if self.real is not self.runner:
            res.real_steps, res.timed_steps = len(self.real_peaks), self.real_timed
            res.largest_real_peak = max(self.real_peaks, default=None)

    def _first_steps(self, batch_size: int) -> None:
        """The ordering step; with probes under fake tensors, the user's step run for real first
        (`_real_plain`), so that whatever the user's code keeps from its first call (a cached batch, a
        lazily built buffer) is made of real tensors, as in training."""
        if not self.plain_ran and self.real is not self.runner:
            self._real_plain(batch_size)
        self.order_units(batch_size)

    def _real_plain(self, batch_size: int) -> None:
        """Probes under fake tensors: the user's step run for real once, at the first small batch, as it
        is (the first step of any search), so that a failure of the real step is the user's and what
        fails later is ckpt-tune's."""
        self._say(f"running the step for real at batch {batch_size}")
        m = self.real.measure(batch_size)
        self.real_peaks.append(m.peak_bytes)
        self.runs += 1
        self.plain_ran = True

    def _plain_again(self) -> None:
        """After a failure: the user's plain step at the batch it happened at, with nothing of ckpt-tune's
        added. It raising (make_batch or the model cannot take that batch) is the user's error."""
        if self._at is not None and (self._at != self.b1 or self.real is not self.runner):
            self.real.measure(self._at)

    def _limitation(self, error: BaseException) -> LimitationError:
        return LimitationError(
            f"ckpt-tune could not plan this model: the training step runs as it is, but ckpt-tune's own "
            f"machinery failed on it ({_first_line(error)}); chain of {len(self.units)} candidate modules"
            + (f", first {self.units[0]}" if self.units else ""),
            "this is a limitation of ckpt-tune, not an error in your step: please report it with the output "
            "of --debug; `--candidates blocks` offers fewer refinements",
        )

    def _search(self, budget: int, batch_size: int | None, b1: int | None, b2: int | None) -> SearchResult:
        self.b1, self.b2 = b1 or self.b1, b2 or self.b2
        self._settled = False
        self.budget = budget
        try:
            self._first_steps(self.b1)
        except Exception as e:  # raised by the user's model (session.user_errors words it for the user)
            if self.b1 != 1 or ONE_SAMPLE_FAILS not in str(e):
                raise
            # BatchNorm over a 1x1 feature map cannot train on one sample: the smallest batch is 2
            self.notes.append("batch 1 cannot train this model (BatchNorm needs more than one value per channel): batches start at 2")
            self.b1 = 2
            self._first_steps(self.b1)
        b1, b2 = self.b1, self.b2
        over = self._states_over(budget)  # the ordering step has built every state: nothing to probe
        if over is not None:
            raise over
        self.prefetch((b1, b2) if batch_size is None else (batch_size, b1, b2), timing=(batch_size or b1,))
        if batch_size is None:
            guess = self.largest_fitting(budget, b1, b2)
            if guess == 0:
                raise self._no_fit(budget, b1)
            b = self._settle(guess, budget, b1, b2)
        else:
            b = batch_size
        room, tightened = budget, 0
        verified: dict[tuple[int, ...], int] = {}  # choice -> its measured peak, at batch b
        trials = solves = 0
        # every pass solves at b, or gives b up; a batch has at most SOLVES_PER_BATCH solves and b only
        # goes down, so the loop ends: with a verified plan, or no-fit at the smallest batch (or the given one)
        while True:
            sol = solve(self.terms(b), self.costs(b), room)
            if sol is None or tightened >= MAX_TIGHTENINGS or solves >= SOLVES_PER_BATCH:
                if batch_size is None and b > b1:  # this batch does not fit after all: one smaller
                    b, room, tightened, verified, trials, solves = b - 1, budget, 0, {}, 0, 0
                    continue
                raise self._no_fit(budget, b, verified)
            solves += 1
            rerun = sol.choice in verified  # solved again after its own run, on terms learned from it
            if not rerun:
                self._first_predicted.setdefault((b, sol.choice), sol.peak)
            if sol.choice not in verified and (b, sol.choice) in self._speculated and self.accum_steps == 1:
                verified[sol.choice] = self._speculated[(b, sol.choice)]  # verified alongside the probes at b
            if sol.choice not in verified:
                segs = segments_of(sol.choice)
                estimated = any(self._prev_of(sol.choice, i) not in self.terms(b).segments[(i, j)].measured for i, j in segs)
                try:
                    verified[sol.choice] = self.verify(b, tuple(sol.names(self.terms(b))), sol.choice)
                except (torch.OutOfMemoryError, NoFitError, KeyboardInterrupt):
                    raise
                except Exception as e:
                    if not self._drop_refinements(sol.choice, e):
                        raise
                    continue
                if estimated:
                    # the segments' terms are measured now: solve again on them before trusting the plan
                    trials += 1
                    if trials >= SEGMENT_TRIALS:
                        self.drop_estimated_segments(b)
                    continue
            peak = verified[sol.choice]
            if peak <= budget:
                res = self._result(b, sol, peak, budget)
                res.first_predicted_peak = self._first_predicted.get((b, sol.choice), sol.peak)
                res.resolved = rerun and res.first_predicted_peak != sol.peak
                if res.resolved:
                    res.notes.append(
                        f"predicted at {format_bytes(res.first_predicted_peak)} before its first run, where its "
                        f"segments' terms were estimated; solved again on the terms that run measured: "
                        f"{format_bytes(res.predicted_peak)}, the plan file's predicted_peak_bytes"
                    )
                return res
            room = tighten(room, sol.peak, peak, budget)  # the model was optimistic here
            tightened += 1

    def _drop_refinements(self, choice: tuple[int, ...], error: BaseException) -> bool:
        """A plan failed when run: drop what it used beyond checkpointing whole blocks (its segments,
        groups, sub-module options and op policies) and say so; False when it used none of those."""
        segs = segments_of(choice)
        runs = [key for key in segs if key not in self.spans]
        groups = [key for key in segs if key in self.spans]
        finer = sorted({k for k in choice if k >= 2})
        if not (runs or groups or finer):
            return False
        if runs or groups:
            self._forbid_segments(runs + groups, _first_line(error))
        for k in finer:
            self._drop_option(self.options[k], error)
        return True

    def _forbid_segments(self, segs: list[tuple[int, int]], why: str) -> None:
        """Drop segments whose recompute did not repeat the forward (code between their blocks saved
        tensors for backward): every segment spanning the same blocks' links goes."""
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
        for b, t in self._terms.items():
            self._terms[b] = replace(t, segments={k: v for k, v in t.segments.items() if k in keep})
        for known in self._measured_segments.values():
            for k in [k for k in known if k not in keep]:
                del known[k]
        names = ", ".join(f"{self.units[i]}..{self.units[j]}" for i, j in segs)
        self.notes.append(f"segments {names} dropped: their recompute did not repeat the forward ({why.splitlines()[0][:120]})")

    @staticmethod
    def _prev_of(choice: tuple[int, ...], i: int) -> int:
        """The predecessor option block i sees: a segment before it counts as checkpointed."""
        return 0 if i == 0 else (1 if choice[i - 1] < 0 else choice[i - 1])

    def _result(self, b: int, sol: Solution, verified: int, budget: int) -> SearchResult:
        costs, step = self.costs(b), self.step_ms(b)
        res = SearchResult(
            batch_size=b,
            checkpoint=sol.names(self.terms(b)),
            predicted_peak=sol.peak,
            verified_peak=verified,
            recompute_fraction=round(sol.cost / step, 4),
            budget=budget,
            units=self.units,
            step_ms=step,
        )
        n = len(self.units)
        t = self.terms(b)
        for label, choice in (("no checkpointing", (0,) * n), ("every block", (1,) * n)):
            peak = t.measured.get(choice, predict(t, choice))
            cost = sum(c[x] for c, x in zip(costs, choice, strict=False))
            res.baselines[label] = FrontierRow(b, t.names(choice), peak, round(cost / step, 4), peak <= budget)
        res.probes = self.runs
        res.notes.extend(self.notes)
        res.extended_terms = self.repeat.extended() if self.repeat is not None and self._kind == 1 else {}
        res.stage_seconds = dict(self.stage_seconds)
        self._real_counts(res)
        return res

    def frontier_sizes(self, b: int) -> list[int]:
        """The batch sizes the frontier shows around answer b."""
        return sorted({self.b1, self.b2, max(1, b // 2), b, b + 1})

    def frontier(self, budget: int, batch_sizes: list[int], b1: int, b2: int, timed_at: int) -> list[FrontierRow]:
        """Best plan per batch size on fitted terms; recompute as a fraction of the step timed at `timed_at`.
        Rows solved alongside the probes at `timed_at` (`_record_shorts`) are taken as they came, where
        nothing they rest on changed since."""
        got = self._frontiers.get((self._kind, budget, tuple(batch_sizes), b1, b2, timed_at))
        if got is not None and got[1] == self._version and set(self._terms) - {timed_at} == got[2]:
            return list(got[0])
        # probed here, before the solves are shared out, and before the costs are read: a probe that drops
        # a failing option renumbers the options and clears the costs timed with it
        self.terms(b1), self.terms(b2)
        costs, step = self.costs(timed_at), self.step_ms(timed_at)
        # each batch's solve is pure arithmetic on recorded terms: under fake tensors, where a 70B's
        # loose budget at batch 1 makes a large DP, they are shared out over the cores (measure/forked.py)
        return fork_map(lambda b: self._row(b, budget, b1, b2, costs, step), batch_sizes, self._workers(len(batch_sizes)))

    def _row(self, b: int, budget: int, b1: int, b2: int, costs, step: float) -> FrontierRow:
        t = self.fitted(b, b1, b2)
        sol = solve(t, costs, budget)
        if sol is None:
            mp = min_peak(t, costs)
            return FrontierRow(b, mp.names(t), mp.peak, round(mp.cost / step, 4), False)
        return FrontierRow(b, sol.names(t), sol.peak, round(sol.cost / step, 4), True)

    def _states(self) -> tuple[int, int, int]:
        """(parameters, gradients, optimizer state) on one GPU, as of the last recorded step."""
        params, opt, grads = self.runner.state_bytes()
        if self.sharding == "arithmetic":
            per = static_per_gpu(params, grads, opt, self.world_size, self.shard, self.gathered_bytes())
            params, grads, opt = per.params + per.gathered, per.grads, per.optimizer
        return params, grads, opt

    def _states_over(self, budget: int, where: str = "") -> NoFitError | None:
        """The answer when weights + gradients + optimizer state alone exceed the budget (None if not):
        no plan or batch can help, so search says so after its first recorded step."""
        params, grads, opt = self._states()
        states = params + grads + opt
        if states <= budget:
            return None
        n = sum(p.numel() for p in self.runner.model.parameters() if p.requires_grad) or 1
        return NoFitError(
            f"nothing fits {format_bytes(budget)}: weights + gradients + optimizer state alone are "
            f"{format_bytes(states)} ({format_bytes(params)} + {format_bytes(grads)} + {format_bytes(opt)}, "
            f"{states / n:.1f} bytes per trainable parameter), more than the budget before any activation"
            + (f"; {where}" if where else ""),
            "no checkpoint plan can fix that: shard the states over GPUs (FSDP / ZeRO-3), use an 8-bit optimizer "
            "or train adapters (LoRA); `ckpt-tune diagnose` predicts each",
        )

    def _no_fit(self, budget: int, b: int, verified: dict[tuple[int, ...], int] | None = None) -> NoFitError:
        t = self.terms(b)
        mp = min_peak(t, self.costs(b))
        over = [p for p in (verified or {}).values() if p > budget]
        if mp.peak <= budget and over:
            # the model says a plan fits, but every plan run measured over the budget
            return NoFitError(
                f"no verified plan fits {format_bytes(budget)} at batch {b}: {len(over)} plan(s) predicted to fit "
                f"measured over it when run (by up to {format_bytes(max(over) - budget)}), though the smallest "
                f"predicted peak is {format_bytes(mp.peak)}",
                "the memory model is optimistic for this model here; allow that much more --vram or a smaller "
                "--batch-size, and please report it (ckpt-tune search --json shows the plans tried)",
            )
        where = (
            f"the smallest peak reachable at batch {b} is {format_bytes(mp.peak)} "
            f"(checkpointing in {sum(1 for c in mp.choice if c)} of {len(self.units)} blocks)"
        )
        alone = self._states_over(budget, where)
        if alone is not None:
            return alone
        states = sum(self._states())
        return NoFitError(
            f"nothing fits {format_bytes(budget)}: {where}; weights + gradients + optimizer state are "
            f"{format_bytes(states)}, the step's activations and temporaries the rest",
            "raise --vram, use --precision bf16-mixed, a smaller --batch-size, or see `ckpt-tune diagnose`",
        )


def _largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest batch from `start` up to MAX_BATCH for which `fits` holds, by doubling then bisection
    (`fits` taken as monotone); 0 when it does not hold at `start`."""
    if not fits(start):
        return 0
    lo, hi = start, 2 * start
    while hi <= MAX_BATCH and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, MAX_BATCH + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _first_line(error: BaseException) -> str:
    """`Type: the first line of the message`, at most 160 characters of it."""
    text = str(error).strip()
    if isinstance(error, CkptTuneError):
        text = error.message
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def _inputs_changed(model: torch.nn.Module, names):
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
