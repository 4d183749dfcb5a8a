"""`diagnose`: does the step fit, where is its peak, what is live then, and which remedies make it fit.

    from ckpt_tune.diagnosis import diagnose
    d = diagnose("examples/gpt.py:build", vram="6GiB", batch_size=8)
    d.fits, d.peak.where, [(r.title, r.peak_bytes, r.fits) for r in d.remedies]

One attributed recorded step gives the moments (sharding.Moment: what is live at the largest point of
start, forward, backward and optimizer step). Each remedy is then either measured (checkpoint plans,
smaller micro-batches, bf16 autocast: recorded steps with the remedy applied) or predicted by arithmetic
on measured moments (8-bit optimizer, LoRA, activation offload, sharding: sharding.py); `Remedy.basis`
says which. Ranking: what fits first; then what keeps what is trained, fewer GPUs, lower accuracy risk,
less extra time (`rank_remedies`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError, NoFitError
from ckpt_tune.measure import session
from ckpt_tune.measure.device import Budget, parse_budget, resolve_device
from ckpt_tune.measure.profiler import OUTSIDE, StepProfile, build_profile, module_records
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.tune.moments import moments_of
from ckpt_tune.tune.planner import min_peak, solve
from ckpt_tune.tune.searcher import Searcher
from ckpt_tune.tune.sharding import (
    LoraPlan,
    Moment,
    StaticBytes,
    accumulate_moment,
    check_shard,
    eight_bit_moment,
    eight_bit_state_bytes,
    lora_moment,
    offload_moment,
    peak_of,
    per_gpu_terms,
    shard_moment,
    static_per_gpu,
)
from ckpt_tune.units import format_bytes

if TYPE_CHECKING:
    from ckpt_tune.tune.search import Settings

ACCURACY = ("none", "low", "changes what is trained")


@dataclass(frozen=True)
class Remedy:
    kind: str  # checkpoint | mixed-precision | micro-batch | 8bit-optimizer | lora | offload | zero1 | zero2 | zero3
    title: str  # what to do, in one line
    peak_bytes: int  # peak per GPU after the remedy
    fits: bool
    basis: str  # "measured", "measured + arithmetic" or "predicted (arithmetic)"
    peak_where: str  # where that peak is reached
    gpus: int = 1
    time_overhead: float | None = 0.0  # extra step time as a fraction of today's step; None: not known here
    accuracy: str = "none"  # one of ACCURACY
    cost: str = ""  # the cost in words
    assumes: str = ""  # what the number rests on
    keeps_setup: bool = True  # same model, optimizer, trainable weights and GPU count
    config: dict[str, Any] = field(default_factory=dict)  # the settings that realise it (plan names, batch sizes, …)


@dataclass(frozen=True)
class Diagnosis:
    target: str
    device: str
    precision: str
    optimizer: str
    batch_size: int
    budget: Budget
    world_size: int
    shard: str
    profile: StepProfile  # the measured step on one device (no sharding applied)
    moments: tuple[Moment, ...]  # per GPU
    states: StaticBytes  # weights, gradients, optimizer state per GPU
    floor: Remedy | None  # the smallest peak checkpointing reaches at batch 1 (per GPU), measured
    remedies: tuple[Remedy, ...]  # ranked
    units: tuple[str, ...]  # checkpoint candidates, in execution order
    notes: tuple[str, ...] = ()

    @property
    def peak(self) -> Moment:
        return peak_of(self.moments)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.budget.usable_bytes

    @property
    def states_exceed(self) -> bool:
        return self.states.params + self.states.grads + self.states.optimizer > self.budget.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("target", "device", "precision", "optimizer", "batch_size", "world_size", "shard")}
        d.update(
            budget=asdict(self.budget),
            fits=self.fits,
            peak=_moment_dict(self.peak),
            moments=[_moment_dict(m) for m in self.moments],
            states=asdict(self.states) | {"total": self.states.params + self.states.grads + self.states.optimizer},
            states_exceed_budget=self.states_exceed,
            floor=asdict(self.floor) if self.floor else None,
            remedies=[asdict(r) for r in self.remedies],
            candidates=list(self.units),
            notes=list(self.notes),
            profile=self.profile.to_dict(),
        )
        return d


def _moment_dict(m: Moment) -> dict[str, Any]:
    d = asdict(m)
    d["modules"] = [{"module": n or OUTSIDE, "bytes": b} for n, b in m.modules]
    d["total"] = m.total
    return d


# -- LoRA: the adapter used by the prediction, and to apply it for real ------------------------------

WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)


class LoRALinear(nn.Module):
    """A frozen `base` Linear plus a trainable rank-r update: base(x) + (alpha/r)·lora_b(lora_a(x))
    (Hu et al. 2021); lora_b starts at zero, so the model computes what it did before."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))  # [..., out_features]


