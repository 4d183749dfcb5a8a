"""`profile`: where the memory of one training iteration goes, as a data record.

One recorded iteration (runner.measure with attribution) gives the measured peak and the moment it is
reached; saved-tensor hooks give each module's activation bytes; gradient hooks and the allocator's
intervals say what is live at the peak. A second recorded iteration at another batch size splits the peak
into a fixed part and a per-sample part. A timing pass without the profiler gives forward times.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ckpt_tune.measure.runner import Measurement, StepRunner, StepSettings
from ckpt_tune.measure.tensors import unique_bytes
from ckpt_tune.measure.timing import Timing
from ckpt_tune.vocab import Parts, RunSpec

OUTSIDE = "(outside the model)"


@dataclass(frozen=True)
class ModuleRecord:
    name: str  # from named_modules(); "" is the root
    type: str  # class name
    depth: int  # 0 for the root
    activation_bytes: int  # saved for backward by this module's own ops (parameters excluded, storages once)
    subtree_activation_bytes: int  # the same, summed over the module and everything below it
    input_bytes: int
    output_bytes: int
    param_bytes: int  # parameters of the subtree (tied weights once)
    forward_ms: float  # inclusive forward wall time, fastest of the timing repeats


@dataclass(frozen=True)
class Scaling:
    """peak(b) ≈ fixed_bytes + per_sample_bytes * b, from two measured batch sizes."""

    batch_sizes: tuple[int, int]
    peaks: tuple[int, int]
    fixed_bytes: int
    per_sample_bytes: int

    def predict(self, batch_size: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch_size


@dataclass(frozen=True, kw_only=True)
class StepProfile(RunSpec):
    """One profiled iteration: the RunSpec it ran under (its batch size, and under a sharded engine its
    world_size and shard), where its memory went, and its time."""

    fixed_batch: ClassVar[bool] = True

    target: str
    torch_version: str
    measured_by: str  # what the peak comes from
    peak_bytes: int  # largest live bytes of the iteration, parameters included
    peak_phase: str  # where it is reached, e.g. "backward: blocks.5.mlp"
    breakdown: Parts  # what is live at the moment of the peak
    param_bytes: int  # whole-step totals, independent of the peak moment
    grad_bytes: int
    optimizer_bytes: int
    activation_total_bytes: int  # everything saved for backward = Σ modules' activation_bytes + unattributed
    unattributed_activation_bytes: int  # saved by ops outside every module (loss, code in loss_fn)
    modules: tuple[ModuleRecord, ...]
    scaling: Scaling | None
    step_ms: float  # step time; under fake tensors (time_unit "GFLOP") the step's GFLOPs instead
    cuda_reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    # live bytes over the iteration: (ms since the iteration started, bytes), at most ~2000 points with
    # every local extreme kept, and the phase boundaries (make_batch, forward+loss, backward, step) in ms
    timeline: tuple[tuple[float, int], ...] = ()
    phases: dict[str, float] | None = None
    time_unit: str = "ms"  # of step_ms and modules' forward_ms: "ms", or "GFLOP" under fake tensors
    # the timeline's points split into the five parts (vocab.Part order):
    # (ms, params, grads, optimizer, activations, other); each point's parts sum to its live bytes
    part_timeline: tuple[tuple[float, int, int, int, int, int], ...] = ()

    def to_dict(self, with_timeline: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["breakdown"] = asdict(self.breakdown)
        if not with_timeline:
            d.pop("timeline")
            d.pop("phases")
            d.pop("part_timeline")
        return json.loads(json.dumps(d))  # plain lists, dicts, str, int, float: safe for YAML and JSON


def timeline_points(m: Measurement, max_points: int = 2000) -> tuple[tuple[tuple[float, int], ...], dict[str, float]]:
    """The live-byte curve of a measurement in ms from the iteration's start, thinned but peak-preserving."""
    tl = m.timeline
    t0 = tl.marker("iter")
    pts = _thinned([(t, m.static_bytes + v) for t, v in zip(tl.times, tl.live, strict=False) if t >= t0], max_points)
    phases = {k: (tl.marker(k) - t0) / 1e6 for k in ("iter", "batch", "loss", "backward", "step")}
    return tuple(((t - t0) / 1e6, v) for t, v in pts), phases


