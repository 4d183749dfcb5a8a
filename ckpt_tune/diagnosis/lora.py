"""LoRA: the adapter the LoRA remedy records with, how to apply it for real, and what it changes
(`lora_plan`, the input of sharding.lora_moment's arithmetic)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ckpt_tune.measure.profiler import StepProfile
from ckpt_tune.measure.tensors import unique_bytes
from ckpt_tune.tune.sharding import LoraPlan

WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)


class LoRALinear(nn.Module):
    """A frozen `base` Linear plus a trainable rank-r update: base(x) + (alpha/r)·lora_b(lora_a(x))
    (Hu et al. 2021); lora_b starts at zero, so the model computes what it did before."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))  # [..., out_features]


def lora_targets(model: nn.Module, units: tuple[str, ...]) -> tuple[str, ...]:
    """The Linear layers that get adapters: those inside the repeated blocks, or every one without blocks."""
    names = [n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if units:
        names = [n for n in names if any(n.startswith(u + ".") for u in units)]
    return tuple(names)


def _wrap(model: nn.Module, rank: int, names: tuple[str, ...], wrapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Freeze every parameter and wrap the named Linear layers, recording (parent, child, original) in
    `wrapped` as it goes (so that a failure half way can still be undone)."""
    model.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped.append((parent, child, parent.get_submodule(child)))
        setattr(parent, child, LoRALinear(wrapped[-1][2], rank))


def apply_lora(model: nn.Module, rank: int, names: tuple[str, ...]) -> nn.Module:
    """Freeze every parameter, then wrap the named Linear layers with LoRALinear adapters (in place)."""
    _wrap(model, rank, names, [])
    return model


@contextlib.contextmanager
def lora_applied(model: nn.Module, rank: int, names: tuple[str, ...]) -> Iterator[nn.Module]:
    """apply_lora for the length of a `with`, then the original layers and requires_grad flags come back."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    wrapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        _wrap(model, rank, names, wrapped)
        yield model
    finally:
        for parent, child, original in reversed(wrapped):
            setattr(parent, child, original)
        for p, flag in flags:
            p.requires_grad_(flag)


def lora_plan(model: nn.Module, prof: StepProfile, units: tuple[str, ...], rank: int) -> LoraPlan | None:
    """What `apply_lora(model, rank, lora_targets(model, units))` changes, from the model's shapes and the profile."""
    names = lora_targets(model, units)
    if not names:
        return None
    rec = {r.name: r for r in prof.modules}
    adapter_bytes, saves, branch = 0, [], 0
    for n in names:
        lin = model.get_submodule(n)
        es = lin.weight.element_size()
        adapter_bytes += rank * (lin.in_features + lin.out_features) * es
        r = rec.get(n)
        inp = r.input_bytes if r else 0
        saves.append((n, inp * rank // max(lin.in_features, 1), bool(r and r.activation_bytes)))
        branch = max(branch, inp)
    frozen = tuple(
        n for n, mod in model.named_modules()
        if isinstance(mod, WEIGHT_LAYERS) and n not in names and any(p.requires_grad for p in mod.parameters(recurse=False))
    )
    trainable = unique_bytes(p for p in model.parameters() if p.requires_grad)
    return LoraPlan(rank, names, frozen, adapter_bytes, tuple(saves), branch, trainable, prof.optimizer_bytes)

