"""Activation offload: the tensors a module saves for backward are kept in host memory, not on the GPU.

`offload(module)` replaces the module instance's `forward` with one that runs the original under
`torch.autograd.graph.saved_tensors_hooks`: every tensor its forward saves for backward is copied to
pinned host memory as it is saved (the GPU copy is freed once nothing else holds it), and copied back
to the GPU when backward needs it. The forward and backward compute exactly what they would without
it; only where the saved tensors live changes, and the step pays for the transfers that compute does
not hide (`torch.autograd.graph.save_on_cpu` does the same for a whole step).

Parameters are not copied: a weight saved for backward is the weight itself, on the GPU already.
Tensors already in host memory (a model on the CPU) stay where they are, as host and device are then
the same memory. `HOST_ALLOCATIONS`, when set, is a context manager under which the host copies are
made instead: a measurement that runs on host memory standing in for a GPU's sets it, so that the copies
are not counted as device memory.

This module is torch-only (no other ckpt_tune import) so that the patch snippet can embed it verbatim.
"""

from __future__ import annotations

import types

import torch

OFFLOAD_FORWARD = "_offload_forward"  # the wrapper's name marks an offloaded module
OFFLOAD_INNER_ATTR = "_offload_inner_forward"  # a forward the instance had before it was wrapped
HOST_ALLOCATIONS = None


def moves(tensor) -> bool:
    """Whether offloading copies this saved tensor: parameters (trainable leaves) stay where they are."""
    return not (isinstance(tensor, torch.nn.Parameter) or (tensor.is_leaf and tensor.requires_grad))


def _pack(tensor):
    if not moves(tensor):
        return None, tensor
    if tensor.device.type == "cpu":
        if HOST_ALLOCATIONS is None:
            return None, tensor
        with HOST_ALLOCATIONS():
            return tensor.device, tensor.detach().clone()
    packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=torch.cuda.is_available())
    packed.copy_(tensor, non_blocking=True)
    return tensor.device, packed


def _unpack(saved):
    device, tensor = saved
    if device is None:
        return tensor
    if tensor.device == device:  # a measurement's host copy: the copy back is a new tensor
        return tensor.clone()
    return tensor.to(device, non_blocking=True)


def _offload_forward(self, *args, **kwargs):
    inner = self.__dict__.get(OFFLOAD_INNER_ATTR) or types.MethodType(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        return inner(*args, **kwargs)


def is_offloaded(module) -> bool:
    return getattr(module.__dict__.get("forward"), "__name__", None) == OFFLOAD_FORWARD


def offload(module) -> None:
    """Keep the tensors `module`'s forward saves for backward in host memory (in place; idempotent)."""
    if is_offloaded(module):
        return
    own = module.__dict__.get("forward")
    if own is not None:
        setattr(module, OFFLOAD_INNER_ATTR, own)
    module.forward = types.MethodType(_offload_forward, module)


def restore(module) -> None:
    """Undo `offload`: the module's forward as it was."""
    if not is_offloaded(module):
        return
    inner = module.__dict__.pop(OFFLOAD_INNER_ATTR, None)
    del module.__dict__["forward"]
    if inner is not None:
        module.forward = inner
