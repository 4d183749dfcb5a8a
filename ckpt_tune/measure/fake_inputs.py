"""The user's model and batches under fake tensors: parameters, buffers and batch tensors that
allocate nothing (docs/design.md §3). Recording them is fake.py's job."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_tune.measure import loader
from ckpt_tune.measure.fake import fake_mode, note_new, running


def to_fake(obj: Any) -> Any:
    """obj with every real tensor in nested lists, tuples and dicts replaced by a fake one."""
    mode = fake_mode()
    flat, spec = tree_flatten(obj)
    if not any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in flat):
        return obj
    flat = [mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t for t in flat]
    return tree_unflatten(flat, spec)


def _fakeify_module(model: nn.Module) -> None:
    """Replace real parameters and buffers the user's build left (made outside dispatch) with fake ones."""
    mode = fake_mode()
    done: dict[int, torch.Tensor] = {}  # keeps tied weights tied
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and not isinstance(p, FakeTensor):
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and not isinstance(b, FakeTensor):
                done.setdefault(id(b), mode.from_tensor(b))
                mod._buffers[name] = done[id(b)]


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` for a fake model, in place: floating parameters and buffers only, ties kept.

    `Module.to` swaps fake parameters (`torch.utils.swap_tensors`), which fails once the fake mode
    holds a weak reference to them, and it memoizes every tensor its ops make. Assigning `.data`
    keeps each Parameter object, so tied weights stay one parameter.
    """
    with running():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    mod._buffers[name] = b.to(dtype)
    return model


def build_fake_model(target: loader.Target) -> nn.Module:
    """The target's model with fake parameters and buffers: built under the fake mode, allocating nothing."""
    with running():
        model = loader.build_model(target)
    _fakeify_module(model)
    return model


def fake_batch_fn(target: loader.Target, device: str = "cpu") -> Callable[[int], Any]:
    """batch_size -> the target's batch made under the fake mode (tensors that came out real are converted).

    Fake mode profiles the CPU-device graph (fake CUDA tensors need a CUDA build and device), so the
    batch is on the CPU whatever `device` the step is sized for; the recorder's device sets the rounding.
    """
    del device

    def batch_fn(batch_size: int) -> Any:
        with running():
            batch = loader.make_batch(target, batch_size, "cpu")
        fake = to_fake(batch)
        if fake is not batch:
            note_new(fake)
        return fake

    return batch_fn
