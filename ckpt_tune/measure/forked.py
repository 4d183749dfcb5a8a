"""Fake-tensor steps on more than one core: independent probe steps in forked copies of this process.

Under fake tensors (`--device meta`) a recorded step is pure Python on one core, and the probe steps a
search records at one batch do not depend on each other. `fork_map` shares them out: this process and
forked children each take the next item from a queue whenever they are free. A child starts as a
copy-on-write copy of this process, so it holds the model, the optimizer state and the fake process
group exactly as they are here; it sends back only what the function returns (a probe's cut: a few
numbers per block), pickled through a pipe, and exits. Results come back in item order, so a search
gets the same terms, to the byte, on one core or on many (docs/design.md §3).

Only fake steps are shared out: a real step's allocations and timings would compete with the others'
for the host's RAM and cores. `fork_ahead` runs one call in a child while this process goes on (the op
policies' timing beside the ordering step, where this process runs one torch thread, as a child does;
`cores_left` counts the whole cores a step's threads leave free). A child that dies (killed, crashed) costs nothing but time: the items it
took are run here after all. `usable_workers` counts one process per core this one may run on, no more
than the items and than the RAM available holds copies of this process; `CKPT_TUNE_WORKERS=N` sets N
(1: everything in this process). Fork is used on Linux only.
"""

from __future__ import annotations

import array
import contextlib
import gc
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
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


