"""The pytest marker `@pytest.mark.peak_memory("200MiB")`: fail a test whose tensors reach more than a
size, naming the modules whose forward allocated what was live at the peak.

    @pytest.mark.peak_memory("200MiB")               # CPU tensors (the default)
    @pytest.mark.peak_memory("20GB", device="cuda")  # CUDA tensors

The plugin is loaded in every pytest run where ckpt-tune is installed (entry point `pytest11`), so this
module imports neither torch nor the measuring layers: they are imported when a marked test runs, and an
unmarked test runs exactly as it would without the plugin.

Only the test function's call is measured, not its fixtures. The peak is the largest total of the
tensors the call allocated and had not yet freed, above what was live when it started (docs/design.md
§3): on CPU from the allocator's own events (`measure.timeline.Recorder`, torch.profiler with
`profile_memory=True`), to the byte; on CUDA `torch.cuda.max_memory_allocated` after
`reset_peak_memory_stats`, less what was allocated when the call started. Global forward hooks drop a
marker where each module's forward starts and ends; a tensor belongs to the innermost forward running
when it was allocated, or to no module. A passing test's breakdown is kept in pytest's cache
(`ckpt_tune/peak_memory/<nodeid>`); a failing one names the modules that grew since then.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.units import format_bytes

MARKER = "peak_memory"
CACHE_PREFIX = "ckpt_tune/peak_memory/"
ACCEPTED_SIZES = "200MiB, 24GB, 1.5GiB, 512KB, or an int of bytes"
USAGE = '@pytest.mark.peak_memory("200MiB") or @pytest.mark.peak_memory("20GB", device="cuda")'
TOP = 10  # modules named per line of a failure; the rest are counted


@dataclass(frozen=True)
class Limit:
    """A marker, read: the most bytes the test's tensors may reach, on which device."""

    bytes: int
    device: str  # "cpu", "cuda" or "cuda:N"
    written: str  # the marker as the test wrote it, for messages


@dataclass(frozen=True)
class Peak:
    """What one marked call reached: the peak and, by module label, the bytes live at that moment."""

    bytes: int
    modules: dict[str, int]  # label -> bytes its forward allocated that are live at the peak
    reached_in: str  # the label of the innermost forward running at the peak
    measured_by: str


class ProfilerTaken(Exception):
    """The test ran torch.profiler itself, which ended the marker's recording."""


_LIMIT = pytest.StashKey[Limit]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(size, device='cpu'): fail the test when the tensors it allocates reach more than size "
        "('200MiB', '24GB'), naming the modules whose forward allocated them (ckpt-tune)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Read a marked test's limit before its fixtures are set up: a bad marker is that test's error."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    try:
        item.stash[_LIMIT] = read_marker(marker.args, marker.kwargs)
    except CkptTuneError as e:
        raise pytest.fail.Exception(str(e), pytrace=False) from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    limit = item.stash.get(_LIMIT, None)
    if limit is None:
        yield
        return
    trace = Trace(limit.device)
    trace.start()
    outcome = yield
    try:
        peak = trace.stop()
    except ProfilerTaken as e:
        if outcome.excinfo is None:
            outcome.force_exception(pytest.fail.Exception(str(e), pytrace=False))
        return
    if outcome.excinfo is not None:
        return  # the test failed (or skipped) on its own
    item.user_properties.append(("peak_memory_bytes", peak.bytes))
    cache = getattr(item.config, "cache", None)
    key = CACHE_PREFIX + item.nodeid
    if peak.bytes <= limit.bytes:
        if cache is not None:
            cache.set(key, {"peak_bytes": peak.bytes, "device": limit.device, "modules": peak.modules})
        return
    before = _cached(cache.get(key, None), limit.device) if cache is not None else None
    outcome.force_exception(pytest.fail.Exception(explain_peak(peak, limit, before), pytrace=False))


