"""Fake-tensor steps on more than one core: independent probe steps in forked copies of this process.

Under fake tensors (`--device meta`) a recorded step is pure Python on one core, and the probe steps a
search records at one batch do not depend on each other. `fork_map` shares them out: this process takes
every `workers`-th item and forked children the others. A child starts as a copy-on-write copy of this
process, so it holds the model, the optimizer state and the fake process group exactly as they are
here; it sends back only what the function returns (a probe's cut: a few numbers per block), pickled
through a pipe, and exits. Results come back in item order, so a search gets the same terms, to the
byte, on one core or on many (docs/design.md §3).

Only fake steps are shared out: a real step's allocations and timings would compete with the others'
for the host's RAM and cores. A child that dies (killed, crashed) costs nothing but time: its items
are run here after all. `usable_workers` counts one process per core this one may run on, no more
than the items and than the RAM available holds copies of this process; `CKPT_TUNE_WORKERS=N` sets N
(1: everything in this process). Fork is used on Linux only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure.host import SAFETY, host_headroom

WORKERS_ENV = "CKPT_TUNE_WORKERS"

T = TypeVar("T")
R = TypeVar("R")


def _env_workers() -> int | None:
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise CkptTuneError(f"{WORKERS_ENV}={raw!r} is not a number of processes", f"set {WORKERS_ENV} to 1 or more, or unset it")
    return int(raw)


def usable_workers(items: int, process_bytes: int) -> int:
    """Processes (this one included) to run `items` fake steps on: one per core this process may run
    on, at most `items`, and only as many copies of this process (`process_bytes` each, its resident
    size) as the RAM available holds; CKPT_TUNE_WORKERS overrides the core count."""
    want = _env_workers()
    if want is None:
        if sys.platform != "linux" or not hasattr(os, "fork"):
            return 1
        want = len(os.sched_getaffinity(0))
    room = int(host_headroom() * SAFETY) // max(process_bytes, 1)
    return max(1, min(want, items, 1 + room))


def resident_bytes() -> int:
    """This process's resident set size."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is a dependency
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _portable(exc: BaseException) -> tuple[BaseException, BaseException | None]:
    """The exception and its cause, as they can cross a pipe (an unpicklable one as RuntimeError)."""

    def one(e: BaseException | None) -> BaseException | None:
        if e is None:
            return None
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:
            return RuntimeError(f"{type(e).__name__}: {e}")

    return one(exc), one(exc.__cause__)


def _run_share(fn, items, share, results) -> None:
    """Items `share` of `items` in this process, into `results` (index -> ("ok", value) or ("error",
    (exception, cause))); it stops at the first failure, as a loop would."""
    for k in share:
        try:
            results[k] = ("ok", fn(items[k]))
        except Exception as e:
            results[k] = ("error", (e, e.__cause__))
            break


def _child(fn: Callable[[T], R], items: Sequence[T], share: Sequence[int], write_fd: int) -> None:
    """A forked child's whole life: run its share, send the results (exceptions made portable), exit."""
    code = 0
    try:
        # nothing of the parent's output (a spinner's thread may hold its lock): a child is silent
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends below
        results: dict[int, tuple[str, Any]] = {}
        _run_share(fn, items, share, results)
        for k, (kind, value) in results.items():
            if kind == "error":
                results[k] = (kind, _portable(value[0]))
        with os.fdopen(write_fd, "wb") as w:
            w.write(pickle.dumps(results))
    except BaseException:  # the parent sees a short answer and runs the items itself
        code = 1
    finally:
        os._exit(code)


def shares_of(n: int, workers: int, costs: Sequence[float] | None = None) -> list[list[int]]:
    """Item indices per process (this one first): k % workers, or, given each item's expected cost,
    the longest first to the least loaded process; each share in item order."""
    if costs is None:
        return [list(range(w, n, workers)) for w in range(workers)]
    loads, shares = [0.0] * workers, [[] for _ in range(workers)]
    for k in sorted(range(n), key=lambda k: -costs[k]):
        w = min(range(workers), key=loads.__getitem__)
        shares[w].append(k)
        loads[w] += costs[k]
    return [sorted(s) for s in shares]


def fork_map(fn: Callable[[T], R], items: Sequence[T], workers: int, costs: Sequence[float] | None = None) -> list[R]:
    """[fn(x) for x in items], items[k] run by process k % workers (this process is 0), or, given
    `costs` (each item's expected time, any unit), in shares of about equal cost (`shares_of`).

    The first item that raises, in item order, raises here, as it would in a loop (items after it may
    have run). `fn` must leave this process as it found it apart from what it returns: a child's side
    effects are lost with it."""
    items = list(items)
    workers = max(1, min(workers, len(items)))
    if workers == 1:
        return [fn(x) for x in items]
    shares = shares_of(len(items), workers, costs)
    children: list[tuple[int, int, list[int]]] = []  # (pid, read fd, item indices)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # the collector leaves the inherited objects alone in the children: fewer pages copied. No collection
    # first (0.2 s per call in a 7B search): garbage inherited is only dropped with the short-lived child.
    # Objects a caller froze (runner.StepRunner) stay frozen after
    frozen = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        for share in shares[1:]:
            r, w = os.pipe()
            with warnings.catch_warnings():
                # Python 3.12+ warns of fork in a process with threads (a progress spinner's): the
                # child takes none of their locks (it writes nothing to the parent's streams)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # pragma: no cover - the child's coverage is not collected
                os.close(r)
                _child(fn, items, share, w)
            os.close(w)
            children.append((pid, r, share))
    finally:
        if not frozen:
            gc.unfreeze()
    results: dict[int, tuple[str, Any]] = {}
    unread, unreaped = {r for _p, r, _s in children}, {p for p, _r, _s in children}
    try:
        _run_share(fn, items, shares[0], results)
        for pid, r, share in children:
            try:
                with os.fdopen(r, "rb") as f:
                    data = f.read()
            finally:
                unread.discard(r)
            _pid, status = os.waitpid(pid, 0)
            unreaped.discard(pid)
            if data and status == 0:
                results.update(pickle.loads(data))
            else:  # the child died: its items are run here
                _run_share(fn, items, share, results)
    finally:  # interrupted: no child outlives the call
        for r in unread:
            with contextlib.suppress(OSError):
                os.close(r)
        for pid in unreaped:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
    out: list[R] = []
    for k in range(len(items)):
        kind, value = results.get(k, ("missing", None))
        if kind == "error":
            exc, cause = value
            if cause is not None and exc.__cause__ is None:
                exc.__cause__ = cause
            raise exc
        if kind == "missing":  # a share stops only after a failure, which comes earlier in item order
            raise RuntimeError(f"fork_map: item {k} was not run")
        out.append(value)
    return out
