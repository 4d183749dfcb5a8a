"""Allocator ground truth: every allocation and free of one training iteration, with markers.

On CPU the allocator reports each allocation and free to `torch.profiler` when `profile_memory=True`
(docs/design.md §3). Summed in time order they give the exact live-byte curve above what was live when
recording started. Markers are zero-length `record_function` ranges emitted from module hooks and from
the training loop; they land in the same clock as the memory events, so a region of the curve can be
cut out between two markers (the forward of `blocks.3`, its backward, the optimizer step).

Frees of blocks allocated before recording started are not reported by the profiler, so callers free
what they want freed (the previous iteration's gradients) before recording starts.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

PREFIX = "ck::"
_LISTENERS: list[Callable[[str], None]] = []  # recorders that keep their own clock (fake tensors)


def add_listener(fn: Callable[[str], None]) -> None:
    _LISTENERS.append(fn)


def remove_listener(fn: Callable[[str], None]) -> None:
    _LISTENERS.remove(fn)


def mark(name: str) -> None:
    """Drop a named point into the recording (no tensor is allocated)."""
    for fn in _LISTENERS:
        fn(name)
    with record_function(PREFIX + name):
        pass


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Kineto prints start/stop lines straight to fd 2; keep the user's terminal clean. The process's
    own stderr, not `sys.stderr`, which pytest's capture (or a caller) may have replaced."""
    try:
        fd = (sys.__stderr__ or sys.stderr).fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


@dataclass
class Timeline:
    """The live-byte curve of one recording, relative to the bytes live when it started.

    `times[k]`, `live[k]` is the curve after the k-th allocator event; `deltas[k]` and `ptrs[k]` the event
    itself (positive: allocation, negative: free). `markers` maps a marker name to its times.
    """

    times: list[int] = field(default_factory=list)
    deltas: list[int] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    markers: dict[str, list[int]] = field(default_factory=dict)

    def marker(self, name: str, occurrence: int = 0) -> int:
        return self.markers[name][occurrence]

    def live_at(self, t: int) -> int:
        """Live bytes just before time t (all events strictly earlier than t applied)."""
        k = bisect.bisect_left(self.times, t)
        return self.live[k - 1] if k > 0 else 0

    def max_between(self, t0: int, t1: int | None = None) -> tuple[int, int]:
        """(largest live bytes, time it was reached) in [t0, t1); the level at t0 counts too."""
        lo = bisect.bisect_left(self.times, t0)
        hi = len(self.times) if t1 is None else bisect.bisect_left(self.times, t1)
        best, when = self.live_at(t0), t0
        for k in range(lo, hi):
            if self.live[k] > best:
                best, when = self.live[k], self.times[k]
        return best, when

    def held_at_end(self) -> dict[int, int]:
        """ptr -> index of the event that allocated what that ptr still holds when the recording ends."""
        net: dict[int, int] = {}
        start: dict[int, int] = {}
        for k, (d, p) in enumerate(zip(self.deltas, self.ptrs, strict=True)):
            if d > 0 and not net.get(p):
                start[p] = k
            net[p] = net.get(p, 0) + d
            if net[p] <= 0:
                net.pop(p)
                start.pop(p, None)
        return {p: start[p] for p in net if p in start}

    def without(self, drop: set[int]) -> Timeline:
        """The curve without the events at these indices (markers unchanged)."""
        events = zip(self.times, self.deltas, self.ptrs, strict=True)
        return Timeline.of((e for k, e in enumerate(events) if k not in drop), self.markers)

    @classmethod
    def of(cls, events: Iterable[tuple[int, int, int]], markers: dict[str, list[int]]) -> Timeline:
        """The curve of (time, delta, ptr) events in time order, with these markers."""
        tl = cls(markers={k: list(v) for k, v in markers.items()})
        live = 0
        for t, d, p in events:
            live += d
            tl.times.append(t)
            tl.deltas.append(d)
            tl.ptrs.append(p)
            tl.live.append(live)
        return tl

    def intervals(self) -> list[tuple[int, int, int, int]]:
        """Every allocation as (ptr, bytes, t_alloc, t_free); t_free is a large sentinel if never freed."""
        open_: dict[int, tuple[int, int]] = {}
        out: list[tuple[int, int, int, int]] = []
        end = (self.times[-1] + 1) if self.times else 0
        for t, d, p in zip(self.times, self.deltas, self.ptrs, strict=False):
            if d > 0:
                open_[p] = (d, t)
            elif p in open_:
                size, t0 = open_.pop(p)
                out.append((p, size, t0, t))
        for p, (size, t0) in open_.items():
            out.append((p, size, t0, end + 1))
        return out


def _flatten(events) -> Iterator:
    stack = list(events)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


class Recorder:
    """Context manager: record allocator events and markers on one device type.

    Usage: `with Recorder(device) as rec: ...` then `rec.timeline`.
    """

    def __init__(self, device: str = "cpu", marker_prefix: str = PREFIX) -> None:
        self.device_type = torch.device(device).type
        self.prefix = marker_prefix
        self.timeline = Timeline()
        self._prof: torch.profiler.profile | None = None

    def __enter__(self) -> Recorder:
        # Garbage from earlier work (reference cycles: models, closures) must not be collected while
        # recording: the profiler reports frees of blocks it saw in an earlier session, which would
        # read as this iteration releasing memory it never held.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=False)
        with quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._prof is not None
        with quiet_stderr():
            self._prof.__exit__(*exc)
        if self._gc_was_enabled:
            gc.enable()
        if exc[0] is None:
            self.timeline = self._build(self._prof)

    def _build(self, prof) -> Timeline:
        from torch._C._profiler import _EventType

        rows: list[tuple[int, int, int, int, str]] = []  # (time, seq, delta, ptr, marker name)
        tree = prof.profiler.kineto_results.experimental_event_tree()
        for seq, e in enumerate(_flatten(tree)):
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if f.device.type != self.device_type:
                    continue
                rows.append((e.start_time_ns, seq, int(f.alloc_size), int(f.ptr), ""))
            elif e.tag == _EventType.TorchOp and e.name.startswith(self.prefix):
                rows.append((e.start_time_ns, seq, 0, 0, e.name))
        rows.sort(key=lambda r: (r[0], r[1]))
        markers: dict[str, list[int]] = {}
        events: list[tuple[int, int, int]] = []
        born: set[int] = set()  # blocks allocated while recording
        for t, _seq, d, p, name in rows:
            if name:
                markers.setdefault(name[len(self.prefix):], []).append(t)
                continue
            if d > 0:
                born.add(p)
            elif p not in born:
                continue  # a block from before recording (see __enter__): not part of this iteration
            else:
                born.discard(p)
            events.append((t, d, p))
        return Timeline.of(events, markers)