def lora_targets(model: nn.Module, units: tuple[str, ...]) -> tuple[str, ...]:
    """The Linear layers that get adapters: those inside the repeated blocks, or every one without blocks."""
    names = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if units:
        names = [n for n in names if any(n.startswith(u + ".") for u in units)]
    return tuple(names)


def apply_lora(model: nn.Module, rank: int, names: tuple[str, ...]) -> nn.Module:
    """Freeze every parameter, then wrap the named Linear layers with LoRALinear adapters (in place)."""
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(parent.get_submodule(child), rank))
    return model


@contextlib.contextmanager
def lora_applied(model: nn.Module, rank: int, names: tuple[str, ...]) -> Iterator[nn.Module]:
    """apply_lora for the length of a `with`, then the original layers and requires_grad flags come back."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    wrapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        model.requires_grad_(False)
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            wrapped.append((parent, child, parent.get_submodule(child)))
            setattr(parent, child, LoRALinear(wrapped[-1][2], rank))
        yield model
    finally:
        for parent, child, original in reversed(wrapped):
            setattr(parent, child, original)
        for p, flag in flags:
            p.requires_grad_(flag)


def lora_plan(model: nn.Module, prof: StepProfile, units: tuple[str, ...], rank: int) -> LoraPlan | None:
    """What `apply_lora(model, rank, lora_targets(model, units))` changes, from the model's shapes and the profile."""
    names = lora_targets(model, units)
    if not names:
        return None
    rec = {r.name: r for r in prof.modules}
    adapter_bytes, saves, branch = 0, [], 0
    for n in names:
        lin = model.get_submodule(n)
        es = lin.weight.element_size()
        adapter_bytes += rank * (lin.in_features + lin.out_features) * es
        r = rec.get(n)
        inp = r.input_bytes if r else 0
        saves.append((n, inp * rank // max(lin.in_features, 1), bool(r and r.activation_bytes)))
        branch = max(branch, inp)
    frozen = tuple(
        n for n, mod in model.named_modules()
        if isinstance(mod, WEIGHT_LAYERS) and n not in names and any(p.requires_grad for p in mod.parameters(recurse=False))
    )
    trainable = _unique_bytes(p for p in model.parameters() if p.requires_grad)
    return LoraPlan(rank, names, frozen, adapter_bytes, tuple(saves), branch, trainable, prof.optimizer_bytes)


def _unique_bytes(params) -> int:
    seen = {}
    for p in params:
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


# -- ranking and the answer ----------------------------------------------------------------------------


def rank_remedies(remedies: list[Remedy] | tuple[Remedy, ...]) -> tuple[Remedy, ...]:
    """What fits first. Among those: what keeps what is trained before what changes it, then fewer GPUs,
    lower accuracy risk, less extra time (unknown last). What does not fit: closest to the budget first."""

    def key(r: Remedy):
        acc = ACCURACY.index(r.accuracy)
        if r.fits:
            t = r.time_overhead if r.time_overhead is not None else float("inf")
            return (0, acc >= 2, r.gpus, acc, t, r.peak_bytes)
        return (1, r.peak_bytes, r.gpus, acc, 0.0, 0)

    return tuple(sorted(remedies, key=key))


def no_fit_error(d: Diagnosis) -> NoFitError | None:
    """NoFitError (exit 3) when the step does not fit and nothing that keeps the model, optimizer, trainable
    weights and GPU count makes it fit; its message leads with the states against the budget."""
    if d.fits or any(r.fits and r.keeps_setup for r in d.remedies):
        return None
    usable = d.budget.usable_bytes
    s = d.states
    per_gpu = f" per GPU ({d.shard} over {d.world_size})" if d.world_size > 1 else ""
    states = (
        f"weights {format_bytes(s.params)} + gradients {format_bytes(s.grads)} + optimizer state "
        f"{format_bytes(s.optimizer)} = {format_bytes(s.params + s.grads + s.optimizer)}{per_gpu}"
    )
    if d.states_exceed:
        lead = f"{states} exceed the budget {format_bytes(usable)} before any activation: no checkpoint plan or batch size can fit"
    elif d.floor is not None and not d.floor.fits:
        lead = (
            f"{states} of a {format_bytes(usable)} budget; even {d.floor.title} the step peaks at "
            f"{format_bytes(d.floor.peak_bytes)} ({d.floor.peak_where})"
        )
    else:
        lead = (
            f"{states} of a {format_bytes(usable)} budget; the step peaks at {format_bytes(d.peak.total)} "
            f"({d.peak.where}) and no remedy that keeps the model, optimizer and GPU count fits"
        )
    others = [r for r in d.remedies if not r.keeps_setup]
    if others:
        lines = [
            f"  {r.title}: {format_bytes(r.peak_bytes)}{' per GPU' if r.gpus > 1 else ''} "
            f"({'fits' if r.fits else 'does not fit'}, {r.basis})"
            for r in others
        ]
        lead += "\nwhat changes the setup:\n" + "\n".join(lines)
    return NoFitError(lead, "the remedy table above has the numbers and costs; --json has them all")


def summarize(d: Diagnosis) -> str:
    """One line: does it fit, by how much, where."""
    usable = d.budget.usable_bytes
    p = d.peak
    if d.fits:
        return f"fits: peak {format_bytes(p.total)} of {format_bytes(usable)} ({format_bytes(usable - p.total)} to spare), reached in {p.where}"
    return f"does not fit: peak {format_bytes(p.total)} is {format_bytes(p.total - usable)} over {format_bytes(usable)}, reached in {p.where}"


def states_exceed_text(d: Diagnosis) -> str:
    """Weights + gradients + optimizer state against the budget, for a diagnosis whose states alone exceed it."""
    s = d.states
    return (
        f"weights {format_bytes(s.params)} + gradients {format_bytes(s.grads)} + optimizer state "
        f"{format_bytes(s.optimizer)} = {format_bytes(s.params + s.grads + s.optimizer)} exceed the budget "
        f"{format_bytes(d.budget.usable_bytes)} before any activation: no checkpoint plan or batch size can fit"
    )


# -- the library call ---------------------------------------------------------------------------------


def diagnose(
    target: str | None,
    vram: str,
    batch_size: int = 8,
    margin: str | None = None,
    settings: Settings | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    lora_rank: int = 8,
    progress: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Measure one step of `target` at `batch_size` against `vram` (per GPU with `world_size`/`shard`),
    and when it does not fit, every remedy's peak, measured where a recorded step can show it."""
    from ckpt_tune.measure import session

    settings = settings or session.Settings()
    n, shard = check_shard(world_size, shard)
    if lora_rank < 1:
        raise CkptTuneError(f"--lora-rank must be at least 1, got {lora_rank}", "e.g. --lora-rank 8")
    t = session.load(target, settings)
    device = resolve_device(settings.device)
    budget = parse_budget(vram, device, margin)
    model, runner, step = session.build_runner(t, settings)
    study = _Study(model, runner, step, t.spec, batch_size, budget, n, shard, lora_rank, progress)
    try:
        _run(study, runner)
    except CkptTuneError as e:
        if isinstance(e.__cause__, (MemoryError, torch.OutOfMemoryError)):
            # the device cannot hold the step it is asked about: measure where memory is plentiful
            raise CkptTuneError(e.message, "run diagnose with --device cpu: it measures the same step exactly, "
                                "and the budget stays the GPU's") from e
        raise
    return study.result()


def _run(study: _Study, runner) -> None:
    with session.user_errors("diagnosing"):
        with runner:
            study.recording = True
            study.start()
            if not study.fits:
                study.single_gpu_remedies()
            study.recording = False
        if not study.fits:  # remedies that run the step under other settings, each with its own runner
            study.mixed_precision()
            study.lora()


class _Study:
    """The recorded steps of one diagnosis (cached per batch size and checkpointed blocks) and the
    remedies built from them. Moments are kept as measured (one device); `per_gpu` applies the sharding
    the user asked for."""

    def __init__(self, model, runner, step, target, batch_size, budget, n, shard, lora_rank, progress) -> None:
        self.model, self.runner, self.step, self.target = model, runner, step, target
        self.b, self.budget, self.usable = batch_size, budget, budget.usable_bytes
        self.n, self.shard, self.lora_rank = n, shard, lora_rank
        self.say = progress or (lambda msg: None)
        self.raw: dict[tuple[int, tuple[str, ...]], tuple[Moment, ...]] = {}
        self.remedies: list[Remedy] = []
        self.notes: list[str] = []
        self.floor: Remedy | None = None
        self.gathered = 0
        self._min_plan: tuple[tuple[str, ...], float] | None = None
        self.recording = False  # True while self.runner is open

    # -- recorded steps ---------------------------------------------------------------------------
    def moments(self, b: int, names: tuple[str, ...] = ()) -> tuple[Moment, ...]:
        key = (b, tuple(names))
        if key not in self.raw:
            if not self.recording:  # the runner's optimizer is gone once it closed: a record now would be wrong
                raise RuntimeError(f"diagnose: batch {b} with {names} was not recorded while the runner was open")
            self.say(f"recording batch {b}" + (f", {len(names)} blocks checkpointed" if names else ""))
            self.raw[key] = moments_of(self.runner.measure(b, checkpoint=list(names), attribute=True))
        return self.raw[key]

    def per_gpu(self, m: Moment) -> Moment:
        return shard_moment(m, self.n, self.shard, self.gathered)

    def peak(self, raws, fn: Callable[[Moment], Moment] = lambda m: m) -> Moment:
        return peak_of(self.per_gpu(fn(m)) for m in raws)

    def start(self) -> None:
        b = self.b
        self.say(f"recording batch {b}")
        m = self.runner.measure(b, attribute=True)
        timing = self.runner.time_step(b, repeats=3)
        self.prof = build_profile(m, module_records(self.model, m, timing), None, timing, self.step, self.target)
        self.raw[(b, ())] = moments_of(m)
        self.searcher = Searcher(self.runner, progress=self.say)
        if self.searcher.units:
            self.searcher.order_units(1)
        self.units = self.searcher.units
        rec = {r.name: r for r in self.prof.modules}
        leaves = [n for n, mod in self.model.named_modules() if next(mod.children(), None) is None]
        # the all-gathered working set of ZeRO-3/FSDP: one wrapped block, or one layer without blocks
        self.gathered = max([rec[u].param_bytes for u in self.units if u in rec] or [rec[n].param_bytes for n in leaves if n in rec] or [0])
        # one autograd node's parameter gradients (a layer's weight and bias), in flight during accumulation
        self.in_flight = max(
            [_unique_bytes(p for p in mod.parameters(recurse=False) if p.requires_grad) for mod in self.model.modules()] or [0]
        )
        self.states = static_per_gpu(self.prof.param_bytes, self.prof.grad_bytes, self.prof.optimizer_bytes, self.n, self.shard, self.gathered)
        self.base = self.peak(self.raw[(b, ())])
        self.fits = self.base.total <= self.usable
        if not self.units:
            self.notes.append("no repeated blocks (children of a ModuleList/Sequential) found: checkpointing has no candidates")

    def result(self) -> Diagnosis:
        p = self.prof
        return Diagnosis(
            target=self.target, device=p.device, precision=p.precision, optimizer=p.optimizer, batch_size=self.b,
            budget=self.budget, world_size=self.n, shard=self.shard, profile=p,
            moments=tuple(self.per_gpu(m) for m in self.raw[(self.b, ())]), states=self.states, floor=self.floor,
            remedies=rank_remedies(self.remedies), units=self.units, notes=tuple(self.notes),
        )

    # -- checkpoint plans -------------------------------------------------------------------------
    def terms(self, b: int):
        t = self.searcher.terms(b)
        if self.n > 1:
            t = per_gpu_terms(t, self.prof.param_bytes, self.prof.optimizer_bytes, self.n, self.shard, self.gathered)
        return t

    def fit_plan(self, b: int, accumulate: bool = False) -> tuple[tuple[str, ...], float, Moment]:
        """The cheapest plan at micro-batch b whose recorded per-GPU peak fits (the planner's choice,
        tightened by any overshoot, as Searcher.search); else the smallest-peak plan. (names, recompute ms, peak)"""
        fn = (lambda m: accumulate_moment(m, self.prof.grad_bytes, self.in_flight)) if accumulate else (lambda m: m)
        terms, costs = self.terms(b), self.searcher.costs(b)
        room = self.usable - (self.states.grads if accumulate else 0)
        for _ in range(4):
            sol = solve(terms, costs, room)
            if sol is None:
                break
            names = self.names(sol.choice)
            pk = self.peak(self.moments(b, names), fn)
            if pk.total <= self.usable:
                return names, sol.cost, pk
            room -= pk.total - self.usable
        mp = min_peak(terms, costs)
        names = self.names(mp.choice)
        return names, mp.cost, self.peak(self.moments(b, names), fn)

    def min_plan(self) -> tuple[tuple[str, ...], float]:
        if self._min_plan is None:
            mp = min_peak(self.terms(self.b), self.searcher.costs(self.b))
            self._min_plan = (self.names(mp.choice), mp.cost)
        return self._min_plan

    def compose(
        self, fn: Callable[[Moment], Moment], terms_fn: Callable[[Terms], Terms] | None = None
    ) -> tuple[Moment, tuple[str, ...], float]:
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
            return both, names, cost / self.searcher.step_ms(self.b)
        return alone, (), 0.0

    def cheapest_plan(
        self, fn: Callable[[Moment], Moment], terms_fn: Callable[[Terms], Terms]
    ) -> tuple[Moment, tuple[str, ...], float] | None:
        terms, costs = terms_fn(self.terms(self.b)), self.searcher.costs(self.b)
        room = self.usable
        for _ in range(4):
            sol = solve(terms, costs, room)
            if sol is None:
                return None
            names = self.names(sol.choice)
            pk = self.peak(self.moments(self.b, names), fn)
            if pk.total <= self.usable:
                return pk, names, sol.cost / self.searcher.step_ms(self.b)
            room -= pk.total - self.usable  # the model was optimistic here: tighten, as Searcher.search
        return None

    def names(self, choice: tuple[int, ...]) -> tuple[str, ...]:
        """Module names of a planner choice (whole blocks, or a block's sub-module where the searcher offers one)."""
        if hasattr(self.searcher, "names"):
            return tuple(self.searcher.names(choice))
        return tuple(u for u, c in zip(self.units, choice) if c)

    def _ckpt_label(self, names: tuple[str, ...]) -> str:
        return f"{len(names)} of {len(self.units)} blocks"

    # -- the remedies -----------------------------------------------------------------------------
    def single_gpu_remedies(self) -> None:
        basis = "measured" if self.n == 1 else "measured + arithmetic"
        if self.units:
            self.checkpoint(basis)
        self.set_floor(basis)
        self.micro_batch()
        self.eight_bit()
        self.offload()
        if self.n == 1:
            self.sharding()
        if self.units:  # recorded now, while the searcher's runner is open: LoRA's estimate composes with it
            self.moments(self.b, self.min_plan()[0])

    def checkpoint(self, basis: str) -> None:
        names, cost, pk = self.fit_plan(self.b)
        frac = cost / self.searcher.step_ms(self.b)
        shown = ": " + ", ".join(names) if 0 < len(names) <= 4 else ""
        self.remedies.append(Remedy(
            "checkpoint", f"checkpoint {self._ckpt_label(names)}{shown}", pk.total, pk.total <= self.usable, basis,
            pk.where, gpus=self.n, time_overhead=round(frac, 4), cost=f"recompute: +{frac:.0%} step time",
            assumes="non-reentrant torch.utils.checkpoint on the named blocks (ckpt_tune.apply); placement by the exact planner",
            config={"checkpoint": list(names), "batch_size": self.b},
        ))

    def set_floor(self, basis: str) -> None:
        if self.units:
            mp = min_peak(self.terms(1), self.searcher.costs(1))
            names = self.names(mp.choice)
            title = f"with {self._ckpt_label(names)} checkpointed at batch 1"
        else:
            names, title = (), "at batch 1"
        pk = self.peak(self.moments(1, names))
        self.floor = Remedy("floor", title, pk.total, pk.total <= self.usable, basis, pk.where, gpus=self.n,
                            config={"checkpoint": list(names), "batch_size": 1})

    def micro_batch(self) -> None:
        b = self.b
        if b == 1:
            self.notes.append("batch 1 already: no smaller micro-batch")
            return
        acc = lambda m: accumulate_moment(m, self.prof.grad_bytes, self.in_flight)  # noqa: E731
        chosen: tuple[int, tuple[str, ...], float, Moment] | None = None
        for mb in [d for d in range(b - 1, 0, -1) if b % d == 0][:6]:
            chosen = (mb, (), 0.0, self.peak(self.moments(mb), acc))
            if chosen[3].total <= self.usable:
                break
        else:
            if self.units:
                names, cost, pk = self.fit_plan(1, accumulate=True)
                if pk.total <= self.usable:
                    chosen = (1, names, cost, pk)
        assert chosen is not None
        mb, names, _cost, pk = chosen
        k = b // mb
        # timed back to back (the same machine load for both), the micro-step with its plan applied
        t_b = self.runner.time_step(b, repeats=3).step_ms
        t_m = self.runner.time_step(mb, checkpoint=list(names), repeats=3).step_ms
        overhead = max(0.0, k * t_m / t_b - 1)
        bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        title = f"micro-batch {mb} × {k} accumulation steps (effective batch {b})"
        if names:
            title += f" + checkpoint {self._ckpt_label(names)}"
        self.remedies.append(Remedy(
            "micro-batch", title, pk.total, pk.total <= self.usable, "measured + arithmetic", pk.where, gpus=self.n,
            time_overhead=round(overhead, 4), accuracy="low" if bn else "none",
            cost=f"{k} sequential micro-steps: {overhead:+.0%} step time (timed here)"
            + ("; BatchNorm statistics over micro-batches" if bn else ""),
            assumes="a recorded step at the micro-batch, plus the gradients summed so far live through every "
            "later micro-step's forward and backward (added in place; one layer's new gradients in flight)",
            config={"batch_size": mb, "grad_accum_steps": k, "checkpoint": list(names)},
        ))

    def eight_bit(self) -> None:
        opt = self.step.optimizer
        if vocab.optimizer(opt).eight_bit is None:
            self.notes.append(f"optimizer {opt} keeps no state: an 8-bit optimizer saves nothing")
            return
        trainable = {p.untyped_storage().data_ptr(): p.numel() for p in self.model.parameters() if p.requires_grad}
        new = eight_bit_state_bytes(list(trainable.values()), opt)
        start = self.raw[(self.b, ())][0]
        saved = self.per_gpu(start).optimizer - self.per_gpu(eight_bit_moment(start, new)).optimizer
        pk, names, frac = self.compose(lambda m: eight_bit_moment(m, new), lambda t: replace(t, static=t.static - saved, measured={}))
        name = vocab.optimizer(opt).eight_bit
        title = f"8-bit optimizer state (bitsandbytes.optim.{name})"
        if names:
            title += f" + checkpoint {self._ckpt_label(names)}"
        self.remedies.append(Remedy(
            "8bit-optimizer", title, pk.total, pk.total <= self.usable, "predicted (arithmetic)", pk.where, gpus=self.n,
            time_overhead=round(frac, 4), accuracy="low", keeps_setup=False,
            cost=f"optimizer state {format_bytes(self.prof.optimizer_bytes)} → {format_bytes(new)}; quantized moments",
            assumes="bitsandbytes' layout: 1 byte per state value and an fp32 absmax per 256; tensors under 4096 "
            "values keep 32-bit state; the step's scratch as measured for torch's optimizer",
            config={"optimizer": f"bitsandbytes.optim.{name}", "optimizer_bytes": new, "checkpoint": list(names)},
        ))

    def lora(self) -> None:
        """Measured with the adapters applied (lora_applied), alone or with the smallest-peak checkpoint
        plan when only that fits; the arithmetic estimate (sharding.lora_moment) is kept beside it."""
        plan = lora_plan(self.model, self.prof, self.units, self.lora_rank)
        if plan is None or not plan.trainable_param_bytes:
            self.notes.append("no Linear layers to adapt: LoRA not considered")
            return
        fn = lambda m: lora_moment(m, plan)  # noqa: E731
        estimate = self.peak(self.moments(self.b), fn)  # arithmetic, LoRA alone: shown beside the record
        basis, alone = ("measured" if self.n == 1 else "measured + arithmetic"), None
        try:
            pk = alone = self._lora_peak(plan, ())
            names, frac = (), 0.0
            if pk.total > self.usable and self.units:
                found = self._lora_with_plan(plan)
                if found is not None:
                    pk, names, frac = found
        except Exception as e:  # a model whose code reads the wrapped layers' attributes directly
            (pk, names, frac), basis = self.compose(fn), "predicted (arithmetic)"
            self.notes.append(f"LoRA could not be applied for a recorded step ({type(e).__name__}: {e}); arithmetic estimate shown")
        where = " of the blocks" if self.units else ""
        title = f"LoRA rank {plan.rank} on {len(plan.adapted)} Linear layers{where}, everything else frozen"
        if names:
            title += f" + checkpoint {self._ckpt_label(names)}"
        check = (
            f"; without checkpointing it records {format_bytes(alone.total)} against {format_bytes(estimate.total)} "
            "estimated by arithmetic (sharding.lora_moment)" if alone is not None else ""
        )
        self.remedies.append(Remedy(
            "lora", title, pk.total, pk.total <= self.usable, basis, pk.where, gpus=self.n,
            time_overhead=round(frac, 4), accuracy="changes what is trained", keeps_setup=False,
            cost=f"trains {format_bytes(plan.adapter_param_bytes)} of adapters instead of {format_bytes(plan.trainable_param_bytes)}",
            assumes="ckpt_tune.diagnosis.apply_lora: adapters on the named layers, every other parameter frozen" + check,
            config={"lora_rank": plan.rank, "adapted": list(plan.adapted), "checkpoint": list(names),
                    "alone_measured_bytes": alone.total if alone is not None else None,
                    "alone_arithmetic_bytes": estimate.total},
        ))

    def _lora_with_plan(self, plan: LoraPlan) -> tuple[Moment, tuple[str, ...], float] | None:
        """The cheapest checkpoint plan that fits with the adapters: planned on terms whose static part
        loses the frozen weights' optimizer state (gradients are left in: the safe side), each candidate
        recorded with the adapters applied; else the smallest-peak plan if that fits."""
        start = self.raw[(self.b, ())][0]
        before, after = self.per_gpu(start), self.per_gpu(lora_moment(start, plan))
        saved = before.params + before.optimizer - after.params - after.optimizer
        terms, costs = replace(self.terms(self.b), measured={}), self.searcher.costs(self.b)
        terms = replace(terms, static=terms.static - saved)
        step, room = self.searcher.step_ms(self.b), self.usable
        for _ in range(3):
            sol = solve(terms, costs, room)
            if sol is None:
                break
            names = self.names(sol.choice)
            pk = self._lora_peak(plan, names)
            if pk.total <= self.usable:
                return pk, names, sol.cost / step
            room -= pk.total - self.usable
        names, cost = self.min_plan()
        pk = self._lora_peak(plan, names)
        return (pk, names, cost / step) if pk.total <= self.usable else None

    def _lora_peak(self, plan: LoraPlan, names: tuple[str, ...]) -> Moment:
        self.say("recording with LoRA adapters" + (f", {len(names)} blocks checkpointed" if names else ""))
        with lora_applied(self.model, plan.rank, plan.adapted), StepRunner(self.model, self.runner.batch_fn, self.runner.loss_fn, self.step) as r:
            return self.peak(moments_of(r.measure(self.b, checkpoint=list(names), attribute=True)))

    def offload(self) -> None:
        rec = {r.name: r for r in self.prof.modules}
        work = max([rec[u].subtree_activation_bytes for u in self.units if u in rec]
                   or [r.activation_bytes for r in self.prof.modules] or [0])
        pk = self.peak(self.moments(self.b), lambda m: offload_moment(m, work))
        moved = self.prof.activation_total_bytes
        ms = 2 * moved / PCIE_BYTES_PER_S * 1e3
        self.remedies.append(Remedy(
            "offload", "offload saved activations to CPU memory (torch.autograd.graph.save_on_cpu(pin_memory=True))",
            pk.total, pk.total <= self.usable, "predicted (arithmetic)", pk.where, gpus=self.n, time_overhead=None,
            cost=f"{format_bytes(moved)} to the host and back each step: ≈{ms:.1f} ms at 25 GB/s, hidden only behind enough compute",
            assumes=f"the GPU keeps one block's saved activations ({format_bytes(work)}) at a time; not measurable "
            "on CPU, where host and device memory are the same",
            config={"working_set_bytes": work, "host_bytes": moved},
        ))

    def sharding(self) -> None:
        base = self.moments(self.b)
        for stage in ("zero1", "zero2", "zero3"):
            def at(raws, n: int, stage=stage) -> Moment:
                return peak_of(shard_moment(m, n, stage, self.gathered) for m in raws)

            found: tuple[int, Moment, tuple[str, ...], float] | None = None
            for n in WORLD_SIZES:
                pk = at(base, n)
                if pk.total <= self.usable:
                    found = (n, pk, (), 0.0)
                    break
                if not self.units:
                    continue
                names, cost = self.min_plan()
                smallest = at(self.moments(self.b, names), n)
                if smallest.total <= self.usable:  # some plan fits at this world size: take the cheapest
                    cheap = self.cheapest_plan(
                        lambda m, n=n, stage=stage: shard_moment(m, n, stage, self.gathered),
                        lambda t, n=n, stage=stage: per_gpu_terms(
                            t, self.prof.param_bytes, self.prof.optimizer_bytes, n, stage, self.gathered),
                    )
                    if cheap is not None:
                        found = (n, cheap[0], cheap[1], cheap[2])
                    else:
                        found = (n, smallest, names, cost / self.searcher.step_ms(self.b))
                    break
            if found is None:
                found = (WORLD_SIZES[-1], at(base, WORLD_SIZES[-1]), (), 0.0)
            n, pk, names, frac = found
            what = SHARD_WHAT[stage]
            title = f"{SHARD_NAME[stage]} over {n} GPUs: {what} divided by {n}"
            if names:
                title += f" + checkpoint {self._ckpt_label(names)}"
            gathered = f"; plus one block's full parameters ({format_bytes(self.gathered)}) while it runs" if stage == "zero3" else ""
            self.remedies.append(Remedy(
                stage, title, pk.total, pk.total <= self.usable, "predicted (arithmetic)", pk.where, gpus=n,
                time_overhead=round(frac, 4), keeps_setup=False,
                cost=f"{n} GPUs ({n - 1} more); collectives every step",
                assumes=f"data parallel, the same micro-batch on each GPU; {what} divided by {n}{gathered}; "
                "communication buffers not counted",
                config={"world_size": n, "shard": stage, "checkpoint": list(names)},
            ))

    def mixed_precision(self) -> None:
        if self.step.precision != "fp32":
            self.notes.append(f"precision is {self.step.precision} already: no autocast remedy")
            return
        settings = StepSettings(self.step.device, "bf16-mixed", self.step.optimizer)
        self.say("recording with bf16 autocast")
        with StepRunner(self.model, self.runner.batch_fn, self.runner.loss_fn, settings) as r:
            pk = self.peak(moments_of(r.measure(self.b, attribute=True)))
        self.remedies.append(Remedy(
            "mixed-precision", "bf16 autocast (--precision bf16-mixed; fp16-mixed saves the same, with a GradScaler)",
            pk.total, pk.total <= self.usable, "measured" if self.n == 1 else "measured + arithmetic", pk.where,
            gpus=self.n, accuracy="low", cost="bf16 matmuls and saved activations; usually faster on tensor-core GPUs",
            assumes="torch.autocast: fp32 weights, gradients and optimizer state kept",
            config={"precision": "bf16-mixed"},
        ))


PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, one direction, as measured by bandwidthTest on pinned memory
WORLD_SIZES = (2, 4, 8, 16, 32, 64)
SHARD_NAME = {"zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "FSDP / ZeRO-3", "fsdp": "FSDP"}
SHARD_WHAT = {
    "zero1": "optimizer state",
    "zero2": "optimizer state and gradients",
    "zero3": "parameters, gradients and optimizer state",
    "fsdp": "parameters, gradients and optimizer state",
}