def read_marker(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Limit:
    """The limit of `peak_memory(size, device="cpu")`. Raises CkptTuneError naming what is wrong."""
    written = "@pytest.mark.peak_memory(" + ", ".join(
        [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    ) + ")"
    if len(args) != 1 or set(kwargs) - {"device"}:
        raise CkptTuneError(f"{written}: takes one size and an optional device=", hint=f"write {USAGE}")
    size = args[0]
    if isinstance(size, bool) or not isinstance(size, (str, int)):
        raise CkptTuneError(
            f"{written}: the size is a {type(size).__name__}, not a string or an int of bytes",
            hint=f"accepted forms: {ACCEPTED_SIZES}",
        )
    # measure.device imports torch: here, when a marked test runs, not when pytest loads the plugin
    from ckpt_tune.measure.device import DeviceError, parse_bytes, resolve_device

    limit = parse_bytes(str(size), what=f"{written}: the size", accepted=ACCEPTED_SIZES)
    device = kwargs.get("device", "cpu")
    if not isinstance(device, str) or device.strip().lower() == "meta":
        raise CkptTuneError(
            f"{written}: device {device!r} is not one whose allocator can be read",
            hint='use device="cpu", "cuda", "cuda:N" or "auto" (cuda when torch sees a GPU, else cpu)',
        )
    try:
        device = resolve_device(device)
    except DeviceError as e:
        raise CkptTuneError(f"{written}: {e.message}", hint='use device="cpu", or run it where torch sees a GPU') from None
    return Limit(limit, device, written)


@dataclass
class Trace:
    """The allocator's events and the module forwards of one marked call (start, run the test, stop)."""

    device: str
    modules: list[Any] = field(default_factory=list)  # every module whose forward ran, first seen first
    _index: dict[int, int] = field(default_factory=dict)  # id(module) -> its position in `modules`
    _handles: list[Any] = field(default_factory=list)

    def start(self) -> None:
        import torch
        from torch.nn.modules import module as nn_module

        from ckpt_tune.measure.timeline import Recorder, mark

        self._mark = mark
        self._cuda = torch.device(self.device).type == "cuda"
        if self._cuda:  # untested here: this project's machines have no GPU
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        self._recorder = Recorder(self.device)
        gc_enabled = gc.isenabled()  # the recorder holds the collector off while it records
        try:
            with _quiet_profiler():
                self._recorder.__enter__()
        except RuntimeError as e:
            if gc_enabled:
                gc.enable()
            raise pytest.fail.Exception(f"peak_memory could not start torch.profiler: {e}", pytrace=False) from None
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True),
        ]

    def stop(self) -> Peak:
        import torch

        from ckpt_tune.measure.profiler import OUTSIDE

        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            cuda_peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        # a profiler the test started itself takes the events and, when it stops, ends this recording too
        ended = not torch._C._autograd._profiler_enabled()
        with _quiet_profiler():
            self._recorder.__exit__(None, None, None)
        if ended:
            self.modules.clear()
            raise ProfilerTaken(
                "peak_memory's recording was ended by a torch.profiler session the test ran itself "
                "(one profiler at a time records allocator events): the test's peak is unknown; "
                "measure it without @pytest.mark.peak_memory, or move the profiling out of this test"
            )
        peak, owners, at = attribute(self._recorder.timeline)
        names = module_names(self.modules)
        self.modules.clear()  # the test's modules are not kept past its call
        self._index.clear()

        def label(owner: int | None) -> str:
            return OUTSIDE if owner is None else names[owner] or "(root)"

        by_label: dict[str, int] = {}
        for owner, n in owners.items():
            by_label[label(owner)] = by_label.get(label(owner), 0) + n
        if self._cuda:
            return Peak(cuda_peak, by_label, label(at), "torch.cuda.max_memory_allocated (the breakdown from allocator events)")
        return Peak(peak, by_label, label(at), "allocator events (torch.profiler, profile_memory=True)")

    def _pre(self, module, args) -> None:
        k = self._index.get(id(module))
        if k is None:
            k = self._index[id(module)] = len(self.modules)
            self.modules.append(module)  # held until stop(): its id cannot be reused meanwhile
        self._mark(f"pm>{k}")

    def _post(self, module, args, output) -> None:
        k = self._index.get(id(module))
        if k is not None:
            self._mark(f"pm<{k}")


def attribute(tl) -> tuple[int, dict[int | None, int], int | None]:
    """(peak bytes, owner -> bytes live at the peak, owner running at the peak) of a recorded Timeline
    whose markers are "pm>k" / "pm<k" around the forward of module k; owner None: no forward ran.

    The peak is the first moment the live curve is highest; the owners' bytes add up to it exactly.
    """
    marks: list[tuple[int, int, int]] = []  # (time, 0 enter / 2 leave, module); allocations sort as 1
    for key, times in tl.markers.items():
        if key.startswith(("pm>", "pm<")):
            order, k = (0 if key[2] == ">" else 2), int(key[3:])
            marks += [(t, order, k) for t in times]
    marks.sort()
    if not tl.live or max(tl.live) <= 0:
        return 0, {}, None
    peak = max(tl.live)
    last = tl.live.index(peak)
    stack: list[int] = []
    live: dict[int, tuple[int, int | None]] = {}  # ptr -> (bytes, owner)
    m = 0
    for k in range(last + 1):
        t = tl.times[k]
        while m < len(marks) and (marks[m][0], marks[m][1]) < (t, 1):
            _, order, mod = marks[m]
            if order == 0:
                stack.append(mod)
            elif mod in stack:  # the module's own entry, even if a marker of the same instant came late
                del stack[len(stack) - 1 - stack[::-1].index(mod)]
            m += 1
        d, p = tl.deltas[k], tl.ptrs[k]
        if d > 0:
            live[p] = (d, stack[-1] if stack else None)
        else:
            live.pop(p, None)
    owners: dict[int | None, int] = {}
    for n, owner in live.values():
        owners[owner] = owners.get(owner, 0) + n
    return peak, owners, stack[-1] if stack else None