def part_timeline(m: Measurement, max_points: int = 2000) -> tuple[tuple[float, int, int, int, int, int], ...]:
    """`timeline_points`' points, each split into the five parts: (ms, params, grads, optimizer,
    activations, other). Saved activations and gradients are told apart by allocation, as in
    `live_at_peak`: a saved tensor's allocation is the one live at the end of forward, a gradient's the
    one live at the end of backward; `other` is the rest of the live bytes."""
    tl = m.timeline
    t0, t_fwd, t_bwd = tl.marker("iter"), tl.marker("loss"), tl.marker("backward")
    saved, grads = set(m.saved), set(m.grad_ptrs)
    kind: dict[tuple[int, int], int] = {}  # (ptr, t_alloc) -> 0 saved activation, 1 gradient
    for ptr, _size, a, b in tl.intervals():
        if ptr in saved and a <= t_fwd < b:
            kind[(ptr, a)] = 0
        elif ptr in grads and a <= t_bwd < b:
            kind[(ptr, a)] = 1
    held: dict[int, tuple[int, int]] = {}  # ptr -> (kind, bytes) of an open allocation counted
    sums = [0, 0]
    pts: list[tuple[float, int, int, int]] = []  # (t, live, activations, grads) after each event
    for t, d, p, v in zip(tl.times, tl.deltas, tl.ptrs, tl.live, strict=True):
        if d > 0 and (p, t) in kind:
            held[p] = (kind[(p, t)], d)
            sums[kind[(p, t)]] += d
        elif d < 0 and p in held:
            k, n = held.pop(p)
            sums[k] -= n
        if t >= t0:
            pts.append((t, m.static_bytes + v, sums[0], sums[1]))
    return tuple(
        ((t - t0) / 1e6, m.param_bytes, g, m.optimizer_bytes, a, v - m.param_bytes - m.optimizer_bytes - g - a)
        for t, v, a, g in _thinned(pts, max_points)
    )


def _thinned(pts: list[tuple], max_points: int) -> list[tuple]:
    """At most `max_points` of `pts` ((t, live, ...) in time order): the largest live point of each of
    `max_points` equal chunks, so the peak is kept. `timeline_points` and `part_timeline` thin alike."""
    if len(pts) <= max_points:
        return pts
    step = len(pts) / max_points
    return [max(pts[int(k * step): int((k + 1) * step)] or pts[-1:], key=lambda p: p[1]) for k in range(max_points)]


def profile_model(
    model: nn.Module,
    batch_fn,
    loss_fn,
    batch_size: int = 8,
    settings: StepSettings = StepSettings(),
    target: str = "<model>",
    scaling: bool = True,
    checkpoint: tuple[str, ...] = (),
    runner: StepRunner | None = None,
) -> StepProfile:
    """Profile one training iteration of `model`. The model is restored afterwards (see StepRunner).
    `runner`: one already built for this model (session.build_runner's, which may be a host.HostGuard)."""
    with runner or StepRunner(model, batch_fn, loss_fn, settings) as runner:
        m = runner.measure(batch_size, checkpoint=checkpoint, attribute=True)
        timing = runner.time_step(batch_size, checkpoint=checkpoint, repeats=3)
        scale = None
        if scaling:
            b2 = batch_size * 2 if batch_size <= 4 else batch_size // 2
            m2 = runner.measure(b2, checkpoint=checkpoint)
            scale = fit_scaling((batch_size, m.peak_bytes), (b2, m2.peak_bytes))
        modules = module_records(model, m, timing)
    return build_profile(m, modules, scale, timing, settings, target)


def fit_scaling(a: tuple[int, int], b: tuple[int, int]) -> Scaling:
    (b1, p1), (b2, p2) = sorted([a, b])
    per = (p2 - p1) // (b2 - b1) if b2 != b1 else 0
    return Scaling((b1, b2), (p1, p2), p1 - per * b1, per)


def module_records(model: nn.Module, m: Measurement, timing: Timing) -> tuple[ModuleRecord, ...]:
    own: dict[str, int] = {}
    for nbytes, owner in m.saved.values():
        if owner is not None:
            own[owner] = own.get(owner, 0) + nbytes
    out = []
    for name, mod in model.named_modules():
        prefix = name + "." if name else ""
        subtree = sum(v for k, v in own.items() if k == name or k.startswith(prefix))
        io = m.module_io.get(name, (0, 0))
        out.append(
            ModuleRecord(
                name=name,
                type=type(mod).__name__,
                depth=0 if not name else name.count(".") + 1,
                activation_bytes=own.get(name, 0),
                subtree_activation_bytes=subtree,
                input_bytes=io[0],
                output_bytes=io[1],
                param_bytes=unique_bytes(mod.parameters()),
                forward_ms=round(timing.forward_ms.get(name, 0.0), 4),
            )
        )
    return tuple(out)


