"""Never let the OS kill the tool: steps this machine cannot hold are recorded under fake tensors.

A user plans for the 24 GiB GPU they will rent on a laptop with less RAM than that. On `--device cpu`
every step is checked against what this process can still allocate (available RAM, and what an
address-space limit such as `ulimit -v` leaves) before it runs: steps that fit run for real, and larger
ones are recorded under fake tensors with the CPU allocator's rules (measure/fake.py), which allocate
nothing (docs/design.md §3). The step's peak at a batch is predicted from the real ones recorded so far
as an upper bound: proportional in the batch from the largest real step, above the static states.
Timing a step that does not fit runs the largest batch that does
and scales it linearly. Every switch is written to `notes`, so the output says what was measured how.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Sequence
from typing import Any

from ckpt_tune.measure.runner import Measurement, StepRunner
from ckpt_tune.measure.timing import Timing
from ckpt_tune.units import format_bytes

# Fraction of the free bytes a real step may use: the profiler's own event buffers, allocator caching
# and Python objects come on top of the step's live tensors.
SAFETY = 0.6


def host_headroom() -> int:
    """Bytes this process can still allocate: available RAM, less what an address-space limit leaves."""
    try:
        import psutil  # optional: /proc is read where it is missing

        available = psutil.virtual_memory().available
        used_vm = psutil.Process().memory_info().vms
    except ImportError:  # pragma: no cover - psutil is a dependency; kept for minimal installs
        available, used_vm = _proc_available(), _proc_vms()
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        available = min(available, soft - used_vm)
    return max(int(available), 0)


def release_freed() -> None:
    """Give the memory the allocator keeps after a real CPU step back to the OS (glibc's `malloc_trim`),
    so that the next step's peak adds to what is live, not to what earlier steps left: without it, a
    search's few real steps at different batches each leave their freed heap pages resident."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def bounded_heap():
    """Keep the process's size near the live tensors' bytes while real CPU steps run: glibc's mmap
    threshold fixed at `HEAP_MMAP_THRESHOLD`, where glibc starts. By default glibc raises the threshold
    after every large free, up to 32 MiB, so that a step's tensors below it come from the heap, where
    what a step frees stays resident, and a search's process grows by several times its budget. Above
    the fixed threshold each tensor is its own mapping, given back when freed; each costs its page
    faults, so CPU steps take longer, the blocks' share of a step a few hundredths more
    (benchmarks/results/host_memory.md). glibc cannot go back to its moving threshold: on leaving, the
    threshold is fixed where a training process's settles, 32 MiB (docs/design.md §3)."""
    global _BOUNDED
    libc = _libc()
    if libc is None or _BOUNDED:  # not glibc, or bounded by an outer guard
        yield
        return
    _BOUNDED = bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    try:
        yield
    finally:
        if _BOUNDED:
            libc.mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_THRESHOLD)
            _BOUNDED = False
            libc.malloc_trim(0)


@contextlib.contextmanager
def settled_heap():
    """Inside `bounded_heap`: glibc's threshold where a training process's settles, for real steps that
    hold no more than the first real step (a batch-1 profile holds as much): their tensors below it come
    from the heap, reused from one iteration to the next as in training, without a fresh mapping and its
    page faults each. Leaving, the bound is set again and the freed pages are given back (malloc_trim),
    so the larger steps after it add to what is live, not to what these left (docs/design.md §3)."""
    libc = _libc()
    if libc is None or not _BOUNDED:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
        libc.malloc_trim(0)