def module_names(modules: list[Any]) -> list[str]:
    """Qualified names of modules seen running, from the roots among them (a module no other seen
    module contains). One root is named "", its submodules as in its named_modules(); with several,
    each name starts with its root's class name ("GPT.blocks.3.attn"; "Linear#2" for a second root of a
    class)."""
    ids = {id(m): k for k, m in enumerate(modules)}
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m and id(sub) in ids}
    roots = [m for m in modules if id(m) not in inside]
    labels: list[str] = []
    for r in roots:
        cls = type(r).__name__
        seen = sum(1 for other in roots[: len(labels)] if type(other).__name__ == cls)
        labels.append("" if len(roots) == 1 else cls if not seen else f"{cls}#{seen + 1}")
    names: list[str | None] = [None] * len(modules)
    for root, prefix in zip(roots, labels):
        for name, sub in root.named_modules():
            k = ids.get(id(sub))
            if k is not None and names[k] is None:
                names[k] = ".".join(p for p in (prefix, name) if p)
    return [n or "" for n in names]


def explain_peak(peak: Peak, limit: Limit, before: dict[str, Any] | None) -> str:
    """The failure of a test over its limit, exact bytes first (the house style of gate/explain.py)."""
    from ckpt_tune.gate.explain import change_percent, signed_bytes

    lines = [
        f"peak memory {peak.bytes} bytes ({format_bytes(peak.bytes)}) is over the limit of {limit.bytes} bytes "
        f"({format_bytes(limit.bytes)}, {limit.written}) by {signed_bytes(peak.bytes - limit.bytes)}",
        f"measured on {limit.device} by {peak.measured_by}: the tensors the test allocated, above what was live "
        f"when it started; the peak is reached in {_where(peak.reached_in)}",
    ]
    rows = sorted(peak.modules.items(), key=lambda kv: (-kv[1], kv[0]))
    lines.append(
        "live at the peak, by the module whose forward allocated it: "
        + (", ".join(f"{name} {n} bytes ({format_bytes(n)})" for name, n in rows[:TOP]) or "nothing")
        + (f", and {len(rows) - TOP} more" if len(rows) > TOP else "")
    )
    if before is None:
        lines.append("modules that grew: no earlier pass of this test on this device in pytest's cache to compare with")
        return "\n".join(lines)
    was = before["modules"]
    grew = sorted(
        ((name, was.get(name), n) for name, n in peak.modules.items() if n > was.get(name, 0)),
        key=lambda r: (-(r[2] - (r[1] or 0)), r[0]),
    )

    def row(name: str, b0: int | None, b1: int) -> str:
        pct = f" ({change_percent((b1 - b0) / b0)})" if b0 else ""
        return f"{name}{' (new)' if b0 is None else ''} {b0 or 0} -> {b1} bytes ({b1 - (b0 or 0):+d}{pct})"

    lines.append(
        f"modules that grew since the last pass (peak then {before['peak_bytes']} bytes, "
        f"{format_bytes(before['peak_bytes'])}): "
        + (", ".join(row(*r) for r in grew[:TOP]) or "none")
        + (f", and {len(grew) - TOP} more" if len(grew) > TOP else "")
    )
    return "\n".join(lines)


def _where(label: str) -> str:
    from ckpt_tune.measure.profiler import OUTSIDE

    return (
        "no module's forward (the test's own code, a loss, backward or an optimizer step)"
        if label == OUTSIDE
        else f"the forward of {label}"
    )


def _cached(value: Any, device: str) -> dict[str, Any] | None:
    """A cached pass on `device` as pytest_runtest_call wrote it; None for anything else (another
    device, another layout)."""
    if not isinstance(value, dict) or not isinstance(value.get("peak_bytes"), int) or value.get("device") != device:
        return None
    modules = value.get("modules")
    if not isinstance(modules, dict) or not all(isinstance(n, int) for n in modules.values()):
        return None
    return value


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """Around torch.profiler's start and stop: its warnings on CPU-only builds are not the test's (the
    test's warnings filters are not for them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
