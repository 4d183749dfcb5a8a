"""Checkpoint candidates: which modules of a model the planner may choose (docs/design.md §4).

The blocks are the children of `nn.ModuleList`/`nn.Sequential` containers that repeat one type and have
parameters, outermost first, in registration order; finer options are the large sub-modules every
block has (attention, MLP).
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks a user would wrap, outermost first, in registration order."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(mod.named_children())
        types = [type(c) for _, c in children]
        for cname, child in children:
            if types.count(type(child)) >= 2 and sum(1 for _ in child.parameters()) > 0:
                full = f"{name}.{cname}" if name else cname
                if not any(full.startswith(f + ".") for f in found):
                    found.append(full)
    # a block nested in another found block is a finer option, not a chain member
    return [f for f in found if not any(f != g and f.startswith(g + ".") for g in found)]


_NOT_WORTH_A_CHECKPOINT = (nn.LayerNorm, nn.Dropout, nn.Embedding, nn.modules.batchnorm._NormBase)


def find_sub_options(model: nn.Module, blocks: list[str] | tuple[str, ...]) -> list[str]:
    """Relative names of the large sub-modules every block has (attention, MLP): composite children
    (two or more submodules, with parameters), which a user can checkpoint instead of the whole block."""
    common: list[str] | None = None
    for b in blocks:
        names = [
            n for n, c in model.get_submodule(b).named_children()
            if len(list(c.children())) >= 2 and any(True for _ in c.parameters()) and not isinstance(c, _NOT_WORTH_A_CHECKPOINT)
        ]
        common = names if common is None else [n for n in common if n in names]
    return common or []
