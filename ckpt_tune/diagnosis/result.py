"""What a diagnosis answers: the remedies and the diagnosis itself, how remedies are ranked, and the
texts built from them (the one-line verdict, the states against the budget, the exit-3 error).

Pure: data in, data or text out; nothing here runs a step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ckpt_tune.errors import NoFitError
from ckpt_tune.measure.device import Budget
from ckpt_tune.measure.profiler import OUTSIDE, StepProfile
from ckpt_tune.tune.sharding import Moment, StaticBytes, peak_of
from ckpt_tune.units import format_bytes

ACCURACY = ("none", "low", "changes what is trained")


@dataclass(frozen=True)
class Remedy:
    kind: str  # checkpoint | mixed-precision | micro-batch | 8bit-optimizer | lora | qlora | offload | zero1 | zero2 | zero3
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
    profile: StepProfile  # the recorded step: rank 0's when `sharding` is "measured", else one device's
    moments: tuple[Moment, ...]  # per GPU
    states: StaticBytes  # weights, gradients, optimizer state per GPU
    floor: Remedy | None  # the smallest peak checkpointing reaches at batch 1 (per GPU), measured
    remedies: tuple[Remedy, ...]  # ranked
    units: tuple[str, ...]  # checkpoint candidates, in execution order
    notes: tuple[str, ...] = ()
    # vocab.SHARDINGS, with world_size > 1: "measured" (rank 0 recorded under the sharding engine, a fake
    # process group) or "arithmetic" (one device's step divided, tune/sharding.py); "none" on one GPU
    sharding: str = "none"

    @property
    def peak(self) -> Moment:
        return peak_of(self.moments)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.budget.usable_bytes

    @property
    def states_bytes(self) -> int:
        """Weights + gradients + optimizer state per GPU (without ZeRO-3's gathered working set)."""
        return self.states.params + self.states.grads + self.states.optimizer

    @property
    def states_exceed(self) -> bool:
        return self.states_bytes > self.budget.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("target", "device", "precision", "optimizer", "batch_size", "world_size", "shard", "sharding")}
        d.update(
            budget=asdict(self.budget),
            fits=self.fits,
            peak=_moment_dict(self.peak),
            moments=[_moment_dict(m) for m in self.moments],
            states=asdict(self.states) | {"total": self.states_bytes},
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


def rank_remedies(remedies: list[Remedy] | tuple[Remedy, ...]) -> tuple[Remedy, ...]:
    """What fits first. Among those: fewer GPUs (a remedy for the GPUs one has before one that rents
    more), then what keeps what is trained before what changes it, lower accuracy risk, less extra time
    (unknown last). What does not fit: closest to the budget first."""

    def key(r: Remedy):
        acc = ACCURACY.index(r.accuracy)
        if r.fits:
            t = r.time_overhead if r.time_overhead is not None else float("inf")
            return (0, r.gpus, acc >= 2, acc, t, r.peak_bytes)
        return (1, r.peak_bytes, r.gpus, acc, 0.0, 0)

    return tuple(sorted(remedies, key=key))


def _states_text(d: Diagnosis, per_gpu: str = "") -> str:
    s = d.states
    return (
        f"weights {format_bytes(s.params)} + gradients {format_bytes(s.grads)} + optimizer state "
        f"{format_bytes(s.optimizer)} = {format_bytes(d.states_bytes)}{per_gpu}"
    )


def _exceed_text(states: str, usable: int) -> str:
    return (
        f"{states} exceed the budget {format_bytes(usable)} before any activation: "
        "no checkpoint plan or batch size can fit"
    )


def no_fit_error(d: Diagnosis) -> NoFitError | None:
    """NoFitError (exit 3) when the step does not fit and nothing that keeps the model, optimizer, trainable
    weights and GPU count makes it fit; its message leads with the states against the budget."""
    if d.fits or any(r.fits and r.keeps_setup for r in d.remedies):
        return None
    usable = d.budget.usable_bytes
    states = _states_text(d, f" per GPU ({d.shard} over {d.world_size})" if d.world_size > 1 else "")
    if d.states_exceed:
        lead = _exceed_text(states, usable)
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
    return _exceed_text(_states_text(d), d.budget.usable_bytes)
