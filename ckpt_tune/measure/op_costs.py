"""What an op policy leaves to recompute: the share of each block's forward cost in the ops a policy
does not keep (plan/policy.py; docs/design.md §4, recompute cost).

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

import time
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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


def recompute_shares(runner, batch_size: int, units: Sequence[str], policies: Sequence[str], repeats: int = 3) -> dict[tuple[str, str], float]:
    """(unit, policy) -> share (0..1) of the unit's forward cost in the ops the policy recomputes.

    `runner`: a StepRunner (measure/runner.py) with its model built; the forward runs as a training
    step's does (its device, precision and fake-tensor context), without backward.
    """
    if not policies or not units:
        return {}
    fake = runner.fake
    clock = _OpClock(policies, roofline=fake)
    model: nn.Module = runner.model
    handles = []
    for u in units:
        mod = model.get_submodule(u)
        handles.append(mod.register_forward_pre_hook(lambda m, a, u=u: clock.enter(u)))
        handles.append(mod.register_forward_hook(lambda m, a, o: clock.leave()))
    try:
        for _ in range(1 if fake else repeats):
            with runner._ctx():
                batch = runner.batch_fn(batch_size)
                with runner._autocast(), clock:
                    loss = runner.loss_fn(model, batch)
                del loss, batch
    finally:
        for h in handles:
            h.remove()
    return {
        (u, p): (clock.recomputed[(u, p)] / clock.total[u]) if clock.total[u] > 0 else 1.0
        for u in units
        for p in policies
    }