def cores_left(threads: int) -> int:
    """Cores this process may run on that a step on `threads` threads leaves free: whole cores, so that
    nothing runs on a hardware thread beside one of the step's (the two share the core). 0 where unknown."""
    if sys.platform != "linux" or not hasattr(os, "sched_getaffinity"):
        return 0
    try:
        import psutil

        per_core = max(1, (psutil.cpu_count() or 1) // max(psutil.cpu_count(logical=False) or 1, 1))
    except ImportError:  # pragma: no cover - psutil is a dependency
        per_core = 1
    return max(len(os.sched_getaffinity(0)) // per_core - threads, 0)


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


# A pipe holds 64 KiB unread (Linux's default): the queue of item numbers is written whole before the fork
_QUEUE_MAX = 65536 // 4


def _take(queue: int) -> int | None:
    """The next item number of the queue (a pipe every process reads), or None once it is empty. Every
    number was written before any process read one, in 4 bytes: a read of 4 takes one, whole."""
    data = os.read(queue, 4)
    return int.from_bytes(data, "little") if len(data) == 4 else None


def _run(fn, items, ks, results) -> bool:
    """Items ks, one at a time, into `results` (index -> ("ok", value) or ("error", (exception,
    cause))); False at the first failure, where a process stops, as a loop would."""
    for k in ks:
        try:
            results[k] = ("ok", fn(items[k]))
        except Exception as e:
            results[k] = ("error", (e, e.__cause__))
            return False
    return True


def _queued(queue: int, leave: int = 0) -> Iterator[int]:
    """The queue's item numbers, each taken when asked for, while more than `leave` are left."""
    while (not leave or _left(queue) > leave) and (k := _take(queue)) is not None:
        yield k


def _left(queue: int) -> int:
    """Item numbers not yet taken from the queue (the bytes unread in its pipe, 4 each)."""
    import fcntl
    import termios

    unread = array.array("i", [0])
    fcntl.ioctl(queue, termios.FIONREAD, unread)
    return unread[0] // 4


def _child(fn: Callable[[T], R], items: Sequence[T], queue: int, write_fd: int) -> None:
    """A forked child's whole life: run items from the queue, send the results (exceptions made
    portable), exit."""
    code = 0
    try:
        _quiet_child()
        results: dict[int, tuple[str, Any]] = {}
        _run(fn, items, _queued(queue), results)
        for k, (kind, value) in results.items():
            if kind == "error":
                results[k] = (kind, _portable(value[0]))
        with os.fdopen(write_fd, "wb") as w:
            w.write(pickle.dumps(results))
    except BaseException:  # the parent sees a short answer and runs the items itself
        code = 1
    finally:
        os._exit(code)


def _quiet_child() -> None:
    """A forked child's set-up: nothing of the parent's output (a spinner's thread may hold its lock), and
    one torch thread. OpenMP's thread team does not survive a fork: a kernel that runs in parallel here
    would wait on threads the child does not have (after the parent ran real CPU steps)."""
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the process ends with os._exit
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _fork() -> int:
    """os.fork, the streams flushed first. The collector leaves the inherited objects alone in the child:
    fewer pages copied (no collection first: 0.2 s per call in a 7B search; garbage inherited is only
    dropped with the short-lived child). Objects a caller froze (runner.StepRunner) stay frozen after."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    frozen = gc.get_freeze_count() > 0
    gc.freeze()
    pid = -1
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns of fork in a process with threads (a progress spinner's): the child
            # takes none of their locks (it writes nothing to the parent's streams)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        return pid
    finally:
        if pid != 0 and not frozen:  # the child keeps them frozen
            gc.unfreeze()


def queue_order(n: int, costs: Sequence[float] | None = None) -> list[int]:
    """The order items are taken in: item order, or, given each item's expected cost, the longest
    first (ties in item order), so that the last items taken are short ones and no process waits long
    for another."""
    return list(range(n)) if costs is None else sorted(range(n), key=lambda k: -costs[k])


def fork_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    workers: int,
    costs: Sequence[float] | None = None,
    here: Sequence[int] = (),
    leave: int = 0,
    first: Sequence[int] = (),
) -> list[R]:
    """[fn(x) for x in items], in `workers` processes (this one and forked children): each takes the
    next item from a shared queue whenever it is free, in `queue_order` (given `costs`, each item's
    expected time in any unit: the longest first). The items numbered in `here` are not queued: this
    process runs them first, then takes queued ones only while more than `leave` are left. The items
    numbered in `first` run in this process before any child is forked: what they leave in it (a cache)
    the children start with.

    The first item that raises, in item order, raises here, as it would in a loop (items after it may
    have run). An item that no process ran (its child died, or every process stopped at a failure
    first) is run here, in item order. `fn` must leave this process as it found it apart from what it
    returns: a child's side effects are lost with it."""
    items = list(items)
    results: dict[int, tuple[str, Any]] = {}
    ahead = set(first)
    workers = max(1, min(workers, len(items) - len(ahead)))
    if workers == 1 or len(items) > _QUEUE_MAX or not _run(fn, items, first, results):
        return _in_order(fn, items, results)
    queue, w = os.pipe()
    try:
        os.write(w, b"".join(k.to_bytes(4, "little") for k in queue_order(len(items), costs) if k not in here and k not in ahead))
    finally:
        os.close(w)  # read to its end, the queue reads as empty
    children: list[tuple[int, int]] = []  # (pid, read fd)
    for _ in range(workers - 1):
        r, w = os.pipe()
        pid = _fork()
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            os.close(r)
            _child(fn, items, queue, w)
        os.close(w)
        children.append((pid, r))
    unread, unreaped = {r for _p, r in children}, {p for p, _r in children}
    try:
        if _run(fn, items, here, results):
            _run(fn, items, _queued(queue, leave), results)
        for pid, r in children:
            try:
                with os.fdopen(r, "rb") as f:
                    data = f.read()
            finally:
                unread.discard(r)
            _pid, status = os.waitpid(pid, 0)
            unreaped.discard(pid)
            if data and status == 0:
                results.update(pickle.loads(data))
    finally:  # interrupted: no child outlives the call
        os.close(queue)
        for r in unread:
            with contextlib.suppress(OSError):
                os.close(r)
        for pid in unreaped:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
    return _in_order(fn, items, results)


def _in_order(fn: Callable[[T], R], items: list[T], results: dict[int, tuple[str, Any]]) -> list[R]:
    """The items' values in item order, from `results` (`_run`'s) or, for an item no process ran, run
    here; the first failure in item order raised."""
    out: list[R] = []
    for k in range(len(items)):
        if k not in results:  # taken by a child that died, or left by processes that failed first
            out.append(fn(items[k]))
            continue
        kind, value = results[k]
        if kind == "error":
            exc, cause = value
            if cause is not None and exc.__cause__ is None:
                exc.__cause__ = cause
            raise exc
        out.append(value)
    return out


class Ahead:
    """`fn()` under way in a forked child (`fork_ahead`). `result()` waits for its value: None where the
    child failed or died (the caller then runs `fn` itself). `close()` ends a child whose value is not
    wanted. Either reaps it."""

    def __init__(self, pid: int, fd: int) -> None:
        self._pid, self._fd, self._parent = pid, fd, os.getpid()

    def result(self) -> Any:
        if self._pid is None or os.getpid() != self._parent:  # a forked copy of the parent: not its child
            return None
        try:
            with os.fdopen(self._fd, "rb") as f:
                data = f.read()
            _pid, status = os.waitpid(self._pid, 0)
        finally:
            self._pid = None
        if not data or status != 0:
            return None
        try:
            return pickle.loads(data)
        except Exception:
            return None

    def close(self) -> None:
        if self._pid is None or os.getpid() != self._parent:
            return
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.kill(self._pid, 9)
            os.waitpid(self._pid, 0)
        self._pid = None


def fork_ahead(fn: Callable[[], R]) -> Ahead | None:
    """`fn()` started in a forked child, while this process goes on; None where there is no fork. The child
    runs one torch thread, as `fork_map`'s do, writes nothing to this process's streams, and sends back
    only what `fn` returns, pickled; an exception in it is a None result."""
    if sys.platform != "linux" or not hasattr(os, "fork"):
        return None
    r, w = os.pipe()
    pid = _fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        os.close(r)
        code = 1
        try:
            _quiet_child()
            value = fn()
            with os.fdopen(w, "wb") as out:
                out.write(pickle.dumps(value))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return Ahead(pid, r)
