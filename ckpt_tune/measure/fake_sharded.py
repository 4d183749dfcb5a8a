"""FSDP2 under fake tensors (`--device meta`): what the recorder of measure/fake.py needs to see of a
sharded step (docs/design.md §6). `LocalForeach` runs an optimizer's foreach ops on DTensors' local
shards; `fake_fsdp_recording` counts DTensor outputs by their local tensor and FSDP2's storage resizes as
allocations and frees."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from ckpt_tune.measure.tensors import local_tensor


class LocalForeach(TorchFunctionMode):
    """While open, a `torch._foreach_*` call on DTensors runs on their local tensors.

    An optimizer's foreach step over FSDP2's sharded parameters is pointwise over lists of DTensors
    that share one mesh and placements (parameters, gradients, state made by zeros_like): DTensor's
    dispatch propagates the placements and runs the same foreach op on the local tensors, whose
    results are what is allocated. That propagation, cold, takes seconds per op over a 7B model's
    291 parameters under fake tensors (docs/design.md §6); this mode runs the local op
    directly. Its temporaries come back as plain tensors, which only later foreach calls of the same
    step take. A call whose DTensors differ in mesh or placements, or are not Shard/Replicate, goes
    to DTensor as before. tests/test_sharded_engine.py (`test_fake_optimizer_step_on_local_shards_equals_dtensors`) checks the recorded step equals DTensor's to the byte.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "").startswith("_foreach_"):
            from torch.distributed.tensor import DTensor

            dts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
            if dts and _pointwise_safe(dts):
                args, kwargs = tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs))
        return func(*args, **kwargs)


def _pointwise_safe(dts: list) -> bool:
    """Whether a pointwise op on these DTensors is the same op on their local tensors."""
    first = dts[0]
    return all(p.is_shard() or p.is_replicate() for p in first.placements) and all(
        t.device_mesh == first.device_mesh and t.placements == first.placements for t in dts
    )




@contextlib.contextmanager
def fake_fsdp_recording() -> Iterator[None]:
    """While open, `fake.FakeRecorder` sees the two things of FSDP2 it misses on its own.

    1. DTensor outputs. The optimizer step on sharded parameters runs DTensor ops; the recorder's
       dispatch mode sees their DTensor results, whose own storage is not real. Each is counted by
       its local tensor (what `Recorder` sees on the CPU).
    2. `UntypedStorage.resize_`. FSDP2 allocates a unit's unsharded parameters by resizing their
       storages to full size before the all-gather copies into them, and frees them by resizing to 0
       (fsdp/_fully_shard/_fsdp_common.py `alloc_storage`/`free_storage`). That is no op, so no dispatch
       mode sees it; on the CPU it is an allocation and a free like any other. Each resize of a fake
       storage is reported to the active recorders as the allocator would see it.

    Scoped to a sharded step, so the single-device path is untouched.
    """
    from ckpt_tune.measure import fake

    orig_key, orig_see, orig_resize = fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_

    def key(t: torch.Tensor) -> int:
        return orig_key(local_tensor(t))

    def see(self, t, inputs, size):
        return orig_see(self, local_tensor(t), inputs, size)

    def resize_(st, size):
        out = orig_resize(st, size)
        for rec in list(fake._RECORDERS):
            if rec._active:
                _resized(rec, st)
        return out

    fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_ = key, see, resize_
    try:
        yield
    finally:
        fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_ = orig_key, orig_see, orig_resize


def _resized(rec, st: torch.UntypedStorage) -> None:
    """Tell FakeRecorder `rec` that storage `st` now holds st.nbytes() bytes."""
    k, raw = st._cdata, st.nbytes()
    if k in rec._live:  # born while recording: its size changes now
        n = rec._rounded(raw)
        if n != rec._live[k]:
            rec._events.append((rec._tick(), n - rec._live[k], k))
        rec._live[k], rec._raw[k] = n, raw
    elif raw > 0:  # older and grown: a block allocated now (its earlier free, like Recorder's, unseen)
        rec._old.pop(k, None)
        rec._alloc(st, k, None)
