"""Tensors counted as the allocator counts them: distinct storages, a rank's local shard of a DTensor,
every tensor of a nested output. Shared by the runner, its instrumentation and the sharded runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ckpt_tune.measure import fake


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (FSDP2's parameters, gradients and optimizer
    state under measure/sharded.py), else t itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    t = local_tensor(t)
    return (str(t.device), fake.fake_storage_key(t))


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            seen[storage_key(t)] = local_tensor(t).untyped_storage().nbytes()
    return sum(seen.values())


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and ModelOutput-like objects. Not pytree: a
    user's output dataclass is not a registered pytree node, and its tensors count all the same."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for k in obj.__dataclass_fields__:
            yield from iter_tensors(getattr(obj, k, None))
