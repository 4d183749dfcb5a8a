"""What an op policy leaves to recompute: the share of each block's forward cost in the ops a policy
does not keep (plan/policy.py; docs/design.md §4, recompute cost); and what offloading a block moves
(`saved_bytes`, plan/offload.py).

One forward of the model under a `TorchDispatchMode` that sees every aten op after autograd, as the
selective-checkpoint API does. Module hooks say which block an op runs in; each block call gets a
fresh `OpRule` per policy, as each checkpointed region does, so "every second matmul" counts as the
policy will. An op's cost is its wall time on a real device (CPU: measured around the op) and, under
fake tensors, a roofline figure: max(FLOPs, bytes moved × FLOPS_PER_BYTE), the time an accelerator
whose matmul throughput is FLOPS_PER_BYTE times its memory bandwidth spends on it (an H100/H200 runs
bf16 matmuls at about 990 TFLOP/s over 3.3-4.8 TB/s: 200-300 FLOP per byte). Norms, activations and
dropout move bytes but do little arithmetic; FLOPs alone would price their recompute at nothing.

The search multiplies a block's forward cost (its measured time, or FLOPs under fake tensors) by the
share this returns for the policy.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_tune.measure import quantized
from ckpt_tune.plan import offload
from ckpt_tune.plan.apply import cache_off
from ckpt_tune.plan.policy import OpRule

FLOPS_PER_BYTE = 250


def _bytes(obj) -> int:
    flat = torch.utils._pytree.tree_leaves(obj)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def _roofline(func, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "overloadpacket", func)
    flops = 0.0
    if packet in flop_registry:
        try:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a shape rule that does not fit this call: count its bytes only
            flops = 0.0
    return max(flops, (_bytes(args) + _bytes(kwargs) + _bytes(out)) * FLOPS_PER_BYTE)


class _OpClock(TorchDispatchMode):
    """Per block: the cost of every op, and of the ops each policy recomputes."""

    def __init__(self, policies: Sequence[str], roofline: bool) -> None:
        super().__init__()
        self.policies, self.roofline = tuple(policies), roofline
        self.stack: list[tuple[str, dict[str, OpRule]]] = []
        self.total: dict[str, float] = defaultdict(float)
        self.recomputed: dict[tuple[str, str], float] = defaultdict(float)

    def enter(self, unit: str) -> None:
        self.stack.append((unit, {p: OpRule(p) for p in self.policies}))

    def leave(self) -> None:
        self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.stack:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        cost = _roofline(func, args, kwargs, out) if self.roofline else time.perf_counter() - t0
        unit, rules = self.stack[-1]
        self.total[unit] += cost
        for p, rule in rules.items():
            if not rule.saves(func):
                self.recomputed[(unit, p)] += cost
        return out


def _forward(runner, batch_size: int, mode=None) -> None:
    """One forward and loss of the runner's model, as a training step runs it (its device, precision
    and fake-tensor context), without backward; under `mode` (a dispatch mode) when given."""
    with runner._ctx():
        batch = runner.batch_fn(batch_size)
        with runner._autocast(), (mode if mode is not None else contextlib.nullcontext()):
            runner.loss_fn(runner.model, batch)
        del batch


def recompute_shares(runner, batch_size: int, units: Sequence[str], policies: Sequence[str], repeats: int = 3) -> dict[tuple[str, str], float]:
    """(unit, policy) -> share (0..1) of the unit's forward cost in the ops the policy recomputes.

    `runner`: a StepRunner (measure/runner.py) with its model built; the forward runs as a training
    step's does (its device, precision and fake-tensor context), without backward.
    """
    if not policies or not units:
        return {}
    fake = runner.fake
    quantized.register_flops()
    clock = _OpClock(policies, roofline=fake)
    with _each_unit(runner.model, units, clock.enter, clock.leave):
        for _ in range(1 if fake else repeats):
            _forward(runner, batch_size, clock)
    return {
        (u, p): (clock.recomputed[(u, p)] / clock.total[u]) if clock.total[u] > 0 else 1.0
        for u in units
        for p in policies
    }


def saved_bytes(runner, batch_size: int, units: Sequence[str]) -> dict[str, int]:
    """unit -> bytes of the tensors its forward saves for backward, parameters left out: what offloading
    the unit (plan/offload.py) copies to host memory and back, each saved tensor on its own. One
    forward, as a training step runs it, without backward."""
    inside: list[str] = []
    moved = dict.fromkeys(units, 0)

    def pack(t: torch.Tensor):
        if inside and offload.moves(t):
            moved[inside[-1]] += t.numel() * t.element_size()  # each saved tensor is copied on its own
        return t

    with _each_unit(runner.model, units, inside.append, inside.pop), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward(runner, batch_size)
    return moved


@contextlib.contextmanager
def _each_unit(model: nn.Module, units: Sequence[str], enter, leave):
    """`enter(unit)` as each unit's forward starts and `leave()` as it ends (their results are
    dropped: the module's output stays as it is)."""
    handles = []
    for u in units:
        mod = model.get_submodule(u)
        handles.append(mod.register_forward_pre_hook(lambda m, a, u=u: enter(u) and None))
        handles.append(mod.register_forward_hook(lambda m, a, o: leave() and None))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _signature(module: nn.Module) -> tuple:
    return (type(module).__qualname__, tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()))


