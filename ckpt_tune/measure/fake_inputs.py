"""The user's model and batches under fake tensors: parameters, buffers and batch tensors that
allocate nothing (docs/design.md §3). Recording them is fake.py's job."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ckpt_tune.measure import loader, quantized, user_code
from ckpt_tune.measure.fake import fake_errors, fake_mode, note_new, running


def to_fake(obj: Any) -> Any:
    """obj with every real tensor in nested lists, tuples and dicts replaced by a fake one."""
    mode = fake_mode()
    flat, spec = tree_flatten(obj)
    if not any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in flat):
        return obj
    flat = [mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t for t in flat]
    return tree_unflatten(flat, spec)


def _fakeify_module(model: nn.Module) -> None:
    """Replace the real and meta parameters and buffers the build left with fake ones, ties kept.

    Meta tensors (from `_meta_registration`) become fake tensors on the CPU, where fake mode runs the
    step (docs/design.md §3). Attributes that hold the old tensors besides the module's own tables
    (an RNN's `_flat_weights`) are pointed at the new ones.
    """
    mode = fake_mode()
    done: dict[int, torch.Tensor] = {}  # id(old) -> new: keeps tied weights tied

    def fake_of(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in done:
            if t.is_meta:
                with mode:
                    new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            else:
                new = mode.from_tensor(t.detach())
            done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return done[id(t)]

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and not isinstance(p, FakeTensor):
                mod._parameters[name] = fake_of(p, param=True)
        for name, b in list(mod._buffers.items()):
            if b is not None and not isinstance(b, FakeTensor):
                mod._buffers[name] = fake_of(b, param=False)
    if not done:
        return
    for mod in model.modules():
        for key, value in list(vars(mod).items()):
            if isinstance(value, torch.Tensor) and id(value) in done:
                setattr(mod, key, done[id(value)])
            elif isinstance(value, list) and any(isinstance(v, torch.Tensor) and id(v) in done for v in value):
                value[:] = [done.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in value]


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


@contextlib.contextmanager
def _meta_registration() -> Iterator[None]:
    """While open, every parameter and buffer a module registers moves to the meta device at once.

    The approach of accelerate's `init_empty_weights`. The constructor runs on real tensors, so what it
    computes on the side stays real and exact (stochastic-depth rates from `torch.linspace(...).tolist()`
    in ConvNeXt, Swin and ViT, index tables); what becomes model state is meta before any initialiser
    runs on it (torch's initialisers skip meta tensors). The real tensor a constructor makes first is an
    untouched `torch.empty` (the allocator maps pages only when they are written), freed on replacement:
    only one layer's real tensors exist at a time, so an address-space limit (`ulimit -v`) far below the
    model's size holds the build. A tensor registered twice while alive (a buffer shared by two modules)
    maps to one meta tensor. docs/design.md §3.
    """
    # id(real) -> (a weak reference to it, its meta tensor); the entry goes when the real tensor does,
    # so a later tensor that reuses its id is not taken for it
    made: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def to_meta(t: torch.Tensor, param: bool) -> torch.Tensor:
        key = id(t)
        if key not in made or made[key][0]() is not t:
            meta = t.detach().to("meta")
            made[key] = (weakref.ref(t, lambda _r, k=key: made.pop(k, None)), nn.Parameter(meta, requires_grad=t.requires_grad) if param else meta)
        return made[key][1]

    def on_parameter(_module: nn.Module, _name: str, p: Any) -> Any:
        # parameter subclasses (quantised weights) keep their type: converted after the build
        if p is None or isinstance(p, FakeTensor) or p.is_meta or type(p) is not nn.Parameter:
            return None
        return to_meta(p, param=True)

    def on_buffer(_module: nn.Module, _name: str, b: Any) -> Any:
        if b is None or isinstance(b, FakeTensor) or b.is_meta or type(b) not in (torch.Tensor, nn.Buffer):
            return None
        return to_meta(b, param=False)

    handles = [
        nn.modules.module.register_module_parameter_registration_hook(on_parameter),
        nn.modules.module.register_module_buffer_registration_hook(on_buffer),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        made.clear()


@contextlib.contextmanager
def _device_moves_dropped() -> Iterator[None]:
    """While open, `Module.to(device)`, `.cuda()` and `.cpu()` keep the module where it is (a dtype asked
    for still applies): a model built on meta tensors for a fake step has no device to go to, and a copy
    out of a meta tensor fails. A 4-bit weight, which bitsandbytes quantizes on that move, is quantized
    on the meta device instead (quantized.quantize_on_meta)."""
    real_to, real_cuda, real_cpu = nn.Module.to, nn.Module.cuda, nn.Module.cpu

    def to(self, *args, **kwargs):
        device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type == "meta":
            return real_to(self, *args, **kwargs)
        quantized.quantize_on_meta(self)
        return self if dtype is None else real_to(self, dtype)

    def stay(self, *args, **kwargs):
        quantized.quantize_on_meta(self)
        return self

    nn.Module.to, nn.Module.cuda, nn.Module.cpu = to, stay, stay
    try:
        yield
    finally:
        nn.Module.to, nn.Module.cuda, nn.Module.cpu = real_to, real_cuda, real_cpu


def build_fake_model(target: loader.Target) -> nn.Module:
    """The target's model with fake parameters and buffers, allocating nothing (docs/design.md §3).

    Built on real tensors with each parameter and buffer moved to the meta device as it is registered
    (`_meta_registration`), then made fake: a build under the fake mode itself fails on constructors
    that read a small tensor they computed (`torch.linspace(0, rate, n).tolist()`) or that initialise by
    rejection sampling (`nn.init.trunc_normal_`).
    """
    with fake_errors(), _meta_registration(), _device_moves_dropped(), quantized.meta_quantization():
        model = user_code.build_model(target)
    four_bit = quantized.weight_states(model)  # bitsandbytes' attributes on 4-bit weights, lost otherwise
    _fakeify_module(model)
    quantized.restore_weight_states(four_bit)
    return model


def fake_batch_fn(target: loader.Target, device: str = "cpu") -> Callable[[int], Any]:
    """batch_size -> the target's batch made under the fake mode (tensors that came out real are converted).

    Fake mode profiles the CPU-device graph (fake CUDA tensors need a CUDA build and device), so the
    batch is on the CPU whatever `device` the step is sized for; the recorder's device sets the rounding.
    """
    del device

    def batch_fn(batch_size: int) -> Any:
        with running():
            batch = user_code.make_batch(target, batch_size, "cpu")
        fake = to_fake(batch)
        if fake is not batch:
            note_new(fake)
        return fake

    return batch_fn
