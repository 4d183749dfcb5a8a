"""`--device meta`: one training iteration under fake tensors, recorded like the allocator would see it.

Under `FakeTensorMode` every tensor has shape, dtype and a storage of the right size, but no data: a
Llama-7B-shaped step runs in seconds in a few hundred MiB of RAM (docs/design.md §3). There is no allocator
to ask, so `FakeRecorder` plays its part. A `TorchDispatchMode` (user modes always run above the fake
mode) sees the result of every op and counts each storage it has not seen before as an allocation of
its `nbytes`; a weakref on that storage counts its death as the free. The result is the same
`timeline.Timeline` the CPU `Recorder` gives, on a logical clock: one tick per event or marker.

What no op returns, fake mode cannot see: memory a kernel allocates and frees inside itself. The CPU
recorder replays what scratch.py measured of it (`CPU_SCRATCH_OPS`); on CUDA the calls that would take
a cuDNN workspace are counted in `FakeRecorder.unmodelled` (`CUDA_WORKSPACE_OPS`), and the caching
allocator's rounding of each block up to 512 B is applied (`FakeRecorder(device="cuda")`). The cuBLAS
workspace is one block per handle and stream, allocated at the first matmul and kept: a constant for
the caller to add, not an event here.

A storage is named by `fake_storage_key(t)`: the StorageImpl's address for a fake tensor (whose
`data_ptr()` is 0 and deprecated), the data pointer for a real one, which is what `Recorder` records.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import timeline
from ckpt_tune.measure.fake_memo import OpMemo
from ckpt_tune.measure.fake_ops import (
    META_GAPS,
    RECORD_FUNCTION_ENTER,
    SHORTCUTS,
    MetaGaps,
    cpu_rng_states,
    eager_hf_masks,
    fresh,
    written_in_place,
)
from ckpt_tune.measure.scratch import (
    CPU_SCRATCH_OPS,
    CUDA_BLOCK_ROUND,
    CUDA_WORKSPACE_OPS,
    Scratch,
    batch_norm_sizes,
    bnb_cuda_scratch,
    bnb_scratch_ops,
    calibrated,
)
from ckpt_tune.measure.timeline import Timeline
from ckpt_tune.plan import offload

aten = torch.ops.aten

FAKE_HINT = "use --device cpu on a smaller config"
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)

_MODE: FakeTensorMode | None = None

# aten ops' outputs by their inputs' metadata (fake_memo.py); None: every op dispatched to the fake mode
MEMO: OpMemo | None = OpMemo()


class FakeModeError(CkptTuneError):
    """The model runs an op whose result fake tensors cannot know without data (nonzero, .item(), ...)."""


def fake_mode() -> FakeTensorMode:
    """The one FakeTensorMode that fake models, batches and optimizer steps share.

    Fake tensors of two modes cannot meet in one op, so everything in ckpt-tune uses this instance.
    `allow_non_fake_inputs`: a real tensor the user's code keeps on the side (a constant made with
    `torch.from_numpy`) is converted when used instead of failing the run.
    """
    global _MODE
    if _MODE is None:
        _MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _MODE


def fake_storage_key(t: torch.Tensor) -> int:
    """The key `FakeRecorder` records in `ptrs` for t's storage (for a real t: `Recorder`'s data pointer)."""
    st = t.untyped_storage()
    return st._cdata if isinstance(t, FakeTensor) else st.data_ptr()


# --- data-dependent ops -----------------------------------------------------------------------


def _fake_mode_error(e: BaseException) -> FakeModeError:
    func = getattr(e, "func", None)
    op = str(func).removesuffix(".default") if func is not None else type(e).__name__
    if op == "aten._local_scalar_dense":
        op += " (.item(), or bool()/int()/float() of a tensor)"
    return FakeModeError(f"fake tensors cannot run this model: {op}", FAKE_HINT)


def as_fake_mode_error(exc: BaseException) -> FakeModeError | None:
    """exc if it is a FakeModeError; else a new one for the fake-tensor failure in its cause chain, if any.

    New, not the one found: raising that one again `from exc` would make its cause chain a cycle.
    """
    if isinstance(exc, FakeModeError):
        return exc
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FakeModeError):
            return FakeModeError(e.message, e.hint)
        if isinstance(e, _DATA_DEPENDENT):
            return _fake_mode_error(e)
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def fake_errors() -> Iterator[None]:
    """Raise a FakeModeError for a data-dependent failure below, even one wrapped in a UserCodeError."""
    try:
        yield
    except Exception as exc:
        err = as_fake_mode_error(exc)
        if err is None or err is exc:
            raise
        raise err from exc


@contextlib.contextmanager
def running() -> Iterator[FakeTensorMode]:
    """The fake mode, entered, with FakeModeError translation: wrap each iteration (warm-up too) in it."""
    with fake_errors(), fake_mode() as mode, MetaGaps(), eager_hf_masks():
        yield mode


# --- the recorder -------------------------------------------------------------------------------

class _Dispatch(TorchDispatchMode):
    """Sees every op's outputs above the fake mode and tells the recorder about new storages."""

    def __init__(self, rec: FakeRecorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        rec._in_place = None
        if func is RECORD_FUNCTION_ENTER and rec._intercept_marks:
            name = args[0] if args else None
            if isinstance(name, str) and name.startswith(timeline.PREFIX):
                rec._marker(name[len(timeline.PREFIX) :])
        if func in SHORTCUTS:
            return SHORTCUTS[func](func, args, kwargs)
        cal = rec._scratch(func, args, kwargs) if func in rec._hidden else None
        if cal is None and func is aten.native_batch_norm.default:
            cal = batch_norm_sizes(args)
        try:
            if MEMO is not None and func not in META_GAPS:
                out = MEMO.call(func, args, kwargs, lambda: func(*args, **kwargs))
            else:
                out = func(*args, **kwargs)
        except _DATA_DEPENDENT as e:
            raise _fake_mode_error(e) from e
        sizes = cal[0] if cal is not None else ()
        inputs = None if fresh(func) else (args, kwargs)
        for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                rec._see(t, inputs, sizes[i] if i < len(sizes) else None)
        if cal is not None and cal[1] > 0:  # the kernel's own peak, above its outputs
            rec._spike(cal[1])
        first = written_in_place(func, args, kwargs, out)
        if first is not None:
            rec._maybe_in_place(first, out)
        return out


class FakeRecorder:
    """Context manager with `timeline.Recorder`'s interface, for fake tensors.

    `with FakeRecorder(device) as rec: ...` then `rec.timeline`. `device` is the allocator to mimic:
    "cpu" (exact bytes, CPU kernel scratch measured), "cuda" (blocks rounded up to 512 B), "meta"
    (storage bytes only). Every storage created while recording is an allocation, its death a free;
    `timeline.mark()` calls are markers; time is a counter shared by both. Storages that existed
    before are not counted, nor their frees, as with `Recorder`. `unmodelled` counts the calls whose
    kernel scratch is not in the timeline, by op.
    """

    def __init__(self, device: str = "cpu", round_to: int | None = None) -> None:
        self.device_type = torch.device(device).type
        self.round_to = round_to if round_to is not None else (CUDA_BLOCK_ROUND if self.device_type == "cuda" else 1)
        self.timeline = Timeline()
        self.unmodelled: dict[str, int] = {}
        self._clock = 0
        self._active = False
        self._events: list[tuple[int, int, int]] = []  # (time, delta, key)
        self._markers: dict[str, list[int]] = {}
        self._live: dict[int, int] = {}  # key -> recorded bytes, for storages born while recording
        self._raw: dict[int, int] = {}  # key -> the storage's nbytes when recorded (to see resize_)
        self._refs: dict[int, weakref.ref] = {}
        self._old: dict[int, weakref.ref] = {}  # storages born before recording, seen as op inputs
        self._mode: _Dispatch | None = None
        self._intercept_marks = not hasattr(timeline, "add_listener")
        # ops whose hidden memory is measured ("cpu") or counted as unmodelled ("cuda")
        self._hidden = {"cpu": CPU_SCRATCH_OPS, "cuda": CUDA_WORKSPACE_OPS}.get(self.device_type, frozenset())
        if self.device_type in ("cpu", "cuda"):
            self._hidden = self._hidden | bnb_scratch_ops()
        self._gc_was_enabled = False
        self._rng: contextlib.AbstractContextManager | None = None
        self._hosting = 0  # inside `host()`: new storages are host memory, not the device's
        self._in_place: tuple[int, int] | None = None  # (result's key, first argument's key): `_maybe_in_place`
        self._host_was = offload.HOST_ALLOCATIONS

    def __enter__(self) -> FakeRecorder:
        # Garbage from earlier work must not be collected in the middle of the iteration, where freeing
        # it would read as this iteration releasing memory: the collector is off while recording. Unlike
        # Recorder, nothing is collected first: a fake storage costs no host memory, and every free this
        # recorder counts is of a storage it saw allocated or used, so old garbage left alone is never
        # seen (a full collection of a 7B model's objects took 0.2 s per step: docs/design.md §3)
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._active = True
        if not self._intercept_marks:
            timeline.add_listener(self._marker)
        _RECORDERS.append(self)
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        if self.device_type == "cpu":
            self._rng = cpu_rng_states()
            self._rng.__enter__()
        elif self.device_type == "cuda":  # offloaded tensors' copies are host memory (plan/offload.py)
            self._host_was, offload.HOST_ALLOCATIONS = offload.HOST_ALLOCATIONS, self.host
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._rng is not None:
                self._rng.__exit__(*exc)
                self._rng = None
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            self._mode = None
            self._active = False
            if self.device_type == "cuda":
                offload.HOST_ALLOCATIONS = self._host_was
            _RECORDERS.remove(self)
            if not self._intercept_marks:
                timeline.remove_listener(self._marker)
            self._refs.clear()  # dropped weakrefs never call back
            self._old.clear()
            self._raw.clear()
            if self._gc_was_enabled:
                gc.enable()
        if exc[0] is None:
            self.timeline = self._build()
        elif isinstance(exc[1], Exception):
            err = as_fake_mode_error(exc[1])
            if err is not None and err is not exc[1]:
                raise err from exc[1]

    def nbytes(self, t: torch.Tensor) -> int:
        """Bytes recorded for t's storage (its calibrated size, e.g. a oneDNN workspace), else its nbytes."""
        return self._live.get(fake_storage_key(t), self._rounded(t.untyped_storage().nbytes()))

    def note(self, t: torch.Tensor) -> None:
        """Count t's storage as born now unless already known (tensors made outside dispatch)."""
        if self._active:
            key = fake_storage_key(t)
            if key not in self._live and key not in self._old:
                self._alloc(t.untyped_storage(), key, None)

    # -- events -------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _marker(self, name: str) -> None:
        if self._active:
            self._markers.setdefault(name, []).append(self._tick())

    def _rounded(self, n: int) -> int:
        r = self.round_to
        return -(-n // r) * r if r > 1 else n

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Storages made in here are host memory standing in for a GPU's host: not counted, ever."""
        self._hosting += 1
        try:
            yield
        finally:
            self._hosting -= 1

    def _alloc(self, st: torch.UntypedStorage, key: int, size: int | None) -> None:
        if self._hosting:
            self._old[key] = weakref.ref(st, functools.partial(self._forget_old, key))
            return
        n = self._rounded(st.nbytes() if size is None else size)
        self._live[key], self._raw[key] = n, st.nbytes()
        self._refs[key] = weakref.ref(st, functools.partial(self._free, key))
        if n > 0:  # kept even when empty, to see a later resize_; the allocator reports no empty blocks
            self._events.append((self._tick(), n, key))

    def _maybe_in_place(self, first: torch.Tensor, out: torch.Tensor) -> None:
        """`out` taken as written into `first` (fake_ops.written_in_place) if `first`'s storage dies
        right after `out`'s is born (`_free`): the engine's condition of holding its last references."""
        key, arg = fake_storage_key(out), fake_storage_key(first)
        if self._events and self._events[-1][2] == key and self._events[-1][0] == self._clock and arg in self._live:
            self._in_place = (key, arg)

    def _free(self, key: int, _ref: Any = None) -> None:
        placed = self._in_place is not None and self._in_place[1] == key and self._events[-1][0] == self._clock
        self._in_place = None
        if placed and self._active and self._live.get(key) == self._events[-1][1]:
            self._events.pop()  # the result's storage is the first argument's: neither event happens
            self._live.pop(key)
            self._refs.pop(key, None)
            self._raw.pop(key, None)
            return
        if self._active and key in self._live:
            n = self._live.pop(key)
            if n > 0:
                self._events.append((self._tick(), -n, key))
            self._refs.pop(key, None)
            self._raw.pop(key, None)

    def _forget_old(self, key: int, _ref: Any = None) -> None:
        self._old.pop(key, None)

    def _spike(self, n: int) -> None:
        n = self._rounded(n)
        self._events.append((self._tick(), n, 0))
        self._events.append((self._tick(), -n, 0))

    def _scratch(self, func, args, kwargs) -> Scratch | None:
        """What func's kernel allocates beyond its outputs' storages, or None (and counted) if unknown."""
        if self.device_type == "cpu":
            found = calibrated(func, args, kwargs)
            if found is not None:
                return found
        elif self.device_type == "cuda":
            found = bnb_cuda_scratch(func, args, kwargs)
            if found is not None:
                return found
        name = str(func).removesuffix(".default")
        self.unmodelled[name] = self.unmodelled.get(name, 0) + 1
        return None

    def _see(self, t: torch.Tensor, inputs: tuple | None, size: int | None) -> None:
        """Count t's storage as born now unless it is known, or one of the op's `inputs` (args, kwargs)
        holds it; `inputs` None: no output of the op can share an input's storage (`fake_ops.fresh`)."""
        if t.layout != torch.strided:  # sparse and other layouts have no single storage to follow
            self.unmodelled[f"{t.layout} outputs"] = self.unmodelled.get(f"{t.layout} outputs", 0) + 1
            return
        key = fake_storage_key(t)
        if key in self._live:
            raw = t.untyped_storage().nbytes()
            if raw != self._raw[key]:  # resize_ of a storage born here
                n = self._rounded(raw)
                self._events.append((self._tick(), n - self._live[key], key))
                self._live[key], self._raw[key] = n, raw
            return
        if key in self._old:
            return
        # An unseen storage that is also an input's (an in-place op or a view of an older tensor) is old.
        for a in tree_flatten(inputs)[0] if inputs is not None else ():
            if isinstance(a, torch.Tensor) and a.layout == torch.strided and fake_storage_key(a) == key:
                self._old[key] = weakref.ref(t.untyped_storage(), functools.partial(self._forget_old, key))
                return
        self._alloc(t.untyped_storage(), key, size)

    def _build(self) -> Timeline:
        return Timeline.of(self._events, self._markers)


_RECORDERS: list[FakeRecorder] = []


def note_new(obj: Any) -> None:
    """Tell the active recorders about the tensors in obj made outside dispatch (converted batches)."""
    tensors = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    for rec in _RECORDERS:
        for t in tensors:
            rec.note(t)