def _ones_like_outputs(out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    return leaves, [torch.ones_like(t) for t in leaves]


def _time_block(runner, block: nn.Module, args: tuple, kwargs: dict, extra: dict | None) -> float:
    """Seconds of one forward and backward of `block` alone: stored (`extra` None) or under
    checkpoint with `extra` as checkpoint's keyword arguments."""
    from torch.utils.checkpoint import checkpoint

    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with runner._ctx(), runner._autocast():
        if extra is None:
            res = block(*args, **kwargs)
        else:
            res = checkpoint(lambda *a: block(*a, **kwargs), *args, use_reentrant=False, **extra)
    leaves, grads = _ones_like_outputs(res)
    if leaves:
        torch.autograd.backward(leaves, grads)
    sync()
    return time.perf_counter() - t0


def policy_ratios(
    runner, batch_size: int, units: Sequence[str], policies: Sequence[str], repeats: int = 3
) -> tuple[dict[tuple[str, str], float], dict[str, str]]:
    """(unit, policy) -> a policy's recompute cost as a fraction of checkpointing the whole block, on a
    real device: one block of each kind (type and parameter shapes) run alone on the input it had in a
    step, forward and backward, stored / checkpointed whole / under each policy, interleaved, median
    of `repeats`: (t_policy - t_stored) / (t_whole - t_stored). What this measures and an op's share
    of the forward (`recompute_shares`) leaves out is the selective-checkpoint machinery itself (a
    Python dispatch mode over every op of the region, in forward and in recompute), which on a CPU
    costs about as much as the cheap ops it saves storing. Also returns the policies torch refused
    on some block (an in-place change of an output the policy keeps), with the error."""
    if not policies or not units:
        return {}, {}
    model: nn.Module = runner.model
    first: dict[tuple, str] = {}
    kind = {u: first.setdefault(_signature(model.get_submodule(u)), u) for u in units}
    reps = sorted(set(kind.values()), key=list(units).index)
    with cache_off(model):  # as a checkpointed model runs (plan/apply.py)
        return _time_policies(runner, batch_size, units, policies, repeats, kind, reps)


def _time_policies(runner, batch_size, units, policies, repeats, kind, reps):
    from ckpt_tune.plan.policy import context_fn

    model: nn.Module = runner.model
    inputs: dict[str, tuple] = {}

    def grab(name):
        def hook(mod, args, kwargs):
            if name not in inputs:
                keep = lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t  # noqa: E731
                inputs[name] = (torch.utils._pytree.tree_map(keep, args), torch.utils._pytree.tree_map(keep, kwargs))

        return hook

    handles = [model.get_submodule(u).register_forward_pre_hook(grab(u), with_kwargs=True) for u in reps]
    try:
        _forward(runner, batch_size)
    finally:
        for h in handles:
            h.remove()
    out: dict[tuple[str, str], float] = {}
    failed: dict[str, str] = {}
    for u in reps:
        block = model.get_submodule(u)
        args, kwargs = inputs[u]
        saved = {p: p.grad for p in block.parameters()}
        variants = {"stored": None, "whole": {}, **{p: {"context_fn": context_fn(p)} for p in policies}}

        times: dict[str, list[float]] = {k: [] for k in variants}
        try:
            for k, extra in list(variants.items()):  # warm-up; a policy torch refuses here is out
                try:
                    _time_block(runner, block, args, kwargs, extra)
                except RuntimeError as e:
                    if k in ("stored", "whole"):
                        raise
                    failed.setdefault(k, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
                    del variants[k], times[k]
            for _ in range(repeats):
                for k, extra in variants.items():
                    times[k].append(_time_block(runner, block, args, kwargs, extra))
        finally:
            for p, g in saved.items():
                p.grad = g
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        whole = max(med["whole"] - med["stored"], 1e-9)
        for p in policies:
            if p in med:
                out[(u, p)] = max(med[p] - med["stored"], 0.0) / whole
    ratios = {(u, p): out[(kind[u], p)] for u in units for p in policies if (kind[u], p) in out}
    return ratios, failed