def live_at_peak(m: Measurement) -> tuple[int, int]:
    """(activation bytes, gradient bytes) live at the peak moment, from the allocator's intervals."""
    tl, t = m.timeline, m.peak_time
    if t == tl.marker("iter"):
        return 0, m.peak_bytes - m.static_bytes
    t_fwd_end = tl.marker("loss")
    t_bwd_end = tl.marker("backward")
    by_ptr: dict[int, list[tuple[int, int, int]]] = {}
    for ptr, size, t0, t1 in tl.intervals():
        by_ptr.setdefault(ptr, []).append((t0, t1, size))

    def live_bytes(ptrs, anchor: int) -> int:
        total = 0
        for p in set(ptrs):
            for t0, t1, size in by_ptr.get(p, ()):
                if t0 <= anchor < t1 and t0 <= t < t1:  # the allocation that held it at `anchor` is live at t
                    total += size
        return total

    acts = live_bytes(m.saved.keys(), t_fwd_end)
    grads = live_bytes(m.grad_ptrs, t_bwd_end)
    return acts, grads


def peak_phase(m: Measurement) -> str:
    tl, t = m.timeline, m.peak_time
    mk = tl.markers
    if t <= mk["iter"][0]:
        return "start of the iteration (previous gradients still live)"
    if t < mk["batch"][0]:
        return "make_batch"
    if t < mk["loss"][0]:
        root_end = mk.get("f<", [None])[0]
        if root_end is not None and t >= root_end:
            return "loss (after the model's forward)"
        return "forward: " + _innermost_forward(mk, t)
    if t < mk["backward"][0]:
        last, when = None, -1
        for key, times in mk.items():
            if key.startswith("b>"):
                i = bisect.bisect_right(times, t)
                if i and times[i - 1] > when:
                    last, when = key[2:], times[i - 1]
        return "backward: " + (last if last else "loss") if last != "" else "backward: (root)"
    return "optimizer step"


def _innermost_forward(mk: dict[str, list[int]], t: int) -> str:
    best, depth = "(root)", -1
    for key, starts in mk.items():
        if not key.startswith("f>"):
            continue
        name = key[2:]
        ends = mk.get("f<" + name, [])
        for s, e in zip(starts, ends, strict=False):
            d = 0 if not name else name.count(".") + 1
            if s <= t <= e and d > depth:
                best, depth = name or "(root)", d
    return best


def build_profile(
    m: Measurement,
    modules: tuple[ModuleRecord, ...],
    scale: Scaling | None,
    timing: Timing,
    settings: StepSettings,
    target: str,
) -> StepProfile:
    acts_live, grads_live = live_at_peak(m)
    breakdown = Parts(
        params=m.param_bytes,
        grads=grads_live,
        optimizer=m.optimizer_bytes,
        activations=acts_live,
        other=m.peak_bytes - m.param_bytes - m.optimizer_bytes - grads_live - acts_live,
    )
    unattributed = sum(n for n, owner in m.saved.values() if owner is None)
    total = sum(n for n, _ in m.saved.values())
    points, phases = timeline_points(m)
    cuda = torch.device(settings.device).type == "cuda"
    total_mem = torch.cuda.mem_get_info()[1] if cuda else None
    return StepProfile(
        target=target,
        device=settings.device,
        precision=settings.precision,
        optimizer=settings.optimizer,
        batch_size=m.batch_size,
        world_size=settings.world_size,
        shard=settings.shard,
        torch_version=str(torch.__version__),
        measured_by=(
            "torch.cuda.max_memory_allocated" if cuda
            else "fake tensors (FakeTensorMode): storages born and freed, CUDA 512 B block rounding modelled"
            if settings.device == "meta"
            else "allocator events (torch.profiler, profile_memory=True)"
        ),
        peak_bytes=m.peak_bytes,
        peak_phase=peak_phase(m),
        breakdown=breakdown,
        param_bytes=m.param_bytes,
        grad_bytes=m.grad_bytes,
        optimizer_bytes=m.optimizer_bytes,
        activation_total_bytes=total,
        unattributed_activation_bytes=unattributed,
        modules=modules,
        scaling=scale,
        step_ms=round(timing.step_ms, 3),
        time_unit=timing.unit,
        cuda_reserved_bytes=m.reserved_bytes,
        device_total_bytes=total_mem,
        timeline=points,
        phases=phases,
        part_timeline=part_timeline(m),
    )
