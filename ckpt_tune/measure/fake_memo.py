"""Outputs of aten ops under fake tensors, remembered by their inputs' metadata (docs/design.md §3).

A fake step dispatches every op to `FakeTensorMode`, whose own cache spends most of an op's time building
its key (the metadata of every argument, checked for symbolic sizes, sparse layouts and constants). The
outputs of an aten op on fake tensors are a function of the op, its arguments' metadata and its other
arguments: their shapes, strides, dtypes, and which of them are new storages, views into an argument's
storage, or the argument itself (an in-place op). `OpMemo` keeps that function's values seen so far,
keyed by what it reads, and builds the outputs of a repeated call without dispatching it, as the fake
mode's cache builds them: a meta tensor of the remembered layout (set on the argument's storage for a
view) wrapped as a `FakeTensor` of the same mode, or the argument itself.

Calls it does not answer go to the fake mode as before: a mode with symbolic sizes (a shape
environment, as `torch.compile` traces with), an argument that is a real tensor, a constant
fake tensor (the fake mode computes on its value), anything but plain Python values, dtypes, devices
and fake tensors; ops the fake mode itself does not cache (data-dependent or dynamic output shapes, ops
that change an argument's metadata); outputs that are neither a new storage of exactly their size, a
view into one argument's storage, nor an argument left as it was. `tests/test_fake_memo.py` checks recorded
timelines equal with and without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_SKIP_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view)
_BYPASS = object()  # an entry: this call's outputs cannot be rebuilt from metadata
_MAX_ENTRIES = 200_000
_SAME = -1  # an output that is the argument itself (an in-place op)


class _NoKey(Exception):
    pass


def _key(a: Any) -> Any:
    t = type(a)
    if t is FakeTensor:
        if a.constant is not None or a.layout is not torch.strided or a.is_neg() or a.is_conj():
            raise _NoKey
        return (a.shape, a.stride(), a.dtype, a.fake_device, a.storage_offset())
    if t in _PLAIN:
        return (t, a)
    if t is list or t is tuple:
        return (t, tuple(_key(x) for x in a))
    raise _NoKey


def _state(t: FakeTensor) -> tuple:
    """What an op may change of a fake tensor: its layout and its storage."""
    st = t.untyped_storage()
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, st._cdata, st.nbytes())


def _top(args: tuple, kwargs: dict) -> list[tuple[int | str, Any]]:
    """The arguments an output may be or view: positional by index, keyword by name."""
    return [*enumerate(args), *kwargs.items()]


def _output(t: Any, args: tuple, kwargs: dict, nested: list) -> tuple | None:
    """How to rebuild one output: (source, shape, stride, offset, dtype, device), source None for a new
    storage, a position (index or keyword) for a view into that argument's storage, (_SAME, position)
    for the argument itself; None where it cannot be. `nested`: every fake tensor among the arguments."""
    if type(t) is not FakeTensor or t.constant is not None or t.requires_grad or t.layout is not torch.strided or t.is_neg() or t.is_conj():
        return None
    for where, a in _top(args, kwargs):
        if t is a:  # an in-place or out= op's output: that argument
            return ((_SAME, where), None, None, None, None, None)
    st = t.untyped_storage()
    same = [a for a in nested if a.untyped_storage()._cdata == st._cdata]
    if len(same) > 1:
        return None
    if same:  # a view: of an argument itself, not of a tensor inside a list
        where = next((w for w, a in _top(args, kwargs) if a is same[0]), None)
        return None if where is None else (where, t.shape, t.stride(), t.storage_offset(), t.dtype, t.fake_device)
    with torch._C._DisableTorchDispatch():
        minimal = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes()
    if t.storage_offset() != 0 or st.nbytes() != minimal:
        return None
    return (None, t.shape, t.stride(), 0, t.dtype, t.fake_device)


def _arg(args: tuple, kwargs: dict, where: int | str) -> Any:
    return kwargs[where] if type(where) is str else args[where]


class OpMemo:
    """`call(func, args, kwargs, run)`: the outputs of an aten op on fake tensors (see the module
    docstring), rebuilt from a remembered entry, or `run()`'s, remembered for the next call with the
    same key."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Any] = {}
        self.hits = 0
        self._skip: dict[Any, bool] = {}

    def _skipped(self, func) -> bool:
        skip = self._skip.get(func)
        if skip is None:
            skip = self._skip[func] = getattr(func, "namespace", None) != "aten" or any(tag in _SKIP_TAGS for tag in func.tags)
        return skip

    def call(self, func, args: tuple, kwargs: dict, run):
        mode = None
        for a in args:
            if type(a) is FakeTensor:
                mode = a.fake_mode
                break
        if mode is None or mode.shape_env is not None or self._skipped(func):  # symbolic sizes: the fake mode's own cache
            return run()
        try:
            key = (func, id(mode), _key(args), _key(tuple(sorted(kwargs.items()))) if kwargs else ())
        except _NoKey:
            return run()
        entry = self.entries.get(key)
        if entry is None:
            nested = [a for a in tree_flatten((args, kwargs))[0] if type(a) is FakeTensor]
            before = [_state(a) for a in nested]
            out = run()
            if len(self.entries) >= _MAX_ENTRIES:
                self.entries.clear()
            many = isinstance(out, (tuple, list))
            outs = [_output(t, args, kwargs, nested) for t in (out if many else (out,))]
            # an op that changed an argument's layout or storage (resize_, set_, out= resized) is not replayed,
            # nor one whose new outputs share a storage (rebuilt, each would have its own)
            changed = before != [_state(a) for a in nested]
            fresh = [t.untyped_storage()._cdata for t, o in zip(out if many else (out,), outs) if o is not None and o[0] is None]
            shared = len(set(fresh)) < len(fresh)
            valid = not changed and not shared and all(o is not None for o in outs)
            self.entries[key] = (type(out) if many else None, outs) if valid else _BYPASS
            return out
        if entry is _BYPASS:
            return run()
        self.hits += 1
        many, outs = entry
        built = []
        for source, shape, stride, offset, dtype, device in outs:
            if type(source) is tuple:
                built.append(_arg(args, kwargs, source[1]))
                continue
            with torch._C._DisableTorchDispatch():
                meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                if source is not None:
                    meta.set_(_arg(args, kwargs, source).untyped_storage(), offset, shape, stride)
            built.append(FakeTensor(mode, meta, device))
        return many(built) if many is not None else built[0]
