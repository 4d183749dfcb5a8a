"""What a recorded or timed step learns from module hooks (measure/runner.py runs the step).

`Instrument`: forward and backward markers of the marked modules, which of them are called as a chain,
the module stack, and, with `attribute`, each saved tensor's module, gradient pointers and module
input/output bytes (docs/design.md §4). `ForwardClock`: inclusive forward wall time per module.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn

from ckpt_tune.measure import fake
from ckpt_tune.measure.tensors import iter_tensors, local_tensor, unique_bytes
from ckpt_tune.measure.timeline import mark


class Instrument:
    """Forward/backward markers, module stack, saved-tensor attribution, gradient pointers."""

    def __init__(self, model: nn.Module, names: dict[nn.Module, str], marked: set[str], attribute: bool) -> None:
        self.model, self.names, self.marked, self.attribute = model, names, marked, attribute
        self.handles: list[Any] = []
        self.stack: list[str] = []
        self.saved: dict[int, tuple[int, str | None]] = {}
        self.grad_ptrs: list[int] = []
        self.module_io: dict[str, tuple[int, int]] = {}
        self.chained: set[str] = set()
        self._last_out: Any = None  # (weak reference, version) of the last marked module's first output
        # id of a marked module's output -> (weak reference, version, the module it chained into)
        self._links: dict[int, tuple[Any, int, str]] = {}
        self._hooks_ctx = None
        self._param_ptrs = {fake.fake_storage_key(local_tensor(p)) for p in model.parameters()}
        self._gathered: dict[str, set[int]] = {}  # unit -> its parameters' storages gathered by FSDP2

    def install(self) -> None:
        for mod, name in self.names.items():
            if hookable(mod) and (name in self.marked or (self.attribute and mod is self.model)):
                self.handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self.handles.append(mod.register_forward_hook(self._post(name), with_kwargs=True))
        if self.attribute:
            for p in self.model.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._hooks_ctx.__enter__()

    def remove(self) -> None:
        if self._hooks_ctx is not None:
            self._hooks_ctx.__exit__(None, None, None)
            self._hooks_ctx = None
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()
        self._links.clear()

    def _pre(self, name: str):
        def hook(mod, args, kwargs):
            if recomputing():
                return
            mark(f"f>{name}")
            first = next(iter_tensors((args, kwargs)), None)
            link = self._links.get(id(first)) if first is not None else None
            linked = link is not None and link[0]() is first and first._version == link[1]
            if linked and link[2] not in self.stack:
                # an output another marked module chained into is this one's input too (HRNet's branches
                # of one tensor; not a module inside that one): a segment through that link would
                # recompute a tensor used outside it
                self.chained.discard(link[2])
            # the previous block's output, untouched since (an in-place op keeps the object, not the version)
            elif first is not None and self._last_out is not None and self._last_out[0]() is first and first._version == self._last_out[1]:
                self.chained.add(name)
                if not linked:
                    self._links[id(first)] = (self._last_out[0], first._version, name)
            self.stack.append(name)
            if self.attribute:
                self.module_io[name] = (unique_bytes(iter_tensors((args, kwargs))), 0)
                # FSDP2 has just gathered this unit's parameters (its pre-hook runs first): weights, not
                # activations, while its forward runs; the storage is freed or reused after
                gathered = {fake.fake_storage_key(local_tensor(p)) for p in mod.parameters()} - self._param_ptrs
                self._gathered[name] = gathered
                self._param_ptrs |= gathered

        return hook

    def _post(self, name: str):
        def hook(mod, args, kwargs, out):
            if recomputing():
                return
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            mark(f"f<{name}")
            if self.attribute:
                self.module_io[name] = (self.module_io[name][0], unique_bytes(iter_tensors(out)))
                self._param_ptrs -= self._gathered.pop(name, set())
            first = next(iter_tensors(out), None)
            self._last_out = (weakref.ref(first), first._version) if first is not None else None
            for t in iter_tensors(out):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(lambda g, name=name: mark(f"b>{name}"))
                    break

        return hook

    def _pack(self, t: torch.Tensor):
        if t.device.type != "meta":
            ptr = fake.fake_storage_key(t)
            if ptr not in self._param_ptrs and ptr not in self.saved:
                self.saved[ptr] = (t.untyped_storage().nbytes(), self.stack[-1] if self.stack else None)
        # detached: a node that saves its own output would hold that output's grad_fn, itself, in a
        # reference cycle; a graph the loss never reaches (GoogLeNet's aux heads) then outlives the step
        # until the collector runs, which the plain step's graph does not (docs/design.md §4)
        return t.detach()

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.grad_ptrs.append(fake.fake_storage_key(local_tensor(p.grad)))


def hookable(module: nn.Module) -> bool:
    """Whether the module takes forward hooks and an instance forward: not a TorchScript module
    (`torch.jit.script`), whose hooks torch refuses and whose forward cannot be replaced, so a step
    neither marks it nor checkpoints it (tune/candidates.py)."""
    return not isinstance(module, torch.jit.ScriptModule)


def recomputing() -> bool:
    """True while backward runs a forward again: a checkpointed module's recompute calls the marked
    blocks inside it a second time, which is not a step of the forward (docs/design.md §4)."""
    return torch._C._current_autograd_node() is not None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class ForwardClock:
    """Inclusive forward wall time per module, via pre/post hooks (no profiler)."""

    def __init__(self, model: nn.Module, names: dict[nn.Module, str]) -> None:
        self.model, self.names = model, names
        self.handles: list[Any] = []
        self.start: dict[str, list[float]] = {}
        self.total: dict[str, float] = {}
        self.best: dict[str, float] = {}

    def install(self) -> None:
        for mod, name in self.names.items():
            if not hookable(mod):
                continue
            self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post(name)))

    def _pre(self, name):
        def hook(mod, args):
            self.start.setdefault(name, []).append(time.perf_counter())

        return hook

    def _post(self, name):
        def hook(mod, args, out):
            t0 = self.start[name].pop()
            self.total[name] = self.total.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        return hook

    def reset(self) -> None:
        self.total = {}

    def keep_min(self) -> None:
        for k, v in self.total.items():
            self.best[k] = min(v, self.best.get(k, v))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
