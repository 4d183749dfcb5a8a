"""Checkpointing one module whole: its entry kind, and the two choice kinds that make such entries
(whole blocks and the stages holding them; a block's large sub-modules). Runtime: plan/checkpoint.py."""

from __future__ import annotations

from ckpt_tune.plan.kinds.base import MARK, Action, Call, EntryKind, Kind

MAX_SUB_OPTIONS = 3  # sub-module options kept (each costs one recorded step per probed batch)


class CheckpointEntry(EntryKind):
    action, runtime, whole = Action.CHECKPOINT, ("checkpoint",), True

    def parse(self, value):
        return ((value,), None) if isinstance(value, str) else None

    def data(self, modules, policy):
        return modules[0]

    def label(self, modules, policy):
        return modules[0]

    def state(self, policy):
        return "checkpointed whole"

    def call(self, modules, policy):
        return Call("checkpoint", "checkpoint_module", modules[0])

    def state_of(self, module):
        rt = self._runtime()
        return self.state(None) if rt.is_checkpointed(module) and rt.POLICY_ATTR not in module.__dict__ else None

    def undo(self, module):
        self._runtime().uncheckpoint_module(module)


ENTRY = CheckpointEntry()


class Blocks(Kind):
    name, entry, groups = "blocks", ENTRY, True
    help = "whole blocks and the stages holding them"

    def entries(self, unit, option):
        return (unit,)


class Submodules(Kind):
    name, entry, inside = "submodules", ENTRY, True
    help = "a block's attention or MLP"

    def offer(self, search, batch_size):
        subs = find_sub_options(search.runner.model, search.units)
        # modules run more than once inside a unit: checkpointed at each call (a shared layer's loop)
        return (*subs, *(o for o in dict.fromkeys(search.repeats.values()) if o not in subs))

    def owns(self, option):
        return not option.startswith(MARK)

    def has(self, search, unit, option):
        return search.repeats.get(unit) == option or has_sub_option(search.runner.model, unit, option)

    def entries(self, unit, option):
        return tuple(f"{unit}.{sub}" for sub in option.split("+"))

    def modules(self, unit, option):
        return list(self.entries(unit, option))

    def neighbour(self, option):
        return 0  # the block keeps its input and output as when stored


def sub_options_of(module) -> list[str]:
    """Relative names of a block's large sub-modules (attention, MLP): composite children (two or
    more submodules, with parameters) other than its only one, which a user can checkpoint instead
    of the whole block."""
    from torch import nn

    small = (nn.LayerNorm, nn.Dropout, nn.Embedding, nn.modules.batchnorm._NormBase, nn.ModuleList, nn.ModuleDict)
    children = list(module.named_children())
    return [
        n for n, c in children
        if len(children) > 1 and len(list(c.children())) >= 2 and any(True for _ in c.parameters())
        and not isinstance(c, small)
    ]


def find_sub_options(model, blocks: list[str] | tuple[str, ...]) -> list[str]:
    """The sub-module options: names that at least half the blocks (and two) have, in first-seen order,
    and `a+b` (both checkpointed, each on its own) for the first two when blocks have both. A block
    without an option cannot take it (the memory model prices it out). A sub-module shared by several
    blocks (one module object, CoaT's position encoding) is no option: checkpointing it in one block
    checkpoints it inside every other."""
    per_block = [sub_options_of(model.get_submodule(b)) for b in blocks]
    seen: list[str] = []
    for names in per_block:
        seen += [n for n in names if n not in seen]
    need = max(2, (len(blocks) + 1) // 2)

    def shared(name: str) -> bool:
        held = [model.get_submodule(f"{b}.{name}") for b, names in zip(blocks, per_block) if name in names]
        return len({id(m) for m in held}) < len(held)

    kept = [n for n in seen if sum(n in names for names in per_block) >= need and not shared(n)][:MAX_SUB_OPTIONS]
    if len(kept) >= 2 and sum(kept[0] in names and kept[1] in names for names in per_block) >= need:
        kept.append(f"{kept[0]}+{kept[1]}")
    return kept


def has_sub_option(model, block: str, option: str) -> bool:
    """Whether the block has every sub-module an option names (`a+b`: both)."""
    names = sub_options_of(model.get_submodule(block))
    return all(part in names for part in option.split("+"))