def _libc():
    """glibc's functions, or None where the C library is another (nothing to trim or bound)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            lib = ctypes.CDLL("libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False
    return _LIBC or None


_LIBC = None
_BOUNDED = False
# glibc's malloc.h: mallopt's parameter number for the mmap threshold, and the threshold glibc starts at
M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 128 * 1024
SETTLED_MMAP_THRESHOLD = 32 * 1024 * 1024


def _proc_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _proc_vms() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class HostGuard:
    """A StepRunner's interface over a real CPU runner and, for steps too large for this machine, a
    runner of the same target under fake tensors (built on first need by `make_fake`)."""

    def __init__(
        self,
        real: StepRunner,
        make_fake: Callable[[], StepRunner],
        headroom: Callable[[], int] = host_headroom,
    ) -> None:
        self.real = real
        self.model, self.batch_fn, self.loss_fn, self.settings = real.model, real.batch_fn, real.loss_fn, real.settings
        self._make_fake, self._headroom = make_fake, headroom
        self._fake: StepRunner | None = None
        self._peaks: dict[int, tuple[int, int]] = {}  # batch -> (peak, static) of real steps without checkpointing
        self.limit = 0
        self.notes: list[str] = []
        self.fake_batches: set[int] = set()

    # -- the StepRunner interface ---------------------------------------------------------------
    def __enter__(self) -> HostGuard:
        self._heap = bounded_heap()
        self._heap.__enter__()
        try:
            self.real.__enter__()
        except BaseException:
            self._heap.__exit__(None, None, None)
            raise
        self._take_notes(self.real)
        self.limit = int(self._headroom() * SAFETY)
        return self

    def _take_notes(self, runner: StepRunner) -> None:
        """A runner's own notes (how it holds the model: LayerDrop off) are this guard's too."""
        self.notes += [n for n in runner.notes if n not in self.notes]

    def __exit__(self, *exc) -> None:
        try:
            if self._fake is not None:
                self._fake.__exit__(*exc)
                self._fake = None
        finally:
            try:
                self.real.__exit__(*exc)
            finally:
                self._heap.__exit__(None, None, None)

    def state_bytes(self) -> tuple[int, int, int]:
        return self.real.state_bytes()

    @property
    def real_peaks(self) -> list[int]:
        return self.real.real_peaks

    def measure(
        self,
        batch_size: int,
        checkpoint: Sequence = (),
        units: Sequence[str] = (),
        attribute: bool = False,
        accum_steps: int = 1,
        optimizer_step: bool = True,
        cold: bool = False,
    ) -> Measurement:
        # a first plain step at batch <= 2 is the one `fits` would run to bound the others: run once, as the bound
        whole = not checkpoint and accum_steps == 1 and optimizer_step
        first = not self._peaks and whole and batch_size <= 2
        if first or self.fits(batch_size, accum_steps):
            with self.small_steps(batch_size):
                m = self.real.measure(batch_size, checkpoint, units, attribute, accum_steps, optimizer_step, cold)
            release_freed()
            if whole:
                self._peaks[batch_size] = (m.peak_bytes, m.static_bytes)
            return m
        self._say_fake(batch_size, accum_steps)
        return self._fake_runner().measure(batch_size, checkpoint, units, attribute, accum_steps, optimizer_step)

    def time_step(self, batch_size: int, checkpoint: Sequence = (), repeats: int = 3) -> Timing:
        if self.fits(batch_size):
            with self.small_steps(batch_size):
                t = self.real.time_step(batch_size, checkpoint, repeats)
            release_freed()
            return t
        small = self.largest_real()
        with self.small_steps(small):
            t = self.real.time_step(small, checkpoint, repeats)
        scale = batch_size / small
        note = f"step times above batch {small} are scaled linearly from batch {small} (larger steps do not fit this machine)"
        if note not in self.notes:
            self.notes.append(note)
        return Timing(batch_size, t.checkpoint, t.step_ms * scale, {k: v * scale for k, v in t.forward_ms.items()}, t.unit)

    def small_steps(self, batch_size: int) -> contextlib.AbstractContextManager:
        """Real steps at `batch_size` under glibc's settled threshold (`settled_heap`) where the batch is
        no larger than the smallest real plain step's (before any ran: 2, the batch `fits` starts at),
        whose process size a profile at batch 1 or 2 has too; otherwise under the bound."""
        return settled_heap() if batch_size <= min(self._peaks, default=2) else contextlib.nullcontext()

    # -- deciding ----------------------------------------------------------------------------------
    def predicted_peak(self, batch_size: int, accum_steps: int = 1) -> int:
        """An upper bound of the step's peak at `batch_size` (no checkpointing), from the largest real step
        b0: every moment's live bytes are c + v·b with c >= the static states, so v <= (peak(b0) -
        static) / b0 and peak(b) <= static + (peak(b0) - static)·b/b0 for b >= b0. One more copy of the
        static states when micro-batches accumulate (gradients stay live)."""
        b0 = max(self._peaks)
        peak, static = self._peaks[b0]
        return static + -(-(peak - static) * batch_size // b0) + (static if accum_steps > 1 else 0)

    def fits(self, batch_size: int, accum_steps: int = 1) -> bool:
        if batch_size in self._peaks and accum_steps == 1:
            return True
        if not self._peaks:
            # nothing recorded yet: one real step at batch 2 (small enough for any machine that holds the
            # model) bounds the others
            b = min(batch_size, 2)
            with self.small_steps(b):
                m = self.real.measure(b)
            self._peaks[b] = (m.peak_bytes, m.static_bytes)
            self.real._warm = False  # the next step warms up at its own batch: steady state as asked
            if batch_size == b and accum_steps == 1:
                return True
        return self.predicted_peak(batch_size, accum_steps) <= self.limit

    def largest_real(self) -> int:
        """The largest batch run for real (each was checked to fit first); 1 before any was."""
        return max(self._peaks, default=1)

    def _fake_runner(self) -> StepRunner:
        if self._fake is None:
            self._fake = self._make_fake()
            self._fake.__enter__()
            self._take_notes(self._fake)
        return self._fake

    def largest_fitting(self) -> int:
        """The largest batch whose bound (`predicted_peak`, one micro-batch) fits the limit; 0 if none."""
        b0 = max(self._peaks)
        peak, static = self._peaks[b0]
        return max((self.limit - static) * b0 // max(peak - static, 1), 0)

    def _say_fake(self, batch_size: int, accum_steps: int) -> None:
        self.fake_batches.add(batch_size)
        top = max(self.fake_batches)
        note = (
            f"steps above batch {self.largest_fitting()} do not fit this machine ({format_bytes(self.limit)}, "
            f"{SAFETY:.0%} of what this process can still allocate; batch {top} would need about "
            f"{format_bytes(self.predicted_peak(top, accum_steps))}): they were recorded under fake tensors "
            "with the CPU allocator's rules, which allocate nothing"
        )
        self.notes = [n for n in self.notes if not n.startswith("steps above batch")] + [note]

    def __getattr__(self, name: str) -> Any:  # anything else of the real runner (e.g. `device`, `fake`)
        return getattr(self.real, name)
